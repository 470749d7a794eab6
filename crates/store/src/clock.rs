//! The one clock: wall-clock time as memory reads it, everywhere (stored timestamps, TTLs,
//! throttles, the ledger's days). Tests move it forward; nothing reads the system time
//! otherwise (`clippy.toml` refuses `SystemTime::now` outside this file).

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Wall-clock time: the system's, plus an offset tests can move. One per store, shared with
/// the memory core above it (`Store::clock`, `Memory::clock`).
#[derive(Debug, Default)]
pub struct Clock {
    offset_ms: AtomicI64,
}

impl Clock {
    /// UTC milliseconds since the epoch, plus the offset.
    pub fn now_ms(&self) -> i64 {
        system_ms().saturating_add(self.offset_ms.load(Ordering::Relaxed))
    }

    /// Sets this clock to read `now_ms` from here on (a replay of a conversation that
    /// happened at other times: `examples/recall_eval.rs`).
    pub fn set(&self, now_ms: i64) {
        self.offset_ms
            .store(now_ms.saturating_sub(system_ms()), Ordering::Relaxed);
    }

    /// Moves this clock forward (tests).
    pub fn advance(&self, by: Duration) {
        let ms = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        self.offset_ms.fetch_add(ms, Ordering::Relaxed);
    }
}

/// UTC milliseconds since the Unix epoch, as the system says.
#[allow(clippy::disallowed_methods)] // The one read of the system's time; every other goes through a Clock.
fn system_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_moved_forward_reads_later_by_as_much() {
        let clock = Clock::default();
        let before = clock.now_ms();
        clock.advance(Duration::from_secs(3600));
        let after = clock.now_ms();
        assert!(after - before >= 3_600_000, "{before} → {after}");
        assert!(after - before < 3_660_000, "{before} → {after}");
    }

    #[test]
    fn a_clock_set_to_a_time_reads_it() {
        let clock = Clock::default();
        let may_2023 = 1_683_504_000_000;
        clock.set(may_2023);
        let read = clock.now_ms();
        assert!((may_2023..may_2023 + 60_000).contains(&read), "{read}");
    }
}
