//! Compression replay: how many tokens each turn forwards as a conversation grows to 500
//! exchanges, with compression on and off, and what the turn that triggers a summary costs in
//! async and sync mode.
//!
//! ```text
//! cargo run --release --example compression_replay
//! cargo run --release --example compression_replay -- --reply-words 150   # model-length replies
//! cargo run --release --example compression_replay -- --exchanges 200 --summary-delay-ms 300
//! ```
//!
//! In one process: the mock upstream (its summaries are about a quarter of their input, each
//! made after `--summary-delay-ms`, like a real model call) and a real memproxy per scenario on
//! a runtime of its own, on 127.0.0.1. A synthetic conversation is sent newest-message-only; the mock records what it is
//! sent, and the forwarded prompt's tokens are counted the same way for every scenario
//! (tiktoken `o200k_base`, content text plus a per-message overhead):
//! - `full history`: no memory; the client re-sends everything, as an SDK loop does;
//! - `window+recall`: memproxy with compression off;
//! - `compression async` / `compression sync`: memproxy with compression on
//!   (`compression_interval = PT0S`, so every time the unsummarized pool passes the threshold a
//!   new summary is made).
//!
//! Then the triggering turn: `--trigger-samples` conversations per mode grow until one turn
//! queues (async) or makes (sync) the conversation's first summary; that turn's latency minus
//! the median of the 8 turns before it is what the summary adds. The control runs the same
//! turns with compression off, so its spread is the noise.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use memproxy::state::AppState;
use memproxy::tokens;
use serde_json::{Value, json};

#[path = "../tests/support/mock_upstream.rs"]
mod mock_upstream;
#[path = "../tests/support/rng.rs"]
mod rng;
use mock_upstream::{MockUpstream, Reply};
use rng::Rng;

#[derive(Parser)]
struct Args {
    /// Exchanges per conversation.
    #[arg(long, default_value_t = 500)]
    exchanges: usize,
    /// How long the mock takes to write a summary.
    #[arg(long, default_value_t = 200)]
    summary_delay_ms: u64,
    /// Pause between turns (a person typing; without it 500 turns run inside one summary call).
    #[arg(long, default_value_t = 20)]
    turn_pause_ms: u64,
    /// compression_threshold_tokens.
    #[arg(long, default_value_t = 8192)]
    threshold: u64,
    /// Words in each assistant reply; 0: the mock echoes the question (`reply to: …`), so a
    /// reply is as short as a question (about 37 tokens).
    #[arg(long, default_value_t = 0)]
    reply_words: usize,
    /// Conversations grown until they trigger their first summary, per mode, for the
    /// triggering turn's latency.
    #[arg(long, default_value_t = 20)]
    trigger_samples: usize,
}

const WORDS: &[&str] = &[
    "garden", "invoice", "meeting", "budget", "holiday", "sister", "recipe", "train", "ticket",
    "account", "doctor", "weather", "bike", "novel", "project", "deadline", "coffee", "market",
    "flight", "hotel", "museum", "guitar", "school", "birthday", "camera", "mountain", "river",
    "dinner", "friend", "office", "server", "backup", "release", "customer", "order", "refund",
    "address", "phone", "concert", "team", "plan", "idea", "price", "review", "lesson",
];

/// The user message of turn `turn`: 24 words.
fn sentence(rng: &mut Rng, turn: usize) -> String {
    words(rng, turn, 24)
}

/// `Turn N: `, `n` words and a number, so that no two texts are alike.
fn words(rng: &mut Rng, turn: usize, n: usize) -> String {
    let words: Vec<&str> = (0..n).map(|_| *rng.pick(WORDS)).collect();
    format!("Turn {turn}: {} ({}).", words.join(" "), rng.below(100_000))
}

fn prompt_tokens(messages: &[Value]) -> u64 {
    messages
        .iter()
        .map(|m| {
            let text = match &m["content"] {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            u64::from(tokens::count_message(None, &text))
        })
        .sum()
}

#[derive(Clone, Copy, PartialEq)]
enum Scenario {
    FullHistory,
    WindowRecall,
    Async,
    Sync,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::FullHistory => "full history (no memory)",
            Scenario::WindowRecall => "window+recall (compression off)",
            Scenario::Async => "compression async",
            Scenario::Sync => "compression sync",
        }
    }
}

struct Outcome {
    tokens: Vec<u64>,
    /// Turns whose answer carried a new summary label.
    summary_turns: Vec<usize>,
    summaries: usize,
}

/// A mock upstream and a real memproxy in front of it, in this process.
struct Harness {
    mock: MockUpstream,
    state: Arc<AppState>,
    addr: std::net::SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    server: std::thread::JoinHandle<Result<(), memproxy::store::StoreError>>,
    _dir: tempfile::TempDir,
}

impl Harness {
    async fn start(scenario: Scenario, args: &Args, summaries: usize) -> Harness {
        let mock = MockUpstream::start().await.unwrap();
        // Every summary call takes the configured time, like a model's, then the mock writes it.
        for _ in 0..summaries {
            mock.push_summary(Reply::Delay(
                Duration::from_millis(args.summary_delay_ms),
                Box::new(Reply::Auto),
            ));
        }
        let dir = tempfile::tempdir().unwrap();
        let (enabled, is_async) = match scenario {
            Scenario::FullHistory | Scenario::WindowRecall => (false, true),
            Scenario::Async => (true, true),
            Scenario::Sync => (true, false),
        };
        let text = format!(
            "[upstream]\nbase_url = \"{}\"\n[storage]\ndata_dir = \"{}\"\n[memory]\ncompression_enabled = {enabled}\ncompression_async = {is_async}\ncompression_interval = \"PT0S\"\ncompression_threshold_tokens = {}\nmax_messages = 100000\n",
            mock.base_url(),
            dir.path().display(),
            args.threshold
        );
        let config = memproxy::config::from_toml(&text, &|_| None).unwrap();
        // memproxy runs on a runtime of its own, as the binary does, so the replay's client and
        // mock do not share its threads.
        let (ready, started) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = std::thread::spawn(move || {
            let runtime = memproxy::server::runtime(None).unwrap();
            runtime.block_on(async move {
                let state = AppState::build(config).unwrap();
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                ready
                    .send((Arc::clone(&state), listener.local_addr().unwrap()))
                    .unwrap();
                memproxy::server::run(listener, state, async {
                    let _ = stopped.await;
                })
                .await
            })
        });
        let (state, addr) = started.recv().unwrap();
        Harness {
            mock,
            state,
            addr,
            stop,
            server,
            _dir: dir,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let server = self.server;
        let _ = tokio::task::spawn_blocking(move || server.join()).await;
    }
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Sends one turn; returns the answer's `x-memory-summary` label, its body and the latency.
async fn send(
    client: &HttpClient,
    addr: std::net::SocketAddr,
    conversation: Option<&str>,
    messages: &[Value],
) -> (String, Value, Duration) {
    let body = json!({"model": "gpt-4o-mini", "messages": messages}).to_string();
    let mut request = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-replay");
    if let Some(conversation) = conversation {
        request = request.header("x-memory-conversation-id", conversation);
    }
    let started = Instant::now();
    let response = client
        .request(request.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .unwrap();
    let label = response
        .headers()
        .get("x-memory-summary")
        .map_or("none", |v| v.to_str().unwrap())
        .to_string();
    let answer: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    (label, answer, started.elapsed())
}

async fn run(scenario: Scenario, args: &Args) -> Outcome {
    let harness = Harness::start(scenario, args, args.exchanges).await;
    let (mock, addr) = (&harness.mock, harness.addr);
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut rng = Rng::new(42);
    let mut history: Vec<Value> = Vec::new();
    let mut outcome = Outcome {
        tokens: vec![],
        summary_turns: vec![],
        summaries: 0,
    };
    let mut last_label = "none".to_string();
    for turn in 1..=args.exchanges {
        let message = json!({"role": "user", "content": sentence(&mut rng, turn)});
        let messages = if scenario == Scenario::FullHistory {
            history.push(message);
            history.clone()
        } else {
            vec![message]
        };
        if args.reply_words > 0 {
            mock.push(Reply::Text(words(&mut rng, turn, args.reply_words)));
        }
        tokio::time::sleep(Duration::from_millis(args.turn_pause_ms)).await;
        let conversation = (scenario != Scenario::FullHistory).then_some("replay");
        let (label, answer, _) = send(&client, addr, conversation, &messages).await;
        if label != last_label {
            outcome.summary_turns.push(turn);
            last_label = label;
        }
        outcome.tokens.push(prompt_tokens(&mock.last_messages()));
        mock.clear();
        if scenario == Scenario::FullHistory {
            history.push(answer["choices"][0]["message"].clone());
        }
    }
    outcome.summaries = harness
        .state
        .memory()
        .unwrap()
        .summarizer
        .counters
        .made
        .load(std::sync::atomic::Ordering::Relaxed) as usize;
    harness.stop().await;
    outcome
}

/// Turns before the trigger whose median latency is the baseline.
const BEFORE: usize = 8;

struct TriggerSample {
    /// The turn that triggered the summary (1-based).
    turn: usize,
    trigger_ms: f64,
    baseline_ms: f64,
}

impl TriggerSample {
    fn added_ms(&self) -> f64 {
        self.trigger_ms - self.baseline_ms
    }
}

/// Grows `samples` conversations on one proxy until each triggers its first summary (or, with
/// `at_turns`, to those turns) and compares that turn's latency with the turns before it.
async fn trigger_latency(
    scenario: Scenario,
    samples: usize,
    at_turns: &[usize],
    args: &Args,
) -> Vec<TriggerSample> {
    let harness = Harness::start(scenario, args, samples * 4).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut out = Vec::new();
    for sample in 0..samples {
        let id = format!("trigger-{sample}");
        let key = memproxy::identity::ConversationKey {
            tenant: memproxy::identity::TenantId::from_token(Some("sk-replay")),
            agent: "default".into(),
            conversation: id.clone(),
        };
        let mut rng = Rng::new(1000 + sample as u64);
        let mut latency = Vec::new();
        // Bounded: the threshold is crossed long before this.
        for turn in 1..=args.exchanges.max(2000) {
            if args.reply_words > 0 {
                harness
                    .mock
                    .push(Reply::Text(words(&mut rng, turn, args.reply_words)));
            }
            harness.mock.clear();
            let message = json!({"role": "user", "content": sentence(&mut rng, turn)});
            tokio::time::sleep(Duration::from_millis(args.turn_pause_ms)).await;
            let (_, _, took) = send(&client, harness.addr, Some(&id), &[message]).await;
            latency.push(took.as_secs_f64() * 1e3);
            let triggered = match at_turns.get(sample) {
                Some(at) => turn == *at,
                None => {
                    harness.state.memory().unwrap().summarizer.in_flight(&key)
                        || !harness.mock.summary_requests().is_empty()
                }
            };
            if triggered {
                if turn > BEFORE {
                    let mut before = latency[turn - 1 - BEFORE..turn - 1].to_vec();
                    before.sort_by(f64::total_cmp);
                    out.push(TriggerSample {
                        turn,
                        trigger_ms: latency[turn - 1],
                        baseline_ms: before[BEFORE / 2],
                    });
                }
                break;
            }
        }
        // Let the summary finish before the next conversation, so jobs do not overlap.
        let started = Instant::now();
        while harness.state.memory().unwrap().summarizer.in_flight(&key)
            && started.elapsed() < Duration::from_secs(30)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    harness.stop().await;
    out
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let started = Instant::now();
    let checkpoints: Vec<usize> = [50, 100, 250, 500]
        .into_iter()
        .filter(|t| *t <= args.exchanges)
        .collect();
    println!(
        "compression_replay  exchanges={}  threshold={} tokens  recent_n=10  top_k=5  summary call={} ms (mock)  pause between turns={} ms",
        args.exchanges, args.threshold, args.summary_delay_ms, args.turn_pause_ms
    );
    println!("forwarded prompt tokens at turn (o200k_base, content + 4 per message):");
    print!("{:<34}", "scenario");
    for t in &checkpoints {
        print!("{:>9}", format!("t{t}"));
    }
    println!("{:>12}{:>11}", "t500/t50", "summaries");
    let mut outcomes = Vec::new();
    for scenario in [
        Scenario::FullHistory,
        Scenario::WindowRecall,
        Scenario::Async,
        Scenario::Sync,
    ] {
        let outcome = run(scenario, &args).await;
        print!("{:<34}", scenario.name());
        for t in &checkpoints {
            print!("{:>9}", outcome.tokens[t - 1]);
        }
        let last = *checkpoints.last().unwrap();
        println!(
            "{:>12.2}{:>11}",
            outcome.tokens[last - 1] as f64 / outcome.tokens[49.min(last - 1)] as f64,
            outcome.summaries
        );
        if !outcome.summary_turns.is_empty() {
            println!(
                "{:<34}summary in the prompt changed at turns {:?}",
                "", outcome.summary_turns
            );
        }
        outcomes.push((scenario, outcome));
    }
    println!(
        "\nlatency of the turn that triggers a conversation's first summary, minus the median of the {BEFORE} turns before it\n({} conversations per mode; control: compression off, the same turns):",
        args.trigger_samples
    );
    let asynchronous = trigger_latency(Scenario::Async, args.trigger_samples, &[], &args).await;
    let turns: Vec<usize> = asynchronous.iter().map(|s| s.turn).collect();
    let control = trigger_latency(Scenario::WindowRecall, turns.len(), &turns, &args).await;
    let synchronous = trigger_latency(Scenario::Sync, args.trigger_samples, &[], &args).await;
    for (name, samples) in [
        ("control (compression off)", control),
        ("compression async", asynchronous),
        ("compression sync", synchronous),
    ] {
        if samples.is_empty() {
            println!("  {name:<27} n=0");
            continue;
        }
        let mut added: Vec<f64> = samples.iter().map(|s| s.added_ms()).collect();
        added.sort_by(f64::total_cmp);
        let mut trigger: Vec<f64> = samples.iter().map(|s| s.trigger_ms).collect();
        trigger.sort_by(f64::total_cmp);
        let at = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        println!(
            "  {name:<27} n={:<3} triggering turn median {:>8.3} ms   added: median {:>+8.3} ms  p10 {:>+8.3}  p90 {:>+8.3}",
            samples.len(),
            at(&trigger, 0.5),
            at(&added, 0.5),
            at(&added, 0.1),
            at(&added, 0.9),
        );
    }
    println!("\nwall time {:.1} s", started.elapsed().as_secs_f64());
}
