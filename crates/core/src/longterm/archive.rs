//! A user's archive (layer 1): every stored message of the user's conversations, copied once
//! committed, kept until the user is deleted, whatever happens to the conversation.
//!
//! Records of the user's owner (`store/owners.rs`, sealed with the user's key):
//! - [`SPACE_ARCHIVE`]: `conversation id (u64 BE) ++ turn (u64 BE)` → [`ArchivedTurn`] (JSON).
//!   Ids group a conversation's turns in order, so the archive reads back conversation by
//!   conversation, and a turn is found without a scan.
//! - [`SPACE_CONVERSATIONS`]: `agent \0 conversation` → [`Synced`] (JSON): which life of the
//!   conversation the archive follows and how far; also the list of the user's conversations
//!   a user delete removes.

use serde::{Deserialize, Serialize};

use memproxy_base::identity::ConversationKey;
use memproxy_store::{
    Conversation, ImportMeta, OwnerHandle, OwnerKey, Store, StoreError, StoredMessage,
};

/// The archived turns.
pub const SPACE_ARCHIVE: u8 = 1;
/// The user's conversations and how far each is archived.
pub const SPACE_CONVERSATIONS: u8 = 2;

/// One archived message and the conversation it was said in.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArchivedTurn {
    pub agent: String,
    pub conversation: String,
    pub message: StoredMessage,
}

/// How far a conversation is archived: its life (id) and the next turn to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Synced {
    pub id: u64,
    pub next_turn: u64,
    /// The last turn an extraction was queued for (layer 2).
    #[serde(default)]
    pub extracted_turn: u64,
    /// User messages archived since.
    #[serde(default)]
    pub pending_user_messages: u64,
}

/// What a commit asks of the archive about extraction.
#[derive(Debug, Clone, Copy)]
pub struct ExtractionRule {
    /// User messages between two extractions.
    pub every: u64,
    /// An extraction may be queued now (the request brought what it needs).
    pub may_queue: bool,
}

/// A run of turns due for extraction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DueRun {
    pub conversation_id: u64,
    pub from_turn: u64,
    pub to_turn: u64,
}

/// The archive id of turn `turn` of conversation `id`.
pub fn turn_id(id: u64, turn: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(16);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&turn.to_be_bytes());
    out
}

/// The id of a conversation's record in [`SPACE_CONVERSATIONS`].
pub fn conversation_id(agent: &str, conversation: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(agent.len() + conversation.len() + 1);
    out.extend_from_slice(agent.as_bytes());
    out.push(0);
    out.extend_from_slice(conversation.as_bytes());
    out
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|err| StoreError::Corrupt(err.to_string()))
}

fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|err| StoreError::Corrupt(err.to_string()))
}

/// An archived turn as the user's index keeps it.
#[derive(Debug, Clone)]
pub struct Added {
    pub id: Vec<u8>,
    pub turn: ArchivedTurn,
}

/// Copies what the user's archive lacks of `conversation` into it and removes `dropped`
/// turns, in one write; returns what was added. Called under the conversation's lock.
pub fn catch_up(
    store: &Store,
    user: &OwnerKey,
    conversation: &Conversation,
    dropped: &[u64],
    rule: Option<ExtractionRule>,
) -> Result<(Vec<Added>, Option<DueRun>), StoreError> {
    let Some(meta) = &conversation.meta else {
        return Ok((Vec::new(), None));
    };
    let key = &conversation.key;
    let Some(handle) = store.owner(user, true)? else {
        return Ok((Vec::new(), None));
    };
    let record_id = conversation_id(&key.agent, &key.conversation);
    let synced: Option<Synced> = synced(store, &handle, &record_id)?;
    let (from, extracted_turn, pending) = match synced {
        Some(synced) if synced.id == meta.id => (
            synced.next_turn,
            synced.extracted_turn,
            synced.pending_user_messages,
        ),
        _ => (1, 0, 0),
    };
    let messages = if from < meta.next_turn {
        store.messages_since(conversation, from)?
    } else {
        Vec::new()
    };
    let mut put = Vec::with_capacity(messages.len() + 1);
    let mut added = Vec::with_capacity(messages.len());
    for message in messages {
        let turn = ArchivedTurn {
            agent: key.agent.clone(),
            conversation: key.conversation.clone(),
            message,
        };
        let id = turn_id(meta.id, turn.message.turn);
        put.push((SPACE_ARCHIVE, id.clone(), encode(&turn)?));
        added.push(Added { id, turn });
    }
    let user_messages = added
        .iter()
        .filter(|a| a.turn.message.role == memproxy_base::message::Role::User)
        .count() as u64;
    let mut now = Synced {
        id: meta.id,
        next_turn: meta.next_turn,
        extracted_turn,
        pending_user_messages: pending + user_messages,
    };
    let mut due = None;
    if let Some(rule) = rule
        && rule.may_queue
        && now.pending_user_messages >= rule.every
    {
        due = Some(DueRun {
            conversation_id: meta.id,
            from_turn: extracted_turn + 1,
            to_turn: meta.next_turn.saturating_sub(1),
        });
        now.extracted_turn = meta.next_turn.saturating_sub(1);
        now.pending_user_messages = 0;
    }
    if synced != Some(now) {
        put.push((SPACE_CONVERSATIONS, record_id, encode(&now)?));
    }
    let remove: Vec<(u8, Vec<u8>)> = dropped
        .iter()
        .map(|&turn| (SPACE_ARCHIVE, turn_id(meta.id, turn)))
        .collect();
    if put.is_empty() && remove.is_empty() {
        return Ok((added, due));
    }
    if !store.write_owner(&handle, put, &remove)? {
        // The user was deleted meanwhile: nothing of them is kept.
        return Ok((Vec::new(), None));
    }
    Ok((added, due))
}

fn synced(
    store: &Store,
    handle: &OwnerHandle,
    record_id: &[u8],
) -> Result<Option<Synced>, StoreError> {
    store
        .owner_record(handle, SPACE_CONVERSATIONS, record_id)?
        .map(|bytes| decode(&bytes))
        .transpose()
}

/// True when `user`'s archive follows the conversation at `key` (it was committed with the
/// user's id, or imported into the user's archive).
pub fn follows(store: &Store, user: &OwnerKey, key: &ConversationKey) -> Result<bool, StoreError> {
    let Some(handle) = store.owner(user, false)? else {
        return Ok(false);
    };
    Ok(store
        .owner_record(
            &handle,
            SPACE_CONVERSATIONS,
            &conversation_id(&key.agent, &key.conversation),
        )?
        .is_some())
}

/// User messages of the conversation archived since its last extraction.
pub fn pending_user_messages(
    store: &Store,
    user: &OwnerKey,
    key: &ConversationKey,
) -> Result<u64, StoreError> {
    let Some(handle) = store.owner(user, false)? else {
        return Ok(0);
    };
    Ok(synced(
        store,
        &handle,
        &conversation_id(&key.agent, &key.conversation),
    )?
    .map_or(0, |s| s.pending_user_messages))
}

/// One archived turn.
pub fn read(
    store: &Store,
    handle: &OwnerHandle,
    id: &[u8],
) -> Result<Option<ArchivedTurn>, StoreError> {
    store
        .owner_record(handle, SPACE_ARCHIVE, id)?
        .map(|bytes| decode(&bytes))
        .transpose()
}

/// Every archived turn of the user, conversation by conversation, each with its id.
pub fn all(store: &Store, handle: &OwnerHandle) -> Result<Vec<Added>, StoreError> {
    store
        .all_owner_records(handle, SPACE_ARCHIVE)?
        .into_iter()
        .map(|record| {
            Ok(Added {
                turn: decode(&record.value)?,
                id: record.id,
            })
        })
        .collect()
}

/// The user's conversations (agent, conversation) the archive knows.
pub fn conversations(
    store: &Store,
    handle: &OwnerHandle,
) -> Result<Vec<ConversationKey>, StoreError> {
    let records = store.all_owner_records(handle, SPACE_CONVERSATIONS)?;
    let mut out = Vec::with_capacity(records.len());
    for record in records {
        let text = String::from_utf8_lossy(&record.id).into_owned();
        if let Some((agent, conversation)) = text.split_once('\0') {
            out.push(ConversationKey {
                tenant: handle.owner.tenant.clone(),
                agent: agent.to_string(),
                conversation: conversation.to_string(),
            });
        }
    }
    Ok(out)
}

/// Adds archived turns from an export to the user's archive: each conversation's turns as a
/// life of their own, unless the archive already follows that conversation or it is stored
/// (its next commit archives it). Returns (conversations added, conversations skipped).
pub fn import(
    store: &Store,
    handle: &OwnerHandle,
    turns: Vec<ArchivedTurn>,
) -> Result<(usize, usize), StoreError> {
    // Grouped by conversation, in the export's order.
    let mut groups: Vec<((String, String), Vec<ArchivedTurn>)> = Vec::new();
    for turn in turns {
        let name = (turn.agent.clone(), turn.conversation.clone());
        match groups.iter_mut().find(|(n, _)| *n == name) {
            Some((_, group)) => group.push(turn),
            None => groups.push((name, vec![turn])),
        }
    }
    let (mut added, mut skipped) = (0, 0);
    for ((agent, conversation), mut group) in groups {
        let record_id = conversation_id(&agent, &conversation);
        let key = ConversationKey {
            tenant: handle.owner.tenant.clone(),
            agent,
            conversation,
        };
        if synced(store, handle, &record_id)?.is_some() || store.meta(&key)?.is_some() {
            skipped += 1;
            continue;
        }
        group.sort_by_key(|t| t.message.turn);
        group.dedup_by_key(|t| t.message.turn);
        let id = store.new_id()?;
        let last = group.last().map_or(0, |t| t.message.turn);
        let mut put = Vec::with_capacity(group.len() + 1);
        for turn in &group {
            put.push((SPACE_ARCHIVE, turn_id(id, turn.message.turn), encode(turn)?));
        }
        let now = Synced {
            id,
            next_turn: last + 1,
            extracted_turn: last,
            pending_user_messages: 0,
        };
        put.push((SPACE_CONVERSATIONS, record_id, encode(&now)?));
        if !store.write_owner(handle, put, &[])? {
            return Err(StoreError::Stale);
        }
        added += 1;
    }
    Ok((added, skipped))
}

/// Stores the archived turns of the conversation at `key` again, when it is not stored (see
/// [`super::LongTerm::rebuild`]); the archive then follows the new life from its end.
pub fn rebuild(store: &Store, user: &OwnerKey, key: &ConversationKey) -> Result<bool, StoreError> {
    {
        let handle = store.conversation(key)?;
        if memproxy_store::lock(&handle).meta.is_some() {
            return Ok(false);
        }
    }
    let Some(owner) = store.owner(user, false)? else {
        return Ok(false);
    };
    let record_id = conversation_id(&key.agent, &key.conversation);
    let Some(synced) = store
        .owner_record(&owner, SPACE_CONVERSATIONS, &record_id)?
        .map(|bytes| decode::<Synced>(&bytes))
        .transpose()?
    else {
        return Ok(false);
    };
    // The turns of that life: ids `synced.id ++ turn`, turns from 1.
    let mut messages: Vec<StoredMessage> = Vec::new();
    let mut after = turn_id(synced.id, 0);
    loop {
        let (page, next) = store.owner_records(&owner, SPACE_ARCHIVE, Some(&after), 500)?;
        let mut done = next.is_none();
        for record in page {
            if record.id.get(..8) != Some(&synced.id.to_be_bytes()[..]) {
                done = true;
                break;
            }
            let turn: ArchivedTurn = decode(&record.value)?;
            messages.push(turn.message);
            after = record.id;
        }
        if done {
            break;
        }
    }
    if messages.is_empty() {
        return Ok(false);
    }
    let imported =
        store.import_conversation(key, messages, Vec::new(), Vec::new(), ImportMeta::default())?;
    if imported.added == 0 {
        return Ok(false);
    }
    // Follow the new life from its end: what was imported is archived already.
    let handle = store.conversation(key)?;
    let conversation = memproxy_store::lock(&handle);
    if let Some(meta) = &conversation.meta {
        let now = Synced {
            id: meta.id,
            next_turn: meta.next_turn,
            extracted_turn: meta.next_turn.saturating_sub(1),
            pending_user_messages: 0,
        };
        store.write_owner(
            &owner,
            vec![(SPACE_CONVERSATIONS, record_id, encode(&now)?)],
            &[],
        )?;
    }
    Ok(true)
}
