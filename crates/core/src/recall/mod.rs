//! Relevance recall: an index per conversation over its stored messages, held in a
//! memory-weighted cache, updated at each commit and rebuilt from the store on a miss.
//!
//! The index covers every stored message; a search only considers those before the recent
//! window (the older pool). This module searches and keeps indexes; choosing the window and
//! rendering the recalled turns is the pipeline's job.
//!
//! - `index.rs` — BM25 over the messages' words (`tokenize.rs` makes the terms);
//! - `vectors.rs` — with an embedder, the messages' vectors, loaded from the store with the
//!   index and added as commits (the static table's) or background jobs make them;
//! - `hybrid.rs` — words and meaning fused into one score, and the relevance floor;
//! - `when.rs` — the period a question names ("in July 2022", "last week"): the turns stored
//!   in it are favoured;
//! - `excerpt.rs` — the passage of a long recalled turn that best matches the question.

pub mod excerpt;
pub mod hybrid;
pub mod index;
pub mod tokenize;
pub mod vectors;
pub mod when;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use self::hybrid::{Fusion, Scored, fuse, fuse_with_feedback};
use self::index::Index;
use self::tokenize::{Lang, TextLanguage, detect, terms};
use self::vectors::DocVectors;
use memproxy_base::cache::{Cache, Policy, Shrink};
use memproxy_base::heap;
use memproxy_base::identity::ConversationKey;
use memproxy_base::message::search_text;
use memproxy_embed::Embed;
use memproxy_store::{Conversation, Quantised, Store, StoreError};

/// How much text `auto` language detection reads from the start of a conversation.
const DETECTION_SAMPLE_CHARS: usize = 2000;

/// One conversation's index and what it was built with.
#[derive(Debug)]
pub struct ConversationIndex {
    /// The setting it was built for.
    setting: TextLanguage,
    /// The stemming language of Latin text (`None`: no stemming).
    latin: Option<Lang>,
    /// The conversation's `next_turn` the index reflects.
    synced_next_turn: u64,
    /// The conversation's id (a conversation deleted and started again can reach the same
    /// `next_turn`).
    conversation_id: Option<u64>,
    index: Index,
    /// The messages' vectors, of the recall's space (`None`: no embedder).
    vectors: Option<DocVectors>,
    /// The similarities of a search's query with every vector, kept from one search to the
    /// next (weighed as if it held one per vector).
    similarities: Vec<(u64, f32)>,
    /// The last search's query and its terms: a stored exchange's question is that query, and
    /// its commit indexes it with these instead of reading the text again.
    last_query: Option<(String, Vec<String>)>,
}

impl ConversationIndex {
    fn terms(&self, text: &str) -> Vec<String> {
        terms(text, self.latin)
    }

    /// The terms of `text`: the last query's when it is that text (taken), else read anew.
    fn terms_of_added(&mut self, text: &str) -> Vec<String> {
        match self.last_query.take() {
            Some((query, terms)) if query == text => terms,
            _ => self.terms(text),
        }
    }

    /// Heap bytes of the last query kept.
    fn last_query_heap(&self) -> usize {
        self.last_query.as_ref().map_or(0, |(text, terms)| {
            heap::string(text.capacity())
                + heap::vec::<String>(terms.capacity())
                + terms
                    .iter()
                    .map(|t| heap::string(t.capacity()))
                    .sum::<usize>()
        })
    }
}

/// The indexes of recently used conversations.
pub struct Recall {
    cache: Arc<Cache<ConversationKey, Arc<Mutex<ConversationIndex>>>>,
    /// The embedder's vector space and dimension (`None`: recall by words alone).
    space: Option<(String, usize)>,
    /// The embedder, when its vectors are not stored (`Embed::derived`): an index built from
    /// the store embeds the stored texts with it.
    derive: Option<Arc<dyn Embed>>,
    lookups: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for Recall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recall")
            .field("cached", &self.cache.entry_count())
            .finish()
    }
}

fn lock(index: &Mutex<ConversationIndex>) -> MutexGuard<'_, ConversationIndex> {
    index
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What a search looks for: the new message's text, and its vector when it has one.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    pub text: &'a str,
    pub vector: QueryVector<'a>,
    pub fusion: Fusion,
    /// The period the text names (`when.rs`): turns stored in it are favoured. Its words
    /// ("july") are still matched as words: a turn that says "in July" tells of it too
    /// (leaving them out measured 0.817 against 0.820 on LoCoMo).
    pub when: Option<when::Period>,
}

/// The new message's vector: none, at hand, or [`Later`]: made when a search first needs it,
/// after the words are matched (an embedding started ahead, `crate::embedding::Ahead`, has
/// that long to finish on its own thread).
#[derive(Debug, Clone, Copy, Default)]
pub enum QueryVector<'a> {
    #[default]
    None,
    Ready(&'a [f32]),
    Later(&'a dyn MadeLater),
}

impl<'a> QueryVector<'a> {
    /// The vector (made now if it is [`Later`]'s), `None` without one or if it failed.
    pub fn get(self) -> Option<&'a [f32]> {
        match self {
            QueryVector::None => None,
            QueryVector::Ready(vector) => Some(vector),
            QueryVector::Later(later) => later.vector(),
        }
    }

    /// Whether there is a vector to ask for (it may still fail).
    pub fn is_some(self) -> bool {
        !matches!(self, QueryVector::None)
    }
}

impl<'a> From<Option<&'a [f32]>> for QueryVector<'a> {
    fn from(vector: Option<&'a [f32]>) -> Self {
        vector.map_or(QueryVector::None, QueryVector::Ready)
    }
}

/// [`Later`] behind a reference that does not tie the query's lifetime to what its maker
/// borrows.
pub trait MadeLater {
    /// The vector, `None` if it failed; made on the first call.
    fn vector(&self) -> Option<&[f32]>;
}

impl std::fmt::Debug for dyn MadeLater + '_ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MadeLater")
    }
}

/// A vector made once, when first asked for, or why there is none (`E`).
pub struct Later<'a, E> {
    made: std::cell::OnceCell<Option<Result<Vec<f32>, E>>>,
    make: std::cell::Cell<Option<LaterMake<'a, E>>>,
}

type LaterMake<'a, E> = Box<dyn FnOnce() -> Result<Vec<f32>, E> + 'a>;

impl<'a, E> Later<'a, E> {
    pub fn new(make: impl FnOnce() -> Result<Vec<f32>, E> + 'a) -> Later<'a, E> {
        Later {
            made: std::cell::OnceCell::new(),
            make: std::cell::Cell::new(Some(Box::new(make))),
        }
    }

    /// The vector, or why there is none; made on the first call (`None` only if making it
    /// panicked).
    pub fn get(&self) -> Option<&Result<Vec<f32>, E>> {
        self.made
            .get_or_init(|| self.make.take().map(|make| make()))
            .as_ref()
    }

    /// The vector or why there is none, made now if no search asked for it.
    pub fn into_result(self) -> Option<Result<Vec<f32>, E>> {
        self.get();
        self.made.into_inner().flatten()
    }
}

impl<E> MadeLater for Later<'_, E> {
    fn vector(&self) -> Option<&[f32]> {
        self.get()?.as_deref().ok()
    }
}

/// What a search found: the turns to recall, best first, and those the relevance floor left
/// out, best first.
#[derive(Debug, Clone, Default)]
pub struct Found {
    pub hits: Vec<Scored>,
    pub under_floor: Vec<Scored>,
    /// Vectors took part (the query had one and so did some of the older turns).
    pub semantic: bool,
}

impl Recall {
    /// Indexes held within `capacity_bytes`; `space` is the embedder's (id, dimension) when
    /// there is one: the indexes then load and hold the messages' vectors.
    pub fn new(capacity_bytes: u64, space: Option<(String, usize)>) -> Recall {
        let cache = Arc::new(Cache::new(
            "recall",
            capacity_bytes,
            Policy::TinyLfu,
            |key: &ConversationKey, index: &Arc<Mutex<ConversationIndex>>| {
                // `try_lock`: a search may hold it; a guess until the next re-insert.
                let index = index.try_lock().map_or(4096, |i| {
                    i.index.heap_bytes()
                        + i.last_query_heap()
                        + i.vectors.as_ref().map_or(0, |v| {
                            v.heap_bytes()
                                + heap::vec::<(u64, f32)>(i.similarities.capacity().max(v.len()))
                        })
                });
                let bytes = heap::CACHE_ENTRY
                    + key.heap_bytes()
                    + heap::arc::<Mutex<ConversationIndex>>()
                    + index;
                u32::try_from(bytes).unwrap_or(u32::MAX)
            },
        ));
        Recall {
            cache,
            space,
            derive: None,
            lookups: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The same, with `embedder` making the vectors of an index built from the store when its
    /// vectors are not stored (`Embed::derived`, of the recall's space); else they are read.
    pub fn deriving(mut self, embedder: Option<Arc<dyn Embed>>) -> Recall {
        self.derive = embedder.filter(|e| {
            e.derived()
                && self
                    .space
                    .as_ref()
                    .is_some_and(|(space, dims)| space == e.id() && *dims == e.dims())
        });
        self
    }

    /// The `k` stored messages most relevant to `query` among those with a turn below
    /// `before_turn`, best first. Called with the conversation locked; builds the index from the
    /// store when it is missing, stale or built for another language.
    pub fn search(
        &self,
        store: &Store,
        conversation: &Conversation,
        language: TextLanguage,
        query: Query<'_>,
        before_turn: u64,
        k: usize,
    ) -> Result<Found, StoreError> {
        let Some(meta) = &conversation.meta else {
            return Ok(Found::default());
        };
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let handle = match self.cache.get(&conversation.key) {
            Some(handle)
                if {
                    let index = lock(&handle);
                    index.synced_next_turn == meta.next_turn
                        && index.conversation_id == Some(meta.id)
                        && index.setting == language
                } =>
            {
                handle
            }
            _ => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                let built = Arc::new(Mutex::new(build(
                    store,
                    conversation,
                    language,
                    self.space.as_ref(),
                    self.derive.as_deref(),
                )?));
                self.cache
                    .insert(conversation.key.clone(), Arc::clone(&built));
                built
            }
        };
        let (query_terms, with_vectors, every, mut lexical) = {
            let mut guard = lock(&handle);
            let index = &mut *guard;
            let query_terms = index.terms(query.text);
            let with_vectors = index.vectors.as_ref().is_some_and(|v| !v.is_empty());
            // Every matching turn when the fusion ranks them with the rest.
            let every = (query.vector.is_some() && with_vectors) || query.when.is_some();
            let lexical = index.index.search(
                &query_terms,
                before_turn,
                if every { usize::MAX } else { k },
            );
            (query_terms, with_vectors, every, lexical)
        };
        // The query's vector only now, after the words (one embedded ahead has had this long),
        // and with the index let go meanwhile: the background worker may be adding vectors to
        // it. The conversation's own lock, held by the caller, keeps its turns as they are.
        let vector = with_vectors.then(|| query.vector.get()).flatten();
        let mut guard = lock(&handle);
        let ConversationIndex {
            index: words,
            vectors,
            similarities: kept,
            ..
        } = &mut *guard;
        let mut similarities = match (vector, &*vectors) {
            (Some(vector), Some(vectors)) => {
                let mut similarities = std::mem::take(kept);
                vectors.smoothed_into(vector, &mut similarities);
                Some(similarities)
            }
            _ => None,
        };
        if every && similarities.is_none() && query.when.is_none() {
            // The vector failed: by words alone, as without one.
            lexical = words.search(&query_terms, before_turn, k);
        }
        let weight = words.query_weight(&query_terms);
        // The turns stored in the period the question names, by turn ascending.
        let in_period: Option<Vec<u64>> = query.when.map(|period| {
            conversation
                .entries
                .iter()
                .filter(|e| e.turn < before_turn && period.holds(e.at_ms))
                .map(|e| e.turn)
                .collect()
        });
        let holds = |turn: u64| {
            in_period
                .as_ref()
                .is_some_and(|turns| turns.binary_search(&turn).is_ok())
        };
        let ranked = |semantic: Option<&[(u64, f32)]>, k: usize| {
            fuse(
                &lexical,
                weight,
                semantic,
                |turn| turn < before_turn,
                in_period.as_ref().map(|_| &holds as &dyn Fn(u64) -> bool),
                query.fusion,
                k,
            )
        };
        // Feedback: scored again with the query moved towards the best turns' meaning.
        let semantic = similarities.is_some();
        let (hits, under_floor) = fuse_with_feedback(
            similarities.as_mut(),
            query.fusion,
            k,
            ranked,
            |best, similarities| vectors.as_ref()?.feedback_into(vector?, best, similarities),
        );
        // The buffer kept for the next search.
        if let Some(similarities) = similarities {
            *kept = similarities;
        }
        guard.last_query = Some((query.text.to_string(), query_terms));
        Ok(Found {
            hits,
            under_floor,
            semantic,
        })
    }

    /// Hands the vectors a background job stored to conversation `key`'s cached index (if it
    /// is cached and of the same conversation id).
    pub fn add_vectors(
        &self,
        key: &ConversationKey,
        conversation_id: u64,
        vectors: &[(u64, Vec<f32>)],
    ) {
        let Some(held) = self.cache.get_held(key) else {
            return;
        };
        {
            let mut index = lock(held.value());
            if index.conversation_id != Some(conversation_id) {
                return;
            }
            let ConversationIndex {
                index: words,
                vectors: held,
                ..
            } = &mut *index;
            let Some(held) = held.as_mut() else {
                return;
            };
            for (turn, vector) in vectors {
                if words.holds(*turn) {
                    held.insert(*turn, vector);
                }
            }
        }
        // So the cache counts what the grown index weighs.
        self.cache.reweigh(key.clone(), held);
    }

    /// Brings a cached index up to date with a commit, under the conversation's lock:
    /// `removed` turns were deleted, `added` (turn, text) appended with the `vectors` the
    /// commit wrote for some of them, and the conversation's `next_turn` went from `before` to
    /// `after`. An index that was not in step is dropped and rebuilt on its next search.
    pub fn apply(
        &self,
        key: &ConversationKey,
        before: Option<u64>,
        removed: &[u64],
        added: &[(u64, String)],
        vectors: &[(u64, Quantised)],
        after: u64,
    ) {
        let Some(held) = self.cache.get_held(key) else {
            return;
        };
        {
            let mut index = lock(held.value());
            if Some(index.synced_next_turn) != before {
                drop(index);
                self.cache.invalidate(key);
                return;
            }
            // Commits remove the newest messages (a replaced reply, a closed branch) and the
            // oldest (trimmed rounds); anything else is not a shape commits make, so rebuild
            // to be safe.
            let mut sorted = removed.to_vec();
            sorted.sort_unstable();
            let is_removed = |turn: u64| sorted.binary_search(&turn).is_ok();
            let mut unaccounted = sorted.len();
            while index.index.last_turn().is_some_and(is_removed) {
                index.index.pop();
                unaccounted -= 1;
            }
            while index.index.first_turn().is_some_and(is_removed) {
                index.index.drop_front(1);
                unaccounted -= 1;
            }
            if unaccounted > 0 {
                drop(index);
                self.cache.invalidate(key);
                return;
            }
            if let Some(vectors) = index.vectors.as_mut() {
                vectors.remove(&sorted);
            }
            for (turn, text) in added {
                let terms = index.terms_of_added(text);
                index.index.push(*turn, terms);
            }
            index.last_query = None;
            if let Some(held) = index.vectors.as_mut() {
                for (turn, vector) in vectors {
                    held.insert_quantised(*turn, vector);
                }
            }
            index.synced_next_turn = after;
        }
        // So the cache counts what the index weighs now.
        self.cache.reweigh(key.clone(), held);
    }

    /// [`Recall::apply`] for turns another replica appended (read from a shared store,
    /// `pipeline/catch_up.rs`). With a derived embedder their vectors are made here, as an
    /// index built from the store makes them, and only for a cached index in step with
    /// `before` (another is dropped or built whole at its next search); stored vectors are not
    /// read here.
    pub fn append(
        &self,
        key: &ConversationKey,
        before: Option<u64>,
        added: &[(u64, String)],
        after: u64,
    ) {
        let in_step = || {
            self.cache
                .get(key)
                .is_some_and(|held| Some(lock(&held).synced_next_turn) == before)
        };
        let vectors = match &self.derive {
            Some(embedder) if in_step() => derive_vectors(embedder.as_ref(), added),
            _ => Vec::new(),
        };
        self.apply(key, before, &[], added, &vectors, after);
    }

    /// Searches and the ones that had to build an index: (lookups, misses).
    pub fn cache_counts(&self) -> (u64, u64) {
        (
            self.lookups.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }

    /// Drops a conversation's index.
    pub fn forget(&self, key: &ConversationKey) {
        self.cache.invalidate(key);
    }

    /// Drops every cached index (the store was reopened: they may cover lost writes).
    pub fn forget_all(&self) {
        self.cache.invalidate_all();
    }

    /// Heap bytes of all cached indexes (approximate).
    pub fn weighted_size(&self) -> u64 {
        self.cache.weighted_size()
    }

    /// The index cache, as the memory guard shrinks it under pressure.
    pub fn cache(&self) -> Arc<dyn Shrink> {
        Arc::clone(&self.cache) as Arc<dyn Shrink>
    }
}

/// The stemming language of Latin text for `setting`: `auto` detects it from the start of
/// `texts` (at most [`DETECTION_SAMPLE_CHARS`] of it).
pub fn stemming<'a>(setting: TextLanguage, texts: impl Iterator<Item = &'a str>) -> Option<Lang> {
    match setting {
        TextLanguage::Plain => None,
        TextLanguage::Fixed(lang) => Some(lang),
        TextLanguage::Auto => {
            let mut sample = String::new();
            for text in texts {
                if sample.len() >= DETECTION_SAMPLE_CHARS {
                    break;
                }
                sample.push_str(text);
                sample.push('\n');
            }
            Some(detect(&sample))
        }
    }
}

/// Builds a conversation's index from the store.
fn build(
    store: &Store,
    conversation: &Conversation,
    setting: TextLanguage,
    space: Option<&(String, usize)>,
    derive: Option<&dyn Embed>,
) -> Result<ConversationIndex, StoreError> {
    let turns: Vec<u64> = conversation.entries.iter().map(|e| e.turn).collect();
    let messages = store.messages(conversation, turns)?;
    let texts: Vec<(u64, String)> = messages
        .iter()
        .map(|m| (m.turn, search_text(&m.message)))
        .collect();
    let latin = stemming(setting, texts.iter().map(|(_, text)| text.as_str()));
    let mut index = Index::new();
    for (turn, text) in &texts {
        index.push(*turn, terms(text, latin));
    }
    // Weighed by its capacity: what the build's growth left unused would take room from
    // other conversations' indexes.
    index.shrink_to_fit();
    let vectors = match space {
        Some((space, dims)) => {
            let mut vectors = DocVectors::new(*dims);
            match derive {
                Some(embedder) => {
                    for (turn, vector) in derive_vectors(embedder, &texts) {
                        vectors.insert_quantised(turn, &vector);
                    }
                }
                None => {
                    for (turn, vector) in store.vectors(conversation, space)? {
                        vectors.insert_quantised(turn, &vector);
                    }
                }
            }
            vectors.shrink_to_fit();
            Some(vectors)
        }
        None => None,
    };
    Ok(ConversationIndex {
        setting,
        latin,
        synced_next_turn: conversation.meta.as_ref().map_or(1, |m| m.next_turn),
        conversation_id: conversation.meta.as_ref().map(|m| m.id),
        index,
        vectors,
        similarities: Vec::new(),
        last_query: None,
    })
}

/// Texts embedded at a time by [`derive_vectors`]: their vectors are quantised before the
/// next are made, so a long conversation's floats are never all held at once.
const DERIVE_BATCH: usize = 64;

/// The vectors of `texts` (stored messages' search texts) made by `embedder`, whose vectors
/// are not stored, quantised as a commit puts them into an index (and as the store would have
/// given them back). When embedding fails, the turns are left without one (found by their
/// words), as turns whose vectors are not made yet.
fn derive_vectors(embedder: &dyn Embed, texts: &[(u64, String)]) -> Vec<(u64, Quantised)> {
    let mut out = Vec::with_capacity(texts.len());
    for batch in texts.chunks(DERIVE_BATCH) {
        let refs: Vec<&str> = batch.iter().map(|(_, text)| text.as_str()).collect();
        let made = match embedder.embed(&refs) {
            Ok(made) => made,
            Err(err) => {
                tracing::warn!(error = %err, "embedding stored turns for a recall index failed; they are found by their words");
                return out;
            }
        };
        for ((turn, _), vector) in batch.iter().zip(made) {
            if let Some(quantised) = memproxy_store::quantise(&vector) {
                out.push((*turn, quantised));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use memproxy_base::identity::TenantId;
    use memproxy_base::message::Role;
    use memproxy_store::{Change, Durability, Origin, StoreOptions, StoredMessage, lock};
    use serde_json::value::RawValue;

    const SPACE: &str = "test/2";

    /// A store with one conversation of `texts`, each with a vector of the test space (turn
    /// `t`'s vector points at angle `t`), and a recall over it.
    fn conversation(dir: &std::path::Path, texts: &[&str]) -> (Store, ConversationKey) {
        conversation_with(dir, texts, true)
    }

    /// As [`conversation`], the vectors stored or not.
    fn conversation_with(
        dir: &std::path::Path,
        texts: &[&str],
        with_vectors: bool,
    ) -> (Store, ConversationKey) {
        let options = StoreOptions {
            durability: Durability::Interval(std::time::Duration::from_secs(1)),
            page_cache_bytes: 1 << 20,
            state_cache_bytes: 1 << 20,
        };
        let store = Store::open(dir, options).unwrap();
        let key = ConversationKey {
            tenant: TenantId::from_token(Some("t")),
            agent: "a".into(),
            conversation: "c".into(),
        };
        let add = texts
            .iter()
            .enumerate()
            .map(|(i, text)| StoredMessage {
                turn: 0,
                role: if i % 2 == 0 {
                    Role::User
                } else {
                    Role::Assistant
                },
                origin: Origin::Client,
                at_ms: 1_000,
                tokens: 5,
                fingerprint: i as u64 + 1,
                message: RawValue::from_string(
                    serde_json::json!({"role": "user", "content": text}).to_string(),
                )
                .unwrap(),
                exchange: None,
            })
            .collect();
        let handle = store.conversation(&key).unwrap();
        let mut held = lock(&handle);
        store
            .commit(
                &mut held,
                Change {
                    add,
                    ..Change::default()
                },
            )
            .unwrap();
        let vectors: Vec<(u64, Vec<f32>)> = held
            .entries
            .iter()
            .map(|e| {
                let angle = e.turn as f32;
                (e.turn, vec![angle.cos(), angle.sin()])
            })
            .collect();
        if with_vectors {
            store.put_vectors(&held, SPACE, &vectors).unwrap();
        }
        drop(held);
        (store, key)
    }

    /// A search of the conversation's turns before the last two, by `vector`.
    fn search(store: &Store, key: &ConversationKey, vector: QueryVector<'_>) -> Found {
        let recall = Recall::new(1 << 20, Some((SPACE.to_string(), 2)));
        search_in(&recall, store, key, vector)
    }

    /// [`search`] with `recall`.
    fn search_in(
        recall: &Recall,
        store: &Store,
        key: &ConversationKey,
        vector: QueryVector<'_>,
    ) -> Found {
        let handle = store.conversation(key).unwrap();
        let held = lock(&handle);
        let before = held.entries.last().unwrap().turn - 1;
        recall
            .search(
                store,
                &held,
                TextLanguage::Auto,
                Query {
                    text: "where is the silver car parked",
                    vector,
                    fusion: Fusion::default(),
                    when: None,
                },
                before,
                3,
            )
            .unwrap()
    }

    fn turns(found: &Found) -> Vec<u64> {
        found.hits.iter().map(|h| h.turn).collect()
    }

    /// A conversation of two facts among small talk, for searches by vector.
    const CAR_AND_SISTER: [&str; 8] = [
        "the silver car is parked in the garage",
        "noted",
        "my sister lives in Oslo",
        "nice",
        "the car needs new tyres",
        "ok",
        "dinner is at eight",
        "fine",
    ];

    #[test]
    fn a_search_with_a_later_vector_finds_what_one_at_hand_finds_and_a_failed_one_what_words_find()
    {
        let dir = tempfile::tempdir().unwrap();
        let texts = CAR_AND_SISTER;
        let (store, key) = conversation(dir.path(), &texts);
        let at_hand = [0.0f32, 1.0];
        let ready = search(&store, &key, QueryVector::Ready(&at_hand));
        assert!(ready.semantic);
        let asked = std::cell::Cell::new(0);
        let later = Later::new(|| {
            asked.set(asked.get() + 1);
            Ok::<_, ()>(at_hand.to_vec())
        });
        let lazily = search(&store, &key, QueryVector::Later(&later));
        assert_eq!(asked.get(), 1);
        assert!(lazily.semantic);
        assert_eq!(turns(&lazily), turns(&ready));
        let scores = |found: &Found| found.hits.iter().map(|h| h.score).collect::<Vec<_>>();
        assert_eq!(scores(&lazily), scores(&ready));

        // A vector that fails: the words alone, exactly as a search without one.
        let words = search(&store, &key, QueryVector::None);
        assert!(!words.semantic);
        let failed = Later::new(|| Err::<Vec<f32>, _>(()));
        let without = search(&store, &key, QueryVector::Later(&failed));
        assert!(!without.semantic);
        assert_eq!(turns(&without), turns(&words));
        assert_eq!(scores(&without), scores(&words));
        assert!(!turns(&words).is_empty());
    }

    /// An embedder of the test space: the text stored at turn `t` points at angle `t`, as
    /// [`conversation`] stores its vector; `derived` as told, failing when told.
    #[derive(Debug)]
    struct ByTurn {
        turns: Vec<(String, u64)>,
        derived: bool,
        fails: bool,
    }

    impl ByTurn {
        fn of(store: &Store, key: &ConversationKey, derived: bool, fails: bool) -> Arc<ByTurn> {
            let handle = store.conversation(key).unwrap();
            let held = lock(&handle);
            let turns: Vec<u64> = held.entries.iter().map(|e| e.turn).collect();
            let turns = store
                .messages(&held, turns)
                .unwrap()
                .iter()
                .map(|m| (search_text(&m.message), m.turn))
                .collect();
            Arc::new(ByTurn {
                turns,
                derived,
                fails,
            })
        }
    }

    impl Embed for ByTurn {
        fn id(&self) -> &str {
            SPACE
        }

        fn dims(&self) -> usize {
            2
        }

        fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, memproxy_embed::EmbedError> {
            if self.fails {
                return Err(memproxy_embed::EmbedError::Failed("told to".into()));
            }
            Ok(texts
                .iter()
                .map(|text| {
                    let (_, turn) = self.turns.iter().find(|(t, _)| t == text).unwrap();
                    let angle = *turn as f32;
                    vec![angle.cos(), angle.sin()]
                })
                .collect())
        }

        fn derived(&self) -> bool {
            self.derived
        }
    }

    /// With a derived embedder, an index built from a store that holds no vectors makes them
    /// from the stored texts, and a search finds what it finds with the same vectors stored;
    /// an embedder that is not derived, or that fails, is not asked and the words alone find.
    #[test]
    fn an_index_made_with_a_derived_embedder_finds_what_stored_vectors_find() {
        let texts = CAR_AND_SISTER;
        let (stored_dir, bare_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (stored, stored_key) = conversation(stored_dir.path(), &texts);
        let (bare, key) = conversation_with(bare_dir.path(), &texts, false);
        let space = || Some((SPACE.to_string(), 2));
        let query = [0.0f32, 1.0];
        let from_store = search(&stored, &stored_key, QueryVector::Ready(&query));
        assert!(from_store.semantic);

        let derived = ByTurn::of(&bare, &key, true, false);
        let recall = Recall::new(1 << 20, space()).deriving(Some(derived));
        let from_texts = search_in(&recall, &bare, &key, QueryVector::Ready(&query));
        assert!(from_texts.semantic);
        let found = |f: &Found| f.hits.iter().map(|h| (h.turn, h.score)).collect::<Vec<_>>();
        assert_eq!(found(&from_texts), found(&from_store));
        assert!(!from_texts.hits.is_empty());

        let words = search(&bare, &key, QueryVector::None);
        for embedder in [
            ByTurn::of(&bare, &key, false, false),
            ByTurn::of(&bare, &key, true, true),
        ] {
            let recall = Recall::new(1 << 20, space()).deriving(Some(embedder));
            let found_then = search_in(&recall, &bare, &key, QueryVector::Ready(&query));
            assert!(!found_then.semantic, "no vector made, none stored");
            assert_eq!(found(&found_then), found(&words));
        }
    }

    #[test]
    fn a_commit_indexes_its_question_with_the_terms_the_search_read_and_any_other_text_anew() {
        let dir = tempfile::tempdir().unwrap();
        let (store, key) = conversation(dir.path(), &["the silver car is parked", "noted"]);
        let recall = Recall::new(1 << 20, None);
        let handle = store.conversation(&key).unwrap();
        let held = lock(&handle);
        let next = held.meta.as_ref().unwrap().next_turn;
        let query = |text| Query {
            text,
            vector: QueryVector::None,
            fusion: Fusion::default(),
            when: None,
        };
        let question = "where is the silver car parked";
        recall
            .search(&store, &held, TextLanguage::Auto, query(question), next, 3)
            .unwrap();
        let index = recall.cache.get(&key).unwrap();
        {
            let mut index = super::lock(&index);
            let (text, terms) = index.last_query.clone().unwrap();
            assert_eq!((text.as_str(), &terms), (question, &index.terms(question)));
            // Kept terms told apart from terms read anew: the question's are taken for its
            // own text only.
            index.last_query = Some((question.to_string(), vec!["kept".to_string()]));
            assert_eq!(index.terms_of_added("a zebra"), index.terms("a zebra"));
            assert!(index.last_query.is_none());
            index.last_query = Some((question.to_string(), vec!["kept".to_string()]));
            assert_eq!(index.terms_of_added(question), vec!["kept".to_string()]);
            index.last_query = Some((question.to_string(), index.terms(question)));
        }
        let added = [
            (next, question.to_string()),
            (next + 1, "the zebra crossing".to_string()),
        ];
        recall.apply(&key, Some(next), &[], &added, &[], next + 2);
        assert!(super::lock(&index).last_query.is_none());
        // The applied index as it is (a search would build it again: the store was not
        // written here).
        let found = |text| {
            let mut index = super::lock(&index);
            let terms = index.terms(text);
            let hits = index.index.search(&terms, u64::MAX, 5);
            hits.iter().map(|h| h.turn).collect::<Vec<_>>()
        };
        // Best first; a turn also carries its neighbours' words, at less weight.
        assert_eq!(found("zebra").first(), Some(&(next + 1)));
        assert!(found("silver car parked").contains(&next));
    }

    #[test]
    fn a_later_vector_is_made_once_when_first_asked_for() {
        let calls = std::cell::Cell::new(0);
        let later = Later::new(|| {
            calls.set(calls.get() + 1);
            Ok::<_, &str>(vec![1.0, 0.0])
        });
        assert_eq!(calls.get(), 0, "not made before it is asked for");
        let vector = QueryVector::Later(&later);
        assert!(vector.is_some());
        assert_eq!(vector.get(), Some(&[1.0, 0.0][..]));
        assert_eq!(vector.get(), Some(&[1.0, 0.0][..]));
        assert_eq!(later.into_result(), Some(Ok(vec![1.0, 0.0])));
        assert_eq!(calls.get(), 1);
    }

    #[test]
    fn a_failed_later_vector_is_none_to_the_search_and_keeps_its_reason() {
        let later = Later::new(|| Err::<Vec<f32>, _>("no model"));
        assert_eq!(QueryVector::Later(&later).get(), None);
        assert_eq!(later.into_result(), Some(Err("no model")));
        // Never asked for by a search: made when the plan takes it.
        let unasked = Later::new(|| Ok::<_, &str>(vec![0.5]));
        assert_eq!(unasked.into_result(), Some(Ok(vec![0.5])));
        assert!(!QueryVector::None.is_some());
        assert_eq!(
            QueryVector::from(Some(&[2.0f32][..])).get(),
            Some(&[2.0][..])
        );
    }
}
