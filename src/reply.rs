//! The assistant's reply, read from an upstream answer of any of the three APIs
//! ([`ReplyReader`], [`reply_of`]; the Responses and Anthropic readers are in `wire/`). For
//! chat completions: a JSON body, or the
//! SSE chunks of a stream as they pass (content deltas appended, tool-call deltas merged by
//! index, the finish reason noted). Only choice 0 is kept when `n` > 1.
//!
//! The reply is rebuilt as a clean assistant message (`role`, `content`, `refusal`,
//! `tool_calls`): the fields the API accepts back as input.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::wire::Api;
use crate::wire::anthropic::AnthropicStream;
use crate::wire::responses::ResponsesStream;

/// Builds the reply from stream events.
#[derive(Debug, Default)]
pub struct StreamReply {
    content: String,
    refusal: String,
    tool_calls: BTreeMap<u64, PartialToolCall>,
    finish_reason: Option<String>,
    done: bool,
    failed: bool,
    /// Bytes of text assembled so far, and the most kept (`0`: no limit).
    bytes: usize,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct PartialToolCall {
    id: String,
    kind: String,
    name: String,
    arguments: String,
}

impl StreamReply {
    pub fn new() -> StreamReply {
        StreamReply::default()
    }

    /// A reply assembled up to `max_bytes` of text: past it the reply is unusable (nothing is
    /// stored; the stream still reaches the client) and what was assembled is freed.
    pub fn with_limit(max_bytes: usize) -> StreamReply {
        StreamReply {
            max_bytes,
            ..StreamReply::default()
        }
    }

    /// Takes the data of one SSE event.
    pub fn on_event(&mut self, data: &str) {
        if self.failed {
            return;
        }
        self.read_event(data);
        if self.max_bytes > 0 && self.bytes > self.max_bytes {
            self.fail();
            self.content = String::new();
            self.refusal = String::new();
            self.tool_calls.clear();
        }
    }

    fn read_event(&mut self, data: &str) {
        if data.trim() == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            // A chunk memproxy cannot read: the reply is unknown, so nothing will be stored.
            self.failed = true;
            return;
        };
        if chunk.get("error").is_some() {
            self.failed = true;
            return;
        }
        let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
            return;
        };
        for choice in choices {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_string());
            }
            let Some(delta) = choice.get("delta") else {
                continue;
            };
            if let Some(text) = delta.get("content").and_then(Value::as_str) {
                self.content.push_str(text);
                self.bytes += text.len();
            }
            if let Some(text) = delta.get("refusal").and_then(Value::as_str) {
                self.refusal.push_str(text);
                self.bytes += text.len();
            }
            if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
                for (position, call) in calls.iter().enumerate() {
                    let index = call
                        .get("index")
                        .and_then(Value::as_u64)
                        .unwrap_or(position as u64);
                    let entry = self.tool_calls.entry(index).or_default();
                    if let Some(id) = call.get("id").and_then(Value::as_str) {
                        entry.id.push_str(id);
                    }
                    if let Some(kind) = call.get("type").and_then(Value::as_str) {
                        entry.kind = kind.to_string();
                    }
                    if let Some(function) = call.get("function") {
                        if let Some(name) = function.get("name").and_then(Value::as_str) {
                            entry.name.push_str(name);
                        }
                        if let Some(args) = function.get("arguments").and_then(Value::as_str) {
                            entry.arguments.push_str(args);
                            self.bytes += args.len();
                        }
                    }
                }
            }
        }
    }

    /// Marks the stream unreadable (a line too long, say).
    pub fn fail(&mut self) {
        self.failed = true;
    }

    /// True when the stream ended properly: `[DONE]` or a finish reason, and nothing unreadable.
    pub fn is_complete(&self) -> bool {
        !self.failed && (self.done || self.finish_reason.is_some())
    }

    /// The reply as an assistant message.
    pub fn to_message(&self) -> Box<RawValue> {
        let calls = self
            .tool_calls
            .values()
            .map(|call| {
                json!({
                    "id": call.id,
                    "type": if call.kind.is_empty() { "function" } else { &call.kind },
                    "function": {"name": call.name, "arguments": call.arguments},
                })
            })
            .collect::<Vec<_>>();
        let content = (!self.content.is_empty() || calls.is_empty())
            .then(|| Value::String(self.content.clone()));
        let refusal = (!self.refusal.is_empty()).then(|| self.refusal.clone());
        assistant_message(content, refusal, calls)
    }
}

/// The reply being read from a stream, in the format of the API it answers.
#[derive(Debug)]
pub enum ReplyReader {
    Chat(StreamReply),
    Responses(ResponsesStream),
    Anthropic(AnthropicStream),
}

impl ReplyReader {
    /// A reader for `api` that gives up past `max_bytes` of assembled reply.
    pub fn new(api: Api, max_bytes: usize) -> ReplyReader {
        match api {
            Api::Chat => ReplyReader::Chat(StreamReply::with_limit(max_bytes)),
            Api::Responses => ReplyReader::Responses(ResponsesStream::default()),
            Api::Anthropic => ReplyReader::Anthropic(AnthropicStream::with_limit(max_bytes)),
        }
    }

    pub fn on_event(&mut self, data: &str) {
        match self {
            ReplyReader::Chat(reply) => reply.on_event(data),
            ReplyReader::Responses(reply) => reply.on_event(data),
            ReplyReader::Anthropic(reply) => reply.on_event(data),
        }
    }

    pub fn fail(&mut self) {
        match self {
            ReplyReader::Chat(reply) => reply.fail(),
            ReplyReader::Responses(reply) => reply.fail(),
            ReplyReader::Anthropic(reply) => reply.fail(),
        }
    }

    pub fn is_complete(&self) -> bool {
        match self {
            ReplyReader::Chat(reply) => reply.is_complete(),
            ReplyReader::Responses(reply) => reply.is_complete(),
            ReplyReader::Anthropic(reply) => reply.is_complete(),
        }
    }

    pub fn to_message(&self) -> Box<RawValue> {
        match self {
            ReplyReader::Chat(reply) => reply.to_message(),
            ReplyReader::Responses(reply) => reply.to_message(),
            ReplyReader::Anthropic(reply) => reply.to_message(),
        }
    }
}

/// The reply in a JSON answer of `api`, as a message to store.
pub fn reply_of(api: Api, body: &[u8]) -> Option<Box<RawValue>> {
    match api {
        Api::Chat => reply_from_json(body),
        other => crate::wire::reply_from_json(other, body),
    }
}

/// The reply in a JSON chat-completions response body: `choices[0].message`, cleaned.
pub fn reply_from_json(body: &[u8]) -> Option<Box<RawValue>> {
    let value: Value = serde_json::from_slice(body).ok()?;
    let choices = value.get("choices")?.as_array()?;
    let choice = choices
        .iter()
        .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)?;
    let message = choice.get("message")?.as_object()?;
    let content = match message.get("content") {
        Some(Value::Null) | None => None,
        Some(other) => Some(other.clone()),
    };
    let refusal = message
        .get("refusal")
        .and_then(Value::as_str)
        .map(str::to_string);
    let calls = match message.get("tool_calls") {
        Some(Value::Array(calls)) => calls.clone(),
        _ => Vec::new(),
    };
    Some(assistant_message(content, refusal, calls))
}

/// An assistant message with `role` first, as clients write it.
#[derive(Serialize)]
struct AssistantMessage {
    role: &'static str,
    content: Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<Value>,
}

fn assistant_message(
    content: Option<Value>,
    refusal: Option<String>,
    tool_calls: Vec<Value>,
) -> Box<RawValue> {
    let message = AssistantMessage {
        role: "assistant",
        content: content.unwrap_or(Value::Null),
        refusal,
        tool_calls,
    };
    // Serializing plain values cannot fail.
    serde_json::value::to_raw_value(&message).unwrap_or_else(|_| Box::<RawValue>::default())
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_reply_past_its_limit_is_unusable_and_freed() {
        let mut reply = StreamReply::with_limit(10);
        for _ in 0..5 {
            reply.on_event(r#"{"choices":[{"index":0,"delta":{"content":"abcd"}}]}"#);
        }
        reply.on_event(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#);
        reply.on_event("[DONE]");
        assert!(!reply.is_complete());
        assert!(reply.content.is_empty());
        let mut within = StreamReply::with_limit(10);
        within.on_event(r#"{"choices":[{"index":0,"delta":{"content":"abcd"}}]}"#);
        within.on_event("[DONE]");
        assert!(within.is_complete());
    }

    use super::*;

    fn as_value(raw: &RawValue) -> Value {
        serde_json::from_str(raw.get()).unwrap()
    }

    #[test]
    fn stream_content_and_tool_calls_are_merged() {
        let mut reply = StreamReply::new();
        for data in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"Hel"}},{"index":1,"delta":{"content":"other"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"lo"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"get_","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"weather","arguments":"{\"ci"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_2","function":{"name":"t","arguments":"{}"}},{"index":0,"function":{"arguments":"ty\":1}"}}]}}]}"#,
        ] {
            reply.on_event(data);
        }
        assert!(!reply.is_complete());
        reply.on_event(r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#);
        reply.on_event(r#"{"choices":[],"usage":{"total_tokens":5}}"#);
        reply.on_event("[DONE]");
        assert!(reply.is_complete());
        let message = as_value(&reply.to_message());
        assert_eq!(message["content"], "Hello");
        assert_eq!(message["tool_calls"][0]["id"], "call_1");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            "{\"city\":1}"
        );
        assert_eq!(message["tool_calls"][1]["id"], "call_2");
        assert_eq!(message["tool_calls"][1]["type"], "function");
    }

    #[test]
    fn an_error_or_garbage_chunk_makes_the_reply_unusable() {
        let mut reply = StreamReply::new();
        reply.on_event(r#"{"error":{"message":"overloaded"}}"#);
        reply.on_event("[DONE]");
        assert!(!reply.is_complete());
        let mut reply = StreamReply::new();
        reply.on_event("not json");
        reply.on_event("[DONE]");
        assert!(!reply.is_complete());
    }

    #[test]
    fn json_reply_takes_choice_zero() {
        let body = br#"{"id":"x","choices":[{"index":1,"message":{"role":"assistant","content":"no"}},{"index":0,"message":{"role":"assistant","content":"yes","refusal":null,"annotations":[]},"finish_reason":"stop"}]}"#;
        let message = as_value(&reply_from_json(body).unwrap());
        assert_eq!(
            message,
            serde_json::json!({"role": "assistant", "content": "yes"})
        );
        assert!(reply_from_json(b"{\"object\":\"list\"}").is_none());
    }
}
