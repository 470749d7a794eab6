//! One conversation's search index: BM25 over its stored messages, kept up to date as
//! messages are committed or trimmed, never rebuilt per request.
//!
//! Each message is a document made of its own terms plus, at lower weights, the terms of the
//! two messages before and after it: a question and its answer describe each other, so a fact
//! stated in a short reply is found through the question that prompted it. Weights are
//! integers (own term = [`OWN`], neighbour terms = [`NEIGHBOURS`]: 0.75 and 0.375 of a term of
//! its own) so adding and removing a neighbour's contribution is exact, and the incremental
//! index always equals a fresh build. Measured on the LoCoMo dev file (recall_any at top-10):
//! no neighbours 0.64, one neighbour each side 0.79, two 0.81.
//!
//! Scoring is BM25 with the collection statistics (live document count, average length, document
//! frequencies) as they are at query time, so ranking does not drift as the conversation grows.
//! A query costs the postings of its terms, not the size of the conversation.

use std::collections::HashMap;

use memproxy_base::heap;

/// Weight of a message's own term occurrence.
pub const OWN: u32 = 8;
/// Weight of a neighbouring message's term occurrence.
/// Weight of the terms of the messages one and two places away.
pub const NEIGHBOURS: [u32; 2] = [6, 3];

/// BM25 parameters.
const K1: f32 = 1.2;
const B: f32 = 0.75;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Posting {
    doc: u32,
    weight: u32,
}

/// A document's (term, weight) pairs are held once, in the postings: a document's terms are
/// its own and its live neighbours' (`own`), so every pair is found from those. Half the
/// memory of also keeping them per document, which lets the recall cache hold twice the
/// conversations before it must rebuild an index from the store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Doc {
    turn: u64,
    /// Sum of term weights.
    len: u32,
    /// The message's own terms (with repeats), for its neighbours' documents.
    own: Vec<u32>,
}

/// A document as `(turn, length, sorted (term, weight) pairs)`.
pub type CanonicalDoc = (u64, u32, Vec<(String, u32)>);

/// A search hit: a stored message's turn and its score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hit {
    pub turn: u64,
    pub score: f32,
}

#[derive(Debug, Default)]
pub struct Index {
    term_ids: HashMap<String, u32, foldhash::fast::RandomState>,
    postings: Vec<Vec<Posting>>,
    /// Live documents holding each term.
    df: Vec<u32>,
    /// Each term's postings of trimmed documents, at the front of its list until the next
    /// compaction: where its live postings start, so neither a search nor a trim looks for
    /// that place (a binary search of the list, a cache miss at each step in an index not
    /// read since the last request).
    dead: Vec<u32>,
    docs: Vec<Doc>,
    /// Documents before this one were trimmed away.
    first_live: usize,
    /// Sum of live document lengths.
    total_len: u64,
    /// Score accumulator, reused across queries; only touched slots are reset.
    scratch: Vec<f32>,
    /// Each document's BM25 length norm, `K1 * (1 - B + B * dl / avgdl)`, made at the first
    /// query after a change and kept until the next (empty: to be made): a query then costs
    /// one division per posting, not two, and a conversation read again and again (the same
    /// statistics every time) makes them once. The same expression as per posting, so the
    /// scores are the same to the bit.
    norms: Vec<f32>,
    /// What [`Index::heap_bytes`] would otherwise walk every term and document for, kept as
    /// they change (the recall cache weighs an index at every commit): the heap of each term's
    /// postings, of each document's own terms, and of the terms' keys.
    inner_heap: InnerHeap,
}

/// The heap of the vectors and strings an [`Index`] holds per term and per document.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct InnerHeap {
    postings: usize,
    own: usize,
    keys: usize,
}

/// Where document `doc`'s posting is in `postings` (by document), or where it would go, as
/// `binary_search` says, given that none before `live` (the term's dead postings) is of `doc`
/// or after it: the last few first, since the documents a push or a pop adjusts are the
/// newest, then the first few live ones, which a trim adjusts (a search of the whole list
/// would read a cache line at each of its steps).
fn locate(postings: &[Posting], doc: u32, live: usize) -> Result<usize, usize> {
    use std::cmp::Ordering;
    let n = postings.len();
    let tail = n.saturating_sub(4).max(live);
    for at in (tail..n).rev() {
        match postings[at].doc.cmp(&doc) {
            Ordering::Equal => return Ok(at),
            Ordering::Less => return Err(at + 1),
            Ordering::Greater => {}
        }
    }
    let head_end = (live + 4).min(tail);
    for (at, posting) in postings.iter().enumerate().take(head_end).skip(live) {
        match posting.doc.cmp(&doc) {
            Ordering::Equal => return Ok(at),
            Ordering::Greater => return Err(at),
            Ordering::Less => {}
        }
    }
    postings[head_end..tail]
        .binary_search_by_key(&doc, |p| p.doc)
        .map(|at| at + head_end)
        .map_err(|at| at + head_end)
}

/// Each distinct term of `terms` with how often it occurs, by term.
fn counts(terms: &[u32]) -> Vec<(u32, u32)> {
    summed(terms.iter().map(|&t| (t, 1)).collect())
}

/// `(term, weight)` pairs with one pair per term, its weights summed, by term: a sort and a
/// merge, cheaper than a hash map for the few dozen terms of a message and its neighbours.
fn summed(mut pairs: Vec<(u32, u32)>) -> Vec<(u32, u32)> {
    pairs.sort_unstable_by_key(|&(t, _)| t);
    pairs.dedup_by(|next, kept| {
        let same = next.0 == kept.0;
        if same {
            kept.1 += next.1;
        }
        same
    });
    pairs
}

impl Index {
    pub fn new() -> Index {
        Index::default()
    }

    /// Live documents.
    pub fn len(&self) -> usize {
        self.docs.len() - self.first_live
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The turn of the oldest live document.
    pub fn first_turn(&self) -> Option<u64> {
        self.live().first().map(|d| d.turn)
    }

    /// The turn of the newest document.
    pub fn last_turn(&self) -> Option<u64> {
        self.live().last().map(|d| d.turn)
    }

    fn live(&self) -> &[Doc] {
        &self.docs[self.first_live..]
    }

    /// Appends a message (its terms, in order) as the newest document.
    pub fn push(&mut self, turn: u64, terms: Vec<String>) {
        self.norms.clear();
        let own: Vec<u32> = terms.into_iter().map(|t| self.ensure_term(t)).collect();
        let own_counts = counts(&own);
        let doc_index = self.docs.len();
        let mut weights: Vec<(u32, u32)> = own_counts.iter().map(|&(t, n)| (t, n * OWN)).collect();
        for (distance, weight) in NEIGHBOURS.into_iter().enumerate() {
            let Some(previous) = doc_index.checked_sub(distance + 1) else {
                break;
            };
            if previous < self.first_live || weight == 0 {
                break;
            }
            weights.extend(self.docs[previous].own.iter().map(|&t| (t, weight)));
            self.adjust(previous, &own_counts, weight, true);
        }
        let mut len = 0;
        for (t, weight) in summed(weights) {
            let postings = &mut self.postings[t as usize];
            let before = postings.capacity();
            postings.push(Posting {
                doc: doc_index as u32,
                weight,
            });
            self.inner_heap.postings +=
                heap::vec::<Posting>(postings.capacity()) - heap::vec::<Posting>(before);
            self.df[t as usize] += 1;
            len += weight;
        }
        self.total_len += u64::from(len);
        self.inner_heap.own += heap::vec::<u32>(own.capacity());
        self.docs.push(Doc { turn, len, own });
    }

    /// The distinct terms that may hold a posting of document `doc`: its own and those of the
    /// documents within [`NEIGHBOURS`] of it (a superset: a term is in the document only if
    /// its postings say so).
    fn candidate_terms(&self, doc: usize) -> Vec<u32> {
        let reach = NEIGHBOURS.len();
        let from = doc.saturating_sub(reach).max(self.first_live);
        let to = (doc + reach + 1).min(self.docs.len());
        let mut terms: Vec<u32> = self.docs[from..to]
            .iter()
            .flat_map(|d| d.own.iter().copied())
            .collect();
        terms.sort_unstable();
        terms.dedup();
        terms
    }

    fn ensure_term(&mut self, term: String) -> u32 {
        let next = self.postings.len() as u32;
        let key_heap = heap::string(term.capacity());
        let id = *self.term_ids.entry(term).or_insert(next);
        if id == next {
            self.inner_heap.keys += key_heap;
            self.postings.push(Vec::new());
            self.df.push(0);
            self.dead.push(0);
        }
        id
    }

    /// Adds (or removes) a neighbour's terms, at neighbour weight, to document `doc`.
    fn adjust(&mut self, doc: usize, neighbour_counts: &[(u32, u32)], weight: u32, add: bool) {
        let delta = neighbour_counts.iter().map(|&(t, n)| (t, n * weight));
        for (t, w) in delta {
            let postings = &mut self.postings[t as usize];
            let at = locate(postings, doc as u32, self.dead[t as usize] as usize);
            match (add, at) {
                (true, Ok(p)) => postings[p].weight += w,
                (true, Err(p)) => {
                    let before = postings.capacity();
                    postings.insert(
                        p,
                        Posting {
                            doc: doc as u32,
                            weight: w,
                        },
                    );
                    self.inner_heap.postings +=
                        heap::vec::<Posting>(postings.capacity()) - heap::vec::<Posting>(before);
                    self.df[t as usize] += 1;
                }
                (false, Ok(p)) => {
                    postings[p].weight -= w;
                    if postings[p].weight == 0 {
                        postings.remove(p);
                        self.df[t as usize] -= 1;
                    }
                }
                // A neighbour's term always has its posting; nothing to undo without one.
                (false, Err(_)) => continue,
            }
            if add {
                self.docs[doc].len += w;
                self.total_len += u64::from(w);
            } else {
                self.docs[doc].len -= w;
                self.total_len -= u64::from(w);
            }
        }
    }

    /// Removes the newest document (a reply replaced by a retry).
    pub fn pop(&mut self) {
        self.norms.clear();
        if self.is_empty() {
            return;
        }
        let removed = self.docs.len() - 1;
        for t in self.candidate_terms(removed) {
            let postings = &mut self.postings[t as usize];
            if postings.last().is_some_and(|p| p.doc as usize == removed) {
                postings.pop();
                self.df[t as usize] -= 1;
            }
        }
        let Some(doc) = self.docs.pop() else { return };
        self.inner_heap.own -= heap::vec::<u32>(doc.own.capacity());
        let own_counts = counts(&doc.own);
        self.total_len -= u64::from(doc.len);
        for (distance, weight) in NEIGHBOURS.into_iter().enumerate() {
            let Some(previous) = removed.checked_sub(distance + 1) else {
                break;
            };
            if previous < self.first_live || weight == 0 {
                break;
            }
            self.adjust(previous, &own_counts, weight, false);
        }
    }

    /// Removes the `count` oldest documents (trimmed rounds).
    pub fn drop_front(&mut self, count: usize) {
        self.norms.clear();
        for _ in 0..count.min(self.len()) {
            let index = self.first_live;
            // Its postings stay (a search starts past them) until the next compaction. Each is
            // its term's first live one, if the term is in it.
            for t in self.candidate_terms(index) {
                let t = t as usize;
                let first = self.dead[t] as usize;
                if self.postings[t]
                    .get(first)
                    .is_some_and(|p| p.doc as usize == index)
                {
                    self.df[t] -= 1;
                    self.dead[t] += 1;
                }
            }
            let doc = std::mem::take(&mut self.docs[index]);
            self.inner_heap.own -= heap::vec::<u32>(doc.own.capacity());
            let own_counts = counts(&doc.own);
            self.total_len -= u64::from(doc.len);
            self.first_live += 1;
            // Keep the turn so documents stay searchable by turn.
            self.docs[index].turn = doc.turn;
            for (distance, weight) in NEIGHBOURS.into_iter().enumerate() {
                let next = index + distance + 1;
                if next >= self.docs.len() || weight == 0 {
                    break;
                }
                self.adjust(next, &own_counts, weight, false);
            }
        }
        if self.first_live > 64 && self.first_live > self.len() {
            self.compact();
        }
    }

    /// Drops trimmed documents and their postings for good.
    fn compact(&mut self) {
        self.norms.clear();
        let first = self.first_live as u32;
        self.docs.drain(..self.first_live);
        self.first_live = 0;
        for (postings, dead) in self.postings.iter_mut().zip(&mut self.dead) {
            postings.drain(..*dead as usize);
            *dead = 0;
            debug_assert!(postings.iter().all(|p| p.doc >= first));
            for p in postings.iter_mut() {
                p.doc -= first;
            }
        }
    }

    /// Gives back what the vectors grew past their contents while the index was built.
    pub fn shrink_to_fit(&mut self) {
        for postings in &mut self.postings {
            postings.shrink_to_fit();
        }
        self.postings.shrink_to_fit();
        self.df.shrink_to_fit();
        self.dead.shrink_to_fit();
        self.docs.shrink_to_fit();
        self.term_ids.shrink_to_fit();
        self.inner_heap = self.inner_heap_walked();
    }

    /// Whether `turn` is a live document (documents are in turn order).
    pub fn holds(&self, turn: u64) -> bool {
        self.live().binary_search_by_key(&turn, |d| d.turn).is_ok()
    }

    /// The `k` best documents for `query` among those with a turn below `before_turn`, best
    /// first (with `k` at `usize::MAX`, every match by turn: [`Index::search_where`]).
    /// Documents with no query term are never returned.
    pub fn search(&mut self, query: &[String], before_turn: u64, k: usize) -> Vec<Hit> {
        self.search_where(query, before_turn, k, |_| true)
    }

    /// As [`Index::search`], among the documents whose turn `keep` accepts; with `k` at
    /// `usize::MAX`, every match, by turn ascending instead (hybrid recall ranks them itself,
    /// and walks them beside the vectors in that order).
    pub fn search_where(
        &mut self,
        query: &[String],
        before_turn: u64,
        k: usize,
        keep: impl Fn(u64) -> bool,
    ) -> Vec<Hit> {
        if k == 0 {
            return Vec::new();
        }
        let Some((mut touched, end)) = self.score(query, before_turn, keep) else {
            return Vec::new();
        };
        if k == usize::MAX {
            // By document, which is by turn. A dense match is read off the scores in order;
            // a sparse one sorted.
            let mut hits = Vec::with_capacity(touched.len());
            if touched.len() * 8 > end - self.first_live.min(end) {
                for doc in self.first_live.min(end)..end {
                    let score = self.scratch[doc];
                    if score != 0.0 {
                        hits.push(Hit {
                            turn: self.docs[doc].turn,
                            score,
                        });
                        self.scratch[doc] = 0.0;
                    }
                }
            } else {
                touched.sort_unstable();
                for &d in &touched {
                    hits.push(Hit {
                        turn: self.docs[d as usize].turn,
                        score: std::mem::take(&mut self.scratch[d as usize]),
                    });
                }
            }
            return hits;
        }
        let mut hits: Vec<Hit> = touched
            .iter()
            .map(|&d| Hit {
                turn: self.docs[d as usize].turn,
                score: self.scratch[d as usize],
            })
            .collect();
        for &d in &touched {
            self.scratch[d as usize] = 0.0;
        }
        let by_score = |a: &Hit, b: &Hit| b.score.total_cmp(&a.score).then(b.turn.cmp(&a.turn));
        if hits.len() > k {
            hits.select_nth_unstable_by(k - 1, by_score);
            hits.truncate(k);
        }
        hits.sort_by(by_score);
        hits
    }

    /// Scores every document before `before_turn` that `keep` accepts and `query` matches into
    /// `scratch`: the documents touched (each once) and the end of the range; `None` when
    /// nothing can match. The caller reads the scores and sets them back to 0.
    fn score(
        &mut self,
        query: &[String],
        before_turn: u64,
        keep: impl Fn(u64) -> bool,
    ) -> Option<(Vec<u32>, usize)> {
        let n = self.len();
        if n == 0 || query.is_empty() {
            return None;
        }
        let avgdl = self.total_len as f32 / n as f32 / OWN as f32;
        let end = self.docs.partition_point(|d| d.turn < before_turn);
        if self.scratch.len() < self.docs.len() {
            self.scratch.resize(self.docs.len(), 0.0);
        }
        let mut query_terms: Vec<u32> = query
            .iter()
            .filter_map(|t| self.term_ids.get(t).copied())
            .collect();
        query_terms.sort_unstable();
        query_terms.dedup();

        if self.norms.len() != self.docs.len() {
            self.norms.clear();
            self.norms.extend(self.docs.iter().map(|d| {
                let dl = d.len as f32 / OWN as f32;
                K1 * (1.0 - B + B * dl / avgdl)
            }));
        }
        // At most every live document before `end`: allocated once instead of grown.
        let mut touched: Vec<u32> = Vec::with_capacity(end.saturating_sub(self.first_live));
        for t in query_terms {
            let df = self.df[t as usize] as f32;
            if df == 0.0 {
                continue;
            }
            let idf = (1.0 + (n as f32 - df + 0.5) / (df + 0.5)).ln();
            let postings = &self.postings[t as usize];
            for p in &postings[self.dead[t as usize] as usize..] {
                let doc = p.doc as usize;
                if doc >= end {
                    break;
                }
                if !keep(self.docs[doc].turn) {
                    continue;
                }
                let tf = p.weight as f32 / OWN as f32;
                let score = idf * tf * (K1 + 1.0) / (tf + self.norms[doc]);
                if self.scratch[doc] == 0.0 {
                    touched.push(p.doc);
                }
                self.scratch[doc] += score;
            }
        }
        Some((touched, end))
    }

    /// The score of a document matching every distinct term of `query` once, at average
    /// length: the scale hybrid recall puts lexical scores on (`hybrid.rs`). A query term the
    /// conversation never used weighs as a term of one document: it is information no turn
    /// matches.
    pub fn query_weight(&self, query: &[String]) -> f32 {
        let n = self.len() as f32;
        let mut seen: Vec<&String> = Vec::with_capacity(query.len());
        let mut weight = 0.0;
        for term in query {
            if seen.contains(&term) {
                continue;
            }
            seen.push(term);
            let df = self
                .term_ids
                .get(term)
                .map_or(0.0, |&t| self.df[t as usize] as f32)
                .max(1.0);
            weight += (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
        }
        weight
    }

    /// Heap bytes held, as the allocator hands them out (`heap.rs`), for the cache's weigher
    /// and the memory report. Constant time: the per-term and per-document parts are kept as
    /// they change.
    pub fn heap_bytes(&self) -> usize {
        let InnerHeap {
            postings,
            own,
            keys,
        } = self.inner_heap;
        heap::vec::<Vec<Posting>>(self.postings.capacity())
            + postings
            + heap::vec::<Doc>(self.docs.capacity())
            + own
            + heap::hash_table(
                self.term_ids.capacity(),
                std::mem::size_of::<(String, u32)>(),
            )
            + keys
            + heap::vec::<u32>(self.df.capacity())
            + heap::vec::<u32>(self.dead.capacity())
            + heap::vec::<f32>(self.scratch.capacity())
            + heap::vec::<f32>(self.norms.capacity())
    }

    /// The per-term and per-document parts of [`Index::heap_bytes`], walked.
    fn inner_heap_walked(&self) -> InnerHeap {
        InnerHeap {
            postings: self
                .postings
                .iter()
                .map(|p| heap::vec::<Posting>(p.capacity()))
                .sum(),
            own: self
                .docs
                .iter()
                .map(|d| heap::vec::<u32>(d.own.capacity()))
                .sum(),
            keys: self
                .term_ids
                .keys()
                .map(|k| heap::string(k.capacity()))
                .sum(),
        }
    }

    /// A canonical description of the live index, independent of history: for tests that check
    /// an incrementally kept index equals a fresh build.
    pub fn canonical(&self) -> Vec<CanonicalDoc> {
        let names: HashMap<u32, &str> = self
            .term_ids
            .iter()
            .map(|(k, v)| (*v, k.as_str()))
            .collect();
        let mut terms: Vec<Vec<(String, u32)>> = vec![Vec::new(); self.docs.len()];
        for (t, postings) in self.postings.iter().enumerate() {
            let name = names.get(&(t as u32)).copied().unwrap_or("");
            for p in postings {
                terms[p.doc as usize].push((name.to_string(), p.weight));
            }
        }
        self.live()
            .iter()
            .zip(terms.into_iter().skip(self.first_live))
            .map(|(d, mut terms)| {
                terms.sort();
                (d.turn, d.len, terms)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn words(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn finds_the_matching_document_and_respects_the_cut() {
        let mut index = Index::new();
        index.push(1, words("my account number is 99812"));
        index.push(2, words("thanks noted"));
        index.push(3, words("what is the weather"));
        index.push(4, words("sunny today"));
        let hits = index.search(&words("account number"), 100, 2);
        assert_eq!(hits[0].turn, 1);
        // Turn 2 holds "account" only through its neighbour, at a lower score.
        assert_eq!(hits[1].turn, 2);
        assert!(hits[0].score > hits[1].score);
        assert!(index.search(&words("account"), 1, 5).is_empty());
        assert!(index.search(&words("nothing"), 100, 5).is_empty());
    }

    /// Every match by turn, read off the scores densely (a common word) or from the sorted
    /// touched list (a rare one), with the same scores as a ranked search; either way the
    /// scratch is left clean, so a later search scores as on a fresh index.
    #[test]
    fn every_match_comes_by_turn_and_leaves_no_scores_behind() {
        let text = |i: u64| words(&format!("common w{} r{}", i % 7, i % 97));
        let build = || {
            let mut index = Index::new();
            for turn in 0..300u64 {
                index.push(turn * 2, text(turn));
            }
            index
        };
        let (mut index, mut fresh) = (build(), build());
        for query in ["common w3", "r5", "r5 r6 w2"] {
            let all = index.search(&words(query), u64::MAX, usize::MAX);
            assert!(all.windows(2).all(|p| p[0].turn < p[1].turn), "{query}");
            let mut ranked = index.search(&words(query), u64::MAX, all.len());
            ranked.sort_by_key(|h| h.turn);
            assert_eq!(all, ranked, "{query}");
            let a = index.search(&words("w4"), 400, 5);
            let b = fresh.search(&words("w4"), 400, 5);
            assert_eq!(a, b, "scores left behind by {query}");
        }
    }

    /// A document's weights are its own terms at [`OWN`] each occurrence and its neighbours'
    /// at theirs, summed per term; taking the neighbour back leaves the own alone.
    #[test]
    fn a_document_weighs_its_own_terms_and_its_neighbours_summed_per_term() {
        let mut index = Index::new();
        index.push(1, words("a a b"));
        index.push(2, words("b c"));
        index.push(3, words("c"));
        let pairs = |v: &[(&str, u32)]| -> Vec<(String, u32)> {
            v.iter().map(|&(t, w)| (t.to_string(), w)).collect()
        };
        assert_eq!(
            index.canonical(),
            vec![
                (1, 39, pairs(&[("a", 16), ("b", 14), ("c", 9)])),
                (2, 40, pairs(&[("a", 12), ("b", 14), ("c", 14)])),
                (3, 29, pairs(&[("a", 6), ("b", 9), ("c", 14)])),
            ]
        );
        index.pop();
        assert_eq!(
            index.canonical(),
            vec![
                (1, 36, pairs(&[("a", 16), ("b", 14), ("c", 6)])),
                (2, 34, pairs(&[("a", 12), ("b", 14), ("c", 8)])),
            ]
        );
    }

    #[test]
    fn holds_the_live_turns_only() {
        let mut index = Index::new();
        for turn in [2, 5, 9, 12] {
            index.push(turn, words("a b"));
        }
        index.drop_front(1);
        index.pop();
        let held: Vec<u64> = (0..14).filter(|&t| index.holds(t)).collect();
        assert_eq!(held, [5, 9]);
    }

    #[test]
    fn a_compacted_index_equals_a_fresh_build_of_what_it_kept() {
        let text = |i: usize| words(&format!("w{} w{} w{} w{}", i % 7, i % 11, i % 13, i % 5));
        let mut index = Index::new();
        for i in 0..200 {
            index.push(i as u64 + 1, text(i));
        }
        // Trimmed past the point where the dropped documents and their postings go for good.
        index.drop_front(150);
        assert_eq!(index.first_live, 0, "compacted");
        index.push(201, text(200));
        index.pop();
        let mut fresh = Index::new();
        for i in 150..200 {
            fresh.push(i as u64 + 1, text(i));
        }
        assert_eq!(index.canonical(), fresh.canonical());
        assert_eq!(index.total_len, fresh.total_len);
        let live_df = |index: &Index| {
            let mut df: Vec<(String, u32)> = index
                .term_ids
                .iter()
                .map(|(t, &id)| (t.clone(), index.df[id as usize]))
                .filter(|(_, df)| *df > 0)
                .collect();
            df.sort();
            df
        };
        assert_eq!(live_df(&index), live_df(&fresh));
        // Same scores (term ids, and so the order scores are summed in, depend on history).
        let query = words("w3 w4 w12");
        let scores = |hits: Vec<Hit>| hits.iter().map(|h| h.score).collect::<Vec<f32>>();
        let expected = scores(fresh.search(&query, u64::MAX, 5));
        let same = |got: Vec<f32>| {
            got.len() == expected.len()
                && got.iter().zip(&expected).all(|(x, y)| (x - y).abs() < 1e-4)
        };
        assert!(same(scores(index.search(&query, u64::MAX, 5))));
        // Giving back unused capacity changes nothing a search sees.
        index.shrink_to_fit();
        assert!(same(scores(index.search(&query, u64::MAX, 5))));
    }

    /// Wherever the list's live postings start, a document after the dead ones is located
    /// (at the tail, at the head or between) as a binary search of the whole list finds it.
    #[test]
    fn a_posting_is_located_as_a_binary_search_finds_it() {
        let docs = [1u32, 3, 4, 7, 9, 12, 15, 16, 20, 22, 23, 27, 30, 31];
        let postings: Vec<Posting> = docs.iter().map(|&doc| Posting { doc, weight: 1 }).collect();
        for n in 0..=postings.len() {
            for live in 0..=n {
                let after_dead = live.checked_sub(1).map_or(0, |d| docs[d] + 1);
                for doc in after_dead..33 {
                    assert_eq!(
                        locate(&postings[..n], doc, live),
                        postings[..n].binary_search_by_key(&doc, |p| p.doc),
                        "doc {doc} in the first {n}, live from {live}"
                    );
                }
            }
        }
    }

    /// A one-term query's scores are BM25's formula over the index's statistics as they are
    /// now, to the bit, after every kind of change, each made right after a search (which
    /// keeps the documents' length norms until the next change).
    #[test]
    fn scores_are_the_formula_over_the_statistics_of_now_after_every_change() {
        let expected = |index: &Index, term: &str| -> Vec<Hit> {
            let n = index.len();
            let avgdl = index.total_len as f32 / n as f32 / OWN as f32;
            let t = index.term_ids[term];
            let df = index.df[t as usize] as f32;
            let idf = (1.0 + (n as f32 - df + 0.5) / (df + 0.5)).ln();
            index.postings[t as usize]
                .iter()
                .filter(|p| p.doc as usize >= index.first_live)
                .map(|p| {
                    let tf = p.weight as f32 / OWN as f32;
                    let dl = index.docs[p.doc as usize].len as f32 / OWN as f32;
                    Hit {
                        turn: index.docs[p.doc as usize].turn,
                        score: idf * tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * dl / avgdl)),
                    }
                })
                .collect()
        };
        let mut index = Index::new();
        let check = |index: &mut Index, step: &str| {
            let got = index.search(&words("alpha"), u64::MAX, usize::MAX);
            let want = expected(index, "alpha");
            assert_eq!(got, want, "after {step}");
        };
        for turn in 1..=6u64 {
            index.push(turn, words(&"alpha beta ".repeat(turn as usize)));
        }
        check(&mut index, "pushes");
        index.push(
            7,
            words("alpha gamma gamma gamma gamma gamma gamma gamma gamma"),
        );
        check(&mut index, "a long document");
        index.drop_front(2);
        check(&mut index, "a trim");
        index.pop();
        check(&mut index, "a pop");
        index.push(8, words("alpha"));
        check(&mut index, "a short document");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(Vec<u8>),
        Pop,
        DropFront(usize),
        /// A search between changes: what it keeps must not outlive the next change.
        Search(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => proptest::collection::vec(0u8..12, 0..6).prop_map(Op::Push),
            1 => Just(Op::Pop),
            1 => (0usize..3).prop_map(Op::DropFront),
            1 => (0u8..12).prop_map(Op::Search),
        ]
    }

    proptest! {
        /// After any sequence of pushes, pops and trims, the index equals one built fresh from
        /// the messages that remain, and searches the same way.
        #[test]
        fn incremental_equals_rebuild(ops in proptest::collection::vec(op(), 0..60)) {
            let mut index = Index::new();
            let mut kept: Vec<(u64, Vec<String>)> = Vec::new();
            let mut next_turn = 1;
            for op in ops {
                match op {
                    Op::Push(ws) => {
                        let terms: Vec<String> = ws.iter().map(|w| format!("w{w}")).collect();
                        index.push(next_turn, terms.clone());
                        kept.push((next_turn, terms));
                        next_turn += 1;
                    }
                    Op::Pop => {
                        index.pop();
                        kept.pop();
                    }
                    Op::DropFront(n) => {
                        index.drop_front(n);
                        kept.drain(..n.min(kept.len()));
                    }
                    Op::Search(w) => {
                        index.search(&[format!("w{w}")], u64::MAX, 3);
                    }
                }
            }
            // Each term's dead postings are those of trimmed documents, at the front.
            for (postings, &dead) in index.postings.iter().zip(&index.dead) {
                let trimmed = postings.partition_point(|p| (p.doc as usize) < index.first_live);
                prop_assert_eq!(dead as usize, trimmed);
            }
            let mut fresh = Index::new();
            for (turn, terms) in &kept {
                fresh.push(*turn, terms.clone());
            }
            prop_assert_eq!(index.canonical(), fresh.canonical());
            prop_assert_eq!(index.total_len, fresh.total_len);
            // The heap kept as the index changed is the heap walked.
            prop_assert_eq!(index.inner_heap, index.inner_heap_walked());
            index.shrink_to_fit();
            prop_assert_eq!(index.inner_heap, index.inner_heap_walked());
            let query: Vec<String> = vec!["w1".into(), "w3".into(), "w7".into()];
            let a = index.search(&query, u64::MAX, 5);
            let b = fresh.search(&query, u64::MAX, 5);
            prop_assert_eq!(a.len(), b.len());
            // Same scores in the same order; a tie may list its turns either way, since term
            // ids (and so the order scores are summed in) depend on history.
            for (x, y) in a.iter().zip(&b) {
                prop_assert!((x.score - y.score).abs() < 1e-4);
            }
            let score_of = |hits: &[Hit], turn: u64| hits.iter().find(|h| h.turn == turn).map(|h| h.score);
            for x in &a {
                if let Some(score) = score_of(&b, x.turn) {
                    prop_assert!((x.score - score).abs() < 1e-4);
                }
            }
        }
    }
}
