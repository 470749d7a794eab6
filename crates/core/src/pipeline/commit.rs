//! Commit: the exchange's new messages and the reply, written in one atomic batch once the
//! upstream response has completed, then made durable (group commit) before the client sees the
//! end of the response.
//!
//! The plan made before forwarding is reused when the conversation has not changed since; when
//! another request committed in between, the request is aligned again against what is stored
//! now, so concurrent requests never store a message twice.
//!
//! The TTL the request ran with is remembered here too, and only here: once its exchange is
//! stored. A request refused or failed (bad body, upstream error, a stream cut) writes nothing.
//!
//! A branch (the client's history left the stored line) is closed in the same write as the
//! exchange: the stored messages past the shared run leave the main line, kept as a closed
//! branch with the summaries that reach them.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde_json::value::RawValue;

use super::catch_up::reread;
use super::reconcile::{Alignment, Mark, align};
use super::window::trim_start;
use crate::longterm::memories::MemoryRecord;
use crate::longterm::{ExtractionCall, ExtractionRule};
use crate::memory::Memory;
use crate::worker::Backoff;
use memproxy_base::identity::ConversationKey;
use memproxy_base::message::{HasRole, Message, Role};
use memproxy_base::tokens;
use memproxy_store::{
    AddedVectors, Change, Conversation, Entry, LedgerTotals, Origin, OwnerKey, Quantised,
    StoreError, StoredMessage, lock,
};

/// How often a commit re-plans against a conversation that keeps changing under it. In one
/// process the conversation's lock makes a conflict rare; replicas sharing a store race for
/// every commit of a busy conversation, so a commit backs off a little more each time
/// ([`back_off`]) and tries up to this many times before the exchange is given up (degraded).
const MAX_ATTEMPTS: usize = 16;

/// The wait between two attempts after another replica's commit won.
const COMMIT_BACKOFF: Backoff = Backoff {
    first: Duration::from_millis(1),
    cap: Duration::from_millis(8),
};

/// The most stored messages one write trims; a longer trim goes in batches of this size.
pub const TRIM_BATCH: usize = 512;

/// A planned write: the change, how many stored messages it trims, and how many of the
/// exchange's own oldest messages are left out to stay within `max_messages`.
struct PlannedWrite {
    change: Change,
    trimmed: usize,
    dropped_new: usize,
}

/// The exchange's messages as they are stored: the request's new ones and the reply, with the
/// reply's searchable text for the recall index.
struct ReadyToStore {
    new: Vec<StoredMessage>,
    reply: StoredMessage,
    reply_search: String,
}

/// A commit done: the messages the conversation holds afterwards, and whether it was written
/// where the answer arrived (else on the blocking pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Committed {
    pub messages: usize,
    pub here: bool,
}

/// Where a commit's writes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Where the answer arrived, a runtime's thread: one try, no back-off.
    Here,
    /// The blocking pool: every try a commit may take.
    Pool,
}

/// An exchange given back for the pool: its reply as it came, or already made ready.
enum Pending {
    Raw(Box<RawValue>),
    Ready(ReadyToStore),
}

/// The most bytes of text (the reply as it came, and the new messages' searchable text) a
/// commit written where the answer arrived may hold ([`Exchange::write_here`]): its parse,
/// sealing and index update stay within tens of microseconds. The same bound as the body of a
/// plan made where it arrives (the edge's `PLAN_NOW_MAX_BODY`).
const WRITE_HERE_MAX_BYTES: usize = 16 * 1024;

/// What one write of a commit did.
enum Written {
    /// A batch of a long trim, of this many stored messages: the exchange is still to write.
    TrimBatch(usize),
    /// The exchange: the commit is done.
    Exchange,
}

/// The stored turns the exchange's write takes off the main line.
struct Leaving {
    /// Every one: trimmed, a replaced reply, or closed into a branch.
    removed: Vec<u64>,
    /// Those of a branch closed.
    closed: Vec<u64>,
    /// What leaves what was said (not a trim): a closed branch, a replaced reply.
    unsaid: Vec<u64>,
}

impl Leaving {
    fn of(entries: &[Entry], change: &Change, alignment: Alignment) -> Leaving {
        let closed: Vec<u64> = change
            .branch_from_turn
            .map(|from| {
                let first = entries.partition_point(|e| e.turn < from);
                entries[first..].iter().map(|e| e.turn).collect()
            })
            .unwrap_or_default();
        let mut removed = change.remove_turns.clone();
        removed.extend(&closed);
        let mut unsaid = closed.clone();
        if matches!(alignment, Alignment::ReplaceLastReply { .. }) {
            unsaid.extend(entries.last().map(|e| e.turn));
        }
        Leaving {
            removed,
            closed,
            unsaid,
        }
    }
}

/// Everything a commit needs, prepared before the request is forwarded.
#[derive(Debug)]
pub struct Exchange {
    pub key: ConversationKey,
    pub handle: Arc<Mutex<Conversation>>,
    /// Every conversation message of the request (instructions left out), as marks.
    pub marks: Vec<Mark>,
    /// The plan: what is new and whether the last reply is replaced.
    pub alignment: Alignment,
    /// The request's new messages: its conversation messages from `alignment.from()` on.
    pub new_turns: Vec<Message>,
    /// Their token counts, taken once when planning.
    pub new_tokens: Vec<u32>,
    /// Their searchable text for the recall index, from the same parse.
    pub new_texts: Vec<String>,
    /// The conversation's `next_turn` when the plan was made (`None`: not yet stored).
    pub planned_next_turn: Option<u64>,
    pub max_messages: usize,
    pub model: Option<String>,
    /// Tokens of the prompt forwarded for this exchange.
    pub prompt_tokens: u64,
    /// Tokens the request would have sent without memproxy (the token ledger).
    pub history_tokens: u64,
    /// Of the prompt, the tokens the upstream reported cached (set by the edge once the
    /// answer's usage is read).
    pub cached_tokens: u64,
    /// The TTL the request ran with (`ttl` setting or `X-Memory-Ttl`), remembered for the
    /// conversation once the exchange is stored.
    pub ttl: Option<Duration>,
    /// The user whose archive the exchange is copied into (long-term memory), if any.
    pub user: Option<OwnerKey>,
    /// When memories are extracted for that user, and whether this exchange may queue an
    /// extraction.
    pub extraction_rule: Option<ExtractionRule>,
    /// The model and credentials of a due extraction (added by the edge when the plan says
    /// one is due, as for summaries).
    pub extraction: Option<ExtractionCall>,
    /// Memories the prompt used whose last access is to be refreshed (their decay restarts).
    pub refresh_memories: Vec<(OwnerKey, MemoryRecord)>,
    /// Recall's query and the vector made of it: a stored turn of that same searchable text
    /// takes this vector instead of being embedded again in the background.
    pub query_vector: Option<(String, Vec<f32>)>,
}

impl Exchange {
    /// Stores the new messages and `reply` and remembers the request's TTL, then waits for
    /// durability. Where the answer arrived when the exchange may be written there
    /// ([`Exchange::write_here`]); else on the blocking pool, so the store's I/O and the wait
    /// for the conversation's lock never hold a runtime thread.
    pub async fn commit(
        self,
        memory: Arc<Memory>,
        reply: Box<RawValue>,
    ) -> Result<Committed, StoreError> {
        let store = Arc::clone(&memory.store);
        // A panic here fails the commit as one on the pool would (its task's error), not the
        // request's task: the answer still goes out, degraded.
        let here = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.write_here(&memory, reply)
        }));
        let committed = match here {
            Err(panic) => {
                let said = super::panic_said(panic.as_ref());
                return Err(StoreError::Engine(
                    format!("the commit panicked: {said}").into(),
                ));
            }
            Ok(Ok(written)) => Committed {
                messages: written?,
                here: true,
            },
            Ok(Err(pending)) => tokio::task::spawn_blocking(move || {
                let ready = match pending {
                    Pending::Raw(reply) => self.ready_to_store(reply, memory.clock.now_ms())?,
                    Pending::Ready(ready) => ready,
                };
                self.write(&memory, &ready).map(|messages| Committed {
                    messages,
                    here: false,
                })
            })
            .await
            .map_err(|err| StoreError::Engine(Box::new(err)))??,
        };
        store.sync().await?;
        Ok(committed)
    }

    /// The commit made on the calling thread, a runtime's worker, when nothing in it waits or
    /// blocks there (as a plan may be, `plan::Free`): the store is this process's own and
    /// its writes succeed, the conversation's lock is free, the exchange is small
    /// ([`WRITE_HERE_MAX_BYTES`]), and no user's long-term memory is written. Its one write
    /// goes into the engine's memory and log buffer (durability follows in the group flush,
    /// awaited); with the static table the exchange's vectors are made here too, a table's
    /// additions over at most those bytes ([`Embedding::in_commit`](crate::embedding::Embedding::in_commit)). A stored exchange then takes one hop to the blocking pool (its plan) instead
    /// of two. Anything else, and a write that finds the conversation changed or a long trim
    /// to batch, gives the exchange back (`Err`, nothing written) for the pool.
    fn write_here(
        &self,
        memory: &Memory,
        reply: Box<RawValue>,
    ) -> Result<Result<usize, StoreError>, Pending> {
        let bytes = reply.get().len() + self.new_texts.iter().map(String::len).sum::<usize>();
        if bytes > WRITE_HERE_MAX_BYTES
            || memory.store.shared()
            || self.user.is_some()
            || !self.refresh_memories.is_empty()
            || memory.store.write_failure().is_some()
        {
            return Err(Pending::Raw(reply));
        }
        let ready = match self.ready_to_store(reply, memory.clock.now_ms()) {
            Ok(ready) => ready,
            Err(err) => return Ok(Err(err)),
        };
        let conversation = match self.handle.try_lock() {
            Ok(held) => held,
            Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Err(Pending::Ready(ready)),
        };
        match self.write_under(memory, &ready, conversation, Place::Here) {
            Some(written) => Ok(written),
            None => Err(Pending::Ready(ready)),
        }
    }

    /// The commit's writes on the blocking pool, under the conversation's lock.
    fn write(&self, memory: &Memory, ready: &ReadyToStore) -> Result<usize, StoreError> {
        let conversation = lock(&self.handle);
        // On the pool every write is tried until it is done or fails.
        self.write_under(memory, ready, conversation, Place::Pool)
            .unwrap_or(Err(StoreError::Stale))
    }

    /// The commit's writes, under the conversation's lock: trims past [`TRIM_BATCH`] messages
    /// go first in batches of their own (each an atomic write of whole old messages), then the
    /// exchange and what is left to trim, in one atomic write. `None` (only [`Place::Here`]):
    /// nothing was written, the pool is to try.
    fn write_under(
        &self,
        memory: &Memory,
        ready: &ReadyToStore,
        mut conversation: MutexGuard<'_, Conversation>,
        place: Place,
    ) -> Option<Result<usize, StoreError>> {
        let store = &memory.store;
        let mut attempt = 0;
        // Stored messages this commit's own trim batches removed from the front.
        let mut batched = 0;
        loop {
            attempt += 1;
            let alignment = self.alignment_now(&conversation, batched);
            let planned = self.change(&conversation.entries, alignment, &ready.new, &ready.reply);
            // A long trim (a conversation far over `max_messages`) goes in batches, so no
            // one write grows with it.
            let written = if planned.trimmed > TRIM_BATCH {
                if place == Place::Here {
                    return None;
                }
                self.write_trim_batch(memory, &mut conversation)
            } else {
                self.write_exchange(memory, &mut conversation, alignment, planned, ready)
            };
            match written {
                Ok(Written::TrimBatch(count)) => {
                    batched += count;
                    attempt = 0;
                }
                Ok(Written::Exchange) => break,
                // The back-off sleeps: not on a runtime's thread.
                Err(StoreError::Stale) if place == Place::Here => return None,
                Err(StoreError::Stale) if attempt < MAX_ATTEMPTS => {
                    back_off(memory, attempt);
                    if let Err(err) = reread(memory, &self.key, &mut conversation) {
                        return Some(Err(err));
                    }
                }
                Err(err) => return Some(Err(err)),
            }
        }
        if !self.refresh_memories.is_empty() {
            memory
                .longterm
                .refresh(store, &self.refresh_memories, memory.clock.now_ms());
        }
        // Under the conversation's lock, so a delete cannot come between the exchange and its
        // TTL record; the flush after this makes both durable.
        memory.remember_ttl(&self.key, self.ttl);
        let count = conversation.entries.len();
        drop(conversation);
        store.touch(&self.key, &self.handle);
        Some(Ok(count))
    }

    /// The request's new messages and `reply` as they are stored, with the reply's
    /// searchable text for the recall index.
    fn ready_to_store(&self, reply: Box<RawValue>, at_ms: i64) -> Result<ReadyToStore, StoreError> {
        let model = self.model.as_deref();
        let reply = Message::parse(reply, "reply")
            .map_err(|err| StoreError::Corrupt(format!("the reply is not a message: {err}")))?;
        let (reply_text, reply_search) = reply.text_and_search_text();
        let reply_tokens = tokens::count_message(model, &reply_text);
        let reply = stored_message(&reply, Origin::Reply, reply_tokens, at_ms);
        let new: Vec<StoredMessage> = self
            .new_turns
            .iter()
            .zip(&self.new_tokens)
            .map(|(m, tokens)| stored_message(m, Origin::Client, *tokens, at_ms))
            .collect();
        Ok(ReadyToStore {
            new,
            reply,
            reply_search,
        })
    }

    /// The plan's alignment while the conversation is as planned (moved by this commit's own
    /// trim batches, `batched` messages); once another commit changed it, the request aligned
    /// again against what is stored now.
    fn alignment_now(&self, conversation: &Conversation, batched: usize) -> Alignment {
        let current = conversation.meta.as_ref().map(|m| m.next_turn);
        if current == self.planned_next_turn {
            after_trim(self.alignment, batched)
        } else {
            let entries = &conversation.entries;
            let now = align(entries, last_is_reply(entries), &self.marks);
            Alignment::settle(self.alignment, now)
        }
    }

    /// One batch of a long trim: the [`TRIM_BATCH`] oldest stored messages removed in a write
    /// of their own, and from the recall index.
    fn write_trim_batch(
        &self,
        memory: &Memory,
        conversation: &mut Conversation,
    ) -> Result<Written, StoreError> {
        let current = conversation.meta.as_ref().map(|m| m.next_turn);
        let batch: Vec<u64> = conversation.entries[..TRIM_BATCH]
            .iter()
            .map(|e| e.turn)
            .collect();
        let trim = Change {
            remove_turns: batch.clone(),
            ..Change::default()
        };
        memory.store.commit(conversation, trim)?;
        let after = conversation.meta.as_ref().map_or(1, |m| m.next_turn);
        memory
            .recall
            .apply(&self.key, current, &batch, &[], &[], after);
        Ok(Written::TrimBatch(batch.len()))
    }

    /// The exchange's write: its messages and reply, what is left to trim and a branch to
    /// close, with what memproxy's own calls spent for the conversation since its last commit
    /// (given back to the ledger when the write fails). Once stored, the recall index and
    /// the user's long-term memory follow.
    fn write_exchange(
        &self,
        memory: &Memory,
        conversation: &mut Conversation,
        alignment: Alignment,
        planned: PlannedWrite,
        ready: &ReadyToStore,
    ) -> Result<Written, StoreError> {
        let store = &memory.store;
        let current = conversation.meta.as_ref().map(|m| m.next_turn);
        let leaving = Leaving::of(&conversation.entries, &planned.change, alignment);
        let added_count = planned.change.add.len();
        let mut change = planned.change;
        let background = memory.ledger.take_pending(&self.key);
        change.ledger.background_tokens = background;
        let still_new = self.still_new(alignment, &self.new_texts);
        let mut added_texts = still_new[planned.dropped_new.min(still_new.len())..].to_vec();
        added_texts.push(ready.reply_search.clone());
        // With an embedder cheap enough to run here (a table's additions), the added
        // messages' vectors are made now, so the next request finds them by meaning; else
        // they are made in the background after the commit. A derived embedder's (the
        // table's) go to the recall index alone: an index built from the store makes them
        // again from the texts. Another's are written with the messages.
        let made = memory
            .embedding
            .in_commit(&added_texts, self.query_vector.as_ref());
        // Quantised once, for the store and the recall index alike.
        let quantised: Vec<Option<Quantised>> = made.as_ref().map_or_else(Vec::new, |(_, v)| {
            v.iter().map(|v| memproxy_store::quantise(v)).collect()
        });
        let derived = memory.embedding.derived().is_some();
        change.vectors = made
            .as_ref()
            .filter(|_| !derived)
            .map(|(space, _)| AddedVectors {
                space: space.clone(),
                of: quantised.clone(),
            });
        if let Err(err) = store.commit(conversation, change) {
            memory.ledger.give_back(&self.key, background);
            return Err(err);
        }
        if !leaving.closed.is_empty() {
            memory
                .branches_closed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(
                closed = leaving.closed.len(),
                branch = conversation.meta.as_ref().map_or(0, |m| m.branches),
                "the client's history left the stored line: a branch was closed"
            );
        }
        let entries = &conversation.entries;
        let added: Vec<(u64, String)> = entries[entries.len() - added_count..]
            .iter()
            .map(|e| e.turn)
            .zip(added_texts)
            .collect();
        let vectors: Vec<(u64, Quantised)> = match made {
            Some((_, floats)) => {
                // A text with nothing to embed has a vector of zeros, which is not counted.
                let made = floats
                    .iter()
                    .filter(|v| v.iter().any(|x| *x != 0.0))
                    .count();
                memory.embedding.made_in_commit(made);
                // One the store could not take (empty, not finite) is all zeros in the index.
                let held = quantised
                    .into_iter()
                    .zip(&floats)
                    .map(|(q, v)| q.unwrap_or_else(|| crate::recall::vectors::quantise(v)));
                added.iter().map(|(turn, _)| *turn).zip(held).collect()
            }
            None => Vec::new(),
        };
        let after = conversation.meta.as_ref().map_or(1, |m| m.next_turn);
        memory.recall.apply(
            &self.key,
            current,
            &leaving.removed,
            &added,
            &vectors,
            after,
        );
        let archived = self.user.as_ref().and_then(|user| {
            let extraction = self
                .extraction_rule
                .map(|rule| (rule, self.extraction.as_ref()));
            memory
                .longterm
                .after_commit(store, user, conversation, &leaving.unsaid, extraction)
        });
        // Their vectors when not made above, and the archived copies', are made in the
        // background, off this request's path.
        let id = conversation.meta.as_ref().map_or(0, |m| m.id);
        let unmade: &[(u64, String)] = if vectors.is_empty() { &added } else { &[] };
        memory
            .embedding
            .after_commit(&self.key, id, unmade, archived, self.query_vector.as_ref());
        Ok(Written::Exchange)
    }

    /// Of the planned new messages, those still new under `alignment` (a concurrent commit may
    /// have stored some; never more than were planned).
    fn still_new<'a, T>(&self, alignment: Alignment, new: &'a [T]) -> &'a [T] {
        let skip = alignment
            .from()
            .saturating_sub(self.alignment.from())
            .min(new.len());
        &new[skip..]
    }

    /// The change that applies `alignment` and the reply to `entries`, trimming the oldest
    /// rounds past `max_messages`: stored ones first, then, when the exchange alone is longer,
    /// its own oldest messages (the reply is always kept), so a commit never leaves more than
    /// `max_messages`. A branch's stored messages leave the main line in the same change.
    fn change(
        &self,
        entries: &[Entry],
        alignment: Alignment,
        new: &[StoredMessage],
        reply: &StoredMessage,
    ) -> PlannedWrite {
        let mut remove_turns = Vec::new();
        let kept = alignment.kept(entries.len());
        let mut branch_from_turn = None;
        match alignment {
            Alignment::ReplaceLastReply { .. } => {
                remove_turns.extend(entries.last().map(|e| e.turn))
            }
            Alignment::Branch { .. } => branch_from_turn = entries.get(kept).map(|e| e.turn),
            Alignment::Append { .. } => {}
        }
        let mut add: Vec<StoredMessage> = self.still_new(alignment, new).to_vec();
        add.push(reply.clone());
        let cut = self.cut(&entries[..kept], add.iter().map(|m| m.role));
        let trimmed = cut.min(kept);
        remove_turns.extend(entries[..trimmed].iter().map(|e| e.turn));
        let dropped_new = (cut - trimmed).min(add.len() - 1);
        add.drain(..dropped_new);
        PlannedWrite {
            change: Change {
                remove_turns,
                add,
                tokens_forwarded: self.prompt_tokens,
                ledger: LedgerTotals {
                    exchanges: 1,
                    history_tokens: self.history_tokens,
                    cached_tokens: self.cached_tokens,
                    background_tokens: 0,
                },
                branch_from_turn,
                vectors: None,
            },
            trimmed,
            dropped_new,
        }
    }

    /// How many of the `kept` stored messages and then the `added` ones are trimmed when they
    /// join: whole rounds, to at most `max_messages`.
    fn cut<I>(&self, kept: &[Entry], added: I) -> usize
    where
        I: Iterator<Item = Role> + Clone,
    {
        let len = kept.len() + added.clone().count();
        let roles = kept.iter().map(HasRole::role).chain(added);
        trim_start(len, roles, self.max_messages).min(len.saturating_sub(1))
    }

    /// The number of messages the conversation will hold once this exchange is committed as
    /// planned (for `X-Memory-Turns` on a stream, sent before the commit).
    pub fn planned_count(&self, entries: &[Entry]) -> usize {
        let kept = self.alignment.kept(entries.len());
        let added = self
            .new_turns
            .iter()
            .map(|m| m.role)
            .chain(std::iter::once(Role::Assistant));
        let cut = self.cut(&entries[..kept], added);
        kept + self.new_turns.len() + 1 - cut
    }
}

/// `alignment` once this commit's own trim batches removed the `trimmed` oldest stored
/// messages: a branch's index into the stored line moves down with them.
fn after_trim(alignment: Alignment, trimmed: usize) -> Alignment {
    match alignment {
        Alignment::Branch { keep, from } => Alignment::Branch {
            keep: keep.saturating_sub(trimmed),
            from,
        },
        other => other,
    }
}

/// True when the stored last message is an upstream reply.
pub fn last_is_reply(entries: &[Entry]) -> bool {
    entries.last().is_some_and(|e| e.origin == Origin::Reply)
}

/// A message ready to store, with its token count.
fn stored_message(message: &Message, origin: Origin, tokens: u32, at_ms: i64) -> StoredMessage {
    StoredMessage {
        turn: 0,
        role: message.role,
        origin,
        at_ms,
        tokens,
        fingerprint: message.fingerprint,
        message: message.raw.clone(),
        exchange: None,
    }
}

/// After a conflict with another replica's commit (a shared store): waits a little, more at
/// each attempt (1, 2, 4, then 8 ms) and by a varying amount (up to as much again), so two
/// replicas committing to one conversation stop colliding instead of retrying in step. In one
/// process a conflict has no one to wait for.
fn back_off(memory: &Memory, attempt: usize) {
    if !memory.store.shared() {
        return;
    }
    let attempt = u32::try_from(attempt).unwrap_or(u32::MAX);
    std::thread::sleep(COMMIT_BACKOFF.jittered(attempt));
}
