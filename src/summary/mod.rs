//! Summaries of old history: the records, the LLM call that makes them, and the background
//! worker that runs those calls off the request path.
//!
//! A summary is progressive: the next one is made from the previous summary plus the messages
//! that aged out since, with a prompt template holding `{prev_summary}` and
//! `{messages_joined}`. Each is stored as a record in sled (`summaries` tree) and as Markdown
//! in the conversation's workspace folder (`memory/summary-1-{n}.md`). When no model summary
//! exists yet, a heuristic one (no LLM) stands in and is marked as such.
//!
//! The worker: a bounded queue, one job per conversation at a time, a concurrency limit, a
//! back-off per conversation after a failure, and every job tracked so shutdown waits for it
//! (within the grace period) or cancels it.

pub mod heuristic;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue, Request, header};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::{JoinHandle, JoinSet};

use crate::body::{collect_limited, full};
use crate::config::CompressionConfig;
use crate::identity::ConversationKey;
use crate::pipeline::recall::render_line;
use crate::store::{Store, StoreError, StoredMessage, lock, now_ms, workspace_dir};
use crate::tokens;
use crate::upstream::Upstream;

pub use crate::config::DEFAULT_PROMPT;

/// The header memproxy's own upstream calls carry, so upstream logs (and the test mock) can
/// tell them apart.
pub const TASK_HEADER: &str = "x-memproxy-task";

/// A stored summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryRecord {
    /// 1, 2, 3… per conversation.
    pub number: u64,
    pub text: String,
    /// The turns it covers: `from_turn..=to_turn`.
    pub from_turn: u64,
    pub to_turn: u64,
    /// Tokens of `text`.
    pub tokens: u32,
    /// Tokens of what it was made from (previous summary + new messages).
    pub original_tokens: u64,
    /// `tokens / original_tokens`.
    pub ratio: f64,
    /// Time of the first and last covered message (UTC ms).
    pub from_ms: i64,
    pub to_ms: i64,
    /// The model that wrote it (`heuristic` for the stand-in).
    pub model: String,
    pub created_ms: i64,
    /// A stand-in made without an LLM.
    pub heuristic: bool,
    /// Upstream token usage of the call.
    #[serde(default)]
    pub usage_prompt_tokens: u64,
    #[serde(default)]
    pub usage_completion_tokens: u64,
    /// 0, or how many summaries in a row (this one included) read `max_input_tokens` and
    /// stopped before the last turn that was due. While it is between 1 and
    /// [`MAX_CATCH_UP_CALLS`], the next summary continues through the backlog without waiting
    /// for `compression_interval`.
    #[serde(default)]
    pub partial_run: u32,
}

/// Summaries in a row that may skip `compression_interval` to work through a backlog larger
/// than one call's input (64 calls of the default 16,384 tokens: about a million tokens).
pub const MAX_CATCH_UP_CALLS: u32 = 64;

impl SummaryRecord {
    /// The call stopped before the last turn that was due.
    pub fn partial(&self) -> bool {
        self.partial_run > 0
    }

    /// The next summary may skip `compression_interval`: a backlog is being worked through.
    pub fn catching_up(&self) -> bool {
        (1..=MAX_CATCH_UP_CALLS).contains(&self.partial_run)
    }

    /// `1-120`, or `1-120 heuristic`: for `X-Memory-Summary`.
    pub fn label(&self) -> String {
        let range = format!("{}-{}", self.from_turn, self.to_turn);
        if self.heuristic {
            format!("{range} heuristic")
        } else {
            range
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SummaryError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the summary call failed: {0}")]
    Upstream(String),
    #[error("the summary call took longer than {0:?}")]
    Timeout(Duration),
    #[error("nothing to summarize")]
    Empty,
    #[error("the conversation was deleted while its summary was being made")]
    Gone,
    #[error("writing the summary file failed: {0}")]
    File(#[from] std::io::Error),
    #[error("a background step failed: {0}")]
    Task(String),
}

/// The conversation's newest summary record.
pub fn latest(store: &Store, conversation_id: u64) -> Result<Option<SummaryRecord>, StoreError> {
    match store
        .summaries_tree()
        .scan_prefix(conversation_id.to_be_bytes())
        .next_back()
    {
        None => Ok(None),
        Some(item) => {
            let (_, value) = item?;
            serde_json::from_slice(&value)
                .map(Some)
                .map_err(|err| StoreError::Corrupt(err.to_string()))
        }
    }
}

/// Every summary record of a conversation, oldest first.
pub fn all(store: &Store, conversation_id: u64) -> Result<Vec<SummaryRecord>, StoreError> {
    store
        .summaries_tree()
        .scan_prefix(conversation_id.to_be_bytes())
        .map(|item| {
            let (_, value) = item?;
            serde_json::from_slice(&value).map_err(|err| StoreError::Corrupt(err.to_string()))
        })
        .collect()
}

/// Stores a record and writes its Markdown copy (`memory/summary-1-{to_turn}.md`), unless the
/// conversation was deleted (or replaced) meanwhile: then nothing is written and the result is
/// `false`. The caller holds the conversation's lock, so a delete cannot run between the record
/// and its file.
pub fn save(
    store: &Store,
    key: &ConversationKey,
    conversation_id: u64,
    record: &SummaryRecord,
) -> Result<bool, SummaryError> {
    let value = serde_json::to_vec(record).map_err(|err| StoreError::Corrupt(err.to_string()))?;
    if !store.put_summary_if_current(key, conversation_id, record.number, &value)? {
        return Ok(false);
    }
    let folder = workspace_dir(store.data_dir(), key).join("memory");
    std::fs::create_dir_all(&folder)?;
    let file = folder.join(format!(
        "summary-{}-{}.md",
        record.from_turn, record.to_turn
    ));
    let markdown = format!(
        "# Summary of turns {}–{}{}\n\n- made: {} ms since epoch by {}\n- tokens: {} (from {}, ratio {:.2})\n\n{}\n",
        record.from_turn,
        record.to_turn,
        if record.heuristic { " (heuristic)" } else { "" },
        record.created_ms,
        record.model,
        record.tokens,
        record.original_tokens,
        record.ratio,
        record.text
    );
    // Written aside and renamed, so a reader never sees half a file.
    let partial = folder.join(format!(".summary-{}.partial", record.number));
    std::fs::write(&partial, markdown)?;
    std::fs::rename(&partial, &file)?;
    Ok(true)
}

/// What a summary job needs.
#[derive(Debug)]
pub struct Job {
    pub key: ConversationKey,
    pub conversation_id: u64,
    /// The newest turn to cover (the last message before the recent window).
    pub upto_turn: u64,
    pub model: String,
    /// The triggering request's credentials, held in memory only.
    pub authorization: Option<HeaderValue>,
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
    in_flight: Arc<Mutex<HashSet<ConversationKey>>>,
    key: ConversationKey,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation").finish_non_exhaustive()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        guard(&self.in_flight).remove(&self.key);
    }
}

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
    upstream: Upstream,
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

impl Summarizer {
    /// Starts the worker. Must be called inside a tokio runtime.
    pub fn start(
        store: Arc<Store>,
        upstream: Upstream,
        config: CompressionConfig,
    ) -> Arc<Summarizer> {
        let (tx, rx) = mpsc::channel(config.queue_capacity);
        let summarizer = Arc::new(Summarizer {
            store,
            upstream,
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
            if let Err(err) = blocking(move || stand_in(&store, &key, id, upto)).await {
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
                let failures = backoff.get(key).map_or(0, |(n, _)| *n) + 1;
                let wait = self.config.retry_backoff * 2u32.pow(failures.min(16) - 1);
                backoff.insert(key.clone(), (failures, Instant::now() + wait));
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
            let previous = latest(&store, id)?;
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
        let joined: Vec<String> = messages.iter().map(render_line).collect();
        let joined = joined.join("\n");
        let prev_text = previous_llm
            .as_ref()
            .map_or("(none yet)", |r| r.text.as_str());
        let prompt = self
            .config
            .prompt
            .replace("{prev_summary}", prev_text)
            .replace("{messages_joined}", &joined)
            .replace(
                "{max_summary_tokens}",
                &self.config.max_summary_tokens.to_string(),
            );

        let (text, usage) = tokio::time::timeout(self.config.timeout, self.call(job, prompt))
            .await
            .map_err(|_| SummaryError::Timeout(self.config.timeout))??;

        let model = Some(job.model.as_str());
        // A model that ignores the length asked for is cut to it (keeping the start).
        let text = cap_tokens(model, text, self.config.max_summary_tokens);
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
            usage_prompt_tokens: usage.0,
            usage_completion_tokens: usage.1,
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
            let _conversation = lock(&handle);
            if save(&store, &key, id, &record)? {
                Ok(record)
            } else {
                Err(SummaryError::Gone)
            }
        })
        .await
    }

    /// One chat completion upstream; returns the text and (prompt, completion) token usage.
    async fn call(&self, job: &Job, prompt: String) -> Result<(String, (u64, u64)), SummaryError> {
        let body = json!({
            "model": job.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": false,
        });
        let mut client_headers = HeaderMap::new();
        if let Some(auth) = &job.authorization {
            client_headers.insert(header::AUTHORIZATION, auth.clone());
        }
        let mut request = Request::new(full(body.to_string()));
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = self
            .upstream
            .uri_for("/v1/chat/completions", None)
            .map_err(|err| SummaryError::Upstream(err.to_string()))?;
        let headers = request.headers_mut();
        *headers = self.upstream.request_headers(&client_headers);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        headers.insert(TASK_HEADER, HeaderValue::from_static("summary"));

        let response = self
            .upstream
            .send(request)
            .await
            .map_err(|err| SummaryError::Upstream(err.to_string()))?;
        let status = response.status();
        let body = collect_limited(response.into_body(), 16 * 1024 * 1024)
            .await
            .map_err(|err| SummaryError::Upstream(err.to_string()))?;
        if !status.is_success() {
            return Err(SummaryError::Upstream(format!(
                "upstream answered {status}"
            )));
        }
        let value: Value = serde_json::from_slice(&body)
            .map_err(|_| SummaryError::Upstream("the answer is not JSON".into()))?;
        let text = value
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| SummaryError::Upstream("the answer has no text".into()))?
            .to_string();
        let usage = (
            value
                .pointer("/usage/prompt_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            value
                .pointer("/usage/completion_tokens")
                .and_then(Value::as_u64)
                .unwrap_or(0),
        );
        Ok((text, usage))
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

/// Stores the heuristic stand-in for a conversation's turns up to `upto_turn`, unless a summary
/// exists by now. Reads under the conversation's lock, summarizes without it, saves under it.
fn stand_in(
    store: &Store,
    key: &ConversationKey,
    conversation_id: u64,
    upto_turn: u64,
) -> Result<(), SummaryError> {
    let handle = store.conversation(key)?;
    let messages = {
        let conversation = lock(&handle);
        let turns: Vec<u64> = conversation
            .entries
            .iter()
            .take_while(|e| e.turn <= upto_turn)
            .map(|e| e.turn)
            .collect();
        store.messages(&conversation, turns)?
    };
    let Some(record) = heuristic::summarize(&messages, 1) else {
        return Ok(());
    };
    let _conversation = lock(&handle);
    if latest(store, conversation_id)?.is_none() {
        save(store, key, conversation_id, &record)?;
    }
    Ok(())
}

/// Runs store and file work on the blocking pool, off the threads that serve requests.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, SummaryError> + Send + 'static,
) -> Result<T, SummaryError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|err| SummaryError::Task(err.to_string()))?
}

/// A summary's size as a share of what it was made from.
pub fn ratio(tokens: u32, original_tokens: u64) -> f64 {
    if original_tokens == 0 {
        0.0
    } else {
        f64::from(tokens) / original_tokens as f64
    }
}

/// `text` cut to at most `max` tokens, keeping its start and ending with `…`.
fn cap_tokens(model: Option<&str>, text: String, max: u32) -> String {
    if tokens::count_text(model, &text) <= max {
        return text;
    }
    let mut cut: String = text.chars().collect();
    // Halve towards the cap; a few encodings at most.
    let mut keep = cut.chars().count();
    while keep > 0 && tokens::count_text(model, &cut) > max.saturating_sub(1) {
        keep = keep * 3 / 4;
        cut = text.chars().take(keep).collect();
    }
    cut.push('…');
    cut
}

fn guard<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
