//! The upstream: one pooled HTTP/HTTPS client, the mapping of `/v1/X` onto the configured base
//! URL, and the header rules for both directions.
//!
//! Header rules: hop-by-hop headers are dropped both ways; every `x-memory-*` request header is
//! consumed by memproxy and never sent on; everything else (`x-stainless-*`,
//! `OpenAI-Organization`, …) is forwarded. When memproxy holds an upstream key, it replaces the
//! client's `Authorization`.

use std::sync::Arc;
use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::body::ProxyBody;
use crate::config::UpstreamConfig;
use crate::error::ProxyError;

/// Headers that describe one connection, not the message: never forwarded.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
];

#[derive(Debug, thiserror::Error)]
pub enum UpstreamSetupError {
    #[error("TLS setup failed: {0}")]
    Tls(#[from] rustls::Error),
    #[error("the upstream key is not a valid header value")]
    BadKey,
}

#[derive(Clone)]
pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    /// `scheme://authority` of the base URL.
    origin: String,
    /// The base URL's path without a trailing slash (`/v1`).
    base_path: String,
    authorization: Option<HeaderValue>,
    timeout: Duration,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("origin", &self.origin)
            .field("base_path", &self.base_path)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    pub fn new(config: &UpstreamConfig) -> Result<Upstream, UpstreamSetupError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        // Native roots add what the machine trusts (a corporate CA); a failure to read them
        // leaves the webpki roots in place.
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();

        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_nodelay(true);
        http.set_connect_timeout(Some(config.connect_timeout));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .wrap_connector(http);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(256)
            .build(https);

        let authorization = match &config.api_key {
            None => None,
            Some(key) => {
                let mut value = HeaderValue::try_from(format!("Bearer {}", key.0))
                    .map_err(|_| UpstreamSetupError::BadKey)?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        let base = &config.base_url;
        let origin = format!(
            "{}://{}",
            base.scheme_str().unwrap_or("https"),
            base.authority().map_or("", |a| a.as_str())
        );
        Ok(Upstream {
            client,
            origin,
            base_path: base.path().trim_end_matches('/').to_string(),
            authorization,
            timeout: config.timeout,
        })
    }

    /// The upstream URI for a request path `/v1/X` and query `q`: `{base_url}/X?q`, built
    /// in one allocation.
    pub fn uri_for(&self, path: &str, query: Option<&str>) -> Result<Uri, ProxyError> {
        let rest = path.strip_prefix("/v1").unwrap_or(path);
        let mut uri = String::with_capacity(
            self.origin.len()
                + self.base_path.len()
                + rest.len()
                + query.map_or(0, |q| q.len() + 1),
        );
        uri.push_str(&self.origin);
        uri.push_str(&self.base_path);
        uri.push_str(rest);
        if let Some(query) = query {
            uri.push('?');
            uri.push_str(query);
        }
        Uri::try_from(uri).map_err(|_| {
            ProxyError::invalid("path", "invalid_path", "the request path is not valid")
        })
    }

    /// The headers to send upstream for a client request's headers.
    pub fn request_headers(&self, incoming: &HeaderMap) -> HeaderMap {
        let mut out = forwardable(incoming);
        drop_memory_headers(&mut out);
        if let Some(auth) = &self.authorization {
            out.insert(header::AUTHORIZATION, auth.clone());
        }
        out
    }

    /// Sends a request, waiting at most the configured timeout for the response head.
    pub async fn send(
        &self,
        request: Request<ProxyBody>,
    ) -> Result<Response<Incoming>, ProxyError> {
        match tokio::time::timeout(self.timeout, self.client.request(request)).await {
            Err(_) => Err(ProxyError::UpstreamTimeout {
                seconds: self.timeout.as_secs(),
            }),
            Ok(Err(err)) => Err(ProxyError::UpstreamUnreachable(Box::new(err))),
            Ok(Ok(response)) => Ok(response),
        }
    }
}

/// The headers of `from` minus the hop-by-hop ones (and those the `Connection` header names).
pub fn forwardable(from: &HeaderMap) -> HeaderMap {
    let named: Vec<HeaderName> = from
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    let mut out = HeaderMap::with_capacity(from.len());
    for (name, value) in from {
        if HOP_BY_HOP.contains(&name.as_str()) || named.contains(name) {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// Drops every `x-memory-*` header: they are memproxy's own and never go upstream.
fn drop_memory_headers(headers: &mut HeaderMap) {
    let memory: Vec<HeaderName> = headers
        .keys()
        .filter(|name| name.as_str().starts_with("x-memory-"))
        .cloned()
        .collect();
    for name in memory {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    fn upstream(base: &str, key: Option<&str>) -> Upstream {
        Upstream::new(&UpstreamConfig {
            base_url: base.parse().unwrap(),
            api_key: key.map(|k| Secret(k.to_string())),
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
        })
        .unwrap()
    }

    #[test]
    fn paths_map_onto_the_base_url() {
        let up = upstream("http://127.0.0.1:8000/v1", None);
        assert_eq!(
            up.uri_for("/v1/chat/completions", None).unwrap(),
            "http://127.0.0.1:8000/v1/chat/completions"
        );
        assert_eq!(
            up.uri_for("/v1/models", Some("limit=2")).unwrap(),
            "http://127.0.0.1:8000/v1/models?limit=2"
        );
        let router = upstream("https://openrouter.example/api/v1", None);
        assert_eq!(
            router.uri_for("/v1/models", None).unwrap(),
            "https://openrouter.example/api/v1/models"
        );
    }

    #[tokio::test]
    async fn headers_are_filtered_and_the_key_replaced() {
        let mut incoming = HeaderMap::new();
        incoming.insert("authorization", HeaderValue::from_static("Bearer client"));
        incoming.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-custom-hop"),
        );
        incoming.insert("x-custom-hop", HeaderValue::from_static("1"));
        incoming.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        incoming.insert("x-memory-conversation-id", HeaderValue::from_static("c"));
        incoming.insert("x-stainless-lang", HeaderValue::from_static("python"));
        incoming.insert("openai-organization", HeaderValue::from_static("org"));

        let plain = upstream("http://127.0.0.1:1/v1", None).request_headers(&incoming);
        assert_eq!(plain["authorization"], "Bearer client");
        assert_eq!(plain["x-stainless-lang"], "python");
        assert_eq!(plain["openai-organization"], "org");
        for gone in [
            "connection",
            "x-custom-hop",
            "keep-alive",
            "x-memory-conversation-id",
        ] {
            assert!(!plain.contains_key(gone), "{gone}");
        }
        let keyed = upstream("http://127.0.0.1:1/v1", Some("sk-proxy")).request_headers(&incoming);
        assert_eq!(keyed["authorization"], "Bearer sk-proxy");
    }
}
