//! Recall by meaning's metrics (`crate::embedding`): the new messages embedded on the request
//! path (and those that failed, so recall went by words), the time they took, the stored
//! messages given a vector in the background, the jobs dropped or failed and the catch-ups of
//! dropped ones, mirrored from the embedding's counters at each scrape; whether an embedder is
//! in use, and how many conversations and owners are owed a catch-up.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::embedding::{Embedding, EmbeddingCounters};

/// The embedding metrics.
pub(crate) struct EmbeddingMetrics {
    up: Gauge,
    queries: Counter,
    queries_ahead: Counter,
    query_halves_helped: Counter,
    query_failures: Counter,
    query_seconds: Counter<f64>,
    vectors_stored: Counter,
    vectors_in_commit: Counter,
    vectors_derived: Counter,
    jobs_dropped: Counter,
    jobs_failed: Counter,
    caught_up: Counter,
    owed_forgotten: Counter,
    owed: Gauge,
    pending: Gauge,
}

impl EmbeddingMetrics {
    pub(crate) fn register(registry: &mut Registry) -> EmbeddingMetrics {
        let metrics = EmbeddingMetrics {
            up: Gauge::default(),
            queries: Counter::default(),
            queries_ahead: Counter::default(),
            query_halves_helped: Counter::default(),
            query_failures: Counter::default(),
            query_seconds: Counter::default(),
            vectors_stored: Counter::default(),
            vectors_in_commit: Counter::default(),
            vectors_derived: Counter::default(),
            jobs_dropped: Counter::default(),
            jobs_failed: Counter::default(),
            caught_up: Counter::default(),
            owed_forgotten: Counter::default(),
            owed: Gauge::default(),
            pending: Gauge::default(),
        };
        registry.register(
            "embedding_up",
            "1 when an embedder is in use (recall by words and meaning), 0 when recall goes by words alone (none configured, or it could not be loaded: /readyz says why)",
            metrics.up.clone(),
        );
        registry.register(
            "embedding_owed",
            "Conversations and owners whose embedding job was dropped (queue full) and whose missing vectors the worker has yet to make",
            metrics.owed.clone(),
        );
        registry.register(
            "embedding_jobs_pending",
            "Background embedding jobs queued or running (a commit's messages, a user's records, a catch-up): 0 with memproxy_embedding_owed at 0 when the embedding has caught up",
            metrics.pending.clone(),
        );
        let counters = [
            (
                "embedding_queries",
                "New messages embedded on the request path",
                &metrics.queries,
            ),
            (
                "embedding_queries_ahead",
                "New messages whose embedding was started on the helper thread as the plan began, while it reconciled and read the window, the summary and the words' matches (an embedder worth a thread: the full model, the upstream's); started, whether or not recall took it",
                &metrics.queries_ahead,
            ),
            (
                "embedding_query_halves_helped",
                "Halves of a step of the helper's forward pass that the request waiting for its new message's vector ran itself instead of waiting (the full model: 12 steps of two halves a pass)",
                &metrics.query_halves_helped,
            ),
            (
                "embedding_query_failures",
                "New messages whose embedding failed or passed embedding.query_timeout: recall went by words (X-Memory-Recall: lexical; reason=query-embedding-failed)",
                &metrics.query_failures,
            ),
            (
                "embedding_vectors_stored",
                "Stored messages given a stored vector: in their commit (with an embedder cheap enough to run there, embedding_vectors_in_commit) or by the background job; a derived embedder's (the static table's) are not stored (embedding_vectors_derived)",
                &metrics.vectors_stored,
            ),
            (
                "embedding_vectors_in_commit",
                "Vectors made in a stored exchange's commit (an embedder cheap enough to run there): written with its messages (counted in embedding_vectors_stored too), or derived (embedding_vectors_derived)",
                &metrics.vectors_in_commit,
            ),
            (
                "embedding_vectors_derived",
                "Of embedding_vectors_in_commit, the vectors of an embedder whose vectors are not stored (the static table's): kept in the recall index, made again from the stored texts when an index is built",
                &metrics.vectors_derived,
            ),
            (
                "embedding_jobs_dropped",
                "Background embedding jobs dropped (queue full): their conversation or owner is owed a catch-up (embedding_owed) that makes the missing vectors once the queue has room",
                &metrics.jobs_dropped,
            ),
            (
                "embedding_caught_up",
                "Conversations and owners whose missing vectors were made after a job of theirs was dropped",
                &metrics.caught_up,
            ),
            (
                "embedding_owed_forgotten",
                "Dropped jobs whose conversation or owner could not be remembered for a catch-up (4,096 of each already owed): their vectors wait for `memproxy vectors rebuild`",
                &metrics.owed_forgotten,
            ),
            (
                "embedding_jobs_failed",
                "Background embedding jobs that failed (the embedder or the store)",
                &metrics.jobs_failed,
            ),
        ];
        for (name, help, counter) in counters {
            registry.register(name, help, counter.clone());
        }
        registry.register(
            "embedding_query_seconds",
            "Time spent embedding new messages for recall (on the request path, or ahead of it on the helper thread: memproxy_embedding_queries_ahead_total)",
            metrics.query_seconds.clone(),
        );
        metrics
    }

    /// Brings the metrics up to the embedding's counters.
    pub(crate) fn mirror(&self, embedding: &Embedding, catch_up: fn(&Counter, u64)) {
        let c: &EmbeddingCounters = &embedding.counters;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        self.up.set(i64::from(embedding.space().is_some()));
        catch_up(&self.queries, load(&c.queries));
        catch_up(&self.queries_ahead, load(&c.queries_ahead));
        catch_up(&self.query_halves_helped, load(&c.query_halves_helped));
        catch_up(&self.query_failures, load(&c.query_failures));
        catch_up(&self.vectors_stored, load(&c.vectors_stored));
        catch_up(&self.vectors_in_commit, load(&c.vectors_in_commit));
        catch_up(&self.vectors_derived, load(&c.vectors_derived));
        catch_up(&self.jobs_dropped, load(&c.jobs_dropped));
        catch_up(&self.jobs_failed, load(&c.jobs_failed));
        catch_up(&self.caught_up, load(&c.caught_up));
        catch_up(&self.owed_forgotten, load(&c.owed_forgotten));
        self.owed.set(embedding.owed() as i64);
        self.pending
            .set(load(&c.jobs_queued).saturating_sub(load(&c.jobs_finished)) as i64);
        let seconds = load(&c.query_micros) as f64 / 1e6;
        let current = self.query_seconds.get();
        if seconds > current {
            self.query_seconds.inc_by(seconds - current);
        }
    }
}
