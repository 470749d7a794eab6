//! Vectors for recall by meaning: the configured embedder (`memproxy-embed`, or the upstream's
//! `/v1/embeddings` from the edge), the new message's embedding on the request path, a stored
//! exchange's vectors made in its commit with the static table ([`Embedding::in_commit`]), and
//! the background jobs that embed each commit's new messages otherwise and owners' records
//! (long-term memory's archived turns and memories, queued by `crate::longterm`) and store
//! their vectors.
//!
//! Nothing here fails a chat request: without an embedder, or when an embedding fails, recall
//! goes on by words alone and the request's `X-Memory-Recall` says why.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod ahead;

pub use ahead::Ahead;

use crate::recall::Recall;
use crate::worker::Worker;
use memproxy_base::identity::ConversationKey;
use memproxy_embed::Embed;
use memproxy_store::{OwnerHandle, OwnerKey, Store, StoreError, lock};

/// Texts embedded at once by a background job.
const BATCH: usize = 32;

/// Why recall went by words alone on a request: a closed set, sent as `X-Memory-Recall`'s
/// reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lexical {
    /// `relevance_semantic` is off.
    Setting,
    /// No embedder is configured (`embedding.embedder = "off"`).
    NoEmbedder,
    /// The configured embedder could not be loaded (its model missing or broken).
    EmbedderUnavailable,
    /// The new message's embedding failed or took longer than `embedding.query_timeout`.
    QueryFailed,
    /// None of the conversation's older messages has a vector yet (stored before the
    /// embedder was configured: `memproxy vectors rebuild`).
    NoVectors,
}

/// How recall searched on a request, sent as `X-Memory-Recall`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecallMode {
    /// No search (relevance off, nothing older than the window).
    #[default]
    None,
    /// Words and meaning.
    Hybrid,
    /// Words alone, and why.
    Lexical(Lexical),
}

impl RecallMode {
    /// The header's value: `hybrid`, `lexical; reason=…`, or `None` when recall did not search.
    pub fn header(self) -> Option<String> {
        match self {
            RecallMode::None => None,
            RecallMode::Hybrid => Some("hybrid".to_string()),
            RecallMode::Lexical(why) => Some(format!("lexical; reason={}", why.as_str())),
        }
    }
}

impl Lexical {
    pub fn as_str(self) -> &'static str {
        match self {
            Lexical::Setting => "setting",
            Lexical::NoEmbedder => "no-embedder",
            Lexical::EmbedderUnavailable => "embedder-unavailable",
            Lexical::QueryFailed => "query-embedding-failed",
            Lexical::NoVectors => "no-vectors",
        }
    }
}

/// What the embedder has done since start (the edge's `/metrics`).
#[derive(Debug, Default)]
pub struct EmbeddingCounters {
    /// New messages embedded on the request path.
    pub queries: AtomicU64,
    /// Of those, failed or late (recall went by words).
    pub query_failures: AtomicU64,
    /// Microseconds spent embedding new messages on the request path.
    pub query_micros: AtomicU64,
    /// New messages whose embedding was started ahead, on the helper thread.
    pub queries_ahead: AtomicU64,
    /// Halves of a step of the helper's pass that the request waiting for it ran
    /// (`memproxy_embed::Assist`; 12 steps a pass of the full model).
    pub query_halves_helped: AtomicU64,
    /// Stored messages given a vector.
    pub vectors_stored: AtomicU64,
    /// Vectors a commit made ([`Embedding::in_commit`]): written with its messages (counted
    /// in `vectors_stored` too), or derived ones kept in the recall index alone.
    pub vectors_in_commit: AtomicU64,
    /// Of `vectors_in_commit`, those of an embedder whose vectors are not stored
    /// (`Embed::derived`: a table's), made again from the stored texts when an index is built.
    pub vectors_derived: AtomicU64,
    /// Background jobs dropped (queue full): their conversation or owner is owed a catch-up
    /// ([`Owed`]), which makes the missing vectors once the queue has room.
    pub jobs_dropped: AtomicU64,
    pub jobs_failed: AtomicU64,
    /// Catch-ups run: conversations and owners whose missing vectors were made after a job
    /// of theirs was dropped.
    pub caught_up: AtomicU64,
    /// Conversations and owners not remembered for a catch-up (more than [`OWED_MAX`] were
    /// owed at once): their vectors wait for `memproxy vectors rebuild`.
    pub owed_forgotten: AtomicU64,
    /// Background jobs queued, and finished (stored, failed or found nothing to store).
    pub jobs_queued: AtomicU64,
    pub jobs_finished: AtomicU64,
}

/// A commit's new messages to embed, and the same turns as the user's archive copied them
/// (their vectors are the messages', not made twice).
#[derive(Debug)]
struct Job {
    key: ConversationKey,
    conversation_id: u64,
    texts: Vec<(u64, String)>,
    archive: Vec<RecordsJob>,
    /// Vectors already made, by text (recall's query): a message of one of these texts takes
    /// it instead of being embedded.
    known: Vec<(String, Vec<f32>)>,
}

/// The turns a commit copied into the user's archive, to embed with the commit's messages
/// (`crate::longterm` makes it; [`Embedding::after_commit`] takes it).
pub struct Archived {
    pub owner: OwnerKey,
    pub texts: Vec<RecordText>,
    pub stored: RecordsStored,
}

/// An owner's record to embed: (record space, record id, text).
pub type RecordText = (u8, Vec<u8>, String);

/// An owner's record's vector: (record space, record id, embedding).
pub type RecordVector = (u8, Vec<u8>, Vec<f32>);

/// What a records job embeds: texts known when it was queued, or read when it runs (a
/// memory's current text, so that an edit queued before a later one never leaves the older
/// text's vector behind).
pub enum RecordTexts {
    Given(Vec<RecordText>),
    Read(Box<ReadTexts>),
}

/// Reads the texts of a [`RecordTexts::Read`] job from the owner's records.
pub type ReadTexts = dyn FnOnce(&Store, &OwnerHandle) -> Result<Vec<RecordText>, StoreError> + Send;

/// Told the vectors a records job stored (the user's index takes them).
pub type RecordsStored = Box<dyn FnOnce(&[RecordVector]) + Send>;

/// An owner's records to embed, and who is told once their vectors are stored.
struct RecordsJob {
    owner: OwnerKey,
    texts: RecordTexts,
    stored: Option<RecordsStored>,
}

impl std::fmt::Debug for RecordsJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordsJob").finish_non_exhaustive()
    }
}

/// A background job: a conversation's messages, or an owner's records.
#[derive(Debug)]
enum Work {
    Messages(Job),
    Records(RecordsJob),
    /// Nothing to embed of its own: the batch it is in runs the next catch-ups ([`Owed`]).
    CatchUp,
}

/// Conversations and owners at most remembered as owed a catch-up, each.
pub const OWED_MAX: usize = 4096;
/// Catch-ups run after each batch, at most: new commits' jobs go first.
const CATCH_UPS_PER_BATCH: usize = 16;

/// Conversations and owners whose background job was dropped because the queue was full.
/// After each batch the worker takes a few and gives every message (or record) of theirs
/// that has no vector one, as `memproxy vectors rebuild` does for all; so a burst that fills
/// the queue leaves recall by words alone for as long as it lasts, not until someone runs the
/// rebuild. Oldest first, each at most once (known by a hash of its key: the key is held
/// once); at most [`OWED_MAX`] of each, so at most about 2 MB.
#[derive(Debug, Default)]
struct Owed {
    conversations: VecDeque<ConversationKey>,
    owners: VecDeque<OwnerKey>,
    held: HashSet<u64>,
    hasher: RandomState,
}

/// One conversation or owner owed a catch-up.
#[derive(Debug)]
enum Due {
    Conversation(ConversationKey),
    Owner(OwnerKey),
}

impl Owed {
    /// Remembers who `work` was for; false when that would pass [`OWED_MAX`].
    fn owe(&mut self, work: &Work) -> bool {
        match work {
            Work::Messages(job) => {
                let mut all = self.owe_conversation(&job.key);
                for archive in &job.archive {
                    all &= self.owe_owner(&archive.owner);
                }
                all
            }
            Work::Records(job) => self.owe_owner(&job.owner),
            Work::CatchUp => true,
        }
    }

    fn owe_conversation(&mut self, key: &ConversationKey) -> bool {
        let hash = self.hasher.hash_one((0u8, key));
        Self::owe_one(&mut self.held, &mut self.conversations, hash, key)
    }

    fn owe_owner(&mut self, owner: &OwnerKey) -> bool {
        let hash = self.hasher.hash_one((1u8, owner));
        Self::owe_one(&mut self.held, &mut self.owners, hash, owner)
    }

    /// Queues `key` (known by `hash`) unless it is owed already; false past [`OWED_MAX`].
    fn owe_one<K: Clone>(
        held: &mut HashSet<u64>,
        queue: &mut VecDeque<K>,
        hash: u64,
        key: &K,
    ) -> bool {
        if held.contains(&hash) {
            return true;
        }
        if queue.len() >= OWED_MAX {
            return false;
        }
        held.insert(hash);
        queue.push_back(key.clone());
        true
    }

    /// The `n` owed longest, conversations first.
    fn take(&mut self, n: usize) -> Vec<Due> {
        let mut due = Vec::new();
        while due.len() < n {
            if let Some(key) = self.conversations.pop_front() {
                self.held.remove(&self.hasher.hash_one((0u8, &key)));
                due.push(Due::Conversation(key));
            } else if let Some(owner) = self.owners.pop_front() {
                self.held.remove(&self.hasher.hash_one((1u8, &owner)));
                due.push(Due::Owner(owner));
            } else {
                break;
            }
        }
        due
    }

    fn len(&self) -> usize {
        self.conversations.len() + self.owners.len()
    }
}

/// What the worker needs of long-term memory to catch an owner up: which records have vectors
/// and how their texts are read, and who is told once an owner's vectors are made (its
/// cached index, which holds them, is dropped). Long-term memory is above this module.
pub struct OwnerCatchUp {
    pub records: &'static OwnerRecords<'static>,
    pub caught_up: Box<dyn Fn(&OwnerKey) + Send + Sync>,
}

/// The embedder and its background worker.
pub struct Embedding {
    embedder: Result<Arc<dyn Embed>, Lexical>,
    /// Why the configured embedder is unavailable (for `/readyz` and the log).
    unavailable: Option<String>,
    query_timeout: Duration,
    jobs: Worker<Work>,
    owed: Arc<Mutex<Owed>>,
    pub counters: Arc<EmbeddingCounters>,
    /// The thread that embeds new messages ahead ([`Embedding::ahead`]).
    helper: ahead::Helper,
}

impl std::fmt::Debug for Embedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedding")
            .field("space", &self.space())
            .field("unavailable", &self.unavailable)
            .finish_non_exhaustive()
    }
}

/// What the edge found of the configured embedder.
pub enum Embedder {
    Ready(Arc<dyn Embed>),
    /// None configured.
    Off,
    /// Configured, and could not be loaded: why.
    Unavailable(String),
}

impl Embedding {
    /// The embedder `found`; its worker is started by [`Embedding::start`].
    pub fn new(found: Embedder, query_timeout: Duration, queue: usize) -> Embedding {
        let (embedder, unavailable) = match found {
            Embedder::Ready(embedder) => (Ok(embedder), None),
            Embedder::Off => (Err(Lexical::NoEmbedder), None),
            Embedder::Unavailable(why) => {
                tracing::warn!(
                    reason = %why,
                    "recall by meaning is off: the embedder could not be loaded; recall goes by words alone"
                );
                (Err(Lexical::EmbedderUnavailable), Some(why))
            }
        };
        Embedding {
            embedder,
            unavailable,
            query_timeout,
            jobs: Worker::new(queue),
            owed: Arc::new(Mutex::new(Owed::default())),
            counters: Arc::new(EmbeddingCounters::default()),
            helper: ahead::Helper::default(),
        }
    }

    /// No embedder (tests, tools).
    pub fn off() -> Embedding {
        Embedding::new(Embedder::Off, Duration::from_secs(1), 1)
    }

    /// The vector space in use and its dimension (`None`: recall by words alone).
    pub fn space(&self) -> Option<(&str, usize)> {
        self.embedder.as_ref().ok().map(|e| (e.id(), e.dims()))
    }

    /// The embedder in use.
    pub fn embedder(&self) -> Option<&Arc<dyn Embed>> {
        self.embedder.as_ref().ok()
    }

    /// The embedder when its vectors are not stored but made again from the texts whenever
    /// a recall index is built (`Embed::derived`: the static table's).
    pub fn derived(&self) -> Option<&Arc<dyn Embed>> {
        self.embedder().filter(|embedder| embedder.derived())
    }

    /// True when the embedder is a model worth a thread of its own (`Embed::worth_a_thread`):
    /// a plan then waits for its query vector from that thread.
    pub fn worth_a_thread(&self) -> bool {
        self.embedder()
            .is_some_and(|embedder| embedder.worth_a_thread())
    }

    /// Why the configured embedder is unavailable, if it is.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    /// Starts embedding the new message `text` on the helper thread, for
    /// [`Embedding::query_from`] to take when recall needs it, when the embedder is worth a
    /// thread; `None` otherwise (and when the helper's queue is full).
    pub fn ahead(&self, text: String) -> Option<Ahead> {
        let embedder = self.embedder.as_ref().ok()?;
        if !embedder.worth_a_thread() {
            return None;
        }
        let ahead = self.helper.start(embedder, text);
        if ahead.is_some() {
            self.counters.queries_ahead.fetch_add(1, Ordering::Relaxed);
        }
        ahead
    }

    /// Embeds the new message on the request path. Blocks; a failure, or an embedding longer
    /// than `embedding.query_timeout`, is why recall goes by words.
    pub fn query(&self, text: &str) -> Result<Vec<f32>, Lexical> {
        self.query_from(None, text)
    }

    /// [`Embedding::query`], with the embedding `ahead` started if it is of this same text
    /// (waited for if the helper is making it, made here if it has not begun).
    pub fn query_from(&self, ahead: Option<Ahead>, text: &str) -> Result<Vec<f32>, Lexical> {
        let embedder = self.embedder.as_ref().map_err(|why| *why)?;
        let ((result, took), helped) = match ahead {
            Some(ahead) if ahead.text() == text => ahead.take(),
            _ => (ahead::embed(embedder.as_ref(), text), 0),
        };
        let c = &self.counters;
        c.query_halves_helped
            .fetch_add(helped as u64, Ordering::Relaxed);
        c.queries.fetch_add(1, Ordering::Relaxed);
        c.query_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        match result {
            Ok(mut vectors) if took <= self.query_timeout && vectors.len() == 1 => {
                Ok(vectors.swap_remove(0))
            }
            Ok(_) => {
                c.query_failures.fetch_add(1, Ordering::Relaxed);
                Err(Lexical::QueryFailed)
            }
            Err(err) => {
                c.query_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %err, "embedding the new message failed; recall goes by words");
                Err(Lexical::QueryFailed)
            }
        }
    }

    /// Queues the embedding of a commit's new messages `(turn, search text)` and of the turns
    /// it copied into the user's archive (one job: an archived turn whose text is one of the
    /// messages' takes that message's vector); a full queue drops the job (counted) and the
    /// conversation and the user are owed a catch-up. `known` is a vector this embedder made
    /// already, with its text (recall's query): a message of exactly that text takes it.
    pub fn after_commit(
        &self,
        key: &ConversationKey,
        conversation_id: u64,
        texts: &[(u64, String)],
        archived: Option<Archived>,
        known: Option<&(String, Vec<f32>)>,
    ) {
        if self.embedder.is_err() {
            return;
        }
        let archive: Vec<RecordsJob> = archived
            .filter(|a| !a.texts.is_empty())
            .map(|a| RecordsJob {
                owner: a.owner,
                texts: RecordTexts::Given(a.texts),
                stored: Some(a.stored),
            })
            .into_iter()
            .collect();
        if texts.is_empty() {
            for job in archive {
                self.enqueue(Work::Records(job));
            }
            return;
        }
        let known = known
            .filter(|(text, _)| texts.iter().any(|(_, t)| t == text))
            .cloned()
            .into_iter()
            .collect();
        self.enqueue(Work::Messages(Job {
            key: key.clone(),
            conversation_id,
            texts: texts.to_vec(),
            archive,
            known,
        }));
    }

    /// The vectors of a commit's added messages `texts`, in order, with their space: made on
    /// the committing thread when the embedder costs less there than the hand-over to the
    /// background worker and the separate write after it (a table's additions, not
    /// [`Embed::worth_a_thread`]), for the commit to write with the messages. `None` with
    /// another embedder or none, or when embedding fails (the worker then makes them after the
    /// commit, as for any other). A text of `known` (recall's query vector) takes it.
    pub fn in_commit(
        &self,
        texts: &[String],
        known: Option<&(String, Vec<f32>)>,
    ) -> Option<(String, Vec<Vec<f32>>)> {
        let embedder = self.embedder.as_ref().ok()?;
        if embedder.worth_a_thread() || texts.is_empty() {
            return None;
        }
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let made = embed_unless_known(embedder.as_ref(), &refs, |text| {
            known.filter(|(k, _)| k == text).map(|(_, vector)| vector)
        })
        .ok()?;
        let whole = made.len() == texts.len() && made.iter().all(|v| v.len() == embedder.dims());
        whole.then(|| (embedder.id().to_string(), made))
    }

    /// Counts the vectors a commit made ([`Embedding::in_commit`]): written with its messages
    /// among those stored, or, of a derived embedder ([`Embedding::derived`]), not stored.
    pub fn made_in_commit(&self, count: usize) {
        let c = &self.counters;
        let count = count as u64;
        c.vectors_in_commit.fetch_add(count, Ordering::Relaxed);
        if self.derived().is_some() {
            c.vectors_derived.fetch_add(count, Ordering::Relaxed);
        } else {
            c.vectors_stored.fetch_add(count, Ordering::Relaxed);
        }
    }

    /// Queues the embedding of an owner's records (archived turns, memories); `stored` is
    /// told the vectors once they are stored. A full queue drops the job (counted) and the
    /// owner is owed a catch-up; until it runs, the records are found by words.
    pub fn after_records(
        &self,
        owner: &OwnerKey,
        texts: RecordTexts,
        stored: Option<RecordsStored>,
    ) {
        if self.embedder.is_err() || matches!(&texts, RecordTexts::Given(t) if t.is_empty()) {
            return;
        }
        self.enqueue(Work::Records(RecordsJob {
            owner: owner.clone(),
            texts,
            stored,
        }));
    }

    fn enqueue(&self, work: Work) {
        match self.jobs.try_enqueue(work) {
            Ok(()) => {
                self.counters.jobs_queued.fetch_add(1, Ordering::Relaxed);
            }
            Err(work) => {
                self.counters.jobs_dropped.fetch_add(1, Ordering::Relaxed);
                if !lock_owed(&self.owed).owe(&work) {
                    self.counters.owed_forgotten.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// No background job is queued or running, and no catch-up is owed.
    pub fn idle(&self) -> bool {
        let c = &self.counters;
        c.jobs_finished.load(Ordering::Relaxed) >= c.jobs_queued.load(Ordering::Relaxed)
            && self.owed() == 0
    }

    /// Conversations and owners owed a catch-up.
    pub fn owed(&self) -> usize {
        lock_owed(&self.owed).len()
    }

    /// Starts the background worker: one batch of jobs at a time (embedding is CPU work, and a
    /// sidecar's cores are the agent's too), a batch being what queued while the last one ran,
    /// its jobs of one conversation stored together, then up to [`CATCH_UPS_PER_BATCH`]
    /// catch-ups ([`Owed`]). Must be called inside a tokio runtime.
    pub fn start(&self, store: Arc<Store>, recall: Arc<Recall>, owners: OwnerCatchUp) {
        let Ok(embedder) = &self.embedder else {
            return;
        };
        let embedder = Arc::clone(embedder);
        let counters = Arc::clone(&self.counters);
        let owed = Arc::clone(&self.owed);
        let owners = Arc::new(owners);
        // Weak: the worker's own task must not keep its queue open.
        let Some(again) = self.jobs.weak_sender() else {
            return;
        };
        self.jobs
            .start_batched(BATCH_JOBS, move |batch: Vec<Work>| {
                let (embedder, store, recall, counters, owed, owners, again) = (
                    Arc::clone(&embedder),
                    Arc::clone(&store),
                    Arc::clone(&recall),
                    Arc::clone(&counters),
                    Arc::clone(&owed),
                    Arc::clone(&owners),
                    again.clone(),
                );
                async move {
                    let jobs = batch.len() as u64;
                    let due = lock_owed(&owed).take(CATCH_UPS_PER_BATCH);
                    let done = tokio::task::spawn_blocking(move || {
                        let mut outcome = run_batch(&*embedder, &store, &recall, batch);
                        for due in due {
                            outcome.catch_up(catch_up(&*embedder, &store, &recall, &owners, &due));
                        }
                        outcome
                    })
                    .await;
                    match done {
                        Ok(outcome) => {
                            counters
                                .vectors_stored
                                .fetch_add(outcome.stored as u64, Ordering::Relaxed);
                            counters
                                .jobs_failed
                                .fetch_add(outcome.failed_jobs, Ordering::Relaxed);
                            counters
                                .caught_up
                                .fetch_add(outcome.caught_up, Ordering::Relaxed);
                        }
                        Err(err) => {
                            counters.jobs_failed.fetch_add(jobs, Ordering::Relaxed);
                            tracing::warn!(error = %err, "an embedding task failed");
                        }
                    }
                    // More owed: a marker so a batch comes even if no commit queues one (when
                    // the queue is full, a batch is coming anyway). Queued before this batch
                    // counts as finished, so `idle` never sees the gap.
                    if lock_owed(&owed).len() > 0
                        && again
                            .upgrade()
                            .is_some_and(|tx| tx.try_send(Work::CatchUp).is_ok())
                    {
                        counters.jobs_queued.fetch_add(1, Ordering::Relaxed);
                    }
                    counters.jobs_finished.fetch_add(jobs, Ordering::Relaxed);
                }
            });
    }

    /// Stops the worker, waiting up to `grace` for the job in flight.
    pub async fn shutdown(&self, grace: Duration) {
        self.jobs.shutdown(grace).await;
    }
}

/// Why a background embedding failed (never holds message text).
#[derive(Debug, thiserror::Error)]
pub enum EmbedJobError {
    #[error(transparent)]
    Embed(#[from] memproxy_embed::EmbedError),
    #[error(transparent)]
    Store(#[from] memproxy_store::StoreError),
}

/// Jobs a background batch takes at most.
const BATCH_JOBS: usize = 256;

/// What a batch of jobs did.
#[derive(Debug, Default)]
struct BatchOutcome {
    stored: usize,
    failed_jobs: u64,
    caught_up: u64,
}

impl BatchOutcome {
    fn catch_up(&mut self, result: Result<usize, EmbedJobError>) {
        match result {
            Ok(stored) => {
                self.stored += stored;
                self.caught_up += 1;
            }
            Err(err) => {
                self.failed_jobs += 1;
                tracing::warn!(error = %err, "making the vectors of dropped jobs failed");
            }
        }
    }

    fn add(&mut self, result: Result<usize, EmbedJobError>, jobs: u64) {
        match result {
            Ok(stored) => self.stored += stored,
            Err(err) => {
                self.failed_jobs += jobs;
                tracing::warn!(error = %err, "embedding stored messages failed");
            }
        }
    }
}

/// Runs a batch: the owners' records job by job; the messages of each conversation (same key
/// and id) merged into one job, in the order they came (a turn made again later keeps the
/// later vector), so the batch costs one store transaction per conversation.
fn run_batch(
    embedder: &dyn Embed,
    store: &Store,
    recall: &Recall,
    batch: Vec<Work>,
) -> BatchOutcome {
    let mut outcome = BatchOutcome::default();
    // Each conversation's merged job and how many jobs it took in, in order of arrival.
    let mut merged: Vec<(Job, u64)> = Vec::new();
    let mut at: HashMap<(ConversationKey, u64), usize> = HashMap::new();
    for work in batch {
        match work {
            Work::Messages(job) => match at.entry((job.key.clone(), job.conversation_id)) {
                Entry::Occupied(slot) => {
                    let (into, jobs) = &mut merged[*slot.get()];
                    into.texts.extend(job.texts);
                    into.archive.extend(job.archive);
                    into.known.extend(job.known);
                    *jobs += 1;
                }
                Entry::Vacant(slot) => {
                    slot.insert(merged.len());
                    merged.push((job, 1));
                }
            },
            Work::Records(job) => {
                outcome.add(embed_records(embedder, store, job, &HashMap::new()), 1);
            }
            Work::CatchUp => {}
        }
    }
    for (job, jobs) in merged {
        outcome.add(embed_and_store(embedder, store, recall, job), jobs);
    }
    outcome
}

fn lock_owed(owed: &Mutex<Owed>) -> std::sync::MutexGuard<'_, Owed> {
    owed.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Makes the missing vectors of one conversation or owner owed a catch-up. The number stored.
fn catch_up(
    embedder: &dyn Embed,
    store: &Store,
    recall: &Recall,
    owners: &OwnerCatchUp,
    due: &Due,
) -> Result<usize, EmbedJobError> {
    match due {
        // A derived embedder's vectors are never stored, so none is missing.
        Due::Conversation(_) if embedder.derived() => Ok(0),
        Due::Conversation(key) => match missing_vectors(store, key, embedder.id())?.0 {
            Some(job) => embed_and_store(embedder, store, recall, job),
            None => Ok(0),
        },
        Due::Owner(owner) => {
            let (made, _) = owner_missing_vectors(store, embedder, owners.records, owner)?;
            if made > 0 {
                (owners.caught_up)(owner);
            }
            Ok(made)
        }
    }
}

/// The job that gives conversation `key`'s stored messages without a vector of `space` one
/// (`None`: every one has), and how many already have one. Reads under the conversation's lock.
fn missing_vectors(
    store: &Store,
    key: &ConversationKey,
    space: &str,
) -> Result<(Option<Job>, u64), StoreError> {
    let handle = store.conversation(key)?;
    let mut conversation = lock(&handle);
    store.refresh(&mut conversation)?;
    let Some(id) = conversation.meta.as_ref().map(|m| m.id) else {
        return Ok((None, 0));
    };
    let missing = store.turns_without_vectors(&conversation, space)?;
    let present = (conversation.entries.len() - missing.len()) as u64;
    if missing.is_empty() {
        return Ok((None, present));
    }
    let texts = store
        .messages(&conversation, missing)?
        .iter()
        .map(|m| (m.turn, memproxy_base::message::search_text(&m.message)))
        .collect();
    let job = Job {
        key: key.clone(),
        conversation_id: id,
        texts,
        archive: Vec::new(),
        known: Vec::new(),
    };
    Ok((Some(job), present))
}

/// Gives `owner`'s records of `records`' spaces without a vector of `embedder`'s space one:
/// (records given one, records that had one).
fn owner_missing_vectors(
    store: &Store,
    embedder: &dyn Embed,
    records: &OwnerRecords<'_>,
    owner: &OwnerKey,
) -> Result<(usize, usize), EmbedJobError> {
    let Some(handle) = store.owner(owner, false)? else {
        return Ok((0, 0));
    };
    let (mut made, mut present) = (0, 0);
    for &space in records.spaces {
        let missing = store.owner_records_without_vectors(&handle, space, embedder.id())?;
        present += store.owner_vectors(&handle, space, embedder.id())?.len();
        if missing.is_empty() {
            continue;
        }
        let texts = (records.read)(store, &handle, space, &missing)?;
        for chunk in texts.chunks(BATCH * 8) {
            let job = RecordsJob {
                owner: owner.clone(),
                texts: RecordTexts::Given(chunk.to_vec()),
                stored: None,
            };
            made += embed_records(embedder, store, job, &HashMap::new())?;
        }
    }
    Ok((made, present))
}

/// Embeds `job`'s texts (without the conversation's lock; a text of `job.known` takes the vector
/// made of it already), then, under it, stores the vectors of the turns still stored and hands
/// them to the recall index. The number stored.
fn embed_and_store(
    embedder: &dyn Embed,
    store: &Store,
    recall: &Recall,
    job: Job,
) -> Result<usize, EmbedJobError> {
    let texts: Vec<&str> = job.texts.iter().map(|(_, text)| text.as_str()).collect();
    let made = embed_unless_known(embedder, &texts, |text| {
        job.known
            .iter()
            .find(|(known, _)| known == text)
            .map(|(_, vector)| vector)
    })?;
    let vectors: Vec<(u64, Vec<f32>)> = job.texts.iter().map(|(turn, _)| *turn).zip(made).collect();
    let mut stored = store_vectors(
        store,
        recall,
        &job.key,
        job.conversation_id,
        (!embedder.derived()).then(|| embedder.id()),
        &vectors,
    )?;
    // The archived copies of these turns take their vectors.
    let known: HashMap<&str, &Vec<f32>> = texts
        .iter()
        .copied()
        .zip(vectors.iter().map(|(_, vector)| vector))
        .collect();
    for archive in job.archive {
        stored += embed_records(embedder, store, archive, &known)?;
    }
    Ok(stored)
}

/// The vectors of `texts`, in order: a text `known` gives a vector for takes it, the others are
/// embedded ([`embed_all`]).
fn embed_unless_known<'k>(
    embedder: &dyn Embed,
    texts: &[&str],
    known: impl Fn(&str) -> Option<&'k Vec<f32>>,
) -> Result<Vec<Vec<f32>>, EmbedJobError> {
    let unknown: Vec<&str> = texts
        .iter()
        .copied()
        .filter(|text| known(text).is_none())
        .collect();
    let mut made = embed_all(embedder, &unknown)?.into_iter();
    Ok(texts
        .iter()
        .map(|text| match known(text) {
            Some(vector) => vector.clone(),
            None => made.next().unwrap_or_default(),
        })
        .collect())
}

/// Embeds `texts` in batches of [`BATCH`].
pub fn embed_all(embedder: &dyn Embed, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedJobError> {
    let mut out = Vec::with_capacity(texts.len());
    for batch in texts.chunks(BATCH) {
        let made = embedder.embed(batch)?;
        if made.len() != batch.len() {
            return Err(EmbedJobError::Embed(memproxy_embed::EmbedError::Failed(
                format!("{} vectors made for {} texts", made.len(), batch.len()),
            )));
        }
        out.extend(made);
    }
    Ok(out)
}

/// Embeds a records job's texts and stores them for the owner (only for records still
/// stored, nothing once the owner is deleted); a text in `known` takes its vector from there.
/// The job's `stored` is told what was stored. The number stored.
fn embed_records(
    embedder: &dyn Embed,
    store: &Store,
    job: RecordsJob,
    known: &HashMap<&str, &Vec<f32>>,
) -> Result<usize, EmbedJobError> {
    let Some(handle) = store.owner(&job.owner, false)? else {
        return Ok(0);
    };
    let texts = match job.texts {
        RecordTexts::Given(texts) => texts,
        RecordTexts::Read(read) => read(store, &handle)?,
    };
    if texts.is_empty() {
        return Ok(0);
    }
    let of: Vec<&str> = texts.iter().map(|(_, _, t)| t.as_str()).collect();
    let made = embed_unless_known(embedder, &of, |text| known.get(text).copied())?;
    let vectors: Vec<RecordVector> = texts
        .into_iter()
        .zip(made)
        .map(|((space, id, _), vector)| (space, id, vector))
        .collect();
    let stored = store.put_owner_vectors(&handle, embedder.id(), &vectors)?;
    if let Some(told) = job.stored {
        told(&vectors);
    }
    Ok(stored)
}

/// Stores `vectors` of conversation `key` (id `conversation_id`) under its lock as vectors of
/// `space` (`None`: a derived embedder's, not stored), and hands them to its recall index.
/// The number stored (those of turns no longer stored are not).
pub fn store_vectors(
    store: &Store,
    recall: &Recall,
    key: &ConversationKey,
    conversation_id: u64,
    space: Option<&str>,
    vectors: &[(u64, Vec<f32>)],
) -> Result<usize, EmbedJobError> {
    let handle = store.conversation(key)?;
    let mut conversation = lock(&handle);
    store.refresh(&mut conversation)?;
    if conversation.meta.as_ref().map(|m| m.id) != Some(conversation_id) {
        return Ok(0);
    }
    let stored = match space {
        Some(space) => store.put_vectors(&conversation, space, vectors)?,
        None => 0,
    };
    recall.add_vectors(key, conversation_id, vectors);
    Ok(stored)
}

/// What [`rebuild`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rebuilt {
    /// Conversations looked at.
    pub conversations: u64,
    /// Stored messages given a vector.
    pub vectors: u64,
    /// Stored messages that already had one of this space.
    pub present: u64,
    /// Owners looked at (long-term memory).
    pub owners: u64,
    /// Owners' records given a vector.
    pub records: u64,
    /// Owners' records that already had one of this space.
    pub records_present: u64,
}

/// Reads the texts of an owner's records `ids` (in id order) of record space `space`.
pub type ReadRecords =
    dyn Fn(&Store, &OwnerHandle, u8, &[Vec<u8>]) -> Result<Vec<RecordText>, StoreError> + Sync;

/// Which owners' records have vectors, and how their texts are read: what a rebuild needs
/// to know of long-term memory (`crate::longterm::VECTOR_RECORDS`), which this module, below
/// it, does not import.
pub struct OwnerRecords<'a> {
    /// The record spaces embedded.
    pub spaces: &'a [u8],
    pub read: &'a ReadRecords,
}

/// Owners looked at in one page of a rebuild.
const OWNER_PAGE: usize = 200;

/// Gives every stored message of every conversation in `store` a vector of `embedder`'s space
/// (those that have one are left alone): for data stored before the embedder was configured,
/// jobs dropped under load, or a new embedder (`memproxy vectors rebuild`). Each conversation
/// is embedded outside its lock and stored under it (turns gone meanwhile are not written).
/// Then every owner's records of `records`' spaces (long-term memory's archived turns and
/// memories: memories imported, written offline, or whose text changed with no embedder at
/// hand) the same way. `progress` is told after each conversation. A derived embedder's
/// message vectors (`Embed::derived`) are not stored: the conversations are passed over.
pub fn rebuild(
    store: &Store,
    recall: &Recall,
    embedder: &dyn Embed,
    records: &OwnerRecords<'_>,
    mut progress: impl FnMut(&ConversationKey, &Rebuilt),
) -> Result<Rebuilt, EmbedJobError> {
    let mut done = rebuild_conversations(store, recall, embedder, &mut progress)?;
    rebuild_owners(store, embedder, records, &mut done)?;
    Ok(done)
}

/// The owners' part of [`rebuild`]: page by page, as the TTL sweeper walks them.
fn rebuild_owners(
    store: &Store,
    embedder: &dyn Embed,
    records: &OwnerRecords<'_>,
    done: &mut Rebuilt,
) -> Result<(), EmbedJobError> {
    let mut after: Option<Vec<u8>> = None;
    loop {
        let (page, next) = store.owners(after.as_deref(), OWNER_PAGE)?;
        for (owner, _) in page {
            done.owners += 1;
            let (made, present) = owner_missing_vectors(store, embedder, records, &owner)?;
            done.records += made as u64;
            done.records_present += present as u64;
        }
        match next {
            Some(next) => after = Some(next),
            None => return Ok(()),
        }
    }
}

/// The conversations' part of [`rebuild`].
fn rebuild_conversations(
    store: &Store,
    recall: &Recall,
    embedder: &dyn Embed,
    progress: &mut impl FnMut(&ConversationKey, &Rebuilt),
) -> Result<Rebuilt, EmbedJobError> {
    let mut done = Rebuilt::default();
    if embedder.derived() {
        // Its vectors are made from the texts whenever an index is built: none to store.
        return Ok(done);
    }
    let mut cursor: Option<Vec<u8>> = None;
    loop {
        let (batch, more) = store.scan(cursor.as_deref(), 500)?;
        for (key, _) in &batch {
            cursor = Some(key.to_bytes());
            done.conversations += 1;
            let (job, present) = missing_vectors(store, key, embedder.id())?;
            done.present += present;
            if let Some(job) = job {
                done.vectors += embed_and_store(embedder, store, recall, job)? as u64;
            }
            progress(key, &done);
        }
        if !more {
            return Ok(done);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memproxy_base::identity::TenantId;

    fn messages(conversation: &str) -> Work {
        Work::Messages(Job {
            key: ConversationKey {
                tenant: TenantId::from_token(None),
                agent: "default".into(),
                conversation: conversation.into(),
            },
            conversation_id: 1,
            texts: vec![(0, "text".into())],
            archive: Vec::new(),
            known: Vec::new(),
        })
    }

    /// Embeds each text as `[its length, 1]`, and keeps the texts it was given.
    #[derive(Debug, Default)]
    struct Told(Mutex<Vec<String>>);

    impl Embed for Told {
        fn id(&self) -> &str {
            "told/2"
        }
        fn dims(&self) -> usize {
            2
        }
        fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, memproxy_embed::EmbedError> {
            let mut told = self.0.lock().unwrap();
            told.extend(texts.iter().map(|t| t.to_string()));
            Ok(texts.iter().map(|t| vec![t.len() as f32, 1.0]).collect())
        }
    }

    #[test]
    fn a_message_of_the_known_text_takes_its_vector_and_only_the_others_are_embedded() {
        use memproxy_base::message::Role;
        use memproxy_store::{Change, Durability, Origin, StoreOptions, StoredMessage};
        let dir = tempfile::tempdir().unwrap();
        let options = StoreOptions {
            durability: Durability::Interval(std::time::Duration::from_secs(1)),
            page_cache_bytes: 1 << 20,
            state_cache_bytes: 1 << 20,
        };
        let store = Store::open(dir.path(), options).unwrap();
        let key = ConversationKey {
            tenant: TenantId::from_token(Some("t")),
            agent: "a".into(),
            conversation: "c".into(),
        };
        let texts = ["where did I park", "on level two", "where did I park"];
        let add = texts
            .iter()
            .enumerate()
            .map(|(i, text)| StoredMessage {
                turn: 0,
                role: [Role::User, Role::Assistant][i % 2],
                origin: Origin::Client,
                at_ms: 1_000,
                tokens: 5,
                fingerprint: i as u64 + 1,
                message: serde_json::value::RawValue::from_string(
                    serde_json::json!({"role": "user", "content": text}).to_string(),
                )
                .unwrap(),
                exchange: None,
            })
            .collect();
        let handle = store.conversation(&key).unwrap();
        let (id, turns) = {
            let mut held = lock(&handle);
            let change = Change {
                add,
                ..Change::default()
            };
            store.commit(&mut held, change).unwrap();
            let turns: Vec<u64> = held.entries.iter().map(|e| e.turn).collect();
            (held.meta.as_ref().unwrap().id, turns)
        };
        let recall = Recall::new(1 << 20, Some(("told/2".to_string(), 2)));
        let embedder = Told::default();
        let job = Job {
            key: key.clone(),
            conversation_id: id,
            texts: turns.iter().copied().zip(texts.map(String::from)).collect(),
            archive: Vec::new(),
            known: vec![("where did I park".into(), vec![0.0, 1.0])],
        };
        assert_eq!(embed_and_store(&embedder, &store, &recall, job).unwrap(), 3);
        assert_eq!(*embedder.0.lock().unwrap(), ["on level two"]);
        let held = lock(&handle);
        // As stored (quantised to 8 bits, so nearly).
        let stored = store.vectors(&held, "told/2").unwrap();
        let expected = [
            (turns[0], [0.0, 1.0]),
            (turns[1], [12.0, 1.0]),
            (turns[2], [0.0, 1.0]),
        ];
        assert_eq!(stored.len(), expected.len());
        for ((turn, vector), (want_turn, want)) in stored.iter().zip(expected) {
            assert_eq!(*turn, want_turn);
            let off = vector
                .to_floats()
                .into_iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs());
            assert!(off.fold(0.0, f32::max) < 0.1, "{stored:?}");
        }
    }

    fn records(user: &str) -> Work {
        Work::Records(RecordsJob {
            owner: OwnerKey::user(&TenantId::from_token(None), user),
            texts: RecordTexts::Given(Vec::new()),
            stored: None,
        })
    }

    fn names(due: &[Due]) -> Vec<String> {
        due.iter()
            .map(|d| match d {
                Due::Conversation(key) => key.conversation.clone(),
                Due::Owner(owner) => {
                    assert_eq!(*owner, OwnerKey::user(&TenantId::from_token(None), "ana"));
                    "ana".to_string()
                }
            })
            .collect()
    }

    #[test]
    fn each_is_owed_once_oldest_first_conversations_before_owners() {
        let mut owed = Owed::default();
        for work in [
            messages("a"),
            records("ana"),
            messages("b"),
            messages("a"),
            records("ana"),
        ] {
            assert!(owed.owe(&work));
        }
        assert!(owed.owe(&Work::CatchUp));
        assert_eq!(owed.len(), 3);
        assert_eq!(names(&owed.take(2)), ["a", "b"]);
        assert_eq!(names(&owed.take(5)), ["ana"]);
        assert_eq!(owed.len(), 0);
        // Taken, it may be owed again.
        assert!(owed.owe(&messages("a")));
        assert_eq!(owed.len(), 1);
    }

    #[test]
    fn past_the_bound_a_new_one_is_not_remembered() {
        let mut owed = Owed::default();
        for i in 0..OWED_MAX {
            assert!(owed.owe(&messages(&format!("c{i}"))));
        }
        assert!(!owed.owe(&messages("one too many")));
        assert!(owed.owe(&messages("c7")), "one already owed still is");
        assert!(owed.owe(&records("ana")), "owners have their own bound");
        assert_eq!(owed.len(), OWED_MAX + 1);
    }
}
