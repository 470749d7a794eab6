//! Helpers for the operations tests (admin API, metrics, TTL): the admin token a proxy started
//! with [`Harness::admin`](super::Harness::admin) accepts, and the helpers that call the admin
//! API.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::support::{Answer, Proxy, send};
use memproxy::identity::TenantId;

pub const ADMIN_TOKEN: &str = "admin-token-for-tests";

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
