//! `[storage]`: where the store lives, when commits reach the disk, and the cache sizes set
//! explicitly (unset, each takes its share of `server.memory_budget`: `budget.rs`).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::budget::ExplicitCaches;
use super::values::{RawSize, nonzero_duration, size};

pub const DEFAULT_DATA_DIR: &str = "./data";
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// When a commit reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Each commit is flushed before the client sees the end of the response; concurrent
    /// commits share one flush (group commit).
    Commit,
    /// The store is flushed on this interval; a crash can lose the commits of the last one.
    Interval(Duration),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStorage {
    data_dir: Option<String>,
    durability: Option<String>,
    flush_interval: Option<String>,
    cache_bytes: Option<RawSize>,
    state_cache_bytes: Option<RawSize>,
    recall_cache_bytes: Option<RawSize>,
}

/// `[storage]`, checked.
pub(super) struct Storage {
    pub data_dir: PathBuf,
    pub durability: Durability,
    pub caches: ExplicitCaches,
}

/// Checks `[storage]`; `data_dir` (from a flag or the environment) wins over the file.
pub(super) fn check_storage(
    raw: RawStorage,
    data_dir: Option<PathBuf>,
    problems: &mut Vec<String>,
) -> Storage {
    let data_dir = data_dir
        .or(raw.data_dir.map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let durability = match raw.durability.as_deref().unwrap_or("commit") {
        "commit" => {
            if raw.flush_interval.is_some() {
                problems.push(
                    "storage.flush_interval: only used with storage.durability = \"interval\""
                        .to_string(),
                );
            }
            Durability::Commit
        }
        "interval" => {
            let every = nonzero_duration(
                "storage.flush_interval",
                raw.flush_interval,
                DEFAULT_FLUSH_INTERVAL,
                problems,
            );
            Durability::Interval(every)
        }
        other => {
            problems.push(format!(
                "storage.durability: `{other}` must be \"commit\" or \"interval\""
            ));
            Durability::Commit
        }
    };
    Storage {
        data_dir,
        durability,
        caches: ExplicitCaches {
            state: size("storage.state_cache_bytes", raw.state_cache_bytes, problems),
            store: size("storage.cache_bytes", raw.cache_bytes, problems),
            recall: size(
                "storage.recall_cache_bytes",
                raw.recall_cache_bytes,
                problems,
            ),
        },
    }
}
