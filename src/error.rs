//! The one error type that reaches a client, and its OpenAI-shaped body.
//!
//! Every layer has its own error enum (`store::StoreError`, `config::ConfigError`, …); the
//! request path turns those into [`ProxyError`] at the server edge, where the status is chosen
//! by where the error came from: the client (400/401/404/413), the upstream (502/504) or
//! memproxy itself (500). Messages never carry secrets or message text: they name the field or
//! header that was wrong and what it accepts.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde_json::json;

use crate::body::{ProxyBody, full};

/// An error that becomes an HTTP response with an OpenAI-shaped JSON body:
/// `{"error":{"message","type","param","code"}}`.
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
    #[error("a valid client key is required: send `Authorization: Bearer <key>`")]
    Unauthorized,
    #[error("no route for {method} {path}")]
    NotFound { method: String, path: String },
    #[error("the upstream could not be reached")]
    UpstreamUnreachable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the upstream did not answer within {seconds} seconds")]
    UpstreamTimeout { seconds: u64 },
    #[error("internal error in memproxy")]
    Internal(#[source] Box<dyn std::error::Error + Send + Sync>),
}

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
        match self {
            ProxyError::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            ProxyError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::NotFound { .. } => StatusCode::NOT_FOUND,
            ProxyError::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ProxyError::InvalidRequest { .. } | ProxyError::PayloadTooLarge { .. } => {
                "invalid_request_error"
            }
            ProxyError::Unauthorized => "authentication_error",
            ProxyError::NotFound { .. } => "not_found_error",
            ProxyError::UpstreamUnreachable(_) | ProxyError::UpstreamTimeout { .. } => {
                "upstream_error"
            }
            ProxyError::Internal(_) => "server_error",
        }
    }

    fn code(&self) -> &'static str {
        match self {
            ProxyError::InvalidRequest { code, .. } => code,
            ProxyError::PayloadTooLarge { .. } => "request_too_large",
            ProxyError::Unauthorized => "invalid_api_key",
            ProxyError::NotFound { .. } => "not_found",
            ProxyError::UpstreamUnreachable(_) => "upstream_unreachable",
            ProxyError::UpstreamTimeout { .. } => "upstream_timeout",
            ProxyError::Internal(_) => "internal_error",
        }
    }

    /// The JSON body: `{"error":{"message","type","param","code"}}`.
    pub fn body(&self) -> Bytes {
        let param = match self {
            ProxyError::InvalidRequest { param, .. } => param.clone(),
            _ => None,
        };
        let value = json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": param,
                "code": self.code(),
            }
        });
        Bytes::from(value.to_string())
    }

    pub fn into_response(self) -> Response<ProxyBody> {
        let mut response = Response::new(full(self.body()));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if matches!(self, ProxyError::Unauthorized) {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
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
    fn upstream_errors_map_to_gateway_statuses() {
        assert_eq!(
            ProxyError::UpstreamTimeout { seconds: 3 }.status(),
            StatusCode::GATEWAY_TIMEOUT
        );
        let unreachable = ProxyError::UpstreamUnreachable("refused".into());
        assert_eq!(unreachable.status(), StatusCode::BAD_GATEWAY);
        let value: serde_json::Value = serde_json::from_slice(&unreachable.body()).unwrap();
        assert_eq!(value["error"]["param"], serde_json::Value::Null);
    }
}
