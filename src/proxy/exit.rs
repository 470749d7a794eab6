//! How a memory request ends. Every way out of one — memory off by its headers, a side call,
//! a chained request memproxy cannot follow, a request the memory guard did not admit, memory
//! that failed (no store, a store error), a refusal, an upstream that failed, and the answers
//! memory ran for, streamed or JSON — is one [`Exit`]. [`Ending::finish`] is the one place that
//! writes what it says: the `X-Memory-*` headers, the metrics of that way out and the
//! exchange's ledger entry (its receipt's memory status); and it hangs what must outlive the
//! answer ([`AnswerGuard`]) on the answer's body.

use std::sync::Arc;

use http::Response;
use http::header::{HeaderMap, HeaderValue};

use super::responses::{UNKNOWN_PREVIOUS, Unchained};
use super::{
    BUDGET_HEADER, CONVERSATION_ID_HEADER, DegradedReason, HISTORY_TOKENS_HEADER, MEMORIES_HEADER,
    MemoryStatus, PROMPT_TOKENS_HEADER, REASON_HEADER, RECALL_HEADER, RETRIEVED_ELSEWHERE_HEADER,
    RETRIEVED_HEADER, RETRIEVED_TURNS_HEADER, STATUS_HEADER, SUMMARY_HEADER, TURNS_HEADER,
};
use crate::body::{OnDrop, ProxyBody, boxed};
use crate::error::ProxyError;
use crate::longterm::extract::HandOver;
use crate::memory_guard::{PlanStart, Pressure, Reservation};
use crate::metrics::Refusal;
use crate::pipeline::plan::Report;
use crate::receipts::{RECEIPT_HEADER, Receipt};
use crate::state::AppState;
use crate::summary::DeferredSummary;

/// One way out of a memory request: what memory says of it.
pub enum Exit {
    /// Memory says nothing: a request memproxy cannot place in a conversation (forwarded
    /// untouched), a refusal (its error says why), an upstream that failed after memory
    /// planned (the receipt says so).
    Silent,
    /// Memory is off: by the request's own headers (`side_call: None`), or for a side call
    /// (`wire::SideCall`, forwarded as sent, its reason sent and counted).
    Off {
        conversation: String,
        side_call: Option<&'static str>,
    },
    /// A chained Responses request forwarded as sent (`responses.rs`): the conversation its
    /// header names, if any.
    Unchained {
        conversation: Option<String>,
        why: Unchained,
    },
    /// The memory guard did not admit the request: forwarded untouched, counted, and said
    /// (`degraded`, `memory-budget`) when its conversation is known.
    NotAdmitted {
        conversation: Option<String>,
        pressure: Pressure,
    },
    /// Memory failed before the forward (no store, a store that could not be read): the
    /// client's own body went upstream.
    Degraded {
        conversation: String,
        reason: DegradedReason,
    },
    /// Memory planned the prompt and the upstream answered.
    Answered(Answered),
}

/// What memory did with an answered exchange.
pub struct Answered {
    pub conversation: String,
    /// `stored`, `not-stored`, or `degraded` when the commit failed (`reason`).
    pub status: MemoryStatus,
    pub reason: Option<DegradedReason>,
    /// Messages stored (or, for a stream, stored once it completes).
    pub turns: usize,
    /// The plan's report as headers ([`report_headers`]): what was recalled, the prompt's
    /// size, the budget, the summary.
    pub report: HeaderMap,
}

/// What an exit says in the `X-Memory-*` headers and the receipt.
struct Said<'a> {
    status: MemoryStatus,
    /// `None`: no conversation header (one the upstream sent is removed).
    conversation: Option<&'a str>,
    turns: Option<usize>,
    reason: Option<&'static str>,
}

impl Exit {
    /// What the exit says; `None`: no `X-Memory-*` header at all.
    fn said(&self) -> Option<Said<'_>> {
        fn said<'a>(
            status: MemoryStatus,
            conversation: &'a str,
            reason: Option<&'static str>,
        ) -> Said<'a> {
            Said {
                status,
                conversation: Some(conversation),
                turns: None,
                reason,
            }
        }
        match self {
            Exit::Silent
            | Exit::NotAdmitted {
                conversation: None, ..
            } => None,
            Exit::Off {
                conversation,
                side_call,
            } => Some(said(MemoryStatus::Off, conversation, *side_call)),
            Exit::Unchained { conversation, why } => {
                let (status, reason) = match why {
                    Unchained::Unknown => (MemoryStatus::Off, UNKNOWN_PREVIOUS),
                    Unchained::Store(reason) => (MemoryStatus::Degraded, reason.as_str()),
                };
                Some(Said {
                    conversation: conversation.as_deref(),
                    ..said(status, "", Some(reason))
                })
            }
            Exit::NotAdmitted {
                conversation: Some(conversation),
                ..
            } => Some(said(
                MemoryStatus::Degraded,
                conversation,
                Some(DegradedReason::MemoryBudget.as_str()),
            )),
            Exit::Degraded {
                conversation,
                reason,
            } => Some(said(
                MemoryStatus::Degraded,
                conversation,
                Some(reason.as_str()),
            )),
            Exit::Answered(answered) => Some(Said {
                turns: Some(answered.turns),
                ..said(
                    answered.status,
                    &answered.conversation,
                    answered.reason.map(DegradedReason::as_str),
                )
            }),
        }
    }

    /// Counts the ways out that have a metric of their own, and logs them.
    fn count(&self, state: &AppState) {
        match self {
            Exit::NotAdmitted { pressure, .. } => {
                state
                    .metrics
                    .admission_refused(Refusal::Degraded, *pressure);
                tracing::debug!(
                    reason = pressure.as_str(),
                    "memory budget: forwarding with memory off"
                );
            }
            Exit::Off {
                side_call: Some(reason),
                ..
            } => {
                state.metrics.memory_off(reason);
                tracing::debug!(reason, "forwarding a side call with memory off");
            }
            _ => {}
        }
    }
}

impl Said<'_> {
    /// Sets `X-Memory-Status`, `X-Memory-Conversation-Id`, `X-Memory-Turns` and
    /// `X-Memory-Reason`.
    fn write(&self, headers: &mut HeaderMap) {
        headers.insert(
            STATUS_HEADER,
            HeaderValue::from_static(self.status.as_str()),
        );
        match self.conversation.map(HeaderValue::from_str) {
            Some(Ok(value)) => {
                headers.insert(CONVERSATION_ID_HEADER, value);
            }
            Some(Err(_)) => {}
            None => {
                headers.remove(CONVERSATION_ID_HEADER);
            }
        }
        if let Some(turns) = self.turns {
            headers.insert(TURNS_HEADER, HeaderValue::from(turns));
        }
        if let Some(Ok(value)) = self.reason.map(HeaderValue::from_str) {
            headers.insert(REASON_HEADER, value);
        }
    }

    /// The exchange's ledger entry: what memory did, in its receipt.
    fn tell(&self, receipt: &Receipt) {
        let reason = self
            .reason
            .filter(|_| self.status == MemoryStatus::Degraded);
        receipt.memory_status(self.status.as_str(), reason);
    }
}

/// How a memory request ended: its [`Exit`], the answer (or the error it ended in), its
/// receipt, and what must outlive the answer.
pub struct Ending {
    pub exit: Exit,
    pub answer: Result<Response<ProxyBody>, ProxyError>,
    /// The exchange's receipt (receipts on, for an exchange memory planned or failed).
    pub receipt: Option<Arc<Receipt>>,
    pub guard: AnswerGuard,
}

impl Ending {
    /// An ending with no receipt and nothing to outlive the answer.
    pub fn new(exit: Exit, answer: Result<Response<ProxyBody>, ProxyError>) -> Ending {
        Ending {
            exit,
            answer,
            receipt: None,
            guard: AnswerGuard::default(),
        }
    }

    /// A request refused (or failed) with `err`: nothing said.
    pub fn refused(err: ProxyError, guard: AnswerGuard) -> Ending {
        Ending {
            guard,
            ..Ending::new(Exit::Silent, Err(err))
        }
    }

    /// Writes what the exit says — the `X-Memory-*` headers (the plan's report and the
    /// receipt's id too), the metrics, the ledger entry — and hangs the guard on the answer's
    /// body (an error drops it now).
    pub fn finish(self, state: &AppState) -> Result<Response<ProxyBody>, ProxyError> {
        let Ending {
            mut exit,
            answer,
            receipt,
            guard,
        } = self;
        exit.count(state);
        let report = match &mut exit {
            Exit::Answered(answered) => std::mem::take(&mut answered.report),
            _ => HeaderMap::new(),
        };
        let said = exit.said();
        if let (Some(said), Some(receipt)) = (&said, &receipt) {
            said.tell(receipt);
        }
        let mut response = answer?;
        let headers = response.headers_mut();
        headers.extend(report);
        if let Some(Ok(value)) = receipt.map(|r| HeaderValue::from_str(&r.id)) {
            headers.insert(RECEIPT_HEADER, value);
        }
        if let Some(said) = said {
            said.write(headers);
        }
        Ok(guard.ride(response))
    }
}

/// The headers that describe a plan: what was recalled, the prompt's size, the budget, the
/// summary. Made once the plan is complete (a summary made now is in it), before the receipt
/// takes its parts.
pub fn report_headers(report: &Report) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let label = report
        .summary
        .as_ref()
        .map_or_else(|| "none".to_string(), |r| r.label());
    if let Ok(value) = HeaderValue::from_str(&label) {
        headers.insert(SUMMARY_HEADER, value);
    }
    headers.insert(
        RETRIEVED_HEADER,
        HeaderValue::from(report.recalled_turns.len()),
    );
    let turns: Vec<String> = report.recalled_turns.iter().map(u64::to_string).collect();
    if let Ok(value) = HeaderValue::from_str(&turns.join(",")) {
        headers.insert(RETRIEVED_TURNS_HEADER, value);
    }
    if !report.recalled_elsewhere.is_empty() {
        headers.insert(
            RETRIEVED_ELSEWHERE_HEADER,
            HeaderValue::from(report.recalled_elsewhere.len()),
        );
    }
    if !report.memories.is_empty() {
        headers.insert(MEMORIES_HEADER, HeaderValue::from(report.memories.len()));
    }
    if let Some(Ok(value)) = report.recall_mode.header().map(HeaderValue::try_from) {
        headers.insert(RECALL_HEADER, value);
    }
    headers.insert(
        PROMPT_TOKENS_HEADER,
        HeaderValue::from(report.prompt_tokens),
    );
    headers.insert(
        HISTORY_TOKENS_HEADER,
        HeaderValue::from(report.history_tokens),
    );
    if let Some(verdict) = report.fitted.map(|f| f.verdict()) {
        headers.insert(BUDGET_HEADER, HeaderValue::from_static(verdict));
    }
    headers
}

/// What must outlive the answer, riding on its body as one guard: let go, in this order,
/// when the body is dropped (sent, or abandoned by the client).
#[derive(Default)]
pub struct AnswerGuard {
    /// The memory the request reserved (`memory_guard.rs`).
    pub reservation: Option<Reservation>,
    /// A due summary (async compression): queued once the answer was handed over, so its
    /// work never competes with the request that triggered it. A stream's tee takes it, to
    /// queue it once the stream is committed.
    pub summary: Option<DeferredSummary>,
    /// A due extraction starts once this is dropped (`longterm::extract::HandOver`).
    pub hand_over: Option<HandOver>,
}

impl AnswerGuard {
    /// The guard of an admitted request: its reservation.
    pub fn holding(reservation: Reservation) -> AnswerGuard {
        AnswerGuard {
            reservation: Some(reservation),
            ..AnswerGuard::default()
        }
    }

    /// What starts the reservation of the plan's part where the planning runs
    /// ([`crate::memory_guard::Reservation::plan_start`]); nothing without a reservation.
    pub fn plan_start(&self) -> PlanStart {
        self.reservation
            .as_ref()
            .map(Reservation::plan_start)
            .unwrap_or_default()
    }

    /// The request's prompt of `prompt` bytes is about to be forwarded: its reservation keeps
    /// that and its answer's part ([`crate::memory_guard::Reservation::settle`]).
    pub fn settle(&mut self, prompt: u64) {
        if let Some(reservation) = self.reservation.as_mut() {
            reservation.settle(prompt);
        }
    }

    /// `response`, its body carrying the guard (as it is when the guard holds nothing).
    fn ride(self, response: Response<ProxyBody>) -> Response<ProxyBody> {
        if self.reservation.is_none() && self.summary.is_none() && self.hand_over.is_none() {
            return response;
        }
        response.map(|body| boxed(OnDrop::new(body, move || drop(self))))
    }
}
