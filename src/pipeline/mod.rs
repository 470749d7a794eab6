//! The memory pipeline for `POST /v1/chat/completions`, one stage per file:
//!
//! 1. [`identify`] — conversation key and settings from headers or the path form
//!    (done by the router, which needs it for every route);
//! 2. [`reconcile`] — which of the request's messages are new;
//! 3. recall and summary stages fill their slots of the prompt (later stages);
//! 4. [`window`] + [`assemble`] — the forwarded `messages`;
//! 5. forward (here, through [`crate::upstream`]);
//! 6. [`capture`] — the reply, read from JSON or teed from SSE;
//! 7. [`commit`] — new messages and the reply, stored atomically and durably.
//!
//! Invariant: a memory failure never fails the chat request. If the store cannot be read, the
//! request goes upstream with the client's own messages and `X-Memory-Status: degraded`.

pub mod assemble;
pub mod capture;
pub mod commit;
pub mod identify;
pub mod reconcile;
pub mod window;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, request::Parts};
use hyper::body::Incoming;

use self::assemble::{Prompt, split_request};
use self::capture::TeeBody;
use self::commit::{Exchange, last_is_reply};
use self::reconcile::{Mark, align};
use self::window::window_start;
use crate::body::{CollectError, ProxyBody, boxed, collect_limited, full};
use crate::error::ProxyError;
use crate::identity::ConversationKey;
use crate::message::{ChatRequest, Message, Role};
use crate::reply::reply_from_json;
use crate::settings::MemorySettings;
use crate::state::AppState;
use crate::store::{Store, StoreError, lock};
use crate::upstream::forwardable;

pub const STATUS_HEADER: &str = "x-memory-status";
pub const TURNS_HEADER: &str = "x-memory-turns";
pub const CONVERSATION_ID_HEADER: &str = "x-memory-conversation-id";

/// What happened to memory on a request, sent as `X-Memory-Status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryStatus {
    /// The exchange was (or, for a stream, will be once it completes) stored.
    Stored,
    /// Memory was used but nothing stored (`persist` off, or an upstream error).
    NotStored,
    /// Memory is off for this request.
    Off,
    /// The store failed; the request went through with the client's own messages.
    Degraded,
}

impl MemoryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryStatus::Stored => "stored",
            MemoryStatus::NotStored => "not-stored",
            MemoryStatus::Off => "off",
            MemoryStatus::Degraded => "degraded",
        }
    }
}

/// A planned exchange: the prompt to forward and what to commit afterwards.
struct Plan {
    prompt: Prompt,
    exchange: Exchange,
    /// Messages stored now (before this exchange).
    stored_count: usize,
    /// Messages stored once this exchange commits as planned.
    planned_count: usize,
}

/// Runs a chat completion with memory on. `upstream_path` is the `/v1/...` path and query.
pub async fn chat(
    state: &Arc<AppState>,
    parts: Parts,
    body: Incoming,
    key: ConversationKey,
    settings: MemorySettings,
    upstream_path: &str,
) -> Result<Response<ProxyBody>, ProxyError> {
    let bytes = collect_limited(body, state.config.body_limit_bytes)
        .await
        .map_err(|err| match err {
            CollectError::TooLarge { limit } => ProxyError::PayloadTooLarge { limit },
            CollectError::Read(err) => ProxyError::InvalidRequest {
                message: format!("the request body could not be read: {err}"),
                param: None,
                code: "invalid_body",
            },
        })?;
    let mut request = ChatRequest::parse(&bytes)?;
    if let Some(model) = &request.model {
        tracing::Span::current().record("model", model.as_str());
    }

    let messages = std::mem::take(&mut request.messages);
    let planned = plan(&state.store, &key, &settings, request.model.clone(), messages);
    let (forward_body, plan) = match planned {
        Ok(plan) => (
            Bytes::from(request.body_with_messages(plan.prompt.messages())),
            Some(plan),
        ),
        Err(err) => {
            tracing::error!(error = %err, "memory unavailable; forwarding the client's own messages");
            (bytes, None)
        }
    };

    let mut upstream_request = Request::new(full(forward_body.clone()));
    *upstream_request.method_mut() = parts.method.clone();
    *upstream_request.uri_mut() = state.upstream.uri_for(upstream_path)?;
    let headers = upstream_request.headers_mut();
    *headers = state.upstream.request_headers(&parts.headers);
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(forward_body.len()));
    // The reply must be read: ask for an uncompressed body. The client's leg is local.
    headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));

    let started = Instant::now();
    let response = state.upstream.send(upstream_request).await;
    tracing::Span::current().record("upstream_ms", started.elapsed().as_millis() as u64);
    let response = response?;

    let (mut head, upstream_body) = response.into_parts();
    head.headers = forwardable(&head.headers);
    let conversation_id = key.conversation.clone();

    let Some(plan) = plan else {
        let mut response = Response::from_parts(head, boxed(upstream_body));
        set_memory_headers(&mut response, MemoryStatus::Degraded, &conversation_id, None);
        return Ok(response);
    };

    if !head.status.is_success() {
        let mut response = Response::from_parts(head, boxed(upstream_body));
        set_memory_headers(
            &mut response,
            MemoryStatus::NotStored,
            &conversation_id,
            Some(plan.stored_count),
        );
        return Ok(response);
    }

    let is_stream = head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));

    if is_stream {
        let (status, turns, pending) = if settings.persist {
            let pending = (Arc::clone(&state.store), Arc::new(plan.exchange));
            (MemoryStatus::Stored, plan.planned_count, Some(pending))
        } else {
            (MemoryStatus::NotStored, plan.stored_count, None)
        };
        let mut response = Response::from_parts(head, boxed(TeeBody::new(upstream_body, pending)));
        set_memory_headers(&mut response, status, &conversation_id, Some(turns));
        return Ok(response);
    }

    // A JSON reply is complete only at its end: read it, store it, then answer.
    let body = collect_limited(upstream_body, state.config.response_limit_bytes)
        .await
        .map_err(|err| ProxyError::UpstreamUnreachable(Box::new(err)))?;
    let (status, turns) = if !settings.persist {
        (MemoryStatus::NotStored, plan.stored_count)
    } else {
        match reply_from_json(&body) {
            None => {
                tracing::warn!("upstream answer has no choices[0].message; nothing stored");
                (MemoryStatus::NotStored, plan.stored_count)
            }
            Some(reply) => match plan.exchange.commit(&state.store, reply).await {
                Ok(count) => (MemoryStatus::Stored, count),
                Err(err) => {
                    tracing::error!(error = %err, "storing the exchange failed");
                    (MemoryStatus::Degraded, plan.stored_count)
                }
            },
        }
    };
    let mut response = Response::from_parts(head, full(body));
    set_memory_headers(&mut response, status, &conversation_id, Some(turns));
    Ok(response)
}

/// Reconciles the request with the stored conversation and assembles the prompt.
fn plan(
    store: &Store,
    key: &ConversationKey,
    settings: &MemorySettings,
    model: Option<String>,
    messages: Vec<Message>,
) -> Result<Plan, StoreError> {
    let handle = store.conversation(key)?;
    let conversation = lock(&handle);
    let entries = &conversation.entries;

    // The request's conversation messages (instructions are not turns), by request index.
    let turn_index: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.role.is_instruction())
        .map(|(i, _)| i)
        .collect();
    let marks: Vec<Mark> = turn_index.iter().map(|&i| Mark::from(&messages[i])).collect();
    let alignment = align(entries, last_is_reply(entries), &marks);
    let from = alignment.from().min(marks.len());
    let history = match alignment {
        reconcile::Alignment::ReplaceLastReply { .. } => &entries[..entries.len() - 1],
        reconcile::Alignment::Append { .. } => &entries[..],
    };

    // The window must hold the current round when the new messages continue it.
    let continue_round = marks.get(from).is_none_or(|m| m.role != Role::User);
    let start = window_start(history, settings.recent_n, continue_round);
    let window = store
        .messages(&conversation, history[start..].iter().map(|e| e.turn))?
        .into_iter()
        .map(|m| m.message)
        .collect();

    let first_new = turn_index.get(from).copied().unwrap_or(messages.len());
    let new_turns: Vec<Message> = turn_index[from..]
        .iter()
        .map(|&i| messages[i].clone())
        .collect();
    let (instructions, incoming) = split_request(messages, first_new);

    let exchange = Exchange {
        key: key.clone(),
        handle: Arc::clone(&handle),
        marks,
        alignment,
        new_turns,
        planned_next_turn: conversation.meta.as_ref().map(|m| m.next_turn),
        max_messages: settings.max_messages,
        model,
    };
    let planned_count = exchange.planned_count(entries);
    let stored_count = entries.len();
    drop(conversation);
    Ok(Plan {
        prompt: Prompt {
            instructions,
            summary: None,
            recalled: None,
            window,
            incoming,
        },
        exchange,
        stored_count,
        planned_count,
    })
}

/// Sets `X-Memory-Status`, `X-Memory-Conversation-Id` and `X-Memory-Turns`.
pub fn set_memory_headers(
    response: &mut Response<ProxyBody>,
    status: MemoryStatus,
    conversation: &str,
    turns: Option<usize>,
) {
    let headers = response.headers_mut();
    headers.insert(STATUS_HEADER, HeaderValue::from_static(status.as_str()));
    if let Ok(value) = HeaderValue::from_str(conversation) {
        headers.insert(CONVERSATION_ID_HEADER, value);
    }
    if let Some(turns) = turns {
        headers.insert(TURNS_HEADER, HeaderValue::from(turns));
    }
}
