//! The memory pipeline for `POST /v1/chat/completions`, one stage per file:
//!
//! 1. [`identify`] — conversation key and settings from headers or the path form
//!    (done by the router, which needs it for every route);
//! 2. [`reconcile`] — which of the request's messages are new;
//! 3. [`window`] — the recent window; [`recall`] — relevant older turns; [`budget`] — the
//!    token budget; the summary stage fills its own slot of the prompt;
//! 4. [`assemble`] — the forwarded `messages` ([`plan`] runs stages 2–4 under the
//!    conversation's lock);
//! 5. forward (here, through [`crate::upstream`]);
//! 6. [`capture`] — the reply, read from JSON or teed from SSE;
//! 7. [`commit`] — new messages and the reply, stored atomically and durably.
//!
//! Invariant: a memory failure never fails the chat request. If the store cannot be read, the
//! request goes upstream with the client's own messages and `X-Memory-Status: degraded`.

pub mod assemble;
pub mod budget;
pub mod capture;
pub mod commit;
pub mod identify;
pub mod plan;
pub mod recall;
pub mod reconcile;
pub mod summary;
pub mod window;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, Response, request::Parts};
use hyper::body::Incoming;

use http::HeaderMap;

use self::capture::TeeBody;
use self::commit::DeferredSummary;
use self::plan::Plan;
use crate::body::{CollectError, OnDrop, ProxyBody, boxed, collect_limited, full};
use crate::error::ProxyError;
use crate::identity::ConversationKey;
use crate::message::ChatRequest;
use crate::reply::reply_from_json;
use crate::settings::MemorySettings;
use crate::state::AppState;
use crate::upstream::forwardable;

pub const STATUS_HEADER: &str = "x-memory-status";
pub const TURNS_HEADER: &str = "x-memory-turns";
pub const CONVERSATION_ID_HEADER: &str = "x-memory-conversation-id";
pub const RETRIEVED_HEADER: &str = "x-memory-retrieved";
pub const RETRIEVED_TURNS_HEADER: &str = "x-memory-retrieved-turns";
pub const PROMPT_TOKENS_HEADER: &str = "x-memory-prompt-tokens";
pub const BUDGET_HEADER: &str = "x-memory-budget";
pub const SUMMARY_HEADER: &str = "x-memory-summary";

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

/// Runs a chat completion with memory on, forwarded to `upstream_uri`.
pub async fn chat(
    state: &Arc<AppState>,
    parts: Parts,
    body: Incoming,
    key: ConversationKey,
    settings: MemorySettings,
    upstream_uri: http::Uri,
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
    let planned = plan::plan(state, &key, &settings, request.model.clone(), messages);
    let mut plan_headers = HeaderMap::new();
    let (forward_body, plan) = match planned {
        Ok(mut plan) => {
            summarize_if_due(state, &settings, &parts.headers, &mut plan).await;
            plan_headers = headers_of(&plan);
            state.metrics.planned(&plan);
            (
                Bytes::from(request.body_with_messages(plan.prompt.messages())),
                Some(plan),
            )
        }
        Err(err) => {
            tracing::error!(error = %err, "memory unavailable; forwarding the client's own messages");
            (bytes, None)
        }
    };

    let mut upstream_request = Request::new(full(forward_body.clone()));
    *upstream_request.method_mut() = parts.method.clone();
    *upstream_request.uri_mut() = upstream_uri;
    let headers = upstream_request.headers_mut();
    *headers = state.upstream.request_headers(&parts.headers);
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(
        header::CONTENT_LENGTH,
        HeaderValue::from(forward_body.len()),
    );
    // The reply must be read: ask for an uncompressed body. The client's leg is local.
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );

    let started = Instant::now();
    let response = state.upstream.send(upstream_request).await;
    tracing::Span::current().record("upstream_ms", started.elapsed().as_millis() as u64);
    let response = response?;

    let (mut head, upstream_body) = response.into_parts();
    state
        .metrics
        .upstream(&mut head.extensions, started.elapsed());
    head.headers = forwardable(&head.headers);
    head.headers.extend(plan_headers);
    let conversation_id = key.conversation.clone();

    let Some(plan) = plan else {
        let mut response = Response::from_parts(head, boxed(upstream_body));
        set_memory_headers(
            &mut response,
            MemoryStatus::Degraded,
            &conversation_id,
            None,
        );
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
            let pending = (Arc::clone(state), Arc::new(plan.exchange));
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
            Some(reply) => match plan.exchange.commit(state, reply).await {
                Ok(count) => (MemoryStatus::Stored, count),
                Err(err) => {
                    tracing::error!(error = %err, "storing the exchange failed");
                    (MemoryStatus::Degraded, plan.stored_count)
                }
            },
        }
    };
    // A due summary starts once the answer has been handed over, so its work never competes
    // with the request that triggered it.
    let body = match plan.exchange.take_summary() {
        None => full(body),
        Some(summary) => boxed(OnDrop::new(full(body), move || drop(summary))),
    };
    let mut response = Response::from_parts(head, body);
    set_memory_headers(&mut response, status, &conversation_id, Some(turns));
    Ok(response)
}

/// Starts a due summary: queued for the background worker once the exchange is stored, or with
/// `compression_async = false` made now, so this request already carries it. A failure leaves
/// the previous summary in place.
async fn summarize_if_due(
    state: &Arc<AppState>,
    settings: &MemorySettings,
    request_headers: &HeaderMap,
    plan: &mut Plan,
) {
    let Some(mut job) = plan.summary_due.take() else {
        return;
    };
    // The triggering request's credentials, held in memory only for the call.
    job.authorization = request_headers.get(header::AUTHORIZATION).cloned();
    if settings.compression_async {
        // Queued when this exchange is done with (`commit::DeferredSummary`).
        *plan
            .exchange
            .deferred_summary
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(DeferredSummary::new(Arc::clone(state), job));
        return;
    }
    let started = std::time::Instant::now();
    let result = state.summarizer.run_now(job).await;
    state
        .metrics
        .observe_stage(crate::metrics::Stage::Summary, started.elapsed());
    match result {
        Ok(record) => {
            plan.prompt.summary = summary::render(&record);
            plan.summary = Some(record);
        }
        Err(err) => {
            tracing::warn!(error = %err, "synchronous summary failed; using the previous one")
        }
    }
}

/// The headers that describe a plan: what was recalled, the prompt's size, the budget, the
/// summary.
fn headers_of(plan: &Plan) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let label = plan
        .summary
        .as_ref()
        .map_or_else(|| "none".to_string(), |r| r.label());
    if let Ok(value) = HeaderValue::from_str(&label) {
        headers.insert(SUMMARY_HEADER, value);
    }
    headers.insert(
        RETRIEVED_HEADER,
        HeaderValue::from(plan.recalled_turns.len()),
    );
    let turns: Vec<String> = plan.recalled_turns.iter().map(u64::to_string).collect();
    if let Ok(value) = HeaderValue::from_str(&turns.join(",")) {
        headers.insert(RETRIEVED_TURNS_HEADER, value);
    }
    headers.insert(PROMPT_TOKENS_HEADER, HeaderValue::from(plan.prompt_tokens));
    if let Some(fitted) = plan.fitted {
        let verdict = if fitted.exceeded {
            "exceeded"
        } else if fitted.truncated || fitted.dropped_recalled > 0 || fitted.dropped_window > 0 {
            "trimmed"
        } else {
            "fits"
        };
        headers.insert(BUDGET_HEADER, HeaderValue::from_static(verdict));
    }
    headers
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
