//! One user's index: BM25 over every archived turn of their conversations (the same index
//! as a conversation's, `recall/index.rs`, with neighbour context), documents numbered in the
//! order they were added, each pointing back to its archive record; with an embedder, the
//! archived turns' vectors too (loaded from the store with the index, added as the
//! background jobs store them), and a search fuses words and meaning exactly as a
//! conversation's own recall does (`recall/hybrid.rs`: the same [`Fusion`], the cosine
//! smoothed over neighbouring turns, here those of the same conversation).

use std::collections::HashMap;

use super::archive::{self, Added, ArchivedTurn, SPACE_ARCHIVE};
use crate::recall::Query;
use crate::recall::hybrid::{fuse, fuse_with_feedback, smooth};
use crate::recall::index::Index;
use crate::recall::stemming;
use crate::recall::tokenize::{Lang, TextLanguage, terms};
use crate::recall::vectors::DocVectors;
use memproxy_base::message::search_text;
use memproxy_store::{OwnerHandle, Store, StoreError};

#[derive(Debug)]
struct Doc {
    /// The archive record's id.
    id: Vec<u8>,
    /// Its conversation, as an index into `names`.
    name: u32,
    /// When the turn was stored (UTC ms), for questions that name a period.
    at_ms: i64,
}

#[derive(Debug)]
pub struct UserIndex {
    setting: TextLanguage,
    latin: Option<Lang>,
    index: Index,
    docs: Vec<Doc>,
    names: Vec<(String, String)>,
    name_ids: HashMap<(String, String), u32>,
    /// The archived turns' vectors by document number (`None`: no embedder).
    vectors: Option<DocVectors>,
}

impl UserIndex {
    /// Builds the index of the user's whole archive, with the vectors of `space` (the
    /// embedder's id and dimension) when there is one.
    pub fn build(
        store: &Store,
        handle: &OwnerHandle,
        setting: TextLanguage,
        space: Option<&(String, usize)>,
    ) -> Result<UserIndex, StoreError> {
        let turns = archive::all(store, handle)?;
        let texts: Vec<String> = turns
            .iter()
            .map(|t| search_text(&t.turn.message.message))
            .collect();
        let latin = stemming(setting, texts.iter().map(String::as_str));
        let mut index = UserIndex {
            setting,
            latin,
            index: Index::new(),
            docs: Vec::with_capacity(turns.len()),
            names: Vec::new(),
            name_ids: HashMap::new(),
            vectors: space.map(|(_, dims)| DocVectors::new(*dims)),
        };
        for (added, text) in turns.into_iter().zip(texts) {
            index.push_text(added.id, &added.turn, &text);
        }
        index.index.shrink_to_fit();
        if let Some((space, _)) = space {
            // Both in record id order: documents were added in the archive's order.
            let stored = store.owner_vectors(handle, SPACE_ARCHIVE, space)?;
            index.add_vectors(&stored);
            if let Some(vectors) = index.vectors.as_mut() {
                vectors.shrink_to_fit();
            }
        }
        Ok(index)
    }

    /// Adds the vectors (archive record id, embedding) of documents it holds; others are
    /// ignored (a turn removed since).
    pub fn add_vectors(&mut self, vectors: &[(Vec<u8>, Vec<f32>)]) {
        let Some(held) = self.vectors.as_mut() else {
            return;
        };
        // A build reads both in id order; a job's vectors are of the newest documents.
        let mut ids: HashMap<&[u8], u64> = HashMap::new();
        if vectors.len() > 8 {
            ids = self
                .docs
                .iter()
                .enumerate()
                .map(|(seq, doc)| (doc.id.as_slice(), seq as u64))
                .collect();
        }
        for (id, vector) in vectors {
            let seq = match ids.get(id.as_slice()) {
                Some(&seq) => Some(seq),
                None if ids.is_empty() => self
                    .docs
                    .iter()
                    .rposition(|d| d.id == *id)
                    .map(|s| s as u64),
                None => None,
            };
            if let Some(seq) = seq {
                held.insert(seq, vector);
            }
        }
    }

    /// Each document's cosine with `query` mixed with its neighbours' of the same
    /// conversation (`hybrid::smooth`), by document number ascending.
    fn similarities(&self, vectors: &DocVectors, query: &[f32]) -> Vec<(u64, f32)> {
        let mut by_conversation: HashMap<u32, Vec<(u64, f32)>> = HashMap::new();
        for (seq, similarity) in vectors.similarities(query) {
            if let Some(doc) = self.docs.get(seq as usize) {
                by_conversation
                    .entry(doc.name)
                    .or_default()
                    .push((seq, similarity));
            }
        }
        let mut out: Vec<(u64, f32)> = by_conversation
            .into_values()
            .flat_map(|mut similarities| {
                smooth(&mut similarities);
                similarities
            })
            .collect();
        out.sort_unstable_by_key(|(seq, _)| *seq);
        out
    }

    pub fn setting(&self) -> TextLanguage {
        self.setting
    }

    /// Adds an archived turn as the newest document.
    pub fn push(&mut self, added: &Added) {
        let text = search_text(&added.turn.message.message);
        self.push_text(added.id.clone(), &added.turn, &text);
    }

    fn push_text(&mut self, id: Vec<u8>, turn: &ArchivedTurn, text: &str) {
        let name = (turn.agent.clone(), turn.conversation.clone());
        let next = self.names.len() as u32;
        let name = *self.name_ids.entry(name.clone()).or_insert_with(|| {
            self.names.push(name);
            next
        });
        let seq = self.docs.len() as u64;
        self.index.push(seq, terms(text, self.latin));
        self.docs.push(Doc {
            id,
            name,
            at_ms: turn.message.at_ms,
        });
    }

    /// The `k` best documents for `query` outside the conversation `skip` (agent,
    /// conversation): their scores and archive ids, best first. Scores are hybrid recall's
    /// fused scores (0..1, `recall/hybrid.rs`; by words alone on its lexical scale when the
    /// query or the archive has no vector), so these compete with the conversation's own
    /// turns for the same slots; those under the fusion's floor are left out.
    pub fn search(
        &mut self,
        query: Query<'_>,
        skip: Option<(&str, &str)>,
        k: usize,
    ) -> Vec<(f32, Vec<u8>)> {
        if k == 0 {
            return Vec::new();
        }
        let words = terms(query.text, self.latin);
        let skipped = skip.and_then(|(agent, conversation)| {
            self.name_ids
                .get(&(agent.to_string(), conversation.to_string()))
                .copied()
        });
        let mut semantic = match (query.vector.get(), &self.vectors) {
            (Some(vector), Some(vectors)) if !vectors.is_empty() => {
                Some(self.similarities(vectors, vector))
            }
            _ => None,
        };
        let docs = &self.docs;
        let in_pool = |seq: u64| {
            docs.get(seq as usize)
                .is_some_and(|d| Some(d.name) != skipped)
        };
        // With meaning or a period, every matching document: the fusion ranks them with the
        // rest.
        let lexical_k = if semantic.is_some() || query.when.is_some() {
            usize::MAX
        } else {
            k
        };
        let lexical = self
            .index
            .search_where(&words, u64::MAX, lexical_k, in_pool);
        let weight = self.index.query_weight(&words);
        let in_period = query.when.map(|period| {
            move |seq: u64| {
                docs.get(seq as usize)
                    .is_some_and(|d| period.holds(d.at_ms))
            }
        });
        let ranked = |semantic: Option<&[(u64, f32)]>, k: usize| {
            fuse(
                &lexical,
                weight,
                semantic,
                in_pool,
                in_period.as_ref().map(|f| f as &dyn Fn(u64) -> bool),
                query.fusion,
                k,
            )
        };
        // Feedback, as a conversation's own recall (`recall/hybrid.rs`).
        let (hits, _) = fuse_with_feedback(
            semantic.as_mut(),
            query.fusion,
            k,
            ranked,
            |best, similarities| {
                let vectors = self.vectors.as_ref()?;
                let moved = vectors.feedback(query.vector.get()?, best)?;
                *similarities = self.similarities(vectors, &moved);
                Some(())
            },
        );
        hits.into_iter()
            .filter_map(|hit| {
                let doc = self.docs.get(hit.turn as usize)?;
                Some((hit.score, doc.id.clone()))
            })
            .collect()
    }

    /// Approximate heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.index.heap_bytes()
            + self.vectors.as_ref().map_or(0, DocVectors::heap_bytes)
            + self.docs.len() * 48
            + self
                .names
                .iter()
                .map(|(a, c)| 2 * (a.len() + c.len()) + 96)
                .sum::<usize>()
    }
}
