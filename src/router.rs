//! The router: health checks, client-key checks, the path form, and the choice between the
//! memory pipeline and plain pass-through. Errors become responses here, and are logged here,
//! once.

use std::sync::Arc;
use std::time::Instant;

use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use tracing::Instrument;
use tracing::field::Empty;

use crate::body::{ProxyBody, full};
use crate::config::hash_key;
use crate::error::{ProxyError, json_response};
use crate::identity::{Credential, split_path_form};
use crate::metrics::{Route, UpstreamTime};
use crate::proxy::identify::{PathIds, credential_of, identify};
use crate::proxy::{self, MemoryStatus, set_memory_headers};
use crate::state::AppState;

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

async fn route(
    state: &Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let path = request.uri().path();
    match (request.method(), path) {
        (&Method::GET, "/healthz") => {
            return Ok(json_response(StatusCode::OK, r#"{"status":"ok"}"#));
        }
        (&Method::GET, "/readyz") => return Ok(readiness(state)),
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

    let is_chat = request.method() == Method::POST && api_path == "/v1/chat/completions";
    let identity = identify(&state.config, request.headers(), path_ids, is_chat)?;
    let span = tracing::Span::current();
    span.record("agent", identity.agent.as_str());
    if let Some(conversation) = &identity.conversation {
        span.record("conversation", conversation.as_str());
    }
    // A path the upstream URI cannot hold is refused before anything else happens.
    state.upstream.uri_for(api_path, request.uri().query())?;
    let api_path = api_path.to_string();

    match (identity.key, identity.conversation) {
        (Some(key), _) => {
            let (parts, body) = request.into_parts();
            proxy::chat::chat(state, parts, body, key, identity.settings, &api_path).await
        }
        (None, Some(conversation)) if is_chat => {
            let mut response = proxy::passthrough(state, request, &api_path).await?;
            set_memory_headers(&mut response, MemoryStatus::Off, &conversation, None);
            Ok(response)
        }
        _ => proxy::passthrough(state, request, &api_path).await,
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

/// `GET /metrics`: Prometheus (OpenMetrics) text. Open like `/healthz`, unless
/// `admin.protect_metrics` asks for the admin token.
fn metrics(state: &AppState, headers: &http::HeaderMap) -> Response<ProxyBody> {
    if state.config.protect_metrics && !crate::admin::authorized(state, headers) {
        return crate::admin::AdminError::Unauthorized.into_response();
    }
    let mut response = Response::new(full(state.metrics.render(&state.memory)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    response
}

fn readiness(state: &AppState) -> Response<ProxyBody> {
    let store = state.memory.store.is_ready();
    let body = format!(
        r#"{{"status":"{}","store":{store},"upstream":true}}"#,
        if store { "ready" } else { "unavailable" }
    );
    let status = if store {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, body)
}
