//! What the Responses API adds at the edge: finding a chained request's conversation from its
//! `previous_response_id`, and `GET`/`DELETE /v1/responses/{id}` for the ids memproxy
//! answered.
//!
//! The ids are kept by the store with the replies they name (`Write::response_ids`, written in
//! the exchange's own atomic commit), per tenant: they survive a restart, every replica sharing
//! a Redis store finds them, and they go when their conversation is deleted. A tenant only ever
//! finds the ids it was answered.
//!
//! A request chained to an id memproxy does not know (answered by the upstream directly, or
//! its conversation deleted) is forwarded as sent with `X-Memory-Status: off` and
//! `X-Memory-Reason: unknown-previous-response`: memproxy cannot rebuild a history it never
//! saw, and the upstream may still hold it. When the store cannot be read the request is
//! forwarded as sent too, `degraded` with the store's reason (and, when its conversation is
//! named, a receipt, as every memory-on request whose memory failed).

use std::sync::Arc;

use http::{HeaderMap, Method, Response, StatusCode};

use super::DegradedReason;
use super::identify::credential_of;
use crate::body::ProxyBody;
use crate::error::{ProxyError, json_response};
use crate::identity::{ConversationKey, TenantId};
use crate::memory::Memory;
use crate::message::parse_object;
use crate::settings::MemorySettings;
use crate::state::AppState;
use crate::store::{StoreError, lock};
use crate::wire::response_id_of;
use crate::wire::responses::{conversation_field, previous_id_field, response_object};

/// The reason sent with a chained request memproxy cannot serve with memory.
pub const UNKNOWN_PREVIOUS: &str = "unknown-previous-response";

/// Where a Responses request goes.
#[derive(Debug)]
pub enum Chain {
    /// Memory runs for this conversation (the settings boxed: they are most of its size).
    Memory(ConversationKey, Box<MemorySettings>),
    /// Forwarded as sent, saying why memory did not run for it (`None`: nothing to say).
    Forward(Option<Unchained>),
    /// Its conversation is known but the store could not be read: forwarded as sent,
    /// `degraded`, as any memory-on request whose memory failed (with its receipt).
    Degraded(ConversationKey, Box<MemorySettings>, DegradedReason),
}

/// Why a chained request was forwarded as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unchained {
    /// Its `previous_response_id` is not one memproxy answered for this tenant.
    Unknown,
    /// The store could not be read.
    Store(DegradedReason),
}

/// A Responses request whose conversation is to be found.
pub struct ResponsesRequest<'a> {
    pub headers: &'a HeaderMap,
    pub body: &'a [u8],
    /// The conversation its header or path form named.
    pub key: Option<ConversationKey>,
    /// The agent a conversation named by its `conversation` field belongs to.
    pub agent: &'a str,
    pub settings: MemorySettings,
}

/// Resolves a Responses request's conversation: the conversation id it names (header, path
/// form, or its `conversation` field under `agent`), else the one its `previous_response_id`
/// was answered in. An unknown
/// `previous_response_id` turns memory off for the request, conversation id or not.
pub async fn resolve(
    state: &AppState,
    memory: &Arc<Memory>,
    request: ResponsesRequest<'_>,
) -> Result<Chain, ProxyError> {
    let ResponsesRequest {
        headers,
        body,
        key,
        agent,
        settings,
    } = request;
    // A body that does not parse is refused by the planner with the field at fault.
    let fields = parse_object(body).unwrap_or_default();
    let previous = previous_id_field(&fields).ok().flatten();
    let named = conversation_field(&fields)?;
    let tenant = match &key {
        Some(key) => Some(key.tenant.clone()),
        None => match credential_of(headers)? {
            Some(credential) => Some(TenantId::of(Some(&credential))),
            None if state.config.allow_anonymous => Some(TenantId::of(None)),
            None => None,
        },
    };
    // The `conversation` field names the conversation when no header does (and must agree
    // with one that does).
    let key = match (key, named, &tenant) {
        (Some(key), Some(named), _) if named != key.conversation => {
            return Err(ProxyError::invalid(
                "conversation",
                "conversation_mismatch",
                "`conversation` disagrees with the X-Memory-Conversation-Id header",
            ));
        }
        (None, Some(conversation), Some(tenant)) => Some(ConversationKey {
            tenant: tenant.clone(),
            agent: agent.to_string(),
            conversation,
        }),
        (key, ..) => key,
    };
    let Some(previous) = previous else {
        return Ok(match key {
            Some(key) => Chain::Memory(key, Box::new(settings)),
            None => Chain::Forward(None),
        });
    };
    let Some(tenant) = tenant else {
        return Ok(Chain::Forward(Some(Unchained::Unknown)));
    };
    match answered_in(memory, tenant, previous).await {
        Err(err) => {
            tracing::warn!(error = %err, "finding a previous response's conversation failed");
            let reason = DegradedReason::of(&err);
            Ok(match key {
                Some(key) => Chain::Degraded(key, Box::new(settings), reason),
                None => Chain::Forward(Some(Unchained::Store(reason))),
            })
        }
        Ok(None) => Ok(Chain::Forward(Some(Unchained::Unknown))),
        Ok(Some(found)) => Ok(match key {
            Some(key) => Chain::Memory(key, Box::new(settings)),
            None => {
                let settings = state.config.profile(&found.agent).clone();
                if settings.enabled {
                    Chain::Memory(found, Box::new(settings))
                } else {
                    Chain::Forward(None)
                }
            }
        }),
    }
}

/// The conversation `tenant` was answered `id` in (a store read, off the runtime's threads).
async fn answered_in(
    memory: &Arc<Memory>,
    tenant: TenantId,
    id: String,
) -> Result<Option<ConversationKey>, StoreError> {
    let memory = Arc::clone(memory);
    tokio::task::spawn_blocking(move || memory.store.response_conversation(&tenant, &id))
        .await
        .map_err(|err| StoreError::Engine(Box::new(err)))?
}

/// The id of `GET`/`DELETE /v1/responses/{id}` (nothing after it).
pub fn stored_response_route<'a>(method: &Method, api_path: &'a str) -> Option<&'a str> {
    if method != Method::GET && method != Method::DELETE {
        return None;
    }
    let id = api_path.strip_prefix("/v1/responses/")?;
    (!id.is_empty() && !id.contains('/')).then_some(id)
}

/// `GET`/`DELETE /v1/responses/{id}` for an id memproxy answered (for this tenant): the stored
/// reply as a response object, or the id forgotten. `None`: memproxy never answered it (the
/// request goes to the upstream).
pub async fn stored_response(
    state: &Arc<AppState>,
    method: &Method,
    headers: &HeaderMap,
    id: &str,
) -> Result<Option<Response<ProxyBody>>, ProxyError> {
    let Some(memory) = state.memory() else {
        return Ok(None);
    };
    let credential = credential_of(headers)?;
    let tenant = TenantId::of(credential.as_ref());
    // A store that cannot be read: the upstream answers (it may hold the id).
    let Ok(Some(key)) = answered_in(memory, tenant.clone(), id.to_string()).await else {
        return Ok(None);
    };
    if method == Method::DELETE {
        let forgotten = {
            let memory = Arc::clone(memory);
            let id = id.to_string();
            tokio::task::spawn_blocking(move || memory.store.forget_response(&tenant, &id)).await
        };
        if !matches!(forgotten, Ok(Ok(true))) {
            return Ok(None);
        }
        let body = serde_json::json!({"id": id, "object": "response", "deleted": true});
        return Ok(Some(json_response(StatusCode::OK, body.to_string())));
    }
    let memory = Arc::clone(memory);
    let wanted = id.to_string();
    let found = tokio::task::spawn_blocking(move || find_reply(&memory, &key, &wanted))
        .await
        .ok()
        .flatten();
    Ok(Some(match found {
        Some(object) => json_response(StatusCode::OK, object.to_string()),
        // The conversation was deleted (or trimmed past the reply) since.
        None => ProxyError::NotFound {
            method: method.to_string(),
            path: format!("/v1/responses/{id}"),
        }
        .into_response(),
    }))
}

/// The stored reply answered as `id`, newest first, read a few turns at a time.
fn find_reply(
    memory: &crate::memory::Memory,
    key: &ConversationKey,
    id: &str,
) -> Option<serde_json::Value> {
    let store = &memory.store;
    let handle = store.conversation(key).ok()?;
    let conversation = lock(&handle);
    let replies: Vec<u64> = conversation
        .entries
        .iter()
        .rev()
        .filter(|e| e.role == crate::message::Role::Assistant)
        .map(|e| e.turn)
        .collect();
    for batch in replies.chunks(16) {
        let messages = store.messages(&conversation, batch.iter().copied()).ok()?;
        if let Some(found) = messages
            .iter()
            .find(|m| response_id_of(&m.message).as_deref() == Some(id))
        {
            return response_object(&found.message);
        }
    }
    None
}
