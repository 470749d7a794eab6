//! One benchmark request: what a scenario's requests look like ([`Spec`]), building one, and
//! sending it and reading the answer whole ([`send`]).

use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

/// Every request gives up after this long.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub struct Ctx {
    pub client: HttpClient,
    pub mock_url: Uri,
    pub proxy_url: Uri,
    pub texts: Vec<String>,
    pub counter: AtomicU64,
    pub proxy_pid: u32,
    pub mock_pid: u32,
    pub clk_tck: u64,
}

/// The API a scenario's requests speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Responses,
    /// The Anthropic Messages API.
    Messages,
}

impl Api {
    /// `chat_uri` (a chat completions URI) with this API's path.
    pub fn uri(self, chat_uri: &Uri) -> Uri {
        let path = match self {
            Api::Chat => return chat_uri.clone(),
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        };
        let authority = chat_uri.authority().map_or("", |a| a.as_str());
        format!("http://{authority}{path}")
            .parse()
            .unwrap_or_else(|_| chat_uri.clone())
    }

    /// A request body of this API: `messages` (alternating, from a user message), model's
    /// choice, streamed or not.
    pub fn body(self, messages: Vec<Value>, stream: bool) -> String {
        let mut body = match self {
            Api::Chat => json!({"model": "gpt-4o-mini", "messages": messages}),
            Api::Responses => json!({"model": "gpt-4o-mini", "input": messages, "store": false}),
            Api::Messages => {
                json!({"model": "claude-sonnet-4-6", "max_tokens": 256, "messages": messages})
            }
        };
        if stream {
            body["stream"] = Value::Bool(true);
        }
        body.to_string()
    }
}

/// What one scenario's requests look like.
#[derive(Debug, Clone)]
pub struct Spec {
    pub api: Api,
    pub uri: Uri,
    pub conversation: Option<String>,
    pub persist_false: bool,
    /// Extra headers (diagnostic scenarios turn a memory stage off).
    pub extra_headers: &'static [(&'static str, &'static str)],
    pub stream: bool,
    /// Each closed-loop task sends in a conversation of its own (`conversation` + `-N`).
    pub spread: bool,
    /// The `X-Memory-Status` every answer must carry (`None`: no such header).
    pub expect_memory: Option<&'static str>,
}

pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

pub fn chat_request(spec: &Spec, body: String) -> Result<Request<Full<Bytes>>, String> {
    let mut builder = Request::post(spec.uri.clone()).header("content-type", "application/json");
    builder = match spec.api {
        Api::Messages => builder
            .header("x-api-key", "sk-ant-loadbench")
            .header("anthropic-version", "2023-06-01"),
        Api::Chat | Api::Responses => builder.header("authorization", "Bearer sk-loadbench"),
    };
    if let Some(conversation) = &spec.conversation {
        builder = builder.header("x-memory-conversation-id", conversation.as_str());
    }
    if spec.persist_false {
        builder = builder.header("x-memory-persist", "false");
    }
    for (name, value) in spec.extra_headers {
        builder = builder.header(*name, *value);
    }
    builder
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("building a request: {e}"))
}

/// The body of the `n`-th measured request: one new user message, unique by `n`.
pub fn small_body(ctx: &Ctx, spec: &Spec, n: u64) -> String {
    let text = format!(
        "{} (request {n})",
        ctx.texts[(n % ctx.texts.len() as u64) as usize]
    );
    spec.api
        .body(vec![json!({"role": "user", "content": text})], spec.stream)
}

/// One answer, read whole.
pub struct Outcome {
    pub status: u16,
    pub memory: Option<String>,
    pub turns: Option<u64>,
    pub retrieved: Option<u64>,
    pub prompt_tokens: Option<u64>,
    pub summary: Option<String>,
    /// `X-Memory-Recall`: words and meaning, or words alone and why.
    pub recall: Option<String>,
    pub first_byte: Instant,
    pub done: Instant,
    pub body: Vec<u8>,
}

impl Outcome {
    pub fn snippet(&self) -> String {
        let end = self.body.len().min(200);
        String::from_utf8_lossy(&self.body[..end]).replace('\n', "\\n")
    }

    pub fn body_ok(&self, api: Api, stream: bool) -> bool {
        let has = |needle: &[u8]| self.body.windows(needle.len()).any(|w| w == needle);
        match (api, stream) {
            (Api::Chat, true) => self.body.ends_with(b"data: [DONE]\n\n"),
            (Api::Chat, false) => has(b"\"chat.completion\""),
            (Api::Responses, true) => has(b"event: response.completed"),
            (Api::Responses, false) => has(b"\"object\":\"response\""),
            (Api::Messages, true) => has(b"event: message_stop"),
            (Api::Messages, false) => has(b"\"type\":\"message\""),
        }
    }
}

pub async fn send(client: &HttpClient, request: Request<Full<Bytes>>) -> Result<Outcome, String> {
    let response = client.request(request).await.map_err(|e| error_chain(&e))?;
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let memory = header("x-memory-status");
    let turns = header("x-memory-turns").and_then(|t| t.parse().ok());
    let retrieved = header("x-memory-retrieved").and_then(|t| t.parse().ok());
    let prompt_tokens = header("x-memory-prompt-tokens").and_then(|t| t.parse().ok());
    let summary = header("x-memory-summary");
    let recall = header("x-memory-recall");
    let mut body = response.into_body();
    let mut first_byte = None;
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the body: {}", error_chain(&e)))?;
        if let Some(data) = frame.data_ref()
            && !data.is_empty()
        {
            first_byte.get_or_insert_with(Instant::now);
            bytes.extend_from_slice(data);
        }
    }
    let done = Instant::now();
    Ok(Outcome {
        status,
        memory,
        turns,
        retrieved,
        prompt_tokens,
        summary,
        recall,
        first_byte: first_byte.unwrap_or(done),
        done,
        body: bytes,
    })
}
