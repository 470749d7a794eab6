//! The summary call's prompt: the template filled with the previous summary and the messages
//! that aged out since, and the length rules applied to the answer.

use crate::store::{StoredMessage, transcript_line};
use crate::tokens;

/// The default prompt: what a continuing conversation needs, in well under a third of the
/// original's length.
pub const DEFAULT_PROMPT: &str = "You maintain the running summary of a long conversation between a user and an AI assistant. \
The summary replaces the old messages in the assistant's context, so keep everything a continuing conversation needs:
- who the user is, and their preferences and constraints;
- facts and identifiers stated (names, numbers, account ids, addresses, dates) exactly as written;
- decisions made, and why;
- tool calls made and their outcomes, errors and failures seen;
- open tasks, promises and questions not yet answered.
Merge the previous summary with the new messages into one updated summary. Drop small talk and repetition. \
Write short factual bullet points in the conversation's language. Keep it under 30% of the length of the input below, and under {max_summary_tokens} tokens in all.

Previous summary:
{prev_summary}

New messages (oldest first):
{messages_joined}

Updated summary:";

/// The template filled in: `{prev_summary}` (or "(none yet)"), `{messages_joined}` (one
/// transcript line per message) and `{max_summary_tokens}`.
pub fn fill(
    template: &str,
    previous: Option<&str>,
    messages: &[StoredMessage],
    max_summary_tokens: u32,
) -> String {
    let joined: Vec<String> = messages.iter().map(transcript_line).collect();
    template
        .replace("{prev_summary}", previous.unwrap_or("(none yet)"))
        .replace("{messages_joined}", &joined.join("\n"))
        .replace("{max_summary_tokens}", &max_summary_tokens.to_string())
}

/// A summary's size as a share of what it was made from.
pub fn ratio(tokens: u32, original_tokens: u64) -> f64 {
    if original_tokens == 0 {
        0.0
    } else {
        f64::from(tokens) / original_tokens as f64
    }
}

/// `text` cut to at most `max` tokens, keeping its start and ending with `…`.
pub fn cap_tokens(model: Option<&str>, text: String, max: u32) -> String {
    if tokens::count_text(model, &text) <= max {
        return text;
    }
    let mut cut: String = text.chars().collect();
    // Shrink towards the cap; a few encodings at most.
    let mut keep = cut.chars().count();
    while keep > 0 && tokens::count_text(model, &cut) > max.saturating_sub(1) {
        keep = keep * 3 / 4;
        cut = text.chars().take(keep).collect();
    }
    cut.push('…');
    cut
}
