//! `[compression]`: how summaries are made, and the built-in summary prompt.

use std::time::Duration;

use serde::Deserialize;

use super::values::{at_least_one, duration};

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

pub const DEFAULT_SUMMARY_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_SUMMARY_CONCURRENCY: usize = 2;
pub const DEFAULT_SUMMARY_QUEUE: usize = 256;
pub const DEFAULT_SUMMARY_BACKOFF: Duration = Duration::from_secs(60);
pub const DEFAULT_SUMMARY_MAX_INPUT_TOKENS: u64 = 16_384;
pub const DEFAULT_MAX_SUMMARY_TOKENS: u32 = 1024;

/// How summaries are made (the compression stage).
#[derive(Debug, Clone)]
pub struct CompressionConfig {
    /// The prompt template, with `{prev_summary}` and `{messages_joined}`.
    pub prompt: String,
    /// Longest wait for one summary call.
    pub timeout: Duration,
    /// Summary calls running at once.
    pub concurrency: usize,
    /// Jobs waiting, at most; past it new jobs are dropped (and counted).
    pub queue_capacity: usize,
    /// Wait after a failed summary before the conversation is tried again (doubles per failure,
    /// up to 16 times).
    pub retry_backoff: Duration,
    /// Tokens of new messages one summary call reads at most; a larger backlog is summarized
    /// over several calls, oldest first, so no call overflows the model's context.
    pub max_input_tokens: u64,
    /// Longest summary kept (tokens); the prompt asks for it through `{max_summary_tokens}`
    /// and a longer answer is cut to it. Bounds what every later prompt carries.
    pub max_summary_tokens: u32,
    /// Tokens the background model calls (summaries, extraction) of one agent may spend per
    /// UTC day (`None`: no limit); agents may set their own (`BackgroundBudget`).
    pub max_tokens_per_day: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawCompression {
    prompt: Option<String>,
    prompt_file: Option<String>,
    timeout: Option<String>,
    concurrency: Option<u64>,
    queue_capacity: Option<u64>,
    retry_backoff: Option<String>,
    max_input_tokens: Option<u64>,
    max_summary_tokens: Option<u64>,
    max_tokens_per_day: Option<u64>,
}

/// Checks `[compression]`; a `prompt_file` is read here.
pub(super) fn check_compression(
    raw: RawCompression,
    problems: &mut Vec<String>,
) -> CompressionConfig {
    let prompt = match (raw.prompt, raw.prompt_file) {
        (Some(_), Some(_)) => {
            problems.push(
                "compression.prompt_file: set either prompt or prompt_file, not both".to_string(),
            );
            DEFAULT_PROMPT.to_string()
        }
        (Some(prompt), None) => prompt,
        (None, Some(path)) => std::fs::read_to_string(&path).unwrap_or_else(|err| {
            problems.push(format!(
                "compression.prompt_file: cannot read {path}: {err}"
            ));
            DEFAULT_PROMPT.to_string()
        }),
        (None, None) => DEFAULT_PROMPT.to_string(),
    };
    for placeholder in ["{prev_summary}", "{messages_joined}"] {
        if !prompt.contains(placeholder) {
            problems.push(format!(
                "compression.prompt: the template must contain {placeholder}"
            ));
        }
    }
    CompressionConfig {
        prompt,
        timeout: duration(
            "compression.timeout",
            raw.timeout,
            DEFAULT_SUMMARY_TIMEOUT,
            problems,
        ),
        concurrency: at_least_one(
            "compression.concurrency",
            raw.concurrency,
            DEFAULT_SUMMARY_CONCURRENCY,
            problems,
        ),
        queue_capacity: at_least_one(
            "compression.queue_capacity",
            raw.queue_capacity,
            DEFAULT_SUMMARY_QUEUE,
            problems,
        ),
        retry_backoff: duration(
            "compression.retry_backoff",
            raw.retry_backoff,
            DEFAULT_SUMMARY_BACKOFF,
            problems,
        ),
        max_input_tokens: at_least_one(
            "compression.max_input_tokens",
            raw.max_input_tokens,
            DEFAULT_SUMMARY_MAX_INPUT_TOKENS as usize,
            problems,
        ) as u64,
        max_summary_tokens: u32::try_from(at_least_one(
            "compression.max_summary_tokens",
            raw.max_summary_tokens,
            DEFAULT_MAX_SUMMARY_TOKENS as usize,
            problems,
        ))
        .unwrap_or(u32::MAX),
        max_tokens_per_day: match raw.max_tokens_per_day {
            Some(0) => {
                problems.push(
                    "compression.max_tokens_per_day: must be above 0 (leave it unset for no limit)"
                        .to_string(),
                );
                None
            }
            other => other,
        },
    }
}
