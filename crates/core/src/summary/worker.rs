//! The summarizer: one job per conversation at a time, run by the background [`Worker`] (a
//! bounded queue, a concurrency limit, shutdown within the grace period), and a [`Backoff`]
//! per conversation after a failure. Making one summary is [`Summarizer::make`]: read
//! the backlog, call the model through [`ModelCall`], store the record.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::job::{InFlight, Job};
use super::prompt::{cap_tokens, fill, ratio};
use super::{SummaryError, TASK, guard, heuristic};
use crate::config::CompressionConfig;
use crate::ledger::{Ledger, Task};
use crate::worker::{Backoff, Worker};
use memproxy_base::identity::ConversationKey;
use memproxy_base::model::{ModelCall, ModelRequest};
use memproxy_base::tokens;
use memproxy_store::{Store, StoredMessage, SummaryRecord, lock};

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
    /// Who holds a summary lease taken by this process (random per process).
    holder: String,
    model: Arc<dyn ModelCall>,
    config: Arc<CompressionConfig>,
    /// Where the calls' tokens are counted, and the daily budget that stops them.
    ledger: Arc<Ledger>,
    jobs: Worker<Job>,
    in_flight: Arc<Mutex<HashSet<ConversationKey>>>,
    /// Failures in a row and when the conversation may be tried again.
    backoff: Mutex<HashMap<ConversationKey, (u32, Instant)>>,
    pub counters: SummaryCounters,
}

impl std::fmt::Debug for Summarizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Summarizer").finish_non_exhaustive()
    }
}

/// How much longer than the summary call's time limit a lease lasts: the read before the call
/// and the write after it.
const LEASE_MARGIN: Duration = Duration::from_secs(10);

/// A name for this process as a lease holder: 64 random bits.
fn lease_holder() -> String {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 8];
    let _ = ring::rand::SystemRandom::new().fill(&mut bytes);
    format!("{:016x}-{}", u64::from_be_bytes(bytes), std::process::id())
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
        ledger: Arc<Ledger>,
    ) -> Arc<Summarizer> {
        let queue_capacity = config.queue_capacity;
        let summarizer = Arc::new(Summarizer {
            holder: lease_holder(),
            store,
            model,
            config: Arc::new(config),
            ledger,
            jobs: Worker::new(queue_capacity),
            in_flight: Arc::new(Mutex::new(HashSet::new())),
            backoff: Mutex::new(HashMap::new()),
            counters: SummaryCounters::default(),
        });
        let me = Arc::clone(&summarizer);
        summarizer
            .jobs
            .start(summarizer.config.concurrency, move |job| {
                let me = Arc::clone(&me);
                async move { me.run(job).await }
            });
        summarizer
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
    pub fn reserve(&self, key: &ConversationKey) -> Option<InFlight> {
        guard(&self.in_flight)
            .insert(key.clone())
            .then(|| InFlight {
                in_flight: Arc::clone(&self.in_flight),
                key: key.clone(),
            })
    }

    /// Queues a job; returns false when the queue is full or closed (the job is dropped and
    /// its reservation released).
    pub fn enqueue(&self, job: Job) -> bool {
        let sent = self.jobs.enqueue(job);
        if !sent {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Runs a job now and waits for it (synchronous compression).
    pub async fn run_now(&self, mut job: Job) -> Result<SummaryRecord, SummaryError> {
        let result = self.make(&job).await;
        self.finish(&mut job, &result);
        result
    }

    async fn run(&self, mut job: Job) {
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
        self.finish(&mut job, &result);
    }

    /// Counts and logs a job's result, hands a stored summary to the job's
    /// [`Job::on_stored`], and sets the back-off after a failure. The job's reservation is
    /// released when the caller drops the job, after this.
    fn finish(&self, job: &mut Job, result: &Result<SummaryRecord, SummaryError>) {
        if let (Ok(record), Some(on_stored)) = (result, job.on_stored.take()) {
            on_stored.call(record, &job.credentials);
        }
        let key = &job.key;
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
            // Another summary covered these turns meanwhile, or a branch took some of them off
            // the main line: nothing to do, not a failure.
            Err(
                SummaryError::Empty
                | SummaryError::Branched
                | SummaryError::Leased
                | SummaryError::BudgetSpent,
            ) => {
                tracing::debug!("summary not needed any more")
            }
            Err(err) => {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                let mut backoff = guard(&self.backoff);
                // Entries whose wait ended long ago are dropped, so the map stays bounded by
                // the conversations failing recently.
                let now = Instant::now();
                backoff.retain(|_, (_, until)| *until + BACKOFF_KEEP > now);
                let failures = backoff.get(key).map_or(0, |(n, _)| *n) + 1;
                let wait = Backoff::doubling(self.config.retry_backoff).after(failures);
                backoff.insert(key.clone(), (failures, now + wait));
                tracing::warn!(error = %err, failures, retry_in_s = wait.as_secs(), "summary failed; the previous summary stays");
            }
        }
    }

    /// Makes and stores the next summary of a conversation. With a store shared by replicas,
    /// under the conversation's summary lease (fenced by its id, expiring after the summary
    /// call's time limit): a replica that finds another holding it leaves the summary to that
    /// one ([`SummaryError::Leased`]).
    async fn make(&self, job: &Job) -> Result<SummaryRecord, SummaryError> {
        if !self.store.shared() {
            return self.make_now(job).await;
        }
        let (store, key, holder) = (
            Arc::clone(&self.store),
            job.key.clone(),
            self.holder.clone(),
        );
        let (id, lease) = (job.conversation_id, self.config.timeout + LEASE_MARGIN);
        let taken =
            blocking(move || Ok(store.take_summary_lease(&key, id, &holder, lease)?)).await?;
        if !taken {
            return Err(SummaryError::Leased);
        }
        let made = self.make_now(job).await;
        let (store, key, holder) = (
            Arc::clone(&self.store),
            job.key.clone(),
            self.holder.clone(),
        );
        if let Err(err) = blocking(move || Ok(store.release_summary_lease(&key, &holder)?)).await {
            tracing::debug!(error = %err, "releasing a summary lease failed; it expires");
        }
        made
    }

    async fn make_now(&self, job: &Job) -> Result<SummaryRecord, SummaryError> {
        // The previous summary and the messages that aged out since, read on the blocking pool.
        let (store, key) = (Arc::clone(&self.store), job.key.clone());
        let (id, upto_turn) = (job.conversation_id, job.upto_turn);
        let max_input_tokens = self.config.max_input_tokens;
        let (previous, messages, branches) = blocking(move || {
            let previous = store.latest_summary(&key, id)?;
            let covered_to = previous
                .as_ref()
                .filter(|r| !r.heuristic)
                .map_or(0, |r| r.to_turn);
            let handle = store.conversation(&key)?;
            let mut conversation = lock(&handle);
            // Another replica sharing the store may have written since this one cached it.
            store.refresh(&mut conversation)?;
            let branches = conversation.meta.as_ref().map_or(0, |m| m.branches);
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
            Ok((previous, messages, branches))
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
        let clock = self.store.clock();
        if !self
            .ledger
            .allow(&job.key.agent, Task::Summary, clock.now_ms())
        {
            return Err(SummaryError::BudgetSpent);
        }
        let request = ModelRequest::prompt(&job.model, TASK, prompt, job.credentials.clone());
        // Kept to count the prompt with the tokenizer only if the answer reports no usage.
        let sent = request.clone();
        let mut reply = tokio::time::timeout(self.config.timeout, self.model.complete(request))
            .await
            .map_err(|_| SummaryError::Timeout(self.config.timeout))??;
        // An answer without usage is counted with the tokenizer.
        if reply.prompt_tokens == 0 && reply.completion_tokens == 0 {
            reply.prompt_tokens = sent.counted_tokens();
            reply.completion_tokens = tokens::count_text(Some(&job.model), &reply.text).into();
        }
        self.ledger.spent(
            &job.key,
            Task::Summary,
            reply.prompt_tokens + reply.completion_tokens,
            clock.now_ms(),
        );

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
            created_ms: clock.now_ms(),
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
            let mut conversation = lock(&handle);
            store.refresh(&mut conversation)?;
            // A branch closed since the messages were read may have taken some of them off
            // the main line: this summary would speak of them, so it is not stored.
            if conversation.meta.as_ref().map_or(0, |m| m.branches) != branches {
                return Err(SummaryError::Branched);
            }
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
        if self.jobs.shutdown(grace).await {
            tracing::warn!("summary jobs still running at the end of the grace period; cancelled");
        }
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex as StdMutex;

    use serde_json::value::RawValue;

    use super::*;
    use memproxy_base::identity::TenantId;
    use memproxy_base::message::Role;
    use memproxy_base::model::{Credentials, ModelError, ModelFuture, ModelReply};
    use memproxy_store::{Change, Durability, Origin, StoreOptions};

    /// A model that answers from a closure and remembers what it was asked: the summarizer is
    /// tested without a socket.
    struct FakeModel {
        answer: Result<String, ModelError>,
        asked: StdMutex<Vec<ModelRequest>>,
    }

    impl ModelCall for FakeModel {
        fn complete(&self, request: ModelRequest) -> ModelFuture<'_> {
            self.asked.lock().unwrap().push(request);
            let answer = self.answer.clone().map(|text| ModelReply {
                text,
                prompt_tokens: 100,
                completion_tokens: 10,
            });
            Box::pin(async move { answer })
        }
    }

    fn config() -> CompressionConfig {
        CompressionConfig {
            prompt: "prev={prev_summary}\n{messages_joined}\nmax={max_summary_tokens}".into(),
            timeout: Duration::from_secs(5),
            concurrency: 1,
            queue_capacity: 4,
            retry_backoff: Duration::from_secs(60),
            max_input_tokens: 10_000,
            max_summary_tokens: 50,
            max_tokens_per_day: None,
        }
    }

    fn ledger() -> Arc<Ledger> {
        Arc::new(Ledger::new(crate::config::BackgroundBudget::default()))
    }

    /// A store holding one conversation of four messages; its key and id.
    fn store_with_history(dir: &std::path::Path) -> (Arc<Store>, ConversationKey, u64) {
        let options = StoreOptions {
            durability: Durability::Interval(Duration::from_secs(1)),
            page_cache_bytes: 1 << 20,
            state_cache_bytes: 1 << 20,
        };
        let store = Arc::new(Store::open(dir, options).unwrap());
        let key = ConversationKey {
            tenant: TenantId::from_token(Some("t")),
            agent: "a".into(),
            conversation: "c".into(),
        };
        let add = (1..=4)
            .map(|i| StoredMessage {
                turn: 0,
                role: if i % 2 == 1 {
                    Role::User
                } else {
                    Role::Assistant
                },
                origin: Origin::Client,
                at_ms: 1_000,
                tokens: 5,
                fingerprint: i,
                message: RawValue::from_string(format!(
                    r#"{{"role":"user","content":"fact {i}"}}"#
                ))
                .unwrap(),
                exchange: None,
            })
            .collect();
        let handle = store.conversation(&key).unwrap();
        let mut conversation = lock(&handle);
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
        drop(conversation);
        (store, key, id)
    }

    fn job(summarizer: &Summarizer, key: &ConversationKey, id: u64) -> Job {
        Job {
            key: key.clone(),
            conversation_id: id,
            upto_turn: 3,
            model: "small".into(),
            credentials: Credentials::new(vec![("authorization".into(), "Bearer k".into())]),
            stand_in: false,
            reservation: summarizer.reserve(key).unwrap(),
            on_stored: None,
        }
    }

    #[tokio::test]
    async fn a_summary_is_made_through_the_model_trait_and_stored() {
        let dir = tempfile::tempdir().unwrap();
        let (store, key, id) = store_with_history(dir.path());
        let model = Arc::new(FakeModel {
            answer: Ok("the user stated facts 1 to 3".into()),
            asked: StdMutex::new(Vec::new()),
        });
        let summarizer = Summarizer::start(Arc::clone(&store), model.clone(), config(), ledger());
        let job = job(&summarizer, &key, id);
        assert!(summarizer.in_flight(&key));
        let record = summarizer.run_now(job).await.unwrap();
        assert!(
            !summarizer.in_flight(&key),
            "the reservation went with the job"
        );
        assert_eq!((record.from_turn, record.to_turn), (1, 3));
        assert_eq!(record.text, "the user stated facts 1 to 3");
        assert_eq!(record.usage_prompt_tokens, 100);
        assert_eq!(store.latest_summary(&key, id).unwrap(), Some(record));

        let request = model.asked.lock().unwrap()[0].clone();
        assert_eq!((request.model.as_str(), request.task), ("small", TASK));
        assert_eq!(request.credentials.pairs()[0].1, "Bearer k");
        let prompt = &request.messages[0].content;
        assert!(prompt.starts_with("prev=(none yet)\n"), "{prompt}");
        assert!(prompt.contains("fact 1") && prompt.contains("fact 3"));
        assert!(!prompt.contains("fact 4"), "only up to the job's turn");
        assert!(prompt.ends_with("max=50"));
        assert!(
            !format!("{:?}", request.credentials).contains("Bearer"),
            "credentials never print"
        );
        summarizer.shutdown(Duration::from_secs(1)).await;
    }

    #[tokio::test]
    async fn a_failed_call_stores_nothing_and_backs_off() {
        let dir = tempfile::tempdir().unwrap();
        let (store, key, id) = store_with_history(dir.path());
        let model = Arc::new(FakeModel {
            answer: Err(ModelError::Status(503)),
            asked: StdMutex::new(Vec::new()),
        });
        let summarizer = Summarizer::start(Arc::clone(&store), model, config(), ledger());
        let job = job(&summarizer, &key, id);
        assert!(matches!(
            summarizer.run_now(job).await,
            Err(SummaryError::Model(ModelError::Status(503)))
        ));
        assert!(store.latest_summary(&key, id).unwrap().is_none());
        assert!(summarizer.backing_off(&key));
        assert_eq!(summarizer.counters.failed.load(Ordering::Relaxed), 1);
        summarizer.shutdown(Duration::from_secs(1)).await;
    }
}
