//! Prometheus metrics: one registry per process, held in [`crate::state::AppState`] (never a
//! global), rendered as OpenMetrics text by `GET /metrics`.
//!
//! Labels are closed sets chosen here (a route name, a status code, a stage, a cache name,
//! an outcome). No label ever carries a conversation id, a tenant, a token or message text:
//! that keeps cardinality bounded and the scrape free of anything private.
//!
//! The pipeline calls the small recording methods below; the router records requests and the
//! time memproxy adds. What other parts count themselves (the store's cache lookups, the
//! summarizer's jobs and tokens) and the gauges that describe the store (size on disk, cached
//! conversations) are read when the scrape happens.

use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::ledger::Task;
use crate::memory::Memory;

// Long-term memory's extraction metrics.
#[path = "metrics_longterm.rs"]
mod longterm;
use crate::memory_guard::{MemoryGuard, Pressure};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// The content type of the scrape.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Which part of the API a request went to: the `route` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/chat/completions` (header or path form), memory on or off.
    Chat,
    /// `POST /v1/responses`, memory on or off.
    Responses,
    /// `POST /v1/messages` (Anthropic), memory on or off.
    Messages,
    /// Any other `/v1/...` request, forwarded untouched.
    Passthrough,
    /// `/admin/...`.
    Admin,
    /// `/healthz`, `/readyz`.
    Health,
    /// `/metrics`.
    Metrics,
    /// Anything else (404).
    Other,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Chat => "chat",
            Route::Responses => "responses",
            Route::Messages => "messages",
            Route::Passthrough => "passthrough",
            Route::Admin => "admin",
            Route::Health => "health",
            Route::Metrics => "metrics",
            Route::Other => "other",
        }
    }

    /// The route of a request, from its method and path alone.
    pub fn of(method: &http::Method, path: &str) -> Route {
        match path {
            "/healthz" | "/readyz" => return Route::Health,
            "/metrics" => return Route::Metrics,
            _ => {}
        }
        if path == "/admin" || path.starts_with("/admin/") {
            return Route::Admin;
        }
        let api_path = match crate::identity::split_path_form(path) {
            Some((_, _, rest)) => rest,
            None => path,
        };
        if api_path != "/v1" && !api_path.starts_with("/v1/") {
            return Route::Other;
        }
        match (method == http::Method::POST, api_path) {
            (true, "/v1/chat/completions") => Route::Chat,
            (true, "/v1/responses") => Route::Responses,
            (true, "/v1/messages") => Route::Messages,
            _ => Route::Passthrough,
        }
    }
}

/// A stage of the memory pipeline: the `stage` label of `memproxy_stage_duration_seconds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Reconcile,
    Recall,
    Budget,
    Assemble,
    Commit,
    Summary,
}

impl Stage {
    pub const ALL: [Stage; 6] = [
        Stage::Reconcile,
        Stage::Recall,
        Stage::Budget,
        Stage::Assemble,
        Stage::Commit,
        Stage::Summary,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Reconcile => "reconcile",
            Stage::Recall => "recall",
            Stage::Budget => "budget",
            Stage::Assemble => "assemble",
            Stage::Commit => "commit",
            Stage::Summary => "summary",
        }
    }
}

/// A cache whose hits and misses are counted: the `cache` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cache {
    /// The store's per-conversation state (turn index).
    Conversation,
    /// The per-conversation BM25 recall index.
    Recall,
}

impl Cache {
    fn as_str(self) -> &'static str {
        match self {
            Cache::Conversation => "conversation",
            Cache::Recall => "recall",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    stage: &'static str,
}

/// An agent label: a name from the config, or `other` (`ledger.rs`): a closed set.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentLabels {
    agent: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AgentTaskLabels {
    agent: String,
    task: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabels {
    cache: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// What a request refused by the memory guard got: the `action` label of
/// `memproxy_admission_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A chat request served with memory off (`X-Memory-Status: degraded`).
    Degraded,
    /// An admin request answered 503.
    Unavailable,
}

impl Refusal {
    pub const ALL: [Refusal; 2] = [Refusal::Degraded, Refusal::Unavailable];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Degraded => "degraded",
            Refusal::Unavailable => "unavailable",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    action: &'static str,
    reason: &'static str,
}

/// How the reply of an exchange came: a JSON body, or a stream (whose `X-Memory-Status:
/// stored` was sent before the commit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    Json,
    Stream,
}

impl ReplyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplyKind::Json => "json",
            ReplyKind::Stream => "stream",
        }
    }
}

/// The time the upstream took to answer with its head, put into a response's extensions by
/// whoever forwarded it, so the router can tell the time memproxy added.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamTime(pub Duration);

fn latency_buckets() -> Histogram {
    // 1 ms … ~65 s.
    Histogram::new([
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ])
}

fn added_buckets() -> Histogram {
    // 50 µs … 5 s: what memproxy adds is meant to be small.
    Histogram::new([
        0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
        1.0, 5.0,
    ])
}

/// Every metric memproxy exports.
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    upstream_latency: Histogram,
    added_time: Histogram,
    stages: Family<StageLabels, Histogram, fn() -> Histogram>,
    retrieved_turns: Histogram,
    summaries: Family<ResultLabels, Counter>,
    summary_input_tokens: Counter,
    summary_output_tokens: Counter,
    tokens_forwarded: Counter,
    tokens_history: Counter,
    ledger_history: Family<AgentLabels, Counter>,
    ledger_forwarded: Family<AgentLabels, Counter>,
    ledger_cached: Family<AgentLabels, Counter>,
    ledger_background: Family<AgentTaskLabels, Counter>,
    background_budget_exhausted: Family<AgentTaskLabels, Counter>,
    receipts_bytes: Gauge,
    receipts_kept: Gauge,
    store_size: Gauge,
    store_up: Gauge,
    cached_conversations: Gauge,
    recall_cache_bytes: Gauge,
    cache_lookups: Family<CacheLabels, Counter>,
    cache_misses: Family<CacheLabels, Counter>,
    ttl_deletions: Counter,
    ttl_passes: Counter,
    ttl_scanned: Counter,
    admin_deletions: Counter,
    commit_failures: Counter,
    branches_closed: Counter,
    stream_commit_failures: Counter,
    admission_refused: Family<RefusalLabels, Counter>,
    memory_off: Family<ReasonLabels, Counter>,
    resident_memory: Gauge,
    memory_budget: Gauge,
    memory_high_water: Gauge,
    memory_in_flight: Gauge,
    longterm: longterm::LongTermMetrics,
    /// Held while a scrape mirrors counters kept elsewhere, so two scrapes never add twice.
    scrape: Mutex<()>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("memproxy");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Requests answered, by route and HTTP status",
            requests.clone(),
        );
        let upstream_latency = latency_buckets();
        registry.register_with_unit(
            "upstream_latency",
            "Time the upstream took to answer with its response head",
            Unit::Seconds,
            upstream_latency.clone(),
        );
        let added_time = added_buckets();
        registry.register_with_unit(
            "added_time",
            "Time memproxy added to a forwarded request: time to the response head minus the upstream's time",
            Unit::Seconds,
            added_time.clone(),
        );
        let stages: Family<StageLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(added_buckets);
        registry.register_with_unit(
            "stage_duration",
            "Time spent in each memory stage (reconcile, recall, assemble, commit, summary)",
            Unit::Seconds,
            stages.clone(),
        );
        let retrieved_turns = Histogram::new([0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 10.0, 15.0, 20.0]);
        registry.register(
            "retrieved_turns",
            "Older turns recalled into a forwarded prompt",
            retrieved_turns.clone(),
        );
        let summaries = Family::<ResultLabels, Counter>::default();
        registry.register(
            "summaries",
            "Summary jobs by result: made, failed, dropped (queue full or shutting down)",
            summaries.clone(),
        );
        let summary_input_tokens = Counter::default();
        registry.register(
            "summary_input_tokens",
            "Prompt tokens the summary calls used (the upstream's usage)",
            summary_input_tokens.clone(),
        );
        let summary_output_tokens = Counter::default();
        registry.register(
            "summary_output_tokens",
            "Completion tokens of the summary calls (the upstream's usage)",
            summary_output_tokens.clone(),
        );
        let tokens_forwarded = Counter::default();
        registry.register(
            "prompt_tokens_forwarded",
            "Tokens of the prompts memproxy forwarded upstream",
            tokens_forwarded.clone(),
        );
        let tokens_history = Counter::default();
        registry.register(
            "history_tokens",
            "Tokens of the full history those prompts stood for (stored messages plus the new ones); the saving is this minus prompt_tokens_forwarded",
            tokens_history.clone(),
        );
        let ledger_history = Family::<AgentLabels, Counter>::default();
        registry.register(
            "ledger_history_tokens",
            "Token ledger, by agent: tokens the memory-on requests would have sent without memproxy (the whole history each time)",
            ledger_history.clone(),
        );
        let ledger_forwarded = Family::<AgentLabels, Counter>::default();
        registry.register(
            "ledger_forwarded_tokens",
            "Token ledger, by agent: tokens of the prompts memproxy forwarded for them",
            ledger_forwarded.clone(),
        );
        let ledger_cached = Family::<AgentLabels, Counter>::default();
        registry.register(
            "ledger_cached_tokens",
            "Token ledger, by agent: of the prompts forwarded, the tokens the upstream reported read from its prompt cache",
            ledger_cached.clone(),
        );
        let ledger_background = Family::<AgentTaskLabels, Counter>::default();
        registry.register(
            "ledger_background_tokens",
            "Token ledger, by agent and task (summary, extraction): tokens memproxy's own model calls spent (the upstream's usage, else counted)",
            ledger_background.clone(),
        );
        let background_budget_exhausted = Family::<AgentTaskLabels, Counter>::default();
        registry.register(
            "background_budget_exhausted",
            "Background model calls not made because the agent's budget for the UTC day (compression.max_tokens_per_day) was spent, by agent and task",
            background_budget_exhausted.clone(),
        );
        let receipts_bytes = Gauge::default();
        registry.register_with_unit(
            "receipts",
            "Memory the kept receipts take (receipts.max_bytes bounds it)",
            Unit::Bytes,
            receipts_bytes.clone(),
        );
        let receipts_kept = Gauge::default();
        registry.register("receipts_kept", "Receipts kept now", receipts_kept.clone());
        let store_size = Gauge::default();
        registry.register_with_unit(
            "store_size",
            "Size of the store on disk",
            Unit::Bytes,
            store_size.clone(),
        );
        let store_up = Gauge::default();
        registry.register(
            "store_up",
            "1 when the store was opened and takes writes, with no conversation found unreadable; 0 when memory is off or degraded (see /readyz)",
            store_up.clone(),
        );
        let cached_conversations = Gauge::default();
        registry.register(
            "cached_conversations",
            "Conversations whose state is held in memory",
            cached_conversations.clone(),
        );
        let recall_cache_bytes = Gauge::default();
        registry.register_with_unit(
            "recall_cache",
            "Approximate heap size of the cached recall indexes",
            Unit::Bytes,
            recall_cache_bytes.clone(),
        );
        let cache_lookups = Family::<CacheLabels, Counter>::default();
        registry.register(
            "cache_lookups",
            "Lookups in memproxy's in-memory caches, by cache",
            cache_lookups.clone(),
        );
        let cache_misses = Family::<CacheLabels, Counter>::default();
        registry.register(
            "cache_misses",
            "Lookups that missed and loaded from the store, by cache",
            cache_misses.clone(),
        );
        let ttl_deletions = Counter::default();
        registry.register(
            "ttl_deletions",
            "Conversations deleted by the TTL sweeper",
            ttl_deletions.clone(),
        );
        let ttl_passes = Counter::default();
        registry.register(
            "ttl_sweeps",
            "Passes of the TTL sweeper",
            ttl_passes.clone(),
        );
        let ttl_scanned = Counter::default();
        registry.register(
            "ttl_scanned",
            "Conversations the TTL sweeper looked at",
            ttl_scanned.clone(),
        );
        let admin_deletions = Counter::default();
        registry.register(
            "admin_deletions",
            "Conversations deleted through the admin API or the CLI",
            admin_deletions.clone(),
        );
        let branches_closed = Counter::default();
        registry.register(
            "branches_closed",
            "Branches closed: requests whose re-sent history left the stored line (an edited earlier message, a regenerated earlier reply)",
            branches_closed.clone(),
        );
        let commit_failures = Counter::default();
        registry.register(
            "commit_failures",
            "Exchanges that could not be stored",
            commit_failures.clone(),
        );
        let stream_commit_failures = Counter::default();
        registry.register(
            "stream_commit_failures",
            "Streamed exchanges that could not be stored after X-Memory-Status: stored was sent",
            stream_commit_failures.clone(),
        );
        let admission_refused = Family::<RefusalLabels, Counter>::default();
        registry.register(
            "admission_refused",
            "Requests refused memory by the memory guard (server.memory_budget), by what they got (degraded: served with memory off; unavailable: 503) and why (resident: the RSS reached the high-water mark; in_flight: with the requests in flight it would have)",
            admission_refused.clone(),
        );
        let memory_off = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "memory_off",
            "Requests with a conversation id forwarded as sent with memory off (X-Memory-Status: off), by X-Memory-Reason (side-call-no-tools, side-call-structured-output, side-call-compaction: a request shaped as no turn of its conversation)",
            memory_off.clone(),
        );
        let resident_memory = Gauge::default();
        registry.register_with_unit(
            "resident_memory",
            "The process's resident memory (RSS) as the memory guard last read it",
            Unit::Bytes,
            resident_memory.clone(),
        );
        let memory_budget = Gauge::default();
        registry.register_with_unit(
            "memory_budget",
            "server.memory_budget",
            Unit::Bytes,
            memory_budget.clone(),
        );
        let memory_high_water = Gauge::default();
        registry.register_with_unit(
            "memory_high_water",
            "The RSS from which new chat requests are served with memory off",
            Unit::Bytes,
            memory_high_water.clone(),
        );
        let memory_in_flight = Gauge::default();
        registry.register_with_unit(
            "memory_in_flight",
            "Bytes reserved by the memory requests in flight (their estimates)",
            Unit::Bytes,
            memory_in_flight.clone(),
        );
        let longterm = longterm::LongTermMetrics::register(&mut registry);
        let metrics = Metrics {
            registry,
            requests,
            upstream_latency,
            added_time,
            stages,
            retrieved_turns,
            summaries,
            summary_input_tokens,
            summary_output_tokens,
            tokens_forwarded,
            tokens_history,
            ledger_history,
            ledger_forwarded,
            ledger_cached,
            ledger_background,
            background_budget_exhausted,
            receipts_bytes,
            receipts_kept,
            store_size,
            store_up,
            cached_conversations,
            recall_cache_bytes,
            cache_lookups,
            cache_misses,
            ttl_deletions,
            ttl_passes,
            ttl_scanned,
            admin_deletions,
            commit_failures,
            branches_closed,
            stream_commit_failures,
            admission_refused,
            memory_off,
            resident_memory,
            memory_budget,
            memory_high_water,
            memory_in_flight,
            longterm,
            scrape: Mutex::new(()),
        };
        // Every labelled series exists from the start, so dashboards see zeros, not gaps.
        for stage in Stage::ALL {
            let _ = metrics.stage(stage);
        }
        for result in ["made", "failed", "dropped"] {
            let _ = metrics.summaries.get_or_create(&ResultLabels { result });
        }
        for cache in [Cache::Conversation, Cache::Recall] {
            let labels = CacheLabels {
                cache: cache.as_str(),
            };
            let _ = metrics.cache_lookups.get_or_create(&labels);
            let _ = metrics.cache_misses.get_or_create(&labels);
        }
        for action in Refusal::ALL {
            for reason in Pressure::ALL {
                let _ = metrics.admission_refused.get_or_create(&RefusalLabels {
                    action: action.as_str(),
                    reason: reason.as_str(),
                });
            }
        }
        metrics
    }

    /// Counts one answered request.
    pub fn request(&self, route: Route, status: http::StatusCode) {
        self.requests
            .get_or_create(&RequestLabels {
                route: route.as_str(),
                status: status.as_u16(),
            })
            .inc();
    }

    /// Records a request's timings: `total` to the response head, `upstream` the part the
    /// upstream took (when it was called). Observes the time memproxy added.
    pub fn timings(&self, total: Duration, upstream: Option<Duration>) {
        if let Some(upstream) = upstream {
            self.added_time
                .observe(total.saturating_sub(upstream).as_secs_f64());
        }
    }

    /// Records the upstream's time to its response head, and notes it in `extensions` (the
    /// response's) so the router can tell the time memproxy added.
    pub fn upstream(&self, extensions: &mut http::Extensions, elapsed: Duration) {
        self.upstream_latency.observe(elapsed.as_secs_f64());
        extensions.insert(UpstreamTime(elapsed));
    }

    /// The histogram of one stage's durations: `metrics.stage(Stage::Recall).observe(secs)`.
    pub fn stage(&self, stage: Stage) -> impl std::ops::Deref<Target = Histogram> + '_ {
        self.stages.get_or_create(&StageLabels {
            stage: stage.as_str(),
        })
    }

    /// Records the time one stage took.
    pub fn observe_stage(&self, stage: Stage, elapsed: Duration) {
        self.stage(stage).observe(elapsed.as_secs_f64());
    }

    /// Records a planned prompt: how many older turns were recalled, the tokens forwarded and
    /// the tokens of the full history they stand for.
    pub fn prompt(&self, retrieved_turns: usize, forwarded_tokens: u64, history_tokens: u64) {
        self.retrieved_turns.observe(retrieved_turns as f64);
        self.tokens_forwarded.inc_by(forwarded_tokens);
        self.tokens_history.inc_by(history_tokens);
    }

    /// The token ledger of a planned memory-on request of agent label `agent`: the tokens it
    /// would have sent without memproxy, and those forwarded.
    pub fn ledger_exchange(&self, agent: &str, history_tokens: u64, forwarded_tokens: u64) {
        let labels = AgentLabels {
            agent: agent.to_string(),
        };
        self.ledger_history
            .get_or_create(&labels)
            .inc_by(history_tokens);
        self.ledger_forwarded
            .get_or_create(&labels)
            .inc_by(forwarded_tokens);
    }

    /// The cached prompt tokens the upstream reported for an exchange of agent label `agent`.
    pub fn ledger_cached(&self, agent: &str, cached_tokens: u64) {
        self.ledger_cached
            .get_or_create(&AgentLabels {
                agent: agent.to_string(),
            })
            .inc_by(cached_tokens);
    }

    /// The receipts kept: their bytes and their number.
    pub fn receipts(&self, bytes: u64, kept: u64) {
        self.receipts_bytes.set(gauge(bytes));
        self.receipts_kept.set(gauge(kept));
    }

    /// Counts a cache lookup, and whether it missed.
    pub fn cache_lookup(&self, cache: Cache, hit: bool) {
        let labels = CacheLabels {
            cache: cache.as_str(),
        };
        self.cache_lookups.get_or_create(&labels).inc();
        if !hit {
            self.cache_misses.get_or_create(&labels).inc();
        }
    }

    /// Counts an exchange that could not be stored.
    pub fn commit_failed(&self, kind: ReplyKind) {
        self.commit_failures.inc();
        if kind == ReplyKind::Stream {
            self.stream_commit_failures.inc();
        }
    }

    /// Counts a request the memory guard refused memory, what it got and why.
    pub fn admission_refused(&self, action: Refusal, reason: Pressure) {
        self.admission_refused
            .get_or_create(&RefusalLabels {
                action: action.as_str(),
                reason: reason.as_str(),
            })
            .inc();
    }

    /// Counts a request forwarded with memory off, and why.
    pub fn memory_off(&self, reason: &'static str) {
        self.memory_off
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts conversations deleted by an operator.
    pub fn admin_deleted(&self, count: usize) {
        self.admin_deletions.inc_by(count as u64);
    }

    /// The scrape: OpenMetrics text, with the memory core's and the memory guard's gauges and
    /// counters read now (`memory` is `None` when the store could not be opened; only the edge's
    /// own figures are there then).
    pub fn render(&self, memory: Option<&Memory>, guard: &MemoryGuard) -> String {
        let _scrape = self
            .scrape
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.resident_memory
            .set(gauge(guard.resident_bytes().unwrap_or(0)));
        self.memory_budget.set(gauge(guard.budget().total));
        self.memory_high_water.set(gauge(guard.budget().high_water));
        self.memory_in_flight.set(gauge(guard.reserved_bytes()));
        match memory {
            Some(memory) => self.mirror(memory),
            None => {
                self.store_up.set(0);
            }
        }
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Reads the memory core's gauges and counters into the registry.
    fn mirror(&self, memory: &Memory) {
        let store = &memory.store;
        let up = store.write_failure().is_none() && store.damaged_conversations() == 0;
        self.store_up.set(i64::from(up));
        self.store_size.set(gauge(store.size_on_disk()));
        self.cached_conversations
            .set(gauge(store.cached_conversations()));
        self.recall_cache_bytes.set(gauge(
            memory.recall.weighted_size() + memory.longterm.weighted_size(),
        ));
        let (lookups, misses) = store.cache_counts();
        let labels = CacheLabels {
            cache: Cache::Conversation.as_str(),
        };
        catch_up(&self.cache_lookups.get_or_create(&labels), lookups);
        catch_up(&self.cache_misses.get_or_create(&labels), misses);
        let (lookups, misses) = memory.recall.cache_counts();
        let labels = CacheLabels {
            cache: Cache::Recall.as_str(),
        };
        catch_up(&self.cache_lookups.get_or_create(&labels), lookups);
        catch_up(&self.cache_misses.get_or_create(&labels), misses);
        // The sweeper and the summarizer keep their own counters; they are mirrored here.
        let sweeps = &memory.sweeps;
        catch_up(&self.ttl_passes, sweeps.passes.load(Ordering::Relaxed));
        catch_up(&self.ttl_scanned, sweeps.scanned.load(Ordering::Relaxed));
        catch_up(&self.ttl_deletions, sweeps.deleted.load(Ordering::Relaxed));
        catch_up(
            &self.branches_closed,
            memory.branches_closed.load(Ordering::Relaxed),
        );
        let counters = &memory.summarizer.counters;
        for (result, counter) in [
            ("made", &counters.made),
            ("failed", &counters.failed),
            ("dropped", &counters.dropped),
        ] {
            catch_up(
                &self.summaries.get_or_create(&ResultLabels { result }),
                counter.load(Ordering::Relaxed),
            );
        }
        catch_up(
            &self.summary_input_tokens,
            counters.prompt_tokens.load(Ordering::Relaxed),
        );
        catch_up(
            &self.summary_output_tokens,
            counters.completion_tokens.load(Ordering::Relaxed),
        );
        // The ledger's background side, per agent label; every label's series exists.
        for (agent, counters) in memory.ledger.labels() {
            let labels = AgentLabels {
                agent: agent.to_string(),
            };
            let _ = self.ledger_history.get_or_create(&labels);
            let _ = self.ledger_forwarded.get_or_create(&labels);
            let _ = self.ledger_cached.get_or_create(&labels);
            for task in Task::ALL {
                let labels = AgentTaskLabels {
                    agent: agent.to_string(),
                    task: task.as_str(),
                };
                let (tokens, skipped) = match task {
                    Task::Summary => (&counters.summary_tokens, &counters.summary_skipped),
                    Task::Extraction => (&counters.extraction_tokens, &counters.extraction_skipped),
                };
                catch_up(
                    &self.ledger_background.get_or_create(&labels),
                    tokens.load(Ordering::Relaxed),
                );
                catch_up(
                    &self.background_budget_exhausted.get_or_create(&labels),
                    skipped.load(Ordering::Relaxed),
                );
            }
        }
        self.longterm
            .mirror(&memory.longterm.extractor.counters, catch_up);
    }
}

/// A byte count or a count as a gauge's value.
fn gauge(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// Brings a counter mirrored from elsewhere up to `value` (counters only grow).
fn catch_up(counter: &Counter, value: u64) {
    let current = counter.get();
    if value > current {
        counter.inc_by(value - current);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_named_from_the_path_alone() {
        use http::Method;
        let cases = [
            (Method::POST, "/v1/chat/completions", Route::Chat),
            (
                Method::POST,
                "/agents/a/conversations/c/v1/chat/completions",
                Route::Chat,
            ),
            (Method::POST, "/v1/responses", Route::Responses),
            (Method::POST, "/v1/messages", Route::Messages),
            (
                Method::POST,
                "/v1/messages/count_tokens",
                Route::Passthrough,
            ),
            (Method::GET, "/v1/responses/resp_1", Route::Passthrough),
            (Method::GET, "/v1/models", Route::Passthrough),
            (Method::GET, "/v1/chat/completions", Route::Passthrough),
            (Method::GET, "/healthz", Route::Health),
            (Method::GET, "/readyz", Route::Health),
            (Method::GET, "/metrics", Route::Metrics),
            (Method::GET, "/admin/v1/conversations", Route::Admin),
            (Method::GET, "/nope", Route::Other),
        ];
        for (method, path, route) in cases {
            assert_eq!(Route::of(&method, path), route, "{path}");
        }
    }
}
