//! The summarizer: a bounded queue, one job per conversation at a time, a concurrency limit, a
//! back-off per conversation after a failure, and every job tracked so shutdown waits for it
//! (within the grace period) or cancels it. Making one summary is [`Summarizer::make`]: read
//! the backlog, call the model through [`ModelCall`], store the record.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};

use super::job::{Job, Reservation};
use super::prompt::{cap_tokens, fill, ratio};
use super::{SummaryError, TASK, guard, heuristic};
use crate::config::CompressionConfig;
use crate::identity::ConversationKey;
use crate::model::{ModelCall, ModelRequest};
use crate::store::{Store, StoredMessage, SummaryRecord, lock, now_ms};
use crate::tokens;

/// How long conversations that failed stay in the back-off map after their wait is over.
const BACKOFF_KEEP: Duration = Duration::from_secs(3600);

/// Counters of the summaries made.
#[derive(Debug, Default)]
pub struct SummaryCounters {
    pub made: AtomicU64,
    pub failed: AtomicU64,
    pub dropped: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
}

/// Runs summary jobs in the background.
pub struct Summarizer {
    store: Arc<Store>,
    model: Arc<dyn ModelCall>,
    config: Arc<CompressionConfig>,
    queue: Mutex<Option<mpsc::Sender<Job>>>,
    in_flight: Arc<Mutex<HashSet<ConversationKey>>>,
    /// Failures in a row and when the conversation may be tried again.
    backoff: Mutex<HashMap<ConversationKey, (u32, Instant)>>,
    stop: Notify,
    worker: Mutex<Option<JoinHandle<()>>>,
    pub counters: SummaryCounters,
}

impl std::fmt::Debug for Summarizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Summarizer").finish_non_exhaustive()
    }
}

/// Runs store and file work on the blocking pool, off the threads that serve requests.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, SummaryError> + Send + 'static,
) -> Result<T, SummaryError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|err| SummaryError::Task(err.to_string()))?
}

impl Summarizer {
    /// Starts the worker. Must be called inside a tokio runtime.
    pub fn start(
        store: Arc<Store>,
        model: Arc<dyn ModelCall>,
        config: CompressionConfig,
    ) -> Arc<Summarizer> {
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let summarizer = Arc::new(Summarizer {
            store,
            model,
            config: Arc::new(config),
            queue: Mutex::new(Some(tx)),
            in_flight: Arc::new(Mutex::new(HashSet::new())),
            backoff: Mutex::new(HashMap::new()),
            stop: Notify::new(),
            worker: Mutex::new(None),
            counters: SummaryCounters::default(),
        });
        let worker = tokio::spawn(Arc::clone(&summarizer).work(rx));
        *guard(&summarizer.worker) = Some(worker);
        summarizer
    }

    async fn work(self: Arc<Self>, mut rx: mpsc::Receiver<Job>) {
        let permits = Arc::new(Semaphore::new(self.config.concurrency));
        let mut jobs = JoinSet::new();
        loop {
            tokio::select! {
                job = rx.recv() => {
                    let Some(job) = job else { break };
                    let Ok(permit) = Arc::clone(&permits).acquire_owned().await else { break };
                    let me = Arc::clone(&self);
                    jobs.spawn(async move {
                        let _permit = permit;
                        me.run(job).await;
                    });
                }
                Some(_) = jobs.join_next(), if !jobs.is_empty() => {}
                () = self.stop.notified() => break,
            }
        }
        // Jobs still queued are not started; the ones running finish (or are aborted when the
        // grace period ends and this task is dropped).
        rx.close();
        while jobs.join_next().await.is_some() {}
    }

    /// True when a job for `key` is planned, queued or running.
    pub fn in_flight(&self, key: &ConversationKey) -> bool {
        guard(&self.in_flight).contains(key)
    }

    /// True while the conversation is backing off after a failed summary.
    pub fn backing_off(&self, key: &ConversationKey) -> bool {
        guard(&self.backoff)
            .get(key)
            .is_some_and(|(_, until)| Instant::now() < *until)
    }

    /// Marks `key` busy for a job about to be planned; `None` when a job for it already is.
    pub fn reserve(&self, key: &ConversationKey) -> Option<Reservation> {
        guard(&self.in_flight)
            .insert(key.clone())
            .then(|| Reservation {
                in_flight: Arc::clone(&self.in_flight),
                key: key.clone(),
            })
    }

    /// Queues a job; returns false when the queue is full or closed (the job is dropped and
    /// its reservation released).
    pub fn enqueue(&self, job: Job) -> bool {
        let sent = match &*guard(&self.queue) {
            Some(tx) => tx.try_send(job).is_ok(),
            None => false,
        };
        if !sent {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Runs a job now and waits for it (synchronous compression).
    pub async fn run_now(&self, job: Job) -> Result<SummaryRecord, SummaryError> {
        let result = self.make(&job).await;
        self.finish(&job.key, &result);
        result
    }

    async fn run(&self, job: Job) {
        if job.stand_in {
            let (store, key) = (Arc::clone(&self.store), job.key.clone());
            let (id, upto) = (job.conversation_id, job.upto_turn);
            let written = blocking(move || {
                let handle = store.conversation(&key)?;
                let conversation = lock(&handle);
                Ok(heuristic::store_stand_in(&store, &conversation, id, upto)?)
            })
            .await;
            if let Err(err) = written {
                tracing::warn!(error = %err, "could not store the heuristic summary");
            }
        }
        let result = self.make(&job).await;
        self.finish(&job.key, &result);
    }

    /// Counts and logs a job's result and sets the back-off after a failure. The job's
    /// reservation is released when the caller drops the job, after this.
    fn finish(&self, key: &ConversationKey, result: &Result<SummaryRecord, SummaryError>) {
        match result {
            Ok(record) => {
                guard(&self.backoff).remove(key);
                self.counters.made.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .prompt_tokens
                    .fetch_add(record.usage_prompt_tokens, Ordering::Relaxed);
                self.counters
                    .completion_tokens
                    .fetch_add(record.usage_completion_tokens, Ordering::Relaxed);
                tracing::info!(
                    summary = record.number,
                    to_turn = record.to_turn,
                    tokens = record.tokens,
                    ratio = record.ratio,
                    "summary stored"
                );
            }
            // Another summary covered these turns meanwhile: nothing to do, not a failure.
            Err(SummaryError::Empty) => tracing::debug!("summary not needed any more"),
            Err(err) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                let mut backoff = guard(&self.backoff);
                // Entries whose wait ended long ago are dropped, so the map stays bounded by
                // the conversations failing recently.
                let now = Instant::now();
                backoff.retain(|_, (_, until)| *until + BACKOFF_KEEP > now);
                let failures = backoff.get(key).map_or(0, |(n, _)| *n) + 1;
                let wait = self.config.retry_backoff * 2u32.pow(failures.min(16) - 1);
                backoff.insert(key.clone(), (failures, now + wait));
                tracing::warn!(error = %err, failures, retry_in_s = wait.as_secs(), "summary failed; the previous summary stays");
            }
        }
    }

    /// Makes and stores the next summary of a conversation.
    async fn make(&self, job: &Job) -> Result<SummaryRecord, SummaryError> {
        // The previous summary and the messages that aged out since, read on the blocking pool.
        let (store, key) = (Arc::clone(&self.store), job.key.clone());
        let (id, upto_turn) = (job.conversation_id, job.upto_turn);
        let max_input_tokens = self.config.max_input_tokens;
        let (previous, messages) = blocking(move || {
            let previous = store.latest_summary(&key, id)?;
            let covered_to = previous
                .as_ref()
                .filter(|r| !r.heuristic)
                .map_or(0, |r| r.to_turn);
            let handle = store.conversation(&key)?;
            let conversation = lock(&handle);
            // Oldest first, up to the input cap (at least one message): a larger backlog is
            // left to the next summary.
            let mut budget = max_input_tokens;
            let turns: Vec<u64> = conversation
                .entries
                .iter()
                .filter(|e| e.turn > covered_to && e.turn <= upto_turn)
                .take_while(|e| {
                    let fits = budget > 0;
                    budget = budget.saturating_sub(u64::from(e.tokens));
                    fits
                })
                .map(|e| e.turn)
                .collect();
            let messages: Vec<StoredMessage> = store.messages(&conversation, turns)?;
            Ok((previous, messages))
        })
        .await?;
        let previous_llm = previous.clone().filter(|r| !r.heuristic);
        let (Some(first), Some(last)) = (messages.first(), messages.last()) else {
            return Err(SummaryError::Empty);
        };
        let prompt = fill(
            &self.config.prompt,
            previous_llm.as_ref().map(|r| r.text.as_str()),
            &messages,
            self.config.max_summary_tokens,
        );
        let request = ModelRequest::prompt(&job.model, TASK, prompt, job.credentials.clone());
        let reply = tokio::time::timeout(self.config.timeout, self.model.complete(request))
            .await
            .map_err(|_| SummaryError::Timeout(self.config.timeout))??;

        let model = Some(job.model.as_str());
        // A model that ignores the length asked for is cut to it (keeping the start).
        let text = cap_tokens(model, reply.text, self.config.max_summary_tokens);
        let original_tokens = previous_llm.as_ref().map_or(0, |r| u64::from(r.tokens))
            + messages.iter().map(|m| u64::from(m.tokens)).sum::<u64>();
        let tokens = tokens::count_text(model, &text);
        let record = SummaryRecord {
            number: previous.as_ref().map_or(1, |r| r.number + 1),
            from_turn: previous_llm.as_ref().map_or(first.turn, |r| r.from_turn),
            to_turn: last.turn,
            tokens,
            original_tokens,
            ratio: ratio(tokens, original_tokens),
            from_ms: previous_llm.as_ref().map_or(first.at_ms, |r| r.from_ms),
            to_ms: last.at_ms,
            model: job.model.clone(),
            created_ms: now_ms(),
            heuristic: false,
            usage_prompt_tokens: reply.prompt_tokens,
            usage_completion_tokens: reply.completion_tokens,
            partial_run: if last.turn < job.upto_turn {
                previous_llm.as_ref().map_or(0, |r| r.partial_run) + 1
            } else {
                0
            },
            text,
        };
        let (store, key) = (Arc::clone(&self.store), job.key.clone());
        blocking(move || {
            let handle = store.conversation(&key)?;
            let conversation = lock(&handle);
            if store.save_summary(&conversation, id, &record)? {
                Ok(record)
            } else {
                Err(SummaryError::Gone)
            }
        })
        .await
    }

    /// Stops taking jobs and waits up to `grace` for running ones; then cancels them.
    pub async fn shutdown(&self, grace: Duration) {
        guard(&self.queue).take();
        self.stop.notify_one();
        let worker = guard(&self.worker).take();
        if let Some(mut worker) = worker
            && tokio::time::timeout(grace, &mut worker).await.is_err()
        {
            tracing::warn!("summary jobs still running at the end of the grace period; cancelled");
            worker.abort();
            let _ = worker.await;
        }
    }
}
