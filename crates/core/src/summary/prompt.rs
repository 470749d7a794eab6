//! The summary call's prompt: the template filled with the previous summary and the messages
//! that aged out since, and the length rules applied to the answer.

use memproxy_base::tokens;
use memproxy_store::{StoredMessage, transcript_line};

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
