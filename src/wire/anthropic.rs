//! The Anthropic Messages API (`POST /v1/messages`) read into neutral messages and written
//! back.
//!
//! - The top-level `system` (a string or text blocks) is the client's instructions: never a
//!   turn, forwarded as sent. What memory adds (the summary, recalled turns, memories) goes
//!   into `system` as extra text blocks, so the messages list stays what the API accepts.
//! - A user message is its `tool_result` blocks (one `tool` message each, answering the
//!   `tool_use` id) and then the rest (text, images, documents) as one user message. An
//!   assistant message is one assistant message: its text, its `tool_use` blocks as tool
//!   calls, and every block (`thinking`/`redacted_thinking` with their signatures included)
//!   kept raw.
//! - Written back, the messages list starts with a user turn and alternates roles: neighbours
//!   of one role are merged (tool results first in a user turn).

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::{Neutral, Wire, content_text, parsed, tool_call};
use crate::message::{InvalidRequest, Message, canonical_json, write_fields};

/// What goes first when a prompt would otherwise open with an assistant turn.
const OPENING_USER_TURN: &str = "(conversation continues)";

#[derive(Deserialize)]
struct MessageIn {
    role: String,
    content: Box<RawValue>,
}

/// The neutral messages of an Anthropic request's `messages`.
pub fn parse_messages(fields: &[(String, Box<RawValue>)]) -> Result<Vec<Message>, InvalidRequest> {
    let bad =
        |param: String, why: &str| InvalidRequest::field(param.clone(), format!("`{param}` {why}"));
    let Some((_, list)) = fields.iter().find(|(k, _)| k == "messages") else {
        return Err(bad("messages".into(), "is required"));
    };
    let list: Vec<Box<RawValue>> = serde_json::from_str(list.get())
        .map_err(|_| bad("messages".into(), "must be an array of message objects"))?;
    let mut messages = Vec::with_capacity(list.len());
    for (i, raw) in list.into_iter().enumerate() {
        let path = format!("messages[{i}]");
        let message: MessageIn = serde_json::from_str(raw.get()).map_err(|_| {
            bad(
                path.clone(),
                "must be an object with a `role` and a `content`",
            )
        })?;
        if let Ok(text) = serde_json::from_str::<String>(message.content.get()) {
            let neutral = match message.role.as_str() {
                "user" | "assistant" => Neutral {
                    role: message.role.clone(),
                    content: Value::String(text),
                    ..Neutral::default()
                },
                _ => return Err(bad(format!("{path}.role"), "must be user or assistant")),
            };
            messages.push(parsed(neutral.to_raw(), &path)?);
            continue;
        }
        let blocks: Vec<Box<RawValue>> =
            serde_json::from_str(message.content.get()).map_err(|_| {
                bad(
                    format!("{path}.content"),
                    "must be a string or an array of content blocks",
                )
            })?;
        let mut parsed_blocks = Vec::with_capacity(blocks.len());
        for (j, raw) in blocks.into_iter().enumerate() {
            let value: Value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
            if value.get("type").and_then(Value::as_str).is_none() {
                return Err(bad(format!("{path}.content[{j}].type"), "is required"));
            }
            parsed_blocks.push((raw, value));
        }
        match message.role.as_str() {
            "user" => user(parsed_blocks, &path, &mut messages)?,
            "assistant" => messages.push(parsed(assistant(parsed_blocks, None), &path)?),
            _ => return Err(bad(format!("{path}.role"), "must be user or assistant")),
        }
    }
    Ok(messages)
}

/// A user turn of blocks: its tool results, then the rest as one user message.
fn user(
    blocks: Vec<(Box<RawValue>, Value)>,
    path: &str,
    messages: &mut Vec<Message>,
) -> Result<(), InvalidRequest> {
    let mut rest: Vec<(Box<RawValue>, Value)> = Vec::new();
    for (j, (raw, block)) in blocks.into_iter().enumerate() {
        if block["type"] != "tool_result" {
            rest.push((raw, block));
            continue;
        }
        let id = block
            .get("tool_use_id")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                let param = format!("{path}.content[{j}].tool_use_id");
                InvalidRequest::field(param.clone(), format!("`{param}` is required"))
            })?;
        let neutral = Neutral {
            role: "tool".into(),
            content: Value::String(content_text(block.get("content").unwrap_or(&Value::Null))),
            tool_call_id: Some(id.to_string()),
            wire: Some(Wire {
                anthropic: Some(vec![raw]),
                ..Wire::default()
            }),
            ..Neutral::default()
        };
        messages.push(parsed(neutral.to_raw(), path)?);
    }
    if !rest.is_empty() {
        let content = Value::Array(rest.iter().map(|(_, b)| chat_part(b)).collect());
        let neutral = Neutral {
            role: "user".into(),
            content,
            wire: Some(Wire {
                anthropic: Some(rest.into_iter().map(|(raw, _)| raw).collect()),
                ..Wire::default()
            }),
            ..Neutral::default()
        };
        messages.push(parsed(neutral.to_raw(), path)?);
    }
    Ok(())
}

/// An assistant turn of blocks as one assistant message.
fn assistant(blocks: Vec<(Box<RawValue>, Value)>, model: Option<String>) -> Box<RawValue> {
    let texts: Vec<&str> = blocks
        .iter()
        .filter(|(_, b)| b["type"] == "text")
        .filter_map(|(_, b)| b.get("text").and_then(Value::as_str))
        .collect();
    let calls: Vec<Value> = blocks
        .iter()
        .filter(|(_, b)| b["type"] == "tool_use")
        .map(|(_, b)| {
            let arguments = canonical_json(b.get("input").unwrap_or(&json!({})));
            tool_call(
                b.get("id").and_then(Value::as_str).unwrap_or_default(),
                b.get("name").and_then(Value::as_str).unwrap_or_default(),
                &arguments,
            )
        })
        .collect();
    Neutral {
        role: "assistant".into(),
        content: if texts.is_empty() {
            Value::Null
        } else {
            Value::String(texts.join("\n"))
        },
        tool_calls: (!calls.is_empty()).then_some(calls),
        tool_call_id: None,
        wire: Some(Wire {
            anthropic: Some(blocks.into_iter().map(|(raw, _)| raw).collect()),
            model,
            ..Wire::default()
        }),
    }
    .to_raw()
}

/// An Anthropic block as a chat-completions content part.
fn chat_part(block: &Value) -> Value {
    match block["type"].as_str() {
        Some("text") => {
            json!({"type": "text", "text": block.get("text").cloned().unwrap_or(Value::Null)})
        }
        Some("image") => match block.pointer("/source/type").and_then(Value::as_str) {
            Some("base64") => {
                let media = block
                    .pointer("/source/media_type")
                    .and_then(Value::as_str)
                    .unwrap_or("image/png");
                let data = block
                    .pointer("/source/data")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                json!({"type": "image_url", "image_url": {"url": format!("data:{media};base64,{data}")}})
            }
            Some("url") => {
                json!({"type": "image_url", "image_url": {"url": block.pointer("/source/url").cloned().unwrap_or(Value::Null)}})
            }
            _ => block.clone(),
        },
        _ => block.clone(),
    }
}

/// A chat-completions content part as an Anthropic block (`None`: it has no Anthropic form).
fn anthropic_part(part: &Value) -> Option<Value> {
    match part.get("type").and_then(Value::as_str) {
        Some("text") => {
            Some(json!({"type": "text", "text": part.get("text").cloned().unwrap_or(Value::Null)}))
        }
        Some("image_url") => {
            let url = part.pointer("/image_url/url").and_then(Value::as_str)?;
            Some(
                match url
                    .strip_prefix("data:")
                    .and_then(|rest| rest.split_once(";base64,"))
                {
                    Some((media, data)) => {
                        json!({"type": "image", "source": {"type": "base64", "media_type": media, "data": data}})
                    }
                    None => json!({"type": "image", "source": {"type": "url", "url": url}}),
                },
            )
        }
        _ => None,
    }
}

/// A message being written: its role and blocks (each with whether it is a tool result).
struct Turn {
    role: &'static str,
    /// `Some` while the turn is one string content, as sent.
    text: Option<String>,
    blocks: Vec<(Box<RawValue>, bool)>,
}

impl Turn {
    fn into_blocks(self) -> Vec<(Box<RawValue>, bool)> {
        match self.text {
            Some(text) => vec![(raw(&json!({"type": "text", "text": text})), false)],
            None => self.blocks,
        }
    }
}

fn raw(value: &Value) -> Box<RawValue> {
    serde_json::value::to_raw_value(value).unwrap_or_default()
}

fn is_tool_result(block: &RawValue) -> bool {
    serde_json::from_str::<Value>(block.get())
        .ok()
        .is_some_and(|b| b["type"] == "tool_result")
}

/// The request body for a prompt of neutral messages: system messages (the client's own
/// system-role messages, memproxy's summary, recall and memories) become extra `system` text
/// blocks after the client's `system`; the rest become alternating turns starting with a user
/// turn.
pub fn render<'a>(
    fields: &[(String, Box<RawValue>)],
    prompt: impl IntoIterator<Item = &'a RawValue>,
) -> Vec<u8> {
    let mut system_texts: Vec<String> = Vec::new();
    let mut turns: Vec<Turn> = Vec::new();
    for message in prompt {
        let Some(neutral) = Neutral::read(message) else {
            continue;
        };
        let turn = match neutral.role.as_str() {
            "system" | "developer" => {
                system_texts.push(neutral.text());
                continue;
            }
            _ => to_turn(neutral),
        };
        let Some(turn) = turn else {
            continue;
        };
        match turns.last_mut() {
            Some(last) if last.role == turn.role => {
                let previous = std::mem::replace(
                    last,
                    Turn {
                        role: turn.role,
                        text: None,
                        blocks: Vec::new(),
                    },
                );
                let mut blocks = previous.into_blocks();
                blocks.extend(turn.into_blocks());
                last.blocks = blocks;
            }
            _ => turns.push(turn),
        }
    }
    if turns.first().is_some_and(|t| t.role == "assistant") {
        turns.insert(
            0,
            Turn {
                role: "user",
                text: Some(OPENING_USER_TURN.to_string()),
                blocks: Vec::new(),
            },
        );
    }
    let mut list = String::from("[");
    for (i, turn) in turns.into_iter().enumerate() {
        if i > 0 {
            list.push(',');
        }
        let role = turn.role;
        list.push_str(&format!("{{\"role\":\"{role}\",\"content\":"));
        match turn.text {
            Some(text) => list.push_str(&Value::String(text).to_string()),
            None => {
                // Tool results first in a user turn, as the API requires.
                let mut blocks = turn.blocks;
                blocks.sort_by_key(|(_, tool_result)| !tool_result);
                list.push('[');
                for (j, (block, _)) in blocks.iter().enumerate() {
                    if j > 0 {
                        list.push(',');
                    }
                    list.push_str(block.get());
                }
                list.push(']');
            }
        }
        list.push('}');
    }
    list.push(']');

    if system_texts.is_empty() {
        return write_fields(fields, "messages", list.as_bytes(), &[]);
    }
    let mut system: Vec<Box<RawValue>> = match fields.iter().find(|(k, _)| k == "system") {
        None => Vec::new(),
        Some((_, value)) => match serde_json::from_str::<String>(value.get()) {
            Ok(text) if text.is_empty() => Vec::new(),
            Ok(text) => vec![raw(&json!({"type": "text", "text": text}))],
            Err(_) => serde_json::from_str(value.get()).unwrap_or_default(),
        },
    };
    for text in system_texts {
        system.push(raw(&json!({"type": "text", "text": text})));
    }
    let system = super::json_list(system);
    let mut fields = fields.to_vec();
    let system =
        RawValue::from_string(String::from_utf8_lossy(&system).into_owned()).unwrap_or_default();
    match fields.iter_mut().find(|(k, _)| k == "system") {
        Some((_, value)) => *value = system,
        None => fields.insert(0, ("system".to_string(), system)),
    }
    write_fields(&fields, "messages", list.as_bytes(), &[])
}

/// One neutral message as an Anthropic turn (`None`: nothing of it can be sent).
fn to_turn(neutral: Neutral) -> Option<Turn> {
    let own = neutral.wire.as_ref().and_then(|w| w.anthropic.clone());
    let role: &'static str = if neutral.role == "assistant" {
        "assistant"
    } else {
        "user"
    };
    if let Some(blocks) = own {
        let blocks = blocks
            .into_iter()
            .map(|b| {
                let tool_result = is_tool_result(&b);
                (b, tool_result)
            })
            .collect();
        return Some(Turn {
            role,
            text: None,
            blocks,
        });
    }
    match neutral.role.as_str() {
        "assistant" => {
            let mut blocks = Vec::new();
            let text = neutral.text();
            if !text.is_empty() {
                blocks.push((raw(&json!({"type": "text", "text": text})), false));
            }
            for (id, name, arguments) in neutral.calls() {
                let input: Value = serde_json::from_str(&arguments).unwrap_or_else(|_| json!({}));
                blocks.push((
                    raw(&json!({"type": "tool_use", "id": id, "name": name, "input": input})),
                    false,
                ));
            }
            (!blocks.is_empty()).then_some(Turn {
                role,
                text: None,
                blocks,
            })
        }
        "tool" | "function" => Some(Turn {
            role,
            text: None,
            blocks: vec![(
                raw(
                    &json!({"type": "tool_result", "tool_use_id": neutral.tool_call_id.clone().unwrap_or_default(), "content": neutral.text()}),
                ),
                true,
            )],
        }),
        _ => match &neutral.content {
            Value::String(text) => Some(Turn {
                role,
                text: Some(text.clone()),
                blocks: Vec::new(),
            }),
            Value::Array(parts) => {
                let blocks: Vec<_> = parts
                    .iter()
                    .filter_map(anthropic_part)
                    .map(|b| (raw(&b), false))
                    .collect();
                (!blocks.is_empty()).then_some(Turn {
                    role,
                    text: None,
                    blocks,
                })
            }
            _ => None,
        },
    }
}

#[derive(Deserialize)]
struct MessageObject {
    model: Option<String>,
    #[serde(default)]
    content: Vec<Box<RawValue>>,
}

/// The reply in a JSON answer: its content blocks as one assistant message.
pub fn reply_from_json(body: &[u8]) -> Option<Box<RawValue>> {
    let object: MessageObject = serde_json::from_slice(body).ok()?;
    let blocks = object
        .content
        .into_iter()
        .map(|raw| {
            let value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
            (raw, value)
        })
        .collect();
    Some(assistant(blocks, object.model))
}

/// The reply read from a stream's events: blocks opened by `content_block_start`, grown by
/// their deltas (text, tool input JSON, thinking, signature, citations), complete at
/// `message_stop`.
#[derive(Debug, Default)]
pub struct AnthropicStream {
    model: Option<String>,
    blocks: Vec<Value>,
    /// A `tool_use` block's input JSON as it arrives, by block.
    partial: Vec<String>,
    done: bool,
    failed: bool,
    bytes: usize,
    max_bytes: usize,
}

impl AnthropicStream {
    /// A reader that gives up (stores nothing) past `max_bytes` of assembled text (`0`: no
    /// limit).
    pub fn with_limit(max_bytes: usize) -> AnthropicStream {
        AnthropicStream {
            max_bytes,
            ..AnthropicStream::default()
        }
    }

    /// Takes the data of one SSE event.
    pub fn on_event(&mut self, data: &str) {
        if self.failed {
            return;
        }
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            self.failed = true;
            return;
        };
        let index = event.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                self.model = event
                    .pointer("/message/model")
                    .and_then(Value::as_str)
                    .map(str::to_string);
            }
            Some("content_block_start") => {
                if index > 4096 {
                    self.failed = true;
                    return;
                }
                if self.blocks.len() <= index {
                    self.blocks.resize(index + 1, Value::Null);
                    self.partial.resize(index + 1, String::new());
                }
                self.blocks[index] = event.get("content_block").cloned().unwrap_or(Value::Null);
            }
            Some("content_block_delta") => {
                let (Some(block), Some(delta)) = (self.blocks.get_mut(index), event.get("delta"))
                else {
                    self.failed = true;
                    return;
                };
                let append = |block: &mut Value, field: &str, text: &str| {
                    let current = block.get(field).and_then(Value::as_str).unwrap_or_default();
                    block[field] = Value::String(format!("{current}{text}"));
                };
                let text = |name: &str| delta.get(name).and_then(Value::as_str).unwrap_or_default();
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => append(block, "text", text("text")),
                    Some("thinking_delta") => append(block, "thinking", text("thinking")),
                    Some("signature_delta") => append(block, "signature", text("signature")),
                    Some("input_json_delta") => self.partial[index].push_str(text("partial_json")),
                    Some("citations_delta") => {
                        if let Some(citation) = delta.get("citation") {
                            match block.get_mut("citations").and_then(Value::as_array_mut) {
                                Some(list) => list.push(citation.clone()),
                                None => block["citations"] = json!([citation]),
                            }
                        }
                    }
                    _ => {}
                }
                self.bytes += data.len();
            }
            Some("content_block_stop") => {
                if let (Some(block), Some(partial)) =
                    (self.blocks.get_mut(index), self.partial.get_mut(index))
                    && !partial.is_empty()
                {
                    match serde_json::from_str::<Value>(partial) {
                        Ok(input) => block["input"] = input,
                        Err(_) => self.failed = true,
                    }
                    partial.clear();
                }
            }
            Some("message_stop") => self.done = true,
            Some("error") => self.failed = true,
            _ => {}
        }
        if self.max_bytes > 0 && self.bytes > self.max_bytes {
            self.fail();
        }
    }

    pub fn fail(&mut self) {
        self.failed = true;
        self.blocks.clear();
        self.partial.clear();
    }

    pub fn is_complete(&self) -> bool {
        self.done && !self.failed
    }

    pub fn to_message(&self) -> Box<RawValue> {
        let blocks = self
            .blocks
            .iter()
            .filter(|b| !b.is_null())
            .map(|b| (raw(b), b.clone()))
            .collect();
        assistant(blocks, self.model.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;

    fn request(messages: Value, system: Option<Value>) -> Vec<(String, Box<RawValue>)> {
        let mut fields = vec![("model".to_string(), raw(&json!("claude")))];
        if let Some(system) = system {
            fields.push(("system".into(), raw(&system)));
        }
        fields.push(("messages".into(), raw(&messages)));
        fields
    }

    #[test]
    fn tool_results_are_tool_messages_and_thinking_is_kept_raw() {
        let thinking = r#"{"type":"thinking","thinking":"hmm","signature":"EqQBCgIYAhIM+/=="}"#;
        let messages = RawValue::from_string(format!(
            r#"[{{"role":"user","content":"weather?"}},{{"role":"assistant","content":[{thinking},{{"type":"tool_use","id":"t1","name":"get","input":{{"b":1,"a":2}}}}]}},{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t1","content":"sunny"}},{{"type":"text","text":"and tomorrow?"}}]}}]"#
        ))
        .unwrap();
        let fields = vec![("messages".to_string(), messages)];
        let parsed = parse_messages(&fields).unwrap();
        let roles: Vec<Role> = parsed.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::User, Role::Assistant, Role::Tool, Role::User]);
        assert_eq!(parsed[1].tool_call_ids, ["t1"]);
        assert_eq!(parsed[2].tool_call_id.as_deref(), Some("t1"));

        let body = render(&fields, parsed.iter().map(|m| &*m.raw));
        let text = String::from_utf8(body).unwrap();
        assert!(text.contains(thinking), "{text}");
        let value: Value = serde_json::from_str(&text).unwrap();
        let list = value["messages"].as_array().unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[2]["content"][0]["type"], "tool_result");
        assert_eq!(list[2]["content"][1]["text"], "and tomorrow?");
    }

    #[test]
    fn memory_goes_into_system_and_turns_alternate_from_a_user_turn() {
        let fields = request(
            json!([{"role": "user", "content": "new"}]),
            Some(json!("Be brief.")),
        );
        let neutral = |v: Value| raw(&v);
        let prompt = [
            neutral(json!({"role": "system", "content": "[Summary of earlier conversation] x"})),
            neutral(json!({"role": "assistant", "content": "old reply"})),
            neutral(json!({"role": "user", "content": "a"})),
            neutral(json!({"role": "user", "content": "b"})),
            neutral(
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]}),
            ),
            neutral(json!({"role": "tool", "tool_call_id": "c", "content": "ok"})),
            neutral(json!({"role": "user", "content": "new"})),
        ];
        let body: Value =
            serde_json::from_slice(&render(&fields, prompt.iter().map(|m| &**m))).unwrap();
        assert_eq!(body["system"][0]["text"], "Be brief.");
        assert_eq!(
            body["system"][1]["text"],
            "[Summary of earlier conversation] x"
        );
        let list = body["messages"].as_array().unwrap();
        let roles: Vec<&str> = list.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["user", "assistant", "user", "assistant", "user"]);
        assert_eq!(list[2]["content"][1]["text"], "b");
        assert_eq!(list[3]["content"][0]["input"]["x"], 1);
        assert_eq!(list[4]["content"][0]["type"], "tool_result");
        assert_eq!(list[4]["content"][1]["text"], "new");
    }

    #[test]
    fn the_stream_is_assembled_from_its_deltas() {
        let mut stream = AnthropicStream::default();
        for data in [
            r#"{"type":"message_start","message":{"model":"claude","content":[]}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"SIG"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Hel"}}"#,
            r#"{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"lo"}}"#,
            r#"{"type":"content_block_stop","index":1}"#,
            r#"{"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"t","name":"f","input":{}}}"#,
            r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"a\":"}}"#,
            r#"{"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"1}"}}"#,
            r#"{"type":"content_block_stop","index":2}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"tool_use"}}"#,
        ] {
            stream.on_event(data);
        }
        assert!(!stream.is_complete());
        stream.on_event(r#"{"type":"message_stop"}"#);
        assert!(stream.is_complete());
        let message: Value = serde_json::from_str(stream.to_message().get()).unwrap();
        assert_eq!(message["content"], "Hello");
        assert_eq!(
            message["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert_eq!(message["_wire"]["anthropic"][0]["signature"], "SIG");
    }
}
