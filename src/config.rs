//! The checked configuration, and the one `load` that builds it.
//!
//! Loading is two steps: the TOML file is read into raw structs that refuse unknown keys, then
//! every value is checked and turned into [`Config`]. Every problem is collected, so a bad file
//! is reported whole, each problem with its key. Overrides from flags and the environment are
//! passed in as [`Overrides`] (read by `main`), and environment lookups go through a function
//! the caller supplies, so tests never touch the real environment.
//!
//! Order: built-in defaults ← config file ← overrides (`--flag` / `MEMPROXY_*`).

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::identity::is_valid_id;
use crate::settings::{self, MemorySettings, parse_iso8601_duration};

pub const DEFAULT_CONFIG_PATH: &str = "config/memproxy.toml";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_UPSTREAM: &str = "https://api.openai.com/v1";
pub const DEFAULT_DATA_DIR: &str = "./data";
pub const DEFAULT_BODY_LIMIT_BYTES: usize = 32 * 1024 * 1024;
/// The largest upstream JSON (non-streaming) chat response memproxy reads to capture a reply.
pub const DEFAULT_RESPONSE_LIMIT_BYTES: usize = 64 * 1024 * 1024;
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(600);
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_secs(1);
pub const DEFAULT_STORE_CACHE_BYTES: u64 = 64 * 1024 * 1024;
pub const DEFAULT_STATE_CACHE_BYTES: u64 = 64 * 1024 * 1024;
pub const DEFAULT_RECALL_CACHE_BYTES: u64 = 256 * 1024 * 1024;
/// The environment variable holding the admin token when `admin.token_env` names none.
pub const DEFAULT_ADMIN_TOKEN_ENV: &str = "MEMPROXY_ADMIN_TOKEN";
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(60);
pub const DEFAULT_SWEEP_MAX_SCANNED: usize = 1000;
pub const DEFAULT_SWEEP_MAX_DELETED: usize = 100;

/// A secret string whose `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// When a commit reaches the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Each commit is flushed before the client sees the end of the response; concurrent
    /// commits share one flush (group commit).
    Commit,
    /// The store is flushed on this interval; a crash can lose the commits of the last one.
    Interval(Duration),
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// The base URL including its version path, like an SDK's `base_url`.
    pub base_url: http::Uri,
    /// The key memproxy sends instead of the client's `Authorization`, when configured.
    pub api_key: Option<Secret>,
    pub connect_timeout: Duration,
    /// How long to wait for the upstream's response head.
    pub timeout: Duration,
}

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub body_limit_bytes: usize,
    pub response_limit_bytes: usize,
    pub shutdown_grace: Duration,
    /// Threads serving requests; `None`: one per CPU the process may use.
    pub worker_threads: Option<usize>,
    pub upstream: UpstreamConfig,
    /// SHA-256 of each accepted client key; empty = any client may call.
    pub client_key_hashes: HashSet<[u8; 32]>,
    pub data_dir: PathBuf,
    pub durability: Durability,
    pub store_cache_bytes: u64,
    pub state_cache_bytes: u64,
    /// Memory for the cached recall indexes.
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
}

/// How summaries are made (the compression stage).
#[derive(Debug, Clone)]
pub struct CompressionConfig {
    /// The prompt template, with `{prev_summary}` and `{messages_joined}`.
    pub prompt: String,
    /// Longest wait for one summary call.
    pub timeout: Duration,
    /// Summary calls running at once.
    pub concurrency: usize,
    /// Jobs waiting, at most; past it new jobs are dropped (and counted).
    pub queue_capacity: usize,
    /// Wait after a failed summary before the conversation is tried again (doubles per failure,
    /// up to 16 times).
    pub retry_backoff: Duration,
    /// Tokens of new messages one summary call reads at most; a larger backlog is summarized
    /// over several calls, oldest first, so no call overflows the model's context.
    pub max_input_tokens: u64,
    /// Longest summary kept (tokens); the prompt asks for it through `{max_summary_tokens}`
    /// and a longer answer is cut to it. Bounds what every later prompt carries.
    pub max_summary_tokens: u32,
}

pub const DEFAULT_SUMMARY_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_SUMMARY_CONCURRENCY: usize = 2;
pub const DEFAULT_SUMMARY_QUEUE: usize = 256;
pub const DEFAULT_SUMMARY_BACKOFF: Duration = Duration::from_secs(60);
pub const DEFAULT_SUMMARY_MAX_INPUT_TOKENS: u64 = 16_384;
pub const DEFAULT_MAX_SUMMARY_TOKENS: u32 = 1024;

/// The TTL sweeper's pace: one pass per `interval`, each bounded in work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweeperConfig {
    pub interval: Duration,
    /// Conversations looked at per pass, at most.
    pub max_scanned: usize,
    /// Conversations deleted per pass, at most.
    pub max_deleted: usize,
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
    pub log_format: Option<String>,
}

/// Every problem found in the configuration, each naming its key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n  - {}", .problems.join("\n  - "))]
pub struct ConfigError {
    pub problems: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: RawServer,
    #[serde(default)]
    upstream: RawUpstream,
    #[serde(default)]
    auth: RawAuth,
    #[serde(default)]
    storage: RawStorage,
    #[serde(default)]
    log: RawLog,
    #[serde(default)]
    admin: RawAdmin,
    #[serde(default)]
    sweeper: RawSweeper,
    #[serde(default)]
    compression: RawCompression,
    #[serde(default)]
    memory: toml::Table,
    #[serde(default)]
    agents: BTreeMap<String, toml::Table>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCompression {
    prompt: Option<String>,
    prompt_file: Option<String>,
    timeout: Option<String>,
    concurrency: Option<u64>,
    queue_capacity: Option<u64>,
    retry_backoff: Option<String>,
    max_input_tokens: Option<u64>,
    max_summary_tokens: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: Option<String>,
    body_limit_bytes: Option<u64>,
    response_limit_bytes: Option<u64>,
    shutdown_grace: Option<String>,
    worker_threads: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    base_url: Option<String>,
    api_key_env: Option<String>,
    connect_timeout: Option<String>,
    timeout: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    #[serde(default)]
    client_keys: Vec<String>,
    client_keys_env: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStorage {
    data_dir: Option<String>,
    durability: Option<String>,
    flush_interval: Option<String>,
    cache_bytes: Option<u64>,
    state_cache_bytes: Option<u64>,
    recall_cache_bytes: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLog {
    format: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    token_env: Option<String>,
    protect_metrics: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSweeper {
    interval: Option<String>,
    max_scanned: Option<u64>,
    max_deleted: Option<u64>,
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
    let raw: RawConfig = match text {
        Some(text) => toml::from_str(&text).map_err(|err| ConfigError {
            problems: vec![err.to_string().trim().replace('\n', " ")],
        })?,
        None => RawConfig::default(),
    };
    check(raw, overrides, env)
}

/// Parses a config from TOML text (no file, no overrides): for tests and `check-config`.
pub fn from_toml(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let raw: RawConfig = toml::from_str(text).map_err(|err| ConfigError {
        problems: vec![err.to_string().trim().replace('\n', " ")],
    })?;
    check(raw, &Overrides::default(), env)
}

fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|err| ConfigError {
        problems: vec![format!("cannot read config file {}: {err}", path.display())],
    })
}

fn check(
    raw: RawConfig,
    overrides: &Overrides,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Config, ConfigError> {
    let mut problems = Vec::new();

    let listen_text = overrides
        .listen
        .clone()
        .or(raw.server.listen)
        .unwrap_or_else(|| DEFAULT_LISTEN.to_string());
    let listen = listen_text.parse::<SocketAddr>().unwrap_or_else(|_| {
        problems.push(format!(
            "server.listen: `{listen_text}` is not an address such as 127.0.0.1:8080"
        ));
        SocketAddr::from(([127, 0, 0, 1], 8080))
    });

    let body_limit_bytes = raw
        .server
        .body_limit_bytes
        .map_or(DEFAULT_BODY_LIMIT_BYTES, |n| n as usize);
    if body_limit_bytes == 0 {
        problems.push("server.body_limit_bytes: must be at least 1".to_string());
    }
    let response_limit_bytes = raw
        .server
        .response_limit_bytes
        .map_or(DEFAULT_RESPONSE_LIMIT_BYTES, |n| n as usize);
    let shutdown_grace = duration(
        "server.shutdown_grace",
        raw.server.shutdown_grace,
        DEFAULT_SHUTDOWN_GRACE,
        &mut problems,
    );
    let worker_threads = match raw.server.worker_threads {
        None | Some(0) => None,
        Some(n @ 1..=1024) => Some(n as usize),
        Some(n) => {
            problems.push(format!(
                "server.worker_threads: {n} is too many (0 = one per CPU, at most 1024)"
            ));
            None
        }
    };

    let base_text = overrides
        .upstream
        .clone()
        .or(raw.upstream.base_url)
        .unwrap_or_else(|| DEFAULT_UPSTREAM.to_string());
    let base_url = parse_base_url(&base_text).unwrap_or_else(|why| {
        problems.push(format!("upstream.base_url: `{base_text}` {why}"));
        http::Uri::from_static(DEFAULT_UPSTREAM)
    });
    let api_key = match raw.upstream.api_key_env.filter(|name| !name.is_empty()) {
        None => None,
        Some(name) => match env(&name).filter(|v| !v.trim().is_empty()) {
            Some(value) => Some(Secret(value.trim().to_string())),
            None => {
                problems.push(format!(
                    "upstream.api_key_env: environment variable `{name}` is not set or empty"
                ));
                None
            }
        },
    };
    let connect_timeout = duration(
        "upstream.connect_timeout",
        raw.upstream.connect_timeout,
        DEFAULT_CONNECT_TIMEOUT,
        &mut problems,
    );
    let timeout = duration(
        "upstream.timeout",
        raw.upstream.timeout,
        DEFAULT_UPSTREAM_TIMEOUT,
        &mut problems,
    );

    let mut client_keys = raw.auth.client_keys;
    if let Some(name) = raw.auth.client_keys_env.filter(|n| !n.is_empty()) {
        match env(&name) {
            Some(value) => client_keys.extend(value.split(',').map(|k| k.trim().to_string())),
            None => problems.push(format!(
                "auth.client_keys_env: environment variable `{name}` is not set"
            )),
        }
    }
    let mut client_key_hashes = HashSet::new();
    for (i, key) in client_keys.iter().enumerate() {
        if key.is_empty() {
            problems.push(format!("auth.client_keys[{i}]: a key must not be empty"));
        } else {
            client_key_hashes.insert(hash_key(key));
        }
    }

    let data_dir = overrides
        .data_dir
        .clone()
        .or(raw.storage.data_dir.map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let durability = match raw.storage.durability.as_deref().unwrap_or("commit") {
        "commit" => {
            if raw.storage.flush_interval.is_some() {
                problems.push(
                    "storage.flush_interval: only used with storage.durability = \"interval\""
                        .to_string(),
                );
            }
            Durability::Commit
        }
        "interval" => {
            let every = duration(
                "storage.flush_interval",
                raw.storage.flush_interval,
                DEFAULT_FLUSH_INTERVAL,
                &mut problems,
            );
            if every.is_zero() {
                problems.push("storage.flush_interval: must be longer than zero".to_string());
            }
            Durability::Interval(every)
        }
        other => {
            problems.push(format!(
                "storage.durability: `{other}` must be \"commit\" or \"interval\""
            ));
            Durability::Commit
        }
    };
    let store_cache_bytes = raw.storage.cache_bytes.unwrap_or(DEFAULT_STORE_CACHE_BYTES);
    let state_cache_bytes = raw
        .storage
        .state_cache_bytes
        .unwrap_or(DEFAULT_STATE_CACHE_BYTES);

    let recall_cache_bytes = raw
        .storage
        .recall_cache_bytes
        .unwrap_or(DEFAULT_RECALL_CACHE_BYTES);

    let format_text = overrides
        .log_format
        .clone()
        .or(raw.log.format)
        .unwrap_or_else(|| "text".to_string());
    let log_format = match format_text.as_str() {
        "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => {
            problems.push(format!(
                "log.format: `{other}` must be \"text\" or \"json\""
            ));
            LogFormat::Text
        }
    };

    let mut memory_table = raw.memory;
    let allow_header_overrides = match memory_table.remove("allow_header_overrides") {
        None => true,
        Some(toml::Value::Boolean(b)) => b,
        Some(other) => {
            problems.push(format!(
                "memory.allow_header_overrides: must be `true` or `false`, got {other}"
            ));
            true
        }
    };
    let memory = apply_table(
        MemorySettings::default(),
        &memory_table,
        "memory",
        &mut problems,
    );
    let mut agents = BTreeMap::new();
    for (name, table) in &raw.agents {
        if !is_valid_id(name) {
            problems.push(format!(
                "agents.{name}: an agent name is 1-128 characters from A-Za-z0-9._:@-"
            ));
        }
        let profile = apply_table(
            memory.clone(),
            table,
            &format!("agents.{name}"),
            &mut problems,
        );
        agents.insert(name.clone(), profile);
    }

    // The admin token: from the named variable (which must then be set), else from
    // MEMPROXY_ADMIN_TOKEN when it is set; none means the admin API is off.
    let token_env_named = raw
        .admin
        .token_env
        .as_deref()
        .is_some_and(|n| !n.is_empty());
    let admin_token = match raw.admin.token_env.filter(|name| !name.is_empty()) {
        Some(name) => match env(&name).filter(|v| !v.trim().is_empty()) {
            Some(value) => Some(Secret(value.trim().to_string())),
            None => {
                problems.push(format!(
                    "admin.token_env: environment variable `{name}` is not set or empty"
                ));
                None
            }
        },
        None => env(DEFAULT_ADMIN_TOKEN_ENV)
            .filter(|v| !v.trim().is_empty())
            .map(|v| Secret(v.trim().to_string())),
    };
    let protect_metrics = raw.admin.protect_metrics.unwrap_or(false);
    if protect_metrics && admin_token.is_none() && !token_env_named {
        problems.push(format!(
            "admin.protect_metrics: needs an admin token ({DEFAULT_ADMIN_TOKEN_ENV} or admin.token_env)"
        ));
    }
    let sweep_interval = duration(
        "sweeper.interval",
        raw.sweeper.interval,
        DEFAULT_SWEEP_INTERVAL,
        &mut problems,
    );
    if sweep_interval.is_zero() {
        problems.push("sweeper.interval: must be longer than zero".to_string());
    }
    let mut sweep_limit = |key: &str, value: Option<u64>, default: usize| match value {
        None => default,
        Some(0) => {
            problems.push(format!("sweeper.{key}: must be at least 1"));
            default
        }
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
    };
    let sweeper = SweeperConfig {
        interval: sweep_interval,
        max_scanned: sweep_limit(
            "max_scanned",
            raw.sweeper.max_scanned,
            DEFAULT_SWEEP_MAX_SCANNED,
        ),
        max_deleted: sweep_limit(
            "max_deleted",
            raw.sweeper.max_deleted,
            DEFAULT_SWEEP_MAX_DELETED,
        ),
    };

    let compression = check_compression(raw.compression, &mut problems);

    if !problems.is_empty() {
        return Err(ConfigError { problems });
    }
    Ok(Config {
        listen,
        body_limit_bytes,
        response_limit_bytes,
        shutdown_grace,
        worker_threads,
        upstream: UpstreamConfig {
            base_url,
            api_key,
            connect_timeout,
            timeout,
        },
        client_key_hashes,
        data_dir,
        durability,
        store_cache_bytes,
        state_cache_bytes,
        recall_cache_bytes,
        log_format,
        allow_header_overrides,
        memory,
        agents,
        admin_token,
        protect_metrics,
        sweeper,
        compression,
    })
}

fn check_compression(raw: RawCompression, problems: &mut Vec<String>) -> CompressionConfig {
    let prompt = match (raw.prompt, raw.prompt_file) {
        (Some(_), Some(_)) => {
            problems.push(
                "compression.prompt_file: set either prompt or prompt_file, not both".to_string(),
            );
            crate::summary::DEFAULT_PROMPT.to_string()
        }
        (Some(prompt), None) => prompt,
        (None, Some(path)) => std::fs::read_to_string(&path).unwrap_or_else(|err| {
            problems.push(format!(
                "compression.prompt_file: cannot read {path}: {err}"
            ));
            crate::summary::DEFAULT_PROMPT.to_string()
        }),
        (None, None) => crate::summary::DEFAULT_PROMPT.to_string(),
    };
    for placeholder in ["{prev_summary}", "{messages_joined}"] {
        if !prompt.contains(placeholder) {
            problems.push(format!(
                "compression.prompt: the template must contain {placeholder}"
            ));
        }
    }
    let count =
        |key: &str, value: Option<u64>, default: usize, problems: &mut Vec<String>| match value {
            None => default,
            Some(0) => {
                problems.push(format!("compression.{key}: must be at least 1"));
                default
            }
            Some(n) => n as usize,
        };
    CompressionConfig {
        prompt,
        timeout: duration(
            "compression.timeout",
            raw.timeout,
            DEFAULT_SUMMARY_TIMEOUT,
            problems,
        ),
        concurrency: count(
            "concurrency",
            raw.concurrency,
            DEFAULT_SUMMARY_CONCURRENCY,
            problems,
        ),
        queue_capacity: count(
            "queue_capacity",
            raw.queue_capacity,
            DEFAULT_SUMMARY_QUEUE,
            problems,
        ),
        retry_backoff: duration(
            "compression.retry_backoff",
            raw.retry_backoff,
            DEFAULT_SUMMARY_BACKOFF,
            problems,
        ),
        max_input_tokens: count(
            "max_input_tokens",
            raw.max_input_tokens,
            DEFAULT_SUMMARY_MAX_INPUT_TOKENS as usize,
            problems,
        ) as u64,
        max_summary_tokens: u32::try_from(count(
            "max_summary_tokens",
            raw.max_summary_tokens,
            DEFAULT_MAX_SUMMARY_TOKENS as usize,
            problems,
        ))
        .unwrap_or(u32::MAX),
    }
}

/// SHA-256 of a client key: keys are compared as hashes, so the comparison's timing says
/// nothing about the key.
pub fn hash_key(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

fn duration(
    key: &str,
    value: Option<String>,
    default: Duration,
    problems: &mut Vec<String>,
) -> Duration {
    match value {
        None => default,
        Some(text) => parse_iso8601_duration(&text).unwrap_or_else(|| {
            problems.push(format!(
                "{key}: `{text}` is not an ISO-8601 duration such as PT30S or PT1H"
            ));
            default
        }),
    }
}

fn apply_table(
    mut settings: MemorySettings,
    table: &toml::Table,
    section: &str,
    problems: &mut Vec<String>,
) -> MemorySettings {
    for (key, value) in table {
        let Some(kind) = settings::kind_of(key) else {
            problems.push(format!("{section}.{key}: unknown setting"));
            continue;
        };
        let text = match (kind, value) {
            (settings::Kind::Bool, toml::Value::Boolean(b)) => b.to_string(),
            (
                settings::Kind::Integer { .. } | settings::Kind::OptionalInteger { .. },
                toml::Value::Integer(n),
            ) => n.to_string(),
            (
                settings::Kind::Duration
                | settings::Kind::OptionalDuration
                | settings::Kind::OptionalName
                | settings::Kind::Language
                | settings::Kind::OptionalInteger { .. },
                toml::Value::String(s),
            ) => s.clone(),
            _ => {
                problems.push(format!("{section}.{key}: must be {}", kind.describe()));
                continue;
            }
        };
        if let Err(err) = settings.apply(key, &text) {
            problems.push(format!("{section}.{key}: {err}"));
        }
    }
    settings
}

/// Checks an upstream base URL: `http` or `https`, a host, and a path (the version path) with
/// no query.
fn parse_base_url(text: &str) -> Result<http::Uri, &'static str> {
    let uri: http::Uri = text
        .trim_end_matches('/')
        .parse()
        .map_err(|_| "is not a URL")?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err("must start with http:// or https://"),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err("has no host");
    }
    if uri.query().is_some() {
        return Err("must not have a query");
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
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
        let err = from_toml(text, &no_env).unwrap_err();
        let all = err.problems.join("\n");
        for needle in [
            "server.listen",
            "upstream.base_url",
            "upstream.api_key_env",
            "memory.recent_n",
            "memory.relevance_top_k",
            "memory.bogus: unknown setting",
            "agents.bad name: an agent name",
            "agents.bad name.persist",
        ] {
            assert!(all.contains(needle), "missing {needle} in:\n{all}");
        }
    }

    #[test]
    fn unknown_keys_in_sections_are_errors() {
        let err = from_toml("[server]\nlisten_port = 1\n", &no_env).unwrap_err();
        assert!(err.problems[0].contains("listen_port"), "{err}");
        let err = from_toml("[nope]\n", &no_env).unwrap_err();
        assert!(err.problems[0].contains("nope"), "{err}");
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
    fn the_shipped_config_lists_every_setting_at_its_default() {
        let text = include_str!("../config/memproxy.toml");
        let config = from_toml(text, &no_env).unwrap();
        assert_eq!(config.memory, MemorySettings::default());
        assert_eq!(config.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(config.body_limit_bytes, DEFAULT_BODY_LIMIT_BYTES);
        for (name, _) in settings::SETTINGS {
            assert!(
                text.contains(&format!("\n{name} = ")),
                "{name} missing from config/memproxy.toml"
            );
        }
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
