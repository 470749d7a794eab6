//! `o200k_base`, the default encoding, held in a tenth of the memory tiktoken-rs's `CoreBPE`
//! takes, and encoding exactly as it does.
//!
//! tiktoken-rs's `CoreBPE` for `o200k_base` keeps each of its 200,000 tokens three times, each
//! copy a heap allocation of its own (the encoder's keys, the decoder's values, a sorted list
//! used only for completions), plus 128 clones of its regular expressions: 40 MiB in use
//! (`mallinfo2`), a third of a 128 MiB sidecar. [`Lean`] is built from that `CoreBPE` once, at
//! start (the rank of every token read back with `decode_bytes`), which is then dropped: the
//! tokens' bytes in one buffer, an offset per rank, and an open-addressed table of ranks
//! (4.7 MiB of heap in use, measured). Encoding is tiktoken's, ported: the same pattern
//! (`O200K_BASE_PAT_STR`, with `fancy_regex` as tiktoken-rs uses it), the same merges (its
//! `_byte_pair_merge` and, for pieces of 100 bytes or more, `_byte_pair_merge_large`), special
//! tokens found in the text as `encode_with_special_tokens` finds them. The tests compare both
//! on thousands of texts of every kind.

use std::cell::RefCell;
use std::collections::BinaryHeap;

use fancy_regex::Regex;
use tiktoken_rs::{CoreBPE, Rank};

/// The encoding, compact.
pub struct Lean {
    /// Every token's bytes, in rank order.
    bytes: Vec<u8>,
    /// Rank `r`'s bytes are `bytes[starts[r]..starts[r + 1]]` (empty for a rank the encoding
    /// does not use).
    starts: Vec<u32>,
    /// Open addressing by a hash of a token's bytes: its rank + 1, or 0 for an empty slot.
    slots: Vec<u32>,
    /// The special tokens and their ranks, longest first (the first found at a position wins,
    /// as with tiktoken's alternation of them).
    specials: Vec<(String, Rank)>,
    /// The pattern that splits text into pieces.
    pattern: Regex,
    /// The pattern is `o200k_base`'s: text that is all ASCII is split by [`ascii_pieces`].
    o200k: bool,
}

impl std::fmt::Debug for Lean {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lean")
            .field("tokens", &(self.starts.len() - 1))
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// Each thread's own clone of the pattern, with the address of the [`Lean`] it is of: a
    /// `fancy_regex` match takes scratch space from a pool shared by the clones' users
    /// (tiktoken keeps a clone per thread for the same reason). Freed with the thread.
    static PATTERN: RefCell<Option<(usize, Regex)>> = const { RefCell::new(None) };
}

/// FNV-1a over a token's bytes (tokens are short).
fn hash(piece: &[u8]) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in piece {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h as usize
}

impl Lean {
    /// Reads `bpe`'s tokens (ranks below `ranks`) and special tokens; `pattern` is the regular
    /// expression it was made with.
    pub fn from_core(bpe: &CoreBPE, ranks: u32, pattern: &str) -> Result<Lean, fancy_regex::Error> {
        let mut specials: Vec<(String, Rank)> = bpe
            .special_tokens()
            .into_iter()
            .filter_map(|s| match bpe.encode_with_special_tokens(s).as_slice() {
                [rank] => Some((s.to_string(), *rank)),
                _ => None,
            })
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.0.cmp(&b.0)));
        let special_ranks: Vec<Rank> = specials.iter().map(|(_, r)| *r).collect();
        let mut bytes = Vec::new();
        let mut starts = Vec::with_capacity(ranks as usize + 1);
        for rank in 0..ranks {
            starts.push(bytes.len() as u32);
            if special_ranks.contains(&rank) {
                continue;
            }
            if let Ok(token) = bpe.decode_bytes(&[rank]) {
                bytes.extend_from_slice(&token);
            }
        }
        starts.push(bytes.len() as u32);
        bytes.shrink_to_fit();
        let size = (ranks as usize * 2).next_power_of_two();
        let mut lean = Lean {
            bytes,
            starts,
            slots: vec![0; size],
            specials,
            pattern: Regex::new(pattern)?,
            o200k: pattern == tiktoken_rs::O200K_BASE_PAT_STR,
        };
        for rank in 0..ranks {
            let token = lean.token(rank);
            if token.is_empty() || lean.rank(token).is_some() {
                continue;
            }
            let mut at = hash(token) & (size - 1);
            while lean.slots[at] != 0 {
                at = (at + 1) & (size - 1);
            }
            lean.slots[at] = rank + 1;
        }
        Ok(lean)
    }

    /// Heap bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity() + 4 * self.starts.capacity() + 4 * self.slots.capacity()
    }

    fn token(&self, rank: Rank) -> &[u8] {
        let r = rank as usize;
        match (self.starts.get(r), self.starts.get(r + 1)) {
            (Some(&from), Some(&to)) => &self.bytes[from as usize..to as usize],
            _ => &[],
        }
    }

    /// The rank of the token whose bytes are `piece`.
    fn rank(&self, piece: &[u8]) -> Option<Rank> {
        let mask = self.slots.len() - 1;
        let mut at = hash(piece) & mask;
        loop {
            match self.slots[at] {
                0 => return None,
                slot if self.token(slot - 1) == piece => return Some(slot - 1),
                _ => at = (at + 1) & mask,
            }
        }
    }

    /// The tokens of `text`, special tokens in it included (tiktoken's
    /// `encode_with_special_tokens`).
    pub fn encode(&self, text: &str) -> Vec<Rank> {
        let mut out = Vec::new();
        self.each_token(text, |rank| out.push(rank));
        out
    }

    /// How many tokens [`Lean::encode`] would give.
    pub fn count(&self, text: &str) -> usize {
        let mut n = 0;
        self.each_token(text, |_| n += 1);
        n
    }

    /// The text of `tokens`; an error when they cut a character.
    pub fn decode(&self, tokens: &[Rank]) -> Result<String, std::string::FromUtf8Error> {
        let mut bytes = Vec::new();
        for &rank in tokens {
            match self.specials.iter().find(|(_, r)| *r == rank) {
                Some((special, _)) => bytes.extend_from_slice(special.as_bytes()),
                None => bytes.extend_from_slice(self.token(rank)),
            }
        }
        String::from_utf8(bytes)
    }

    fn each_token(&self, text: &str, mut emit: impl FnMut(Rank)) {
        let mut start = 0;
        while start <= text.len() {
            let next = self.next_special(text, start);
            let end = next.map_or(text.len(), |(at, _, _)| at);
            self.ordinary(&text[start..end], &mut emit);
            match next {
                Some((at, len, rank)) => {
                    emit(rank);
                    start = at + len;
                }
                None => break,
            }
        }
    }

    /// The first special token in `text` from `from`: (position, length, rank).
    fn next_special(&self, text: &str, from: usize) -> Option<(usize, usize, Rank)> {
        let rest = &text[from..];
        let mut best: Option<(usize, usize, Rank)> = None;
        for (special, rank) in &self.specials {
            if let Some(at) = rest.find(special.as_str())
                && best.is_none_or(|(b, _, _)| at < b)
            {
                best = Some((at, special.len(), *rank));
            }
        }
        best.map(|(at, len, rank)| (from + at, len, rank))
    }

    /// tiktoken's ordinary encoding of `text` (no special tokens in it).
    fn ordinary(&self, text: &str, emit: &mut impl FnMut(Rank)) {
        if text.is_empty() {
            return;
        }
        if self.o200k && text.is_ascii() {
            let bytes = text.as_bytes();
            ascii_pieces(bytes, |from, to| self.piece(&bytes[from..to], emit));
            return;
        }
        PATTERN.with(|cell| {
            let mut held = cell.borrow_mut();
            let mine = self as *const Lean as usize;
            if held.as_ref().is_none_or(|(of, _)| *of != mine) {
                *held = Some((mine, self.pattern.clone()));
            }
            let Some((_, pattern)) = held.as_ref() else {
                return;
            };
            let mut done = 0;
            for found in pattern.find_iter(text) {
                match found {
                    Ok(m) => {
                        self.piece(m.as_str().as_bytes(), emit);
                        done = m.end();
                    }
                    // The backtracking limit (tiktoken panics here): what is left is merged
                    // as one piece, so every byte is still counted.
                    Err(_) => {
                        self.piece(&text.as_bytes()[done..], emit);
                        return;
                    }
                }
            }
        });
    }

    fn piece(&self, piece: &[u8], emit: &mut impl FnMut(Rank)) {
        if piece.is_empty() {
            return;
        }
        if let Some(rank) = self.rank(piece) {
            emit(rank);
        } else if piece.len() < 100 {
            let parts = self.merge(piece);
            for pair in parts.windows(2) {
                emit(self.must(&piece[pair[0].0..pair[1].0]));
            }
        } else {
            self.merge_large(piece, emit);
        }
    }

    /// A piece the merges made is a token (every byte is one, and every merge made one).
    fn must(&self, piece: &[u8]) -> Rank {
        self.rank(piece).unwrap_or(Rank::MAX)
    }

    /// tiktoken's `_byte_pair_merge`: (start, rank of the pair starting there).
    fn merge(&self, piece: &[u8]) -> Vec<(usize, Rank)> {
        let rank_of = |bytes: &[u8]| self.rank(bytes).unwrap_or(Rank::MAX);
        let mut parts = Vec::with_capacity(piece.len() + 1);
        let mut min_rank: (Rank, usize) = (Rank::MAX, usize::MAX);
        for i in 0..piece.len() - 1 {
            let rank = rank_of(&piece[i..i + 2]);
            if rank < min_rank.0 {
                min_rank = (rank, i);
            }
            parts.push((i, rank));
        }
        parts.push((piece.len() - 1, Rank::MAX));
        parts.push((piece.len(), Rank::MAX));
        let get_rank = |parts: &Vec<(usize, Rank)>, i: usize| {
            if (i + 3) < parts.len() {
                rank_of(&piece[parts[i].0..parts[i + 3].0])
            } else {
                Rank::MAX
            }
        };
        while min_rank.0 != Rank::MAX {
            let i = min_rank.1;
            if i > 0 {
                parts[i - 1].1 = get_rank(&parts, i - 1);
            }
            parts[i].1 = get_rank(&parts, i);
            parts.remove(i + 1);
            min_rank = (Rank::MAX, usize::MAX);
            for (i, &(_, rank)) in parts[..parts.len() - 1].iter().enumerate() {
                if rank < min_rank.0 {
                    min_rank = (rank, i);
                }
            }
        }
        parts
    }

    /// tiktoken's `_byte_pair_merge_large`: the same merges with a heap, for long pieces.
    fn merge_large(&self, piece: &[u8], emit: &mut impl FnMut(Rank)) {
        let mut state = Vec::with_capacity(piece.len());
        state.push(State {
            prev: usize::MAX,
            end: 1,
            next_end: 2,
            next_rank: Rank::MAX,
            cur_rank: Rank::MAX,
        });
        let mut heap = BinaryHeap::with_capacity(piece.len());
        for i in 0..piece.len() - 1 {
            if let Some(rank) = self.rank(&piece[i..i + 2]) {
                heap.push(Merge { start: i, rank });
                state[i].next_rank = rank;
            }
            state.push(State {
                prev: i,
                end: i + 2,
                next_end: i + 3,
                next_rank: Rank::MAX,
                cur_rank: Rank::MAX,
            });
        }
        let potential_merge = |state: &mut Vec<State>,
                               heap: &mut BinaryHeap<Merge>,
                               start: usize,
                               next_end: usize| {
            state[start].next_end = next_end;
            state[start].next_rank = Rank::MAX;
            if next_end <= piece.len()
                && let Some(rank) = self.rank(&piece[start..next_end])
            {
                heap.push(Merge { start, rank });
                state[start].next_rank = rank;
            }
        };
        while let Some(left) = heap.pop() {
            if left.rank == Rank::MAX {
                break;
            }
            if left.rank != state[left.start].next_rank {
                continue;
            }
            let left_start = left.start;
            let right_start = state[left_start].end;
            let right_end = state[left_start].next_end;
            let right_next_end = state[right_start].next_end;
            state[left_start].cur_rank = state[left_start].next_rank;
            state[left_start].end = right_end;
            potential_merge(&mut state, &mut heap, left_start, right_next_end);
            if right_end < state.len() {
                state[right_end].prev = left_start;
            }
            if left_start > 0 {
                let prev_start = state[left_start].prev;
                potential_merge(&mut state, &mut heap, prev_start, right_end);
            }
            state[right_start].next_rank = Rank::MAX;
        }
        let mut i = 0;
        while i < state.len() {
            if state[i].cur_rank == Rank::MAX {
                emit(self.must(&piece[i..state[i].end]));
            } else {
                emit(state[i].cur_rank);
            }
            i = state[i].end;
        }
    }
}

#[derive(Eq, PartialEq, Clone, Copy)]
struct Merge {
    start: usize,
    rank: Rank,
}

impl Ord for Merge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.start.cmp(&self.start))
    }
}

impl PartialOrd for Merge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

struct State {
    prev: usize,
    end: usize,
    next_end: usize,
    next_rank: Rank,
    cur_rank: Rank,
}

/// `o200k_base`'s pattern (`tiktoken_rs::O200K_BASE_PAT_STR`) over text that is all ASCII,
/// without the regular expression: calls `piece(start, end)` for each match, in order, exactly
/// as `fancy_regex`'s leftmost-first search of the pattern finds them. In ASCII the pattern's
/// classes are plain: letters are `A-Z` (upper) and `a-z` (lower), numbers `0-9`, `\s` is
/// `\t \n \x0b \x0c \r` and space. Its alternatives, tried in order at each position:
///
/// 1. `[^\r\n\p{L}\p{N}]?[upper]*[lower]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
/// 2. `[^\r\n\p{L}\p{N}]?[upper]+[lower]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?`
/// 3. `\p{N}{1,3}`
/// 4. ` ?[^\s\p{L}\p{N}]+[\r\n/]*`
/// 5. `\s*[\r\n]+`
/// 6. `\s+(?!\S)`
/// 7. `\s+`
///
/// Backtracking changes none of them in ASCII: upper and lower letters are apart, so 1 and 2
/// are greedy runs; 5 ends after the last `\r` or `\n` of the whitespace run; 6 is the run
/// less its last character unless the run ends the text.
fn ascii_pieces(text: &[u8], mut piece: impl FnMut(usize, usize)) {
    let upper = |b: u8| b.is_ascii_uppercase();
    let lower = |b: u8| b.is_ascii_lowercase();
    let space = |b: u8| matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ');
    let newline = |b: u8| b == b'\r' || b == b'\n';
    // `[^\r\n\p{L}\p{N}]`: the prefix of the letter alternatives.
    let prefix = |b: u8| !newline(b) && !b.is_ascii_alphanumeric();
    let len = text.len();
    let at = |i: usize| text.get(i).copied();
    let run = |from: usize, class: &dyn Fn(u8) -> bool| {
        let mut i = from;
        while i < len && class(text[i]) {
            i += 1;
        }
        i
    };
    // `(?i:'s|'t|'re|'ve|'m|'ll|'d)?` at `i`: where the match ends.
    let contraction = |i: usize| {
        if at(i) != Some(b'\'') {
            return i;
        }
        match at(i + 1).map(|b| b.to_ascii_lowercase()) {
            Some(b's' | b't' | b'm' | b'd') => i + 2,
            Some(b'r') if at(i + 2).map(|b| b.to_ascii_lowercase()) == Some(b'e') => i + 3,
            Some(b'v') if at(i + 2).map(|b| b.to_ascii_lowercase()) == Some(b'e') => i + 3,
            Some(b'l') if at(i + 2).map(|b| b.to_ascii_lowercase()) == Some(b'l') => i + 3,
            _ => i,
        }
    };
    let mut start = 0;
    while start < len {
        let b = text[start];
        // 1 and 2: an optional prefix, then letters.
        let letters = if prefix(b) && at(start + 1).is_some_and(|c| c.is_ascii_alphabetic()) {
            start + 1
        } else {
            start
        };
        if at(letters).is_some_and(|c| c.is_ascii_alphabetic()) {
            let uppers = run(letters, &upper);
            let lowers = run(uppers, &lower);
            // 1 needs a lower letter after the upper ones; 2 takes the upper ones and any lower.
            let end = contraction(lowers);
            piece(start, end);
            start = end;
            continue;
        }
        // 3: up to three digits.
        if b.is_ascii_digit() {
            let mut end = start + 1;
            while end < len && end - start < 3 && text[end].is_ascii_digit() {
                end += 1;
            }
            piece(start, end);
            start = end;
            continue;
        }
        // 4: an optional space, then what is neither space, letter nor digit, then any `\r`,
        // `\n` and `/`.
        let symbol = |c: u8| !space(c) && !c.is_ascii_alphanumeric();
        let symbols = if b == b' ' { start + 1 } else { start };
        if at(symbols).is_some_and(symbol) {
            let end = run(run(symbols, &symbol), &|c: u8| newline(c) || c == b'/');
            piece(start, end);
            start = end;
            continue;
        }
        // 5, 6, 7: a run of whitespace.
        let end = run(start, &space);
        if let Some(last) = (start..end).rev().find(|&i| newline(text[i])) {
            piece(start, last + 1);
            start = last + 1;
        } else if end == len || end - start == 1 {
            piece(start, end);
            start = end;
        } else {
            piece(start, end - 1);
            start = end - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lean() -> &'static Lean {
        static LEAN: std::sync::OnceLock<Lean> = std::sync::OnceLock::new();
        LEAN.get_or_init(|| {
            let core = tiktoken_rs::o200k_base().unwrap();
            Lean::from_core(
                &core,
                super::super::O200K_RANKS,
                tiktoken_rs::O200K_BASE_PAT_STR,
            )
            .unwrap()
        })
    }

    /// Pieces of text of every kind the pattern and the merges treat apart.
    const FRAGMENTS: &[&str] = &[
        "hello",
        "Hello",
        "HELLO",
        "world",
        " the",
        "don't",
        "I'm",
        "they're",
        "we've",
        "it'll",
        "He'd",
        "JSON",
        "camelCaseName",
        "snake_case_name",
        "x",
        "a",
        "7",
        "42",
        "2023",
        "3.14159",
        "1,000,000",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\r\n",
        "\n\n",
        " \n",
        "  \n\n",
        ".",
        ",",
        "!",
        "?",
        "...",
        "—",
        "–",
        "\"",
        "'",
        "(",
        ")",
        "{",
        "}",
        "[",
        "]",
        "<",
        ">",
        "</div>",
        "=>",
        "->",
        "::",
        "#",
        "//",
        "/*",
        "*/",
        "@",
        "$",
        "%",
        "^",
        "&&",
        "||",
        "~",
        "`",
        "```rust",
        "é",
        "café",
        "naïve",
        "Straße",
        "Zürich",
        "façade",
        "Ærøskøbing",
        "привет",
        "Москва",
        "你好",
        "我的猫叫小白",
        "東京",
        "こんにちは",
        "カタカナ",
        "안녕하세요",
        "مرحبا",
        "שלום",
        "नमस्ते",
        "हिन्दी",
        "ไทย",
        "Ελληνικά",
        "😀",
        "👍🏽",
        "👨‍👩‍👧‍👦",
        "🇫🇷",
        "™",
        "©",
        "\u{200b}",
        "\u{feff}",
        "\u{301}",
        "e\u{301}",
        "ǅ",
        "ǈ",
        "İ",
        "ﬁ",
        "½",
        "²",
        "٣",
        "३",
        "<|endoftext|>",
        "<|endofprompt|>",
        "<|endoftext",
        "|>",
        "<|",
        "<|fim_prefix|>",
        "def f(x):\n    return x ** 2\n",
        "fn main() { println!(\"hi\"); }",
        "https://example.com/a/b?c=d&e=f",
        "user@example.com",
        "0xdeadbeef",
        "1e-9",
        "SGVsbG8gd29ybGQhIFRoaXMgaXMgYmFzZTY0IGVuY29kZWQgdGV4dC4=",
    ];

    /// A small deterministic generator (xorshift), so a failure names its seed.
    fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut state = seed | 1;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    /// Texts of every kind, from `seed`.
    fn texts(seed: u64, count: usize) -> Vec<String> {
        let mut next = xorshift(seed);
        (0..count)
            .map(|_| {
                let parts = 1 + next() % 24;
                let mut text = String::new();
                for _ in 0..parts {
                    let roll = next() % 100;
                    if roll < 3 {
                        // A long run without spaces: pieces of 100 bytes or more take the heap
                        // merge.
                        let unit = FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize];
                        let times = 20 + next() % 200;
                        for _ in 0..times {
                            text.push_str(unit.trim());
                        }
                    } else if roll < 6 {
                        // Random bytes of the ASCII range, control characters included.
                        for _ in 0..(next() % 40) {
                            text.push(char::from((next() % 128) as u8));
                        }
                    } else {
                        text.push_str(FRAGMENTS[(next() % FRAGMENTS.len() as u64) as usize]);
                        if next().is_multiple_of(3) {
                            text.push(' ');
                        }
                    }
                }
                text
            })
            .collect()
    }

    fn assert_same(text: &str) {
        let core = tiktoken_rs::o200k_base_singleton();
        let expected = core.encode_with_special_tokens(text);
        let lean = lean();
        assert_eq!(lean.encode(text), expected, "{text:?}");
        assert_eq!(lean.count(text), expected.len(), "{text:?}");
        assert_eq!(
            lean.decode(&expected).ok().as_deref(),
            Some(text),
            "{text:?}"
        );
    }

    #[test]
    fn encodes_as_tiktoken_does_on_texts_of_every_kind() {
        for seed in 1..=4 {
            for text in texts(seed * 7919, 1000) {
                assert_same(&text);
            }
        }
        for fragment in FRAGMENTS {
            assert_same(fragment);
        }
        assert_same("");
        assert_same(&"a".repeat(5000));
        assert_same(&"👍".repeat(300));
    }

    #[test]
    fn encodes_as_tiktoken_does_on_prose_and_code() {
        for text in [
            include_str!("../../../../README.md"),
            include_str!("../../../../ARCHITECTURE.md"),
            include_str!("lean.rs"),
        ] {
            assert_same(text);
            for line in text.lines() {
                assert_same(line);
            }
        }
    }

    /// The pieces the pattern finds in `text`, as `fancy_regex` finds them.
    fn pattern_pieces(text: &str) -> Vec<(usize, usize)> {
        lean()
            .pattern
            .find_iter(text)
            .map(|m| {
                let m = m.unwrap();
                (m.start(), m.end())
            })
            .collect()
    }

    #[test]
    fn ascii_text_is_split_as_the_pattern_splits_it() {
        // An alphabet weighted to what the pattern treats apart: both cases, the contractions'
        // letters after an apostrophe, digits, every kind of ASCII whitespace, `/` and other
        // symbols; then any ASCII byte.
        const ALPHABET: &[u8] =
            b"aAbZzsStTrReEvVmMlLdD''''0123456789    \t\t\n\n\r\x0b\x0c//.,!-_(){}";
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
        for case in 0..20_000 {
            let len = (next() % 48) as usize;
            let text: String = (0..len)
                .map(|_| {
                    if case % 4 == 3 {
                        char::from((next() % 128) as u8)
                    } else {
                        char::from(ALPHABET[(next() % ALPHABET.len() as u64) as usize])
                    }
                })
                .collect();
            let mut pieces = Vec::new();
            ascii_pieces(text.as_bytes(), |from, to| pieces.push((from, to)));
            assert_eq!(pieces, pattern_pieces(&text), "{text:?}");
        }
        for fragment in FRAGMENTS.iter().filter(|f| f.is_ascii()) {
            let mut pieces = Vec::new();
            ascii_pieces(fragment.as_bytes(), |from, to| pieces.push((from, to)));
            assert_eq!(pieces, pattern_pieces(fragment), "{fragment:?}");
        }
    }

    #[test]
    fn is_a_tenth_of_tiktokens_size() {
        let lean = lean();
        assert!(lean.heap_bytes() < 6 << 20, "{}", lean.heap_bytes());
        assert_eq!(lean.token(lean.rank(b"hello").unwrap()), b"hello");
        assert_eq!(
            lean.rank(b"<|endoftext|>"),
            None,
            "special tokens only as specials"
        );
        assert_eq!(lean.encode("<|endoftext|>"), [199_999]);
    }
}
