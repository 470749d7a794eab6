//! `GET /admin/v1/receipts/{id}` and `POST /admin/v1/receipts/{id}/replay`: what memproxy
//! forwarded for one exchange, and the same body sent upstream again; and
//! `GET /admin/v1/conversations/{tenant}/{agent}/{id}/receipts`: a conversation's kept
//! receipts, newest first, each in brief.
//!
//! The admin token is one for the whole process, so a receipt's id (128 random bits) is what
//! addresses it; `?tenant=T` makes the read tenant-checked as the conversation routes are by
//! their path: a receipt of another tenant is then 404, as if it did not exist.
//!
//! A replay sends the receipt's body byte for byte to the same API and path, with the request
//! headers that shape the answer (`receipts::REPLAYED_HEADERS`), and returns the upstream's
//! answer as it comes (a stream streamed), storing nothing: no memory, no receipt, no
//! `response_ids` entry. Its credential: memproxy's own upstream key when one is configured;
//! otherwise the client's, which a receipt never holds, so the replay request must bring it,
//! in `X-Memory-Upstream-Authorization` (sent upstream as `Authorization`), `x-api-key` or
//! `api-key`, and it must be a credential of the receipt's tenant (else 403).

use std::sync::Arc;

use http::header::{AUTHORIZATION, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Response};
use serde_json::{Value, json};

use super::{AdminError, query_value};
use crate::body::{ProxyBody, boxed, full};
use crate::error::ProxyError;
use crate::identity::{ConversationKey, TenantId};
use crate::proxy::identify::credential_of;
use crate::receipts::{Receipt, render};
use crate::state::AppState;
use crate::upstream::Forward;

/// The header a replay request carries the client's `Authorization` value in (the admin
/// token has the real `Authorization`).
pub const UPSTREAM_AUTHORIZATION_HEADER: &str = "x-memory-upstream-authorization";

/// The header of a replay's answer that names the receipt replayed.
pub const REPLAY_HEADER: &str = "x-memory-replay-of";

/// The receipt `id`, tenant-checked against `?tenant=`.
pub fn find(state: &AppState, id: &str, query: &str) -> Result<Arc<Receipt>, AdminError> {
    let not_found = || {
        AdminError::NotFound(format!(
            "no receipt {id}: receipts are kept for receipts.retention after their exchange, and only while receipts.max_bytes has room"
        ))
    };
    if !state.receipts.enabled() {
        return Err(AdminError::NotFound(
            "receipts are off (receipts.enabled = false or receipts.retention = \"PT0S\")"
                .to_string(),
        ));
    }
    let receipt = state.receipts.get(id).ok_or_else(not_found)?;
    if let Some(tenant) = query_value(query, "tenant")
        && tenant != receipt.key.tenant.as_str()
    {
        return Err(not_found());
    }
    Ok(receipt)
}

/// The kept receipts of a conversation, newest first (`?limit=`, default 20, at most 100).
pub fn of_conversation(
    state: &AppState,
    key: &ConversationKey,
    query: &str,
) -> Result<Value, AdminError> {
    let limit = match query_value(query, "limit") {
        None => DEFAULT_LISTED,
        Some(text) => text
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LISTED).contains(n))
            .ok_or_else(|| {
                AdminError::BadRequest(format!("`limit` must be an integer from 1 to {MAX_LISTED}"))
            })?,
    };
    let kept = state.receipts.of_conversation(key, limit);
    let mut value = super::format::address(key);
    value["receipts_enabled"] = json!(state.receipts.enabled());
    value["receipts"] = kept.iter().map(|r| render::brief(r)).collect();
    Ok(value)
}

/// The receipts a conversation's list gives by default, and at most.
const DEFAULT_LISTED: usize = 20;
const MAX_LISTED: usize = 100;

/// The receipt as JSON.
pub fn show(receipt: &Receipt) -> Value {
    render::to_json(receipt)
}

/// Sends the receipt's body upstream again and returns the answer, storing nothing.
pub async fn replay(
    state: &AppState,
    receipt: &Receipt,
    headers: &HeaderMap,
) -> Result<Response<ProxyBody>, AdminError> {
    let upstream = state.upstream_for(receipt.api);
    let mut out = HeaderMap::new();
    for (name, value) in &receipt.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            out.insert(name, value);
        }
    }
    let mut credential = HeaderMap::new();
    for value in headers.get_all(UPSTREAM_AUTHORIZATION_HEADER) {
        credential.append(AUTHORIZATION, value.clone());
    }
    for name in ["x-api-key", "api-key"] {
        for value in headers.get_all(name) {
            credential.append(HeaderName::from_static(name), value.clone());
        }
    }
    if !upstream.has_key() {
        let presented = credential_of(&credential).map_err(|_| {
            AdminError::BadRequest(format!(
                "{UPSTREAM_AUTHORIZATION_HEADER}, x-api-key, api-key: one credential, visible ASCII"
            ))
        })?;
        if presented.is_none() && receipt.key.tenant != TenantId::of(None) {
            return Err(AdminError::BadRequest(format!(
                "memproxy holds no upstream key, and a receipt never holds the client's: send the client's credential in {UPSTREAM_AUTHORIZATION_HEADER} (its Authorization value), x-api-key or api-key"
            )));
        }
        if presented.is_some() && TenantId::of(presented.as_ref()) != receipt.key.tenant {
            return Err(AdminError::Forbidden(
                "the credential sent is not one of the receipt's tenant".to_string(),
            ));
        }
        for (name, value) in &credential {
            let mut value = value.clone();
            value.set_sensitive(true);
            out.append(name.clone(), value);
        }
    }
    let forwarded = upstream
        .forward(Forward {
            method: Method::POST,
            path: &receipt.api_path,
            query: receipt.query.as_deref(),
            headers: &out,
            body_len: Some(receipt.body.len()),
            body: full(receipt.body.clone()),
            read_reply: false,
            task: None,
        })
        .await;
    let forwarded = match forwarded {
        Ok(forwarded) => forwarded,
        Err(err) => return Ok(crate::error::respond(&ProxyError::from(err))),
    };
    let (mut head, body) = forwarded.response.into_parts();
    if let Ok(value) = HeaderValue::from_str(&receipt.id) {
        head.headers.insert(REPLAY_HEADER, value);
    }
    head.headers
        .insert(crate::proxy::STATUS_HEADER, HeaderValue::from_static("off"));
    Ok(Response::from_parts(head, boxed(body)))
}
