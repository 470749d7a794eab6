//! Relevance recall: an index per conversation over its stored messages, held in a
//! memory-weighted cache, updated at each commit and rebuilt from the store on a miss.
//!
//! The index covers every stored message; a search only considers those before the recent
//! window (the older pool). This module searches and keeps indexes; choosing the window and
//! rendering the recalled turns is the pipeline's job.
//!
//! - `index.rs` — BM25 over the messages' words (`tokenize.rs` makes the terms);
//! - `vectors.rs` — with an embedder, the messages' vectors, loaded from the store with the
//!   index and added as background jobs make them;
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

use self::hybrid::{Fusion, Scored, fuse, fuse_with_feedback, smooth};
use self::index::Index;
use self::tokenize::{Lang, TextLanguage, detect, terms};
use self::vectors::DocVectors;
use memproxy_base::cache::{Cache, Policy, Shrink};
use memproxy_base::heap;
use memproxy_base::identity::ConversationKey;
use memproxy_base::message::search_text;
use memproxy_store::{Conversation, Store, StoreError};

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
}

impl ConversationIndex {
    fn terms(&self, text: &str) -> Vec<String> {
        terms(text, self.latin)
    }
}

/// The indexes of recently used conversations.
pub struct Recall {
    cache: Arc<Cache<ConversationKey, Arc<Mutex<ConversationIndex>>>>,
    /// The embedder's vector space and dimension (`None`: recall by words alone).
    space: Option<(String, usize)>,
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
    pub vector: Option<&'a [f32]>,
    pub fusion: Fusion,
    /// The period the text names (`when.rs`): turns stored in it are favoured. Its words
    /// ("july") are still matched as words: a turn that says "in July" tells of it too
    /// (leaving them out measured 0.817 against 0.820 on LoCoMo).
    pub when: Option<when::Period>,
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
                    i.index.heap_bytes() + i.vectors.as_ref().map_or(0, DocVectors::heap_bytes)
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
            lookups: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
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
                )?));
                self.cache
                    .insert(conversation.key.clone(), Arc::clone(&built));
                built
            }
        };
        let mut guard = lock(&handle);
        let index = &mut *guard;
        let query_terms = index.terms(query.text);
        let semantic = match (query.vector, &index.vectors) {
            (Some(vector), Some(vectors)) if !vectors.is_empty() => {
                Some(smooth(vectors.similarities(vector)))
            }
            _ => None,
        };
        let lexical = match (&semantic, query.when) {
            // Every matching turn: the fusion ranks them with the rest.
            (Some(_), _) | (_, Some(_)) => {
                index.index.search(&query_terms, before_turn, usize::MAX)
            }
            (None, None) => index.index.search(&query_terms, before_turn, k),
        };
        let weight = index.index.query_weight(&query_terms);
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
        let (hits, under_floor) =
            fuse_with_feedback(semantic.as_deref(), query.fusion, k, ranked, |best| {
                let vectors = index.vectors.as_ref()?;
                let moved = vectors.feedback(query.vector?, best)?;
                Some(smooth(vectors.similarities(&moved)))
            });
        Ok(Found {
            hits,
            under_floor,
            semantic: semantic.is_some(),
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
        let Some(handle) = self.cache.get(key) else {
            return;
        };
        {
            let mut index = lock(&handle);
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
        // Re-insert so the cache weighs the grown index.
        self.cache.insert(key.clone(), handle);
    }

    /// Brings a cached index up to date with a commit, under the conversation's lock:
    /// `removed` turns were deleted, `added` (turn, text) appended, and the conversation's
    /// `next_turn` went from `before` to `after`. An index that was not in step is dropped and
    /// rebuilt on its next search.
    pub fn apply(
        &self,
        key: &ConversationKey,
        before: Option<u64>,
        removed: &[u64],
        added: &[(u64, String)],
        after: u64,
    ) {
        let Some(handle) = self.cache.get(key) else {
            return;
        };
        {
            let mut index = lock(&handle);
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
                let terms = index.terms(text);
                index.index.push(*turn, terms);
            }
            index.synced_next_turn = after;
        }
        // Re-insert so the cache weighs the grown index.
        self.cache.insert(key.clone(), handle);
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
) -> Result<ConversationIndex, StoreError> {
    let turns: Vec<u64> = conversation.entries.iter().map(|e| e.turn).collect();
    let messages = store.messages(conversation, turns)?;
    let texts: Vec<(u64, String)> = messages
        .iter()
        .map(|m| (m.turn, search_text(&m.message)))
        .collect();
    let latin = stemming(setting, texts.iter().map(|(_, text)| text.as_str()));
    let mut index = Index::new();
    for (turn, text) in texts {
        index.push(turn, terms(&text, latin));
    }
    // Weighed by its capacity: what the build's growth left unused would take room from
    // other conversations' indexes.
    index.shrink_to_fit();
    let vectors = match space {
        Some((space, dims)) => {
            let mut vectors = DocVectors::new(*dims);
            for (turn, vector) in store.vectors(conversation, space)? {
                vectors.insert(turn, &vector);
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
    })
}
