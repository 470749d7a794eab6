//! The Responses API (`POST /v1/responses`) read into neutral messages and written back.
//!
//! - `input` is a string (one user message) or a list of items. User, system and developer
//!   messages are one neutral message each (system and developer are instructions, never
//!   turns). Every run of items the model produced — output messages, `reasoning` (with its
//!   `encrypted_content`), `function_call` and the other tool calls — is one assistant message
//!   whose `tool_calls` are the calls (by `call_id`), so the window never parts a call from
//!   its `function_call_output` (a `tool` message).
//! - `instructions` stay a top-level field, sent as the client sent them: never turns.
//! - `conversation` (OpenAI's own conversation object) names memory's conversation when no
//!   conversation id header does; like `previous_response_id` it is not forwarded when memory
//!   runs (memory sends the history itself).
//! - The reply is the answer's `output` (from the JSON body, or from `response.completed` in a
//!   stream), one assistant message carrying the response id.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::{Neutral, Wire, content_text, parsed, tool_call};
use crate::message::{InvalidRequest, Message};

/// The neutral messages of a Responses request's `input`.
pub fn parse_input(fields: &[(String, Box<RawValue>)]) -> Result<Vec<Message>, InvalidRequest> {
    let Some((_, input)) = fields.iter().find(|(k, _)| k == "input") else {
        return Ok(Vec::new());
    };
    let bad =
        |param: String, why: &str| InvalidRequest::field(param.clone(), format!("`{param}` {why}"));
    if let Ok(text) = serde_json::from_str::<String>(input.get()) {
        let raw = Neutral {
            role: "user".into(),
            content: Value::String(text),
            ..Neutral::default()
        }
        .to_raw();
        return Ok(vec![parsed(raw, "input")?]);
    }
    let items: Vec<Box<RawValue>> = serde_json::from_str(input.get()).map_err(|_| {
        bad(
            "input".into(),
            "must be a string or an array of input items",
        )
    })?;
    let mut messages = Vec::with_capacity(items.len());
    // The run of model-produced items being gathered into one assistant message.
    let mut run: Vec<(Box<RawValue>, Value)> = Vec::new();
    let mut run_start = 0;
    for (i, raw) in items.into_iter().enumerate() {
        let item: Value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
        if !item.is_object() {
            return Err(bad(format!("input[{i}]"), "must be an object"));
        }
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        let role = item.get("role").and_then(Value::as_str);
        let path = format!("input[{i}]");
        if kind == "message" && role != Some("assistant") {
            flush(&mut run, run_start, &mut messages)?;
            messages.push(parsed(user_side(&item, raw, &path)?, &path)?);
        } else if kind.ends_with("_call_output") {
            flush(&mut run, run_start, &mut messages)?;
            let call_id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| {
                bad(
                    format!("{path}.call_id"),
                    "is required and must be a string",
                )
            })?;
            let neutral = Neutral {
                role: "tool".into(),
                content: Value::String(output_text(item.get("output"))),
                tool_call_id: Some(call_id.to_string()),
                wire: Some(Wire {
                    responses: Some(vec![raw]),
                    ..Wire::default()
                }),
                ..Neutral::default()
            };
            messages.push(parsed(neutral.to_raw(), &path)?);
        } else {
            if run.is_empty() {
                run_start = i;
            }
            run.push((raw, item));
        }
    }
    flush(&mut run, run_start, &mut messages)?;
    Ok(messages)
}

/// The `previous_response_id` field, checked.
pub fn previous_id_field(
    fields: &[(String, Box<RawValue>)],
) -> Result<Option<String>, InvalidRequest> {
    match fields.iter().find(|(k, _)| k == "previous_response_id") {
        None => Ok(None),
        Some((_, raw)) => serde_json::from_str::<Option<String>>(raw.get()).map_err(|_| {
            InvalidRequest::field(
                "previous_response_id",
                "`previous_response_id` must be a string",
            )
        }),
    }
}

/// The `conversation` field (a string, or an object with a string `id`), checked against the
/// rules of conversation ids: memory uses it as the request's conversation.
pub fn conversation_field(
    fields: &[(String, Box<RawValue>)],
) -> Result<Option<String>, InvalidRequest> {
    let Some((_, raw)) = fields.iter().find(|(k, _)| k == "conversation") else {
        return Ok(None);
    };
    let bad = || {
        InvalidRequest::field(
            "conversation",
            "`conversation` must be a conversation id (1-128 characters from A-Za-z0-9._:@-) or an object with one as `id`",
        )
    };
    let id = match serde_json::from_str::<Value>(raw.get()).map_err(|_| bad())? {
        Value::Null => return Ok(None),
        Value::String(id) => id,
        Value::Object(mut object) => match object.remove("id") {
            Some(Value::String(id)) => id,
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    if crate::identity::is_valid_id(&id) {
        Ok(Some(id))
    } else {
        Err(bad())
    }
}

/// Ends a run of model-produced items: one assistant message.
fn flush(
    run: &mut Vec<(Box<RawValue>, Value)>,
    start: usize,
    messages: &mut Vec<Message>,
) -> Result<(), InvalidRequest> {
    if run.is_empty() {
        return Ok(());
    }
    let raw = assistant(std::mem::take(run), None, None, None);
    messages.push(parsed(raw, &format!("input[{start}]"))?);
    Ok(())
}

/// One assistant message from model-produced items (raw, and parsed).
fn assistant(
    items: Vec<(Box<RawValue>, Value)>,
    response_id: Option<String>,
    model: Option<String>,
    response: Option<Box<RawValue>>,
) -> Box<RawValue> {
    let mut texts: Vec<String> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    for (_, item) in &items {
        match item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message")
        {
            "message" => {
                let text = content_text(item.get("content").unwrap_or(&Value::Null));
                if !text.is_empty() {
                    texts.push(text);
                }
            }
            kind if kind.ends_with("_call") => {
                if let Some(call_id) = item.get("call_id").and_then(Value::as_str) {
                    let name = item.get("name").and_then(Value::as_str).unwrap_or(kind);
                    let arguments = item
                        .get("arguments")
                        .or_else(|| item.get("input"))
                        .and_then(Value::as_str)
                        .unwrap_or_default();
                    calls.push(tool_call(call_id, name, arguments));
                }
            }
            _ => {}
        }
    }
    let content = if texts.is_empty() {
        Value::Null
    } else {
        Value::String(texts.join("\n"))
    };
    Neutral {
        role: "assistant".into(),
        content,
        tool_calls: (!calls.is_empty()).then_some(calls),
        tool_call_id: None,
        wire: Some(Wire {
            responses: Some(items.into_iter().map(|(raw, _)| raw).collect()),
            response_id,
            model,
            response,
            ..Wire::default()
        }),
    }
    .to_raw()
}

/// A user, system or developer message item as a neutral message. Content given as a string
/// with nothing else in the item is stored as chat completions would store it; otherwise the
/// item rides along raw.
fn user_side(
    item: &Value,
    raw: Box<RawValue>,
    path: &str,
) -> Result<Box<RawValue>, InvalidRequest> {
    let role = match item.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "system" | "developer")) => role,
        _ => {
            return Err(InvalidRequest::field(
                format!("{path}.role"),
                format!("`{path}.role` must be one of user, system, developer, assistant"),
            ));
        }
    };
    let content = item.get("content").unwrap_or(&Value::Null);
    let plain = content.is_string()
        && item.as_object().is_some_and(|o| {
            o.keys()
                .all(|k| matches!(k.as_str(), "role" | "content" | "type"))
        });
    let neutral_content = match content {
        Value::String(text) => Value::String(text.clone()),
        Value::Array(parts) if role != "user" => {
            // Instructions are text: joined, so that memproxy's own echoed messages are
            // recognized.
            Value::String(content_text(&Value::Array(parts.clone())))
        }
        Value::Array(parts) => Value::Array(parts.iter().map(chat_part).collect()),
        _ => {
            return Err(InvalidRequest::field(
                format!("{path}.content"),
                format!("`{path}.content` must be a string or an array of content parts"),
            ));
        }
    };
    Ok(Neutral {
        role: role.to_string(),
        content: neutral_content,
        wire: (!plain).then(|| Wire {
            responses: Some(vec![raw]),
            ..Wire::default()
        }),
        ..Neutral::default()
    }
    .to_raw())
}

/// A Responses content part as a chat-completions one.
fn chat_part(part: &Value) -> Value {
    match part.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text" | "text") => {
            json!({"type": "text", "text": part.get("text").cloned().unwrap_or(Value::Null)})
        }
        Some("input_image") => match part.get("image_url").and_then(Value::as_str) {
            Some(url) => json!({"type": "image_url", "image_url": {"url": url}}),
            None => part.clone(),
        },
        _ => part.clone(),
    }
}

/// A chat-completions content part as a Responses one.
fn responses_part(part: &Value) -> Value {
    match part.get("type").and_then(Value::as_str) {
        Some("text") => {
            json!({"type": "input_text", "text": part.get("text").cloned().unwrap_or(Value::Null)})
        }
        Some("image_url") => {
            json!({"type": "input_image", "image_url": part.pointer("/image_url/url").cloned().unwrap_or(Value::Null)})
        }
        _ => part.clone(),
    }
}

/// A function call's output as text.
fn output_text(output: Option<&Value>) -> String {
    match output {
        Some(Value::String(text)) => text.clone(),
        Some(other) => content_text(other),
        None => String::new(),
    }
}

/// The `input` items for a prompt of neutral messages.
pub fn render_input<'a>(prompt: impl IntoIterator<Item = &'a RawValue>) -> Vec<Box<RawValue>> {
    let mut items = Vec::new();
    for raw in prompt {
        let Some(neutral) = Neutral::read(raw) else {
            continue;
        };
        if let Some(own) = neutral.wire.as_ref().and_then(|w| w.responses.as_ref()) {
            items.extend(own.iter().cloned());
            continue;
        }
        let mut push = |value: Value| {
            if let Ok(raw) = serde_json::value::to_raw_value(&value) {
                items.push(raw);
            }
        };
        match neutral.role.as_str() {
            "assistant" => {
                let text = neutral.text();
                if !text.is_empty() {
                    push(json!({"role": "assistant", "content": text}));
                }
                for (id, name, arguments) in neutral.calls() {
                    push(
                        json!({"type": "function_call", "call_id": id, "name": name, "arguments": arguments}),
                    );
                }
            }
            "tool" | "function" => push(json!({
                "type": "function_call_output",
                "call_id": neutral.tool_call_id.clone().unwrap_or_default(),
                "output": neutral.text(),
            })),
            role => {
                let content = match &neutral.content {
                    Value::Array(parts) => Value::Array(parts.iter().map(responses_part).collect()),
                    other => other.clone(),
                };
                push(json!({"role": role, "content": content}));
            }
        }
    }
    items
}

/// The parts of a response object memproxy reads.
#[derive(Deserialize)]
struct ResponseObject {
    id: Option<String>,
    model: Option<String>,
    status: Option<String>,
    #[serde(default)]
    output: Vec<Box<RawValue>>,
    created_at: Option<Box<RawValue>>,
    usage: Option<Box<RawValue>>,
    incomplete_details: Option<Box<RawValue>>,
}

/// The fields of a response object kept with its reply besides the output: small, and what a
/// client reads back (`usage`); the request's echo (`instructions`, `tools`) is not kept.
const KEPT_FIELDS: [&str; 4] = ["created_at", "status", "usage", "incomplete_details"];

/// The reply in a response object: its `output`, as one assistant message carrying the id;
/// `None` for a failed response.
pub fn reply_from_response(response: &RawValue) -> Option<Box<RawValue>> {
    let object: ResponseObject = serde_json::from_str(response.get()).ok()?;
    if matches!(object.status.as_deref(), Some("failed" | "cancelled")) {
        return None;
    }
    let items = object
        .output
        .into_iter()
        .map(|raw| {
            let value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
            (raw, value)
        })
        .collect();
    let mut kept = serde_json::Map::new();
    let raw_fields = [
        ("created_at", object.created_at),
        ("usage", object.usage),
        ("incomplete_details", object.incomplete_details),
    ];
    for (name, raw) in raw_fields {
        let value: Option<Value> = raw.and_then(|raw| serde_json::from_str(raw.get()).ok());
        if let Some(value) = value.filter(|v| !v.is_null()) {
            kept.insert(name.to_string(), value);
        }
    }
    if let Some(status) = object.status {
        kept.insert("status".to_string(), Value::String(status));
    }
    let kept = serde_json::value::to_raw_value(&kept).ok();
    Some(assistant(items, object.id, object.model, kept))
}

/// The reply in a JSON answer.
pub fn reply_from_json(body: &[u8]) -> Option<Box<RawValue>> {
    let raw: Box<RawValue> = serde_json::from_slice(body).ok()?;
    reply_from_response(&raw)
}

/// The reply read from a stream's events: complete once `response.completed` (or
/// `response.incomplete`) carried the whole response.
#[derive(Debug, Default)]
pub struct ResponsesStream {
    reply: Option<Box<RawValue>>,
    failed: bool,
}

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    response: Option<Box<RawValue>>,
}

impl ResponsesStream {
    /// Takes the data of one SSE event.
    pub fn on_event(&mut self, data: &str) {
        if self.failed {
            return;
        }
        let Ok(event) = serde_json::from_str::<Event>(data) else {
            self.failed = true;
            return;
        };
        match event.kind.as_str() {
            "response.completed" | "response.incomplete" => {
                self.reply = event.response.as_deref().and_then(reply_from_response);
                self.failed = self.reply.is_none();
            }
            "response.failed" | "error" => self.failed = true,
            _ => {}
        }
    }

    pub fn fail(&mut self) {
        self.failed = true;
        self.reply = None;
    }

    pub fn is_complete(&self) -> bool {
        !self.failed && self.reply.is_some()
    }

    pub fn to_message(&self) -> Box<RawValue> {
        self.reply.clone().unwrap_or_default()
    }
}

/// The response object memproxy answers `GET /v1/responses/{id}` with, from a stored reply.
pub fn response_object(reply: &RawValue) -> Option<Value> {
    let neutral = Neutral::read(reply)?;
    let wire = neutral.wire?;
    let output: Vec<Value> = wire
        .responses
        .unwrap_or_default()
        .iter()
        .filter_map(|raw| serde_json::from_str(raw.get()).ok())
        .collect();
    let mut object = json!({
        "id": wire.response_id?,
        "object": "response",
        "status": "completed",
        "model": wire.model,
        "output": output,
    });
    let kept: Option<serde_json::Map<String, Value>> = wire
        .response
        .and_then(|raw| serde_json::from_str(raw.get()).ok());
    for (name, value) in kept.into_iter().flatten() {
        if KEPT_FIELDS.contains(&name.as_str()) {
            object[name] = value;
        }
    }
    Some(object)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;

    fn fields(input: Value) -> Vec<(String, Box<RawValue>)> {
        vec![(
            "input".into(),
            serde_json::value::to_raw_value(&input).unwrap(),
        )]
    }

    #[test]
    fn a_string_input_is_one_user_message_stored_as_chat_would() {
        let messages = parse_input(&fields(json!("hello"))).unwrap();
        assert_eq!(messages.len(), 1);
        assert_eq!(messages[0].role, Role::User);
        assert_eq!(
            messages[0].raw.get(),
            r#"{"role":"user","content":"hello"}"#
        );
    }

    #[test]
    fn model_items_group_into_one_assistant_message_with_its_calls() {
        let reasoning =
            r#"{"type":"reasoning","id":"rs_1","summary":[],"encrypted_content":"gAAAA+/=="}"#;
        let input = format!(
            r#"[{{"role":"user","content":"weather?"}},{reasoning},{{"type":"function_call","call_id":"c1","name":"get","arguments":"{{}}"}},{{"type":"function_call_output","call_id":"c1","output":"sunny"}}]"#
        );
        let raw = RawValue::from_string(input).unwrap();
        let messages = parse_input(&[("input".into(), raw)]).unwrap();
        let roles: Vec<Role> = messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool]);
        assert_eq!(messages[1].tool_call_ids, ["c1"]);
        assert_eq!(messages[2].tool_call_id.as_deref(), Some("c1"));
        // Written back: the same items, the reasoning item byte for byte.
        let items = render_input(messages.iter().map(|m| &*m.raw));
        assert_eq!(items.len(), 4);
        assert_eq!(items[1].get(), reasoning);
        // Chat completions get the call without the reasoning item.
        let chat = super::super::for_chat(&messages[1].raw).unwrap();
        let chat: Value = serde_json::from_str(chat.get()).unwrap();
        assert_eq!(chat["tool_calls"][0]["id"], "c1");
        assert!(chat.get("_wire").is_none());
    }

    #[test]
    fn a_reasoning_item_does_not_change_the_fingerprint() {
        let with = parse_input(&fields(json!([
            {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "x"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
        ])))
        .unwrap();
        let without =
            parse_input(&fields(json!([{"role": "assistant", "content": "hi"}]))).unwrap();
        assert_eq!(with[0].fingerprint, without[0].fingerprint);
    }

    #[test]
    fn bad_items_name_their_field() {
        let err = parse_input(&fields(
            json!([{"type": "function_call_output", "output": "x"}]),
        ))
        .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0].call_id"));
        let err = parse_input(&fields(json!([7]))).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input[0]"));
        let err = parse_input(&fields(json!({"a": 1}))).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("input"));
    }

    #[test]
    fn the_stream_reply_comes_from_response_completed() {
        let mut stream = ResponsesStream::default();
        stream.on_event(r#"{"type":"response.created","response":{"id":"r1","output":[]}}"#);
        stream.on_event(r#"{"type":"response.output_text.delta","delta":"hi"}"#);
        assert!(!stream.is_complete());
        stream.on_event(r#"{"type":"response.completed","response":{"id":"r1","status":"completed","output":[{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi"}]}]}}"#);
        assert!(stream.is_complete());
        let reply = stream.to_message();
        assert_eq!(super::super::response_id_of(&reply).as_deref(), Some("r1"));
        let mut failed = ResponsesStream::default();
        failed.on_event(r#"{"type":"response.failed","response":{"id":"r2","status":"failed"}}"#);
        assert!(!failed.is_complete());
    }
}
