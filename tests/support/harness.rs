//! The one set-up of the integration tests: a strict mock upstream, a temporary data directory
//! and a memproxy started in-process on `127.0.0.1:0` against the mock, with the tests' config
//! ([`config_toml`](super::config_toml)) and whatever a test adds to it.
//!
//! ```ignore
//! let Started { mock, proxy, .. } = Harness::new()
//!     .config("[memory]\nrecent_n = 2\n")
//!     .start()
//!     .await;
//! ```
//!
//! The proxy keeps the mock and the directory alive (it holds a share of each), so a test binds
//! only what it uses: `..` drops neither. A test that restarts the proxy on the same data binds
//! `mock` and `dir` and starts the next one with [`Harness::proxy_on`].
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;

use memproxy::config;
use tempfile::TempDir;

use super::Proxy;
use super::admin::ADMIN_TOKEN;
use super::mock_upstream::{MockOptions, MockUpstream};
use super::redis_server::RedisServer;

/// What a test starts from: build it, then [`Harness::start`].
#[derive(Default)]
pub struct Harness {
    mock: MockOptions,
    upstream: String,
    anthropic: Option<Anthropic>,
    storage: Option<String>,
    config: String,
    admin: bool,
    env: Vec<(String, String)>,
}

/// Where the proxy's Anthropic upstream is.
enum Anthropic {
    /// The mock itself (it answers `/v1/messages` too).
    TheMock,
    /// Another upstream, e.g. a second mock, so a test can tell which one a request reached.
    At(String),
}

/// A started harness. The fields are dropped in this order (the proxy first), as a test's
/// locals `mock`, `dir`, `proxy` declared in that order were.
pub struct Started {
    pub proxy: Proxy,
    pub dir: Arc<TempDir>,
    /// Strict: a request the provider would refuse fails the test when the mock is dropped,
    /// unless the test took it ([`MockUpstream::take_refusals`]).
    pub mock: Arc<MockUpstream>,
    /// The redis-server the proxy's memory is in, when [`Harness::admin`] ran with
    /// `MEMPROXY_TEST_BACKEND=redis`.
    pub redis: Option<Arc<RedisServer>>,
}

impl Harness {
    pub fn new() -> Harness {
        Harness::default()
    }

    /// Appended to the config. The template ends inside `[server]`, so bare keys at the start
    /// are server settings.
    pub fn config(mut self, toml: &str) -> Harness {
        self.config.push_str(toml);
        self
    }

    /// Added to the `[upstream]` section.
    pub fn upstream(mut self, toml: &str) -> Harness {
        self.upstream.push_str(toml);
        self
    }

    /// The mock's own options (streaming chunks, strictness).
    pub fn mock(mut self, options: MockOptions) -> Harness {
        self.mock = options;
        self
    }

    /// The proxy's Anthropic upstream (`[upstream.anthropic]`) is the mock too.
    pub fn anthropic_to_the_mock(mut self) -> Harness {
        self.anthropic = Some(Anthropic::TheMock);
        self
    }

    /// The proxy's Anthropic upstream is `other` (a second mock the test started).
    pub fn anthropic_to(mut self, other: &MockUpstream) -> Harness {
        self.anthropic = Some(Anthropic::At(other.anthropic_base_url()));
        self
    }

    /// Added to the `[storage]` section (and the memory stays where it says, whatever
    /// `MEMPROXY_TEST_BACKEND` says).
    pub fn storage(mut self, toml: &str) -> Harness {
        self.storage = Some(toml.to_string());
        self
    }

    /// Memory in `redis` ([`redis_storage`](super::redis_storage)): one replica of several
    /// sharing it.
    pub fn redis(self, redis: &RedisServer) -> Harness {
        self.storage(&super::redis_storage(&redis.url()))
    }

    /// The admin API on, with [`ADMIN_TOKEN`] (given as `MEMPROXY_ADMIN_TOKEN` through the
    /// config's environment function, never the real environment). Unless [`Harness::storage`]
    /// says where memory is, `MEMPROXY_TEST_BACKEND=redis` in the test run's environment puts
    /// it in a redis-server of its own instead of sled (and `MEMPROXY_TEST_BACKEND=fjall` every
    /// test proxy's in fjall: `super::config_toml`); `scripts/test.sh` runs the admin, TTL,
    /// metrics and long-term suites so a second and a third time.
    pub fn admin(self) -> Harness {
        Harness {
            admin: true,
            ..self
        }
        .env("MEMPROXY_ADMIN_TOKEN", ADMIN_TOKEN)
    }

    /// A variable the config's environment function answers (`TEST_UPSTREAM_KEY` always does:
    /// `sk-proxy-held`).
    pub fn env(mut self, name: &str, value: &str) -> Harness {
        self.env.push((name.to_string(), value.to_string()));
        self
    }

    pub async fn start(self) -> Started {
        let mock = Arc::new(
            MockUpstream::start_with(self.mock.clone(), None)
                .await
                .unwrap(),
        );
        let dir = Arc::new(tempfile::tempdir().unwrap());
        let (proxy, redis) = self.proxy_and_redis(&mock, dir.path()).await;
        Started {
            proxy: proxy.keeping(Arc::clone(&dir)).keeping(Arc::clone(&mock)),
            dir,
            mock,
            redis,
        }
    }

    /// A proxy with this config on `mock` and the data in `dir`: the next process after a
    /// restart (the mock and the directory are the caller's to keep). With
    /// `MEMPROXY_TEST_BACKEND=redis`, an [`admin`](Harness::admin) proxy's memory is in a new
    /// redis-server, as it was for the first.
    pub async fn proxy_on(self, mock: &MockUpstream, dir: &Path) -> Proxy {
        self.proxy_and_redis(mock, dir).await.0
    }

    async fn proxy_and_redis(
        self,
        mock: &MockUpstream,
        dir: &Path,
    ) -> (Proxy, Option<Arc<RedisServer>>) {
        let redis = (self.admin
            && self.storage.is_none()
            && std::env::var("MEMPROXY_TEST_BACKEND").as_deref() == Ok("redis"))
        .then(|| Arc::new(RedisServer::start()));
        let storage = match (&self.storage, &redis) {
            (Some(storage), _) => storage.clone(),
            (None, Some(redis)) => format!(
                "backend = \"redis\"\nredis_url = \"{}\"\nredis_key_prefix = \"mp:\"\n",
                redis.url()
            ),
            (None, None) => String::new(),
        };
        let upstream = match &self.anthropic {
            Some(anthropic) => format!(
                "{}[upstream.anthropic]\nbase_url = \"{}\"\n",
                self.upstream,
                match anthropic {
                    Anthropic::TheMock => mock.anthropic_base_url(),
                    Anthropic::At(url) => url.clone(),
                }
            ),
            None => self.upstream.clone(),
        };
        let text = super::config_toml(mock, dir, &upstream, &storage, &self.config);
        let env = self.env;
        let config = config::from_toml(&text, &|name| {
            env.iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .or_else(|| super::test_env(name))
        })
        .unwrap();
        let proxy = Proxy::start_config(config).await;
        match redis {
            Some(redis) => (proxy.keeping(Arc::clone(&redis)), Some(redis)),
            None => (proxy, None),
        }
    }
}
