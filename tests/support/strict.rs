//! The rules a provider holds a request to, so that the mock upstream (`mock_upstream.rs`, which
//! includes this file as its `strict` module) refuses what the real API would refuse: a test then
//! passes only when the provider would accept what memproxy forwards.
//!
//! Each rule follows the provider's documentation or the refusal it is known to answer, and each
//! refusal carries the provider's own status (400) and error shape: Anthropic's
//! `{"type":"error","error":{"type":"invalid_request_error","message":..}}`, OpenAI's
//! `{"error":{"message":..,"type":"invalid_request_error","param":..,"code":null}}`. The messages
//! follow the providers' wording where it is known. The rules are listed in
//! [`check_anthropic`], [`check_responses`] and [`check_chat`].
//!
//! Opaque parts the provider signs (Anthropic `thinking` signatures, Responses reasoning
//! `encrypted_content`) are accepted only as the mock issued them: the mock registers each one it
//! sends in an [`Issued`] registry, and a part that comes back changed, or that the mock never
//! sent, is refused as the provider refuses a part it cannot verify.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value, json};

/// The API a request was sent to, told by its method and path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /v1/messages` (Anthropic).
    Anthropic,
}

impl Api {
    /// The API whose rules apply to `method path`; `None` for every other route (the mock checks
    /// model calls only: listings, token counts and its own control routes pass).
    pub fn of(method: &str, path: &str) -> Option<Api> {
        if method != "POST" {
            return None;
        }
        let path = path.split('?').next().unwrap_or(path);
        if path.ends_with("/chat/completions") {
            Some(Api::Chat)
        } else if path.ends_with("/responses") {
            Some(Api::Responses)
        } else if path.ends_with("/v1/messages") {
            Some(Api::Anthropic)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "chat_completions",
            Api::Responses => "responses",
            Api::Anthropic => "anthropic_messages",
        }
    }
}

/// Why the mock refused a request, as the provider would say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub api: Api,
    pub message: String,
    /// The OpenAI error's `param` (Anthropic errors name the field in the message instead).
    pub param: Option<String>,
}

impl Refusal {
    /// The HTTP status the provider answers a refused request with.
    pub const STATUS: u16 = 400;

    /// The provider's error body.
    pub fn body(&self) -> Value {
        match self.api {
            Api::Anthropic => json!({
                "type": "error",
                "error": {"type": "invalid_request_error", "message": self.message},
            }),
            Api::Chat | Api::Responses => json!({
                "error": {
                    "message": self.message,
                    "type": "invalid_request_error",
                    "param": self.param,
                    "code": null,
                },
            }),
        }
    }
}

/// The opaque parts the mock issued, which the provider would verify when they come back.
#[derive(Debug, Default)]
pub struct Issued {
    /// Anthropic `thinking` signatures, each with the thinking text it signs.
    signatures: HashMap<String, String>,
    /// Responses reasoning items' `encrypted_content`.
    encrypted: HashSet<String>,
}

impl Issued {
    /// Registers a `thinking` block the mock sent: `signature` signs `thinking`.
    pub fn thinking(&mut self, signature: &str, thinking: &str) {
        self.signatures
            .insert(signature.to_string(), thinking.to_string());
    }

    /// Registers a reasoning item's `encrypted_content` the mock sent.
    pub fn encrypted_content(&mut self, content: &str) {
        self.encrypted.insert(content.to_string());
    }

    fn verifies(&self, signature: &str, thinking: &str) -> bool {
        self.signatures
            .get(signature)
            .is_some_and(|signed| signed == thinking)
    }
}

/// A rule broken: the message and, for OpenAI, the parameter it names.
struct Fault {
    message: String,
    param: Option<String>,
}

type Checked = Result<(), Fault>;

fn fault(message: impl Into<String>) -> Fault {
    Fault {
        message: message.into(),
        param: None,
    }
}

fn fault_at(message: impl Into<String>, param: impl Into<String>) -> Fault {
    Fault {
        message: message.into(),
        param: Some(param.into()),
    }
}

/// Checks a request body sent to `api`. `anthropic_beta` is the request's `anthropic-beta`
/// header (empty when absent): some Anthropic rules depend on the betas it names.
pub fn check(api: Api, anthropic_beta: &str, body: &[u8], issued: &Issued) -> Result<(), Refusal> {
    let refuse = |fault: Fault| Refusal {
        api,
        message: fault.message,
        param: fault.param,
    };
    let request = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(request)) => request,
        Ok(_) | Err(_) => {
            return Err(refuse(match api {
                Api::Anthropic => {
                    fault("There was an error parsing the body: expected a JSON object")
                }
                Api::Chat | Api::Responses => fault(
                    "We could not parse the JSON body of your request. The body must be a JSON object.",
                ),
            }));
        }
    };
    match api {
        Api::Anthropic => check_anthropic(&request, anthropic_beta, issued),
        Api::Responses => check_responses(&request, issued),
        Api::Chat => check_chat(&request),
    }
    .map_err(refuse)
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// `'a', 'b', and 'c'`, as OpenAI lists supported values.
fn listed(values: &[&str]) -> String {
    let quoted: Vec<String> = values.iter().map(|v| format!("'{v}'")).collect();
    match quoted.as_slice() {
        [] => String::new(),
        [one] => one.clone(),
        [first, second] => format!("{first} and {second}"),
        [rest @ .., last] => format!("{}, and {last}", rest.join(", ")),
    }
}

/// OpenAI's refusal of a value of the wrong JSON type at `param`.
fn invalid_type(param: &str, expected: &str, value: &Value) -> Fault {
    fault_at(
        format!(
            "Invalid type for '{param}': expected {expected}, but got {} instead.",
            kind(value)
        ),
        param,
    )
}

/// OpenAI's refusal of `value` at `param` unless it is one of `allowed`.
fn one_of(value: &str, allowed: &[&str], param: impl Into<String>) -> Checked {
    if allowed.contains(&value) {
        return Ok(());
    }
    Err(fault_at(
        format!(
            "Invalid value: '{value}'. Supported values are: {}.",
            listed(allowed)
        ),
        param,
    ))
}

/// An OpenAI message's `role`, required and one of `allowed`.
fn openai_role<'a>(
    object: &'a Map<String, Value>,
    at: &str,
    allowed: &[&str],
) -> Result<&'a str, Fault> {
    let role = object
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| missing(&format!("{at}.role")))?;
    one_of(role, allowed, format!("{at}.role"))?;
    Ok(role)
}

/// Each part of `parts` has a `type` among `allowed` (`param` names the part's field).
fn part_types(parts: &[Value], allowed: &[&str], param: impl Fn(usize) -> String) -> Checked {
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        one_of(kind, allowed, param(j))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Anthropic Messages
// ---------------------------------------------------------------------------------------------

/// The content block types either role may hold.
const EITHER_ROLE: &[&str] = &["text"];

/// Blocks only the model writes: they may appear in `assistant` messages only.
const ASSISTANT_ONLY: &[&str] = &[
    "tool_use",
    "thinking",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "compaction",
];

/// Blocks only the client writes: they may appear in `user` messages only.
const USER_ONLY: &[&str] = &[
    "tool_result",
    "image",
    "document",
    "search_result",
    "container_upload",
];

/// The most blocks one request may mark with `cache_control` (the Messages API: "A maximum of 4
/// blocks with cache_control may be provided").
pub const MAX_CACHE_BREAKPOINTS: usize = 4;

/// The prefix of the beta that lets `system`-role messages into `messages` (Claude Code sends
/// `mid-conversation-system-2026-04-07`).
const MID_CONVERSATION_SYSTEM: &str = "mid-conversation-system";
/// Claude Code's own beta (`claude-code-20250219`), under which it sends `system`-role
/// messages without naming the mid-conversation one.
const CLAUDE_CODE_BETA: &str = "claude-code-";

/// One block of a turn (a run of same-role messages the API merges into one turn), with where it
/// was in the request.
struct Placed<'a> {
    message: usize,
    block: usize,
    value: &'a Value,
}

struct Turn<'a> {
    role: &'a str,
    first: usize,
    last: usize,
    blocks: Vec<Placed<'a>>,
}

/// The `cache_control` markers of a request in the order the API processes them (`tools`,
/// `system`, `messages`), for the count and the TTL order.
#[derive(Default)]
struct Breakpoints {
    ttls: Vec<String>,
}

impl Breakpoints {
    fn mark(&mut self, block: &Value, at: &str) -> Checked {
        let Some(marker) = block.get("cache_control") else {
            return Ok(());
        };
        if marker.is_null() {
            return Ok(());
        }
        if marker.get("type").and_then(Value::as_str) != Some("ephemeral") {
            return Err(fault(format!(
                "{at}.cache_control.type: Input should be 'ephemeral'"
            )));
        }
        let ttl = match marker.get("ttl") {
            None | Some(Value::Null) => "5m",
            Some(Value::String(ttl)) if ttl == "5m" || ttl == "1h" => ttl.as_str(),
            Some(_) => {
                return Err(fault(format!(
                    "{at}.cache_control.ephemeral.ttl: Input should be '5m' or '1h'"
                )));
            }
        };
        self.ttls.push(ttl.to_string());
        Ok(())
    }

    fn check(&self) -> Checked {
        if self.ttls.len() > MAX_CACHE_BREAKPOINTS {
            return Err(fault(format!(
                "A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. Found {}.",
                self.ttls.len()
            )));
        }
        if let Some(five) = self.ttls.iter().position(|t| t == "5m")
            && self.ttls[five..].iter().any(|t| t == "1h")
        {
            return Err(fault(
                "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block. Note that blocks are processed in the following order: `tools`, `system`, `messages`.",
            ));
        }
        Ok(())
    }
}

/// The Anthropic Messages rules:
/// - `model` and `max_tokens` (at least 1) are required; `messages` is a non-empty list;
/// - `system` is a string or a list of non-empty `text` blocks;
/// - roles are `user` and `assistant`, and `system` only when `anthropic-beta` names the
///   `mid-conversation-system` beta; the first message that is not a `system` one is a `user`
///   message; consecutive same-role messages are allowed (the API merges them into one turn);
/// - every message has content (a non-empty string or list; only a final `assistant` message may
///   be empty), text blocks are non-empty, block types are known and in a role that may hold
///   them;
/// - every `tool_use` is answered by a `tool_result` with its id in the next turn, which begins
///   with its `tool_result` blocks; every `tool_result` answers a `tool_use` of the turn before;
///   `tool_use` ids are unique;
/// - a `thinking` block carries a signature the mock issued for exactly its text; a
///   `redacted_thinking` block (the mock issues none) cannot be verified;
/// - at most 4 `cache_control` markers (tools, system and message blocks, nested tool results
///   included), each `ephemeral` with a `ttl` of `5m` or `1h`, no `1h` after a `5m`;
/// - tool names are unique, a custom tool has an `input_schema`, a forced `tool_choice` names a
///   tool of `tools` and is not combined with extended thinking; thinking's `budget_tokens` is
///   at least 1024 and below `max_tokens`.
pub fn check_anthropic_value(request: &Value, beta: &str, issued: &Issued) -> Result<(), String> {
    match request.as_object() {
        Some(request) => check_anthropic(request, beta, issued).map_err(|f| f.message),
        None => Err("There was an error parsing the body: expected a JSON object".into()),
    }
}

fn check_anthropic(request: &Map<String, Value>, beta: &str, issued: &Issued) -> Checked {
    if !request.get("model").is_some_and(Value::is_string) {
        return Err(fault("model: Field required"));
    }
    let max_tokens = match request.get("max_tokens") {
        None | Some(Value::Null) => return Err(fault("max_tokens: Field required")),
        Some(value) => value
            .as_u64()
            .ok_or_else(|| fault("max_tokens: Input should be a valid integer"))?,
    };
    if max_tokens < 1 {
        return Err(fault(
            "max_tokens: Input should be greater than or equal to 1",
        ));
    }
    let messages = match request.get("messages") {
        None => return Err(fault("messages: Field required")),
        Some(Value::Array(messages)) => messages,
        Some(_) => return Err(fault("messages: Input should be a valid list")),
    };
    if messages.is_empty() {
        return Err(fault("messages: at least one message is required"));
    }
    let mut breakpoints = Breakpoints::default();
    let tool_names = anthropic_tools(request.get("tools"), &mut breakpoints)?;
    anthropic_thinking_config(request, max_tokens, &tool_names)?;
    anthropic_system(request.get("system"), &mut breakpoints)?;
    // `system`-role messages inside `messages`: the `mid-conversation-system` beta names them,
    // and the API takes them from Claude Code (its own `claude-code-` beta) without it.
    let system_beta = beta.split(',').any(|b| {
        let b = b.trim();
        b.starts_with(MID_CONVERSATION_SYSTEM) || b.starts_with(CLAUDE_CODE_BETA)
    });

    let mut turns: Vec<Turn> = Vec::new();
    let mut tool_use_ids: HashSet<&str> = HashSet::new();
    let last_index = messages.len() - 1;
    for (i, message) in messages.iter().enumerate() {
        let role = message
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| fault(format!("messages.{i}.role: Field required")))?;
        match role {
            "user" | "assistant" => {}
            "system" if system_beta => {}
            _ => {
                return Err(fault(format!(
                    "messages.{i}.role: Input should be 'user' or 'assistant'"
                )));
            }
        }
        let blocks = anthropic_blocks(message, i, role, i == last_index)?;
        for placed in &blocks {
            let at = format!("messages.{i}.content.{}", placed.block);
            anthropic_block(placed.value, role, &at, issued)?;
            breakpoints.mark(placed.value, &at)?;
            if let Some(Value::Array(nested)) = placed
                .value
                .get("content")
                .filter(|_| placed.value["type"] == "tool_result")
            {
                for (k, inner) in nested.iter().enumerate() {
                    breakpoints.mark(inner, &format!("{at}.content.{k}"))?;
                }
            }
            if placed.value["type"] == "tool_use"
                && let Some(id) = placed.value.get("id").and_then(Value::as_str)
                && !tool_use_ids.insert(id)
            {
                return Err(fault(format!("{at}: `tool_use` ids must be unique")));
            }
        }
        match turns.last_mut() {
            Some(turn) if turn.role == role && role != "system" => {
                turn.last = i;
                turn.blocks.extend(blocks);
            }
            _ => turns.push(Turn {
                role,
                first: i,
                last: i,
                blocks,
            }),
        }
    }
    if turns.iter().find(|t| t.role != "system").map(|t| t.role) != Some("user") {
        return Err(fault("messages: first message must use the \"user\" role"));
    }
    anthropic_tool_pairs(&turns)?;
    breakpoints.check()
}

/// The tools' names (unique, each custom tool with its schema), their markers counted.
fn anthropic_tools<'a>(
    tools: Option<&'a Value>,
    breakpoints: &mut Breakpoints,
) -> Result<HashSet<&'a str>, Fault> {
    let mut names = HashSet::new();
    let tools = match tools {
        None | Some(Value::Null) => return Ok(names),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(fault("tools: Input should be a valid list")),
    };
    for (i, tool) in tools.iter().enumerate() {
        let name = tool
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| fault(format!("tools.{i}.name: Field required")))?;
        if !names.insert(name) {
            return Err(fault("tools: Tool names must be unique."));
        }
        let custom = tool
            .get("type")
            .and_then(Value::as_str)
            .is_none_or(|t| t == "custom");
        if custom && !tool.get("input_schema").is_some_and(Value::is_object) {
            return Err(fault(format!(
                "tools.{i}.custom.input_schema: Field required"
            )));
        }
        breakpoints.mark(tool, &format!("tools.{i}"))?;
    }
    Ok(names)
}

/// Extended thinking's budget, and a forced `tool_choice`.
fn anthropic_thinking_config(
    request: &Map<String, Value>,
    max_tokens: u64,
    tool_names: &HashSet<&str>,
) -> Checked {
    let thinking = request
        .get("thinking")
        .filter(|t| t.get("type").and_then(Value::as_str) == Some("enabled"));
    if let Some(thinking) = thinking {
        let budget = thinking
            .get("budget_tokens")
            .and_then(Value::as_u64)
            .ok_or_else(|| fault("thinking.enabled.budget_tokens: Field required"))?;
        if budget < 1024 {
            return Err(fault(
                "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024",
            ));
        }
        if budget >= max_tokens {
            return Err(fault(
                "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size",
            ));
        }
    }
    let Some(choice) = request.get("tool_choice").filter(|c| !c.is_null()) else {
        return Ok(());
    };
    let forced = matches!(
        choice.get("type").and_then(Value::as_str),
        Some("tool" | "any")
    );
    if forced && thinking.is_some() {
        return Err(fault(
            "Thinking may not be enabled when tool_choice forces tool use.",
        ));
    }
    if choice.get("type").and_then(Value::as_str) == Some("tool") {
        let name = choice.get("name").and_then(Value::as_str).unwrap_or("");
        if !tool_names.contains(name) {
            return Err(fault(format!(
                "tool_choice: the tool `{name}` is not in `tools`"
            )));
        }
    }
    Ok(())
}

/// `system`: a string, or a list of non-empty text blocks.
fn anthropic_system(system: Option<&Value>, breakpoints: &mut Breakpoints) -> Checked {
    match system {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(()),
        Some(Value::Array(blocks)) => {
            for (i, block) in blocks.iter().enumerate() {
                if block.get("type").and_then(Value::as_str) != Some("text") {
                    return Err(fault(format!("system.{i}.type: Input should be 'text'")));
                }
                match block.get("text").and_then(Value::as_str) {
                    None => return Err(fault(format!("system.{i}.text: Field required"))),
                    Some("") => return Err(fault("system: text content blocks must be non-empty")),
                    Some(_) => {}
                }
                breakpoints.mark(block, &format!("system.{i}"))?;
            }
            Ok(())
        }
        Some(_) => Err(fault("system: Input should be a valid list")),
    }
}

/// A message's blocks (a string content is one text block), checked for emptiness.
fn anthropic_blocks<'a>(
    message: &'a Value,
    i: usize,
    role: &str,
    last: bool,
) -> Result<Vec<Placed<'a>>, Fault> {
    // Claude Code sends a `system` message with `content: []` after `/compact`, and the API
    // takes it.
    let empty_allowed = (last && role == "assistant") || role == "system";
    let empty = || {
        fault(format!(
            "messages.{i}: all messages must have non-empty content except for the optional final assistant message"
        ))
    };
    match message.get("content") {
        None => Err(fault(format!("messages.{i}.content: Field required"))),
        Some(Value::String(text)) => {
            if text.is_empty() && !empty_allowed {
                return Err(empty());
            }
            Ok(vec![Placed {
                message: i,
                block: 0,
                value: message.get("content").unwrap_or(&Value::Null),
            }])
        }
        Some(Value::Array(blocks)) => {
            if blocks.is_empty() && !empty_allowed {
                return Err(empty());
            }
            Ok(blocks
                .iter()
                .enumerate()
                .map(|(block, value)| Placed {
                    message: i,
                    block,
                    value,
                })
                .collect())
        }
        Some(_) => Err(fault(format!(
            "messages.{i}.content: Input should be a valid list"
        ))),
    }
}

/// One block: its type known and allowed in `role`, text non-empty, thinking verified.
fn anthropic_block(block: &Value, role: &str, at: &str, issued: &Issued) -> Checked {
    // A string content was turned into its own pseudo block: nothing more to check.
    if block.is_string() {
        return Ok(());
    }
    let kind = block
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| fault(format!("{at}.type: Field required")))?;
    // The known types: those of either role, the client's and the model's (server tools'
    // blocks included).
    let known = || EITHER_ROLE.iter().chain(USER_ONLY).chain(ASSISTANT_ONLY);
    if !known().any(|k| *k == kind) {
        let all: Vec<&str> = known().copied().collect();
        return Err(fault(format!(
            "{at}.type: Input tag '{kind}' found using 'type' does not match any of the expected tags: {}",
            listed(&all)
        )));
    }
    if role == "system" && kind != "text" {
        return Err(fault(format!(
            "{at}: `system` messages may only hold `text` blocks"
        )));
    }
    if role == "user" && ASSISTANT_ONLY.contains(&kind) {
        return Err(fault(format!(
            "{at}: `{kind}` blocks can only be in `assistant` messages"
        )));
    }
    if role == "assistant" && USER_ONLY.contains(&kind) {
        return Err(fault(format!(
            "{at}: `{kind}` blocks can only be in `user` messages"
        )));
    }
    match kind {
        "text" => match block.get("text").and_then(Value::as_str) {
            None => Err(fault(format!("{at}.text: Field required"))),
            Some("") => Err(fault("messages: text content blocks must be non-empty")),
            Some(_) => Ok(()),
        },
        "thinking" => {
            let thinking = block.get("thinking").and_then(Value::as_str);
            let signature = block.get("signature").and_then(Value::as_str);
            match (thinking, signature) {
                (None, _) => Err(fault(format!("{at}.thinking.thinking: Field required"))),
                (_, None) => Err(fault(format!("{at}.thinking.signature: Field required"))),
                (Some(thinking), Some(signature)) if issued.verifies(signature, thinking) => Ok(()),
                (Some(_), Some(_)) => Err(fault(format!(
                    "{at}: Invalid `signature` in `thinking` block"
                ))),
            }
        }
        "redacted_thinking" => Err(fault(format!(
            "{at}: Invalid `data` in `redacted_thinking` block"
        ))),
        "tool_use" => {
            if !block.get("id").is_some_and(Value::is_string) {
                return Err(fault(format!("{at}.tool_use.id: Field required")));
            }
            if !block.get("name").is_some_and(Value::is_string) {
                return Err(fault(format!("{at}.tool_use.name: Field required")));
            }
            if !block.get("input").is_some_and(Value::is_object) {
                return Err(fault(format!(
                    "{at}.tool_use.input: Input should be a valid dictionary"
                )));
            }
            Ok(())
        }
        "tool_result" => {
            if !block.get("tool_use_id").is_some_and(Value::is_string) {
                return Err(fault(format!(
                    "{at}.tool_result.tool_use_id: Field required"
                )));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Every `tool_use` answered at the start of the next turn, every `tool_result` answering the
/// turn before.
fn anthropic_tool_pairs(turns: &[Turn]) -> Checked {
    for (t, turn) in turns.iter().enumerate() {
        let previous_uses: Vec<&str> = match t.checked_sub(1).and_then(|p| turns.get(p)) {
            Some(previous) if previous.role == "assistant" => tool_uses(previous),
            _ => Vec::new(),
        };
        for placed in &turn.blocks {
            if placed.value["type"] != "tool_result" {
                continue;
            }
            let id = placed.value["tool_use_id"].as_str().unwrap_or("");
            if !previous_uses.contains(&id) {
                return Err(fault(format!(
                    "messages.{}.content.{}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message.",
                    placed.message, placed.block
                )));
            }
        }
        if turn.role != "assistant" {
            continue;
        }
        let uses = tool_uses(turn);
        if uses.is_empty() {
            continue;
        }
        let next = turns.get(t + 1).filter(|n| n.role == "user");
        let answered: HashSet<&str> = next
            .map(|n| {
                n.blocks
                    .iter()
                    .filter(|p| p.value["type"] == "tool_result")
                    .filter_map(|p| p.value["tool_use_id"].as_str())
                    .collect()
            })
            .unwrap_or_default();
        let missing: Vec<&str> = uses
            .iter()
            .copied()
            .filter(|id| !answered.contains(id))
            .collect();
        if !missing.is_empty() {
            return Err(fault(format!(
                "messages.{}: `tool_use` ids were found without `tool_result` blocks immediately after: {}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                turn.last,
                missing.join(", ")
            )));
        }
        if let Some(next) = next {
            let leading = next
                .blocks
                .iter()
                .take_while(|p| p.value["type"] == "tool_result")
                .count();
            if leading < uses.len() {
                return Err(fault(format!(
                    "messages.{}: Did not find {} `tool_result` block(s) at the beginning of this message. Messages following `tool_use` blocks must begin with a matching number of `tool_result` blocks.",
                    next.first,
                    uses.len()
                )));
            }
        }
    }
    Ok(())
}

fn tool_uses<'a>(turn: &Turn<'a>) -> Vec<&'a str> {
    turn.blocks
        .iter()
        .filter(|p| p.value["type"] == "tool_use")
        .filter_map(|p| p.value["id"].as_str())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

/// The `input` item types the Responses API knows.
const RESPONSES_ITEMS: &[&str] = &[
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "file_search_call",
    "web_search_call",
    "computer_call",
    "computer_call_output",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    "item_reference",
    "compaction",
    // Remote compaction v2: the Codex CLI ends a request with it to have the model answer with
    // a `compaction` item (the API's compaction, in the input list instead of
    // `/v1/responses/compact`).
    "compaction_trigger",
];

const RESPONSES_ROLES: &[&str] = &["assistant", "system", "developer", "user"];
const RESPONSES_INPUT_PARTS: &[&str] = &["input_text", "input_image", "input_file", "input_audio"];
const RESPONSES_OUTPUT_PARTS: &[&str] = &["output_text", "refusal"];

/// The Responses rules:
/// - `model` is required; `input` is a string or a list of items;
/// - each item is a message (a `role` among assistant, system, developer, user, with content
///   parts of its side: `output_text`/`refusal` for the assistant, `input_*` for the others) or
///   has a known `type`; item ids are unique;
/// - every `function_call` (and `custom_tool_call`) has its output with the same `call_id` later
///   in `input` ("No tool output found for function call …"), and every output answers an
///   earlier call in `input` ("No tool call found for function call output with call_id …")
///   unless `previous_response_id` or `conversation` holds the earlier turns;
/// - a `reasoning` item has its `summary`, and its `encrypted_content` is byte for byte what the
///   mock issued.
pub fn check_responses_value(request: &Value, issued: &Issued) -> Result<(), String> {
    match request.as_object() {
        Some(request) => check_responses(request, issued).map_err(|f| f.message),
        None => Err("We could not parse the JSON body of your request.".into()),
    }
}

fn check_responses(request: &Map<String, Value>, issued: &Issued) -> Checked {
    if !request.get("model").is_some_and(Value::is_string) {
        return Err(fault_at("Missing required parameter: 'model'.", "model"));
    }
    let items = match request.get("input") {
        None | Some(Value::Null) | Some(Value::String(_)) => return Ok(()),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(invalid_type(
                "input",
                "one of a string or array of input items",
                other,
            ));
        }
    };
    let stored_turns = request
        .get("previous_response_id")
        .is_some_and(Value::is_string)
        || request.get("conversation").is_some_and(|c| !c.is_null());
    let mut ids: HashSet<&str> = HashSet::new();
    // Calls in order, each with whether an output answered it.
    let mut calls: Vec<(&str, &str, bool)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let Some(object) = item.as_object() else {
            return Err(invalid_type(&at, "an input item", item));
        };
        if let Some(id) = object.get("id").and_then(Value::as_str)
            && !ids.insert(id)
        {
            return Err(fault_at(
                format!(
                    "Duplicate item found with id {id}. Remove duplicate items from your input and try again."
                ),
                "input",
            ));
        }
        let kind_of = object.get("type").and_then(Value::as_str);
        match kind_of {
            None | Some("message") => responses_message(object, &at)?,
            Some(t @ ("function_call" | "custom_tool_call")) => {
                let payload = if t == "function_call" {
                    "arguments"
                } else {
                    "input"
                };
                for field in ["call_id", "name", payload] {
                    if !object.get(field).is_some_and(Value::is_string) {
                        return Err(missing(&format!("{at}.{field}")));
                    }
                }
                let call_id = object["call_id"].as_str().unwrap_or("");
                calls.push((t, call_id, false));
            }
            Some(t @ ("function_call_output" | "custom_tool_call_output")) => {
                let call_id = object
                    .get("call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| missing(&format!("{at}.call_id")))?;
                if object.get("output").is_none_or(Value::is_null) {
                    return Err(missing(&format!("{at}.output")));
                }
                let call = t.trim_end_matches("_output");
                match calls
                    .iter_mut()
                    .find(|(kind, id, _)| *kind == call && *id == call_id)
                {
                    Some(found) => found.2 = true,
                    None if stored_turns => {}
                    None => {
                        return Err(fault_at(
                            format!(
                                "No tool call found for {} output with call_id {call_id}.",
                                call_name(call)
                            ),
                            "input",
                        ));
                    }
                }
            }
            Some("reasoning") => {
                if !object.get("summary").is_some_and(Value::is_array) {
                    return Err(missing(&format!("{at}.summary")));
                }
                if let Some(content) = object.get("encrypted_content").and_then(Value::as_str)
                    && !issued.encrypted.contains(content)
                {
                    let name = object
                        .get("id")
                        .and_then(Value::as_str)
                        .map_or_else(|| at.clone(), str::to_string);
                    return Err(fault(format!(
                        "The encrypted content for item {name} could not be verified."
                    )));
                }
            }
            Some(t) => one_of(t, RESPONSES_ITEMS, format!("{at}.type"))?,
        }
    }
    if let Some((kind, call_id, _)) = calls.iter().find(|(_, _, answered)| !answered) {
        return Err(fault_at(
            format!("No tool output found for {} {call_id}.", call_name(kind)),
            "input",
        ));
    }
    Ok(())
}

/// How the Responses API names a call type in its refusals.
fn call_name(kind: &str) -> &'static str {
    if kind == "function_call" {
        "function call"
    } else {
        "custom tool call"
    }
}

fn missing(param: &str) -> Fault {
    fault_at(format!("Missing required parameter: '{param}'."), param)
}

/// A message item: a known role, and content parts of the role's side.
fn responses_message(item: &Map<String, Value>, at: &str) -> Checked {
    let role = openai_role(item, at, RESPONSES_ROLES)?;
    let parts = match item.get("content") {
        None | Some(Value::Null) => return Err(missing(&format!("{at}.content"))),
        Some(Value::String(_)) => return Ok(()),
        Some(Value::Array(parts)) => parts,
        Some(other) => {
            return Err(invalid_type(
                &format!("{at}.content"),
                "one of a string or array of input items",
                other,
            ));
        }
    };
    let allowed = if role == "assistant" {
        RESPONSES_OUTPUT_PARTS
    } else {
        RESPONSES_INPUT_PARTS
    };
    part_types(parts, allowed, |j| format!("{at}.content[{j}]"))
}

// ---------------------------------------------------------------------------------------------
// Chat completions
// ---------------------------------------------------------------------------------------------

const CHAT_ROLES: &[&str] = &[
    "system",
    "assistant",
    "user",
    "function",
    "tool",
    "developer",
];
const CHAT_USER_PARTS: &[&str] = &["text", "image_url", "input_audio", "file"];
const CHAT_ASSISTANT_PARTS: &[&str] = &["text", "refusal"];
const CHAT_TEXT_PARTS: &[&str] = &["text"];

/// The chat completions rules:
/// - `model` is required; `messages` is a non-empty list;
/// - roles are system, developer, user, assistant, tool and function; content is a string or a
///   list of parts of the role's kinds, required except on an assistant message with tool calls;
/// - every assistant `tool_calls` entry (a non-empty list, each with its id and function) is
///   answered by a `tool` message with its `tool_call_id` before the next message that is not a
///   tool message ("An assistant message with 'tool_calls' must be followed by tool messages
///   responding to each 'tool_call_id'"); a `tool` message follows an assistant message with
///   tool calls or another tool message, and names one of those calls.
pub fn check_chat_value(request: &Value) -> Result<(), String> {
    match request.as_object() {
        Some(request) => check_chat(request).map_err(|f| f.message),
        None => Err("We could not parse the JSON body of your request.".into()),
    }
}

fn check_chat(request: &Map<String, Value>) -> Checked {
    if !request.get("model").is_some_and(Value::is_string) {
        return Err(fault("you must provide a model parameter"));
    }
    let messages = match request.get("messages") {
        None | Some(Value::Null) => return Err(missing("messages")),
        Some(Value::Array(messages)) => messages,
        Some(other) => return Err(invalid_type("messages", "an array", other)),
    };
    if messages.is_empty() {
        return Err(fault_at(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
            "messages",
        ));
    }
    // The assistant message whose calls are being answered: its index, its call ids, and the
    // ids answered so far.
    let mut pending: Option<(usize, Vec<&str>, HashSet<&str>)> = None;
    for (i, message) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Some(object) = message.as_object() else {
            return Err(invalid_type(&at, "an object", message));
        };
        let role = openai_role(object, &at, CHAT_ROLES)?;
        if role != "tool"
            && let Some((assistant, calls, answered)) = pending.take()
        {
            unanswered(assistant, &calls, &answered)?;
        }
        match role {
            "tool" => {
                let Some((_, calls, answered)) = pending.as_mut() else {
                    return Err(fault_at(
                        "Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.",
                        format!("messages.[{i}].role"),
                    ));
                };
                let id = object
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| missing(&format!("{at}.tool_call_id")))?;
                if !calls.contains(&id) {
                    return Err(fault_at(
                        format!(
                            "Invalid parameter: 'tool_call_id' of '{id}' not found in 'tool_calls' of previous message."
                        ),
                        format!("messages.[{i}].tool_call_id"),
                    ));
                }
                answered.insert(id);
                chat_content(object, &at, CHAT_TEXT_PARTS, false)?;
            }
            "assistant" => {
                let calls = chat_tool_calls(object, &at)?;
                let has_function_call = object.get("function_call").is_some_and(|f| !f.is_null());
                chat_content(
                    object,
                    &at,
                    CHAT_ASSISTANT_PARTS,
                    !calls.is_empty() || has_function_call,
                )?;
                if !calls.is_empty() {
                    pending = Some((i, calls, HashSet::new()));
                }
            }
            "user" => chat_content(object, &at, CHAT_USER_PARTS, false)?,
            "function" => {}
            _ => chat_content(object, &at, CHAT_TEXT_PARTS, false)?,
        }
    }
    if let Some((assistant, calls, answered)) = pending {
        unanswered(assistant, &calls, &answered)?;
    }
    Ok(())
}

fn unanswered(assistant: usize, calls: &[&str], answered: &HashSet<&str>) -> Checked {
    let missing: Vec<&str> = calls
        .iter()
        .copied()
        .filter(|id| !answered.contains(id))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(fault_at(
        format!(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
            missing.join(", ")
        ),
        format!("messages.[{assistant}].role"),
    ))
}

/// An assistant message's tool call ids (none when it has no `tool_calls`).
fn chat_tool_calls<'a>(message: &'a Map<String, Value>, at: &str) -> Result<Vec<&'a str>, Fault> {
    let calls = match message.get("tool_calls") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(calls)) => calls,
        Some(other) => {
            return Err(invalid_type(&format!("{at}.tool_calls"), "an array", other));
        }
    };
    if calls.is_empty() {
        return Err(fault_at(
            format!(
                "Invalid '{at}.tool_calls': empty array. Expected an array with minimum length 1, but got an empty array instead."
            ),
            format!("{at}.tool_calls"),
        ));
    }
    let mut ids = Vec::new();
    for (j, call) in calls.iter().enumerate() {
        let call_at = format!("{at}.tool_calls[{j}]");
        let id = call
            .get("id")
            .and_then(Value::as_str)
            .ok_or_else(|| missing(&format!("{call_at}.id")))?;
        match call.get("type").and_then(Value::as_str) {
            Some("function") => {
                for field in ["name", "arguments"] {
                    if !call
                        .pointer(&format!("/function/{field}"))
                        .is_some_and(Value::is_string)
                    {
                        return Err(missing(&format!("{call_at}.function.{field}")));
                    }
                }
            }
            Some("custom") => {}
            None => return Err(missing(&format!("{call_at}.type"))),
            Some(other) => one_of(other, &["function", "custom"], format!("{call_at}.type"))?,
        }
        ids.push(id);
    }
    Ok(ids)
}

/// A message's content: a string or a list of parts of `allowed` kinds; null or absent only
/// when `optional`.
fn chat_content(
    message: &Map<String, Value>,
    at: &str,
    allowed: &[&str],
    optional: bool,
) -> Checked {
    let parts = match message.get("content") {
        None | Some(Value::Null) if optional => return Ok(()),
        None => return Err(missing(&format!("{at}.content"))),
        Some(Value::Null) => {
            return Err(fault_at(
                format!("Invalid value for '{at}.content': expected a string, got null."),
                format!("{at}.content"),
            ));
        }
        Some(Value::String(_)) => return Ok(()),
        Some(Value::Array(parts)) => parts,
        Some(other) => {
            return Err(invalid_type(
                &format!("{at}.content"),
                "one of a string or array of objects",
                other,
            ));
        }
    };
    part_types(parts, allowed, |j| format!("{at}.content[{j}].type"))
}
