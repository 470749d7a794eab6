//! Token counting with tiktoken: the encoding chosen by model, `o200k_base` when the model is
//! unknown. A message is counted once, when it is stored; nothing on the request path counts a
//! stored message again.
//!
//! `o200k_base` (the default, and every recent OpenAI model's) is held compact (`lean.rs`,
//! 4.7 MiB of heap instead of tiktoken-rs's 40); the other encodings are tiktoken-rs's own,
//! loaded the first time a model needs one.

mod lean;

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use tiktoken_rs::tokenizer::{Tokenizer, get_tokenizer};
use tiktoken_rs::{CoreBPE, Rank};

pub use lean::Lean;

/// Ranks `o200k_base` uses, its special tokens' included (`<|endofprompt|>` is 200018).
const O200K_RANKS: u32 = 200_019;

/// Set once the default encoder is loaded (by [`warm`] or by a first count).
static WARM: AtomicBool = AtomicBool::new(false);

/// Loads the default encoder (`o200k_base`, a few hundred milliseconds): the server does it at
/// start, before `/readyz` answers ready, so no request pays for it.
pub fn warm() {
    let _ = encoder(None).count("warm");
    WARM.store(true, Ordering::Release);
}

/// True once the default encoder is loaded.
pub fn is_warm() -> bool {
    WARM.load(Ordering::Acquire)
}

/// Tokens added per message for the role and separators (OpenAI's chat format uses 3–4).
pub const MESSAGE_OVERHEAD_TOKENS: u32 = 4;

/// An encoding: `o200k_base` compact, or one of tiktoken-rs's.
#[derive(Clone, Copy)]
enum Encoder {
    Lean(&'static Lean),
    Core(&'static CoreBPE),
}

impl Encoder {
    fn encode(self, text: &str) -> Vec<Rank> {
        match self {
            Encoder::Lean(lean) => lean.encode(text),
            Encoder::Core(core) => core.encode_with_special_tokens(text),
        }
    }

    fn count(self, text: &str) -> usize {
        match self {
            Encoder::Lean(lean) => lean.count(text),
            Encoder::Core(core) => core.encode_with_special_tokens(text).len(),
        }
    }

    fn decode(self, tokens: &[Rank]) -> Option<String> {
        match self {
            Encoder::Lean(lean) => lean.decode(tokens).ok(),
            Encoder::Core(core) => core.decode(tokens).ok(),
        }
    }

    /// Tells encodings apart (a cache key).
    fn id(self) -> usize {
        match self {
            Encoder::Lean(lean) => lean as *const Lean as usize,
            Encoder::Core(core) => core as *const CoreBPE as usize,
        }
    }
}

/// `o200k_base`, compact: built once from tiktoken-rs's (which is then dropped); tiktoken-rs's
/// own if that fails (it cannot with the encoding tiktoken-rs ships, but nothing here panics).
fn o200k() -> Encoder {
    static LEAN: OnceLock<Option<Lean>> = OnceLock::new();
    let lean = LEAN.get_or_init(|| {
        let core = tiktoken_rs::o200k_base().ok()?;
        Lean::from_core(&core, O200K_RANKS, tiktoken_rs::O200K_BASE_PAT_STR).ok()
    });
    match lean {
        Some(lean) => Encoder::Lean(lean),
        None => Encoder::Core(tiktoken_rs::o200k_base_singleton()),
    }
}

/// The encoder for `model`; the encoders are built once per process and shared.
fn encoder(model: Option<&str>) -> Encoder {
    encoder_of(model.and_then(get_tokenizer))
}

/// The encoder of a tokenizer (`None`: the default, `o200k_base`).
fn encoder_of(tokenizer: Option<Tokenizer>) -> Encoder {
    match tokenizer {
        Some(Tokenizer::Cl100kBase) => Encoder::Core(tiktoken_rs::cl100k_base_singleton()),
        Some(Tokenizer::P50kBase) => Encoder::Core(tiktoken_rs::p50k_base_singleton()),
        Some(Tokenizer::R50kBase | Tokenizer::Gpt2) => {
            Encoder::Core(tiktoken_rs::r50k_base_singleton())
        }
        Some(Tokenizer::P50kEdit) => Encoder::Core(tiktoken_rs::p50k_edit_singleton()),
        Some(Tokenizer::O200kHarmony) => Encoder::Core(tiktoken_rs::o200k_harmony_singleton()),
        Some(Tokenizer::O200kBase) | None => o200k(),
    }
}

/// Tokens of `text` under the encoding of `model`.
pub fn count_text(model: Option<&str>, text: &str) -> u32 {
    if text.is_empty() {
        return 0;
    }
    let tokenizer = model.and_then(get_tokenizer);
    let n = encoder_of(tokenizer).count(text);
    // The first count with the default encoder loaded it: say so once (one model lookup per
    // count, and no shared write once warm).
    if !WARM.load(Ordering::Relaxed) && matches!(tokenizer, Some(Tokenizer::O200kBase) | None) {
        WARM.store(true, Ordering::Release);
    }
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Tokens of a message whose text is `text`, including the per-message overhead.
pub fn count_message(model: Option<&str>, text: &str) -> u32 {
    count_text(model, text).saturating_add(MESSAGE_OVERHEAD_TOKENS)
}

/// The end of `text` that fits in `max_tokens`, cut at a token boundary.
pub fn keep_last_tokens(model: Option<&str>, text: &str, max_tokens: usize) -> String {
    let bpe = encoder(model);
    let tokens = bpe.encode(text);
    if tokens.len() <= max_tokens {
        return text.to_string();
    }
    // A cut inside a multi-byte character does not decode: move it a token later.
    for skip in 0..4 {
        let start = tokens.len() - max_tokens.saturating_sub(skip);
        if let Some(kept) = bpe.decode(&tokens[start..]) {
            return kept;
        }
    }
    String::new()
}

/// Token counts of instruction messages, which are re-sent with every request but never
/// stored: counted once per distinct message and encoding, then looked up.
/// `text` is only called on a miss, so a repeated system prompt is neither parsed nor encoded.
pub fn count_cached(model: Option<&str>, fingerprint: u64, text: impl FnOnce() -> String) -> u32 {
    use std::sync::OnceLock;
    static CACHE: OnceLock<moka::sync::Cache<(u64, usize), u32>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| moka::sync::Cache::new(16_384));
    let encoding = encoder(model).id();
    let key = (fingerprint, encoding);
    if let Some(count) = cache.get(&key) {
        return count;
    }
    let count = count_message(model, &text());
    cache.insert(key, count);
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_model_encoding() {
        assert_eq!(count_text(None, ""), 0);
        assert_eq!(count_text(Some("gpt-4o"), "hello world"), 2);
        assert_eq!(count_text(Some("gpt-4"), "hello world"), 2);
        // Unknown models fall back to o200k_base.
        assert_eq!(
            count_text(Some("llama-3-70b"), "tokenization"),
            count_text(Some("gpt-4o"), "tokenization")
        );
        assert_eq!(count_message(None, "hi"), 1 + MESSAGE_OVERHEAD_TOKENS);
    }

    #[test]
    fn warming_loads_the_default_encoder() {
        warm();
        assert!(is_warm());
    }

    #[test]
    fn keeping_the_end_cuts_at_a_token_boundary() {
        let text = "one two three four five six seven";
        let kept = keep_last_tokens(None, text, 3);
        assert_eq!(kept, " five six seven");
        assert_eq!(keep_last_tokens(None, "short", 10), "short");
        let chinese = keep_last_tokens(None, "我的猫叫小白我的狗叫大黄", 4);
        assert!("我的猫叫小白我的狗叫大黄".ends_with(&chinese) && !chinese.is_empty());
        assert_eq!(
            count_cached(None, 7, || "hello world".to_string()),
            count_message(None, "hello world")
        );
    }
}
