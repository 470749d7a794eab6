//! Compression replay: how many tokens each turn forwards as a conversation grows to 500
//! exchanges, with compression on and off, how much of it a provider's prompt cache could
//! serve, and what the turn that triggers a summary costs in async and sync mode.
//!
//! ```text
//! cargo run --release --example compression_replay
//! cargo run --release --example compression_replay -- --reply-words 150   # model-length replies
//! cargo run --release --example compression_replay -- --exchanges 200 --summary-delay-ms 300
//! cargo run --example compression_replay -- --reply-words 150 --no-trigger   # tokens only
//! ```
//!
//! The prompt cache: per turn, the longest prefix (in tokens) the forwarded prompt shares with
//! the conversation's previous one, counted the way OpenAI caches (nothing below 1,024 tokens,
//! else rounded down to a multiple of 128). Whole messages that are equal count whole; in the
//! first message that differs, the tokens of the text both start with (less one, for the
//! token that may straddle the difference). Reported: the cacheable share of all forwarded
//! tokens, and the effective input cost `uncached + 0.1 × cached` (cached input is billed at a
//! tenth), also as a ratio to today's layout.
//!
//! "Today's layout" (before issue 14) is measured in the same run: memproxy with
//! `window_step = 0` (the window slides every turn, as it did), whose forwarded messages the
//! replay puts back in the old order (instructions · memories · summary · recalled turns ·
//! window · new message) before measuring. The window, the recall and the summaries are then
//! exactly what the old code chose (the window and the pool it bounds are the same), and only
//! the order differs, as it did.
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
// Allowed: a measurement run by hand prints its tables, and a step that fails ends it (unwrap)
// rather than let it report figures from half a run.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use memproxy::tokens;
use serde_json::{Value, json};

#[path = "../tests/support/mock_upstream.rs"]
mod mock_upstream;
#[path = "support/own_runtime.rs"]
mod own_runtime;
#[path = "../tests/support/rng.rs"]
mod rng;
use mock_upstream::{MockUpstream, Reply};
use own_runtime::Served;
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
    /// Leave out the triggering turn's latency (token figures only: they do not depend on the
    /// build's speed, but for when an async summary lands).
    #[arg(long)]
    no_trigger: bool,
    /// Only the scenarios whose name contains this (today's layout of the same compression is
    /// always run too, for the ratio).
    #[arg(long)]
    only: Option<String>,
    /// The `window_step` of the "longer step" scenario.
    #[arg(long, default_value_t = 30)]
    longer_step: usize,
    /// `relevance_max_tokens` of the new layout (`auto`, or 0 for no limit: recalled turns
    /// whole, as before issue 14; today's layout always has no limit).
    #[arg(long, default_value = "auto")]
    relevance_max_tokens: String,
    /// Print every turn of the measured scenarios: tokens, cacheable, and the prompt's parts.
    #[arg(long)]
    trace: bool,
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

/// A message's text as counted: its content, a string or (parts, tool calls) its JSON.
fn message_text(message: &Value) -> String {
    match &message["content"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Token counts of messages, each counted once (the prompts repeat them turn after turn).
#[derive(Default)]
struct Counter {
    seen: std::collections::HashMap<String, u64>,
}

impl Counter {
    /// A message's tokens: content plus the per-message overhead.
    fn message(&mut self, message: &Value) -> u64 {
        let text = message_text(message);
        if let Some(&n) = self.seen.get(&text) {
            return n;
        }
        let n = u64::from(tokens::count_message(None, &text));
        self.seen.insert(text, n);
        n
    }

    fn prompt(&mut self, messages: &[Value]) -> u64 {
        messages.iter().map(|m| self.message(m)).sum()
    }

    /// The tokens `next` shares as a prefix with `previous` (see the module's documentation).
    fn shared_prefix(&mut self, previous: &[Value], next: &[Value]) -> u64 {
        let mut shared = 0;
        for (a, b) in previous.iter().zip(next) {
            if a == b {
                shared += self.message(a);
                continue;
            }
            if a["role"] == b["role"] {
                let (a, b) = (message_text(a), message_text(b));
                let common: usize = a
                    .char_indices()
                    .zip(b.chars())
                    .take_while(|((_, x), y)| x == y)
                    .last()
                    .map_or(0, |((i, c), _)| i + c.len_utf8());
                if common > 0 {
                    shared += u64::from(tokens::count_text(None, &a[..common])).saturating_sub(1);
                }
            }
            break;
        }
        shared
    }
}

/// What a provider serves from its cache of a shared prefix: nothing under 1,024 tokens, else
/// the prefix rounded down to 128 tokens.
fn cacheable(shared: u64) -> u64 {
    if shared < 1024 { 0 } else { shared / 128 * 128 }
}

/// The messages in today's (pre-issue-14) order: instructions · memories · summary · recalled ·
/// window · new, from a prompt in the new order (instructions · summary · memories · window ·
/// recalled · new). The replay names no user, so there are no memories.
fn in_old_order(messages: Vec<Value>) -> Vec<Value> {
    let marked = |m: &Value, marker: &str| {
        m["role"] == "system" && m["content"].as_str().is_some_and(|c| c.starts_with(marker))
    };
    let summary = |m: &Value| marked(m, memproxy::message::SUMMARY_MARKER);
    let recalled = |m: &Value| marked(m, memproxy::message::RECALL_MARKER);
    // The client's instructions: the system messages before the first injected or turn one.
    let leading = messages
        .iter()
        .position(|m| m["role"] != "system" || summary(m) || recalled(m))
        .unwrap_or(messages.len());
    let (head, rest) = messages.split_at(leading);
    let mut out: Vec<Value> = head.to_vec();
    out.extend(rest.iter().filter(|m| summary(m)).cloned());
    out.extend(rest.iter().filter(|m| recalled(m)).cloned());
    out.extend(rest.iter().filter(|m| !summary(m) && !recalled(m)).cloned());
    out
}

#[derive(Clone, Copy, PartialEq)]
enum Compression {
    Off,
    Async,
    Sync,
}

/// One replay: a client and the memproxy settings in front of the mock.
#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    /// `None`: no memory, the client re-sends its whole history.
    compression: Option<Compression>,
    /// `window_step`, as the config file takes it.
    window_step: &'static str,
    /// Measure the prompt in today's order.
    old_order: bool,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "full history (no memory)",
        compression: None,
        window_step: "\"auto\"",
        old_order: false,
    },
    Scenario {
        name: "today's layout, compression off",
        compression: Some(Compression::Off),
        window_step: "0",
        old_order: true,
    },
    Scenario {
        name: "new layout, compression off",
        compression: Some(Compression::Off),
        window_step: "\"auto\"",
        old_order: false,
    },
    Scenario {
        name: "today's layout, compression async",
        compression: Some(Compression::Async),
        window_step: "0",
        old_order: true,
    },
    Scenario {
        name: "new layout, compression async",
        compression: Some(Compression::Async),
        window_step: "\"auto\"",
        old_order: false,
    },
    Scenario {
        name: "new layout, async, longer step",
        compression: Some(Compression::Async),
        window_step: "LONGER",
        old_order: false,
    },
    Scenario {
        name: "new layout, compression sync",
        compression: Some(Compression::Sync),
        window_step: "\"auto\"",
        old_order: false,
    },
];

struct Outcome {
    tokens: Vec<u64>,
    /// Per turn, what the provider could serve from its cache.
    cached: Vec<u64>,
    /// Turns whose answer carried a new summary label.
    summary_turns: Vec<usize>,
    summaries: usize,
}

impl Outcome {
    fn total(&self) -> u64 {
        self.tokens.iter().sum()
    }

    fn cached_share(&self) -> f64 {
        self.cached.iter().sum::<u64>() as f64 / self.total() as f64
    }

    /// `uncached + 0.1 × cached`, over the whole replay.
    fn effective_cost(&self) -> f64 {
        let cached = self.cached.iter().sum::<u64>() as f64;
        (self.total() as f64 - cached) + 0.1 * cached
    }
}

/// A mock upstream and a real memproxy in front of it, in this process.
struct Harness {
    mock: MockUpstream,
    served: Served,
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
        let (enabled, is_async) = match scenario.compression {
            None | Some(Compression::Off) => (false, true),
            Some(Compression::Async) => (true, true),
            Some(Compression::Sync) => (true, false),
        };
        let text = format!(
            "[upstream]\nbase_url = \"{}\"\n[storage]\ndata_dir = \"{}\"\n[memory]\ncompression_enabled = {enabled}\ncompression_async = {is_async}\ncompression_interval = \"PT0S\"\ncompression_threshold_tokens = {}\nmax_messages = 100000\nwindow_step = {}\nrelevance_max_tokens = {:?}\n",
            mock.base_url(),
            dir.path().display(),
            args.threshold,
            scenario
                .window_step
                .replace("LONGER", &args.longer_step.to_string()),
            if scenario.old_order {
                "0"
            } else {
                args.relevance_max_tokens.as_str()
            },
        );
        // memproxy runs on a runtime of its own, as the binary does, so the replay's client and
        // mock do not share its threads.
        let served = Served::start(&text);
        Harness {
            mock,
            served,
            _dir: dir,
        }
    }

    async fn stop(self) {
        self.served.stop().await;
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
    let (mock, addr) = (&harness.mock, harness.served.addr);
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut rng = Rng::new(42);
    let mut history: Vec<Value> = Vec::new();
    let mut outcome = Outcome {
        tokens: vec![],
        cached: vec![],
        summary_turns: vec![],
        summaries: 0,
    };
    let mut counter = Counter::default();
    let mut previous: Vec<Value> = Vec::new();
    let full_history = scenario.compression.is_none();
    let mut last_label = "none".to_string();
    for turn in 1..=args.exchanges {
        let message = json!({"role": "user", "content": sentence(&mut rng, turn)});
        let messages = if full_history {
            history.push(message);
            history.clone()
        } else {
            vec![message]
        };
        if args.reply_words > 0 {
            mock.push(Reply::Text(words(&mut rng, turn, args.reply_words)));
        }
        tokio::time::sleep(Duration::from_millis(args.turn_pause_ms)).await;
        let conversation = (!full_history).then_some("replay");
        let (label, answer, _) = send(&client, addr, conversation, &messages).await;
        if label != last_label {
            outcome.summary_turns.push(turn);
            last_label = label;
        }
        let mut forwarded = mock.last_messages();
        if scenario.old_order {
            forwarded = in_old_order(forwarded);
        }
        outcome.tokens.push(counter.prompt(&forwarded));
        let shared = counter.shared_prefix(&previous, &forwarded);
        outcome.cached.push(cacheable(shared));
        if args.trace {
            let part = |marker: &str, counter: &mut Counter| -> u64 {
                forwarded
                    .iter()
                    .filter(|m| m["content"].as_str().is_some_and(|c| c.starts_with(marker)))
                    .map(|m| counter.message(m))
                    .sum()
            };
            let recalled_ids: Vec<String> = forwarded
                .iter()
                .filter_map(|m| m["content"].as_str())
                .filter(|c| c.starts_with(memproxy::message::RECALL_MARKER))
                .flat_map(|c| c.lines().filter_map(|l| l.strip_prefix("[earlier turn #")))
                .filter_map(|l| l.split(' ').next().map(str::to_string))
                .collect();
            let summary = part(memproxy::message::SUMMARY_MARKER, &mut counter);
            let recalled = part(memproxy::message::RECALL_MARKER, &mut counter);
            println!(
                "  trace {:<28} turn {turn:>4} msgs {:>3} tokens {:>5} shared {:>5} cached {:>5} summary {:>5} recalled {:>5} turns {}",
                scenario.name,
                forwarded.len(),
                outcome.tokens.last().unwrap(),
                shared,
                outcome.cached.last().unwrap(),
                summary,
                recalled,
                recalled_ids.join(",")
            );
        }
        previous = forwarded;
        mock.clear();
        if full_history {
            history.push(answer["choices"][0]["message"].clone());
        }
    }
    outcome.summaries = harness
        .served
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
    scenario: &Scenario,
    samples: usize,
    at_turns: &[usize],
    args: &Args,
) -> Vec<TriggerSample> {
    let harness = Harness::start(*scenario, args, samples * 4).await;
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
            let (_, _, took) = send(&client, harness.served.addr, Some(&id), &[message]).await;
            latency.push(took.as_secs_f64() * 1e3);
            let triggered = match at_turns.get(sample) {
                Some(at) => turn == *at,
                None => {
                    harness
                        .served
                        .state
                        .memory()
                        .unwrap()
                        .summarizer
                        .in_flight(&key)
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
        while harness
            .served
            .state
            .memory()
            .unwrap()
            .summarizer
            .in_flight(&key)
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
    println!(
        "forwarded prompt tokens at turn (o200k_base, content + 4 per message); cacheable: the prefix shared with the previous prompt (>= 1024, in steps of 128) over all forwarded tokens; cost: uncached + 0.1 x cached, over all turns, and its ratio to today's layout with the same compression:"
    );
    print!("{:<36}", "scenario");
    for t in &checkpoints {
        print!("{:>9}", format!("t{t}"));
    }
    println!(
        "{:>10}{:>11}{:>12}{:>9}{:>11}",
        "tN/t50", "cacheable", "cost", "/today", "summaries"
    );
    let mut outcomes: Vec<(Scenario, Outcome)> = Vec::new();
    for scenario in SCENARIOS {
        if let Some(only) = &args.only
            && !scenario.name.contains(only.as_str())
            && !(scenario.old_order && scenario.compression == Some(Compression::Async))
        {
            continue;
        }
        let outcome = run(*scenario, &args).await;
        let today = outcomes
            .iter()
            .find(|(s, _)| s.old_order && s.compression == scenario.compression)
            .map(|(_, o)| o.effective_cost());
        print!("{:<36}", scenario.name);
        for t in &checkpoints {
            print!("{:>9}", outcome.tokens[t - 1]);
        }
        let last = *checkpoints.last().unwrap();
        print!(
            "{:>10.2}{:>11.3}{:>12.0}",
            outcome.tokens[last - 1] as f64 / outcome.tokens[49.min(last - 1)] as f64,
            outcome.cached_share(),
            outcome.effective_cost(),
        );
        match today {
            Some(today) => print!("{:>9.3}", outcome.effective_cost() / today),
            None => print!("{:>9}", "—"),
        }
        println!("{:>11}", outcome.summaries);
        if !outcome.summary_turns.is_empty() {
            println!(
                "{:<36}summary in the prompt changed at turns {:?}",
                "", outcome.summary_turns
            );
        }
        outcomes.push((*scenario, outcome));
    }
    if args.no_trigger {
        println!("\nwall time {:.1} s", started.elapsed().as_secs_f64());
        return;
    }
    println!(
        "\nlatency of the turn that triggers a conversation's first summary, minus the median of the {BEFORE} turns before it\n({} conversations per mode; control: compression off, the same turns):",
        args.trigger_samples
    );
    let new_layout = |compression: Compression| {
        SCENARIOS
            .iter()
            .find(|s| !s.old_order && s.compression == Some(compression))
            .unwrap()
    };
    let asynchronous = trigger_latency(
        new_layout(Compression::Async),
        args.trigger_samples,
        &[],
        &args,
    )
    .await;
    let turns: Vec<usize> = asynchronous.iter().map(|s| s.turn).collect();
    let control = trigger_latency(new_layout(Compression::Off), turns.len(), &turns, &args).await;
    let synchronous = trigger_latency(
        new_layout(Compression::Sync),
        args.trigger_samples,
        &[],
        &args,
    )
    .await;
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
