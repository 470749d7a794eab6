//! What a run's answers add up to: each answer checked, then its latency recorded in
//! histograms if it was sent in the measured window.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::client::{Outcome, REQUEST_TIMEOUT, Spec};

/// Largest latency the histograms hold, in microseconds (10 minutes).
pub const HIST_MAX_US: u64 = 600_000_000;

pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("valid histogram bounds")
}

pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The measured part of a run.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub measure_start: Instant,
    pub end: Instant,
}

/// What a run's requests added up to.
pub struct Tally {
    /// Time to first body byte for streams, to the whole answer otherwise.
    pub latency: Histogram<u64>,
    /// Time to the whole answer.
    pub total: Histogram<u64>,
    pub completed: u64,
    pub errors: u64,
    pub samples: Vec<String>,
    /// Last `X-Memory-Turns`, `X-Memory-Retrieved`, `X-Memory-Prompt-Tokens` seen.
    pub turns: Option<u64>,
    pub retrieved: Option<u64>,
    pub prompt_tokens: Option<u64>,
    /// Last `X-Memory-Summary` seen.
    pub summary: Option<String>,
    /// Last `X-Memory-Recall` seen (a memory row measured by words alone says so).
    pub recall: Option<String>,
}

impl Tally {
    pub fn new() -> Tally {
        Tally {
            latency: histogram(),
            total: histogram(),
            completed: 0,
            errors: 0,
            samples: Vec::new(),
            turns: None,
            retrieved: None,
            prompt_tokens: None,
            summary: None,
            recall: None,
        }
    }

    pub fn error(&mut self, message: String) {
        self.errors += 1;
        if self.samples.len() < 4 && !self.samples.contains(&message) {
            self.samples.push(message);
        }
    }

    pub fn merge(&mut self, other: Tally) {
        let _ = self.latency.add(&other.latency);
        let _ = self.total.add(&other.total);
        self.completed += other.completed;
        self.errors += other.errors;
        for sample in other.samples {
            if self.samples.len() < 4 && !self.samples.contains(&sample) {
                self.samples.push(sample);
            }
        }
        self.turns = self.turns.max(other.turns);
        self.retrieved = self.retrieved.max(other.retrieved);
        self.prompt_tokens = self.prompt_tokens.max(other.prompt_tokens);
        if other.summary.is_some() {
            self.summary = other.summary;
        }
        if other.recall.is_some() {
            self.recall = other.recall;
        }
    }

    /// Checks and records one answer to a request whose latency counts from `origin`.
    pub fn observe(
        &mut self,
        spec: &Spec,
        origin: Instant,
        window: Window,
        result: Result<Result<Outcome, String>, tokio::time::error::Elapsed>,
    ) {
        let mut outcome = match result {
            Err(_) => {
                return self.error(format!("no answer within {} s", REQUEST_TIMEOUT.as_secs()));
            }
            Ok(Err(err)) => return self.error(err),
            Ok(Ok(outcome)) => outcome,
        };
        if outcome.turns.is_some() {
            self.turns = outcome.turns;
        }
        if outcome.retrieved.is_some() {
            self.retrieved = outcome.retrieved;
        }
        if outcome.prompt_tokens.is_some() {
            self.prompt_tokens = outcome.prompt_tokens;
        }
        if outcome.summary.is_some() {
            self.summary = outcome.summary.take();
        }
        if outcome.recall.is_some() {
            self.recall = outcome.recall.take();
        }
        if outcome.status != 200 {
            return self.error(format!("HTTP {}: {}", outcome.status, outcome.snippet()));
        }
        if outcome.memory.as_deref() != spec.expect_memory {
            return self.error(format!(
                "x-memory-status {:?}, expected {:?}",
                outcome.memory, spec.expect_memory
            ));
        }
        if !outcome.body_ok(spec.api, spec.stream) {
            return self.error(format!("unexpected body: {}", outcome.snippet()));
        }
        if origin >= window.measure_start {
            let first = if spec.stream {
                outcome.first_byte
            } else {
                outcome.done
            };
            self.latency
                .saturating_record(micros(first.saturating_duration_since(origin)));
            self.total
                .saturating_record(micros(outcome.done.saturating_duration_since(origin)));
        }
        if outcome.done >= window.measure_start && outcome.done <= window.end {
            self.completed += 1;
        }
    }
}
