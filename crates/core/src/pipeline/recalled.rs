//! Recall: older turns relevant to the new message, brought back into the prompt as one
//! system message, oldest first, each line tagged `[earlier turn #N at TIME] role:`.
//!
//! Tool calls and tool results are written as text, never as raw `tool` messages, so the
//! forwarded list stays valid. Only turns before the recent window are searched, so nothing in
//! the window is repeated.

use std::collections::HashSet;

use serde_json::value::RawValue;

use crate::recall::excerpt::excerpt;
use crate::recall::hybrid::Scored;
use crate::recall::stemming;
use crate::recall::tokenize::{TextLanguage, terms};
use memproxy_store::StoredMessage;
pub use memproxy_store::transcript_line as render_line;

/// How every recalled-turns message begins; also how an echo of one is recognised.
pub use memproxy_base::message::RECALL_MARKER;

/// Tokens a rendered line adds to its message's stored count (the tag and role).
pub const LINE_OVERHEAD_TOKENS: u32 = 20;

/// A recalled turn, ready to render.
#[derive(Debug, Clone)]
pub struct RecalledTurn {
    pub turn: u64,
    /// The fused score, 0..1 (`recall/hybrid.rs`).
    pub score: f32,
    /// Its parts: the words' score and the meaning's (`None`: no vector took part).
    pub lexical: f32,
    pub semantic: Option<f32>,
    /// Stored in the period the question names (`recall/when.rs`).
    pub when: bool,
    /// The stored token count plus the line overhead.
    pub tokens: u32,
    pub line: String,
    /// For a turn of another of the user's conversations (long-term memory): which, and when
    /// it was stored. Those come first in the message, oldest first, then the conversation's
    /// own.
    pub elsewhere: Option<Elsewhere>,
    /// Cut to its most relevant passage by [`fit_recalled`].
    pub excerpted: bool,
}

/// Where a recalled turn of another of the user's conversations comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Elsewhere {
    pub conversation: String,
    /// When it was stored (ms since the epoch).
    pub at_ms: i64,
}

/// Turns `hits` and their stored messages (same order) into recalled turns, best first.
pub fn recalled_turns(hits: &[Scored], messages: Vec<StoredMessage>) -> Vec<RecalledTurn> {
    hits.iter()
        .zip(messages)
        .map(|(hit, message)| RecalledTurn {
            turn: hit.turn,
            score: hit.score,
            lexical: hit.lexical,
            semantic: hit.semantic,
            when: hit.when,
            tokens: message.tokens + LINE_OVERHEAD_TOKENS,
            line: render_line(&message),
            elsewhere: None,
            excerpted: false,
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
                lexical: turn.score,
                semantic: None,
                when: false,
                tokens: turn.message.tokens + LINE_OVERHEAD_TOKENS + 4,
                line,
                elsewhere: Some(Elsewhere {
                    conversation: turn.conversation,
                    at_ms: turn.message.at_ms,
                }),
                excerpted: false,
            }
        })
        .collect()
}

/// The fewest tokens of text an excerpt keeps of a recalled message, however many turns share
/// the budget.
const MIN_EXCERPT_TOKENS: u32 = 16;

/// Fits the recalled turns into `budget` tokens (`relevance_max_tokens`; `None`: no limit)
/// without dropping any: when they would take more, the best match stays whole while it takes
/// at most half the budget, and every other turn longer than a common cap is cut to the
/// passage that best matches `query` (`recall/excerpt.rs`), the cap being the largest that
/// fits (short turns stay whole and leave their room to the long ones). A line
/// keeps its tag, and its token count is counted again. Which turns are recalled does not
/// change, only how much of a long one is shown.
pub fn fit_recalled(
    turns: &mut [RecalledTurn],
    query: &str,
    language: TextLanguage,
    budget: Option<u64>,
    model: Option<&str>,
) {
    let Some(budget) = budget else { return };
    let total: u64 = turns.iter().map(|t| u64::from(t.tokens)).sum();
    if total <= budget {
        return;
    }
    // The best match stays whole when it takes at most half the budget; the others share
    // what it leaves.
    let whole = turns
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.score.total_cmp(&b.1.score))
        .filter(|(_, t)| u64::from(t.tokens) * 2 <= budget)
        .map(|(i, _)| i);
    let shares = |i: usize| whole != Some(i);
    let shared = budget - whole.map_or(0, |i| u64::from(turns[i].tokens));
    let cap = common_cap(
        turns
            .iter()
            .enumerate()
            .filter(|(i, _)| shares(*i))
            .map(|(_, t)| t.tokens)
            .collect(),
        shared,
    );
    let overhead = LINE_OVERHEAD_TOKENS + memproxy_base::tokens::MESSAGE_OVERHEAD_TOKENS;
    let keep = cap.saturating_sub(overhead).max(MIN_EXCERPT_TOKENS);
    let latin = stemming(
        language,
        std::iter::once(query).chain(turns.iter().map(|t| t.line.as_str())),
    );
    let query_terms: HashSet<String> = terms(query, latin).into_iter().collect();
    for (_, turn) in turns
        .iter_mut()
        .enumerate()
        .filter(|(i, t)| t.tokens > cap && shares(*i))
    {
        let split = content_start(&turn.line);
        let (head, body) = turn.line.split_at(split);
        // The line's tokens less its tag and the message overhead: the text's stored count.
        let body_tokens = turn.tokens.saturating_sub(overhead);
        if let Some(short) = excerpt(body, body_tokens, &query_terms, latin, keep, |text| {
            memproxy_base::tokens::count_text(model, text)
        }) {
            turn.tokens =
                memproxy_base::tokens::count_message(model, &short) + LINE_OVERHEAD_TOKENS;
            turn.line = format!("{head}{short}");
            turn.excerpted = true;
        }
    }
}

/// The largest `cap` with `sum(min(t, cap)) <= budget` over `tokens` (water-filling).
fn common_cap(mut tokens: Vec<u32>, budget: u64) -> u32 {
    tokens.sort_unstable();
    let mut left = budget;
    let n = tokens.len() as u64;
    for (i, &t) in tokens.iter().enumerate() {
        let rest = n - i as u64;
        if u64::from(t) * rest > left {
            return u32::try_from(left / rest).unwrap_or(u32::MAX);
        }
        left -= u64::from(t);
    }
    u32::MAX
}

/// Where a rendered line's text begins: after its tag and `role: `.
fn content_start(line: &str) -> usize {
    let tag_end = line.find("] ").map_or(0, |i| i + 2);
    line[tag_end..]
        .find(": ")
        .map_or(tag_end, |i| tag_end + i + 2)
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
            t.elsewhere.is_none(),
            t.elsewhere.as_ref().map_or(0, |e| e.at_ms),
            t.turn,
        )
    });
    let mut content =
        format!("{RECALL_MARKER}: older turns relevant to the current message, oldest first]");
    for turn in ordered {
        content.push('\n');
        content.push_str(&turn.line);
    }
    // Serialized straight into the raw value (no `Value` made, and what serde_json wrote is
    // not parsed again to check it), in the bytes a `Value` of it printed: keys in order.
    #[derive(serde::Serialize)]
    struct System<'a> {
        content: &'a str,
        role: &'static str,
    }
    serde_json::value::to_raw_value(&System {
        content: &content,
        role: "system",
    })
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use memproxy_base::message::Role;
    use memproxy_store::Origin;
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
            exchange: None,
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
    fn the_common_cap_fills_the_budget_short_turns_first() {
        assert_eq!(common_cap(vec![10, 20, 30], 100), u32::MAX);
        // 10 and 20 whole, then 2 × 25.
        assert_eq!(common_cap(vec![300, 10, 20, 300], 80), 25);
        assert_eq!(common_cap(vec![100, 100], 50), 25);
    }

    fn turn(number: u64, text: &str) -> RecalledTurn {
        let line = format!("[earlier turn #{number} at 2026-11-22T10:15:00Z] assistant: {text}");
        RecalledTurn {
            turn: number,
            score: 1.0,
            lexical: 1.0,
            semantic: None,
            when: false,
            tokens: memproxy_base::tokens::count_message(None, text) + LINE_OVERHEAD_TOKENS,
            line,
            elsewhere: None,
            excerpted: false,
        }
    }

    #[test]
    fn long_turns_are_cut_to_their_relevant_passage_and_short_ones_stay_whole() {
        let filler = "We talked about the weather and the traffic on the way home. ".repeat(20);
        let long = format!("{filler}The storage unit code is 7781 at the north gate. {filler}");
        let mut turns = vec![turn(3, "My sister lives in Porto."), turn(9, &long)];
        let short_line = turns[0].line.clone();
        fit_recalled(
            &mut turns,
            "what is the code of the storage unit",
            TextLanguage::Auto,
            Some(120),
            None,
        );
        assert_eq!(turns[0].line, short_line);
        assert!(
            turns[1]
                .line
                .starts_with("[earlier turn #9 at 2026-11-22T10:15:00Z] assistant: … ")
        );
        assert!(
            turns[1].line.contains("The storage unit code is 7781"),
            "{}",
            turns[1].line
        );
        let total: u32 = turns.iter().map(|t| t.tokens).sum();
        assert!(total <= 120, "{total}");
        assert!(!turns[0].excerpted && turns[1].excerpted);
        assert_eq!(
            turns[1].tokens,
            memproxy_base::tokens::count_message(
                None,
                turns[1].line.split_once("assistant: ").unwrap().1
            ) + LINE_OVERHEAD_TOKENS
        );
        // No budget, or one they fit: nothing changes.
        let mut again = vec![turn(9, &long)];
        let before = again[0].line.clone();
        fit_recalled(&mut again, "storage code", TextLanguage::Auto, None, None);
        assert_eq!(again[0].line, before);
        fit_recalled(
            &mut again,
            "storage code",
            TextLanguage::Auto,
            Some(100_000),
            None,
        );
        assert_eq!(again[0].line, before);
    }

    #[test]
    fn the_message_is_chronological() {
        let turns = vec![
            RecalledTurn {
                turn: 9,
                score: 3.0,
                lexical: 3.0,
                semantic: None,
                when: false,
                tokens: 1,
                line: "nine".into(),
                elsewhere: None,
                excerpted: false,
            },
            RecalledTurn {
                turn: 2,
                score: 1.0,
                lexical: 1.0,
                semantic: None,
                when: false,
                tokens: 1,
                line: "two".into(),
                elsewhere: None,
                excerpted: false,
            },
        ];
        let message: Value = serde_json::from_str(render(&turns).unwrap().get()).unwrap();
        assert_eq!(message["role"], "system");
        let content = message["content"].as_str().unwrap();
        assert!(content.starts_with(RECALL_MARKER));
        assert!(content.ends_with("\ntwo\nnine"));
        assert!(render(&[]).is_none());
        // The bytes are those of the message as a `Value` prints it, whatever a line holds.
        let mut odd = turns.clone();
        odd[0].line = "a \"quote\", a \\ and a\ttab, é, \u{1} and </script>".into();
        let rendered = render(&odd).unwrap();
        let content: Value = serde_json::from_str(rendered.get()).unwrap();
        assert!(
            content["content"]
                .as_str()
                .unwrap()
                .contains("é, \u{1} and")
        );
        assert_eq!(
            rendered.get(),
            serde_json::json!({"role": "system", "content": content["content"]}).to_string()
        );
    }
}
