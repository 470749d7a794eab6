//! Extraction (layer 2): one model call turns a run of a conversation's turns into memories,
//! off the request's path. Planned when a request brings the conversation's user messages
//! since the last extraction to `extraction_every`; queued by the commit (so only what was
//! stored is read); run by the background [`Worker`] one job at a time, which reads the turns from the user's
//! archive, asks the model, checks the answer and applies it ([`super::memories::apply`]).
//! Also queued whenever a model summary of a user's conversation is stored: then the model
//! reads the summary's text instead of the turns (the source turns being the range the
//! summary covers), as the reference design extracts from its summaries.
//!
//! The wire contract (fixed, `docs/memories.md`): a chat completion with `response_format`
//! `{"type": "json_schema", "json_schema": {"name": "memproxy_memories", ...}}`, answered by
//! `{"memories": [{"text", "type", "scope", "importance", "confidence", "tags",
//! "source_turns", "supersedes"}]}`. A call that fails, or an answer that does not parse as
//! that, changes nothing: it is counted, logged without text, and retried with back-off.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

use super::archive;
use super::memories::{self, Candidate, CandidateSource, MemoryRecord};
use crate::ledger::{Ledger, Task};
use crate::worker::{Backoff, Worker};
use memproxy_base::identity::ConversationKey;
use memproxy_base::model::{Credentials, ModelCall, ModelMessage, ModelRequest};
use memproxy_embed::Embed;
use memproxy_store::{OwnerKey, Store, StoreError};

/// The `x-memproxy-task` of an extraction call.
pub const TASK: &str = "extraction";
/// The name of the response format's schema.
pub const SCHEMA_NAME: &str = "memproxy_memories";
/// Jobs waiting at most; past it a job is dropped (counted) and its turns wait for the next.
const QUEUE_CAPACITY: usize = 256;
/// Attempts per job, and the wait before the second (doubling).
const ATTEMPTS: u32 = 3;
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// Known memories shown to the model, at most (so it can name what a statement supersedes).
const KNOWN_IN_PROMPT: usize = 50;
/// Characters of one turn shown to the model, at most.
const TURN_CHARS: usize = 4000;

/// What an extraction needs from the request that made it due.
#[derive(Debug, Clone)]
pub struct ExtractionCall {
    pub model: String,
    pub credentials: Credentials,
    /// When the triggering request's answer has been handed over: the worker starts the job
    /// only then (or after [`HAND_OVER_WAIT`]), so its work never competes with that request.
    pub handed_over: Option<HandedOver>,
}

/// Held by the triggering request's answer, dropped once it is handed over.
#[derive(Debug)]
pub struct HandOver(#[allow(dead_code)] tokio::sync::watch::Sender<()>);

/// Waits for its [`HandOver`] to be dropped.
#[derive(Debug, Clone)]
pub struct HandedOver(tokio::sync::watch::Receiver<()>);

/// A hand-over and what waits for it.
pub fn hand_over() -> (HandOver, HandedOver) {
    let (tx, rx) = tokio::sync::watch::channel(());
    (HandOver(tx), HandedOver(rx))
}

/// How long a job waits for its request's answer to be handed over, at most (a client
/// reading its answer slowly holds no extraction back longer).
const HAND_OVER_WAIT: Duration = Duration::from_secs(30);

impl HandedOver {
    async fn wait(&self) {
        let mut rx = self.0.clone();
        let _ = tokio::time::timeout(HAND_OVER_WAIT, async {
            // Nothing is ever sent: `changed` fails once the sender is dropped.
            while rx.changed().await.is_ok() {}
        })
        .await;
    }
}

/// One extraction: a run of turns of one life of a conversation, for one user.
#[derive(Debug, Clone)]
pub struct ExtractionJob {
    pub user: OwnerKey,
    pub agent: String,
    pub conversation: String,
    pub conversation_id: u64,
    pub from_turn: u64,
    pub to_turn: u64,
    pub call: ExtractionCall,
    /// Extract from this summary of `from_turn..=to_turn` instead of the turns themselves.
    pub summary: Option<String>,
}

/// Turns of a summary's range read for the memories' excerpts and sources, at most (the
/// newest): a summary of a long conversation covers all of it.
const SUMMARY_SOURCE_TURNS: u64 = 500;

/// Extraction's counters, for metrics (`memproxy_extractions_total` and the others).
#[derive(Debug, Default)]
pub struct ExtractionCounters {
    /// Jobs started, and how they ended: applied, or failed after every attempt.
    pub runs: AtomicU64,
    pub done: AtomicU64,
    pub failures: AtomicU64,
    /// Attempts whose answer was not the contract's JSON.
    pub bad_answers: AtomicU64,
    /// Waits before another attempt (back-offs).
    pub retries: AtomicU64,
    /// Jobs dropped: the queue was full or closed.
    pub dropped: AtomicU64,
    /// Candidates: added, a new version of a similar memory, a new version of a memory the
    /// model named as superseded, a near-duplicate that only raised scores, rejected.
    pub added: AtomicU64,
    pub updated: AtomicU64,
    pub superseded: AtomicU64,
    pub ignored: AtomicU64,
    pub rejected: AtomicU64,
}

/// The background extraction worker.
pub struct Extractor {
    store: Arc<Store>,
    model: Arc<dyn ModelCall>,
    /// Where the calls' tokens are counted, and the daily budget that stops them.
    ledger: Arc<Ledger>,
    /// Embeds the candidates: deduplication by meaning, and the new memories' vectors.
    embedder: Option<Arc<dyn Embed>>,
    jobs: Worker<ExtractionJob>,
    pub counters: ExtractionCounters,
}

impl std::fmt::Debug for Extractor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Extractor").finish_non_exhaustive()
    }
}

/// Why one extraction attempt failed (never holds message text).
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the extraction call failed: {0}")]
    Model(String),
    #[error("the extraction answer is unusable: {0}")]
    BadAnswer(&'static str),
    #[error("a background task failed: {0}")]
    Task(String),
}

impl Extractor {
    /// Starts the worker. Must be called inside a tokio runtime.
    pub fn start(
        store: Arc<Store>,
        model: Arc<dyn ModelCall>,
        ledger: Arc<Ledger>,
        embedder: Option<Arc<dyn Embed>>,
    ) -> Arc<Extractor> {
        let extractor = Arc::new(Extractor {
            store,
            model,
            ledger,
            embedder,
            jobs: Worker::new(QUEUE_CAPACITY),
            counters: ExtractionCounters::default(),
        });
        let me = Arc::clone(&extractor);
        extractor.jobs.start(1, move |job| {
            let me = Arc::clone(&me);
            async move { me.run(job).await }
        });
        extractor
    }

    /// Queues a job; false (counted) when the queue is full or closed.
    pub fn enqueue(&self, job: ExtractionJob) -> bool {
        let sent = self.jobs.enqueue(job);
        if !sent {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Runs a job with retries; a failure leaves the memories as they were.
    async fn run(&self, job: ExtractionJob) {
        if let Some(handed_over) = &job.call.handed_over {
            handed_over.wait().await;
        }
        self.counters.runs.fetch_add(1, Ordering::Relaxed);
        for attempt in 1..=ATTEMPTS {
            match self.attempt(&job).await {
                Ok(applied) => {
                    let c = &self.counters;
                    for (counter, n) in [
                        (&c.added, applied.added),
                        (&c.updated, applied.updated),
                        (&c.superseded, applied.superseded),
                        (&c.ignored, applied.ignored),
                        (&c.rejected, applied.rejected),
                    ] {
                        counter.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    c.done.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(err) => {
                    if matches!(err, ExtractError::BadAnswer(_)) {
                        self.counters.bad_answers.fetch_add(1, Ordering::Relaxed);
                    }
                    tracing::warn!(error = %err, attempt, "memory extraction failed");
                    if attempt < ATTEMPTS {
                        self.counters.retries.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Backoff::doubling(FIRST_BACKOFF).after(attempt)).await;
                    }
                }
            }
        }
        self.counters.failures.fetch_add(1, Ordering::Relaxed);
    }

    async fn attempt(&self, job: &ExtractionJob) -> Result<memories::Applied, ExtractError> {
        let store = Arc::clone(&self.store);
        let read_job = job.clone();
        let (turns, known) = tokio::task::spawn_blocking(move || read(&store, &read_job))
            .await
            .map_err(|err| ExtractError::Task(err.to_string()))??;
        if turns.is_empty() && job.summary.is_none() {
            return Ok(memories::Applied::default());
        }
        let key = ConversationKey {
            tenant: job.user.tenant.clone(),
            agent: job.agent.clone(),
            conversation: job.conversation.clone(),
        };
        if !self
            .ledger
            .allow(&job.agent, Task::Extraction, self.store.clock().now_ms())
        {
            tracing::debug!("the agent's background budget for today is spent; no extraction");
            return Ok(memories::Applied::default());
        }
        let request = request(job, &turns, &known);
        // Kept to count the prompt with the tokenizer only if the answer reports no usage.
        let sent = request.clone();
        let reply = tokio::time::timeout(CALL_TIMEOUT, self.model.complete(request))
            .await
            .map_err(|_| ExtractError::Model("timed out".into()))?
            .map_err(|err| ExtractError::Model(err.to_string()))?;
        let spent = reply.spent_tokens(None, || sent.counted_tokens());
        let now = self.store.clock().now_ms();
        self.ledger.spent(&key, Task::Extraction, spent, now);
        let candidates = parse(&reply.text)?;
        let store = Arc::clone(&self.store);
        let job = job.clone();
        let embedder = self.embedder.clone();
        tokio::task::spawn_blocking(move || {
            apply(&store, embedder.as_deref(), &job, &turns, &candidates)
        })
        .await
        .map_err(|err| ExtractError::Task(err.to_string()))?
        .map_err(ExtractError::from)
    }

    /// Stops taking jobs and waits up to `grace` for the running one; then cancels it.
    pub async fn shutdown(&self, grace: Duration) {
        self.jobs.shutdown(grace).await;
    }
}

/// One turn as the extraction sees it.
#[derive(Debug, Clone)]
pub struct SourceTurn {
    pub turn: u64,
    pub role: &'static str,
    pub text: String,
}

/// The owners a user's memories may be kept under (private, the agent's, the tenant's).
pub fn owners(user: &OwnerKey, agent: &str) -> [OwnerKey; 3] {
    [
        user.clone(),
        OwnerKey::agent(&user.tenant, agent),
        OwnerKey::tenant(&user.tenant),
    ]
}

/// The memories of each owner, as read.
pub type Known = HashMap<OwnerKey, Vec<MemoryRecord>>;

/// The job's turns from the user's archive and the memories it may touch.
fn read(store: &Store, job: &ExtractionJob) -> Result<(Vec<SourceTurn>, Known), StoreError> {
    let Some(handle) = store.owner(&job.user, false)? else {
        return Ok((Vec::new(), Known::new()));
    };
    let mut turns = Vec::new();
    let from_turn = if job.summary.is_some() {
        job.from_turn
            .max(job.to_turn.saturating_sub(SUMMARY_SOURCE_TURNS - 1))
    } else {
        job.from_turn
    };
    let mut after = archive::turn_id(job.conversation_id, from_turn.saturating_sub(1));
    'pages: loop {
        let (page, next) =
            store.owner_records(&handle, archive::SPACE_ARCHIVE, Some(&after), 200)?;
        for record in page {
            let turn: archive::ArchivedTurn = serde_json::from_slice(&record.value)
                .map_err(|err| StoreError::Corrupt(err.to_string()))?;
            let in_job = record.id.get(..8) == Some(&job.conversation_id.to_be_bytes()[..])
                && turn.message.turn <= job.to_turn;
            if !in_job {
                break 'pages;
            }
            let text: String = memproxy_store::transcript_line(&turn.message)
                .split_once("] ")
                .and_then(|(_, rest)| rest.split_once(": "))
                .map_or_else(String::new, |(_, text)| text.to_string())
                .chars()
                .take(TURN_CHARS)
                .collect();
            turns.push(SourceTurn {
                turn: turn.message.turn,
                role: turn.message.role.as_str(),
                text,
            });
            after = record.id;
        }
        if next.is_none() {
            break;
        }
    }
    Ok((turns, known(store, &job.user, &job.agent)?))
}

/// The memories of every owner a memory of `user` with `agent` may be kept under.
pub fn known(store: &Store, user: &OwnerKey, agent: &str) -> Result<Known, StoreError> {
    let mut known = Known::new();
    for owner in owners(user, agent) {
        let list = match store.owner(&owner, false)? {
            Some(handle) => memories::all(store, &handle)?,
            None => Vec::new(),
        };
        known.insert(owner, list);
    }
    Ok(known)
}

/// The response format of the call (the fixed wire contract).
pub fn response_format() -> Value {
    json!({
        "type": "json_schema",
        "json_schema": {
            "name": SCHEMA_NAME,
            "strict": true,
            "schema": {
                "type": "object",
                "additionalProperties": false,
                "required": ["memories"],
                "properties": {
                    "memories": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": false,
                            "required": ["text", "type", "scope", "importance", "confidence", "tags", "source_turns", "supersedes"],
                            "properties": {
                                "text": {"type": "string"},
                                "type": {"type": "string", "enum": memories::MemoryType::ALL},
                                "scope": {"type": "string", "enum": ["private", "agent", "tenant"]},
                                "importance": {"type": "number", "minimum": 0, "maximum": 1},
                                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                                "tags": {"type": "array", "items": {"type": "string"}},
                                "source_turns": {"type": "array", "items": {"type": "integer"}},
                                "supersedes": {"type": "array", "items": {"type": "integer"}}
                            }
                        }
                    }
                }
            }
        }
    })
}

/// The instructions of the call.
pub const INSTRUCTIONS: &str = "You maintain a long-term memory of what a user told an assistant. \
From the new conversation turns, extract the facts worth remembering in later conversations: \
the user's preferences, profile facts (who they are, where they live, what they work on), \
lasting facts about their world, notable events, and procedures the assistant learned. \
Write each as one short statement about the user in the third person. \
type: preference | profile | semantic | episodic | procedural. \
scope: private (about this user; the default), agent (a procedure useful to every user of this assistant), tenant (true for the whole organisation). \
importance and confidence: numbers from 0 to 1. source_turns: the turn numbers it comes from. \
When a statement changes or corrects a known memory, put that memory's id in supersedes. \
Do not repeat known memories unchanged. Answer with {\"memories\": []} when nothing is worth keeping.";

fn request(job: &ExtractionJob, turns: &[SourceTurn], known: &Known) -> ModelRequest {
    let mut prompt = String::from("Known memories:\n");
    let mut shown = 0;
    for memory in known.values().flatten().take(KNOWN_IN_PROMPT) {
        prompt.push_str(&format!(
            "[id {}] ({}, {}) {}\n",
            memory.id,
            memory.kind.as_str(),
            match memory.scope {
                memories::MemoryScope::Private => "private",
                memories::MemoryScope::Agent => "agent",
                memories::MemoryScope::Tenant => "tenant",
            },
            memory.text
        ));
        shown += 1;
    }
    if shown == 0 {
        prompt.push_str("(none)\n");
    }
    match &job.summary {
        Some(summary) => prompt.push_str(&format!(
            "\nSummary of conversation turns #{} to #{}:\n{summary}\n",
            job.from_turn, job.to_turn
        )),
        None => {
            prompt.push_str("\nNew conversation turns:\n");
            for turn in turns {
                prompt.push_str(&format!(
                    "[turn #{}] {}: {}\n",
                    turn.turn, turn.role, turn.text
                ));
            }
        }
    }
    ModelRequest {
        model: job.call.model.clone(),
        messages: vec![
            ModelMessage {
                role: "system",
                content: INSTRUCTIONS.to_string(),
            },
            ModelMessage {
                role: "user",
                content: prompt,
            },
        ],
        task: TASK,
        credentials: job.call.credentials.clone(),
        response_format: Some(response_format()),
    }
}

#[derive(Deserialize)]
struct Answer {
    memories: Vec<Candidate>,
}

/// The candidates of an answer; an error when it is not the contract's JSON.
pub fn parse(text: &str) -> Result<Vec<Candidate>, ExtractError> {
    let answer: Answer = serde_json::from_str(text.trim())
        .map_err(|_| ExtractError::BadAnswer("not the memproxy_memories JSON"))?;
    if answer.memories.len() > 100 {
        return Err(ExtractError::BadAnswer("more than 100 memories"));
    }
    Ok(answer.memories)
}

fn apply(
    store: &Store,
    embedder: Option<&dyn Embed>,
    job: &ExtractionJob,
    turns: &[SourceTurn],
    candidates: &[Candidate],
) -> Result<memories::Applied, StoreError> {
    // Read again now: a hand edit or another extraction may have changed them meanwhile.
    let (_, mut known) = read(
        store,
        &ExtractionJob {
            from_turn: 1,
            to_turn: 0,
            ..job.clone()
        },
    )?;
    let origin = CandidateSource {
        user: job.user.clone(),
        agent: job.agent.clone(),
        conversation: Some(job.conversation.clone()),
        turns: turns
            .iter()
            .filter(|t| t.role == "user")
            .map(|t| (t.turn, t.text.clone()))
            .collect(),
        stated: false,
        now_ms: store.clock().now_ms(),
    };
    let mut meanings = meanings(store, embedder, &known, candidates)?;
    let (applied, changed) =
        memories::apply(&mut known, candidates, &origin, &mut meanings, || {
            store.new_id()
        })?;
    memories::store_changed(store, changed, &known, &meanings, embedder.map(|e| e.id()))?;
    Ok(applied)
}

/// The vectors that deduplicate `candidates` by meaning against the `known` memories: the
/// candidates embedded (off every request's path: extraction's worker, a memory tool's call)
/// and the memories' stored vectors. Without an embedder, or when embedding fails (logged),
/// none: candidates are then compared by text alone, and new texts get no vector until
/// `memproxy vectors rebuild`.
pub fn meanings(
    store: &Store,
    embedder: Option<&dyn Embed>,
    known: &Known,
    candidates: &[Candidate],
) -> Result<memories::Meanings, StoreError> {
    let Some(embedder) = embedder else {
        return Ok(memories::Meanings::default());
    };
    let texts: Vec<&str> = candidates.iter().map(|c| c.text.trim()).collect();
    match crate::embedding::embed_all(embedder, &texts) {
        Ok(vectors) => Ok(memories::Meanings {
            candidates: vectors,
            memories: memories::Meanings::of_known(store, known, embedder.id())?,
            renewed: Default::default(),
        }),
        Err(err) => {
            tracing::warn!(error = %err, "embedding memory candidates failed; deduplicated by text alone");
            Ok(memories::Meanings::default())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_job_waits_until_its_requests_answer_is_handed_over() {
        let (held, handed_over) = hand_over();
        let waiting = tokio::spawn(async move { handed_over.wait().await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
    }

    #[test]
    fn answers_parse_only_in_the_contract_shape() {
        let good = r#"{"memories":[{"text":"The user lives in Berlin","type":"profile","scope":"private","importance":0.8,"confidence":0.9,"tags":["home"],"source_turns":[3],"supersedes":[12]}]}"#;
        let parsed = parse(good).unwrap();
        assert_eq!(parsed[0].supersedes, [12]);
        for bad in [
            "",
            "not json",
            "{}",
            r#"{"memories":{}}"#,
            r#"{"memories":[{"text":1}]}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        let format = response_format();
        assert_eq!(format["json_schema"]["name"], SCHEMA_NAME);
        assert_eq!(format["type"], "json_schema");
    }
}
