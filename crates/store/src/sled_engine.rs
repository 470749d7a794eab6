//! The embedded engine: sled, in the data directory's `store/` folder. The default.
//!
//! Trees:
//! - `conversations`: `tenant \0 agent \0 conversation` → [`ConversationMeta`] (JSON); the
//!   record's bytes are the conversation's [`Version`];
//! - `messages`: `conversation id (u64 BE) ++ turn (u64 BE)` → [`StoredMessage`] (JSON), or
//!   a JSON array of up to [`PER_KEY`] of them at consecutive turns, the key the first one's
//!   (`layout::encode_batch`): an exchange's turn and reply under one key, as sled's memory
//!   grows with the keys it holds (README, "Sizing the sidecar"). A turn is at its own key or
//!   in the batch at the turn before it;
//! - `summaries`: `conversation id (u64 BE) ++ summary number (u64 BE)` → record (JSON);
//! - `branches`: `conversation id (u64 BE) ++ branch number (u64 BE) ++ part` → a closed
//!   branch, where `part` is `0 ++ 0 (u64)` for its [`BranchRecord`] (JSON), `1 ++ turn (u64
//!   BE)` for each of its messages and `2 ++ summary number (u64 BE)` for each of its summary
//!   records (both as they were stored on the main line);
//! - `ttl`: `tenant \0 agent \0 conversation` → [`TtlRecord`] (JSON);
//! - `responses`: `tenant \0 response id` → conversation id (u64 BE) ++ the conversation's key
//!   bytes: the Responses API ids a write named (`Write::response_ids`);
//! - `conversation_responses`: `conversation id (u64 BE) ++ response id` → nothing: the same
//!   ids by conversation, so a delete finds them;
//! - `owners`: owner key bytes ([`OwnerKey::to_bytes`]) → [`OwnerMeta`] (JSON);
//! - `owner_records`: owner key bytes `\0 space id` → the record's value;
//! - `vectors`: `conversation id (u64 BE) ++ turn (u64 BE)` → the message's vector (sealed,
//!   `vectors.rs`), as in `messages`;
//! - `owner_vectors`: owner key bytes `\0 space id` → the record's vector (sealed), as in
//!   `owner_records`.
//!
//! Every conditional write is one sled transaction over the trees it touches that first checks
//! the conversation's record, but one: a write that appends messages and trims the oldest (the
//! common commit) writes the new ones past the record's `next_turn`, swaps the record, and then
//! removes what fell below its `first_turn` (`SledEngine::append`), as sled rolls its log
//! buffer to disk twice for every transaction. So the `messages` tree may hold turns outside
//! `first_turn..next_turn` that are not the conversation's (a swap that failed, a crash before
//! or after it): every reader takes that range only.
//!
//! # Failures
//!
//! - **A failed write poisons the database.** When sled cannot write its log (the disk is
//!   full, an I/O error), it keeps the error and fails every later write and flush with it, even
//!   once space is free again; writes it had acknowledged in memory but not flushed are lost.
//!   Only a new open clears it: [`Engine::reopen`] closes the database and opens it again from
//!   what is on disk. sled does not panic on a full disk.
//! - **Damaged files.** At open, sled replays the part of its log written since its last
//!   snapshot. A record there that fails its checksum is taken for the torn end of the log:
//!   sled overwrites the rest of that segment and zeroes the segments after it, and then, when
//!   its snapshot says the log went further, refuses to open ("corrupted data"). A damaged
//!   record in an older part of the log shows up later, as a read of the pages kept there
//!   failing (a scan stops at the first one and repeats the error). On some damage sled panics
//!   instead; [`SledEngine::open`] turns that into an error.
//! - **A half-written snapshot.** sled writes a snapshot to `snap.N.generating` and renames it
//!   once complete; on a full disk the rename never comes, and sled reads such a file at its next
//!   open as a damaged snapshot and refuses to open. Such files never hold the only copy of
//!   anything (the log does), so [`SledEngine::open`] removes them first.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionError};

use super::StoreError;
use super::engine::{Engine, Loaded, Owners, Page, Scope, Version, Write};
use super::layout::{
    BRANCH_RECORD, Rows, assemble_branches, branch_key_parts, branch_rows,
    conversation_response_key, conversations_page, decode, decode_batch, encode, in_order,
    listing_start, live_keys, loaded, message_key, owner_prefix, owner_record_key, owners_page,
    response_key, ttl_page, turn_of,
};
use super::records::{
    ConversationMeta, Deleted, OwnerKey, OwnerMeta, OwnerRecord, StoredBranch, StoredMessage,
    TtlRecord,
};
use memproxy_base::identity::{ConversationKey, TenantId};

// Vectors (recall by meaning): `sled_vectors.rs`.
#[path = "sled_vectors.rs"]
mod vectors;

/// How often a delete retries when a commit changed the conversation under it.
const MAX_ATTEMPTS: usize = 8;

/// How long [`open_locked`] waits for a previous holder of the database's file lock.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The sled engine.
pub struct SledEngine {
    /// How it was opened, to open it again.
    dir: PathBuf,
    config: sled::Config,
    /// The open database; `None` once a reopen failed (every call then fails until the next
    /// reopen succeeds).
    open: RwLock<Option<Arc<Trees>>>,
}

/// An open database and its trees.
pub(super) struct Trees {
    pub(super) db: sled::Db,
    pub(super) conversations: sled::Tree,
    pub(super) messages: sled::Tree,
    pub(super) summaries: sled::Tree,
    pub(super) branches: sled::Tree,
    pub(super) ttl: sled::Tree,
    pub(super) responses: sled::Tree,
    pub(super) conversation_responses: sled::Tree,
    pub(super) owners: sled::Tree,
    pub(super) owner_records: sled::Tree,
    pub(super) vectors: sled::Tree,
    pub(super) owner_vectors: sled::Tree,
}

impl Trees {
    pub(super) fn of(db: sled::Db) -> Result<Trees, StoreError> {
        Ok(Trees {
            conversations: db.open_tree("conversations")?,
            messages: db.open_tree("messages")?,
            summaries: db.open_tree("summaries")?,
            branches: db.open_tree("branches")?,
            ttl: db.open_tree("ttl")?,
            responses: db.open_tree("responses")?,
            conversation_responses: db.open_tree("conversation_responses")?,
            owners: db.open_tree("owners")?,
            owner_records: db.open_tree("owner_records")?,
            vectors: db.open_tree("vectors")?,
            owner_vectors: db.open_tree("owner_vectors")?,
            db,
        })
    }
}

impl std::fmt::Debug for SledEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledEngine").finish_non_exhaustive()
    }
}

impl From<sled::Error> for StoreError {
    fn from(err: sled::Error) -> StoreError {
        match err {
            sled::Error::Io(err) => StoreError::Disk(err),
            sled::Error::Corruption { .. } => {
                StoreError::Damaged("sled found corrupted data in its files".to_string())
            }
            other => StoreError::Engine(Box::new(other)),
        }
    }
}

/// The result of a transaction that answers `false` rather than aborting.
fn done_or_false(result: Result<bool, TransactionError<()>>) -> Result<bool, StoreError> {
    match result {
        Ok(done) => Ok(done),
        Err(TransactionError::Abort(())) => Ok(false),
        Err(TransactionError::Storage(err)) => Err(err.into()),
    }
}

/// The result of a transaction that answers a count, or `None` rather than aborting.
fn done_or_count(
    result: Result<Option<usize>, TransactionError<()>>,
) -> Result<Option<usize>, StoreError> {
    match result {
        Ok(done) => Ok(done),
        Err(TransactionError::Abort(())) => Ok(None),
        Err(TransactionError::Storage(err)) => Err(err.into()),
    }
}

/// A row of a sled walk, its error as the store's.
fn sled_row(
    item: sled::Result<(sled::IVec, sled::IVec)>,
) -> Result<(sled::IVec, sled::IVec), StoreError> {
    item.map_err(StoreError::from)
}

/// The entries of `tree` whose keys come after `after` (all of them without one).
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

impl SledEngine {
    /// Opens (or creates) the database in `dir`. `cache_bytes` is sled's page cache;
    /// `flush_every` its own background flush (`None`: only explicit flushes).
    pub fn open(
        dir: &Path,
        cache_bytes: u64,
        flush_every: Option<std::time::Duration>,
    ) -> Result<SledEngine, StoreError> {
        let config = sled::Config::new()
            .path(dir)
            .cache_capacity(cache_bytes)
            .flush_every_ms(flush_every.map(|d| d.as_millis().max(1) as u64));
        let trees = open_trees(dir, &config)?;
        Ok(SledEngine {
            dir: dir.to_path_buf(),
            config,
            open: RwLock::new(Some(Arc::new(trees))),
        })
    }

    /// The open database, or why there is none.
    fn trees(&self) -> Result<Arc<Trees>, StoreError> {
        self.open
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .ok_or(StoreError::Closed)
    }

    fn remove_prefix(tree: &sled::Tree, prefix: &[u8]) -> Result<usize, StoreError> {
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
}

impl SledEngine {
    /// A write that adds messages at turns the conversation never held and removes only
    /// turns below the new record's `first_turn` (an exchange appended, the oldest trimmed:
    /// the common commit), without a transaction: sled rolls its log buffer twice for every
    /// transaction, a write and a `sync_file_range` each on its IO threads, where single-key
    /// writes only fill the buffer that the next flush writes.
    ///
    /// The messages (and the Responses ids) are written first, at turns from the record's
    /// `next_turn` on, which no reader takes for the conversation's (readers take
    /// `first_turn..next_turn`); then the record is swapped for the new one when it is still
    /// `expected`: that swap is the commit. sled recovers a prefix of its log, so a crash keeps
    /// the record only with the messages written before it. Then every message (and vector)
    /// below the new `first_turn` is removed: the turns trimmed, and any a crash left there
    /// before.
    ///
    /// A message is only written where there is none: a turn already there (a write that
    /// came first, or one left by a crash) sends the write to the transaction (`None`), which
    /// checks the record and overwrites. When the swap finds the record stale, what this call
    /// wrote is removed, each value only while it is still this call's (a transaction may have
    /// written that turn since).
    fn append(
        t: &Trees,
        expected: &Version,
        write: Write<'_>,
        rows: &Rows,
    ) -> Result<Option<Version>, StoreError> {
        let id = write.meta.id;
        let added = &rows.added;
        let undo = |written: &[([u8; 16], Vec<u8>)]| -> Result<(), StoreError> {
            for (k, v) in written {
                // Not ours any more: a transaction wrote the turn since.
                let _ = t
                    .messages
                    .compare_and_swap(k, Some(v.as_slice()), None::<&[u8]>)?;
            }
            Ok(())
        };
        for (n, (k, v)) in added.iter().enumerate() {
            let put = t
                .messages
                .compare_and_swap(k, None::<&[u8]>, Some(v.as_slice()))?;
            if put.is_err() {
                undo(&added[..n])?;
                return Ok(None);
            }
        }
        // The added messages' vectors, beside them (a turn past the stored `next_turn`: no
        // reader takes it before the record below says it is there).
        for (turn, value) in write.vectors {
            t.vectors.insert(message_key(id, *turn), value.as_slice())?;
        }
        for (by_id, by_conversation) in &rows.responses {
            t.responses
                .insert(by_id.as_slice(), rows.response_value.as_slice())?;
            t.conversation_responses
                .insert(by_conversation.as_slice(), &[][..])?;
        }
        let swapped = t.conversations.compare_and_swap(
            rows.key.as_slice(),
            expected.token(),
            Some(rows.meta.as_slice()),
        )?;
        if swapped.is_ok() {
            if !write.remove_turns.is_empty() {
                // The trimmed turns by their keys; then, when the trim passes a multiple of
                // `SWEEP_EVERY`, whatever else is left below the new first turn (a crash here
                // before, or a removal here that failed): no reader looks below the first
                // turn, so what is left there only takes room until then. The range is then
                // empty, one step of sled's iterator, but a step copies a node: at every trim
                // it was 1.5% of a stored exchange's CPU.
                let sweep = write
                    .remove_turns
                    .iter()
                    .any(|turn| turn % SWEEP_EVERY == 0);
                //
                // In `messages` the key of the turn before the new first one stays when it
                // holds a batch with the first turn in it (readers pass over the trimmed
                // turn), and the key before the first turn trimmed goes (such a batch that a
                // trim before this one kept).
                let first = write.meta.first_turn;
                let kept = match first.checked_sub(1) {
                    Some(before) if PER_KEY > 1 => holding(&t.messages, id, first)?
                        .and_then(|(at, _)| (at == message_key(id, before)).then_some(before)),
                    _ => None,
                };
                let earlier = write
                    .remove_turns
                    .iter()
                    .min()
                    .and_then(|t| t.checked_sub(1));
                for (tree, holds_batches) in [(&t.messages, true), (&t.vectors, false)] {
                    let kept = kept.filter(|_| holds_batches);
                    let earlier = earlier.filter(|_| holds_batches);
                    for turn in write.remove_turns.iter().chain(&earlier) {
                        if Some(*turn) != kept {
                            tree.remove(message_key(id, *turn))?;
                        }
                    }
                    if sweep {
                        let below = message_key(id, 0)..message_key(id, kept.unwrap_or(first));
                        let keys = tree.range(below).keys();
                        for k in keys.collect::<Result<Vec<_>, _>>()? {
                            tree.remove(k)?;
                        }
                    }
                }
            }
            return Ok(Some(Version::of(rows.meta.clone())));
        }
        // Stale: nothing written here is the conversation's. The Responses ids go first, as
        // they name the conversation; the messages lie past its `next_turn` meanwhile.
        for (by_id, by_conversation) in &rows.responses {
            t.responses.remove(by_id.as_slice())?;
            t.conversation_responses
                .remove(by_conversation.as_slice())?;
        }
        for (turn, value) in write.vectors {
            // Not ours any more either when a transaction wrote the turn's vector since.
            let _ = t.vectors.compare_and_swap(
                message_key(id, *turn),
                Some(value.as_slice()),
                None::<&[u8]>,
            )?;
        }
        undo(added)?;
        Err(StoreError::Stale)
    }
}

/// The most consecutive turns a `messages` value holds (the module's documentation): two, an
/// exchange's turn and reply, halve the keys sled keeps pages for, and so the memory it grows
/// by with what is stored.
pub(crate) const PER_KEY: usize = 2;

/// A trim that removes a turn numbered a multiple of this also sweeps what is left below the
/// conversation's new first turn ([`SledEngine::append`]): whatever a crash between the
/// record's swap and the trim's removals left there goes within this many trimmed turns.
const SWEEP_EVERY: u64 = 64;

/// The first turn whose key can hold `turn`: that of a batch starting [`PER_KEY`] − 1 turns
/// before it.
pub(crate) fn first_holder(turn: u64) -> u64 {
    turn.saturating_sub(PER_KEY as u64 - 1)
}

/// The key of `messages` that holds conversation `id`'s `turn` and its value: the turn's own,
/// or the batch at the turn before it when that batch holds it.
pub(crate) fn holding(
    messages: &sled::Tree,
    id: u64,
    turn: u64,
) -> Result<Option<([u8; 16], sled::IVec)>, StoreError> {
    let own = message_key(id, turn);
    if let Some(value) = messages.get(own)? {
        return Ok(Some((own, value)));
    }
    let Some(before) = turn.checked_sub(1) else {
        return Ok(None);
    };
    let k = message_key(id, before);
    Ok(messages
        .get(k)?
        .filter(|value| decode_batch(value).is_ok_and(|batch| batch.iter().any(|m| m.turn == turn)))
        .map(|value| (k, value)))
}

/// True when `write` adds messages, every one at a turn the stored record (`expected`) has
/// not reached, under the same id, and removes only turns below its new record's
/// `first_turn`: [`SledEngine::append`] can write it.
fn appends_only(expected: &Version, write: &Write<'_>) -> Result<bool, StoreError> {
    let plain = write
        .remove_turns
        .iter()
        .all(|turn| *turn < write.meta.first_turn)
        && write.summaries.is_empty()
        && write.remove_summaries.is_empty()
        && write.branches.is_empty()
        && !write.add.is_empty();
    if !plain {
        return Ok(false);
    }
    let first_free = match expected.token() {
        None => 0,
        Some(bytes) => {
            let stored: ConversationMeta = decode(bytes)?;
            if stored.id != write.meta.id {
                return Ok(false);
            }
            stored.next_turn
        }
    };
    Ok(write
        .add
        .iter()
        .all(|m| m.turn >= first_free && m.turn < write.meta.next_turn))
}

impl Engine for SledEngine {
    fn name(&self) -> &'static str {
        "sled"
    }

    fn load(&self, key: &ConversationKey) -> Result<Loaded, StoreError> {
        let t = self.trees()?;
        let Some(stored) = t.conversations.get(key.to_bytes())? else {
            return Ok(Loaded::default());
        };
        let meta: ConversationMeta = decode(&stored)?;
        // Turns outside `first_turn..next_turn` are not the conversation's: an append the
        // record never took, a trim cut short (`SledEngine::append`).
        let live = live_keys(&meta);
        let from = message_key(meta.id, first_holder(meta.first_turn));
        let values = t.messages.range(from..live.end).values();
        loaded(
            meta,
            stored.to_vec(),
            values.map(|v| v.map_err(StoreError::from)),
        )
    }

    fn meta(&self, key: &ConversationKey) -> Result<Option<ConversationMeta>, StoreError> {
        let t = self.trees()?;
        t.conversations
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
        let t = self.trees()?;
        turns
            .iter()
            .map(|&turn| {
                let (_, batch) = holding(&t.messages, id, turn)?
                    .ok_or_else(|| StoreError::Corrupt(format!("turn {turn} is missing")))?;
                decode_batch(&batch)?
                    .into_iter()
                    .find(|m| m.turn == turn)
                    .ok_or_else(|| StoreError::Corrupt(format!("turn {turn} is missing")))
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
        let t = self.trees()?;
        if from > to {
            return Ok(Vec::new());
        }
        let keys = message_key(id, first_holder(from))..=message_key(id, to);
        let mut out = Vec::new();
        let mut expected = from;
        for item in t.messages.range(keys) {
            for message in decode_batch(&item?.1)? {
                if in_order(&mut expected, to.saturating_add(1), message.turn) {
                    out.push(message);
                }
            }
        }
        Ok(out)
    }

    fn new_id(&self) -> Result<u64, StoreError> {
        let t = self.trees()?;
        Ok(t.db.generate_id()?)
    }

    fn write(
        &self,
        key: &ConversationKey,
        expected: &Version,
        write: Write<'_>,
    ) -> Result<Version, StoreError> {
        let t = self.trees()?;
        let rows = Rows::of(key, &write, PER_KEY)?;
        if appends_only(expected, &write)?
            && let Some(version) = Self::append(&t, expected, write, &rows)?
        {
            return Ok(version);
        }
        let id = write.meta.id;
        let branch_rows = branch_rows(id, write.branches)?;
        let Rows {
            key,
            meta: meta_bytes,
            added,
            responses,
            response_value,
        } = rows;
        let expected = expected.token();
        // Every turn this write removes or writes again: the keys that hold them go.
        let cleared: BTreeSet<u64> = write
            .remove_turns
            .iter()
            .copied()
            .chain(write.add.iter().map(|m| m.turn))
            .collect();
        let live = write.meta.first_turn..write.meta.next_turn;
        let result = (
            &t.conversations,
            &t.messages,
            &t.summaries,
            &t.branches,
            &t.responses,
            &t.conversation_responses,
            &t.vectors,
        )
            .transaction(
                |(convs, msgs, sums, branches, by_id, by_conversation, vecs)| {
                    if convs.get(&key)?.as_deref() != expected {
                        return Err(ConflictableTransactionError::Abort(()));
                    }
                    // A batch reaching past the turns cleared (at a run's first turn less one, or
                    // at its last) goes whole, and the live turns of it that stay are written
                    // back, each at its own key.
                    for &turn in &cleared {
                        let mut edges = Vec::with_capacity(2);
                        if turn > 0 && !cleared.contains(&(turn - 1)) {
                            edges.push(turn - 1);
                        }
                        if !cleared.contains(&(turn + 1)) {
                            edges.push(turn);
                        }
                        for at in edges {
                            let k = message_key(id, at);
                            let Some(value) = msgs.get(&k[..])? else {
                                continue;
                            };
                            let Ok(batch) = decode_batch(&value) else {
                                continue;
                            };
                            if batch.len() < 2 || !batch.iter().any(|m| cleared.contains(&m.turn)) {
                                continue;
                            }
                            msgs.remove(&k[..])?;
                            for m in &batch {
                                if cleared.contains(&m.turn) || !live.contains(&m.turn) {
                                    continue;
                                }
                                if let Ok(value) = encode(m) {
                                    msgs.insert(&message_key(id, m.turn)[..], value)?;
                                }
                            }
                        }
                    }
                    // A turn removed, or written again, loses its vector with it.
                    for &turn in &cleared {
                        msgs.remove(&message_key(id, turn)[..])?;
                        vecs.remove(&message_key(id, turn)[..])?;
                    }
                    for (k, v) in &added {
                        msgs.insert(&k[..], v.as_slice())?;
                    }
                    for (turn, value) in write.vectors {
                        vecs.insert(&message_key(id, *turn)[..], value.as_slice())?;
                    }
                    for number in write.remove_summaries {
                        sums.remove(&message_key(id, *number)[..])?;
                    }
                    for (number, record) in write.summaries {
                        sums.insert(&message_key(id, *number)[..], *record)?;
                    }
                    for (k, v) in &branch_rows {
                        branches.insert(&k[..], v.as_slice())?;
                    }
                    for (by_id_key, by_conversation_key) in &responses {
                        by_id.insert(by_id_key.as_slice(), response_value.as_slice())?;
                        by_conversation.insert(by_conversation_key.as_slice(), &[][..])?;
                    }
                    convs.insert(key.as_slice(), meta_bytes.as_slice())?;
                    Ok(())
                },
            );
        match result {
            Ok(()) => Ok(Version::of(meta_bytes)),
            Err(TransactionError::Abort(())) => Err(StoreError::Stale),
            Err(TransactionError::Storage(err)) => Err(err.into()),
        }
    }

    fn delete(
        &self,
        key: &ConversationKey,
        idle_before_ms: Option<i64>,
    ) -> Result<Option<Deleted>, StoreError> {
        let t = self.trees()?;
        let key_bytes = key.to_bytes();
        for _ in 0..MAX_ATTEMPTS {
            let Some(stored_meta) = t.conversations.get(&key_bytes)? else {
                t.ttl.remove(&key_bytes)?;
                return Ok(None);
            };
            let meta: ConversationMeta = decode(&stored_meta)?;
            if idle_before_ms.is_some_and(|cutoff| meta.last_activity_ms >= cutoff) {
                return Ok(None);
            }
            let prefix = meta.id.to_be_bytes();
            let live = meta.first_turn..meta.next_turn;
            let mut message_count = 0;
            let message_keys = t
                .messages
                .scan_prefix(prefix)
                .map(|item| {
                    let (k, v) = item?;
                    // The conversation's messages: not the trimmed turn a batch may
                    // still hold below its first turn.
                    message_count += decode_batch(&v).map_or(1, |batch| {
                        batch.iter().filter(|m| live.contains(&m.turn)).count()
                    });
                    Ok(k)
                })
                .collect::<Result<Vec<_>, sled::Error>>()?;
            let summary_keys = t
                .summaries
                .scan_prefix(prefix)
                .keys()
                .collect::<Result<Vec<_>, _>>()?;
            let branch_keys = t
                .branches
                .scan_prefix(prefix)
                .keys()
                .collect::<Result<Vec<_>, _>>()?;
            let vector_keys = t
                .vectors
                .scan_prefix(prefix)
                .keys()
                .collect::<Result<Vec<_>, _>>()?;
            let response_keys = t
                .conversation_responses
                .scan_prefix(prefix)
                .keys()
                .map(|k| {
                    let k = k?;
                    let response_id = String::from_utf8_lossy(&k[8..]).into_owned();
                    Ok((k, response_key(&key.tenant, &response_id)))
                })
                .collect::<Result<Vec<_>, sled::Error>>()?;
            let result = (
                &t.conversations,
                &t.messages,
                &t.summaries,
                &t.branches,
                &t.ttl,
                &t.responses,
                &t.conversation_responses,
                &t.vectors,
            )
                .transaction(
                    |(convs, msgs, sums, branches, ttl, by_id, by_conversation, vecs)| {
                        if convs.get(&key_bytes)?.as_ref() != Some(&stored_meta) {
                            return Err(ConflictableTransactionError::Abort(()));
                        }
                        for k in &message_keys {
                            msgs.remove(k)?;
                        }
                        for k in &summary_keys {
                            sums.remove(k)?;
                        }
                        for k in &branch_keys {
                            branches.remove(k)?;
                        }
                        for k in &vector_keys {
                            vecs.remove(k)?;
                        }
                        for (by_conversation_key, by_id_key) in &response_keys {
                            by_conversation.remove(by_conversation_key)?;
                            by_id.remove(by_id_key.as_slice())?;
                        }
                        convs.remove(key_bytes.as_slice())?;
                        ttl.remove(key_bytes.as_slice())?;
                        Ok(())
                    },
                );
            match result {
                Ok(()) => {
                    // A writer that does not check the record (a summary written in the
                    // background) may have added one since the scan: ids are never reused,
                    // so anything left under this id is removed too.
                    let late = Self::remove_prefix(&t.messages, &prefix)?
                        + Self::remove_prefix(&t.summaries, &prefix)?
                        + Self::remove_prefix(&t.branches, &prefix)?
                        + Self::remove_prefix(&t.vectors, &prefix)?;
                    if late > 0 {
                        tracing::debug!(late, "removed records written during a delete");
                    }
                    return Ok(Some(Deleted {
                        messages: message_count,
                        summaries: summary_keys.len(),
                        branches: branch_keys
                            .iter()
                            .filter(|k| {
                                branch_key_parts(k)
                                    .is_some_and(|(_, part, _)| part == BRANCH_RECORD)
                            })
                            .count(),
                    }));
                }
                Err(TransactionError::Abort(())) => continue,
                Err(TransactionError::Storage(err)) => return Err(err.into()),
            }
        }
        Err(StoreError::Stale)
    }

    fn branches(&self, _key: &ConversationKey, id: u64) -> Result<Vec<StoredBranch>, StoreError> {
        read_branches(&self.trees()?.branches, id)
    }

    fn summaries(
        &self,
        _key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        let t = self.trees()?;
        let mut out = Vec::new();
        for item in t.summaries.scan_prefix(id.to_be_bytes()) {
            let (key, value) = item?;
            out.push((turn_of(&key).unwrap_or(0), value.to_vec()));
        }
        Ok(out)
    }

    fn latest_summary(
        &self,
        _key: &ConversationKey,
        id: u64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let t = self.trees()?;
        // In place: `next_back` copies the leaf it reads, and this runs at every request.
        match t.summaries.scan_prefix(id.to_be_bytes()).last_in_place() {
            None => Ok(None),
            Some(item) => Ok(Some(item?.1.to_vec())),
        }
    }

    fn put_summary(
        &self,
        key: &ConversationKey,
        id: u64,
        number: u64,
        record: &[u8],
    ) -> Result<bool, StoreError> {
        let t = self.trees()?;
        let key_bytes = key.to_bytes();
        let result = (&t.conversations, &t.summaries).transaction(|(convs, sums)| {
            let current = match convs.get(&key_bytes)? {
                None => None,
                Some(bytes) => serde_json::from_slice::<ConversationMeta>(&bytes)
                    .ok()
                    .map(|m| m.id),
            };
            if current != Some(id) {
                return Ok(false);
            }
            sums.insert(&message_key(id, number)[..], record)?;
            Ok(true)
        });
        done_or_false(result)
    }

    fn ttl(&self, key: &ConversationKey) -> Result<Option<TtlRecord>, StoreError> {
        let t = self.trees()?;
        t.ttl
            .get(key.to_bytes())?
            .map(|bytes| decode(&bytes))
            .transpose()
    }

    fn put_ttl(&self, key: &ConversationKey, record: &TtlRecord) -> Result<(), StoreError> {
        let t = self.trees()?;
        t.ttl.insert(key.to_bytes(), encode(record)?)?;
        Ok(())
    }

    fn ttl_page(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(ConversationKey, TtlRecord)>, StoreError> {
        let t = self.trees()?;
        ttl_page(keys_after(&t.ttl, after).map(sled_row), limit)
    }

    fn drop_orphan_ttl(&self, key: &ConversationKey) -> Result<bool, StoreError> {
        let t = self.trees()?;
        let key_bytes = key.to_bytes();
        let result = (&t.conversations, &t.ttl).transaction(|(convs, ttl)| {
            if convs.get(&key_bytes)?.is_some() {
                return Ok(false);
            }
            Ok(ttl.remove(key_bytes.as_slice())?.is_some())
        });
        done_or_false(result)
    }

    fn list(
        &self,
        scope: Scope<'_>,
        after: Option<&[u8]>,
        limit: usize,
        max_scan: usize,
    ) -> Result<Page<(ConversationKey, ConversationMeta)>, StoreError> {
        let t = self.trees()?;
        let (prefix, start) = listing_start(scope, after);
        let rows = t.conversations.range(start..).map(sled_row);
        conversations_page(rows, scope, &prefix, limit, max_scan)
    }

    fn flush(&self) -> Result<(), StoreError> {
        let t = self.trees()?;
        t.db.flush()?;
        Ok(())
    }

    fn is_ready(&self) -> bool {
        self.trees()
            .is_ok_and(|t| t.conversations.get(b"\xff-readiness-probe").is_ok())
    }

    fn size_bytes(&self) -> u64 {
        self.trees()
            .ok()
            .and_then(|t| t.db.size_on_disk().ok())
            .unwrap_or(0)
    }

    fn reopen(&self) -> Result<(), StoreError> {
        let mut open = self
            .open
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The old database is dropped first: it holds the file lock. A call still using it
        // holds it a moment longer, which `open_locked` waits out.
        *open = None;
        *open = Some(Arc::new(open_trees(&self.dir, &self.config)?));
        Ok(())
    }

    fn response_conversation(
        &self,
        tenant: &TenantId,
        response_id: &str,
    ) -> Result<Option<ConversationKey>, StoreError> {
        let t = self.trees()?;
        let Some(value) = t.responses.get(response_key(tenant, response_id))? else {
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
        let Some(meta) = t.conversations.get(key_bytes)? else {
            return Ok(None);
        };
        let meta: ConversationMeta = decode(&meta)?;
        Ok((meta.id == u64::from_be_bytes(*id) && key.tenant == *tenant).then_some(key))
    }

    fn forget_response(&self, tenant: &TenantId, response_id: &str) -> Result<bool, StoreError> {
        let t = self.trees()?;
        let Some(value) = t.responses.remove(response_key(tenant, response_id))? else {
            return Ok(false);
        };
        if let Some((id, _)) = value.split_first_chunk::<8>() {
            t.conversation_responses.remove(conversation_response_key(
                u64::from_be_bytes(*id),
                response_id,
            ))?;
        }
        Ok(true)
    }

    fn any_trace_of(&self, needle: &[u8]) -> Result<bool, StoreError> {
        let t = self.trees()?;
        if needle.is_empty() {
            return Ok(true);
        }
        let found = |bytes: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        for name in t.db.tree_names() {
            let tree = t.db.open_tree(&name)?;
            for item in tree.iter() {
                let (key, value) = item?;
                if found(&key) || found(&value) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }
}

impl Owners for SledEngine {
    fn owner(&self, owner: &OwnerKey) -> Result<Option<OwnerMeta>, StoreError> {
        let t = self.trees()?;
        t.owners
            .get(owner.to_bytes())?
            .map(|bytes| decode(&bytes))
            .transpose()
    }

    fn create_owner(&self, owner: &OwnerKey, meta: OwnerMeta) -> Result<OwnerMeta, StoreError> {
        let t = self.trees()?;
        let encoded = encode(&meta)?;
        match t
            .owners
            .compare_and_swap(owner.to_bytes(), None as Option<&[u8]>, Some(encoded))?
        {
            Ok(()) => Ok(meta),
            Err(current) => decode(&current.current.unwrap_or_default()),
        }
    }

    fn write_owner(
        &self,
        owner: &OwnerKey,
        id: u64,
        put: &[OwnerRecord],
        remove: &[(u8, Vec<u8>)],
    ) -> Result<bool, StoreError> {
        let t = self.trees()?;
        let owner_bytes = owner.to_bytes();
        let result = (&t.owners, &t.owner_records, &t.owner_vectors).transaction(
            |(owners, records, vectors)| {
                let current = owners
                    .get(&owner_bytes)?
                    .and_then(|bytes| serde_json::from_slice::<OwnerMeta>(&bytes).ok());
                if current.map(|m| m.id) != Some(id) {
                    return Ok(false);
                }
                // A record removed loses its vector with it.
                for (space, record_id) in remove {
                    records.remove(owner_record_key(owner, *space, record_id))?;
                    vectors.remove(owner_record_key(owner, *space, record_id))?;
                }
                for record in put {
                    records.insert(
                        owner_record_key(owner, record.space, &record.id),
                        record.value.as_slice(),
                    )?;
                }
                Ok(true)
            },
        );
        done_or_false(result)
    }

    fn owner_record(
        &self,
        owner: &OwnerKey,
        space: u8,
        id: &[u8],
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let t = self.trees()?;
        Ok(t.owner_records
            .get(owner_record_key(owner, space, id))?
            .map(|v| v.to_vec()))
    }

    fn owner_records(
        &self,
        owner: &OwnerKey,
        space: u8,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<OwnerRecord>, StoreError> {
        let t = self.trees()?;
        let prefix = owner_prefix(owner, Some(space));
        let start = match after {
            Some(after) => {
                let mut start = prefix.clone();
                start.extend_from_slice(after);
                start.push(0);
                start
            }
            None => prefix.clone(),
        };
        let mut out = Vec::new();
        for item in t.owner_records.range(start..) {
            let (key, value) = item?;
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
                value: value.to_vec(),
            });
        }
        Ok((out, None))
    }

    fn delete_owner(&self, owner: &OwnerKey) -> Result<Option<u64>, StoreError> {
        let t = self.trees()?;
        let owner_bytes = owner.to_bytes();
        let prefix = owner_prefix(owner, None);
        // The record goes first, in one transaction with the records seen so far; writers
        // check it in theirs, so none can add a record once it is gone, and what one added
        // meanwhile is removed by the sweep after.
        let keys: Vec<sled::IVec> = t
            .owner_records
            .scan_prefix(&prefix)
            .keys()
            .collect::<Result<_, _>>()?;
        let vector_keys: Vec<sled::IVec> = t
            .owner_vectors
            .scan_prefix(&prefix)
            .keys()
            .collect::<Result<_, _>>()?;
        let result = (&t.owners, &t.owner_records, &t.owner_vectors).transaction(
            |(owners, records, vectors)| {
                let removed = owners.remove(owner_bytes.as_slice())?;
                for key in &keys {
                    records.remove(key)?;
                }
                for key in &vector_keys {
                    vectors.remove(key)?;
                }
                Ok(removed.and_then(|bytes| serde_json::from_slice::<OwnerMeta>(&bytes).ok()))
            },
        );
        let removed = match result {
            Ok(removed) => removed,
            Err(TransactionError::Abort(())) => None,
            Err(TransactionError::Storage(err)) => return Err(err.into()),
        };
        Self::remove_prefix(&t.owner_records, &prefix)?;
        Self::remove_prefix(&t.owner_vectors, &prefix)?;
        Ok(removed.map(|m| m.id))
    }

    fn owners(
        &self,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError> {
        let t = self.trees()?;
        owners_page(keys_after(&t.owners, after).map(sled_row), limit)
    }
}

/// The closed branches of conversation `id` in the `branches` tree (also read by salvage).
pub(super) fn read_branches(tree: &sled::Tree, id: u64) -> Result<Vec<StoredBranch>, StoreError> {
    assemble_branches(
        tree.scan_prefix(id.to_be_bytes())
            .map(|item| item.map_err(StoreError::from)),
    )
}

/// Opens the database in `dir` and its trees: partial snapshots removed first (see the module
/// documentation), and a panic of sled's on damaged files turned into an error.
pub(super) fn open_trees(dir: &Path, config: &sled::Config) -> Result<Trees, StoreError> {
    remove_partial_snapshots(dir)?;
    let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Trees::of(open_locked(config)?)
    }));
    opened.unwrap_or_else(|_| {
        Err(StoreError::Damaged(
            "sled failed reading its files (it panicked)".to_string(),
        ))
    })
}

/// Removes the snapshots sled began writing and never finished (`snap.*.generating`).
fn remove_partial_snapshots(dir: &Path) -> Result<(), StoreError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(StoreError::Disk(err)),
    };
    for entry in entries {
        let path = entry.map_err(StoreError::Disk)?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("snap.") && name.ends_with(".generating") {
            tracing::warn!(
                file = name,
                "removing a snapshot sled never finished writing"
            );
            std::fs::remove_file(&path).map_err(StoreError::Disk)?;
        }
    }
    Ok(())
}

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
    use crate::engine::Vectors;

    fn snapshots(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with("snap."))
            .collect()
    }

    #[test]
    fn a_snapshot_sled_never_finished_is_removed_before_it_stops_the_open() {
        let dir = tempfile::tempdir().unwrap();
        let k = crate::tests::key("c");
        let ttl = TtlRecord {
            ttl_ms: Some(1),
            set_ms: 2,
        };
        for _ in 0..2 {
            // The second open writes a snapshot of what the first wrote.
            let engine = SledEngine::open(dir.path(), 1 << 20, None).unwrap();
            engine.put_ttl(&k, &ttl).unwrap();
            engine.flush().unwrap();
        }
        let finished = snapshots(dir.path());
        assert_eq!(finished.len(), 1, "{finished:?}");
        // What a full disk leaves: the next snapshot, half written, never renamed.
        let partial = dir.path().join(format!("{}.generating", finished[0]));
        std::fs::write(&partial, b"half a snapshot").unwrap();
        // sled alone takes it for a damaged snapshot and refuses to open.
        let refused = sled::Config::new().path(dir.path()).open();
        assert!(
            matches!(refused, Err(sled::Error::Corruption { .. })),
            "{refused:?}"
        );
        let engine = SledEngine::open(dir.path(), 1 << 20, None).unwrap();
        assert_eq!(engine.ttl(&k).unwrap().unwrap().ttl_ms, Some(1));
        assert!(!partial.exists());
    }

    /// `last_in_place` (vendor/sled: the newest summary read without copying its leaf) finds
    /// what `next_back` finds, for every prefix and bound, over leaves of large values split
    /// and merged: ids with no key, with keys in one leaf, and with keys over two.
    #[test]
    fn the_last_key_read_in_place_is_the_one_a_reverse_scan_finds() {
        let db = sled::Config::new().temporary(true).open().unwrap();
        let tree = db.open_tree("summaries").unwrap();
        let value = |id: u64, n: u64| vec![(id * 7 + n) as u8; 2_000 + (id % 5) as usize * 500];
        let check = |tree: &sled::Tree, step: &str| {
            for id in 0..320u64 {
                let prefix = id.to_be_bytes();
                let got = tree
                    .scan_prefix(prefix)
                    .last_in_place()
                    .transpose()
                    .unwrap();
                let want = tree.scan_prefix(prefix).next_back().transpose().unwrap();
                assert_eq!(got, want, "id {id} after {step}");
                let (lo, hi) = (message_key(id, 1), message_key(id, 3));
                for (got, want) in [
                    (
                        tree.range(lo..hi).last_in_place(),
                        tree.range(lo..hi).next_back(),
                    ),
                    (
                        tree.range(lo..=hi).last_in_place(),
                        tree.range(lo..=hi).next_back(),
                    ),
                    (
                        tree.range(..=hi).last_in_place(),
                        tree.range(..=hi).next_back(),
                    ),
                ] {
                    assert_eq!(
                        got.transpose().unwrap(),
                        want.transpose().unwrap(),
                        "id {id}'s ranges after {step}"
                    );
                }
            }
        };
        // Every third id has none; the rest one to six, written round-robin so each id's keys
        // land in leaves split around them.
        for n in 0..6u64 {
            for id in (0..300u64).filter(|id| id % 3 != 0 && n <= id % 6) {
                tree.insert(message_key(id, n), value(id, n)).unwrap();
            }
        }
        check(&tree, "the writes");
        for id in (0..300u64).filter(|id| id % 2 == 0) {
            for n in 1..6 {
                tree.remove(message_key(id, n)).unwrap();
            }
        }
        check(&tree, "the removals");
        assert!(
            tree.scan_prefix(999u64.to_be_bytes())
                .last_in_place()
                .is_none()
        );
    }

    fn stored(turn: u64, text: &str) -> StoredMessage {
        let mut message = crate::tests::message(memproxy_base::message::Role::User, text);
        message.turn = turn;
        message
    }

    fn record(id: u64, next_turn: u64, count: u64) -> ConversationMeta {
        let mut meta = ConversationMeta::new(id, 1_000);
        meta.next_turn = next_turn;
        meta.message_count = count;
        meta
    }

    fn adding<'a>(meta: &'a ConversationMeta, add: &'a [StoredMessage]) -> Write<'a> {
        Write {
            meta,
            remove_turns: &[],
            add,
            vectors: &[],
            summaries: &[],
            remove_summaries: &[],
            branches: &[],
            response_ids: &[],
        }
    }

    /// The turns and texts the `messages` tree holds for `id`, whatever the record says.
    fn raw_turns(engine: &SledEngine, id: u64) -> Vec<(u64, String)> {
        let t = engine.trees().unwrap();
        t.messages
            .scan_prefix(id.to_be_bytes())
            .flat_map(|item| decode_batch(&item.unwrap().1).unwrap())
            .map(|message| (message.turn, message.message.get().to_string()))
            .collect()
    }

    /// The turns `loaded` holds, each read back by turn.
    fn live_turns(loaded: &Loaded, engine: &SledEngine, k: &ConversationKey) -> Vec<u64> {
        let id = loaded.meta.as_ref().unwrap().id;
        let turns: Vec<u64> = loaded.entries.iter().map(|e| e.turn).collect();
        assert_eq!(engine.messages(k, id, &turns).unwrap().len(), turns.len());
        turns
    }

    /// A conversation of turns 1 and 2 in a new engine in `dir`: the engine, its key, id and
    /// version.
    fn two_turns(dir: &Path) -> (SledEngine, ConversationKey, u64, Version) {
        let engine = SledEngine::open(dir, 1 << 20, None).unwrap();
        let k = crate::tests::key("c");
        let id = engine.new_id().unwrap();
        let v1 = engine
            .write(
                &k,
                &Version::absent(),
                adding(&record(id, 3, 2), &[stored(1, "m1"), stored(2, "m2")]),
            )
            .unwrap();
        (engine, k, id, v1)
    }

    /// The keys the `messages` tree holds for `id` (their turns).
    fn raw_keys(engine: &SledEngine, id: u64) -> Vec<u64> {
        let t = engine.trees().unwrap();
        t.messages
            .scan_prefix(id.to_be_bytes())
            .keys()
            .map(|k| turn_of(&k.unwrap()).unwrap())
            .collect()
    }

    /// The texts of `loaded`'s turns, read back by turn.
    fn texts(engine: &SledEngine, k: &ConversationKey, id: u64, turns: &[u64]) -> Vec<String> {
        engine
            .messages(k, id, turns)
            .unwrap()
            .iter()
            .map(|m| {
                let message: serde_json::Value = serde_json::from_str(m.message.get()).unwrap();
                message["content"].as_str().unwrap().to_string()
            })
            .collect()
    }

    #[test]
    fn an_exchange_is_one_key_and_a_reply_written_again_splits_it() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, k, id, v1) = two_turns(dir.path());
        // The turn and its reply under one key, the first turn's.
        assert_eq!(raw_keys(&engine, id), [1]);
        assert_eq!(raw_turns(&engine, id).len(), 2);
        let v2 = engine
            .write(
                &k,
                &v1,
                adding(
                    &record(id, 6, 5),
                    &[stored(3, "m3"), stored(4, "m4"), stored(5, "m5")],
                ),
            )
            .unwrap();
        assert_eq!(raw_keys(&engine, id), [1, 3, 5]);
        let loaded = engine.load(&k).unwrap();
        assert_eq!(live_turns(&loaded, &engine, &k), [1, 2, 3, 4, 5]);
        // A batch's second turn read alone, and ranges that start or end inside a batch.
        assert_eq!(texts(&engine, &k, id, &[4, 2]), ["m4", "m2"]);
        let turns = |from, to| -> Vec<u64> {
            let range = engine.range(&k, id, from, to).unwrap();
            range.iter().map(|m| m.turn).collect()
        };
        assert_eq!(turns(2, 3), [2, 3]);
        assert_eq!(turns(4, 4), [4]);
        assert_eq!(turns(1, 9), [1, 2, 3, 4, 5]);
        // Turn 4 written again (a reply replaced: the transaction): its batch goes and turn 3,
        // which stays, is written back at its own key.
        let mut replaced = record(id, 6, 5);
        replaced.first_turn = 1;
        let again = [stored(4, "m4 again"), stored(5, "m5 again")];
        let write = Write {
            remove_turns: &[4, 5],
            ..adding(&replaced, &again)
        };
        assert!(!appends_only(&v2, &write).unwrap());
        let v3 = engine.write(&k, &v2, write).unwrap();
        assert_eq!(raw_keys(&engine, id), [1, 3, 4]);
        let loaded = engine.load(&k).unwrap();
        assert_eq!(loaded.version, v3);
        assert_eq!(live_turns(&loaded, &engine, &k), [1, 2, 3, 4, 5]);
        assert_eq!(
            texts(&engine, &k, id, &[1, 2, 3, 4, 5]),
            ["m1", "m2", "m3", "m4 again", "m5 again"]
        );
        // A branch that cuts the first batch after its first turn: turn 1 stays alone.
        let mut cut = record(id, 2, 1);
        cut.first_turn = 1;
        let write = Write {
            remove_turns: &[2, 3, 4, 5],
            ..adding(&cut, &[])
        };
        engine.write(&k, &v3, write).unwrap();
        assert_eq!(raw_keys(&engine, id), [1]);
        let loaded = engine.load(&k).unwrap();
        assert_eq!(live_turns(&loaded, &engine, &k), [1]);
        assert_eq!(texts(&engine, &k, id, &[1]), ["m1"]);
    }

    #[test]
    fn a_store_of_one_message_a_key_is_read_and_appended_to() {
        // What every sled store held before batches: one message a key.
        let dir = tempfile::tempdir().unwrap();
        let engine = SledEngine::open(dir.path(), 1 << 20, None).unwrap();
        let k = crate::tests::key("c");
        let id = engine.new_id().unwrap();
        let t = engine.trees().unwrap();
        for turn in 1..=3 {
            let value = encode(&stored(turn, &format!("old {turn}"))).unwrap();
            t.messages.insert(message_key(id, turn), value).unwrap();
        }
        let meta = encode(&record(id, 4, 3)).unwrap();
        t.conversations.insert(k.to_bytes(), meta.clone()).unwrap();
        let v1 = Version::of(meta);
        let loaded = engine.load(&k).unwrap();
        assert_eq!(live_turns(&loaded, &engine, &k), [1, 2, 3]);
        // An exchange appended after them, and a trim of the first old turn.
        let mut next = record(id, 6, 4);
        next.first_turn = 2;
        let exchange = [stored(4, "new 4"), stored(5, "new 5")];
        let write = Write {
            remove_turns: &[1],
            ..adding(&next, &exchange)
        };
        assert!(appends_only(&v1, &write).unwrap());
        engine.write(&k, &v1, write).unwrap();
        assert_eq!(raw_keys(&engine, id), [2, 3, 4]);
        let loaded = engine.load(&k).unwrap();
        assert_eq!(live_turns(&loaded, &engine, &k), [2, 3, 4, 5]);
        assert_eq!(
            texts(&engine, &k, id, &[2, 3, 4, 5]),
            ["old 2", "old 3", "new 4", "new 5"]
        );
        let deleted = engine.delete(&k, None).unwrap().unwrap();
        assert_eq!(deleted.messages, 4);
    }

    #[test]
    fn which_writes_append_without_a_transaction() {
        let old = Version::of(encode(&record(7, 3, 2)).unwrap());
        let next = record(7, 5, 4);
        let two = [stored(3, "a"), stored(4, "b")];
        assert!(appends_only(&old, &adding(&next, &two)).unwrap());
        assert!(appends_only(&Version::absent(), &adding(&next, &two)).unwrap());
        // A turn the record has reached, a turn past the new record, another life's record.
        assert!(!appends_only(&old, &adding(&next, &[stored(2, "a")])).unwrap());
        assert!(!appends_only(&old, &adding(&next, &[stored(5, "a")])).unwrap());
        let other_life = Version::of(encode(&record(6, 3, 2)).unwrap());
        assert!(!appends_only(&other_life, &adding(&next, &two)).unwrap());
        // Anything but adding goes through the transaction.
        assert!(!appends_only(&old, &adding(&next, &[])).unwrap());
        let trim = Write {
            remove_turns: &[1],
            ..adding(&next, &two)
        };
        assert!(!appends_only(&old, &trim).unwrap());
        let summary = Write {
            summaries: &[(1, b"{}")],
            ..adding(&next, &two)
        };
        assert!(!appends_only(&old, &summary).unwrap());
        let unsummarized = Write {
            remove_summaries: &[1],
            ..adding(&next, &two)
        };
        assert!(!appends_only(&old, &unsummarized).unwrap());
        // A trim of turns below the new record's first turn appends; one that removes a turn
        // the record still holds does not.
        let trimmed = ConversationMeta {
            first_turn: 2,
            ..record(7, 5, 3)
        };
        let trim = Write {
            remove_turns: &[1],
            ..adding(&trimmed, &two)
        };
        assert!(appends_only(&old, &trim).unwrap());
        let replaced = Write {
            remove_turns: &[1, 2],
            ..adding(&trimmed, &two)
        };
        assert!(!appends_only(&old, &replaced).unwrap());
    }

    #[test]
    fn a_trim_goes_after_the_record_and_takes_what_a_crash_left_below_it() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, k, id, v1) = two_turns(dir.path());
        let v2 = engine
            .write(
                &k,
                &v1,
                adding(&record(id, 5, 4), &[stored(3, "m3"), stored(4, "m4")]),
            )
            .unwrap();
        let vector = |turn: u64| (turn, format!("v{turn}").into_bytes());
        let put = engine
            .put_vectors(&k, id, &[vector(1), vector(2), vector(3)])
            .unwrap();
        assert_eq!(put, Some(3));
        // Turns 1 and 2 trimmed with turn 5 added: the record now starts at turn 3.
        let trimmed = ConversationMeta {
            first_turn: 3,
            ..record(id, 6, 3)
        };
        let five = [stored(5, "m5")];
        let trim = Write {
            remove_turns: &[1, 2],
            ..adding(&trimmed, &five)
        };
        assert!(appends_only(&v2, &trim).unwrap());
        let v3 = engine.write(&k, &v2, trim).unwrap();
        let raw = |engine: &SledEngine| -> Vec<u64> {
            raw_turns(engine, id).iter().map(|(t, _)| *t).collect()
        };
        assert_eq!(raw(&engine), [3, 4, 5]);
        let vectors: Vec<u64> = engine
            .vectors(&k, id)
            .unwrap()
            .iter()
            .map(|v| v.0)
            .collect();
        assert_eq!(vectors, [3]);
        let loaded = engine.load(&k).unwrap();
        assert_eq!(loaded.version, v3);
        assert_eq!(live_turns(&loaded, &engine, &k), [3, 4, 5]);
        // A trim a crash cut short: turn 1 is back on disk, below the record's first turn,
        // and never read.
        let t = engine.trees().unwrap();
        let left = encode(&stored(1, "left")).unwrap();
        t.messages.insert(message_key(id, 1), left).unwrap();
        assert_eq!(
            live_turns(&engine.load(&k).unwrap(), &engine, &k),
            [3, 4, 5]
        );
        assert_eq!(engine.range(&k, id, 3, 5).unwrap().len(), 3);
        // The next trim leaves it (it passes no multiple of `SWEEP_EVERY`), and it is still
        // never read.
        let trimmed = ConversationMeta {
            first_turn: 4,
            ..record(id, 7, 3)
        };
        let six = [stored(6, "m6")];
        let trim = Write {
            remove_turns: &[3],
            ..adding(&trimmed, &six)
        };
        let mut version = engine.write(&k, &v3, trim).unwrap();
        // Turn 3 stays in its exchange's value beside turn 4, the new first turn, and is
        // never read either.
        assert_eq!(raw(&engine), [1, 3, 4, 5, 6]);
        assert!(engine.vectors(&k, id).unwrap().is_empty());
        let loaded = engine.load(&k).unwrap();
        assert_eq!(live_turns(&loaded, &engine, &k), [4, 5, 6]);
        // Exchanges that each trim a turn: the one that trims turn `SWEEP_EVERY` takes it
        // along.
        for turn in 7..=SWEEP_EVERY + 4 {
            let trimmed = ConversationMeta {
                first_turn: turn - 2,
                ..record(id, turn + 1, 3)
            };
            let added = [stored(turn, "m")];
            let trim = Write {
                remove_turns: &[turn - 3],
                ..adding(&trimmed, &added)
            };
            version = engine.write(&k, &version, trim).unwrap();
            let left = if turn - 3 < SWEEP_EVERY {
                vec![1]
            } else {
                vec![]
            };
            let expected: Vec<u64> = left.into_iter().chain(turn - 2..=turn).collect();
            assert_eq!(raw(&engine), expected, "after turn {turn}");
        }
    }

    #[test]
    fn a_stale_append_leaves_nothing_behind_and_takes_nothing_of_the_winner() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, k, id, v1) = two_turns(dir.path());
        let v2 = engine
            .write(&k, &v1, adding(&record(id, 4, 3), &[stored(3, "won")]))
            .unwrap();
        // A writer that planned on v1 appends turns 3 and 4, with a Responses id.
        let late = [stored(3, "lost"), stored(4, "lost too")];
        let stale = engine.write(
            &k,
            &v1,
            Write {
                response_ids: &["resp_late".to_string()],
                ..adding(&record(id, 5, 4), &late)
            },
        );
        assert!(matches!(stale, Err(StoreError::Stale)), "{stale:?}");
        let raw = raw_turns(&engine, id);
        assert_eq!(raw.iter().map(|(t, _)| *t).collect::<Vec<_>>(), [1, 2, 3]);
        assert!(raw[2].1.contains("won"), "{raw:?}");
        assert_eq!(
            engine
                .response_conversation(&k.tenant, "resp_late")
                .unwrap(),
            None
        );
        let loaded = engine.load(&k).unwrap();
        assert_eq!(loaded.version, v2);
        assert_eq!(live_turns(&loaded, &engine, &k), [1, 2, 3]);
        // Without a race, the Responses id of an append is found again.
        let v3 = engine
            .write(
                &k,
                &v2,
                Write {
                    response_ids: &["resp_4".to_string()],
                    ..adding(&record(id, 5, 4), &[stored(4, "m4")])
                },
            )
            .unwrap();
        assert_eq!(
            engine.response_conversation(&k.tenant, "resp_4").unwrap(),
            Some(k.clone())
        );
        assert_eq!(engine.load(&k).unwrap().version, v3);
    }

    #[test]
    fn what_a_crash_left_past_the_record_is_never_read_and_is_written_over() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, k, id, v1) = two_turns(dir.path());
        // An append whose record never came: its messages lie past `next_turn`.
        let t = engine.trees().unwrap();
        for turn in [3, 5] {
            let value = encode(&stored(turn, "left")).unwrap();
            t.messages.insert(message_key(id, turn), value).unwrap();
        }
        let loaded = engine.load(&k).unwrap();
        assert_eq!(live_turns(&loaded, &engine, &k), [1, 2]);
        // The next append finds turn 3 taken and goes through the transaction, which writes
        // over it.
        let v2 = engine
            .write(&k, &v1, adding(&record(id, 4, 3), &[stored(3, "m3")]))
            .unwrap();
        let loaded = engine.load(&k).unwrap();
        assert_eq!(loaded.version, v2);
        assert_eq!(live_turns(&loaded, &engine, &k), [1, 2, 3]);
        let raw = raw_turns(&engine, id);
        assert!(raw[2].1.contains("m3"), "{raw:?}");
        // Turn 5 is still past the record, and still not read.
        assert_eq!(raw.len(), 4);
        let page = engine.range(&k, id, 0, 3).unwrap();
        assert_eq!(page.len(), 3);
    }

    #[test]
    fn damage_sled_finds_at_open_is_an_error_named_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let k = crate::tests::key("c");
        for round in 0..2 {
            let engine = SledEngine::open(dir.path(), 1 << 20, None).unwrap();
            for i in 0..50 {
                let record = TtlRecord {
                    ttl_ms: Some(round * 100 + i),
                    set_ms: 2,
                };
                engine.put_ttl(&k, &record).unwrap();
            }
            engine.flush().unwrap();
        }
        let db = dir.path().join("db");
        let mut bytes = std::fs::read(&db).unwrap();
        bytes[64..96].fill(0xab);
        std::fs::write(&db, bytes).unwrap();
        let err = SledEngine::open(dir.path(), 1 << 20, None).unwrap_err();
        assert!(matches!(err, StoreError::Damaged(_)), "{err:?}");
        assert!(err.to_string().contains("damaged"), "{err}");
        assert!(!err.is_write_failure());
    }
}
