//! Recall evaluation: how much of the evidence for a question reaches the upstream model.
//!
//! ```text
//! cargo run --release --example recall_eval -- ../shared/eval/locomo-dev.json
//! cargo run --release --example recall_eval -- ../shared/eval/locomo-dev.json \
//!     --conversations 1 --configs window,10 --max-context-tokens 4000 --json /tmp/recall.json
//! ```
//!
//! The data file (LoCoMo format, see `../shared/eval/README.md`) is read from outside the
//! repository and never copied into it. In-process, the program starts the mock upstream and a
//! real memproxy (sled in a temporary directory), both on `127.0.0.1` with ephemeral ports, then:
//!
//! 1. replays each conversation into one memproxy conversation: `speaker_a` → `user`,
//!    `speaker_b` → `assistant`, a run of consecutive turns by one speaker joined into one
//!    message (one turn per line), sessions in numeric order. Each request carries only the
//!    newest message(s), as a chat front-end does, and the mock is scripted to answer with the
//!    real `speaker_b` text, so that text is what memproxy stores;
//! 2. checks that the stored history is exactly what was replayed (one request with a window
//!    larger than the conversation);
//! 3. asks every question of categories 1–4 as a new, non-persisted user message under each
//!    configuration (`window`: relevance off; `K`: relevance on with top-K), and looks at the
//!    messages the proxy forwarded, the question itself left out:
//!    - recall_any: at least one evidence turn's text appears in them verbatim;
//!    - recall_all: every evidence turn's text does;
//!    - prompt share: characters forwarded ÷ characters of the whole replayed history.
//!
//! It prints one table per configuration × category, and with `--json PATH` writes the same
//! figures as JSON.
//!
//! `--mode cross-session` measures long-term memory (layer 1, issue 13) instead: each session
//! of a LoCoMo conversation is replayed as its own memproxy conversation of one user
//! (`X-Memory-User-Id` = the sample id), and every question is asked in a fresh conversation
//! of that user, so whatever evidence reaches the model came from the user's other
//! conversations.
// Allowed: an evaluation run by hand prints its results table.
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::error::Error;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use clap::Parser;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use memproxy::state::AppState;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

#[path = "../tests/support/mock_upstream.rs"]
mod mock_upstream;
use mock_upstream::{MockOptions, MockUpstream, Reply};

type BoxResult<T> = Result<T, Box<dyn Error>>;

/// The recent window used for every question, in messages.
const RECENT_N: usize = 10;
/// The categories that have an answer in the conversation (5 is adversarial).
const CATEGORIES: [u8; 4] = [1, 2, 3, 4];
/// LoCoMo's adversarial category: questions nothing in the conversation answers.
const UNANSWERABLE: u8 = 5;
const TOKEN: &str = "sk-eval";
const MODEL: &str = "gpt-4o-mini";

/// Measures how much of each question's evidence memproxy forwards upstream.
#[derive(Debug, Parser)]
#[command(name = "recall_eval")]
struct Args {
    /// The evaluation data (LoCoMo JSON), e.g. ../shared/eval/locomo-dev.json.
    data: PathBuf,
    /// Use only the first N conversations.
    #[arg(long)]
    conversations: Option<usize>,
    /// Configurations, comma-separated: `window` (relevance off) or a top-K number
    /// (relevance on).
    #[arg(long, default_value = "window,5,10,20", value_delimiter = ',')]
    configs: Vec<String>,
    /// `relevance_max_tokens`: the tokens recalled turns may take (`auto`, or 0 for no limit).
    #[arg(long, default_value = "auto")]
    relevance_max_tokens: String,
    /// Sends `X-Memory-Max-Context-Tokens: N` with every question.
    #[arg(long)]
    max_context_tokens: Option<u64>,
    /// Also write the figures as JSON to this path.
    #[arg(long)]
    json: Option<PathBuf>,
    /// `within` (each LoCoMo conversation one memproxy conversation) or `cross-session` (each
    /// session its own conversation of one user; questions in a fresh conversation).
    #[arg(long, default_value = "within")]
    mode: Mode,
    /// `[embedding] embedder`: `static` (the default), `contextual`, `off` (recall by words).
    #[arg(long, default_value = "static")]
    embedder: String,
    /// `X-Memory-Relevance-Semantic`: recall by meaning too (`true`) or by words alone.
    #[arg(long)]
    semantic: Option<bool>,
    /// `X-Memory-Relevance-Floor`: recalled turns under this fused score are not injected.
    #[arg(long)]
    floor: Option<f32>,
    /// `X-Memory-Relevance-Relative-Floor`: recalled turns under this share of the best one's
    /// fused score are not injected.
    #[arg(long)]
    relative_floor: Option<f32>,
    /// `X-Memory-Relevance-Lexical-Weight`: the words' share of the fused score.
    #[arg(long)]
    lexical_weight: Option<f32>,
    /// Write each category 1-4 question whose evidence did not reach the model (the question,
    /// its evidence and what was recalled) as JSON to this path, for study. It holds the
    /// data's text: keep it outside the repository.
    #[arg(long)]
    misses: Option<PathBuf>,
    /// `sessions`: each session is replayed at its date (`session_N_date_time`, as memproxy's
    /// clock reads it) and the questions are asked the day after the last; `now`: everything
    /// at the time of the run.
    #[arg(long, default_value = "sessions")]
    clock: ClockMode,
    /// `X-Memory-Relevance-Time`: favour the turns of the period a question names.
    #[arg(long)]
    time: Option<bool>,
    /// `X-Memory-Relevance-Feedback`: score the turns a second time with the question's vector
    /// moved towards the best turns'.
    #[arg(long)]
    feedback: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ClockMode {
    Sessions,
    Now,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    Within,
    CrossSession,
}

/// One configuration: relevance off (`None`) or on with this top-K.
#[derive(Debug, Clone, Copy)]
struct EvalConfig {
    top_k: Option<usize>,
}

impl EvalConfig {
    fn parse(text: &str) -> BoxResult<EvalConfig> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("window") {
            return Ok(EvalConfig { top_k: None });
        }
        let text = text.strip_prefix("top-").unwrap_or(text);
        match text.parse::<usize>() {
            Ok(k) if k >= 1 => Ok(EvalConfig { top_k: Some(k) }),
            _ => Err(
                format!("--configs: `{text}` is neither `window` nor a top-K of at least 1").into(),
            ),
        }
    }

    fn name(self) -> String {
        match self.top_k {
            None => "window".to_string(),
            Some(k) => format!("top-{k}"),
        }
    }
}

/// One message as replayed.
#[derive(Debug, Clone)]
struct Msg {
    role: &'static str,
    text: String,
    /// When its session took place (UTC ms), from `session_N_date_time`.
    at_ms: Option<i64>,
}

#[derive(Debug)]
struct Question {
    category: u8,
    text: String,
    /// Valid evidence dia_ids, normalised and de-duplicated.
    evidence: Vec<String>,
}

#[derive(Debug)]
struct Conversation {
    id: String,
    messages: Vec<Msg>,
    /// The same turns session by session (runs joined within a session only), for
    /// `--mode cross-session`.
    sessions: Vec<Vec<Msg>>,
    /// dia_id → turn text (as replayed).
    turns: HashMap<String, String>,
    questions: Vec<Question>,
    /// Category 5 questions (adversarial: no answer in the conversation): only what recall
    /// injects for them is measured.
    unanswerable: Vec<String>,
    /// Characters of the whole replayed history.
    history_chars: usize,
}

/// Things about the data that had to be handled, for the report.
#[derive(Debug, Default)]
struct DataNotes {
    /// Evidence entries rewritten to an existing dia_id: (conversation, raw, ids).
    normalised: Vec<(String, String, Vec<String>)>,
    /// Evidence entries (or parts of them) that name no turn: (conversation, raw).
    dropped: Vec<(String, String)>,
    /// Questions with no valid evidence left: (conversation, question).
    skipped: Vec<(String, String)>,
    /// Turns with an image caption appended.
    captions: usize,
    /// Conversations that start with `speaker_b`.
    leading_assistant: Vec<String>,
}

/// Sums for one configuration × category.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    n: usize,
    any: usize,
    all: usize,
    share: f64,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.n += other.n;
        self.any += other.any;
        self.all += other.all;
        self.share += other.share;
    }

    fn ratio(&self, count: usize) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            count as f64 / self.n as f64
        }
    }

    fn figures(&self) -> (f64, f64, f64) {
        let share = if self.n == 0 {
            0.0
        } else {
            self.share / self.n as f64
        };
        (self.ratio(self.any), self.ratio(self.all), share)
    }
}

fn field<'a>(value: &'a Value, name: &str, what: &str) -> BoxResult<&'a Value> {
    value
        .get(name)
        .ok_or_else(|| format!("{what}: no `{name}` field").into())
}

fn string_field(value: &Value, name: &str, what: &str) -> BoxResult<String> {
    field(value, name, what)?
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| format!("{what}: `{name}` is not a string").into())
}

/// The turn's text as replayed: `text`, plus ` [image: caption]` when the turn shared an image.
fn turn_text(turn: &Value, notes: &mut DataNotes) -> BoxResult<String> {
    let mut text = string_field(turn, "text", "turn")?;
    if let Some(caption) = turn.get("blip_caption").and_then(Value::as_str) {
        let caption = caption.trim();
        if !caption.is_empty() {
            text.push_str(" [image: ");
            text.push_str(caption);
            text.push(']');
            notes.captions += 1;
        }
    }
    Ok(text)
}

/// The existing dia_ids an evidence entry names. Entries are trimmed, split on `;` and `,`,
/// stripped of whitespace (`D1: 3` → `D1:3`) and, failing that, read as `D` followed by exactly
/// two numbers with any separators (`D:11:26` → `D11:26`). Parts that name no turn are dropped.
fn normalise_evidence(
    raw: &str,
    turns: &HashMap<String, String>,
    conversation: &str,
    notes: &mut DataNotes,
) -> Vec<String> {
    if turns.contains_key(raw) {
        return vec![raw.to_string()];
    }
    let mut found = Vec::new();
    for piece in raw.split([';', ',']) {
        let compact: String = piece.chars().filter(|c| !c.is_whitespace()).collect();
        if compact.is_empty() {
            continue;
        }
        if turns.contains_key(&compact) {
            found.push(compact);
            continue;
        }
        let numbers: Vec<u64> = compact
            .strip_prefix(['D', 'd'])
            .map(|rest| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .filter(|s| !s.is_empty())
                    .filter_map(|s| s.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let candidate = match numbers.as_slice() {
            [session, turn] => Some(format!("D{session}:{turn}")),
            _ => None,
        };
        match candidate {
            Some(id) if turns.contains_key(&id) => found.push(id),
            _ => notes
                .dropped
                .push((conversation.to_string(), piece.trim().to_string())),
        }
    }
    if !found.is_empty() {
        notes
            .normalised
            .push((conversation.to_string(), raw.to_string(), found.clone()));
    }
    found
}

fn load(path: &Path, limit: Option<usize>, notes: &mut DataNotes) -> BoxResult<Vec<Conversation>> {
    let text = std::fs::read_to_string(path).map_err(|err| format!("{}: {err}", path.display()))?;
    let data: Value =
        serde_json::from_str(&text).map_err(|err| format!("{}: {err}", path.display()))?;
    let list = data
        .as_array()
        .ok_or_else(|| format!("{}: not a JSON array", path.display()))?;
    let take = limit.unwrap_or(list.len()).min(list.len());
    let mut out = Vec::with_capacity(take);
    for sample in &list[..take] {
        out.push(load_conversation(sample, notes)?);
    }
    Ok(out)
}

fn load_conversation(sample: &Value, notes: &mut DataNotes) -> BoxResult<Conversation> {
    let id = string_field(sample, "sample_id", "conversation")?;
    let what = format!("conversation {id}");
    let conversation = field(sample, "conversation", &what)?;
    let speaker_a = string_field(conversation, "speaker_a", &what)?;
    let speaker_b = string_field(conversation, "speaker_b", &what)?;
    let sessions_object = conversation
        .as_object()
        .ok_or_else(|| format!("{what}: `conversation` is not an object"))?;

    // `session_N` keys only (not `session_N_date_time`), in numeric order.
    let mut sessions: Vec<(u64, &Value)> = sessions_object
        .iter()
        .filter_map(|(key, value)| {
            let n = key.strip_prefix("session_")?;
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some((n.parse().ok()?, value))
        })
        .collect();
    sessions.sort_by_key(|(n, _)| *n);

    let mut turns = HashMap::new();
    let mut messages: Vec<Msg> = Vec::new();
    let mut by_session: Vec<Vec<Msg>> = Vec::new();
    for (n, session) in sessions {
        let at_ms = sessions_object
            .get(&format!("session_{n}_date_time"))
            .and_then(Value::as_str)
            .and_then(session_time);
        let mut this_session: Vec<Msg> = Vec::new();
        let session_turns = session
            .as_array()
            .ok_or_else(|| format!("{what}: session_{n} is not a list"))?;
        for turn in session_turns {
            let speaker = string_field(turn, "speaker", &what)?;
            let dia_id = string_field(turn, "dia_id", &what)?;
            let text = turn_text(turn, notes)?;
            let role = if speaker == speaker_a {
                "user"
            } else if speaker == speaker_b {
                "assistant"
            } else {
                return Err(format!("{what}: {dia_id}: unknown speaker `{speaker}`").into());
            };
            for list in [&mut messages, &mut this_session] {
                match list.last_mut() {
                    Some(last) if last.role == role => {
                        last.text.push('\n');
                        last.text.push_str(&text);
                    }
                    _ => list.push(Msg {
                        role,
                        text: text.clone(),
                        at_ms,
                    }),
                }
            }
            if turns.insert(dia_id.clone(), text).is_some() {
                return Err(format!("{what}: dia_id {dia_id} appears twice").into());
            }
        }
        if !this_session.is_empty() {
            by_session.push(this_session);
        }
    }
    if messages.is_empty() {
        return Err(format!("{what}: no turns").into());
    }
    if messages.first().is_some_and(|m| m.role == "assistant") {
        notes.leading_assistant.push(id.clone());
    }
    let history_chars = messages.iter().map(|m| m.text.chars().count()).sum();

    let mut questions = Vec::new();
    let mut unanswerable = Vec::new();
    let qa = field(sample, "qa", &what)?
        .as_array()
        .ok_or_else(|| format!("{what}: `qa` is not a list"))?;
    for q in qa {
        let category = field(q, "category", &what)?
            .as_u64()
            .ok_or_else(|| format!("{what}: a question's category is not a number"))?;
        let Some(category) = u8::try_from(category)
            .ok()
            .filter(|c| CATEGORIES.contains(c) || *c == UNANSWERABLE)
        else {
            continue;
        };
        let text = string_field(q, "question", &what)?;
        if category == UNANSWERABLE {
            unanswerable.push(text);
            continue;
        }
        let mut evidence = Vec::new();
        let mut seen = HashSet::new();
        for raw in field(q, "evidence", &what)?
            .as_array()
            .into_iter()
            .flatten()
        {
            let Some(raw) = raw.as_str() else {
                notes.dropped.push((id.clone(), raw.to_string()));
                continue;
            };
            for found in normalise_evidence(raw.trim(), &turns, &id, notes) {
                if seen.insert(found.clone()) {
                    evidence.push(found);
                }
            }
        }
        if evidence.is_empty() {
            notes.skipped.push((id.clone(), text));
            continue;
        }
        questions.push(Question {
            category,
            text,
            evidence,
        });
    }
    Ok(Conversation {
        id,
        unanswerable,
        messages,
        sessions: by_session,
        turns,
        questions,
        history_chars,
    })
}

/// A session's time as LoCoMo writes it (`1:56 pm on 8 May, 2023`), UTC ms.
fn session_time(text: &str) -> Option<i64> {
    let (clock, date) = text.split_once(" on ")?;
    let day = memproxy::recall::when::period(date, 0)?.first;
    let (hm, half) = clock.trim().split_once(' ')?;
    let (h, m) = hm.split_once(':')?;
    let (h, m): (i64, i64) = (h.parse().ok()?, m.parse().ok()?);
    let h = h % 12
        + if half.eq_ignore_ascii_case("pm") {
            12
        } else {
            0
        };
    let midnight = day.midnight().assume_utc().unix_timestamp() * 1000;
    Some(midnight + (h * 60 + m) * 60_000)
}

/// A message's text: string content, or the `text` of its content parts.
fn content_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A running memproxy against a mock upstream.
struct Harness {
    state: Arc<AppState>,
    mock: MockUpstream,
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), String>>>,
    _data_dir: tempfile::TempDir,
    /// Replay by the sessions' dates (`--clock sessions`).
    dated: bool,
    /// The clock's last setting in this conversation's replay.
    clock_set: AtomicI64,
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    fn describe(&self) -> String {
        format!(
            "status {}, x-memory-status `{}`, body {}",
            self.status,
            self.header("x-memory-status"),
            String::from_utf8_lossy(&self.body)
        )
    }
}

impl Harness {
    async fn start(relevance_max_tokens: &str, embedder: &str, dated: bool) -> BoxResult<Harness> {
        let mock = MockUpstream::start_with(
            MockOptions {
                record: true,
                ..Default::default()
            },
            None,
        )
        .await?;
        let data_dir = tempfile::tempdir()?;
        // JSON string literals are valid TOML basic strings.
        let text = format!(
            "[server]\nmemory_budget = \"2GiB\"\n\
             [upstream]\nbase_url = {}\ntimeout = \"PT60S\"\nconnect_timeout = \"PT5S\"\n\
             [storage]\ndata_dir = {}\n\
             [memory]\nrecent_n = {RECENT_N}\ncompression_enabled = false\nmax_messages = 100000\n\
             relevance_max_tokens = {:?}\n\
             [embedding]\nembedder = {:?}\nqueue = 1000000\n",
            serde_json::to_string(&mock.base_url())?,
            serde_json::to_string(&data_dir.path().display().to_string())?,
            relevance_max_tokens,
            embedder,
        );
        let config = memproxy::config::from_toml(&text, &|_| None)
            .map_err(|err| format!("config: {err}"))?;
        let state = AppState::build(config).map_err(|err| format!("memproxy state: {err}"))?;
        if let Some(memory) = state.memory() {
            match (memory.embedding.space(), memory.embedding.unavailable()) {
                (Some((space, dims)), _) => eprintln!("embedder: {space} ({dims} dimensions)"),
                (None, Some(why)) => return Err(format!("embedder unavailable: {why}").into()),
                (None, None) => eprintln!("embedder: off (recall by words alone)"),
            }
        }
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let server_state = Arc::clone(&state);
        let task = tokio::spawn(async move {
            memproxy::server::run(listener, server_state, async {
                let _ = stopped.await;
            })
            .await
            .map_err(|err| err.to_string())
        });
        Ok(Harness {
            state: Arc::clone(&state),
            mock,
            base: format!("http://{addr}"),
            client: Client::builder(TokioExecutor::new()).build_http(),
            stop: Some(stop),
            task: Some(task),
            _data_dir: data_dir,
            dated,
            clock_set: AtomicI64::new(i64::MIN),
        })
    }

    async fn chat(
        &self,
        conversation: &str,
        messages: &[Value],
        extra: &[(&str, String)],
    ) -> BoxResult<Answer> {
        let body = json!({"model": MODEL, "messages": messages}).to_string();
        let mut request = Request::builder()
            .method("POST")
            .uri(format!("{}/v1/chat/completions", self.base))
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .header("x-memory-conversation-id", conversation);
        for (name, value) in extra {
            request = request.header(*name, value.as_str());
        }
        let response = self
            .client
            .request(request.body(Full::new(Bytes::from(body)))?)
            .await?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// Sends one exchange of the replay and checks it was stored with `reply` as the answer.
    async fn exchange(
        &self,
        conversation: &str,
        messages: &[Value],
        reply: &str,
        extra: &[(&str, String)],
    ) -> BoxResult<()> {
        self.mock.clear();
        self.mock.push(Reply::Text(reply.to_string()));
        let answer = self.chat(conversation, messages, extra).await?;
        if answer.status != StatusCode::OK || answer.header("x-memory-status") != "stored" {
            return Err(format!(
                "{conversation}: replay request not stored: {}",
                answer.describe()
            )
            .into());
        }
        let body: Value = serde_json::from_slice(&answer.body)?;
        if body
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            != Some(reply)
        {
            return Err(format!(
                "{conversation}: replay answer is not the scripted reply: {}",
                answer.describe()
            )
            .into());
        }
        Ok(())
    }

    /// Asks `question` without storing it; returns the forwarded messages before the question.
    async fn ask(
        &self,
        conversation: &str,
        question: &str,
        headers: &[(&str, String)],
    ) -> BoxResult<Vec<Value>> {
        self.mock.clear();
        let answer = self
            .chat(
                conversation,
                &[json!({"role": "user", "content": question})],
                headers,
            )
            .await?;
        if answer.status != StatusCode::OK || answer.header("x-memory-status") == "stored" {
            return Err(format!(
                "{conversation}: question request failed or was stored: {}",
                answer.describe()
            )
            .into());
        }
        let mut forwarded = self.mock.last_messages();
        self.mock.clear();
        match forwarded.pop() {
            Some(last) if last["role"] == "user" && content_text(&last) == question => {
                Ok(forwarded)
            }
            other => Err(format!(
                "{conversation}: the last forwarded message is not the question: {other:?}"
            )
            .into()),
        }
    }

    /// Moves memproxy's clock to `at_ms` when the replay goes by the sessions' dates and it
    /// is later than the clock's last setting (a session's exchanges keep the real time's
    /// pace from there).
    fn at(&self, at_ms: Option<i64>) {
        let (Some(at_ms), Some(memory)) = (at_ms.filter(|_| self.dated), self.state.memory())
        else {
            return;
        };
        if self.clock_set.fetch_max(at_ms, Ordering::Relaxed) < at_ms {
            memory.clock.set(at_ms);
        }
    }

    /// Waits until the background embedding jobs are done (every replayed message has its
    /// vector, as a conversation asked later would).
    async fn embedded(&self) -> BoxResult<()> {
        let Some(memory) = self.state.memory() else {
            return Ok(());
        };
        for _ in 0..36_000 {
            if memory.embedding.idle() {
                return Ok(());
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        Err("the background embedding jobs did not finish within 6 minutes".into())
    }

    async fn stop(mut self) -> BoxResult<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await?.map_err(|err| format!("memproxy: {err}"))?;
        }
        Ok(())
    }
}

fn message_json(message: &Msg) -> Value {
    json!({"role": message.role, "content": message.text})
}

/// Replays a conversation as a front-end would: each request carries only the newest message(s).
async fn replay(harness: &Harness, conversation: &Conversation) -> BoxResult<()> {
    replay_messages(harness, &conversation.id, &conversation.messages, &[]).await
}

/// The user id of a conversation's sessions in `--mode cross-session`, and the id of the
/// conversation of session `n` (1-based).
fn session_conversation(conversation: &Conversation, n: usize) -> String {
    format!("{}-session-{n}", conversation.id)
}

fn user_header(conversation: &Conversation) -> (&'static str, String) {
    ("x-memory-user-id", conversation.id.clone())
}

/// Replays every session as its own conversation of the conversation's user.
async fn replay_sessions(harness: &Harness, conversation: &Conversation) -> BoxResult<()> {
    let user = [user_header(conversation)];
    for (i, session) in conversation.sessions.iter().enumerate() {
        let id = session_conversation(conversation, i + 1);
        replay_messages(harness, &id, session, &user).await?;
    }
    Ok(())
}

async fn replay_messages(
    harness: &Harness,
    id: &str,
    messages: &[Msg],
    extra: &[(&str, String)],
) -> BoxResult<()> {
    let mut pending: Vec<Value> = Vec::new();
    let mut i = 0;
    while i < messages.len() {
        let message = &messages[i];
        if pending.is_empty() {
            harness.at(message.at_ms);
        }
        pending.push(message_json(message));
        i += 1;
        if message.role != "user" {
            // A leading assistant message goes with the next user message.
            continue;
        }
        let reply = match messages.get(i) {
            Some(next) if next.role == "assistant" => {
                i += 1;
                next.text.as_str()
            }
            _ => "ok",
        };
        harness.exchange(id, &pending, reply, extra).await?;
        pending.clear();
    }
    if !pending.is_empty() {
        return Err(format!("{id}: nothing to answer at the end of the replay").into());
    }
    Ok(())
}

/// The messages a replay stores: the replayed ones, plus `ok` after a trailing user message.
fn expected_history(conversation: &Conversation) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = conversation
        .messages
        .iter()
        .map(|m| (m.role.to_string(), m.text.clone()))
        .collect();
    if conversation
        .messages
        .last()
        .is_some_and(|m| m.role == "user")
    {
        out.push(("assistant".to_string(), "ok".to_string()));
    }
    out
}

/// Checks that memproxy holds exactly the replayed history, through a window wider than it.
async fn check_history(harness: &Harness, conversation: &Conversation) -> BoxResult<()> {
    let headers = [
        ("x-memory-persist", "false".to_string()),
        ("x-memory-recent-n", "10000".to_string()),
        ("x-memory-relevance-enabled", "false".to_string()),
        ("x-memory-max-context-tokens", "none".to_string()),
    ];
    let forwarded = harness
        .ask(&conversation.id, "recall_eval: history check", &headers)
        .await?;
    let got: Vec<(String, String)> = forwarded
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap_or("?").to_string(),
                content_text(m),
            )
        })
        .collect();
    let want = expected_history(conversation);
    if got != want {
        let first = got.iter().zip(&want).position(|(g, w)| g != w);
        return Err(format!(
            "{}: stored history differs from the replay ({} stored, {} replayed, first difference at {:?})",
            conversation.id,
            got.len(),
            want.len(),
            first
        )
        .into());
    }
    Ok(())
}

fn question_headers(config: EvalConfig, args: &Args) -> Vec<(&'static str, String)> {
    let max_context_tokens = args.max_context_tokens;
    let mut headers = vec![
        ("x-memory-persist", "false".to_string()),
        ("x-memory-recent-n", RECENT_N.to_string()),
    ];
    if let Some(on) = args.semantic {
        headers.push(("x-memory-relevance-semantic", on.to_string()));
    }
    if let Some(on) = args.time {
        headers.push(("x-memory-relevance-time", on.to_string()));
    }
    if let Some(on) = args.feedback {
        headers.push(("x-memory-relevance-feedback", on.to_string()));
    }
    if let Some(floor) = args.floor {
        headers.push(("x-memory-relevance-floor", floor.to_string()));
    }
    if let Some(share) = args.relative_floor {
        headers.push(("x-memory-relevance-relative-floor", share.to_string()));
    }
    if let Some(weight) = args.lexical_weight {
        headers.push(("x-memory-relevance-lexical-weight", weight.to_string()));
    }
    match config.top_k {
        None => headers.push(("x-memory-relevance-enabled", "false".to_string())),
        Some(k) => {
            headers.push(("x-memory-relevance-enabled", "true".to_string()));
            headers.push(("x-memory-relevance-top-k", k.to_string()));
        }
    }
    if let Some(n) = max_context_tokens {
        headers.push(("x-memory-max-context-tokens", n.to_string()));
    }
    headers
}

/// Scores one question from the messages forwarded before it.
fn score(conversation: &Conversation, question: &Question, forwarded: &[Value]) -> Tally {
    let texts: Vec<String> = forwarded.iter().map(content_text).collect();
    let chars: usize = texts.iter().map(|t| t.chars().count()).sum();
    let joined = texts.join("\n");
    let hits = question
        .evidence
        .iter()
        .filter(|id| {
            conversation
                .turns
                .get(*id)
                .is_some_and(|text| joined.contains(text.as_str()))
        })
        .count();
    Tally {
        n: 1,
        any: usize::from(hits > 0),
        all: usize::from(hits == question.evidence.len()),
        share: if conversation.history_chars == 0 {
            0.0
        } else {
            chars as f64 / conversation.history_chars as f64
        },
    }
}

/// A question whose evidence did not reach the model: what it asked, the evidence turns (id,
/// text) and the recalled turns' lines that were forwarded instead.
fn miss(
    conversation: &Conversation,
    question: &Question,
    config: EvalConfig,
    forwarded: &[Value],
) -> Value {
    let evidence: Vec<Value> = question
        .evidence
        .iter()
        .map(|id| {
            let text = conversation.turns.get(id);
            let message = text.and_then(|text| {
                conversation
                    .messages
                    .iter()
                    .position(|m| m.text.contains(text.as_str()))
            });
            json!({"id": id, "text": text, "message": message})
        })
        .collect();
    let recalled: Vec<String> = forwarded
        .iter()
        .map(content_text)
        .filter(|text| text.contains("[earlier turn #"))
        .flat_map(|text| text.lines().map(str::to_owned).collect::<Vec<_>>())
        .collect();
    json!({
        "conversation": conversation.id,
        "config": config.name(),
        "category": question.category,
        "question": question.text,
        "evidence": evidence,
        "recalled": recalled,
    })
}

/// Figures per configuration: category (1–4) → tally.
type Results = Vec<(EvalConfig, BTreeMap<u8, Tally>)>;

fn total(tallies: &BTreeMap<u8, Tally>) -> Tally {
    let mut all = Tally::default();
    for tally in tallies.values() {
        all.add(*tally);
    }
    all
}

fn settings_line(args: &Args, configs: &[EvalConfig]) -> String {
    let ks: Vec<String> = configs
        .iter()
        .filter_map(|c| c.top_k)
        .map(|k| k.to_string())
        .collect();
    let budget = args
        .max_context_tokens
        .map_or_else(|| "none".to_string(), |n| n.to_string());
    let file = args.data.file_name().map_or_else(
        || args.data.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    format!(
        "recall_eval  data={file}  mode={}  recent_n={RECENT_N}  top-K={}  token budget={budget}  embedder={}  semantic={}  floor={}  relative_floor={}  lexical_weight={}  clock={}  time={}  feedback={}",
        match args.mode {
            Mode::Within => "within",
            Mode::CrossSession => "cross-session",
        },
        if ks.is_empty() {
            "-".to_string()
        } else {
            ks.join(",")
        },
        args.embedder,
        args.semantic
            .map_or("default".to_string(), |b| b.to_string()),
        args.floor.map_or("default".to_string(), |f| f.to_string()),
        args.relative_floor
            .map_or("default".to_string(), |f| f.to_string()),
        args.lexical_weight
            .map_or("default".to_string(), |w| w.to_string()),
        match args.clock {
            ClockMode::Sessions => "sessions",
            ClockMode::Now => "now",
        },
        args.time.map_or("default".to_string(), |t| t.to_string()),
        args.feedback
            .map_or("default".to_string(), |f| f.to_string()),
    )
}

fn print_table(results: &Results) {
    println!(
        "{:<8} {:>4} {:>6} {:>10} {:>10} {:>12}",
        "config", "cat", "n", "recall_any", "recall_all", "prompt_share"
    );
    for (config, tallies) in results {
        let rows = CATEGORIES
            .iter()
            .map(|c| (c.to_string(), tallies.get(c).copied().unwrap_or_default()))
            .chain(std::iter::once(("all".to_string(), total(tallies))));
        for (label, tally) in rows {
            let (any, all, share) = tally.figures();
            println!(
                "{:<8} {:>4} {:>6} {:>10.3} {:>10.3} {:>12.3}",
                config.name(),
                label,
                tally.n,
                any,
                all,
                share
            );
        }
    }
}

fn results_json(
    args: &Args,
    results: &Results,
    conversations: &[Conversation],
    notes: &DataNotes,
    wall_seconds: f64,
) -> Value {
    let configs: Vec<Value> = results
        .iter()
        .map(|(config, tallies)| {
            let mut categories = serde_json::Map::new();
            let rows = CATEGORIES
                .iter()
                .map(|c| (c.to_string(), tallies.get(c).copied().unwrap_or_default()))
                .chain(std::iter::once(("all".to_string(), total(tallies))));
            for (label, tally) in rows {
                let (any, all, share) = tally.figures();
                categories.insert(
                    label,
                    json!({"n": tally.n, "recall_any": any, "recall_all": all, "prompt_share": share}),
                );
            }
            json!({
                "name": config.name(),
                "relevance_enabled": config.top_k.is_some(),
                "top_k": config.top_k,
                "categories": categories,
            })
        })
        .collect();
    json!({
        "data_file": args.data.display().to_string(),
        "settings": {
            "recent_n": RECENT_N,
            "max_context_tokens": args.max_context_tokens,
            "compression_enabled": false,
        },
        "conversations": conversations.iter().map(|c| c.id.clone()).collect::<Vec<_>>(),
        "skipped_questions": notes.skipped.len(),
        "dropped_evidence": notes.dropped.len(),
        "normalised_evidence": notes.normalised.len(),
        "wall_seconds": wall_seconds,
        "configs": configs,
    })
}

/// What recall injected for the questions nothing in the conversation answers (category 5).
#[derive(Debug, Default, Clone, Copy)]
struct Recalled {
    questions: usize,
    /// Questions that got any recalled turn.
    with_recall: usize,
    /// Tokens of the recalled-turns messages (cl100k, as the model counts them).
    tokens: u64,
}

impl Recalled {
    fn add(&mut self, forwarded: &[Value]) {
        self.questions += 1;
        let recalled: Vec<String> = forwarded
            .iter()
            .map(content_text)
            .filter(|text| text.starts_with(memproxy::message::RECALL_MARKER))
            .collect();
        if !recalled.is_empty() {
            self.with_recall += 1;
        }
        self.tokens += recalled
            .iter()
            .map(|text| u64::from(memproxy::tokens::count_message(Some(MODEL), text)))
            .sum::<u64>();
    }
}

fn print_unanswerable(unanswered: &[(EvalConfig, Recalled)]) {
    println!(
        "{:<8} {:>4} {:>6} {:>14} {:>16} {:>18}",
        "config", "cat", "n", "with_recalled", "recalled_tokens", "tokens_per_question"
    );
    for (config, r) in unanswered {
        println!(
            "{:<8} {:>4} {:>6} {:>14} {:>16} {:>18.1}",
            config.name(),
            UNANSWERABLE,
            r.questions,
            r.with_recall,
            r.tokens,
            r.tokens as f64 / r.questions.max(1) as f64
        );
    }
}

fn print_notes(notes: &DataNotes) {
    for (conversation, raw, ids) in &notes.normalised {
        eprintln!(
            "note: {conversation}: evidence `{raw}` read as {}",
            ids.join(", ")
        );
    }
    for (conversation, raw) in &notes.dropped {
        eprintln!("note: {conversation}: evidence `{raw}` names no turn; dropped");
    }
    for (conversation, question) in &notes.skipped {
        eprintln!("note: {conversation}: no valid evidence, question skipped: {question}");
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("recall_eval: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), Box<dyn Error>> {
    let started = Instant::now();
    let configs = args
        .configs
        .iter()
        .filter(|c| !c.trim().is_empty())
        .map(|c| EvalConfig::parse(c))
        .collect::<BoxResult<Vec<_>>>()?;
    if configs.is_empty() {
        return Err("--configs: no configuration given".into());
    }

    let mut notes = DataNotes::default();
    let conversations = load(&args.data, args.conversations, &mut notes)?;
    print_notes(&notes);

    let harness = Harness::start(
        &args.relevance_max_tokens,
        &args.embedder,
        args.clock == ClockMode::Sessions,
    )
    .await?;
    let mut unanswered: Vec<(EvalConfig, Recalled)> =
        configs.iter().map(|c| (*c, Recalled::default())).collect();
    let mut results: Results = configs.iter().map(|c| (*c, BTreeMap::new())).collect();
    let mut misses: Vec<Value> = Vec::new();
    for conversation in &conversations {
        let replay_started = Instant::now();
        harness.clock_set.store(i64::MIN, Ordering::Relaxed);
        let asked_in = match args.mode {
            Mode::Within => {
                replay(&harness, conversation).await?;
                check_history(&harness, conversation).await?;
                conversation.id.clone()
            }
            Mode::CrossSession => {
                replay_sessions(&harness, conversation).await?;
                format!("{}-questions", conversation.id)
            }
        };
        harness.embedded().await?;
        // The questions are asked the day after the last session.
        let last = conversation.messages.iter().filter_map(|m| m.at_ms).max();
        harness.at(last.map(|at| at + 86_400_000));
        let replayed = replay_started.elapsed();
        for ((config, tallies), (_, recalled)) in results.iter_mut().zip(&mut unanswered) {
            let mut headers = question_headers(*config, &args);
            if args.mode == Mode::CrossSession {
                headers.push(user_header(conversation));
            }
            for question in &conversation.questions {
                let forwarded = harness.ask(&asked_in, &question.text, &headers).await?;
                let tally = score(conversation, question, &forwarded);
                if tally.any == 0 && args.misses.is_some() {
                    misses.push(miss(conversation, question, *config, &forwarded));
                }
                tallies.entry(question.category).or_default().add(tally);
            }
            for question in &conversation.unanswerable {
                let forwarded = harness.ask(&asked_in, question, &headers).await?;
                recalled.add(&forwarded);
            }
        }
        eprintln!(
            "{}: {} messages ({} chars) replayed in {:.1}s, {} questions × {} configs asked in {:.1}s",
            conversation.id,
            conversation.messages.len(),
            conversation.history_chars,
            replayed.as_secs_f64(),
            conversation.questions.len(),
            configs.len(),
            (replay_started.elapsed() - replayed).as_secs_f64()
        );
    }
    harness.stop().await?;
    let wall = started.elapsed().as_secs_f64();

    println!("{}", settings_line(&args, &configs));
    let ids: Vec<&str> = conversations.iter().map(|c| c.id.as_str()).collect();
    println!(
        "conversations: {} ({})  questions (categories 1-4): {}",
        conversations.len(),
        ids.join(", "),
        conversations
            .iter()
            .map(|c| c.questions.len())
            .sum::<usize>()
    );
    print_table(&results);
    print_unanswerable(&unanswered);
    println!(
        "skipped: {} question(s) with no valid evidence; evidence entries normalised: {}, dropped: {}",
        notes.skipped.len(),
        notes.normalised.len(),
        notes.dropped.len()
    );
    println!("wall time: {wall:.1}s");

    if let Some(path) = &args.misses {
        std::fs::write(path, serde_json::to_string_pretty(&misses)? + "\n")
            .map_err(|err| format!("{}: {err}", path.display()))?;
    }
    if let Some(path) = &args.json {
        let value = results_json(&args, &results, &conversations, &notes, wall);
        std::fs::write(path, serde_json::to_string_pretty(&value)? + "\n")
            .map_err(|err| format!("{}: {err}", path.display()))?;
    }
    Ok(())
}
