//! The storage contract: what the memory core needs of a storage engine, named from the
//! caller's side, one trait per capability: [`Engine`] the conversations, [`Owners`] the
//! owners' records every engine also keeps, [`Vectors`] the vectors of both, and
//! [`SharedEngine`] what only an engine other replicas write to has (a version check of a
//! cached conversation, the conversations' keys, summary leases). sled (embedded, the default)
//! implements the first three in `sled_engine.rs` (vectors in `sled_vectors.rs`); Redis, for
//! several replicas, all four (vectors in `redis_vectors.rs`), and runs the same contract
//! tests (`contract.rs`, one line per engine).
//!
//! # The contract
//!
//! - **Conversations** are addressed by [`ConversationKey`] (tenant, agent, conversation). A
//!   conversation's record ([`ConversationMeta`]) carries an `id` that names this life of the
//!   conversation: ids come from [`Engine::new_id`], are never reused, and a conversation
//!   deleted and started again gets a new one. Its messages are numbered by `turn`, which only
//!   grows.
//! - **Versions.** [`Engine::load`] returns the conversation as stored and its [`Version`].
//!   [`Engine::write`] applies one [`Write`] (the new record, turns removed, messages added,
//!   summaries added and removed, closed branches added) atomically, and only if the stored
//!   version is still the one given:
//!   otherwise it fails with [`StoreError::Stale`] and changes nothing. Readers never see half a
//!   write. A write against [`Version::absent`] creates the conversation, and fails as stale if
//!   it exists by then.
//! - **Ordered reads.** [`Engine::messages`] reads the turns asked for, in the order asked; a
//!   missing turn is [`StoreError::Corrupt`] (the caller's index said it was there).
//!   [`Engine::range`] reads every stored turn in `from..=to`, in turn order.
//! - **Closed branches** are numbered records per conversation id, each holding the messages
//!   (and summary records) that left the main line when a client's history diverged from it.
//!   A write closes a branch by removing those turns and summaries from the main line and
//!   adding the branch, in the same atomic step. Branch messages are never part of
//!   [`Engine::load`], [`Engine::messages`] or [`Engine::range`]; [`Engine::branches`] reads
//!   them.
//! - **Summaries** are numbered records (opaque bytes) per conversation id. [`Engine::put_summary`]
//!   writes one only if the conversation still has that id, checked atomically with the write,
//!   so a summary finishing after a delete leaves nothing behind.
//! - **TTL records** are one per conversation key, written without a version (last writer
//!   wins); [`Engine::drop_orphan_ttl`] removes one only if its conversation does not exist,
//!   checked atomically.
//! - **Listing** walks conversations in key order ([`ConversationKey::to_bytes`]), filtered by
//!   tenant and agent, a bounded page at a time. A cursor is the key bytes of the last
//!   conversation a page looked at; a page may end early (few matches among many keys) and
//!   then returns a cursor all the same.
//! - **Delete** removes a conversation's record, messages, summaries, closed branches, vectors
//!   and TTL record in one atomic step; with `idle_before_ms` only if its last activity is older
//!   (checked in the same step). Nothing of it is readable afterwards through any method.
//! - **Durability**: a write is visible to every later read at once; [`Engine::flush`] returns
//!   once every write acknowledged before it was called survives a crash of this process.
//! - **Failures to write.** A write or flush that fails on the disk (full, or an I/O error)
//!   returns [`StoreError::Disk`]; an engine may then refuse every later write until
//!   [`Engine::reopen`] (sled does). After a reopen, reads see every write a successful flush
//!   covered and none that no flush did, each exchange whole or not at all.
//! - **Response ids** (the Responses API's, resolved at the edge by `memproxy::proxy::responses`): a write may name the ids
//!   of the replies it adds; each is then found by [`Engine::response_conversation`] for the
//!   conversation's tenant (never another's), as long as the conversation lives with that id.
//!   Delete removes them with the conversation; [`Engine::forget_response`] removes one.
//! - **Owners' records** (long-term memory, `memproxy_core::longterm`) are kept per [`OwnerKey`] (a
//!   user, an agent or a tenant): an owner's record ([`OwnerMeta`], created once by
//!   [`Owners::create_owner`] with an id from [`Engine::new_id`]) and its records, each in a
//!   numbered space under an id. [`Owners::write_owner`] puts and removes records atomically, and
//!   only while the owner still has the id given (a writer that read the owner before a delete
//!   writes nothing). [`Owners::owner_records`] pages one space in id order;
//!   [`Owners::delete_owner`] removes the record and every record of the owner in one step;
//!   [`Owners::owners`] pages owners in key order ([`OwnerKey::to_bytes`]).
//! - **Vectors** (recall by meaning, `vectors.rs`): one opaque value per stored message of
//!   the main line, by conversation id and turn ([`Vectors::put_vectors`]), and one per owner's
//!   record, by space and id ([`Vectors::put_owner_vectors`]). A put writes only the values
//!   whose message (record) is stored when it runs, and only while the conversation (owner)
//!   still has the id given, checked atomically with the write; it replaces the value a turn
//!   (record) had. Vectors are not part of a conversation's [`Version`]: a put never makes a
//!   commit stale. They go with what they describe, in the same atomic step: a write's removed
//!   turns (trims, a replaced reply, a closed branch) and a turn written again lose theirs, a
//!   delete removes all of the conversation's (an idle delete, the TTL sweeper's, too; an
//!   engine that expires keys by itself expires them with the conversation's), a record
//!   removed by [`Owners::write_owner`] loses its own and [`Owners::delete_owner`] removes all
//!   of the owner's. [`Vectors::vectors`] and [`Vectors::owner_vectors`] read a
//!   conversation's (an owner's space's) in one step, by turn (id); [`Vectors::vector_count`]
//!   counts every vector the engine holds (tests, audits). Keys carry the conversation id and
//!   turn, or the owner's key and the record's id, as their other records do, nothing more.
//! - Every method may block (disk or network I/O): callers on an async runtime run them
//!   where blocking is allowed.
//!
//! Message bodies ([`StoredMessage::message`]), summary records and vectors reach an engine
//! sealed by the store (`seal.rs`): an engine stores them as given and never reads inside them.

use memproxy_base::identity::{ConversationKey, TenantId};

use super::StoreError;
use super::records::{
    ConversationMeta, Deleted, Entry, OwnerKey, OwnerMeta, OwnerRecord, StoredBranch,
    StoredMessage, TtlRecord,
};

/// A conversation's version as an engine last read it: a write is checked against it. Opaque
/// to callers; two versions are equal only when nothing was written in between.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Version(Option<Vec<u8>>);

impl Version {
    /// The heap its token holds.
    pub fn heap_bytes(&self) -> usize {
        self.0
            .as_ref()
            .map_or(0, |v| memproxy_base::heap::vec::<u8>(v.capacity()))
    }

    /// The version of a conversation that is not stored.
    pub fn absent() -> Version {
        Version(None)
    }

    /// An engine's version token (for engines only).
    pub fn of(token: impl Into<Vec<u8>>) -> Version {
        Version(Some(token.into()))
    }

    /// The engine's token; `None` for a conversation that is not stored.
    pub fn token(&self) -> Option<&[u8]> {
        self.0.as_deref()
    }
}

/// A conversation as stored: its record, its version, and one [`Entry`] per message in turn
/// order.
#[derive(Debug, Default)]
pub struct Loaded {
    pub meta: Option<ConversationMeta>,
    pub version: Version,
    pub entries: Vec<Entry>,
}

/// One atomic change to a conversation.
#[derive(Debug, Clone, Copy)]
pub struct Write<'a> {
    /// The conversation's record after the change.
    pub meta: &'a ConversationMeta,
    /// Turns to delete.
    pub remove_turns: &'a [u64],
    /// Messages to add, with their turns assigned.
    pub add: &'a [StoredMessage],
    /// Sealed vectors of some of the added messages, by turn ([`Vectors::put_vectors`]'s
    /// values), written with them: atomically with them, and replacing what a turn written
    /// again had.
    pub vectors: &'a [(u64, Vec<u8>)],
    /// Summary records to add, by number.
    pub summaries: &'a [(u64, &'a [u8])],
    /// Summary records to delete, by number (those a closed branch takes along).
    pub remove_summaries: &'a [u64],
    /// Closed branches to add, by their numbers (one being closed, or imported ones).
    pub branches: &'a [StoredBranch],
    /// Responses API ids of the replies added, found again by
    /// [`Engine::response_conversation`].
    pub response_ids: &'a [String],
}

/// Which conversations a listing covers.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scope<'a> {
    pub tenant: Option<&'a TenantId>,
    pub agent: Option<&'a str>,
}

impl Scope<'_> {
    /// True when `key` is in scope.
    pub fn covers(&self, key: &ConversationKey) -> bool {
        self.tenant.is_none_or(|t| *t == key.tenant) && self.agent.is_none_or(|a| a == key.agent)
    }
}

/// What [`SharedEngine::refresh`] found of a cached conversation.
#[derive(Debug)]
pub enum Refresh {
    /// The stored version is the one known.
    Unchanged,
    /// Messages were only added since: the new record and version, and the added messages in
    /// turn order.
    Appended {
        meta: ConversationMeta,
        version: Version,
        added: Vec<StoredMessage>,
    },
    /// Anything else (messages removed, deleted, started afresh): load it again.
    Changed,
}

/// A page of a bounded walk, and the cursor to go on from (`None`: the walk is over).
pub type Page<T> = (Vec<T>, Option<Vec<u8>>);

/// A storage engine. See the module documentation for the contract every engine keeps.
pub trait Engine: Owners + Vectors + Send + Sync + 'static {
    /// The engine's name, for logs and `/readyz`.
    fn name(&self) -> &'static str;

    /// A conversation as stored (an empty [`Loaded`] when it is not).
    fn load(&self, key: &ConversationKey) -> Result<Loaded, StoreError>;

    /// The conversation's record as stored.
    fn meta(&self, key: &ConversationKey) -> Result<Option<ConversationMeta>, StoreError>;

    /// The messages of conversation `id` at `turns`, in the order asked.
    fn messages(
        &self,
        key: &ConversationKey,
        id: u64,
        turns: &[u64],
    ) -> Result<Vec<StoredMessage>, StoreError>;

    /// Every stored message of conversation `id` with a turn in `from..=to`, in turn order.
    fn range(
        &self,
        key: &ConversationKey,
        id: u64,
        from: u64,
        to: u64,
    ) -> Result<Vec<StoredMessage>, StoreError>;

    /// A conversation id never handed out before.
    fn new_id(&self) -> Result<u64, StoreError>;

    /// Applies `write` if the stored version is `expected`; returns the new version.
    fn write(
        &self,
        key: &ConversationKey,
        expected: &Version,
        write: Write<'_>,
    ) -> Result<Version, StoreError>;

    /// Deletes everything of a conversation (see the contract); `None` when it was not
    /// stored, or (with `idle_before_ms`) was used since.
    fn delete(
        &self,
        key: &ConversationKey,
        idle_before_ms: Option<i64>,
    ) -> Result<Option<Deleted>, StoreError>;

    /// The closed branches of conversation `id`, by number, oldest first; each with its
    /// messages in turn order and its summary records by number.
    fn branches(&self, key: &ConversationKey, id: u64) -> Result<Vec<StoredBranch>, StoreError>;

    /// The summary records of conversation `id`, by number, oldest first.
    fn summaries(&self, key: &ConversationKey, id: u64) -> Result<Vec<(u64, Vec<u8>)>, StoreError>;

    /// The newest summary record of conversation `id`.
    fn latest_summary(&self, key: &ConversationKey, id: u64)
    -> Result<Option<Vec<u8>>, StoreError>;

    /// Writes summary `number` if the conversation at `key` still has the id `id`; false when
    /// it does not (deleted, or started afresh).
    fn put_summary(
        &self,
        key: &ConversationKey,
        id: u64,
        number: u64,
        record: &[u8],
    ) -> Result<bool, StoreError>;

    /// The conversation's TTL record.
    fn ttl(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError>;

    /// Writes the conversation's TTL record.
    fn put_ttl(&self, key: &ConversationKey, record: &TtlRecord) -> Result<(), StoreError>;

    /// Up to `limit` TTL records after the cursor `after`, in key order.
    fn ttl_page(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(ConversationKey, TtlRecord)>, StoreError>;

    /// Removes the TTL record of `key` if no conversation is stored there; true if removed.
    fn drop_orphan_ttl(&self, key: &ConversationKey) -> Result<bool, StoreError>;

    /// Up to `limit` conversations in `scope` after the cursor `after`, in key order, looking
    /// at no more than `max_scan` keys.
    fn list(
        &self,
        scope: Scope<'_>,
        after: Option<&[u8]>,
        limit: usize,
        max_scan: usize,
    ) -> Result<Page<(ConversationKey, ConversationMeta)>, StoreError>;

    /// Makes every write acknowledged so far durable.
    fn flush(&self) -> Result<(), StoreError>;

    /// Closes the engine's files and opens them again from what is durable: how an engine
    /// whose writes failed (a full disk) is brought back once the cause is gone. On failure
    /// every call fails until a later reopen succeeds.
    fn reopen(&self) -> Result<(), StoreError>;

    /// True when the engine answers a read.
    fn is_ready(&self) -> bool;

    /// Bytes the engine takes (on disk, or in the server's memory).
    fn size_bytes(&self) -> u64;

    /// The conversation `tenant` was answered the Responses API id `response_id` in (a write
    /// named it), while that conversation lives with the id it had then.
    fn response_conversation(
        &self,
        tenant: &TenantId,
        response_id: &str,
    ) -> Result<Option<ConversationKey>, StoreError>;

    /// Forgets the Responses API id `response_id` of `tenant`; true when it was known.
    fn forget_response(&self, tenant: &TenantId, response_id: &str) -> Result<bool, StoreError>;

    /// True when `needle` occurs in any stored key or value: a full scan, to prove a deletion
    /// left no trace (tests, audits).
    fn any_trace_of(&self, needle: &[u8]) -> Result<bool, StoreError>;
}

/// Owners' records (long-term memory): what every engine keeps beside its conversations.
pub trait Owners: Send + Sync {
    /// The owner's record.
    fn owner(&self, owner: &OwnerKey) -> Result<Option<OwnerMeta>, StoreError>;

    /// The owner's record, created with `meta` if there is none; returns the one stored.
    fn create_owner(&self, owner: &OwnerKey, meta: OwnerMeta) -> Result<OwnerMeta, StoreError>;

    /// Puts `put` and removes `remove` (space, id) among the owner's records, atomically, if
    /// the owner's record still has the id `id`; false (and nothing written) when it does not.
    /// Removes go first, each with its record's vector: a record both removed and put is
    /// written anew without a vector (long-term memory drops a memory's old vector so when
    /// it changes its text).
    fn write_owner(
        &self,
        owner: &OwnerKey,
        id: u64,
        put: &[OwnerRecord],
        remove: &[(u8, Vec<u8>)],
    ) -> Result<bool, StoreError>;

    /// One record of the owner.
    fn owner_record(
        &self,
        owner: &OwnerKey,
        space: u8,
        id: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError>;

    /// Up to `limit` records of the owner in `space` with an id after `after`, in id order.
    fn owner_records(
        &self,
        owner: &OwnerKey,
        space: u8,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<OwnerRecord>, StoreError>;

    /// Removes the owner's record and all its records; the id it had, `None` when it had none.
    fn delete_owner(&self, owner: &OwnerKey) -> Result<Option<u64>, StoreError>;

    /// Up to `limit` owners after the cursor `after` (owner key bytes), in key order.
    fn owners(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError>;
}

/// A vector as an engine keeps it: what it describes (a turn, a record id) and its sealed
/// value.
pub type SealedVector<K> = (K, Vec<u8>);

/// Vectors of stored messages and of owners' records (recall by meaning): what every engine
/// keeps beside what they describe, and removes with it. Values are opaque (sealed by the
/// store, `vectors.rs`).
pub trait Vectors: Send + Sync {
    /// Writes `vectors` (turn, value) of conversation `id`, each only if its turn is stored on
    /// the main line, replacing the value it had; atomically with the check that `key` still
    /// has the id `id`. The count written, `None` (nothing written) when it does not.
    fn put_vectors(
        &self,
        key: &ConversationKey,
        id: u64,
        vectors: &[(u64, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError>;

    /// Every vector of conversation `id` (turn, value), by turn, in one read.
    fn vectors(&self, key: &ConversationKey, id: u64)
    -> Result<Vec<SealedVector<u64>>, StoreError>;

    /// Writes `vectors` (record space, record id, value) of the owner, each only if its record
    /// is stored, replacing the value it had; atomically with the check that the owner still
    /// has the id `id`. The count written, `None` (nothing written) when it does not.
    fn put_owner_vectors(
        &self,
        owner: &OwnerKey,
        id: u64,
        vectors: &[(u8, Vec<u8>, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError>;

    /// Every vector of the owner's records in `space` (record id, value), by id, in one read.
    fn owner_vectors(
        &self,
        owner: &OwnerKey,
        space: u8,
    ) -> Result<Vec<SealedVector<Vec<u8>>>, StoreError>;

    /// How many vectors the engine holds, of conversations and owners together: a full scan,
    /// to prove a deletion left none (tests, audits).
    fn vector_count(&self) -> Result<u64, StoreError>;
}

/// What only an engine that other processes write to has (Redis): a cached conversation is
/// checked against it on every request ([`SharedEngine::refresh`]), the conversations' keys
/// are kept in it, and a summary is made under a lease. An engine this process has alone (sled)
/// has none of it: its keys are files (`keys.rs`), nothing changes under its cache, and no
/// other replica makes summaries.
pub trait SharedEngine: Engine {
    /// Compares a cached conversation (its version, record and message count) with the
    /// stored one in one round trip, and reads only what was added since.
    fn refresh(
        &self,
        key: &ConversationKey,
        known: &Version,
        known_meta: Option<&ConversationMeta>,
        known_count: usize,
    ) -> Result<Refresh, StoreError>;

    /// The key of conversation `id` kept in the engine.
    fn key_bytes(&self, key: &ConversationKey, id: u64) -> Result<Option<Vec<u8>>, StoreError>;

    /// Stores `bytes` as the key of conversation `id` unless it has one; returns the one it
    /// has then.
    fn create_key(
        &self,
        key: &ConversationKey,
        id: u64,
        bytes: &[u8],
    ) -> Result<Vec<u8>, StoreError>;

    /// Removes the key of conversation `id`.
    fn remove_key(&self, key: &ConversationKey, id: u64) -> Result<(), StoreError>;

    /// Takes the summary lease of conversation `id` for `holder` for `ttl` (free, expired,
    /// or already this holder's); false when another holds it or the conversation is not that
    /// id.
    fn take_lease(
        &self,
        key: &ConversationKey,
        id: u64,
        holder: &str,
        ttl: std::time::Duration,
    ) -> Result<bool, StoreError>;

    /// Gives the lease back if `holder` has it.
    fn release_lease(&self, key: &ConversationKey, holder: &str) -> Result<(), StoreError>;
}
