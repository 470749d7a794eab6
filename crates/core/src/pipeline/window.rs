//! The recent window: the stored messages forwarded verbatim, from an anchor to the newest,
//! widened backwards to the start of a round (a user message) so the window never begins with
//! a tool result or separates an assistant's `tool_calls` from their results.
//!
//! # The anchor
//!
//! A provider caches a prompt's longest exact prefix, so a window that slides by one round each
//! turn makes every prompt new after the summary. Instead the window starts at an anchor and
//! grows turn by turn; only when it holds more than `recent_n + window_step` messages does the
//! anchor jump forward, to leave between `recent_n + 1` and `recent_n + window_step` of them.
//! Between two jumps each prompt's window extends the previous one.
//!
//! The anchor is a function of what is stored, never of what a process remembers, so every
//! replica sharing a store and a restarted one pick the same: anchors sit on turn numbers
//! `k × window_step + 1` (turn numbers are stored and only grow, so the trimming of the oldest
//! messages by `max_messages` does not move them), and the anchor is the first of those from
//! which at most `recent_n + window_step` messages are stored. Appending only ever moves it
//! forward; a closed branch (fewer messages on the main line) may move it back. The round
//! widening reads only stored roles. `window_step = 0` is the sliding window: the last
//! `recent_n` messages.

use memproxy_base::message::{HasRole, Role};
use memproxy_store::{Entry, tokens_between};

/// The shortest prefix a provider caches (OpenAI; Anthropic's for most models).
pub const CACHE_MIN_TOKENS: u64 = 1024;

/// A stored message as the window sees it: its role and its turn number.
pub trait Positioned: HasRole {
    fn turn(&self) -> u64;
    /// When the message was stored (ms since the epoch).
    fn at_ms(&self) -> i64;
}

impl Positioned for Entry {
    fn turn(&self) -> u64 {
        self.turn
    }
    fn at_ms(&self) -> i64 {
        self.at_ms
    }
}

/// `window_step = "auto"`: of sliding (0), `recent_n` and `2 × recent_n`, the step whose
/// prompts cost least, cached input billed at a tenth, for a conversation whose messages are
/// as long as its last `3 × recent_n` and whose prompt starts with `head_tokens` (the
/// instructions and the summary). Anchoring pays where prompts pass the provider's cache minimum
/// ([`CACHE_MIN_TOKENS`]): each turn re-sends only what is new, and a longer step makes the
/// uncached jumps rarer for a longer window. Below the minimum nothing is cached and a
/// growing window is only longer, so short exchanges slide, as before anchoring. The choice
/// is a function of what is stored and of the request's instructions, so every replica makes
/// the same; on a tie the longer step wins. A conversation whose messages change length may
/// change step (one cache miss, as at a jump).
pub fn auto_step(history: &[Entry], recent_n: usize, head_tokens: u64) -> usize {
    if recent_n == 0 {
        return 0;
    }
    let n = history.len();
    let sample = n.min(3 * recent_n);
    if sample == 0 {
        return 2 * recent_n;
    }
    let per_message = tokens_between(history, n - sample, n) as f64 / sample as f64;
    let mut best = (f64::INFINITY, 0);
    for step in [2 * recent_n, recent_n, 0] {
        let cost = turn_cost(head_tokens as f64, per_message, recent_n, step);
        if cost < best.0 {
            best = (cost, step);
        }
    }
    best.1
}

/// The mean input cost of a turn's window and head (cached tokens at a tenth) over one anchor
/// cycle of `step`, rounds of two messages of `per_message` tokens each (the recalled turns
/// and the new message cost the same under every step, and are left out).
fn turn_cost(head: f64, per_message: f64, recent_n: usize, step: usize) -> f64 {
    let cacheable = |tokens: f64| {
        if tokens >= CACHE_MIN_TOKENS as f64 {
            (tokens / 128.0).floor() * 128.0
        } else {
            0.0
        }
    };
    if step == 0 {
        return head + recent_n as f64 * per_message - 0.9 * cacheable(head);
    }
    let rounds = step.div_ceil(2);
    let total: f64 = (1..=rounds)
        .map(|k| {
            let window = (recent_n + 2 * k) as f64 * per_message;
            // The jump shares only the head with the prompt before it; every other turn its
            // window but the last round.
            let shared = if k == 1 {
                head
            } else {
                head + window - 2.0 * per_message
            };
            head + window - 0.9 * cacheable(shared)
        })
        .sum();
    total / rounds as f64
}

/// The index where the window over `history` (stored messages, oldest first) starts.
/// `continue_round`: the request's new messages continue the last stored round (tool results,
/// or nothing new at all), so the window must hold at least that round.
pub fn window_start<P: Positioned>(
    history: &[P],
    recent_n: usize,
    window_step: usize,
    continue_round: bool,
) -> usize {
    let n = history.len();
    let mut start = anchor(history, recent_n, window_step);
    if continue_round {
        start = start.min(last_round_start(history));
    }
    while start > 0 && start < n && history[start].role() != Role::User {
        start -= 1;
    }
    // A history that begins with orphan tool results (sent that way by a client) cannot be
    // forwarded as it is; skip them.
    while start < n && history[start].role() == Role::Tool {
        start += 1;
    }
    start
}

/// The anchor before the round widening (see the module's documentation): the index of the
/// first message at or after the first turn boundary `k × step + 1` from which at most
/// `recent_n + step` messages are stored. A binary search over `k`, each step one over the
/// turns: no work grows with the conversation beyond a logarithm.
pub fn anchor<P: Positioned>(history: &[P], recent_n: usize, step: usize) -> usize {
    let n = history.len();
    let most = recent_n.saturating_add(step);
    if step == 0 {
        return n.saturating_sub(recent_n);
    }
    if n <= most {
        return 0;
    }
    let step = step as u64;
    let from_boundary = |k: u64| -> usize {
        let boundary = k.saturating_mul(step).saturating_add(1);
        history.partition_point(|p| p.turn() < boundary)
    };
    // count(k) = n - from_boundary(k) only falls as k grows; the last turn's boundary holds at
    // most one message, which is within `most` (at least 1 here, as `n > most`).
    let (mut low, mut high) = (0u64, history[n - 1].turn() / step);
    while low < high {
        let mid = low + (high - low) / 2;
        if n - from_boundary(mid) <= most {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    from_boundary(low)
}

/// The newest summary the prompt may carry: one made (`created_ms`) at or before the returned
/// time; `None`: any summary.
///
/// A new summary changes the prompt right after the instructions, so the provider's cache
/// keeps nothing of the window behind it; an anchor jump does the same. A summary is therefore
/// adopted at the window's next jump rather than on the turn it lands, and the two break the
/// cache once instead of twice. The jump to the window's current start was made by the first
/// request that found this start: the one that planned on the shortest history with it (found
/// by a binary search, as the start only moves forward while messages are appended). The
/// first message that request stored is when the window last jumped; a summary made after it
/// waits. The request that jumps adopts every summary. Like the anchor, this is a function of
/// what is stored, so every replica picks the same. The turns a waiting summary covers stay
/// within reach of recall meanwhile.
pub fn summary_adoption_cutoff<P: Positioned>(
    history: &[P],
    recent_n: usize,
    step: usize,
) -> Option<i64> {
    if step == 0 {
        return None;
    }
    let start = window_start(history, recent_n, step, false);
    if start == 0 {
        return None;
    }
    let (mut low, mut high) = (start, history.len());
    while low < high {
        let mid = low + (high - low) / 2;
        if window_start(&history[..mid], recent_n, step, false) >= start {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    history.get(low).map(Positioned::at_ms)
}

/// The index of the last user message (the start of the last round), or 0.
pub fn last_round_start<R: HasRole>(roles: &[R]) -> usize {
    roles
        .iter()
        .rposition(|r| r.role() == Role::User)
        .unwrap_or(0)
}

/// The first index to keep when `len` messages, whose roles `roles` yields oldest first, must
/// shrink to `max`, cutting whole rounds: the first user message at or after the cut, else the
/// first non-tool message, else nothing is cut. Only the roles from the cut on are read.
pub fn trim_start<I>(len: usize, roles: I, max: usize) -> usize
where
    I: Iterator<Item = Role> + Clone,
{
    if len <= max {
        return 0;
    }
    let need = len - max;
    let after = roles.skip(need);
    if let Some(i) = after.clone().position(|r| r == Role::User) {
        return need + i;
    }
    after
        .clone()
        .position(|r| r != Role::Tool)
        .map_or(0, |i| need + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(spec: &str) -> Vec<Role> {
        spec.chars()
            .map(|c| match c {
                'u' => Role::User,
                'a' => Role::Assistant,
                'c' => Role::Assistant, // an assistant message with tool calls
                't' => Role::Tool,
                _ => panic!("{c}"),
            })
            .collect()
    }

    /// A stored message in a test: its role, and its turn number.
    #[derive(Clone, Copy)]
    struct At(Role, u64);

    impl HasRole for At {
        fn role(&self) -> Role {
            self.0
        }
    }

    impl Positioned for At {
        fn turn(&self) -> u64 {
            self.1
        }
        fn at_ms(&self) -> i64 {
            (self.1 as i64 - 1) * 1000
        }
    }

    /// `spec`'s messages numbered from `first_turn` on.
    fn history(spec: &str, first_turn: u64) -> Vec<At> {
        roles(spec)
            .into_iter()
            .zip(first_turn..)
            .map(|(r, t)| At(r, t))
            .collect()
    }

    fn check(history_spec: &str, recent_n: usize, continue_round: bool, expected_window: &str) {
        let r = history(history_spec, 1);
        let start = window_start(&r, recent_n, 0, continue_round);
        let history = history_spec;
        let window: String = history[start..].to_string();
        assert_eq!(
            window, expected_window,
            "history {history} recent_n {recent_n}"
        );
    }

    #[test]
    fn windows() {
        check("uauaua", 2, false, "ua");
        check("uauaua", 3, false, "uaua");
        check("uauaua", 0, false, "");
        check("uauaua", 100, false, "uauaua");
        // Never start inside a tool group.
        check("uauctta", 2, false, "uctta");
        check("uauctta", 3, false, "uctta");
        // Tool results arriving as the new messages need their call in the window.
        check("uauc", 0, true, "uc");
        check("uauctt", 0, true, "uctt");
        // Nothing new (a retry): the last round is still sent.
        check("uau", 0, true, "u");
        // A history of one long round is kept whole.
        check("ucttctta", 2, false, "ucttctta");
        // Orphan tool results at the very start are skipped.
        check("ttua", 10, false, "ua");
    }

    /// (stored messages, first turn, recent_n, window_step) → the window's length.
    #[test]
    fn anchors() {
        let u = |n: usize| "ua".repeat(n / 2) + &"u".repeat(n % 2);
        #[rustfmt::skip]
        let cases: &[(usize, u64, usize, usize, usize)] = &[
            // Up to recent_n + step the window holds everything.
            (0, 1, 4, 4, 0),
            (8, 1, 4, 4, 8),
            // Past it, the anchor jumps to turn 5 (a multiple of the step, plus 1): 5 left…
            (9, 1, 4, 4, 5),
            (10, 1, 4, 4, 6),
            (12, 1, 4, 4, 8),
            // …then grows again until it passes 8, and jumps to turn 9.
            (13, 1, 4, 4, 5),
            (16, 1, 4, 4, 8),
            (17, 1, 4, 4, 5),
            // A step of 0 slides: the last recent_n (widened to the round start).
            (9, 1, 4, 0, 5),
            (10, 1, 4, 0, 4),
            (11, 1, 4, 0, 5),
            // A step larger than recent_n.
            (30, 1, 4, 10, 10),
            (31, 1, 4, 10, 11),
            (35, 1, 4, 10, 5),
            // The oldest messages trimmed (max_messages): turn numbers, not positions,
            // place the anchor, so trimming does not move it.
            (10, 3, 4, 4, 8),
            (8, 5, 4, 4, 8),
            (6, 7, 4, 4, 6),
            // A recent_n of 0.
            (5, 1, 0, 2, 1),
            (6, 1, 0, 2, 2),
        ];
        for &(n, first, recent_n, step, expected) in cases {
            let h = history(&u(n), first);
            let start = window_start(&h, recent_n, step, false);
            assert_eq!(
                n - start,
                expected,
                "{n} stored from turn {first}, recent_n {recent_n}, step {step}"
            );
        }
    }

    #[test]
    fn the_anchor_moves_only_at_jumps_and_only_forward() {
        // Messages appended one at a time: between jumps the window keeps its start, so each
        // window extends the previous one; a jump leaves more than recent_n messages and at
        // most recent_n + step.
        for (recent_n, step) in [(4, 4), (10, 10), (10, 3), (3, 17), (1, 1)] {
            let spec = "ua".repeat(100);
            let full = history(&spec, 1);
            let mut previous = 0;
            let mut jumps = 0;
            for n in 1..=full.len() {
                let start = window_start(&full[..n], recent_n, step, false);
                assert!(start >= previous, "the anchor went back at {n}");
                let len = n - start;
                assert!(len <= recent_n + step + 1, "{len} at {n}");
                if start != previous {
                    jumps += 1;
                    assert!(len > recent_n, "a jump left {len} at {n}");
                    assert!(n - previous > recent_n + step, "jumped early at {n}");
                }
                previous = start;
            }
            assert!(jumps > 0);
        }
    }

    #[test]
    fn a_summary_is_adopted_at_the_next_jump_and_not_before() {
        // Message `i` is stored at `i × 1000` ms. A summary landing while `n` messages are
        // stored (at `n × 1000 - 500`) may be carried once a request plans on a window start
        // later than the one planned on before it landed, and not before.
        for (recent_n, step) in [(10, 10), (4, 4), (10, 3), (3, 17), (2, 1)] {
            let full = history(&"ua".repeat(120), 1);
            let start = |n: usize| window_start(&full[..n], recent_n, step, false);
            let mut adopted_later = 0;
            for n in 1..full.len() {
                let landed = n as i64 * 1000 - 500;
                for m in n..=full.len() {
                    let cutoff = summary_adoption_cutoff(&full[..m], recent_n, step);
                    let adoptable = cutoff.is_none_or(|at| landed <= at);
                    assert_eq!(
                        adoptable,
                        start(m) != start(n - 1) || start(m) == 0,
                        "landed with {n} stored, planned on {m} ({recent_n}, {step})"
                    );
                    adopted_later += usize::from(adoptable && m > n);
                }
            }
            assert!(adopted_later > 0);
        }
        // The sliding window adopts every summary at once.
        assert_eq!(summary_adoption_cutoff(&history("uauaua", 1), 2, 0), None);
    }

    fn entries(per_message: u32, count: usize) -> Vec<Entry> {
        let mut cum = 0;
        (0..count)
            .map(|i| {
                cum += u64::from(per_message);
                Entry {
                    turn: i as u64 + 1,
                    role: if i % 2 == 0 {
                        Role::User
                    } else {
                        Role::Assistant
                    },
                    origin: memproxy_store::Origin::Client,
                    tokens: per_message,
                    fingerprint: 0,
                    at_ms: 0,
                    cum_tokens: cum,
                }
            })
            .collect()
    }

    #[test]
    fn auto_anchors_long_exchanges_and_slides_short_ones() {
        // Model-length replies (about 124 tokens a message on average): prompts pass the cache
        // minimum, and the longer step is cheaper.
        assert_eq!(auto_step(&entries(124, 60), 10, 0), 20);
        // One-line exchanges (about 45 tokens a message): nothing would be cached, so slide.
        assert_eq!(auto_step(&entries(45, 60), 10, 0), 0);
        // The same exchanges behind long instructions: the instructions are cached either way,
        // and anchoring caches the window too.
        assert_ne!(auto_step(&entries(45, 60), 10, 3000), 0);
        // No history yet, or no window.
        assert_eq!(auto_step(&[], 10, 0), 20);
        assert_eq!(auto_step(&entries(124, 60), 0, 0), 0);
    }

    #[test]
    fn gaps_in_turn_numbers_still_leave_more_than_recent_n() {
        // Turns missing (replaced replies, a closed branch): the anchor is still the first
        // boundary from which at most recent_n + step messages are stored.
        let turns = [1, 2, 3, 4, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 30, 31];
        let h: Vec<At> = turns
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                At(
                    if i % 2 == 0 {
                        Role::User
                    } else {
                        Role::Assistant
                    },
                    t,
                )
            })
            .collect();
        // recent_n 4, step 4: boundaries 1, 5, 9, 13, 17; from 13 on: 13..18, 30, 31 = 8.
        assert_eq!(anchor(&h, 4, 4), 8);
        assert_eq!(window_start(&h, 4, 4, false), 8);
    }

    #[test]
    fn trimming_cuts_whole_rounds() {
        let trim = |spec: &str, max: usize| {
            let r = roles(spec);
            trim_start(r.len(), r.iter().copied(), max)
        };
        assert_eq!(trim("uauctta", 7), 0);
        assert_eq!(trim("uauctta", 6), 2);
        assert_eq!(trim("uauctta", 5), 2);
        // No round start left to cut at: the first non-tool message.
        assert_eq!(trim("uauctta", 2), 6);
        assert_eq!(trim("cttt", 2), 0);
    }
}
