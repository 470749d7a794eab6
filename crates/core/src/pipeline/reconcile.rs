//! Reconcile: which of the request's messages are new, whatever the client's habit.
//!
//! SDK clients re-send the whole history each time; front-ends send only the newest message;
//! some re-send a tail. The request's conversation messages (instructions left out) are aligned
//! against the stored history by fingerprint, and only what lies past the stored end is new.
//! A retry of the last request (identical messages, nothing new past the stored reply) replaces
//! that reply instead of storing the exchange twice.
//!
//! A re-sent history that leaves the stored line before its end (the user edited an earlier
//! message or regenerated an earlier reply, and the client sends its history up to there) is a
//! branch: the client's history is the truth, so the stored messages after the shared run leave
//! the main line (the commit keeps them as a closed branch) and what follows the run in the
//! request is new.
//!
//! Pure functions over fingerprints: no I/O, so every case is a table-driven test.

use memproxy_base::message::{HasRole, Message, Role};
use memproxy_store::Entry;

/// The fewest messages a request must share with the stored line, in one run, for a divergence
/// to be a branch: a user message and its reply. One shared message is no evidence of a re-sent
/// history (a front-end may put the same greeting first in every request).
const MIN_BRANCH_RUN: usize = 2;

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
    /// The request's history leaves the stored line: it shares the stored messages before index
    /// `keep` and then ends or differs while the stored line goes on. The stored messages from
    /// `keep` on leave the main line (a closed branch), and the request's messages from `from`
    /// on are new.
    Branch { keep: usize, from: usize },
}

impl Alignment {
    /// The index of the first new message.
    pub fn from(self) -> usize {
        match self {
            Alignment::Append { from }
            | Alignment::ReplaceLastReply { from }
            | Alignment::Branch { from, .. } => from,
        }
    }

    /// How many of `stored` stored messages stay on the main line: all of them, all but the
    /// replaced reply, or those before a branch.
    pub fn kept(self, stored: usize) -> usize {
        match self {
            Alignment::Append { .. } => stored,
            Alignment::ReplaceLastReply { .. } => stored.saturating_sub(1),
            Alignment::Branch { keep, .. } => keep.min(stored),
        }
    }

    /// The alignment a commit applies when the conversation changed after the plan and
    /// aligning again gave `now`. A branch is closed only when the plan found one: a branch
    /// that appears only now comes from a concurrent commit (another request continued the
    /// line meanwhile), not from the client's history, and the exchange is appended after what
    /// is stored instead, as before branches existed.
    pub fn settle(planned: Alignment, now: Alignment) -> Alignment {
        match (planned, now) {
            (Alignment::Branch { .. }, now) => now,
            (_, Alignment::Branch { from, .. }) => Alignment::Append { from },
            (_, now) => now,
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

    // 4. The request re-sends history that leaves ours (an edited earlier message, a
    //    regenerated earlier reply): the client's history is the truth. The stored messages
    //    after the longest run it shares with us leave the main line; what follows the run in
    //    the request is new. A lone message is always new: a front-end may repeat an earlier
    //    message on purpose (the newest-only habit is never a branch).
    if m >= 2 {
        let runs = shared_runs(stored, incoming);
        if let Some(run) = runs.iter().max_by_key(|r| (r.len, r.keep))
            && run.len >= MIN_BRANCH_RUN
            && run.keep < stored.len()
        {
            return Alignment::Branch {
                keep: run.keep,
                from: run.from,
            };
        }
        // A shorter run at the request's start is not stored again.
        let prefix = runs
            .iter()
            .filter(|r| r.from == r.len)
            .map(|r| r.len)
            .max()
            .unwrap_or(0);
        if prefix > 0 {
            return Alignment::Append { from: prefix };
        }
    }
    Alignment::Append { from: 0 }
}

/// The client's own compaction (a rebase): a re-sent history that neither continues, retries
/// nor branches off the stored line, yet holds messages already stored. Claude Code's
/// `/compact` sends its summary, then a few of the old messages and the new prompt; Codex keeps
/// earlier user messages verbatim, re-inserts its context items in another place and adds its
/// summary. The client's history is the truth for the prompt: it is forwarded as sent, and
/// only what is not stored yet is stored (a moved or re-sent item never becomes a duplicate);
/// the stored line stays whole, so what the client compacted away is still recalled.
///
/// Returns, per request message, whether it is already stored; `None` when the request is no
/// rebase. A request that opens with a tool result continues a round (a newest-only client
/// answering a tool call), and one that shares nothing with the stored line is a new history
/// (appended, as ever).
pub fn rebase<S: Marked, I: Marked>(
    stored: &[S],
    incoming: &[I],
    alignment: Alignment,
) -> Option<Vec<bool>> {
    let (m, n) = (incoming.len(), stored.len());
    if m < 2 || n == 0 || incoming[0].role() == Role::Tool {
        return None;
    }
    match alignment {
        // Step 1 of `align`: the request continues the stored line.
        Alignment::Append { from }
            if from > 0
                && incoming[from - 1].fingerprint() == stored[n - 1].fingerprint()
                && ends_match(stored, incoming, from) =>
        {
            return None;
        }
        Alignment::Append { .. } => {}
        // A history that leaves the stored line yet holds its newest message past the point
        // where it left is the client's own edit of its history, not a branch: a branch goes
        // on from an earlier message and never holds what the line said after it. So is the
        // next request of a client that compacted (its history holds the stored messages in
        // its own order, the rebase stored only what was new).
        Alignment::Branch { from, .. } => {
            let newest = stored[n - 1].fingerprint();
            if !incoming[from.min(m)..]
                .iter()
                .any(|message| message.fingerprint() == newest)
            {
                return None;
            }
        }
        Alignment::ReplaceLastReply { .. } => return None,
    }
    let on_line: std::collections::HashSet<u64> = stored.iter().map(Marked::fingerprint).collect();
    let known: Vec<bool> = incoming
        .iter()
        .map(|message| on_line.contains(&message.fingerprint()))
        .collect();
    known.iter().any(|&k| k).then_some(known)
}

/// A run of the request's messages equal to a run of stored messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    /// Messages in the run.
    len: usize,
    /// The stored index just past the run.
    keep: usize,
    /// The request's index just past the run.
    from: usize,
}

/// The runs a re-sent history can share with the stored line, each as long as it goes: those
/// that start at the request's first message (wherever it is stored: a full or a tail re-send),
/// and those that start at the first stored message (found later in the request: the store
/// trimmed its oldest messages, the client did not). One pass over each side per candidate
/// start; only requests that neither continue nor retry the stored line come here.
fn shared_runs<S: Marked, I: Marked>(stored: &[S], incoming: &[I]) -> Vec<Run> {
    let common = |a: &[S], b: &[I]| {
        a.iter()
            .zip(b)
            .take_while(|(x, y)| x.fingerprint() == y.fingerprint())
            .count()
    };
    let mut runs = Vec::new();
    let first = incoming[0].fingerprint();
    for start in 0..stored.len() {
        if stored[start].fingerprint() == first {
            let len = common(&stored[start..], incoming);
            runs.push(Run {
                len,
                keep: start + len,
                from: len,
            });
        }
    }
    let stored_first = stored[0].fingerprint();
    for start in 1..incoming.len() {
        if incoming[start].fingerprint() == stored_first {
            let len = common(stored, &incoming[start..]);
            runs.push(Run {
                len,
                keep: len,
                from: start + len,
            });
        }
    }
    runs
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

    fn rebased(stored: &str, incoming: &str) -> Option<Vec<bool>> {
        let (stored, incoming) = (marks(stored), marks(incoming));
        rebase(&stored, &incoming, align(&stored, true, &incoming))
    }

    #[test]
    fn a_client_compaction_is_a_rebase_that_stores_only_what_is_new() {
        // Claude Code after `/compact`: its summary, the last answer kept, the new prompt.
        assert_eq!(
            rebased("u1 a1 u2 a2", "u9 a2 u3"),
            Some(vec![false, true, false])
        );
        // Codex: earlier user messages kept verbatim and moved, its summary, the new prompt.
        assert_eq!(
            rebased("u0 u1 a1 u2 a2", "u1 u2 u0 u8 u3"),
            Some(vec![true, true, true, false, false])
        );
        // The next request of a client that compacted: its history in its own order, every
        // message stored, the last answer and a new question past them.
        assert_eq!(
            rebased("u1 a1 u2 a2 u9 u3 a3", "u9 a2 u3 a3 u4"),
            Some(vec![true, true, true, true, false])
        );
        // A client's own edit of an earlier message (a pruned tool output), going on.
        assert_eq!(
            rebased("u1 a1 t1 u2 a2", "u1 a1 t7 u2 a2 u3"),
            Some(vec![true, true, false, true, true, false])
        );
        // Not rebases: a continuation, a retry, a branch, a newest-only request, a new history
        // sharing nothing, a request that opens with tool results.
        assert_eq!(rebased("u1 a1", "u1 a1 u2"), None);
        assert_eq!(rebased("u1 a1 u2 a2", "u1 a1 u2"), None);
        assert_eq!(rebased("u1 a1 u2 a2", "u1 a1 u3"), None);
        assert_eq!(rebased("u1 a1", "u2"), None);
        assert_eq!(rebased("u1 a1", "u5 a5 u6"), None);
        assert_eq!(rebased("u1 a1", "t1 u1"), None);
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
        // An edited last user message: the common run is not stored again, and the stored
        // line after it leaves the main line (a branch).
        check("u1 a1 u2 a2", "u1 a1 u8", Branch { keep: 2, from: 2 });
        // Same history re-sent with nothing new: nothing to add.
        check("u1 a1", "u1 a1", Append { from: 2 });
    }

    /// Five stored exchanges, as the branching tests through the proxy use them.
    const FIVE: &str = "u1 a1 u2 a2 u3 a3 u4 a4 u5 a5";

    #[test]
    fn branches() {
        use Alignment::*;
        // Reply 3 regenerated: the client sends its history up to user 3.
        check(FIVE, "u1 a1 u2 a2 u3", Branch { keep: 5, from: 5 });
        // User 3 edited.
        check(FIVE, "u1 a1 u2 a2 u9", Branch { keep: 4, from: 4 });
        // The client went on along its branch before memproxy saw it: all of it is new.
        check(FIVE, "u1 a1 u2 a2 u9 a9 u10", Branch { keep: 4, from: 4 });
        // Reply 4 regenerated.
        check(FIVE, "u1 a1 u2 a2 u3 a3 u4", Branch { keep: 7, from: 7 });
        // User 5 edited: the last round leaves the main line.
        check(
            FIVE,
            "u1 a1 u2 a2 u3 a3 u4 a4 u9",
            Branch { keep: 8, from: 8 },
        );
        // The store trimmed its oldest messages, the client did not.
        check(
            "u3 a3 u4 a4 u5 a5",
            "u1 a1 u2 a2 u3 a3 u9",
            Branch { keep: 2, from: 6 },
        );
        // A sliding-window client that edits inside its window.
        check(FIVE, "a1 u2 a2 u9", Branch { keep: 4, from: 3 });
        // Inside a tool group: the client changed the second tool result.
        check(
            "u1 a1 t1 t2 a2 u2 a3",
            "u1 a1 t1 t9",
            Branch { keep: 3, from: 3 },
        );
        // The same exchange stored twice: the later copy is the one shared (least abandoned).
        check("u1 a1 u1 a1 u2 a2", "u1 a1 u9", Branch { keep: 4, from: 2 });
    }

    #[test]
    fn what_is_never_a_branch() {
        use Alignment::*;
        // A newest-only client repeating an earlier user message.
        check(FIVE, "u2", Append { from: 0 });
        check(FIVE, "u1", Append { from: 0 });
        // One shared message (a front-end that puts the same greeting first every time) is
        // no evidence of a re-sent history.
        check("a0 u1 a1 u2 a2", "a0 u3", Append { from: 1 });
        check(FIVE, "u1 a9 u2", Append { from: 1 });
        // A sliding-window client, its window inside and at the end of the stored line.
        check(FIVE, "u4 a4 u5 a5 u6", Append { from: 4 });
        check(FIVE, "a5 u6", Append { from: 1 });
        // Retries of the last message, and a regenerated last answer.
        check(
            FIVE,
            "u1 a1 u2 a2 u3 a3 u4 a4 u5",
            ReplaceLastReply { from: 9 },
        );
        check(FIVE, "u5", ReplaceLastReply { from: 1 });
        check(FIVE, "u4 a4 u5 a9 u6", ReplaceLastReply { from: 3 });
    }

    #[test]
    fn a_commit_closes_a_branch_only_when_its_plan_did() {
        use Alignment::*;
        let branch = Branch { keep: 2, from: 2 };
        // Planned on a line that another request continued meanwhile: appended, as before.
        assert_eq!(
            Alignment::settle(Append { from: 2 }, branch),
            Append { from: 2 }
        );
        assert_eq!(
            Alignment::settle(ReplaceLastReply { from: 3 }, branch),
            Append { from: 2 }
        );
        // Planned as a branch: still one.
        assert_eq!(Alignment::settle(branch, branch), branch);
        assert_eq!(
            Alignment::settle(branch, Append { from: 4 }),
            Append { from: 4 }
        );
        assert_eq!(
            Alignment::settle(Append { from: 2 }, Append { from: 3 }),
            Append { from: 3 }
        );
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
        // The request ends before the stored (client-sent) last message: that message leaves
        // the main line as a closed branch; it is kept there, not replaced.
        assert_eq!(
            align(&stored, false, &marks("u1 a1 u2")),
            Alignment::Branch { keep: 3, from: 3 }
        );
        // Continuing it is appending, never replacing.
        assert_eq!(
            align(&stored, false, &marks("u1 a1 u2 a2 u3")),
            Alignment::Append { from: 4 }
        );
    }
}
