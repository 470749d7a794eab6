//! `[receipts]`: the receipt kept for each memory-on exchange (`receipts/`): on or off, how
//! long it is kept, and the memory all receipts may take together.

use std::time::Duration;

use serde::Deserialize;

use super::values::{RawSize, duration, size};

/// How long a receipt can be read after its exchange.
pub const DEFAULT_RECEIPT_RETENTION: Duration = Duration::from_secs(15 * 60);

/// `[receipts]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiptsConfig {
    /// False with `enabled = false` or `retention = "PT0S"`: no receipt is kept and no
    /// `X-Memory-Receipt` is sent.
    pub enabled: bool,
    pub retention: Duration,
    /// The memory the receipts may take together (`max_bytes`, or its share of
    /// `server.memory_budget`: `config/memory_budget.rs`). Set by the budget check.
    pub max_bytes: u64,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawReceipts {
    enabled: Option<bool>,
    retention: Option<String>,
    max_bytes: Option<RawSize>,
}

/// Checks `[receipts]`; the size set explicitly, if any, comes back beside it for the budget.
pub(super) fn check_receipts(
    raw: RawReceipts,
    problems: &mut Vec<String>,
) -> (ReceiptsConfig, Option<u64>) {
    let retention = duration(
        "receipts.retention",
        raw.retention,
        DEFAULT_RECEIPT_RETENTION,
        problems,
    );
    let explicit = size("receipts.max_bytes", raw.max_bytes, problems);
    let config = ReceiptsConfig {
        enabled: raw.enabled.unwrap_or(true) && !retention.is_zero() && explicit != Some(0),
        retention,
        max_bytes: explicit.unwrap_or(0),
    };
    (config, explicit)
}
