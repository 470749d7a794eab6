//! What the HTTP edge shares (the server, the router, the admin API): the checked config, the
//! memory core, the upstream client, the metrics and the memory guard. Nothing below the edge
//! sees it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::Config;
use crate::memory::{self, Memory};
use crate::memory_guard::MemoryGuard;
use crate::metrics::Metrics;
use crate::store::{Store, StoreError};
use crate::ttl::Sweeper;
use crate::upstream::{Upstream, UpstreamSetupError};

/// Why memproxy could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot create the data directory {path}: {source}")]
    DataDir {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open the store: {0}")]
    Store(#[from] StoreError),
    #[error("cannot set up the upstream client: {0}")]
    Upstream(#[from] UpstreamSetupError),
}

#[derive(Debug)]
pub struct AppState {
    pub config: Arc<Config>,
    pub memory: Arc<Memory>,
    pub upstream: Upstream,
    /// The Prometheus registry (`GET /metrics`).
    pub metrics: Metrics,
    /// Admission against `server.memory_budget`.
    pub memory_guard: MemoryGuard,
    next_request: AtomicU64,
    /// Distinguishes request ids across restarts.
    boot: u64,
}

impl AppState {
    /// Must be called inside a tokio runtime: the summary worker starts here.
    pub fn new(config: Arc<Config>, store: Arc<Store>, upstream: Upstream) -> AppState {
        let boot = crate::store::now_ms() as u64 & 0xff_ffff;
        let memory = Memory::new(
            store,
            Arc::new(upstream.clone()),
            config.compression.clone(),
            config.recall_cache_bytes,
        );
        AppState {
            memory_guard: MemoryGuard::new(config.memory_budget),
            config,
            memory: Arc::new(memory),
            upstream,
            metrics: Metrics::new(),
            next_request: AtomicU64::new(1),
            boot,
        }
    }

    /// Opens the store (creating the data directory) and the upstream client for `config`.
    /// Must run inside a tokio runtime.
    pub fn build(config: Config) -> Result<Arc<AppState>, StartError> {
        std::fs::create_dir_all(&config.data_dir).map_err(|source| StartError::DataDir {
            path: config.data_dir.display().to_string(),
            source,
        })?;
        let store = Store::open(&config.data_dir, memory::store_options(&config))?;
        let upstream = Upstream::new(&config.upstream)?;
        Ok(Arc::new(AppState::new(
            Arc::new(config),
            Arc::new(store),
            upstream,
        )))
    }

    /// Starts the TTL sweeper over this state's memory.
    pub fn start_sweeper(&self) -> Sweeper {
        Sweeper::start(Arc::clone(&self.memory), Arc::clone(&self.config))
    }

    /// A fresh request id, unique within this process and unlikely to repeat across restarts.
    pub fn request_id(&self) -> String {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        format!("req-{:06x}-{n}", self.boot)
    }
}
