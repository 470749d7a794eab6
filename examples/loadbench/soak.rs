//! The memory soak (`--soak`): the memproxy binary as a child process, with its memory budget
//! at the default (or `--budget-mib`), under mixed traffic for `--duration` seconds, its RSS
//! sampled every second. It fails (exit status 1) if the RSS ever exceeded the budget plus
//! [`ALLOWANCE_MIB`], the pod limit the README recommends, or if memproxy died.
//!
//! The traffic, from `--concurrency` clients that each wait for an answer before sending again:
//!
//! - `--conversations` conversations (default 10,000), each client owning every
//!   `concurrency`-th one, so a conversation never has two requests in flight; each is visited
//!   once in order, then at random;
//! - one conversation in three is a full-history client (it sends every message so far, the
//!   replies as the mock gave them), the others send only their newest message;
//! - half the requests stream (SSE), half are JSON;
//! - recall on, compression on with a low threshold and no interval, so summaries are made all
//!   along (the mock answers the summary calls);
//! - 16 tenants (`Authorization: Bearer sk-soak-N`).
//!
//! In the middle, for `--burst` seconds, four more clients send requests whose own size passes
//! the high-water mark: they must be refused memory (`degraded`) while they last, and the
//! ordinary requests must get memory again within 5 s after. After the traffic and `--rest`
//! seconds of quiet, 20 new requests must all get memory. With `--redis`, memory is in a
//! redis-server the soak starts; with `--fjall`, in fjall.
//!
//! It fails when, besides the RSS and memproxy's life, fewer than 99% of the ordinary requests
//! after the first minute got memory (stored), when a burst request got memory, when memory
//! was not back within 5 s of the burst, or when a request after the rest did not get it.
//!
//! A conversation's text follows from its number and turn, so a full-history client can send
//! its history again without keeping it: the client keeps one turn counter per conversation.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Uri};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::args::Args;
use crate::children::ChildProc;
use crate::client::{HttpClient, REQUEST_TIMEOUT, send};
use crate::machine::{load_average, machine_line, run_dir, source_state, status_kb};
use crate::redis_server::RedisServer;
use crate::report::{mib, report_log};
use crate::rng::Rng;
use crate::text::sentence;
use memproxy_embed::files::{MODEL_DIR_ENV, WORKSPACE_MODEL_DIR};

/// memproxy's default `server.memory_budget`, in MiB (`DEFAULT_MEMORY_BUDGET` in the crate).
pub const DEFAULT_BUDGET_MIB: u64 = memproxy::config::DEFAULT_MEMORY_BUDGET >> 20;

/// What the RSS may exceed the budget by: the README's pod limit is the budget plus this.
pub const ALLOWANCE_MIB: u64 = 64;

/// How often the RSS is sampled, and a progress line printed.
const SAMPLE_EVERY: Duration = Duration::from_secs(1);
const PROGRESS_EVERY: u64 = 30;

/// Tenants the conversations are spread over.
const TENANTS: usize = 16;

/// The metrics printed at the end (lines starting with these names).
const METRICS: &[&str] = &[
    "memproxy_resident_memory_bytes",
    "memproxy_memory_budget_bytes",
    "memproxy_memory_in_flight_bytes",
    "memproxy_admission_refused_total",
    "memproxy_admission_waited_total",
    "memproxy_memory_planning_estimate_bytes",
    "memproxy_summaries_total",
    "memproxy_recall_cache_bytes",
    "memproxy_cached_conversations",
    "memproxy_commit_failures_total",
];

/// What the clients counted.
#[derive(Default)]
struct Counts {
    /// (HTTP status, `X-Memory-Status`) → answers.
    answers: BTreeMap<(u16, String), u64>,
    /// Answers whose body was not a whole chat completion or stream.
    incomplete: u64,
    /// Requests with no answer (transport error or timeout), and a few of their messages.
    failed: u64,
    samples: Vec<String>,
    /// Microseconds from sending each answered request to its whole answer, after the first
    /// minute.
    latency_us: Vec<u32>,
}

impl Counts {
    fn merge(&mut self, other: Counts) {
        for (key, n) in other.answers {
            *self.answers.entry(key).or_insert(0) += n;
        }
        self.incomplete += other.incomplete;
        self.failed += other.failed;
        self.latency_us.extend(other.latency_us);
        for sample in other.samples {
            if self.samples.len() < 5 {
                self.samples.push(sample);
            }
        }
    }

    fn total(&self) -> u64 {
        self.answers.values().sum::<u64>() + self.failed
    }
}

/// What every client shares.
struct Traffic {
    client: HttpClient,
    url: Uri,
    conversations: usize,
    clients: usize,
    started: Instant,
    deadline: Instant,
    sent: AtomicU64,
    /// The ordinary requests' answers, second by second.
    timeline: Arc<Timeline>,
}

/// Answers per second of the traffic: how many got memory, and how many in all.
struct Timeline {
    seconds: Vec<(AtomicU64, AtomicU64)>,
}

impl Timeline {
    fn new(seconds: usize) -> Timeline {
        Timeline {
            seconds: (0..seconds)
                .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
                .collect(),
        }
    }

    fn record(&self, second: u64, with_memory: bool) {
        let last = self.seconds.len().saturating_sub(1);
        let (on, all) = &self.seconds[usize::try_from(second).unwrap_or(last).min(last)];
        if with_memory {
            on.fetch_add(1, Ordering::Relaxed);
        }
        all.fetch_add(1, Ordering::Relaxed);
    }

    /// (with memory, in all) of the answers in seconds `from..to`.
    fn count(&self, from: u64, to: u64) -> (u64, u64) {
        let to = usize::try_from(to)
            .unwrap_or(usize::MAX)
            .min(self.seconds.len());
        let from = usize::try_from(from).unwrap_or(usize::MAX).min(to);
        self.seconds[from..to]
            .iter()
            .fold((0, 0), |(on, all), (o, a)| {
                (
                    on + o.load(Ordering::Relaxed),
                    all + a.load(Ordering::Relaxed),
                )
            })
    }
}

/// An answer that says memory served the request.
fn with_memory(status: u16, memory: &str) -> bool {
    status == 200 && memory == "stored"
}

/// What the ordinary requests must reach after the first minute, in percent.
const MEMORY_ON_PERCENT: f64 = 99.0;
/// Seconds after a burst within which memory must be back.
const RECOVERY_S: u64 = 5;
/// Requests sent after the rest.
const PROBES: usize = 20;

/// Runs the soak; `Ok(false)` when memproxy went over its limit or died.
pub async fn soak(args: &Args) -> Result<bool, String> {
    let duration = Duration::from_secs_f64(args.duration);
    if !(args.duration > 0.0 && args.duration <= 86_400.0) {
        return Err("--duration must be in (0, 86400] seconds".to_string());
    }
    if args.conversations == 0 || !(1..=1024).contains(&args.concurrency) {
        return Err("--conversations must be at least 1, --concurrency 1..=1024".to_string());
    }
    let budget_mib = args.budget_mib.unwrap_or(DEFAULT_BUDGET_MIB);
    let limit_kb = (budget_mib + ALLOWANCE_MIB) * 1024;
    let exe = memproxy_binary(args)?;
    println!("memproxy memory soak");
    println!("machine: {}", machine_line());
    println!(
        "command: {}",
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    println!("source: {}", source_state(Some(&exe)));
    println!("memproxy binary: {}", exe.display());
    let model_env = model_dir_env();
    match &model_env {
        Some(dir) => println!("embedding model: {dir} (passed as {MODEL_DIR_ENV})"),
        None => {
            println!("embedding model: as memproxy finds it ({MODEL_DIR_ENV} or its own search)")
        }
    }
    println!("load average at start: {}", load_average());

    let dir = run_dir("soak")?;
    let mut mock = ChildProc::mock(dir.path())?;
    let redis = args.redis.then(RedisServer::start);
    let config_text = config(args, redis.as_ref().map(RedisServer::url).as_deref())?;
    let config_path = dir.path().join("memproxy.toml");
    std::fs::write(&config_path, &config_text).map_err(|e| format!("writing the config: {e}"))?;
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let upstream = format!("http://127.0.0.1:{}/v1", mock.port);
    let data_dir = dir.path().join("data");
    let (mut proxy, _) = ChildProc::launch(
        "memproxy",
        &exe,
        &[
            "--config".as_ref(),
            config_path.as_os_str(),
            "--listen".as_ref(),
            listen.as_ref(),
            "--upstream".as_ref(),
            upstream.as_ref(),
            "--data-dir".as_ref(),
            data_dir.as_os_str(),
            "serve".as_ref(),
        ],
        &envs(model_env.as_ref()),
        &dir.path().join("memproxy.log"),
    )?;
    proxy.port = port;

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(args.concurrency * 2)
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector);
    let ready = wait_ready(&client, port, &mut proxy).await?;
    println!("recall: {}", recall_line(&ready));
    let idle_kb = status_kb(proxy.pid, "VmRSS");
    println!(
        "memproxy pid {} on {listen}, idle RSS {} MiB; budget {budget_mib} MiB, limit {} MiB (budget + {ALLOWANCE_MIB})",
        proxy.pid,
        mib(idle_kb),
        budget_mib + ALLOWANCE_MIB
    );
    println!(
        "memproxy config: {}",
        config_text.trim().replace('\n', "; ")
    );
    println!(
        "traffic: {} s, {} conversations, {} clients; 1 in 3 full-history, half streamed",
        args.duration, args.conversations, args.concurrency
    );

    if let Some(redis) = &redis {
        println!("memory in redis-server at {}", redis.url());
    }
    let high_water = high_water_bytes(&client, port).await;
    // A body whose estimate alone (4 copies of it) passes the mark over the idle RSS.
    let burst_body =
        usize::try_from(high_water.saturating_sub(idle_kb.unwrap_or(0) * 1024) / 4 + (1 << 20))
            .unwrap_or(usize::MAX)
            .min(memproxy::config::DEFAULT_BODY_LIMIT_BYTES - (1 << 20));

    let started = Instant::now();
    let traffic = Arc::new(Traffic {
        client: client.clone(),
        url: format!("http://{listen}/v1/chat/completions")
            .parse()
            .map_err(|e| format!("proxy url: {e}"))?,
        conversations: args.conversations,
        clients: args.concurrency,
        started,
        deadline: started + duration,
        sent: AtomicU64::new(0),
        timeline: Arc::new(Timeline::new(duration.as_secs() as usize + 2)),
    });
    let burst_from = duration.as_secs_f64() / 2.0;
    let burst_to = burst_from + args.burst.max(0.0);
    let burst = (args.burst > 0.0).then(|| {
        println!(
            "burst: {BURST_CLIENTS} clients, {burst_from:.0}–{burst_to:.0} s, bodies of {} MiB (high-water mark {} MiB)",
            burst_body >> 20,
            high_water >> 20
        );
        // Each client a task of its own, so the four send at once.
        let bursts: Vec<_> = (0..BURST_CLIENTS)
            .map(|n| {
                tokio::spawn(run_burst(
                    Arc::clone(&traffic),
                    n,
                    burst_body,
                    Duration::from_secs_f64(burst_from),
                    Duration::from_secs_f64(burst_to),
                ))
            })
            .collect();
        bursts
    });
    let done = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample(
        proxy.pid,
        Arc::clone(&traffic),
        Arc::clone(&done),
        started,
    ));
    let clients: Vec<_> = (0..args.concurrency)
        .map(|n| tokio::spawn(run_client(Arc::clone(&traffic), n)))
        .collect();
    let mut counts = Counts::default();
    for client in clients {
        match client.await {
            Ok(c) => counts.merge(c),
            Err(err) => return Err(format!("a client task failed: {err}")),
        }
    }
    let traffic_s = started.elapsed().as_secs_f64();
    let burst_counts = match burst {
        Some(tasks) => {
            let mut counts = Counts::default();
            for task in tasks {
                counts.merge(task.await.map_err(|e| format!("the burst failed: {e}"))?);
            }
            Some(counts)
        }
        None => None,
    };
    // Let what the last requests started (summaries) finish, rest, then ask again.
    tokio::time::sleep(Duration::from_secs_f64(args.rest.max(3.0))).await;
    let probes = probe(&traffic).await;
    done.store(true, Ordering::Relaxed);
    let samples = sampler
        .await
        .map_err(|e| format!("the sampler failed: {e}"))?;
    let alive = proxy.check_alive();
    let final_kb = status_kb(proxy.pid, "VmRSS");
    let hwm_kb = status_kb(proxy.pid, "VmHWM");
    let metrics = scrape(&client, port).await;
    let timeline = Arc::clone(&traffic.timeline);
    drop(traffic);
    drop(client);
    let proxy_exit = proxy.terminate(Duration::from_secs(20));
    let mock_exit = mock.stop(Duration::from_secs(5));

    let peak = samples.iter().max_by_key(|(_, kb)| *kb).copied();
    let peak_kb = peak.map(|(_, kb)| kb).into_iter().chain(hwm_kb).max();
    let total = counts.total();
    println!();
    println!(
        "requests: {total} in {traffic_s:.0} s ({:.0}/s); by status and X-Memory-Status:",
        total as f64 / traffic_s
    );
    for ((status, memory), n) in &counts.answers {
        println!("  {status} {memory:<12} {n}");
    }
    println!(
        "  no answer (transport error or {} s timeout): {}; answers cut short: {}",
        REQUEST_TIMEOUT.as_secs(),
        counts.failed,
        counts.incomplete
    );
    for sample in &counts.samples {
        println!("    e.g. {sample}");
    }
    println!("RSS over time (MiB, every {PROGRESS_EVERY} s):");
    let line: Vec<String> = samples
        .iter()
        .filter(|(s, _)| s.is_multiple_of(PROGRESS_EVERY))
        .map(|(s, kb)| format!("{s}s {}", mib(Some(*kb))))
        .collect();
    println!("  {}", line.join(", "));
    println!(
        "RSS: idle {} MiB; peak sampled {} MiB (at {} s); peak VmHWM {} MiB; final {} MiB; budget {budget_mib} MiB, limit {} MiB",
        mib(idle_kb),
        mib(peak.map(|(_, kb)| kb)),
        peak.map_or(0, |(s, _)| s),
        mib(hwm_kb),
        mib(final_kb),
        budget_mib + ALLOWANCE_MIB
    );
    println!("memproxy metrics at the end:");
    for line in metrics
        .lines()
        .filter(|l| METRICS.iter().any(|m| l.starts_with(m)))
    {
        println!("  {line}");
    }
    println!("shutdown: memproxy {proxy_exit}; mock {mock_exit}");
    report_log(
        "memproxy",
        &std::fs::read_to_string(&proxy.log).unwrap_or_default(),
    );
    println!("load average at the end: {}", load_average());

    let last = duration.as_secs();
    let (on, all) = timeline.count(60.min(last / 2), last + 1);
    let on_percent = percent(on, all);
    println!(
        "ordinary requests after the first minute: {on} of {all} got memory ({on_percent:.2}%)"
    );
    counts.latency_us.sort_unstable();
    let at = |q: f64| {
        let last = counts.latency_us.len().saturating_sub(1);
        counts
            .latency_us
            .get((last as f64 * q).round() as usize)
            .map_or(0.0, |us| f64::from(*us) / 1000.0)
    };
    println!(
        "their time to the whole answer, ms: p50 {:.1}, p90 {:.1}, p99 {:.1}, p99.9 {:.1}, max {:.1}",
        at(0.5),
        at(0.9),
        at(0.99),
        at(0.999),
        at(1.0)
    );
    let recovery = burst_counts.as_ref().map(|counts| {
        let refused = counts
            .answers
            .iter()
            .filter(|((_, memory), _)| memory == "degraded")
            .map(|(_, n)| n)
            .sum::<u64>();
        let given = counts
            .answers
            .iter()
            .filter(|((status, memory), _)| with_memory(*status, memory))
            .map(|(_, n)| n)
            .sum::<u64>();
        println!(
            "burst: {} requests, {refused} refused memory (degraded), {given} given memory, {} failed",
            counts.total(),
            counts.failed
        );
        let end = burst_to.ceil() as u64;
        let during = timeline.count(burst_from as u64, end);
        let after = timeline.count(end + RECOVERY_S, end + RECOVERY_S + 30);
        println!(
            "ordinary requests during the burst: {:.2}% got memory; from {RECOVERY_S} s after it for 30 s: {:.2}% ({} of {})",
            percent(during.0, during.1),
            percent(after.0, after.1),
            after.0,
            after.1
        );
        (given, after)
    });
    println!(
        "after {:.0} s of rest: {} of {PROBES} new requests got memory",
        args.rest.max(3.0),
        probes
    );

    let mut passed = true;
    if on_percent < MEMORY_ON_PERCENT {
        println!(
            "FAIL: {on_percent:.2}% of the ordinary requests after the first minute got memory, under {MEMORY_ON_PERCENT}%"
        );
        passed = false;
    }
    if let Some((given, (after_on, after_all))) = recovery {
        if given > 0 {
            println!("FAIL: {given} burst requests were given memory");
            passed = false;
        }
        if percent(after_on, after_all) < MEMORY_ON_PERCENT {
            println!(
                "FAIL: memory was not back for ordinary requests {RECOVERY_S} s after the burst"
            );
            passed = false;
        }
    }
    if probes < PROBES {
        println!("FAIL: only {probes} of {PROBES} requests after the rest got memory");
        passed = false;
    }
    if let Err(err) = alive {
        println!("FAIL: {err}");
        passed = false;
    }
    match peak_kb {
        Some(kb) if kb > limit_kb => {
            println!(
                "FAIL: RSS reached {} MiB, over the limit of {} MiB",
                mib(Some(kb)),
                budget_mib + ALLOWANCE_MIB
            );
            passed = false;
        }
        Some(_) => {}
        None => {
            println!("FAIL: memproxy's RSS could not be read");
            passed = false;
        }
    }
    if total == 0 {
        println!("FAIL: no request was answered");
        passed = false;
    }
    if passed {
        println!(
            "PASS: RSS stayed under budget + {ALLOWANCE_MIB} MiB, memory on for {on_percent:.2}% after the first minute"
        );
    }
    Ok(passed)
}

/// The memproxy binary: `--memproxy`, or the one beside this example's folder.
fn memproxy_binary(args: &Args) -> Result<PathBuf, String> {
    if let Some(path) = &args.memproxy {
        return Ok(path.clone());
    }
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let path = exe
        .parent()
        .and_then(|examples| examples.parent())
        .map(|profile| profile.join("memproxy"))
        .ok_or_else(|| "no folder above this example".to_string())?;
    if !path.exists() {
        return Err(format!(
            "{} not found: build it (cargo build --release --bins --examples) or pass --memproxy",
            path.display()
        ));
    }
    Ok(path)
}

/// The config: the budget when one is asked for, and summaries made all along.
fn config(args: &Args, redis_url: Option<&str>) -> Result<String, String> {
    let mut text = String::from("[server]\nshutdown_grace = \"PT10S\"\n");
    if let Some(budget) = args.budget_mib {
        text.push_str(&format!("memory_budget = \"{budget}MiB\"\n"));
    }
    text.push_str(&crate::bench::runtime_line(args));
    text.push_str(
        "\n[memory]\nrecent_n = 6\nrelevance_enabled = true\ncompression_enabled = true\ncompression_threshold_tokens = 200\ncompression_interval = \"PT0S\"\n",
    );
    if let Some(url) = redis_url {
        text.push_str(&format!(
            "\n[storage]\nbackend = \"redis\"\nredis_url = \"{url}\"\nredis_pool_size = 64\n"
        ));
    } else if args.fjall {
        text.push_str("\n[storage]\nbackend = \"fjall\"\n");
    }
    crate::args::with_extra(&text, args.proxy_config.as_deref())
}

/// A port nobody listens on now (the child binds it a moment later).
fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("local_addr: {e}"))
}

/// The child's environment: memproxy's log level, and the model's directory when one is passed.
fn envs(model: Option<&String>) -> Vec<(&'static str, &str)> {
    let mut envs = vec![("RUST_LOG", "warn")];
    if let Some(dir) = model {
        envs.push((MODEL_DIR_ENV, dir.as_str()));
    }
    envs
}

/// Where the model is, for memproxy's environment: `$MEMPROXY_MODEL_DIR` is left as it is when
/// set; otherwise this workspace's `models/` when the files are there. memproxy looks in its
/// working directory and in the workspace its binary was built in, so a binary copied elsewhere
/// and run from another folder would find no model and recall by words alone, and the soak
/// would not measure the default.
fn model_dir_env() -> Option<String> {
    if std::env::var_os(MODEL_DIR_ENV).is_some() {
        return None;
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(WORKSPACE_MODEL_DIR);
    memproxy_embed::files::ModelFiles::at(&dir)
        .ok()
        .map(|files| files.dir().display().to_string())
}

/// What `/readyz` says of recall: by meaning (and with what), or by words alone and why.
fn recall_line(ready: &Value) -> String {
    match (
        ready["recall"].as_str(),
        ready["embedder"].as_str(),
        ready["embedder_reason"].as_str(),
    ) {
        (Some("hybrid"), Some(embedder), _) => format!("hybrid (by words and meaning, {embedder})"),
        (Some(recall), _, Some(why)) => {
            format!("WARNING: {recall}, by words alone (not the default): {why}")
        }
        (Some(recall), _, None) => recall.to_string(),
        _ => format!("unknown (/readyz said {ready})"),
    }
}

/// Waits (at most 60 s) for `/readyz` to answer 200; its JSON body.
async fn wait_ready(
    client: &HttpClient,
    port: u16,
    proxy: &mut ChildProc,
) -> Result<Value, String> {
    let uri: Uri = format!("http://127.0.0.1:{port}/readyz")
        .parse()
        .map_err(|e| format!("readyz url: {e}"))?;
    for _ in 0..600 {
        proxy.check_alive()?;
        let request = Request::get(uri.clone())
            .body(Full::new(Bytes::new()))
            .map_err(|e| format!("readyz request: {e}"))?;
        if let Ok(Ok(answer)) =
            tokio::time::timeout(Duration::from_secs(2), send(client, request)).await
            && answer.status == 200
        {
            return Ok(serde_json::from_slice(&answer.body).unwrap_or(Value::Null));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("memproxy was not ready within 60 s".to_string())
}

/// `GET /metrics` as text (empty if it fails).
async fn scrape(client: &HttpClient, port: u16) -> String {
    let Ok(uri) = format!("http://127.0.0.1:{port}/metrics").parse::<Uri>() else {
        return String::new();
    };
    let Ok(request) = Request::get(uri).body(Full::new(Bytes::new())) else {
        return String::new();
    };
    match tokio::time::timeout(Duration::from_secs(10), send(client, request)).await {
        Ok(Ok(answer)) => String::from_utf8_lossy(&answer.body).into_owned(),
        _ => String::new(),
    }
}

/// Samples memproxy's RSS every second until `done`; prints a line every
/// [`PROGRESS_EVERY`] seconds. Returns (second, kB) samples.
async fn sample(
    pid: u32,
    traffic: Arc<Traffic>,
    done: Arc<AtomicBool>,
    started: Instant,
) -> Vec<(u64, u64)> {
    let mut samples = Vec::new();
    let mut peak = 0;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    // Bounded by the traffic's deadline: `done` is set a few seconds after it.
    while !done.load(Ordering::Relaxed) {
        tick.tick().await;
        let second = started.elapsed().as_secs();
        let Some(kb) = status_kb(pid, "VmRSS") else {
            break;
        };
        peak = peak.max(kb);
        samples.push((second, kb));
        if second > 0 && second.is_multiple_of(PROGRESS_EVERY) {
            let sent = traffic.sent.load(Ordering::Relaxed);
            println!(
                "[{second:>5} s] {sent} requests ({:.0}/s), RSS {} MiB, peak {} MiB",
                sent as f64 / started.elapsed().as_secs_f64(),
                mib(Some(kb)),
                mib(Some(peak))
            );
        }
    }
    samples
}

/// One client: its conversations, each visited once in order, then at random, until the
/// deadline. Returns what it counted.
async fn run_client(traffic: Arc<Traffic>, n: usize) -> Counts {
    let mine: Vec<usize> = (n..traffic.conversations)
        .step_by(traffic.clients)
        .collect();
    let mut counts = Counts::default();
    if mine.is_empty() {
        return counts;
    }
    let mut turns = vec![0u32; mine.len()];
    let mut rng = Rng::new(0x50a4 + n as u64);
    let mut visit = 0usize;
    while Instant::now() < traffic.deadline {
        let slot = if visit < mine.len() {
            visit
        } else {
            rng.below(mine.len())
        };
        visit += 1;
        let conversation = mine[slot];
        let stream = rng.below(2) == 0;
        let request = match request(&traffic.url, conversation, turns[slot], stream) {
            Ok(request) => request,
            Err(err) => {
                counts.failed += 1;
                counts.samples.push(err);
                continue;
            }
        };
        traffic.sent.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        match tokio::time::timeout(REQUEST_TIMEOUT, send(&traffic.client, request)).await {
            Ok(Ok(answer)) => {
                let memory = answer.memory.clone().unwrap_or_else(|| "-".to_string());
                let second = traffic.started.elapsed().as_secs();
                if second >= 60 {
                    let took = sent.elapsed().as_micros();
                    counts
                        .latency_us
                        .push(u32::try_from(took).unwrap_or(u32::MAX));
                }
                traffic
                    .timeline
                    .record(second, with_memory(answer.status, &memory));
                *counts.answers.entry((answer.status, memory)).or_insert(0) += 1;
                if answer.status == 200 && answer.body_ok(crate::client::Api::Chat, stream) {
                    turns[slot] += 1;
                } else if answer.status == 200 {
                    counts.incomplete += 1;
                } else if counts.samples.len() < 5 {
                    counts
                        .samples
                        .push(format!("HTTP {}: {}", answer.status, answer.snippet()));
                }
            }
            Ok(Err(err)) => {
                counts.failed += 1;
                if counts.samples.len() < 5 {
                    counts.samples.push(err);
                }
            }
            Err(_) => counts.failed += 1,
        }
    }
    counts
}

/// Clients sending oversized requests during the burst.
const BURST_CLIENTS: usize = 4;

/// One burst client: from `from` to `to` after the start, requests of `body_bytes` to
/// conversations of its own, one after the other.
async fn run_burst(
    traffic: Arc<Traffic>,
    n: usize,
    body_bytes: usize,
    from: Duration,
    to: Duration,
) -> Counts {
    let mut counts = Counts::default();
    tokio::time::sleep_until((traffic.started + from).into()).await;
    let text = "x ".repeat(body_bytes / 2);
    let mut sent = 0u64;
    while traffic.started.elapsed() < to {
        sent += 1;
        let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]});
        let request = Request::post(traffic.url.clone())
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-soak-burst")
            .header("x-memory-conversation-id", format!("burst-{n}-{sent}"))
            .body(Full::new(Bytes::from(body.to_string())));
        let Ok(request) = request else {
            counts.failed += 1;
            continue;
        };
        match tokio::time::timeout(REQUEST_TIMEOUT, send(&traffic.client, request)).await {
            Ok(Ok(answer)) => {
                let memory = answer.memory.clone().unwrap_or_else(|| "-".to_string());
                *counts.answers.entry((answer.status, memory)).or_insert(0) += 1;
            }
            _ => counts.failed += 1,
        }
    }
    counts
}

/// After the rest: [`PROBES`] requests to new conversations; how many got memory.
async fn probe(traffic: &Traffic) -> usize {
    let mut given = 0;
    for n in 0..PROBES {
        let body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": format!("after the rest, {n}")}]});
        let Ok(request) = Request::post(traffic.url.clone())
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-soak-0")
            .header("x-memory-conversation-id", format!("probe-{n}"))
            .body(Full::new(Bytes::from(body.to_string())))
        else {
            continue;
        };
        if let Ok(Ok(answer)) =
            tokio::time::timeout(REQUEST_TIMEOUT, send(&traffic.client, request)).await
            && with_memory(answer.status, answer.memory.as_deref().unwrap_or("-"))
        {
            given += 1;
        }
    }
    given
}

fn percent(part: u64, all: u64) -> f64 {
    if all == 0 {
        0.0
    } else {
        100.0 * part as f64 / all as f64
    }
}

/// memproxy's high-water mark, from its metrics (0 if they do not say).
async fn high_water_bytes(client: &HttpClient, port: u16) -> u64 {
    scrape(client, port)
        .await
        .lines()
        .find_map(|l| l.strip_prefix("memproxy_memory_high_water_bytes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The text of a conversation's `turn`-th user message.
fn user_text(conversation: usize, turn: u32) -> String {
    let mut rng = Rng::new(((conversation as u64) << 32) ^ u64::from(turn) ^ 0x5eed);
    format!("{} [c{conversation} t{turn}]", sentence(&mut rng))
}

/// The request a conversation sends at `turn` (that many exchanges done): the newest message,
/// or for a full-history client every message so far.
fn request(
    url: &Uri,
    conversation: usize,
    turn: u32,
    stream: bool,
) -> Result<Request<Full<Bytes>>, String> {
    let mut messages = Vec::new();
    if conversation.is_multiple_of(3) {
        for earlier in 0..turn {
            let text = user_text(conversation, earlier);
            let reply = format!("reply to: {text}");
            messages.push(json!({"role": "user", "content": text}));
            messages.push(json!({"role": "assistant", "content": reply}));
        }
    }
    messages.push(json!({"role": "user", "content": user_text(conversation, turn)}));
    let mut body = json!({"model": "gpt-4o-mini", "messages": messages});
    if stream {
        body["stream"] = Value::Bool(true);
    }
    Request::post(url.clone())
        .header("content-type", "application/json")
        .header(
            "authorization",
            format!("Bearer sk-soak-{}", conversation % TENANTS),
        )
        .header("x-memory-conversation-id", format!("soak-{conversation}"))
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| format!("building a request: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recall_line_warns_when_memproxy_recalls_by_words_alone() {
        let hybrid = json!({"recall": "hybrid", "embedder": "static-table"});
        assert_eq!(
            recall_line(&hybrid),
            "hybrid (by words and meaning, static-table)"
        );
        let lexical = json!({"recall": "lexical", "embedder_reason": "no model files"});
        let line = recall_line(&lexical);
        assert!(line.starts_with("WARNING: lexical"), "{line}");
        assert!(line.ends_with("no model files"), "{line}");
        assert_eq!(recall_line(&json!({"recall": "lexical"})), "lexical");
        assert!(recall_line(&Value::Null).starts_with("unknown"));
    }
}
