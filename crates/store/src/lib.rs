//! The conversation store: a storage [`Engine`] (sled by default) behind the memory core's
//! view of it: a cache of each conversation's in-memory index, locked per conversation,
//! optimistic commits against the version the request planned on, and group flushes.
//!
//! - `engine.rs` — the storage contract every engine keeps (read it first), one trait per
//!   capability ([`Engine`], [`Owners`], [`SharedEngine`]);
//! - `sled_engine.rs` — the embedded engine (the default); `fjall_engine.rs` — the embedded
//!   engine whose memory its caches bound (`storage.backend = "fjall"`); `layout.rs` — the
//!   keys, record encoding and paging both keep; `redis_engine.rs`, `redis_owners.rs` — the
//!   engine shared by replicas (conversations, and owners' records) in a Redis server;
//! - `records.rs` — what is stored (records, messages, summaries, TTL);
//! - this file — the request path: handles, load, read, commit, durability;
//! - `summaries.rs`, `branches.rs`, `ttl.rs`, `listing.rs`, `transfer.rs` — summary records
//!   (and their Markdown copies), closed branches, TTL records, listing and paging,
//!   export/import/delete;
//! - `flush.rs` — the group flusher; `contract.rs` — the contract tests, run per engine;
//! - `seal.rs`, `keys.rs` — message bodies and summary records encrypted with a key per
//!   conversation, kept in its own file, so that a delete leaves nothing readable on disk;
//! - `owners.rs` — owners' records (long-term memory per user, agent or tenant), sealed with
//!   a key per owner like conversations;
//! - `vectors.rs` — vectors of stored messages and of owners' records (recall by meaning):
//!   their quantised, sealed format, written only for what is stored and gone with it;
//!   `sled_vectors.rs`, `redis_vectors.rs` — how sled and Redis keep them (fjall's are in
//!   `fjall_engine.rs`);
//! - `clock.rs` — the one clock every timestamp is read from ([`Clock`]; tests move it);
//! - `health.rs` — the check at open, failures to write and their retry (readiness);
//! - `salvage.rs`, `sled_salvage.rs` — reading a damaged data directory and writing what can
//!   be read into a fresh one (`memproxy store check|repair`).
//!
//! Files: each conversation may have a workspace folder, [`workspace_dir`], for copies meant
//! for people (summaries as Markdown). Its path is derived so no id can escape the data
//! directory.
//!
//! This crate stores and loads; deciding what to store is the pipeline's job.

mod branches;
mod clock;
mod engine;
mod fjall_engine;
mod flush;
mod health;
mod keys;
mod layout;
mod listing;
mod owners;
mod records;
mod redis_engine;
pub mod salvage;
mod seal;
mod sled_engine;
mod sled_salvage;
mod summaries;
mod transfer;
mod ttl;
mod vectors;

#[cfg(test)]
mod contract;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::task::JoinHandle;

pub use branches::closed_by_branch;
pub use clock::Clock;
pub use engine::{
    Engine, Loaded, Owners, Page, Refresh, Scope, SealedVector, SharedEngine, Vectors, Version,
    Write,
};
pub use fjall_engine::FjallEngine;
pub use flush::FlushError;
pub use health::RETRY_AFTER;
pub use owners::OwnerHandle;
pub use records::{
    BranchRecord, ConversationMeta, ConversationSummary, Deleted, Entry, ExchangeFigures,
    ExchangePoint, ImportMeta, Imported, LedgerTotals, MAX_CATCH_UP_CALLS, Origin, OwnerKey,
    OwnerKind, OwnerMeta, OwnerRecord, StoredBranch, StoredMessage, SummaryRecord, TtlRecord,
    rfc3339_seconds, tokens_between, transcript_line,
};
pub use redis_engine::{RedisEngine, RedisOptions, is_redis_url};
pub use sled_engine::SledEngine;
pub use transfer::already_stored;
pub use vectors::{Quantised, RecordVector, quantise};

use flush::GroupFlusher;
use keys::{EngineKeys, KeyFiles, Keys};
use memproxy_base::cache::{Cache, Policy};
use memproxy_base::heap;
use memproxy_base::identity::ConversationKey;

/// When a commit reaches the disk (`storage.durability`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Each commit is flushed before the client sees the end of the response; concurrent
    /// commits share one flush (group commit).
    Commit,
    /// The store is flushed on this interval in the background; a crash can lose the commits
    /// of the last one.
    Interval(Duration),
}

impl Durability {
    /// How often an embedded engine flushes on its own (`None`: only when asked).
    fn engine_flush_every(self) -> Option<Duration> {
        match self {
            Durability::Commit => None,
            Durability::Interval(every) => Some(every),
        }
    }
}

/// How the store is set up.
#[derive(Debug, Clone, Copy)]
pub struct StoreOptions {
    pub durability: Durability,
    /// The engine's page cache (sled).
    pub page_cache_bytes: u64,
    /// The cache of conversations' in-memory indexes.
    pub state_cache_bytes: u64,
}

/// A conversation's in-memory index: its record and version as last read or written, and one
/// [`Entry`] per stored message in turn order. Held behind a mutex that is never held across
/// an `.await`.
#[derive(Debug)]
pub struct Conversation {
    pub key: ConversationKey,
    pub meta: Option<ConversationMeta>,
    /// The version a commit checks against.
    version: Version,
    pub entries: Vec<Entry>,
    /// The message bodies last read and opened ([`Store::messages`]).
    opened: Mutex<Opened>,
    /// The newest summary record last opened ([`Store::newest_summary`]).
    summary: Mutex<Option<Box<summaries::HeldSummary>>>,
}

impl Conversation {
    fn from_loaded(key: ConversationKey, loaded: Loaded) -> Conversation {
        Conversation {
            key,
            meta: loaded.meta,
            version: loaded.version,
            entries: loaded.entries,
            opened: Mutex::default(),
            summary: Mutex::default(),
        }
    }

    /// The heap it holds beyond its own struct, but for [`Opened`]: its key's strings, its
    /// version, its entries, its record's list of the newest exchanges' figures.
    fn own_heap_bytes(&self) -> usize {
        self.key.heap_bytes()
            + self.version.heap_bytes()
            + heap::vec::<Entry>(self.entries.capacity())
            + self
                .meta
                .as_ref()
                .map_or(0, |meta| heap::vec::<ExchangePoint>(meta.recent.capacity()))
            + self
                .summary
                .try_lock()
                .map_or(0, |held| held.as_ref().map_or(0, |h| h.heap_bytes()))
    }

    /// Weighs the conversation for the state cache, granting [`Opened`] its allowance for
    /// until the next weighing: as much as the rest of the conversation weighs, at most
    /// [`Opened::MAX_ALLOWANCE`] (what it held over the new grant is let go now).
    fn weigh(&self) -> usize {
        let own = self.own_heap_bytes();
        let granted = match self.opened.try_lock() {
            Ok(mut opened) => {
                opened.grant(own.min(Opened::MAX_ALLOWANCE));
                opened.allowance
            }
            // Held by a reader right now: its allowance stays the one last weighed.
            Err(_) => 0,
        };
        own + granted
    }

    /// Empties an in-memory conversation.
    fn reset(&mut self) {
        self.meta = None;
        self.version = Version::absent();
        self.entries.clear();
        self.opened_lock().clear();
        *self
            .summary
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
    }

    fn opened_lock(&self) -> MutexGuard<'_, Opened> {
        self.opened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The stored fingerprint of `turn`, if the conversation holds it.
    fn fingerprint(&self, turn: u64) -> Option<u64> {
        self.position(turn).map(|i| self.entries[i].fingerprint)
    }

    /// Where `turn` is in `entries`, if the conversation holds it. Turns are numbered one
    /// after another and leave from the front (trims) and the end (a replaced reply, a closed
    /// branch), so a turn is nearly always where its distance from the first or the last
    /// entry puts it: those two places are looked at before a binary search (whose steps
    /// are a cache miss each over a long conversation's entries).
    pub fn position(&self, turn: u64) -> Option<usize> {
        let entries = &self.entries;
        let first = entries.first()?.turn;
        let last = entries.last()?.turn;
        let from_first = turn.checked_sub(first);
        let from_last = last
            .checked_sub(turn)
            .and_then(|back| (entries.len() as u64 - 1).checked_sub(back));
        for guess in [from_last, from_first].into_iter().flatten() {
            if let Ok(guess) = usize::try_from(guess)
                && entries.get(guess).is_some_and(|e| e.turn == turn)
            {
                return Some(guess);
            }
        }
        entries.binary_search_by_key(&turn, |e| e.turn).ok()
    }
}

/// The message bodies a cached conversation last read and opened, each with when it was last
/// used: each request reads its window (and its recalled turns) again, and reading one from the
/// engine means a lookup, a base64 decode and a decryption, about a tenth of a read-only
/// request's CPU. Held for one conversation id (cleared when it changes) and checked against
/// the entry's fingerprint on each use, so a body is never taken for another message. It holds
/// at most the allowance the state cache's weigher granted when it last weighed the
/// conversation ([`Conversation::weigh`]), so a conversation never holds more than it is
/// counted for; past it the least recently used go first. A use marks the body in place (its
/// `used` tick), so no body moves when it is read.
#[derive(Debug, Default)]
struct Opened {
    id: u64,
    messages: Vec<Held>,
    clock: u64,
    bytes: usize,
    allowance: usize,
}

/// A body [`Opened`] holds, with when it was last used: a tick of its clock.
#[derive(Debug)]
struct Held {
    message: StoredMessage,
    used: u64,
}

impl Opened {
    /// The most bytes of opened bodies a conversation keeps: a window of ten messages and
    /// five recalled turns of a few hundred bytes each.
    const MAX_ALLOWANCE: usize = 12 << 10;

    fn clear(&mut self) {
        self.messages.clear();
        self.bytes = 0;
    }

    /// Sets the allowance, letting go of the least recently used bodies over it.
    fn grant(&mut self, allowance: usize) {
        self.allowance = allowance;
        while self.bytes > allowance && !self.messages.is_empty() {
            self.let_go_of_least_used();
        }
    }

    fn weight(message: &StoredMessage) -> usize {
        heap::string(message.message.get().len()) + std::mem::size_of::<StoredMessage>()
    }

    /// The next tick of the use clock.
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Lets go of the body used longest ago (there is one).
    fn let_go_of_least_used(&mut self) {
        let Some(i) = (0..self.messages.len()).min_by_key(|&i| self.messages[i].used) else {
            return;
        };
        self.let_go_of(i);
    }

    fn let_go_of(&mut self, i: usize) {
        let old = self.messages.swap_remove(i);
        self.bytes -= Opened::weight(&old.message);
    }

    /// The body of `turn` when it is held for conversation `id` with `fingerprint`; marked as
    /// used last.
    fn take(&mut self, id: u64, turn: u64, fingerprint: u64) -> Option<StoredMessage> {
        if self.id != id {
            return None;
        }
        let i = self
            .messages
            .iter()
            .position(|h| h.message.turn == turn && h.message.fingerprint == fingerprint)?;
        self.messages[i].used = self.tick();
        Some(self.messages[i].message.clone())
    }

    /// Keeps `message` (of conversation `id`), dropping the least recently used past the
    /// allowance.
    fn keep(&mut self, id: u64, message: &StoredMessage) {
        self.hold_for(id);
        if self.light_enough(message) {
            self.hold(message.clone());
        }
    }

    /// [`Opened::keep`] for a message of one's own.
    fn keep_owned(&mut self, id: u64, message: StoredMessage) {
        self.hold_for(id);
        if self.light_enough(&message) {
            self.hold(message);
        }
    }

    /// Holds bodies of conversation `id` from now on: those of another id are let go.
    fn hold_for(&mut self, id: u64) {
        if self.id != id {
            self.clear();
            self.id = id;
        }
    }

    /// Whether `message` weighs little enough for the allowance to hold.
    fn light_enough(&self, message: &StoredMessage) -> bool {
        Opened::weight(message) <= self.allowance / 4
    }

    /// Holds `message` as the most recently used, in place of its turn's older body, letting
    /// go of the least recently used past the allowance.
    fn hold(&mut self, message: StoredMessage) {
        let weight = Opened::weight(&message);
        if let Some(i) = self
            .messages
            .iter()
            .position(|h| h.message.turn == message.turn)
        {
            self.let_go_of(i);
        }
        while self.bytes + weight > self.allowance && !self.messages.is_empty() {
            self.let_go_of_least_used();
        }
        self.bytes += weight;
        let used = self.tick();
        self.messages.push(Held { message, used });
    }

    /// The turns held, least recently used first.
    #[cfg(test)]
    fn turns_by_use(&self) -> Vec<u64> {
        let mut order: Vec<&Held> = self.messages.iter().collect();
        order.sort_by_key(|h| h.used);
        order.into_iter().map(|h| h.message.turn).collect()
    }
}

/// What [`Store::refresh`] did to a cached conversation.
#[derive(Debug)]
pub enum Refreshed {
    /// It was the stored version.
    Unchanged,
    /// Messages another replica stored were appended (bodies opened); `before` was its
    /// `next_turn` until then.
    Appended {
        before: Option<u64>,
        added: Vec<StoredMessage>,
    },
    /// It was read again whole.
    Reloaded,
}

/// A change to one conversation, applied atomically by [`Store::commit`].
#[derive(Debug, Default)]
pub struct Change {
    /// Turns to delete (a replaced reply, trimmed rounds).
    pub remove_turns: Vec<u64>,
    /// Messages to add, in order; their `turn` is assigned by the commit.
    pub add: Vec<StoredMessage>,
    /// Tokens of the prompt forwarded for this exchange, added to the conversation's total.
    pub tokens_forwarded: u64,
    /// The exchange's part of the conversation's token ledger, added to its totals.
    pub ledger: LedgerTotals,
    /// Closes a branch: the stored messages from this turn on leave the main line, and are
    /// kept as a closed branch with the summaries that reach them, in the same write.
    pub branch_from_turn: Option<u64>,
    /// Vectors of some of the added messages, sealed as [`Store::put_vectors`] seals them and
    /// written with them in the same write.
    pub vectors: Option<AddedVectors>,
}

/// Vectors of a [`Change`]'s added messages, of one embedder's space.
#[derive(Debug, Default)]
pub struct AddedVectors {
    /// The space (`Embed::id`), as [`Store::put_vectors`] takes it.
    pub space: String,
    /// One per message of `Change::add`, in its order, quantised ([`quantise`]); `None` for
    /// one that could not be (not stored).
    pub of: Vec<Option<Quantised>>,
}

/// The turn of the first of `entries` whose index is not in `removed` (sorted).
fn first_kept(entries: &[Entry], removed: &[usize]) -> Option<u64> {
    (0..entries.len())
        .find(|i| removed.binary_search(i).is_err())
        .map(|i| entries[i].turn)
}

/// The Responses API ids of the replies among `messages` (before they are sealed).
pub(crate) fn response_ids_of(messages: &[StoredMessage]) -> Vec<String> {
    messages
        .iter()
        .filter(|m| m.role == memproxy_base::message::Role::Assistant)
        .filter_map(|m| memproxy_base::wire::response_id_of(&m.message))
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage engine: {0}")]
    Engine(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("a stored record could not be decoded: {0}")]
    Corrupt(String),
    #[error("the conversation changed since it was read")]
    Stale,
    #[error(transparent)]
    Flush(#[from] FlushError),
    #[error("writing a workspace file failed: {0}")]
    File(#[from] std::io::Error),
    #[error("a conversation key file could not be read or written: {0}")]
    KeyFile(#[source] std::io::Error),
    #[error("the key of conversation {0} is missing: its sealed messages cannot be read")]
    KeyMissing(u64),
    #[error("encryption failed: {0}")]
    Crypto(&'static str),
    /// The engine could not read or write its files (the disk is full, an I/O error).
    #[error("the store's files could not be written or read: {0}")]
    Disk(#[source] std::io::Error),
    /// The engine found its files damaged.
    #[error("the store's files are damaged: {0}")]
    Damaged(String),
    /// A shared engine (Redis) cannot be reached: refused, timed out, the connection lost.
    #[error("the store cannot be reached: {0}")]
    Unreachable(String),
    /// The engine is closed: reopening it after a failure did not succeed (yet).
    #[error("the store is closed after a failure to write")]
    Closed,
    /// The data directory holds the other embedded engine's store, which this one would not
    /// read: starting empty beside it would hide every conversation stored there.
    #[error(
        "the data directory holds a {found} store (its folder `{folder}`) and storage.backend is \"{wanted}\": set storage.backend = \"{found}\"{way}"
    )]
    OtherEngine {
        found: &'static str,
        folder: &'static str,
        wanted: &'static str,
        /// How the store moves, where it can (a sled store to fjall).
        way: &'static str,
    },
    /// Writes failed earlier and the store has not recovered yet (see [`Store::writable`]).
    #[error("the store cannot write ({0}); memory is off until it can")]
    Unwritable(String),
}

impl StoreError {
    /// True when the error is a failure to write to disk (full, or an I/O error): the store
    /// stops taking writes until [`Store::writable`] finds it can again.
    pub fn is_write_failure(&self) -> bool {
        let disk_full = |err: &std::io::Error| {
            matches!(
                err.kind(),
                std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
            )
        };
        match self {
            StoreError::Disk(_)
            | StoreError::Closed
            | StoreError::Unwritable(_)
            | StoreError::Unreachable(_) => true,
            StoreError::Flush(err) => err.disk,
            StoreError::KeyFile(err) | StoreError::File(err) => disk_full(err),
            _ => false,
        }
    }
}

/// The embedded engines, each in its own folder of the data directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Embedded {
    /// sled, in `store/` (the default).
    Sled,
    /// fjall, in `fjall/`.
    Fjall,
}

impl Embedded {
    /// The engine's name (`storage.backend`).
    pub fn name(self) -> &'static str {
        match self {
            Embedded::Sled => "sled",
            Embedded::Fjall => "fjall",
        }
    }

    /// The folder of the data directory the engine keeps its files in.
    pub fn folder(self) -> &'static str {
        match self {
            Embedded::Sled => "store",
            Embedded::Fjall => "fjall",
        }
    }

    /// The engine `storage.backend` names `name`, if embedded.
    pub fn named(name: &str) -> Option<Embedded> {
        [Embedded::Sled, Embedded::Fjall]
            .into_iter()
            .find(|e| e.name() == name)
    }

    /// Opens (or creates) the engine's files in its folder of the data directory `dir`, with
    /// a cache of `cache_bytes`, flushing on its own every `flush_every` (`None`: when asked).
    pub fn open_engine(
        self,
        dir: &Path,
        cache_bytes: u64,
        flush_every: Option<Duration>,
    ) -> Result<Arc<dyn Engine>, StoreError> {
        let dir = dir.join(self.folder());
        Ok(match self {
            Embedded::Sled => Arc::new(SledEngine::open(&dir, cache_bytes, flush_every)?),
            Embedded::Fjall => Arc::new(FjallEngine::open(&dir, cache_bytes, flush_every)?),
        })
    }

    fn other(self) -> Embedded {
        match self {
            Embedded::Sled => Embedded::Fjall,
            Embedded::Fjall => Embedded::Sled,
        }
    }
}

/// Fails when `dir` holds the other embedded engine's store and not `wanted`'s.
fn refuse_other_engine(dir: &Path, wanted: Embedded) -> Result<(), StoreError> {
    let other = wanted.other();
    if dir.join(other.folder()).is_dir() && !dir.join(wanted.folder()).exists() {
        return Err(StoreError::OtherEngine {
            found: other.name(),
            folder: other.folder(),
            wanted: wanted.name(),
            way: match other {
                Embedded::Sled => {
                    ", or move the store to fjall with `memproxy store repair --into NEW_DIR --engine fjall`"
                }
                Embedded::Fjall => "",
            },
        });
    }
    Ok(())
}

/// Cached conversation handles.
pub type Handle = Arc<Mutex<Conversation>>;

/// The engine a store runs on: one this process has alone (sled), or one other replicas write
/// to as well (Redis), which has what sharing needs ([`SharedEngine`]).
pub enum Backing {
    Own(Arc<dyn Engine>),
    Shared(Arc<dyn SharedEngine>),
}

pub struct Store {
    engine: Arc<dyn Engine>,
    /// The one clock (`clock.rs`), shared with the memory core.
    clock: Arc<Clock>,
    /// The same engine when other replicas share it.
    shared: Option<Arc<dyn SharedEngine>>,
    data_dir: PathBuf,
    /// The conversations' keys (`{data_dir}/keys/`, or in a shared engine).
    keys: Keys,
    cache: Arc<Cache<ConversationKey, Handle>>,
    flusher: Option<Arc<GroupFlusher>>,
    background: Mutex<Vec<JoinHandle<()>>>,
    /// Failures to write, and conversations found unreadable (`health.rs`).
    health: health::Health,
    /// Lookups in `cache`, and those that missed (for metrics).
    cache_lookups: AtomicU64,
    cache_misses: AtomicU64,
    /// Messages on the main lines of the conversations stored: counted at open (`health.rs`),
    /// then kept by each write and delete. What sled's own memory grows with
    /// (`memory_budget.rs`); not counted for a shared engine, whose memory is elsewhere.
    stored_messages: AtomicU64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("engine", &self.engine.name())
            .finish_non_exhaustive()
    }
}

/// Locks a conversation; a poisoned lock (a panic while held) still yields the data, which is
/// only ever changed after its commit succeeded.
pub fn lock(handle: &Handle) -> MutexGuard<'_, Conversation> {
    handle
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Store {
    /// Opens (or creates) the sled store under `dir` (`dir/store`): [`Store::open_embedded`]
    /// with sled, the default.
    pub fn open(dir: &Path, options: StoreOptions) -> Result<Store, StoreError> {
        Store::open_embedded(dir, Embedded::Sled, options)
    }

    /// Opens (or creates) the store of the embedded `engine` under `dir` (in its folder, with
    /// `options.page_cache_bytes` as its cache), unless `dir` holds the other engine's store.
    /// Must be called inside a tokio runtime: the group flusher runs as a task.
    pub fn open_embedded(
        dir: &Path,
        engine: Embedded,
        options: StoreOptions,
    ) -> Result<Store, StoreError> {
        refuse_other_engine(dir, engine)?;
        let opened = engine.open_engine(
            dir,
            options.page_cache_bytes,
            options.durability.engine_flush_every(),
        )?;
        Store::with_engine(Backing::Own(opened), dir, options)
    }

    /// The store over a Redis server shared with other replicas (`redis_engine.rs`). Opens
    /// even when Redis is down: memory is then off until it answers (`health.rs`). Must be
    /// called inside a tokio runtime.
    pub fn open_redis(
        redis: &RedisOptions,
        data_dir: &Path,
        options: StoreOptions,
    ) -> Result<Store, StoreError> {
        let engine = RedisEngine::open(redis)?;
        Store::with_engine(Backing::Shared(Arc::new(engine)), data_dir, options)
    }

    /// A store over `engine`, with workspace folders and conversation keys under `data_dir`.
    /// Every conversation record is read here once, before any write (`health.rs`): a record
    /// that cannot be read fails the open; keys of conversations the engine no longer holds
    /// are removed. Must be called inside a tokio runtime.
    pub fn with_engine(
        backing: Backing,
        data_dir: &Path,
        options: StoreOptions,
    ) -> Result<Store, StoreError> {
        let (engine, shared): (Arc<dyn Engine>, _) = match backing {
            Backing::Own(engine) => (engine, None),
            Backing::Shared(shared) => (shared.clone(), Some(shared)),
        };
        let keys = match &shared {
            Some(shared) => Keys::Engine(EngineKeys::new(Arc::clone(shared))),
            None => Keys::Files(KeyFiles::open(data_dir.join("keys"))?),
        };
        let mut background = Vec::new();
        let flusher = match options.durability {
            // A shared engine's writes are durable when acknowledged: nothing to group.
            Durability::Commit if shared.is_none() => {
                let (flusher, task) = GroupFlusher::start(Arc::clone(&engine));
                background.push(task);
                Some(flusher)
            }
            Durability::Commit | Durability::Interval(_) => None,
        };
        let cache = Arc::new(Cache::new(
            "state",
            options.state_cache_bytes,
            Policy::TinyLfu,
            |key: &ConversationKey, handle: &Handle| {
                // `try_lock`: the weigher may run while the caller holds the lock (the weight
                // is refreshed by `touch` after each commit).
                let state = handle.try_lock().map_or(0, |c| c.weigh());
                let bytes = heap::CACHE_ENTRY
                    + key.heap_bytes()
                    + heap::arc::<Mutex<Conversation>>()
                    + state;
                u32::try_from(bytes).unwrap_or(u32::MAX)
            },
        ));
        let store = Store {
            engine,
            clock: Arc::default(),
            shared,
            data_dir: data_dir.to_path_buf(),
            keys,
            cache,
            flusher,
            background: Mutex::new(background),
            health: health::Health::default(),
            cache_lookups: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            stored_messages: AtomicU64::new(0),
        };
        store.check_on_open()?;
        Ok(store)
    }

    /// The conversation's handle, loading its index from the engine on a cache miss.
    pub fn conversation(&self, key: &ConversationKey) -> Result<Handle, StoreError> {
        self.cache_lookups.fetch_add(1, Ordering::Relaxed);
        if let Some(handle) = self.cache.get(key) {
            return Ok(handle);
        }
        self.cache_misses.fetch_add(1, Ordering::Relaxed);
        let conversation = self.load(key)?;
        let handle = Arc::new(Mutex::new(conversation));
        // Two loaders racing keep one handle: the first inserted wins.
        Ok(self.cache.get_or_insert_with(key.clone(), || handle))
    }

    /// `key`'s conversation when it is cached; never loads it. A hit counts as a lookup; a
    /// miss does not (the caller goes on to [`Store::conversation`], which counts it).
    pub fn cached(&self, key: &ConversationKey) -> Option<Handle> {
        let handle = self.cache.get(key)?;
        self.cache_lookups.fetch_add(1, Ordering::Relaxed);
        Some(handle)
    }

    fn load(&self, key: &ConversationKey) -> Result<Conversation, StoreError> {
        let loaded = self.unreachable_is_down(self.engine.load(key))?;
        Ok(Conversation::from_loaded(key.clone(), loaded))
    }

    /// Passes `result` on; a shared engine that cannot be reached turns memory off (and is
    /// retried) like a failed write, so later requests do not each wait for it to time out.
    /// The conversation `tenant` was answered the Responses API id `response_id` in.
    pub fn response_conversation(
        &self,
        tenant: &memproxy_base::identity::TenantId,
        response_id: &str,
    ) -> Result<Option<ConversationKey>, StoreError> {
        self.unreachable_is_down(self.engine.response_conversation(tenant, response_id))
    }

    /// Forgets `tenant`'s Responses API id `response_id`; true when it was known.
    pub fn forget_response(
        &self,
        tenant: &memproxy_base::identity::TenantId,
        response_id: &str,
    ) -> Result<bool, StoreError> {
        self.unreachable_is_down(self.engine.forget_response(tenant, response_id))
    }

    fn unreachable_is_down<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        match result {
            Err(err @ StoreError::Unreachable(_)) => self.watch(Err(err)),
            other => other,
        }
    }

    /// Brings a cached conversation (locked by the caller) up to the stored version: with a
    /// shared engine another replica may have written since. One round trip when nothing
    /// changed; messages only added are read alone and appended; anything else reloads it
    /// whole. With an engine no other process writes to, nothing to do.
    pub fn refresh(&self, conversation: &mut Conversation) -> Result<Refreshed, StoreError> {
        let Some(shared) = &self.shared else {
            return Ok(Refreshed::Unchanged);
        };
        let found = self.unreachable_is_down(shared.refresh(
            &conversation.key,
            &conversation.version,
            conversation.meta.as_ref(),
            conversation.entries.len(),
        ))?;
        match found {
            Refresh::Unchanged => Ok(Refreshed::Unchanged),
            Refresh::Changed => {
                self.reload(conversation)?;
                Ok(Refreshed::Reloaded)
            }
            Refresh::Appended {
                meta,
                version,
                mut added,
            } => {
                let before = conversation.meta.as_ref().map(|m| m.next_turn);
                for message in &added {
                    let cum = conversation.entries.last().map_or(0, |e| e.cum_tokens);
                    conversation.entries.push(Entry::new(message, cum));
                }
                let id = meta.id;
                conversation.meta = Some(meta);
                conversation.version = version;
                self.open_messages(&conversation.key, id, &mut added)?;
                Ok(Refreshed::Appended { before, added })
            }
        }
    }

    /// Re-reads a conversation whose commit found it stale.
    pub fn reload(&self, conversation: &mut Conversation) -> Result<(), StoreError> {
        *conversation = self.load(&conversation.key)?;
        Ok(())
    }

    /// Reads stored messages by turn, in the order asked, their bodies opened. A turn that is
    /// missing is an error: the index said it was there.
    pub fn messages(
        &self,
        conversation: &Conversation,
        turns: impl IntoIterator<Item = u64>,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        let Some(meta) = &conversation.meta else {
            return Ok(Vec::new());
        };
        let turns: Vec<u64> = turns.into_iter().collect();
        let mut found: Vec<Option<StoredMessage>> = Vec::with_capacity(turns.len());
        let mut missing = Vec::new();
        {
            let mut opened = conversation.opened_lock();
            for &turn in &turns {
                let held = conversation
                    .fingerprint(turn)
                    .and_then(|fingerprint| opened.take(meta.id, turn, fingerprint));
                if held.is_none() {
                    missing.push(turn);
                }
                found.push(held);
            }
        }
        if missing.is_empty() {
            return Ok(found.into_iter().flatten().collect());
        }
        let mut read = self.engine.messages(&conversation.key, meta.id, &missing)?;
        self.open_messages(&conversation.key, meta.id, &mut read)?;
        {
            let mut opened = conversation.opened_lock();
            for message in &read {
                if conversation.fingerprint(message.turn) == Some(message.fingerprint) {
                    opened.keep(meta.id, message);
                }
            }
        }
        let mut read = read.into_iter();
        Ok(found
            .into_iter()
            .filter_map(|held| held.or_else(|| read.next()))
            .collect())
    }

    /// Applies `change` to `conversation` atomically, assigning turn numbers to the added
    /// messages, sealing their bodies with the conversation's key (created first for a new
    /// conversation) and closing the branch it names (its messages and the summaries that reach
    /// them move off the main line in the same write). Fails with [`StoreError::Stale`] when
    /// the stored conversation is not the one `conversation` holds; the caller then reloads and
    /// plans again. On success the in-memory index is updated to match; on any failure it is
    /// left as it was.
    pub fn commit(
        &self,
        conversation: &mut Conversation,
        change: Change,
    ) -> Result<(), StoreError> {
        let committed = self.commit_change(conversation, change);
        self.watch(committed)
    }

    fn commit_change(
        &self,
        conversation: &mut Conversation,
        mut change: Change,
    ) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        let mut meta = match &conversation.meta {
            Some(meta) => meta.clone(),
            None => ConversationMeta::new(self.engine.new_id()?, now),
        };
        for message in &mut change.add {
            message.turn = meta.next_turn;
            meta.next_turn += 1;
        }
        let closing = match change.branch_from_turn {
            Some(from_turn) => Some(self.closing(conversation, &meta, from_turn, now)?),
            None => None,
        }
        .filter(|closing| !closing.turns.is_empty());
        let mut remove_turns = change.remove_turns;
        let mut remove_summaries: Vec<u64> = Vec::new();
        let mut branches: Vec<StoredBranch> = Vec::new();
        if let Some(closing) = closing {
            remove_turns.extend(&closing.turns);
            remove_turns.sort_unstable();
            remove_turns.dedup();
            remove_summaries = closing.summaries;
            meta.branches = closing.branch.record.number;
            branches.push(closing.branch);
        }
        let mut removed: Vec<usize> = remove_turns
            .iter()
            .filter_map(|turn| conversation.position(*turn))
            .collect();
        let removed_tokens: u64 = removed
            .iter()
            .map(|&i| u64::from(conversation.entries[i].tokens))
            .sum();
        let added_tokens: u64 = change.add.iter().map(|m| u64::from(m.tokens)).sum();
        meta.message_count = (conversation.entries.len() - removed.len() + change.add.len()) as u64;
        removed.sort_unstable();
        meta.first_turn = first_kept(&conversation.entries, &removed)
            .or(change.add.first().map(|m| m.turn))
            .unwrap_or(meta.next_turn);
        meta.total_tokens = meta.total_tokens - removed_tokens + added_tokens;
        meta.last_activity_ms = now;
        meta.tokens_forwarded += change.tokens_forwarded;
        meta.ledger.add(&change.ledger);
        if change.ledger.exchanges > 0
            && let Some(reply) = change.add.last_mut()
        {
            reply.exchange = Some(ExchangeFigures::new(
                change.tokens_forwarded,
                change.ledger.history_tokens,
                change.ledger.cached_tokens,
            ));
        }
        // A record written before keeps its newest exchanges' figures in itself; they go now.
        meta.recent = Vec::new();

        let response_ids = response_ids_of(&change.add);
        // The added bodies as they are before sealing: kept opened once the write succeeds, so
        // the next plan's window reads them without the engine, a decode and a decryption.
        let plain: Vec<StoredMessage> = {
            let opened = conversation.opened_lock();
            change
                .add
                .iter()
                .filter(|message| opened.light_enough(message))
                .cloned()
                .collect()
        };
        let mut created_key = false;
        let mut vectors: Vec<(u64, Vec<u8>)> = Vec::new();
        if !change.add.is_empty() {
            let (key, created) = self.sealing_key(&conversation.key, meta.id)?;
            created_key = created;
            if let Some(added) = change.vectors.take() {
                vectors = vectors::seal_added(&key, &added, &change.add)?;
            }
            seal::seal_messages(&key, &mut change.add)?;
        }
        let version = self.write_sealed(
            conversation,
            Write {
                meta: &meta,
                remove_turns: &remove_turns,
                add: &change.add,
                vectors: &vectors,
                summaries: &[],
                remove_summaries: &remove_summaries,
                branches: &branches,
                response_ids: &response_ids,
            },
            (created_key && conversation.meta.is_none()).then_some(meta.id),
        )?;

        // A run of entries (a trim's, a replaced reply's) goes in one move: each `remove` at
        // the front would move every entry after it.
        match (removed.first(), removed.last()) {
            (Some(&first), Some(&last)) if last - first + 1 == removed.len() => {
                conversation.entries.drain(first..=last);
            }
            _ => {
                for i in removed.into_iter().rev() {
                    conversation.entries.remove(i);
                }
            }
        }
        for message in &change.add {
            let before = conversation.entries.last().map_or(0, |e| e.cum_tokens);
            conversation.entries.push(Entry::new(message, before));
        }
        {
            let mut opened = conversation.opened_lock();
            for message in plain {
                opened.keep_owned(meta.id, message);
            }
        }
        conversation.meta = Some(meta);
        conversation.version = version;
        Ok(())
    }

    /// After a commit through `handle`: refreshes the cache's weight of the conversation when
    /// the cache still holds that handle. After a delete or an eviction the cache may hold a
    /// newer handle, loaded before this commit and so missing it: that one is dropped, and the
    /// next request reads the conversation again (an old handle never replaces a newer one).
    pub fn touch(&self, key: &ConversationKey, handle: &Handle) {
        match self.cache.get_held(key) {
            Some(current) if Arc::ptr_eq(current.value(), handle) => {
                self.cache.reweigh(key.clone(), current);
            }
            Some(_) => self.cache.invalidate(key),
            None => {}
        }
    }

    /// Waits until earlier commits are durable (group commit). With interval durability this
    /// returns at once: the background flush covers it.
    pub async fn sync(&self) -> Result<(), StoreError> {
        match &self.flusher {
            Some(flusher) => {
                let synced = flusher.sync().await.map_err(StoreError::from);
                self.watch(synced)
            }
            None => Ok(()),
        }
    }

    /// The one clock: what every timestamp the store writes reads, and the memory core with it.
    pub fn clock(&self) -> &Arc<Clock> {
        &self.clock
    }

    /// True when other replicas share this store (Redis).
    pub fn shared(&self) -> bool {
        self.shared.is_some()
    }

    /// Takes the summary lease of conversation `id` for `holder` (always granted when the
    /// store is this process's alone); see [`SharedEngine::take_lease`].
    pub fn take_summary_lease(
        &self,
        key: &ConversationKey,
        id: u64,
        holder: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        match &self.shared {
            Some(shared) => self.unreachable_is_down(shared.take_lease(key, id, holder, ttl)),
            None => Ok(true),
        }
    }

    /// Gives a summary lease back.
    pub fn release_summary_lease(
        &self,
        key: &ConversationKey,
        holder: &str,
    ) -> Result<(), StoreError> {
        match &self.shared {
            Some(shared) => shared.release_lease(key, holder),
            None => Ok(()),
        }
    }

    /// True when the store answers a read.
    pub fn is_ready(&self) -> bool {
        self.engine.is_ready()
    }

    /// The engine's name (`sled`).
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// Flushes everything and stops the background flushing: the last step of shutdown. The
    /// background tasks are awaited, so once this returns they hold no handle on the engine.
    pub async fn close(&self) -> Result<(), StoreError> {
        let tasks = std::mem::take(
            &mut *self
                .background
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        for task in tasks {
            task.abort();
            let _ = task.await;
        }
        self.cache.invalidate_all();
        self.engine.flush()
    }

    /// The data directory the store's files live in.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Bytes the store takes on disk.
    pub fn size_on_disk(&self) -> u64 {
        self.engine.size_bytes()
    }

    /// Group flushes started (0 with a shared engine or interval durability: no flush waits).
    pub fn flushes(&self) -> u64 {
        self.flusher.as_ref().map_or(0, |f| f.flushes())
    }

    /// Messages on the main lines of the conversations stored (0 with a shared engine).
    pub fn stored_messages(&self) -> u64 {
        self.stored_messages.load(Ordering::Relaxed)
    }

    /// Counts a write that took the conversation from `before` messages to `after`, or a
    /// delete (`after` 0).
    fn count_messages(&self, before: u64, after: u64) {
        if self.shared() {
            // Other replicas write too: a count of this one's writes would mean nothing.
            return;
        }
        if after >= before {
            self.stored_messages
                .fetch_add(after - before, Ordering::Relaxed);
        } else {
            let gone = before - after;
            let _ = self
                .stored_messages
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(gone))
                });
        }
    }
}

/// The bytes of the files under `dir`, its sub-folders included (0 for what cannot be read):
/// a store's size on disk without opening it (a running memproxy holds sled's lock).
pub fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|entry| match entry.metadata() {
            Ok(meta) if meta.is_dir() => dir_bytes(&entry.path()),
            Ok(meta) => meta.len(),
            Err(_) => 0,
        })
        .sum()
}

/// The folder for a conversation's files: `{data_dir}/workspaces/{tenant}/{agent}/{conversation}`,
/// each name reduced to `[A-Za-z0-9_-]` (at most 40 characters) and followed by 128 bits of a
/// SHA-256 of the full id, so the path stays inside the data directory whatever the id (`..`,
/// `/etc`, a very long id) and two ids never share a folder.
pub fn workspace_dir(data_dir: &Path, key: &ConversationKey) -> PathBuf {
    workspace_path(data_dir, key, 40, 16)
}

/// The folder earlier versions used (64 characters and a 32-bit hash, which two ids could
/// share): only removed, never written.
pub fn legacy_workspace_dir(data_dir: &Path, key: &ConversationKey) -> PathBuf {
    workspace_path(data_dir, key, 64, 4)
}

fn workspace_path(data_dir: &Path, key: &ConversationKey, chars: usize, hash: usize) -> PathBuf {
    data_dir
        .join("workspaces")
        .join(safe_name(key.tenant.as_str(), chars, hash))
        .join(safe_name(&key.agent, chars, hash))
        .join(safe_name(&key.conversation, chars, hash))
}

fn safe_name(id: &str, chars: usize, hash_bytes: usize) -> String {
    use sha2::{Digest, Sha256};
    let mut name: String = id
        .chars()
        .take(chars)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let digest = Sha256::digest(id.as_bytes());
    name.push('-');
    for b in &digest[..hash_bytes] {
        name.push_str(&format!("{b:02x}"));
    }
    name
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use memproxy_base::identity::TenantId;
    use memproxy_base::message::Role;
    use serde_json::value::RawValue;

    /// The module documentation names every file of the store (a file added without its line
    /// there fails here, so the list cannot go stale).
    #[test]
    fn the_module_documentation_names_every_file() {
        let doc: String = include_str!("lib.rs")
            .lines()
            .take_while(|l| l.starts_with("//!"))
            .collect::<Vec<_>>()
            .join("\n");
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        for file in std::fs::read_dir(dir).unwrap() {
            let name = file.unwrap().file_name().to_string_lossy().into_owned();
            if name.ends_with(".rs") && name != "lib.rs" {
                assert!(
                    doc.contains(&format!("`{name}`")),
                    "the store crate's lib.rs does not name {name}"
                );
            }
        }
    }

    proptest::proptest! {
        /// Whatever gaps the turns have, a turn's position is the binary search's.
        #[test]
        fn a_turns_position_is_the_binary_searchs(
            first in 0u64..4,
            steps in proptest::collection::vec(1u64..4, 0..40),
        ) {
            let mut turns = vec![first];
            for step in steps {
                turns.push(turns.last().unwrap() + step);
            }
            let entries: Vec<Entry> = turns
                .iter()
                .map(|&turn| {
                    let mut m = message(Role::User, "x");
                    m.turn = turn;
                    Entry::new(&m, 0)
                })
                .collect();
            let conversation = Conversation::from_loaded(
                key("c"),
                Loaded { entries, ..Loaded::default() },
            );
            for turn in 0..turns.last().unwrap() + 3 {
                proptest::prop_assert_eq!(
                    conversation.position(turn),
                    turns.binary_search(&turn).ok(),
                    "turn {}", turn
                );
            }
            let empty = Conversation::from_loaded(key("c"), Loaded::default());
            proptest::prop_assert_eq!(empty.position(first), None);
        }
    }

    /// A conversation of tenant `t`, agent `default` (also for the other store tests).
    pub(crate) fn key(conversation: &str) -> ConversationKey {
        ConversationKey {
            tenant: TenantId::from_token(Some("t")),
            agent: "default".into(),
            conversation: conversation.into(),
        }
    }

    pub(crate) fn message(role: Role, text: &str) -> StoredMessage {
        StoredMessage {
            turn: 0,
            role,
            origin: Origin::Client,
            at_ms: Clock::default().now_ms(),
            tokens: 3,
            fingerprint: text.len() as u64,
            message: RawValue::from_string(
                serde_json::json!({"role": role.as_str(), "content": text}).to_string(),
            )
            .unwrap(),
            exchange: None,
        }
    }

    pub(crate) fn options() -> StoreOptions {
        StoreOptions {
            durability: Durability::Commit,
            page_cache_bytes: 1 << 20,
            state_cache_bytes: 1 << 20,
        }
    }

    fn open(dir: &Path) -> Store {
        Store::open(dir, options()).unwrap()
    }

    #[test]
    fn neither_embedded_engine_opens_beside_the_others_store() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("fjall")).unwrap();
        let refused = Store::open(dir.path(), options()).unwrap_err().to_string();
        assert!(refused.contains("holds a fjall store"), "{refused}");
        assert!(refused.contains("storage.backend = \"fjall\""), "{refused}");
        assert!(
            !refused.contains("repair"),
            "no way back from fjall: {refused}"
        );
        assert!(
            !dir.path().join("store").exists(),
            "nothing written beside it"
        );

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("store")).unwrap();
        let refused = Store::open_embedded(dir.path(), Embedded::Fjall, options())
            .unwrap_err()
            .to_string();
        assert!(refused.contains("holds a sled store"), "{refused}");
        assert!(refused.contains("--engine fjall"), "{refused}");
        assert!(
            !dir.path().join("fjall").exists(),
            "nothing written beside it"
        );
    }

    #[tokio::test]
    async fn commits_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path());
            {
                let handle = store.conversation(&key("c")).unwrap();
                let mut conv = lock(&handle);
                let change = Change {
                    tokens_forwarded: 0,
                    ledger: LedgerTotals::default(),
                    branch_from_turn: None,
                    vectors: None,
                    remove_turns: vec![],
                    add: vec![message(Role::User, "a"), message(Role::Assistant, "bb")],
                };
                store.commit(&mut conv, change).unwrap();
                assert_eq!(conv.entries.len(), 2);
            }
            store.sync().await.unwrap();
            store.close().await.unwrap();
        }
        let store = open(dir.path());
        let handle = store.conversation(&key("c")).unwrap();
        let conv = lock(&handle);
        assert_eq!(
            conv.entries.iter().map(|e| e.turn).collect::<Vec<_>>(),
            [1, 2]
        );
        assert_eq!(conv.meta.as_ref().unwrap().total_tokens, 6);
        let loaded = store.messages(&conv, [2]).unwrap();
        assert!(loaded[0].message.get().contains("bb"));
        assert!(
            lock(&store.conversation(&key("other")).unwrap())
                .entries
                .is_empty()
        );
    }

    #[tokio::test]
    async fn the_record_names_its_first_turn_through_trims_replies_replaced_and_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let exchange = |remove_turns: Vec<u64>| Change {
            tokens_forwarded: 0,
            ledger: LedgerTotals::default(),
            branch_from_turn: None,
            vectors: None,
            remove_turns,
            add: vec![message(Role::User, "q"), message(Role::Assistant, "a")],
        };
        let first_and_turns = |conv: &Conversation| {
            let turns: Vec<u64> = conv.entries.iter().map(|e| e.turn).collect();
            (conv.meta.as_ref().unwrap().first_turn, turns)
        };
        {
            let store = open(dir.path());
            let handle = store.conversation(&key("c")).unwrap();
            {
                let mut conv = lock(&handle);
                store.commit(&mut conv, exchange(vec![])).unwrap();
                assert_eq!(first_and_turns(&conv), (1, vec![1, 2]));
                store.commit(&mut conv, exchange(vec![])).unwrap();
                // The oldest round trimmed as the next is added.
                store.commit(&mut conv, exchange(vec![1, 2])).unwrap();
                assert_eq!(first_and_turns(&conv), (3, vec![3, 4, 5, 6]));
                // The last reply replaced: the first turn stays.
                store.commit(&mut conv, exchange(vec![6])).unwrap();
                assert_eq!(first_and_turns(&conv), (3, vec![3, 4, 5, 7, 8]));
                // Everything removed but the new exchange.
                store
                    .commit(&mut conv, exchange(vec![3, 4, 5, 7, 8]))
                    .unwrap();
                assert_eq!(first_and_turns(&conv), (9, vec![9, 10]));
            }
            store.sync().await.unwrap();
            store.close().await.unwrap();
        }
        let store = open(dir.path());
        let handle = store.conversation(&key("c")).unwrap();
        let conv = lock(&handle);
        assert_eq!(first_and_turns(&conv), (9, vec![9, 10]));
        let meta = conv.meta.clone().unwrap();
        let all = store.all_messages(&key("c"), &meta).unwrap();
        assert_eq!(all.iter().map(|m| m.turn).collect::<Vec<_>>(), [9, 10]);
    }

    #[tokio::test]
    async fn the_record_stays_small_however_many_exchanges_each_reply_keeping_its_own_figures() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path());
            let handle = store.conversation(&key("c")).unwrap();
            let mut record_sizes = Vec::new();
            for i in 1..=150u64 {
                let mut conv = lock(&handle);
                let change = Change {
                    tokens_forwarded: i,
                    ledger: LedgerTotals {
                        exchanges: 1,
                        history_tokens: 10 * i,
                        cached_tokens: i % 3,
                        background_tokens: 0,
                    },
                    branch_from_turn: None,
                    remove_turns: vec![],
                    add: vec![message(Role::User, "q"), message(Role::Assistant, "a")],
                    vectors: None,
                };
                store.commit(&mut conv, change).unwrap();
                record_sizes.push(conv.version.token().unwrap().len());
            }
            // The record is rewritten with every exchange: its size does not grow with their
            // number (only with the digits of its totals).
            assert!(
                record_sizes[149] <= record_sizes[0] + 24,
                "{} then {}",
                record_sizes[0],
                record_sizes[149]
            );
            store.sync().await.unwrap();
            store.close().await.unwrap();
        }
        let store = open(dir.path());
        let meta = store.meta(&key("c")).unwrap().unwrap();
        assert!(meta.recent.is_empty());
        assert_eq!(meta.ledger.exchanges, 150);
        let messages = store.all_messages(&key("c"), &meta).unwrap();
        let points = ExchangePoint::newest(&meta.recent, &messages);
        assert_eq!(points.len(), records::RECENT_EXCHANGES);
        // The newest hundred, oldest first, each on its reply's turn with its own figures.
        for (point, i) in points.iter().zip(51..=150u64) {
            assert_eq!(point.turn, 2 * i);
            assert_eq!(point.forwarded_tokens, i);
            assert_eq!(point.history_tokens, 10 * i);
            assert_eq!(point.cached_tokens, i % 3);
        }
        // Only the reply that ends an exchange carries figures.
        assert!(
            messages
                .iter()
                .all(|m| m.exchange.is_some() == (m.turn % 2 == 0))
        );
    }

    #[tokio::test]
    async fn stored_messages_are_counted_at_open_and_by_each_write_and_delete() {
        let exchange = |store: &Store, name: &str, remove_turns: Vec<u64>| {
            let handle = store.conversation(&key(name)).unwrap();
            let mut conv = lock(&handle);
            let change = Change {
                remove_turns,
                add: vec![message(Role::User, "q"), message(Role::Assistant, "a")],
                ..Change::default()
            };
            store.commit(&mut conv, change).unwrap();
        };
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path());
            assert_eq!(store.stored_messages(), 0);
            for _ in 0..3 {
                exchange(&store, "a", vec![]);
            }
            exchange(&store, "b", vec![]);
            assert_eq!(store.stored_messages(), 8);
            // A write that removes turns (a trim, a replaced reply) counts them out.
            exchange(&store, "a", vec![1, 2, 3]);
            assert_eq!(store.stored_messages(), 7);
            store.sync().await.unwrap();
            store.close().await.unwrap();
        }
        let store = open(dir.path());
        assert_eq!(store.stored_messages(), 7);
        store.delete_conversation(&key("a")).unwrap().unwrap();
        assert_eq!(store.stored_messages(), 2);
        // A conversation started again under the same key counts from nothing.
        exchange(&store, "a", vec![]);
        assert_eq!(store.stored_messages(), 4);
    }

    #[tokio::test]
    async fn opened_bodies_are_served_again_only_for_the_message_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let handle = store.conversation(&key("c")).unwrap();
        let mut conv = lock(&handle);
        let change = Change {
            add: vec![
                message(Role::User, "one"),
                message(Role::Assistant, "two two"),
                message(Role::User, "three three three"),
            ],
            ..Change::default()
        };
        store.commit(&mut conv, change).unwrap();
        // Weighed again after the commit, as the pipeline does: the allowance follows.
        drop(conv);
        store.touch(&key("c"), &handle);
        let mut conv = lock(&handle);
        assert!(conv.opened_lock().allowance > 0);
        let text = |m: &StoredMessage| m.message.get().to_string();
        let first: Vec<String> = store
            .messages(&conv, [3, 1])
            .unwrap()
            .iter()
            .map(text)
            .collect();
        assert!(first[0].contains("three") && first[1].contains("one"));
        assert_eq!(conv.opened_lock().messages.len(), 2);

        // Held: a second read takes turn 1 from what was opened (marked here), and turn 2,
        // never read, from the engine, in the order asked.
        let marked = RawValue::from_string(r#"{"role":"user","content":"held"}"#.into()).unwrap();
        for h in conv
            .opened_lock()
            .messages
            .iter_mut()
            .filter(|h| h.message.turn == 1)
        {
            h.message.message = marked.clone();
        }
        let again: Vec<String> = store
            .messages(&conv, [2, 1])
            .unwrap()
            .iter()
            .map(text)
            .collect();
        assert!(again[0].contains("two two"), "{again:?}");
        assert!(again[1].contains("held"), "{again:?}");

        // An entry whose fingerprint is not the held body's: read from the engine again.
        let i = conv.entries.iter().position(|e| e.turn == 1).unwrap();
        conv.entries[i].fingerprint += 1;
        let fresh = store.messages(&conv, [1]).unwrap();
        assert!(text(&fresh[0]).contains("one"), "{fresh:?}");
        conv.entries[i].fingerprint -= 1;

        // Another conversation id: nothing held is used.
        let mut opened = Opened::default();
        opened.grant(Opened::MAX_ALLOWANCE);
        opened.keep(7, &fresh[0]);
        assert!(opened.take(8, 1, fresh[0].fingerprint).is_none());
        assert!(opened.take(7, 1, fresh[0].fingerprint).is_some());
    }

    #[tokio::test]
    async fn a_commit_keeps_what_it_added_opened_as_the_engine_gives_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let handle = store.conversation(&key("c")).unwrap();
        let first = Change {
            add: vec![message(Role::User, "one"), message(Role::Assistant, "two")],
            ..Change::default()
        };
        store.commit(&mut lock(&handle), first).unwrap();
        // Not weighed yet: no allowance, nothing held.
        assert!(lock(&handle).opened_lock().messages.is_empty());
        store.touch(&key("c"), &handle);
        let mut second = Change {
            add: vec![
                message(Role::User, &"z".repeat(Opened::MAX_ALLOWANCE)),
                message(Role::User, "three"),
                message(Role::Assistant, "four"),
            ],
            ..Change::default()
        };
        second.ledger.exchanges = 1;
        second.tokens_forwarded = 9;
        store.commit(&mut lock(&handle), second).unwrap();
        let held: Vec<StoredMessage> = lock(&handle)
            .opened_lock()
            .messages
            .iter()
            .map(|h| h.message.clone())
            .collect();
        // The two light ones, with their turns (the reply with its exchange's figures); the
        // heavy one is not held.
        assert_eq!(held.iter().map(|m| m.turn).collect::<Vec<_>>(), [4, 5]);
        assert!(held[1].exchange.is_some());
        drop(handle);
        store.close().await.unwrap();
        drop(store);
        // What the engine gives back for those turns, read by a store opened afresh.
        let store = open(dir.path());
        let handle = store.conversation(&key("c")).unwrap();
        let conv = lock(&handle);
        let read = store.messages(&conv, [4, 5]).unwrap();
        let json = |m: &StoredMessage| serde_json::to_string(m).unwrap();
        assert_eq!(
            held.iter().map(json).collect::<Vec<_>>(),
            read.iter().map(json).collect::<Vec<_>>()
        );
    }

    #[test]
    fn opened_bodies_stay_within_their_allowance_least_recently_used_out() {
        let mut opened = Opened::default();
        opened.grant(Opened::MAX_ALLOWANCE);
        let body = "x".repeat(600);
        for turn in 1..=100u64 {
            let mut m = message(Role::User, &body);
            m.turn = turn;
            opened.keep(1, &m);
            // Turn 1 is used after each keep: it stays.
            assert!(opened.take(1, 1, m.fingerprint).is_some(), "turn {turn}");
            assert!(
                opened.bytes <= Opened::MAX_ALLOWANCE,
                "{} bytes",
                opened.bytes
            );
        }
        let held: Vec<u64> = opened.messages.iter().map(|h| h.message.turn).collect();
        assert!(
            held.contains(&100) && held.contains(&1) && !held.contains(&2),
            "{held:?}"
        );
        assert_eq!(
            opened.bytes,
            opened
                .messages
                .iter()
                .map(|h| Opened::weight(&h.message))
                .sum::<usize>()
        );
        // A body over a quarter of the allowance is not kept.
        let mut big = message(Role::User, &"y".repeat(Opened::MAX_ALLOWANCE));
        big.turn = 200;
        opened.keep(1, &big);
        assert!(opened.take(1, 200, big.fingerprint).is_none());
        // A smaller grant lets the least recently used go at once.
        opened.grant(2_000);
        assert!(opened.bytes <= 2_000 && !opened.messages.is_empty());
        assert_eq!(opened.turns_by_use().last(), Some(&1));
    }

    #[test]
    fn workspace_paths_stay_inside_the_data_directory() {
        let data = Path::new("/data");
        for hostile in [
            "..",
            "../../etc",
            "/etc/passwd",
            "a/b",
            "C:\\x",
            "",
            &"x".repeat(5000),
            "ok-id",
        ] {
            let key = ConversationKey {
                tenant: TenantId::from_token(Some("t")),
                agent: "..".into(),
                conversation: hostile.to_string(),
            };
            let dir = workspace_dir(data, &key);
            assert!(dir.starts_with("/data/workspaces"), "{dir:?}");
            for part in dir.strip_prefix(data).unwrap().components() {
                let part = part.as_os_str().to_str().unwrap();
                assert!(
                    part != ".." && part != "." && !part.contains('/') && part.len() <= 73,
                    "{part}"
                );
            }
        }
        let a = workspace_dir(data, &key("a:b"));
        let b = workspace_dir(data, &key("a@b"));
        assert_ne!(
            a, b,
            "ids that reduce to the same name still get their own folder"
        );
        // The hash that tells them apart is 128 bits, not the 32 of earlier versions.
        let name = a.file_name().unwrap().to_str().unwrap();
        assert_eq!(name.len(), "a_b-".len() + 32, "{name}");
        assert_ne!(a, legacy_workspace_dir(data, &key("a:b")));
    }

    #[tokio::test]
    async fn a_stale_commit_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path());
        let mut first = store.load(&key("c")).unwrap();
        let mut second = store.load(&key("c")).unwrap();
        store
            .commit(
                &mut first,
                Change {
                    remove_turns: vec![],
                    add: vec![message(Role::User, "a")],
                    tokens_forwarded: 0,
                    ledger: LedgerTotals::default(),
                    branch_from_turn: None,
                    vectors: None,
                },
            )
            .unwrap();
        let err = store
            .commit(
                &mut second,
                Change {
                    remove_turns: vec![],
                    add: vec![message(Role::User, "b")],
                    tokens_forwarded: 0,
                    ledger: LedgerTotals::default(),
                    branch_from_turn: None,
                    vectors: None,
                },
            )
            .unwrap_err();
        assert!(matches!(err, StoreError::Stale));
        assert!(second.entries.is_empty());
        store.reload(&mut second).unwrap();
        assert_eq!(second.entries.len(), 1);
        store
            .commit(
                &mut second,
                Change {
                    remove_turns: vec![1],
                    add: vec![message(Role::User, "b")],
                    tokens_forwarded: 0,
                    ledger: LedgerTotals::default(),
                    branch_from_turn: None,
                    vectors: None,
                },
            )
            .unwrap();
        assert_eq!(
            second.entries.iter().map(|e| e.turn).collect::<Vec<_>>(),
            [2]
        );
        let meta = second.meta.clone().unwrap();
        assert_eq!(store.all_messages(&second.key, &meta).unwrap().len(), 1);
    }
}
