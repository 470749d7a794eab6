//! Errors at the HTTP edge, and the one place they become responses.
//!
//! The core returns typed errors (`store::StoreError`, `message::InvalidRequest`,
//! `upstream::UpstreamError`, …); the edge turns them into [`ProxyError`] (the proxy's routes)
//! or `admin::AdminError` (the admin API). Both implement [`ApiError`], and [`respond`] makes
//! every error response: an OpenAI-shaped JSON body `{"error":{"message","type","param","code"}}`
//! with the status chosen by where the error came from: the client (400/401/404/408/413), the
//! upstream (502/504) or memproxy itself (500, 503). Messages never carry secrets or message text:
//! they name the field or header that was wrong and what it accepts.

use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

use crate::body::{ProxyBody, full};
use crate::message::InvalidRequest;
use crate::upstream::UpstreamError;

/// An error a client sees.
pub trait ApiError: std::fmt::Display {
    fn status(&self) -> StatusCode;
    /// `type`: `invalid_request_error`, `authentication_error`, …
    fn kind(&self) -> &'static str;
    fn code(&self) -> &'static str;
    /// The field or header at fault, as the client would spell it.
    fn param(&self) -> Option<&str> {
        None
    }
    /// Headers the status calls for (`WWW-Authenticate`, `Allow`).
    fn headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        Vec::new()
    }
}

/// The JSON body of an error: `{"error":{"message","type","param","code"}}`.
pub fn body_of(err: &dyn ApiError) -> Bytes {
    let value = json!({
        "error": {
            "message": err.to_string(),
            "type": err.kind(),
            "param": err.param(),
            "code": err.code(),
        }
    });
    Bytes::from(value.to_string())
}

/// The response for an error.
pub fn respond(err: &dyn ApiError) -> Response<ProxyBody> {
    let mut response = json_response(err.status(), body_of(err));
    for (name, value) in err.headers() {
        response.headers_mut().insert(name, value);
    }
    response
}

/// A JSON response: every response memproxy makes itself goes through here.
pub fn json_response(status: StatusCode, body: impl Into<Bytes>) -> Response<ProxyBody> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// An error of the proxy's routes.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The request itself is wrong: a bad header, malformed JSON, a missing field.
    #[error("{message}")]
    InvalidRequest {
        message: String,
        /// The field or header at fault, as the client would spell it.
        param: Option<String>,
        code: &'static str,
    },
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// The request adds more to memory than one request may (`[limits]`).
    #[error("{message}")]
    LimitExceeded { message: String, code: &'static str },
    /// The client did not send its body in time (`server.body_read_timeout`).
    #[error("the request body was not received within {} seconds", .within.as_secs_f64())]
    RequestTimeout { within: Duration },
    #[error(
        "a valid client key is required: send it as `Authorization: Bearer <key>`, `api-key` or `x-api-key`"
    )]
    Unauthorized,
    /// A request with a conversation id presents no credential, and `auth.allow_anonymous` is
    /// off: memory could not keep it apart from other tenants.
    #[error(
        "memory needs a credential to tell tenants apart: send `Authorization`, `api-key` or `x-api-key`, or set `auth.allow_anonymous = true` to give requests without one a shared memory"
    )]
    NoCredential,
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    #[error("the upstream could not be reached")]
    UpstreamUnreachable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the upstream did not answer within {seconds} seconds")]
    UpstreamTimeout { seconds: u64 },
    /// The upstream sent its head, then not the rest of its answer in time
    /// (`upstream.read_timeout`, `upstream.idle_timeout`).
    #[error("the upstream's answer was not received within {} seconds", .within.as_secs_f64())]
    UpstreamReadTimeout { within: Duration },
    /// `server.max_connections` connections are open: answered on the connection itself.
    #[error("memproxy is serving its maximum of {max} connections; retry shortly")]
    Overloaded { max: usize },
    /// memproxy runs without a store (it could not be opened at start): what needs memory
    /// itself (the memory tools at `/mcp`) cannot be served.
    #[error("memory is unavailable: the store could not be opened (see /readyz)")]
    MemoryUnavailable,
    #[error("internal error in memproxy")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Seconds a client refused for too many connections is asked to wait (`Retry-After`).
pub const OVERLOADED_RETRY_AFTER_SECONDS: u64 = 1;

impl ProxyError {
    /// A 400 that names the header or field at fault.
    pub fn invalid(
        param: impl Into<String>,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ProxyError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code,
        }
    }

    pub fn status(&self) -> StatusCode {
        ApiError::status(self)
    }

    /// The JSON body: `{"error":{"message","type","param","code"}}`.
    pub fn body(&self) -> Bytes {
        body_of(self)
    }

    pub fn into_response(self) -> Response<ProxyBody> {
        respond(&self)
    }
}

impl ApiError for ProxyError {
    fn status(&self) -> StatusCode {
        match self {
            ProxyError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ProxyError::PayloadTooLarge { .. } | ProxyError::LimitExceeded { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            ProxyError::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Unauthorized | ProxyError::NoCredential => StatusCode::UNAUTHORIZED,
            ProxyError::NotFound { .. } => StatusCode::NOT_FOUND,
            ProxyError::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout { .. } | ProxyError::UpstreamReadTimeout { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ProxyError::Overloaded { .. } | ProxyError::MemoryUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::InvalidRequest { .. }
            | ProxyError::PayloadTooLarge { .. }
            | ProxyError::LimitExceeded { .. }
            | ProxyError::RequestTimeout { .. } => "invalid_request_error",
            ProxyError::Unauthorized | ProxyError::NoCredential => "authentication_error",
            ProxyError::NotFound { .. } => "not_found_error",
            ProxyError::UpstreamUnreachable(_)
            | ProxyError::UpstreamTimeout { .. }
            | ProxyError::UpstreamReadTimeout { .. } => "upstream_error",
            ProxyError::Overloaded { .. }
            | ProxyError::MemoryUnavailable
            | ProxyError::Internal(_) => "server_error",
        }
    }

    fn code(&self) -> &'static str {
        match self {
            ProxyError::InvalidRequest { code, .. } => code,
            ProxyError::PayloadTooLarge { .. } => "request_too_large",
            ProxyError::LimitExceeded { code, .. } => code,
            ProxyError::RequestTimeout { .. } => "request_timeout",
            ProxyError::Unauthorized => "invalid_api_key",
            ProxyError::NoCredential => "missing_credential",
            ProxyError::NotFound { .. } => "not_found",
            ProxyError::UpstreamUnreachable(_) => "upstream_unreachable",
            ProxyError::UpstreamTimeout { .. } | ProxyError::UpstreamReadTimeout { .. } => {
                "upstream_timeout"
            }
            ProxyError::Overloaded { .. } => "server_overloaded",
            ProxyError::MemoryUnavailable => "memory_unavailable",
            ProxyError::Internal(_) => "internal_error",
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            ProxyError::InvalidRequest { param, .. } => param.as_deref(),
            ProxyError::LimitExceeded { .. } => Some("messages"),
            _ => None,
        }
    }

    fn headers(&self) -> Vec<(HeaderName, HeaderValue)> {
        match self {
            ProxyError::Unauthorized | ProxyError::NoCredential => {
                vec![(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"))]
            }
            // The rest of the body may still be on its way: the connection cannot be reused.
            ProxyError::RequestTimeout { .. } => {
                vec![(header::CONNECTION, HeaderValue::from_static("close"))]
            }
            ProxyError::Overloaded { .. } => vec![
                (
                    header::RETRY_AFTER,
                    HeaderValue::from(OVERLOADED_RETRY_AFTER_SECONDS),
                ),
                (header::CONNECTION, HeaderValue::from_static("close")),
            ],
            _ => Vec::new(),
        }
    }
}

impl From<InvalidRequest> for ProxyError {
    fn from(err: InvalidRequest) -> ProxyError {
        ProxyError::InvalidRequest {
            message: err.message,
            param: err.param,
            code: err.code,
        }
    }
}

impl From<UpstreamError> for ProxyError {
    fn from(err: UpstreamError) -> ProxyError {
        match err {
            UpstreamError::BadPath => {
                ProxyError::invalid("path", "invalid_path", "the request path is not valid")
            }
            UpstreamError::Unreachable(source) => ProxyError::UpstreamUnreachable(source),
            UpstreamError::Timeout { seconds } => ProxyError::UpstreamTimeout { seconds },
            UpstreamError::ReadTimeout { within } => ProxyError::UpstreamReadTimeout { within },
            UpstreamError::RequestBodyStalled { idle } => {
                ProxyError::RequestTimeout { within: idle }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped_and_names_the_param() {
        let err = ProxyError::invalid("x-memory-recent-n", "invalid_header", "bad value");
        let value: serde_json::Value = serde_json::from_slice(&err.body()).unwrap();
        assert_eq!(value["error"]["message"], "bad value");
        assert_eq!(value["error"]["type"], "invalid_request_error");
        assert_eq!(value["error"]["param"], "x-memory-recent-n");
        assert_eq!(value["error"]["code"], "invalid_header");
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn an_invalid_request_is_a_400() {
        let err = ProxyError::from(InvalidRequest {
            message: "`stream` must be a boolean".into(),
            param: Some("stream".into()),
            code: "invalid_request_body",
        });
        assert_eq!(err.status(), StatusCode::BAD_REQUEST);
        let value: serde_json::Value = serde_json::from_slice(&err.body()).unwrap();
        assert_eq!(value["error"]["param"], "stream");
    }

    #[test]
    fn upstream_errors_map_to_gateway_statuses() {
        assert_eq!(
            ProxyError::UpstreamTimeout { seconds: 3 }.status(),
            StatusCode::GATEWAY_TIMEOUT
        );
        let unreachable = ProxyError::UpstreamUnreachable("refused".into());
        assert_eq!(unreachable.status(), StatusCode::BAD_GATEWAY);
        let value: serde_json::Value = serde_json::from_slice(&unreachable.body()).unwrap();
        assert_eq!(value["error"]["param"], serde_json::Value::Null);
        let stalled = ProxyError::from(UpstreamError::ReadTimeout {
            within: Duration::from_secs(2),
        });
        assert_eq!(stalled.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(ApiError::code(&stalled), "upstream_timeout");
    }

    #[test]
    fn timeouts_and_overload_say_what_to_do() {
        let slow_client = ProxyError::RequestTimeout {
            within: Duration::from_secs(30),
        };
        assert_eq!(slow_client.status(), StatusCode::REQUEST_TIMEOUT);
        let value: serde_json::Value = serde_json::from_slice(&slow_client.body()).unwrap();
        assert_eq!(value["error"]["code"], "request_timeout");
        assert!(
            value["error"]["message"]
                .as_str()
                .unwrap()
                .contains("30 seconds")
        );
        let response = respond(&slow_client);
        assert_eq!(response.headers()[header::CONNECTION], "close");

        let busy = respond(&ProxyError::Overloaded { max: 2 });
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(busy.headers()[header::RETRY_AFTER], "1");
        assert_eq!(busy.headers()[header::CONNECTION], "close");
    }
}
