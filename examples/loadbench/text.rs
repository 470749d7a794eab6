//! The synthetic text of the benchmark's messages: sentences of words from `words.txt`, drawn
//! with a seeded generator so that every run sends the same text.

use std::sync::LazyLock;

use crate::rng::Rng;

/// The words of the benchmark's text, one a line in `words.txt`; common words appear more than
/// once, so they are drawn more often.
static WORDS: LazyLock<Vec<&'static str>> =
    LazyLock::new(|| include_str!("words.txt").lines().collect());

/// About 20 words (16 to 24) from [`WORDS`], as a sentence.
pub fn sentence(rng: &mut Rng) -> String {
    let count = 16 + rng.below(9);
    let mut text = String::with_capacity(count * 8);
    for i in 0..count {
        let word = *rng.pick(&WORDS);
        if i == 0 {
            let mut chars = word.chars();
            if let Some(first) = chars.next() {
                text.extend(first.to_uppercase());
                text.push_str(chars.as_str());
            }
        } else {
            text.push(' ');
            text.push_str(word);
        }
    }
    text.push('.');
    text
}

/// FNV-1a of `text`: a conversation's seed, so its pre-filled text follows from its name.
pub fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}
