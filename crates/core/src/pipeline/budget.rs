//! The token budget (`max_context_tokens`): when the assembled prompt would be too long, drop
//! recalled turns (lowest score first), then the oldest whole rounds of the recent window, then
//! the oldest parts of the last round; if the newest remaining message alone is still too long,
//! keep its end behind a notice. The client's instructions and new messages are never cut.
//!
//! Counts come from the stored token counts; only a message being cut is encoded again.
//!
//! What a cut does to the provider's prompt cache: dropping recalled turns costs nothing (they
//! come after everything a next prompt repeats). Cutting the window's oldest rounds moves its
//! start, so a prompt the budget cut shares only instructions, summary and memories with the
//! previous one; a conversation whose window passes the budget on every turn slides again, as
//! with `window_step = 0`, until the anchor's next jump leaves the window short enough
//! (`window.rs`). The window is cut only on the turns where it is too long, which with an
//! anchor are the last ones before a jump. Truncating the newest message changes only the end.

use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::recalled::RecalledTurn;
use memproxy_base::message::Role;
use memproxy_base::tokens::{self, MESSAGE_OVERHEAD_TOKENS};
use memproxy_store::StoredMessage;

/// Put in front of a message whose beginning was cut.
pub const TRUNCATION_NOTICE: &str =
    "Notice: Chat history truncated due to maximum context window. ";

/// What fitting the budget did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Fitted {
    pub dropped_recalled: usize,
    pub dropped_window: usize,
    pub truncated: bool,
    /// Still over budget: the client's own messages alone do not fit.
    pub exceeded: bool,
    /// Tokens of the prompt as fitted (from stored counts).
    pub total: u64,
}

impl Fitted {
    /// `fits`, `trimmed` or `exceeded`: for `X-Memory-Budget` and the admin preview.
    pub fn verdict(&self) -> &'static str {
        if self.exceeded {
            "exceeded"
        } else if self.truncated || self.dropped_recalled > 0 || self.dropped_window > 0 {
            "trimmed"
        } else {
            "fits"
        }
    }
}

/// What the budget dropped, by name: the recalled turns (with their scores) and the window's
/// turns that were candidates for the prompt and left out (for the receipt).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Dropped {
    /// Recalled turns dropped, best first: (turn, BM25 score); turns of the user's other
    /// conversations have their conversation named.
    pub recalled: Vec<(Option<String>, u64, f32)>,
    /// Window turns dropped, oldest first.
    pub window: Vec<u64>,
}

/// The candidates before fitting, to tell afterwards what was dropped.
#[derive(Debug, Clone)]
pub struct Candidates {
    recalled: Vec<(Option<String>, u64, f32)>,
    window: Vec<u64>,
}

impl Candidates {
    pub fn of(recalled: &[RecalledTurn], window: &[StoredMessage]) -> Candidates {
        Candidates {
            recalled: recalled.iter().map(candidate).collect(),
            window: window.iter().map(|m| m.turn).collect(),
        }
    }

    /// The candidates no longer in `recalled` and `window`.
    pub fn dropped(self, recalled: &[RecalledTurn], window: &[StoredMessage]) -> Dropped {
        let kept: Vec<(Option<String>, u64, f32)> = recalled.iter().map(candidate).collect();
        Dropped {
            recalled: self
                .recalled
                .into_iter()
                .filter(|c| !kept.iter().any(|k| k.0 == c.0 && k.1 == c.1))
                .collect(),
            window: self
                .window
                .into_iter()
                .filter(|turn| !window.iter().any(|m| m.turn == *turn))
                .collect(),
        }
    }
}

fn candidate(r: &RecalledTurn) -> (Option<String>, u64, f32) {
    let elsewhere = r.elsewhere.as_ref().map(|e| e.conversation.clone());
    (elsewhere, r.turn, r.score)
}

fn recalled_cost(recalled: &[RecalledTurn]) -> u64 {
    if recalled.is_empty() {
        0
    } else {
        u64::from(MESSAGE_OVERHEAD_TOKENS)
            + recalled.iter().map(|r| u64::from(r.tokens)).sum::<u64>()
    }
}

fn window_cost(window: &[StoredMessage]) -> u64 {
    window.iter().map(|m| u64::from(m.tokens)).sum()
}

/// Where the next droppable piece of `window` ends: the next round (user message) after the
/// first message, or, inside the last round, the first message together with the tool results
/// that answer it. `None` when only the newest piece is left.
fn first_piece_end(window: &[StoredMessage]) -> Option<usize> {
    if let Some(next_round) = window.iter().skip(1).position(|m| m.role == Role::User) {
        return Some(next_round + 1);
    }
    let mut end = 1;
    while end < window.len() && window[end].role == Role::Tool {
        end += 1;
    }
    (end < window.len()).then_some(end)
}

/// Fits `recalled` (best first) and `window` (oldest first) into `budget`, given `fixed` tokens
/// that cannot be cut (instructions, summary, new messages).
pub fn fit(
    budget: u64,
    fixed: u64,
    recalled: &mut Vec<RecalledTurn>,
    window: &mut Vec<StoredMessage>,
    model: Option<&str>,
) -> Fitted {
    let mut fitted = Fitted::default();
    let total = |recalled: &[RecalledTurn], window: &[StoredMessage]| {
        fixed + recalled_cost(recalled) + window_cost(window)
    };
    while total(recalled, window) > budget && !recalled.is_empty() {
        recalled.pop();
        fitted.dropped_recalled += 1;
    }
    while total(recalled, window) > budget {
        let Some(end) = first_piece_end(window) else {
            break;
        };
        window.drain(..end);
        fitted.dropped_window += end;
    }
    let current = total(recalled, window);
    if current > budget
        && let Some(newest) = window.last_mut()
    {
        let others = current - u64::from(newest.tokens);
        let room = budget.saturating_sub(others);
        fitted.truncated = truncate(newest, room, model);
    }
    fitted.total = total(recalled, window);
    fitted.exceeded = fitted.total > budget;
    fitted
}

/// Keeps the end of a message's text content so the message takes at most `room` tokens.
fn truncate(message: &mut StoredMessage, room: u64, model: Option<&str>) -> bool {
    let Ok(mut object) = serde_json::from_str::<Map<String, Value>>(message.message.get()) else {
        return false;
    };
    let Some(Value::String(text)) = object.get("content") else {
        return false;
    };
    let notice = tokens::count_text(model, TRUNCATION_NOTICE);
    // Two tokens of slack: the joined text may encode a token longer than its parts.
    let keep = room.saturating_sub(u64::from(notice + MESSAGE_OVERHEAD_TOKENS) + 2) as usize;
    let kept = tokens::keep_last_tokens(model, text, keep);
    let content = format!("{TRUNCATION_NOTICE}{kept}");
    message.tokens = tokens::count_message(model, &content);
    object.insert("content".into(), Value::String(content));
    match RawValue::from_string(Value::Object(object).to_string()) {
        Ok(raw) => {
            message.message = raw;
            true
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memproxy_store::Origin;
    use serde_json::json;

    fn msg(role: Role, text: &str, tokens: u32) -> StoredMessage {
        StoredMessage {
            turn: 0,
            role,
            origin: Origin::Client,
            at_ms: 0,
            tokens,
            fingerprint: 0,
            message: RawValue::from_string(
                json!({"role": role.as_str(), "content": text}).to_string(),
            )
            .unwrap(),
            exchange: None,
        }
    }

    fn recalled(scores: &[f32]) -> Vec<RecalledTurn> {
        scores
            .iter()
            .enumerate()
            .map(|(i, s)| RecalledTurn {
                turn: i as u64,
                score: *s,
                lexical: *s,
                semantic: None,
                when: false,
                tokens: 10,
                line: String::new(),
                elsewhere: None,
                excerpted: false,
            })
            .collect()
    }

    fn window() -> Vec<StoredMessage> {
        vec![
            msg(Role::User, "u1", 10),
            msg(Role::Assistant, "a1", 10),
            msg(Role::User, "u2", 10),
            msg(Role::Assistant, "a2", 10),
        ]
    }

    /// (budget) → (recalled kept, window kept, truncated, exceeded)
    fn check(budget: u64, expected: (usize, usize, bool, bool)) {
        let mut r = recalled(&[3.0, 2.0, 1.0]);
        let mut w = window();
        let fitted = fit(budget, 20, &mut r, &mut w, None);
        assert_eq!(
            (r.len(), w.len(), fitted.truncated, fitted.exceeded),
            expected,
            "budget {budget}"
        );
        assert!(r.windows(2).all(|p| p[0].score >= p[1].score));
    }

    #[test]
    fn budgets_drop_in_order() {
        // fixed 20, recalled 3×10 + 4, window 4×10: 94 in all.
        check(1000, (3, 4, false, false));
        check(94, (3, 4, false, false));
        check(84, (2, 4, false, false));
        check(74, (1, 4, false, false));
        check(64, (0, 4, false, false));
        check(50, (0, 2, false, false));
        check(40, (0, 2, false, false));
        // Inside the last round: its first message goes, the newest stays.
        check(35, (0, 1, false, false));
        // The newest alone is too long: cut to the notice, still over.
        check(25, (0, 1, true, true));
    }

    #[test]
    fn the_newest_message_keeps_its_end_behind_the_notice() {
        let long = (0..400)
            .map(|i| format!("w{i}"))
            .collect::<Vec<_>>()
            .join(" ");
        let tokens = tokens::count_message(None, &long);
        let mut w = vec![msg(Role::User, &long, tokens)];
        let mut r = Vec::new();
        let fitted = fit(100, 10, &mut r, &mut w, None);
        assert!(fitted.truncated && !fitted.exceeded, "{fitted:?}");
        let content: Value = serde_json::from_str(w[0].message.get()).unwrap();
        let content = content["content"].as_str().unwrap();
        assert!(content.starts_with(TRUNCATION_NOTICE));
        assert!(content.ends_with("w399"));
        assert!(u64::from(w[0].tokens) <= 90);
    }

    #[test]
    fn tool_groups_are_dropped_whole() {
        let call = StoredMessage {
            message: RawValue::from_string(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}).to_string()).unwrap(),
            ..msg(Role::Assistant, "", 10)
        };
        let result = StoredMessage {
            message: RawValue::from_string(
                json!({"role": "tool", "tool_call_id": "c", "content": "r"}).to_string(),
            )
            .unwrap(),
            ..msg(Role::Tool, "r", 10)
        };
        let mut w = vec![
            msg(Role::User, "u", 10),
            call,
            result,
            msg(Role::Assistant, "done", 10),
        ];
        let fitted = fit(25, 0, &mut Vec::new(), &mut w, None);
        assert_eq!(w.len(), 1, "{fitted:?}");
        assert_eq!(w[0].role, Role::Assistant);
    }
}
