//! What the memory tools read (the MCP server, `src/mcp/`, serves them; nothing here knows the
//! protocol): a user's memories and the turns of their conversations relevant to a query, and
//! the turns of one conversation relevant to a query. The same functions as a prompt's:
//! memories are chosen by [`memories::select`] over the owners a request reads
//! ([`extract::owners`]), turns of the user's conversations by the user's index
//! ([`LongTerm::search`](crate::longterm::LongTerm::search)), a conversation's turns by its
//! recall index ([`Recall::search`](crate::recall::Recall::search)), long ones cut to their
//! relevant passage ([`excerpt`]). Reading changes nothing: no memory's last access is
//! refreshed, no index is written to the store.
//!
//! What tools change goes through `longterm::edits` (as the admin API's edits do).
//! Callers run these on the blocking pool (store reads).

use std::collections::HashSet;

use serde::Serialize;

use crate::longterm::memories::{self, MemoryRecord};
use crate::longterm::{archive, decay_of, extract};
use crate::memory::Memory;
use crate::pipeline::catch_up::catch_up;
use crate::recall::excerpt::excerpt;
use crate::recall::stemming;
use crate::recall::tokenize::terms;
use crate::settings::MemorySettings;
use memproxy_base::identity::ConversationKey;
use memproxy_base::message::search_text;
use memproxy_store::{OwnerKey, OwnerKind, StoreError, StoredMessage, lock};

/// The longest a turn's text is in an answer, in tokens: a longer one is cut to its passage
/// most relevant to the query.
pub const TURN_MAX_TOKENS: u32 = 400;

/// UTC milliseconds as RFC 3339 (empty outside the years 0–9999).
pub fn rfc3339(ms: i64) -> String {
    memproxy_store::rfc3339_seconds(ms).unwrap_or_default()
}

/// A memory found, with its score and where it comes from.
#[derive(Debug, Clone, Serialize)]
pub struct FoundMemory {
    pub id: u64,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub scope: &'static str,
    pub text: String,
    /// BM25 over the memories' text × (0.5 + importance) × decay, as a prompt ranks them.
    pub score: f64,
    pub decay: f64,
    pub importance: f64,
    pub source: memories::MemorySource,
    pub version: u32,
    pub created_at: String,
    pub updated_at: String,
    /// Whose memory it is: `user` (private), `agent` or `tenant` (shared).
    pub owner: &'static str,
    /// The conversation and turns it was learned from.
    pub conversation: Option<String>,
    pub source_turns: Vec<u64>,
}

impl FoundMemory {
    fn of(owner: &OwnerKey, memory: MemoryRecord, score: f64, decay: f64) -> FoundMemory {
        FoundMemory {
            id: memory.id,
            kind: memory.kind.as_str(),
            scope: memory.scope.as_str(),
            score,
            decay,
            importance: memory.importance,
            source: memory.source,
            version: memory.version,
            created_at: rfc3339(memory.created_ms),
            updated_at: rfc3339(memory.updated_ms),
            owner: match owner.kind {
                OwnerKind::User => "user",
                OwnerKind::Agent => "agent",
                OwnerKind::Tenant => "tenant",
            },
            conversation: memory.conversation,
            source_turns: memory.source_turns,
            text: memory.text,
        }
    }
}

/// A stored turn found, with its score and where it comes from.
#[derive(Debug, Clone, Serialize)]
pub struct FoundTurn {
    pub score: f32,
    pub agent: String,
    pub conversation: String,
    pub turn: u64,
    pub role: &'static str,
    pub at: String,
    /// The turn's text, or its passage most relevant to the query ([`TURN_MAX_TOKENS`]).
    pub text: String,
}

/// What a search found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Found {
    pub memories: Vec<FoundMemory>,
    pub turns: Vec<FoundTurn>,
}

/// Turns of one conversation (`agent`, `conversation`) as found.
fn found_turns(
    hits: Vec<(f32, String, String, StoredMessage)>,
    query: &str,
    settings: &MemorySettings,
) -> Vec<FoundTurn> {
    let texts: Vec<String> = hits.iter().map(|h| search_text(&h.3.message)).collect();
    let latin = stemming(
        settings.relevance_language,
        std::iter::once(query).chain(texts.iter().map(String::as_str)),
    );
    let query_terms: HashSet<String> = terms(query, latin).into_iter().collect();
    hits.into_iter()
        .zip(texts)
        .map(|((score, agent, conversation, message), text)| {
            let text = excerpt(
                &text,
                message.tokens,
                &query_terms,
                latin,
                TURN_MAX_TOKENS,
                |t| memproxy_base::tokens::count_text(None, t),
            )
            .unwrap_or(text);
            FoundTurn {
                score,
                agent,
                conversation,
                turn: message.turn,
                role: message.role.as_str(),
                at: rfc3339(message.at_ms),
                text,
            }
        })
        .collect()
}

/// The memories of `user` (talking to `agent`: the agent's and the tenant's shared memories
/// too) relevant to `query`, and the turns of the user's conversations relevant to it, at most
/// `limit` of each, best first.
pub fn search(
    memory: &Memory,
    user: &OwnerKey,
    agent: &str,
    settings: &MemorySettings,
    query: &str,
    limit: usize,
) -> Result<Found, StoreError> {
    let store = &memory.store;
    let now = store.clock().now_ms();
    let candidates: Vec<(OwnerKey, MemoryRecord)> = extract::known(store, user, agent)?
        .into_iter()
        .flat_map(|(owner, list)| list.into_iter().map(move |m| (owner.clone(), m)))
        .collect();
    // By meaning too, as a chat request's memories and recall.
    let vector = settings
        .relevance_semantic
        .then(|| memory.embedding.query(query).ok())
        .flatten();
    let when = settings.period(query, now);
    let asked = crate::recall::Query {
        text: query,
        vector: vector.as_deref().into(),
        fusion: settings.fusion(),
        when,
    };
    let mut vectors = std::collections::HashMap::new();
    if let (Some(space), Some(_)) = (memory.longterm.space(), vector.as_ref()) {
        for owner in extract::owners(user, agent) {
            if let Some(handle) = store.owner(&owner, false)? {
                vectors.extend(memories::vectors(store, &handle, space)?);
            }
        }
    }
    let ask = memories::Ask {
        query: asked,
        vectors: &vectors,
    };
    let memories = memories::select(candidates, ask, now, decay_of(settings), limit, u64::MAX)
        .into_iter()
        .filter(|c| c.score > 0.0)
        .map(|c| FoundMemory::of(&c.owner, c.memory, c.score, c.decay))
        .collect();
    let hits = memory
        .longterm
        .search(store, user, None, settings.relevance_language, asked, limit)?
        .into_iter()
        .map(|t| (t.score, t.agent, t.conversation, t.message))
        .collect();
    Ok(Found {
        memories,
        turns: found_turns(hits, query, settings),
    })
}

/// The turns of the conversation at `key` relevant to `query`, at most `limit`, best first;
/// `None` when there is no such conversation, or, with `user`, when it is not one of the
/// user's (their archive does not follow it).
pub fn recall_conversation(
    memory: &Memory,
    key: &ConversationKey,
    user: Option<&OwnerKey>,
    settings: &MemorySettings,
    query: &str,
    limit: usize,
) -> Result<Option<Vec<FoundTurn>>, StoreError> {
    let store = &memory.store;
    if let Some(user) = user
        && !archive::follows(store, user, key)?
    {
        return Ok(None);
    }
    // By meaning too, as a chat request's recall; embedded before the conversation is locked.
    let vector = settings
        .relevance_semantic
        .then(|| memory.embedding.query(query).ok())
        .flatten();
    let when = settings.period(query, store.clock().now_ms());
    let handle = store.conversation(key)?;
    let mut conversation = lock(&handle);
    if store.shared() {
        catch_up(memory, key, &mut conversation)?;
    }
    let Some(next_turn) = conversation.meta.as_ref().map(|m| m.next_turn) else {
        return Ok(None);
    };
    let hits = memory
        .recall
        .search(
            store,
            &conversation,
            settings.relevance_language,
            crate::recall::Query {
                text: query,
                vector: vector.as_deref().into(),
                fusion: settings.fusion(),
                when,
            },
            next_turn,
            limit,
        )?
        .hits;
    let messages = store.messages(&conversation, hits.iter().map(|h| h.turn))?;
    drop(conversation);
    let found = hits
        .iter()
        .zip(messages)
        .map(|(hit, message)| {
            (
                hit.score,
                key.agent.clone(),
                key.conversation.clone(),
                message,
            )
        })
        .collect();
    Ok(Some(found_turns(found, query, settings)))
}
