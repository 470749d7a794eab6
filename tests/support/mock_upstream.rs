//! A mock OpenAI-compatible upstream, for tests, the recall evaluation and benchmarks. Never
//! used on the proxy's request path, and not part of the memproxy crate: the integration tests
//! reach it through `tests/support/mod.rs`, and the examples include this file with
//! `#[path = ".../tests/support/mock_upstream.rs"] mod mock_upstream;`. It imports nothing from
//! memproxy: it stands in for an upstream that knows nothing of the proxy.
//!
//! It listens on `127.0.0.1`, records every request it receives, and answers chat completions
//! with JSON or SSE. By default the reply is `reply to: <last user text>`; tests queue scripted
//! replies (text, tool calls, an error status, a delay, a stream cut midway, an answer that
//! stalls after its head) with
//! [`MockUpstream::push`]. `GET /v1/models` lists one model; any other path echoes its method,
//! path and body length as JSON.
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
}

impl Default for MockOptions {
    fn default() -> Self {
        MockOptions {
            stream_chunks: 4,
            chunk_delay: Duration::ZERO,
            record: true,
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    recorded: Mutex<Vec<Recorded>>,
    script: Mutex<VecDeque<Reply>>,
    /// Answers to memproxy's summary calls (requests whose [`TASK_HEADER`] is `summary`).
    summary_script: Mutex<VecDeque<Reply>>,
    /// Answers to memproxy's memory extraction calls (task `extraction`); without one, an
    /// extraction is answered `{"memories":[]}`.
    extraction_script: Mutex<VecDeque<Reply>>,
}

/// A running mock upstream. Dropping it stops the server.
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

    pub fn clear(&self) {
        lock(&self.shared.recorded).clear();
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

    if parts.uri.path().ends_with("/chat/completions") && is_summary_call(&recorded) {
        let request = recorded.json();
        let auto = Reply::Text(default_summary(&last_user_text(&request)));
        let reply = lock(&shared.summary_script)
            .pop_front()
            .unwrap_or(Reply::Auto);
        return chat_answer(&request, reply, auto, options).await;
    }
    if parts.uri.path().ends_with("/chat/completions") && is_extraction_call(&recorded) {
        let request = recorded.json();
        let auto = Reply::Text(r#"{"memories":[]}"#.to_string());
        let reply = lock(&shared.extraction_script)
            .pop_front()
            .unwrap_or(Reply::Auto);
        return chat_answer(&request, reply, auto, options).await;
    }
    if parts.uri.path().ends_with("/chat/completions") {
        let request = recorded.json();
        let auto = Reply::Text(format!("reply to: {}", last_user_text(&request)));
        let reply = lock(&shared.script).pop_front().unwrap_or(Reply::Auto);
        return chat_answer(&request, reply, auto, options).await;
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
    let mut reply = reply;
    while let Reply::Delay(delay, inner) = reply {
        tokio::time::sleep(delay).await;
        reply = *inner;
    }
    if let Reply::Auto = reply {
        reply = auto;
    }
    let stream = request
        .get("stream")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
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
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
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
        Reply::Stall { chunks } if !stream => {
            let start = Ok(r#"{"id": "chatcmpl-mock", "object": "chat.completion", "#.to_string());
            let events = if chunks > 0 { vec![start] } else { Vec::new() };
            channel_response("application/json", events, Duration::ZERO, true)
        }
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
fn sse_events(model: &str, reply: Reply, chunks: usize, usage: bool) -> Vec<Result<String, ()>> {
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
        Reply::Status(..) | Reply::Delay(..) | Reply::Auto => {}
    }
    if usage {
        events.push(Ok(format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        )));
    }
    events.push(Ok("data: [DONE]\n\n".to_string()));
    events
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
