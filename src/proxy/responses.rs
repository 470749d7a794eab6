//! What the Responses API adds at the edge: finding a chained request's conversation from its
//! `previous_response_id` (the tenant's map of ids memproxy answered, `response_ids.rs`), and
//! `GET`/`DELETE /v1/responses/{id}` for those ids.
//!
//! A request chained to an id memproxy does not know (answered by the upstream directly, or
//! forgotten) is forwarded as sent with `X-Memory-Status: off` and
//! `X-Memory-Reason: unknown-previous-response`: memproxy cannot rebuild a history it never
//! saw, and the upstream may still hold it.

use std::sync::Arc;

use bytes::Bytes;
use http::header::HeaderValue;
use http::request::Parts;
use http::{HeaderMap, Method, Response, StatusCode};

use super::identify::credential_of;
use super::{MemoryStatus, REASON_HEADER, set_memory_headers};
use crate::body::ProxyBody;
use crate::error::{ProxyError, json_response};
use crate::identity::{ConversationKey, TenantId};
use crate::message::parse_object;
use crate::settings::MemorySettings;
use crate::state::AppState;
use crate::store::lock;
use crate::wire::responses::{previous_id_field, response_object};
use crate::wire::{Api, response_id_of};

/// The reason sent with a chained request memproxy cannot serve with memory.
pub const UNKNOWN_PREVIOUS: &str = "unknown-previous-response";

/// Where a Responses request goes.
#[derive(Debug)]
pub enum Chain {
    /// Memory runs for this conversation (the settings boxed: they are most of its size).
    Memory(ConversationKey, Box<MemorySettings>),
    /// Forwarded as sent; `true`: memory is said to be off for it (an unknown
    /// `previous_response_id`).
    Forward(bool),
}

/// Resolves a Responses request's conversation: the conversation id it names (header or path
/// form), else the one its `previous_response_id` was answered in. An unknown
/// `previous_response_id` turns memory off for the request, conversation id or not.
pub fn resolve(
    state: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    key: Option<ConversationKey>,
    settings: MemorySettings,
) -> Result<Chain, ProxyError> {
    // A body that does not parse is refused by the planner with the field at fault.
    let previous = parse_object(body)
        .ok()
        .and_then(|fields| previous_id_field(&fields).ok().flatten());
    let Some(previous) = previous else {
        return Ok(match key {
            Some(key) => Chain::Memory(key, Box::new(settings)),
            None => Chain::Forward(false),
        });
    };
    let tenant = match &key {
        Some(key) => key.tenant.clone(),
        None => match credential_of(headers)? {
            Some(credential) => TenantId::of(Some(&credential)),
            None if state.config.allow_anonymous => TenantId::of(None),
            None => return Ok(Chain::Forward(true)),
        },
    };
    match state.response_ids.get(&tenant, &previous) {
        None => Ok(Chain::Forward(true)),
        Some(found) => Ok(match key {
            Some(key) => Chain::Memory(key, Box::new(settings)),
            None => {
                let settings = state.config.profile(&found.agent).clone();
                if settings.enabled {
                    Chain::Memory(found, Box::new(settings))
                } else {
                    Chain::Forward(false)
                }
            }
        }),
    }
}

/// Forwards a Responses request as the client sent it; with `unknown_previous`, marked memory
/// off with the reason.
pub async fn forward_as_sent(
    state: &AppState,
    parts: &Parts,
    body: Bytes,
    api_path: &str,
    unknown_previous: bool,
) -> Result<Response<ProxyBody>, ProxyError> {
    let mut response =
        super::forward_bytes(state, parts, body, Api::Responses, api_path, false).await?;
    if unknown_previous {
        let conversation = parts
            .headers
            .get(super::identify::CONVERSATION_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        set_memory_headers(&mut response, MemoryStatus::Off, &conversation, None);
        if conversation.is_empty() {
            response.headers_mut().remove(super::CONVERSATION_ID_HEADER);
        }
        response
            .headers_mut()
            .insert(REASON_HEADER, HeaderValue::from_static(UNKNOWN_PREVIOUS));
    }
    Ok(response)
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
    let Some(key) = state.response_ids.get(&tenant, id) else {
        return Ok(None);
    };
    if method == Method::DELETE {
        state.response_ids.remove(&tenant, id);
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
