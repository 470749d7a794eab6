//! A mock OpenAI-compatible upstream, for tests, the recall evaluation and benchmarks. Never
//! used on the proxy's request path, and not part of the memproxy crate: the integration tests
//! reach it through `tests/support/mod.rs`, and the examples include this file with
//! `#[path = ".../tests/support/mock_upstream.rs"] mod mock_upstream;`. It imports nothing from
//! memproxy: it stands in for an upstream that knows nothing of the proxy.
//!
//! It listens on `127.0.0.1`, records every request it receives, and answers three wire formats,
//! each with JSON or SSE: chat completions (`/v1/chat/completions`), the Responses API
//! (`/v1/responses`: `response.*` events, `response.completed` carrying the whole response,
//! function calls, reasoning items with `encrypted_content`) and the Anthropic Messages API
//! (`/v1/messages`: `message_start`, `content_block_*`, `message_delta`, `message_stop`;
//! `tool_use`, `thinking` with a signature; `/v1/messages/count_tokens`). By default the reply is `reply to: <last user text>`; tests queue scripted
//! replies (text, tool calls, an error status, a delay, a stream cut midway, an answer that
//! stalls after its head) with
//! [`MockUpstream::push`]. `GET /v1/models` lists one model (in Anthropic's shape when asked with
//! `anthropic-version`); any other path echoes its method, path and body length as JSON.
//!
//! The mock is strict by default: every model call (memproxy's own summary and extraction calls
//! too) is checked against the provider's documented rules ([`strict`], in `strict.rs`) and a
//! request the provider would refuse is refused as the provider would (400, the provider's error
//! JSON), before any scripted reply is used. Refusals are kept ([`MockUpstream::refusals`]) and
//! printed to stderr as one line each (method, path, task and the reason: never a header or a
//! body); one that no test took ([`MockUpstream::take_refusals`]) fails the test when the mock is
//! dropped. A test that forwards an invalid body on purpose turns this off with
//! `MockOptions { strict: false, .. }` or [`MockUpstream::set_strict`].
//!
//! For end-to-end tests in other languages the mock also answers, outside `/v1`:
//! `GET /_mock/requests` (every request recorded: method, path, headers, body as JSON),
//! `GET /_mock/refusals` (every refused request: method, path, api, task, status, message),
//! `POST /_mock/script` (queues a reply: `{"text": ".."}` or
//! `{"tool_calls": [[id, name, arguments]]}`; `{"extraction": {"memories": [..]}}` queues the
//! answer of memproxy's next memory extraction call), `POST /_mock/strict` (`{"strict": false}` turns
//! the checks off) and `POST /_mock/clear` (requests, script and refusals).
// Each target that includes this file uses a different part of it.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, header};
use http_body::{Body, Frame};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

// A sibling file: `#[path]` is relative to this file's directory, so the examples that include
// this file by `#[path]` find it too.
#[path = "strict.rs"]
pub mod strict;

/// The header memproxy marks its own summary calls with (mirrors
/// `memproxy::upstream::TASK_HEADER`); its value is `summary`.
const TASK_HEADER: &str = "x-memproxy-task";

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The mock's response body: one buffer, or SSE events fed by a channel.
type MockBody = UnsyncBoxBody<Bytes, BoxError>;

fn full(bytes: impl Into<Bytes>) -> MockBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A request the mock received.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    /// Path and query.
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Recorded {
    /// The body as JSON (`Null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// A scripted answer to the next chat completion.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A text answer (JSON or SSE, as the request asks).
    Text(String),
    /// Tool calls: `(id, function name, arguments)`.
    ToolCalls(Vec<(String, String, String)>),
    /// An error status with this JSON body.
    Status(u16, String),
    /// Wait, then answer.
    Delay(Duration, Box<Reply>),
    /// A stream that sends `chunks` content chunks, then breaks the connection.
    CutStream { chunks: usize },
    /// A stream that sends content chunks, then ends cleanly without a finish or `[DONE]`.
    UnfinishedStream,
    /// An answer that sends its head, then `chunks` pieces of its body, then nothing more until
    /// the caller gives up and closes the connection. Streamed: the role chunk and `chunks`
    /// content chunks; JSON: `chunks` > 0 sends the start of the JSON object.
    Stall { chunks: usize },
    /// The mock's own default answer (useful inside `Delay`).
    Auto,
    /// `inner`, preceded by an opaque reasoning part: a Responses `reasoning` item with this
    /// `encrypted_content`, or an Anthropic `thinking` block with this `signature` (chat
    /// completions ignore it).
    Reasoning(String, Box<Reply>),
    /// `inner`, preceded by the provider's compaction of the conversation so far (server-side
    /// compaction): an Anthropic `compaction` block with this text as its `content`, or a
    /// Responses `compaction` item with it as `encrypted_content` (chat completions ignore it).
    Compaction(String, Box<Reply>),
}

/// How the default answers are shaped.
#[derive(Debug, Clone)]
pub struct MockOptions {
    /// Content chunks per streamed answer.
    pub stream_chunks: usize,
    /// Pause between streamed chunks.
    pub chunk_delay: Duration,
    /// Keep recorded requests (off for load benchmarks).
    pub record: bool,
    /// Refuse what the provider would refuse (on unless a test forwards an invalid body on
    /// purpose).
    pub strict: bool,
}

impl Default for MockOptions {
    fn default() -> Self {
        MockOptions {
            stream_chunks: 4,
            chunk_delay: Duration::ZERO,
            record: true,
            strict: true,
        }
    }
}

/// A request the mock refused under the provider's rules.
#[derive(Debug, Clone)]
pub struct Refused {
    pub method: String,
    pub path: String,
    /// memproxy's [`TASK_HEADER`] (`summary`, `extraction`), empty for a client's own call.
    pub task: String,
    pub refusal: strict::Refusal,
}

/// The most refusals kept: enough for any test, and flat memory for a long load run.
const MAX_REFUSALS: usize = 1000;

/// The thinking text of every `thinking` block the mock sends (what its signature signs).
pub const THINKING_TEXT: &str = "Let me think.";

#[derive(Debug, Default)]
struct Shared {
    recorded: Mutex<Vec<Recorded>>,
    /// Whether requests are checked ([`MockOptions::strict`], [`MockUpstream::set_strict`]).
    strict: std::sync::atomic::AtomicBool,
    /// The requests refused, oldest first, at most [`MAX_REFUSALS`].
    refusals: Mutex<Vec<Refused>>,
    /// The signatures and encrypted contents the mock sent, which come back unchanged or are
    /// refused.
    issued: Mutex<strict::Issued>,
    script: Mutex<VecDeque<Reply>>,
    /// Answers to memproxy's summary calls (requests whose [`TASK_HEADER`] is `summary`).
    summary_script: Mutex<VecDeque<Reply>>,
    /// Answers to memproxy's memory extraction calls (task `extraction`); without one, an
    /// extraction is answered `{"memories":[]}`.
    extraction_script: Mutex<VecDeque<Reply>>,
    /// Numbers the ids of answers (`resp_mock_N`, `msg_mock_N`).
    next_id: std::sync::atomic::AtomicU64,
    /// Milliseconds every `/v1/embeddings` answer waits ([`MockUpstream::set_embeddings_delay`]).
    embeddings_delay_ms: std::sync::atomic::AtomicU64,
}

/// A running mock upstream. Dropping it stops the server (and fails the test when it refused a
/// request nobody took).
#[derive(Debug)]
pub struct MockUpstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl MockUpstream {
    /// Starts a mock on `127.0.0.1` with an ephemeral port.
    pub async fn start() -> std::io::Result<MockUpstream> {
        MockUpstream::start_with(MockOptions::default(), "127.0.0.1:0".parse().ok()).await
    }

    /// Starts a mock with `options` on `addr` (default `127.0.0.1:0`).
    pub async fn start_with(
        options: MockOptions,
        addr: Option<SocketAddr>,
    ) -> std::io::Result<MockUpstream> {
        let addr = addr.unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 0)));
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        shared
            .strict
            .store(options.strict, std::sync::atomic::Ordering::Relaxed);
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let server_shared = Arc::clone(&shared);
        let options = Arc::new(options);
        tokio::spawn(async move {
            let builder = auto::Builder::new(TokioExecutor::new());
            loop {
                let stream = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((stream, _)) => stream,
                        Err(_) => continue,
                    },
                    _ = &mut stopped => break,
                };
                let _ = stream.set_nodelay(true);
                let shared = Arc::clone(&server_shared);
                let options = Arc::clone(&options);
                let service = service_fn(move |request| {
                    let shared = Arc::clone(&shared);
                    let options = Arc::clone(&options);
                    async move { Ok::<_, Infallible>(answer(&shared, &options, request).await) }
                });
                let connection = builder
                    .serve_connection(TokioIo::new(stream), service)
                    .into_owned();
                tokio::spawn(async move {
                    let _ = connection.await;
                });
            }
        });
        Ok(MockUpstream {
            addr,
            shared,
            _stop: stop,
        })
    }

    /// The base URL to configure memproxy with: `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Queues a scripted answer for the next chat completion.
    pub fn push(&self, reply: Reply) {
        lock(&self.shared.script).push_back(reply);
    }

    /// Queues a scripted answer for the next summary call.
    pub fn push_summary(&self, reply: Reply) {
        lock(&self.shared.summary_script).push_back(reply);
    }

    /// Queues a scripted answer for the next memory extraction call.
    pub fn push_extraction(&self, reply: Reply) {
        lock(&self.shared.extraction_script).push_back(reply);
    }

    /// The memory extraction calls received so far.
    pub fn extraction_requests(&self) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(is_extraction_call)
            .collect()
    }

    /// The summary calls received so far.
    pub fn summary_requests(&self) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(is_summary_call)
            .collect()
    }

    /// Every request received so far.
    pub fn recorded(&self) -> Vec<Recorded> {
        lock(&self.shared.recorded).clone()
    }

    /// The chat-completion requests received so far.
    pub fn chat_requests(&self) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(|r| {
                r.path.ends_with("/chat/completions")
                    && !is_summary_call(r)
                    && !is_extraction_call(r)
            })
            .collect()
    }

    /// The `messages` of the last chat completion received.
    pub fn last_messages(&self) -> Vec<Value> {
        self.chat_requests()
            .last()
            .and_then(|r| r.json().get("messages").and_then(Value::as_array).cloned())
            .unwrap_or_default()
    }

    /// The Responses API requests received so far (summary calls excluded).
    pub fn responses_requests(&self) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(|r| r.path.ends_with("/responses") && !is_summary_call(r))
            .collect()
    }

    /// The Anthropic Messages requests received so far (summary calls excluded).
    pub fn anthropic_requests(&self) -> Vec<Recorded> {
        self.recorded()
            .into_iter()
            .filter(|r| r.path.ends_with("/v1/messages") && !is_summary_call(r))
            .collect()
    }

    /// The base URL an Anthropic SDK takes (no `/v1`): `http://127.0.0.1:PORT`.
    pub fn anthropic_base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn clear(&self) {
        lock(&self.shared.recorded).clear();
    }

    /// Turns the provider's rules on or off for the requests to come (off: anything is answered,
    /// for a test that forwards an invalid body on purpose).
    pub fn set_strict(&self, strict: bool) {
        self.shared
            .strict
            .store(strict, std::sync::atomic::Ordering::Relaxed);
    }

    /// Makes every `/v1/embeddings` answer wait `delay` (a slow provider).
    pub fn set_embeddings_delay(&self, delay: Duration) {
        self.shared.embeddings_delay_ms.store(
            delay.as_millis() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The requests refused so far under the provider's rules.
    pub fn refusals(&self) -> Vec<Refused> {
        lock(&self.shared.refusals).clone()
    }

    /// The requests refused so far, forgotten: a test that expects refusals takes them, so that
    /// dropping the mock does not fail the test.
    pub fn take_refusals(&self) -> Vec<Refused> {
        std::mem::take(&mut *lock(&self.shared.refusals))
    }
}

/// A test whose mock refused a request fails when the mock is dropped, even if it never looked at
/// the answer: memproxy forwarded something the provider would refuse. Refusals a test expects
/// are taken with [`MockUpstream::take_refusals`] first.
impl Drop for MockUpstream {
    fn drop(&mut self) {
        // A test already failing says why; a second panic while unwinding would abort.
        if std::thread::panicking() {
            return;
        }
        let refusals = lock(&self.shared.refusals);
        let reasons: Vec<String> = refusals
            .iter()
            .map(|r| format!("{} {}: {}", r.method, r.path, r.refusal.message))
            .collect();
        assert!(
            reasons.is_empty(),
            "the strict mock upstream refused {} request(s): {reasons:#?}",
            reasons.len()
        );
    }
}

fn is_summary_call(r: &Recorded) -> bool {
    r.headers
        .get(TASK_HEADER)
        .is_some_and(|v| v.as_bytes() == b"summary")
}

fn is_extraction_call(r: &Recorded) -> bool {
    r.headers
        .get(TASK_HEADER)
        .is_some_and(|v| v.as_bytes() == b"extraction")
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn answer(
    shared: &Shared,
    options: &MockOptions,
    request: Request<Incoming>,
) -> Response<MockBody> {
    let (parts, body) = request.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string());
    let recorded = Recorded {
        method: parts.method.to_string(),
        path: path.clone(),
        headers: parts.headers.clone(),
        body: body.clone(),
    };
    if options.record {
        lock(&shared.recorded).push(recorded.clone());
    }
    if let Some(refused) = refuse(shared, &recorded) {
        return refused;
    }
    // `x-mock-cached-tokens: N` makes every usage the answer carries report N cached prompt
    // tokens, in each API's own field.
    let cached = parts
        .headers
        .get("x-mock-cached-tokens")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let recorded_json = |recorded: &Recorded| {
        let mut request = recorded.json();
        if let (Some(n), Some(object)) = (cached, request.as_object_mut()) {
            object.insert(MOCK_CACHED.to_string(), json!(n));
        }
        request
    };

    if parts.uri.path().ends_with("/chat/completions") && is_summary_call(&recorded) {
        let request = recorded_json(&recorded);
        let auto = Reply::Text(default_summary(&last_user_text(&request)));
        let reply = lock(&shared.summary_script)
            .pop_front()
            .unwrap_or(Reply::Auto);
        return chat_answer(&request, reply, auto, options).await;
    }
    if parts.uri.path().ends_with("/chat/completions") && is_extraction_call(&recorded) {
        let request = recorded_json(&recorded);
        let auto = Reply::Text(r#"{"memories":[]}"#.to_string());
        let reply = lock(&shared.extraction_script)
            .pop_front()
            .unwrap_or(Reply::Auto);
        return chat_answer(&request, reply, auto, options).await;
    }
    if parts.uri.path().ends_with("/chat/completions") {
        let request = recorded_json(&recorded);
        let auto = Reply::Text(format!("reply to: {}", last_user_text(&request)));
        let reply = lock(&shared.script).pop_front().unwrap_or(Reply::Auto);
        return chat_answer(&request, reply, auto, options).await;
    }
    if let Some(response) = control(shared, &parts, &body) {
        return response;
    }
    if parts.uri.path().ends_with("/embeddings") {
        let delay = shared
            .embeddings_delay_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        return embeddings_answer(&recorded.json());
    }
    let api_path = parts.uri.path();
    if api_path.ends_with("/responses") || api_path.ends_with("/v1/messages") {
        let request = recorded_json(&recorded);
        let anthropic = api_path.ends_with("/v1/messages");
        let text = if anthropic {
            last_anthropic_user_text(&request)
        } else {
            last_input_text(&request)
        };
        let (reply, auto) = if is_summary_call(&recorded) {
            let reply = lock(&shared.summary_script).pop_front();
            (reply, Reply::Text(default_summary(&text)))
        } else if anthropic && is_extraction_call(&recorded) {
            // Structured output on the Messages API: the scripted JSON becomes the input of
            // the tool the request forces, as a model answers a forced tool call.
            let reply = lock(&shared.extraction_script).pop_front();
            let reply = resolve(
                reply.unwrap_or(Reply::Auto),
                Reply::Text(r#"{"memories":[]}"#.to_string()),
            )
            .await;
            let forced = request
                .pointer("/tool_choice/name")
                .and_then(Value::as_str)
                .map(str::to_string);
            let reply = match (reply, forced) {
                (Reply::Text(json), Some(name)) => {
                    Reply::ToolCalls(vec![("toolu_mock".to_string(), name, json)])
                }
                (reply, _) => reply,
            };
            (Some(reply), Reply::Auto)
        } else {
            let reply = lock(&shared.script).pop_front();
            (reply, Reply::Text(format!("reply to: {text}")))
        };
        let id = shared
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let reply = resolve(reply.unwrap_or(Reply::Auto), auto).await;
        issue(shared, &reply, anthropic);
        return if anthropic {
            anthropic_answer(&request, reply, id, options)
        } else {
            responses_answer(&request, reply, id, options)
        };
    }
    if api_path.ends_with("/v1/messages/count_tokens") {
        let tokens = body.len() / 4 + 1;
        return json_response(StatusCode::OK, json!({"input_tokens": tokens}));
    }
    if api_path.ends_with("/models") && parts.headers.contains_key("anthropic-version") {
        return json_response(
            StatusCode::OK,
            json!({"data": [{"type": "model", "id": "claude-mock", "display_name": "Claude Mock", "created_at": "2025-01-01T00:00:00Z"}],
                   "has_more": false, "first_id": "claude-mock", "last_id": "claude-mock"}),
        );
    }
    if parts.uri.path().ends_with("/models") {
        return json_response(
            StatusCode::OK,
            json!({"object": "list", "data": [{"id": "mock-model", "object": "model", "owned_by": "memproxy"}]}),
        );
    }
    json_response(
        StatusCode::OK,
        json!({"method": recorded.method, "path": path, "body_len": body.len()}),
    )
}

/// The provider's refusal of `recorded` when the mock is strict and the request breaks one of the
/// provider's rules; the refusal is kept and printed (without headers or body).
fn refuse(shared: &Shared, recorded: &Recorded) -> Option<Response<MockBody>> {
    if !shared.strict.load(std::sync::atomic::Ordering::Relaxed) {
        return None;
    }
    let api = strict::Api::of(&recorded.method, recorded.path.as_str())?;
    let beta = recorded
        .headers
        .get_all("anthropic-beta")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>()
        .join(",");
    let refusal = strict::check(api, &beta, &recorded.body, &lock(&shared.issued)).err()?;
    let task = recorded
        .headers
        .get(TASK_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    eprintln!(
        "mock upstream refused {} {}{}: {}",
        recorded.method,
        recorded.path,
        if task.is_empty() {
            String::new()
        } else {
            format!(" (task {task})")
        },
        refusal.message
    );
    let body = refusal.body().to_string();
    let mut refusals = lock(&shared.refusals);
    if refusals.len() < MAX_REFUSALS {
        refusals.push(Refused {
            method: recorded.method.clone(),
            path: recorded.path.clone(),
            task,
            refusal,
        });
    }
    Some(status_response(strict::Refusal::STATUS, body))
}

/// Registers the opaque parts of `reply` the mock is about to send (thinking signatures for the
/// Messages API, encrypted reasoning for Responses), so that they are accepted when they come
/// back unchanged.
fn issue(shared: &Shared, reply: &Reply, anthropic: bool) {
    let mut reply = reply;
    let mut issued = lock(&shared.issued);
    loop {
        reply = match reply {
            Reply::Reasoning(secret, inner) => {
                if anthropic {
                    issued.thinking(secret, THINKING_TEXT);
                } else {
                    issued.encrypted_content(secret);
                }
                inner
            }
            Reply::Compaction(_, inner) => inner,
            _ => break,
        };
    }
}

/// A deterministic stand-in for a model's summary of a summary prompt: a count, the previous
/// summary's lines, and every fourth new message line, so its size behaves like a real
/// summary's (about a quarter of its input).
fn default_summary(prompt: &str) -> String {
    let lines: Vec<&str> = prompt
        .lines()
        .filter(|l| l.starts_with("[earlier turn #"))
        .collect();
    let previous: Vec<&str> = prompt
        .split("Previous summary:\n")
        .nth(1)
        .and_then(|rest| rest.split("\n\nNew messages").next())
        .filter(|p| *p != "(none yet)")
        .map(|p| p.lines().skip(1).step_by(2).collect())
        .unwrap_or_default();
    let mut out = vec![format!("Summary of {} messages.", lines.len())];
    out.extend(previous.iter().map(|l| l.to_string()));
    out.extend(lines.iter().step_by(4).map(|l| {
        let text = l.split("] ").nth(1).unwrap_or(l);
        format!("- {text}")
    }));
    out.join("\n")
}

fn last_user_text(request: &Value) -> String {
    request
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|list| list.iter().rev().find(|m| m["role"] == "user"))
        .map(|m| match &m["content"] {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .unwrap_or_default()
}

async fn chat_answer(
    request: &Value,
    reply: Reply,
    auto: Reply,
    options: &MockOptions,
) -> Response<MockBody> {
    let mut reply = resolve(reply, auto).await;
    // Chat completions have no opaque reasoning part, nor compaction.
    while let Reply::Reasoning(_, inner) | Reply::Compaction(_, inner) = reply {
        reply = *inner;
    }
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        .then(|| chat_usage(request));
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("mock-model")
        .to_string();
    match reply {
        Reply::Status(status, body) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut response = Response::new(full(body));
            *response.status_mut() = status;
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            response
        }
        Reply::Text(text) if !stream => json_response(
            StatusCode::OK,
            json!({
                "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": null}, "finish_reason": "stop"}],
                "usage": chat_usage(request),
            }),
        ),
        Reply::ToolCalls(calls) if !stream => {
            let calls: Vec<Value> = calls
                .iter()
                .map(|(id, name, args)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect();
            json_response(
                StatusCode::OK,
                json!({
                    "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": calls}, "finish_reason": "tool_calls"}],
                }),
            )
        }
        Reply::Stall { chunks } if !stream => stalled_json(
            r#"{"id": "chatcmpl-mock", "object": "chat.completion", "#,
            chunks,
        ),
        Reply::Stall { chunks } => channel_response(
            "text/event-stream",
            sse_events(
                &model,
                Reply::Stall { chunks },
                options.stream_chunks,
                usage,
            ),
            options.chunk_delay,
            true,
        ),
        other => sse_response(
            sse_events(&model, other, options.stream_chunks, usage),
            options.chunk_delay,
        ),
    }
}

/// The SSE events of a streamed answer; `Err(())` marks where the stream breaks.
fn sse_events(
    model: &str,
    reply: Reply,
    chunks: usize,
    usage: Option<Value>,
) -> Vec<Result<String, ()>> {
    let chunk = |delta: Value, finish: Value| {
        Ok(format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
        ))
    };
    let mut events = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    let text_chunks = |text: &str| -> Vec<String> {
        let chars: Vec<char> = text.chars().collect();
        let size = chars.len().div_ceil(chunks.max(1)).max(1);
        chars.chunks(size).map(|c| c.iter().collect()).collect()
    };
    match reply {
        Reply::Text(text) => {
            for piece in text_chunks(&text) {
                events.push(chunk(json!({"content": piece}), Value::Null));
            }
            events.push(chunk(json!({}), json!("stop")));
        }
        Reply::ToolCalls(calls) => {
            for (index, (id, name, args)) in calls.iter().enumerate() {
                events.push(chunk(
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                    Value::Null,
                ));
                for piece in text_chunks(args) {
                    events.push(chunk(
                        json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}),
                        Value::Null,
                    ));
                }
            }
            events.push(chunk(json!({}), json!("tool_calls")));
        }
        Reply::CutStream { chunks: n } => {
            for i in 0..n {
                events.push(chunk(json!({"content": format!("part{i} ")}), Value::Null));
            }
            events.push(Err(()));
            return events;
        }
        Reply::UnfinishedStream => {
            events.push(chunk(json!({"content": "half an answer"}), Value::Null));
            return events;
        }
        Reply::Stall { chunks: n } => {
            for i in 0..n {
                events.push(chunk(json!({"content": format!("part{i} ")}), Value::Null));
            }
            return events;
        }
        Reply::Status(..)
        | Reply::Delay(..)
        | Reply::Auto
        | Reply::Reasoning(..)
        | Reply::Compaction(..) => {}
    }
    if let Some(usage) = usage {
        events.push(Ok(format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [],
                   "usage": usage})
        )));
    }
    events.push(Ok("data: [DONE]\n\n".to_string()));
    events
}

/// The field `answer` puts into a request's JSON for `x-mock-cached-tokens`.
const MOCK_CACHED: &str = "__mock_cached_tokens";

/// The cached prompt tokens the answer to `request` reports (0 unless asked for).
fn mock_cached(request: &Value) -> u64 {
    request
        .get(MOCK_CACHED)
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// A chat completion's `usage`, with `prompt_tokens_details.cached_tokens`.
fn chat_usage(request: &Value) -> Value {
    let cached = mock_cached(request);
    json!({"prompt_tokens": 1 + cached, "completion_tokens": 1, "total_tokens": 2 + cached,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

fn json_response(status: StatusCode, value: Value) -> Response<MockBody> {
    let mut response = Response::new(full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

fn sse_response(events: Vec<Result<String, ()>>, delay: Duration) -> Response<MockBody> {
    channel_response("text/event-stream", events, delay, false)
}

/// A response whose body sends `events` as they come (`delay` apart), then ends; with `stall`,
/// it sends nothing more and never ends, until the caller drops the body. SSE responses carry
/// `Cache-Control: no-cache`.
fn channel_response(
    content_type: &'static str,
    events: Vec<Result<String, ()>>,
    delay: Duration,
    stall: bool,
) -> Response<MockBody> {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(4);
    tokio::spawn(async move {
        for (i, event) in events.into_iter().enumerate() {
            if i > 0 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let frame = match event {
                Ok(text) => Ok(Frame::data(Bytes::from(text))),
                Err(()) => Err(BoxError::from("mock: stream cut")),
            };
            if tx.send(frame).await.is_err() {
                return;
            }
        }
        if stall {
            tx.closed().await;
        }
    });
    let mut response = Response::new(ChannelBody { rx }.boxed_unsync());
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    if content_type == "text/event-stream" {
        response.headers_mut().insert(
            header::CACHE_CONTROL,
            header::HeaderValue::from_static("no-cache"),
        );
    }
    response
}

/// A body fed by a channel: frames go out as they are sent.
struct ChannelBody {
    rx: mpsc::Receiver<Result<Frame<Bytes>, BoxError>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.rx.poll_recv(cx)
    }
}

/// A JSON answer that sends its head, then `start` when `chunks` > 0, then stalls.
fn stalled_json(start: &str, chunks: usize) -> Response<MockBody> {
    let events = if chunks > 0 {
        vec![Ok(start.to_string())]
    } else {
        Vec::new()
    };
    channel_response("application/json", events, Duration::ZERO, true)
}

/// Waits out `Delay`s and turns `Auto` into `auto` (also under a `Reasoning`).
async fn resolve(mut reply: Reply, auto: Reply) -> Reply {
    while let Reply::Delay(delay, inner) = reply {
        tokio::time::sleep(delay).await;
        reply = *inner;
    }
    match reply {
        Reply::Auto => auto,
        Reply::Reasoning(secret, inner) => {
            Reply::Reasoning(secret, Box::new(Box::pin(resolve(*inner, auto)).await))
        }
        Reply::Compaction(summary, inner) => {
            Reply::Compaction(summary, Box::new(Box::pin(resolve(*inner, auto)).await))
        }
        other => other,
    }
}

/// The control routes under `/_mock/` for tests that reach the mock over HTTP only.
fn control(
    shared: &Shared,
    parts: &http::request::Parts,
    body: &Bytes,
) -> Option<Response<MockBody>> {
    match (parts.method.as_str(), parts.uri.path()) {
        ("GET", "/_mock/requests") => {
            let list: Vec<Value> = lock(&shared.recorded)
                .iter()
                .filter(|r| !r.path.starts_with("/_mock/"))
                .map(|r| {
                    let headers: serde_json::Map<String, Value> = r
                        .headers
                        .iter()
                        .map(|(k, v)| {
                            (k.as_str().to_string(), json!(v.to_str().unwrap_or_default()))
                        })
                        .collect();
                    json!({"method": r.method, "path": r.path, "headers": headers, "body": r.json()})
                })
                .collect();
            Some(json_response(StatusCode::OK, Value::Array(list)))
        }
        ("POST", "/_mock/script") => {
            let value: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            // `{"extraction": {"memories": [...]}}` answers memproxy's next extraction call.
            if let Some(extraction) = value.get("extraction") {
                lock(&shared.extraction_script).push_back(Reply::Text(extraction.to_string()));
                return Some(json_response(StatusCode::OK, json!({"queued": true})));
            }
            let reply = if let Some(text) = value.get("text").and_then(Value::as_str) {
                Reply::Text(text.to_string())
            } else if let Some(calls) = value.get("tool_calls").and_then(Value::as_array) {
                Reply::ToolCalls(
                    calls
                        .iter()
                        .map(|c| {
                            let field = |i: usize| c[i].as_str().unwrap_or_default().to_string();
                            (field(0), field(1), field(2))
                        })
                        .collect(),
                )
            } else {
                return Some(json_response(
                    StatusCode::BAD_REQUEST,
                    json!({"error": {"message": "script needs `text` or `tool_calls`"}}),
                ));
            };
            lock(&shared.script).push_back(reply);
            Some(json_response(StatusCode::OK, json!({"queued": true})))
        }
        ("GET", "/_mock/refusals") => {
            let list: Vec<Value> = lock(&shared.refusals)
                .iter()
                .map(|r| {
                    json!({"method": r.method, "path": r.path, "api": r.refusal.api.name(),
                           "task": r.task, "status": strict::Refusal::STATUS,
                           "message": r.refusal.message, "error": r.refusal.body()})
                })
                .collect();
            Some(json_response(StatusCode::OK, Value::Array(list)))
        }
        ("POST", "/_mock/strict") => {
            let value: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let Some(on) = value.get("strict").and_then(Value::as_bool) else {
                return Some(json_response(
                    StatusCode::BAD_REQUEST,
                    json!({"error": {"message": "needs `strict`: true or false"}}),
                ));
            };
            shared
                .strict
                .store(on, std::sync::atomic::Ordering::Relaxed);
            Some(json_response(StatusCode::OK, json!({"strict": on})))
        }
        ("POST", "/_mock/clear") => {
            lock(&shared.recorded).clear();
            lock(&shared.script).clear();
            lock(&shared.refusals).clear();
            Some(json_response(StatusCode::OK, json!({"cleared": true})))
        }
        _ => None,
    }
}

/// The text of a content value: a string, or the `text` of its parts.
fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// The last user text of a Responses request: `input` as a string, or its last user message
/// item; a last `function_call_output` gives `tool said: <output>`.
fn last_input_text(request: &Value) -> String {
    match request.get("input") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            if let Some(last) = items.last()
                && last["type"] == "function_call_output"
            {
                return format!("tool said: {}", content_text(&last["output"]));
            }
            items
                .iter()
                .rev()
                .find(|i| i["role"] == "user")
                .map(|i| content_text(&i["content"]))
                .unwrap_or_default()
        }
        _ => String::new(),
    }
}

/// The last user text of an Anthropic request; a last user turn of tool results only gives
/// `tool said: <content>`.
fn last_anthropic_user_text(request: &Value) -> String {
    let Some(last) = request
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|list| list.iter().rev().find(|m| m["role"] == "user"))
    else {
        return String::new();
    };
    let text = content_text(&last["content"]);
    if !text.is_empty() {
        return text;
    }
    last["content"]
        .as_array()
        .and_then(|blocks| blocks.iter().find(|b| b["type"] == "tool_result"))
        .map(|b| format!("tool said: {}", content_text(&b["content"])))
        .unwrap_or_default()
}

fn text_pieces(text: &str, chunks: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(chunks.max(1)).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}

fn status_response(status: u16, body: String) -> Response<MockBody> {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

/// One named SSE event.
fn named_event(name: &str, data: &Value) -> Result<String, ()> {
    Ok(format!("event: {name}\ndata: {data}\n\n"))
}

/// The Responses API output items of a reply.
fn responses_output(reply: &Reply, id: u64) -> Vec<Value> {
    match reply {
        Reply::Reasoning(secret, inner) => {
            let mut items = vec![json!({"type": "reasoning", "id": format!("rs_mock_{id}"), "summary": [], "encrypted_content": secret})];
            items.extend(responses_output(inner, id));
            items
        }
        Reply::Compaction(summary, inner) => {
            let mut items = vec![json!({"type": "compaction", "id": format!("cmp_mock_{id}"), "encrypted_content": summary})];
            items.extend(responses_output(inner, id));
            items
        }
        Reply::ToolCalls(calls) => calls
            .iter()
            .enumerate()
            .map(|(i, (call_id, name, args))| {
                json!({"type": "function_call", "id": format!("fc_mock_{id}_{i}"), "call_id": call_id, "name": name, "arguments": args, "status": "completed"})
            })
            .collect(),
        Reply::Text(text) => vec![json!({
            "type": "message", "id": format!("msg_mock_{id}"), "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        })],
        _ => Vec::new(),
    }
}

/// A whole Responses API response object.
fn response_object(request: &Value, id: u64, status: &str, output: Vec<Value>) -> Value {
    let model = request.get("model").cloned().unwrap_or(json!("mock-model"));
    json!({
        "id": format!("resp_mock_{id}"), "object": "response", "created_at": 1, "status": status,
        "model": model, "output": output, "error": null, "incomplete_details": null,
        "instructions": request.get("instructions").cloned().unwrap_or(Value::Null),
        "metadata": {}, "parallel_tool_calls": true, "temperature": 1.0, "top_p": 1.0,
        "tool_choice": "auto", "tools": request.get("tools").cloned().unwrap_or(json!([])),
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": false,
        "usage": {"input_tokens": 1 + mock_cached(request), "input_tokens_details": {"cached_tokens": mock_cached(request)},
                  "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2 + mock_cached(request)},
    })
}

fn responses_answer(
    request: &Value,
    reply: Reply,
    id: u64,
    options: &MockOptions,
) -> Response<MockBody> {
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if let Reply::Status(status, body) = reply {
        return status_response(status, body);
    }
    if !stream {
        if let Reply::Stall { chunks } = reply {
            return stalled_json(r#"{"id": "resp_mock", "object": "response", "#, chunks);
        }
        let output = responses_output(&reply, id);
        return json_response(
            StatusCode::OK,
            response_object(request, id, "completed", output),
        );
    }
    let stall = matches!(reply, Reply::Stall { .. });
    channel_response(
        "text/event-stream",
        responses_events(request, reply, id, options.stream_chunks),
        options.chunk_delay,
        stall,
    )
}

/// The events of a streamed Responses API answer; `Err(())` marks where the stream breaks.
fn responses_events(
    request: &Value,
    reply: Reply,
    id: u64,
    chunks: usize,
) -> Vec<Result<String, ()>> {
    let mut seq = 0u64;
    let mut event = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        data["sequence_number"] = json!(seq);
        seq += 1;
        named_event(name, &data)
    };
    let mut events = vec![event(
        "response.created",
        json!({"response": response_object(request, id, "in_progress", Vec::new())}),
    )];
    let (output, cut) = match &reply {
        Reply::CutStream { chunks } | Reply::Stall { chunks } => {
            let parts: Vec<String> = (0..*chunks).map(|i| format!("part{i} ")).collect();
            (responses_output(&Reply::Text(parts.concat()), id), true)
        }
        Reply::UnfinishedStream => (
            responses_output(&Reply::Text("half an answer".into()), id),
            true,
        ),
        other => (responses_output(other, id), false),
    };
    for (index, item) in output.iter().enumerate() {
        let item_id = item["id"].clone();
        match item["type"].as_str() {
            Some("message") => {
                let text = item["content"][0]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let mut open = item.clone();
                open["status"] = json!("in_progress");
                open["content"] = json!([]);
                events.push(event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": open}),
                ));
                events.push(event("response.content_part.added", json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})));
                for piece in text_pieces(&text, chunks) {
                    events.push(event("response.output_text.delta", json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": piece, "logprobs": []})));
                }
                if cut {
                    break;
                }
                events.push(event("response.output_text.done", json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text, "logprobs": []})));
                events.push(event("response.content_part.done", json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": item["content"][0]})));
            }
            Some("function_call") => {
                let mut open = item.clone();
                open["status"] = json!("in_progress");
                open["arguments"] = json!("");
                events.push(event(
                    "response.output_item.added",
                    json!({"output_index": index, "item": open}),
                ));
                let args = item["arguments"].as_str().unwrap_or_default();
                for piece in text_pieces(args, chunks) {
                    events.push(event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id, "output_index": index, "delta": piece}),
                    ));
                }
                events.push(event(
                    "response.function_call_arguments.done",
                    json!({"item_id": item_id, "output_index": index, "arguments": args}),
                ));
            }
            _ => events.push(event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            )),
        }
        events.push(event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
    }
    match reply {
        Reply::CutStream { .. } => events.push(Err(())),
        Reply::UnfinishedStream | Reply::Stall { .. } => {}
        _ => events.push(event(
            "response.completed",
            json!({"response": response_object(request, id, "completed", output)}),
        )),
    }
    events
}

/// The Anthropic content blocks of a reply.
fn anthropic_content(reply: &Reply) -> Vec<Value> {
    match reply {
        Reply::Reasoning(secret, inner) => {
            let mut blocks =
                vec![json!({"type": "thinking", "thinking": THINKING_TEXT, "signature": secret})];
            blocks.extend(anthropic_content(inner));
            blocks
        }
        Reply::Compaction(summary, inner) => {
            let mut blocks = vec![json!({"type": "compaction", "content": summary})];
            blocks.extend(anthropic_content(inner));
            blocks
        }
        Reply::ToolCalls(calls) => calls
            .iter()
            .map(|(call_id, name, args)| {
                let input: Value = serde_json::from_str(args).unwrap_or_else(|_| json!({}));
                json!({"type": "tool_use", "id": call_id, "name": name, "input": input})
            })
            .collect(),
        Reply::Text(text) => vec![json!({"type": "text", "text": text})],
        _ => Vec::new(),
    }
}

fn anthropic_message(request: &Value, id: u64, content: Vec<Value>, stop: Value) -> Value {
    let model = request
        .get("model")
        .cloned()
        .unwrap_or(json!("claude-mock"));
    json!({
        "id": format!("msg_mock_{id}"), "type": "message", "role": "assistant", "model": model,
        "content": content, "stop_reason": stop, "stop_sequence": null,
        "usage": {"input_tokens": 1, "output_tokens": 1,
                  "cache_read_input_tokens": mock_cached(request), "cache_creation_input_tokens": 0},
    })
}

fn stop_reason(content: &[Value]) -> &'static str {
    if content.iter().any(|b| b["type"] == "tool_use") {
        "tool_use"
    } else {
        "end_turn"
    }
}

fn anthropic_answer(
    request: &Value,
    reply: Reply,
    id: u64,
    options: &MockOptions,
) -> Response<MockBody> {
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if let Reply::Status(status, body) = reply {
        return status_response(status, body);
    }
    if !stream {
        if let Reply::Stall { chunks } = reply {
            return stalled_json(r#"{"id": "msg_mock", "type": "message", "#, chunks);
        }
        let content = anthropic_content(&reply);
        let stop = json!(stop_reason(&content));
        return json_response(
            StatusCode::OK,
            anthropic_message(request, id, content, stop),
        );
    }
    let stall = matches!(reply, Reply::Stall { .. });
    channel_response(
        "text/event-stream",
        anthropic_events(request, reply, id, options.stream_chunks),
        options.chunk_delay,
        stall,
    )
}

/// The events of a streamed Anthropic answer; `Err(())` marks where the stream breaks.
fn anthropic_events(
    request: &Value,
    reply: Reply,
    id: u64,
    chunks: usize,
) -> Vec<Result<String, ()>> {
    let event = |name: &str, mut data: Value| {
        data["type"] = json!(name);
        named_event(name, &data)
    };
    let mut start = anthropic_message(request, id, Vec::new(), Value::Null);
    start["usage"]["output_tokens"] = json!(0);
    let mut events = vec![
        event("message_start", json!({"message": start})),
        event("ping", json!({})),
    ];
    let (content, cut) = match &reply {
        Reply::CutStream { chunks } | Reply::Stall { chunks } => {
            let parts: Vec<String> = (0..*chunks).map(|i| format!("part{i} ")).collect();
            (anthropic_content(&Reply::Text(parts.concat())), true)
        }
        Reply::UnfinishedStream => (
            anthropic_content(&Reply::Text("half an answer".into())),
            true,
        ),
        other => (anthropic_content(other), false),
    };
    for (index, block) in content.iter().enumerate() {
        match block["type"].as_str() {
            Some("text") => {
                events.push(event(
                    "content_block_start",
                    json!({"index": index, "content_block": {"type": "text", "text": ""}}),
                ));
                for piece in text_pieces(block["text"].as_str().unwrap_or_default(), chunks) {
                    events.push(event(
                        "content_block_delta",
                        json!({"index": index, "delta": {"type": "text_delta", "text": piece}}),
                    ));
                }
                if cut {
                    break;
                }
            }
            Some("thinking") => {
                events.push(event("content_block_start", json!({"index": index, "content_block": {"type": "thinking", "thinking": "", "signature": ""}})));
                events.push(event("content_block_delta", json!({"index": index, "delta": {"type": "thinking_delta", "thinking": block["thinking"]}})));
                events.push(event("content_block_delta", json!({"index": index, "delta": {"type": "signature_delta", "signature": block["signature"]}})));
            }
            Some("compaction") => {
                events.push(event(
                    "content_block_start",
                    json!({"index": index, "content_block": {"type": "compaction", "content": ""}}),
                ));
                events.push(event("content_block_delta", json!({"index": index, "delta": {"type": "compaction_delta", "content": block["content"]}})));
            }
            Some("tool_use") => {
                events.push(event("content_block_start", json!({"index": index, "content_block": {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}})));
                let args = block["input"].to_string();
                for piece in text_pieces(&args, chunks) {
                    events.push(event("content_block_delta", json!({"index": index, "delta": {"type": "input_json_delta", "partial_json": piece}})));
                }
            }
            _ => {}
        }
        events.push(event("content_block_stop", json!({"index": index})));
    }
    match reply {
        Reply::CutStream { .. } => events.push(Err(())),
        Reply::UnfinishedStream | Reply::Stall { .. } => {}
        _ => {
            events.push(event(
                "message_delta",
                json!({"delta": {"stop_reason": stop_reason(&content), "stop_sequence": null}, "usage": {"output_tokens": 1}}),
            ));
            events.push(event("message_stop", json!({})));
        }
    }
    events
}

/// Dimensions of the mock's embeddings.
const MOCK_EMBEDDING_DIMS: usize = 64;

/// `/v1/embeddings` as OpenAI answers it, refusing what OpenAI refuses (no model, an input that
/// is not a string or a list of strings, an empty list or one of more than 2,048, an empty
/// string). A text's vector counts its lower-case words hashed into 64 dimensions: texts that
/// share words are near, others are not (enough to tell whether memproxy uses the vectors).
fn embeddings_answer(request: &Value) -> Response<MockBody> {
    let refuse = |message: &str, param: &str| {
        json_response(
            StatusCode::BAD_REQUEST,
            json!({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": null}}),
        )
    };
    let Some(model) = request["model"].as_str().filter(|m| !m.is_empty()) else {
        return refuse("you must provide a model parameter", "model");
    };
    let inputs: Vec<&str> = match &request["input"] {
        Value::String(text) => vec![text.as_str()],
        Value::Array(items) => match items.iter().map(Value::as_str).collect::<Option<Vec<_>>>() {
            Some(texts) => texts,
            None => return refuse("'input' must be a string or a list of strings", "input"),
        },
        _ => return refuse("'input' is a required property", "input"),
    };
    if inputs.is_empty() || inputs.len() > 2048 {
        return refuse("'input' must hold 1 to 2048 items", "input");
    }
    if inputs.iter().any(|t| t.is_empty()) {
        return refuse("'input' cannot contain an empty string", "input");
    }
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, text)| {
            let mut vector = [0f32; MOCK_EMBEDDING_DIMS];
            for word in text
                .split(|c: char| !c.is_alphanumeric())
                .filter(|w| w.len() > 2)
            {
                let hash = word
                    .to_lowercase()
                    .bytes()
                    .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                    });
                vector[(hash % MOCK_EMBEDDING_DIMS as u64) as usize] += 1.0;
            }
            json!({"object": "embedding", "index": index, "embedding": vector.to_vec()})
        })
        .collect();
    json_response(
        StatusCode::OK,
        json!({"object": "list", "data": data, "model": model,
               "usage": {"prompt_tokens": inputs.len(), "total_tokens": inputs.len()}}),
    )
}
