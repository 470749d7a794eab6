//! The router: the path check, health checks, client-key checks, the path form, and the choice
//! between the memory pipeline (chat completions, the Responses API, the Anthropic Messages
//! API) and plain pass-through (to the OpenAI-compatible upstream, or the Anthropic one for
//! `/v1/messages...` and for `/v1/models` asked with `anthropic-version`). Errors become responses here, and are
//! logged here, once.
//!
//! Every path is checked before it is routed: a `.` or `..` segment (also percent-encoded) or
//! an encoded slash or backslash is a 400, so no path can climb out of the upstream's `/v1`
//! (with memproxy's own upstream key, when one is configured) or out of an admin route.

use std::sync::Arc;
use std::time::Instant;

use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use tracing::Instrument;
use tracing::field::Empty;

use crate::body::{ProxyBody, full};
use crate::config::hash_key;
use crate::error::{ProxyError, json_response};
use crate::identity::{ConversationKey, Credential, split_path_form};
use crate::metrics::{Route, UpstreamTime};
use crate::proxy::chat::MemoryRequest;
use crate::proxy::identify::{Identity, PathIds, credential_of, identify};
use crate::proxy::{self, DegradedReason, MemoryStatus, set_degraded_reason, set_memory_headers};
use crate::state::AppState;
use crate::wire::Api;

pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Handles one request: never fails, every error is an OpenAI-shaped response.
pub async fn handle(state: Arc<AppState>, request: Request<Incoming>) -> Response<ProxyBody> {
    let request_id = state.request_id();
    let span = tracing::info_span!(
        "request",
        request_id = %request_id,
        method = %request.method(),
        path = %request.uri().path(),
        agent = Empty,
        conversation = Empty,
        model = Empty,
        status = Empty,
        upstream_ms = Empty,
        elapsed_ms = Empty,
    );
    let metrics_route = Route::of(request.method(), request.uri().path());
    async move {
        let started = Instant::now();
        let mut response = match route(&state, request).await {
            Ok(response) => response,
            Err(err) => {
                if err.status().is_server_error() {
                    tracing::warn!(error = %err, source = ?std::error::Error::source(&err).map(ToString::to_string), "request failed");
                } else {
                    tracing::info!(error = %err, "request refused");
                }
                err.into_response()
            }
        };
        if let Ok(value) = HeaderValue::from_str(&request_id) {
            response.headers_mut().insert(REQUEST_ID_HEADER, value);
        }
        let span = tracing::Span::current();
        span.record("status", response.status().as_u16());
        span.record("elapsed_ms", started.elapsed().as_millis() as u64);
        state.metrics.request(metrics_route, response.status());
        let upstream = response.extensions().get::<UpstreamTime>().map(|t| t.0);
        state.metrics.timings(started.elapsed(), upstream);
        tracing::info!("request finished");
        response
    }
    .instrument(span)
    .await
}

/// Routes one request, in order: the path check, memproxy's own routes (health, metrics,
/// admin), the `/v1` API's checks (client key, identity, a path the upstream can hold), a
/// stored Responses id, then memory or pass-through.
async fn route(
    state: &Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let path = request.uri().path();
    check_path(path)?;
    match (request.method(), path) {
        (&Method::GET, "/healthz") => {
            return Ok(json_response(StatusCode::OK, r#"{"status":"ok"}"#));
        }
        (&Method::GET, "/readyz") => return Ok(readiness(state).await),
        (&Method::GET, "/metrics") => return Ok(metrics(state, request.headers())),
        _ => {}
    }
    if path == "/admin" || path.starts_with("/admin/") {
        return Ok(crate::admin::handle(state, request).await);
    }

    let (path_ids, api_path) = match split_path_form(path) {
        Some((agent, conversation, rest)) => (
            Some(PathIds {
                agent,
                conversation,
            }),
            rest,
        ),
        None => (None, path),
    };
    if api_path != "/v1" && !api_path.starts_with("/v1/") {
        return Err(ProxyError::NotFound {
            method: request.method().to_string(),
            path: path.to_string(),
        });
    }
    check_client_key(state, request.headers())?;

    // The APIs memory serves: chat completions, the Responses API, the Anthropic Messages API.
    let api = if request.method() == Method::POST {
        Api::of_post(api_path)
    } else {
        None
    };
    let identity = identify(&state.config, request.headers(), path_ids, api.is_some())?;
    let span = tracing::Span::current();
    span.record("agent", identity.agent.as_str());
    if let Some(conversation) = &identity.conversation {
        span.record("conversation", conversation.as_str());
    }
    // A path the upstream URI cannot hold is refused before anything else happens.
    state
        .upstream_for_path(api_path, request.headers())
        .uri_for(api_path, request.uri().query())?;
    let api_path = api_path.to_string();

    // `GET`/`DELETE /v1/responses/{id}` of an id memproxy answered.
    let stored_id =
        proxy::responses::stored_response_route(request.method(), &api_path).map(str::to_string);
    if let Some(id) = stored_id {
        let method = request.method().clone();
        if let Some(response) =
            proxy::responses::stored_response(state, &method, request.headers(), &id).await?
        {
            return Ok(response);
        }
    }

    memory_or_pass_through(state, request, identity, api, api_path).await
}

/// Where an identified `/v1` request goes: memory for a conversation of an API memory serves
/// (without a store: pass-through marked `degraded`), pass-through marked `off` for one whose
/// memory is off, memory for a Responses request that may name its conversation in its body;
/// anything else passes through untouched.
async fn memory_or_pass_through(
    state: &Arc<AppState>,
    request: Request<Incoming>,
    mut identity: Identity,
    api: Option<Api>,
    api_path: String,
) -> Result<Response<ProxyBody>, ProxyError> {
    match (identity.key.take(), identity.conversation.take(), api) {
        (Some(key), _, Some(api)) => match &state.memory {
            Ok(memory) => {
                let request = memory_request(request, Some(key), identity, api, api_path);
                proxy::chat::chat(state, memory, request).await
            }
            // No store: the request goes through untouched, said in its headers (the cause was
            // logged once at start and is in `/readyz`).
            Err(_) => {
                let mut response = proxy::passthrough(state, request, &api_path).await?;
                let status = MemoryStatus::Degraded;
                set_memory_headers(&mut response, status, &key.conversation, None);
                set_degraded_reason(&mut response, DegradedReason::StoreUnavailable);
                Ok(response)
            }
        },
        (None, Some(conversation), Some(_)) => {
            let mut response = proxy::passthrough(state, request, &api_path).await?;
            set_memory_headers(&mut response, MemoryStatus::Off, &conversation, None);
            Ok(response)
        }
        // A Responses request without a conversation id header: its `conversation` field may
        // name one, or its `previous_response_id` one memproxy answered.
        (None, None, Some(Api::Responses)) if identity.settings.enabled => match &state.memory {
            Ok(memory) => {
                let request = memory_request(request, None, identity, Api::Responses, api_path);
                proxy::chat::chat(state, memory, request).await
            }
            Err(_) => proxy::passthrough(state, request, &api_path).await,
        },
        _ => proxy::passthrough(state, request, &api_path).await,
    }
}

/// The memory pipeline's request: the request's head and body, for whom and with what
/// settings it runs (`key`: its conversation, when the request named one).
fn memory_request(
    request: Request<Incoming>,
    key: Option<ConversationKey>,
    identity: Identity,
    api: Api,
    api_path: String,
) -> MemoryRequest {
    let (parts, body) = request.into_parts();
    MemoryRequest {
        parts,
        body,
        key,
        agent: identity.agent,
        user: identity.user,
        settings: identity.settings,
        api,
        api_path,
    }
}

/// With `auth.client_keys` set, only those keys may call, sent in any of the credential
/// headers (`Authorization: Bearer`, `api-key`, `x-api-key`). A request presenting two
/// different credentials is refused (400), so an allowed key can never carry another upstream.
fn check_client_key(state: &AppState, headers: &http::HeaderMap) -> Result<(), ProxyError> {
    if state.config.client_key_hashes.is_empty() {
        return Ok(());
    }
    let credential = credential_of(headers)?;
    match credential.as_ref().and_then(Credential::key) {
        Some(key) if state.config.client_key_hashes.contains(&hash_key(key)) => Ok(()),
        _ => Err(ProxyError::Unauthorized),
    }
}

/// Refuses a path with a dot segment (`.`, `..`, percent-encoded in any case or mix, also before
/// a `;` parameter as some servers read it) or an encoded slash or backslash (`%2F`, `%5C`), or
/// a raw backslash: an upstream that normalises or decodes the path would read it as a climb out
/// of `/v1`.
fn check_path(path: &str) -> Result<(), ProxyError> {
    let bad = |message: &str| Err(ProxyError::invalid("path", "invalid_path", message));
    if path.contains('\\') || contains_encoded_separator(path) {
        return bad("the request path must not contain encoded slashes or backslashes (%2F, %5C)");
    }
    if path.split('/').any(is_dot_segment) {
        return bad(
            "the request path must not contain `.` or `..` segments (also percent-encoded)",
        );
    }
    Ok(())
}

/// True for `%2F`/`%5C` in any case.
fn contains_encoded_separator(path: &str) -> bool {
    path.as_bytes().windows(3).any(|w| {
        w[0] == b'%'
            && ((w[1] == b'2' && w[2].eq_ignore_ascii_case(&b'f'))
                || (w[1] == b'5' && w[2].eq_ignore_ascii_case(&b'c')))
    })
}

/// True when a path segment is `.` or `..` once `%2E`/`%2e` are decoded, or before a `;`.
fn is_dot_segment(segment: &str) -> bool {
    let segment = segment.split(';').next().unwrap_or(segment);
    let mut dots = 0;
    let mut rest = segment.as_bytes();
    while !rest.is_empty() {
        match rest {
            [b'.', tail @ ..] => rest = tail,
            [b'%', b'2', e, tail @ ..] if e.eq_ignore_ascii_case(&b'e') => rest = tail,
            _ => return false,
        }
        dots += 1;
    }
    dots == 1 || dots == 2
}

/// `GET /metrics`: Prometheus (OpenMetrics) text. Open like `/healthz`, unless
/// `admin.protect_metrics` asks for the admin token.
fn metrics(state: &AppState, headers: &http::HeaderMap) -> Response<ProxyBody> {
    if state.config.protect_metrics && !crate::admin::authorized(state, headers) {
        return crate::admin::AdminError::Unauthorized.into_response();
    }
    state
        .metrics
        .receipts(state.receipts.weighted_size(), state.receipts.len());
    let mut response = Response::new(full(
        state
            .metrics
            .render(state.memory().map(|m| &**m), &state.memory_guard),
    ));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    response
}

/// `GET /readyz`: 200 when the store and the tokenizer are ready, else 503 with the reason
/// (`{"status":"unavailable","store":false,...,"reason":"..."}`). A store whose writes failed
/// is retried here too (`store/health.rs`), so probes alone bring memory back once the disk has
/// room again.
async fn readiness(state: &AppState) -> Response<ProxyBody> {
    let reason = match &state.memory {
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
    };
    let store = reason.is_none();
    let tokenizer = crate::tokens::is_warm();
    let ready = store && tokenizer;
    let mut body = serde_json::json!({
        "status": if ready { "ready" } else { "unavailable" },
        "store": store,
        "tokenizer": tokenizer,
        "upstream": true,
    });
    if let Some(reason) = reason {
        body["reason"] = serde_json::Value::String(reason);
    }
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, body.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_and_encoded_separators_are_refused() {
        for bad in [
            "/v1/../../internal/admin",
            "/v1/%2e%2e/%2e%2e/internal",
            "/v1/%2E%2E/internal",
            "/v1/.%2e/internal",
            "/v1/%2E./internal",
            "/v1/./models",
            "/v1/%2e/models",
            "/v1/models/.",
            "/v1/models/..",
            "/v1/..;x=1/internal",
            "/v1/files%2f..%2finternal",
            "/v1/files%2F",
            "/v1/files%5cx",
            "/v1/files%5C",
            "/v1/files\\x",
            "/agents/a/conversations/c/v1/../../internal",
            "/agents/%2e%2e/conversations/c/v1/chat/completions",
            "/admin/v1/../../v1/models",
        ] {
            let err = check_path(bad).unwrap_err();
            assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad}");
            match err {
                ProxyError::InvalidRequest { param, .. } => {
                    assert_eq!(param.as_deref(), Some("path"), "{bad}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn dots_inside_names_are_fine() {
        for good in [
            "/v1/models/gpt-4.1",
            "/v1/files/a..b",
            "/v1/files/...",
            "/v1/files/.hidden",
            "/v1/files/x%2e",
            "/v1/files/%2e%2e%2e",
            "/v1/files/%25%32%65",
            "/agents/a.b/conversations/c..d/v1/chat/completions",
            "/v1/",
            "/",
        ] {
            assert!(check_path(good).is_ok(), "{good}");
        }
    }
}
