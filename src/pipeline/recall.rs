//! Recall: older turns relevant to the new message, brought back into the prompt as one
//! system message, oldest first, each line tagged `[earlier turn #N at TIME] role:`.
//!
//! Tool calls and tool results are written as text, never as raw `tool` messages, so the
//! forwarded list stays valid. Only turns before the recent window are searched, so nothing in
//! the window is repeated.

use serde_json::value::RawValue;

use crate::recall::index::Hit;
use crate::store::StoredMessage;
pub use crate::store::transcript_line as render_line;

/// How every recalled-turns message begins; also how an echo of one is recognised.
pub use crate::message::RECALL_MARKER;

/// Tokens a rendered line adds to its message's stored count (the tag and role).
pub const LINE_OVERHEAD_TOKENS: u32 = 20;

/// A recalled turn, ready to render.
#[derive(Debug, Clone)]
pub struct RecalledTurn {
    pub turn: u64,
    pub score: f32,
    /// The stored token count plus the line overhead.
    pub tokens: u32,
    pub line: String,
    /// For a turn of another of the user's conversations (long-term memory): when it was
    /// stored. Those come first in the message, oldest first, then the conversation's own.
    pub elsewhere_at: Option<i64>,
}

/// Turns `hits` and their stored messages (same order) into recalled turns, best first.
pub fn recalled_turns(hits: &[Hit], messages: Vec<StoredMessage>) -> Vec<RecalledTurn> {
    hits.iter()
        .zip(messages)
        .map(|(hit, message)| RecalledTurn {
            turn: hit.turn,
            score: hit.score,
            tokens: message.tokens + LINE_OVERHEAD_TOKENS,
            line: render_line(&message),
            elsewhere_at: None,
        })
        .collect()
}

/// Turns found in the user's other conversations (`crate::longterm`), best first, each line
/// tagged `[earlier conversation C, turn #N at TIME] role:`.
pub fn elsewhere_turns(found: Vec<crate::longterm::ElsewhereTurn>) -> Vec<RecalledTurn> {
    found
        .into_iter()
        .map(|turn| {
            let line = render_line(&turn.message);
            let line = match line.strip_prefix("[earlier turn #") {
                Some(rest) => format!("[earlier conversation {}, turn #{rest}", turn.conversation),
                None => line,
            };
            RecalledTurn {
                turn: turn.message.turn,
                score: turn.score,
                tokens: turn.message.tokens + LINE_OVERHEAD_TOKENS + 4,
                line,
                elsewhere_at: Some(turn.message.at_ms),
            }
        })
        .collect()
}

/// The one system message holding `turns`, in chronological order.
pub fn render(turns: &[RecalledTurn]) -> Option<Box<RawValue>> {
    if turns.is_empty() {
        return None;
    }
    let mut ordered: Vec<&RecalledTurn> = turns.iter().collect();
    // Other conversations' turns first (oldest first), then the conversation's own in turn
    // order; without long-term memory only the latter.
    ordered.sort_by_key(|t| {
        (
            t.elsewhere_at.is_none(),
            t.elsewhere_at.unwrap_or(0),
            t.turn,
        )
    });
    let mut content =
        format!("{RECALL_MARKER}: older turns relevant to the current message, oldest first]");
    for turn in ordered {
        content.push('\n');
        content.push_str(&turn.line);
    }
    let message = serde_json::json!({"role": "system", "content": content});
    RawValue::from_string(message.to_string()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;
    use crate::store::Origin;
    use serde_json::Value;

    fn stored(turn: u64, role: Role, message: Value) -> StoredMessage {
        StoredMessage {
            turn,
            role,
            origin: Origin::Client,
            at_ms: 1_795_342_500_000,
            tokens: 5,
            fingerprint: 0,
            message: RawValue::from_string(message.to_string()).unwrap(),
        }
    }

    #[test]
    fn lines_are_tagged_and_tools_become_text() {
        let user = stored(
            3,
            Role::User,
            serde_json::json!({"role": "user", "content": "my account is 99812"}),
        );
        assert_eq!(
            render_line(&user),
            "[earlier turn #3 at 2026-11-22T10:15:00Z] user: my account is 99812"
        );
        let call = stored(
            4,
            Role::Assistant,
            serde_json::json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"id\":1}"}}]}),
        );
        assert_eq!(
            render_line(&call),
            "[earlier turn #4 at 2026-11-22T10:15:00Z] assistant: [called lookup({\"id\":1})]"
        );
        let result = stored(
            5,
            Role::Tool,
            serde_json::json!({"role": "tool", "tool_call_id": "c1", "content": "found"}),
        );
        assert_eq!(
            render_line(&result),
            "[earlier turn #5 at 2026-11-22T10:15:00Z] tool result for c1: found"
        );
    }

    #[test]
    fn the_message_is_chronological() {
        let turns = vec![
            RecalledTurn {
                turn: 9,
                score: 3.0,
                tokens: 1,
                line: "nine".into(),
                elsewhere_at: None,
            },
            RecalledTurn {
                turn: 2,
                score: 1.0,
                tokens: 1,
                line: "two".into(),
                elsewhere_at: None,
            },
        ];
        let message: Value = serde_json::from_str(render(&turns).unwrap().get()).unwrap();
        assert_eq!(message["role"], "system");
        let content = message["content"].as_str().unwrap();
        assert!(content.starts_with(RECALL_MARKER));
        assert!(content.ends_with("\ntwo\nnine"));
        assert!(render(&[]).is_none());
    }
}
