//! `[sweeper]`: the pace of the TTL sweeper.

use std::time::Duration;

use serde::Deserialize;

use super::values::{at_least_one, nonzero_duration};

pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
pub const DEFAULT_SWEEP_MAX_SCANNED: usize = 1000;
pub const DEFAULT_SWEEP_MAX_DELETED: usize = 100;

/// The TTL sweeper's pace: one pass per `interval`, each bounded in work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweeperConfig {
    pub interval: Duration,
    /// Conversations looked at per pass, at most.
    pub max_scanned: usize,
    /// Conversations deleted per pass, at most.
    pub max_deleted: usize,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSweeper {
    interval: Option<String>,
    max_scanned: Option<u64>,
    max_deleted: Option<u64>,
}

/// Checks `[sweeper]`.
pub(super) fn check_sweeper(raw: RawSweeper, problems: &mut Vec<String>) -> SweeperConfig {
    let interval = nonzero_duration(
        "sweeper.interval",
        raw.interval,
        DEFAULT_SWEEP_INTERVAL,
        problems,
    );
    SweeperConfig {
        interval,
        max_scanned: at_least_one(
            "sweeper.max_scanned",
            raw.max_scanned,
            DEFAULT_SWEEP_MAX_SCANNED,
            problems,
        ),
        max_deleted: at_least_one(
            "sweeper.max_deleted",
            raw.max_deleted,
            DEFAULT_SWEEP_MAX_DELETED,
            problems,
        ),
    }
}
