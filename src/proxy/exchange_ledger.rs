//! The edge's part of one exchange's token ledger and receipt: once the answer's usage is
//! read (a JSON answer, or a stream's last events) the cached tokens the upstream reported are
//! counted per agent, and the receipt is filled in with the usage, how the exchange ended and
//! what memory did.
//!
//! The ledger is made before the forward and lives as long as the exchange: in the request's
//! future, then in the response body. Dropped before the exchange ended (the client went away:
//! hyper drops the request's future, or the body of a stream under way), it finishes the
//! receipt as `client_gone`; a stream's tee tells it the usage seen so far first
//! ([`ExchangeLedger::gone`]).

use std::sync::Arc;

use super::{DegradedReason, MemoryStatus};
use crate::receipts::Receipt;
use crate::state::AppState;
use crate::wire::usage::Usage;

/// One exchange's ledger at the edge.
pub struct ExchangeLedger {
    state: Arc<AppState>,
    /// The agent's label (a name from the config, or `other`).
    label: String,
    receipt: Option<Arc<Receipt>>,
    /// Counts the upstream's cached tokens per agent (memory-on exchanges only).
    metered: bool,
}

impl ExchangeLedger {
    pub fn new(state: &Arc<AppState>, agent: &str, receipt: Option<Arc<Receipt>>) -> Self {
        let label = state.memory().map_or_else(
            || crate::ledger::OTHER_AGENT.to_string(),
            |memory| memory.ledger.label(agent).to_string(),
        );
        ExchangeLedger {
            state: Arc::clone(state),
            label,
            receipt,
            metered: true,
        }
    }

    /// The ledger of an exchange memory did not plan (its memory failed): it fills in the
    /// receipt only; the token ledger's counters are of the exchanges memory planned.
    pub fn unmetered(state: &Arc<AppState>, receipt: Option<Arc<Receipt>>) -> Self {
        ExchangeLedger {
            state: Arc::clone(state),
            label: crate::ledger::OTHER_AGENT.to_string(),
            receipt,
            metered: false,
        }
    }

    /// The exchange's receipt, when receipts are kept.
    pub fn receipt(&self) -> Option<&Arc<Receipt>> {
        self.receipt.as_ref()
    }

    /// Memory failed for the exchange after its head was sent (a stream whose commit failed):
    /// said in the receipt only.
    pub fn degraded(&self, reason: DegradedReason) {
        if let Some(receipt) = &self.receipt {
            receipt.memory_status(MemoryStatus::Degraded.as_str(), Some(reason.as_str()));
        }
    }

    /// The upstream could not be reached, or gave no answer in time.
    pub fn failed(&self) {
        if let Some(receipt) = &self.receipt {
            receipt.ended("error", None);
        }
    }

    /// The exchange ended: `complete` (an answer read whole, a stream that finished) or not
    /// (cut, unfinished, timed out), with the usage read from the answer.
    pub fn ended(&self, complete: bool, usage: Option<Usage>) {
        self.count(usage);
        if let Some(receipt) = &self.receipt {
            receipt.ended(if complete { "complete" } else { "cut" }, usage);
        }
    }

    /// The client went away mid-stream, after `usage` was seen (the upstream counts what it
    /// sent before the stream was dropped).
    pub fn gone(&self, usage: Option<Usage>) {
        self.count(usage);
        if let Some(receipt) = &self.receipt {
            receipt.gone(usage);
        }
    }

    fn count(&self, usage: Option<Usage>) {
        if let Some(usage) = usage.filter(|_| self.metered) {
            self.state
                .metrics
                .ledger_cached(&self.label, usage.cached_tokens);
        }
    }
}

impl Drop for ExchangeLedger {
    /// An exchange dropped before it ended: the client went away (nothing when it ended).
    fn drop(&mut self) {
        if let Some(receipt) = &self.receipt {
            receipt.gone(None);
        }
    }
}
