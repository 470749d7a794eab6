//! `/mcp`: the memory tools over MCP's Streamable HTTP transport, served by `rmcp`'s
//! [`StreamableHttpService`] (a tower `Service` over `http::Request`) called from the router,
//! stateless (no sessions: each POST is answered on its own, as JSON), so any replica answers
//! any request.
//!
//! Before the service sees a request, the router has checked its path and client key
//! (`auth.client_keys`, as for chat requests); here its caller is settled as a chat request's
//! (`proxy::identify`: the credential's tenant, 401 without one unless `auth.allow_anonymous`;
//! the `X-Memory-*` headers, each checked) and handed to the tools in the request's
//! extensions. Bodies are bounded by `server.body_limit_bytes` (a larger `Content-Length` is a
//! 413 at once, a larger body a 413 as it streams) and `server.body_read_timeout` (a stalled
//! body fails). The `Host` must be one of `mcp.allowed_hosts` (DNS rebinding).

use std::sync::Arc;

use http::{Request, Response, header};
use hyper::body::Incoming;
use rmcp::transport::StreamableHttpServerConfig;
use rmcp::transport::StreamableHttpService;
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use tower_service::Service;

use super::{Caller, MemoryTools};
use crate::body::{IdleTimeout, ProxyBody, boxed};
use crate::config::Config;
use crate::error::ProxyError;
use crate::proxy::identify::{identify, tenant_of};
use crate::state::AppState;

/// The path the tools are served at.
pub const MCP_PATH: &str = "/mcp";

/// The caller of an MCP request, read as a chat request's identity.
fn caller_of(config: &Config, headers: &http::HeaderMap) -> Result<Caller, ProxyError> {
    let identity = identify(config, headers, None, false)?;
    Ok(Caller {
        tenant: tenant_of(config, headers)?,
        user: identity.user,
        agent: identity.agent,
        settings: identity.settings,
    })
}

/// The transport's settings: stateless, JSON answers, the server's body limit and hosts.
fn transport_config(config: &Config) -> StreamableHttpServerConfig {
    let transport = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_max_request_body_bytes(config.body_limit_bytes);
    if config.mcp.allowed_hosts.is_empty() {
        transport.disable_allowed_hosts()
    } else {
        transport.with_allowed_hosts(config.mcp.allowed_hosts.iter().cloned())
    }
}

/// Answers one request to `/mcp` (the router checked the path and the client key).
pub async fn serve(
    state: &Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let config = &state.config;
    let caller = caller_of(config, request.headers())?;
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > config.body_limit_bytes as u64) {
        return Err(ProxyError::PayloadTooLarge {
            limit: config.body_limit_bytes,
        });
    }
    if state.memory.is_err() {
        return Err(ProxyError::MemoryUnavailable);
    }
    let span = tracing::Span::current();
    span.record("agent", caller.agent.as_str());
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(caller);
    let request = Request::from_parts(parts, IdleTimeout::new(body, config.body_read_timeout));
    let handler_state = Arc::clone(state);
    let mut service = StreamableHttpService::new(
        move || Ok(MemoryTools::new(Arc::clone(&handler_state), None)),
        Arc::new(NeverSessionManager::default()),
        transport_config(config),
    );
    let response = match service.call(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    Ok(response.map(boxed))
}
