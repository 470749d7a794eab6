//! `[storage]`: which engine holds memory (sled in the data directory, or a Redis server shared
//! by replicas), where the store lives, when commits reach the disk, and the cache sizes set
//! explicitly (unset, each takes its share of `server.memory_budget`: `memory_budget.rs`).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::memory_budget::ExplicitCaches;
use super::values::{RawSize, Secret, at_least_one, nonzero_duration, secret_from_env, size};

pub const DEFAULT_DATA_DIR: &str = "./data";
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_secs(1);
pub const DEFAULT_REDIS_KEY_PREFIX: &str = "memproxy:";
pub const DEFAULT_REDIS_POOL_SIZE: usize = 16;
pub const DEFAULT_REDIS_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_REDIS_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
pub const DEFAULT_REDIS_WAIT_TIMEOUT: Duration = Duration::from_secs(1);

/// The storage engine (`storage.backend`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// sled in `{data_dir}/store`, this process's alone (the default).
    Sled,
    /// fjall in `{data_dir}/fjall`, this process's alone: its memory bounded by its caches
    /// (`store::FjallEngine`).
    Fjall,
    /// A Redis server shared by every replica.
    Redis(RedisConfig),
}

impl Backend {
    /// The embedded engine, for sled and fjall (`None` for Redis).
    pub fn embedded(&self) -> Option<memproxy_store::Embedded> {
        memproxy_store::Embedded::named(self.name())
    }

    /// The engine's name, as `storage.backend` takes it.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Sled => "sled",
            Backend::Fjall => "fjall",
            Backend::Redis(_) => "redis",
        }
    }
}

/// `storage.redis_*`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` (TLS); may carry a user and password, so kept secret.
    pub url: Secret,
    /// The password from the variable `storage.redis_password_env` names (wins over the
    /// URL's).
    pub password: Option<Secret>,
    /// What every key memproxy writes starts with.
    pub key_prefix: String,
    /// Connections kept open to Redis.
    pub pool_size: usize,
    pub connect_timeout: Duration,
    pub command_timeout: Duration,
    /// Replicas of the Redis server that must acknowledge each write (WAIT); 0: none.
    pub wait_replicas: u32,
    /// How long a write waits for them.
    pub wait_timeout: Duration,
}

/// When a commit reaches the disk: the store's own type.
pub use memproxy_store::Durability;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStorage {
    data_dir: Option<String>,
    durability: Option<String>,
    flush_interval: Option<String>,
    cache_bytes: Option<RawSize>,
    state_cache_bytes: Option<RawSize>,
    recall_cache_bytes: Option<RawSize>,
    backend: Option<String>,
    redis_url: Option<String>,
    redis_password_env: Option<String>,
    redis_key_prefix: Option<String>,
    redis_pool_size: Option<u64>,
    redis_connect_timeout: Option<String>,
    redis_command_timeout: Option<String>,
    redis_wait_replicas: Option<u64>,
    redis_wait_timeout: Option<String>,
}

/// `[storage]`, checked.
pub(super) struct Storage {
    pub backend: Backend,
    pub data_dir: PathBuf,
    pub durability: Durability,
    pub caches: ExplicitCaches,
}

/// Checks `[storage]`; `data_dir` and `redis_url` (from flags or the environment) win over
/// the file, and a `redis_url` given so selects the Redis backend.
pub(super) fn check_storage(
    mut raw: RawStorage,
    data_dir: Option<PathBuf>,
    redis_url: Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> Storage {
    if let Some(url) = redis_url.filter(|url| !url.is_empty()) {
        raw.redis_url = Some(url);
        raw.backend = Some("redis".to_string());
    }
    let backend = check_backend(&mut raw, env, problems);
    let data_dir = data_dir
        .or(raw.data_dir.map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    let durability = match raw.durability.as_deref().unwrap_or("commit") {
        "commit" => {
            if raw.flush_interval.is_some() {
                problems.push(
                    "storage.flush_interval: only used with storage.durability = \"interval\""
                        .to_string(),
                );
            }
            Durability::Commit
        }
        "interval" => {
            let every = nonzero_duration(
                "storage.flush_interval",
                raw.flush_interval,
                DEFAULT_FLUSH_INTERVAL,
                problems,
            );
            Durability::Interval(every)
        }
        other => {
            problems.push(format!(
                "storage.durability: `{other}` must be \"commit\" or \"interval\""
            ));
            Durability::Commit
        }
    };
    Storage {
        backend,
        data_dir,
        durability,
        caches: ExplicitCaches {
            state: size("storage.state_cache_bytes", raw.state_cache_bytes, problems),
            store: size("storage.cache_bytes", raw.cache_bytes, problems),
            recall: size(
                "storage.recall_cache_bytes",
                raw.recall_cache_bytes,
                problems,
            ),
        },
    }
}

/// `storage.backend` and the `storage.redis_*` keys (which only the Redis backend takes).
fn check_backend(
    raw: &mut RawStorage,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> Backend {
    let redis_keys = [
        ("storage.redis_url", raw.redis_url.is_some()),
        (
            "storage.redis_password_env",
            raw.redis_password_env.is_some(),
        ),
        ("storage.redis_key_prefix", raw.redis_key_prefix.is_some()),
        ("storage.redis_pool_size", raw.redis_pool_size.is_some()),
        (
            "storage.redis_connect_timeout",
            raw.redis_connect_timeout.is_some(),
        ),
        (
            "storage.redis_command_timeout",
            raw.redis_command_timeout.is_some(),
        ),
        (
            "storage.redis_wait_replicas",
            raw.redis_wait_replicas.is_some(),
        ),
        (
            "storage.redis_wait_timeout",
            raw.redis_wait_timeout.is_some(),
        ),
    ];
    let embedded = |backend: Backend, problems: &mut Vec<String>| {
        for (key, set) in redis_keys {
            if set {
                problems.push(format!("{key}: only used with storage.backend = \"redis\""));
            }
        }
        backend
    };
    match raw.backend.as_deref().unwrap_or("sled") {
        "sled" => embedded(Backend::Sled, problems),
        "fjall" => embedded(Backend::Fjall, problems),
        "redis" => Backend::Redis(check_redis(raw, env, problems)),
        other => {
            problems.push(format!(
                "storage.backend: `{other}` must be \"sled\", \"fjall\" or \"redis\""
            ));
            Backend::Sled
        }
    }
}

fn check_redis(
    raw: &mut RawStorage,
    env: &dyn Fn(&str) -> Option<String>,
    problems: &mut Vec<String>,
) -> RedisConfig {
    let url = match raw.redis_url.take() {
        None => {
            problems.push(
                "storage.redis_url: required with storage.backend = \"redis\" (or --redis-url / MEMPROXY_REDIS_URL)"
                    .to_string(),
            );
            String::new()
        }
        Some(url) => {
            if let Err(why) = check_redis_url(&url) {
                // The URL may hold a password: only its scheme is quoted.
                problems.push(format!("storage.redis_url: {why}"));
            }
            url
        }
    };
    let password = raw
        .redis_password_env
        .take()
        .filter(|name| !name.is_empty())
        .and_then(|name| secret_from_env("storage.redis_password_env", &name, env, problems));
    let key_prefix = raw
        .redis_key_prefix
        .take()
        .unwrap_or_else(|| DEFAULT_REDIS_KEY_PREFIX.to_string());
    if key_prefix.contains(['{', '}']) {
        problems.push(format!(
            "storage.redis_key_prefix: `{key_prefix}` must not contain `{{` or `}}` (memproxy sets the hash tags)"
        ));
    }
    let pool_size = at_least_one(
        "storage.redis_pool_size",
        raw.redis_pool_size,
        DEFAULT_REDIS_POOL_SIZE,
        problems,
    );
    let wait_replicas = match raw.redis_wait_replicas {
        None => 0,
        Some(n) => u32::try_from(n).unwrap_or_else(|_| {
            problems.push(format!(
                "storage.redis_wait_replicas: `{n}` is too many replicas"
            ));
            0
        }),
    };
    RedisConfig {
        url: Secret(url),
        password,
        key_prefix,
        pool_size,
        connect_timeout: nonzero_duration(
            "storage.redis_connect_timeout",
            raw.redis_connect_timeout.take(),
            DEFAULT_REDIS_CONNECT_TIMEOUT,
            problems,
        ),
        command_timeout: nonzero_duration(
            "storage.redis_command_timeout",
            raw.redis_command_timeout.take(),
            DEFAULT_REDIS_COMMAND_TIMEOUT,
            problems,
        ),
        wait_replicas,
        wait_timeout: nonzero_duration(
            "storage.redis_wait_timeout",
            raw.redis_wait_timeout.take(),
            DEFAULT_REDIS_WAIT_TIMEOUT,
            problems,
        ),
    }
}

/// Checks a Redis URL without ever quoting it (it may hold a password).
fn check_redis_url(url: &str) -> Result<(), String> {
    let scheme = url.split_once("://").map(|(scheme, _)| scheme);
    match scheme {
        Some("redis" | "rediss") => {}
        _ => return Err("must start with redis:// or rediss:// (TLS)".to_string()),
    }
    if memproxy_store::is_redis_url(url) {
        Ok(())
    } else {
        Err("is not a valid Redis URL (redis://[user:password@]host[:port][/db])".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Overrides, from_toml, load};
    use super::*;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn problems(text: &str) -> Vec<String> {
        from_toml(text, &no_env).unwrap_err().problems
    }

    #[test]
    fn sled_is_the_default_and_takes_no_redis_keys() {
        assert_eq!(from_toml("", &no_env).unwrap().backend, Backend::Sled);
        let found = problems("[storage]\nredis_pool_size = 3\n");
        assert_eq!(
            found,
            ["storage.redis_pool_size: only used with storage.backend = \"redis\""]
        );
    }

    #[test]
    fn fjall_is_chosen_by_name_and_takes_no_redis_keys() {
        let config = from_toml("[storage]\nbackend = \"fjall\"\n", &no_env).unwrap();
        assert_eq!(config.backend, Backend::Fjall);
        let found =
            problems("[storage]\nbackend = \"fjall\"\nredis_url = \"redis://127.0.0.1:1\"\n");
        assert_eq!(
            found,
            ["storage.redis_url: only used with storage.backend = \"redis\""]
        );
        let found = problems("[storage]\nbackend = \"rocks\"\n");
        assert_eq!(
            found,
            ["storage.backend: `rocks` must be \"sled\", \"fjall\" or \"redis\""]
        );
    }

    #[test]
    fn the_redis_backend_is_read_with_its_defaults() {
        let config = from_toml(
            "[storage]\nbackend = \"redis\"\nredis_url = \"redis://127.0.0.1:6390/2\"\n",
            &no_env,
        )
        .unwrap();
        let Backend::Redis(redis) = config.backend else {
            panic!("not redis")
        };
        assert_eq!(redis.url, Secret("redis://127.0.0.1:6390/2".into()));
        assert_eq!(redis.key_prefix, DEFAULT_REDIS_KEY_PREFIX);
        assert_eq!(redis.pool_size, DEFAULT_REDIS_POOL_SIZE);
        assert_eq!(redis.connect_timeout, DEFAULT_REDIS_CONNECT_TIMEOUT);
        assert_eq!(redis.command_timeout, DEFAULT_REDIS_COMMAND_TIMEOUT);
        assert_eq!(redis.wait_replicas, 0);
        assert_eq!(redis.password, None);
    }

    #[test]
    fn every_redis_problem_is_named_and_no_password_is_quoted() {
        let found = problems(
            "[storage]\nbackend = \"redis\"\nredis_url = \"http://:hunter2@h\"\nredis_key_prefix = \"{x}\"\nredis_pool_size = 0\nredis_command_timeout = \"soon\"\nredis_wait_replicas = 99999999999\nredis_password_env = \"NOPE\"\n",
        );
        let all = found.join("\n");
        assert!(!all.contains("hunter2"), "{all}");
        for key in [
            "storage.redis_url: must start with redis://",
            "storage.redis_key_prefix",
            "storage.redis_pool_size",
            "storage.redis_command_timeout",
            "storage.redis_wait_replicas",
            "storage.redis_password_env: environment variable `NOPE`",
        ] {
            assert!(all.contains(key), "{key} missing from {all}");
        }
        let found = problems("[storage]\nbackend = \"redis\"\n");
        assert!(
            found[0].starts_with("storage.redis_url: required"),
            "{found:?}"
        );
        let found = problems("[storage]\nbackend = \"postgres\"\n");
        assert!(
            found[0].starts_with("storage.backend: `postgres`"),
            "{found:?}"
        );
    }

    #[test]
    fn the_flag_selects_redis_and_the_password_comes_from_the_named_variable() {
        let overrides = Overrides {
            redis_url: Some("rediss://cache.internal:6380".into()),
            ..Overrides::default()
        };
        let env = |name: &str| (name == "REDIS_PW").then(|| "s3cret".to_string());
        let config = load(&overrides, &env).unwrap();
        assert!(matches!(config.backend, Backend::Redis(_)));
        let text = "[storage]\nbackend = \"redis\"\nredis_url = \"redis://h\"\nredis_password_env = \"REDIS_PW\"\nredis_wait_replicas = 1\n";
        let config = from_toml(text, &env).unwrap();
        let Backend::Redis(redis) = config.backend else {
            panic!("not redis")
        };
        assert_eq!(redis.password, Some(Secret("s3cret".into())));
        assert_eq!(redis.wait_replicas, 1);
        assert!(!format!("{redis:?}").contains("s3cret"));
    }
}
