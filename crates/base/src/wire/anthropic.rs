//! The Anthropic Messages API (`POST /v1/messages`) read into neutral messages and written
//! back.
//!
//! - The top-level `system` (a string or text blocks) is the client's instructions: never a
//!   turn, forwarded as sent. What memory adds that changes rarely (the summary, memories)
//!   goes into `system` as extra text blocks, so the messages list stays what the API accepts;
//!   the recalled turns, new with every question, go at the start of the last user turn, so
//!   they never break the cached prefix ([`render`]).
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

use super::{Neutral, Part, Wire, content_text, parsed, tool_call};
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
                "system" => system_turn(Value::String(text), None),
                _ => return Err(bad(format!("{path}.role"), ROLES)),
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
            "system" => {
                let text = block_texts(&parsed_blocks).join("\n");
                let blocks = parsed_blocks.into_iter().map(|(raw, _)| raw).collect();
                let neutral = system_turn(Value::String(text), Some(blocks));
                messages.push(parsed(neutral.to_raw(), &path)?);
            }
            _ => return Err(bad(format!("{path}.role"), ROLES)),
        }
    }
    Ok(messages)
}

/// The texts of a message's `text` blocks, in order.
fn block_texts(blocks: &[(Box<RawValue>, Value)]) -> Vec<&str> {
    blocks
        .iter()
        .filter(|(_, b)| b["type"] == "text")
        .filter_map(|(_, b)| b.get("text").and_then(Value::as_str))
        .collect()
}

/// What a message's `role` may be.
const ROLES: &str = "must be user, assistant or system";

/// A `system`-role message inside `messages` (Claude Code's mid-conversation system messages):
/// a turn kept where the client put it, its text as the neutral content and its blocks raw.
fn system_turn(text: Value, blocks: Option<Vec<Box<RawValue>>>) -> Neutral {
    Neutral {
        role: "system".into(),
        content: text,
        wire: Some(Wire {
            anthropic: blocks,
            in_place: true,
            ..Wire::default()
        }),
        ..Neutral::default()
    }
}

/// A user turn of blocks: its tool results, then the rest as one user message.
fn user(
    blocks: Vec<(Box<RawValue>, Value)>,
    path: &str,
    messages: &mut Vec<Message>,
) -> Result<(), InvalidRequest> {
    let mut rest: Vec<(Box<RawValue>, Value)> = Vec::new();
    let mut results = false;
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
        results = true;
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
                beside_results: results,
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
    let texts = block_texts(&blocks);
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
            _ => without_marker(block),
        },
        _ => without_marker(block),
    }
}

/// A block without its `cache_control` marker: the client moves its markers from request to
/// request, so a marker is no part of what a block means.
fn without_marker(block: &Value) -> Value {
    let mut block = block.clone();
    remove_marker(&mut block);
    block
}

/// Removes `cache_control` from a block (an object; anything else is left alone).
fn remove_marker(block: &mut Value) {
    if let Some(object) = block.as_object_mut() {
        object.remove("cache_control");
    }
}

/// `block` without the `cache_control` markers it carries at its top or in its nested content
/// (a `tool_result`'s blocks); `None` when it carries none. Markers are the client's, for one
/// request: a stored block never brings one back.
pub fn strip_markers(block: &RawValue) -> Option<Box<RawValue>> {
    if breakpoints_in(block.get()) == 0 {
        return None;
    }
    let mut value: Value = serde_json::from_str(block.get()).ok()?;
    remove_marker(&mut value);
    if let Some(Value::Array(inner)) = value.get_mut("content") {
        inner.iter_mut().for_each(remove_marker);
    }
    Some(raw(&value))
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

/// A block being written: raw, whether it is a tool result, and the index in the prompt of
/// the message it came from (`usize::MAX`: memproxy's own).
struct Block {
    raw: Box<RawValue>,
    tool_result: bool,
    source: usize,
}

/// A message being written: its role and blocks.
struct Turn {
    role: &'static str,
    /// `Some` while the turn is one string content, as sent.
    text: Option<String>,
    blocks: Vec<Block>,
    /// The prompt message a string content came from.
    source: usize,
}

impl Turn {
    fn new(role: &'static str, blocks: Vec<(Box<RawValue>, bool)>) -> Turn {
        Turn {
            role,
            text: None,
            blocks: blocks
                .into_iter()
                .map(|(raw, tool_result)| Block {
                    raw,
                    tool_result,
                    source: usize::MAX,
                })
                .collect(),
            source: usize::MAX,
        }
    }

    fn text(role: &'static str, text: String) -> Turn {
        Turn {
            role,
            text: Some(text),
            blocks: Vec::new(),
            source: usize::MAX,
        }
    }

    /// The turn as coming from prompt message `source`.
    fn tagged_with(mut self, source: usize) -> Turn {
        self.source = source;
        for block in &mut self.blocks {
            block.source = source;
        }
        self
    }

    fn into_blocks(self) -> Vec<Block> {
        match self.text {
            Some(text) => vec![Block {
                raw: raw(&json!({"type": "text", "text": text})),
                tool_result: false,
                source: self.source,
            }],
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

/// The most `cache_control` breakpoints a request may carry.
pub const MAX_BREAKPOINTS: usize = 4;

/// `block` with an ephemeral `cache_control` breakpoint, or `None` when it cannot take one
/// (thinking blocks cannot) or already has one.
fn with_breakpoint(block: &RawValue) -> Option<Box<RawValue>> {
    let mut value: Value = serde_json::from_str(block.get()).ok()?;
    let object = value.as_object_mut()?;
    let kind = object.get("type").and_then(Value::as_str)?;
    if matches!(kind, "thinking" | "redacted_thinking") || object.contains_key("cache_control") {
        return None;
    }
    object.insert("cache_control".into(), json!({"type": "ephemeral"}));
    Some(raw(&value))
}

/// How many `cache_control` breakpoints a piece of request JSON holds (a key, never text: a
/// quote inside a string is escaped).
fn breakpoints_in(json: &str) -> usize {
    json.matches("\"cache_control\"").count()
}

/// The request body for a prompt of neutral messages, each tagged with its part.
///
/// - System messages (memproxy's summary and memories, and any system-role message) become
///   extra `system` text blocks after the client's `system`, in the prompt's order; the rest
///   become alternating turns starting with a user turn.
/// - The recalled turns change with every question, and Anthropic caches in the order tools →
///   system → messages: as a `system` block they would make every turn's messages new. They
///   go instead as a text block at the start of the user turn that follows their place in the
///   prompt (after its tool results, which the API wants first): the newest user turn, new
///   anyway, so tools, system and every earlier turn stay the previous prompt's prefix; in a
///   tool loop, the turn that opened the round, so the newest input stays the tool result.
///   (A prompt without such a turn gets them as the last `system` block.)
/// - A `system`-role message inside `messages` (`_wire.in_place`) stays a message, in place.
/// - Only the request's own blocks keep their `cache_control` markers: a stored block's
///   markers (from before they were stripped at store time) are dropped.
/// - With `breakpoints`, `cache_control` marks the last block of the recent window (the end
///   of what the next prompt repeats) and then the last `system` block memproxy added (what
///   survives a jump of the window's anchor), as far as the API's four breakpoints allow with
///   the ones the request already carries. The provider reads earlier cached prefixes back
///   from a later breakpoint, so the mark moving forward each turn keeps reusing them.
pub fn render<'a>(
    fields: &[(String, Box<RawValue>)],
    prompt: impl IntoIterator<Item = (Part, &'a RawValue)>,
    breakpoints: bool,
) -> Vec<u8> {
    let mut layout = Layout::read(prompt);
    layout.place_recalled();

    // Breakpoints: the room the request's own leave.
    let mut room = if breakpoints {
        MAX_BREAKPOINTS.saturating_sub(client_breakpoints(fields, &layout.turns))
    } else {
        0
    };
    if room > 0 && layout.mark_window_end() {
        room -= 1;
    }

    let list = messages_list(layout.turns);
    if layout.system_texts.is_empty() {
        return write_fields(fields, None, "messages", list.as_bytes(), &[]);
    }
    let fields = with_system(fields, layout.system_texts, room > 0);
    write_fields(&fields, None, "messages", list.as_bytes(), &[])
}

/// A prompt sorted out for the Messages API ([`render`]).
struct Layout {
    /// The texts of memproxy's `system` blocks, in the prompt's order.
    system_texts: Vec<String>,
    /// The recalled turns' text and where they stand in the prompt.
    recalled: Option<(usize, String)>,
    /// The prompt index of the recent window's last message.
    window_end: Option<usize>,
    /// The turns, alternating roles from a user turn.
    turns: Vec<Turn>,
}

impl Layout {
    /// Sorts the prompt's messages: system messages (not in place) into `system` texts, the
    /// recalled turns aside, the rest into turns, neighbours of one role merged.
    fn read<'a>(prompt: impl IntoIterator<Item = (Part, &'a RawValue)>) -> Layout {
        let mut layout = Layout {
            system_texts: Vec::new(),
            recalled: None,
            window_end: None,
            turns: Vec::new(),
        };
        for (source, (part, message)) in prompt.into_iter().enumerate() {
            let Some(neutral) = Neutral::read(message) else {
                continue;
            };
            if part == Part::Recalled {
                layout.recalled = Some((source, neutral.text()));
                continue;
            }
            let in_place = neutral.wire.as_ref().is_some_and(|w| w.in_place);
            let turn = match neutral.role.as_str() {
                "system" | "developer" if !in_place => {
                    layout.system_texts.push(neutral.text());
                    continue;
                }
                _ => to_turn(neutral),
            };
            let Some(mut turn) = turn else {
                continue;
            };
            // Only the request's own messages keep the client's markers: one stored from an
            // earlier request would pile up with the client's new ones past the API's four.
            if part != Part::Incoming {
                for block in &mut turn.blocks {
                    if let Some(stripped) = strip_markers(&block.raw) {
                        block.raw = stripped;
                    }
                }
            }
            if part == Part::Window {
                layout.window_end = Some(source);
            }
            layout.push(turn.tagged_with(source));
        }
        if layout.turns.first().is_some_and(|t| t.role == "assistant") {
            let opening = Turn::text("user", OPENING_USER_TURN.to_string());
            layout.turns.insert(0, opening);
        }
        layout
    }

    /// Adds a turn, merged into the last one when of the same role (roles alternate).
    fn push(&mut self, turn: Turn) {
        match self.turns.last_mut() {
            Some(last) if last.role == turn.role => {
                let previous = std::mem::replace(last, Turn::new(turn.role, Vec::new()));
                let mut blocks = previous.into_blocks();
                blocks.extend(turn.into_blocks());
                last.blocks = blocks;
            }
            _ => self.turns.push(turn),
        }
    }

    /// Puts the recalled turns as a text block at the start of the first turn after their
    /// place when it is a user turn (the newest user turn, or in a tool loop the user turn
    /// that opened the round); else as the last `system` text.
    fn place_recalled(&mut self) {
        let Some((at, text)) = self.recalled.take() else {
            return;
        };
        let turns = &mut self.turns;
        let after = |turn: &Turn| {
            let from = |source: usize| source != usize::MAX && source > at;
            from(turn.source) || turn.blocks.iter().any(|b| from(b.source))
        };
        match turns
            .iter()
            .position(after)
            .filter(|&i| turns[i].role == "user")
        {
            Some(i) => {
                let turn = std::mem::replace(&mut turns[i], Turn::new("user", Vec::new()));
                let mut blocks = vec![Block {
                    raw: raw(&json!({"type": "text", "text": text})),
                    tool_result: false,
                    source: usize::MAX,
                }];
                blocks.extend(turn.into_blocks());
                turns[i].blocks = blocks;
            }
            None => self.system_texts.push(text),
        }
    }

    /// Marks the last block of the recent window that can take it with a `cache_control`
    /// breakpoint (a string content becomes a text block first); true when one was set.
    fn mark_window_end(&mut self) -> bool {
        let Some(end) = self.window_end else {
            return false;
        };
        let Some(turn) = self
            .turns
            .iter_mut()
            .rfind(|t| t.source == end || t.blocks.iter().any(|b| b.source == end))
        else {
            return false;
        };
        if turn.text.is_some() {
            let whole = std::mem::replace(turn, Turn::new(turn.role, Vec::new()));
            let role = whole.role;
            *turn = Turn {
                blocks: whole.into_blocks(),
                ..Turn::new(role, Vec::new())
            };
        }
        let marked = turn
            .blocks
            .iter_mut()
            .rev()
            .filter(|b| b.source == end)
            .find_map(|b| with_breakpoint(&b.raw).map(|raw| (b, raw)));
        match marked {
            Some((block, marked)) => {
                block.raw = marked;
                true
            }
            None => false,
        }
    }
}

/// The breakpoints the request already carries: in its `tools`, its `system` and its turns.
fn client_breakpoints(fields: &[(String, Box<RawValue>)], turns: &[Turn]) -> usize {
    fields
        .iter()
        .filter(|(k, _)| k == "tools" || k == "system")
        .map(|(_, v)| breakpoints_in(v.get()))
        .sum::<usize>()
        + turns
            .iter()
            .flat_map(|t| &t.blocks)
            .map(|b| breakpoints_in(b.raw.get()))
            .sum::<usize>()
}

/// The `messages` list as JSON: a string content as it was sent, blocks with the tool results
/// first in a user turn, as the API requires.
fn messages_list(turns: Vec<Turn>) -> String {
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
                let mut blocks = turn.blocks;
                blocks.sort_by_key(|b| !b.tool_result);
                list.push('[');
                for (j, block) in blocks.iter().enumerate() {
                    if j > 0 {
                        list.push(',');
                    }
                    list.push_str(block.raw.get());
                }
                list.push(']');
            }
        }
        list.push('}');
    }
    list.push(']');
    list
}

/// The request's fields with `system` made of the client's blocks (a string as one text
/// block) and then one text block for each of `texts`, the last with a breakpoint when `mark`.
fn with_system(
    fields: &[(String, Box<RawValue>)],
    texts: Vec<String>,
    mark: bool,
) -> Vec<(String, Box<RawValue>)> {
    let mut system: Vec<Box<RawValue>> = match fields.iter().find(|(k, _)| k == "system") {
        None => Vec::new(),
        Some((_, value)) => match serde_json::from_str::<String>(value.get()) {
            Ok(text) if text.is_empty() => Vec::new(),
            Ok(text) => vec![raw(&json!({"type": "text", "text": text}))],
            Err(_) => serde_json::from_str(value.get()).unwrap_or_default(),
        },
    };
    let added = texts.len();
    for text in texts {
        system.push(raw(&json!({"type": "text", "text": text})));
    }
    if mark
        && added > 0
        && let Some(last) = system.last_mut()
        && let Some(marked) = with_breakpoint(last)
    {
        *last = marked;
    }
    let system = super::json_list(system);
    let mut fields = fields.to_vec();
    let system =
        RawValue::from_string(String::from_utf8_lossy(&system).into_owned()).unwrap_or_default();
    match fields.iter_mut().find(|(k, _)| k == "system") {
        Some((_, value)) => *value = system,
        None => fields.insert(0, ("system".to_string(), system)),
    }
    fields
}

/// One neutral message as an Anthropic turn (`None`: nothing of it can be sent).
fn to_turn(neutral: Neutral) -> Option<Turn> {
    let own = neutral.wire.as_ref().and_then(|w| w.anthropic.clone());
    let in_place = neutral.wire.as_ref().is_some_and(|w| w.in_place);
    let role: &'static str = match neutral.role.as_str() {
        "assistant" => "assistant",
        "system" | "developer" if in_place => "system",
        _ => "user",
    };
    if let Some(blocks) = own {
        let blocks = blocks
            .into_iter()
            .map(|b| {
                let tool_result = is_tool_result(&b);
                (b, tool_result)
            })
            .collect();
        return Some(Turn::new(role, blocks));
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
            (!blocks.is_empty()).then(|| Turn::new(role, blocks))
        }
        "tool" | "function" => Some(Turn::new(
            role,
            vec![(
                raw(
                    &json!({"type": "tool_result", "tool_use_id": neutral.tool_call_id.clone().unwrap_or_default(), "content": neutral.text()}),
                ),
                true,
            )],
        )),
        _ => match &neutral.content {
            Value::String(text) => Some(Turn::text(role, text.clone())),
            Value::Array(parts) => {
                let blocks: Vec<_> = parts
                    .iter()
                    .filter_map(anthropic_part)
                    .map(|b| (raw(&b), false))
                    .collect();
                (!blocks.is_empty()).then(|| Turn::new(role, blocks))
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

        let body = render(
            &fields,
            parsed.iter().map(|m| (Part::Incoming, &*m.raw)),
            true,
        );
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
        let body: Value = serde_json::from_slice(&render(
            &fields,
            prompt.iter().map(|m| (Part::Incoming, &**m)),
            false,
        ))
        .unwrap();
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

    /// A prompt of every part, as the pipeline assembles it.
    fn parts_prompt(window_last: Value) -> Vec<(Part, Box<RawValue>)> {
        vec![
            (
                Part::Summary,
                raw(&json!({"role": "system", "content": "[Summary of earlier conversation] s"})),
            ),
            (
                Part::Memories,
                raw(&json!({"role": "system", "content": "[What you know about the user] m"})),
            ),
            (Part::Window, raw(&json!({"role": "user", "content": "w1"}))),
            (Part::Window, raw(&window_last)),
            (
                Part::Recalled,
                raw(&json!({"role": "system", "content": "[Recalled] r"})),
            ),
            (
                Part::Incoming,
                raw(&json!({"role": "user", "content": "new"})),
            ),
        ]
    }

    fn render_value(
        fields: &[(String, Box<RawValue>)],
        prompt: &[(Part, Box<RawValue>)],
        breakpoints: bool,
    ) -> Value {
        serde_json::from_slice(&render(
            fields,
            prompt.iter().map(|(p, m)| (*p, &**m)),
            breakpoints,
        ))
        .unwrap()
    }

    #[test]
    fn recalled_turns_open_the_last_user_turn_and_breakpoints_mark_the_stable_parts() {
        let fields = request(
            json!([{"role": "user", "content": "new"}]),
            Some(json!("Be brief.")),
        );
        let prompt = parts_prompt(json!({"role": "assistant", "content": "w2"}));
        let body = render_value(&fields, &prompt, true);
        let system: Vec<&str> = body["system"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["text"].as_str().unwrap())
            .collect();
        assert_eq!(
            system,
            [
                "Be brief.",
                "[Summary of earlier conversation] s",
                "[What you know about the user] m"
            ]
        );
        assert_eq!(
            body["system"][2]["cache_control"],
            json!({"type": "ephemeral"})
        );
        assert!(body["system"][1].get("cache_control").is_none());
        let list = body["messages"].as_array().unwrap();
        assert_eq!(list.len(), 3);
        assert_eq!(list[0], json!({"role": "user", "content": "w1"}));
        // The end of the window carries the breakpoint.
        assert_eq!(
            list[1]["content"],
            json!([{"type": "text", "text": "w2", "cache_control": {"type": "ephemeral"}}])
        );
        // The recalled turns open the newest user turn.
        assert_eq!(
            list[2]["content"],
            json!([{"type": "text", "text": "[Recalled] r"}, {"type": "text", "text": "new"}])
        );

        // Without breakpoints: nothing marked, the same order.
        let plain = render_value(&fields, &prompt, false);
        assert_eq!(breakpoints_in(&plain.to_string()), 0);
        assert_eq!(
            plain["messages"][1]["content"],
            json!([{"type": "text", "text": "w2"}])
        );

        // The request's own breakpoints leave room for fewer: 3 of the client's, one added
        // at the window's end.
        let mut own = request(
            json!([{"role": "user", "content": "new"}]),
            Some(
                json!([{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]),
            ),
        );
        own.push((
            "tools".into(),
            raw(
                &json!([{"name": "t", "input_schema": {}, "cache_control": {"type": "ephemeral"}}]),
            ),
        ));
        let body = render_value(&own, &prompt, true);
        assert_eq!(breakpoints_in(&body.to_string()), 4);
        assert!(
            body["messages"][1]["content"][0]
                .get("cache_control")
                .is_some()
        );
        assert!(body["system"][3].get("cache_control").is_none());
        own.push(("metadata".into(), raw(&json!({"cache_control": 1}))));
        own[1].1 = raw(
            &json!([{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "c", "cache_control": {"type": "ephemeral"}}]),
        );
        let body = render_value(&own, &prompt, true);
        assert_eq!(breakpoints_in(&body["messages"].to_string()), 0);
    }

    #[test]
    fn recalled_turns_follow_tool_results_and_breakpoints_skip_thinking() {
        let fields = request(json!([{"role": "user", "content": "x"}]), None);
        let thinking = json!({"type": "thinking", "thinking": "t", "signature": "S"});
        let call = json!({"type": "tool_use", "id": "c", "name": "f", "input": {}});
        let mut prompt = parts_prompt(json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            "_wire": {"anthropic": [call, thinking]}}));
        prompt.insert(
            5,
            (
                Part::Incoming,
                raw(&json!({"role": "tool", "tool_call_id": "c", "content": "ok"})),
            ),
        );
        let body = render_value(&fields, &prompt, true);
        let list = body["messages"].as_array().unwrap();
        // The tool_use block takes the breakpoint: the thinking block after it cannot.
        assert_eq!(
            list[1]["content"][0]["cache_control"],
            json!({"type": "ephemeral"})
        );
        assert!(list[1]["content"][1].get("cache_control").is_none());
        let kinds: Vec<&str> = list[2]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["type"].as_str().unwrap())
            .collect();
        assert_eq!(kinds, ["tool_result", "text", "text"]);
        assert_eq!(list[2]["content"][1]["text"], "[Recalled] r");
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
