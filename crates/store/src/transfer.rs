//! Whole conversations in and out: complete deletion and idempotent import.
//!
//! A delete removes the conversation's key after the engine's step is durable (`seal.rs`), so
//! whatever the engine's files still hold of it can no longer be read; an import seals what it
//! stores like a commit.
//!
//! Everything that changes a conversation here takes the conversation's lock (the same handle
//! the request path uses) and writes in one atomic engine step checked against the version it
//! read, exactly like a commit: no reader ever sees a half-deleted or half-imported
//! conversation, and a request racing with a delete either commits before it (and is deleted)
//! or finds its handle reset and starts a fresh conversation.

use serde_json::value::RawValue;

use super::engine::Write;
use super::records::{
    ConversationMeta, Deleted, ImportMeta, Imported, StoredBranch, StoredMessage,
};
use super::seal::{seal_messages, seal_summary};
use super::{Conversation, Handle, Store, StoreError, legacy_workspace_dir, lock, workspace_dir};
use memproxy_base::identity::ConversationKey;

/// How often an import retries when a commit changed the conversation under it.
const MAX_ATTEMPTS: usize = 8;

impl Store {
    /// Deletes a conversation completely: its record, messages, summaries, vectors and TTL
    /// record in one atomic step, under the conversation's lock; once that is durable its key,
    /// so that no byte the engine's files still hold of it can be read; then its cached state
    /// and its workspace folder. `None` when it did not exist (its TTL record and cache entry are
    /// dropped all the same). The recall index is not the store's: the caller forgets it.
    pub fn delete_conversation(
        &self,
        key: &ConversationKey,
    ) -> Result<Option<Deleted>, StoreError> {
        self.delete_with(key, None)
    }

    /// Deletes a conversation as [`Store::delete_conversation`] does, only if its last
    /// activity (checked in the deleting step) is before `cutoff_ms`: the TTL sweeper's
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
        let (result, erased) = {
            let mut conversation = lock(&handle);
            let id = self.engine.meta(key)?.map(|meta| meta.id);
            let result = self.engine.delete(key, cutoff_ms);
            if let Ok(Some(deleted)) = &result {
                self.count_messages(deleted.messages as u64, 0);
            }
            let erased = match (&result, id) {
                (Ok(Some(_)), Some(id)) => {
                    self.forget_damage(id);
                    self.erase_key(key, id)
                }
                _ => Ok(()),
            };
            // Whatever happened in the engine, the in-memory state is read again from it: an
            // empty conversation after a delete, so a request holding this handle starts afresh.
            if let Err(err) = self.reload(&mut conversation) {
                tracing::warn!(error = %err, "reloading a deleted conversation failed");
                conversation.reset();
            }
            (result, erased)
        };
        // A kept idle conversation (it was used meanwhile) is left alone.
        if cutoff_ms.is_some() && !matches!(result, Ok(Some(_))) {
            return result;
        }
        self.cache.invalidate(key);
        // The folder, and the one an earlier version may have written under its old name.
        for dir in [
            workspace_dir(&self.data_dir, key),
            legacy_workspace_dir(&self.data_dir, key),
        ] {
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => return Err(StoreError::File(err)),
            }
            // The agent's and the tenant's folders go too once empty: their names say the
            // tenant and agent existed. Removing a folder that is not empty fails, harmlessly.
            let workspaces = self.data_dir.join("workspaces");
            for parent in dir.ancestors().skip(1) {
                if parent == workspaces || !parent.starts_with(&workspaces) {
                    break;
                }
                if std::fs::remove_dir(parent).is_err() {
                    break;
                }
            }
        }
        // A key that could not be removed leaves the delete incomplete: said here, and the key
        // file is removed when the store next opens (its conversation is gone).
        erased?;
        result
    }

    /// Imports messages (and, into an empty conversation, summaries and closed branches)
    /// idempotently: messages already stored (matched by fingerprint and position) are not
    /// stored again; the rest are appended with their timestamps and token counts. Into an
    /// empty conversation the exported turn numbers, record times and branches are kept, so
    /// export then import gives back the same conversation.
    pub fn import_conversation(
        &self,
        key: &ConversationKey,
        messages: Vec<StoredMessage>,
        summaries: Vec<(u64, Box<RawValue>)>,
        branches: Vec<StoredBranch>,
        hint: ImportMeta,
    ) -> Result<Imported, StoreError> {
        let handle: Handle = self.conversation(key)?;
        let mut conversation = lock(&handle);
        for _ in 0..MAX_ATTEMPTS {
            self.reload(&mut conversation)?;
            match self.import_once(&conversation, &messages, &summaries, &branches, hint) {
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

    /// One import against the conversation as read (`Stale`: a commit changed it since).
    fn import_once(
        &self,
        conversation: &Conversation,
        messages: &[StoredMessage],
        summaries: &[(u64, Box<RawValue>)],
        branches: &[StoredBranch],
        hint: ImportMeta,
    ) -> Result<Imported, StoreError> {
        let stored: Vec<u64> = conversation.entries.iter().map(|e| e.fingerprint).collect();
        let incoming: Vec<u64> = messages.iter().map(|m| m.fingerprint).collect();
        let from = already_stored(&stored, &incoming);
        let new = &messages[from..];
        let empty = conversation.meta.is_none();
        let (mut meta, added) = self.imported_meta(conversation, messages, new, hint)?;
        let wanted = self.wanted_summaries(conversation, &meta, summaries)?;
        // Closed branches go into an empty conversation only, like summaries: their turns
        // name the exported main line.
        let branch_rows: &[StoredBranch] = if empty { branches } else { &[] };
        for branch in branch_rows {
            meta.branches = meta.branches.max(branch.record.number);
            // Turn numbers only grow, branches' included.
            if let Some(last) = branch.messages.last() {
                meta.next_turn = meta.next_turn.max(last.turn + 1);
            }
        }
        let imported = Imported {
            added: new.len(),
            already_stored: from,
            summaries_added: wanted.len(),
            summaries_skipped: summaries.len() - wanted.len(),
            branches_added: branch_rows.len(),
            branches_skipped: branches.len() - branch_rows.len(),
        };
        if added.is_empty() && wanted.is_empty() && branch_rows.is_empty() {
            return Ok(imported);
        }
        self.seal_and_write(conversation, &meta, added, wanted, branch_rows)?;
        Ok(imported)
    }

    /// The conversation's record once the `new` messages of `messages` are imported, and those
    /// messages with their turn numbers: into an empty conversation (a new record, its times
    /// and ledger from `hint`) the exported turn numbers are kept when they increase; else
    /// they follow the stored ones.
    fn imported_meta(
        &self,
        conversation: &Conversation,
        messages: &[StoredMessage],
        new: &[StoredMessage],
        hint: ImportMeta,
    ) -> Result<(ConversationMeta, Vec<StoredMessage>), StoreError> {
        let now = self.clock.now_ms();
        let empty = conversation.meta.is_none();
        let mut meta = match &conversation.meta {
            Some(meta) => meta.clone(),
            None => {
                let mut meta = ConversationMeta::new(self.engine.new_id()?, now);
                meta.created_ms = hint
                    .created_ms
                    .or_else(|| messages.iter().map(|m| m.at_ms).min())
                    .unwrap_or(now);
                meta
            }
        };
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
            added.push(message);
        }
        if empty {
            meta.next_turn = meta.next_turn.max(hint.next_turn.unwrap_or(0));
            // The ledger comes along with a conversation imported whole, once.
            meta.tokens_forwarded = hint.tokens_forwarded.unwrap_or(meta.tokens_forwarded);
            meta.ledger = hint.ledger.unwrap_or(meta.ledger);
        }
        meta.message_count += new.len() as u64;
        let newest = new.iter().map(|m| m.at_ms).max();
        meta.last_activity_ms = if empty {
            hint.last_activity_ms.or(newest).unwrap_or(now)
        } else {
            meta.last_activity_ms.max(newest.unwrap_or(i64::MIN))
        };
        Ok((meta, added))
    }

    /// The summaries an import stores: into an empty conversation, those of `summaries` it
    /// does not hold yet; into one with history, none (their turn ranges would not match).
    fn wanted_summaries<'a>(
        &self,
        conversation: &Conversation,
        meta: &ConversationMeta,
        summaries: &'a [(u64, Box<RawValue>)],
    ) -> Result<Vec<(u64, &'a [u8])>, StoreError> {
        let empty = conversation.meta.is_none();
        let existing: Vec<u64> = if empty {
            Vec::new()
        } else {
            self.engine
                .summaries(&conversation.key, meta.id)?
                .into_iter()
                .map(|(number, _)| number)
                .collect()
        };
        Ok(summaries
            .iter()
            .filter(|(number, _)| empty && !existing.contains(number))
            .map(|(number, record)| (*number, record.get().as_bytes()))
            .collect())
    }

    /// Seals the import's messages, summaries and closed branches with the conversation's key
    /// (made now for a new conversation) and writes them with `meta` in one step.
    fn seal_and_write(
        &self,
        conversation: &Conversation,
        meta: &ConversationMeta,
        mut added: Vec<StoredMessage>,
        summaries: Vec<(u64, &[u8])>,
        branches: &[StoredBranch],
    ) -> Result<(), StoreError> {
        let empty = conversation.meta.is_none();
        let (secret, created_key) = self.sealing_key(&conversation.key, meta.id)?;
        let response_ids = super::response_ids_of(&added);
        seal_messages(&secret, &mut added)?;
        let sealed_summaries = summaries
            .into_iter()
            .map(|(number, record)| Ok((number, seal_summary(&secret, record)?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        let summary_rows: Vec<(u64, &[u8])> = sealed_summaries
            .iter()
            .map(|(number, record)| (*number, record.as_slice()))
            .collect();
        // Closed branches are sealed like the main line.
        let mut sealed_branches: Vec<StoredBranch> = branches.to_vec();
        for branch in &mut sealed_branches {
            seal_messages(&secret, &mut branch.messages)?;
            for (_, record) in &mut branch.summaries {
                *record = seal_summary(&secret, record)?;
            }
        }
        self.write_sealed(
            conversation,
            Write {
                meta,
                remove_turns: &[],
                add: &added,
                vectors: &[],
                summaries: &summary_rows,
                remove_summaries: &[],
                branches: &sealed_branches,
                response_ids: &response_ids,
            },
            (created_key && empty).then_some(meta.id),
        )?;
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{key, options};
    use crate::{Change, Origin};
    use memproxy_base::message::Role;

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
            exchange: None,
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
        let store = Store::open(dir.path(), options()).unwrap();
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
        assert!(
            store
                .engine
                .put_summary(&k, old_id, 1, b"{\"number\":1}")
                .unwrap()
        );
        // A request that read the conversation before the delete.
        let mut stale = store.load(&k).unwrap();
        let deleted = store.delete_conversation(&k).unwrap().unwrap();
        assert_eq!(
            deleted,
            Deleted {
                messages: 2,
                summaries: 1,
                branches: 0
            }
        );
        assert!(store.meta(&k).unwrap().is_none());
        assert!(!store.any_trace_of(b"\"bb\"").unwrap());
        assert!(!store.any_trace_of(b"{\"number\":1}").unwrap());
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
    async fn a_delete_removes_the_workspace_under_its_old_name_too() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), options()).unwrap();
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
        let legacy = legacy_workspace_dir(dir.path(), &k).join("memory");
        std::fs::create_dir_all(&legacy).unwrap();
        std::fs::write(legacy.join("summary-1-2.md"), "old copy").unwrap();
        store.delete_conversation(&k).unwrap().unwrap();
        assert!(!legacy.exists());
        assert!(
            !dir.path()
                .join("workspaces")
                .read_dir()
                .unwrap()
                .any(|_| true)
        );
    }

    #[tokio::test]
    async fn a_summary_of_a_deleted_conversation_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), options()).unwrap();
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
        assert!(store.engine.put_summary(&k, id, 1, b"{}").unwrap());
        assert!(!store.engine.put_summary(&k, id + 1, 2, b"{}").unwrap());
        store.delete_conversation(&k).unwrap().unwrap();
        assert!(!store.engine.put_summary(&k, id, 2, b"{}").unwrap());
        assert!(store.engine.summaries(&k, id).unwrap().is_empty());
    }

    #[tokio::test]
    async fn import_is_idempotent_and_keeps_turns_into_an_empty_conversation() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), options()).unwrap();
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
            ..ImportMeta::default()
        };
        let first = store
            .import_conversation(
                &k,
                messages.clone(),
                vec![(1, summary.clone())],
                vec![],
                hint,
            )
            .unwrap();
        assert_eq!((first.added, first.summaries_added), (3, 1));
        let again = store
            .import_conversation(&k, messages.clone(), vec![(1, summary)], vec![], hint)
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
            .all_messages(&k, &meta)
            .unwrap()
            .iter()
            .map(|m| m.turn)
            .collect();
        assert_eq!(turns, [5, 6, 7]);
        // The cached handle sees the import.
        assert_eq!(lock(&store.conversation(&k).unwrap()).entries.len(), 3);
        messages.push(message("dddd"));
        let more = store
            .import_conversation(&k, messages, vec![], vec![], ImportMeta::default())
            .unwrap();
        assert_eq!((more.added, more.already_stored), (1, 3));
        let meta = store.meta(&k).unwrap().unwrap();
        assert_eq!((meta.next_turn, meta.message_count), (9, 4));
    }
}
