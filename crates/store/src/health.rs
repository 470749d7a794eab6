//! The store's health, which readiness reports: whether writes are failing (a full disk) and
//! when to try again, and which conversations the check at open found unreadable.
//!
//! - **The check at open** ("the first read"): every conversation record is read once, and
//!   each conversation's key file looked at (present, 32 bytes). A record that cannot be read
//!   fails the open: the caller then runs without memory. A conversation whose key file is
//!   missing (when its messages are sealed) or malformed is *damaged*: the store opens, its
//!   reads fail (each request on it is answered without memory), and readiness says so until
//!   it is deleted or repaired offline. The same walk removes the key files of conversations
//!   that are not stored (a delete that crashed before removing its key, a first write that
//!   never happened). A key file of the right size holding the wrong bytes is found only when
//!   a value sealed with it is opened (then that request goes without memory); `memproxy store
//!   check` opens every value.
//! - **Failures to write.** A commit, flush, TTL or summary write that fails on the disk marks
//!   the store unwritable: from then on [`Store::writable`] answers no without touching the
//!   engine, except once every [`RETRY_AFTER`], when it reopens the engine (sled fails every
//!   write after one failed, until reopened) and, if that works, empties the cache of
//!   conversations, which may hold writes no flush made durable. A reopen while the disk is
//!   still full may succeed; the next write then fails and marks the store again.

use std::collections::{BTreeSet, HashSet};
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::records::ConversationMeta;
use super::seal::{sealed_message, sealed_record};
use super::{Store, StoreError};
use memproxy_base::identity::ConversationKey;

/// How long after a failed write (or a failed reopen) the store tries to write again.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// What readiness reads of the store.
#[derive(Debug, Default)]
pub struct Health {
    failure: Mutex<Option<Failure>>,
    /// Ids of the conversations found unreadable at open (their key files).
    damaged: Mutex<BTreeSet<u64>>,
}

#[derive(Debug)]
struct Failure {
    reason: String,
    retry_at: Instant,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Health {
    /// Marks the store unwritable because of `err` (a failure to write), unless it is already.
    fn failed(&self, err: &StoreError) {
        let mut failure = lock(&self.failure);
        if failure.is_none() {
            tracing::warn!(
                error = %err,
                retry_s = RETRY_AFTER.as_secs(),
                "the store cannot write: memory is off (requests go through with their own messages) until it can"
            );
            *failure = Some(Failure {
                reason: err.to_string(),
                retry_at: Instant::now() + RETRY_AFTER,
            });
        }
    }
}

impl Store {
    /// Passes `result` on, marking the store unwritable when it is a failure to write.
    pub(super) fn watch<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        if let Err(err) = &result
            && err.is_write_failure()
        {
            self.health.failed(err);
        }
        result
    }

    /// Whether the store takes writes: `Ok(false)` when it does; `Ok(true)` when it did not,
    /// and a retry just reopened the engine (cached state was dropped: the caller drops what
    /// it cached of the store too); [`StoreError::Unwritable`] while writes still fail. Blocks
    /// (a reopen reads the engine's files).
    pub fn writable(&self) -> Result<bool, StoreError> {
        let reason = {
            let mut failure = lock(&self.health.failure);
            let Some(current) = failure.as_mut() else {
                return Ok(false);
            };
            if Instant::now() < current.retry_at {
                return Err(StoreError::Unwritable(current.reason.clone()));
            }
            // The others keep answering no while this one retries.
            current.retry_at = Instant::now() + RETRY_AFTER;
            current.reason.clone()
        };
        match self.engine.reopen() {
            Ok(()) => {
                self.cache.invalidate_all();
                *lock(&self.health.failure) = None;
                tracing::warn!("the store was reopened and takes writes again: memory is back");
                Ok(true)
            }
            Err(err) => {
                tracing::debug!(error = %err, "reopening the store failed; retrying later");
                Err(StoreError::Unwritable(reason))
            }
        }
    }

    /// Why the store is not ready, or `None` when it is: writes failing, reads failing, or
    /// conversations found unreadable at open. Names no conversation.
    pub fn unready_reason(&self) -> Option<String> {
        if let Some(failure) = lock(&self.health.failure).as_ref() {
            return Some(format!(
                "{} (memory is off; retried every {} s)",
                failure.reason,
                RETRY_AFTER.as_secs()
            ));
        }
        if !self.engine.is_ready() {
            if self.shared() {
                // Noticed here first: memory goes off (and is retried) as after a failed
                // request, so the next requests do not each wait for a timeout.
                self.health.failed(&StoreError::Unreachable(
                    "the store does not answer".to_string(),
                ));
            }
            return Some("the store does not answer reads".to_string());
        }
        match self.damaged_conversations() {
            0 => None,
            n => Some(format!(
                "{n} conversation(s) cannot be read: their key files are missing or malformed (requests on them go without memory; run `memproxy store check`)"
            )),
        }
    }

    /// Why writes are failing, while they are.
    pub fn write_failure(&self) -> Option<String> {
        lock(&self.health.failure)
            .as_ref()
            .map(|f| f.reason.clone())
    }

    /// How many conversations the check at open found unreadable (and not deleted since).
    pub fn damaged_conversations(&self) -> usize {
        lock(&self.health.damaged).len()
    }

    /// Forgets a damaged conversation once deleted.
    pub(super) fn forget_damage(&self, id: u64) {
        lock(&self.health.damaged).remove(&id);
    }

    /// The check at open (see the module documentation). Fails when a conversation record
    /// cannot be read.
    pub(super) fn check_on_open(&self) -> Result<(), StoreError> {
        let Some(key_files) = self.keys.files() else {
            // A shared engine (Redis) keeps the keys itself and its conversations are other
            // replicas' too: nothing to walk. One that cannot be reached now leaves the store
            // open with memory off, retried like a failed write, so memory comes back on its
            // own once it answers.
            if let Err(err) = self.engine.reopen() {
                self.health.failed(&err);
            }
            return Ok(());
        };
        let files = key_files.inventory()?;
        let well_formed: HashSet<u64> = files.iter().filter(|f| f.1).map(|f| f.0).collect();
        let mut live = HashSet::new();
        let mut damaged = BTreeSet::new();
        let mut messages = 0;
        self.for_each_conversation(|key, meta| {
            live.insert(meta.id);
            messages += meta.message_count;
            if !well_formed.contains(&meta.id) && self.needs_key(key, meta)? {
                damaged.insert(meta.id);
            }
            Ok(true)
        })?;
        // Owners of long-term records hold keys too.
        let mut after: Option<Vec<u8>> = None;
        loop {
            let (page, next) = self.engine.owners(after.as_deref(), 1000)?;
            live.extend(page.iter().map(|(_, meta)| meta.id));
            match next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        if !damaged.is_empty() {
            tracing::warn!(
                conversations = damaged.len(),
                "conversations whose key file is missing or malformed cannot be read: requests on them go without memory; run `memproxy store check`"
            );
        }
        self.stored_messages.store(messages, Ordering::Relaxed);
        *lock(&self.health.damaged) = damaged;
        let mut removed = 0;
        for (id, _) in files.into_iter().filter(|f| !live.contains(&f.0)) {
            key_files.remove(id)?;
            removed += 1;
        }
        if removed > 0 {
            tracing::info!(removed, "removed the keys of deleted conversations");
        }
        Ok(())
    }

    /// True when conversation `key` holds sealed values, so it cannot be read without its key:
    /// its last message or its newest summary is sealed (values of earlier versions, stored
    /// before sealing, are read without one; a conversation gets its key at its first sealed
    /// write). A message that cannot be read counts as needing the key.
    fn needs_key(
        &self,
        key: &ConversationKey,
        meta: &ConversationMeta,
    ) -> Result<bool, StoreError> {
        let last = meta.next_turn.saturating_sub(1);
        let sealed_message = match self.engine.messages(key, meta.id, &[last]) {
            Ok(messages) => messages
                .iter()
                .any(|m| sealed_message(&m.message).is_some()),
            Err(StoreError::Corrupt(_)) => false,
            Err(err) if err.is_write_failure() => return Err(err),
            Err(_) => true,
        };
        let sealed_summary = self
            .engine
            .latest_summary(key, meta.id)?
            .is_some_and(|record| sealed_record(&record).is_some());
        Ok(sealed_message || sealed_summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{key, message, options};
    use crate::{Change, lock as lock_conversation};
    use memproxy_base::message::Role;
    use std::path::Path;

    fn commit(store: &Store, name: &str) -> u64 {
        let handle = store.conversation(&key(name)).unwrap();
        let mut conversation = lock_conversation(&handle);
        let change = Change {
            add: vec![message(Role::User, name), message(Role::Assistant, "reply")],
            ..Change::default()
        };
        store.commit(&mut conversation, change).unwrap();
        conversation.meta.as_ref().unwrap().id
    }

    fn key_file(dir: &Path, id: u64) -> std::path::PathBuf {
        dir.join("keys").join(format!("{id:016x}.key"))
    }

    #[tokio::test]
    async fn conversations_whose_keys_are_missing_or_malformed_are_counted_until_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let (missing, malformed) = {
            let store = Store::open(dir.path(), options()).unwrap();
            let ids = (commit(&store, "missing"), commit(&store, "malformed"));
            commit(&store, "fine");
            assert_eq!(store.damaged_conversations(), 0);
            assert!(store.unready_reason().is_none());
            store.close().await.unwrap();
            ids
        };
        std::fs::remove_file(key_file(dir.path(), missing)).unwrap();
        std::fs::write(key_file(dir.path(), malformed), b"not a key").unwrap();

        let store = Store::open(dir.path(), options()).unwrap();
        assert_eq!(store.damaged_conversations(), 2);
        let reason = store.unready_reason().unwrap();
        assert!(reason.contains("2 conversation(s)"), "{reason}");
        // The others read as before; the damaged ones fail to read, without their text.
        let handle = store.conversation(&key("fine")).unwrap();
        assert_eq!(
            store
                .messages(&lock_conversation(&handle), [1])
                .unwrap()
                .len(),
            1
        );
        let handle = store.conversation(&key("missing")).unwrap();
        let err = store
            .messages(&lock_conversation(&handle), [1])
            .unwrap_err();
        assert!(matches!(err, StoreError::KeyMissing(_)), "{err}");
        // The malformed file is kept (it may be repaired by hand); a delete clears the count.
        assert!(key_file(dir.path(), malformed).exists());
        store.delete_conversation(&key("missing")).unwrap().unwrap();
        store
            .delete_conversation(&key("malformed"))
            .unwrap()
            .unwrap();
        assert_eq!(store.damaged_conversations(), 0);
        assert!(store.unready_reason().is_none());
    }

    #[tokio::test]
    async fn after_a_failure_to_write_the_store_refuses_until_a_reopen_works() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), options()).unwrap();
        commit(&store, "kept");
        store.sync().await.unwrap();
        assert!(!store.writable().unwrap());

        let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
        let failed = store.watch::<()>(Err(StoreError::Disk(full)));
        assert!(failed.unwrap_err().is_write_failure());
        let reason = store.unready_reason().unwrap();
        assert!(reason.contains("could not be written"), "{reason}");
        // Until the retry is due the engine is not touched.
        let refused = store.writable().unwrap_err();
        assert!(matches!(refused, StoreError::Unwritable(_)), "{refused}");
        std::thread::sleep(RETRY_AFTER + Duration::from_millis(50));
        assert!(store.writable().unwrap(), "reopened");
        assert!(!store.writable().unwrap());
        assert!(store.write_failure().is_none());
        // What was flushed is there; writes go on.
        let handle = store.conversation(&key("kept")).unwrap();
        assert_eq!(lock_conversation(&handle).entries.len(), 2);
        commit(&store, "after");
        store.sync().await.unwrap();
        store.close().await.unwrap();
    }

    #[test]
    fn which_errors_are_failures_to_write() {
        let io = |kind| std::io::Error::from(kind);
        assert!(StoreError::Disk(io(std::io::ErrorKind::Other)).is_write_failure());
        assert!(StoreError::KeyFile(io(std::io::ErrorKind::StorageFull)).is_write_failure());
        assert!(!StoreError::KeyFile(io(std::io::ErrorKind::NotFound)).is_write_failure());
        assert!(!StoreError::Corrupt("x".into()).is_write_failure());
        assert!(!StoreError::Damaged("x".into()).is_write_failure());
        assert!(!StoreError::KeyMissing(3).is_write_failure());
    }
}
