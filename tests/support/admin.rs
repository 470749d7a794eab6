//! Helpers for the operations tests (admin API, metrics, TTL): a memproxy started with an
//! admin token, and one helper that calls the admin API.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;

use crate::support::mock_upstream::MockUpstream;
use crate::support::redis_server::RedisServer;
use crate::support::{Answer, Proxy, send};
use memproxy::config;
use memproxy::identity::TenantId;

pub const ADMIN_TOKEN: &str = "admin-token-for-tests";

/// The config text [`Proxy::start`] uses, with `extra_toml` appended.
pub fn config_text(mock: &MockUpstream, data_dir: &Path, extra_toml: &str) -> String {
    config_with_storage(mock, data_dir, "", extra_toml)
}

/// [`config_text`] with `storage_toml` in `[storage]`.
pub fn config_with_storage(
    mock: &MockUpstream,
    data_dir: &Path,
    storage_toml: &str,
    extra_toml: &str,
) -> String {
    crate::support::config_toml(mock, data_dir, "", storage_toml, extra_toml)
}

/// Starts memproxy with the admin token set (as `MEMPROXY_ADMIN_TOKEN`, through the config's
/// environment function, never the real environment). With `MEMPROXY_TEST_BACKEND=redis` in
/// the test run's environment (`scripts/test.sh` runs the admin suite so a second time), its
/// memory is in a redis-server of its own instead of sled.
pub async fn start_admin(mock: &MockUpstream, data_dir: &Path, extra_toml: &str) -> Proxy {
    start_admin_backend(mock, data_dir, extra_toml).await.0
}

/// [`start_admin`], and the redis-server its memory is in (with `MEMPROXY_TEST_BACKEND=redis`)
/// for tests that look into it (kept alive by the proxy too).
pub async fn start_admin_backend(
    mock: &MockUpstream,
    data_dir: &Path,
    extra_toml: &str,
) -> (Proxy, Option<Arc<RedisServer>>) {
    let redis = (std::env::var("MEMPROXY_TEST_BACKEND").as_deref() == Ok("redis"))
        .then(|| Arc::new(RedisServer::start()));
    let storage = redis.as_ref().map_or(String::new(), |redis| {
        format!(
            "backend = \"redis\"\nredis_url = \"{}\"\nredis_key_prefix = \"mp:\"\n",
            redis.url()
        )
    });
    let text = config_with_storage(mock, data_dir, &storage, extra_toml);
    let config = config::from_toml(&text, &|name| match name {
        "MEMPROXY_ADMIN_TOKEN" => Some(ADMIN_TOKEN.to_string()),
        _ => None,
    })
    .unwrap();
    let proxy = Proxy::start_config(config).await;
    match redis {
        Some(redis) => (proxy.keeping(Arc::clone(&redis)), Some(redis)),
        None => (proxy, None),
    }
}

/// Calls the admin API with the admin token.
pub async fn admin(proxy: &Proxy, method: &str, path: &str, body: &str) -> Answer {
    admin_as(proxy, Some(ADMIN_TOKEN), method, path, body).await
}

/// Calls the admin API with `token` (or none).
pub async fn admin_as(
    proxy: &Proxy,
    token: Option<&str>,
    method: &str,
    path: &str,
    body: &str,
) -> Answer {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth.as_str()));
    }
    send(method, &proxy.url(path), &headers, body.to_string()).await
}

/// The tenant id of a client token, as the admin API shows it.
pub fn tenant(token: &str) -> String {
    TenantId::from_token(Some(token)).as_str().to_string()
}

/// The admin path of a conversation.
pub fn conversation_path(token: &str, agent: &str, id: &str) -> String {
    format!("/admin/v1/conversations/{}/{agent}/{id}", tenant(token))
}

/// True when `needle` occurs anywhere in the store (every tree, keys and values).
pub fn store_contains(state: &memproxy::state::AppState, needle: &str) -> bool {
    state
        .memory()
        .unwrap()
        .store
        .any_trace_of(needle.as_bytes())
        .unwrap()
}
