//! The chat-completions request as memproxy sees it: the top-level fields kept as raw JSON in
//! their order, and the `messages` parsed just enough to know each one's role, fingerprint and
//! tool-call links.
//!
//! Nothing here rewrites a value it does not own: every field but `messages` is written back
//! byte for byte, so key order and number formatting survive, and each message is forwarded as
//! the raw JSON the client sent (or that was stored).

use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// A message's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
    Function,
}

impl Role {
    pub fn parse(text: &str) -> Option<Role> {
        Some(match text {
            "system" => Role::System,
            "developer" => Role::Developer,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            "function" => Role::Function,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Function => "function",
        }
    }

    /// System and developer messages are the client's instructions, not conversation turns.
    pub fn is_instruction(self) -> bool {
        matches!(self, Role::System | Role::Developer)
    }
}

/// Anything with a role: request messages, stored entries, plain roles. Lets the window and
/// alignment code read roles in place instead of copying them out per request.
pub trait HasRole {
    fn role(&self) -> Role;
}

impl HasRole for Role {
    fn role(&self) -> Role {
        *self
    }
}

impl HasRole for Message {
    fn role(&self) -> Role {
        self.role
    }
}

/// One message as sent (or as stored), with what memproxy needs to know of it.
#[derive(Debug, Clone)]
pub struct Message {
    pub raw: Box<RawValue>,
    pub role: Role,
    /// Identity of the message's meaning (role, text, name, tool calls), independent of key
    /// order and of fields memproxy does not compare. Two sends of the same message match.
    pub fingerprint: u64,
    /// The `id`s of an assistant message's `tool_calls`.
    pub tool_call_ids: Vec<String>,
    /// The `tool_call_id` a tool message answers.
    pub tool_call_id: Option<String>,
    /// A system message memproxy itself injected (recalled turns, a summary), sent back by a
    /// client: never stored or forwarded twice. Decided once, when the message is parsed.
    pub injected: bool,
    /// A system message that is a turn of the conversation, kept in place (an Anthropic
    /// `system`-role message inside `messages`, `_wire.in_place`): stored like any turn, not
    /// gathered with the instructions.
    pub in_place: bool,
}

/// How the recalled-turns message memproxy injects begins.
pub const RECALL_MARKER: &str = "[Earlier in this conversation";
/// How the summary message memproxy injects begins.
pub const SUMMARY_MARKER: &str = "[Summary of earlier conversation";
/// How the message of extracted memories memproxy injects begins (long-term memory).
pub const MEMORIES_MARKER: &str = "[What you know about this user";

/// Why a message could not be read; `index` is its position in `messages`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct MessageError {
    pub field: String,
    pub why: String,
}

/// Why a request body was refused: a message for the client, the field at fault (as the
/// client spells it) and a stable code. The edge turns it into a 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidRequest {
    pub message: String,
    pub param: Option<String>,
    pub code: &'static str,
}

impl InvalidRequest {
    pub fn field(param: impl Into<String>, message: impl Into<String>) -> InvalidRequest {
        InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
            code: "invalid_request_body",
        }
    }
}

impl Message {
    /// Parses one message object. `path` names it in errors (`messages[3]`).
    pub fn parse(raw: Box<RawValue>, path: &str) -> Result<Message, MessageError> {
        let err = |field: &str, why: &str| MessageError {
            field: format!("{path}{field}"),
            why: why.to_string(),
        };
        let object: Map<String, Value> =
            serde_json::from_str(raw.get()).map_err(|_| err("", "must be a JSON object"))?;
        let role_text = object
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| err(".role", "is required and must be a string"))?;
        let role = Role::parse(role_text).ok_or_else(|| {
            err(
                ".role",
                "must be one of system, developer, user, assistant, tool, function",
            )
        })?;
        let tool_call_ids = match object.get("tool_calls") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(calls)) => calls
                .iter()
                .map(|call| call.get("id").and_then(Value::as_str).map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| err(".tool_calls", "each tool call needs a string `id`"))?,
            Some(_) => return Err(err(".tool_calls", "must be an array")),
        };
        let tool_call_id = match object.get("tool_call_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(id)) => Some(id.clone()),
            Some(_) => return Err(err(".tool_call_id", "must be a string")),
        };
        if role == Role::Tool && tool_call_id.is_none() {
            return Err(err(".tool_call_id", "is required on a tool message"));
        }
        let injected = role.is_instruction()
            && object
                .get("content")
                .and_then(Value::as_str)
                .is_some_and(|c| {
                    c.starts_with(RECALL_MARKER)
                        || c.starts_with(SUMMARY_MARKER)
                        || c.starts_with(MEMORIES_MARKER)
                });
        // `_wire` is the neutral message's own field (`wire::WIRE_KEY`; `wire` builds on this
        // module, not the other way round).
        let in_place = role == Role::System
            && object
                .get("_wire")
                .and_then(|wire| wire.get("in_place"))
                .and_then(Value::as_bool)
                .unwrap_or(false);
        Ok(Message {
            fingerprint: fingerprint(role, &object),
            raw,
            role,
            tool_call_ids,
            tool_call_id,
            injected,
            in_place,
        })
    }

    /// A user message that opens a round: not one sent beside tool results, which continues
    /// the round (`_wire.beside_results`).
    pub fn opens_round(&self) -> bool {
        opens_round(self.role, &self.raw)
    }

    /// The client's instructions (system and developer messages), not turns of the
    /// conversation: a system message kept in place ([`Message::in_place`]) is a turn.
    pub fn is_instruction(&self) -> bool {
        self.role.is_instruction() && !self.in_place
    }

    /// The message's text: content text parts joined by newlines, then any tool calls as
    /// `name(arguments)`. Used for token counts and search, never forwarded.
    pub fn text(&self) -> String {
        match serde_json::from_str::<Map<String, Value>>(self.raw.get()) {
            Ok(object) => text_of(&object),
            Err(_) => String::new(),
        }
    }

    /// The text (for token counts) and the searchable text (for recall), from one parse.
    pub fn text_and_search_text(&self) -> (String, String) {
        match serde_json::from_str::<Map<String, Value>>(self.raw.get()) {
            Ok(object) => {
                let text = text_of(&object);
                let search = with_name(text.clone(), &object);
                (text, search)
            }
            Err(_) => (String::new(), String::new()),
        }
    }
}

/// True for a user message (`role`, `raw`) that opens a round, not one sent beside tool
/// results (`_wire.beside_results`, which serde writes exactly so: a client's text holding
/// those characters has its quotes escaped).
pub fn opens_round(role: Role, raw: &RawValue) -> bool {
    role == Role::User && !raw.get().contains("\"beside_results\":true")
}

/// The searchable text of a raw stored message: [`text_of`] and its `name`.
pub fn search_text(raw: &RawValue) -> String {
    match serde_json::from_str::<Map<String, Value>>(raw.get()) {
        Ok(object) => with_name(text_of(&object), &object),
        Err(_) => String::new(),
    }
}

fn with_name(mut text: String, object: &Map<String, Value>) -> String {
    if let Some(name) = object.get("name").and_then(Value::as_str) {
        text.push(' ');
        text.push_str(name);
    }
    text
}

/// The text of a parsed message object (see [`Message::text`]).
pub fn text_of(object: &Map<String, Value>) -> String {
    let mut out = String::new();
    match object.get("content") {
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => {
            for part in parts {
                if let Some(text) = part.get("text").and_then(Value::as_str) {
                    if !out.is_empty() {
                        out.push('\n');
                    }
                    out.push_str(text);
                }
            }
        }
        _ => {}
    }
    if let Some(Value::Array(calls)) = object.get("tool_calls") {
        for call in calls {
            let function = call.get("function");
            let name = function
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .unwrap_or("tool");
            let args = function
                .and_then(|f| f.get("arguments"))
                .and_then(Value::as_str)
                .unwrap_or("");
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(name);
            out.push('(');
            out.push_str(args);
            out.push(')');
        }
    }
    out
}

/// A stable 64-bit identity of a message's meaning. Content given as a string and as one text
/// part are the same; `null` and empty content are the same; key order and fields such as
/// `refusal: null` do not count.
fn fingerprint(role: Role, object: &Map<String, Value>) -> u64 {
    const SEP: &[u8] = &[0x1f];
    let mut hasher = Sha256::new();
    hasher.update(role.as_str());
    hasher.update(SEP);
    match object.get("content") {
        Some(Value::String(s)) => hasher.update(s),
        Some(Value::Array(parts)) => {
            // One text part hashes like the same text sent as a string.
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    hasher.update([0x1e]);
                }
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text") | None, Some(Value::String(text))) => hasher.update(text),
                    _ => hasher.update(canonical_json(part)),
                }
            }
        }
        _ => {}
    }
    hasher.update(SEP);
    if let Some(Value::String(name)) = object.get("name") {
        hasher.update(name);
    }
    hasher.update(SEP);
    if let Some(Value::Array(calls)) = object.get("tool_calls") {
        for call in calls {
            let mut call = call.clone();
            if let Value::Object(map) = &mut call {
                map.remove("index");
                if map.get("type").and_then(Value::as_str) == Some("function") {
                    map.remove("type");
                }
            }
            hasher.update(canonical_json(&call));
            hasher.update([0x1e]);
        }
    }
    hasher.update(SEP);
    if let Some(Value::String(id)) = object.get("tool_call_id") {
        hasher.update(id);
    }
    let digest = hasher.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// JSON text with object keys sorted at every level, so equal values give equal text whatever
/// their key order (serde_json keeps insertion order when a dependency enables
/// `preserve_order`).
pub fn canonical_json(value: &Value) -> String {
    fn write(value: &Value, out: &mut String) {
        match value {
            Value::Object(map) => {
                let mut keys: Vec<&String> = map.keys().collect();
                keys.sort();
                out.push('{');
                for (i, key) in keys.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::String(key.clone()).to_string());
                    out.push(':');
                    write(&map[key], out);
                }
                out.push('}');
            }
            Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write(item, out);
                }
                out.push(']');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let mut out = String::new();
    write(value, &mut out);
    out
}

/// A chat-completions request: its top-level fields in order (raw), and its messages parsed.
#[derive(Debug)]
pub struct ChatRequest {
    pub fields: Vec<(String, Box<RawValue>)>,
    pub messages: Vec<Message>,
    pub model: Option<String>,
    pub stream: bool,
}

impl ChatRequest {
    /// Parses a request body. Errors name the field at fault.
    pub fn parse(body: &[u8]) -> Result<ChatRequest, InvalidRequest> {
        let fields = parse_object(body)?;
        let field = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
        let bad = |param: &str, why: &str| InvalidRequest::field(param, format!("`{param}` {why}"));

        let raw_messages = field("messages").ok_or_else(|| bad("messages", "is required"))?;
        let list: Vec<Box<RawValue>> = serde_json::from_str(raw_messages.get())
            .map_err(|_| bad("messages", "must be an array of message objects"))?;
        let mut messages = Vec::with_capacity(list.len());
        for (i, raw) in list.into_iter().enumerate() {
            let message = Message::parse(raw, &format!("messages[{i}]"))
                .map_err(|e| InvalidRequest::field(e.field.clone(), e.to_string()))?;
            messages.push(message);
        }
        let (model, stream) = model_and_stream(&fields)?;
        Ok(ChatRequest {
            fields,
            messages,
            model,
            stream,
        })
    }

    /// The request body with `messages` replaced by `messages`; every other field is written
    /// back as it came, in its place.
    pub fn body_with_messages<'a>(
        &self,
        messages: impl IntoIterator<Item = &'a RawValue>,
    ) -> Vec<u8> {
        let mut list = Vec::with_capacity(4096);
        list.push(b'[');
        for (i, message) in messages.into_iter().enumerate() {
            if i > 0 {
                list.push(b',');
            }
            list.extend_from_slice(message.get().as_bytes());
        }
        list.push(b']');

        write_fields(&self.fields, None, "messages", &list, &[])
    }
}

/// A request body's top-level fields, in document order, as raw JSON; errors say what is wrong
/// with the body as a whole.
pub fn parse_object(body: &[u8]) -> Result<Vec<(String, Box<RawValue>)>, InvalidRequest> {
    let RawObject(fields) = serde_json::from_slice(body).map_err(|err| {
        let why = if err.is_data() {
            "the request body must be a JSON object".to_string()
        } else {
            format!("the request body is not valid JSON ({err})")
        };
        InvalidRequest {
            message: why,
            param: None,
            code: "invalid_json",
        }
    })?;
    Ok(fields)
}

/// The `model` (a string) and `stream` (a boolean, `null` for false) fields, checked.
pub fn model_and_stream(
    fields: &[(String, Box<RawValue>)],
) -> Result<(Option<String>, bool), InvalidRequest> {
    let field = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
    let bad = |param: &str, why: &str| InvalidRequest::field(param, format!("`{param}` {why}"));
    let model = match field("model") {
        None => None,
        Some(raw) => Some(
            serde_json::from_str::<String>(raw.get())
                .map_err(|_| bad("model", "must be a string"))?,
        ),
    };
    let stream = match field("stream") {
        None => false,
        Some(raw) => match serde_json::from_str::<Option<bool>>(raw.get()) {
            Ok(flag) => flag.unwrap_or(false),
            Err(_) => return Err(bad("stream", "must be a boolean")),
        },
    };
    Ok((model, stream))
}

/// Writes `fields` back as a JSON object: `key`'s value replaced by `replacement` (raw JSON,
/// appended at the end when the body had no such field), the fields in `drop` left out, every
/// other field byte for byte in its place; `added`, a field the body did not have, after them.
pub fn write_fields(
    fields: &[(String, Box<RawValue>)],
    added: Option<(&str, &RawValue)>,
    key: &str,
    replacement: &[u8],
    drop: &[&str],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(replacement.len() + 1024);
    out.push(b'{');
    let mut first = true;
    let mut replaced = false;
    let mut put = |out: &mut Vec<u8>, name: &str, value: &[u8]| {
        if !first {
            out.push(b',');
        }
        first = false;
        // Writing a String to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, name);
        out.push(b':');
        out.extend_from_slice(value);
    };
    for (name, value) in fields {
        if drop.contains(&name.as_str()) {
            continue;
        }
        if name == key {
            replaced = true;
            put(&mut out, name, replacement);
        } else {
            put(&mut out, name, value.get().as_bytes());
        }
    }
    if let Some((name, value)) = added {
        put(&mut out, name, value.get().as_bytes());
    }
    if !replaced {
        put(&mut out, key, replacement);
    }
    out.push(b'}');
    out
}

/// A JSON object read as `(key, raw value)` pairs in document order.
pub struct RawObject(pub Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for RawObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PairsVisitor;
        impl<'de> Visitor<'de> for PairsVisitor {
            type Value = RawObject;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawObject, A::Error> {
                let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(8));
                while let Some((key, value)) = map.next_entry::<String, Box<RawValue>>()? {
                    pairs.push((key, value));
                }
                Ok(RawObject(pairs))
            }
        }
        deserializer.deserialize_map(PairsVisitor)
    }
}

/// Checks a forwarded `messages` list the way the OpenAI API does: every `tool` message answers
/// a `tool_call_id` of the assistant message before it (with only tool messages between), and
/// every assistant `tool_calls` id is answered before the next non-tool message.
pub fn check_tool_sequence(messages: &[Value]) -> Result<(), String> {
    let mut open: Vec<String> = Vec::new();
    let mut answered: Vec<String> = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Value::as_str).unwrap_or("");
        if role == "tool" {
            let id = message
                .get("tool_call_id")
                .and_then(Value::as_str)
                .unwrap_or("");
            if !open.iter().any(|open_id| open_id == id) {
                return Err(format!(
                    "messages[{i}]: tool message answers `{id}`, which the assistant message before it did not call"
                ));
            }
            answered.push(id.to_string());
            continue;
        }
        if let Some(missing) = open.iter().find(|id| !answered.contains(id)) {
            return Err(format!(
                "messages[{i}]: tool call `{missing}` was not answered before this message"
            ));
        }
        open.clear();
        answered.clear();
        if role == "assistant"
            && let Some(Value::Array(calls)) = message.get("tool_calls")
        {
            open = calls
                .iter()
                .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_string))
                .collect();
        }
    }
    if let Some(missing) = open.iter().find(|id| !answered.contains(id)) {
        return Err(format!("tool call `{missing}` was never answered"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn message(value: Value) -> Message {
        Message::parse(RawValue::from_string(value.to_string()).unwrap(), "m").unwrap()
    }

    #[test]
    fn fingerprints_ignore_form_but_not_meaning() {
        let a = message(json!({"role": "user", "content": "hi"}));
        let b = message(json!({"content": "hi", "role": "user"}));
        let c = message(json!({"role": "user", "content": [{"type": "text", "text": "hi"}]}));
        let d = message(json!({"role": "assistant", "content": "hi"}));
        let e = message(json!({"role": "user", "content": "hi!"}));
        assert_eq!(a.fingerprint, b.fingerprint);
        assert_eq!(a.fingerprint, c.fingerprint);
        assert_ne!(a.fingerprint, d.fingerprint);
        assert_ne!(a.fingerprint, e.fingerprint);

        let call =
            json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
        let sdk = message(
            json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": call}),
        );
        let ours = message(
            json!({"role": "assistant", "tool_calls": [{"index": 0, "id": "c1", "function": {"arguments": "{}", "name": "f"}}]}),
        );
        assert_eq!(sdk.fingerprint, ours.fingerprint);
        assert_eq!(sdk.tool_call_ids, vec!["c1".to_string()]);
    }

    #[test]
    fn messages_are_checked() {
        let bad = |v: Value| {
            Message::parse(RawValue::from_string(v.to_string()).unwrap(), "messages[2]")
                .unwrap_err()
        };
        assert_eq!(bad(json!({"content": "x"})).field, "messages[2].role");
        assert_eq!(bad(json!({"role": "robot"})).field, "messages[2].role");
        assert_eq!(
            bad(json!({"role": "tool", "content": "x"})).field,
            "messages[2].tool_call_id"
        );
        assert_eq!(bad(json!([1])).field, "messages[2]");
    }

    #[test]
    fn unknown_fields_and_formatting_survive_a_rewrite() {
        let body = br#"{"model":"m","temperature":1.0,"zeta":{"b":1,"a":2e3},"messages":[{"role":"user","content":"x"}],"alpha":[1.50]}"#;
        let request = ChatRequest::parse(body).unwrap();
        let same = request.body_with_messages(request.messages.iter().map(|m| &*m.raw));
        assert_eq!(same, body.to_vec());
        let injected = RawValue::from_string(r#"{"role":"system","content":"s"}"#.into()).unwrap();
        let rewritten = request.body_with_messages([&*injected]);
        assert_eq!(
            String::from_utf8(rewritten).unwrap(),
            r#"{"model":"m","temperature":1.0,"zeta":{"b":1,"a":2e3},"messages":[{"role":"system","content":"s"}],"alpha":[1.50]}"#
        );
    }

    #[test]
    fn request_errors_name_the_field() {
        let param = |body: &[u8]| {
            let InvalidRequest { param, code, .. } = ChatRequest::parse(body).unwrap_err();
            (param, code)
        };
        assert_eq!(param(b"{not json"), (None, "invalid_json"));
        assert_eq!(param(b"[1,2]"), (None, "invalid_json"));
        assert_eq!(param(br#"{"model":"m"}"#).0.as_deref(), Some("messages"));
        assert_eq!(param(br#"{"messages":{}}"#).0.as_deref(), Some("messages"));
        assert_eq!(
            param(br#"{"messages":[],"stream":"yes"}"#).0.as_deref(),
            Some("stream")
        );
        assert_eq!(
            param(br#"{"messages":[{"role":"user"},{"role":7}]}"#)
                .0
                .as_deref(),
            Some("messages[1].role")
        );
        let ok = ChatRequest::parse(br#"{"messages":[],"stream":true,"model":"gpt-4o"}"#).unwrap();
        assert!(ok.stream);
        assert_eq!(ok.model.as_deref(), Some("gpt-4o"));
    }

    #[test]
    fn tool_sequences_are_validated() {
        let call = |id: &str| json!({"role": "assistant", "tool_calls": [{"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}}]});
        let result = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "ok"});
        let user = json!({"role": "user", "content": "q"});
        assert!(check_tool_sequence(&[user.clone(), call("a"), result("a"), user.clone()]).is_ok());
        assert!(check_tool_sequence(&[result("a"), user.clone()]).is_err());
        assert!(check_tool_sequence(&[call("a"), user.clone()]).is_err());
        assert!(check_tool_sequence(&[call("a"), result("b")]).is_err());
        assert!(check_tool_sequence(&[call("a")]).is_err());
    }

    #[test]
    fn text_joins_parts_and_tool_calls() {
        let m = message(
            json!({"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "get", "arguments": "{\"x\":1}"}}]}),
        );
        assert_eq!(m.text(), "a\nb\nget({\"x\":1})");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn json_value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(|n| json!(n)),
                "[a-z\\u{4e00}-\\u{4e05}\"\\\\]{0,8}".prop_map(Value::String),
                prop_oneof![
                    Just("user"),
                    Just("assistant"),
                    Just("tool"),
                    Just("system")
                ]
                .prop_map(|r| json!(r)),
            ];
            leaf.prop_recursive(4, 32, 6, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                    proptest::collection::btree_map(
                        prop_oneof![
                            Just("role".to_string()),
                            Just("content".to_string()),
                            Just("tool_calls".to_string()),
                            Just("tool_call_id".to_string()),
                            Just("id".to_string()),
                            Just("messages".to_string()),
                            Just("stream".to_string()),
                            Just("model".to_string()),
                            "[a-z]{1,4}"
                        ],
                        inner,
                        0..5,
                    )
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        proptest! {
            /// Any bytes: a parsed request or a 400 naming its cause; never a panic.
            #[test]
            fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
                // Every refusal is an `InvalidRequest`, which the edge answers with a 400
                // (`error::tests::an_invalid_request_is_a_400`).
                if let Err(err) = ChatRequest::parse(&bytes) {
                    prop_assert!(!err.code.is_empty());
                }
            }

            /// Any JSON shape, including messages of every form: parsed, or a 400 with a
            /// param; a parsed request writes back to valid JSON.
            #[test]
            fn arbitrary_json_is_parsed_or_refused_with_a_param(mut value in json_value(), messages in json_value()) {
                if let Value::Object(map) = &mut value {
                    map.insert("messages".into(), messages);
                }
                let body = value.to_string();
                match ChatRequest::parse(body.as_bytes()) {
                    Ok(request) => {
                        let out = request.body_with_messages(request.messages.iter().map(|m| &*m.raw));
                        prop_assert!(serde_json::from_slice::<Value>(&out).is_ok());
                    }
                    Err(InvalidRequest { param, code, .. }) => {
                        prop_assert!(param.is_some() || code == "invalid_json");
                    }
                }
            }
        }
    }
}
