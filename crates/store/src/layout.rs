//! The key layout and record encoding the embedded engines share (`sled_engine.rs`,
//! `fjall_engine.rs`): which key each record has in which tree (the trees are listed in
//! `sled_engine.rs`'s documentation), how records are encoded (JSON), a write's rows, and the
//! listing and the pages of TTL records and owners over rows in key order.

use serde::{Deserialize, Serialize};

use super::StoreError;
use super::engine::{Loaded, Page, Scope, Version, Write};
use super::records::{
    BranchRecord, ConversationMeta, Entry, OwnerKey, OwnerMeta, StoredBranch, StoredMessage,
    TtlRecord,
};
use memproxy_base::identity::{ConversationKey, TenantId};

/// The `responses` tree's key of `tenant`'s `response_id`.
pub(super) fn response_key(tenant: &TenantId, response_id: &str) -> Vec<u8> {
    [tenant.as_str().as_bytes(), b"\0", response_id.as_bytes()].concat()
}

/// The `conversation_responses` tree's key of conversation `id`'s `response_id`.
pub(super) fn conversation_response_key(id: u64, response_id: &str) -> Vec<u8> {
    [&id.to_be_bytes()[..], response_id.as_bytes()].concat()
}

pub(super) fn message_key(id: u64, turn: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&id.to_be_bytes());
    key[8..].copy_from_slice(&turn.to_be_bytes());
    key
}

/// The second half of a [`message_key`]: a turn, or a summary's number (`None` for a key too
/// short to hold one).
pub(super) fn turn_of(key: &[u8]) -> Option<u64> {
    key.get(8..16)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_be_bytes)
}

/// A conversation as loaded: its record `meta` (decoded from `stored`) and the values of its
/// live turns, `first_turn..next_turn`, in key order (the engine reads that key range, from
/// the key of a batch that can hold `first_turn`: turns outside it are not the
/// conversation's). A value holds one message or a [batch](encode_batch) of consecutive ones,
/// of which [`in_order`] keeps the turns.
pub(super) fn loaded<V: AsRef<[u8]>>(
    meta: ConversationMeta,
    stored: Vec<u8>,
    values: impl Iterator<Item = Result<V, StoreError>>,
) -> Result<Loaded, StoreError> {
    let mut entries: Vec<Entry> = Vec::with_capacity(meta.message_count as usize);
    let mut expected = meta.first_turn;
    for value in values {
        for message in decode_batch(value?.as_ref())? {
            if !in_order(&mut expected, meta.next_turn, message.turn) {
                continue;
            }
            let before = entries.last().map_or(0, |e| e.cum_tokens);
            entries.push(Entry::new(&message, before));
        }
    }
    Ok(Loaded {
        meta: Some(meta),
        version: Version::of(stored),
        entries,
    })
}

/// The keys of the live turns of the conversation `meta` records, where each value holds one
/// message (fjall's; sled's may start a turn before, `sled_engine::first_holder`).
pub(super) fn live_keys(meta: &ConversationMeta) -> std::ops::Range<[u8; 16]> {
    message_key(meta.id, meta.first_turn)..message_key(meta.id, meta.next_turn)
}

/// True when a turn read in key order is the next one taken from values that start at or
/// before the turn `expected` and end below `end`; it then moves `expected` past it. A turn
/// below `expected` is passed over (below the first turn asked: trimmed, or in a batch that
/// starts before it; past it: a value a batch before it replaced, left by a crash), and one
/// at or past `end` too.
pub(super) fn in_order(expected: &mut u64, end: u64, turn: u64) -> bool {
    if turn < *expected || turn >= end {
        return false;
    }
    *expected = turn + 1;
    true
}

/// The messages of a `messages` value: one ([`StoredMessage`] as JSON, every value before
/// batches and every value the fjall engine writes) or a batch of consecutive turns (a JSON
/// array of them, [`encode_batch`]).
pub(super) fn decode_batch(bytes: &[u8]) -> Result<Vec<StoredMessage>, StoreError> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => decode(bytes),
        _ => Ok(vec![decode(bytes)?]),
    }
}

/// The value of `messages` (one or more consecutive turns): a single message as it always
/// was, more as a JSON array ([`decode_batch`]).
pub(super) fn encode_batch(messages: &[StoredMessage]) -> Result<Vec<u8>, StoreError> {
    match messages {
        [one] => encode(one),
        many => encode(&many),
    }
}

/// `messages` split into the values of a store that keeps up to `per_key` consecutive turns
/// under one key (the first one's): a run breaks where the turns do.
pub(super) fn batches(messages: &[StoredMessage], per_key: usize) -> Vec<&[StoredMessage]> {
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..=messages.len() {
        let full = i - start == per_key.max(1);
        let broken = i < messages.len() && messages[i].turn != messages[i - 1].turn + 1;
        if i == messages.len() || full || broken {
            out.push(&messages[start..i]);
            start = i;
        }
    }
    out
}

/// The parts of a closed branch, in key order.
pub(super) const BRANCH_RECORD: u8 = 0;
pub(super) const BRANCH_MESSAGE: u8 = 1;
pub(super) const BRANCH_SUMMARY: u8 = 2;

pub(super) fn branch_key(id: u64, number: u64, part: u8, n: u64) -> [u8; 25] {
    let mut key = [0u8; 25];
    key[..8].copy_from_slice(&id.to_be_bytes());
    key[8..16].copy_from_slice(&number.to_be_bytes());
    key[16] = part;
    key[17..].copy_from_slice(&n.to_be_bytes());
    key
}

/// The (branch number, part, n) of a `branches` key.
pub(super) fn branch_key_parts(key: &[u8]) -> Option<(u64, u8, u64)> {
    let number = u64::from_be_bytes(key.get(8..16)?.try_into().ok()?);
    let n = u64::from_be_bytes(key.get(17..25)?.try_into().ok()?);
    Some((number, *key.get(16)?, n))
}

/// A `branches` key and its encoded value.
pub(super) type BranchRow = ([u8; 25], Vec<u8>);

/// The rows of `branches` (encoded) for the `branches` tree of conversation `id`.
pub(super) fn branch_rows(
    id: u64,
    branches: &[StoredBranch],
) -> Result<Vec<BranchRow>, StoreError> {
    let mut rows = Vec::new();
    for branch in branches {
        let number = branch.record.number;
        rows.push((
            branch_key(id, number, BRANCH_RECORD, 0),
            encode(&branch.record)?,
        ));
        for message in &branch.messages {
            rows.push((
                branch_key(id, number, BRANCH_MESSAGE, message.turn),
                encode(message)?,
            ));
        }
        for (n, record) in &branch.summaries {
            rows.push((branch_key(id, number, BRANCH_SUMMARY, *n), record.clone()));
        }
    }
    Ok(rows)
}

pub(super) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|err| StoreError::Corrupt(err.to_string()))
}

pub(super) fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|err| StoreError::Corrupt(err.to_string()))
}

/// The prefix of every record of `owner` in `owner_records`; with `space`, of that space.
pub(super) fn owner_prefix(owner: &OwnerKey, space: Option<u8>) -> Vec<u8> {
    let mut prefix = owner.to_bytes();
    prefix.push(0);
    prefix.extend(space);
    prefix
}

pub(super) fn owner_record_key(owner: &OwnerKey, space: u8, id: &[u8]) -> Vec<u8> {
    let mut key = owner_prefix(owner, Some(space));
    key.extend_from_slice(id);
    key
}

/// A write's rows as stored, encoded once for whichever path writes them.
pub(super) struct Rows {
    /// The conversation's key bytes and its new record.
    pub(super) key: Vec<u8>,
    pub(super) meta: Vec<u8>,
    /// The messages added, by their keys: up to `per_key` consecutive turns a value
    /// ([`batches`]).
    pub(super) added: Vec<([u8; 16], Vec<u8>)>,
    /// Each Responses id's two rows (`responses`, `conversation_responses`) and the value of
    /// the first.
    pub(super) responses: Vec<(Vec<u8>, Vec<u8>)>,
    pub(super) response_value: Vec<u8>,
}

impl Rows {
    pub(super) fn of(
        key: &ConversationKey,
        write: &Write<'_>,
        per_key: usize,
    ) -> Result<Rows, StoreError> {
        let id = write.meta.id;
        let key_bytes = key.to_bytes();
        Ok(Rows {
            meta: encode(write.meta)?,
            added: batches(write.add, per_key)
                .into_iter()
                .map(|batch| Ok((message_key(id, batch[0].turn), encode_batch(batch)?)))
                .collect::<Result<_, StoreError>>()?,
            responses: write
                .response_ids
                .iter()
                .map(|r| {
                    (
                        response_key(&key.tenant, r),
                        conversation_response_key(id, r),
                    )
                })
                .collect(),
            response_value: [&id.to_be_bytes()[..], &key_bytes].concat(),
            key: key_bytes,
        })
    }
}

/// The closed branches in `rows` (`branches` keys and values, in key order).
pub(super) fn assemble_branches<K: AsRef<[u8]>, V: AsRef<[u8]>>(
    rows: impl Iterator<Item = Result<(K, V), StoreError>>,
) -> Result<Vec<StoredBranch>, StoreError> {
    let mut out: Vec<StoredBranch> = Vec::new();
    for item in rows {
        let (key, value) = item?;
        let (key, value) = (key.as_ref(), value.as_ref());
        let (number, part, n) = branch_key_parts(key)
            .ok_or_else(|| StoreError::Corrupt("a branch key is too short".into()))?;
        if part == BRANCH_RECORD {
            out.push(StoredBranch {
                record: decode::<BranchRecord>(value)?,
                messages: Vec::new(),
                summaries: Vec::new(),
            });
            continue;
        }
        // A branch's record sorts before its parts.
        let branch = out
            .last_mut()
            .filter(|b| b.record.number == number)
            .ok_or_else(|| {
                StoreError::Corrupt(format!("branch {number} has parts but no record"))
            })?;
        match part {
            BRANCH_MESSAGE => branch.messages.push(decode(value)?),
            BRANCH_SUMMARY => branch.summaries.push((n, value.to_vec())),
            other => {
                return Err(StoreError::Corrupt(format!(
                    "branch {number} has an unknown part {other}"
                )));
            }
        }
    }
    Ok(out)
}

/// Where a listing of `scope` walks the `conversations` tree: the key prefix every
/// conversation in it shares (a tenant, and an agent, are key prefixes), and the first key to
/// read, past the cursor `after` (the walk ends past the prefix).
pub(super) fn listing_start(scope: Scope<'_>, after: Option<&[u8]>) -> (Vec<u8>, Vec<u8>) {
    let mut prefix = Vec::new();
    if let Some(tenant) = scope.tenant {
        prefix.extend_from_slice(tenant.as_str().as_bytes());
        prefix.push(0);
        if let Some(agent) = scope.agent {
            prefix.extend_from_slice(agent.as_bytes());
            prefix.push(0);
        }
    }
    let start = match after {
        Some(after) if after >= prefix.as_slice() => {
            let mut start = after.to_vec();
            start.push(0);
            start
        }
        _ => prefix.clone(),
    };
    (prefix, start)
}

/// A page of a listing ([`Engine::list`](super::engine::Engine::list)) from `rows`: the
/// `conversations` records from [`listing_start`]'s key on, in key order.
pub(super) fn conversations_page<K: AsRef<[u8]>, V: AsRef<[u8]>>(
    rows: impl Iterator<Item = Result<(K, V), StoreError>>,
    scope: Scope<'_>,
    prefix: &[u8],
    limit: usize,
    max_scan: usize,
) -> Result<Page<(ConversationKey, ConversationMeta)>, StoreError> {
    let mut out = Vec::new();
    let mut last: Option<Vec<u8>> = None;
    for (scanned, item) in rows.enumerate() {
        let (key_bytes, value) = item?;
        let key_bytes = key_bytes.as_ref();
        if !key_bytes.starts_with(prefix) {
            break;
        }
        // A filter that matches little must not walk the whole store in one call: the page
        // ends early, with a cursor to go on from.
        if scanned == max_scan {
            return Ok((out, last));
        }
        let Some(key) = ConversationKey::from_bytes(key_bytes) else {
            last = Some(key_bytes.to_vec());
            continue;
        };
        if !scope.covers(&key) {
            last = Some(key_bytes.to_vec());
            continue;
        }
        if out.len() == limit {
            let cursor = out.last().map(|(k, _): &(ConversationKey, _)| k.to_bytes());
            return Ok((out, cursor));
        }
        last = Some(key_bytes.to_vec());
        out.push((key, decode(value.as_ref())?));
    }
    Ok((out, None))
}

/// A page of up to `limit` records from `rows` (the keys after a cursor, in key order), each
/// made by `make` from its key and value (`None`: skipped, the cursor moving past it).
fn page_after<K: AsRef<[u8]>, V: AsRef<[u8]>, T>(
    rows: impl Iterator<Item = Result<(K, V), StoreError>>,
    limit: usize,
    mut make: impl FnMut(&[u8], &[u8]) -> Result<Option<T>, StoreError>,
) -> Result<Page<T>, StoreError> {
    let mut out = Vec::new();
    let mut last: Option<Vec<u8>> = None;
    for item in rows {
        if out.len() == limit {
            return Ok((out, last));
        }
        let (key, value) = item?;
        last = Some(key.as_ref().to_vec());
        out.extend(make(key.as_ref(), value.as_ref())?);
    }
    Ok((out, None))
}

/// A page of TTL records from `rows` (the `ttl` tree after a cursor); keys that name no
/// conversation are skipped.
pub(super) fn ttl_page<K: AsRef<[u8]>, V: AsRef<[u8]>>(
    rows: impl Iterator<Item = Result<(K, V), StoreError>>,
    limit: usize,
) -> Result<Page<(ConversationKey, TtlRecord)>, StoreError> {
    page_after(rows, limit, |key, value| {
        ConversationKey::from_bytes(key)
            .map(|key| Ok((key, decode(value)?)))
            .transpose()
    })
}

/// A page of owners from `rows` (the `owners` tree after a cursor).
pub(super) fn owners_page<K: AsRef<[u8]>, V: AsRef<[u8]>>(
    rows: impl Iterator<Item = Result<(K, V), StoreError>>,
    limit: usize,
) -> Result<Page<(OwnerKey, OwnerMeta)>, StoreError> {
    page_after(rows, limit, |key, value| {
        let owner = OwnerKey::from_bytes(key)
            .ok_or_else(|| StoreError::Corrupt("an owner key is malformed".into()))?;
        Ok(Some((owner, decode(value)?)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use memproxy_base::message::Role;

    fn at(turns: &[u64]) -> Vec<StoredMessage> {
        turns
            .iter()
            .map(|&turn| {
                let mut message = crate::tests::message(Role::User, "m");
                message.turn = turn;
                message
            })
            .collect()
    }

    fn turns_of(batches: &[&[StoredMessage]]) -> Vec<Vec<u64>> {
        let turns = |b: &&[StoredMessage]| b.iter().map(|m| m.turn).collect();
        batches.iter().map(turns).collect()
    }

    #[test]
    fn batches_hold_consecutive_turns_up_to_the_size() {
        let five = at(&[3, 4, 5, 6, 7]);
        assert_eq!(
            turns_of(&batches(&five, 2)),
            [vec![3, 4], vec![5, 6], vec![7]]
        );
        assert_eq!(turns_of(&batches(&five, 1)).len(), 5);
        let broken = at(&[3, 5, 6]);
        assert_eq!(turns_of(&batches(&broken, 2)), [vec![3], vec![5, 6]]);
        assert!(batches(&[], 2).is_empty());
    }

    #[test]
    fn a_value_of_one_message_or_a_batch_decodes_to_its_messages() {
        let two = at(&[1, 2]);
        let one = encode_batch(&two[..1]).unwrap();
        assert_eq!(
            one,
            encode(&two[0]).unwrap(),
            "one message is stored as it always was"
        );
        let both = encode_batch(&two).unwrap();
        assert_eq!(both.first(), Some(&b'['));
        let turns =
            |v: &[u8]| -> Vec<u64> { decode_batch(v).unwrap().iter().map(|m| m.turn).collect() };
        assert_eq!(turns(&one), [1]);
        assert_eq!(turns(&both), [1, 2]);
        assert!(decode_batch(b"[{").is_err());
    }
}
