//! What the turn that queues a memory extraction (long-term memory, `docs/memories.md`) adds
//! to its request's latency, with the extraction model slow and with it down: the approach of
//! `compression_replay`'s trigger phase, for extractions.
//!
//! ```text
//! cargo run --example extraction_latency
//! cargo run --example extraction_latency -- --samples 40 --extraction-delay-ms 5000
//! ```
//!
//! In one process: the mock upstream and a real memproxy on a runtime of its own, on
//! 127.0.0.1. Each sample is a fresh conversation of a fresh user (`X-Memory-User-Id`) with
//! `extraction_every = --every`: turn `--every` is the one that queues the extraction. Its
//! latency minus the median of the turns before it is what the extraction adds; the control
//! sends the same turns with extraction never due, so its spread is the noise. Modes:
//! - `extraction slow`: the mock answers each extraction after `--extraction-delay-ms`;
//! - `extraction down`: the mock answers every extraction attempt 503 (three attempts, with
//!   back-off), the worker gives up; chat must not notice.
//!
//! Each sample waits for its extraction to end before the next starts, so jobs never overlap.
// Allowed: a measurement run by hand prints its figures, and a step that fails ends it
// (unwrap) rather than let it report figures from half a run.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;

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
    /// Conversations (one user each) per mode.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// extraction_every: the turn that queues the extraction; the turns before it are the
    /// baseline.
    #[arg(long, default_value_t = 9)]
    every: usize,
    /// How long the mock takes to answer an extraction in the slow mode.
    #[arg(long, default_value_t = 2000)]
    extraction_delay_ms: u64,
    /// Pause between turns.
    #[arg(long, default_value_t = 20)]
    turn_pause_ms: u64,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Control,
    Slow,
    Down,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Control => "control (no extraction)",
            Mode::Slow => "extraction slow",
            Mode::Down => "extraction down (503)",
        }
    }
}

const WORDS: &[&str] = &[
    "garden", "invoice", "meeting", "budget", "holiday", "sister", "recipe", "train", "ticket",
    "account", "doctor", "weather", "bike", "novel", "project", "deadline", "coffee", "market",
    "flight", "hotel", "museum", "guitar", "school", "birthday", "camera", "mountain", "river",
];

/// A user message of 24 words.
fn sentence(rng: &mut Rng) -> String {
    let words: Vec<&str> = (0..24).map(|_| *rng.pick(WORDS)).collect();
    format!("I like {}", words.join(" "))
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

async fn send(
    client: &HttpClient,
    addr: std::net::SocketAddr,
    conversation: &str,
    user: &str,
    every: usize,
    text: String,
) -> Duration {
    let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]});
    let request = http::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-extraction")
        .header("x-memory-conversation-id", conversation)
        .header("x-memory-user-id", user)
        .header("x-memory-extraction-every", every.to_string())
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let started = Instant::now();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers()["x-memory-status"],
        "stored",
        "chat goes on whatever the extraction model does"
    );
    response.into_body().collect().await.unwrap();
    started.elapsed()
}

/// One mode's samples: (the triggering turn's latency, the median of the turns before), ms.
async fn measure(mode: Mode, args: &Args) -> Vec<(f64, f64)> {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[upstream]\nbase_url = \"{}\"\n[storage]\ndata_dir = \"{}\"\n[memory]\ncompression_enabled = false\n",
        mock.base_url(),
        dir.path().display(),
    );
    // memproxy on a runtime of its own, as the binary runs.
    let served = Served::start(&text);
    let (state, addr) = (Arc::clone(&served.state), served.addr);
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let counters = &state.memory().unwrap().longterm.extractor.counters;
    let every = if mode == Mode::Control {
        10_000
    } else {
        args.every
    };
    let mut out = Vec::new();
    for sample in 0..args.samples {
        match mode {
            Mode::Control => {}
            Mode::Slow => mock.push_extraction(Reply::Delay(
                Duration::from_millis(args.extraction_delay_ms),
                Box::new(Reply::Text(r#"{"memories":[]}"#.into())),
            )),
            Mode::Down => {
                for _ in 0..3 {
                    mock.push_extraction(Reply::Status(503, r#"{"error":{}}"#.into()));
                }
            }
        }
        let mut rng = Rng::new(7000 + sample as u64);
        let (conversation, user) = (format!("c{sample}"), format!("u{sample}"));
        let mut latency = Vec::new();
        for _ in 0..args.every {
            tokio::time::sleep(Duration::from_millis(args.turn_pause_ms)).await;
            let took = send(
                &client,
                addr,
                &conversation,
                &user,
                every,
                sentence(&mut rng),
            )
            .await;
            latency.push(took.as_secs_f64() * 1e3);
        }
        let trigger = latency.pop().unwrap();
        latency.sort_by(f64::total_cmp);
        out.push((trigger, latency[latency.len() / 2]));
        // The extraction ends (answered, or given up after its attempts) before the next.
        if mode != Mode::Control {
            let waited = Instant::now();
            let ended = || {
                counters.done.load(Ordering::Relaxed) + counters.failures.load(Ordering::Relaxed)
            };
            while ended() < sample as u64 + 1 && waited.elapsed() < Duration::from_secs(60) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(ended(), sample as u64 + 1, "the extraction was queued");
        }
    }
    let runs = counters.runs.load(Ordering::Relaxed);
    let failed = counters.failures.load(Ordering::Relaxed);
    println!(
        "  {:<26} extractions run {runs}, failed {failed}, extraction calls {}",
        mode.name(),
        mock.extraction_requests().len()
    );
    served.stop().await;
    out
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let started = Instant::now();
    println!(
        "latency of the turn that queues a memory extraction (turn {} of a user's conversation), minus the median of the {} turns before it\n({} conversations per mode; slow: the extraction answers after {} ms; down: every attempt 503):",
        args.every,
        args.every - 1,
        args.samples,
        args.extraction_delay_ms
    );
    let mut results = Vec::new();
    for mode in [Mode::Control, Mode::Slow, Mode::Down] {
        results.push((mode, measure(mode, &args).await));
    }
    let at = |v: &[f64], q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    for (mode, samples) in results {
        let mut added: Vec<f64> = samples.iter().map(|(t, b)| t - b).collect();
        added.sort_by(f64::total_cmp);
        let mut trigger: Vec<f64> = samples.iter().map(|(t, _)| *t).collect();
        trigger.sort_by(f64::total_cmp);
        println!(
            "  {:<26} n={:<3} triggering turn median {:>7.3} ms   added: median {:>+7.3} ms  p10 {:>+7.3}  p90 {:>+7.3}",
            mode.name(),
            samples.len(),
            at(&trigger, 0.5),
            at(&added, 0.5),
            at(&added, 0.1),
            at(&added, 0.9),
        );
    }
    println!("\nwall time {:.1} s", started.elapsed().as_secs_f64());
}
