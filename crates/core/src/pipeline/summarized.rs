//! Summary: the summary slot of the prompt, and whether a new summary is due.
//!
//! Runs under the conversation's lock as part of the plan: it reads the newest summary record,
//! estimates the tokens of the older pool not yet covered (from stored counts, no scan), and
//! decides. Making the summary is the summarizer's job, off the hot path (or, with
//! `compression_async = false`, awaited by the request before it is forwarded).

use serde_json::value::RawValue;

use super::assemble::SUMMARY_MARKER;
use crate::ledger::Task;
use crate::memory::Memory;
use crate::settings::MemorySettings;
use crate::summary::{Job, SummaryRecord, heuristic};
use memproxy_base::model::Credentials;
use memproxy_store::{Conversation, StoreError, closed_by_branch, tokens_between};

/// What the summary stage decided.
#[derive(Debug, Default)]
pub struct SummaryPlan {
    /// The summary to put in the prompt.
    pub current: Option<SummaryRecord>,
    /// A new summary is due: the job to run (credentials are added by the caller).
    pub due: Option<Job>,
    /// Tokens of the older pool not covered by a model summary.
    pub uncovered_tokens: u64,
}

/// What the summary stage reads: the plan's context and where the window starts.
pub struct SummaryInput<'a> {
    pub memory: &'a Memory,
    pub conversation: &'a Conversation,
    pub settings: &'a MemorySettings,
    /// The conversation's newest summary record, read by the caller (which sizes the window
    /// with it).
    pub latest: Option<SummaryRecord>,
    /// Where the window starts (an index into the conversation's entries): what is before it
    /// may be summarized.
    pub pool_end: usize,
    /// The request closes a branch from this turn on. Summaries that reach it go with the
    /// branch, so the prompt carries the newest one that does not; nothing is reserved or
    /// stored while the stored line is about to change (the next request plans on the new one).
    pub closing_from: Option<u64>,
    /// The request's model (a summary without `compression.model` is made with it).
    pub request_model: Option<&'a str>,
    /// False for a preview: nothing is reserved or stored.
    pub writes: bool,
}

/// Decides the summary stage for a conversation whose recent window starts at `pool_end`
/// (an index into its entries). Without `writes` (a preview) nothing is reserved or stored.
pub fn plan_summary(input: SummaryInput<'_>) -> Result<SummaryPlan, StoreError> {
    let SummaryInput {
        memory,
        conversation,
        settings,
        latest,
        pool_end,
        closing_from,
        request_model,
        writes,
    } = input;
    let (Some(meta), true) = (&conversation.meta, settings.compression_enabled) else {
        return Ok(SummaryPlan::default());
    };
    let store = &memory.store;
    if let Some(from_turn) = closing_from {
        let current = store
            .summaries(&conversation.key, meta.id)?
            .into_iter()
            .rfind(|record| !closed_by_branch(record, from_turn));
        return Ok(SummaryPlan {
            current,
            ..SummaryPlan::default()
        });
    }
    let summarizer = &memory.summarizer;
    let model_summary = latest.as_ref().filter(|r| !r.heuristic);
    let covered_to = model_summary.map_or(0, |r| r.to_turn);
    let entries = &conversation.entries;
    let pool_end = pool_end.min(entries.len());
    let from = entries
        .partition_point(|e| e.turn <= covered_to)
        .min(pool_end);
    let uncovered_tokens = tokens_between(entries, from, pool_end);
    let mut plan = SummaryPlan {
        current: latest.clone(),
        due: None,
        uncovered_tokens,
    };
    if uncovered_tokens <= settings.compression_threshold_tokens {
        return Ok(plan);
    }

    // At most one summary per interval, except while a backlog larger than one call's input
    // is worked through.
    let throttled = model_summary.is_some_and(|r| {
        let interval = settings.compression_interval.as_millis() as i64;
        !r.catching_up() && memory.clock.now_ms() - r.created_ms < interval
    });
    let model = settings.compression_model.as_deref().or(request_model);
    // The reservation is taken here, under the conversation's lock, so two requests planned
    // at once never both make the same summary.
    if !throttled
        && writes
        && let Some(model) = model
        && !summarizer.backing_off(&conversation.key)
        // The agent's background budget for the day (`compression.max_tokens_per_day`):
        // once spent, no job; the stand-in below is used.
        && memory
            .ledger
            .allow(&conversation.key.agent, Task::Summary, memory.clock.now_ms())
        && let Some(reservation) = summarizer.reserve(&conversation.key)
    {
        plan.due = Some(Job {
            key: conversation.key.clone(),
            conversation_id: meta.id,
            upto_turn: entries[pool_end - 1].turn,
            model: model.to_string(),
            credentials: Credentials::default(),
            // With no summary at all yet, the background worker writes the heuristic stand-in
            // before it calls the model: this request only queues the job.
            stand_in: latest.is_none() && settings.compression_async,
            reservation,
            on_stored: None,
        });
    }

    // No summary at all, and no job queued or running that will write the stand-in (a sync
    // summary that failed and is backing off, or no model to ask): it is made here, once.
    let covered_elsewhere = plan.due.is_some() || summarizer.in_flight(&conversation.key);
    if latest.is_none() && !covered_elsewhere && writes && pool_end > 0 {
        let upto = entries[pool_end - 1].turn;
        match heuristic::store_stand_in(store, conversation, meta.id, upto) {
            Ok(Some(record)) => plan.current = Some(record),
            Ok(None) => {}
            Err(err) => tracing::warn!(error = %err, "could not store the heuristic summary"),
        }
    }
    Ok(plan)
}

/// Holds a new summary back until the window's next jump: the prompt keeps the newest summary
/// made by `made_by` ([`super::window::summary_adoption_cutoff`]; `None`: the newest), so a new
/// summary and an anchor jump break the provider's prompt cache once, not twice. Only a model
/// summary is kept waiting that way: with none or only the heuristic stand-in before it, a
/// summary is used on the next turn.
pub fn adopt_at_jumps(
    memory: &Memory,
    conversation: &Conversation,
    plan: &mut SummaryPlan,
    made_by: Option<i64>,
) -> Result<(), StoreError> {
    if let (Some(cutoff), Some(meta)) = (made_by, &conversation.meta)
        && plan.current.as_ref().is_some_and(|r| r.created_ms > cutoff)
    {
        let adopted = memory
            .store
            .newest_summary_where(&conversation.key, meta.id, |r| r.created_ms <= cutoff)?;
        if adopted.as_ref().is_some_and(|r| !r.heuristic) {
            plan.current = adopted;
        }
    }
    Ok(())
}

/// The summary as one system message.
pub fn render(record: &SummaryRecord) -> Option<Box<RawValue>> {
    let kind = if record.heuristic {
        ", heuristic: no model summary yet"
    } else {
        ""
    };
    let content = format!(
        "{SUMMARY_MARKER} (turns {}–{}){kind}]\n{}",
        record.from_turn, record.to_turn, record.text
    );
    let message = serde_json::json!({"role": "system", "content": content});
    RawValue::from_string(message.to_string()).ok()
}
