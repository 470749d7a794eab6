//! A summary job, from the moment a request finds one due until the worker is done with it:
//! the [`Job`], the [`Reservation`] that marks its conversation busy, and the
//! [`DeferredSummary`] that queues it once the request that found it is over.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use super::worker::Summarizer;
use crate::identity::ConversationKey;
use crate::model::Credentials;

/// What a summary job needs.
#[derive(Debug)]
pub struct Job {
    pub key: ConversationKey,
    pub conversation_id: u64,
    /// The newest turn to cover (the last message before the recent window).
    pub upto_turn: u64,
    pub model: String,
    /// The triggering request's credentials, held in memory only.
    pub credentials: Credentials,
    /// No summary exists yet: store the heuristic stand-in first, so the turns that come
    /// while the model works carry it (async mode; the request that queued the job does not
    /// wait for it).
    pub stand_in: bool,
    /// Marks the conversation busy from planning until the job is done or dropped.
    pub reservation: Reservation,
}

/// A conversation's place in the summarizer's in-flight set, from the moment a job is planned
/// until the job is finished or dropped (whichever way: never sent, refused by a full queue,
/// cancelled at shutdown), so a job can never leave a conversation marked busy.
pub struct Reservation {
    pub(super) in_flight: Arc<Mutex<HashSet<ConversationKey>>>,
    pub(super) key: ConversationKey,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation").finish_non_exhaustive()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        super::guard(&self.in_flight).remove(&self.key);
    }
}

/// A summary job queued for the background worker when this value is dropped: after the
/// answer was handed over, or whichever other way the request ends (an upstream error, a
/// timeout, a client gone, a stream cut), so a due summary is never lost with its request.
/// It moves with the response body, so "dropped" means "the request is over".
#[derive(Debug)]
pub struct DeferredSummary {
    summarizer: Arc<Summarizer>,
    job: Option<Job>,
}

impl DeferredSummary {
    pub fn new(summarizer: Arc<Summarizer>, job: Job) -> DeferredSummary {
        DeferredSummary {
            summarizer,
            job: Some(job),
        }
    }
}

impl Drop for DeferredSummary {
    fn drop(&mut self) {
        if let Some(job) = self.job.take()
            && !self.summarizer.enqueue(job)
        {
            tracing::debug!("summary not queued: the queue is full or closed");
        }
    }
}
