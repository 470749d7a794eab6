//! The HTTP edge of memory: what turns a chat request into a plan, a forward and a commit,
//! and the `X-Memory-*` headers that say what happened.
//!
//! - [`identify`] — `X-Memory-*` headers and the path form → conversation key and settings;
//! - [`chat`] — memory around the one forward path, for chat completions, the Responses API and
//!   the Anthropic Messages API alike: admit, `before` (collect the body, parse, plan, start a
//!   due summary), forward, `after` (tee or collect the reply, commit);
//! - [`exit`] — every way out of a memory request as one [`exit::Exit`], and the one place
//!   that writes what it says (`X-Memory-*` headers, metrics, the ledger entry) and hangs what
//!   must outlive the answer on its body ([`exit::AnswerGuard`]);
//! - [`responses`] — the Responses API's chaining (`previous_response_id` → conversation) and
//!   `GET`/`DELETE /v1/responses/{id}`;
//! - [`tee`] — an SSE body passed through frame by frame while the reply is read from it;
//! - [`passthrough`] — everything else, forwarded untouched.

pub mod chat;
pub mod exchange_ledger;
pub mod exit;
pub mod identify;
pub mod responses;
pub mod tee;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::body::{IdleTimeout, ProxyBody, boxed, full};
use crate::error::ProxyError;
use crate::metrics::{ReplyKind, Stage};
use crate::state::AppState;
use crate::store::StoreError;
use crate::upstream::{Forward, UpstreamBody};
use crate::wire::Api;
use bytes::Bytes;
use http::HeaderName;
use http::request::Parts;

pub const STATUS_HEADER: HeaderName = HeaderName::from_static("x-memory-status");
pub const TURNS_HEADER: HeaderName = HeaderName::from_static("x-memory-turns");
pub const CONVERSATION_ID_HEADER: HeaderName = HeaderName::from_static("x-memory-conversation-id");
pub const RETRIEVED_HEADER: HeaderName = HeaderName::from_static("x-memory-retrieved");
pub const RETRIEVED_TURNS_HEADER: HeaderName = HeaderName::from_static("x-memory-retrieved-turns");
/// Memories about the user in the prompt (long-term memory), when there are any.
pub const MEMORIES_HEADER: HeaderName = HeaderName::from_static("x-memory-memories");
/// Turns recalled from the user's other conversations (long-term memory), when there are any.
pub const RETRIEVED_ELSEWHERE_HEADER: HeaderName =
    HeaderName::from_static("x-memory-retrieved-elsewhere");
/// How recall searched: `hybrid` (words and meaning) or `lexical; reason=…` (words alone:
/// `setting`, `no-embedder`, `embedder-unavailable`, `query-embedding-failed`, `no-vectors`).
pub const RECALL_HEADER: HeaderName = HeaderName::from_static("x-memory-recall");
pub const PROMPT_TOKENS_HEADER: HeaderName = HeaderName::from_static("x-memory-prompt-tokens");
/// Tokens the request would have sent without memproxy (the token ledger).
pub const HISTORY_TOKENS_HEADER: HeaderName = HeaderName::from_static("x-memory-history-tokens");
pub const BUDGET_HEADER: HeaderName = HeaderName::from_static("x-memory-budget");
pub const SUMMARY_HEADER: HeaderName = HeaderName::from_static("x-memory-summary");
pub const REASON_HEADER: HeaderName = HeaderName::from_static("x-memory-reason");

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

/// Why a request went without memory (`X-Memory-Status: degraded`), sent as `X-Memory-Reason`:
/// a closed set of codes; the details are in the log and in `/readyz`, never in a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DegradedReason {
    /// The store could not be opened at start: memory is off for the whole process.
    StoreUnavailable,
    /// The store's writes fail (a full disk): memory is off until a retry succeeds.
    StoreUnwritable,
    /// Reading the conversation failed (a damaged record, a missing key).
    StoreFailed,
    /// The exchange was forwarded with memory but could not be stored.
    CommitFailed,
    /// The memory guard did not admit the request: memproxy is at its memory high-water mark.
    MemoryBudget,
}

impl DegradedReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DegradedReason::StoreUnavailable => "store-unavailable",
            DegradedReason::StoreUnwritable => "store-unwritable",
            DegradedReason::StoreFailed => "store-error",
            DegradedReason::CommitFailed => "commit-failed",
            DegradedReason::MemoryBudget => "memory-budget",
        }
    }

    /// The reason a store error gives.
    pub fn of(err: &StoreError) -> DegradedReason {
        if err.is_write_failure() {
            DegradedReason::StoreUnwritable
        } else {
            DegradedReason::StoreFailed
        }
    }
}

/// Forwards a request untouched: method, path, query, headers (less hop-by-hop and
/// `x-memory-*`), body streamed both ways, status unchanged. A request body that pauses longer
/// than `server.body_read_timeout` cuts the upstream request (408); the answer's body is
/// bounded by `upstream.idle_timeout` (see `upstream.rs`).
pub async fn passthrough(
    state: &AppState,
    request: Request<Incoming>,
    api_path: &str,
) -> Result<Response<ProxyBody>, ProxyError> {
    let query = request.uri().query().map(str::to_string);
    let (parts, body) = request.into_parts();
    let forwarded = state
        .upstream_for_path(api_path, &parts.headers)
        .forward(Forward {
            method: parts.method,
            path: api_path,
            query: query.as_deref(),
            headers: &parts.headers,
            body: boxed(IdleTimeout::new(body, state.config.body_read_timeout)),
            body_len: None,
            read_reply: false,
            task: None,
        })
        .await?;
    let (mut head, body) = forwarded.response.into_parts();
    state
        .metrics
        .upstream(&mut head.extensions, forwarded.elapsed);
    Ok(Response::from_parts(head, boxed(body)))
}

/// A request's head and where it goes: its API's upstream, at `api_path`.
#[derive(Clone, Copy)]
pub struct Outbound<'a> {
    pub parts: &'a Parts,
    pub api: Api,
    pub api_path: &'a str,
}

/// Forwards a body memproxy holds, as it is (`read_reply`: memproxy will read the answer).
pub async fn forward_held(
    state: &AppState,
    to: Outbound<'_>,
    body: Bytes,
    read_reply: bool,
) -> Result<Response<UpstreamBody>, ProxyError> {
    let Outbound {
        parts,
        api,
        api_path,
    } = to;
    let forwarded = state
        .upstream_for(api)
        .forward(Forward {
            method: parts.method.clone(),
            path: api_path,
            query: parts.uri.query(),
            headers: &parts.headers,
            body_len: Some(body.len()),
            body: full(body),
            read_reply,
            task: None,
        })
        .await?;
    let (mut head, body) = forwarded.response.into_parts();
    state
        .metrics
        .upstream(&mut head.extensions, forwarded.elapsed);
    Ok(Response::from_parts(head, body))
}

/// The `after` step's store: commits the exchange and records its time. A failure is logged
/// here and becomes `X-Memory-Status: degraded` with the returned reason.
pub async fn commit(
    state: &AppState,
    exchange: crate::pipeline::commit::Exchange,
    reply: Box<serde_json::value::RawValue>,
    kind: ReplyKind,
) -> Result<usize, DegradedReason> {
    let Some(memory) = state.memory() else {
        return Err(DegradedReason::StoreUnavailable);
    };
    let started = std::time::Instant::now();
    match exchange.commit(std::sync::Arc::clone(memory), reply).await {
        Ok(committed) => {
            state
                .metrics
                .observe_stage(Stage::Commit, started.elapsed());
            state.metrics.committed(committed.here);
            Ok(committed.messages)
        }
        Err(err) => {
            state.metrics.commit_failed(kind);
            tracing::error!(error = %err, reply = kind.as_str(), "storing the exchange failed");
            Err(match DegradedReason::of(&err) {
                DegradedReason::StoreUnwritable => DegradedReason::StoreUnwritable,
                _ => DegradedReason::CommitFailed,
            })
        }
    }
}
