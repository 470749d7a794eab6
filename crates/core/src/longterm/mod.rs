//! Long-term memory: what a user said in any of their conversations, recalled in the next one.
//! Runs only for requests that name a user (`X-Memory-User-Id`) with `long_term_enabled`.
//!
//! - **Layer 1** (`archive.rs`, `user_index.rs`): every stored message of the user's
//!   conversations is copied, once committed, into the user's archive (an owner's records in
//!   the store, sealed with the user's key) and indexed per user (BM25, incrementally, rebuilt
//!   from the archive on a cache miss). A request searches the user's *other* conversations
//!   too; what it finds competes with the conversation's own older turns for the same
//!   `relevance_top_k` slots and token budget. The archive outlives the conversations: a
//!   conversation deleted by its TTL is still searchable, and a new request on its id is
//!   rebuilt from it, until the user is deleted. With an embedder, archived turns get vectors
//!   in the background (`crate::embedding`'s worker) and the search fuses words and meaning
//!   as a conversation's recall does (`recall/hybrid.rs`), with the request's query vector.
//! - **Layer 2** (`memories.rs`, `extract.rs`): memories extracted from what the user said by a
//!   background model call (`extract.rs`, queued by the commit, never on a request's path),
//!   deduplicated (by text, and by meaning), superseded and decaying (`memories.rs`), chosen
//!   for the prompt by relevance (words and meaning) and importance (`docs/memories.md`); `edits.rs` the memories changed at someone's word
//!   (an operator's hand edits, a user's agent through the memory tools), through the same
//!   records, history and dedup.
//!
//! Records are kept per [`OwnerKey`] (a user; an agent or the whole tenant for shared
//! memories), always inside one tenant: the tenant is part of every owner key, so no id a
//! client sends can reach another tenant's records.
//!
//! Nothing here fails a chat request: the pipeline logs and counts a failure and goes on
//! without long-term memory.

pub mod archive;
pub mod edits;
pub mod extract;
pub mod memories;
mod user_index;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::embedding::{Archived, RecordVector, RecordsStored};
use crate::ledger::Ledger;
use crate::recall::Query;
use crate::recall::tokenize::TextLanguage;
use crate::summary::OnStored;
use memproxy_base::cache::{Cache, Policy, Shrink};
use memproxy_base::identity::{ConversationKey, TenantId};
use memproxy_base::model::ModelCall;
use memproxy_embed::Embed;
use memproxy_store::{Conversation, OwnerKey, Store, StoreError, StoredMessage};

pub use archive::{ArchivedTurn, ExtractionRule, SPACE_ARCHIVE, SPACE_CONVERSATIONS};
pub use extract::{ExtractionCall, Extractor};
use user_index::UserIndex;

/// What long-term memory did, for metrics.
#[derive(Debug, Default)]
pub struct Counters {
    /// Messages copied into users' archives.
    pub archived: AtomicU64,
    /// Archive writes that failed (logged; the chat went on).
    pub archive_failures: AtomicU64,
    /// Searches of a user's other conversations, and the turns they brought back.
    pub searches: AtomicU64,
    pub recalled: AtomicU64,
    /// Conversations rebuilt from a user's archive after they were deleted.
    pub rebuilt: AtomicU64,
}

/// A user's cached state: the index of their archive, when built.
#[derive(Debug, Default)]
struct UserState {
    index: Option<UserIndex>,
}

/// A turn of one of the user's other conversations, found relevant.
#[derive(Debug, Clone)]
pub struct ElsewhereTurn {
    pub score: f32,
    pub agent: String,
    pub conversation: String,
    pub message: StoredMessage,
}

/// The users' cached indexes.
type Users = Cache<OwnerKey, Arc<Mutex<UserState>>>;

/// Long-term memory's part of the memory core: the users' indexes and the counters.
pub struct LongTerm {
    users: Arc<Users>,
    /// The embedder's vector space and dimension (`None`: by words alone).
    space: Option<(String, usize)>,
    pub counters: Counters,
    /// The background worker that extracts memories (layer 2).
    pub extractor: Arc<Extractor>,
}

impl std::fmt::Debug for LongTerm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LongTerm")
            .field("cached_users", &self.users.entry_count())
            .finish_non_exhaustive()
    }
}

fn lock(state: &Mutex<UserState>) -> MutexGuard<'_, UserState> {
    state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl LongTerm {
    /// Long-term memory whose user indexes take at most `capacity_bytes`, its memories
    /// extracted by `model`; with `embedder`, archived turns and memories are found by
    /// meaning too, and memories deduplicated by it. Must be called inside a tokio runtime:
    /// the extraction worker starts here.
    pub fn new(
        capacity_bytes: u64,
        store: Arc<Store>,
        model: Arc<dyn ModelCall>,
        ledger: Arc<Ledger>,
        embedder: Option<Arc<dyn Embed>>,
    ) -> LongTerm {
        let users = Arc::new(Cache::new(
            "users",
            capacity_bytes.max(1),
            Policy::TinyLfu,
            |_key: &OwnerKey, state: &Arc<Mutex<UserState>>| {
                let bytes = state.try_lock().map_or(4096, |s| {
                    s.index.as_ref().map_or(256, UserIndex::heap_bytes)
                });
                u32::try_from(bytes).unwrap_or(u32::MAX)
            },
        ));
        LongTerm {
            users,
            space: embedder.as_ref().map(|e| (e.id().to_string(), e.dims())),
            counters: Counters::default(),
            extractor: Extractor::start(store, model, ledger, embedder),
        }
    }

    /// The embedder's vector space (`None`: by words alone).
    pub fn space(&self) -> Option<&str> {
        self.space.as_ref().map(|(id, _)| id.as_str())
    }

    /// What a records job of `user`'s archive tells once it stored their vectors: the
    /// user's cached index takes them.
    fn archive_vectors_stored(&self, user: &OwnerKey) -> RecordsStored {
        let (users, user) = (Arc::clone(&self.users), user.clone());
        Box::new(move |vectors: &[RecordVector]| {
            let Some(state) = users.get(&user) else {
                return;
            };
            {
                let mut state = lock(&state);
                let Some(index) = state.index.as_mut() else {
                    return;
                };
                let archived: Vec<(Vec<u8>, Vec<f32>)> = vectors
                    .iter()
                    .filter(|(space, _, _)| *space == SPACE_ARCHIVE)
                    .map(|(_, id, vector)| (id.clone(), vector.clone()))
                    .collect();
                index.add_vectors(&archived);
            }
            // Re-inserted so the cache weighs the vectors.
            users.insert(user, state);
        })
    }

    fn state(&self, user: &OwnerKey) -> Arc<Mutex<UserState>> {
        self.users
            .get_or_insert_with(user.clone(), || Arc::new(Mutex::new(UserState::default())))
    }

    /// After a commit of `conversation` for `user` (under the conversation's lock): copies
    /// the messages not yet in the user's archive into it, and removes `dropped` turns (a
    /// replaced reply, a closed branch: no longer what was said). The user's index follows;
    /// the archived turns are returned for the embedding job of the same commit, which gives
    /// them their messages' vectors (`None`: none archived, or no recall by meaning).
    pub fn after_commit(
        &self,
        store: &Store,
        user: &OwnerKey,
        conversation: &Conversation,
        dropped: &[u64],
        extraction: Option<(ExtractionRule, Option<&ExtractionCall>)>,
    ) -> Option<Archived> {
        let state = self.state(user);
        let mut state = lock(&state);
        let mut archived = None;
        let rule = extraction.map(|(rule, call)| ExtractionRule {
            may_queue: rule.may_queue && call.is_some(),
            ..rule
        });
        match archive::catch_up(store, user, conversation, dropped, rule) {
            Ok((added, due)) => {
                self.counters
                    .archived
                    .fetch_add(added.len() as u64, Ordering::Relaxed);
                if self.space.is_some() && !added.is_empty() {
                    let texts = added
                        .iter()
                        .map(|a| {
                            let text = memproxy_base::message::search_text(&a.turn.message.message);
                            (SPACE_ARCHIVE, a.id.clone(), text)
                        })
                        .collect();
                    archived = Some(Archived {
                        owner: user.clone(),
                        texts,
                        stored: self.archive_vectors_stored(user),
                    });
                }
                if let Some(index) = &mut state.index {
                    if dropped.is_empty() {
                        for turn in &added {
                            index.push(turn);
                        }
                    } else {
                        state.index = None;
                    }
                }
                if let (Some(due), Some((_, Some(call)))) = (due, extraction) {
                    self.extractor.enqueue(extract::ExtractionJob {
                        user: user.clone(),
                        agent: conversation.key.agent.clone(),
                        conversation: conversation.key.conversation.clone(),
                        conversation_id: due.conversation_id,
                        from_turn: due.from_turn,
                        to_turn: due.to_turn,
                        call: call.clone(),
                        summary: None,
                    });
                }
            }
            Err(err) => {
                self.counters
                    .archive_failures
                    .fetch_add(1, Ordering::Relaxed);
                // The next commit of the conversation catches up from where the archive is.
                tracing::warn!(error = %err, "copying turns into the user's archive failed");
            }
        }
        drop(state);
        // Re-inserted so the cache weighs the grown index.
        if let Some(state) = self.users.get(user) {
            self.users.insert(user.clone(), state);
        }
        archived
    }

    /// What a summary job of conversation `key` (life `conversation_id`) of `user` does once
    /// its model summary is stored: queues one extraction from the summary's text (with the
    /// job's credentials), its source turns the range the summary covers.
    pub fn extraction_from_summary(
        &self,
        user: &OwnerKey,
        key: &ConversationKey,
        conversation_id: u64,
        model: String,
    ) -> OnStored {
        let extractor = Arc::clone(&self.extractor);
        let (user, agent, conversation) =
            (user.clone(), key.agent.clone(), key.conversation.clone());
        OnStored::new(move |record, credentials| {
            extractor.enqueue(extract::ExtractionJob {
                user,
                agent,
                conversation,
                conversation_id,
                from_turn: record.from_turn,
                to_turn: record.to_turn,
                // Made once the summary is stored: after its request's answer.
                call: ExtractionCall {
                    model,
                    credentials: credentials.clone(),
                    handed_over: None,
                },
                summary: Some(record.text.clone()),
            });
        })
    }

    /// True when a request adding `new_user_messages` user messages to the conversation
    /// brings it to an extraction (`every` user messages since the last one).
    pub fn extraction_due(
        &self,
        store: &Store,
        user: &OwnerKey,
        key: &ConversationKey,
        new_user_messages: u64,
        every: u64,
    ) -> Result<bool, StoreError> {
        if new_user_messages == 0 {
            return Ok(false);
        }
        let pending = archive::pending_user_messages(store, user, key)?;
        Ok(pending + new_user_messages >= every)
    }

    /// The memories for a request's prompt: the user's own, the agent's and the tenant's,
    /// chosen as [`memories::select`] says (by meaning too when `query` has a vector).
    pub fn memories_for(
        &self,
        store: &Store,
        user: &OwnerKey,
        agent: &str,
        query: Query<'_>,
        settings: &crate::settings::MemorySettings,
        now_ms: i64,
    ) -> Result<Vec<memories::Chosen>, StoreError> {
        if settings.long_term_top_k == 0 || settings.long_term_max_tokens == 0 {
            return Ok(Vec::new());
        }
        let mut candidates = Vec::new();
        let mut vectors = std::collections::HashMap::new();
        for owner in extract::owners(user, agent) {
            if let Some(handle) = store.owner(&owner, false)? {
                let found = memories::all(store, &handle)?;
                if let (Some(space), Some(_), false) =
                    (self.space(), query.vector.get(), found.is_empty())
                {
                    vectors.extend(memories::vectors(store, &handle, space)?);
                }
                for memory in found {
                    candidates.push((owner.clone(), memory));
                }
            }
        }
        Ok(memories::select(
            candidates,
            memories::Ask {
                query,
                vectors: &vectors,
            },
            now_ms,
            decay_of(settings),
            settings.long_term_top_k,
            settings.long_term_max_tokens,
        ))
    }

    /// Marks `used` memories as accessed at `now_ms` (recalled into a prompt that was
    /// answered and stored): their decay starts again. A failure is logged, never returned.
    pub fn refresh(&self, store: &Store, used: &[(OwnerKey, memories::MemoryRecord)], now_ms: i64) {
        let mut by_owner: std::collections::HashMap<&OwnerKey, Vec<memories::MemoryRecord>> =
            std::collections::HashMap::new();
        for (owner, record) in used {
            let mut record = record.clone();
            record.last_accessed_ms = now_ms;
            by_owner.entry(owner).or_default().push(record);
        }
        for (owner, records) in by_owner {
            // Only owners that still exist: a refresh never recreates a deleted user.
            let written = match store.owner(owner, false) {
                // The texts are unchanged: their vectors stay.
                Ok(Some(_)) => memories::write(store, owner, &records, &[], &[]).map(|_| ()),
                Ok(None) => Ok(()),
                Err(err) => Err(err),
            };
            if let Err(err) = written {
                tracing::warn!(error = %err, "refreshing the memories' last access failed");
            }
        }
    }

    /// Stops the extraction worker (waiting up to `grace` for the job in flight).
    pub async fn shutdown(&self, grace: std::time::Duration) {
        self.extractor.shutdown(grace).await;
    }

    /// The `k` turns of `user`'s conversations other than `current` (all of them: `None`)
    /// most relevant to `query` (by words, and by meaning when it has a vector), best first.
    pub fn search(
        &self,
        store: &Store,
        user: &OwnerKey,
        current: Option<&ConversationKey>,
        language: TextLanguage,
        query: Query<'_>,
        k: usize,
    ) -> Result<Vec<ElsewhereTurn>, StoreError> {
        if k == 0 || query.text.trim().is_empty() {
            return Ok(Vec::new());
        }
        let Some(handle) = store.owner(user, false)? else {
            return Ok(Vec::new());
        };
        self.counters.searches.fetch_add(1, Ordering::Relaxed);
        let state = self.state(user);
        let hits = {
            let mut state = lock(&state);
            let fresh = match state.index.take() {
                Some(index) if index.setting() == language => index,
                _ => UserIndex::build(store, &handle, language, self.space.as_ref())?,
            };
            let index = state.index.insert(fresh);
            index.search(
                query,
                current.map(|c| (c.agent.as_str(), c.conversation.as_str())),
                k,
            )
        };
        self.users.insert(user.clone(), state);
        let mut found = Vec::with_capacity(hits.len());
        for (score, id) in hits {
            if let Some(turn) = archive::read(store, &handle, &id)? {
                found.push(ElsewhereTurn {
                    score,
                    agent: turn.agent,
                    conversation: turn.conversation,
                    message: turn.message,
                });
            }
        }
        self.counters
            .recalled
            .fetch_add(found.len() as u64, Ordering::Relaxed);
        Ok(found)
    }

    /// When the conversation at `key` is not stored but `user`'s archive holds its turns (it
    /// was deleted by its TTL), stores them again as the conversation, so a new request on
    /// it goes on where it left off. True when it was rebuilt.
    pub fn rebuild(
        &self,
        store: &Store,
        user: &OwnerKey,
        key: &ConversationKey,
    ) -> Result<bool, StoreError> {
        let rebuilt = archive::rebuild(store, user, key)?;
        if rebuilt {
            self.counters.rebuilt.fetch_add(1, Ordering::Relaxed);
        }
        Ok(rebuilt)
    }

    /// What the embedding worker needs to catch an owner's vectors up after a dropped job:
    /// the records that have vectors, and the user's cached index dropped once they are made
    /// (it is rebuilt with them on its next search).
    pub fn owner_catch_up(&self) -> crate::embedding::OwnerCatchUp {
        let users = Arc::clone(&self.users);
        crate::embedding::OwnerCatchUp {
            records: &VECTOR_RECORDS,
            caught_up: Box::new(move |owner| users.invalidate(owner)),
        }
    }

    /// Drops a user's cached index (after a delete).
    pub fn forget(&self, user: &OwnerKey) {
        self.users.invalidate(user);
    }

    /// Drops every cached index of a tenant's users.
    pub fn forget_tenant(&self, tenant: &TenantId) {
        let keys: Vec<OwnerKey> = self
            .users
            .iter()
            .filter(|(key, _)| key.tenant == *tenant)
            .map(|(key, _)| (*key).clone())
            .collect();
        for key in keys {
            self.users.invalidate(&key);
        }
    }

    /// Drops every cached index (the store was reopened).
    pub fn forget_all(&self) {
        self.users.invalidate_all();
    }

    /// Heap bytes of the cached user indexes (approximate).
    pub fn weighted_size(&self) -> u64 {
        self.users.weighted_size()
    }

    /// The users' index cache, as the memory guard shrinks it under pressure.
    pub fn cache(&self) -> Arc<dyn Shrink> {
        Arc::clone(&self.users) as Arc<dyn Shrink>
    }
}

/// The owners' records that have vectors (archived turns, memories) and how a rebuild reads
/// their texts (`crate::embedding::rebuild`).
pub static VECTOR_RECORDS: crate::embedding::OwnerRecords<'static> =
    crate::embedding::OwnerRecords {
        spaces: &[SPACE_ARCHIVE, memories::SPACE_MEMORIES],
        read: &record_texts,
    };

/// The texts of an owner's records `ids` of record space `space`, as they are embedded: an
/// archived turn's search text, a memory's text.
fn record_texts(
    store: &Store,
    handle: &memproxy_store::OwnerHandle,
    space: u8,
    ids: &[Vec<u8>],
) -> Result<Vec<crate::embedding::RecordText>, StoreError> {
    let mut wanted: Vec<&[u8]> = ids.iter().map(Vec::as_slice).collect();
    wanted.sort_unstable();
    let corrupt = |err: serde_json::Error| StoreError::Corrupt(err.to_string());
    let mut out = Vec::with_capacity(ids.len());
    for record in store.all_owner_records(handle, space)? {
        if wanted.binary_search(&record.id.as_slice()).is_err() {
            continue;
        }
        let text = match space {
            SPACE_ARCHIVE => {
                let turn: ArchivedTurn = serde_json::from_slice(&record.value).map_err(corrupt)?;
                memproxy_base::message::search_text(&turn.message.message)
            }
            memories::SPACE_MEMORIES => {
                let memory: memories::MemoryRecord =
                    serde_json::from_slice(&record.value).map_err(corrupt)?;
                memory.text
            }
            _ => continue,
        };
        out.push((space, record.id, text));
    }
    Ok(out)
}

/// The decay settings of `settings`.
pub fn decay_of(settings: &crate::settings::MemorySettings) -> memories::Decay {
    memories::Decay {
        half_life_ms: settings.memory_half_life.as_secs_f64() * 1000.0,
        min: settings.memory_min_decay(),
    }
}

/// Deletes the memories whose decay score fell under `decay.min`, looking at up to `limit`
/// owners after the cursor `after`; returns how many were deleted and where to go on from.
pub fn sweep_decayed(
    store: &Store,
    after: Option<&[u8]>,
    limit: usize,
    decay: memories::Decay,
    now_ms: i64,
) -> Result<(usize, Option<Vec<u8>>), StoreError> {
    let (page, next) = store.owners(after, limit.max(1))?;
    let mut deleted = 0;
    for (owner, _) in page {
        let Some(handle) = store.owner(&owner, false)? else {
            continue;
        };
        let gone: Vec<(u8, Vec<u8>)> = memories::all(store, &handle)?
            .iter()
            .filter(|m| m.decay(now_ms, decay) < decay.min)
            .map(|m| (memories::SPACE_MEMORIES, memories::record_id(m.id)))
            .collect();
        if !gone.is_empty() && store.write_owner(&handle, Vec::new(), &gone)? {
            deleted += gone.len();
        }
    }
    Ok((deleted, next))
}
