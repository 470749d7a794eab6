//! Plan: the stages before forwarding, run under the conversation's lock: reconcile the request
//! with the stored history, pick the recent window, recall older turns, fit the token budget,
//! and assemble the prompt. Produces the prompt to forward and the exchange to commit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::assemble::{CacheHints, Prompt, Split, is_injected_echo, split_request};
use super::budget::{self, Dropped, Fitted};
use super::catch_up::catch_up;
use super::commit::{Exchange, last_is_reply};
use super::recalled::{RecalledTurn, elsewhere_turns, fit_recalled, recalled_turns, render};
use super::reconcile::{Alignment, Mark, align, rebase};
use super::summarized::{SummaryInput, adopt_at_jumps, plan_summary};
use super::window::{auto_step, summary_adoption_cutoff, window_start};
use crate::embedding::{Ahead, Lexical, RecallMode};
use crate::longterm::ExtractionRule;
use crate::longterm::memories::{self, Chosen};
use crate::memory::Memory;
use crate::recall::hybrid::Scored;
use crate::recall::{Later, Query, QueryVector};
use crate::settings::MemorySettings;
use crate::summary::{DeferredSummary, Job, SummaryRecord};
use memproxy_base::identity::ConversationKey;
use memproxy_base::message::{Message, Role};
use memproxy_base::model::Credentials;
use memproxy_base::tokens;
use memproxy_store::{Conversation, OwnerKey, StoreError, StoredMessage, lock, tokens_between};

/// A memory used in a prompt is marked accessed again once this long has passed since.
const REFRESH_AFTER_MS: i64 = 3_600_000;

/// How long the stages of a plan took (the edge reports them as metrics).
#[derive(Debug, Clone, Copy, Default)]
pub struct Timings {
    pub reconcile: Duration,
    pub recall: Duration,
    pub budget: Duration,
    pub assemble: Duration,
    /// A summary made on the request's path (synchronous compression).
    pub summary: Option<Duration>,
}

/// A planned exchange: the prompt to forward, what to commit afterwards, and what the edge
/// reports of it.
#[derive(Debug)]
pub struct Plan {
    pub prompt: Prompt,
    pub exchange: Exchange,
    /// What the headers, the receipt, the metrics and the admin preview say of the plan.
    pub report: Report,
    /// A new summary is due: the job (without credentials; the caller adds them).
    pub summary_due: Option<Job>,
    /// Memories are due to be extracted once this exchange is stored: the model to use
    /// (the caller adds the credentials into `exchange.extraction`).
    pub extraction_due: Option<String>,
    pub timings: Timings,
}

/// What a plan is reported as: none of it is forwarded or committed.
#[derive(Debug)]
pub struct Report {
    /// Messages stored now (before this exchange).
    pub stored_count: usize,
    /// Messages stored once this exchange commits as planned.
    pub planned_count: usize,
    /// Turns recalled into the prompt, oldest first.
    pub recalled_turns: Vec<u64>,
    /// The recalled turns as recall scored them (the fused score, 0..1, and its parts), best
    /// first.
    pub recalled_scores: Vec<Scored>,
    /// Turns the relevance floor kept out, best first.
    pub under_floor: Vec<Scored>,
    /// How recall searched: words and meaning, or words alone and why.
    pub recall_mode: RecallMode,
    /// The conversation's recalled turns cut to their most relevant passage
    /// (`relevance_max_tokens`), in turn order.
    pub excerpted_turns: Vec<u64>,
    /// The `window_step` in effect (`auto` resolved).
    pub window_step: usize,
    /// Turns recalled from the user's other conversations (long-term memory), best first:
    /// (conversation, turn, score).
    pub recalled_elsewhere: Vec<(String, u64, f32)>,
    /// The forwarded prompt's size in tokens, from stored counts.
    pub prompt_tokens: u64,
    /// What the token budget did, when one is set.
    pub fitted: Option<Fitted>,
    /// What the token budget dropped, by name (for the receipt).
    pub dropped: Dropped,
    /// The summary in the prompt.
    pub summary: Option<SummaryRecord>,
    /// The user's memories in the prompt, with their scores (long-term memory).
    pub memories: Vec<Chosen>,
    /// Tokens of the whole history this prompt stands for: what is stored plus the new
    /// messages, and never less than the prompt's (which carries the instructions too).
    pub history_tokens: u64,
}

/// What one request may add to memory; past it the request is refused before its new
/// messages are counted further or stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    pub max_new_messages: usize,
    pub max_new_tokens: u64,
    /// A plan for a request that will be forwarded (it may reserve a summary job and write
    /// the heuristic stand-in); `false` for a preview, which stores nothing.
    pub writes: bool,
}

/// Why a plan could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Memory is unavailable: the request goes on with the client's own messages.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The request adds more than a limit allows: refused.
    #[error(
        "the request adds {count} new messages to the conversation; at most {limit} may be added by one request (limits.max_new_messages)"
    )]
    TooManyMessages { count: usize, limit: usize },
    #[error(
        "the request's new messages hold more than {limit} tokens; one request may add at most that many (limits.max_new_tokens)"
    )]
    TooManyTokens { limit: u64 },
}

/// Plans a request of conversation `key`; with a `user` (and `long_term_enabled`) long-term
/// memory takes part (`crate::longterm`): the user's other conversations are searched too, and
/// a conversation deleted by its TTL is rebuilt from the user's archive.
///
/// The stages run in the order of the diagram (ARCHITECTURE.md), under the conversation's
/// lock, each a function below with its own output: reconcile → window → summary → recall →
/// long-term memory → budget → assemble.
pub fn plan(
    memory: &Memory,
    key: &ConversationKey,
    user: Option<&str>,
    settings: &MemorySettings,
    limits: RequestLimits,
    model: Option<String>,
    messages: Vec<Message>,
) -> Result<Plan, PlanError> {
    // A store whose writes fail (a full disk) is not planned against: what it holds in memory
    // may never reach the disk. It is retried here, once a retry is due.
    memory.writable()?;
    let user = long_term_user(memory, key, user, settings, limits);
    let started = Instant::now();
    let handle = memory.store.conversation(key)?;
    let to = To {
        memory,
        key,
        user,
        settings,
        limits,
    };
    plan_under(&to, &handle, lock(&handle), started, model, messages)
}

/// A conversation whose plan can be made on the calling thread, a runtime's worker, without
/// waiting or blocking there: it is cached, nobody holds it, it is not long
/// ([`PLAN_NOW_MAX_ENTRIES`]), and nothing the plan does waits for another thread or the
/// network (the store is this process's own, so there is no catch-up with other replicas; the
/// embedder is not a model worth a thread of its own, whose answer recall would wait for; no
/// user's long-term memory, read from the store, takes part). A stored exchange qualifies
/// too: its commit is written where its answer arrives when small
/// (`commit.rs::Exchange::write_here`), so it holds the lock for tens of microseconds, not
/// across a hop to the pool (before that, planning stored exchanges here made them slower:
/// `scripts/perf.sh`'s stored row ×0.59). Any other plan is made on the blocking pool
/// ([`plan`]).
#[derive(Debug)]
pub struct Free(memproxy_store::Handle);

impl Free {
    /// `key`'s conversation, when its plan can be made now.
    pub fn now(
        memory: &Memory,
        key: &ConversationKey,
        user: Option<&str>,
        settings: &MemorySettings,
    ) -> Option<Free> {
        if memory.store.shared()
            || memory.embedding.worth_a_thread()
            || (user.is_some() && settings.long_term_enabled)
        {
            return None;
        }
        let handle = memory.store.cached(key)?;
        let free = handle
            .try_lock()
            .is_ok_and(|conversation| conversation.entries.len() <= PLAN_NOW_MAX_ENTRIES);
        free.then_some(Free(handle))
    }
}

/// A conversation of at most this many stored messages is planned where the request is
/// ([`Free`]): its recall searches few enough turns to take less than a millisecond.
const PLAN_NOW_MAX_ENTRIES: usize = 1_000;

/// [`plan`] of a conversation found [`Free`]. Its lock is taken without waiting; when a
/// request on another thread took it meanwhile, or the store's writes are failing (`plan`
/// retries them, which reopens the store: not work for here), the plan is not made here:
/// `Err` gives the messages back, for [`plan`] on the blocking pool.
pub fn plan_free(
    memory: &Memory,
    key: &ConversationKey,
    settings: &MemorySettings,
    limits: RequestLimits,
    model: Option<String>,
    messages: Vec<Message>,
    free: Free,
) -> Result<Result<Plan, PlanError>, Vec<Message>> {
    let started = Instant::now();
    let Free(handle) = free;
    let conversation = match handle.try_lock() {
        Ok(held) => held,
        Err(std::sync::TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return Err(messages),
    };
    if memory.store.write_failure().is_some() {
        return Err(messages);
    }
    let to = To {
        memory,
        key,
        user: None,
        settings,
        limits,
    };
    Ok(plan_under(
        &to,
        &handle,
        conversation,
        started,
        model,
        messages,
    ))
}

/// Whose plan it is and under what settings.
struct To<'a> {
    memory: &'a Memory,
    key: &'a ConversationKey,
    user: Option<OwnerKey>,
    settings: &'a MemorySettings,
    limits: RequestLimits,
}

/// The stages, with the conversation's lock held.
fn plan_under(
    to: &To<'_>,
    handle: &memproxy_store::Handle,
    mut conversation: std::sync::MutexGuard<'_, memproxy_store::Conversation>,
    started: Instant,
    model: Option<String>,
    messages: Vec<Message>,
) -> Result<Plan, PlanError> {
    let To {
        memory,
        key,
        ref user,
        settings,
        limits,
    } = *to;
    let mut timings = Timings::default();
    // Another replica sharing the store may have written since this one cached it.
    catch_up(memory, key, &mut conversation)?;
    // The question's embedding starts before reconcile, from what the request most likely
    // adds; reconcile confirms it (`embed_ahead`).
    let early = likely_query(settings, user.as_ref(), &conversation, &messages)
        .and_then(|text| memory.embedding.ahead(text));
    let on = Planning {
        memory,
        conversation: &conversation,
        key,
        user: user.as_ref(),
        settings,
        limits,
        model: model.as_deref(),
    };

    let request = reconciled(&on, messages)?;
    timings.reconcile = started.elapsed();
    // The new message's embedding on another thread, confirmed (or started) now: the window,
    // the summary and the words' search run meanwhile (`recalled` takes it).
    let ahead = embed_ahead(&on, &request, early);
    let latest_summary = if settings.compression_enabled {
        memory.store.newest_summary(&conversation)?
    } else {
        None
    };
    // What precedes the window: the instructions and the summary.
    let head =
        request.instruction_tokens + latest_summary.as_ref().map_or(0, |r| u64::from(r.tokens));
    let steps = Steps { settings, head };
    let mut window = windowed(&on, &request, &steps)?;
    let mut summary = summarized(&on, &request, &window, latest_summary)?;

    let started = Instant::now();
    let mut recall = recalled(&on, &request, &window, &steps, ahead)?;
    timings.recall = started.elapsed();
    let long_term = long_term(
        &on,
        &request,
        &window,
        recall.query.as_deref(),
        recall.vector.as_deref(),
        &mut summary,
    );

    let started = Instant::now();
    let budget = budgeted(
        &on,
        &request,
        &summary,
        &long_term,
        &mut recall.turns,
        &mut window.messages,
    );
    timings.budget = started.elapsed();

    let started = Instant::now();
    let staged = Staged {
        request,
        window,
        summary,
        recall,
        long_term,
        budget,
    };
    let mut plan = assembled(&on, handle, staged);
    drop(conversation);
    timings.assemble = started.elapsed();
    plan.timings = timings;
    Ok(plan)
}

/// What every stage of one plan reads: the conversation (locked), whose request it is, and
/// the settings and limits it runs under.
struct Planning<'a> {
    memory: &'a Memory,
    conversation: &'a memproxy_store::Conversation,
    key: &'a ConversationKey,
    /// The user, when long-term memory takes part.
    user: Option<&'a OwnerKey>,
    settings: &'a MemorySettings,
    limits: RequestLimits,
    /// The request's model.
    model: Option<&'a str>,
}

/// The user whose long-term memory takes part (with `long_term_enabled`); a conversation of
/// theirs deleted by its TTL is rebuilt from their archive first (not by a preview).
fn long_term_user(
    memory: &Memory,
    key: &ConversationKey,
    user: Option<&str>,
    settings: &MemorySettings,
    limits: RequestLimits,
) -> Option<OwnerKey> {
    let user = user
        .filter(|_| settings.long_term_enabled)
        .map(|user| OwnerKey::user(&key.tenant, user))?;
    if limits.writes
        && let Err(err) = memory.longterm.rebuild(&memory.store, &user, key)
    {
        tracing::warn!(error = %err, "rebuilding the conversation from the user's archive failed");
    }
    Some(user)
}

/// The reconcile stage's output: the request's messages aligned with the stored line.
struct Reconciled {
    /// The request's messages (memproxy's own echoed back left out), instructions included.
    messages: Vec<Message>,
    /// The indexes in `messages` of the conversation's messages (not instructions); of a
    /// rebase, only those not stored yet.
    turn_index: Vec<usize>,
    marks: Vec<Mark>,
    alignment: Alignment,
    /// A client's own compaction (`reconcile::rebase`): its history is forwarded as sent.
    rebase: bool,
    /// The index in `marks` of the first new message.
    from: usize,
    /// How many stored messages stay on the main line for this request.
    kept: usize,
    /// A branch: the first stored turn that leaves the main line with it.
    closing_from: Option<u64>,
    /// The new messages as they will be stored, their texts (text, recall text) and tokens.
    new_turns: Vec<Message>,
    texts: Vec<(String, String)>,
    new_tokens: Vec<u32>,
    /// The client's instructions, counted once (cached per distinct message): they size the
    /// window's step and are part of the budget's fixed tokens.
    instruction_tokens: u64,
}

impl Reconciled {
    /// The stored messages that stay on the main line for this request: a replaced reply
    /// and the stored line past a branch are not part of its history.
    fn history<'a>(&self, on: &Planning<'a>) -> &'a [memproxy_store::Entry] {
        &on.conversation.entries[..self.kept]
    }

    /// The new messages continue the last stored round (tool results, or nothing new).
    fn continues_round(&self) -> bool {
        self.marks
            .get(self.from)
            .is_none_or(|m| m.role != Role::User)
    }
}

/// Reconcile: which of the request's messages are new, a retry, a branch or a rebase, checked
/// against the limits on what one request may add.
fn reconciled(on: &Planning<'_>, messages: Vec<Message>) -> Result<Reconciled, PlanError> {
    let entries = &on.conversation.entries;
    // Messages memproxy itself injected, echoed back by a client, are neither stored nor sent
    // twice.
    let messages: Vec<Message> = messages
        .into_iter()
        .filter(|m| !is_injected_echo(m))
        .collect();
    // The request's conversation messages (instructions are not turns).
    let turn_index: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.is_instruction())
        .map(|(i, _)| i)
        .collect();
    let marks: Vec<Mark> = turn_index
        .iter()
        .map(|&i| Mark::from(&messages[i]))
        .collect();
    let alignment = align(entries, last_is_reply(entries), &marks);
    // The client's own compaction: its history is forwarded as sent, and only the messages
    // not stored yet are new (`reconcile::rebase`).
    let rebased = rebase(entries, &marks, alignment).map(|known| {
        let retried = known.iter().all(|&k| k)
            && last_is_reply(entries)
            && entries.len() >= 2
            && marks.last().map(|m| m.fingerprint) == Some(entries[entries.len() - 2].fingerprint);
        (known, retried)
    });
    let rebase = rebased.is_some();
    let (turn_index, marks, alignment) = match rebased {
        None => (turn_index, marks, alignment),
        Some((known, retried)) => {
            let unknown: Vec<usize> = turn_index
                .iter()
                .zip(&known)
                .filter(|(_, known)| !**known)
                .map(|(&i, _)| i)
                .collect();
            let marks: Vec<Mark> = unknown.iter().map(|&i| Mark::from(&messages[i])).collect();
            let alignment = if retried {
                Alignment::ReplaceLastReply { from: 0 }
            } else if let Some(keep) =
                summarizer_exchange(&on.memory.store, on.conversation, &marks, &messages)?
            {
                // The stored line's last exchange was the client's own summarizer call: its
                // answer is now the client's summary. It leaves the main line (a closed
                // branch), so its instruction and answer are never a turn.
                Alignment::Branch { keep, from: 0 }
            } else {
                Alignment::Append { from: 0 }
            };
            (unknown, marks, alignment)
        }
    };
    let from = alignment.from().min(marks.len());
    let kept = alignment.kept(entries.len());
    let closing_from = match alignment {
        Alignment::Branch { .. } => entries.get(kept).map(|e| e.turn),
        Alignment::Append { .. } | Alignment::ReplaceLastReply { .. } => None,
    };
    let limits = on.limits;
    let new_count = turn_index.len() - from;
    if new_count > limits.max_new_messages {
        return Err(PlanError::TooManyMessages {
            count: new_count,
            limit: limits.max_new_messages,
        });
    }
    let new_turns: Vec<Message> = turn_index[from..]
        .iter()
        .map(|&i| memproxy_base::wire::stored_form(messages[i].clone()))
        .collect();
    // One parse per new message gives its text (token count, recall query) and its recall
    // text for the index at commit. Counting stops at the token limit.
    let mut texts: Vec<(String, String)> = Vec::with_capacity(new_count);
    let mut new_tokens: Vec<u32> = Vec::with_capacity(new_count);
    let mut new_total: u64 = 0;
    for message in &new_turns {
        let (text, search) = message.text_and_search_text();
        let counted = tokens::count_message(on.model, &text);
        new_total += u64::from(counted);
        if new_total > limits.max_new_tokens {
            return Err(PlanError::TooManyTokens {
                limit: limits.max_new_tokens,
            });
        }
        texts.push((text, search));
        new_tokens.push(counted);
    }
    let instruction_tokens: u64 = messages
        .iter()
        .filter(|m| m.is_instruction())
        .map(|m| u64::from(tokens::count_cached(on.model, m.fingerprint, || m.text())))
        .sum();
    Ok(Reconciled {
        messages,
        turn_index,
        marks,
        alignment,
        rebase,
        from,
        kept,
        closing_from,
        new_turns,
        texts,
        new_tokens,
        instruction_tokens,
    })
}

/// The window's step over a history: `window_step`, or when `auto`, the cheapest for the
/// conversation's message lengths and what precedes the window (`head`: instructions and
/// summary).
struct Steps<'a> {
    settings: &'a MemorySettings,
    head: u64,
}

impl Steps<'_> {
    fn over(&self, history: &[memproxy_store::Entry]) -> usize {
        self.settings
            .window_step
            .unwrap_or_else(|| auto_step(history, self.settings.recent_n, self.head))
    }
}

/// The window stage's output.
struct Windowed {
    /// Where the window starts in the request's history (an index into its entries): the
    /// older pool is everything before it.
    start: usize,
    /// The messages forwarded verbatim: stored ones, or a rebase's own history before its
    /// newest question.
    messages: Vec<StoredMessage>,
    /// The `window_step` in effect (`auto` resolved).
    step: usize,
    /// A rebase: the index in the request's messages of its newest question, where its own
    /// history (standing as the window) ends.
    opener: Option<usize>,
}

/// Window: the stored messages forwarded verbatim (`window.rs`); it holds the current round
/// when the new messages continue it, and starts no earlier than a provider's compaction.
fn windowed(
    on: &Planning<'_>,
    request: &Reconciled,
    steps: &Steps<'_>,
) -> Result<Windowed, PlanError> {
    let history = request.history(on);
    let settings = on.settings;
    let step = steps.over(history);
    // A rebase brings its own history (the client's compacted one, forwarded as sent): the
    // window holds none of the stored line, and all of it is the older pool.
    let mut start = if request.rebase {
        history.len()
    } else {
        window_start(history, settings.recent_n, step, request.continues_round())
    };
    let mut messages: Vec<StoredMessage> = on
        .memory
        .store
        .messages(on.conversation, history[start..].iter().map(|e| e.turn))?;
    // A provider's compaction in the window (a compaction block or item its answer carried):
    // the provider reads nothing before the newest one, so the window starts there and what
    // came before joins the older pool, for recall (`wire::holds_compaction`).
    if let Some(at) = messages
        .iter()
        .rposition(|m| {
            m.role == Role::Assistant && memproxy_base::wire::holds_compaction(&m.message)
        })
        .filter(|&at| at > 0)
    {
        let turn = messages[at].turn;
        messages.drain(..at);
        start = history.partition_point(|e| e.turn < turn);
    }
    // The rebase's split: the client's messages before its newest question stand as the
    // window, the rest as the new messages (the recalled turns go between).
    let opener = request.rebase.then(|| {
        request
            .messages
            .iter()
            .rposition(|m| !m.is_instruction() && m.opens_round())
            .unwrap_or(0)
    });
    if let Some(opener) = opener {
        messages = request.messages[..opener]
            .iter()
            .map(|m| StoredMessage {
                turn: 0,
                role: m.role,
                origin: memproxy_store::Origin::Client,
                at_ms: 0,
                // Instructions are counted once, with the budget's fixed part.
                tokens: if m.is_instruction() {
                    0
                } else {
                    tokens::count_cached(on.model, m.fingerprint, || m.text())
                },
                fingerprint: m.fingerprint,
                message: m.raw.clone(),
                exchange: None,
            })
            .collect();
    }
    Ok(Windowed {
        start,
        messages,
        step,
        opener,
    })
}

/// Summary: the newest one goes in the prompt (of a branch: the newest that covers only turns
/// it keeps); a new one may be due. With the window anchored, a new summary waits for the next
/// jump (`window.rs`); a synchronous one is made for the request that waits for it, so it is
/// used at once. A rebase carries the client's own summary: none of memproxy's is added or
/// made.
fn summarized(
    on: &Planning<'_>,
    request: &Reconciled,
    window: &Windowed,
    latest: Option<SummaryRecord>,
) -> Result<super::summarized::SummaryPlan, PlanError> {
    if request.rebase {
        return Ok(super::summarized::SummaryPlan::default());
    }
    let settings = on.settings;
    let mut summary = plan_summary(SummaryInput {
        memory: on.memory,
        conversation: on.conversation,
        settings,
        latest,
        pool_end: window.start,
        closing_from: request.closing_from,
        request_model: on.model,
        writes: on.limits.writes,
    })?;
    if settings.compression_async {
        let made_by = summary_adoption_cutoff(request.history(on), settings.recent_n, window.step);
        adopt_at_jumps(on.memory, on.conversation, &mut summary, made_by)?;
    }
    Ok(summary)
}

/// The recall stage's output.
struct Recalled {
    /// What recall searched with (`None`: it did not search).
    query: Option<String>,
    /// Its vector (`None`: recall by words alone), which long-term memory's stage uses too.
    vector: Option<Vec<f32>>,
    /// The recalled turns, fitted to `relevance_max_tokens`.
    turns: Vec<RecalledTurn>,
    /// Turns the relevance floor kept out, best first.
    under_floor: Vec<Scored>,
    mode: RecallMode,
}

/// Whether recall will likely search, so that embedding the question ahead is not thrown
/// away: with a user (their other conversations), or with more stored messages than the
/// recent window's `recent_n` (an older pool; the window may hold up to a step more, so a
/// few are still embedded for nothing).
fn worth_searching(
    settings: &MemorySettings,
    user: Option<&OwnerKey>,
    conversation: &Conversation,
) -> bool {
    user.is_some() || conversation.entries.len() > settings.recent_n
}

/// Whether recall will search by meaning (if there is anything to search).
fn searching_by_meaning(settings: &MemorySettings) -> bool {
    settings.relevance_enabled && settings.relevance_top_k > 0 && settings.relevance_semantic
}

/// The query as the request most likely makes it, read before reconcile: the text of its
/// trailing user messages, which is what a client sends new, whether it sends the whole
/// history or only the newest message. `None` when it ends with another role's message, or
/// when recall will likely not search ([`worth_searching`]).
fn likely_query(
    settings: &MemorySettings,
    user: Option<&OwnerKey>,
    conversation: &Conversation,
    messages: &[Message],
) -> Option<String> {
    if !searching_by_meaning(settings) || !worth_searching(settings, user, conversation) {
        return None;
    }
    let first = messages
        .iter()
        .rposition(|m| m.role != Role::User)
        .map_or(0, |i| i + 1);
    let trailing = &messages[first..];
    (!trailing.is_empty()).then(|| {
        trailing
            .iter()
            .map(Message::text)
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// The query's embedding ahead ([`crate::embedding::Embedding::ahead`]) once reconcile knows
/// the new messages, when recall will search by meaning: `early` if it was started for the
/// same text, else started now for the new messages' text when they hold a user message
/// ([`query_text`]; a tool loop's query is its opening question, found from the window and
/// embedded when recall needs it). An `early` of another text is dropped (skipped if the
/// helper has not begun it).
fn embed_ahead(on: &Planning<'_>, request: &Reconciled, early: Option<Ahead>) -> Option<Ahead> {
    // A rebase's query is its opener's text, found with the window.
    if !searching_by_meaning(on.settings)
        || !worth_searching(on.settings, on.user, on.conversation)
        || !exchange_has_user(&request.new_turns)
        || request.rebase
    {
        return None;
    }
    let text = query_text(&request.new_turns, &request.texts, &[]);
    if let Some(early) = early {
        if early.text() == text {
            return Some(early);
        }
        // Dropped before the right one is queued, so the helper skips it.
        drop(early);
    }
    on.memory.embedding.ahead(text)
}

/// Recall: the older pool is everything before the window; in a tool loop, everything before
/// the window the loop's opening question had, so every step recalls what the first did
/// (`loop_pool_end`). With a user, the user's other conversations compete for the same slots.
fn recalled(
    on: &Planning<'_>,
    request: &Reconciled,
    window: &Windowed,
    steps: &Steps<'_>,
    ahead: Option<Ahead>,
) -> Result<Recalled, PlanError> {
    let (settings, store) = (on.settings, &on.memory.store);
    let history = request.history(on);
    let mut turns: Vec<RecalledTurn> = Vec::new();
    let mut under_floor = Vec::new();
    let mut mode = RecallMode::None;
    let searching = settings.relevance_enabled && settings.relevance_top_k > 0;
    let pool_end = match window.opener {
        Some(_) => window.start,
        None => loop_pool_end(
            history,
            &request.new_turns,
            &window.messages,
            settings.recent_n,
            steps,
        )
        .unwrap_or(window.start),
    };
    let query = (searching && (pool_end > 0 || on.user.is_some())).then(|| match window.opener {
        // A rebase's new messages hold the client's summary: the question is the newest one.
        Some(opener) => request.messages[opener].text(),
        None => query_text(&request.new_turns, &request.texts, &window.messages),
    });
    // The query's vector, made once, when the search first needs it (after the words are
    // matched): the conversation's own recall, the user's other conversations and the user's
    // memories all use it. One started ahead (`ahead`) is taken if it is of this query.
    let searching_by_meaning =
        settings.relevance_semantic && on.memory.embedding.embedder().is_some();
    let later = query.as_deref().map(|query| {
        Later::new(move || match settings.relevance_semantic {
            true => on.memory.embedding.query_from(ahead, query),
            false => Err(Lexical::Setting),
        })
    });
    // The period the question names, if any: turns stored in it are favoured.
    let when = query
        .as_deref()
        .and_then(|query| settings.period(query, on.memory.clock.now_ms()));
    if let (Some(query), Some(later)) = (query.as_deref(), later.as_ref())
        && pool_end > 0
    {
        let before_turn =
            history[pool_end.min(history.len() - 1)].turn + u64::from(pool_end == history.len());
        let found = on.memory.recall.search(
            store,
            on.conversation,
            settings.relevance_language,
            Query {
                text: query,
                // Without an embedder (or by words on purpose) no vector is asked for, and
                // the words are matched as by words alone.
                vector: match searching_by_meaning {
                    true => QueryVector::Later(later),
                    false => QueryVector::None,
                },
                fusion: settings.fusion(),
                when,
            },
            before_turn,
            settings.relevance_top_k,
        )?;
        mode = match (later.get(), found.semantic) {
            (Some(Ok(_)), true) => RecallMode::Hybrid,
            (Some(Ok(_)), false) => RecallMode::Lexical(Lexical::NoVectors),
            (Some(Err(why)), _) => RecallMode::Lexical(*why),
            (None, _) => RecallMode::Lexical(Lexical::QueryFailed),
        };
        under_floor = found.under_floor;
        let hits = found.hits;
        let found = store.messages(on.conversation, hits.iter().map(|h| h.turn))?;
        turns = recalled_turns(&hits, found);
        // A rebase's history is the client's: what it already holds is not recalled again.
        if request.rebase {
            let held: std::collections::HashSet<u64> =
                request.messages.iter().map(|m| m.fingerprint).collect();
            let held_turns: std::collections::HashSet<u64> = on
                .conversation
                .entries
                .iter()
                .filter(|e| held.contains(&e.fingerprint))
                .map(|e| e.turn)
                .collect();
            turns.retain(|r| !held_turns.contains(&r.turn));
        }
    }
    // Long-term memory: the user's other conversations compete for the same slots.
    let vector = later.and_then(|later| later.into_result()?.ok());
    if let (Some(user), Some(query)) = (on.user, query.as_deref()) {
        match on.memory.longterm.search(
            store,
            user,
            Some(on.key),
            settings.relevance_language,
            Query {
                text: query,
                vector: vector.as_deref().into(),
                fusion: settings.fusion(),
                when,
            },
            settings.relevance_top_k,
        ) {
            Ok(found) if !found.is_empty() => {
                turns.extend(elsewhere_turns(found));
                turns.sort_by(|a, b| b.score.total_cmp(&a.score));
                turns.truncate(settings.relevance_top_k);
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(error = %err, "searching the user's other conversations failed")
            }
        }
    }
    // The recalled turns fit `relevance_max_tokens`: the longest are cut to the passage that
    // answers the question.
    if let Some(query) = query.as_deref() {
        fit_recalled(
            &mut turns,
            query,
            settings.relevance_language,
            settings.relevance_budget(),
            on.model,
        );
    }
    Ok(Recalled {
        query,
        vector,
        turns,
        under_floor,
        mode,
    })
}

/// The long-term memory stage's output.
#[derive(Default)]
struct LongTerm {
    /// The user's memories for the prompt, with their scores.
    chosen: Vec<Chosen>,
    /// Memories are due to be extracted once this exchange is stored: the model to use.
    extraction_due: Option<String>,
}

/// Long-term memory: what is known about the user, and whether an extraction is due (a due
/// summary is extracted from too, once stored). Its failures are logged, never returned.
fn long_term(
    on: &Planning<'_>,
    request: &Reconciled,
    window: &Windowed,
    query: Option<&str>,
    vector: Option<&[f32]>,
    summary: &mut super::summarized::SummaryPlan,
) -> LongTerm {
    let Some(user) = on.user else {
        return LongTerm::default();
    };
    let (memory, settings, key) = (on.memory, on.settings, on.key);
    let store = &memory.store;
    let mut out = LongTerm::default();
    let query = query.map_or_else(
        || query_text(&request.new_turns, &request.texts, &window.messages),
        str::to_string,
    );
    match memory.longterm.memories_for(
        store,
        user,
        &key.agent,
        Query {
            text: &query,
            vector: vector.into(),
            fusion: settings.fusion(),
            when: None,
        },
        settings,
        memory.clock.now_ms(),
    ) {
        Ok(found) => out.chosen = found,
        Err(err) => tracing::warn!(error = %err, "reading the user's memories failed"),
    }
    let new_user = request
        .new_turns
        .iter()
        .filter(|m| m.role == Role::User)
        .count() as u64;
    match memory
        .longterm
        .extraction_due(store, user, key, new_user, settings.extraction_every)
    {
        Ok(true)
            if on.limits.writes
                && settings.persist
                && memory.ledger.allow(
                    &key.agent,
                    crate::ledger::Task::Extraction,
                    memory.clock.now_ms(),
                ) =>
        {
            out.extraction_due = Some(extraction_model(settings, on.model));
        }
        Ok(_) => {}
        Err(err) => tracing::warn!(error = %err, "reading the user's archive failed"),
    }
    // A summary made for this conversation is extracted from too, once stored.
    if let Some(job) = summary.due.as_mut()
        && settings.persist
    {
        job.on_stored = Some(memory.longterm.extraction_from_summary(
            user,
            key,
            job.conversation_id,
            extraction_model(settings, on.model),
        ));
    }
    out
}

/// What the edge reports of the recalled turns.
struct RecallReport {
    /// The conversation's own recalled turns, oldest first.
    turns: Vec<u64>,
    /// The same as recall scored them, best first.
    scores: Vec<Scored>,
    /// Those cut to their most relevant passage, in turn order.
    excerpted: Vec<u64>,
    /// Turns of the user's other conversations: (conversation, turn, score), best first.
    elsewhere: Vec<(String, u64, f32)>,
}

impl RecallReport {
    fn of(recalled: &[RecalledTurn]) -> RecallReport {
        let own = || recalled.iter().filter(|r| r.elsewhere.is_none());
        let mut turns: Vec<u64> = own().map(|r| r.turn).collect();
        turns.sort_unstable();
        let mut excerpted: Vec<u64> = own().filter(|r| r.excerpted).map(|r| r.turn).collect();
        excerpted.sort_unstable();
        RecallReport {
            turns,
            scores: own()
                .map(|r| Scored {
                    turn: r.turn,
                    score: r.score,
                    lexical: r.lexical,
                    semantic: r.semantic,
                    when: r.when,
                })
                .collect(),
            excerpted,
            elsewhere: recalled
                .iter()
                .filter_map(|r| Some((r.elsewhere.as_ref()?.conversation.clone(), r.turn, r.score)))
                .collect(),
        }
    }
}

/// Tokens of the whole history a prompt stands for: what is stored on the request's main line
/// (its first `kept` messages) plus the new messages and the client's instructions (they count
/// on both sides, as the prompt carries them). memproxy's own parts (a summary, recalled
/// turns) can make a short conversation's prompt larger than its history: never less than
/// what is forwarded (`prompt_tokens`).
fn history_tokens(
    conversation: &memproxy_store::Conversation,
    kept: usize,
    new_tokens: &[u32],
    instruction_tokens: u64,
    prompt_tokens: u64,
) -> u64 {
    let entries = &conversation.entries;
    let stored = conversation
        .meta
        .as_ref()
        .map_or(0, |m| m.total_tokens)
        .saturating_sub(tokens_between(entries, kept, entries.len()));
    let new: u64 = new_tokens.iter().map(|&t| u64::from(t)).sum();
    (stored + new + instruction_tokens).max(prompt_tokens)
}

/// The budget stage's output.
struct Budgeted {
    /// What the token budget did, when one is set.
    fitted: Option<Fitted>,
    dropped: Dropped,
    /// The forwarded prompt's size in tokens, from stored counts.
    prompt_tokens: u64,
}

/// Budget (`max_context_tokens`): what cannot be cut is the client's instructions and new
/// messages, the summary and the memories; recalled turns, then old rounds go first
/// (`budget.rs`).
fn budgeted(
    on: &Planning<'_>,
    request: &Reconciled,
    summary: &super::summarized::SummaryPlan,
    long_term: &LongTerm,
    recalled: &mut Vec<RecalledTurn>,
    window: &mut Vec<StoredMessage>,
) -> Budgeted {
    let summary_tokens = summary.current.as_ref().map_or(0, |r| {
        u64::from(r.tokens) + u64::from(tokens::MESSAGE_OVERHEAD_TOKENS) + 16
    });
    let memories_tokens: u64 = if long_term.chosen.is_empty() {
        0
    } else {
        long_term
            .chosen
            .iter()
            .map(|c| memories::memory_tokens(&c.memory))
            .sum::<u64>()
            + u64::from(tokens::MESSAGE_OVERHEAD_TOKENS)
            + 16
    };
    let fixed: u64 = request.instruction_tokens
        + request
            .new_tokens
            .iter()
            .map(|&t| u64::from(t))
            .sum::<u64>()
        + summary_tokens
        + memories_tokens;
    let max = on.settings.max_context_tokens;
    let candidates = max.map(|_| budget::Candidates::of(recalled, window));
    let fitted = max.map(|budget| budget::fit(budget, fixed, recalled, window, on.model));
    let dropped = candidates
        .map(|c| c.dropped(recalled, window))
        .unwrap_or_default();
    let prompt_tokens = fitted.map_or_else(
        || {
            fixed
                + window.iter().map(|m| u64::from(m.tokens)).sum::<u64>()
                + recalled.iter().map(|r| u64::from(r.tokens)).sum::<u64>()
        },
        |f| f.total,
    );
    Budgeted {
        fitted,
        dropped,
        prompt_tokens,
    }
}

/// What the stages before assembly made, each moved in once.
struct Staged {
    request: Reconciled,
    window: Windowed,
    summary: super::summarized::SummaryPlan,
    recall: Recalled,
    long_term: LongTerm,
    budget: Budgeted,
}

/// The memories recalled into a prompt to mark accessed once it is stored: at most once an
/// hour each, so a busy user does not write per request (none for a preview).
fn memories_to_refresh(
    on: &Planning<'_>,
    chosen: &[Chosen],
) -> Vec<(OwnerKey, memories::MemoryRecord)> {
    if !(on.limits.writes && on.settings.persist) {
        return Vec::new();
    }
    let now = on.memory.clock.now_ms();
    chosen
        .iter()
        .filter(|c| now - c.memory.last_accessed_ms > REFRESH_AFTER_MS)
        .map(|c| (c.owner.clone(), c.memory.clone()))
        .collect()
}

/// Assemble: the prompt (`assemble.rs`: instructions · summary · memories · window · recalled ·
/// new), the exchange to commit, and what the edge reports.
fn assembled(on: &Planning<'_>, handle: &memproxy_store::Handle, staged: Staged) -> Plan {
    let Staged {
        request,
        window,
        summary,
        recall,
        long_term,
        budget,
    } = staged;
    let (settings, key) = (on.settings, on.key);
    let entries = &on.conversation.entries;
    let recalled = recall.turns;
    let report = RecallReport::of(&recalled);
    let (under_floor, recall_mode) = (recall.under_floor, recall.mode);
    let history_len = request.kept;
    let Reconciled {
        messages,
        turn_index,
        marks,
        alignment,
        from,
        new_turns,
        texts,
        new_tokens,
        instruction_tokens,
        ..
    } = request;
    // The new messages are the request's non-instruction messages from `first_new` on.
    let first_new = turn_index.get(from).copied().unwrap_or(messages.len());
    let split = match window.opener {
        Some(opener) => Split {
            instructions: Vec::new(),
            incoming: messages.into_iter().skip(opener).map(|m| m.raw).collect(),
            answers: 0,
        },
        None => split_request(messages, first_new),
    };
    // In a tool loop the recalled turns go before the round's opening user message.
    let in_loop = !exchange_has_user(&new_turns);
    let recalled_at = in_loop.then(|| {
        window
            .messages
            .iter()
            .rposition(|m| memproxy_base::message::opens_round(m.role, &m.message))
            .unwrap_or(0)
    });
    let chosen = long_term.chosen;
    let model = on.model.map(str::to_string);
    let mut exchange = Exchange {
        key: key.clone(),
        handle: Arc::clone(handle),
        marks,
        alignment,
        new_turns,
        new_tokens,
        new_texts: texts.into_iter().map(|(_, search)| search).collect(),
        planned_next_turn: on.conversation.meta.as_ref().map(|m| m.next_turn),
        max_messages: settings.max_messages,
        model,
        prompt_tokens: budget.prompt_tokens,
        // Set below, once counted; the edge fills in the cached tokens once the answer is read.
        history_tokens: 0,
        cached_tokens: 0,
        ttl: settings.ttl,
        user: on.user.cloned(),
        extraction_rule: on.user.map(|_| ExtractionRule {
            every: settings.extraction_every,
            may_queue: true,
        }),
        extraction: None,
        refresh_memories: memories_to_refresh(on, &chosen),
        query_vector: recall.query.zip(recall.vector),
    };
    let planned_count = exchange.planned_count(entries);
    let stored_count = entries.len();
    let history_tokens = history_tokens(
        on.conversation,
        history_len,
        &exchange.new_tokens,
        instruction_tokens,
        budget.prompt_tokens,
    );
    exchange.history_tokens = history_tokens;
    Plan {
        prompt: Prompt {
            instructions: split.instructions,
            summary: summary.current.as_ref().and_then(super::summarized::render),
            memories: memories::render(&chosen),
            window: window.messages.into_iter().map(|m| m.message).collect(),
            recalled: render(&recalled),
            incoming: split.incoming,
            answers: split.answers,
            recalled_at,
            cache: CacheHints {
                key: settings.prompt_cache_key.then(|| key.prompt_cache_key()),
                breakpoints: settings.cache_breakpoints,
            },
        },
        exchange,
        report: Report {
            stored_count,
            planned_count,
            recalled_turns: report.turns,
            recalled_scores: report.scores,
            under_floor,
            recall_mode,
            excerpted_turns: report.excerpted,
            window_step: window.step,
            recalled_elsewhere: report.elsewhere,
            prompt_tokens: budget.prompt_tokens,
            fitted: budget.fitted,
            dropped: budget.dropped,
            summary: summary.current,
            memories: chosen,
            history_tokens,
        },
        summary_due: summary.due,
        extraction_due: long_term.extraction_due,
        timings: Timings::default(),
    }
}

/// Starts the summary a plan found due, with the triggering request's `credentials`: with
/// `compression_async` (the default) it is returned as a [`DeferredSummary`], which queues the
/// job for the background worker once dropped (the caller moves it into the response, so the
/// job starts when the request is over); otherwise it is made now, and this request's prompt
/// already carries it. A failure leaves the previous summary in place.
pub async fn start_due(
    memory: &Memory,
    settings: &MemorySettings,
    plan: &mut Plan,
    credentials: impl FnOnce() -> Credentials,
) -> Option<DeferredSummary> {
    let mut job = plan.summary_due.take()?;
    // Copied from the request only when a summary is due.
    job.credentials = credentials();
    if settings.compression_async {
        return Some(DeferredSummary::new(Arc::clone(&memory.summarizer), job));
    }
    let started = std::time::Instant::now();
    let result = memory.summarizer.run_now(job).await;
    plan.timings.summary = Some(started.elapsed());
    match result {
        Ok(record) => {
            plan.prompt.summary = super::summarized::render(&record);
            plan.report.summary = Some(record);
        }
        Err(err) => {
            tracing::warn!(error = %err, "synchronous summary failed; using the previous one")
        }
    }
    None
}

/// Where the stored line's last exchange starts, when it was the client's own summarizer
/// call: its answer (or the `<summary>` inside it) is held, as the client's summary, by a
/// message of the rebasing request. A client never re-sends its summarizer call's
/// instruction: when the request (`marks`) holds the exchange's opening message, it was a turn,
/// and nothing is read (every later request of a compacted client is a rebase too).
fn summarizer_exchange(
    store: &memproxy_store::Store,
    conversation: &memproxy_store::Conversation,
    marks: &[Mark],
    messages: &[Message],
) -> Result<Option<usize>, StoreError> {
    /// Shorter answers prove nothing (an "ok" is in many messages).
    const MIN_SUMMARY_CHARS: usize = 24;
    let entries = &conversation.entries;
    let (Some(last), true) = (entries.last(), last_is_reply(entries)) else {
        return Ok(None);
    };
    let Some(opening) = entries.iter().rposition(|e| e.role == Role::User) else {
        return Ok(None);
    };
    if marks
        .iter()
        .any(|m| m.fingerprint == entries[opening].fingerprint)
    {
        return Ok(None);
    }
    let Some(reply) = store.messages(conversation, [last.turn])?.pop() else {
        return Ok(None);
    };
    let text = Message::parse(reply.message, "reply").map_or_else(|_| String::new(), |m| m.text());
    let summary = match (text.find("<summary>"), text.rfind("</summary>")) {
        (Some(start), Some(end)) if start + 9 <= end => &text[start + 9..end],
        _ => text.as_str(),
    }
    .trim();
    let held = summary.len() >= MIN_SUMMARY_CHARS
        && messages
            .iter()
            .any(|m| m.role == Role::User && m.text().contains(summary));
    Ok(held.then_some(opening))
}

/// The model of an extraction: `extraction_model`, else `compression_model`, else the
/// request's.
fn extraction_model(settings: &MemorySettings, request_model: Option<&str>) -> String {
    settings
        .extraction_model
        .as_deref()
        .or(settings.compression_model.as_deref())
        .or(request_model)
        .unwrap_or("gpt-4o-mini")
        .to_string()
}

/// True when the new messages hold a user message (else they continue a round: a tool loop's
/// results, or a retry).
fn exchange_has_user(new_turns: &[Message]) -> bool {
    new_turns.iter().any(Message::opens_round)
}

/// In a tool loop (the new messages continue a round opened by a stored user message), where
/// recall's pool ends: the window's start over the history the loop's opening question found,
/// as the request that sent it computed it. The pool, like the query, is then the same at
/// every step of the loop, so the recalled turns are too, and the loop's own messages (stored
/// since) never reach it. `None`: no loop.
fn loop_pool_end(
    history: &[memproxy_store::Entry],
    new_turns: &[Message],
    window: &[StoredMessage],
    recent_n: usize,
    steps: &Steps<'_>,
) -> Option<usize> {
    if exchange_has_user(new_turns) {
        return None;
    }
    let opening = window
        .iter()
        .rev()
        .find(|m| memproxy_base::message::opens_round(m.role, &m.message))?;
    let opened = history.partition_point(|e| e.turn < opening.turn);
    let before = &history[..opened];
    Some(window_start(before, recent_n, steps.over(before), false))
}

/// What recall searches with: the new messages; when they continue a round (a tool loop's
/// results, a retry), the user message that opened it, alone: a tool's output is no question,
/// and the same query at every step of a loop recalls the same turns (the provider's cache
/// holds).
fn query_text(
    new_turns: &[Message],
    texts: &[(String, String)],
    window: &[StoredMessage],
) -> String {
    if !exchange_has_user(new_turns)
        && let Some(opening) = window
            .iter()
            .rev()
            .find(|m| memproxy_base::message::opens_round(m.role, &m.message))
        && let Ok(message) = Message::parse(opening.message.clone(), "window")
    {
        return message.text();
    }
    texts
        .iter()
        .map(|(text, _)| text.as_str())
        .collect::<Vec<_>>()
        .join("\n")
}
