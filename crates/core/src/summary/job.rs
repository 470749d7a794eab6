//! A summary job, from the moment a request finds one due until the worker is done with it:
//! the [`Job`] and the [`InFlight`] that marks its conversation busy. (The
//! `DeferredSummary` that queues a job once its request is over is the worker's.)

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use memproxy_base::identity::ConversationKey;
use memproxy_base::model::Credentials;
use memproxy_store::SummaryRecord;

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
    pub reservation: InFlight,
    /// Handed the model summary once it is stored (long-term memory queues an extraction
    /// from it); never called when no summary is stored.
    pub on_stored: Option<OnStored>,
}

/// What to do with a summary once it is stored, given the summary and the job's credentials.
pub struct OnStored(Box<StoredHook>);

type StoredHook = dyn FnOnce(&SummaryRecord, &Credentials) + Send + Sync;

impl OnStored {
    pub fn new(f: impl FnOnce(&SummaryRecord, &Credentials) + Send + Sync + 'static) -> OnStored {
        OnStored(Box::new(f))
    }

    pub(super) fn call(self, record: &SummaryRecord, credentials: &Credentials) {
        (self.0)(record, credentials);
    }
}

impl std::fmt::Debug for OnStored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnStored")
    }
}

/// A conversation's place in the summarizer's in-flight set, from the moment a job is planned
/// until the job is finished or dropped (whichever way: never sent, refused by a full queue,
/// cancelled at shutdown), so a job can never leave a conversation marked busy.
pub struct InFlight {
    pub(super) in_flight: Arc<Mutex<HashSet<ConversationKey>>>,
    pub(super) key: ConversationKey,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").finish_non_exhaustive()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        super::guard(&self.in_flight).remove(&self.key);
    }
}
