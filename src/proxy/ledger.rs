//! The edge's part of one exchange's token ledger and receipt: once the answer's usage is
//! read (a JSON answer, or a stream's last events) the cached tokens the upstream reported are
//! counted per agent, and the receipt is filled in with the usage, how the exchange ended and
//! what memory did.

use std::sync::Arc;

use super::MemoryStatus;
use crate::receipts::Receipt;
use crate::state::AppState;
use crate::wire::usage::Usage;

/// One exchange's ledger at the edge.
pub struct ExchangeLedger {
    state: Arc<AppState>,
    /// The agent's label (a name from the config, or `other`).
    label: String,
    receipt: Option<Arc<Receipt>>,
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
        }
    }

    /// What memory did with the exchange (`X-Memory-Status`).
    pub fn status(&self, status: MemoryStatus) {
        if let Some(receipt) = &self.receipt {
            receipt.memory_status(status.as_str());
        }
    }

    /// The exchange ended: `complete` (an answer read whole, a stream that finished) or not
    /// (cut, unfinished, timed out), with the usage read from the answer.
    pub fn ended(&self, complete: bool, usage: Option<Usage>) {
        if let Some(usage) = usage {
            self.state
                .metrics
                .ledger_cached(&self.label, usage.cached_tokens);
        }
        if let Some(receipt) = &self.receipt {
            receipt.ended(if complete { "complete" } else { "cut" }, usage);
        }
    }
}
