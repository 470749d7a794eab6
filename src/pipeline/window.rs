//! The recent window: the last `recent_n` stored messages, widened backwards to the start of a
//! round (a user message) so the window never begins with a tool result or separates an
//! assistant's `tool_calls` from their results.

use crate::message::{HasRole, Role};

/// The index where the window over `roles` (stored messages, oldest first) starts.
/// `continue_round`: the request's new messages continue the last stored round (tool results,
/// or nothing new at all), so the window must hold at least that round.
pub fn window_start<R: HasRole>(roles: &[R], recent_n: usize, continue_round: bool) -> usize {
    let n = roles.len();
    let mut start = n.saturating_sub(recent_n);
    if continue_round {
        start = start.min(last_round_start(roles));
    }
    while start > 0 && start < n && roles[start].role() != Role::User {
        start -= 1;
    }
    // A history that begins with orphan tool results (sent that way by a client) cannot be
    // forwarded as it is; skip them.
    while start < n && roles[start].role() == Role::Tool {
        start += 1;
    }
    start
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

    fn check(history: &str, recent_n: usize, continue_round: bool, expected_window: &str) {
        let r = roles(history);
        let start = window_start(&r, recent_n, continue_round);
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
