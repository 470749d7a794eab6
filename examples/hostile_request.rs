//! One hostile request against a memproxy binary, measured: a chat completion carrying
//! `--messages` one-line messages (100,000 by default, about 4.9 MiB), sent while `/healthz` and
//! an unrelated conversation are probed every `--probe-ms`. Prints the hostile request's status
//! and time, the next one-line turn's time, memproxy's RSS before and after, what was stored,
//! and the probes' latency percentiles.
//!
//! ```sh
//! cargo build --release --bins --examples
//! ./target/release/examples/hostile_request --proxy-bin ./target/release/memproxy
//! ```
//!
//! The binary under test runs as a child process on a free 127.0.0.1 port with a temporary
//! data directory, in front of the in-process mock upstream; `--proxy-bin` may name any
//! memproxy build (an older one, for a before/after comparison).
// Allowed: a check run by hand prints what each request got, and a set-up step that fails
// ends it (unwrap) rather than let it report on half a set-up.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

#[path = "../tests/support/mock_upstream.rs"]
mod mock_upstream;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use mock_upstream::MockUpstream;
use serde_json::{Value, json};

#[derive(Debug, Parser)]
struct Args {
    /// The memproxy binary to measure.
    #[arg(long)]
    proxy_bin: PathBuf,
    /// Messages in the hostile request.
    #[arg(long, default_value_t = 100_000)]
    messages: usize,
    /// Pause between two probes of each prober, in milliseconds.
    #[arg(long, default_value_t = 10)]
    probe_ms: u64,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

const TOKEN: &str = "sk-hostile";
const ADMIN: &str = "admin-token-for-the-run";

/// Sends one request; returns its status, body and time.
async fn send(
    client: &HttpClient,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> (u16, Bytes, Duration) {
    let mut request = http::Request::builder().method(method).uri(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let started = Instant::now();
    let response = client
        .request(request.body(Full::new(body)).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, body, started.elapsed())
}

async fn chat(
    client: &HttpClient,
    base: &str,
    conversation: &str,
    body: &Value,
) -> (u16, Duration) {
    let (status, _, took) = send(
        client,
        "POST",
        &format!("{base}/v1/chat/completions"),
        &[
            ("authorization", &format!("Bearer {TOKEN}")),
            ("content-type", "application/json"),
            ("x-memory-conversation-id", conversation),
        ],
        Bytes::from(body.to_string()),
    )
    .await;
    (status, took)
}

fn one_line(text: &str) -> Value {
    json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]})
}

fn rss_mib(child: &Child) -> f64 {
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Probes `url` (GET, or a one-line chat when `chat` is set) until `done`; returns latencies.
async fn probe(
    client: HttpClient,
    base: String,
    chat_probe: bool,
    every: Duration,
    done: Arc<AtomicBool>,
) -> Vec<Duration> {
    let mut latencies = Vec::new();
    let mut i = 0;
    while !done.load(Ordering::Relaxed) && latencies.len() < 100_000 {
        let took = if chat_probe {
            i += 1;
            let mut body = one_line(&format!("probe {i}"));
            body["stream"] = json!(false);
            chat(&client, &base, "unrelated", &body).await.1
        } else {
            send(
                &client,
                "GET",
                &format!("{base}/healthz"),
                &[],
                Bytes::new(),
            )
            .await
            .2
        };
        latencies.push(took);
        tokio::time::sleep(every).await;
    }
    latencies
}

fn percentiles(label: &str, latencies: &mut [Duration]) {
    latencies.sort();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * q).round() as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
    };
    println!(
        "{label:<26} n={:<6} p50={:>8.2} ms  p99={:>8.2} ms  max={:>8.2} ms",
        latencies.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
}

fn main() {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(args));
}

async fn run(args: Args) {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = dir.path().join("memproxy.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[upstream]\nbase_url = \"{}\"\n[storage]\ndata_dir = \"{}\"\n",
            mock.base_url(),
            dir.path().join("data").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(&args.proxy_bin)
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .env("MEMPROXY_ADMIN_TOKEN", ADMIN)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    for _ in 0..500 {
        if client
            .request(
                http::Request::get(format!("{base}/healthz"))
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .is_ok()
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Warm: the tokenizer loads on the first chat request.
    chat(&client, &base, "unrelated", &one_line("warm up")).await;
    let rss_before = rss_mib(&child);

    let messages: Vec<Value> = (0..args.messages)
        .map(|i| {
            let role = if i % 2 == 0 || i + 1 == args.messages {
                "user"
            } else {
                "assistant"
            };
            json!({"role": role, "content": format!("line {i}")})
        })
        .collect();
    let hostile = json!({"model": "gpt-4o-mini", "messages": messages});
    let hostile_bytes = hostile.to_string().len();

    let done = Arc::new(AtomicBool::new(false));
    let every = Duration::from_millis(args.probe_ms);
    let health = tokio::spawn(probe(
        client.clone(),
        base.clone(),
        false,
        every,
        Arc::clone(&done),
    ));
    let other = tokio::spawn(probe(
        client.clone(),
        base.clone(),
        true,
        every,
        Arc::clone(&done),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, took) = chat(&client, &base, "hostile", &hostile).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    done.store(true, Ordering::Relaxed);
    let mut health = health.await.unwrap();
    let mut other = other.await.unwrap();
    let rss_after = rss_mib(&child);
    let (next_status, next) = chat(&client, &base, "hostile", &one_line("one more line")).await;

    // What was stored, read through the admin API (every conversation of the run).
    let (_, listing, _) = send(
        &client,
        "GET",
        &format!("{base}/admin/v1/conversations?limit=1000"),
        &[("authorization", &format!("Bearer {ADMIN}"))],
        Bytes::new(),
    )
    .await;
    let listing: Value = serde_json::from_slice(&listing).unwrap_or(Value::Null);
    let stored = listing["conversations"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["id"] == "hostile"))
        .map_or(json!("nothing"), |c| c["message_count"].clone());

    println!("binary: {}", args.proxy_bin.display());
    println!(
        "hostile request: {} messages, {:.1} MiB -> {status} in {:.2} s",
        args.messages,
        hostile_bytes as f64 / 1048576.0,
        took.as_secs_f64()
    );
    println!(
        "next one-line turn: {next_status} in {:.1} ms",
        next.as_secs_f64() * 1000.0
    );
    println!("stored messages in the hostile conversation: {stored}");
    println!("memproxy RSS: {rss_before:.1} MiB before, {rss_after:.1} MiB after");
    percentiles("/healthz during it", &mut health);
    percentiles("other conversation", &mut other);
    let _ = child.kill();
    let _ = child.wait();
}
