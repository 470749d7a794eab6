//! Operator access to the store: listing, reading a conversation whole, export and import,
//! complete deletion, and the `ttl` tree the sweeper reads.
//!
//! A second `impl Store` block, kept apart from the request path. Everything that changes a
//! conversation here takes the conversation's lock (the same handle the request path uses)
//! and writes in one sled transaction that first checks the stored meta is the one it read,
//! exactly like a commit: no reader ever sees a half-deleted or half-imported conversation,
//! and a request racing with a delete either commits before it (and is deleted) or finds its
//! handle reset and starts a fresh conversation.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};

use super::{
    Conversation, ConversationMeta, Handle, Store, StoreError, StoredMessage, decode, encode, lock,
    message_key, now_ms,
};
use crate::identity::ConversationKey;

/// The most keys one listing call looks at.
const MAX_LIST_SCAN: usize = 10_000;

/// How often a delete or import retries when a commit changed the conversation under it.
const MAX_ATTEMPTS: usize = 8;

/// The TTL a conversation's requests asked for, as last seen (`ttl` tree).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TtlRecord {
    /// Milliseconds of idleness after which the conversation is deleted; `None`: keep forever.
    pub ttl_ms: Option<u64>,
    /// When the record was written (UTC ms): lets the sweeper drop records whose conversation
    /// was never stored.
    pub set_ms: i64,
}

impl TtlRecord {
    pub fn ttl(&self) -> Option<Duration> {
        self.ttl_ms.map(Duration::from_millis)
    }
}

/// A page of TTL records (key bytes and record), and whether more follow.
pub type TtlPage = (Vec<(Vec<u8>, TtlRecord)>, bool);

/// One conversation in a listing.
#[derive(Debug, Clone)]
pub struct ConversationSummary {
    pub key: ConversationKey,
    pub meta: ConversationMeta,
    pub summary_count: usize,
    pub ttl: Option<TtlRecord>,
}

/// What a delete removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    pub messages: usize,
    pub summaries: usize,
}

/// What an import did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Messages appended.
    pub added: usize,
    /// Messages already stored, not stored again.
    pub already_stored: usize,
    pub summaries_added: usize,
    /// Summaries not imported: already there, or the conversation was not empty (their turn
    /// ranges would not match the renumbered messages).
    pub summaries_skipped: usize,
}

/// What an import keeps of the exported conversation's record, for an empty target.
#[derive(Debug, Clone, Copy, Default)]
pub struct ImportMeta {
    pub created_ms: Option<i64>,
    pub last_activity_ms: Option<i64>,
    pub next_turn: Option<u64>,
}

impl Store {
    /// Conversations whose state is cached in memory.
    pub fn cached_conversations(&self) -> u64 {
        self.cache.run_pending_tasks();
        self.cache.entry_count()
    }

    /// Lookups in the conversation cache so far, and how many missed.
    pub fn cache_counts(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering;
        (
            self.cache_lookups.load(Ordering::Relaxed),
            self.cache_misses.load(Ordering::Relaxed),
        )
    }

    /// True when `needle` occurs in any key or value of any tree: a full scan, to prove a
    /// deletion left no trace (tests, audits). Slow on a large store.
    pub fn any_trace_of(&self, needle: &[u8]) -> Result<bool, StoreError> {
        if needle.is_empty() {
            return Ok(true);
        }
        let found = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        for name in self.db.tree_names() {
            let tree = self.db.open_tree(&name)?;
            for item in tree.iter() {
                let (key, value) = item?;
                if found(&key) || found(&value) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Drops a conversation's cached state (it is read from disk on next use).
    pub fn invalidate(&self, key: &ConversationKey) {
        self.cache.invalidate(key);
    }

    /// The stored record of a conversation, read from disk (not the cache).
    pub fn meta(&self, key: &ConversationKey) -> Result<Option<ConversationMeta>, StoreError> {
        read(&self.conversations, key)
    }

    /// Lists conversations whose key starts with `prefix` (a tenant, or tenant and agent, as
    /// `tenant \0` / `tenant \0 agent \0`), after the key `after` (a cursor), at most `limit`.
    /// Returns the page and the cursor of the next one.
    pub fn list(
        &self,
        prefix: &[u8],
        agent: Option<&str>,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<(Vec<ConversationSummary>, Option<Vec<u8>>), StoreError> {
        let mut out: Vec<ConversationSummary> = Vec::new();
        let mut last_scanned: Option<Vec<u8>> = None;
        let start: Vec<u8> = match after {
            Some(after) if after >= prefix => {
                let mut start = after.to_vec();
                start.push(0);
                start
            }
            _ => prefix.to_vec(),
        };
        for (scanned, item) in self.conversations.range(start..).enumerate() {
            let (key_bytes, value) = item?;
            if !key_bytes.starts_with(prefix) {
                break;
            }
            // A filter that matches little must not walk the whole store in one call: the
            // page ends early, with a cursor to go on from.
            if scanned == MAX_LIST_SCAN {
                return Ok((out, last_scanned));
            }
            last_scanned = Some(key_bytes.to_vec());
            let Some(key) = ConversationKey::from_bytes(&key_bytes) else {
                continue;
            };
            if agent.is_some_and(|a| a != key.agent) {
                continue;
            }
            if out.len() == limit {
                let cursor = out.last().map(|s| s.key.to_bytes());
                return Ok((out, cursor));
            }
            let meta: ConversationMeta = decode(&value)?;
            out.push(ConversationSummary {
                summary_count: self.summaries.scan_prefix(meta.id.to_be_bytes()).count(),
                ttl: self.ttl_of(&key)?,
                key,
                meta,
            });
        }
        Ok((out, None))
    }

    /// Up to `limit` conversations (key and record) after the key `after`, in key order: the
    /// sweeper's bounded walk. The second value is false when the walk reached the end.
    pub fn scan(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<(Vec<(ConversationKey, ConversationMeta)>, bool), StoreError> {
        let range = keys_after(&self.conversations, after);
        let mut out = Vec::new();
        for item in range {
            if out.len() == limit {
                return Ok((out, true));
            }
            let (key_bytes, value) = item?;
            let Some(key) = ConversationKey::from_bytes(&key_bytes) else {
                continue;
            };
            out.push((key, decode(&value)?));
        }
        Ok((out, false))
    }

    /// Every stored message of the conversation with record `meta`, in turn order.
    pub fn all_messages(&self, meta: &ConversationMeta) -> Result<Vec<StoredMessage>, StoreError> {
        self.messages
            .scan_prefix(meta.id.to_be_bytes())
            .map(|item| decode(&item?.1))
            .collect()
    }

    /// The summary records of a conversation as stored (opaque JSON), by number.
    pub fn summaries_of(
        &self,
        meta: &ConversationMeta,
    ) -> Result<Vec<(u64, Box<RawValue>)>, StoreError> {
        let mut out = Vec::new();
        for item in self.summaries.scan_prefix(meta.id.to_be_bytes()) {
            let (key, value) = item?;
            let number = key
                .get(8..16)
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map_or(0, u64::from_be_bytes);
            let text = String::from_utf8(value.to_vec())
                .map_err(|_| StoreError::Corrupt("a summary record is not UTF-8".into()))?;
            let raw = RawValue::from_string(text)
                .map_err(|err| StoreError::Corrupt(format!("a summary record: {err}")))?;
            out.push((number, raw));
        }
        Ok(out)
    }

    /// The TTL last asked for by the conversation's requests, if any.
    pub fn ttl_of(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError> {
        read(&self.ttl, key)
    }

    /// Remembers the TTL a request used. Writes only when it changed, so a steady client costs
    /// one read per request; a request without TTL (`None`) on a conversation that never had
    /// one writes nothing.
    pub fn remember_ttl(
        &self,
        key: &ConversationKey,
        ttl: Option<Duration>,
    ) -> Result<(), StoreError> {
        let ttl_ms = ttl.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let current = self.ttl_of(key)?;
        match current {
            Some(record) if record.ttl_ms == ttl_ms => return Ok(()),
            None if ttl_ms.is_none() => return Ok(()),
            _ => {}
        }
        let record = TtlRecord {
            ttl_ms,
            set_ms: now_ms(),
        };
        self.ttl.insert(key.to_bytes(), encode(&record)?)?;
        Ok(())
    }

    /// Up to `limit` TTL records after `after`: the sweeper drops those whose conversation was
    /// never stored.
    pub fn scan_ttl(&self, after: Option<&[u8]>, limit: usize) -> Result<TtlPage, StoreError> {
        let range = keys_after(&self.ttl, after);
        let mut out = Vec::new();
        for item in range {
            if out.len() == limit {
                return Ok((out, true));
            }
            let (key, value) = item?;
            out.push((key.to_vec(), decode(&value)?));
        }
        Ok((out, false))
    }

    /// Removes a TTL record whose conversation does not exist (checked in the same
    /// transaction).
    pub fn drop_orphan_ttl(&self, key_bytes: &[u8]) -> Result<bool, StoreError> {
        let result = (&self.conversations, &self.ttl).transaction(|(convs, ttl)| {
            if convs.get(key_bytes)?.is_some() {
                return Ok(false);
            }
            Ok(ttl.remove(key_bytes)?.is_some())
        });
        done_or_false(result)
    }

    /// Writes a summary record only if the conversation still has the record id
    /// `conversation_id`, checked in the same transaction: a summary that finishes after its
    /// conversation was deleted (or deleted and started afresh) is dropped, not left behind.
    /// Returns false when it was dropped. Call it with the conversation's lock held and write
    /// the Markdown copy under the same lock only when it returns true: a delete takes that
    /// lock, so no file outlives its conversation.
    pub fn put_summary_if_current(
        &self,
        key: &ConversationKey,
        conversation_id: u64,
        number: u64,
        record: &[u8],
    ) -> Result<bool, StoreError> {
        let key_bytes = key.to_bytes();
        let result = (&self.conversations, &self.summaries).transaction(|(convs, sums)| {
            let current = match convs.get(&key_bytes)? {
                None => None,
                Some(bytes) => serde_json::from_slice::<ConversationMeta>(&bytes)
                    .ok()
                    .map(|m| m.id),
            };
            if current != Some(conversation_id) {
                return Ok(false);
            }
            sums.insert(&message_key(conversation_id, number)[..], record)?;
            Ok(true)
        });
        done_or_false(result)
    }

    /// Deletes a conversation completely: its record, messages, summaries and TTL record in one
    /// transaction, under the conversation's lock; then its cached state and its workspace
    /// folder. `None` when it did not exist (its TTL record and cache entry are dropped all the
    /// same). The recall index is not the store's: the caller forgets it.
    pub fn delete_conversation(
        &self,
        key: &ConversationKey,
    ) -> Result<Option<Deleted>, StoreError> {
        self.delete_with(key, None)
    }

    /// Deletes a conversation as [`Store::delete_conversation`] does, only if its last
    /// activity (checked in the deleting transaction) is before `cutoff_ms`: the TTL sweeper's
    /// delete, which must not remove a conversation a request just used.
    pub fn delete_idle_conversation(
        &self,
        key: &ConversationKey,
        cutoff_ms: i64,
    ) -> Result<Option<Deleted>, StoreError> {
        self.delete_with(key, Some(cutoff_ms))
    }

    fn delete_with(
        &self,
        key: &ConversationKey,
        cutoff_ms: Option<i64>,
    ) -> Result<Option<Deleted>, StoreError> {
        let handle = self.conversation(key)?;
        let result = {
            let mut conversation = lock(&handle);
            let result = self.delete_locked(key, cutoff_ms);
            // Whatever happened on disk, the in-memory state is read again from it: an empty
            // conversation after a delete, so a request holding this handle starts afresh.
            if let Err(err) = self.reload(&mut conversation) {
                tracing::warn!(error = %err, "reloading a deleted conversation failed");
                reset(&mut conversation);
            }
            result
        };
        // A kept idle conversation (it was used meanwhile) is left alone.
        if cutoff_ms.is_some() && !matches!(result, Ok(Some(_))) {
            return result;
        }
        self.cache.invalidate(key);
        let dir = super::workspace_dir(&self.data_dir, key);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                return Err(StoreError::Corrupt(format!(
                    "the conversation's workspace folder could not be removed: {err}"
                )));
            }
        }
        // The agent's and the tenant's folders go too once empty: their names say the tenant
        // and agent existed. Removing a folder that is not empty fails, harmlessly.
        let workspaces = self.data_dir.join("workspaces");
        for parent in dir.ancestors().skip(1) {
            if parent == workspaces || !parent.starts_with(&workspaces) {
                break;
            }
            if std::fs::remove_dir(parent).is_err() {
                break;
            }
        }
        result
    }

    fn delete_locked(
        &self,
        key: &ConversationKey,
        cutoff_ms: Option<i64>,
    ) -> Result<Option<Deleted>, StoreError> {
        let key_bytes = key.to_bytes();
        for _ in 0..MAX_ATTEMPTS {
            let Some(stored_meta) = self.conversations.get(&key_bytes)? else {
                self.ttl.remove(&key_bytes)?;
                return Ok(None);
            };
            let meta: ConversationMeta = decode(&stored_meta)?;
            if cutoff_ms.is_some_and(|cutoff| meta.last_activity_ms >= cutoff) {
                return Ok(None);
            }
            let prefix = meta.id.to_be_bytes();
            let message_keys = self
                .messages
                .scan_prefix(prefix)
                .keys()
                .collect::<Result<Vec<_>, _>>()?;
            let summary_keys = self
                .summaries
                .scan_prefix(prefix)
                .keys()
                .collect::<Result<Vec<_>, _>>()?;
            let result = (
                &self.conversations,
                &self.messages,
                &self.summaries,
                &self.ttl,
            )
                .transaction(|(convs, msgs, sums, ttl)| {
                    if convs.get(&key_bytes)?.as_ref() != Some(&stored_meta) {
                        return Err(ConflictableTransactionError::Abort(()));
                    }
                    for k in &message_keys {
                        msgs.remove(k)?;
                    }
                    for k in &summary_keys {
                        sums.remove(k)?;
                    }
                    convs.remove(key_bytes.as_slice())?;
                    ttl.remove(key_bytes.as_slice())?;
                    Ok(())
                });
            match result {
                Ok(()) => {
                    // A writer that does not check the meta (a summary written in the
                    // background) may have added a record since the scan: ids are never
                    // reused, so anything left under this id is removed too.
                    let late = self.remove_prefix(&self.messages, &prefix)?
                        + self.remove_prefix(&self.summaries, &prefix)?;
                    if late > 0 {
                        tracing::debug!(late, "removed records written during a delete");
                    }
                    return Ok(Some(Deleted {
                        messages: message_keys.len(),
                        summaries: summary_keys.len(),
                    }));
                }
                Err(TransactionError::Abort(())) => continue,
                Err(TransactionError::Storage(err)) => return Err(StoreError::Sled(err)),
            }
        }
        Err(StoreError::Stale)
    }

    fn remove_prefix(&self, tree: &sled::Tree, prefix: &[u8]) -> Result<usize, StoreError> {
        let mut batch = sled::Batch::default();
        let mut count = 0;
        for key in tree.scan_prefix(prefix).keys() {
            batch.remove(key?);
            count += 1;
        }
        if count > 0 {
            tree.apply_batch(batch)?;
        }
        Ok(count)
    }

    /// Imports messages (and, into an empty conversation, summaries) idempotently: messages
    /// already stored (matched by fingerprint and position) are not stored again; the rest
    /// are appended with their timestamps and token counts. Into an empty conversation the
    /// exported turn numbers and record times are kept, so export then import gives back the
    /// same conversation.
    pub fn import_conversation(
        &self,
        key: &ConversationKey,
        messages: Vec<StoredMessage>,
        summaries: Vec<(u64, Box<RawValue>)>,
        hint: ImportMeta,
    ) -> Result<Imported, StoreError> {
        let handle: Handle = self.conversation(key)?;
        let mut conversation = lock(&handle);
        for _ in 0..MAX_ATTEMPTS {
            self.reload(&mut conversation)?;
            match self.import_once(&conversation, &messages, &summaries, hint) {
                Ok(imported) => {
                    self.reload(&mut conversation)?;
                    return Ok(imported);
                }
                Err(StoreError::Stale) => continue,
                Err(err) => return Err(err),
            }
        }
        Err(StoreError::Stale)
    }

    fn import_once(
        &self,
        conversation: &Conversation,
        messages: &[StoredMessage],
        summaries: &[(u64, Box<RawValue>)],
        hint: ImportMeta,
    ) -> Result<Imported, StoreError> {
        let now = now_ms();
        let stored: Vec<u64> = conversation.entries.iter().map(|e| e.fingerprint).collect();
        let incoming: Vec<u64> = messages.iter().map(|m| m.fingerprint).collect();
        let from = already_stored(&stored, &incoming);
        let new = &messages[from..];
        let mut imported = Imported {
            added: new.len(),
            already_stored: from,
            ..Imported::default()
        };

        let empty = conversation.meta.is_none();
        let mut meta = match &conversation.meta {
            Some(meta) => meta.clone(),
            None => ConversationMeta {
                id: self.db.generate_id()?,
                next_turn: 1,
                message_count: 0,
                total_tokens: 0,
                created_ms: hint
                    .created_ms
                    .or_else(|| messages.iter().map(|m| m.at_ms).min())
                    .unwrap_or(now),
                last_activity_ms: now,
                tokens_forwarded: 0,
            },
        };
        // Into an empty conversation the exported turn numbers are kept when they increase.
        let keep_turns = empty
            && new.windows(2).all(|w| w[0].turn < w[1].turn)
            && new.first().is_none_or(|m| m.turn >= 1);
        let mut added = Vec::with_capacity(new.len());
        for message in new {
            let mut message = message.clone();
            if !keep_turns {
                message.turn = meta.next_turn;
            }
            meta.next_turn = meta.next_turn.max(message.turn + 1);
            meta.total_tokens += u64::from(message.tokens);
            added.push((message_key(meta.id, message.turn), encode(&message)?));
        }
        if empty {
            meta.next_turn = meta.next_turn.max(hint.next_turn.unwrap_or(0));
        }
        meta.message_count += new.len() as u64;
        let newest = new.iter().map(|m| m.at_ms).max();
        meta.last_activity_ms = if empty {
            hint.last_activity_ms.or(newest).unwrap_or(now)
        } else {
            meta.last_activity_ms.max(newest.unwrap_or(i64::MIN))
        };

        let mut summary_rows = Vec::new();
        for (number, record) in summaries {
            let exists = self.summaries.contains_key(message_key(meta.id, *number))?;
            if empty && !exists {
                summary_rows.push((message_key(meta.id, *number), record.get().as_bytes()));
            } else {
                imported.summaries_skipped += 1;
            }
        }
        imported.summaries_added = summary_rows.len();
        if added.is_empty() && summary_rows.is_empty() {
            return Ok(imported);
        }

        let key_bytes = conversation.key.to_bytes();
        let meta_bytes = encode(&meta)?;
        let expected = conversation.stored_meta.clone();
        let result = (&self.conversations, &self.messages, &self.summaries).transaction(
            |(convs, msgs, sums)| {
                if convs.get(&key_bytes)? != expected {
                    return Err(ConflictableTransactionError::Abort(()));
                }
                for (k, v) in &added {
                    msgs.insert(&k[..], v.as_slice())?;
                }
                for (k, v) in &summary_rows {
                    sums.insert(&k[..], *v)?;
                }
                convs.insert(key_bytes.as_slice(), meta_bytes.as_slice())?;
                Ok(())
            },
        );
        match result {
            Ok(()) => Ok(imported),
            Err(TransactionError::Abort(())) => Err(StoreError::Stale),
            Err(TransactionError::Storage(err)) => Err(StoreError::Sled(err)),
        }
    }
}

/// Empties an in-memory conversation.
fn reset(conversation: &mut Conversation) {
    conversation.meta = None;
    conversation.stored_meta = None;
    conversation.entries.clear();
}

/// How many of the `incoming` fingerprints, from the start, are already in `stored`:
/// 1. the stored history is a prefix of the incoming one (a re-import, or an import that
///    extends it): all of it;
/// 2. the incoming history is a run of the stored one (an older export): all of it;
/// 3. the incoming history's start ends with the stored history's end (the stored one was
///    trimmed): up to there;
/// 4. otherwise nothing: everything is new.
pub fn already_stored(stored: &[u64], incoming: &[u64]) -> usize {
    if stored.is_empty() || incoming.is_empty() {
        return 0;
    }
    if incoming.starts_with(stored) {
        return stored.len();
    }
    if incoming.len() <= stored.len() && stored.windows(incoming.len()).any(|w| w == incoming) {
        return incoming.len();
    }
    for p in (1..=incoming.len()).rev() {
        let k = p.min(stored.len());
        if incoming[p - k..p] == stored[stored.len() - k..] {
            return p;
        }
    }
    0
}

/// The result of a transaction that answers `false` rather than aborting.
fn done_or_false(result: Result<bool, TransactionError<()>>) -> Result<bool, StoreError> {
    match result {
        Ok(done) => Ok(done),
        Err(TransactionError::Abort(())) => Ok(false),
        Err(TransactionError::Storage(err)) => Err(StoreError::Sled(err)),
    }
}

/// The record stored under a conversation's key in `tree`, decoded.
fn read<T: for<'de> serde::Deserialize<'de>>(
    tree: &sled::Tree,
    key: &ConversationKey,
) -> Result<Option<T>, StoreError> {
    tree.get(key.to_bytes())?
        .map(|bytes| decode(&bytes))
        .transpose()
}

/// The entries of `tree` whose keys come after `after` (all of them without one): one page of
/// a bounded walk.
fn keys_after(tree: &sled::Tree, after: Option<&[u8]>) -> sled::Iter {
    match after {
        Some(after) => {
            let mut start = after.to_vec();
            start.push(0);
            tree.range(start..)
        }
        None => tree.iter(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Durability;
    use crate::message::Role;
    use crate::store::{Change, Origin};

    use crate::store::tests::key;

    fn message(text: &str) -> StoredMessage {
        StoredMessage {
            turn: 0,
            role: Role::User,
            origin: Origin::Client,
            at_ms: 1000,
            tokens: 3,
            fingerprint: text.len() as u64 * 31 + text.bytes().map(u64::from).sum::<u64>(),
            message: RawValue::from_string(
                serde_json::json!({"role": "user", "content": text}).to_string(),
            )
            .unwrap(),
        }
    }

    #[test]
    fn already_stored_cases() {
        let cases: &[(&[u64], &[u64], usize)] = &[
            (&[], &[1, 2], 0),
            (&[1, 2], &[1, 2], 2),
            (&[1, 2], &[1, 2, 3], 2),
            (&[1, 2, 1, 2], &[1, 2], 2),
            (&[1, 2], &[1, 2, 1, 2], 2),
            (&[3, 4], &[1, 2, 3, 4, 5], 4),
            (&[1, 2, 3, 4], &[2, 3], 2),
            (&[1, 2, 3, 4], &[3, 4, 5], 2),
            (&[9], &[1], 0),
        ];
        for (stored, incoming, expected) in cases {
            assert_eq!(
                already_stored(stored, incoming),
                *expected,
                "{stored:?} {incoming:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_handle_read_before_a_delete_is_stale_and_a_later_commit_starts_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), Durability::Commit, 1 << 20, 1 << 20).unwrap();
        let k = key("c");
        {
            let handle = store.conversation(&k).unwrap();
            let mut conv = lock(&handle);
            let change = Change {
                remove_turns: vec![],
                add: vec![message("a"), message("bb")],
                ..Change::default()
            };
            store.commit(&mut conv, change).unwrap();
        }
        let old_id = store.meta(&k).unwrap().unwrap().id;
        store
            .summaries
            .insert(message_key(old_id, 1), b"{\"number\":1}".as_slice())
            .unwrap();
        // A request that read the conversation before the delete.
        let mut stale = store.load(&k).unwrap();
        let deleted = store.delete_conversation(&k).unwrap().unwrap();
        assert_eq!(
            deleted,
            Deleted {
                messages: 2,
                summaries: 1
            }
        );
        assert!(store.meta(&k).unwrap().is_none());
        assert_eq!(store.messages.len(), 0);
        assert_eq!(store.summaries.len(), 0);
        let err = store
            .commit(
                &mut stale,
                Change {
                    remove_turns: vec![],
                    add: vec![message("c")],
                    ..Change::default()
                },
            )
            .unwrap_err();
        assert!(matches!(err, StoreError::Stale));
        store.reload(&mut stale).unwrap();
        assert!(stale.meta.is_none());
        store
            .commit(
                &mut stale,
                Change {
                    remove_turns: vec![],
                    add: vec![message("c")],
                    ..Change::default()
                },
            )
            .unwrap();
        let meta = store.meta(&k).unwrap().unwrap();
        assert_ne!(meta.id, old_id);
        assert_eq!(meta.message_count, 1);
        assert_eq!(meta.next_turn, 2);
        assert!(
            store
                .delete_conversation(&key("nothing"))
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_summary_of_a_deleted_conversation_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), Durability::Commit, 1 << 20, 1 << 20).unwrap();
        let k = key("c");
        {
            let handle = store.conversation(&k).unwrap();
            let mut conv = lock(&handle);
            let change = Change {
                add: vec![message("a")],
                ..Change::default()
            };
            store.commit(&mut conv, change).unwrap();
        }
        let id = store.meta(&k).unwrap().unwrap().id;
        assert!(store.put_summary_if_current(&k, id, 1, b"{}").unwrap());
        assert!(!store.put_summary_if_current(&k, id + 1, 2, b"{}").unwrap());
        store.delete_conversation(&k).unwrap().unwrap();
        assert!(!store.put_summary_if_current(&k, id, 2, b"{}").unwrap());
        assert_eq!(store.summaries.len(), 0);
    }

    #[tokio::test]
    async fn import_is_idempotent_and_keeps_turns_into_an_empty_conversation() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), Durability::Commit, 1 << 20, 1 << 20).unwrap();
        let k = key("c");
        let mut messages = vec![message("a"), message("bb"), message("ccc")];
        for (i, m) in messages.iter_mut().enumerate() {
            m.turn = 5 + i as u64;
        }
        let summary = RawValue::from_string("{\"number\":1,\"to_turn\":4}".into()).unwrap();
        let hint = ImportMeta {
            created_ms: Some(7),
            last_activity_ms: Some(9),
            next_turn: Some(8),
        };
        let first = store
            .import_conversation(&k, messages.clone(), vec![(1, summary.clone())], hint)
            .unwrap();
        assert_eq!((first.added, first.summaries_added), (3, 1));
        let again = store
            .import_conversation(&k, messages.clone(), vec![(1, summary)], hint)
            .unwrap();
        assert_eq!((again.added, again.already_stored), (0, 3));
        assert_eq!(again.summaries_skipped, 1);
        let meta = store.meta(&k).unwrap().unwrap();
        assert_eq!((meta.created_ms, meta.last_activity_ms), (7, 9));
        assert_eq!(
            (meta.next_turn, meta.message_count, meta.total_tokens),
            (8, 3, 9)
        );
        let turns: Vec<u64> = store
            .all_messages(&meta)
            .unwrap()
            .iter()
            .map(|m| m.turn)
            .collect();
        assert_eq!(turns, [5, 6, 7]);
        // The cached handle sees the import.
        assert_eq!(lock(&store.conversation(&k).unwrap()).entries.len(), 3);
        messages.push(message("dddd"));
        let more = store
            .import_conversation(&k, messages, vec![], ImportMeta::default())
            .unwrap();
        assert_eq!((more.added, more.already_stored), (1, 3));
        let meta = store.meta(&k).unwrap().unwrap();
        assert_eq!((meta.next_turn, meta.message_count), (9, 4));
    }
}
