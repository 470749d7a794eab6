//! What the HTTP edge shares (the server, the router, the admin API): the checked config, the
//! memory core, the upstream clients (OpenAI-compatible and Anthropic), the Responses ids, the metrics and the memory guard. Nothing below the edge
//! sees it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{Backend, Config};
use crate::memory::{self, Erased, Memory};
use crate::memory_guard::MemoryGuard;
use crate::metrics::Metrics;
use crate::models::Models;
use crate::receipts::Receipts;
use crate::store::{Clock, Embedded, Store};
use crate::ttl::Sweeper;
use crate::upstream::{Upstream, UpstreamSetupError};
use crate::wire::Api;

/// Why memproxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot set up the upstream client: {0}")]
    Upstream(#[from] UpstreamSetupError),
}

/// Why memory is off for the whole process: the store could not be opened, or failed its
/// first read, at start (`store/health.rs`). Memproxy serves on without it (chat requests go
/// upstream with the client's own messages and `X-Memory-Status: degraded`); the reason is in
/// `/readyz` and logged once at warn level. It is not retried: a damaged store does not heal;
/// restart once it is repaired (`memproxy store check`, `memproxy store repair`) or the cause
/// (permissions, space) is gone.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{reason}")]
pub struct StoreUnavailable {
    /// What failed, without secrets or message text.
    pub reason: String,
}

#[derive(Debug)]
pub struct AppState {
    pub config: Arc<Config>,
    /// The memory core, or why there is none.
    pub memory: Result<Arc<Memory>, StoreUnavailable>,
    pub upstream: Upstream,
    /// The Anthropic Messages API's upstream (`[upstream.anthropic]`).
    pub anthropic: Upstream,
    /// The Prometheus registry (`GET /metrics`).
    pub metrics: Metrics,
    /// Admission against `server.memory_budget`.
    pub memory_guard: MemoryGuard,
    /// The receipts of recent memory-on exchanges (`[receipts]`).
    pub receipts: Receipts,
    /// The one clock: the store's when there is one (`Memory::clock`), else one of its own.
    pub clock: Arc<Clock>,
    next_request: AtomicU64,
    /// Distinguishes request ids across restarts.
    boot: u64,
}

impl AppState {
    /// Must be called inside a tokio runtime: the summary worker starts here (when there is a
    /// store).
    pub fn new(
        config: Arc<Config>,
        store: Result<Arc<Store>, StoreUnavailable>,
        upstream: Upstream,
    ) -> AppState {
        // `build` checks this client can be made before it gets here.
        let anthropic = Upstream::new(&config.upstream.anthropic_upstream()).unwrap_or_else(|err| {
            tracing::warn!(error = %err, "the Anthropic upstream client could not be set up; /v1/messages goes to [upstream]");
            upstream.clone()
        });
        AppState::with_upstreams(config, store, upstream, anthropic)
    }

    /// [`AppState::new`] with the Anthropic upstream's client given.
    pub fn with_upstreams(
        config: Arc<Config>,
        store: Result<Arc<Store>, StoreUnavailable>,
        upstream: Upstream,
        anthropic: Upstream,
    ) -> AppState {
        let clock = store
            .as_ref()
            .map_or_else(|_| Arc::default(), |store| Arc::clone(store.clock()));
        let boot = clock.now_ms() as u64 & 0xff_ffff;
        let memory = store.map(|store| {
            Arc::new(Memory::new(
                store,
                Arc::new(Models::new(
                    upstream.clone(),
                    anthropic.clone(),
                    &config.upstream,
                )),
                config.compression.clone(),
                config.recall_cache_bytes,
                Arc::new(crate::ledger::Ledger::new(config.background_budget.clone())),
                crate::embedding::Embedding::new(
                    crate::embedder::load(&config, &upstream),
                    config.embedding.query_timeout,
                    config.embedding.queue,
                ),
            ))
        });
        let receipts = Receipts::new(&config.receipts);
        if let Ok(memory) = &memory {
            // Whoever deletes a conversation (an operator, a user or tenant delete, the TTL
            // sweeper), its receipts go with it.
            let told = receipts.clone();
            memory.on_delete.set(move |erased| match erased {
                Erased::Conversation(key) => told.forget_conversation(key),
                Erased::Tenant(tenant) => told.forget_tenant(tenant),
            });
        }
        let memory_guard = MemoryGuard::new(config.memory_budget);
        let mut caches = memory.as_ref().map(|m| m.caches()).unwrap_or_default();
        caches.push(Arc::new(receipts.clone()));
        // An embedded store's messages are counted; sled's memory grows with them, fjall's
        // caches bound its own. Redis keeps it in another process, written by every replica.
        let embedded = !matches!(config.backend, Backend::Redis(_));
        let stored = memory.as_ref().ok().filter(|_| embedded).map(|m| {
            let store = Arc::clone(&m.store);
            crate::memory_guard::Stored {
                count: Box::new(move || store.stored_messages()),
                grows: matches!(config.backend, Backend::Sled),
            }
        });
        memory_guard.watch(caches, stored);
        AppState {
            memory_guard,
            receipts,
            clock,
            config,
            memory,
            upstream,
            anthropic,
            metrics: Metrics::new(),
            next_request: AtomicU64::new(1),
            boot,
        }
    }

    /// Opens the store (creating the data directory) and the upstream client for `config`. A
    /// store that cannot be opened is no error: memproxy then runs without memory (see
    /// [`StoreUnavailable`]). Must run inside a tokio runtime.
    pub fn build(config: Config) -> Result<Arc<AppState>, StartError> {
        let store = open_store(&config);
        if let Err(unavailable) = &store {
            tracing::warn!(
                reason = %unavailable,
                "memory is off: the store could not be opened; requests go upstream with their own messages (X-Memory-Status: degraded) and /readyz answers 503 until memproxy is restarted on a working store"
            );
        }
        let upstream = Upstream::new(&config.upstream)?;
        let anthropic = Upstream::new(&config.upstream.anthropic_upstream())?;
        Ok(Arc::new(AppState::with_upstreams(
            Arc::new(config),
            store,
            upstream,
            anthropic,
        )))
    }

    /// The memory core, when the store opened.
    /// Why memory cannot serve now, or `None` when it can: no store since the start, or the
    /// store's own reason (writes failing, and then retried here: readiness drives the retry).
    /// Run on the blocking pool, as a store check may block.
    pub async fn memory_unready_reason(&self) -> Option<String> {
        match &self.memory {
            Err(unavailable) => Some(format!("memory is off: {unavailable}")),
            Ok(memory) => {
                let memory = Arc::clone(memory);
                tokio::task::spawn_blocking(move || {
                    // A failure is in the reason below.
                    let _ = memory.writable();
                    memory.store.unready_reason()
                })
                .await
                .unwrap_or_else(|_| Some("the store check failed".to_string()))
            }
        }
    }

    pub fn memory(&self) -> Option<&Arc<Memory>> {
        self.memory.as_ref().ok()
    }

    /// Starts the TTL sweeper over this state's memory (none without a store).
    pub fn start_sweeper(&self) -> Option<Sweeper> {
        let memory = self.memory()?;
        Some(Sweeper::start(Arc::clone(memory), Arc::clone(&self.config)))
    }

    /// The upstream requests of `api` go to.
    pub fn upstream_for(&self, api: Api) -> &Upstream {
        match api {
            Api::Anthropic => &self.anthropic,
            Api::Chat | Api::Responses => &self.upstream,
        }
    }

    /// The upstream a pass-through request goes to: the Anthropic one for `/v1/messages...`
    /// and for `/v1/models...` asked with `anthropic-version`, else the OpenAI-compatible one.
    pub fn upstream_for_path(&self, api_path: &str, headers: &http::HeaderMap) -> &Upstream {
        let messages = api_path == "/v1/messages" || api_path.starts_with("/v1/messages/");
        let models = (api_path == "/v1/models" || api_path.starts_with("/v1/models/"))
            && headers.contains_key("anthropic-version");
        if messages || models {
            &self.anthropic
        } else {
            &self.upstream
        }
    }

    /// A fresh request id, unique within this process and unlikely to repeat across restarts.
    pub fn request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("req-{:06x}-{n}", self.boot)
    }
}

/// The store under `config.data_dir`, created if missing, or why it cannot be used.
fn open_store(config: &Config) -> Result<Arc<Store>, StoreUnavailable> {
    let unavailable = |reason: String| StoreUnavailable { reason };
    if let Backend::Redis(redis) = &config.backend {
        return Store::open_redis(
            &memory::redis_options(redis),
            &config.data_dir,
            memory::store_options(config),
        )
        .map(Arc::new)
        .map_err(|err| unavailable(format!("the Redis store could not be set up: {err}")));
    }
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|err| unavailable(format!("cannot create the data directory: {err}")))?;
    let engine = config.backend.embedded().unwrap_or(Embedded::Sled);
    Store::open_embedded(&config.data_dir, engine, memory::store_options(config))
        .map(Arc::new)
        .map_err(|err| unavailable(format!("the store could not be opened: {err}")))
}
