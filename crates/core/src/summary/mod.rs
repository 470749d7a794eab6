//! Summaries of old history, in one place: the job and its reservation (`job.rs`), the
//! background worker and the making of one summary (`worker.rs`), the prompt (`prompt.rs`) and
//! the no-LLM stand-in (`heuristic.rs`). The records themselves are stored by the store
//! (`store/summaries.rs`); the model is called through [`memproxy_base::model::ModelCall`].
//!
//! A summary is progressive: the next one is made from the previous summary plus the messages
//! that aged out since, with a prompt template holding `{prev_summary}` and
//! `{messages_joined}`. When no model summary exists yet, a heuristic one stands in and is
//! marked as such.

pub mod heuristic;
mod job;
mod prompt;
mod worker;

use std::sync::Mutex;
use std::time::Duration;

pub use job::{InFlight, Job, OnStored};
pub use prompt::ratio;
pub use worker::{DeferredSummary, Summarizer, SummaryCounters};

/// The default summary prompt (it lives with the config, which must not import this module).
pub use crate::config::DEFAULT_PROMPT;
use memproxy_base::model::ModelError;
use memproxy_store::StoreError;
pub use memproxy_store::{MAX_CATCH_UP_CALLS, SummaryRecord};

/// The task name summary calls carry upstream (`x-memproxy-task: summary`).
pub const TASK: &str = "summary";

#[derive(Debug, thiserror::Error)]
pub enum SummaryError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the summary call failed: {0}")]
    Model(#[from] ModelError),
    #[error("the summary call took longer than {0:?}")]
    Timeout(Duration),
    #[error("nothing to summarize")]
    Empty,
    #[error("the conversation was deleted while its summary was being made")]
    Gone,
    #[error("a branch left the conversation's main line while its summary was being made")]
    Branched,
    #[error("another replica sharing the store is making this summary")]
    Leased,
    #[error("a background step failed: {0}")]
    Task(String),
    /// The agent's background budget for the day is spent (`compression.max_tokens_per_day`):
    /// the heuristic stand-in stays in use until the next UTC day.
    #[error("the agent's background token budget for today is spent")]
    BudgetSpent,
}

fn guard<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
