//! The stand-in summary, made without an LLM: counts, the first and last user message, the
//! tools used and the errors seen. Used while no model summary exists yet.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use memproxy_base::message::{Role, text_of};
use memproxy_base::tokens;
use memproxy_store::{Conversation, Store, StoreError, StoredMessage, SummaryRecord};

/// The longest excerpt of one message.
const EXCERPT_CHARS: usize = 200;
/// Error excerpts kept.
const MAX_ERRORS: usize = 3;

fn excerpt(text: &str) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= EXCERPT_CHARS {
        flat
    } else {
        let cut: String = flat.chars().take(EXCERPT_CHARS).collect();
        format!("{cut}…")
    }
}

fn looks_like_error(text: &str) -> bool {
    let lower = text.to_lowercase();
    [
        "error",
        "failed",
        "exception",
        "traceback",
        "timed out",
        "not found",
    ]
    .iter()
    .any(|w| lower.contains(w))
}

/// Stores the stand-in for the turns up to `upto_turn` of `conversation` (locked by the
/// caller) whose id was `id`, unless a summary exists by now: the one writer of the stand-in,
/// used by the summary worker before it calls the model and by a request that finds no job
/// will write it. Returns the record stored.
pub fn store_stand_in(
    store: &Store,
    conversation: &Conversation,
    id: u64,
    upto_turn: u64,
) -> Result<Option<SummaryRecord>, StoreError> {
    if store.latest_summary(&conversation.key, id)?.is_some() {
        return Ok(None);
    }
    let turns = conversation
        .entries
        .iter()
        .take_while(|e| e.turn <= upto_turn)
        .map(|e| e.turn);
    let messages = store.messages(conversation, turns)?;
    let Some(record) = summarize(&messages, 1, store.clock().now_ms()) else {
        return Ok(None);
    };
    Ok(store
        .save_summary(conversation, id, &record)?
        .then_some(record))
}

/// A heuristic summary of `messages` (oldest first), numbered `number`, made at `created_ms`.
pub fn summarize(
    messages: &[StoredMessage],
    number: u64,
    created_ms: i64,
) -> Option<SummaryRecord> {
    let (first, last) = (messages.first()?, messages.last()?);
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut tools: BTreeMap<String, usize> = BTreeMap::new();
    let mut errors = Vec::new();
    let mut user_texts = Vec::new();
    for message in messages {
        *counts.entry(message.role.as_str()).or_default() += 1;
        let object: Map<String, Value> =
            serde_json::from_str(message.message.get()).unwrap_or_default();
        let text = text_of(&object);
        if let Some(Value::Array(calls)) = object.get("tool_calls") {
            for call in calls {
                let name = call
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .unwrap_or("tool");
                *tools.entry(name.to_string()).or_default() += 1;
            }
        }
        if message.role == Role::User {
            user_texts.push(text.clone());
        }
        if matches!(message.role, Role::Tool | Role::Assistant)
            && looks_like_error(&text)
            && errors.len() < MAX_ERRORS
        {
            errors.push(format!("turn {}: {}", message.turn, excerpt(&text)));
        }
    }
    let mut lines = vec![format!(
        "- {} messages ({})",
        messages.len(),
        counts
            .iter()
            .map(|(r, n)| format!("{n} {r}"))
            .collect::<Vec<_>>()
            .join(", ")
    )];
    if let Some(first_user) = user_texts.first() {
        lines.push(format!("- first user message: {}", excerpt(first_user)));
    }
    if user_texts.len() > 1
        && let Some(last_user) = user_texts.last()
    {
        lines.push(format!("- last user message: {}", excerpt(last_user)));
    }
    if !tools.is_empty() {
        lines.push(format!(
            "- tools used: {}",
            tools
                .iter()
                .map(|(t, n)| format!("{t} ×{n}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    for error in &errors {
        lines.push(format!("- error seen at {error}"));
    }
    let text = lines.join("\n");
    let original_tokens: u64 = messages.iter().map(|m| u64::from(m.tokens)).sum();
    let tokens = tokens::count_text(None, &text);
    Some(SummaryRecord {
        number,
        from_turn: first.turn,
        to_turn: last.turn,
        tokens,
        original_tokens,
        ratio: super::ratio(tokens, original_tokens),
        from_ms: first.at_ms,
        to_ms: last.at_ms,
        model: "heuristic".to_string(),
        created_ms,
        heuristic: true,
        usage_prompt_tokens: 0,
        usage_completion_tokens: 0,
        partial_run: 0,
        text,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use memproxy_store::Origin;
    use serde_json::json;
    use serde_json::value::RawValue;

    fn stored(turn: u64, role: Role, message: Value) -> StoredMessage {
        StoredMessage {
            turn,
            role,
            origin: Origin::Client,
            at_ms: turn as i64,
            tokens: 10,
            fingerprint: 0,
            message: RawValue::from_string(message.to_string()).unwrap(),
            exchange: None,
        }
    }

    #[test]
    fn counts_first_last_tools_and_errors() {
        let messages = vec![
            stored(
                1,
                Role::User,
                json!({"role": "user", "content": "Book a table for two"}),
            ),
            stored(
                2,
                Role::Assistant,
                json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "book", "arguments": "{}"}}]}),
            ),
            stored(
                3,
                Role::Tool,
                json!({"role": "tool", "tool_call_id": "c", "content": "Error: restaurant full"}),
            ),
            stored(
                4,
                Role::User,
                json!({"role": "user", "content": "Try tomorrow then"}),
            ),
        ];
        let record = summarize(&messages, 1, 0).unwrap();
        assert!(record.heuristic);
        assert_eq!((record.from_turn, record.to_turn), (1, 4));
        assert!(record.text.contains("4 messages"), "{}", record.text);
        assert!(
            record
                .text
                .contains("first user message: Book a table for two")
        );
        assert!(record.text.contains("last user message: Try tomorrow then"));
        assert!(record.text.contains("tools used: book ×1"));
        assert!(
            record
                .text
                .contains("error seen at turn 3: Error: restaurant full")
        );
        assert!(summarize(&[], 1, 0).is_none());
    }
}
