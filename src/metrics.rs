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
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::ledger::Task;
use crate::memory::Memory;

// Long-term memory's extraction metrics.
#[path = "metrics_longterm.rs"]
mod longterm;
// Recall by meaning's metrics.
#[path = "metrics_embedding.rs"]
mod embedding;
use crate::memory_guard::{MemoryGuard, Pressure};
use crate::summary::SummaryCounters;

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
    /// `/mcp`: the memory tools.
    Mcp,
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
            Route::Mcp => "mcp",
            Route::Health => "health",
            Route::Metrics => "metrics",
            Route::Other => "other",
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
struct AllocatorLabels {
    state: &'static str,
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
struct PlaceLabels {
    place: &'static str,
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

/// Every metric memproxy exports, in groups by what they describe. Each group registers its
/// own families; the order the groups register in is the order of the scrape.
pub struct Metrics {
    registry: Registry,
    traffic: TrafficMetrics,
    summaries: SummaryMetrics,
    tokens: TokenMetrics,
    receipts: ReceiptMetrics,
    store: StoreMetrics,
    deletions: DeletionMetrics,
    commits: CommitMetrics,
    admission: AdmissionMetrics,
    longterm: longterm::LongTermMetrics,
    embedding: embedding::EmbeddingMetrics,
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

/// The request path: requests answered, the upstream's time and the time memproxy added,
/// each stage's time, and the older turns recalled into a prompt.
struct TrafficMetrics {
    requests: Family<RequestLabels, Counter>,
    upstream_latency: Histogram,
    added_time: Histogram,
    stages: Family<StageLabels, Histogram, fn() -> Histogram>,
    retrieved_turns: Histogram,
    /// The most a planning held allocated at once (jemalloc's count of its thread).
    planning_bytes: Histogram,
    /// Plans made on the request's own thread, and on the blocking pool (`plans{place}`).
    plans: Places,
    /// Exchanges written where the answer arrived, and on the blocking pool
    /// (`commits{place}`).
    commits: Places,
}

/// A counter by `place`: work done on the request's own thread, or on the blocking pool.
struct Places {
    here: Counter,
    pooled: Counter,
}

impl Places {
    fn register(registry: &mut Registry, name: &str, help: &str) -> Places {
        let family = Family::<PlaceLabels, Counter>::default();
        registry.register(name, help, family.clone());
        let place = |place| family.get_or_create(&PlaceLabels { place }).clone();
        Places {
            here: place("request"),
            pooled: place("pool"),
        }
    }

    fn count(&self, here: bool) {
        if here {
            self.here.inc();
        } else {
            self.pooled.inc();
        }
    }
}

impl TrafficMetrics {
    fn register(registry: &mut Registry) -> TrafficMetrics {
        let plans = Places::register(
            registry,
            "plans",
            "Memory plans made, by place: `request` (on the request's own thread: a small request of a short cached conversation nobody else holds) or `pool` (the blocking pool)",
        );
        let commits = Places::register(
            registry,
            "commits",
            "Exchanges stored, by where they were written: `request` (on the request's own thread: a small exchange of a conversation nobody else holds, in a store of this process's own, with no user's long-term memory) or `pool` (the blocking pool)",
        );
        let metrics = TrafficMetrics {
            requests: Family::default(),
            upstream_latency: latency_buckets(),
            added_time: added_buckets(),
            stages: Family::new_with_constructor(added_buckets),
            retrieved_turns: Histogram::new([0.0, 1.0, 2.0, 3.0, 5.0, 8.0, 10.0, 15.0, 20.0]),
            planning_bytes: Histogram::new([
                4096.0, 16384.0, 32768.0, 65536.0, 131072.0, 262144.0, 524288.0, 1048576.0,
                2097152.0, 4194304.0, 16777216.0,
            ]),
            plans,
            commits,
        };
        registry.register(
            "requests",
            "Requests answered, by route and HTTP status",
            metrics.requests.clone(),
        );
        registry.register_with_unit(
            "upstream_latency",
            "Time the upstream took to answer with its response head",
            Unit::Seconds,
            metrics.upstream_latency.clone(),
        );
        registry.register_with_unit(
            "added_time",
            "Time memproxy added to a forwarded request: time to the response head minus the upstream's time",
            Unit::Seconds,
            metrics.added_time.clone(),
        );
        registry.register_with_unit(
            "stage_duration",
            "Time spent in each memory stage (reconcile, recall, assemble, commit, summary)",
            Unit::Seconds,
            metrics.stages.clone(),
        );
        registry.register(
            "retrieved_turns",
            "Older turns recalled into a forwarded prompt",
            metrics.retrieved_turns.clone(),
        );
        registry.register(
            "planning_peak_bytes",
            "The most a request's parsing and planning held allocated at once, in bytes (with jemalloc)",
            metrics.planning_bytes.clone(),
        );
        // Every labelled series exists from the start, so dashboards see zeros, not gaps.
        for stage in Stage::ALL {
            let _ = metrics.stage(stage);
        }
        metrics
    }

    fn stage(&self, stage: Stage) -> impl std::ops::Deref<Target = Histogram> + '_ {
        self.stages.get_or_create(&StageLabels {
            stage: stage.as_str(),
        })
    }
}

/// The summarizer's jobs by result and the tokens its calls used (mirrored at each scrape).
struct SummaryMetrics {
    results: Family<ResultLabels, Counter>,
    input_tokens: Counter,
    output_tokens: Counter,
}

/// The `result` of `memproxy_summaries_total` and the summarizer's counter behind each.
fn summary_results(c: &SummaryCounters) -> [(&'static str, &AtomicU64); 3] {
    [
        ("made", &c.made),
        ("failed", &c.failed),
        ("dropped", &c.dropped),
    ]
}

impl SummaryMetrics {
    fn register(registry: &mut Registry) -> SummaryMetrics {
        let metrics = SummaryMetrics {
            results: Family::default(),
            input_tokens: Counter::default(),
            output_tokens: Counter::default(),
        };
        registry.register(
            "summaries",
            "Summary jobs by result: made, failed, dropped (queue full or shutting down)",
            metrics.results.clone(),
        );
        registry.register(
            "summary_input_tokens",
            "Prompt tokens the summary calls used (the upstream's usage)",
            metrics.input_tokens.clone(),
        );
        registry.register(
            "summary_output_tokens",
            "Completion tokens of the summary calls (the upstream's usage)",
            metrics.output_tokens.clone(),
        );
        for (result, _) in summary_results(&SummaryCounters::default()) {
            let _ = metrics.results.get_or_create(&ResultLabels { result });
        }
        metrics
    }
}

/// What prompts cost: the tokens forwarded against the history they stand for, in all and per
/// agent (the token ledger), and what memproxy's own model calls spent or were refused.
struct TokenMetrics {
    forwarded: Counter,
    history: Counter,
    ledger_history: Family<AgentLabels, Counter>,
    ledger_forwarded: Family<AgentLabels, Counter>,
    ledger_cached: Family<AgentLabels, Counter>,
    ledger_background: Family<AgentTaskLabels, Counter>,
    background_budget_exhausted: Family<AgentTaskLabels, Counter>,
}

impl TokenMetrics {
    fn register(registry: &mut Registry) -> TokenMetrics {
        let metrics = TokenMetrics {
            forwarded: Counter::default(),
            history: Counter::default(),
            ledger_history: Family::default(),
            ledger_forwarded: Family::default(),
            ledger_cached: Family::default(),
            ledger_background: Family::default(),
            background_budget_exhausted: Family::default(),
        };
        registry.register(
            "prompt_tokens_forwarded",
            "Tokens of the prompts memproxy forwarded upstream",
            metrics.forwarded.clone(),
        );
        registry.register(
            "history_tokens",
            "Tokens of the full history those prompts stood for (stored messages plus the new ones); the saving is this minus prompt_tokens_forwarded",
            metrics.history.clone(),
        );
        registry.register(
            "ledger_history_tokens",
            "Token ledger, by agent: tokens the memory-on requests would have sent without memproxy (the whole history each time)",
            metrics.ledger_history.clone(),
        );
        registry.register(
            "ledger_forwarded_tokens",
            "Token ledger, by agent: tokens of the prompts memproxy forwarded for them",
            metrics.ledger_forwarded.clone(),
        );
        registry.register(
            "ledger_cached_tokens",
            "Token ledger, by agent: of the prompts forwarded, the tokens the upstream reported read from its prompt cache",
            metrics.ledger_cached.clone(),
        );
        registry.register(
            "ledger_background_tokens",
            "Token ledger, by agent and task (summary, extraction): tokens memproxy's own model calls spent (the upstream's usage, else counted)",
            metrics.ledger_background.clone(),
        );
        registry.register(
            "background_budget_exhausted",
            "Background model calls not made because the agent's budget for the UTC day (compression.max_tokens_per_day) was spent, by agent and task",
            metrics.background_budget_exhausted.clone(),
        );
        metrics
    }
}

/// The receipts kept in memory: their bytes and their number.
struct ReceiptMetrics {
    bytes: Gauge,
    kept: Gauge,
}

impl ReceiptMetrics {
    fn register(registry: &mut Registry) -> ReceiptMetrics {
        let metrics = ReceiptMetrics {
            bytes: Gauge::default(),
            kept: Gauge::default(),
        };
        registry.register_with_unit(
            "receipts",
            "Memory the kept receipts take (receipts.max_bytes bounds it)",
            Unit::Bytes,
            metrics.bytes.clone(),
        );
        registry.register("receipts_kept", "Receipts kept now", metrics.kept.clone());
        metrics
    }
}

/// The store and the caches in front of it: size on disk, health, what is cached, and the
/// caches' lookups and misses (read at each scrape).
struct StoreMetrics {
    size: Gauge,
    up: Gauge,
    cached_conversations: Gauge,
    recall_cache_bytes: Gauge,
    cache_lookups: Family<CacheLabels, Counter>,
    cache_misses: Family<CacheLabels, Counter>,
    flushes: Counter,
}

impl StoreMetrics {
    fn register(registry: &mut Registry) -> StoreMetrics {
        let metrics = StoreMetrics {
            size: Gauge::default(),
            up: Gauge::default(),
            cached_conversations: Gauge::default(),
            recall_cache_bytes: Gauge::default(),
            cache_lookups: Family::default(),
            cache_misses: Family::default(),
            flushes: Counter::default(),
        };
        registry.register(
            "store_flushes",
            "Group flushes of the store to disk, each making every commit before it durable (sled with durability \"commit\")",
            metrics.flushes.clone(),
        );
        registry.register_with_unit(
            "store_size",
            "Size of the store on disk",
            Unit::Bytes,
            metrics.size.clone(),
        );
        registry.register(
            "store_up",
            "1 when the store was opened and takes writes, with no conversation found unreadable; 0 when memory is off or degraded (see /readyz)",
            metrics.up.clone(),
        );
        registry.register(
            "cached_conversations",
            "Conversations whose state is held in memory",
            metrics.cached_conversations.clone(),
        );
        registry.register_with_unit(
            "recall_cache",
            "Approximate heap size of the cached recall indexes",
            Unit::Bytes,
            metrics.recall_cache_bytes.clone(),
        );
        registry.register(
            "cache_lookups",
            "Lookups in memproxy's in-memory caches, by cache",
            metrics.cache_lookups.clone(),
        );
        registry.register(
            "cache_misses",
            "Lookups that missed and loaded from the store, by cache",
            metrics.cache_misses.clone(),
        );
        for cache in [Cache::Conversation, Cache::Recall] {
            let labels = CacheLabels {
                cache: cache.as_str(),
            };
            let _ = metrics.cache_lookups.get_or_create(&labels);
            let _ = metrics.cache_misses.get_or_create(&labels);
        }
        metrics
    }
}

/// Conversations deleted: by the TTL sweeper (with its passes and what it looked at, mirrored
/// from its counters) and by an operator.
struct DeletionMetrics {
    ttl_deletions: Counter,
    ttl_passes: Counter,
    ttl_scanned: Counter,
    admin_deletions: Counter,
}

impl DeletionMetrics {
    fn register(registry: &mut Registry) -> DeletionMetrics {
        let metrics = DeletionMetrics {
            ttl_deletions: Counter::default(),
            ttl_passes: Counter::default(),
            ttl_scanned: Counter::default(),
            admin_deletions: Counter::default(),
        };
        registry.register(
            "ttl_deletions",
            "Conversations deleted by the TTL sweeper",
            metrics.ttl_deletions.clone(),
        );
        registry.register(
            "ttl_sweeps",
            "Passes of the TTL sweeper",
            metrics.ttl_passes.clone(),
        );
        registry.register(
            "ttl_scanned",
            "Conversations the TTL sweeper looked at",
            metrics.ttl_scanned.clone(),
        );
        registry.register(
            "admin_deletions",
            "Conversations deleted through the admin API or the CLI",
            metrics.admin_deletions.clone(),
        );
        metrics
    }
}

/// What commits did beyond storing an exchange: branches closed, and exchanges that could not
/// be stored (streamed ones apart: their `stored` status was already sent).
struct CommitMetrics {
    branches_closed: Counter,
    failures: Counter,
    stream_failures: Counter,
}

impl CommitMetrics {
    fn register(registry: &mut Registry) -> CommitMetrics {
        let metrics = CommitMetrics {
            branches_closed: Counter::default(),
            failures: Counter::default(),
            stream_failures: Counter::default(),
        };
        registry.register(
            "branches_closed",
            "Branches closed: requests whose re-sent history left the stored line (an edited earlier message, a regenerated earlier reply)",
            metrics.branches_closed.clone(),
        );
        registry.register(
            "commit_failures",
            "Exchanges that could not be stored",
            metrics.failures.clone(),
        );
        registry.register(
            "stream_commit_failures",
            "Streamed exchanges that could not be stored after X-Memory-Status: stored was sent",
            metrics.stream_failures.clone(),
        );
        metrics
    }
}

/// Requests served without memory (refused by the memory guard, or side calls), and the
/// memory guard's figures (read at each scrape).
struct AdmissionMetrics {
    refused: Family<RefusalLabels, Counter>,
    memory_off: Family<ReasonLabels, Counter>,
    resident: Gauge,
    budget: Gauge,
    high_water: Gauge,
    in_flight: Gauge,
    planning: Gauge,
    waiting: Gauge,
    waited: Family<ResultLabels, Counter>,
    pressure: Gauge,
    shrinks: Counter,
    store_share: Gauge,
    store_messages: Gauge,
    allocator: Family<AllocatorLabels, Gauge>,
    cache_bytes: Family<CacheLabels, Gauge>,
    cache_limit: Family<CacheLabels, Gauge>,
    cache_shrunk: Family<CacheLabels, Counter>,
}

impl AdmissionMetrics {
    fn register(registry: &mut Registry) -> AdmissionMetrics {
        let metrics = AdmissionMetrics {
            refused: Family::default(),
            memory_off: Family::default(),
            resident: Gauge::default(),
            budget: Gauge::default(),
            high_water: Gauge::default(),
            in_flight: Gauge::default(),
            planning: Gauge::default(),
            waiting: Gauge::default(),
            waited: Family::default(),
            pressure: Gauge::default(),
            shrinks: Counter::default(),
            store_share: Gauge::default(),
            store_messages: Gauge::default(),
            allocator: Family::default(),
            cache_bytes: Family::default(),
            cache_limit: Family::default(),
            cache_shrunk: Family::default(),
        };
        registry.register(
            "memory_pressure",
            "Where the memory guard's relief stands: 0 calm (RSS under the mark where caches shrink), 1 shrinking the caches, 2 the caches at their floors (what is left is refused)",
            metrics.pressure.clone(),
        );
        registry.register_with_unit(
            "store_memory_share",
            format!(
                "The storage engine's share of the memory budget: its reserve, grown with what it stores (sled's memory past its page cache grows about {} bytes per stored message, `STORE_BYTES_PER_MESSAGE`, and {} more where the embedder's vectors are stored, `STORE_BYTES_PER_VECTOR`); what it needs past the reserve the caches give up (0 with Redis; with fjall, whose caches bound its memory, the reserve)",
                crate::config::STORE_BYTES_PER_MESSAGE,
                crate::config::STORE_BYTES_PER_VECTOR
            ),
            Unit::Bytes,
            metrics.store_share.clone(),
        );
        registry.register(
            "store_messages",
            "Messages on the main lines of the conversations the store holds, counted (what sled's share grows with; fjall's share does not grow with them; 0 with Redis, which every replica writes)",
            metrics.store_messages.clone(),
        );
        registry.register(
            "memory_shrinks",
            "Ticks of the memory guard that shrank a cache and gave the freed pages back to the system",
            metrics.shrinks.clone(),
        );
        registry.register_with_unit(
            "cache",
            "Bytes a cache holds (its weighed entries), by cache: state, recall, users, receipts",
            Unit::Bytes,
            metrics.cache_bytes.clone(),
        );
        registry.register_with_unit(
            "cache_limit",
            "The size a cache is held to now: its configured size, or less while memory is short",
            Unit::Bytes,
            metrics.cache_limit.clone(),
        );
        registry.register_with_unit(
            "cache_shrunk",
            "Bytes evicted from a cache by the memory guard to give memory back",
            Unit::Bytes,
            metrics.cache_shrunk.clone(),
        );
        registry.register(
            "admission_refused",
            "Requests refused memory by the memory guard (server.memory_budget), by what they got (degraded: served with memory off; unavailable: 503) and why (resident: the RSS reached the high-water mark; in_flight: with the requests in flight it would have)",
            metrics.refused.clone(),
        );
        registry.register(
            "memory_off",
            "Requests with a conversation id forwarded as sent with memory off (X-Memory-Status: off), by X-Memory-Reason (side-call-no-tools, side-call-structured-output, side-call-compaction: a request shaped as no turn of its conversation)",
            metrics.memory_off.clone(),
        );
        registry.register_with_unit(
            "resident_memory",
            "The process's resident memory (RSS) as the memory guard last read it",
            Unit::Bytes,
            metrics.resident.clone(),
        );
        registry.register_with_unit(
            "memory_budget",
            "server.memory_budget",
            Unit::Bytes,
            metrics.budget.clone(),
        );
        registry.register_with_unit(
            "memory_high_water",
            "The RSS from which new chat requests are served with memory off",
            Unit::Bytes,
            metrics.high_water.clone(),
        );
        registry.register_with_unit(
            "allocator",
            "What the allocator holds, by state: in_use (handed out to memproxy) and free (kept for later: RSS that is neither memproxy's nor given back). With jemalloc (the default build) or glibc's malloc (`glibc-trim`)",
            Unit::Bytes,
            metrics.allocator.clone(),
        );
        registry.register_with_unit(
            "memory_in_flight",
            "Bytes reserved by the memory requests in flight (their estimates)",
            Unit::Bytes,
            metrics.in_flight.clone(),
        );
        registry.register_with_unit(
            "memory_planning_estimate",
            "What a memory request's planning is taken to need besides its body's copies: with jemalloc, about the 90th percentile of what plannings were measured to take (`memproxy_planning_peak_bytes`), 256 KiB until measured",
            Unit::Bytes,
            metrics.planning.clone(),
        );
        registry.register(
            "memory_waiting",
            "Chat requests waiting now for the requests in flight to give back room under the high-water mark (at most server.memory_wait each, then served with memory off)",
            metrics.waiting.clone(),
        );
        registry.register(
            "admission_waited",
            "Chat requests that waited for room under the high-water mark, by result: admitted (memory on) or refused (memory off after the wait, also counted in memproxy_admission_refused_total)",
            metrics.waited.clone(),
        );
        for action in Refusal::ALL {
            for reason in Pressure::ALL {
                let _ = metrics.refused.get_or_create(&RefusalLabels {
                    action: action.as_str(),
                    reason: reason.as_str(),
                });
            }
        }
        metrics
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("memproxy");
        let traffic = TrafficMetrics::register(&mut registry);
        let summaries = SummaryMetrics::register(&mut registry);
        let tokens = TokenMetrics::register(&mut registry);
        let receipts = ReceiptMetrics::register(&mut registry);
        let store = StoreMetrics::register(&mut registry);
        let deletions = DeletionMetrics::register(&mut registry);
        let commits = CommitMetrics::register(&mut registry);
        let admission = AdmissionMetrics::register(&mut registry);
        let longterm = longterm::LongTermMetrics::register(&mut registry);
        let embedding = embedding::EmbeddingMetrics::register(&mut registry);
        Metrics {
            registry,
            traffic,
            summaries,
            tokens,
            receipts,
            store,
            deletions,
            commits,
            admission,
            longterm,
            embedding,
            scrape: Mutex::new(()),
        }
    }
    /// Counts one answered request.
    pub fn request(&self, route: Route, status: http::StatusCode) {
        self.traffic
            .requests
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
            self.traffic
                .added_time
                .observe(total.saturating_sub(upstream).as_secs_f64());
        }
    }

    /// Records the upstream's time to its response head, and notes it in `extensions` (the
    /// response's) so the router can tell the time memproxy added.
    pub fn upstream(&self, extensions: &mut http::Extensions, elapsed: Duration) {
        self.traffic.upstream_latency.observe(elapsed.as_secs_f64());
        extensions.insert(UpstreamTime(elapsed));
    }

    /// The histogram of one stage's durations: `metrics.stage(Stage::Recall).observe(secs)`.
    pub fn stage(&self, stage: Stage) -> impl std::ops::Deref<Target = Histogram> + '_ {
        self.traffic.stage(stage)
    }

    /// Records the time one stage took.
    pub fn observe_stage(&self, stage: Stage, elapsed: Duration) {
        self.stage(stage).observe(elapsed.as_secs_f64());
    }

    /// Counts a plan made, on the request's own thread (`here`) or on the blocking pool.
    pub fn planned(&self, here: bool) {
        self.traffic.plans.count(here);
    }

    /// Records the most a planning held allocated at once, in bytes.
    pub fn planning_peak(&self, peak: u64) {
        self.traffic.planning_bytes.observe(peak as f64);
    }

    /// Counts an exchange stored, on the request's own thread (`here`) or on the blocking pool.
    pub fn committed(&self, here: bool) {
        self.traffic.commits.count(here);
    }

    /// Records a planned prompt: how many older turns were recalled, the tokens forwarded and
    /// the tokens of the full history they stand for.
    pub fn prompt(&self, retrieved_turns: usize, forwarded_tokens: u64, history_tokens: u64) {
        self.traffic.retrieved_turns.observe(retrieved_turns as f64);
        self.tokens.forwarded.inc_by(forwarded_tokens);
        self.tokens.history.inc_by(history_tokens);
    }

    /// The token ledger of a planned memory-on request of agent label `agent`: the tokens it
    /// would have sent without memproxy, and those forwarded.
    pub fn ledger_exchange(&self, agent: &str, history_tokens: u64, forwarded_tokens: u64) {
        let labels = AgentLabels {
            agent: agent.to_string(),
        };
        self.tokens
            .ledger_history
            .get_or_create(&labels)
            .inc_by(history_tokens);
        self.tokens
            .ledger_forwarded
            .get_or_create(&labels)
            .inc_by(forwarded_tokens);
    }

    /// The cached prompt tokens the upstream reported for an exchange of agent label `agent`.
    pub fn ledger_cached(&self, agent: &str, cached_tokens: u64) {
        self.tokens
            .ledger_cached
            .get_or_create(&AgentLabels {
                agent: agent.to_string(),
            })
            .inc_by(cached_tokens);
    }

    /// The receipts kept: their bytes and their number.
    pub fn receipts(&self, bytes: u64, kept: u64) {
        self.receipts.bytes.set(gauge(bytes));
        self.receipts.kept.set(gauge(kept));
    }

    /// Counts a cache lookup, and whether it missed.
    pub fn cache_lookup(&self, cache: Cache, hit: bool) {
        let labels = CacheLabels {
            cache: cache.as_str(),
        };
        self.store.cache_lookups.get_or_create(&labels).inc();
        if !hit {
            self.store.cache_misses.get_or_create(&labels).inc();
        }
    }

    /// Counts an exchange that could not be stored.
    pub fn commit_failed(&self, kind: ReplyKind) {
        self.commits.failures.inc();
        if kind == ReplyKind::Stream {
            self.commits.stream_failures.inc();
        }
    }

    /// Counts a request the memory guard refused memory, what it got and why.
    pub fn admission_refused(&self, action: Refusal, reason: Pressure) {
        self.admission
            .refused
            .get_or_create(&RefusalLabels {
                action: action.as_str(),
                reason: reason.as_str(),
            })
            .inc();
    }

    /// Counts a request forwarded with memory off, and why.
    pub fn memory_off(&self, reason: &'static str) {
        self.admission
            .memory_off
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Counts conversations deleted by an operator.
    pub fn admin_deleted(&self, count: usize) {
        self.deletions.admin_deletions.inc_by(count as u64);
    }

    /// The scrape: OpenMetrics text, with the memory core's and the memory guard's gauges and
    /// counters read now (`memory` is `None` when the store could not be opened; only the edge's
    /// own figures are there then).
    pub fn render(&self, memory: Option<&Memory>, guard: &MemoryGuard) -> String {
        let _scrape = self
            .scrape
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.admission
            .resident
            .set(gauge(guard.resident_bytes().unwrap_or(0)));
        self.admission.budget.set(gauge(guard.budget().total));
        self.admission
            .high_water
            .set(gauge(guard.budget().high_water));
        self.admission.in_flight.set(gauge(guard.reserved_bytes()));
        self.admission.planning.set(gauge(guard.planning_bytes()));
        self.admission.waiting.set(gauge(guard.waiting()));
        let (admitted, refused) = guard.waited();
        for (result, count) in [("admitted", admitted), ("refused", refused)] {
            catch_up(
                &self
                    .admission
                    .waited
                    .get_or_create(&ResultLabels { result }),
                count,
            );
        }
        if let Some(held) = crate::allocator::held() {
            for (state, bytes) in [("in_use", held.in_use), ("free", held.free)] {
                self.admission
                    .allocator
                    .get_or_create(&AllocatorLabels { state })
                    .set(gauge(bytes));
            }
        }
        let relief = guard.relief();
        self.admission.pressure.set(relief.state() as i64);
        self.admission.store_share.set(gauge(relief.store_share()));
        self.admission
            .store_messages
            .set(gauge(relief.store_messages()));
        catch_up(&self.admission.shrinks, relief.shrinks());
        for cache in relief.caches() {
            let labels = CacheLabels {
                cache: cache.name(),
            };
            self.admission
                .cache_bytes
                .get_or_create(&labels)
                .set(gauge(cache.weighted_bytes()));
            self.admission
                .cache_limit
                .get_or_create(&labels)
                .set(gauge(cache.limit()));
            catch_up(
                &self.admission.cache_shrunk.get_or_create(&labels),
                cache.shrunk_bytes(),
            );
        }
        match memory {
            Some(memory) => self.mirror(memory),
            None => {
                self.store.up.set(0);
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
        self.store.up.set(i64::from(up));
        self.store.size.set(gauge(store.size_on_disk()));
        catch_up(&self.store.flushes, store.flushes());
        self.store
            .cached_conversations
            .set(gauge(store.cached_conversations()));
        self.store.recall_cache_bytes.set(gauge(
            memory.recall.weighted_size() + memory.longterm.weighted_size(),
        ));
        let (lookups, misses) = store.cache_counts();
        let labels = CacheLabels {
            cache: Cache::Conversation.as_str(),
        };
        catch_up(&self.store.cache_lookups.get_or_create(&labels), lookups);
        catch_up(&self.store.cache_misses.get_or_create(&labels), misses);
        let (lookups, misses) = memory.recall.cache_counts();
        let labels = CacheLabels {
            cache: Cache::Recall.as_str(),
        };
        catch_up(&self.store.cache_lookups.get_or_create(&labels), lookups);
        catch_up(&self.store.cache_misses.get_or_create(&labels), misses);
        // The sweeper and the summarizer keep their own counters; they are mirrored here.
        let sweeps = &memory.sweeps;
        catch_up(
            &self.deletions.ttl_passes,
            sweeps.passes.load(Ordering::Relaxed),
        );
        catch_up(
            &self.deletions.ttl_scanned,
            sweeps.scanned.load(Ordering::Relaxed),
        );
        catch_up(
            &self.deletions.ttl_deletions,
            sweeps.deleted.load(Ordering::Relaxed),
        );
        catch_up(
            &self.commits.branches_closed,
            memory.branches_closed.load(Ordering::Relaxed),
        );
        let counters = &memory.summarizer.counters;
        for (result, counter) in summary_results(counters) {
            catch_up(
                &self
                    .summaries
                    .results
                    .get_or_create(&ResultLabels { result }),
                counter.load(Ordering::Relaxed),
            );
        }
        catch_up(
            &self.summaries.input_tokens,
            counters.prompt_tokens.load(Ordering::Relaxed),
        );
        catch_up(
            &self.summaries.output_tokens,
            counters.completion_tokens.load(Ordering::Relaxed),
        );
        // The ledger's background side, per agent label; every label's series exists.
        for (agent, counters) in memory.ledger.labels() {
            let labels = AgentLabels {
                agent: agent.to_string(),
            };
            let _ = self.tokens.ledger_history.get_or_create(&labels);
            let _ = self.tokens.ledger_forwarded.get_or_create(&labels);
            let _ = self.tokens.ledger_cached.get_or_create(&labels);
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
                    &self.tokens.ledger_background.get_or_create(&labels),
                    tokens.load(Ordering::Relaxed),
                );
                catch_up(
                    &self
                        .tokens
                        .background_budget_exhausted
                        .get_or_create(&labels),
                    skipped.load(Ordering::Relaxed),
                );
            }
        }
        self.longterm
            .mirror(&memory.longterm.extractor.counters, catch_up);
        self.embedding.mirror(&memory.embedding, catch_up);
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
