//! The conversation store: sled on disk, and a cache of each conversation's in-memory index.
//!
//! Layout (sled trees):
//! - `conversations`: `tenant \0 agent \0 conversation` → [`ConversationMeta`] (JSON).
//! - `messages`: `conversation id (u64 BE) ++ turn (u64 BE)` → [`StoredMessage`] (JSON).
//! - `summaries`: `conversation id (u64 BE) ++ summary number (u64 BE)` → summary record (JSON),
//!   written by the compression stage.
//!
//! Files: each conversation may have a workspace folder, [`workspace_dir`], for copies meant
//! for people (summaries as Markdown). Its path is derived so no id can escape the data
//! directory.
//!
//! A commit writes its messages and the new meta in one sled transaction that first checks the
//! meta is still the one the caller planned against, so history is never half-written and two
//! writers to one conversation cannot interleave. This module stores and loads; deciding what
//! to store is the pipeline's job.

mod admin;
mod flush;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};
use tokio::task::JoinHandle;

pub use admin::{ConversationSummary, Deleted, ImportMeta, Imported, TtlRecord};
pub use flush::FlushError;
use flush::GroupFlusher;

use crate::config::Durability;
use crate::identity::ConversationKey;
use crate::message::Role;

/// Where a stored message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Sent by the client in a request.
    Client,
    /// The upstream's reply, read from its response.
    Reply,
}

/// A conversation's record in the `conversations` tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationMeta {
    /// The number that prefixes the conversation's message keys.
    pub id: u64,
    /// The turn number the next stored message gets; turn numbers only grow.
    pub next_turn: u64,
    pub message_count: u64,
    pub total_tokens: u64,
    pub created_ms: i64,
    pub last_activity_ms: i64,
    /// Tokens of the prompts forwarded for this conversation's stored exchanges.
    #[serde(default)]
    pub tokens_forwarded: u64,
}

/// One stored message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StoredMessage {
    pub turn: u64,
    pub role: Role,
    pub origin: Origin,
    /// UTC milliseconds since the epoch when it was stored.
    pub at_ms: i64,
    /// Tokens counted once, when stored.
    pub tokens: u32,
    pub fingerprint: u64,
    /// The message object as sent (or, for a reply, as rebuilt from the response).
    pub message: Box<RawValue>,
}

/// What the request path needs of one stored message, kept in memory per conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub turn: u64,
    pub role: Role,
    pub origin: Origin,
    pub tokens: u32,
    pub fingerprint: u64,
    pub at_ms: i64,
    /// Tokens of this message and every one before it still stored: the tokens of any run of
    /// messages is a difference of two of these, with no scan.
    pub cum_tokens: u64,
}

impl Entry {
    /// The entry of `m`, stored after a message whose `cum_tokens` was `before`.
    pub fn new(m: &StoredMessage, before: u64) -> Entry {
        Entry {
            turn: m.turn,
            role: m.role,
            origin: m.origin,
            tokens: m.tokens,
            fingerprint: m.fingerprint,
            at_ms: m.at_ms,
            cum_tokens: before + u64::from(m.tokens),
        }
    }
}

/// Tokens of `entries[from..to]`, from their running totals.
pub fn tokens_between(entries: &[Entry], from: usize, to: usize) -> u64 {
    if from >= to {
        return 0;
    }
    let before = if from == 0 {
        entries[0].cum_tokens - u64::from(entries[0].tokens)
    } else {
        entries[from - 1].cum_tokens
    };
    entries[to - 1].cum_tokens - before
}

/// A conversation's in-memory index: its meta as last read or written, and one [`Entry`] per
/// stored message in turn order. Held behind a mutex that is never held across an `.await`.
#[derive(Debug)]
pub struct Conversation {
    pub key: ConversationKey,
    pub meta: Option<ConversationMeta>,
    /// The meta's bytes as stored: the version a commit checks against.
    stored_meta: Option<sled::IVec>,
    pub entries: Vec<Entry>,
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
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("a stored record could not be decoded: {0}")]
    Corrupt(String),
    #[error("the conversation changed since it was read")]
    Stale,
    #[error(transparent)]
    Flush(#[from] FlushError),
}

/// Cached conversation handles.
type Handle = Arc<Mutex<Conversation>>;

pub struct Store {
    db: sled::Db,
    conversations: sled::Tree,
    messages: sled::Tree,
    summaries: sled::Tree,
    data_dir: PathBuf,
    cache: moka::sync::Cache<ConversationKey, Handle>,
    flusher: Option<Arc<GroupFlusher>>,
    background: Mutex<Vec<JoinHandle<()>>>,
    /// Lookups in `cache`, and those that missed (for metrics).
    cache_lookups: AtomicU64,
    cache_misses: AtomicU64,
    /// The `ttl` tree: `tenant \0 agent \0 conversation` → [`TtlRecord`] (JSON).
    ttl: sled::Tree,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

/// Locks a conversation; a poisoned lock (a panic while held) still yields the data, which is
/// only ever changed after its commit succeeded.
pub fn lock(handle: &Handle) -> MutexGuard<'_, Conversation> {
    handle
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// UTC milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn message_key(id: u64, turn: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&id.to_be_bytes());
    key[8..].copy_from_slice(&turn.to_be_bytes());
    key
}

impl Store {
    /// Opens (or creates) the store under `dir`. Must be called inside a tokio runtime: the
    /// group flusher or the interval flusher runs as a task.
    pub fn open(
        dir: &Path,
        durability: Durability,
        store_cache_bytes: u64,
        state_cache_bytes: u64,
    ) -> Result<Store, StoreError> {
        let flush_every = match durability {
            Durability::Commit => None,
            Durability::Interval(every) => Some(every.as_millis().max(1) as u64),
        };
        let config = sled::Config::new()
            .path(dir.join("store"))
            .cache_capacity(store_cache_bytes)
            .flush_every_ms(flush_every);
        let db = open_locked(&config)?;
        let conversations = db.open_tree("conversations")?;
        let messages = db.open_tree("messages")?;
        let summaries = db.open_tree("summaries")?;
        let ttl = db.open_tree("ttl")?;
        let mut background = Vec::new();
        let flusher = match durability {
            Durability::Commit => {
                let (flusher, task) = GroupFlusher::start(db.clone());
                background.push(task);
                Some(flusher)
            }
            Durability::Interval(_) => None,
        };
        let cache = moka::sync::Cache::builder()
            .max_capacity(state_cache_bytes)
            .weigher(|_key: &ConversationKey, handle: &Handle| {
                // `try_lock`: the weigher may run while the caller holds the lock.
                let entries = handle.try_lock().map_or(0, |c| c.entries.len());
                u32::try_from(256 + entries * std::mem::size_of::<Entry>()).unwrap_or(u32::MAX)
            })
            .build();
        Ok(Store {
            db,
            conversations,
            messages,
            summaries,
            data_dir: dir.to_path_buf(),
            cache,
            flusher,
            background: Mutex::new(background),
            cache_lookups: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            ttl,
        })
    }

    /// The conversation's handle, loading its index from disk on a cache miss.
    pub fn conversation(&self, key: &ConversationKey) -> Result<Handle, StoreError> {
        self.cache_lookups.fetch_add(1, Ordering::Relaxed);
        if let Some(handle) = self.cache.get(key) {
            return Ok(handle);
        }
        self.cache_misses.fetch_add(1, Ordering::Relaxed);
        let conversation = self.load(key)?;
        let handle = Arc::new(Mutex::new(conversation));
        // Two loaders racing keep one handle: the first inserted wins.
        Ok(self
            .cache
            .entry(key.clone())
            .or_insert_with(|| handle)
            .into_value())
    }

    fn load(&self, key: &ConversationKey) -> Result<Conversation, StoreError> {
        let stored_meta = self.conversations.get(key.to_bytes())?;
        let meta = match &stored_meta {
            None => None,
            Some(bytes) => Some(decode::<ConversationMeta>(bytes)?),
        };
        let mut entries = Vec::new();
        if let Some(meta) = &meta {
            entries.reserve(meta.message_count as usize);
            for item in self.messages.scan_prefix(meta.id.to_be_bytes()) {
                let (_, value) = item?;
                let message: StoredMessage = decode(&value)?;
                let before = entries.last().map_or(0, |e: &Entry| e.cum_tokens);
                entries.push(Entry::new(&message, before));
            }
        }
        Ok(Conversation {
            key: key.clone(),
            meta,
            stored_meta,
            entries,
        })
    }

    /// Re-reads a conversation whose commit found it stale.
    pub fn reload(&self, conversation: &mut Conversation) -> Result<(), StoreError> {
        *conversation = self.load(&conversation.key)?;
        Ok(())
    }

    /// Reads stored messages by turn, in the order asked. A turn that is missing is an error:
    /// the index said it was there.
    pub fn messages(
        &self,
        conversation: &Conversation,
        turns: impl IntoIterator<Item = u64>,
    ) -> Result<Vec<StoredMessage>, StoreError> {
        let Some(meta) = &conversation.meta else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for turn in turns {
            let bytes = self
                .messages
                .get(message_key(meta.id, turn))?
                .ok_or_else(|| StoreError::Corrupt(format!("turn {turn} is missing")))?;
            out.push(decode(&bytes)?);
        }
        Ok(out)
    }

    /// Applies `change` to `conversation` in one transaction, assigning turn numbers to the
    /// added messages. Fails with [`StoreError::Stale`] when the stored conversation is not the
    /// one `conversation` holds; the caller then reloads and plans again. On success the
    /// in-memory index is updated to match; on any failure it is left as it was.
    pub fn commit(
        &self,
        conversation: &mut Conversation,
        mut change: Change,
    ) -> Result<(), StoreError> {
        let now = now_ms();
        let mut meta = match &conversation.meta {
            Some(meta) => meta.clone(),
            None => ConversationMeta {
                id: self.db.generate_id()?,
                next_turn: 1,
                message_count: 0,
                total_tokens: 0,
                created_ms: now,
                last_activity_ms: now,
                tokens_forwarded: 0,
            },
        };
        for message in &mut change.add {
            message.turn = meta.next_turn;
            meta.next_turn += 1;
        }
        // Entries are in turn order: each removed turn is found by binary search.
        let removed: Vec<usize> = change
            .remove_turns
            .iter()
            .filter_map(|turn| {
                conversation
                    .entries
                    .binary_search_by_key(turn, |e| e.turn)
                    .ok()
            })
            .collect();
        let removed_tokens: u64 = removed
            .iter()
            .map(|&i| u64::from(conversation.entries[i].tokens))
            .sum();
        let added_tokens: u64 = change.add.iter().map(|m| u64::from(m.tokens)).sum();
        meta.message_count = (conversation.entries.len() - removed.len() + change.add.len()) as u64;
        meta.total_tokens = meta.total_tokens - removed_tokens + added_tokens;
        meta.last_activity_ms = now;
        meta.tokens_forwarded += change.tokens_forwarded;

        let key = conversation.key.to_bytes();
        let meta_bytes = encode(&meta)?;
        let added = change
            .add
            .iter()
            .map(|m| Ok((message_key(meta.id, m.turn), encode(m)?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        let expected = conversation.stored_meta.clone();

        let result = (&self.conversations, &self.messages).transaction(|(convs, msgs)| {
            if convs.get(&key)? != expected {
                return Err(ConflictableTransactionError::Abort(()));
            }
            for turn in &change.remove_turns {
                msgs.remove(&message_key(meta.id, *turn)[..])?;
            }
            for (k, v) in &added {
                msgs.insert(&k[..], v.as_slice())?;
            }
            convs.insert(key.as_slice(), meta_bytes.as_slice())?;
            Ok(())
        });
        match result {
            Ok(()) => {}
            Err(TransactionError::Abort(())) => return Err(StoreError::Stale),
            Err(TransactionError::Storage(err)) => return Err(StoreError::Sled(err)),
        }

        let mut removed = removed;
        removed.sort_unstable();
        for i in removed.into_iter().rev() {
            conversation.entries.remove(i);
        }
        for message in &change.add {
            let before = conversation.entries.last().map_or(0, |e| e.cum_tokens);
            conversation.entries.push(Entry::new(message, before));
        }
        conversation.meta = Some(meta);
        conversation.stored_meta = Some(sled::IVec::from(meta_bytes));
        Ok(())
    }

    /// Refreshes the cache's weight of a conversation after it grew. Only the handle the cache
    /// still holds is put back: after a delete or an eviction a newer handle may be there, and
    /// an old one must not replace it.
    pub fn touch(&self, key: &ConversationKey, handle: &Handle) {
        if self
            .cache
            .get(key)
            .is_some_and(|current| Arc::ptr_eq(&current, handle))
        {
            self.cache.insert(key.clone(), Arc::clone(handle));
        }
    }

    /// Waits until earlier commits are on disk (group commit). With interval durability this
    /// returns at once: the background flush covers it.
    pub async fn sync(&self) -> Result<(), StoreError> {
        match &self.flusher {
            Some(flusher) => Ok(flusher.sync().await?),
            None => Ok(()),
        }
    }

    /// True when the store answers a read.
    pub fn is_ready(&self) -> bool {
        self.conversations.get(b"\xff-readiness-probe").is_ok()
    }

    /// Flushes everything and stops the background flushing: the last step of shutdown. The
    /// background tasks are awaited, so once this returns they hold no handle on the database
    /// and the store can be opened again by the same process.
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
        self.db.flush()?;
        Ok(())
    }

    /// The data directory the store lives in.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The `summaries` tree (read and written by the compression stage).
    pub fn summaries_tree(&self) -> &sled::Tree {
        &self.summaries
    }

    /// Bytes the store takes on disk.
    pub fn size_on_disk(&self) -> u64 {
        self.db.size_on_disk().unwrap_or(0)
    }
}

/// The folder for a conversation's files: `{data_dir}/workspaces/{tenant}/{agent}/{conversation}`,
/// each name reduced to `[A-Za-z0-9_-]` (at most 64 characters) and followed by a hash of the
/// full id, so the path stays inside the data directory whatever the id (`..`, `/etc`, a very
/// long id) and two ids never share a folder.
pub fn workspace_dir(data_dir: &Path, key: &ConversationKey) -> PathBuf {
    data_dir
        .join("workspaces")
        .join(safe_name(key.tenant.as_str()))
        .join(safe_name(&key.agent))
        .join(safe_name(&key.conversation))
}

fn safe_name(id: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut name: String = id
        .chars()
        .take(64)
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
    for b in &digest[..4] {
        name.push_str(&format!("{b:02x}"));
    }
    name
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|err| StoreError::Corrupt(err.to_string()))
}

fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|err| StoreError::Corrupt(err.to_string()))
}

/// How long [`open_locked`] waits for a previous holder of the database's file lock.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Opens the database. A store closed a moment ago in this process (a restart) can hold the
/// file lock until sled's I/O threads let go of it, so a lock conflict is retried for a short
/// while; a second process on the same data directory still gets the error.
fn open_locked(config: &sled::Config) -> Result<sled::Db, sled::Error> {
    let started = std::time::Instant::now();
    loop {
        match config.open() {
            Err(sled::Error::Io(err))
                if err.to_string().contains("could not acquire lock")
                    && started.elapsed() < LOCK_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            result => return result,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::TenantId;

    /// A conversation of tenant `t`, agent `default` (also for `store::admin`'s tests).
    pub(super) fn key(conversation: &str) -> ConversationKey {
        ConversationKey {
            tenant: TenantId::from_token(Some("t")),
            agent: "default".into(),
            conversation: conversation.into(),
        }
    }

    fn message(role: Role, text: &str) -> StoredMessage {
        StoredMessage {
            turn: 0,
            role,
            origin: Origin::Client,
            at_ms: now_ms(),
            tokens: 3,
            fingerprint: text.len() as u64,
            message: RawValue::from_string(
                serde_json::json!({"role": role.as_str(), "content": text}).to_string(),
            )
            .unwrap(),
        }
    }

    fn open(dir: &Path) -> Store {
        Store::open(dir, Durability::Commit, 1 << 20, 1 << 20).unwrap()
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
                },
            )
            .unwrap();
        assert_eq!(
            second.entries.iter().map(|e| e.turn).collect::<Vec<_>>(),
            [2]
        );
        assert_eq!(store.messages.len(), 1);
    }
}
