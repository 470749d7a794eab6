//! Shared helpers for the integration tests: [`Harness`] starts a test's mock upstream
//! ([`mock_upstream`], in-process), its temporary data directory and a real memproxy in-process on
//! `127.0.0.1:0` against the mock, with the tests' config ([`config_toml`]); [`Proxy`] is that
//! running memproxy, and the HTTP helpers below talk to it. [`admin`] calls the admin API,
//! [`cli`] runs the built binary.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod admin;
pub mod child;
pub mod cli;
pub mod harness;
pub mod mock_upstream;
pub mod redis_server;

pub use self::harness::{Harness, Started};

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use memproxy::config::{self, Config};
use memproxy::identity::{ConversationKey, TenantId};
use memproxy::server;
use memproxy::state::AppState;
use memproxy::store::{Durability, Store, StoreOptions, StoredMessage, lock};
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use self::mock_upstream::MockUpstream;

pub const TOKEN: &str = "sk-test-one";

/// Config for tests whose requests send no credential: memory for them must be allowed.
pub const ANONYMOUS_MEMORY: &str = "[auth]\nallow_anonymous = true\n";

/// The memory budget of the tests' proxies unless `extra_toml` sets one: large, so that no
/// test but those of the budget itself depends on how much memory the test process holds
/// (tests sharing one process, as `cargo test` runs them, add up).
pub fn test_budget(extra_toml: &str) -> &'static str {
    if extra_toml.contains("memory_budget") {
        ""
    } else {
        "memory_budget = \"1GiB\"\n"
    }
}

/// The embedder of the tests' proxies unless `extra_toml` has an `[embedding]` section: none
/// (recall by words), so that only the tests of recall by meaning (`recall_meaning.rs`) load
/// the model, once each.
pub fn test_embedding(extra_toml: &str) -> &'static str {
    if extra_toml.contains("[embedding]") {
        ""
    } else {
        "\n[embedding]\nembedder = \"off\"\n"
    }
}

/// The shutdown grace period of the tests' proxies unless `extra_toml` sets one.
pub fn test_grace(extra_toml: &str) -> &'static str {
    if extra_toml.contains("shutdown_grace") {
        ""
    } else {
        "shutdown_grace = \"PT5S\"\n"
    }
}

/// The runtime shape of the tests' proxies unless `extra_toml` sets one:
/// `MEMPROXY_TEST_RUNTIME=per-thread` runs every proxy of the suite with a runtime per thread
/// (`server.runtime`), the default the shared one.
pub fn test_runtime(extra_toml: &str) -> String {
    match std::env::var("MEMPROXY_TEST_RUNTIME") {
        Ok(shape) if !extra_toml.contains("runtime =") => format!("runtime = \"{shape}\"\n"),
        _ => String::new(),
    }
}

/// The tests' config: `mock` as the upstream (with `upstream_toml` added to `[upstream]`), data
/// under `data_dir`, then `extra_toml`. The template ends inside `[server]`, so bare keys at the
/// start of `extra_toml` are server settings.
pub fn test_config(
    mock: &MockUpstream,
    data_dir: &Path,
    upstream_toml: &str,
    extra_toml: &str,
) -> Config {
    test_config_with_storage(mock, data_dir, upstream_toml, "", extra_toml)
}

/// [`test_config`] with `storage_toml` added to `[storage]`.
pub fn test_config_with_storage(
    mock: &MockUpstream,
    data_dir: &Path,
    upstream_toml: &str,
    storage_toml: &str,
    extra_toml: &str,
) -> Config {
    let text = config_toml(mock, data_dir, upstream_toml, storage_toml, extra_toml);
    config::from_toml(&text, &test_env).unwrap()
}

/// The tests' config as text: `mock` as the upstream (with `upstream_toml` added to
/// `[upstream]`), data under `data_dir` (with `storage_toml` added to `[storage]`; when it is
/// empty and the test run's environment has `MEMPROXY_TEST_BACKEND=fjall`, the store is
/// fjall's), then `extra_toml`. The template ends inside `[server]`, so bare keys at the start
/// of `extra_toml` are server settings.
pub fn config_toml(
    mock: &MockUpstream,
    data_dir: &Path,
    upstream_toml: &str,
    storage_toml: &str,
    extra_toml: &str,
) -> String {
    let storage_toml = if storage_toml.is_empty()
        && std::env::var("MEMPROXY_TEST_BACKEND").as_deref() == Ok("fjall")
    {
        "backend = \"fjall\"\n"
    } else {
        storage_toml
    };
    format!(
        "[upstream]\nbase_url = \"{}\"\ntimeout = \"PT5S\"\nconnect_timeout = \"PT2S\"\n{upstream_toml}\n[storage]\ndata_dir = \"{}\"\n{storage_toml}[server]\n{}{}{}{extra_toml}{}",
        mock.base_url(),
        data_dir.display(),
        test_grace(extra_toml),
        test_budget(extra_toml),
        test_runtime(extra_toml),
        test_embedding(extra_toml)
    )
}

/// `[storage]` for memory in the Redis server at `redis_url` (key prefix `mp:`, short
/// timeouts): one replica of several sharing it.
pub fn redis_storage(redis_url: &str) -> String {
    format!(
        "backend = \"redis\"\nredis_url = \"{redis_url}\"\nredis_key_prefix = \"mp:\"\nredis_connect_timeout = \"PT0.5S\"\nredis_command_timeout = \"PT2S\"\n"
    )
}

/// The environment the tests' configs see: only `TEST_UPSTREAM_KEY` (`sk-proxy-held`), never
/// the real environment.
pub fn test_env(name: &str) -> Option<String> {
    match name {
        "TEST_UPSTREAM_KEY" => Some("sk-proxy-held".to_string()),
        _ => None,
    }
}

/// A running memproxy.
pub struct Proxy {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
    /// What must live as long as the proxy (its mock upstream, its data directory, a
    /// redis-server it uses), dropped after it in this order.
    guards: Vec<Box<dyn std::any::Any + Send + Sync>>,
}

impl Proxy {
    /// Starts memproxy with `extra_toml` appended to a config that points at `mock` and keeps
    /// its data under `data_dir`. The template ends inside `[server]`, so bare keys at the start
    /// of `extra_toml` are server settings.
    pub async fn start(mock: &MockUpstream, data_dir: &Path, extra_toml: &str) -> Proxy {
        Proxy::start_with_upstream(mock, data_dir, "", extra_toml).await
    }

    /// [`Proxy::start`] with memory in the Redis server at `redis_url` (key prefix `mp:`)
    /// instead of sled: one replica of several sharing it.
    pub async fn start_redis(
        mock: &MockUpstream,
        data_dir: &Path,
        redis_url: &str,
        extra_toml: &str,
    ) -> Proxy {
        let storage = redis_storage(redis_url);
        Proxy::start_config(test_config_with_storage(
            mock, data_dir, "", &storage, extra_toml,
        ))
        .await
    }

    /// [`Proxy::start`] with `upstream_toml` added to the `[upstream]` section.
    pub async fn start_with_upstream(
        mock: &MockUpstream,
        data_dir: &Path,
        upstream_toml: &str,
        extra_toml: &str,
    ) -> Proxy {
        Proxy::start_config(test_config(mock, data_dir, upstream_toml, extra_toml)).await
    }

    pub async fn start_config(config: Config) -> Proxy {
        Proxy::start_state(AppState::build(config).unwrap()).await
    }

    /// Serves `state` (built by the test, e.g. over a store of its own engine).
    /// With `server.runtime = "per-thread"`, a runtime per serving thread beside the test's own
    /// runtime, which keeps the background work.
    pub async fn start_state(state: Arc<AppState>) -> Proxy {
        let (stop, stopped) = oneshot::channel::<()>();
        let server_state = Arc::clone(&state);
        let stopped = async {
            let _ = stopped.await;
        };
        let listeners = server::Listeners::bind(&state.config, "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = listeners.local_addr().unwrap();
        let task = tokio::spawn(async move {
            listeners.serve(server_state, stopped).await.unwrap();
        });
        Proxy {
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
            guards: Vec::new(),
        }
    }

    /// Keeps `guard` alive as long as the proxy.
    pub fn keeping(mut self, guard: impl std::any::Any + Send + Sync) -> Proxy {
        self.guards.push(Box::new(guard));
        self
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Stops the server and waits for it to drain and flush; the store can then be reopened.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }

    /// The proxy's store (the tests' proxies open one).
    pub fn store(&self) -> &Store {
        &self.state.memory().unwrap().store
    }

    /// The stored messages of a conversation, read through the store's own API.
    pub fn stored(&self, token: Option<&str>, conversation: &str) -> Vec<StoredMessage> {
        stored_in(self.store(), token, conversation)
    }

    /// The stored messages of the test token's conversation under `agent`.
    pub fn stored_agent(&self, agent: &str, conversation: &str) -> Vec<StoredMessage> {
        stored_by_key(self.store(), &key_for(Some(TOKEN), agent, conversation))
    }
}

pub fn key(token: Option<&str>, conversation: &str) -> ConversationKey {
    key_for(token, "default", conversation)
}

pub fn key_for(token: Option<&str>, agent: &str, conversation: &str) -> ConversationKey {
    ConversationKey {
        tenant: TenantId::from_token(token),
        agent: agent.into(),
        conversation: conversation.into(),
    }
}

/// The store of a stopped proxy, opened again as a restart would.
pub fn reopen(dir: &Path) -> Store {
    let options = StoreOptions {
        durability: Durability::Commit,
        page_cache_bytes: 1 << 20,
        state_cache_bytes: 1 << 20,
    };
    Store::open(dir, options).unwrap()
}

pub fn stored_in(store: &Store, token: Option<&str>, conversation: &str) -> Vec<StoredMessage> {
    stored_by_key(store, &key(token, conversation))
}

/// The stored messages of a conversation as the engine holds them now (not this process's
/// cache: with a shared store, other replicas write too).
pub fn stored_now(store: &Store, key: &ConversationKey) -> Vec<StoredMessage> {
    match store.meta(key).unwrap() {
        Some(meta) => store.all_messages(key, &meta).unwrap(),
        None => Vec::new(),
    }
}

pub fn stored_by_key(store: &Store, key: &ConversationKey) -> Vec<StoredMessage> {
    let handle = store.conversation(key).unwrap();
    let conversation = lock(&handle);
    let turns: Vec<u64> = conversation.entries.iter().map(|e| e.turn).collect();
    store.messages(&conversation, turns).unwrap()
}

/// Every file under `dir`, with its bytes.
pub fn files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(folder) = stack.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                out.push((path, bytes));
            }
        }
    }
    out
}

/// `role:content` of each stored message, for compact comparisons.
pub fn summarize(messages: &[StoredMessage]) -> Vec<String> {
    messages
        .iter()
        .map(|m| {
            let v: Value = serde_json::from_str(m.message.get()).unwrap();
            role_content(&v)
        })
        .collect()
}

pub fn role_content(v: &Value) -> String {
    let content = match &v["content"] {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    };
    let calls = v
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|c| format!(" +{} calls", c.len()))
        .unwrap_or_default();
    format!("{}:{}{}", v["role"].as_str().unwrap_or("?"), content, calls)
}

/// A response read whole.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|_| panic!("not JSON: {:?}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .map(|v| v.to_str().unwrap())
            .unwrap_or_else(|| panic!("no header {name} in {:?}", self.headers))
    }

    /// The error `param` of an OpenAI-shaped error body.
    pub fn error_param(&self) -> String {
        self.json()["error"]["param"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Sends a request and reads the whole answer.
pub async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    let mut request = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request.body(Full::new(body.into())).unwrap();
    let response = client().request(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// Posts a chat completion for `conversation` with the test token and `extra` headers.
pub async fn chat(
    proxy: &Proxy,
    conversation: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> Answer {
    chat_as(proxy, TOKEN, conversation, body, extra).await
}

pub async fn chat_as(
    proxy: &Proxy,
    token: &str,
    conversation: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> Answer {
    let auth = format!("Bearer {token}");
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
        ("x-memory-conversation-id", conversation),
    ];
    headers.extend_from_slice(extra);
    send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &headers,
        body.to_string(),
    )
    .await
}

pub fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

pub fn assistant(text: &str) -> Value {
    json!({"role": "assistant", "content": text})
}

pub fn body(messages: &[Value]) -> Value {
    json!({"model": "gpt-4o-mini", "messages": messages})
}

/// The assistant message of a JSON chat answer, as a client would append it to its history.
pub fn reply_message(answer: &Answer) -> Value {
    let message = &answer.json()["choices"][0]["message"];
    let mut out = json!({"role": "assistant", "content": message["content"]});
    if let Some(calls) = message.get("tool_calls") {
        out["tool_calls"] = calls.clone();
    }
    out
}
