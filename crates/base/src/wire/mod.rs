//! The wire formats memory serves: chat completions, the Responses API and the Anthropic
//! Messages API, each read into the one message model the pipeline works on and written back
//! from the prompt it assembled.
//!
//! # The neutral message
//!
//! Memory stores and plans chat-completions messages (`role`, `content`, `tool_calls`,
//! `tool_call_id`), whichever API wrote them, so a conversation is the same memory from any of
//! the three. What a format has beyond them rides along in a `_wire` field that memproxy owns
//! and never forwards as such:
//!
//! - `_wire.responses`: the Responses items the message stands for, as sent or answered
//!   (reasoning items with `encrypted_content`, `function_call`s, output messages), raw;
//! - `_wire.anthropic`: the Anthropic content blocks (`thinking`/`redacted_thinking` with their
//!   signatures, `tool_use`, `image`, `tool_result`), raw;
//! - `_wire.response_id`, `_wire.model`: the Responses answer a reply came from.
//!
//! A message written back to its own format is its raw items or blocks, byte for byte; to
//! another format it is rebuilt from the neutral fields (opaque parts cannot cross formats and
//! are left out). The fingerprint (`message.rs`) reads only the neutral fields, so a client
//! that drops its reasoning items or thinking blocks when it re-sends its history still
//! matches what is stored. Opaque parts have no text: they are never summarized, recalled or
//! indexed.
//!
//! # The provider's prompt cache
//!
//! Every writer keeps the prompt's order (`pipeline/assemble.rs`: stable parts first, recalled
//! turns last before the new messages), so consecutive prompts of a conversation share their
//! longest prefix. Chat completions and Responses requests also get a `prompt_cache_key`
//! ([`CacheHints::key`]) when the client set none, so the provider routes a conversation's
//! requests to the same cache; the Anthropic writer places recalled turns and `cache_control`
//! breakpoints as `anthropic.rs` describes.
//!
//! No HTTP here: the edge (`proxy/`) picks the format from the route.

pub mod anthropic;
pub mod responses;
pub mod usage;

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::message::{
    ChatRequest, InvalidRequest, Message, model_and_stream, parse_object, write_fields,
};

/// The field of a neutral message that carries what only one format has.
pub const WIRE_KEY: &str = "_wire";

/// The API a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages` (Anthropic).
    Anthropic,
}

impl Api {
    /// The API memory serves on a `POST` to `path` (`/v1/...`), if any.
    pub fn of_post(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/responses" => Some(Api::Responses),
            "/v1/messages" => Some(Api::Anthropic),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Responses => "responses",
            Api::Anthropic => "anthropic",
        }
    }
}

/// Which part of memproxy's prompt a message is (`pipeline/assemble.rs`): the Anthropic writer
/// places the parts apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The client's system/developer messages before the new ones.
    Instructions,
    /// memproxy's summary of older history.
    Summary,
    /// memproxy's message of the user's memories.
    Memories,
    /// Stored messages, verbatim.
    Window,
    /// memproxy's message of recalled older turns.
    Recalled,
    /// The request's new messages (and instructions among them), as sent.
    Incoming,
}

/// What a writer adds for the provider's prompt cache.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheHints {
    /// The `prompt_cache_key` to set on a chat-completions or Responses request whose client
    /// set none (the field present at all, even `null`, is the client's choice).
    pub key: Option<String>,
    /// Anthropic: `cache_control` breakpoints at the end of the stable parts, within the four
    /// the API allows.
    pub breakpoints: bool,
}

/// The field that names a prompt's cache on the OpenAI APIs.
pub const PROMPT_CACHE_KEY: &str = "prompt_cache_key";

/// A request of any of the three APIs: its top-level fields in order (raw), and its
/// conversation as neutral messages.
#[derive(Debug)]
pub struct ApiRequest {
    pub api: Api,
    fields: Vec<(String, Box<RawValue>)>,
    pub messages: Vec<Message>,
    pub model: Option<String>,
    pub stream: bool,
    /// The Responses API's `previous_response_id`.
    pub previous_response_id: Option<String>,
}

impl ApiRequest {
    /// Parses a request body of `api`. Errors name the field at fault as the client spells it.
    pub fn parse(api: Api, body: &[u8]) -> Result<ApiRequest, InvalidRequest> {
        let (fields, messages) = match api {
            Api::Chat => {
                let request = ChatRequest::parse(body)?;
                (request.fields, request.messages)
            }
            Api::Responses => {
                let fields = parse_object(body)?;
                let messages = responses::parse_input(&fields)?;
                (fields, messages)
            }
            Api::Anthropic => {
                let fields = parse_object(body)?;
                let messages = anthropic::parse_messages(&fields)?;
                (fields, messages)
            }
        };
        let (model, stream) = model_and_stream(&fields)?;
        let previous_response_id = match api {
            Api::Responses => responses::previous_id_field(&fields)?,
            _ => None,
        };
        Ok(ApiRequest {
            api,
            fields,
            messages,
            model,
            stream,
            previous_response_id,
        })
    }

    /// The body to forward: the prompt (neutral messages, in order) written in this request's
    /// format, every other field as it came. A Responses request goes stateless: its
    /// `previous_response_id` and `conversation` are left out, memory sends the history
    /// itself.
    pub fn render<'a>(&self, prompt: impl IntoIterator<Item = &'a RawValue>) -> Vec<u8> {
        self.render_parts(
            prompt.into_iter().map(|m| (Part::Incoming, m)),
            &CacheHints::default(),
        )
    }

    /// [`ApiRequest::render`] for a prompt whose messages are tagged with their part, with
    /// what `cache` asks for the provider's prompt cache.
    pub fn render_parts<'a>(
        &self,
        prompt: impl IntoIterator<Item = (Part, &'a RawValue)>,
        cache: &CacheHints,
    ) -> Vec<u8> {
        match self.api {
            Api::Chat => {
                let list = json_list(prompt.into_iter().filter_map(|(_, m)| for_chat(m)));
                let key = self.cache_key(cache);
                write_fields(&self.fields, added(&key), "messages", &list, &[])
            }
            Api::Responses => {
                let list = json_list(responses::render_input(prompt.into_iter().map(|(_, m)| m)));
                let key = self.cache_key(cache);
                write_fields(
                    &self.fields,
                    added(&key),
                    "input",
                    &list,
                    &["previous_response_id", "conversation"],
                )
            }
            Api::Anthropic => anthropic::render(&self.fields, prompt, cache.breakpoints),
        }
    }

    /// The `prompt_cache_key` to add after the client's fields: `cache`'s, when the client
    /// set none (the client's fields are written as they are, never copied).
    fn cache_key(&self, cache: &CacheHints) -> Option<Box<RawValue>> {
        let client_set = self.fields.iter().any(|(k, _)| k == PROMPT_CACHE_KEY);
        match &cache.key {
            Some(key) if !client_set => serde_json::value::to_raw_value(key).ok(),
            _ => None,
        }
    }
}

/// Why a request is a side call, not a turn of its conversation: the client asks something
/// about the conversation (a title, a classification, a compaction of its own) under the
/// same conversation id. Decided from the request's shape alone, never from a client's name
/// or its prompt's words:
///
/// - `no-tools`: it offers an empty tool list. A client that sends `tools: []` is saying this
///   call is not its agent's turn (chat completions refuse an empty list, so no plain chat
///   client sends one); Claude Code's title call and Codex's compaction call both do.
/// - `structured-output`: it asks for an answer bound to a JSON schema (Anthropic
///   `output_config.format` or `output_format`, Responses `text.format`, chat completions
///   `response_format`, each of type `json_schema`) and offers no tools: a value for the
///   program, not an answer in the conversation.
/// - `compaction`: a Responses input that asks the provider to compact the conversation (a
///   `compaction_trigger` item).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SideCall {
    NoTools,
    StructuredOutput,
    Compaction,
}

impl SideCall {
    pub fn as_str(self) -> &'static str {
        match self {
            SideCall::NoTools => "side-call-no-tools",
            SideCall::StructuredOutput => "side-call-structured-output",
            SideCall::Compaction => "side-call-compaction",
        }
    }
}

impl ApiRequest {
    /// The side call this request is, if it is one ([`SideCall`]).
    ///
    /// On every request's path, so the large fields (`tools`, `input`) are never built as
    /// values: an empty list is read as a list of nothing, and `input` is looked into only
    /// when its text names a `compaction_trigger`.
    pub fn side_call(&self) -> Option<SideCall> {
        let raw = |name: &str| {
            self.fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.get())
        };
        let field = |name: &str| raw(name).and_then(|v| serde_json::from_str::<Value>(v).ok());
        let tools = raw("tools");
        if tools.is_some_and(|t| {
            serde_json::from_str::<Vec<serde::de::IgnoredAny>>(t).is_ok_and(|t| t.is_empty())
        }) {
            return Some(SideCall::NoTools);
        }
        if self.api == Api::Responses
            && raw("input").is_some_and(|input| input.contains("\"compaction_trigger\""))
            && field("input")
                .as_ref()
                .and_then(Value::as_array)
                .is_some_and(|items| {
                    items.iter().any(|i| {
                        i.get("type").and_then(Value::as_str) == Some("compaction_trigger")
                    })
                })
        {
            return Some(SideCall::Compaction);
        }
        let schema = |value: Option<Value>, pointer: &str| {
            value
                .as_ref()
                .and_then(|v| v.pointer(pointer))
                .and_then(Value::as_str)
                == Some("json_schema")
        };
        let structured = match self.api {
            Api::Anthropic => {
                schema(field("output_config"), "/format/type")
                    || schema(field("output_format"), "/type")
            }
            Api::Responses => schema(field("text"), "/format/type"),
            Api::Chat => schema(field("response_format"), "/type"),
        };
        (structured && tools.is_none()).then_some(SideCall::StructuredOutput)
    }
}

/// `prompt_cache_key` as [`write_fields`] adds it.
fn added(key: &Option<Box<RawValue>>) -> Option<(&'static str, &RawValue)> {
    key.as_deref().map(|key| (PROMPT_CACHE_KEY, key))
}

/// The reply in a JSON answer of `api`, as a neutral assistant message.
pub fn reply_from_json(api: Api, body: &[u8]) -> Option<Box<RawValue>> {
    match api {
        Api::Chat => None,
        Api::Responses => responses::reply_from_json(body),
        Api::Anthropic => anthropic::reply_from_json(body),
    }
}

/// `[a,b,...]` from raw JSON values.
fn json_list<'a, T: AsRef<RawValue> + 'a>(items: impl IntoIterator<Item = T>) -> Vec<u8> {
    let mut list = Vec::with_capacity(4096);
    list.push(b'[');
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            list.push(b',');
        }
        list.extend_from_slice(item.as_ref().get().as_bytes());
    }
    list.push(b']');
    list
}

/// What memproxy keeps of a message's own format.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Wire {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub responses: Option<Vec<Box<RawValue>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub anthropic: Option<Vec<Box<RawValue>>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// A Responses answer's `created_at`, `status`, `usage` and `incomplete_details` (what
    /// `GET /v1/responses/{id}` answers besides the output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response: Option<Box<RawValue>>,
    /// A system message that is a turn, kept where the client put it (an Anthropic
    /// `system`-role message inside `messages`): stored and replayed in place, never moved
    /// into the instructions.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_place: bool,
    /// A user message sent in the same turn as tool results (an Anthropic user turn holding
    /// `tool_result` blocks and text): it continues the tool loop, it opens no round.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub beside_results: bool,
}

/// A neutral message, written with `role` first.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Neutral {
    pub role: String,
    #[serde(default)]
    pub content: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(rename = "_wire", default, skip_serializing_if = "Option::is_none")]
    pub wire: Option<Wire>,
}

impl Neutral {
    /// Reads a stored or planned message; `None` for one that is not a message object.
    pub fn read(raw: &RawValue) -> Option<Neutral> {
        serde_json::from_str(raw.get()).ok()
    }

    /// The message as raw JSON.
    pub fn to_raw(&self) -> Box<RawValue> {
        // Serializing plain values and raw JSON cannot fail.
        serde_json::value::to_raw_value(self).unwrap_or_else(|_| Box::<RawValue>::default())
    }

    /// The content's text: a string, or its text parts joined by newlines.
    pub fn text(&self) -> String {
        content_text(&self.content)
    }

    /// The tool calls as `(id, name, arguments)`.
    pub fn calls(&self) -> Vec<(String, String, String)> {
        self.tool_calls
            .iter()
            .flatten()
            .map(|call| {
                let field = |pointer: &str| {
                    call.pointer(pointer)
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string()
                };
                (
                    field("/id"),
                    field("/function/name"),
                    field("/function/arguments"),
                )
            })
            .collect()
    }
}

/// The text of a content value: a string, or the `text` of its parts joined by newlines.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A chat-completions tool call.
fn tool_call(id: &str, name: &str, arguments: &str) -> Value {
    serde_json::json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// A neutral message as chat completions take it: without `_wire`, and `None` for one that is
/// only opaque parts (a reasoning item, thinking alone), which chat completions cannot carry.
/// A message without `_wire` is passed as it is.
pub fn for_chat(raw: &RawValue) -> Option<Cow<'_, RawValue>> {
    if !raw.get().contains("\"_wire\"") {
        return Some(Cow::Borrowed(raw));
    }
    let Some(mut neutral) = Neutral::read(raw) else {
        return Some(Cow::Borrowed(raw));
    };
    if neutral.wire.take().is_none() {
        return Some(Cow::Borrowed(raw));
    }
    let empty = match &neutral.content {
        Value::Null => true,
        Value::String(text) => text.is_empty(),
        Value::Array(parts) => parts.is_empty(),
        _ => false,
    };
    if neutral.role == "assistant" && empty && neutral.tool_calls.is_none() {
        return None;
    }
    if neutral.role == "assistant" && empty {
        neutral.content = Value::Null;
    }
    Some(Cow::Owned(neutral.to_raw()))
}

/// `message` as it is stored: without the `cache_control` markers of its Anthropic blocks.
/// A marker is the client's hint for one request (it moves its breakpoints to the newest
/// message each time); replayed from the store it would pile up past the API's four.
pub fn stored_form(message: Message) -> Message {
    if !message.raw.get().contains("\"cache_control\"") {
        return message;
    }
    let Some(mut neutral) = Neutral::read(&message.raw) else {
        return message;
    };
    let Some(blocks) = neutral.wire.as_mut().and_then(|w| w.anthropic.as_mut()) else {
        return message;
    };
    for block in blocks.iter_mut() {
        if let Some(stripped) = anthropic::strip_markers(block) {
            *block = stripped;
        }
    }
    Message {
        raw: neutral.to_raw(),
        ..message
    }
}

/// Whether `raw` (a neutral message) holds a provider's compaction: an Anthropic `compaction`
/// block or a Responses `compaction` item (server-side compaction, or `/v1/responses/compact`'s
/// output). The provider reads nothing before the newest one ("drop items that came before the
/// most recent compaction item"; "the API drops all message blocks prior to the compaction
/// block"), so the recent window starts there and what came before is left to recall.
pub fn holds_compaction(raw: &RawValue) -> bool {
    if !raw.get().contains("compaction") {
        return false;
    }
    let Some(wire) = Neutral::read(raw).and_then(|n| n.wire) else {
        return false;
    };
    wire.anthropic
        .iter()
        .chain(wire.responses.iter())
        .flatten()
        .any(|part| {
            #[derive(Deserialize)]
            struct Typed<'a> {
                #[serde(borrow, rename = "type")]
                kind: Option<Cow<'a, str>>,
            }
            serde_json::from_str::<Typed>(part.get())
                .is_ok_and(|t| t.kind.as_deref() == Some("compaction"))
        })
}

/// The Responses id a stored reply came from.
pub fn response_id_of(raw: &RawValue) -> Option<String> {
    if !raw.get().contains("\"response_id\"") {
        return None;
    }
    Neutral::read(raw)?.wire?.response_id
}

/// Parses a neutral message built here (`path` names where it came from in errors).
fn parsed(raw: Box<RawValue>, path: &str) -> Result<Message, InvalidRequest> {
    Message::parse(raw, path).map_err(|e| InvalidRequest::field(e.field.clone(), e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_providers_compaction_is_found_in_either_format_and_nowhere_else() {
        let raw = |v: Value| RawValue::from_string(v.to_string()).unwrap();
        let anthropic = json!({"role": "assistant", "content": "ok", "_wire": {"anthropic": [
            {"type": "compaction", "content": "Summary: …"}, {"type": "text", "text": "ok"}]}});
        assert!(holds_compaction(&raw(anthropic)));
        let responses = json!({"role": "assistant", "content": null, "_wire": {"responses": [
            {"type": "compaction", "id": "cmp_1", "encrypted_content": "e"}]}});
        assert!(holds_compaction(&raw(responses)));
        // The word in a text, or another item type, is no compaction.
        let said = json!({"role": "assistant", "content": "type compaction", "_wire": {"anthropic": [
            {"type": "text", "text": "\"type\":\"compaction\""}]}});
        assert!(!holds_compaction(&raw(said)));
        let trigger = json!({"role": "assistant", "content": null, "_wire": {"responses": [
            {"type": "compaction_trigger"}]}});
        assert!(!holds_compaction(&raw(trigger)));
        assert!(!holds_compaction(&raw(
            json!({"role": "user", "content": "compaction"})
        )));
    }

    #[test]
    fn a_stored_message_keeps_no_cache_marker() {
        let message = Message::parse(
            RawValue::from_string(
                json!({"role": "user", "content": "q", "_wire": {"anthropic": [
                    {"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}},
                    {"type": "tool_result", "tool_use_id": "t", "content": [
                        {"type": "text", "text": "r", "cache_control": {"type": "ephemeral"}}]}]}})
                .to_string(),
            )
            .unwrap(),
            "m",
        )
        .unwrap();
        let fingerprint = message.fingerprint;
        let stored = stored_form(message);
        assert!(
            !stored.raw.get().contains("cache_control"),
            "{}",
            stored.raw.get()
        );
        assert!(stored.raw.get().contains("tool_result"));
        assert_eq!(
            stored.fingerprint, fingerprint,
            "a marker is no part of the message"
        );
    }

    #[test]
    fn chat_drops_wire_and_opaque_only_messages() {
        let plain = RawValue::from_string(r#"{"role":"user","content":"x"}"#.into()).unwrap();
        assert!(matches!(for_chat(&plain), Some(Cow::Borrowed(_))));
        let opaque = RawValue::from_string(
            r#"{"role":"assistant","content":null,"_wire":{"responses":[{"type":"reasoning","encrypted_content":"e"}]}}"#.into(),
        )
        .unwrap();
        assert!(for_chat(&opaque).is_none());
        let mixed = RawValue::from_string(
            r#"{"role":"assistant","content":"hi","_wire":{"anthropic":[{"type":"thinking","signature":"s"},{"type":"text","text":"hi"}]}}"#.into(),
        )
        .unwrap();
        let out: Value = serde_json::from_str(for_chat(&mixed).unwrap().get()).unwrap();
        assert_eq!(out, json!({"role": "assistant", "content": "hi"}));
    }

    #[test]
    fn the_prompt_cache_key_is_set_only_when_the_client_set_none() {
        let cache = CacheHints {
            key: Some("mp-0123".into()),
            breakpoints: true,
        };
        let user = RawValue::from_string(r#"{"role":"user","content":"x"}"#.into()).unwrap();
        let prompt = [(Part::Incoming, &*user)];
        for (api, body) in [
            (
                Api::Chat,
                json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}),
            ),
            (Api::Responses, json!({"model": "m", "input": "x"})),
        ] {
            let request = ApiRequest::parse(api, body.to_string().as_bytes()).unwrap();
            let out: Value = serde_json::from_slice(&request.render_parts(prompt, &cache)).unwrap();
            assert_eq!(out[PROMPT_CACHE_KEY], "mp-0123", "{api:?}");
            let out: Value =
                serde_json::from_slice(&request.render_parts(prompt, &CacheHints::default()))
                    .unwrap();
            assert!(out.get(PROMPT_CACHE_KEY).is_none(), "{api:?}");
            // The client's own, even null, is left alone.
            for own in [json!("mine"), Value::Null] {
                let mut body = body.clone();
                body[PROMPT_CACHE_KEY] = own.clone();
                let request = ApiRequest::parse(api, body.to_string().as_bytes()).unwrap();
                let text = request.render_parts(prompt, &cache);
                let out: Value = serde_json::from_slice(&text).unwrap();
                assert_eq!(out[PROMPT_CACHE_KEY], own, "{api:?}");
                assert_eq!(
                    String::from_utf8(text)
                        .unwrap()
                        .matches(PROMPT_CACHE_KEY)
                        .count(),
                    1
                );
            }
        }
        // Never sent to Anthropic.
        let body =
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
        let request = ApiRequest::parse(Api::Anthropic, body.to_string().as_bytes()).unwrap();
        let out: Value = serde_json::from_slice(&request.render_parts(prompt, &cache)).unwrap();
        assert!(out.get(PROMPT_CACHE_KEY).is_none());
    }

    #[test]
    fn side_calls_are_told_by_their_shape() {
        let side = |api: Api, body: Value| {
            ApiRequest::parse(api, body.to_string().as_bytes())
                .unwrap()
                .side_call()
        };
        let user = json!([{"role": "user", "content": "x"}]);
        let schema = json!({"type": "json_schema", "schema": {"type": "object"}});
        // Claude Code's title call: no tools, a JSON schema.
        assert_eq!(
            side(
                Api::Anthropic,
                json!({"model": "m", "max_tokens": 5, "tools": [], "messages": user, "output_config": {"format": schema}})
            ),
            Some(SideCall::NoTools)
        );
        assert_eq!(
            side(
                Api::Anthropic,
                json!({"model": "m", "max_tokens": 5, "messages": user, "output_format": schema})
            ),
            Some(SideCall::StructuredOutput)
        );
        assert_eq!(
            side(
                Api::Chat,
                json!({"model": "m", "messages": user, "response_format": schema})
            ),
            Some(SideCall::StructuredOutput)
        );
        assert_eq!(
            side(
                Api::Responses,
                json!({"model": "m", "input": [{"role": "user", "content": "x"}, {"type": "compaction_trigger"}]})
            ),
            Some(SideCall::Compaction)
        );
        // Turns: tools offered (with a schema too), plain text, a text that names the trigger.
        let tool = json!([{"name": "t", "input_schema": {"type": "object"}}]);
        assert_eq!(
            side(
                Api::Anthropic,
                json!({"model": "m", "max_tokens": 5, "tools": tool, "messages": user, "output_config": {"format": schema}})
            ),
            None
        );
        assert_eq!(
            side(Api::Chat, json!({"model": "m", "messages": user})),
            None
        );
        assert_eq!(
            side(
                Api::Responses,
                json!({"model": "m", "input": "what is a \"compaction_trigger\"?"})
            ),
            None
        );
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn json_value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i32>().prop_map(|n| json!(n)),
                prop_oneof![
                    Just("user"),
                    Just("assistant"),
                    Just("system"),
                    Just("message"),
                    Just("function_call"),
                    Just("function_call_output"),
                    Just("reasoning"),
                    Just("tool_use"),
                    Just("tool_result"),
                    Just("text"),
                    Just("thinking"),
                    Just("c1"),
                ]
                .prop_map(|s| json!(s)),
                "[a-z\\u{4e00}-\\u{4e02}\"]{0,6}".prop_map(Value::String),
            ];
            leaf.prop_recursive(4, 32, 5, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    proptest::collection::btree_map(
                        prop_oneof![
                            Just("type".to_string()),
                            Just("role".to_string()),
                            Just("content".to_string()),
                            Just("call_id".to_string()),
                            Just("tool_use_id".to_string()),
                            Just("id".to_string()),
                            Just("name".to_string()),
                            Just("arguments".to_string()),
                            Just("input".to_string()),
                            Just("output".to_string()),
                            Just("text".to_string()),
                            "[a-z]{1,3}",
                        ],
                        inner,
                        0..5,
                    )
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        proptest! {
            /// Any JSON as a Responses `input` or Anthropic `messages`: parsed, or a 400 with a
            /// param; a parsed request renders to valid JSON in its format and for chat.
            #[test]
            fn arbitrary_bodies_are_parsed_or_refused_with_a_param(list in json_value()) {
                for (api, field) in [(Api::Responses, "input"), (Api::Anthropic, "messages")] {
                    let body = json!({"model": "m", field: list.clone(), "system": "s"}).to_string();
                    match ApiRequest::parse(api, body.as_bytes()) {
                        Ok(request) => {
                            let prompt: Vec<&RawValue> = request.messages.iter().map(|m| &*m.raw).collect();
                            let out = request.render(prompt.iter().copied());
                            prop_assert!(serde_json::from_slice::<Value>(&out).is_ok());
                            for raw in prompt {
                                if let Some(chat) = for_chat(raw) {
                                    prop_assert!(serde_json::from_str::<Value>(chat.get()).is_ok());
                                }
                            }
                        }
                        Err(err) => prop_assert!(err.param.is_some() || err.code == "invalid_json"),
                    }
                }
            }
        }
    }
}
