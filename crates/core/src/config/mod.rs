//! The checked configuration, and the one `load` that builds it.
//!
//! Loading is two steps: the TOML file is read into raw structs, one per section
//! (`document.rs`), then every value is checked and turned into [`Config`], one file per
//! section. Every problem is collected, so a bad file is reported whole, each problem with its
//! key: every unknown key of every section, every value of the wrong type, every bad setting.
//! Overrides from flags and the environment are passed in as [`Overrides`] (read by `main`),
//! and environment lookups go through a function the caller supplies, so tests never touch the
//! real environment.
//!
//! Order: built-in defaults ← config file ← overrides (`--flag` / `MEMPROXY_*`).
//!
//! Files: `document.rs` reads the TOML; `server.rs` (`[server]`, `[log]`), `upstream.rs`,
//! `auth.rs`, `storage.rs`, `admin.rs`, `sweeper.rs`, `limits.rs`, `mcp.rs`, `embedding.rs`, `compression.rs` (with the
//! built-in summary prompt), `receipts.rs` (`[receipts]`) and `agents.rs` (`[memory]`,
//! `[agents.NAME]`) each hold a section's
//! raw struct and its check; `memory_budget.rs` splits `server.memory_budget` into the cache sizes;
//! `values.rs` holds the checks they share (durations, counts, sizes, secrets). This
//! module imports only the leaves `settings` and `identity`: configuration is read by every
//! layer and depends on none of them.

mod admin;
mod agents;
mod auth;
mod compression;
mod document;
mod embedding;
mod limits;
mod mcp;
mod memory_budget;
mod receipts;
mod server;
mod storage;
mod sweeper;
mod upstream;
mod values;

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::settings::MemorySettings;

pub use admin::DEFAULT_ADMIN_TOKEN_ENV;
pub use agents::{AGENT_BUDGET_KEY, BackgroundBudget};
pub use auth::hash_key;
pub use compression::{
    CompressionConfig, DEFAULT_MAX_SUMMARY_TOKENS, DEFAULT_PROMPT, DEFAULT_SUMMARY_BACKOFF,
    DEFAULT_SUMMARY_CONCURRENCY, DEFAULT_SUMMARY_MAX_INPUT_TOKENS, DEFAULT_SUMMARY_QUEUE,
    DEFAULT_SUMMARY_TIMEOUT,
};
pub use embedding::{
    DEFAULT_EMBEDDING_QUEUE, DEFAULT_QUERY_TIMEOUT, EmbedderKind, EmbeddingConfig,
};
pub use limits::{DEFAULT_MAX_NEW_MESSAGES, DEFAULT_MAX_NEW_TOKENS, LimitsConfig};
pub use mcp::{DEFAULT_MCP_ALLOWED_HOSTS, McpConfig};
pub use memory_budget::{
    CONTEXTUAL_EMBEDDER_BYTES, MIN_MEMORY_BUDGET, MemoryBudget, PROCESS_BASE,
    STATIC_EMBEDDER_BYTES, STORE_BYTES_PER_MESSAGE, STORE_BYTES_PER_VECTOR, StoreGrowth,
    messages_on_disk, split as split_memory_budget,
};
pub use receipts::{DEFAULT_RECEIPT_RETENTION, ReceiptsConfig};
pub use server::{
    BLOCKING_THREADS_PAST_POOL, DEFAULT_BLOCKING_THREADS, DEFAULT_BODY_LIMIT_BYTES,
    DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_LISTEN,
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MEMORY_BUDGET, DEFAULT_MEMORY_WAIT,
    DEFAULT_RESPONSE_LIMIT_BYTES, DEFAULT_SHUTDOWN_GRACE, LogFormat, MAX_MEMORY_WAIT, RuntimeShape,
};
pub use storage::{
    Backend, DEFAULT_DATA_DIR, DEFAULT_FLUSH_INTERVAL, DEFAULT_REDIS_KEY_PREFIX, Durability,
    RedisConfig,
};
pub use sweeper::{
    DEFAULT_SWEEP_INTERVAL, DEFAULT_SWEEP_MAX_DELETED, DEFAULT_SWEEP_MAX_SCANNED, SweeperConfig,
};
pub use upstream::{
    AnthropicUpstream, BaseUrl, DEFAULT_ANTHROPIC_UPSTREAM, DEFAULT_ANTHROPIC_VERSION,
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_UPSTREAM, DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    DEFAULT_UPSTREAM_READ_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT, KeyHeader, UpstreamConfig,
};
pub use values::Secret;

use document::RawConfig;

pub const DEFAULT_CONFIG_PATH: &str = "config/memproxy.toml";

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub body_limit_bytes: usize,
    pub response_limit_bytes: usize,
    pub shutdown_grace: Duration,
    /// Threads serving requests; `None`: one per CPU the process may use.
    pub worker_threads: Option<usize>,
    /// Threads for blocking work, the store's calls above all (`server.blocking_threads`, or
    /// chosen with the store): tokio's blocking pool in each runtime holds at most these.
    pub blocking_threads: usize,
    /// How those threads are arranged (`server.runtime`).
    pub runtime: RuntimeShape,
    /// Time to send a whole request head (from the connection's start, or from the first byte
    /// of a later request); then the connection is closed.
    pub header_read_timeout: Duration,
    /// Time to send a body memproxy reads whole (then 408), and the longest pause between two
    /// frames of a body streamed through (then the upstream request is cut).
    pub body_read_timeout: Duration,
    /// How long a connection with no request in flight stays open.
    pub idle_timeout: Duration,
    /// Connections served at once; past it a new one is answered 503 and closed.
    pub max_connections: usize,
    /// `server.memory_budget` and its split: the cache sizes below are taken from it.
    pub memory_budget: MemoryBudget,
    /// How long a chat request short of room only for the requests in flight waits for it
    /// (`server.memory_wait`).
    pub memory_wait: Duration,
    pub upstream: UpstreamConfig,
    /// SHA-256 of each accepted client key; empty = any client may call.
    pub client_key_hashes: HashSet<[u8; 32]>,
    /// Requests with a conversation id but no credential get the shared tenant `anonymous`
    /// (`auth.allow_anonymous`); otherwise they are refused with a 401.
    pub allow_anonymous: bool,
    /// The storage engine: sled (default) or a shared Redis server.
    pub backend: Backend,
    pub data_dir: PathBuf,
    pub durability: Durability,
    /// sled's page cache (`storage.cache_bytes`, or its share of the budget).
    pub store_cache_bytes: u64,
    /// The conversation state cache (`storage.state_cache_bytes`, or its share).
    pub state_cache_bytes: u64,
    /// Memory for the cached recall indexes (`storage.recall_cache_bytes`, or its share).
    pub recall_cache_bytes: u64,
    pub log_format: LogFormat,
    pub allow_header_overrides: bool,
    /// `[memory]` over the built-in defaults: the profile of any agent not named below.
    pub memory: MemorySettings,
    /// `[agents.NAME]` over `[memory]`.
    pub agents: BTreeMap<String, MemorySettings>,
    /// The admin API's bearer token; `None`: the admin API is off (404).
    pub admin_token: Option<Secret>,
    /// `GET /metrics` requires the admin token too.
    pub protect_metrics: bool,
    pub sweeper: SweeperConfig,
    pub compression: CompressionConfig,
    /// What one request may add to memory.
    pub limits: LimitsConfig,
    /// The receipts of memory-on exchanges (`[receipts]`).
    pub receipts: ReceiptsConfig,
    /// The memory tools over MCP (`[mcp]`).
    pub mcp: McpConfig,
    /// Recall by meaning: the embedder (`[embedding]`).
    pub embedding: EmbeddingConfig,
    /// Tokens of background model calls (summaries, extraction) per UTC day:
    /// `compression.max_tokens_per_day` and each `[agents.NAME]`'s
    /// `compression_max_tokens_per_day` (`None`: no limit).
    pub background_budget: BackgroundBudget,
}

impl Config {
    /// The settings profile of `agent` before any header.
    pub fn profile(&self, agent: &str) -> &MemorySettings {
        self.agents.get(agent).unwrap_or(&self.memory)
    }

    /// Built-in defaults, with no file and no overrides.
    pub fn defaults() -> Result<Config, ConfigError> {
        load(&Overrides::default(), &|_| None)
    }
}

/// Values from flags and environment variables, which win over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub config_path: Option<PathBuf>,
    pub listen: Option<String>,
    pub upstream: Option<String>,
    pub data_dir: Option<PathBuf>,
    /// `--redis-url` / `MEMPROXY_REDIS_URL`: selects the Redis backend.
    pub redis_url: Option<String>,
    pub log_format: Option<String>,
}

/// Every problem found in the configuration, each naming its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .problems.join("\n  - "))]
pub struct ConfigError {
    pub problems: Vec<String>,
}

/// Loads the configuration: the file named by `overrides.config_path` (or
/// [`DEFAULT_CONFIG_PATH`] when it exists), then the overrides. `env` looks up environment
/// variables named in the file (the upstream key, client keys).
pub fn load(
    overrides: &Overrides,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    let text = match &overrides.config_path {
        Some(path) => Some(read_file(path)?),
        None if Path::new(DEFAULT_CONFIG_PATH).exists() => {
            Some(read_file(Path::new(DEFAULT_CONFIG_PATH))?)
        }
        None => None,
    };
    let (raw, problems) = match text {
        Some(text) => RawConfig::parse(&text)?,
        None => (RawConfig::default(), Vec::new()),
    };
    check(raw, problems, overrides, env)
}

/// Parses a config from TOML text (no file, no overrides): for tests and `check-config`.
pub fn from_toml(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let (raw, problems) = RawConfig::parse(text)?;
    check(raw, problems, &Overrides::default(), env)
}

fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|err| ConfigError {
        problems: vec![format!("cannot read config file {}: {err}", path.display())],
    })
}

/// Checks every section, adding to the `problems` found while reading the file.
fn check(
    raw: RawConfig,
    mut problems: Vec<String>,
    overrides: &Overrides,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    let server = server::check_server(raw.server, overrides.listen.clone(), &mut problems);
    let upstream =
        upstream::check_upstream(raw.upstream, overrides.upstream.clone(), env, &mut problems);
    let auth = auth::check_auth(raw.auth, env, &mut problems);
    let storage = storage::check_storage(
        raw.storage,
        overrides.data_dir.clone(),
        overrides.redis_url.clone(),
        env,
        &mut problems,
    );
    let engine = match storage.backend {
        storage::Backend::Sled | storage::Backend::Fjall => memory_budget::StoreResidence::Embedded,
        storage::Backend::Redis(_) => memory_budget::StoreResidence::Remote,
    };
    let embedding = embedding::check_embedding(raw.embedding, &mut problems);
    let mut memory_budget = memory_budget::check_budget(
        server.memory_budget,
        engine,
        memory_budget::Embedder {
            name: embedding.embedder.name(),
            resident: embedding.embedder.resident_bytes(),
            stores_vectors: embedding.embedder.stores_vectors(),
        },
        storage.caches,
        &mut problems,
    );
    let (mut receipts, receipts_bytes) = receipts::check_receipts(raw.receipts, &mut problems);
    memory_budget::apply_receipts(
        &mut memory_budget,
        &mut receipts,
        receipts_bytes,
        &mut problems,
    );
    let log_format = server::check_log(raw.log, overrides.log_format.clone(), &mut problems);
    let profiles = agents::check_profiles(raw.memory, &raw.agents, &mut problems);
    let admin = admin::check_admin(raw.admin, env, &mut problems);
    let sweeper = sweeper::check_sweeper(raw.sweeper, &mut problems);
    let compression = compression::check_compression(raw.compression, &mut problems);
    let limits = limits::check_limits(raw.limits, &mut problems);
    let mcp = mcp::check_mcp(raw.mcp, &mut problems);

    let background_budget = BackgroundBudget {
        default: compression.max_tokens_per_day,
        agents: profiles
            .agents
            .keys()
            .map(|name| {
                let own = profiles.max_tokens_per_day.get(name).copied();
                (name.clone(), own.or(compression.max_tokens_per_day))
            })
            .collect(),
    };

    if !problems.is_empty() {
        return Err(ConfigError { problems });
    }
    Ok(Config {
        listen: server.listen,
        body_limit_bytes: server.body_limit_bytes,
        response_limit_bytes: server.response_limit_bytes,
        shutdown_grace: server.shutdown_grace,
        worker_threads: server.worker_threads,
        blocking_threads: server
            .blocking_threads
            .unwrap_or_else(|| match &storage.backend {
                Backend::Redis(redis) => redis.pool_size + server::BLOCKING_THREADS_PAST_POOL,
                Backend::Sled | Backend::Fjall => server::DEFAULT_BLOCKING_THREADS,
            }),
        runtime: server.runtime,
        header_read_timeout: server.header_read_timeout,
        body_read_timeout: server.body_read_timeout,
        idle_timeout: server.idle_timeout,
        max_connections: server.max_connections,
        memory_budget,
        memory_wait: server.memory_wait,
        upstream,
        client_key_hashes: auth.client_key_hashes,
        allow_anonymous: auth.allow_anonymous,
        backend: storage.backend,
        data_dir: storage.data_dir,
        durability: storage.durability,
        store_cache_bytes: memory_budget.store_cache,
        state_cache_bytes: memory_budget.state_cache,
        recall_cache_bytes: memory_budget.recall_cache,
        log_format,
        allow_header_overrides: profiles.allow_header_overrides,
        memory: profiles.memory,
        agents: profiles.agents,
        admin_token: admin.token,
        protect_metrics: admin.protect_metrics,
        sweeper,
        compression,
        limits,
        receipts,
        mcp,
        embedding,
        background_budget,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    /// Checks that `text` is refused with a problem containing each of `needles`.
    fn assert_refused(text: &str, needles: &[&str]) -> ConfigError {
        let err = from_toml(text, &no_env).unwrap_err();
        let all = err.problems.join("\n");
        for needle in needles {
            assert!(all.contains(needle), "missing {needle} in:\n{all}");
        }
        err
    }

    #[test]
    fn blocking_threads_follow_the_store_unless_set() {
        let threads = |text: &str| from_toml(text, &no_env).unwrap().blocking_threads;
        assert_eq!(threads(""), DEFAULT_BLOCKING_THREADS);
        assert_eq!(
            threads("[storage]\nbackend = \"fjall\"\n"),
            DEFAULT_BLOCKING_THREADS
        );
        let redis = "[storage]\nbackend = \"redis\"\nredis_url = \"redis://127.0.0.1:1\"\n";
        assert_eq!(
            threads(&format!("{redis}redis_pool_size = 40\n")),
            40 + BLOCKING_THREADS_PAST_POOL
        );
        assert_eq!(
            threads(&format!("[server]\nblocking_threads = 3\n{redis}")),
            3
        );
        assert_eq!(
            threads("[server]\nblocking_threads = 0\n"),
            DEFAULT_BLOCKING_THREADS
        );
        assert_refused(
            "[server]\nblocking_threads = 5000\n",
            &["server.blocking_threads: 5000 is too many"],
        );
    }

    #[test]
    fn memory_wait_defaults_to_a_second_and_is_bounded() {
        let wait = |text: &str| from_toml(text, &no_env).unwrap().memory_wait;
        assert_eq!(wait(""), DEFAULT_MEMORY_WAIT);
        assert_eq!(DEFAULT_MEMORY_WAIT, Duration::from_secs(1));
        assert_eq!(wait("[server]\nmemory_wait = \"PT0S\"\n"), Duration::ZERO);
        assert_eq!(
            wait("[server]\nmemory_wait = \"PT0.25S\"\n"),
            Duration::from_millis(250)
        );
        assert_eq!(wait("[server]\nmemory_wait = \"PT1M\"\n"), MAX_MEMORY_WAIT);
        assert_refused(
            "[server]\nmemory_wait = \"PT61S\"\n",
            &["server.memory_wait: 61 s is too long (at most 60 s"],
        );
        assert_refused(
            "[server]\nmemory_wait = \"soon\"\n",
            &["server.memory_wait: `soon` is not an ISO-8601 duration"],
        );
    }

    #[test]
    fn defaults_match_the_documented_values() {
        let config = from_toml("", &no_env).unwrap();
        assert_eq!(config.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(config.upstream.base_url.to_string(), DEFAULT_UPSTREAM);
        assert_eq!(config.memory, MemorySettings::default());
        assert_eq!(config.durability, Durability::Commit);
        assert!(config.allow_header_overrides);
        assert!(config.upstream.api_key.is_none());
        assert!(!config.allow_anonymous);
        assert!(
            from_toml("[auth]\nallow_anonymous = true\n", &no_env)
                .unwrap()
                .allow_anonymous
        );
        assert_refused("[auth]\nallow_anonymous = \"yes\"\n", &["allow_anonymous"]);
    }

    #[test]
    fn agents_inherit_memory_and_override_it() {
        let text = r#"
            [memory]
            recent_n = 4
            compression_enabled = false
            [agents.support]
            recent_n = 20
            max_context_tokens = 8000
            compression_interval = "PT0S"
        "#;
        let config = from_toml(text, &no_env).unwrap();
        let support = config.profile("support");
        assert_eq!(support.recent_n, 20);
        assert!(!support.compression_enabled);
        assert_eq!(support.max_context_tokens, Some(8000));
        assert_eq!(support.compression_interval, Duration::ZERO);
        assert_eq!(config.profile("other").recent_n, 4);
    }

    #[test]
    fn every_problem_is_reported_with_its_key() {
        let text = r#"
            [server]
            listen = "nowhere"
            [upstream]
            base_url = "ftp://x/v1"
            api_key_env = "MISSING_KEY"
            [memory]
            recent_n = "ten"
            relevance_top_k = 50
            bogus = 1
            [agents."bad name"]
            persist = 3
        "#;
        assert_refused(
            text,
            &[
                "server.listen",
                "upstream.base_url",
                "upstream.api_key_env",
                "memory.recent_n",
                "memory.relevance_top_k",
                "memory.bogus: unknown setting",
                "agents.bad name: an agent name",
                "agents.bad name.persist",
            ],
        );
    }

    #[test]
    fn unknown_keys_in_sections_are_errors() {
        let err = from_toml("[server]\nlisten_port = 1\n", &no_env).unwrap_err();
        assert!(err.problems[0].contains("listen_port"), "{err}");
        let err = from_toml("[nope]\n", &no_env).unwrap_err();
        assert!(err.problems[0].contains("nope"), "{err}");
    }

    #[test]
    fn every_unknown_key_of_every_section_is_reported_with_its_path() {
        let text = r#"
            [server]
            foo = 1
            listen = "nowhere"
            [compression]
            timeout = "PT1M"
            retries = 3
            [agents.x]
            recent_n = 4
            bar = true
        "#;
        let err = assert_refused(
            text,
            &[
                "server.foo: unknown key",
                "compression.retries: unknown key",
                "agents.x.bar: unknown setting",
                // The known keys are checked too, in the same pass.
                "server.listen: `nowhere`",
            ],
        );
        assert_eq!(err.problems.len(), 4, "{err}");
    }

    #[test]
    fn keys_come_from_the_named_environment_variables() {
        let text = r#"
            [upstream]
            api_key_env = "UP_KEY"
            [auth]
            client_keys = ["k1"]
            client_keys_env = "MORE_KEYS"
        "#;
        let env = |name: &str| match name {
            "UP_KEY" => Some("sk-upstream".to_string()),
            "MORE_KEYS" => Some("k2, k3".to_string()),
            _ => None,
        };
        let config = from_toml(text, &env).unwrap();
        assert_eq!(config.upstream.api_key, Some(Secret("sk-upstream".into())));
        assert_eq!(config.client_key_hashes.len(), 3);
        assert!(config.client_key_hashes.contains(&hash_key("k3")));
        assert!(!format!("{config:?}").contains("sk-upstream"));
    }

    #[test]
    fn overrides_win_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.toml");
        std::fs::write(
            &path,
            "[server]\nlisten = \"127.0.0.1:1\"\n[log]\nformat = \"text\"\n",
        )
        .unwrap();
        let overrides = Overrides {
            config_path: Some(path),
            listen: Some("127.0.0.1:2".into()),
            upstream: Some("http://127.0.0.1:3/v1/".into()),
            data_dir: Some("/tmp/x".into()),
            redis_url: None,
            log_format: Some("json".into()),
        };
        let config = load(&overrides, &no_env).unwrap();
        assert_eq!(config.listen.port(), 2);
        assert_eq!(
            config.upstream.base_url.to_string(),
            "http://127.0.0.1:3/v1"
        );
        assert_eq!(config.data_dir, PathBuf::from("/tmp/x"));
        assert_eq!(config.log_format, LogFormat::Json);
    }

    #[test]
    fn the_anthropic_upstream_is_checked() {
        let err = from_toml(
            "[upstream.anthropic]\nbase_url = \"ftp://x\"\nversion = \"\"\n",
            &no_env,
        )
        .unwrap_err();
        let all = err.problems.join("\n");
        assert!(all.contains("upstream.anthropic.base_url"), "{all}");
        assert!(all.contains("upstream.anthropic.version"), "{all}");
        let err = from_toml("[upstream.anthropic]\nmodels = 1\n", &no_env).unwrap_err();
        assert!(err.problems.join("\n").contains("models"));
        let config = from_toml(
            "[upstream.anthropic]\nbase_url = \"http://127.0.0.1:9/\"\napi_key_env = \"ANT\"\n",
            &|name| (name == "ANT").then(|| "sk-ant".to_string()),
        )
        .unwrap();
        let anthropic = config.upstream.anthropic_upstream();
        assert_eq!(anthropic.base_url.to_string(), "http://127.0.0.1:9/v1");
        assert_eq!(anthropic.api_key, Some(Secret("sk-ant".into())));
        assert_eq!(anthropic.key_header, KeyHeader::XApiKey);
        assert_eq!(anthropic.timeout, config.upstream.timeout);
    }

    #[test]
    fn the_shipped_config_lists_every_setting_at_its_default() {
        let text = include_str!("../../../../config/memproxy.toml");
        let config = from_toml(text, &no_env).unwrap();
        assert_eq!(config.memory, MemorySettings::default());
        assert_eq!(config.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(config.body_limit_bytes, DEFAULT_BODY_LIMIT_BYTES);
        assert_default_time_limits(&config);
        assert_eq!(
            config.memory_budget,
            memory_budget::split_with(
                DEFAULT_MEMORY_BUDGET,
                memory_budget::StoreResidence::Embedded,
                STATIC_EMBEDDER_BYTES
            )
        );
        assert!(text.contains("\nmemory_budget = \"192MiB\"\n"));
        assert_eq!(config.runtime, RuntimeShape::default());
        assert!(text.contains("\n# runtime = \"per-thread\"\n"));
        assert!(config.receipts.enabled);
        assert_eq!(config.receipts.retention, DEFAULT_RECEIPT_RETENTION);
        assert_eq!(config.compression.max_tokens_per_day, None);
        let anthropic = &config.upstream.anthropic;
        assert_eq!(
            anthropic.base_url.to_string(),
            format!("{DEFAULT_ANTHROPIC_UPSTREAM}/v1")
        );
        assert_eq!(anthropic.version, DEFAULT_ANTHROPIC_VERSION);
        assert_eq!(anthropic.model_prefixes, ["claude"]);
        assert!(anthropic.api_key.is_none());
        for (name, _) in settings::SETTINGS {
            assert!(
                text.contains(&format!("\n{name} = ")),
                "{name} missing from config/memproxy.toml"
            );
        }
    }

    /// Checks the client and upstream time limits and the connection cap are the defaults.
    fn assert_default_time_limits(config: &Config) {
        assert_eq!(config.header_read_timeout, DEFAULT_HEADER_READ_TIMEOUT);
        assert_eq!(config.body_read_timeout, DEFAULT_BODY_READ_TIMEOUT);
        assert_eq!(config.idle_timeout, DEFAULT_IDLE_TIMEOUT);
        assert_eq!(config.max_connections, DEFAULT_MAX_CONNECTIONS);
        assert_eq!(config.upstream.timeout, DEFAULT_UPSTREAM_TIMEOUT);
        assert_eq!(config.upstream.read_timeout, DEFAULT_UPSTREAM_READ_TIMEOUT);
        assert_eq!(config.upstream.idle_timeout, DEFAULT_UPSTREAM_IDLE_TIMEOUT);
    }

    #[test]
    fn client_and_upstream_timeouts_default_and_are_checked() {
        assert_default_time_limits(&from_toml("", &no_env).unwrap());

        let set = from_toml(
            "[server]\nheader_read_timeout = \"PT1S\"\nbody_read_timeout = \"PT2S\"\nidle_timeout = \"PT0.5S\"\nmax_connections = 2\n[upstream]\nread_timeout = \"PT3S\"\nidle_timeout = \"PT4S\"\n",
            &no_env,
        )
        .unwrap();
        assert_eq!(set.header_read_timeout, Duration::from_secs(1));
        assert_eq!(set.body_read_timeout, Duration::from_secs(2));
        assert_eq!(set.idle_timeout, Duration::from_millis(500));
        assert_eq!(set.max_connections, 2);
        assert_eq!(set.upstream.read_timeout, Duration::from_secs(3));
        assert_eq!(set.upstream.idle_timeout, Duration::from_secs(4));

        let text = r#"
            [server]
            header_read_timeout = "PT0S"
            body_read_timeout = "soon"
            idle_timeout = "PT0S"
            max_connections = 0
            [upstream]
            read_timeout = "PT0S"
            idle_timeout = "later"
        "#;
        let err = assert_refused(
            text,
            &[
                "server.header_read_timeout: must be longer than zero",
                "server.body_read_timeout: `soon`",
                "server.idle_timeout: must be longer than zero",
                "server.max_connections: must be at least 1",
                "upstream.read_timeout: must be longer than zero",
                "upstream.idle_timeout: `later`",
            ],
        );
        assert_eq!(err.problems.len(), 6, "{err}");
        assert_refused(
            "[server]\nmax_connections = 2000000\n",
            &["server.max_connections: 2000000 is too many"],
        );
    }

    #[test]
    fn the_caches_take_their_shares_of_the_memory_budget() {
        const MIB: u64 = 1024 * 1024;
        let config = from_toml("[embedding]\nembedder = \"off\"\n", &no_env).unwrap();
        assert_eq!(config.memory_budget.total, DEFAULT_MEMORY_BUDGET);
        assert_eq!(
            (
                config.state_cache_bytes,
                config.store_cache_bytes,
                config.recall_cache_bytes
            ),
            (16 * MIB, 16 * MIB, 32 * MIB)
        );
        // The default static embedder's 17 MiB come first: eighths of 111 MiB.
        let config = from_toml("", &no_env).unwrap();
        let eighth = 111 * MIB / 8;
        assert_eq!(
            (
                config.memory_budget.embedder,
                config.state_cache_bytes,
                config.store_cache_bytes,
                config.recall_cache_bytes
            ),
            (17 * MIB, eighth, eighth, 2 * eighth)
        );

        let config = from_toml(
            "[server]\nmemory_budget = \"320MiB\"\n[storage]\nrecall_cache_bytes = \"64MiB\"\n[embedding]\nembedder = \"off\"\n",
            &no_env,
        )
        .unwrap();
        assert_eq!(config.memory_budget.high_water, 288 * MIB);
        assert_eq!(
            (
                config.state_cache_bytes,
                config.store_cache_bytes,
                config.recall_cache_bytes
            ),
            (32 * MIB, 32 * MIB, 64 * MIB)
        );
        assert_eq!(
            from_toml("[server]\nmemory_budget = 268435456\n", &no_env)
                .unwrap()
                .memory_budget
                .total,
            256 * MIB
        );

        // The sizes earlier versions shipped, under the default budget: refused, with the
        // other problems of the file.
        let err = assert_refused(
            "[server]\nmemory_budget = \"lots\"\n[storage]\ncache_bytes = 67108864\nstate_cache_bytes = 67108864\nrecall_cache_bytes = 268435456\n",
            &[
                "server.memory_budget: `lots` is not a size",
                "storage: the caches take 384 MiB",
            ],
        );
        assert_eq!(err.problems.len(), 2, "{err}");
        assert_refused(
            "[server]\nmemory_budget = \"64MiB\"\n",
            &[
                "server.memory_budget: 64 MiB is too small: at least 113 MiB (the process itself takes about 64 MiB and the static embedder 17 MiB; or set [embedding] embedder = \"off\" or \"upstream\")",
            ],
        );
    }

    #[test]
    fn interval_durability_parses() {
        let config = from_toml(
            "[storage]\ndurability = \"interval\"\nflush_interval = \"PT5M\"\n",
            &no_env,
        )
        .unwrap();
        assert_eq!(
            config.durability,
            Durability::Interval(Duration::from_secs(300))
        );
    }
}
