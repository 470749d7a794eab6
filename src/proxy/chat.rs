//! A request with memory on, in any of the three APIs (chat completions, Responses, Anthropic
//! Messages; `wire/` reads and writes each): admission against the memory budget, then a
//! `before` step (collect the body, parse it, plan the prompt, start a due summary) and an
//! `after` step (tee a stream, or read a JSON reply whole, then commit) around the one forward
//! path.
//!
//! Admission first: a request the memory guard does not admit (the process is at its
//! high-water mark, or would be with this request) is forwarded untouched, its body streamed
//! and never read whole, with `X-Memory-Status: degraded`: memory is off for it, the chat goes
//! on. An admitted request holds its reservation until its response body is done with.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Response, request::Parts};
use http_body::Body as _;
use hyper::body::Incoming;

use super::identify::CREDENTIAL_HEADERS;
use super::ledger::ExchangeLedger;
use super::responses::Chain;
use super::tee::{Pending, TeeBody};
use super::{
    DegradedReason, MemoryStatus, commit, forward_bytes, forward_held, headers_of, passthrough,
    set_degraded_reason, set_memory_headers,
};
use crate::body::{CollectError, OnDrop, ProxyBody, boxed, collect_limited, full};
use crate::error::ProxyError;
use crate::identity::ConversationKey;
use crate::longterm::ExtractionCall;
use crate::longterm::extract::HandOver;
use crate::memory::Memory;
use crate::memory_guard::{self, Pressure};
use crate::metrics::{Refusal, ReplyKind, Stage, UpstreamTime};
use crate::model::Credentials;
use crate::pipeline::plan::start_due;
use crate::pipeline::plan::{self, Plan, PlanError, RequestLimits, Timings};
use crate::receipts::{Made, Planned, RECEIPT_HEADER, Receipt};
use crate::reply::reply_of;
use crate::settings::MemorySettings;
use crate::state::AppState;
use crate::summary::DeferredSummary;
use crate::upstream::UpstreamBody;
use crate::wire::usage::Usage;
use crate::wire::{Api, ApiRequest};

/// What the `before` step made: the body to forward, and the plan (or why memory failed: the
/// client's own body goes upstream).
struct Before {
    body: Bytes,
    plan: Result<Plan, Skipped>,
    headers: HeaderMap,
    deferred: Option<DeferredSummary>,
    /// A due extraction starts once this is dropped with the answer.
    hand_over: Option<HandOver>,
}

/// Why the `before` step made no plan: memory failed (`degraded`), or the request is not one
/// for memory (`off`: a side call, forwarded as sent).
enum Skipped {
    Degraded(DegradedReason),
    Off(&'static str),
}

/// A request for memory, as the router identified it.
pub struct MemoryRequest {
    pub parts: Parts,
    pub body: Incoming,
    /// Its conversation; `None` only for a Responses request without a conversation id,
    /// whose `conversation` field or `previous_response_id` may name one.
    pub key: Option<ConversationKey>,
    /// The agent whose profile applies (`X-Memory-Agent`, or the path form's).
    pub agent: String,
    /// The user it names (`X-Memory-User-Id`): long-term memory takes part.
    pub user: Option<String>,
    pub settings: MemorySettings,
    pub api: Api,
    /// The upstream path it goes to.
    pub api_path: String,
}

/// Runs a request of an API memory serves with memory on; with memory off if the memory
/// guard does not admit it.
pub async fn chat(
    state: &Arc<AppState>,
    memory: &Arc<Memory>,
    request: MemoryRequest,
) -> Result<Response<ProxyBody>, ProxyError> {
    let MemoryRequest {
        parts,
        body,
        key,
        agent,
        user,
        settings,
        api,
        api_path,
    } = request;
    let api_path = api_path.as_str();
    // A body announced past the size limit is refused (413) before anything is read.
    let announced = body.size_hint().exact();
    if announced.is_some_and(|len| len > state.config.body_limit_bytes as u64) {
        return Err(ProxyError::PayloadTooLarge {
            limit: state.config.body_limit_bytes,
        });
    }
    let reservation = match state.memory_guard.admit(memory_guard::estimate(announced)) {
        Ok(reservation) => reservation,
        Err(pressure) => {
            return degraded(state, parts, body, key.as_ref(), api_path, pressure).await;
        }
    };
    let bytes = collect_body(state, body).await?;
    let (key, settings) = match (api, key) {
        (Api::Responses, key) => {
            let chain = super::responses::resolve(
                state,
                memory,
                &parts.headers,
                &bytes,
                key,
                Some(&agent),
                settings,
            )
            .await?;
            match chain {
                Chain::Memory(key, settings) => (key, *settings),
                Chain::Degraded(key, settings, reason) => {
                    let to = Destination::new(&parts, &key, &settings, api, api_path);
                    let response = without_memory(state, to, bytes, reason).await?;
                    return Ok(
                        response.map(|body| boxed(OnDrop::new(body, move || drop(reservation))))
                    );
                }
                Chain::Forward(reason) => {
                    let response =
                        super::responses::forward_as_sent(state, &parts, bytes, api_path, reason)
                            .await?;
                    return Ok(
                        response.map(|body| boxed(OnDrop::new(body, move || drop(reservation))))
                    );
                }
            }
        }
        (_, Some(key)) => (key, settings),
        (_, None) => {
            let forwarded = forward_bytes(state, &parts, bytes, api, api_path, false).await?;
            return Ok(forwarded);
        }
    };
    let to = Destination::new(&parts, &key, &settings, api, api_path);
    let response = with_memory(state, memory, to, user, bytes).await?;
    Ok(response.map(|body| boxed(OnDrop::new(body, move || drop(reservation)))))
}

/// Reads the client's body within `body_limit` and `body_read_timeout`.
async fn collect_body(state: &AppState, body: Incoming) -> Result<Bytes, ProxyError> {
    let config = &state.config;
    collect_limited(body, config.body_limit_bytes, config.body_read_timeout)
        .await
        .map_err(|err| match err {
            CollectError::TooLarge { limit } => ProxyError::PayloadTooLarge { limit },
            CollectError::TimedOut { within } => ProxyError::RequestTimeout { within },
            CollectError::Read(err) => ProxyError::InvalidRequest {
                message: format!("the request body could not be read: {err}"),
                param: None,
                code: "invalid_body",
            },
        })
}

/// A request the memory guard did not admit: forwarded untouched, as pass-through is,
/// with `X-Memory-Status: degraded`, and counted.
async fn degraded(
    state: &AppState,
    parts: Parts,
    body: Incoming,
    key: Option<&ConversationKey>,
    api_path: &str,
    pressure: Pressure,
) -> Result<Response<ProxyBody>, ProxyError> {
    state.metrics.admission_refused(Refusal::Degraded, pressure);
    tracing::debug!(
        reason = pressure.as_str(),
        "memory budget: forwarding with memory off"
    );
    let mut response = passthrough(state, Request::from_parts(parts, body), api_path).await?;
    if let Some(key) = key {
        set_memory_headers(
            &mut response,
            MemoryStatus::Degraded,
            &key.conversation,
            None,
        );
        set_degraded_reason(&mut response, DegradedReason::MemoryBudget);
    }
    Ok(response)
}

/// The request with memory: before, forward, after.
async fn with_memory(
    state: &Arc<AppState>,
    memory: &Arc<Memory>,
    to: Destination<'_>,
    user: Option<String>,
    body: Bytes,
) -> Result<Response<ProxyBody>, ProxyError> {
    let (key, settings, api) = (to.key, to.settings, to.api);
    let before = before(state, memory, &to, user, body).await?;
    let mut plan = match before.plan {
        Ok(plan) => plan,
        Err(Skipped::Degraded(reason)) => {
            return without_memory(state, to, before.body, reason).await;
        }
        Err(Skipped::Off(reason)) => return memory_off(state, to, before.body, reason).await,
    };
    let receipt = state.receipts.enabled().then(|| {
        let model = plan.exchange.model.clone();
        receipt_of(state, &to, &before.body, model, Planned::take(&mut plan))
    });
    let ledger = ExchangeLedger::new(state, &key.agent, receipt.flatten());
    let (head, upstream_body, is_stream) =
        forward_told(state, &to, before.body, &ledger, before.headers, true).await?;
    let conversation_id = key.conversation.as_str();

    if !head.status.is_success() {
        let mut response = Response::from_parts(head, boxed(upstream_body));
        set_memory_headers(
            &mut response,
            MemoryStatus::NotStored,
            conversation_id,
            Some(plan.report.stored_count),
        );
        ledger.status(MemoryStatus::NotStored);
        return Ok(response);
    }

    if is_stream {
        let (status, turns, pending) = if settings.persist {
            let pending = Pending {
                state: Arc::clone(state),
                exchange: plan.exchange,
            };
            (
                MemoryStatus::Stored,
                plan.report.planned_count,
                Some(pending),
            )
        } else {
            (MemoryStatus::NotStored, plan.report.stored_count, None)
        };
        ledger.status(status);
        // The deferred summary rides with the stream: queued once it is committed or dropped.
        let tee = TeeBody::new(
            upstream_body,
            api,
            pending,
            before.deferred,
            state.config.limits.max_sse_event_bytes,
            state.config.response_limit_bytes,
        )
        .with_ledger(ledger);
        let body = match before.hand_over {
            None => boxed(tee),
            Some(hand_over) => boxed(OnDrop::new(boxed(tee), move || drop(hand_over))),
        };
        let mut response = Response::from_parts(head, body);
        set_memory_headers(&mut response, status, conversation_id, Some(turns));
        return Ok(response);
    }

    // A JSON reply is complete only at its end: read it, store it, then answer.
    // Within `upstream.read_timeout`: a stalled answer is a 504 and stores nothing.
    let (body, usage) = read_told(state, api, upstream_body, &ledger).await?;
    plan.exchange.cached_tokens = usage.map_or(0, |u| u.cached_tokens);
    let mut degraded = DegradedReason::CommitFailed;
    let (status, turns) = if !settings.persist {
        (MemoryStatus::NotStored, plan.report.stored_count)
    } else {
        match reply_of(api, &body) {
            None => {
                tracing::warn!(
                    api = api.as_str(),
                    "upstream answer has no reply to read; nothing stored"
                );
                (MemoryStatus::NotStored, plan.report.stored_count)
            }
            Some(reply) => match commit(state, plan.exchange, reply, ReplyKind::Json).await {
                Ok(count) => (MemoryStatus::Stored, count),
                Err(reason) => {
                    degraded = reason;
                    (MemoryStatus::Degraded, plan.report.stored_count)
                }
            },
        }
    };
    // A due summary starts once the answer has been handed over, so its work never competes
    // with the request that triggered it.
    let body = match (before.deferred, before.hand_over) {
        (None, None) => full(body),
        (summary, hand_over) => boxed(OnDrop::new(full(body), move || drop((summary, hand_over)))),
    };
    let mut response = Response::from_parts(head, body);
    set_memory_headers(&mut response, status, conversation_id, Some(turns));
    if status == MemoryStatus::Degraded {
        set_degraded_reason(&mut response, degraded);
        ledger.degraded(degraded);
    } else {
        ledger.status(status);
    }
    Ok(response)
}

/// Where an exchange goes, and for whom.
struct Destination<'a> {
    parts: &'a Parts,
    key: &'a ConversationKey,
    settings: &'a MemorySettings,
    api: Api,
    api_path: &'a str,
}

impl<'a> Destination<'a> {
    fn new(
        parts: &'a Parts,
        key: &'a ConversationKey,
        settings: &'a MemorySettings,
        api: Api,
        api_path: &'a str,
    ) -> Destination<'a> {
        Destination {
            parts,
            key,
            settings,
            api,
            api_path,
        }
    }
}

/// A request that is not one for memory (a side call, `wire::SideCall`): forwarded as the
/// client sent it, nothing stored, with `X-Memory-Status: off` and `X-Memory-Reason`.
async fn memory_off(
    state: &Arc<AppState>,
    to: Destination<'_>,
    body: Bytes,
    reason: &'static str,
) -> Result<Response<ProxyBody>, ProxyError> {
    state.metrics.memory_off(reason);
    tracing::debug!(reason, "forwarding a side call with memory off");
    let mut response = forward_bytes(state, to.parts, body, to.api, to.api_path, false).await?;
    set_memory_headers(&mut response, MemoryStatus::Off, &to.key.conversation, None);
    if let Ok(value) = HeaderValue::from_str(reason) {
        response.headers_mut().insert(super::REASON_HEADER, value);
    }
    Ok(response)
}

/// A memory-on request whose memory failed (the store could not be read): the client's own
/// `body` goes upstream, answered with `X-Memory-Status: degraded` and `reason`, nothing
/// stored. With receipts on it gets one (the client's messages as its only parts); its answer
/// is then read as a memory-on answer is, for the receipt's usage: a stream teed, a JSON
/// answer read whole (within `upstream.read_timeout`). Its tokens are not counted in the
/// token ledger, whose exchanges are those memory planned.
async fn without_memory(
    state: &Arc<AppState>,
    to: Destination<'_>,
    body: Bytes,
    reason: DegradedReason,
) -> Result<Response<ProxyBody>, ProxyError> {
    let receipt = unplanned_receipt(state, &to, &body).await;
    let ledger = ExchangeLedger::unmetered(state, receipt);
    ledger.degraded(reason);
    let read = ledger.receipt().is_some();
    let (head, upstream_body, is_stream) =
        forward_told(state, &to, body, &ledger, HeaderMap::new(), read).await?;
    let body = match (read, head.status.is_success(), is_stream) {
        // Nothing to read: as the upstream sent it.
        (false, ..) | (_, false, _) => boxed(upstream_body),
        (true, true, true) => boxed(
            TeeBody::new(
                upstream_body,
                to.api,
                None,
                None,
                state.config.limits.max_sse_event_bytes,
                state.config.response_limit_bytes,
            )
            .with_ledger(ledger),
        ),
        (true, true, false) => full(read_told(state, to.api, upstream_body, &ledger).await?.0),
    };
    let mut response = Response::from_parts(head, body);
    set_memory_headers(
        &mut response,
        MemoryStatus::Degraded,
        &to.key.conversation,
        None,
    );
    set_degraded_reason(&mut response, reason);
    Ok(response)
}

/// The receipt of a request forwarded as the client sent it (receipts on): its messages parsed
/// again (the plan took them) and counted, off the runtime's threads.
async fn unplanned_receipt(
    state: &AppState,
    to: &Destination<'_>,
    body: &Bytes,
) -> Option<Arc<Receipt>> {
    if !state.receipts.enabled() {
        return None;
    }
    let (bytes, api) = (body.clone(), to.api);
    let parsed = tokio::task::spawn_blocking(move || {
        let request = ApiRequest::parse(api, &bytes).ok()?;
        let model = request.model;
        Some((
            Planned::unplanned(request.messages, model.as_deref()),
            model,
        ))
    })
    .await;
    // A body that does not parse (a planning that panicked) still has its bytes in the receipt.
    let (planned, model) = parsed
        .ok()
        .flatten()
        .unwrap_or_else(|| (Planned::unplanned(Vec::new(), None), None));
    receipt_of(state, to, body, model, planned)
}

/// Forwards `body` (with the receipt's id among `headers`, which go to the client; `read`:
/// memproxy reads the answer); the receipt is told the upstream's status and time, or that it
/// failed. Returns the answer's head, its body, and whether it is a stream.
async fn forward_told(
    state: &AppState,
    to: &Destination<'_>,
    body: Bytes,
    ledger: &ExchangeLedger,
    mut headers: HeaderMap,
    read: bool,
) -> Result<(http::response::Parts, UpstreamBody, bool), ProxyError> {
    if let Some(receipt) = ledger.receipt()
        && let Ok(value) = HeaderValue::from_str(&receipt.id)
    {
        headers.insert(RECEIPT_HEADER, value);
    }
    let forwarded = forward_held(state, to.parts, body, to.api, to.api_path, read).await;
    let (mut head, upstream_body) = match forwarded {
        Ok(forwarded) => forwarded.into_parts(),
        Err(err) => {
            ledger.failed();
            return Err(err);
        }
    };
    head.headers.extend(headers);
    let is_stream = head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    if let Some(receipt) = ledger.receipt() {
        let latency = head.extensions.get::<UpstreamTime>().map(|t| t.0);
        receipt.answered(head.status.as_u16(), latency, is_stream);
    }
    Ok((head, upstream_body, is_stream))
}

/// Reads a JSON answer whole (within `upstream.read_timeout`; a stalled answer is a 504) and
/// its usage, telling the ledger how it ended.
async fn read_told(
    state: &AppState,
    api: Api,
    body: UpstreamBody,
    ledger: &ExchangeLedger,
) -> Result<(Bytes, Option<Usage>), ProxyError> {
    let body = state
        .upstream_for(api)
        .read_answer(body, state.config.response_limit_bytes)
        .await;
    match body {
        Ok(body) => {
            let usage = Usage::from_json(api, &body);
            ledger.ended(true, usage);
            Ok((body, usage))
        }
        Err(err) => {
            ledger.ended(false, None);
            Err(err.into())
        }
    }
}

/// Makes and keeps the receipt of an exchange about to be forwarded to `to` with `body`
/// (receipts on).
fn receipt_of(
    state: &AppState,
    to: &Destination<'_>,
    body: &Bytes,
    model: Option<String>,
    planned: Planned,
) -> Option<Arc<Receipt>> {
    let receipt = Arc::new(Receipt::new(Made {
        key: to.key,
        api: to.api,
        api_path: to.api_path,
        query: to.parts.uri.query(),
        model,
        headers: &to.parts.headers,
        body: body.clone(),
        planned,
        settings: to.settings,
        created_ms: state.clock.now_ms(),
    })?);
    state.receipts.insert(Arc::clone(&receipt));
    Some(receipt)
}

/// The `before` step: the client's body read (within the size limit and the body read timeout)
/// and parsed, the prompt planned from memory, a due summary started. A memory failure is not
/// an error: the client's own body is forwarded.
async fn before(
    state: &AppState,
    memory: &Arc<Memory>,
    to: &Destination<'_>,
    user: Option<String>,
    bytes: Bytes,
) -> Result<Before, ProxyError> {
    let (parts, key, settings, api) = (to.parts, to.key, to.settings, to.api);
    // Parsing and planning are CPU and store work, and planning waits for the conversation's
    // lock: both run on the blocking pool, never on a thread that serves other requests.
    let limits = limits(state);
    let (job_memory, job_key, job_settings) = (Arc::clone(memory), key.clone(), settings.clone());
    let client_body = bytes.clone();
    let store_side_calls = settings.store_side_calls;
    let planning = tokio::task::spawn_blocking(move || {
        let mut request = ApiRequest::parse(api, &bytes)?;
        if !store_side_calls && let Some(side) = request.side_call() {
            return Ok((request, Err(side), bytes));
        }
        let messages = std::mem::take(&mut request.messages);
        let model = request.model.clone();
        let planned = plan::plan(
            &job_memory,
            &job_key,
            user.as_deref(),
            &job_settings,
            limits,
            model,
            messages,
        );
        Ok::<_, ProxyError>((request, Ok(planned), bytes))
    })
    .await;
    let (request, planned, bytes) = match planning {
        Ok(Ok((request, Ok(planned), bytes))) => (request, planned, bytes),
        Ok(Ok((_, Err(side), bytes))) => {
            return Ok(Before {
                body: bytes,
                plan: Err(Skipped::Off(side.as_str())),
                headers: HeaderMap::new(),
                deferred: None,
                hand_over: None,
            });
        }
        Ok(Err(err)) => return Err(err),
        // A panic while planning (the storage engine can panic on damaged files) is a memory
        // failure like any other: the client's own body goes upstream.
        Err(err) => {
            tracing::error!(error = %err, "planning failed; forwarding the client's own messages");
            return Ok(Before {
                body: client_body,
                plan: Err(Skipped::Degraded(DegradedReason::StoreFailed)),
                headers: HeaderMap::new(),
                deferred: None,
                hand_over: None,
            });
        }
    };
    if let Some(model) = &request.model {
        tracing::Span::current().record("model", model.as_str());
    }

    match planned {
        Ok(mut plan) => {
            let deferred =
                start_due(memory, settings, &mut plan, || credentials(&parts.headers)).await;
            // Long-term memory: a due extraction gets the request's credentials, copied only
            // then; it is queued by the commit, off the request's path.
            let mut hand_over = None;
            if let Some(model) = plan.extraction_due.take() {
                let (held, handed_over) = crate::longterm::extract::hand_over();
                hand_over = Some(held);
                plan.exchange.extraction = Some(ExtractionCall {
                    model,
                    credentials: credentials(&parts.headers),
                    handed_over: Some(handed_over),
                });
            }
            record_plan(state, &key.agent, &plan);
            Ok(Before {
                body: Bytes::from(request.render_parts(plan.prompt.parts(), &plan.prompt.cache)),
                headers: headers_of(&plan),
                plan: Ok(plan),
                deferred,
                hand_over,
            })
        }
        Err(PlanError::Store(err)) => {
            let degraded = DegradedReason::of(&err);
            if degraded == DegradedReason::StoreUnwritable {
                // Said once at warn level when the writes began to fail (`store/health.rs`).
                tracing::debug!(error = %err, "the store cannot write; forwarding the client's own messages");
            } else {
                tracing::error!(error = %err, "memory unavailable; forwarding the client's own messages");
            }
            Ok(Before {
                body: bytes,
                plan: Err(Skipped::Degraded(degraded)),
                headers: HeaderMap::new(),
                deferred: None,
                hand_over: None,
            })
        }
        Err(limit @ (PlanError::TooManyMessages { .. } | PlanError::TooManyTokens { .. })) => {
            Err(ProxyError::LimitExceeded {
                message: limit.to_string(),
                code: match limit {
                    PlanError::TooManyMessages { .. } => "too_many_new_messages",
                    _ => "too_many_new_tokens",
                },
            })
        }
    }
}

/// The per-request limits from the config.
pub fn limits(state: &AppState) -> RequestLimits {
    RequestLimits {
        max_new_messages: state.config.limits.max_new_messages,
        max_new_tokens: state.config.limits.max_new_tokens as u64,
        writes: true,
    }
}

/// The triggering request's credentials (every one of [`CREDENTIAL_HEADERS`] it sent), held in
/// memory only for a summary call.
fn credentials(headers: &HeaderMap) -> Credentials {
    Credentials::new(
        CREDENTIAL_HEADERS
            .iter()
            .filter_map(|name| {
                let value = headers.get(name)?.to_str().ok()?;
                Some((name.as_str().to_string(), value.to_string()))
            })
            .collect(),
    )
}

/// Reports a plan to the metrics: its stages' times, what was recalled, the tokens forwarded
/// and the history's.
fn record_plan(state: &AppState, agent: &str, plan: &Plan) {
    let Timings {
        reconcile,
        recall,
        budget,
        assemble,
        summary,
    } = plan.timings;
    let metrics = &state.metrics;
    for (stage, took) in [
        (Stage::Reconcile, Some(reconcile)),
        (Stage::Recall, Some(recall)),
        (Stage::Budget, Some(budget)),
        (Stage::Assemble, Some(assemble)),
        (Stage::Summary, summary),
    ] {
        if let Some(took) = took {
            metrics.observe_stage(stage, took);
        }
    }
    metrics.prompt(
        plan.report.recalled_turns.len(),
        plan.report.prompt_tokens,
        plan.report.history_tokens,
    );
    if let Some(memory) = state.memory() {
        metrics.ledger_exchange(
            memory.ledger.label(agent),
            plan.report.history_tokens,
            plan.report.prompt_tokens,
        );
    }
}
