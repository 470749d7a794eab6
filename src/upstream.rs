//! The upstream: one pooled HTTP/HTTPS client, the mapping of `/v1/X` onto the configured base
//! URL, the header rules for both directions, and the one forward path every upstream call
//! takes ([`Upstream::forward`]): pass-through, memory, and memproxy's own model calls (the
//! [`ModelCall`] implementation below).
//!
//! Time limits: `upstream.timeout` bounds the wait for a response head; every response body
//! is an [`IdleTimeout`] (`upstream.idle_timeout` between two frames), and a body memproxy
//! reads whole ([`Upstream::read_answer`]) must come within `upstream.read_timeout`. A client's
//! body streamed upstream that stalls (see `proxy::passthrough`) is reported as
//! [`UpstreamError::RequestBodyStalled`], the client's fault, not the upstream's.
//!
//! Header rules: hop-by-hop headers are dropped both ways; every `x-memory-*` request header is
//! consumed by memproxy and never sent on; everything else (`x-stainless-*`,
//! `OpenAI-Organization`, …) is forwarded. When memproxy holds an upstream key, it replaces the
//! client's `Authorization`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, Uri};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::body::{CollectError, IdleTimeout, ProxyBody, Stalled, collect_limited, full};
use crate::config::{KeyHeader, UpstreamConfig};
use crate::model::{Credentials, ModelCall, ModelError, ModelFuture, ModelReply, ModelRequest};

/// The header memproxy's own upstream calls carry (`summary`), so upstream logs (and the test
/// mock) can tell them apart.
pub const TASK_HEADER: &str = "x-memproxy-task";

/// The largest answer memproxy reads from one of its own model calls.
const MODEL_REPLY_LIMIT: usize = 16 * 1024 * 1024;

/// Why an upstream call failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("the request path is not valid")]
    BadPath,
    #[error("the upstream could not be reached")]
    Unreachable(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the upstream did not answer within {seconds} seconds")]
    Timeout { seconds: u64 },
    /// The head came, the rest of an answer memproxy reads did not in time.
    #[error("the upstream's answer was not received within {} seconds", .within.as_secs_f64())]
    ReadTimeout { within: Duration },
    /// The client's body, streamed upstream, stalled: the upstream request was cut.
    #[error("the request body stalled for {} seconds", .idle.as_secs_f64())]
    RequestBodyStalled { idle: Duration },
}

/// An upstream response body: failing with `body::Stalled` when a frame takes longer than
/// `upstream.idle_timeout` to come.
pub type UpstreamBody = IdleTimeout<Incoming>;

/// One request to send upstream.
pub struct Forward<'a> {
    pub method: Method,
    /// The client's path, `/v1/...` (the path form's prefix already removed).
    pub path: &'a str,
    pub query: Option<&'a str>,
    /// The client's headers: the header rules choose what goes on.
    pub headers: &'a HeaderMap,
    pub body: ProxyBody,
    /// The body's length, when memproxy made the body (it is sent as `Content-Length`).
    pub body_len: Option<usize>,
    /// memproxy reads the reply: ask for an uncompressed body (the client's leg is local).
    pub read_reply: bool,
    /// memproxy's own call: sent as `x-memproxy-task`.
    pub task: Option<&'static str>,
}

/// The upstream's response head (its headers already filtered for the client) and body, and
/// how long the head took.
pub struct Forwarded {
    pub response: Response<UpstreamBody>,
    pub elapsed: Duration,
}

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
    /// (The URL is not quoted: it may hold a password.)
    #[error("the upstream base URL is not a valid URI")]
    BadBaseUrl,
}

type PooledClient = Client<HttpsConnector<HttpConnector>, ProxyBody>;

thread_local! {
    /// Set on a thread of `server.runtime = "per-thread"`: its requests go over upstream
    /// connections of its own (a connection's task runs on the runtime that opened it, so a
    /// pool shared by the threads would hand a request to another thread's connection).
    static OWN_POOLS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// This thread's pools, one per [`Upstream`] (by its `id`), made on first use.
    static POOLS: std::cell::RefCell<Vec<(usize, PooledClient)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Makes this thread's upstream requests use connection pools of its own (the per-thread
/// runtime's serving threads, `server/mod.rs`).
pub fn own_pools_on_this_thread() {
    OWN_POOLS.set(true);
}

#[derive(Clone)]
pub struct Upstream {
    client: PooledClient,
    /// The connector, for the pools of per-thread runtimes' threads.
    https: HttpsConnector<HttpConnector>,
    /// Names this upstream (and its clones) among a thread's pools.
    id: Arc<()>,
    /// `scheme://authority` of the base URL.
    origin: String,
    /// The base URL's path without a trailing slash (`/v1`).
    base_path: String,
    /// memproxy's own key, and the header it goes in.
    key: Option<(HeaderName, HeaderValue)>,
    timeout: Duration,
    read_timeout: Duration,
    idle_timeout: Duration,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("origin", &self.origin)
            .field("base_path", &self.base_path)
            .finish_non_exhaustive()
    }
}

/// A pool of upstream connections over `https` (which also speaks plain HTTP).
fn pooled_client(https: HttpsConnector<HttpConnector>) -> PooledClient {
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(256)
        // A pooled connection keeps the read buffer a long answer grew.
        .http1_max_buf_size(crate::body::READ_BUFFER_MAX)
        .build(https)
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
        let client = pooled_client(https.clone());

        let key = match &config.api_key {
            None => None,
            Some(key) => {
                let (name, text) = match config.key_header {
                    KeyHeader::Bearer => (header::AUTHORIZATION, format!("Bearer {}", key.0)),
                    KeyHeader::XApiKey => (HeaderName::from_static("x-api-key"), key.0.clone()),
                };
                let mut value =
                    HeaderValue::try_from(text).map_err(|_| UpstreamSetupError::BadKey)?;
                value.set_sensitive(true);
                Some((name, value))
            }
        };
        let base = &config.base_url;
        let origin = format!("{}://{}", base.scheme(), base.authority());
        if Uri::try_from(format!("{origin}{}/", base.path())).is_err() {
            return Err(UpstreamSetupError::BadBaseUrl);
        }
        Ok(Upstream {
            client,
            https,
            id: Arc::new(()),
            origin,
            base_path: base.path().to_string(),
            key,
            timeout: config.timeout,
            read_timeout: config.read_timeout,
            idle_timeout: config.idle_timeout,
        })
    }

    /// Sends one request upstream: its URI mapped onto the base URL, the header rules applied,
    /// the head awaited at most the configured timeout, the time taken noted on the request's
    /// span (`upstream_ms`), the response's hop-by-hop headers dropped, and its body bounded
    /// by the idle timeout.
    pub async fn forward(&self, forward: Forward<'_>) -> Result<Forwarded, UpstreamError> {
        let mut request = Request::new(forward.body);
        *request.method_mut() = forward.method;
        *request.uri_mut() = self.uri_for(forward.path, forward.query)?;
        let headers = request.headers_mut();
        *headers = self.request_headers(forward.headers);
        if let Some(len) = forward.body_len {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
        if forward.read_reply {
            headers.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }
        if let Some(task) = forward.task {
            headers.insert(TASK_HEADER, HeaderValue::from_static(task));
        }
        let started = Instant::now();
        let result = self.send(request).await;
        let elapsed = started.elapsed();
        tracing::Span::current().record("upstream_ms", elapsed.as_millis() as u64);
        let (mut head, body) = result?.into_parts();
        head.headers = forwardable(&head.headers);
        Ok(Forwarded {
            response: Response::from_parts(head, IdleTimeout::new(body, self.idle_timeout)),
            elapsed,
        })
    }

    /// True when memproxy holds this upstream's key (it replaces every client credential).
    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }

    /// Reads an answer's whole body, at most `limit` bytes, within the read timeout.
    pub async fn read_answer(
        &self,
        body: UpstreamBody,
        limit: usize,
    ) -> Result<Bytes, UpstreamError> {
        collect_limited(body, limit, self.read_timeout)
            .await
            .map_err(|err| match err {
                CollectError::TimedOut { within } => UpstreamError::ReadTimeout { within },
                other => UpstreamError::Unreachable(Box::new(other)),
            })
    }

    /// The upstream URI for a request path `/v1/X` and query `q`: `{base_url}/X?q`, built
    /// in one allocation.
    pub fn uri_for(&self, path: &str, query: Option<&str>) -> Result<Uri, UpstreamError> {
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
        Uri::try_from(uri).map_err(|_| UpstreamError::BadPath)
    }

    /// The headers to send upstream for a client request's headers.
    /// When memproxy holds the upstream key, it is the only credential sent: the client's
    /// `Authorization`, `api-key` and `x-api-key` never reach the upstream.
    pub fn request_headers(&self, incoming: &HeaderMap) -> HeaderMap {
        let mut out = forwardable(incoming);
        drop_memory_headers(&mut out);
        if let Some((name, value)) = &self.key {
            out.remove(header::AUTHORIZATION);
            out.remove("api-key");
            out.remove("x-api-key");
            out.insert(name.clone(), value.clone());
        }
        out
    }

    /// Sends a request, waiting at most the configured timeout for the response head.
    async fn send(&self, request: Request<ProxyBody>) -> Result<Response<Incoming>, UpstreamError> {
        let sent = if OWN_POOLS.get() {
            let id = Arc::as_ptr(&self.id) as usize;
            POOLS.with_borrow_mut(|pools| match pools.iter().find(|(of, _)| *of == id) {
                Some((_, client)) => client.request(request),
                None => {
                    let client = pooled_client(self.https.clone());
                    let sent = client.request(request);
                    pools.push((id, client));
                    sent
                }
            })
        } else {
            self.client.request(request)
        };
        match tokio::time::timeout(self.timeout, sent).await {
            Err(_) => Err(UpstreamError::Timeout {
                seconds: self.timeout.as_secs(),
            }),
            Ok(Err(err)) => match Stalled::caused(&err) {
                Some(stalled) => Err(UpstreamError::RequestBodyStalled { idle: stalled.idle }),
                None => Err(UpstreamError::Unreachable(Box::new(err))),
            },
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// One model call of memproxy's own (a summary, an extraction) over [`Upstream::forward`]:
    /// POSTs the JSON `body` to `path` with the request's credentials and `headers` (kept
    /// where the credentials set the same header), and reads the whole answer; a status other
    /// than 2xx is [`ModelError::Status`].
    pub async fn model_post(
        &self,
        path: &'static str,
        credentials: &Credentials,
        mut headers: HeaderMap,
        body: String,
        task: &'static str,
    ) -> Result<Bytes, ModelError> {
        for (name, value) in credentials.pairs() {
            if let (Ok(name), Ok(mut value)) = (
                HeaderName::try_from(name.as_str()),
                HeaderValue::try_from(value.as_str()),
            ) {
                value.set_sensitive(true);
                headers.insert(name, value);
            }
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let forwarded = self
            .forward(Forward {
                method: Method::POST,
                path,
                query: None,
                headers: &headers,
                body_len: Some(body.len()),
                body: full(body),
                read_reply: true,
                task: Some(task),
            })
            .await
            .map_err(|err| ModelError::Unreachable(err.to_string()))?;
        let status = forwarded.response.status();
        let body = self
            .read_answer(forwarded.response.into_body(), MODEL_REPLY_LIMIT)
            .await
            .map_err(|err| ModelError::Unreachable(err.to_string()))?;
        if !status.is_success() {
            return Err(ModelError::Status(status.as_u16()));
        }
        Ok(body)
    }

    /// One chat completion for memproxy itself, over [`Upstream::model_post`].
    async fn complete(&self, call: ModelRequest) -> Result<ModelReply, ModelError> {
        let messages: Vec<Value> = call
            .messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect();
        let mut body = json!({"model": call.model, "messages": messages, "stream": false});
        if let Some(format) = call.response_format {
            body["response_format"] = format;
        }
        let body = self
            .model_post(
                "/v1/chat/completions",
                &call.credentials,
                HeaderMap::new(),
                body.to_string(),
                call.task,
            )
            .await?;
        let value: Value =
            serde_json::from_slice(&body).map_err(|_| ModelError::BadAnswer("not JSON"))?;
        let text = value
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or(ModelError::BadAnswer("no text"))?
            .to_string();
        let usage = |field: &str| {
            value
                .pointer(&format!("/usage/{field}"))
                .and_then(Value::as_u64)
                .unwrap_or(0)
        };
        Ok(ModelReply {
            text,
            prompt_tokens: usage("prompt_tokens"),
            completion_tokens: usage("completion_tokens"),
        })
    }
}

impl ModelCall for Upstream {
    fn complete(&self, request: ModelRequest) -> ModelFuture<'_> {
        Box::pin(Upstream::complete(self, request))
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
            base_url: crate::config::BaseUrl::parse(base).unwrap(),
            api_key: key.map(|k| Secret(k.to_string())),
            connect_timeout: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            read_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            key_header: KeyHeader::Bearer,
            anthropic: crate::config::from_toml("", &|_| None)
                .unwrap()
                .upstream
                .anthropic,
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
        // With memproxy's own key, no client credential of any kind goes upstream.
        incoming.insert("api-key", HeaderValue::from_static("client-azure"));
        incoming.insert("x-api-key", HeaderValue::from_static("client-anthropic"));
        let keyed = upstream("http://127.0.0.1:1/v1", Some("sk-proxy")).request_headers(&incoming);
        assert!(!keyed.contains_key("api-key") && !keyed.contains_key("x-api-key"));
        let plain = upstream("http://127.0.0.1:1/v1", None).request_headers(&incoming);
        assert_eq!(plain["x-api-key"], "client-anthropic");
    }

    #[test]
    fn an_anthropic_key_replaces_every_client_credential_as_x_api_key() {
        let mut settings = crate::config::from_toml("", &|_| None).unwrap().upstream;
        settings.anthropic.api_key = Some(Secret("sk-ant-proxy".into()));
        let config = Upstream::new(&settings.anthropic_upstream()).unwrap();
        let mut incoming = HeaderMap::new();
        incoming.insert("authorization", HeaderValue::from_static("Bearer client"));
        incoming.insert("x-api-key", HeaderValue::from_static("client-key"));
        incoming.insert("anthropic-version", HeaderValue::from_static("2023-06-01"));
        incoming.insert("anthropic-beta", HeaderValue::from_static("b1"));
        let out = config.request_headers(&incoming);
        assert_eq!(out["x-api-key"], "sk-ant-proxy");
        assert!(!out.contains_key("authorization"));
        assert_eq!(out["anthropic-version"], "2023-06-01");
        assert_eq!(out["anthropic-beta"], "b1");
        assert_eq!(
            config.uri_for("/v1/messages", None).unwrap(),
            "https://api.anthropic.com/v1/messages"
        );
    }
}
