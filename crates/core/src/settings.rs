//! Memory settings: their names, defaults, value rules, and the one parser that applies a
//! value to them from either the config file or an `X-Memory-*` header.
//!
//! Every setting is listed once, in [`SETTINGS`]; the config loader and the header parser both
//! go through [`MemorySettings::apply`], so a setting cannot be accepted in one place and
//! rejected in the other. This module knows nothing of HTTP or TOML beyond turning their values
//! into text.

use std::time::Duration;

use crate::recall::tokenize::TextLanguage;

pub const DEFAULT_RECENT_N: usize = 10;
pub const DEFAULT_MAX_MESSAGES: usize = 1000;
pub const DEFAULT_RELEVANCE_TOP_K: usize = 5;
/// The cap on `relevance_top_k`.
pub const MAX_RELEVANCE_TOP_K: usize = 20;
/// `relevance_max_tokens = "auto"`: this many tokens per recalled turn (`relevance_top_k`).
pub const AUTO_RELEVANCE_TOKENS_PER_TURN: u64 = 100;
pub const DEFAULT_COMPRESSION_THRESHOLD_TOKENS: u64 = 8192;
pub const DEFAULT_COMPRESSION_INTERVAL: Duration = Duration::from_secs(3600);
/// The largest `recent_n` and `max_messages` accepted.
pub const MAX_RECENT_N: usize = 10_000;
pub const MAX_MAX_MESSAGES: usize = 1_000_000;
pub const DEFAULT_LONG_TERM_TOP_K: usize = 5;
/// The cap on `long_term_top_k`.
pub const MAX_LONG_TERM_TOP_K: usize = 50;
pub const DEFAULT_LONG_TERM_MAX_TOKENS: u64 = 600;
pub const DEFAULT_EXTRACTION_EVERY: u64 = 6;
/// 30 days.
pub const DEFAULT_MEMORY_HALF_LIFE: Duration = Duration::from_secs(30 * 86_400);
pub const DEFAULT_MEMORY_MIN_DECAY: f64 = 0.2;
/// The largest `window_step` accepted.
pub const MAX_WINDOW_STEP: usize = 10_000;

/// The effective settings for one request: built-in defaults ← `[memory]` ← `[agents.NAME]` ←
/// headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemorySettings {
    /// Memory on at all for this request (with a conversation id).
    pub enabled: bool,
    /// Store this exchange (false: use memory, store nothing).
    pub persist: bool,
    /// Stored messages forwarded verbatim before the new ones (widened to a round start).
    pub recent_n: usize,
    /// How far the recent window grows past `recent_n` before its start jumps forward
    /// (`pipeline/window.rs`); `None`: `auto`, chosen per conversation from its message lengths
    /// (`window::auto_step`); `Some(0)`: the window slides every turn.
    pub window_step: Option<usize>,
    /// Messages kept per conversation; the oldest whole rounds are trimmed past it.
    pub max_messages: usize,
    pub relevance_enabled: bool,
    pub relevance_top_k: usize,
    /// Tokens the recalled turns may take in the prompt: past it, the longest are cut to the
    /// passage that best matches the new message (`pipeline/recalled.rs`). `None`: `auto`
    /// ([`AUTO_RELEVANCE_TOKENS_PER_TURN`] per turn of `relevance_top_k`); `Some(0)`: no limit.
    pub relevance_max_tokens: Option<u64>,
    pub compression_enabled: bool,
    pub compression_threshold_tokens: u64,
    pub compression_model: Option<String>,
    pub compression_interval: Duration,
    pub compression_async: bool,
    pub max_context_tokens: Option<u64>,
    /// How Latin-script text is stemmed for recall: `auto` detects it per conversation.
    pub relevance_language: TextLanguage,
    /// Recall by meaning too (hybrid: words and vectors, `recall/hybrid.rs`) when an embedder
    /// is configured; off: by words alone.
    pub relevance_semantic: bool,
    /// Favour the turns stored in the period a question names ("in July 2022", "last week":
    /// `recall/when.rs`).
    pub relevance_time: bool,
    /// Score the older turns twice, the second time with the question's vector moved towards
    /// the best turns' (`recall/hybrid.rs`'s `feedback`).
    pub relevance_feedback: bool,
    /// The share of the words' score in the fused score (the rest is the meaning's), in
    /// millionths.
    pub relevance_lexical_weight_micros: u32,
    /// Recalled turns whose fused score is below this are not injected, in millionths.
    pub relevance_floor_micros: u32,
    /// Recalled turns whose fused score is below this share of the best one's are not
    /// injected, in millionths.
    pub relevance_relative_floor_micros: u32,
    /// A conversation idle longer than this is deleted by the TTL sweeper; `None`: kept forever.
    pub ttl: Option<Duration>,
    /// Long-term memory (recall across the user's conversations, extracted memories) for
    /// requests that name a user (`X-Memory-User-Id`).
    pub long_term_enabled: bool,
    /// Extracted memories put in the prompt, at most.
    pub long_term_top_k: usize,
    /// Tokens the extracted memories may take in the prompt, at most.
    pub long_term_max_tokens: u64,
    /// The model that extracts memories (`None`: `compression_model`, else the request's).
    pub extraction_model: Option<String>,
    /// User messages between two extractions.
    pub extraction_every: u64,
    /// A memory's decay score halves over this much time without being recalled.
    pub memory_half_life: Duration,
    /// Memories whose decay score falls below this are deleted by the sweeper. Stored as
    /// millionths so the settings stay `Eq`.
    pub memory_min_decay_micros: u32,
    /// Set `prompt_cache_key` (derived from tenant and conversation) on requests to an
    /// OpenAI-compatible upstream whose client set none (`wire/`).
    pub prompt_cache_key: bool,
    /// Mark the end of the stable part of an Anthropic prompt with `cache_control`
    /// breakpoints, within the API's four (`wire/anthropic.rs`).
    pub cache_breakpoints: bool,
    /// Store side calls (a title, a classification, a client's own compaction call: requests
    /// shaped as no turn of the conversation, `wire::side_call`) as turns. Off by default:
    /// they go upstream as sent, memory off.
    pub store_side_calls: bool,
}

impl MemorySettings {
    /// The fusion of hybrid recall: `relevance_lexical_weight`, `relevance_floor`,
    /// `relevance_relative_floor` and `relevance_feedback`.
    pub fn fusion(&self) -> crate::recall::hybrid::Fusion {
        crate::recall::hybrid::Fusion {
            lexical_weight: self.relevance_lexical_weight_micros as f32 / 1e6,
            floor: self.relevance_floor_micros as f32 / 1e6,
            relative_floor: self.relevance_relative_floor_micros as f32 / 1e6,
            feedback: self.relevance_feedback,
        }
    }

    /// The period `text` names, read at `now_ms`, when `relevance_time` is on.
    pub fn period(&self, text: &str, now_ms: i64) -> Option<crate::recall::when::Period> {
        self.relevance_time
            .then(|| crate::recall::when::period(text, now_ms))
            .flatten()
    }

    /// `memory_min_decay` as a fraction.
    pub fn memory_min_decay(&self) -> f64 {
        f64::from(self.memory_min_decay_micros) / 1e6
    }

    /// The tokens recalled turns may take, as it applies (`None`: no limit).
    pub fn relevance_budget(&self) -> Option<u64> {
        match self.relevance_max_tokens {
            None => Some(AUTO_RELEVANCE_TOKENS_PER_TURN * self.relevance_top_k as u64),
            Some(0) => None,
            Some(n) => Some(n),
        }
    }
}

impl Default for MemorySettings {
    fn default() -> Self {
        MemorySettings {
            enabled: true,
            persist: true,
            recent_n: DEFAULT_RECENT_N,
            window_step: None,
            max_messages: DEFAULT_MAX_MESSAGES,
            relevance_enabled: true,
            relevance_top_k: DEFAULT_RELEVANCE_TOP_K,
            relevance_max_tokens: None,
            compression_enabled: true,
            compression_threshold_tokens: DEFAULT_COMPRESSION_THRESHOLD_TOKENS,
            compression_model: None,
            compression_interval: DEFAULT_COMPRESSION_INTERVAL,
            compression_async: true,
            max_context_tokens: None,
            relevance_language: TextLanguage::Auto,
            relevance_semantic: true,
            relevance_time: true,
            relevance_feedback: false,
            relevance_lexical_weight_micros: (crate::recall::hybrid::DEFAULT_LEXICAL_WEIGHT * 1e6)
                as u32,
            relevance_floor_micros: (crate::recall::hybrid::DEFAULT_FLOOR * 1e6) as u32,
            relevance_relative_floor_micros: (crate::recall::hybrid::DEFAULT_RELATIVE_FLOOR * 1e6)
                as u32,
            ttl: None,
            long_term_enabled: true,
            long_term_top_k: DEFAULT_LONG_TERM_TOP_K,
            long_term_max_tokens: DEFAULT_LONG_TERM_MAX_TOKENS,
            extraction_model: None,
            extraction_every: DEFAULT_EXTRACTION_EVERY,
            memory_half_life: DEFAULT_MEMORY_HALF_LIFE,
            memory_min_decay_micros: (DEFAULT_MEMORY_MIN_DECAY * 1e6) as u32,
            prompt_cache_key: true,
            cache_breakpoints: true,
            store_side_calls: false,
        }
    }
}

/// The kind of value a setting takes, which decides how it is parsed and described.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bool,
    /// An integer in `min..=max`.
    Integer {
        min: u64,
        max: u64,
    },
    /// An integer in `1..=max`, or `none` for unset.
    OptionalInteger {
        max: u64,
    },
    /// An integer in `0..=max`, or `auto` for the default another setting implies.
    IntegerOrAuto {
        max: u64,
    },
    /// An ISO-8601 duration such as `PT1H`.
    Duration,
    /// An ISO-8601 duration longer than zero, or `none` for unset.
    OptionalDuration,
    /// A model name, or `none` / empty for unset.
    OptionalName,
    /// `auto`, `none`, or a language name.
    Language,
    /// A number from 0 to 1.
    Fraction,
    /// An ISO-8601 duration longer than zero.
    PositiveDuration,
}

impl Kind {
    /// What the setting accepts, for error messages.
    pub fn describe(self) -> String {
        match self {
            Kind::Bool => "`true` or `false` (also `on` or `off`)".to_string(),
            Kind::Integer { min, max } => format!("an integer from {min} to {max}"),
            Kind::OptionalInteger { max } => format!("an integer from 1 to {max}, or `none`"),
            Kind::IntegerOrAuto { max } => format!("an integer from 0 to {max}, or `auto`"),
            Kind::Duration => "an ISO-8601 duration such as `PT1H`, `PT30M` or `P1D`".to_string(),
            Kind::OptionalDuration => {
                "an ISO-8601 duration longer than zero such as `PT1H` or `P30D`, or `none`"
                    .to_string()
            }
            Kind::OptionalName => {
                "a model name (printable ASCII, at most 256 characters), or `none`".to_string()
            }
            Kind::Language => format!("one of {}", TextLanguage::accepted()),
            Kind::Fraction => "a number from 0 to 1 such as `0.2`".to_string(),
            Kind::PositiveDuration => {
                "an ISO-8601 duration longer than zero such as `P30D` or `PT12H`".to_string()
            }
        }
    }
}

/// Every setting, by its snake-case name (the config key; the header is `X-Memory-` + the
/// kebab-case form).
pub const SETTINGS: &[(&str, Kind)] = &[
    ("enabled", Kind::Bool),
    ("persist", Kind::Bool),
    (
        "recent_n",
        Kind::Integer {
            min: 0,
            max: MAX_RECENT_N as u64,
        },
    ),
    (
        "window_step",
        Kind::IntegerOrAuto {
            max: MAX_WINDOW_STEP as u64,
        },
    ),
    (
        "max_messages",
        Kind::Integer {
            min: 2,
            max: MAX_MAX_MESSAGES as u64,
        },
    ),
    ("relevance_enabled", Kind::Bool),
    (
        "relevance_top_k",
        Kind::Integer {
            min: 0,
            max: MAX_RELEVANCE_TOP_K as u64,
        },
    ),
    (
        "relevance_max_tokens",
        Kind::IntegerOrAuto { max: 1_000_000 },
    ),
    ("compression_enabled", Kind::Bool),
    (
        "compression_threshold_tokens",
        Kind::Integer {
            min: 1,
            max: 100_000_000,
        },
    ),
    ("compression_model", Kind::OptionalName),
    ("compression_interval", Kind::Duration),
    ("compression_async", Kind::Bool),
    (
        "max_context_tokens",
        Kind::OptionalInteger { max: 100_000_000 },
    ),
    ("relevance_language", Kind::Language),
    ("relevance_semantic", Kind::Bool),
    ("relevance_time", Kind::Bool),
    ("relevance_feedback", Kind::Bool),
    ("relevance_lexical_weight", Kind::Fraction),
    ("relevance_floor", Kind::Fraction),
    ("relevance_relative_floor", Kind::Fraction),
    ("ttl", Kind::OptionalDuration),
    ("long_term_enabled", Kind::Bool),
    (
        "long_term_top_k",
        Kind::Integer {
            min: 0,
            max: MAX_LONG_TERM_TOP_K as u64,
        },
    ),
    (
        "long_term_max_tokens",
        Kind::Integer {
            min: 0,
            max: 100_000,
        },
    ),
    ("extraction_model", Kind::OptionalName),
    (
        "extraction_every",
        Kind::Integer {
            min: 1,
            max: 10_000,
        },
    ),
    ("memory_half_life", Kind::PositiveDuration),
    ("memory_min_decay", Kind::Fraction),
    ("prompt_cache_key", Kind::Bool),
    ("cache_breakpoints", Kind::Bool),
    ("store_side_calls", Kind::Bool),
];

/// Looks a setting up by its snake-case name.
pub fn kind_of(name: &str) -> Option<Kind> {
    SETTINGS.iter().find(|(n, _)| *n == name).map(|(_, k)| *k)
}

/// A parsed setting value.
enum Value {
    Bool(bool),
    Integer(u64),
    OptionalInteger(Option<u64>),
    Duration(Duration),
    OptionalDuration(Option<Duration>),
    OptionalName(Option<String>),
    Language(TextLanguage),
    /// In millionths.
    Fraction(u32),
}

fn parse_value(kind: Kind, text: &str) -> Option<Value> {
    let text = text.trim();
    match kind {
        Kind::Bool => match text.to_ascii_lowercase().as_str() {
            "true" | "on" => Some(Value::Bool(true)),
            "false" | "off" => Some(Value::Bool(false)),
            _ => None,
        },
        Kind::Integer { min, max } => text
            .parse::<u64>()
            .ok()
            .filter(|n| (min..=max).contains(n))
            .map(Value::Integer),
        Kind::OptionalInteger { max } => {
            if text.eq_ignore_ascii_case("none") {
                return Some(Value::OptionalInteger(None));
            }
            text.parse::<u64>()
                .ok()
                .filter(|n| (1..=max).contains(n))
                .map(|n| Value::OptionalInteger(Some(n)))
        }
        Kind::IntegerOrAuto { max } => {
            if text.eq_ignore_ascii_case("auto") {
                return Some(Value::OptionalInteger(None));
            }
            text.parse::<u64>()
                .ok()
                .filter(|n| *n <= max)
                .map(|n| Value::OptionalInteger(Some(n)))
        }
        Kind::Duration => parse_iso8601_duration(text).map(Value::Duration),
        Kind::OptionalDuration => {
            if text.eq_ignore_ascii_case("none") {
                return Some(Value::OptionalDuration(None));
            }
            parse_iso8601_duration(text)
                .filter(|d| !d.is_zero())
                .map(|d| Value::OptionalDuration(Some(d)))
        }
        Kind::OptionalName => {
            if text.is_empty() || text.eq_ignore_ascii_case("none") {
                return Some(Value::OptionalName(None));
            }
            let printable = text.bytes().all(|b| (0x20..0x7f).contains(&b));
            (printable && text.len() <= 256).then(|| Value::OptionalName(Some(text.to_string())))
        }
        Kind::Language => TextLanguage::parse(text).map(Value::Language),
        Kind::Fraction => text
            .parse::<f64>()
            .ok()
            .filter(|f| (0.0..=1.0).contains(f))
            .map(|f| Value::Fraction((f * 1e6).round() as u32)),
        Kind::PositiveDuration => parse_iso8601_duration(text)
            .filter(|d| !d.is_zero())
            .map(Value::Duration),
    }
}

/// Why a setting could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SettingError {
    #[error("unknown setting `{0}`")]
    Unknown(String),
    #[error("`{name}` must be {expected}")]
    BadValue { name: String, expected: String },
}

impl MemorySettings {
    /// Sets the setting `name` from its text form (a header value, or a config value turned to
    /// text).
    pub fn apply(&mut self, name: &str, text: &str) -> Result<(), SettingError> {
        let kind = kind_of(name).ok_or_else(|| SettingError::Unknown(name.to_string()))?;
        let bad = || SettingError::BadValue {
            name: name.to_string(),
            expected: kind.describe(),
        };
        let value = parse_value(kind, text).ok_or_else(bad)?;
        match (name, value) {
            ("enabled", Value::Bool(b)) => self.enabled = b,
            ("persist", Value::Bool(b)) => self.persist = b,
            ("recent_n", Value::Integer(n)) => self.recent_n = n as usize,
            ("window_step", Value::OptionalInteger(n)) => self.window_step = n.map(|n| n as usize),
            ("max_messages", Value::Integer(n)) => self.max_messages = n as usize,
            ("relevance_enabled", Value::Bool(b)) => self.relevance_enabled = b,
            ("relevance_top_k", Value::Integer(n)) => self.relevance_top_k = n as usize,
            ("relevance_max_tokens", Value::OptionalInteger(n)) => self.relevance_max_tokens = n,
            ("compression_enabled", Value::Bool(b)) => self.compression_enabled = b,
            ("compression_threshold_tokens", Value::Integer(n)) => {
                self.compression_threshold_tokens = n
            }
            ("compression_model", Value::OptionalName(m)) => self.compression_model = m,
            ("compression_interval", Value::Duration(d)) => self.compression_interval = d,
            ("compression_async", Value::Bool(b)) => self.compression_async = b,
            ("max_context_tokens", Value::OptionalInteger(n)) => self.max_context_tokens = n,
            ("relevance_language", Value::Language(l)) => self.relevance_language = l,
            ("ttl", Value::OptionalDuration(d)) => self.ttl = d,
            ("long_term_enabled", Value::Bool(b)) => self.long_term_enabled = b,
            ("long_term_top_k", Value::Integer(n)) => self.long_term_top_k = n as usize,
            ("long_term_max_tokens", Value::Integer(n)) => self.long_term_max_tokens = n,
            ("extraction_model", Value::OptionalName(m)) => self.extraction_model = m,
            ("extraction_every", Value::Integer(n)) => self.extraction_every = n,
            ("memory_half_life", Value::Duration(d)) => self.memory_half_life = d,
            ("memory_min_decay", Value::Fraction(f)) => self.memory_min_decay_micros = f,
            ("relevance_semantic", Value::Bool(b)) => self.relevance_semantic = b,
            ("relevance_time", Value::Bool(b)) => self.relevance_time = b,
            ("relevance_feedback", Value::Bool(b)) => self.relevance_feedback = b,
            ("relevance_lexical_weight", Value::Fraction(f)) => {
                self.relevance_lexical_weight_micros = f
            }
            ("relevance_floor", Value::Fraction(f)) => self.relevance_floor_micros = f,
            ("relevance_relative_floor", Value::Fraction(f)) => {
                self.relevance_relative_floor_micros = f
            }
            ("prompt_cache_key", Value::Bool(b)) => self.prompt_cache_key = b,
            ("cache_breakpoints", Value::Bool(b)) => self.cache_breakpoints = b,
            ("store_side_calls", Value::Bool(b)) => self.store_side_calls = b,
            _ => return Err(bad()),
        }
        Ok(())
    }

    /// The settings as `(name, text)` pairs, in [`SETTINGS`] order, for `check-config` and the
    /// shipped config file.
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        let opt = |v: &Option<u64>| v.map_or("none".to_string(), |n| n.to_string());
        vec![
            ("enabled", self.enabled.to_string()),
            ("persist", self.persist.to_string()),
            ("recent_n", self.recent_n.to_string()),
            (
                "window_step",
                self.window_step
                    .map_or_else(|| "auto".to_string(), |n| n.to_string()),
            ),
            ("max_messages", self.max_messages.to_string()),
            ("relevance_enabled", self.relevance_enabled.to_string()),
            ("relevance_top_k", self.relevance_top_k.to_string()),
            (
                "relevance_max_tokens",
                self.relevance_max_tokens
                    .map_or_else(|| "auto".to_string(), |n| n.to_string()),
            ),
            ("compression_enabled", self.compression_enabled.to_string()),
            (
                "compression_threshold_tokens",
                self.compression_threshold_tokens.to_string(),
            ),
            (
                "compression_model",
                self.compression_model
                    .clone()
                    .unwrap_or_else(|| "none".into()),
            ),
            (
                "compression_interval",
                format_iso8601_duration(self.compression_interval),
            ),
            ("compression_async", self.compression_async.to_string()),
            ("max_context_tokens", opt(&self.max_context_tokens)),
            (
                "relevance_language",
                self.relevance_language.name().to_string(),
            ),
            ("relevance_semantic", self.relevance_semantic.to_string()),
            ("relevance_time", self.relevance_time.to_string()),
            ("relevance_feedback", self.relevance_feedback.to_string()),
            (
                "relevance_lexical_weight",
                (f64::from(self.relevance_lexical_weight_micros) / 1e6).to_string(),
            ),
            (
                "relevance_floor",
                (f64::from(self.relevance_floor_micros) / 1e6).to_string(),
            ),
            (
                "relevance_relative_floor",
                (f64::from(self.relevance_relative_floor_micros) / 1e6).to_string(),
            ),
            (
                "ttl",
                self.ttl
                    .map_or_else(|| "none".to_string(), format_iso8601_duration),
            ),
            ("long_term_enabled", self.long_term_enabled.to_string()),
            ("long_term_top_k", self.long_term_top_k.to_string()),
            (
                "long_term_max_tokens",
                self.long_term_max_tokens.to_string(),
            ),
            (
                "extraction_model",
                self.extraction_model
                    .clone()
                    .unwrap_or_else(|| "none".into()),
            ),
            ("extraction_every", self.extraction_every.to_string()),
            (
                "memory_half_life",
                format_iso8601_duration(self.memory_half_life),
            ),
            ("memory_min_decay", self.memory_min_decay().to_string()),
            ("prompt_cache_key", self.prompt_cache_key.to_string()),
            ("cache_breakpoints", self.cache_breakpoints.to_string()),
            ("store_side_calls", self.store_side_calls.to_string()),
        ]
    }
}

/// The header that sets `name`: `X-Memory-` + kebab case (`recent_n` → `x-memory-recent-n`).
pub fn header_name(name: &str) -> String {
    format!("x-memory-{}", name.replace('_', "-"))
}

/// The setting a lower-case `x-memory-*` header sets, if any.
pub fn setting_for_header(header: &str) -> Option<&'static str> {
    let rest = header.strip_prefix("x-memory-")?;
    let snake = rest.replace('-', "_");
    SETTINGS
        .iter()
        .find(|(n, _)| *n == snake)
        .map(|(name, _)| *name)
}

/// Parses an ISO-8601 duration: `P[nD]T[nH][nM][n[.f]S]`, also `PnW`. Years and months are
/// refused because their length is not fixed.
pub fn parse_iso8601_duration(text: &str) -> Option<Duration> {
    let rest = text.strip_prefix('P').or_else(|| text.strip_prefix('p'))?;
    if rest.is_empty() {
        return None;
    }
    let mut seconds: f64 = 0.0;
    let mut in_time = false;
    let mut number = String::new();
    let mut saw_unit = false;
    for c in rest.chars() {
        match c {
            '0'..='9' | '.' => number.push(c),
            'T' | 't' if !in_time && number.is_empty() => in_time = true,
            _ => {
                let value: f64 = number.parse().ok()?;
                number.clear();
                let unit = match (in_time, c.to_ascii_uppercase()) {
                    (false, 'W') => 7.0 * 86_400.0,
                    (false, 'D') => 86_400.0,
                    (true, 'H') => 3_600.0,
                    (true, 'M') => 60.0,
                    (true, 'S') => 1.0,
                    _ => return None,
                };
                seconds += value * unit;
                saw_unit = true;
            }
        }
    }
    if !number.is_empty() || !saw_unit || !seconds.is_finite() || seconds > 1e12 {
        return None;
    }
    Some(Duration::from_secs_f64(seconds))
}

/// Formats a duration as ISO-8601 (`PT3600S` style, shortened to the largest exact unit).
pub fn format_iso8601_duration(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_nanos() != 0 {
        return format!("PT{}S", d.as_secs_f64());
    }
    if secs == 0 {
        "PT0S".to_string()
    } else if secs.is_multiple_of(86_400) {
        format!("P{}D", secs / 86_400)
    } else if secs.is_multiple_of(3_600) {
        format!("PT{}H", secs / 3_600)
    } else if secs.is_multiple_of(60) {
        format!("PT{}M", secs / 60)
    } else {
        format!("PT{secs}S")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        let cases = [
            ("PT1H", Some(3600.0)),
            ("PT0S", Some(0.0)),
            ("PT30M", Some(1800.0)),
            ("P1D", Some(86400.0)),
            ("P1DT2H", Some(93600.0)),
            ("PT1.5S", Some(1.5)),
            ("P2W", Some(1_209_600.0)),
            ("P1M", None),
            ("PT", None),
            ("P", None),
            ("1H", None),
            ("PT1", None),
            ("PTH", None),
            ("PT1X", None),
        ];
        for (text, expected) in cases {
            let got = parse_iso8601_duration(text).map(|d| d.as_secs_f64());
            assert_eq!(got, expected, "{text}");
        }
    }

    #[test]
    fn durations_round_trip_through_format() {
        for secs in [0, 1, 59, 60, 3600, 5400, 86_400, 90_000] {
            let d = Duration::from_secs(secs);
            assert_eq!(parse_iso8601_duration(&format_iso8601_duration(d)), Some(d));
        }
    }

    #[test]
    fn apply_checks_every_kind() {
        let mut s = MemorySettings::default();
        s.apply("recent_n", "6").unwrap();
        assert_eq!(s.recent_n, 6);
        s.apply("persist", "FALSE").unwrap();
        assert!(!s.persist);
        s.apply("max_context_tokens", "4000").unwrap();
        assert_eq!(s.max_context_tokens, Some(4000));
        s.apply("max_context_tokens", "none").unwrap();
        assert_eq!(s.max_context_tokens, None);
        s.apply("compression_model", "gpt-4o-mini").unwrap();
        assert_eq!(s.compression_model.as_deref(), Some("gpt-4o-mini"));
        s.apply("compression_interval", "PT0S").unwrap();
        assert_eq!(s.compression_interval, Duration::ZERO);

        let err = s.apply("relevance_top_k", "21").unwrap_err();
        assert_eq!(
            err.to_string(),
            "`relevance_top_k` must be an integer from 0 to 20"
        );
        assert!(s.apply("persist", "yes").is_err());
        assert!(s.apply("recent_n", "-1").is_err());
        assert!(s.apply("max_context_tokens", "0").is_err());
        s.apply("memory_min_decay", "0.35").unwrap();
        assert!((s.memory_min_decay() - 0.35).abs() < 1e-9);
        assert!(s.apply("memory_min_decay", "1.5").is_err());
        assert!(s.apply("memory_min_decay", "-0.1").is_err());
        s.apply("memory_half_life", "P7D").unwrap();
        assert_eq!(s.memory_half_life, Duration::from_secs(7 * 86_400));
        assert!(s.apply("memory_half_life", "PT0S").is_err());
        assert!(s.apply("extraction_every", "0").is_err());
        s.apply("window_step", "0").unwrap();
        assert_eq!(s.window_step, Some(0));
        s.apply("window_step", "AUTO").unwrap();
        assert_eq!(s.window_step, None);
        s.apply("relevance_max_tokens", "0").unwrap();
        assert_eq!(s.relevance_budget(), None);
        s.apply("relevance_max_tokens", "auto").unwrap();
        assert_eq!(s.relevance_budget(), Some(100 * s.relevance_top_k as u64));
        s.apply("relevance_max_tokens", "300").unwrap();
        assert_eq!(s.relevance_budget(), Some(300));
        assert!(s.apply("relevance_max_tokens", "-3").is_err());
        let err = s.apply("window_step", "-1").unwrap_err();
        assert_eq!(
            err.to_string(),
            "`window_step` must be an integer from 0 to 10000, or `auto`"
        );
        assert!(s.apply("window_step", "10001").is_err());
        assert!(s.apply("window_step", "none").is_err());
        s.apply("prompt_cache_key", "off").unwrap();
        assert!(!s.prompt_cache_key);
        s.apply("prompt_cache_key", "On").unwrap();
        assert!(s.prompt_cache_key);
        assert!(s.apply("prompt_cache_key", "maybe").is_err());
        s.apply("extraction_model", "gpt-4o-mini").unwrap();
        assert_eq!(s.extraction_model.as_deref(), Some("gpt-4o-mini"));
        assert_eq!(
            s.apply("nope", "1"),
            Err(SettingError::Unknown("nope".into()))
        );
    }

    #[test]
    fn header_names_map_both_ways() {
        for (name, _) in SETTINGS {
            assert_eq!(setting_for_header(&header_name(name)), Some(*name));
        }
        assert_eq!(header_name("recent_n"), "x-memory-recent-n");
        assert_eq!(setting_for_header("x-memory-conversation-id"), None);
    }

    #[test]
    fn describe_lists_every_setting_and_reapplies() {
        let defaults = MemorySettings::default();
        let described = defaults.describe();
        assert_eq!(described.len(), SETTINGS.len());
        let mut copy = MemorySettings {
            recent_n: 99,
            ..MemorySettings::default()
        };
        for (name, text) in described {
            copy.apply(name, &text).unwrap();
        }
        assert_eq!(copy, defaults);
    }
}
