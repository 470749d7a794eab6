//! A request with memory on, in any of the three APIs (chat completions, Responses, Anthropic
//! Messages; `wire/` reads and writes each), as four steps over its [`MemoryRequest`]:
//!
//! - `admit`: the memory guard admits the request under the memory budget. One it does not
//!   admit (the process is at its high-water mark, or would be with this request) is
//!   forwarded untouched, its body streamed and never read whole, with
//!   `X-Memory-Status: degraded`: memory is off for it, the chat goes on. An admitted request
//!   holds its reservation until its response body is done with.
//! - `before`: the body read, its conversation found (a Responses request's chain), parsed and
//!   planned, a due summary started: a `Course` (memory, memory failed, or forwarded as sent).
//! - `forward`: the receipt made, the body sent upstream, the answer's head read.
//! - `after`: a stream teed (committed at its end), or a JSON answer read whole and committed.
//!
//! Every way out is an [`Ending`] (`exit.rs`): one function writes what it says (headers,
//! metrics, ledger) and hangs the [`AnswerGuard`] on the answer's body.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Request, Response, request::Parts};
use http_body::Body as _;
use hyper::body::Incoming;

use super::exchange_ledger::ExchangeLedger;
use super::exit::{AnswerGuard, Answered, Ending, Exit, report_headers};
use super::identify::{CONVERSATION_HEADER, CREDENTIAL_HEADERS};
use super::responses::{Chain, ResponsesRequest, Unchained};
use super::tee::{Pending, TeeBody, TeeLimits};
use super::{DegradedReason, MemoryStatus, Outbound, commit, forward_held, passthrough};
use crate::body::{CollectError, ProxyBody, boxed, collect_limited, full};
use crate::error::ProxyError;
use crate::identity::ConversationKey;
use crate::longterm::ExtractionCall;
use crate::longterm::extract::HandOver;
use crate::memory::Memory;
use crate::memory_guard::{PlanStart, Pressure, Reservation};
use crate::metrics::{ReplyKind, Stage, UpstreamTime};
use crate::model::Credentials;
use crate::pipeline::commit::Exchange;
use crate::pipeline::plan::start_due;
use crate::pipeline::plan::{self, Plan, PlanError, RequestLimits, Timings};
use crate::receipts::{Made, Planned, Receipt};
use crate::reply::reply_of;
use crate::settings::MemorySettings;
use crate::state::AppState;
use crate::summary::DeferredSummary;
use crate::upstream::UpstreamBody;
use crate::wire::usage::Usage;
use crate::wire::{Api, ApiRequest, SideCall};

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

/// Runs a request of an API memory serves: admit → before → forward → after. Every way out
/// is an [`Ending`], finished here: its headers, metrics and ledger entry written, its guard
/// hung on the answer's body.
pub async fn chat(
    state: &Arc<AppState>,
    memory: &Arc<Memory>,
    request: MemoryRequest,
) -> Result<Response<ProxyBody>, ProxyError> {
    let ending = match admit(state, &request.body).await {
        Ok(reservation) => {
            let guard = AnswerGuard::holding(reservation);
            admitted(state, memory, request, guard).await
        }
        Err(Unadmitted::TooLarge(err)) => Ending::refused(err, AnswerGuard::default()),
        Err(Unadmitted::Pressure(pressure)) => not_admitted(state, request, pressure).await,
    };
    ending.finish(state)
}

/// An admitted request: before, forward, after.
async fn admitted(
    state: &Arc<AppState>,
    memory: &Arc<Memory>,
    request: MemoryRequest,
    mut guard: AnswerGuard,
) -> Ending {
    let mut before = match before(state, memory, request, &mut guard).await {
        Ok(before) => before,
        Err(err) => return Ending::refused(err, guard),
    };
    // Planned: the planning's temporaries are freed; the prompt is held until it is sent.
    guard.settle(before.body.len() as u64);
    let forwarded = forward(state, &mut before).await;
    after(state, before, forwarded, guard).await
}

/// Why a request was not admitted.
enum Unadmitted {
    /// Its body is announced past the size limit (413), before anything is read.
    TooLarge(ProxyError),
    /// The memory guard refused it: it goes with memory off.
    Pressure(Pressure),
}

/// The `admit` step: the memory guard reserves what the request may take, waiting up to
/// `server.memory_wait` for the requests in flight to leave room for it.
async fn admit(state: &AppState, body: &Incoming) -> Result<Reservation, Unadmitted> {
    let announced = body.size_hint().exact();
    let limit = state.config.body_limit_bytes;
    if announced.is_some_and(|len| len > limit as u64) {
        return Err(Unadmitted::TooLarge(ProxyError::PayloadTooLarge { limit }));
    }
    state
        .memory_guard
        .admit_request(announced, state.config.memory_wait)
        .await
        .map_err(Unadmitted::Pressure)
}

/// A request the memory guard did not admit: forwarded untouched, as pass-through is.
async fn not_admitted(state: &AppState, request: MemoryRequest, pressure: Pressure) -> Ending {
    let MemoryRequest {
        parts,
        body,
        key,
        api_path,
        ..
    } = request;
    let answer = passthrough(state, Request::from_parts(parts, body), &api_path).await;
    let conversation = key.map(|key| key.conversation);
    Ending::new(
        Exit::NotAdmitted {
            conversation,
            pressure,
        },
        answer,
    )
}

/// What the `before` step made of a request: where it goes, and the body it forwards.
struct Before {
    parts: Parts,
    api: Api,
    api_path: String,
    /// The planned prompt, or the client's own body.
    body: Bytes,
    course: Course,
}

/// The course a request takes once `before` is done.
enum Course {
    /// Memory planned the prompt.
    Memory(Box<Prepared>),
    /// Memory failed (the store could not be read): the client's own body goes upstream,
    /// `degraded`, with a receipt when receipts are on.
    Degraded {
        key: ConversationKey,
        settings: Box<MemorySettings>,
        reason: DegradedReason,
    },
    /// Forwarded as the client sent it, nothing stored: the exit says why.
    AsSent(Exit),
}

impl Course {
    /// Memory failed for `reason`: the client's own body goes upstream.
    fn degraded(key: ConversationKey, settings: MemorySettings, reason: DegradedReason) -> Course {
        let settings = Box::new(settings);
        Course::Degraded {
            key,
            settings,
            reason,
        }
    }
}

/// A request memory planned: its conversation, settings and plan, and the plan's report as
/// headers.
struct Prepared {
    api: Api,
    key: ConversationKey,
    settings: MemorySettings,
    plan: Plan,
    report: HeaderMap,
}

/// The `before` step: the client's body read (within `body_limit` and `body_read_timeout`),
/// its conversation found (a Responses request's may be named in its body or chain), then
/// parsed and planned. A memory failure is not an error: the client's own body is forwarded.
async fn before(
    state: &AppState,
    memory: &Arc<Memory>,
    request: MemoryRequest,
    guard: &mut AnswerGuard,
) -> Result<Before, ProxyError> {
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
    let body = collect_body(state, body).await?;
    let chain = match (api, key) {
        (Api::Responses, key) => {
            let asked = ResponsesRequest {
                headers: &parts.headers,
                body: &body,
                key,
                agent: &agent,
                settings,
            };
            super::responses::resolve(state, memory, asked).await?
        }
        (_, Some(key)) => Chain::Memory(key, Box::new(settings)),
        (_, None) => Chain::Forward(None),
    };
    let (body, course) = match chain {
        Chain::Memory(key, settings) => {
            let to = ToPlan {
                parts: &parts,
                api,
                key,
                settings: *settings,
                user,
            };
            plan_memory(state, memory, to, body, guard).await?
        }
        Chain::Degraded(key, settings, reason) => (
            body,
            Course::Degraded {
                key,
                settings,
                reason,
            },
        ),
        Chain::Forward(why) => {
            let exit = unchained(&parts.headers, why);
            (body, Course::AsSent(exit))
        }
    };
    Ok(Before {
        parts,
        api,
        api_path,
        body,
        course,
    })
}

/// The exit of a Responses request forwarded as the client sent it (`why`: why memory did
/// not run, when there is something to say): the conversation is the one its header names.
fn unchained(headers: &HeaderMap, why: Option<Unchained>) -> Exit {
    let Some(why) = why else {
        return Exit::Silent;
    };
    let conversation = headers
        .get(CONVERSATION_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_string);
    Exit::Unchained { conversation, why }
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

/// A request of a conversation memory serves, about to be planned.
struct ToPlan<'a> {
    parts: &'a Parts,
    api: Api,
    key: ConversationKey,
    settings: MemorySettings,
    user: Option<String>,
}

/// What parsing and planning on the blocking pool gave.
enum Parsed {
    Planned(ApiRequest, Box<Result<Plan, PlanError>>),
    /// A side call (`wire::SideCall`), not planned.
    SideCall(SideCall),
}

/// Parses and plans the request (the body it goes with: the prompt rendered from the plan, or
/// the client's own), and starts a due summary and a due extraction's hand-over (onto
/// `guard`). A side call is forwarded as sent with memory off, unless `store_side_calls`.
async fn plan_memory(
    state: &AppState,
    memory: &Arc<Memory>,
    to: ToPlan<'_>,
    bytes: Bytes,
    guard: &mut AnswerGuard,
) -> Result<(Bytes, Course), ProxyError> {
    let parsed = match parse_and_plan(state, memory, &to, &bytes, guard.plan_start()).await {
        Ok(parsed) => parsed?,
        // A panic while planning (the storage engine can panic on damaged files) is a memory
        // failure like any other: the client's own body goes upstream.
        Err(err) => {
            tracing::error!(error = %err, "planning failed; forwarding the client's own messages");
            let course = Course::degraded(to.key, to.settings, DegradedReason::StoreFailed);
            return Ok((bytes, course));
        }
    };
    let ToPlan {
        parts,
        api: to_api,
        key,
        settings,
        ..
    } = to;
    let (request, planned) = match parsed {
        Parsed::Planned(request, planned) => (request, *planned),
        Parsed::SideCall(side) => {
            let exit = Exit::Off {
                conversation: key.conversation,
                side_call: Some(side.as_str()),
            };
            return Ok((bytes, Course::AsSent(exit)));
        }
    };
    if let Some(model) = &request.model {
        tracing::Span::current().record("model", model.as_str());
    }
    let mut plan = match planned {
        Ok(plan) => plan,
        Err(PlanError::Store(err)) => {
            let reason = DegradedReason::of(&err);
            if reason == DegradedReason::StoreUnwritable {
                // Said once at warn level when the writes began to fail (`store/health.rs`).
                tracing::debug!(error = %err, "the store cannot write; forwarding the client's own messages");
            } else {
                tracing::error!(error = %err, "memory unavailable; forwarding the client's own messages");
            }
            return Ok((bytes, Course::degraded(key, settings, reason)));
        }
        Err(limit @ (PlanError::TooManyMessages { .. } | PlanError::TooManyTokens { .. })) => {
            return Err(ProxyError::LimitExceeded {
                message: limit.to_string(),
                code: match limit {
                    PlanError::TooManyMessages { .. } => "too_many_new_messages",
                    _ => "too_many_new_tokens",
                },
            });
        }
    };
    guard.summary = start_due(memory, &settings, &mut plan, || credentials(&parts.headers)).await;
    guard.hand_over = hand_over_extraction(&mut plan, &parts.headers);
    record_plan(state, &key.agent, &plan);
    let body = Bytes::from(request.render_parts(plan.prompt.parts(), &plan.prompt.cache));
    let prepared = Prepared {
        api: to_api,
        key,
        settings,
        report: report_headers(&plan.report),
        plan,
    };
    Ok((body, Course::Memory(Box::new(prepared))))
}

/// A body at most this long, of a conversation whose plan can be made now
/// ([`plan::Free`]), is parsed and planned on the runtime's thread, which saves the hand-over
/// to the blocking pool and back (two threads woken; 7% of a read-only request's CPU in the
/// README's profile). A longer body's parsing is left to the pool.
const PLAN_NOW_MAX_BODY: usize = 16 << 10;

/// Parses the request and plans it. On the blocking pool (CPU and store work, and planning
/// waits for the conversation's lock: never on a thread that serves other requests), unless
/// the body is small and the conversation's plan can be made without waiting or blocking
/// ([`plan::Free`]): then here. `Err`: the planning panicked (what it said).
async fn parse_and_plan(
    state: &AppState,
    memory: &Arc<Memory>,
    to: &ToPlan<'_>,
    bytes: &Bytes,
    plan_start: PlanStart,
) -> Result<Result<Parsed, ProxyError>, String> {
    let limits = limits(state);
    let mut unplanned = None;
    if bytes.len() <= PLAN_NOW_MAX_BODY
        && let Some(free) = plan::Free::now(memory, &to.key, to.user.as_deref(), &to.settings)
    {
        plan_start.now();
        let now = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let (request, messages) = match parsed(to.api, &to.settings, bytes) {
                Ok(Ok(parsed)) => parsed,
                Ok(Err(side)) => return Ok(Ok(Parsed::SideCall(side))),
                Err(err) => return Ok(Err(err)),
            };
            let model = request.model.clone();
            match plan::plan_free(memory, &to.key, &to.settings, limits, model, messages, free) {
                Ok(planned) => Ok(Ok(Parsed::Planned(request, Box::new(planned)))),
                Err(messages) => Err(Box::new((request, messages))),
            }
        }));
        match now {
            Ok(Ok(done)) => {
                if matches!(done, Ok(Parsed::Planned(..))) {
                    state.metrics.planned(true);
                    if let Some(peak) = plan_start.done() {
                        state.metrics.planning_peak(peak);
                    }
                }
                return Ok(done);
            }
            // Another request took the conversation meanwhile: planned on the pool after all.
            Ok(Err(parsed)) => unplanned = Some(*parsed),
            Err(panic) => return Err(panic_message(panic.as_ref())),
        }
    }
    let (memory, key, settings) = (Arc::clone(memory), to.key.clone(), to.settings.clone());
    let (user, api, bytes) = (to.user.clone(), to.api, bytes.clone());
    let pooled = tokio::task::spawn_blocking(move || {
        // Counted from when a thread takes it, not while it waits for one.
        plan_start.now();
        let (request, messages) = match unplanned {
            Some(parsed) => parsed,
            None => match parsed(api, &settings, &bytes)? {
                Ok(parsed) => parsed,
                Err(side) => return Ok((Parsed::SideCall(side), None)),
            },
        };
        let planned = plan::plan(
            &memory,
            &key,
            user.as_deref(),
            &settings,
            limits,
            request.model.clone(),
            messages,
        );
        Ok((
            Parsed::Planned(request, Box::new(planned)),
            plan_start.done(),
        ))
    })
    .await
    .map(|pooled| {
        pooled.map(|(parsed, peak)| {
            if let Some(peak) = peak {
                state.metrics.planning_peak(peak);
            }
            parsed
        })
    })
    .map_err(|err| err.to_string());
    if matches!(pooled, Ok(Ok(Parsed::Planned(..)))) {
        state.metrics.planned(false);
    }
    pooled
}

/// A request parsed and its messages (taken out of it, for the plan).
type ToBePlanned = (ApiRequest, Vec<crate::message::Message>);

/// The request parsed, for the plan; `Err`: a side call, forwarded as sent, unless
/// `store_side_calls`.
fn parsed(
    api: Api,
    settings: &MemorySettings,
    bytes: &[u8],
) -> Result<Result<ToBePlanned, SideCall>, ProxyError> {
    let mut request = ApiRequest::parse(api, bytes)?;
    if !settings.store_side_calls
        && let Some(side) = request.side_call()
    {
        return Ok(Err(side));
    }
    let messages = std::mem::take(&mut request.messages);
    Ok(Ok((request, messages)))
}

/// What a panic said, for the log.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    format!("planning panicked: {}", crate::pipeline::panic_said(panic))
}

/// Long-term memory: a due extraction gets the request's credentials, copied only then; it is
/// queued by the commit, off the request's path, and starts once the hand-over returned here
/// is dropped with the answer.
fn hand_over_extraction(plan: &mut Plan, headers: &HeaderMap) -> Option<HandOver> {
    let model = plan.extraction_due.take()?;
    let (held, handed_over) = crate::longterm::extract::hand_over();
    plan.exchange.extraction = Some(ExtractionCall {
        model,
        credentials: credentials(headers),
        handed_over: Some(handed_over),
    });
    Some(held)
}

/// What the `forward` step brought back: the exchange's ledger (with its receipt, when memory
/// planned or failed and receipts are on) and the upstream's answer.
struct Forwarded {
    ledger: ExchangeLedger,
    answer: Result<Answer, ProxyError>,
}

/// The upstream's answer: its head, its body, whether it is a stream.
struct Answer {
    head: http::response::Parts,
    body: UpstreamBody,
    is_stream: bool,
}

impl Answer {
    fn of(response: Response<UpstreamBody>) -> Answer {
        let (head, body) = response.into_parts();
        let is_stream = head
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
        Answer {
            head,
            body,
            is_stream,
        }
    }

    /// The answer as the upstream sent it.
    fn untouched(self) -> Response<ProxyBody> {
        Response::from_parts(self.head, boxed(self.body))
    }
}

/// The `forward` step: the exchange's receipt made (receipts on: a planned exchange's with the
/// plan's parts, a degraded one's with the client's messages), the body sent upstream, the
/// receipt told the upstream's status and time, or that it failed.
async fn forward(state: &Arc<AppState>, before: &mut Before) -> Forwarded {
    let Before {
        parts,
        api,
        api_path,
        body,
        course,
    } = before;
    let out = Outbound {
        parts,
        api: *api,
        api_path,
    };
    let body = body.clone();
    let (ledger, to, read) = match course {
        Course::AsSent(_) => {
            let answer = forward_held(state, out, body, false).await;
            let ledger = ExchangeLedger::unmetered(state, None);
            let answer = answer.map(Answer::of);
            return Forwarded { ledger, answer };
        }
        Course::Memory(prepared) => {
            let Prepared {
                key,
                settings,
                plan,
                ..
            } = &mut **prepared;
            let to = Destination { out, key, settings };
            let receipt = state.receipts.enabled().then(|| {
                let model = plan.exchange.model.clone();
                receipt_of(state, &to, &body, model, Planned::take(plan))
            });
            (
                ExchangeLedger::new(state, &key.agent, receipt.flatten()),
                to,
                true,
            )
        }
        Course::Degraded { key, settings, .. } => {
            let to = Destination { out, key, settings };
            let receipt = unplanned_receipt(state, &to, &body).await;
            // A degraded exchange's answer is read only for its receipt.
            let read = receipt.is_some();
            (ExchangeLedger::unmetered(state, receipt), to, read)
        }
    };
    let answer = forward_told(state, &to, body, &ledger, read).await;
    Forwarded { ledger, answer }
}

/// The `after` step: the answer read as its course wants it (a planned exchange's committed),
/// and the request's [`Ending`].
async fn after(
    state: &Arc<AppState>,
    before: Before,
    forwarded: Forwarded,
    mut guard: AnswerGuard,
) -> Ending {
    let Forwarded { ledger, answer } = forwarded;
    let receipt = ledger.receipt().cloned();
    let api = before.api;
    let (exit, answer) = match before.course {
        Course::AsSent(exit) => (exit, answer.map(Answer::untouched)),
        Course::Degraded { key, reason, .. } => {
            let answer = match answer {
                Ok(answer) => degraded_answer(state, api, answer, ledger).await,
                Err(err) => Err(err),
            };
            let conversation = key.conversation;
            (
                Exit::Degraded {
                    conversation,
                    reason,
                },
                answer,
            )
        }
        Course::Memory(prepared) => match answer {
            Ok(answer) => after_memory(state, *prepared, answer, ledger, &mut guard).await,
            Err(err) => (Exit::Silent, Err(err)),
        },
    };
    Ending {
        exit,
        answer,
        receipt,
        guard,
    }
}

/// The answer of a request whose memory failed, as the upstream sent it; with a receipt it is
/// read as a memory-on answer is, for the receipt's usage: a stream teed, a JSON answer read
/// whole (within `upstream.read_timeout`). Its tokens are not counted in the token ledger,
/// whose exchanges are those memory planned.
async fn degraded_answer(
    state: &AppState,
    api: Api,
    answer: Answer,
    ledger: ExchangeLedger,
) -> Result<Response<ProxyBody>, ProxyError> {
    let read = ledger.receipt().is_some();
    let Answer {
        head,
        body,
        is_stream,
    } = answer;
    let body = match (read, head.status.is_success(), is_stream) {
        // Nothing to read: as the upstream sent it.
        (false, ..) | (_, false, _) => boxed(body),
        (true, true, true) => boxed(tee(state, api, body, None, None).with_ledger(ledger)),
        (true, true, false) => full(read_told(state, api, body, &ledger).await?.0),
    };
    Ok(Response::from_parts(head, body))
}

/// An SSE answer teed with the limits from the config (`pending`: what to commit at its end,
/// `summary`: a due summary, queued once it is committed or the body dropped).
fn tee(
    state: &AppState,
    api: Api,
    body: UpstreamBody,
    pending: Option<Pending>,
    summary: Option<DeferredSummary>,
) -> TeeBody<UpstreamBody> {
    let limits = TeeLimits {
        max_event_bytes: state.config.limits.max_sse_event_bytes,
        max_reply_bytes: state.config.response_limit_bytes,
    };
    TeeBody::new(body, api, pending, summary, limits)
}

/// The `after` step of an exchange memory planned: an error status stores nothing; a stream
/// is teed and committed at its end (its head says `stored` already); a JSON answer is read
/// whole and committed, then answered.
async fn after_memory(
    state: &Arc<AppState>,
    prepared: Prepared,
    answer: Answer,
    ledger: ExchangeLedger,
    guard: &mut AnswerGuard,
) -> (Exit, Result<Response<ProxyBody>, ProxyError>) {
    let Prepared {
        api,
        key,
        settings,
        plan,
        report: described,
    } = prepared;
    let Plan {
        exchange, report, ..
    } = plan;
    let Answer {
        head,
        body,
        is_stream,
    } = answer;
    let stored_count = report.stored_count;
    let (stored, body) = if !head.status.is_success() {
        let stored = Stored::not(stored_count);
        (stored, boxed(body))
    } else if is_stream {
        let pending = settings.persist.then(|| Pending {
            state: Arc::clone(state),
            exchange,
        });
        let stored = match &pending {
            Some(_) => Stored::all(report.planned_count),
            None => Stored::not(stored_count),
        };
        // The deferred summary rides with the stream: queued once it is committed or dropped.
        let tee = tee(state, api, body, pending, guard.summary.take()).with_ledger(ledger);
        (stored, boxed(tee))
    } else {
        let read = ReadWhole {
            api,
            persist: settings.persist,
            exchange,
            stored_count,
        };
        match read_and_commit(state, read, body, &ledger).await {
            Ok((stored, body)) => (stored, full(body)),
            Err(err) => return (Exit::Silent, Err(err)),
        }
    };
    let exit = Exit::Answered(Answered {
        conversation: key.conversation,
        status: stored.status,
        reason: stored.reason,
        turns: stored.turns,
        report: described,
    });
    (exit, Ok(Response::from_parts(head, body)))
}

/// What an answered exchange did to memory.
struct Stored {
    status: MemoryStatus,
    reason: Option<DegradedReason>,
    turns: usize,
}

impl Stored {
    /// Stored: `turns` messages now.
    fn all(turns: usize) -> Stored {
        Stored {
            status: MemoryStatus::Stored,
            reason: None,
            turns,
        }
    }

    /// Nothing stored: the `turns` stored before.
    fn not(turns: usize) -> Stored {
        Stored {
            status: MemoryStatus::NotStored,
            reason: None,
            turns,
        }
    }
}

/// A JSON answer to read whole and commit.
struct ReadWhole {
    api: Api,
    persist: bool,
    exchange: Exchange,
    /// Messages stored before this exchange.
    stored_count: usize,
}

/// A JSON reply is complete only at its end: read it (within `upstream.read_timeout`: a
/// stalled answer is a 504 and stores nothing), store it, then answer.
async fn read_and_commit(
    state: &AppState,
    read: ReadWhole,
    body: UpstreamBody,
    ledger: &ExchangeLedger,
) -> Result<(Stored, Bytes), ProxyError> {
    let ReadWhole {
        api,
        persist,
        mut exchange,
        stored_count,
    } = read;
    let (body, usage) = read_told(state, api, body, ledger).await?;
    exchange.cached_tokens = usage.map_or(0, |u| u.cached_tokens);
    if !persist {
        return Ok((Stored::not(stored_count), body));
    }
    let Some(reply) = reply_of(api, &body) else {
        tracing::warn!(
            api = api.as_str(),
            "upstream answer has no reply to read; nothing stored"
        );
        return Ok((Stored::not(stored_count), body));
    };
    let stored = match commit(state, exchange, reply, ReplyKind::Json).await {
        Ok(count) => Stored::all(count),
        Err(reason) => Stored {
            status: MemoryStatus::Degraded,
            reason: Some(reason),
            turns: stored_count,
        },
    };
    Ok((stored, body))
}

/// Where an exchange goes, and for whom.
struct Destination<'a> {
    out: Outbound<'a>,
    key: &'a ConversationKey,
    settings: &'a MemorySettings,
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
    let (bytes, api) = (body.clone(), to.out.api);
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

/// Forwards `body` (`read`: memproxy reads the answer); the receipt is told the upstream's
/// status and time, or that it failed.
async fn forward_told(
    state: &AppState,
    to: &Destination<'_>,
    body: Bytes,
    ledger: &ExchangeLedger,
    read: bool,
) -> Result<Answer, ProxyError> {
    let forwarded = forward_held(state, to.out, body, read).await;
    let answer = match forwarded {
        Ok(forwarded) => Answer::of(forwarded),
        Err(err) => {
            ledger.failed();
            return Err(err);
        }
    };
    if let Some(receipt) = ledger.receipt() {
        let latency = answer.head.extensions.get::<UpstreamTime>().map(|t| t.0);
        receipt.answered(answer.head.status.as_u16(), latency, answer.is_stream);
    }
    Ok(answer)
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
        api: to.out.api,
        api_path: to.out.api_path,
        query: to.out.parts.uri.query(),
        model,
        headers: &to.out.parts.headers,
        body: body.clone(),
        planned,
        settings: to.settings,
        created_ms: state.clock.now_ms(),
    })?);
    state.receipts.insert(Arc::clone(&receipt));
    Some(receipt)
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
