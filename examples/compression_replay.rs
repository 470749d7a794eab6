//! Compression replay: how many tokens each turn forwards as a conversation grows to 500
//! exchanges, with compression on and off, and what the turn that triggers a summary costs in
//! async and sync mode.
//!
//! ```text
//! cargo run --release --example compression_replay
//! cargo run --release --example compression_replay -- --exchanges 200 --summary-delay-ms 300
//! ```
//!
//! In-process: the mock upstream (its summaries are about a quarter of their input, each made
//! after `--summary-delay-ms`, like a real model call) and a real memproxy per scenario, on
//! 127.0.0.1. A synthetic conversation is sent newest-message-only; the mock records what it is
//! sent, and the forwarded prompt's tokens are counted the same way for every scenario
//! (tiktoken `o200k_base`, content text plus a per-message overhead):
//! - `full history`: no memory; the client re-sends everything, as an SDK loop does;
//! - `window+recall`: memproxy with compression off;
//! - `compression async` / `compression sync`: memproxy with compression on
//!   (`compression_interval = PT0S`, so every time the unsummarized pool passes the threshold a
//!   new summary is made).
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use memproxy::mock_upstream::{MockUpstream, Reply};
use memproxy::state::AppState;
use memproxy::tokens;
use serde_json::{Value, json};

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
}

const WORDS: &[&str] = &[
    "garden", "invoice", "meeting", "budget", "holiday", "sister", "recipe", "train", "ticket",
    "account", "doctor", "weather", "bike", "novel", "project", "deadline", "coffee", "market",
    "flight", "hotel", "museum", "guitar", "school", "birthday", "camera", "mountain", "river",
    "dinner", "friend", "office", "server", "backup", "release", "customer", "order", "refund",
    "address", "phone", "concert", "team", "plan", "idea", "price", "review", "lesson",
];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn sentence(&mut self, turn: usize) -> String {
        let words: Vec<&str> = (0..24)
            .map(|_| WORDS[(self.next() % WORDS.len() as u64) as usize])
            .collect();
        format!(
            "Turn {turn}: {} ({}).",
            words.join(" "),
            self.next() % 100_000
        )
    }
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
    latency: Vec<Duration>,
    /// Turns whose answer carried a new summary label.
    summary_turns: Vec<usize>,
    trigger_turns: Vec<usize>,
    summaries: usize,
}

async fn run(scenario: Scenario, args: &Args) -> Outcome {
    let mock = MockUpstream::start().await.unwrap();
    // Every summary call takes the configured time, like a model's, then the mock writes it.
    for _ in 0..args.exchanges {
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
    let state = AppState::build(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(memproxy::server::run(listener, Arc::clone(&state), async {
        let _ = stopped.await;
    }));
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut rng = Rng(42);
    let mut history: Vec<Value> = Vec::new();
    let mut outcome = Outcome {
        tokens: vec![],
        latency: vec![],
        summary_turns: vec![],
        trigger_turns: vec![],
        summaries: 0,
    };
    let mut last_label = "none".to_string();
    for turn in 1..=args.exchanges {
        let message = json!({"role": "user", "content": rng.sentence(turn)});
        let messages = if scenario == Scenario::FullHistory {
            history.push(message);
            history.clone()
        } else {
            vec![message]
        };
        tokio::time::sleep(Duration::from_millis(args.turn_pause_ms)).await;
        let body = json!({"model": "gpt-4o-mini", "messages": messages}).to_string();
        let mut request = http::Request::post(format!("http://{addr}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-replay");
        if scenario != Scenario::FullHistory {
            request = request.header("x-memory-conversation-id", "replay");
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
            serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes())
                .unwrap();
        outcome.latency.push(started.elapsed());
        // Summary calls received since the last turn (the mock records them on arrival).
        let calls = mock.summary_requests().len();
        if calls > 0 {
            outcome.trigger_turns.push(turn);
            outcome.summaries += calls;
        }
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
    let _ = stop.send(());
    let _ = server.await;
    outcome
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
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
    println!("\nlatency of the turns that triggered a summary vs the median turn:");
    for (scenario, outcome) in &mut outcomes {
        if !matches!(scenario, Scenario::Async | Scenario::Sync) {
            continue;
        }
        let triggers: Vec<Duration> = outcome
            .trigger_turns
            .iter()
            .map(|t| outcome.latency[t - 1])
            .collect();
        let mut all = outcome.latency.clone();
        let median_all = median(&mut all);
        let mut t = triggers.clone();
        let median_trigger = if t.is_empty() {
            Duration::ZERO
        } else {
            median(&mut t)
        };
        println!(
            "  {:<22} median turn {:>8.2} ms   triggering turns (n={}) median {:>8.2} ms   added {:>8.2} ms",
            scenario.name(),
            median_all.as_secs_f64() * 1e3,
            triggers.len(),
            median_trigger.as_secs_f64() * 1e3,
            (median_trigger.as_secs_f64() - median_all.as_secs_f64()) * 1e3,
        );
    }
    println!("\nwall time {:.1} s", started.elapsed().as_secs_f64());
}
