//! Closed branches: when a client's history leaves the stored line (an edited earlier message,
//! a regenerated earlier reply), the stored messages past the point they share leave the main
//! line. They are kept, with the summary records that covered them, as a numbered closed
//! branch of the conversation: readable by people (the admin API, exports), never by the
//! request path (window, recall, summaries read only the main line).
//!
//! Closing is part of a commit ([`Store::commit`] with [`super::Change::branch_from_turn`]):
//! this file reads what the branch takes; the commit writes it in its one atomic step.

use super::records::{BranchRecord, ConversationMeta, StoredBranch, SummaryRecord};
use super::{Conversation, Store, StoreError};
use memproxy_base::identity::ConversationKey;

/// What closing a branch takes from the main line.
#[derive(Debug)]
pub(super) struct Closing {
    /// The branch as it will be stored.
    pub branch: StoredBranch,
    /// The main-line turns it takes.
    pub turns: Vec<u64>,
    /// The main-line summary records it takes, by number.
    pub summaries: Vec<u64>,
}

/// The summary records a branch from `from_turn` takes: those that reach it. An older one
/// covers only turns that stay, and still applies.
pub fn closed_by_branch(record: &SummaryRecord, from_turn: u64) -> bool {
    record.to_turn >= from_turn
}

impl Store {
    /// The closed branches of conversation `id`, oldest first, their bodies opened.
    pub fn branches(
        &self,
        key: &ConversationKey,
        id: u64,
    ) -> Result<Vec<StoredBranch>, StoreError> {
        let mut branches = self.engine.branches(key, id)?;
        for branch in &mut branches {
            self.open_messages(key, id, &mut branch.messages)?;
            for (_, record) in &mut branch.summaries {
                *record = self.open_summary(key, id, std::mem::take(record))?;
            }
        }
        Ok(branches)
    }

    /// Reads what a branch closed at `from_turn` takes from `conversation` (locked by the
    /// caller, whose commit writes it): the stored messages from that turn on, and the
    /// summary records that reach them. `meta` is the record the commit will write, numbering
    /// the branch.
    pub(super) fn closing(
        &self,
        conversation: &Conversation,
        meta: &ConversationMeta,
        from_turn: u64,
        now: i64,
    ) -> Result<Closing, StoreError> {
        let entries = &conversation.entries;
        let first = entries.partition_point(|e| e.turn < from_turn);
        let turns: Vec<u64> = entries[first..].iter().map(|e| e.turn).collect();
        let messages = if turns.is_empty() || conversation.meta.is_none() {
            Vec::new()
        } else {
            self.engine.messages(&conversation.key, meta.id, &turns)?
        };
        let mut summaries = Vec::new();
        let mut taken = Vec::new();
        if conversation.meta.is_some() {
            // Read opened, kept as stored (sealed): the branch takes the bytes as they are.
            for (number, bytes) in self.engine.summaries(&conversation.key, meta.id)? {
                let plain = self.open_summary(&conversation.key, meta.id, bytes.clone())?;
                let record: SummaryRecord = serde_json::from_slice(&plain)
                    .map_err(|err| StoreError::Corrupt(format!("summary {number}: {err}")))?;
                if closed_by_branch(&record, from_turn) {
                    taken.push(number);
                    summaries.push((number, bytes));
                }
            }
        }
        tracing::debug!(
            messages = turns.len(),
            summaries = taken.len(),
            "closing a branch"
        );
        Ok(Closing {
            branch: StoredBranch {
                record: BranchRecord {
                    number: meta.branches + 1,
                    forked_after_turn: first.checked_sub(1).map_or(0, |i| entries[i].turn),
                    closed_ms: now,
                },
                messages,
                summaries,
            },
            turns,
            summaries: taken,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{key, message, options};
    use crate::{Change, lock};
    use memproxy_base::message::Role;

    fn summary(number: u64, to_turn: u64) -> SummaryRecord {
        serde_json::from_value(serde_json::json!({
            "number": number, "text": format!("summary {number}"), "from_turn": 1,
            "to_turn": to_turn, "tokens": 2, "original_tokens": 10, "ratio": 0.2,
            "from_ms": 1, "to_ms": 2, "model": "m", "created_ms": 3, "heuristic": false,
        }))
        .unwrap()
    }

    #[tokio::test]
    async fn a_closed_branch_stays_sealed_in_the_engine_and_reads_plain() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), options()).unwrap();
        let handle = store.conversation(&key("c")).unwrap();
        let mut conversation = lock(&handle);
        let texts = ["q1", "a1", "abandoned-marker-7731", "a2"];
        let roles = [Role::User, Role::Assistant];
        let add = texts
            .iter()
            .enumerate()
            .map(|(i, text)| message(roles[i % 2], text))
            .collect();
        store
            .commit(
                &mut conversation,
                Change {
                    add,
                    ..Change::default()
                },
            )
            .unwrap();
        let id = conversation.meta.as_ref().unwrap().id;
        store
            .commit(
                &mut conversation,
                Change {
                    add: vec![message(Role::User, "edited")],
                    branch_from_turn: Some(3),
                    ..Change::default()
                },
            )
            .unwrap();
        assert!(!store.engine.any_trace_of(b"abandoned-marker-7731").unwrap());
        let branches = store.branches(&key("c"), id).unwrap();
        assert!(
            branches[0].messages[0]
                .message
                .get()
                .contains("abandoned-marker-7731")
        );
    }

    #[tokio::test]
    async fn a_commit_closes_a_branch_with_the_summaries_that_reach_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), options()).unwrap();
        let handle = store.conversation(&key("c")).unwrap();
        let mut conversation = lock(&handle);
        let roles = [Role::User, Role::Assistant];
        let six = (0..6)
            .map(|i| message(roles[i % 2], &"x".repeat(i + 1)))
            .collect();
        store
            .commit(
                &mut conversation,
                Change {
                    add: six,
                    ..Change::default()
                },
            )
            .unwrap();
        let id = conversation.meta.as_ref().unwrap().id;
        for record in [summary(1, 2), summary(2, 4)] {
            assert!(store.save_summary(&conversation, id, &record).unwrap());
        }

        // Turns 4-6 leave the main line with summary 2 (it reaches turn 4); the new reply is
        // stored in the same write.
        store
            .commit(
                &mut conversation,
                Change {
                    add: vec![message(Role::Assistant, "new")],
                    branch_from_turn: Some(4),
                    ..Change::default()
                },
            )
            .unwrap();
        let turns = |c: &Conversation| c.entries.iter().map(|e| e.turn).collect::<Vec<_>>();
        assert_eq!(turns(&conversation), [1, 2, 3, 7]);
        let meta = conversation.meta.clone().unwrap();
        assert_eq!((meta.branches, meta.message_count), (1, 4));
        let remaining: u64 = conversation
            .entries
            .iter()
            .map(|e| u64::from(e.tokens))
            .sum();
        assert_eq!(meta.total_tokens, remaining);
        assert_eq!(
            store.latest_summary(&key("c"), id).unwrap(),
            Some(summary(1, 2))
        );
        let branches = store.branches(&key("c"), id).unwrap();
        assert_eq!(branches.len(), 1);
        assert_eq!(
            branches[0].record,
            BranchRecord {
                number: 1,
                forked_after_turn: 3,
                closed_ms: branches[0].record.closed_ms,
            }
        );
        assert_eq!(
            branches[0]
                .messages
                .iter()
                .map(|m| m.turn)
                .collect::<Vec<_>>(),
            [4, 5, 6]
        );
        assert_eq!(
            branches[0]
                .summaries
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>(),
            [2]
        );
        // What is stored reads back the same.
        store.reload(&mut conversation).unwrap();
        assert_eq!(turns(&conversation), [1, 2, 3, 7]);
        assert_eq!(conversation.meta.as_ref().unwrap().branches, 1);
    }
}
