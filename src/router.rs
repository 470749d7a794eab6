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
use crate::proxy::exit::{Ending, Exit};
use crate::proxy::identify::{Identity, PathIds, credential_of, identify};
use crate::proxy::{self, DegradedReason};
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
    async move {
        let started = Instant::now();
        let (metrics_route, routed) = route(&state, request).await;
        let mut response = match routed {
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

/// Where a request goes, decided once from its method and path: the router dispatches on it
/// and its metrics' `route` label is read from it ([`Target::route`]).
enum Target<'a> {
    /// `/healthz`, `/readyz` (answered to `GET`).
    Health,
    /// `/metrics` (answered to `GET`).
    Metrics,
    /// `/admin/...`.
    Admin,
    /// `/mcp`: the memory tools over MCP (`[mcp] enabled`).
    Mcp,
    /// The `/v1` API, in the header or the path form (`/agents/A/conversations/C/v1/...`).
    Api {
        path_ids: Option<PathIds<'a>>,
        /// The upstream path.
        api_path: &'a str,
        /// An API memory serves: a `POST` to chat completions, the Responses API or the
        /// Anthropic Messages API.
        api: Option<Api>,
    },
    /// Anything else (404).
    Other,
}

impl<'a> Target<'a> {
    fn of(method: &Method, path: &'a str) -> Target<'a> {
        match path {
            "/healthz" | "/readyz" => return Target::Health,
            "/metrics" => return Target::Metrics,
            _ => {}
        }
        if path == "/admin" || path.starts_with("/admin/") {
            return Target::Admin;
        }
        if path == crate::mcp::route::MCP_PATH {
            return Target::Mcp;
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
            return Target::Other;
        }
        let api = (method == Method::POST)
            .then(|| Api::of_post(api_path))
            .flatten();
        Target::Api {
            path_ids,
            api_path,
            api,
        }
    }

    /// The `route` label of the request's metrics.
    fn route(&self) -> Route {
        match self {
            Target::Health => Route::Health,
            Target::Metrics => Route::Metrics,
            Target::Admin => Route::Admin,
            Target::Mcp => Route::Mcp,
            Target::Other => Route::Other,
            Target::Api { api, .. } => match api {
                Some(Api::Chat) => Route::Chat,
                Some(Api::Responses) => Route::Responses,
                Some(Api::Anthropic) => Route::Messages,
                None => Route::Passthrough,
            },
        }
    }
}

/// Routes one request: its [`Target`] decided, then dispatched. Returns the target's metrics
/// route with the answer.
async fn route(
    state: &Arc<AppState>,
    request: Request<Incoming>,
) -> (Route, Result<Response<ProxyBody>, ProxyError>) {
    let uri = request.uri().clone();
    let target = Target::of(request.method(), uri.path());
    (target.route(), dispatch(state, request, target).await)
}

/// Dispatches one request, in order: the path check, memproxy's own routes (health, metrics,
/// admin), the `/v1` API's checks (client key, identity, a path the upstream can hold), a
/// stored Responses id, then memory or pass-through.
async fn dispatch(
    state: &Arc<AppState>,
    request: Request<Incoming>,
    target: Target<'_>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let path = request.uri().path();
    check_path(path)?;
    let (path_ids, api_path, api) = match (request.method(), path, target) {
        (&Method::GET, "/healthz", Target::Health) => {
            return Ok(json_response(StatusCode::OK, r#"{"status":"ok"}"#));
        }
        (&Method::GET, "/readyz", Target::Health) => return Ok(readiness(state).await),
        (&Method::GET, _, Target::Metrics) => return Ok(metrics(state, request.headers())),
        (_, _, Target::Admin) => return Ok(crate::admin::handle(state, request).await),
        (_, _, Target::Mcp) if state.config.mcp.enabled => {
            check_client_key(state, request.headers())?;
            return crate::mcp::route::serve(state, request).await;
        }
        (
            _,
            _,
            Target::Api {
                path_ids,
                api_path,
                api,
            },
        ) => (path_ids, api_path, api),
        _ => {
            return Err(ProxyError::NotFound {
                method: request.method().to_string(),
                path: path.to_string(),
            });
        }
    };
    check_client_key(state, request.headers())?;
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
                let answer = proxy::passthrough(state, request, &api_path).await;
                let exit = Exit::Degraded {
                    conversation: key.conversation,
                    reason: DegradedReason::StoreUnavailable,
                };
                Ending::new(exit, answer).finish(state)
            }
        },
        (None, Some(conversation), Some(_)) => {
            let answer = proxy::passthrough(state, request, &api_path).await;
            let side_call = None;
            Ending::new(
                Exit::Off {
                    conversation,
                    side_call,
                },
                answer,
            )
            .finish(state)
        }
        // A Responses request without a conversation id header: its `conversation` field may
        // name one, or its `previous_response_id` one memproxy answered.
        (None, None, Some(Api::Responses)) if identity.settings.enabled => match &state.memory {
            Ok(memory) => {
                let request = memory_request(request, None, identity, Api::Responses, api_path);
                proxy::chat::chat(state, memory, request).await
            }
            // No store: nothing to find its conversation in; forwarded untouched, nothing said.
            Err(_) => {
                let answer = proxy::passthrough(state, request, &api_path).await;
                Ending::new(Exit::Silent, answer).finish(state)
            }
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
    let reason = state.memory_unready_reason().await;
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
    // Memory refused for want of room is no reason to take the pod out of service (requests
    // still go through, with memory off), but it is said here, with why.
    if let Some(reason) = state.memory_guard.memory_off_reason() {
        body["memory"] = serde_json::Value::String("off".to_string());
        body["memory_reason"] = serde_json::Value::String(reason);
    } else if store {
        body["memory"] = serde_json::Value::String("on".to_string());
    }
    // Recall by meaning: its embedder, or why recall goes by words alone (still ready).
    if let Some(memory) = state.memory() {
        let embedding = &memory.embedding;
        body["recall"] = serde_json::Value::String(
            if embedding.space().is_some() {
                "hybrid"
            } else {
                "lexical"
            }
            .to_string(),
        );
        if let Some((space, _)) = embedding.space() {
            body["embedder"] = serde_json::Value::String(space.to_string());
        }
        if let Some(why) = embedding.unavailable() {
            body["embedder_reason"] = serde_json::Value::String(why.to_string());
        }
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
    fn routes_are_named_from_the_target() {
        let cases = [
            (Method::POST, "/v1/chat/completions", Route::Chat),
            (
                Method::POST,
                "/agents/a/conversations/c/v1/chat/completions",
                Route::Chat,
            ),
            (Method::POST, "/v1/responses", Route::Responses),
            (Method::POST, "/v1/messages", Route::Messages),
            (
                Method::POST,
                "/v1/messages/count_tokens",
                Route::Passthrough,
            ),
            (Method::GET, "/v1/responses/resp_1", Route::Passthrough),
            (Method::GET, "/v1/models", Route::Passthrough),
            (Method::GET, "/v1/chat/completions", Route::Passthrough),
            (Method::GET, "/healthz", Route::Health),
            (Method::GET, "/readyz", Route::Health),
            (Method::GET, "/metrics", Route::Metrics),
            (Method::GET, "/admin/v1/conversations", Route::Admin),
            (Method::GET, "/nope", Route::Other),
        ];
        for (method, path, route) in cases {
            assert_eq!(Target::of(&method, path).route(), route, "{path}");
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
