//! The embedded engine whose memory its caches bound: fjall (an LSM tree), in the data
//! directory's `fjall/` folder, chosen with `storage.backend = "fjall"`. sled stays the
//! default; why a sidecar that stores millions of messages may want this one instead: sled
//! keeps a list of log places for every page it ever wrote, in memory, so its memory grows
//! with the keys stored (README, "The fjall engine"), where fjall keeps its tables on disk and,
//! in memory, its block cache, its memtables, and the indexes and filters of its newest
//! tables (deeper levels' go through the block cache).
//!
//! - **Layout.** The same trees as the sled engine (fjall's keyspaces) with the same keys and
//!   values (`layout.rs`; the list is in `sled_engine.rs`), and one more, `ids`, holding the
//!   next conversation id.
//! - **Writes.** Every write is one fjall write transaction. fjall runs them one at a time and
//!   each reads the latest commit, so a conditional write (the conversation's record checked,
//!   then written with its messages) is one atomic step, and no write can slip in between a
//!   delete's scan and its removal. Reads of more than one record (a load, a page) read one
//!   snapshot, so a reader never sees half a write.
//! - **Durability.** A commit goes to fjall's journal and into the OS's buffers before it is
//!   acknowledged (`PersistMode::Buffer`): it survives this process being killed.
//!   [`Engine::flush`] syncs the journal to the disk (`persist(SyncAll)`); with `flush_every`,
//!   a thread of the engine's syncs it that often too. At open, fjall replays the journal past
//!   its tables; a torn end of it is dropped.
//! - **Ids** are reserved in blocks of [`ID_BLOCK`], each block made durable before an id of it
//!   is handed out: a crash skips the rest of a block and never hands an id out twice.
//! - **Failures.** A write that fails on the disk returns [`StoreError::Disk`]; a journal that
//!   cannot be synced poisons fjall's keyspace, and every later write fails until
//!   [`Engine::reopen`] opens it again from the disk.
//! - **One process.** The engine holds an exclusive lock on `memproxy.lock` in its folder
//!   while open (fjall 3 takes one of its own too), so a second process on the same data
//!   directory gets an error rather than two writers on one journal.
//! - **fjall 3.** fjall 2, which the first version of this engine used, kept in its block cache
//!   the hash of every block it had evicted, up to 500,000 of them (some 35 MB by the entries'
//!   layout), so its memory grew for as long as the store was read (11.3 MB beside a 5 MiB
//!   cache after ten minutes of the soak at 128 MiB, in jemalloc's heap profile). fjall 3
//!   keeps 5,000 at most. It cannot read fjall 2's files: such a folder is refused
//!   ([`StoreError::Engine`]) with a message that says so.

use std::fs::File;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use fjall::config::{BlockSizePolicy, FilterPolicy};
use fjall::{
    KeyspaceCreateOptions, PersistMode, Readable, SingleWriterTxDatabase as Database,
    SingleWriterTxKeyspace as Keyspace, SingleWriterWriteTx as WriteTx,
};

use super::StoreError;
use super::engine::{Engine, Loaded, Owners, Page, Scope, SealedVector, Vectors, Version, Write};
use super::layout::{
    BRANCH_RECORD, Rows, assemble_branches, branch_key_parts, branch_rows,
    conversation_response_key, conversations_page, decode, encode, listing_start, live_keys,
    loaded, message_key, owner_prefix, owner_record_key, owners_page, response_key, ttl_page,
    turn_of,
};
use super::records::{
    ConversationMeta, Deleted, OwnerKey, OwnerMeta, OwnerRecord, StoredBranch, StoredMessage,
    TtlRecord,
};
use memproxy_base::identity::{ConversationKey, TenantId};

/// Conversation ids reserved at a time (one durable write each).
const ID_BLOCK: u64 = 1024;

/// The `ids` keyspace's key of the first id not yet reserved.
const NEXT_ID: &[u8] = b"next";

/// Each keyspace's memtable is written to a table file once it holds an eighth of the store's
/// share of the budget, within these bounds: a handful of keyspaces take writes at once (the
/// messages, their vectors, summaries, the conversations' records), and the budget gives the
/// store's memory beyond its block cache twice that share (`memory_budget.rs`).
const MEMTABLE_BYTES: std::ops::RangeInclusive<u64> = (1 << 20)..=(16 << 20);

/// A table file's data blocks, against fjall's 4 KiB: memproxy reads mostly whole
/// conversations (a range of consecutive keys), and what fjall keeps in memory of its files
/// grows with their blocks. Chosen with fjall 2, whose every table's index stayed in memory:
/// with 4 KiB blocks its heap grew by about 19 bytes a stored message (42.5 MiB at half a
/// million, 89.4 at three million, `store_growth --engine fjall --ledger --vector-dims 256`),
/// with 32 KiB it stayed between 36.6 and 44.3 MiB to four million. fjall 3 keeps only its
/// newest tables' indexes in memory; as opened here its heap stayed between 27.9 and 33.1 MiB
/// to three million (README, "The fjall engine"; 4 KiB not measured with it).
const BLOCK_BYTES: u32 = 32 << 10;

/// The keyspaces that grow with the messages stored and are read mostly by range or prefix
/// (a conversation's messages, vectors, summaries, branches): no filter, whose bits a key would
/// grow with them and speed up only point reads of keys that are not there. With fjall 2 and
/// filters off for these the heap stayed between 32.0 and 38.4 MiB to 2.5 million messages (the
/// same measurement as [`BLOCK_BYTES`]'s). The others keep fjall's.
const UNFILTERED: [&str; 6] = [
    "messages",
    "vectors",
    "summaries",
    "branches",
    "conversation_responses",
    "owner_vectors",
];

/// How long [`FjallEngine::open`] waits for a previous holder of the folder's lock (a store
/// closed a moment ago in this process, whose last call still holds it).
const LOCK_WAIT: Duration = Duration::from_secs(3);

/// The fjall engine.
pub struct FjallEngine {
    dir: PathBuf,
    cache_bytes: u64,
    flush_every: Option<Duration>,
    /// The open keyspace; `None` once a reopen failed.
    open: RwLock<Option<Arc<Parts>>>,
    /// Ids handed out next, and the end of the block reserved for them.
    ids: Mutex<(u64, u64)>,
}

/// An open database and its keyspaces.
struct Parts {
    /// Syncs the journal every `flush_every`, when set; first, so it stops before the rest
    /// closes.
    _syncer: Option<Syncer>,
    db: Database,
    conversations: Keyspace,
    messages: Keyspace,
    summaries: Keyspace,
    branches: Keyspace,
    ttl: Keyspace,
    responses: Keyspace,
    conversation_responses: Keyspace,
    owners: Keyspace,
    owner_records: Keyspace,
    vectors: Keyspace,
    owner_vectors: Keyspace,
    ids: Keyspace,
    /// Held while open: the folder's lock.
    _lock: File,
}

impl std::fmt::Debug for FjallEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FjallEngine")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl From<fjall::Error> for StoreError {
    fn from(err: fjall::Error) -> StoreError {
        match err {
            fjall::Error::Io(err) => StoreError::Disk(err),
            fjall::Error::Storage(fjall::LsmError::Io(err)) => StoreError::Disk(err),
            fjall::Error::Poisoned => StoreError::Disk(std::io::Error::other(
                "fjall stopped writing after a failure to write its files",
            )),
            fjall::Error::InvalidVersion(_)
            | fjall::Error::Storage(fjall::LsmError::InvalidVersion(_)) => StoreError::Engine(
                format!(
                    "the fjall folder is in a format this memproxy does not read ({err}): the \
                     first fjall engine (before fjall 3) wrote fjall 2's files; move the folder \
                     aside to start empty, or convert it with fjall's migrate-v2-v3 tool"
                )
                .into(),
            ),
            fjall::Error::Storage(
                fjall::LsmError::ChecksumMismatch { .. }
                | fjall::LsmError::Decompress(_)
                | fjall::LsmError::InvalidTag(_)
                | fjall::LsmError::InvalidTrailer
                | fjall::LsmError::InvalidHeader(_)
                | fjall::LsmError::Utf8(_)
                | fjall::LsmError::Unrecoverable,
            )
            | fjall::Error::JournalRecovery(_)
            | fjall::Error::Decompress(_)
            | fjall::Error::InvalidTrailer
            | fjall::Error::InvalidTag(_)
            | fjall::Error::Unrecoverable => {
                StoreError::Damaged(format!("fjall found its files damaged: {err}"))
            }
            other => StoreError::Engine(Box::new(other)),
        }
    }
}

/// A row of a fjall walk, its error as the store's.
fn fjall_row(item: fjall::Guard) -> Result<fjall::KvPair, StoreError> {
    item.into_inner().map_err(StoreError::from)
}

/// A key's value as a vector of bytes.
fn bytes(value: fjall::Slice) -> Vec<u8> {
    value.to_vec()
}

/// The bounds of every key after `after` (every key without one).
fn after_bounds(after: Option<&[u8]>) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    match after {
        Some(after) => (Bound::Excluded(after.to_vec()), Bound::Unbounded),
        None => (Bound::Unbounded, Bound::Unbounded),
    }
}

/// The record of the conversation at `key_bytes` as `tx` reads it, decoded leniently: an
/// unreadable record has no id.
fn conversation_id(
    tx: &WriteTx,
    conversations: &Keyspace,
    key_bytes: &[u8],
) -> Result<Option<u64>, StoreError> {
    Ok(tx
        .get(conversations, key_bytes)?
        .and_then(|bytes| serde_json::from_slice::<ConversationMeta>(&bytes).ok())
        .map(|m| m.id))
}

/// The id of `owner`'s record as `tx` reads it, decoded leniently as [`conversation_id`].
fn owner_id(tx: &WriteTx, owners: &Keyspace, owner: &OwnerKey) -> Result<Option<u64>, StoreError> {
    Ok(tx
        .get(owners, owner.to_bytes())?
        .and_then(|bytes| serde_json::from_slice::<OwnerMeta>(&bytes).ok())
        .map(|m| m.id))
}

/// The keys under `prefix` in `keyspace`, as `tx` reads them.
fn keys_under(
    tx: &WriteTx,
    keyspace: &Keyspace,
    prefix: &[u8],
) -> Result<Vec<fjall::Slice>, StoreError> {
    tx.prefix(keyspace, prefix)
        .map(|item| item.key().map_err(StoreError::from))
        .collect()
}

/// A thread that syncs the journal to the disk at an interval (fjall 3 has no such setting of
/// its own); it stops, and is joined, when dropped.
struct Syncer {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Syncer {
    fn start(db: Database, every: Duration) -> Syncer {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("memproxy-fjall-sync".to_string())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(every)
                {
                    if let Err(err) = db.persist(PersistMode::SyncAll) {
                        tracing::warn!(error = %err, "fjall could not sync its journal");
                    }
                }
            })
            .inspect_err(|err| {
                tracing::warn!(error = %err, "no thread to sync fjall's journal: only explicit flushes will");
            })
            .ok();
        Syncer {
            stop: Some(stop),
            thread,
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Opens the folder's lock file and takes it, waiting [`LOCK_WAIT`] at most.
fn take_lock(dir: &Path) -> Result<File, StoreError> {
    std::fs::create_dir_all(dir).map_err(StoreError::Disk)?;
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("memproxy.lock"))
        .map_err(StoreError::Disk)?;
    let started = std::time::Instant::now();
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(std::fs::TryLockError::WouldBlock) if started.elapsed() < LOCK_WAIT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StoreError::Disk(std::io::Error::other(format!(
                    "{} is in use by another process (could not acquire lock)",
                    dir.display()
                ))));
            }
            Err(std::fs::TryLockError::Error(err)) => return Err(StoreError::Disk(err)),
        }
    }
}

impl Parts {
    fn open(
        dir: &Path,
        cache_bytes: u64,
        flush_every: Option<Duration>,
    ) -> Result<Parts, StoreError> {
        let lock = take_lock(dir)?;
        let memtable = (cache_bytes / 8).clamp(*MEMTABLE_BYTES.start(), *MEMTABLE_BYTES.end());
        let db = Database::builder(dir).cache_size(cache_bytes).open()?;
        let keyspace = |name: &str| {
            db.keyspace(name, || {
                let options = KeyspaceCreateOptions::default()
                    .max_memtable_size(memtable)
                    .data_block_size_policy(BlockSizePolicy::all(BLOCK_BYTES));
                if UNFILTERED.contains(&name) {
                    options.filter_policy(FilterPolicy::disabled())
                } else {
                    options
                }
            })
        };
        Ok(Parts {
            _syncer: flush_every.map(|every| Syncer::start(db.clone(), every)),
            conversations: keyspace("conversations")?,
            messages: keyspace("messages")?,
            summaries: keyspace("summaries")?,
            branches: keyspace("branches")?,
            ttl: keyspace("ttl")?,
            responses: keyspace("responses")?,
            conversation_responses: keyspace("conversation_responses")?,
            owners: keyspace("owners")?,
            owner_records: keyspace("owner_records")?,
            vectors: keyspace("vectors")?,
            owner_vectors: keyspace("owner_vectors")?,
            ids: keyspace("ids")?,
            db,
            _lock: lock,
        })
    }

    /// A write transaction whose commit reaches the journal file (the OS's buffers) before it
    /// returns, so it survives this process being killed.
    fn write_tx(&self) -> WriteTx<'_> {
        self.db.write_tx().durability(Some(PersistMode::Buffer))
    }

    /// Every keyspace, for whole-store walks.
    fn all(&self) -> [&Keyspace; 12] {
        [
            &self.conversations,
            &self.messages,
            &self.summaries,
            &self.branches,
            &self.ttl,
            &self.responses,
            &self.conversation_responses,
            &self.owners,
            &self.owner_records,
            &self.vectors,
            &self.owner_vectors,
            &self.ids,
        ]
    }

    /// The first id not yet reserved.
    fn reserved(&self) -> Result<u64, StoreError> {
        Ok(self
            .ids
            .get(NEXT_ID)?
            .and_then(|b| <[u8; 8]>::try_from(&b[..]).ok())
            .map_or(1, u64::from_be_bytes))
    }
}

impl FjallEngine {
    /// Opens (or creates) the database in `dir`. `cache_bytes` is the store's share of the
    /// budget: fjall's block cache, and an eighth of it each keyspace's memtable (within
    /// [`MEMTABLE_BYTES`]); `flush_every` how often the journal is synced to the disk besides
    /// the explicit flushes (`None`: only those).
    pub fn open(
        dir: &Path,
        cache_bytes: u64,
        flush_every: Option<Duration>,
    ) -> Result<FjallEngine, StoreError> {
        let parts = Parts::open(dir, cache_bytes, flush_every)?;
        let next = parts.reserved()?;
        Ok(FjallEngine {
            dir: dir.to_path_buf(),
            cache_bytes,
            flush_every,
            open: RwLock::new(Some(Arc::new(parts))),
            ids: Mutex::new((next, next)),
        })
    }

    /// The open keyspace, or why there is none.
    fn parts(&self) -> Result<Arc<Parts>, StoreError> {
        self.open
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or(StoreError::Closed)
    }

    /// Removes every key under `prefix` in each of `keyspaces`, in `tx`; the number removed
    /// from each.
    fn remove_prefixes<const N: usize>(
        tx: &mut WriteTx,
        keyspaces: [&Keyspace; N],
        prefix: &[u8],
    ) -> Result<[usize; N], StoreError> {
        let mut counts = [0; N];
        for (keyspace, count) in keyspaces.into_iter().zip(counts.iter_mut()) {
            for key in keys_under(tx, keyspace, prefix)? {
                tx.remove(keyspace, key);
                *count += 1;
            }
        }
        Ok(counts)
    }
}

impl Engine for FjallEngine {
    fn name(&self) -> &'static str {
        "fjall"
    }

    fn load(&self, key: &ConversationKey) -> Result<Loaded, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        let Some(stored) = snapshot.get(&p.conversations, key.to_bytes())? else {
            return Ok(Loaded::default());
        };
        let meta: ConversationMeta = decode(&stored)?;
        let rows = snapshot.range(&p.messages, live_keys(&meta));
        loaded(
            meta,
            stored.to_vec(),
            rows.map(|row| fjall_row(row).map(|(_, v)| v)),
        )
    }

    fn meta(&self, key: &ConversationKey) -> Result<Option<ConversationMeta>, StoreError> {
        let p = self.parts()?;
        p.conversations
            .get(key.to_bytes())?
            .map(|bytes| decode(&bytes))
            .transpose()
    }

    fn messages(
        &self,
        _key: &ConversationKey,
        id: u64,
        turns: &[u64],
    ) -> Result<Vec<StoredMessage>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        turns
            .iter()
            .map(|&turn| {
                let bytes = snapshot
                    .get(&p.messages, message_key(id, turn))?
                    .ok_or_else(|| StoreError::Corrupt(format!("turn {turn} is missing")))?;
                decode(&bytes)
            })
            .collect()
    }

    fn range(
        &self,
        _key: &ConversationKey,
        id: u64,
        from: u64,
        to: u64,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        let p = self.parts()?;
        if from > to {
            return Ok(Vec::new());
        }
        let snapshot = p.db.read_tx();
        snapshot
            .range(&p.messages, message_key(id, from)..=message_key(id, to))
            .map(|item| decode(&fjall_row(item)?.1))
            .collect()
    }

    fn new_id(&self) -> Result<u64, StoreError> {
        let p = self.parts()?;
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (next, end) = &mut *ids;
        if *next >= *end {
            // A reopen may have found a later block (none is handed out twice either way).
            let start = (*next).max(p.reserved()?);
            let new_end = start + ID_BLOCK;
            let mut tx = p.write_tx().durability(Some(PersistMode::SyncAll));
            tx.insert(&p.ids, NEXT_ID, new_end.to_be_bytes());
            tx.commit()?;
            *next = start;
            *end = new_end;
        }
        let id = *next;
        *next += 1;
        Ok(id)
    }

    fn write(
        &self,
        key: &ConversationKey,
        expected: &Version,
        write: Write<'_>,
    ) -> Result<Version, StoreError> {
        let p = self.parts()?;
        let rows = Rows::of(key, &write, 1)?;
        let id = write.meta.id;
        let branch_rows = branch_rows(id, write.branches)?;
        let mut tx = p.write_tx();
        if tx.get(&p.conversations, &rows.key)?.as_deref() != expected.token() {
            tx.rollback();
            return Err(StoreError::Stale);
        }
        // A turn removed, or written again, loses its vector with it.
        for turn in write.remove_turns {
            tx.remove(&p.messages, message_key(id, *turn));
            tx.remove(&p.vectors, message_key(id, *turn));
        }
        for (k, v) in &rows.added {
            tx.insert(&p.messages, *k, v.as_slice());
            tx.remove(&p.vectors, *k);
        }
        for (turn, value) in write.vectors {
            tx.insert(&p.vectors, message_key(id, *turn), value.as_slice());
        }
        for number in write.remove_summaries {
            tx.remove(&p.summaries, message_key(id, *number));
        }
        for (number, record) in write.summaries {
            tx.insert(&p.summaries, message_key(id, *number), *record);
        }
        for (k, v) in &branch_rows {
            tx.insert(&p.branches, *k, v.as_slice());
        }
        for (by_id, by_conversation) in &rows.responses {
            tx.insert(
                &p.responses,
                by_id.as_slice(),
                rows.response_value.as_slice(),
            );
            tx.insert(
                &p.conversation_responses,
                by_conversation.as_slice(),
                &[][..],
            );
        }
        tx.insert(&p.conversations, rows.key.as_slice(), rows.meta.as_slice());
        tx.commit()?;
        Ok(Version::of(rows.meta))
    }

    fn delete(
        &self,
        key: &ConversationKey,
        idle_before_ms: Option<i64>,
    ) -> Result<Option<Deleted>, StoreError> {
        let p = self.parts()?;
        let key_bytes = key.to_bytes();
        let mut tx = p.write_tx();
        let Some(stored_meta) = tx.get(&p.conversations, &key_bytes)? else {
            tx.remove(&p.ttl, key_bytes.as_slice());
            tx.commit()?;
            return Ok(None);
        };
        let meta: ConversationMeta = decode(&stored_meta)?;
        if idle_before_ms.is_some_and(|cutoff| meta.last_activity_ms >= cutoff) {
            tx.rollback();
            return Ok(None);
        }
        let prefix = meta.id.to_be_bytes();
        let branch_records = keys_under(&tx, &p.branches, &prefix)?
            .iter()
            .filter(|k| branch_key_parts(k).is_some_and(|(_, part, _)| part == BRANCH_RECORD))
            .count();
        for k in keys_under(&tx, &p.conversation_responses, &prefix)? {
            let response_id = String::from_utf8_lossy(&k[8..]).into_owned();
            tx.remove(&p.responses, response_key(&key.tenant, &response_id));
            tx.remove(&p.conversation_responses, k);
        }
        let [messages, summaries, _, _] = Self::remove_prefixes(
            &mut tx,
            [&p.messages, &p.summaries, &p.branches, &p.vectors],
            &prefix,
        )?;
        tx.remove(&p.conversations, key_bytes.as_slice());
        tx.remove(&p.ttl, key_bytes.as_slice());
        tx.commit()?;
        Ok(Some(Deleted {
            messages,
            summaries,
            branches: branch_records,
        }))
    }

    fn branches(&self, _key: &ConversationKey, id: u64) -> Result<Vec<StoredBranch>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        assemble_branches(
            snapshot
                .prefix(&p.branches, id.to_be_bytes())
                .map(fjall_row),
        )
    }

    fn summaries(
        &self,
        _key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        snapshot
            .prefix(&p.summaries, id.to_be_bytes())
            .map(|item| {
                let (key, value) = fjall_row(item)?;
                Ok((turn_of(&key).unwrap_or(0), bytes(value)))
            })
            .collect()
    }

    fn latest_summary(
        &self,
        _key: &ConversationKey,
        id: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        match snapshot.prefix(&p.summaries, id.to_be_bytes()).next_back() {
            None => Ok(None),
            Some(item) => Ok(Some(bytes(item.value()?))),
        }
    }

    fn put_summary(
        &self,
        key: &ConversationKey,
        id: u64,
        number: u64,
        record: &[u8],
    ) -> Result<bool, StoreError> {
        let p = self.parts()?;
        let mut tx = p.write_tx();
        if conversation_id(&tx, &p.conversations, &key.to_bytes())? != Some(id) {
            tx.rollback();
            return Ok(false);
        }
        tx.insert(&p.summaries, message_key(id, number), record);
        tx.commit()?;
        Ok(true)
    }

    fn ttl(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError> {
        let p = self.parts()?;
        p.ttl
            .get(key.to_bytes())?
            .map(|bytes| decode(&bytes))
            .transpose()
    }

    fn put_ttl(&self, key: &ConversationKey, record: &TtlRecord) -> Result<(), StoreError> {
        let p = self.parts()?;
        let mut tx = p.write_tx();
        tx.insert(&p.ttl, key.to_bytes(), encode(record)?);
        tx.commit()?;
        Ok(())
    }

    fn ttl_page(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(ConversationKey, TtlRecord)>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        ttl_page(
            snapshot.range(&p.ttl, after_bounds(after)).map(fjall_row),
            limit,
        )
    }

    fn drop_orphan_ttl(&self, key: &ConversationKey) -> Result<bool, StoreError> {
        let p = self.parts()?;
        let key_bytes = key.to_bytes();
        let mut tx = p.write_tx();
        if tx.get(&p.conversations, &key_bytes)?.is_some() || tx.get(&p.ttl, &key_bytes)?.is_none()
        {
            tx.rollback();
            return Ok(false);
        }
        tx.remove(&p.ttl, key_bytes.as_slice());
        tx.commit()?;
        Ok(true)
    }

    fn list(
        &self,
        scope: Scope<'_>,
        after: Option<&[u8]>,
        limit: usize,
        max_scan: usize,
    ) -> Result<Page<(ConversationKey, ConversationMeta)>, StoreError> {
        let p = self.parts()?;
        let (prefix, start) = listing_start(scope, after);
        let snapshot = p.db.read_tx();
        let rows = snapshot.range(&p.conversations, start..).map(fjall_row);
        conversations_page(rows, scope, &prefix, limit, max_scan)
    }

    fn flush(&self) -> Result<(), StoreError> {
        let p = self.parts()?;
        p.db.persist(PersistMode::SyncAll)?;
        Ok(())
    }

    fn reopen(&self) -> Result<(), StoreError> {
        let mut open = self
            .open
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The old keyspace goes first: it holds the folder's lock (a call still using it holds
        // it a moment longer, which `take_lock` waits out).
        *open = None;
        let parts = Parts::open(&self.dir, self.cache_bytes, self.flush_every)?;
        let reserved = parts.reserved()?;
        let mut ids = self
            .ids
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // What was reserved durably is never handed out again.
        *ids = (ids.0.max(reserved), ids.0.max(reserved));
        *open = Some(Arc::new(parts));
        Ok(())
    }

    fn is_ready(&self) -> bool {
        self.parts()
            .is_ok_and(|p| p.conversations.get(b"\xff-readiness-probe").is_ok())
    }

    fn size_bytes(&self) -> u64 {
        self.parts().map_or(0, |p| p.db.disk_space().unwrap_or(0))
    }

    fn response_conversation(
        &self,
        tenant: &TenantId,
        response_id: &str,
    ) -> Result<Option<ConversationKey>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        let Some(value) = snapshot.get(&p.responses, response_key(tenant, response_id))? else {
            return Ok(None);
        };
        let Some((id, key_bytes)) = value.split_first_chunk::<8>() else {
            return Err(StoreError::Corrupt(
                "a response id record is too short".into(),
            ));
        };
        let Some(key) = ConversationKey::from_bytes(key_bytes) else {
            return Err(StoreError::Corrupt(
                "a response id record names no conversation".into(),
            ));
        };
        // The conversation must still live with the id the record was written for.
        let Some(meta) = snapshot.get(&p.conversations, key_bytes)? else {
            return Ok(None);
        };
        let meta: ConversationMeta = decode(&meta)?;
        Ok((meta.id == u64::from_be_bytes(*id) && key.tenant == *tenant).then_some(key))
    }

    fn forget_response(&self, tenant: &TenantId, response_id: &str) -> Result<bool, StoreError> {
        let p = self.parts()?;
        let mut tx = p.write_tx();
        let Some(value) = tx.take(&p.responses, response_key(tenant, response_id))? else {
            tx.rollback();
            return Ok(false);
        };
        if let Some((id, _)) = value.split_first_chunk::<8>() {
            tx.remove(
                &p.conversation_responses,
                conversation_response_key(u64::from_be_bytes(*id), response_id),
            );
        }
        tx.commit()?;
        Ok(true)
    }

    fn any_trace_of(&self, needle: &[u8]) -> Result<bool, StoreError> {
        let p = self.parts()?;
        if needle.is_empty() {
            return Ok(true);
        }
        let found = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        let snapshot = p.db.read_tx();
        for keyspace in p.all() {
            for item in snapshot.iter(keyspace) {
                let (key, value) = fjall_row(item)?;
                if found(&key) || found(&value) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

impl Owners for FjallEngine {
    fn owner(&self, owner: &OwnerKey) -> Result<Option<OwnerMeta>, StoreError> {
        let p = self.parts()?;
        p.owners
            .get(owner.to_bytes())?
            .map(|bytes| decode(&bytes))
            .transpose()
    }

    fn create_owner(&self, owner: &OwnerKey, meta: OwnerMeta) -> Result<OwnerMeta, StoreError> {
        let p = self.parts()?;
        let owner_bytes = owner.to_bytes();
        let mut tx = p.write_tx();
        if let Some(current) = tx.get(&p.owners, &owner_bytes)? {
            tx.rollback();
            return decode(&current);
        }
        tx.insert(&p.owners, owner_bytes, encode(&meta)?);
        tx.commit()?;
        Ok(meta)
    }

    fn write_owner(
        &self,
        owner: &OwnerKey,
        id: u64,
        put: &[OwnerRecord],
        remove: &[(u8, Vec<u8>)],
    ) -> Result<bool, StoreError> {
        let p = self.parts()?;
        let mut tx = p.write_tx();
        if owner_id(&tx, &p.owners, owner)? != Some(id) {
            tx.rollback();
            return Ok(false);
        }
        // A record removed loses its vector with it.
        for (space, record_id) in remove {
            tx.remove(&p.owner_records, owner_record_key(owner, *space, record_id));
            tx.remove(&p.owner_vectors, owner_record_key(owner, *space, record_id));
        }
        for record in put {
            tx.insert(
                &p.owner_records,
                owner_record_key(owner, record.space, &record.id),
                record.value.as_slice(),
            );
        }
        tx.commit()?;
        Ok(true)
    }

    fn owner_record(
        &self,
        owner: &OwnerKey,
        space: u8,
        id: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let p = self.parts()?;
        Ok(p.owner_records
            .get(owner_record_key(owner, space, id))?
            .map(bytes))
    }

    fn owner_records(
        &self,
        owner: &OwnerKey,
        space: u8,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<OwnerRecord>, StoreError> {
        let p = self.parts()?;
        let prefix = owner_prefix(owner, Some(space));
        let start = match after {
            Some(after) => Bound::Excluded([prefix.as_slice(), after].concat()),
            None => Bound::Included(prefix.clone()),
        };
        let snapshot = p.db.read_tx();
        let mut out = Vec::new();
        for item in snapshot.range(&p.owner_records, (start, Bound::<Vec<u8>>::Unbounded)) {
            let (key, value) = fjall_row(item)?;
            let Some(id) = key.strip_prefix(prefix.as_slice()) else {
                return Ok((out, None));
            };
            if out.len() == limit {
                let cursor = out.last().map(|r: &OwnerRecord| r.id.clone());
                return Ok((out, cursor));
            }
            out.push(OwnerRecord {
                space,
                id: id.to_vec(),
                value: bytes(value),
            });
        }
        Ok((out, None))
    }

    fn delete_owner(&self, owner: &OwnerKey) -> Result<Option<u64>, StoreError> {
        let p = self.parts()?;
        let owner_bytes = owner.to_bytes();
        let mut tx = p.write_tx();
        let removed = tx
            .take(&p.owners, owner_bytes)?
            .and_then(|bytes| serde_json::from_slice::<OwnerMeta>(&bytes).ok());
        Self::remove_prefixes(
            &mut tx,
            [&p.owner_records, &p.owner_vectors],
            &owner_prefix(owner, None),
        )?;
        tx.commit()?;
        Ok(removed.map(|m| m.id))
    }

    fn owners(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        owners_page(
            snapshot
                .range(&p.owners, after_bounds(after))
                .map(fjall_row),
            limit,
        )
    }
}

impl Vectors for FjallEngine {
    fn put_vectors(
        &self,
        key: &ConversationKey,
        id: u64,
        vectors: &[(u64, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        let p = self.parts()?;
        let mut tx = p.write_tx();
        if conversation_id(&tx, &p.conversations, &key.to_bytes())? != Some(id) {
            tx.rollback();
            return Ok(None);
        }
        let mut written = 0;
        for (turn, value) in vectors {
            let k = message_key(id, *turn);
            if tx.get(&p.messages, k)?.is_some() {
                tx.insert(&p.vectors, k, value.as_slice());
                written += 1;
            }
        }
        tx.commit()?;
        Ok(Some(written))
    }

    fn vectors(
        &self,
        _key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<SealedVector<u64>>, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        snapshot
            .prefix(&p.vectors, id.to_be_bytes())
            .map(|item| {
                let (key, value) = fjall_row(item)?;
                let turn = turn_of(&key)
                    .ok_or_else(|| StoreError::Corrupt("a vector key is malformed".into()))?;
                Ok((turn, bytes(value)))
            })
            .collect()
    }

    fn put_owner_vectors(
        &self,
        owner: &OwnerKey,
        id: u64,
        vectors: &[(u8, Vec<u8>, Vec<u8>)],
    ) -> Result<Option<usize>, StoreError> {
        let p = self.parts()?;
        let mut tx = p.write_tx();
        if owner_id(&tx, &p.owners, owner)? != Some(id) {
            tx.rollback();
            return Ok(None);
        }
        let mut written = 0;
        for (space, record_id, value) in vectors {
            let k = owner_record_key(owner, *space, record_id);
            if tx.get(&p.owner_records, &k)?.is_some() {
                tx.insert(&p.owner_vectors, k, value.as_slice());
                written += 1;
            }
        }
        tx.commit()?;
        Ok(Some(written))
    }

    fn owner_vectors(
        &self,
        owner: &OwnerKey,
        space: u8,
    ) -> Result<Vec<SealedVector<Vec<u8>>>, StoreError> {
        let p = self.parts()?;
        let prefix = owner_prefix(owner, Some(space));
        let snapshot = p.db.read_tx();
        snapshot
            .prefix(&p.owner_vectors, &prefix)
            .map(|item| {
                let (key, value) = fjall_row(item)?;
                let id = key.get(prefix.len()..).unwrap_or_default();
                Ok((id.to_vec(), bytes(value)))
            })
            .collect()
    }

    fn vector_count(&self) -> Result<u64, StoreError> {
        let p = self.parts()?;
        let snapshot = p.db.read_tx();
        let mut count = 0;
        for keyspace in [&p.vectors, &p.owner_vectors] {
            for item in snapshot.iter(keyspace) {
                item.key()?;
                count += 1;
            }
        }
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_open_of_the_same_folder_is_refused_while_the_first_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        // With a syncing thread, which must let go of the database when the engine is dropped.
        let first = FjallEngine::open(dir.path(), 1 << 20, Some(Duration::from_millis(5))).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        let second = FjallEngine::open(dir.path(), 1 << 20, None).unwrap_err();
        assert!(
            second.to_string().contains("could not acquire lock"),
            "{second}"
        );
        drop(first);
        FjallEngine::open(dir.path(), 1 << 20, None).unwrap();
    }

    #[test]
    fn a_folder_in_fjall_2s_format_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().unwrap();
        // fjall 2's format marker: "FJL" and the version.
        std::fs::write(dir.path().join("version"), b"FJL\x02").unwrap();
        let err = FjallEngine::open(dir.path(), 1 << 20, None).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, StoreError::Engine(_)), "{err:?}");
        assert!(text.contains("fjall 2's files"), "{text}");
        assert!(text.contains("migrate-v2-v3"), "{text}");
        // Nothing was written over it.
        assert_eq!(
            std::fs::read(dir.path().join("version")).unwrap(),
            b"FJL\x02"
        );
    }

    #[test]
    fn ids_reserved_before_a_crash_are_never_handed_out_again() {
        let dir = tempfile::tempdir().unwrap();
        let engine = FjallEngine::open(dir.path(), 1 << 20, None).unwrap();
        let first: Vec<u64> = (0..3).map(|_| engine.new_id().unwrap()).collect();
        assert_eq!(first, vec![1, 2, 3]);
        // Nothing flushed: the block's reservation was made durable on its own.
        drop(engine);
        let engine = FjallEngine::open(dir.path(), 1 << 20, None).unwrap();
        let next = engine.new_id().unwrap();
        assert_eq!(next, 1 + ID_BLOCK, "the rest of the first block is skipped");
        // A reopen keeps to the same rule, and ids go on growing past a block's end.
        engine.reopen().unwrap();
        let after: Vec<u64> = (0..ID_BLOCK + 2)
            .map(|_| engine.new_id().unwrap())
            .collect();
        assert!(after[0] > next);
        assert!(after.windows(2).all(|w| w[1] > w[0]));
    }
}
