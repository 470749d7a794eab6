//! Reconcile: which of the request's messages are new, whatever the client's habit.
//!
//! SDK clients re-send the whole history each time; front-ends send only the newest message;
//! some re-send a tail. The request's conversation messages (instructions left out) are aligned
//! against the stored history by fingerprint, and only what lies past the stored end is new.
//! A retry of the last request (identical messages, nothing new past the stored reply) replaces
//! that reply instead of storing the exchange twice.
//!
//! Pure functions over fingerprints: no I/O, so every case is a table-driven test.

use crate::message::{HasRole, Message, Role};
use crate::store::Entry;

/// How many trailing messages an alignment compares at most. Sixty-four matching 64-bit
/// fingerprints in a row do not happen by chance, and the bound keeps a 10,000-message re-send
/// from costing a 10,000-element comparison per candidate.
const MAX_COMPARED: usize = 64;

/// One message's identity for alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    pub fingerprint: u64,
    pub role: Role,
}

/// Anything alignment can read a fingerprint and role from: request messages and stored
/// entries alike, so neither is copied into the other's shape per request.
pub trait Marked: HasRole {
    fn fingerprint(&self) -> u64;
}

impl HasRole for Mark {
    fn role(&self) -> Role {
        self.role
    }
}

impl Marked for Mark {
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

impl HasRole for Entry {
    fn role(&self) -> Role {
        self.role
    }
}

impl Marked for Entry {
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

impl Marked for Message {
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

impl From<&Message> for Mark {
    fn from(m: &Message) -> Mark {
        Mark {
            fingerprint: m.fingerprint,
            role: m.role,
        }
    }
}

/// What the request adds to the stored history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alignment {
    /// The request's messages from index `from` on are new.
    Append { from: usize },
    /// The stored last message (a reply) is replaced, and the request's messages from `from` on
    /// are new. A retry of the last request has `from` equal to the message count: only the new
    /// reply will be stored, in place of the old one.
    ReplaceLastReply { from: usize },
}

impl Alignment {
    /// The index of the first new message.
    pub fn from(self) -> usize {
        match self {
            Alignment::Append { from } | Alignment::ReplaceLastReply { from } => from,
        }
    }
}

/// True when `incoming[..p]` ends with `stored` (the overlap is the shorter of the two, compared
/// over at most [`MAX_COMPARED`] messages).
fn ends_match<S: Marked, I: Marked>(stored: &[S], incoming: &[I], p: usize) -> bool {
    let k = p.min(stored.len()).min(MAX_COMPARED);
    k > 0
        && incoming[p - k..p]
            .iter()
            .zip(&stored[stored.len() - k..])
            .all(|(a, b)| a.fingerprint() == b.fingerprint())
}

/// Aligns the request's conversation messages against the stored history.
/// `last_is_reply`: the stored last message is an upstream reply (and so may be replaced by a
/// retry).
pub fn align<S: Marked, I: Marked>(stored: &[S], last_is_reply: bool, incoming: &[I]) -> Alignment {
    let m = incoming.len();
    if stored.is_empty() || m == 0 {
        return Alignment::Append { from: 0 };
    }

    // 1. The stored end is found in the request: everything after it is new. The largest such
    //    position wins (a full re-send aligns at the end of its history).
    let last = stored[stored.len() - 1].fingerprint();
    for p in (1..=m).rev() {
        if incoming[p - 1].fingerprint() == last && ends_match(stored, incoming, p) {
            return Alignment::Append { from: p };
        }
    }

    if last_is_reply {
        let before_reply = &stored[..stored.len() - 1];
        // 2. A retry: the request is exactly what preceded the stored reply.
        if ends_match(before_reply, incoming, m) {
            return Alignment::ReplaceLastReply { from: m };
        }
        // 3. The client holds a different version of the last reply (a regenerated answer):
        //    its version replaces ours, and what follows it is new.
        for p in (2..=m).rev() {
            if incoming[p - 1].role() == Role::Assistant
                && ends_match(before_reply, incoming, p - 1)
            {
                return Alignment::ReplaceLastReply { from: p - 1 };
            }
        }
    }

    // 4. The request re-sends history that diverges from ours (an edited earlier message): the
    //    longest run of it that we hold is not stored again; what follows the run is new. A
    //    lone message is always new: a front-end may repeat an earlier message on purpose.
    if m >= 2 {
        let run = longest_stored_prefix(stored, incoming);
        if run > 0 {
            return Alignment::Append { from: run };
        }
    }
    Alignment::Append { from: 0 }
}

/// The length of the longest prefix of `incoming` found as a contiguous run in `stored`.
fn longest_stored_prefix<S: Marked, I: Marked>(stored: &[S], incoming: &[I]) -> usize {
    let first = incoming[0].fingerprint();
    let mut best = 0;
    for start in 0..stored.len() {
        if stored[start].fingerprint() != first {
            continue;
        }
        let run = stored[start..]
            .iter()
            .zip(incoming)
            .take_while(|(a, b)| a.fingerprint() == b.fingerprint())
            .count();
        best = best.max(run);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds marks from a compact spec: `u1` is a user message with text 1, `a2` an assistant
    /// message with text 2, `t3` a tool result.
    fn marks(spec: &str) -> Vec<Mark> {
        spec.split_whitespace()
            .map(|m| {
                let (role, n) = m.split_at(1);
                let role = match role {
                    "u" => Role::User,
                    "a" => Role::Assistant,
                    "t" => Role::Tool,
                    _ => panic!("{m}"),
                };
                let n: u64 = n.parse().unwrap();
                Mark {
                    fingerprint: n * 10 + role as u64,
                    role,
                }
            })
            .collect()
    }

    fn check(stored: &str, incoming: &str, expected: Alignment) {
        let got = align(&marks(stored), true, &marks(incoming));
        // Nothing stored ends with a reply that is not there.
        let got = if stored.is_empty() {
            align::<Mark, Mark>(&[], false, &marks(incoming))
        } else {
            got
        };
        assert_eq!(got, expected, "stored [{stored}] incoming [{incoming}]");
    }

    #[test]
    fn alignments() {
        use Alignment::*;
        // Nothing stored: everything is new.
        check("", "u1 a1 u2", Append { from: 0 });
        // Full re-send: only the last message is new.
        check("u1 a1", "u1 a1 u2", Append { from: 2 });
        // Newest only.
        check("u1 a1", "u2", Append { from: 0 });
        // Newest only, repeating an earlier user message: still new.
        check("u1 a1 u2 a2", "u1", Append { from: 0 });
        // A tail re-send (the client trimmed its history).
        check("u1 a1 u2 a2", "u2 a2 u3", Append { from: 2 });
        // The store trimmed its history, the client did not.
        check("u2 a2", "u1 a1 u2 a2 u3", Append { from: 4 });
        // Tool continuation, newest only and full re-send.
        check("u1 a1", "t1 t2", Append { from: 0 });
        check("u1 a1", "u1 a1 t1 t2", Append { from: 2 });
        // Retries of the last request, both habits.
        check("u1 a1 u2 a2", "u1 a1 u2", ReplaceLastReply { from: 3 });
        check("u1 a1 u2 a2", "u2", ReplaceLastReply { from: 1 });
        // The client kept a regenerated reply.
        check(
            "u1 a1 u2 a2",
            "u1 a1 u2 a9 u3",
            ReplaceLastReply { from: 3 },
        );
        // An edited earlier message: the common run is not stored again.
        check("u1 a1 u2 a2", "u1 a1 u8", Append { from: 2 });
        // Same history re-sent with nothing new: nothing to add.
        check("u1 a1", "u1 a1", Append { from: 2 });
    }

    #[test]
    fn a_long_resend_aligns_at_its_end() {
        let stored: Vec<String> = (0..500).map(|i| format!("u{i} a{i}")).collect();
        let stored = stored.join(" ");
        let incoming = format!("{stored} u999");
        check(&stored, &incoming, Alignment::Append { from: 1000 });
    }

    #[test]
    fn a_non_reply_end_is_never_replaced() {
        let stored = marks("u1 a1 u2 a2");
        assert_eq!(
            align(&stored, false, &marks("u1 a1 u2")),
            Alignment::Append { from: 3 }
        );
    }
}
