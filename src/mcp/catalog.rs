//! The tools' definitions as a client lists them: name, title, description, the JSON schema of
//! their arguments and their hints (read-only, destructive, idempotent; none reaches outside
//! memproxy). The schemas say what `calls.rs` checks; a call is checked there whatever its
//! client validated.

use std::sync::Arc;

use rmcp::model::{JsonObject, Tool, ToolAnnotations};
use serde_json::{Value, json};

use crate::longterm::memories::{MAX_MEMORY_CHARS, MemoryType};

pub const MEMORY_SEARCH: &str = "memory_search";
pub const MEMORY_REMEMBER: &str = "memory_remember";
pub const MEMORY_CORRECT: &str = "memory_correct";
pub const MEMORY_FORGET: &str = "memory_forget";
pub const CONVERSATION_RECALL: &str = "conversation_recall";

/// Every tool, in the order they are listed.
pub const TOOL_NAMES: [&str; 5] = [
    MEMORY_SEARCH,
    MEMORY_REMEMBER,
    MEMORY_CORRECT,
    MEMORY_FORGET,
    CONVERSATION_RECALL,
];

/// The most results of each kind a search or recall returns.
pub const MAX_LIMIT: u64 = 50;
/// Results of each kind when the call names no `limit`.
pub const DEFAULT_LIMIT: u64 = 10;

/// The `user` argument, the same in every tool.
fn user() -> Value {
    json!({
        "type": "string",
        "description": "The user (1-128 characters from A-Za-z0-9._:@-). Only where the transport names none: over HTTP the X-Memory-User-Id header names the user, and a different value here is refused.",
        "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9._:@-]+$"
    })
}

fn limit() -> Value {
    json!({"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT,
           "description": "The most results of each kind."})
}

fn memory_type() -> Value {
    json!({"type": "string", "enum": MemoryType::ALL,
           "description": "preference (likes, wishes), profile (facts about the user), semantic (knowledge), episodic (an event), procedural (how the user wants things done)."})
}

fn text() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": MAX_MEMORY_CHARS,
           "description": "The memory as one statement about the user, e.g. \"The user prefers window seats\"."})
}

fn importance() -> Value {
    json!({"type": "number", "minimum": 0, "maximum": 1,
           "description": "How much it matters, 0 to 1 (0.7 if not given): important memories fade slower and come first."})
}

fn id() -> Value {
    json!({"type": "integer", "minimum": 0, "description": "The memory's id, as memory_search returns it."})
}

/// An object schema of `properties`, `required` among them, nothing else allowed.
fn schema(properties: Value, required: &[&str]) -> Arc<JsonObject> {
    let mut object = JsonObject::new();
    object.insert("type".into(), json!("object"));
    object.insert("properties".into(), properties);
    object.insert("required".into(), json!(required));
    object.insert("additionalProperties".into(), json!(false));
    Arc::new(object)
}

/// A tool: `hints` are (read-only, destructive, idempotent).
fn tool(
    name: &'static str,
    title: &str,
    description: &'static str,
    input: Arc<JsonObject>,
    (read_only, destructive, idempotent): (bool, bool, bool),
) -> Tool {
    let hints = ToolAnnotations::with_title(title)
        .read_only(read_only)
        .destructive(destructive)
        .idempotent(idempotent)
        .open_world(false);
    Tool::new(name, description, input)
        .with_title(title)
        .with_annotations(hints)
}

/// Every tool's definition.
pub fn tools() -> Vec<Tool> {
    vec![
        tool(
            MEMORY_SEARCH,
            "Search the user's memory",
            "Finds what is known about the user relevant to a query: their memories (kept across conversations, with their type, scope, score, dates and the conversation they were learned from) and the turns of their earlier conversations (with the conversation, turn number, date and score), best first.",
            schema(
                json!({"query": {"type": "string", "minLength": 1, "description": "What to look for, in words."},
                       "limit": limit(), "user": user()}),
                &["query"],
            ),
            (true, false, true),
        ),
        tool(
            MEMORY_REMEMBER,
            "Remember something about the user",
            "Keeps a memory the user stated or asked to keep. A memory like one already known updates it (the old text kept in its history) and the same memory again changes nothing; it is in the user's next prompts from the next request on.",
            schema(
                json!({"text": text(), "type": memory_type(),
                       "scope": {"type": "string", "enum": ["private", "agent", "tenant"],
                                 "description": "private (the user alone, the default), agent (every user of this agent), tenant (every user)."},
                       "importance": importance(),
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 32},
                       "supersedes": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                      "description": "Ids of memories this one replaces."},
                       "user": user()}),
                &["text", "type"],
            ),
            (false, false, true),
        ),
        tool(
            MEMORY_CORRECT,
            "Correct a memory",
            "Changes one of the user's memories: a new version, the old text kept in its history. Give at least one of text, type, importance, tags.",
            schema(
                json!({"id": id(), "text": text(), "type": memory_type(), "importance": importance(),
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 32},
                       "user": user()}),
                &["id"],
            ),
            (false, true, false),
        ),
        tool(
            MEMORY_FORGET,
            "Forget a memory",
            "Deletes one of the user's memories: it is in no prompt from the next request on.",
            schema(json!({"id": id(), "user": user()}), &["id"]),
            (false, true, true),
        ),
        tool(
            CONVERSATION_RECALL,
            "Recall turns of a conversation",
            "Finds the turns of one of the user's conversations, named by its id, relevant to a query: each with its turn number, role, date, score and text (a long one cut to its relevant passage), best first.",
            schema(
                json!({"conversation": {"type": "string", "minLength": 1, "maxLength": 128,
                                        "description": "The conversation's id (X-Memory-Conversation-Id)."},
                       "query": {"type": "string", "minLength": 1, "description": "What to look for, in words."},
                       "agent": {"type": "string", "minLength": 1, "maxLength": 128,
                                 "description": "The conversation's agent (the caller's agent if not given)."},
                       "limit": limit(), "user": user()}),
                &["conversation", "query"],
            ),
            (true, false, true),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tool_has_a_title_a_closed_object_schema_and_hints() {
        let tools = tools();
        let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
        assert_eq!(names, TOOL_NAMES);
        for tool in &tools {
            assert!(tool.title.is_some(), "{}", tool.name);
            assert_eq!(tool.input_schema["type"], "object");
            assert_eq!(tool.input_schema["additionalProperties"], false);
            for required in tool.input_schema["required"].as_array().unwrap() {
                let name = required.as_str().unwrap();
                assert!(
                    tool.input_schema["properties"].get(name).is_some(),
                    "{name}"
                );
            }
            let hints = tool.annotations.as_ref().unwrap();
            assert!(hints.read_only_hint.is_some() && hints.destructive_hint.is_some());
            assert_eq!(hints.open_world_hint, Some(false));
        }
        let read_only: Vec<&str> = tools
            .iter()
            .filter(|t| t.annotations.as_ref().unwrap().read_only_hint == Some(true))
            .map(|t| t.name.as_ref())
            .collect();
        assert_eq!(read_only, [MEMORY_SEARCH, CONVERSATION_RECALL]);
    }
}
