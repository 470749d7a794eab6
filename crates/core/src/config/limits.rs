//! `[limits]`: what one request may add to memory. A request over a limit is refused with 413
//! before anything is counted further or stored, so one hostile request cannot make the proxy
//! tokenize, hold and store an unbounded history.

use serde::Deserialize;

use super::values::at_least_one;

/// Messages one request may add to a conversation (after reconciliation: a full-history client
/// re-sending what is stored adds only its new messages).
pub const DEFAULT_MAX_NEW_MESSAGES: usize = 1000;
/// Tokens those new messages may hold together.
pub const DEFAULT_MAX_NEW_TOKENS: usize = 262_144;
/// The longest SSE line or event data memproxy keeps while it reads a streamed reply.
pub const DEFAULT_MAX_SSE_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// The per-request limits, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitsConfig {
    pub max_new_messages: usize,
    pub max_new_tokens: usize,
    /// A streamed reply with a longer line or event is passed through but not stored.
    pub max_sse_event_bytes: usize,
}

impl Default for LimitsConfig {
    fn default() -> LimitsConfig {
        LimitsConfig {
            max_new_messages: DEFAULT_MAX_NEW_MESSAGES,
            max_new_tokens: DEFAULT_MAX_NEW_TOKENS,
            max_sse_event_bytes: DEFAULT_MAX_SSE_EVENT_BYTES,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    max_new_messages: Option<u64>,
    max_new_tokens: Option<u64>,
    max_sse_event_bytes: Option<u64>,
}

/// Checks `[limits]`.
pub(super) fn check_limits(raw: RawLimits, problems: &mut Vec<String>) -> LimitsConfig {
    LimitsConfig {
        max_new_messages: at_least_one(
            "limits.max_new_messages",
            raw.max_new_messages,
            DEFAULT_MAX_NEW_MESSAGES,
            problems,
        ),
        max_new_tokens: at_least_one(
            "limits.max_new_tokens",
            raw.max_new_tokens,
            DEFAULT_MAX_NEW_TOKENS,
            problems,
        ),
        max_sse_event_bytes: at_least_one(
            "limits.max_sse_event_bytes",
            raw.max_sse_event_bytes,
            DEFAULT_MAX_SSE_EVENT_BYTES,
            problems,
        ),
    }
}
