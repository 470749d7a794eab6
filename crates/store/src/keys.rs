//! Conversation keys: one random 256-bit AES-GCM key per conversation id. Beside an embedded
//! engine (sled) each is in its own file `{data_dir}/keys/{id as 16 hex digits}.key` (32 bytes,
//! mode 0600), outside the engine ([`KeyFiles`]); with a shared engine (Redis) every replica
//! must read the same key, so it is kept in the engine, under the conversation's hash tag, and
//! removed by the conversation's delete in the same step ([`Keys::Engine`]).
//!
//! What erasure means with Redis: once the delete ran, no Redis key holds the conversation's
//! key and no replica can open its sealed values again. Copies the Redis server itself made
//! before the delete (an RDB snapshot, an append-only file not yet rewritten, a replica's
//! backlog) still hold the key *and* the ciphertext until they are rewritten: the server's
//! persistence decides that (`BGREWRITEAOF` and a fresh snapshot after deletes that must be
//! final).
//!
//! Why files and not the engine: sled is log-structured, so a value it removes stays in its
//! file until the segment is reused; a key kept there would outlive its delete exactly as the
//! text did. A file is unlinked and the directory synced, and from then on the key is in no
//! file of the data directory. Every value sealed with it (`seal.rs`) is noise from then on,
//! wherever its bytes still lie.
//!
//! - A key is created (written aside, synced, renamed, the directory synced) before anything
//!   sealed with it is written, so no stored value ever waits for a key that a crash lost.
//! - Ids are never reused (the storage contract), so a key file names one life of one
//!   conversation, and the name says nothing but that number.
//! - Keys are cached in memory (bounded); a delete drops the cached key with the file.
//! - Creation is serialized per id (striped locks): two writers of one conversation (a handle
//!   evicted from the cache while a request still held it) never write two different keys.

use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ring::aead::{AES_256_GCM, LessSafeKey, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

use super::StoreError;
use super::engine::SharedEngine;
use memproxy_base::identity::ConversationKey;

/// A conversation's key, ready to seal and open.
pub type Key = Arc<LessSafeKey>;

/// Bytes of a key.
pub const KEY_LEN: usize = 32;

/// Keys kept in memory: about 1 KiB each with ring's key schedule, so at most a few MiB.
const CACHED_KEYS: u64 = 4096;

/// Locks that serialize the creation of keys, by id.
const CREATE_STRIPES: usize = 16;

/// The key files of one data directory, and a cache of the keys in use.
pub struct KeyFiles {
    dir: PathBuf,
    cache: moka::sync::Cache<u64, Key>,
    creating: [Mutex<()>; CREATE_STRIPES],
    random: SystemRandom,
}

impl std::fmt::Debug for KeyFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyFiles")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn io(err: std::io::Error) -> StoreError {
    StoreError::KeyFile(err)
}

/// Makes a directory's entries (a created, renamed or removed file) durable.
fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io)
}

pub(super) fn key_of(bytes: &[u8]) -> Result<Key, StoreError> {
    let key = UnboundKey::new(&AES_256_GCM, bytes)
        .map_err(|_| StoreError::Corrupt("a conversation key file is malformed".into()))?;
    Ok(Arc::new(LessSafeKey::new(key)))
}

/// The id a key file's name stands for (`{16 hex digits}.key`).
pub(super) fn id_of(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(".key")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

impl KeyFiles {
    /// The key files under `dir`, created (mode 0700) if missing. Temporary files a crash left
    /// behind (a key written aside, never renamed, so never used) are removed.
    pub fn open(dir: PathBuf) -> Result<KeyFiles, StoreError> {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder.create(&dir).map_err(io)?;
        for entry in std::fs::read_dir(&dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|e| e == "tmp") {
                std::fs::remove_file(&path).map_err(io)?;
            }
        }
        Ok(KeyFiles {
            dir,
            cache: moka::sync::Cache::new(CACHED_KEYS),
            creating: std::array::from_fn(|_| Mutex::new(())),
            random: SystemRandom::new(),
        })
    }

    fn path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:016x}.key"))
    }

    /// The key of conversation `id` as its file holds it; `None` when there is no file.
    fn read(&self, id: u64) -> Result<Option<Key>, StoreError> {
        match std::fs::read(self.path(id)) {
            Ok(bytes) if bytes.len() == KEY_LEN => key_of(&bytes).map(Some),
            Ok(_) => Err(StoreError::Corrupt(
                "a conversation key file is malformed".into(),
            )),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(err) => Err(io(err)),
        }
    }

    /// The key of conversation `id`, to open what was sealed with it; `None` when it has none
    /// (deleted, or stored by a version that did not seal). Callers ask only on meeting a
    /// sealed value, which was written after its key was durable: a key this caches is
    /// durable too.
    pub fn get(&self, id: u64) -> Result<Option<Key>, StoreError> {
        if let Some(key) = self.cache.get(&id) {
            return Ok(Some(key));
        }
        let key = self.read(id)?;
        if let Some(key) = &key {
            self.cache.insert(id, Arc::clone(key));
        }
        Ok(key)
    }

    /// The key of conversation `id`, to seal with: its own, or a new one made durable before
    /// this returns. The flag is true when this call created it.
    ///
    /// A key is cached only once durable, and a writer takes a key from the cache or under
    /// the id's creation lock, so nothing is ever sealed with a key a crash could still lose.
    pub fn get_or_create(&self, id: u64) -> Result<(Key, bool), StoreError> {
        if let Some(key) = self.cache.get(&id) {
            return Ok((key, false));
        }
        let stripe = usize::try_from(id % CREATE_STRIPES as u64).unwrap_or(0);
        let _creating = self.creating[stripe]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(key) = self.read(id)? {
            self.cache.insert(id, Arc::clone(&key));
            return Ok((key, false));
        }
        let mut bytes = [0u8; KEY_LEN];
        self.random
            .fill(&mut bytes)
            .map_err(|_| StoreError::Crypto("no random bytes for a key"))?;
        let key = key_of(&bytes)?;
        let written = self.write(id, &bytes);
        bytes.fill(0);
        written?;
        self.cache.insert(id, Arc::clone(&key));
        Ok((key, true))
    }

    /// Writes `bytes` as the key file of conversation `id`, durably: written aside, synced,
    /// renamed, the directory synced. What a failure (a full disk) left aside is removed.
    fn write(&self, id: u64, bytes: &[u8; KEY_LEN]) -> Result<(), StoreError> {
        let partial = self.dir.join(format!("{id:016x}.tmp"));
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let written = options
            .open(&partial)
            .and_then(|mut file| {
                file.write_all(bytes)?;
                file.sync_all()
            })
            .and_then(|()| std::fs::rename(&partial, self.path(id)));
        if let Err(err) = written {
            let _ = std::fs::remove_file(&partial);
            return Err(io(err));
        }
        sync_dir(&self.dir)
    }

    /// Installs a key kept from another data directory (a repair) as the key of conversation
    /// `id`, before anything sealed with it is written.
    pub fn install(&self, id: u64, bytes: &[u8; KEY_LEN]) -> Result<(), StoreError> {
        key_of(bytes)?;
        self.write(id, bytes)
    }

    /// Removes the key of conversation `id` (its file, then the directory entry made durable)
    /// and forgets the cached copy. A key that is already gone is fine.
    pub fn remove(&self, id: u64) -> Result<(), StoreError> {
        self.cache.invalidate(&id);
        match std::fs::remove_file(self.path(id)) {
            Ok(()) => sync_dir(&self.dir),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(io(err)),
        }
    }

    /// Each key file: the id it stands for, and whether it is well formed (32 bytes). Reads
    /// no key.
    pub fn inventory(&self) -> Result<Vec<(u64, bool)>, StoreError> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            if let Some(id) = entry.file_name().to_str().and_then(id_of) {
                let len = entry.metadata().map_err(io)?.len();
                files.push((id, len == KEY_LEN as u64));
            }
        }
        Ok(files)
    }

    /// The ids that have a key file.
    #[cfg(test)]
    pub fn ids(&self) -> Result<Vec<u64>, StoreError> {
        let mut ids = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            let name = entry.map_err(io)?.file_name();
            if let Some(id) = name.to_str().and_then(id_of) {
                ids.push(id);
            }
        }
        Ok(ids)
    }
}

/// Where the conversations' keys are kept (see the module documentation).
pub enum Keys {
    /// Files beside an embedded engine.
    Files(KeyFiles),
    /// In the shared engine itself.
    Engine(EngineKeys),
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Keys::Files(files) => files.fmt(f),
            Keys::Engine(_) => f.write_str("Keys::Engine"),
        }
    }
}

/// Keys kept in a shared engine, and a cache of those in use. Ids are never reused, so a
/// cached key never goes stale; a key deleted by another replica only opens values that are
/// gone with it.
pub struct EngineKeys {
    engine: Arc<dyn SharedEngine>,
    cache: moka::sync::Cache<u64, Key>,
    random: SystemRandom,
}

impl EngineKeys {
    pub fn new(engine: Arc<dyn SharedEngine>) -> EngineKeys {
        EngineKeys {
            engine,
            cache: moka::sync::Cache::new(CACHED_KEYS),
            random: SystemRandom::new(),
        }
    }

    fn checked(bytes: &[u8]) -> Result<Key, StoreError> {
        if bytes.len() != KEY_LEN {
            return Err(StoreError::Corrupt(
                "a conversation key kept in the store is malformed".into(),
            ));
        }
        key_of(bytes)
    }

    fn get(&self, conversation: &ConversationKey, id: u64) -> Result<Option<Key>, StoreError> {
        if let Some(key) = self.cache.get(&id) {
            return Ok(Some(key));
        }
        let Some(bytes) = self.engine.key_bytes(conversation, id)? else {
            return Ok(None);
        };
        let key = Self::checked(&bytes)?;
        self.cache.insert(id, Arc::clone(&key));
        Ok(Some(key))
    }

    fn get_or_create(
        &self,
        conversation: &ConversationKey,
        id: u64,
    ) -> Result<(Key, bool), StoreError> {
        if let Some(key) = self.get(conversation, id)? {
            return Ok((key, false));
        }
        let mut bytes = [0u8; KEY_LEN];
        self.random
            .fill(&mut bytes)
            .map_err(|_| StoreError::Crypto("no random bytes for a key"))?;
        // Two replicas creating at once: the first stored wins, and both use it.
        let stored = self.engine.create_key(conversation, id, &bytes);
        let created = stored.as_ref().is_ok_and(|s| s.as_slice() == bytes);
        bytes.fill(0);
        let key = Self::checked(&stored?)?;
        self.cache.insert(id, Arc::clone(&key));
        Ok((key, created))
    }

    fn remove(&self, conversation: &ConversationKey, id: u64) -> Result<(), StoreError> {
        self.cache.invalidate(&id);
        self.engine.remove_key(conversation, id)
    }
}

impl Keys {
    /// The key of conversation `id` to open what was sealed with it; `None` when it has none.
    pub fn get(&self, conversation: &ConversationKey, id: u64) -> Result<Option<Key>, StoreError> {
        match self {
            Keys::Files(files) => files.get(id),
            Keys::Engine(keys) => keys.get(conversation, id),
        }
    }

    /// The key of conversation `id` to seal with, created (durably) if it has none; true
    /// when this call created it.
    pub fn get_or_create(
        &self,
        conversation: &ConversationKey,
        id: u64,
    ) -> Result<(Key, bool), StoreError> {
        match self {
            Keys::Files(files) => files.get_or_create(id),
            Keys::Engine(keys) => keys.get_or_create(conversation, id),
        }
    }

    /// Removes the key of conversation `id`; a key already gone is fine.
    pub fn remove(&self, conversation: &ConversationKey, id: u64) -> Result<(), StoreError> {
        match self {
            Keys::Files(files) => files.remove(id),
            Keys::Engine(keys) => keys.remove(conversation, id),
        }
    }

    /// The key files (none when keys are kept in the engine).
    pub fn files(&self) -> Option<&KeyFiles> {
        match self {
            Keys::Files(files) => Some(files),
            Keys::Engine(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_created_once_kept_across_a_reopen_and_gone_after_remove() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        let keys = KeyFiles::open(path.clone()).unwrap();
        assert!(keys.get(7).unwrap().is_none());
        let (_, created) = keys.get_or_create(7).unwrap();
        assert!(created);
        let (_, again) = keys.get_or_create(7).unwrap();
        assert!(!again);
        let file = path.join("0000000000000007.key");
        assert_eq!(std::fs::read(&file).unwrap().len(), KEY_LEN);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&file).unwrap().permissions().mode();
            assert_eq!(mode & 0o077, 0, "only the owner reads a key: {mode:o}");
        }
        assert_eq!(keys.ids().unwrap(), [7]);

        // A crash left a key written aside: it is dropped on open; the real key is kept.
        std::fs::write(path.join("0000000000000008.tmp"), [1u8; KEY_LEN]).unwrap();
        let reopened = KeyFiles::open(path.clone()).unwrap();
        assert!(!path.join("0000000000000008.tmp").exists());
        assert!(reopened.get(7).unwrap().is_some());
        assert!(reopened.get(8).unwrap().is_none());

        reopened.remove(7).unwrap();
        assert!(!file.exists());
        assert!(
            reopened.get(7).unwrap().is_none(),
            "the cached copy went too"
        );
        reopened.remove(7).unwrap();
        assert!(reopened.ids().unwrap().is_empty());
    }

    #[test]
    fn a_malformed_key_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let keys = KeyFiles::open(dir.path().to_path_buf()).unwrap();
        std::fs::write(dir.path().join("0000000000000003.key"), b"short").unwrap();
        assert!(matches!(keys.get(3), Err(StoreError::Corrupt(_))));
        assert!(keys.get_or_create(3).is_err());
    }

    #[test]
    fn key_file_names_stand_for_ids() {
        assert_eq!(id_of("00000000000000ff.key"), Some(255));
        assert_eq!(id_of("ff.key"), None);
        assert_eq!(id_of("00000000000000ff.tmp"), None);
        assert_eq!(id_of("zzzzzzzzzzzzzzzz.key"), None);
    }
}
