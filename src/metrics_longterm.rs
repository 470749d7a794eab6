//! Long-term memory's metrics (`crate::longterm`): the extraction worker's jobs, attempts and
//! what its answers did to the memories, mirrored from its counters at each scrape. Every
//! label is a closed set, every series exists from the start.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::longterm::extract::ExtractionCounters;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// The extraction metrics.
pub(crate) struct LongTermMetrics {
    extractions: Family<ResultLabels, Counter>,
    memories: Family<ResultLabels, Counter>,
    bad_answers: Counter,
    retries: Counter,
}

/// The `result` of `memproxy_extractions_total` and the counter behind each.
fn extraction_results(c: &ExtractionCounters) -> [(&'static str, &AtomicU64); 3] {
    [
        ("done", &c.done),
        ("failed", &c.failures),
        ("dropped", &c.dropped),
    ]
}

/// The `result` of `memproxy_extracted_memories_total` and the counter behind each.
fn memory_results(c: &ExtractionCounters) -> [(&'static str, &AtomicU64); 5] {
    [
        ("added", &c.added),
        ("updated", &c.updated),
        ("superseded", &c.superseded),
        ("ignored", &c.ignored),
        ("rejected", &c.rejected),
    ]
}

impl LongTermMetrics {
    pub(crate) fn register(registry: &mut Registry) -> LongTermMetrics {
        let metrics = LongTermMetrics {
            extractions: Family::default(),
            memories: Family::default(),
            bad_answers: Counter::default(),
            retries: Counter::default(),
        };
        registry.register(
            "extractions",
            "Memory extraction jobs (long-term memory): applied (done), failed after every attempt, or dropped (queue full)",
            metrics.extractions.clone(),
        );
        registry.register(
            "extracted_memories",
            "What extraction answers did with each candidate memory: added, updated (a similar one), superseded (one the model named), ignored (a near-duplicate), rejected (out of the contract)",
            metrics.memories.clone(),
        );
        registry.register(
            "extraction_bad_answers",
            "Extraction attempts whose answer was not the memproxy_memories JSON",
            metrics.bad_answers.clone(),
        );
        registry.register(
            "extraction_retries",
            "Extraction attempts retried after a back-off",
            metrics.retries.clone(),
        );
        let zero = ExtractionCounters::default();
        for (result, _) in extraction_results(&zero) {
            let _ = metrics.extractions.get_or_create(&ResultLabels { result });
        }
        for (result, _) in memory_results(&zero) {
            let _ = metrics.memories.get_or_create(&ResultLabels { result });
        }
        metrics
    }

    /// Brings the metrics up to the extraction worker's counters.
    pub(crate) fn mirror(&self, counters: &ExtractionCounters, catch_up: fn(&Counter, u64)) {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        for (result, counter) in extraction_results(counters) {
            catch_up(
                &self.extractions.get_or_create(&ResultLabels { result }),
                load(counter),
            );
        }
        for (result, counter) in memory_results(counters) {
            catch_up(
                &self.memories.get_or_create(&ResultLabels { result }),
                load(counter),
            );
        }
        catch_up(&self.bad_answers, load(&counters.bad_answers));
        catch_up(&self.retries, load(&counters.retries));
    }
}
