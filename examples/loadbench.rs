//! Load benchmark: memproxy against the mock upstream, side by side with the mock alone.
//!
//! ```text
//! cargo run --release --example loadbench                 # 5 s per run, 1 s warm-up
//! cargo run --release --example loadbench -- --quick      # 1 s per run (CI smoke)
//! cargo run --release --example loadbench -- --seconds 10 --rate 1000 --json bench.json
//! cargo run --release --example loadbench -- --scenarios direct,passthrough,mem-1k --modes c1,c64
//! ```
//!
//! One run starts two child processes from this same binary (hidden modes): the mock upstream
//! (`--serve-mock`) and memproxy pointed at it (`--serve-proxy CONFIG`), each printing its port
//! on stdout and serving until its stdin closes. The load generator is this process, on the same
//! machine, over loopback only. Because the proxy is its own process, its CPU time and RSS
//! (`/proc/PID/stat`, `/proc/PID/status`) are measured apart from the load generator's.
//!
//! Scenarios (`--scenarios`, comma-separated; default all):
//!
//! - `direct`: small chat completion straight to the mock (the baseline);
//! - `passthrough`: the same through memproxy without a conversation id (memory off);
//! - `mem-10`, `mem-1k`, `mem-10k`: memory on, a conversation pre-filled with 10 / 1,000 /
//!   10,000 messages (stored by one request carrying the whole history); measured requests send
//!   one new user message with `X-Memory-Persist: false`, so the conversation stays that size;
//! - `mem-10-persist`, `mem-1k-persist`, `mem-10k-persist`: the same but stored (each request
//!   appends 2 messages); each mode gets its own freshly pre-filled conversation;
//! - `mem-10k-norecall`, `mem-10k-nocompress`: `mem-10k` with `X-Memory-Relevance-Enabled:
//!   false` or `X-Memory-Compression-Enabled: false` (diagnostics: how much of the 10k cost is
//!   recall, and the summary);
//! - `stream-direct`, `stream-passthrough`, `stream-mem-1k`: `"stream": true`; the latency
//!   columns are the time to the first body chunk; full-stream latency is printed separately.
//!
//! Modes (`--modes`, default `c1,c64,open`): closed loop with N concurrent tasks (`cN`), and an
//! open loop at `--rate` requests/s (`open`) whose latency counts from each request's scheduled
//! send time (no coordinated omission). "+p50"/"+p99" are the scenario minus its baseline
//! (`direct` or `stream-direct`) in the same mode.
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use hdrhistogram::Histogram;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;
use tokio::sync::Semaphore;

#[path = "../tests/support/mock_upstream.rs"]
mod mock_upstream;
use mock_upstream::{MockOptions, MockUpstream};

/// Every request gives up after this long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// A pre-fill request (up to 10,000 messages at once) gives up after this long.
const PREFILL_TIMEOUT: Duration = Duration::from_secs(300);
/// A closed-loop task never sends more than this many requests in one run.
const MAX_REQUESTS_PER_TASK: u64 = 5_000_000;
/// An open-loop run never schedules more than this many requests.
const MAX_OPEN_REQUESTS: u64 = 5_000_000;
/// Open-loop requests in flight at once; later ones wait (their wait counts as latency).
const MAX_IN_FLIGHT: usize = 512;
/// Largest latency the histograms hold, in microseconds (10 minutes).
const HIST_MAX_US: u64 = 600_000_000;
/// Conversations per RSS-growth batch.
const RSS_BATCH: usize = 1000;
/// RSS-growth batches.
const RSS_BATCHES: usize = 3;

#[derive(Debug, Parser)]
#[command(
    name = "loadbench",
    about = "Load benchmark: memproxy vs the mock upstream alone"
)]
struct Args {
    /// Measured seconds per run (per scenario and mode).
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Warm-up seconds per run, not measured.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Smoke test: 1 s measured, 0.2 s warm-up per run.
    #[arg(long)]
    quick: bool,
    /// Scenarios to run, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    scenarios: Option<Vec<String>>,
    /// Modes, comma-separated: `cN` (closed loop, N tasks) and `open` (fixed rate).
    #[arg(long, value_delimiter = ',', default_value = "c1,c64,open")]
    modes: Vec<String>,
    /// Open-loop rate, requests per second.
    #[arg(long, default_value_t = 500)]
    rate: u64,
    /// memproxy's `server.worker_threads` (0: one per CPU, as by default).
    #[arg(long, default_value_t = 0)]
    proxy_threads: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Internal: serve memproxy with this config file, print `port N`, serve until stdin closes.
    #[arg(long, hide = true)]
    serve_proxy: Option<PathBuf>,
    /// Internal: serve the mock upstream, print `port N`, serve until stdin closes.
    #[arg(long, hide = true)]
    serve_mock: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.serve_mock {
        return serve_mock();
    }
    if let Some(config) = &args.serve_proxy {
        return serve_proxy(config);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("loadbench: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(bench(args));
    runtime.shutdown_timeout(Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("loadbench: {err}");
            ExitCode::FAILURE
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------------------------

fn child_runtime() -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => Some(runtime),
        Err(err) => {
            eprintln!("loadbench child: cannot start the runtime: {err}");
            None
        }
    }
}

fn announce_port(port: u16) -> bool {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port {port}")
        .and_then(|()| stdout.flush())
        .is_ok()
}

/// Completes when stdin closes (the parent ended or asked us to stop) or on SIGINT/SIGTERM.
async fn parent_gone() {
    let stdin_closed = async {
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        loop {
            match stdin.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = stdin_closed => {}
        () = terminate => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

fn serve_mock() -> ExitCode {
    let Some(runtime) = child_runtime() else {
        return ExitCode::FAILURE;
    };
    let code = runtime.block_on(async {
        let options = MockOptions {
            record: false,
            stream_chunks: 8,
            chunk_delay: Duration::ZERO,
        };
        let mock = match MockUpstream::start_with(options, None).await {
            Ok(mock) => mock,
            Err(err) => {
                eprintln!("loadbench mock: cannot listen: {err}");
                return ExitCode::FAILURE;
            }
        };
        if !announce_port(mock.addr.port()) {
            return ExitCode::FAILURE;
        }
        parent_gone().await;
        drop(mock);
        ExitCode::SUCCESS
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}

fn serve_proxy(config_path: &Path) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let text = match std::fs::read_to_string(config_path) {
        Ok(text) => text,
        Err(err) => {
            eprintln!(
                "loadbench proxy: cannot read {}: {err}",
                config_path.display()
            );
            return ExitCode::FAILURE;
        }
    };
    let config = match memproxy::config::from_toml(&text, &|_| None) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("loadbench proxy: {err}");
            return ExitCode::FAILURE;
        }
    };
    // The runtime the memproxy binary builds from the same config.
    let runtime = match memproxy::server::runtime(config.worker_threads) {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("loadbench proxy: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async {
        let state = match memproxy::state::AppState::build(config) {
            Ok(state) => state,
            Err(err) => {
                eprintln!("loadbench proxy: cannot start: {err}");
                return ExitCode::FAILURE;
            }
        };
        let listener = match tokio::net::TcpListener::bind("127.0.0.1:0").await {
            Ok(listener) => listener,
            Err(err) => {
                eprintln!("loadbench proxy: cannot listen: {err}");
                return ExitCode::FAILURE;
            }
        };
        let port = match listener.local_addr() {
            Ok(addr) => addr.port(),
            Err(err) => {
                eprintln!("loadbench proxy: no local address: {err}");
                return ExitCode::FAILURE;
            }
        };
        if !announce_port(port) {
            return ExitCode::FAILURE;
        }
        match memproxy::server::run(listener, state, parent_gone()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("loadbench proxy: shutdown failed to flush the store: {err}");
                ExitCode::FAILURE
            }
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    code
}

/// A child process of this benchmark; killed when dropped if still running.
struct ChildProc {
    name: &'static str,
    child: Child,
    stdin: Option<ChildStdin>,
    pid: u32,
    port: u16,
    log: PathBuf,
}

impl ChildProc {
    fn spawn(
        name: &'static str,
        args: &[&std::ffi::OsStr],
        log: &Path,
    ) -> Result<ChildProc, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let log_file =
            File::create(log).map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .spawn()
            .map_err(|e| format!("cannot start the {name} process: {e}"))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let pid = child.id();
        // From here on the guard kills the child on any error.
        let mut proc = ChildProc {
            name,
            child,
            stdin,
            pid,
            port: 0,
            log: log.to_path_buf(),
        };
        let stdout = stdout.ok_or_else(|| format!("{name}: no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let read = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(read.map(|_| line));
        });
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(line)) => line,
            Ok(Err(err)) => return Err(format!("{name}: reading its port: {err}")),
            Err(_) => return Err(format!("{name}: no port announced within 60 s")),
        };
        proc.port = line
            .trim()
            .strip_prefix("port ")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| {
                let log = std::fs::read_to_string(&proc.log).unwrap_or_default();
                format!("{name}: expected `port N`, got {line:?}; its stderr: {log}")
            })?;
        Ok(proc)
    }

    fn check_alive(&mut self) -> Result<(), String> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: String = log
                    .lines()
                    .rev()
                    .take(20)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                Err(format!(
                    "the {} process exited ({status}); last stderr lines:\n{tail}",
                    self.name
                ))
            }
            Err(err) => Err(format!("{}: {err}", self.name)),
        }
    }

    /// Closes its stdin (it shuts down gracefully), waits up to `grace`, then kills it.
    fn stop(&mut self, grace: Duration) -> String {
        self.stdin = None;
        let deadline = Instant::now() + grace;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return format!("exited: {status}"),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Ok(None) => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return format!(
                        "killed: no exit within {} s of stdin closing",
                        grace.as_secs()
                    );
                }
                Err(err) => return format!("unknown: {err}"),
            }
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /proc readings
// ---------------------------------------------------------------------------------------------

/// A `kB` field of `/proc/PID/status` (`VmRSS`, `VmHWM`), in kB.
fn status_kb(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// user + system CPU time of a process, in clock ticks.
fn cpu_ticks(pid: u32) -> Option<u64> {
    sys_and_user_ticks(pid).map(|(sys, user)| sys + user)
}

/// (system, user) CPU time of a process, in clock ticks.
fn sys_and_user_ticks(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After the command come fields 3.. of stat(5): utime is field 14, stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((stime, utime))
}

fn clock_ticks_per_second() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(100)
}

fn machine_line() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")?
                .split_once(':')
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string());
    let processors = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kb = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
        })
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "nproc {nproc} ({processors} in /proc/cpuinfo), model name: {model}, MemTotal {:.1} GiB, Linux {}",
        mem_kb as f64 / 1024.0 / 1024.0,
        kernel.trim()
    )
}

/// The git commit and uncommitted files of the crate, and whether `src/` changed after this
/// binary was built (other work in progress would then not be what was measured).
fn source_state() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).to_string())
    };
    let head = git(&["rev-parse", "--short", "HEAD"])
        .map_or_else(|| "unknown".to_string(), |h| h.trim().to_string());
    let dirty: Vec<String> = git(&[
        "status",
        "--porcelain",
        "--",
        "src",
        "Cargo.toml",
        "Cargo.lock",
    ])
    .unwrap_or_default()
    .lines()
    .filter(|l| !l.trim().is_empty())
    .map(|l| l.get(3..).unwrap_or(l).trim().to_string())
    .collect();
    fn newest(path: &Path) -> Option<std::time::SystemTime> {
        let meta = std::fs::metadata(path).ok()?;
        if !meta.is_dir() {
            return meta.modified().ok();
        }
        std::fs::read_dir(path)
            .ok()?
            .flatten()
            .filter_map(|e| newest(&e.path()))
            .max()
    }
    let built = std::env::current_exe()
        .ok()
        .and_then(|exe| std::fs::metadata(exe).ok()?.modified().ok());
    let freshness = match (newest(&root.join("src")), built) {
        (Some(src), Some(built)) => match src.duration_since(built) {
            Ok(newer) if newer > Duration::ZERO => format!(
                "WARNING: src/ was modified {:.0} s after this binary was built; the results measure the older build",
                newer.as_secs_f64()
            ),
            _ => "binary is newer than every file in src/".to_string(),
        },
        _ => "build freshness unknown".to_string(),
    };
    format!(
        "git HEAD {head}; uncommitted: {}; {freshness}",
        if dirty.is_empty() {
            "none".to_string()
        } else {
            dirty.join(", ")
        }
    )
}

/// `/proc/loadavg`: other work on the machine skews every number here.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}

fn dir_size(path: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_size(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn mib(kb: Option<u64>) -> String {
    kb.map_or_else(
        || "-".to_string(),
        |kb| format!("{:.1}", kb as f64 / 1024.0),
    )
}

// ---------------------------------------------------------------------------------------------
// Text
// ---------------------------------------------------------------------------------------------

const WORDS: &[&str] = &[
    "the",
    "project",
    "deadline",
    "moved",
    "because",
    "our",
    "team",
    "needs",
    "more",
    "time",
    "to",
    "review",
    "budget",
    "numbers",
    "with",
    "finance",
    "before",
    "customer",
    "meeting",
    "next",
    "week",
    "please",
    "summarize",
    "latest",
    "changes",
    "in",
    "deployment",
    "pipeline",
    "and",
    "explain",
    "why",
    "tests",
    "failed",
    "on",
    "staging",
    "server",
    "yesterday",
    "evening",
    "after",
    "database",
    "migration",
    "finished",
    "we",
    "should",
    "rewrite",
    "query",
    "that",
    "loads",
    "every",
    "order",
    "for",
    "dashboard",
    "it",
    "takes",
    "several",
    "seconds",
    "when",
    "cache",
    "is",
    "cold",
    "could",
    "you",
    "draft",
    "short",
    "email",
    "support",
    "about",
    "refund",
    "policy",
    "new",
    "pricing",
    "plan",
    "starts",
    "first",
    "day",
    "of",
    "month",
    "remember",
    "my",
    "daughter",
    "likes",
    "chess",
    "piano",
    "lessons",
    "tuesday",
    "afternoon",
    "garden",
    "tomatoes",
    "need",
    "water",
    "weather",
    "forecast",
    "says",
    "rain",
    "weekend",
    "travel",
    "flight",
    "hotel",
    "booking",
    "confirmation",
    "number",
    "arrives",
    "morning",
    "conference",
    "talk",
    "slides",
    "about",
    "distributed",
    "systems",
    "latency",
    "throughput",
    "memory",
    "usage",
    "grows",
    "slowly",
    "under",
    "load",
    "profile",
    "shows",
    "allocation",
    "hot",
    "path",
    "parser",
    "json",
    "request",
    "response",
    "header",
    "timeout",
    "retry",
    "backoff",
    "error",
    "rate",
    "limit",
    "quota",
    "account",
    "invoice",
    "payment",
    "recipe",
    "dinner",
    "guests",
    "vegetarian",
    "lasagna",
    "spinach",
    "ricotta",
    "oven",
    "minutes",
    "bake",
    "until",
    "golden",
    "brown",
    "serve",
    "salad",
    "lemon",
    "dressing",
    "olive",
    "oil",
    "garlic",
    "fresh",
    "basil",
    "book",
    "chapter",
    "character",
    "plot",
    "ending",
    "surprising",
    "library",
    "borrow",
    "return",
    "friday",
    "doctor",
    "appointment",
    "moved",
    "thursday",
    "insurance",
    "form",
    "signed",
    "scanned",
    "uploaded",
    "portal",
    "yesterday",
    "kitchen",
    "renovation",
    "contractor",
    "estimate",
    "cabinets",
    "countertop",
    "granite",
    "tiles",
    "plumber",
    "leak",
    "faucet",
    "sink",
    "bathroom",
    "paint",
    "color",
    "neutral",
    "beige",
    "living",
    "room",
    "sofa",
    "delivery",
    "delayed",
    "warehouse",
    "shipment",
    "tracking",
    "courier",
    "package",
    "damaged",
    "replacement",
    "warranty",
    "claim",
    "receipt",
    "store",
    "manager",
    "phone",
    "call",
    "voicemail",
    "callback",
    "schedule",
    "calendar",
    "reminder",
    "birthday",
    "party",
    "cake",
    "candles",
    "balloons",
    "invitation",
    "friends",
    "family",
    "cousin",
    "wedding",
    "venue",
    "photographer",
    "catering",
    "menu",
    "budget",
    "guests",
    "seating",
    "chart",
    "music",
    "playlist",
    "dance",
    "speech",
    "toast",
    "anniversary",
    "marathon",
    "training",
    "plan",
    "running",
    "shoes",
    "knee",
    "injury",
    "physiotherapy",
    "stretching",
    "routine",
    "gym",
    "membership",
    "swimming",
    "cycling",
    "route",
    "mountain",
    "trail",
    "hiking",
    "backpack",
    "tent",
    "sleeping",
    "bag",
    "campfire",
    "lake",
    "sunrise",
    "photos",
    "camera",
    "lens",
    "tripod",
    "editing",
    "software",
    "subscription",
    "license",
    "renewal",
    "laptop",
    "battery",
    "charger",
    "keyboard",
    "monitor",
    "resolution",
    "printer",
    "cartridge",
    "office",
    "supplies",
    "notebook",
    "pencil",
    "stapler",
    "meeting",
    "agenda",
    "minutes",
    "action",
    "items",
    "owner",
    "quarterly",
    "report",
    "revenue",
    "growth",
    "margin",
    "forecast",
    "hiring",
    "plan",
    "interview",
    "candidate",
    "resume",
    "reference",
    "offer",
    "salary",
    "negotiation",
    "onboarding",
    "mentor",
    "feedback",
    "performance",
    "review",
    "promotion",
    "goals",
    "roadmap",
    "milestone",
    "launch",
    "feature",
    "flag",
    "rollout",
    "rollback",
    "incident",
    "postmortem",
    "alert",
    "pager",
    "oncall",
    "rotation",
    "escalation",
    "runbook",
    "kubernetes",
    "cluster",
    "node",
    "pod",
    "container",
    "image",
    "registry",
    "terraform",
    "module",
    "variable",
    "secret",
    "vault",
    "certificate",
    "expiry",
    "rotation",
    "domain",
    "dns",
    "record",
    "propagation",
    "firewall",
    "rule",
    "port",
    "ingress",
    "gateway",
    "proxy",
    "upstream",
    "downstream",
    "webhook",
    "payload",
    "signature",
    "verification",
    "token",
    "refresh",
    "session",
    "cookie",
    "browser",
    "extension",
    "mobile",
    "app",
    "release",
    "store",
    "review",
    "rating",
    "crash",
    "report",
    "stack",
    "trace",
    "symbol",
    "memory",
    "leak",
    "garbage",
    "collector",
    "thread",
    "pool",
    "mutex",
    "deadlock",
    "race",
    "condition",
    "benchmark",
    "regression",
    "flamegraph",
    "compiler",
    "optimization",
    "cache",
    "miss",
    "branch",
    "prediction",
    "vector",
    "instruction",
    "allocator",
    "arena",
    "fragmentation",
    "page",
    "table",
    "kernel",
    "scheduler",
    "grandmother",
    "soup",
    "carrots",
    "celery",
    "onion",
    "thyme",
    "bay",
    "leaf",
    "simmer",
    "hours",
    "bread",
    "sourdough",
    "starter",
    "flour",
    "yeast",
    "knead",
    "proof",
    "loaf",
    "crust",
    "crumb",
    "butter",
    "jam",
    "strawberries",
    "blueberries",
    "yogurt",
    "granola",
    "breakfast",
    "coffee",
    "espresso",
    "grinder",
    "beans",
    "roast",
    "tea",
    "kettle",
    "mug",
    "cup",
];

/// xorshift64*: a small seeded generator, enough for varied benchmark text.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// About 20 words (16 to 24) from [`WORDS`], as a sentence.
fn sentence(rng: &mut Rng) -> String {
    let count = 16 + rng.below(9);
    let mut text = String::with_capacity(count * 8);
    for i in 0..count {
        let word = WORDS[rng.below(WORDS.len())];
        if i == 0 {
            let mut chars = word.chars();
            if let Some(first) = chars.next() {
                text.extend(first.to_uppercase());
                text.push_str(chars.as_str());
            }
        } else {
            text.push(' ');
            text.push_str(word);
        }
    }
    text.push('.');
    text
}

fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Ctx {
    client: HttpClient,
    mock_url: Uri,
    proxy_url: Uri,
    texts: Vec<String>,
    counter: AtomicU64,
    proxy_pid: u32,
    mock_pid: u32,
    clk_tck: u64,
}

/// What one scenario's requests look like.
#[derive(Debug, Clone)]
struct Spec {
    uri: Uri,
    conversation: Option<String>,
    persist_false: bool,
    /// Extra headers (diagnostic scenarios turn a memory stage off).
    extra_headers: &'static [(&'static str, &'static str)],
    stream: bool,
    /// The `X-Memory-Status` every answer must carry (`None`: no such header).
    expect_memory: Option<&'static str>,
}

fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

fn chat_request(spec: &Spec, body: String) -> Result<Request<Full<Bytes>>, String> {
    let mut builder = Request::post(spec.uri.clone())
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-loadbench");
    if let Some(conversation) = &spec.conversation {
        builder = builder.header("x-memory-conversation-id", conversation.as_str());
    }
    if spec.persist_false {
        builder = builder.header("x-memory-persist", "false");
    }
    for (name, value) in spec.extra_headers {
        builder = builder.header(*name, *value);
    }
    builder
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("building a request: {e}"))
}

/// The body of the `n`-th measured request: one new user message, unique by `n`.
fn small_body(ctx: &Ctx, spec: &Spec, n: u64) -> String {
    let text = format!(
        "{} (request {n})",
        ctx.texts[(n % ctx.texts.len() as u64) as usize]
    );
    let mut body = json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]});
    if spec.stream {
        body["stream"] = Value::Bool(true);
    }
    body.to_string()
}

/// One answer, read whole.
struct Outcome {
    status: u16,
    memory: Option<String>,
    turns: Option<u64>,
    retrieved: Option<u64>,
    prompt_tokens: Option<u64>,
    summary: Option<String>,
    first_byte: Instant,
    done: Instant,
    body: Vec<u8>,
}

impl Outcome {
    fn snippet(&self) -> String {
        let end = self.body.len().min(200);
        String::from_utf8_lossy(&self.body[..end]).replace('\n', "\\n")
    }

    fn body_ok(&self, stream: bool) -> bool {
        if stream {
            self.body.ends_with(b"data: [DONE]\n\n")
        } else {
            self.body.windows(17).any(|w| w == b"\"chat.completion\"")
        }
    }
}

async fn send(client: &HttpClient, request: Request<Full<Bytes>>) -> Result<Outcome, String> {
    let response = client.request(request).await.map_err(|e| error_chain(&e))?;
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let memory = header("x-memory-status");
    let turns = header("x-memory-turns").and_then(|t| t.parse().ok());
    let retrieved = header("x-memory-retrieved").and_then(|t| t.parse().ok());
    let prompt_tokens = header("x-memory-prompt-tokens").and_then(|t| t.parse().ok());
    let summary = header("x-memory-summary");
    let mut body = response.into_body();
    let mut first_byte = None;
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("reading the body: {}", error_chain(&e)))?;
        if let Some(data) = frame.data_ref()
            && !data.is_empty()
        {
            first_byte.get_or_insert_with(Instant::now);
            bytes.extend_from_slice(data);
        }
    }
    let done = Instant::now();
    Ok(Outcome {
        status,
        memory,
        turns,
        retrieved,
        prompt_tokens,
        summary,
        first_byte: first_byte.unwrap_or(done),
        done,
        body: bytes,
    })
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).expect("valid histogram bounds")
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).max(1)
}

/// The measured part of a run.
#[derive(Debug, Clone, Copy)]
struct Window {
    measure_start: Instant,
    end: Instant,
}

/// What a run's requests added up to.
struct Tally {
    /// Time to first body byte for streams, to the whole answer otherwise.
    latency: Histogram<u64>,
    /// Time to the whole answer.
    total: Histogram<u64>,
    completed: u64,
    errors: u64,
    samples: Vec<String>,
    /// Last `X-Memory-Turns`, `X-Memory-Retrieved`, `X-Memory-Prompt-Tokens` seen.
    turns: Option<u64>,
    retrieved: Option<u64>,
    prompt_tokens: Option<u64>,
    /// Last `X-Memory-Summary` seen.
    summary: Option<String>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            latency: histogram(),
            total: histogram(),
            completed: 0,
            errors: 0,
            samples: Vec::new(),
            turns: None,
            retrieved: None,
            prompt_tokens: None,
            summary: None,
        }
    }

    fn error(&mut self, message: String) {
        self.errors += 1;
        if self.samples.len() < 4 && !self.samples.contains(&message) {
            self.samples.push(message);
        }
    }

    fn merge(&mut self, other: Tally) {
        let _ = self.latency.add(&other.latency);
        let _ = self.total.add(&other.total);
        self.completed += other.completed;
        self.errors += other.errors;
        for sample in other.samples {
            if self.samples.len() < 4 && !self.samples.contains(&sample) {
                self.samples.push(sample);
            }
        }
        self.turns = self.turns.max(other.turns);
        self.retrieved = self.retrieved.max(other.retrieved);
        self.prompt_tokens = self.prompt_tokens.max(other.prompt_tokens);
        if other.summary.is_some() {
            self.summary = other.summary;
        }
    }

    /// Checks and records one answer to a request whose latency counts from `origin`.
    fn observe(
        &mut self,
        spec: &Spec,
        origin: Instant,
        window: Window,
        result: Result<Result<Outcome, String>, tokio::time::error::Elapsed>,
    ) {
        let mut outcome = match result {
            Err(_) => {
                return self.error(format!("no answer within {} s", REQUEST_TIMEOUT.as_secs()));
            }
            Ok(Err(err)) => return self.error(err),
            Ok(Ok(outcome)) => outcome,
        };
        if outcome.turns.is_some() {
            self.turns = outcome.turns;
        }
        if outcome.retrieved.is_some() {
            self.retrieved = outcome.retrieved;
        }
        if outcome.prompt_tokens.is_some() {
            self.prompt_tokens = outcome.prompt_tokens;
        }
        if outcome.summary.is_some() {
            self.summary = outcome.summary.take();
        }
        if outcome.status != 200 {
            return self.error(format!("HTTP {}: {}", outcome.status, outcome.snippet()));
        }
        if outcome.memory.as_deref() != spec.expect_memory {
            return self.error(format!(
                "x-memory-status {:?}, expected {:?}",
                outcome.memory, spec.expect_memory
            ));
        }
        if !outcome.body_ok(spec.stream) {
            return self.error(format!("unexpected body: {}", outcome.snippet()));
        }
        if origin >= window.measure_start {
            let first = if spec.stream {
                outcome.first_byte
            } else {
                outcome.done
            };
            self.latency
                .saturating_record(micros(first.saturating_duration_since(origin)));
            self.total
                .saturating_record(micros(outcome.done.saturating_duration_since(origin)));
        }
        if outcome.done >= window.measure_start && outcome.done <= window.end {
            self.completed += 1;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Load loops
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Closed(usize),
    Open(u64),
}

impl Mode {
    fn label(self) -> String {
        match self {
            Mode::Closed(c) => format!("c{c}"),
            Mode::Open(rate) => format!("open@{rate}"),
        }
    }

    fn short(self) -> String {
        match self {
            Mode::Closed(c) => format!("c{c}"),
            Mode::Open(_) => "open".to_string(),
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct CpuUse {
    proxy: f64,
    /// The part of `proxy` spent in the kernel (system time): sockets, wake-ups.
    proxy_sys: f64,
    mock: f64,
    generator: f64,
    /// Every other process on the machine (from `/proc/stat`): other work skews the run.
    other: f64,
}

/// Busy CPU time of the whole machine, in clock ticks (`/proc/stat`, first line).
fn machine_busy_ticks() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let line = text.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    Some(
        v.first()? + v.get(1)? + v.get(2)? + v.get(5)? + v.get(6)? + v.get(7).copied().unwrap_or(0),
    )
}

/// CPU use (percent of one core) of the three processes over the measured window.
async fn cpu_over(ctx: &Ctx, window: Window) -> CpuUse {
    tokio::time::sleep_until(window.measure_start.into()).await;
    let me = std::process::id();
    let before = (
        cpu_ticks(ctx.proxy_pid),
        cpu_ticks(ctx.mock_pid),
        cpu_ticks(me),
        machine_busy_ticks(),
        sys_and_user_ticks(ctx.proxy_pid).map(|t| t.0),
    );
    let started = Instant::now();
    tokio::time::sleep_until(window.end.into()).await;
    let after = (
        cpu_ticks(ctx.proxy_pid),
        cpu_ticks(ctx.mock_pid),
        cpu_ticks(me),
        machine_busy_ticks(),
        sys_and_user_ticks(ctx.proxy_pid).map(|t| t.0),
    );
    let seconds = started.elapsed().as_secs_f64().max(1e-3);
    let pct = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => b.saturating_sub(a) as f64 / ctx.clk_tck as f64 / seconds * 100.0,
        _ => f64::NAN,
    };
    let (proxy, mock, generator) = (
        pct(before.0, after.0),
        pct(before.1, after.1),
        pct(before.2, after.2),
    );
    CpuUse {
        proxy,
        proxy_sys: pct(before.4, after.4),
        mock,
        generator,
        other: (pct(before.3, after.3) - proxy - mock - generator).max(0.0),
    }
}

async fn closed_task(ctx: Arc<Ctx>, spec: Arc<Spec>, window: Window) -> Tally {
    let mut tally = Tally::new();
    for _ in 0..MAX_REQUESTS_PER_TASK {
        let origin = Instant::now();
        if origin >= window.end {
            break;
        }
        let n = ctx.counter.fetch_add(1, Ordering::Relaxed);
        let request = match chat_request(&spec, small_body(&ctx, &spec, n)) {
            Ok(request) => request,
            Err(err) => {
                tally.error(err);
                break;
            }
        };
        let result = tokio::time::timeout(REQUEST_TIMEOUT, send(&ctx.client, request)).await;
        tally.observe(&spec, origin, window, result);
    }
    tally
}

struct RunOutput {
    tally: Tally,
    cpu: CpuUse,
    /// Open loop: how late the scheduler sent each request, in µs.
    lag: Option<Histogram<u64>>,
    measured: Duration,
}

async fn run_closed(
    ctx: &Arc<Ctx>,
    spec: &Arc<Spec>,
    concurrency: usize,
    warmup: Duration,
    measure: Duration,
) -> RunOutput {
    let start = Instant::now();
    let window = Window {
        measure_start: start + warmup,
        end: start + warmup + measure,
    };
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| tokio::spawn(closed_task(Arc::clone(ctx), Arc::clone(spec), window)))
        .collect();
    let cpu = cpu_over(ctx, window).await;
    let mut tally = Tally::new();
    for task in tasks {
        match task.await {
            Ok(t) => tally.merge(t),
            Err(err) => tally.error(format!("load task failed: {err}")),
        }
    }
    RunOutput {
        tally,
        cpu,
        lag: None,
        measured: measure,
    }
}

async fn open_request(
    ctx: Arc<Ctx>,
    spec: Arc<Spec>,
    origin: Instant,
    window: Window,
    limit: Arc<Semaphore>,
    tally: Arc<Mutex<Tally>>,
) {
    let Ok(_permit) = limit.acquire_owned().await else {
        return;
    };
    let n = ctx.counter.fetch_add(1, Ordering::Relaxed);
    let result = match chat_request(&spec, small_body(&ctx, &spec, n)) {
        Ok(request) => tokio::time::timeout(REQUEST_TIMEOUT, send(&ctx.client, request)).await,
        Err(err) => Ok(Err(err)),
    };
    let mut tally = tally
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    tally.observe(&spec, origin, window, result);
}

async fn run_open(
    ctx: &Arc<Ctx>,
    spec: &Arc<Spec>,
    rate: u64,
    warmup: Duration,
    measure: Duration,
) -> RunOutput {
    let start = Instant::now() + Duration::from_millis(20);
    let window = Window {
        measure_start: start + warmup,
        end: start + warmup + measure,
    };
    let total = ((rate as f64 * (warmup + measure).as_secs_f64()) as u64).min(MAX_OPEN_REQUESTS);
    let interval = 1.0 / rate.max(1) as f64;
    let tally = Arc::new(Mutex::new(Tally::new()));
    let limit = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let runtime = tokio::runtime::Handle::current();
    // The scheduler is an OS thread: std::thread::sleep is precise to tens of µs, tokio's
    // timer to a millisecond, and lateness here would count as latency.
    let scheduler = {
        let (ctx, spec, tally, limit) = (
            Arc::clone(ctx),
            Arc::clone(spec),
            Arc::clone(&tally),
            Arc::clone(&limit),
        );
        std::thread::spawn(move || {
            let mut lag = histogram();
            let mut handles = Vec::with_capacity(total as usize);
            for i in 0..total {
                let at = start + Duration::from_secs_f64(i as f64 * interval);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                lag.saturating_record(micros(Instant::now().saturating_duration_since(at)));
                handles.push(runtime.spawn(open_request(
                    Arc::clone(&ctx),
                    Arc::clone(&spec),
                    at,
                    window,
                    Arc::clone(&limit),
                    Arc::clone(&tally),
                )));
            }
            (handles, lag)
        })
    };
    let cpu = cpu_over(ctx, window).await;
    let joined = tokio::task::spawn_blocking(move || scheduler.join()).await;
    let (handles, lag) = match joined {
        Ok(Ok(out)) => out,
        _ => {
            let mut t = Tally::new();
            t.error("the open-loop scheduler failed".to_string());
            return RunOutput {
                tally: t,
                cpu,
                lag: None,
                measured: measure,
            };
        }
    };
    let deadline =
        tokio::time::Instant::from_std(window.end) + REQUEST_TIMEOUT + Duration::from_secs(5);
    let mut unfinished = 0u64;
    for mut handle in handles {
        if tokio::time::timeout_at(deadline, &mut handle)
            .await
            .is_err()
        {
            handle.abort();
            unfinished += 1;
        }
    }
    let mut tally = std::mem::replace(
        &mut *tally
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
        Tally::new(),
    );
    for _ in 0..unfinished {
        tally.error("not finished by the drain deadline".to_string());
    }
    RunOutput {
        tally,
        cpu,
        lag: Some(lag),
        measured: measure,
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Mock,
    Proxy,
}

#[derive(Debug, Clone, Copy)]
struct Scenario {
    name: &'static str,
    target: Target,
    /// Messages stored in the conversation before the run (0: no conversation id).
    prefill: usize,
    persist: bool,
    stream: bool,
    /// Extra headers: the diagnostic scenarios turn one memory stage off.
    headers: &'static [(&'static str, &'static str)],
    baseline: &'static str,
}

const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "direct",
        target: Target::Mock,
        prefill: 0,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "passthrough",
        target: Target::Proxy,
        prefill: 0,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "mem-10",
        target: Target::Proxy,
        prefill: 10,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "mem-10-persist",
        target: Target::Proxy,
        prefill: 10,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "mem-1k",
        target: Target::Proxy,
        prefill: 1000,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "mem-1k-persist",
        target: Target::Proxy,
        prefill: 1000,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "mem-10k",
        target: Target::Proxy,
        prefill: 10_000,
        persist: false,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "mem-10k-persist",
        target: Target::Proxy,
        prefill: 10_000,
        persist: true,
        stream: false,
        headers: &[],
        baseline: "direct",
    },
    Scenario {
        name: "mem-10k-norecall",
        target: Target::Proxy,
        prefill: 10_000,
        persist: false,
        stream: false,
        headers: &[("x-memory-relevance-enabled", "false")],
        baseline: "direct",
    },
    Scenario {
        name: "mem-10k-nocompress",
        target: Target::Proxy,
        prefill: 10_000,
        persist: false,
        stream: false,
        headers: &[("x-memory-compression-enabled", "false")],
        baseline: "direct",
    },
    Scenario {
        name: "stream-direct",
        target: Target::Mock,
        prefill: 0,
        persist: false,
        stream: true,
        headers: &[],
        baseline: "stream-direct",
    },
    Scenario {
        name: "stream-passthrough",
        target: Target::Proxy,
        prefill: 0,
        persist: false,
        stream: true,
        headers: &[],
        baseline: "stream-direct",
    },
    Scenario {
        name: "stream-mem-1k",
        target: Target::Proxy,
        prefill: 1000,
        persist: false,
        stream: true,
        headers: &[],
        baseline: "stream-direct",
    },
];

struct Prefill {
    conversation: String,
    messages: usize,
    body_bytes: usize,
    took: Duration,
    turns: Option<u64>,
    proxy_rss_after_kb: Option<u64>,
}

/// Stores `messages` messages in `conversation` with one request: `messages - 1` alternating
/// user/assistant messages ending with a user message, plus the reply memproxy stores.
async fn prefill(ctx: &Ctx, conversation: &str, messages: usize) -> Result<Prefill, String> {
    let mut rng = Rng::new(fnv(conversation));
    let list: Vec<Value> = (0..messages.saturating_sub(1))
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": format!("{} [{conversation} #{i}]", sentence(&mut rng))})
        })
        .collect();
    let body = json!({"model": "gpt-4o-mini", "messages": list}).to_string();
    let body_bytes = body.len();
    let spec = Spec {
        uri: ctx.proxy_url.clone(),
        conversation: Some(conversation.to_string()),
        persist_false: false,
        extra_headers: &[],
        stream: false,
        expect_memory: Some("stored"),
    };
    let request = chat_request(&spec, body)?;
    let started = Instant::now();
    let outcome = tokio::time::timeout(PREFILL_TIMEOUT, send(&ctx.client, request))
        .await
        .map_err(|_| {
            format!(
                "pre-filling {conversation}: no answer within {} s",
                PREFILL_TIMEOUT.as_secs()
            )
        })?
        .map_err(|e| format!("pre-filling {conversation}: {e}"))?;
    let took = started.elapsed();
    if outcome.status != 200 || outcome.memory.as_deref() != Some("stored") {
        return Err(format!(
            "pre-filling {conversation}: HTTP {}, x-memory-status {:?}: {}",
            outcome.status,
            outcome.memory,
            outcome.snippet()
        ));
    }
    Ok(Prefill {
        conversation: conversation.to_string(),
        messages,
        body_bytes,
        took,
        turns: outcome.turns,
        proxy_rss_after_kb: status_kb(ctx.proxy_pid, "VmRSS"),
    })
}

struct RunResult {
    scenario: &'static str,
    baseline: &'static str,
    stream: bool,
    mode: Mode,
    conversation: Option<String>,
    throughput: f64,
    output: RunOutput,
    proxy_rss_kb: Option<u64>,
    proxy_hwm_kb: Option<u64>,
    mock_rss_kb: Option<u64>,
}

fn quantile(h: &Histogram<u64>, q: f64) -> Option<u64> {
    (!h.is_empty()).then(|| h.value_at_quantile(q))
}

fn fmt_us(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_string(), |v| v.to_string())
}

fn fmt_delta(a: Option<u64>, b: Option<u64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => format!("{:+}", a as i64 - b as i64),
        _ => "-".to_string(),
    }
}

fn fmt_pct(v: f64) -> String {
    if v.is_nan() {
        "-".to_string()
    } else {
        format!("{v:.0}")
    }
}

// ---------------------------------------------------------------------------------------------
// The benchmark
// ---------------------------------------------------------------------------------------------

fn parse_modes(args: &Args) -> Result<Vec<Mode>, String> {
    args.modes
        .iter()
        .map(|m| {
            let m = m.trim();
            if m == "open" {
                return Ok(Mode::Open(args.rate.max(1)));
            }
            m.strip_prefix('c')
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| (1..=4096).contains(&n))
                .map(Mode::Closed)
                .ok_or_else(|| format!("unknown mode `{m}`: use cN (1..=4096) or open"))
        })
        .collect()
}

fn select_scenarios(args: &Args) -> Result<Vec<Scenario>, String> {
    let Some(names) = &args.scenarios else {
        return Ok(SCENARIOS.to_vec());
    };
    let wanted: BTreeSet<&str> = names
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect();
    for name in &wanted {
        if !SCENARIOS.iter().any(|s| s.name == *name) {
            let all: Vec<&str> = SCENARIOS.iter().map(|s| s.name).collect();
            return Err(format!(
                "unknown scenario `{name}`; known: {}",
                all.join(", ")
            ));
        }
    }
    Ok(SCENARIOS
        .iter()
        .filter(|s| wanted.contains(s.name))
        .copied()
        .collect())
}

async fn bench(args: Args) -> Result<(), String> {
    let wall = Instant::now();
    let (measure_s, warmup_s) = if args.quick {
        (1.0, 0.2)
    } else {
        (args.seconds, args.warmup)
    };
    if !(measure_s > 0.0 && measure_s <= 3600.0 && (0.0..=600.0).contains(&warmup_s)) {
        return Err("--seconds must be in (0, 3600] and --warmup in [0, 600]".to_string());
    }
    let measure = Duration::from_secs_f64(measure_s);
    let warmup = Duration::from_secs_f64(warmup_s);
    let modes = parse_modes(&args)?;
    let scenarios = select_scenarios(&args)?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let machine = machine_line();

    println!("memproxy load benchmark");
    println!("machine: {machine}");
    println!("command: {command}");
    println!("source: {}", source_state());
    println!("load average at start: {}", load_average());
    println!(
        "runs: {} s measured + {} s warm-up each; modes {}; open-loop rate {} req/s (max {} in flight); loopback only",
        measure_s,
        warmup_s,
        modes
            .iter()
            .map(|m| m.label())
            .collect::<Vec<_>>()
            .join(","),
        args.rate,
        MAX_IN_FLIGHT
    );

    let dir = tempfile::tempdir().map_err(|e| format!("tempdir: {e}"))?;
    let mut mock = ChildProc::spawn(
        "mock",
        &["--serve-mock".as_ref()],
        &dir.path().join("mock.log"),
    )?;
    let data_dir = dir.path().join("data");
    let config_text = format!(
        "[server]\nbody_limit_bytes = 268435456\nshutdown_grace = \"PT5S\"\nworker_threads = {}\n\n[upstream]\nbase_url = \"http://127.0.0.1:{}/v1\"\nconnect_timeout = \"PT2S\"\ntimeout = \"PT120S\"\n\n[storage]\ndata_dir = {}\n\n[memory]\nmax_messages = 20000\n",
        args.proxy_threads,
        mock.port,
        toml::Value::String(data_dir.display().to_string())
    );
    let config_path = dir.path().join("memproxy.toml");
    std::fs::write(&config_path, &config_text).map_err(|e| format!("writing the config: {e}"))?;
    let mut proxy = ChildProc::spawn(
        "memproxy",
        &["--serve-proxy".as_ref(), config_path.as_os_str()],
        &dir.path().join("memproxy.log"),
    )?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let proxy_idle_kb = status_kb(proxy.pid, "VmRSS");
    let mock_idle_kb = status_kb(mock.pid, "VmRSS");
    println!(
        "processes: mock pid {} port {} (idle RSS {} MiB); memproxy pid {} port {} (idle RSS {} MiB, right after start)",
        mock.pid,
        mock.port,
        mib(mock_idle_kb),
        proxy.pid,
        proxy.port,
        mib(proxy_idle_kb)
    );
    println!(
        "memproxy config: {}",
        config_text.trim().replace('\n', "; ")
    );

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(MAX_IN_FLIGHT * 2)
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector);
    let mut rng = Rng::new(42);
    let texts: Vec<String> = (0..1024).map(|_| sentence(&mut rng)).collect();
    let ctx = Arc::new(Ctx {
        client,
        mock_url: format!("http://127.0.0.1:{}/v1/chat/completions", mock.port)
            .parse()
            .map_err(|e| format!("mock url: {e}"))?,
        proxy_url: format!("http://127.0.0.1:{}/v1/chat/completions", proxy.port)
            .parse()
            .map_err(|e| format!("proxy url: {e}"))?,
        texts,
        counter: AtomicU64::new(0),
        proxy_pid: proxy.pid,
        mock_pid: mock.pid,
        clk_tck: clock_ticks_per_second(),
    });

    // RSS growth per 1,000 newly cached conversations (each stores one exchange), measured
    // first, on a young heap: later, memory freed by the big scenarios is reused and hides it.
    // One warm-up conversation first: the first request loads the tokenizers.
    let warm_errors = new_conversations(&ctx, "warm", 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let proxy_warm_kb = status_kb(proxy.pid, "VmRSS");
    println!(
        "memproxy RSS after its first request (tokenizers loaded): {} MiB{}",
        mib(proxy_warm_kb),
        if warm_errors > 0 {
            " (that request FAILED)"
        } else {
            ""
        }
    );
    let mut growth: Vec<(u64, u64, u64, Duration)> = Vec::new();
    for batch in 0..RSS_BATCHES {
        let before = status_kb(proxy.pid, "VmRSS").unwrap_or(0);
        let started = Instant::now();
        let errors = new_conversations(&ctx, &batch.to_string(), RSS_BATCH).await;
        let took = started.elapsed();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let after = status_kb(proxy.pid, "VmRSS").unwrap_or(0);
        println!(
            "  +{RSS_BATCH} new conversations ({:.1} s, {errors} errors): RSS {} -> {} MiB",
            took.as_secs_f64(),
            mib(Some(before)),
            mib(Some(after))
        );
        growth.push((before, after, errors, took));
        proxy.check_alive()?;
    }

    let mut prefills: Vec<Prefill> = Vec::new();
    let mut prefilled: BTreeSet<String> = BTreeSet::new();
    let mut results: Vec<RunResult> = Vec::new();
    for scenario in &scenarios {
        for &mode in &modes {
            let conversation = match (scenario.prefill, scenario.persist) {
                (0, _) => None,
                (n, false) => Some(format!("bench-{n}")),
                (n, true) => Some(format!("bench-{n}-persist-{}", mode.short())),
            };
            if let Some(conversation) = &conversation
                && !prefilled.contains(conversation)
            {
                let done = prefill(&ctx, conversation, scenario.prefill).await?;
                println!(
                    "  pre-filled {} with {} messages in one request ({:.1} MiB body) in {:.0} ms; X-Memory-Turns {}; proxy RSS now {} MiB",
                    done.conversation,
                    done.messages,
                    done.body_bytes as f64 / 1048576.0,
                    done.took.as_secs_f64() * 1000.0,
                    done.turns.map_or("-".to_string(), |t| t.to_string()),
                    mib(done.proxy_rss_after_kb)
                );
                prefilled.insert(conversation.clone());
                prefills.push(done);
            }
            let spec = Arc::new(Spec {
                uri: match scenario.target {
                    Target::Mock => ctx.mock_url.clone(),
                    Target::Proxy => ctx.proxy_url.clone(),
                },
                conversation: conversation.clone(),
                persist_false: conversation.is_some() && !scenario.persist,
                extra_headers: scenario.headers,
                stream: scenario.stream,
                expect_memory: match (&conversation, scenario.persist) {
                    (None, _) => None,
                    (Some(_), true) => Some("stored"),
                    (Some(_), false) => Some("not-stored"),
                },
            });
            let output = match mode {
                Mode::Closed(c) => run_closed(&ctx, &spec, c, warmup, measure).await,
                Mode::Open(rate) => run_open(&ctx, &spec, rate, warmup, measure).await,
            };
            let throughput = output.tally.completed as f64 / output.measured.as_secs_f64();
            let result = RunResult {
                scenario: scenario.name,
                baseline: scenario.baseline,
                stream: scenario.stream,
                mode,
                conversation,
                throughput,
                proxy_rss_kb: status_kb(proxy.pid, "VmRSS"),
                proxy_hwm_kb: status_kb(proxy.pid, "VmHWM"),
                mock_rss_kb: status_kb(mock.pid, "VmRSS"),
                output,
            };
            let t = &result.output.tally;
            println!(
                "  {:<19} {:<9} {:>9.0} req/s  p50 {:>7} µs  p99 {:>8} µs  errors {}{}{}",
                result.scenario,
                mode.label(),
                throughput,
                fmt_us(quantile(&t.latency, 0.5)),
                fmt_us(quantile(&t.latency, 0.99)),
                t.errors,
                match (t.retrieved, t.prompt_tokens) {
                    (None, None) => String::new(),
                    (r, p) => format!(
                        "; X-Memory-Retrieved {}, X-Memory-Prompt-Tokens {}, X-Memory-Summary {}",
                        fmt_us(r),
                        fmt_us(p),
                        t.summary.as_deref().unwrap_or("-")
                    ),
                },
                if t.samples.is_empty() {
                    String::new()
                } else {
                    format!(" (e.g. {})", t.samples[0])
                }
            );
            results.push(result);
            proxy.check_alive()?;
            mock.check_alive()?;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    let final_rss = status_kb(proxy.pid, "VmRSS");
    let final_hwm = status_kb(proxy.pid, "VmHWM");
    let store_bytes = dir_size(&data_dir);

    drop(ctx);
    let proxy_exit = proxy.stop(Duration::from_secs(15));
    let mock_exit = mock.stop(Duration::from_secs(5));
    let proxy_log = std::fs::read_to_string(&proxy.log).unwrap_or_default();
    let mock_log = std::fs::read_to_string(&mock.log).unwrap_or_default();

    print_report(&results, measure_s);
    println!();
    println!("memproxy memory:");
    println!(
        "  idle RSS right after start: {} MiB; after its first request: {} MiB",
        mib(proxy_idle_kb),
        mib(proxy_warm_kb)
    );
    for p in &prefills {
        println!(
            "  after pre-filling {:<26} ({:>6} messages, {:>5.0} ms): RSS {} MiB",
            p.conversation,
            p.messages,
            p.took.as_secs_f64() * 1000.0,
            mib(p.proxy_rss_after_kb)
        );
    }
    for (i, (before, after, errors, took)) in growth.iter().enumerate() {
        println!(
            "  +{RSS_BATCH} new conversations (batch {}, before the scenarios, {:.1} s, {errors} errors): RSS {} -> {} MiB, growth {:+.2} MiB per 1,000 conversations ({:+.0} bytes each)",
            i + 1,
            took.as_secs_f64(),
            mib(Some(*before)),
            mib(Some(*after)),
            (*after as f64 - *before as f64) / 1024.0 * 1000.0 / RSS_BATCH as f64,
            (*after as f64 - *before as f64) * 1024.0 / RSS_BATCH as f64
        );
    }
    println!(
        "  at the end: RSS {} MiB, peak (VmHWM) {} MiB; store on disk {:.1} MiB",
        mib(final_rss),
        mib(final_hwm),
        store_bytes as f64 / 1048576.0
    );
    println!("  mock idle RSS {} MiB", mib(mock_idle_kb));
    println!();
    println!("shutdown: memproxy {proxy_exit}; mock {mock_exit}");
    report_log("memproxy", &proxy_log);
    report_log("mock", &mock_log);
    let total_errors: u64 = results.iter().map(|r| r.output.tally.errors).sum();
    println!("errors across all runs: {total_errors}");
    for r in results.iter().filter(|r| r.output.tally.errors > 0) {
        println!(
            "  {} {}: {} errors: {}",
            r.scenario,
            r.mode.label(),
            r.output.tally.errors,
            r.output.tally.samples.join(" | ")
        );
    }
    let wall_s = wall.elapsed().as_secs_f64();
    println!("load average at the end: {}", load_average());
    println!("wall time: {wall_s:.1} s");

    if let Some(path) = &args.json {
        let value = json!({
            "machine": machine,
            "command": command,
            "measure_seconds": measure_s,
            "warmup_seconds": warmup_s,
            "rate": args.rate,
            "wall_seconds": wall_s,
            "memproxy_config": config_text,
            "proxy_idle_rss_kb": proxy_idle_kb,
            "proxy_rss_after_first_request_kb": proxy_warm_kb,
            "mock_idle_rss_kb": mock_idle_kb,
            "proxy_final_rss_kb": final_rss,
            "proxy_peak_rss_kb": final_hwm,
            "store_bytes": store_bytes,
            "prefills": prefills.iter().map(|p| json!({
                "conversation": p.conversation, "messages": p.messages, "body_bytes": p.body_bytes,
                "ms": p.took.as_secs_f64() * 1000.0, "turns": p.turns, "proxy_rss_kb": p.proxy_rss_after_kb,
            })).collect::<Vec<_>>(),
            "rss_growth": growth.iter().map(|(b, a, e, t)| json!({
                "conversations": RSS_BATCH, "rss_before_kb": b, "rss_after_kb": a, "errors": e, "seconds": t.as_secs_f64(),
            })).collect::<Vec<_>>(),
            "results": results.iter().map(|r| result_json(r, &results)).collect::<Vec<_>>(),
            "shutdown": {"memproxy": proxy_exit, "mock": mock_exit},
            "errors": total_errors,
        });
        let text = serde_json::to_string_pretty(&value).map_err(|e| format!("json: {e}"))?;
        std::fs::write(path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("results written to {}", path.display());
    }
    Ok(())
}

/// Sends one request each to `count` new conversations (8 at a time); returns the error count.
async fn new_conversations(ctx: &Arc<Ctx>, batch: &str, count: usize) -> u64 {
    let next = Arc::new(AtomicUsize::new(0));
    let window = Window {
        measure_start: Instant::now(),
        end: Instant::now() + Duration::from_secs(3600),
    };
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (ctx, next, batch) = (Arc::clone(ctx), Arc::clone(&next), batch.to_string());
            tokio::spawn(async move {
                let mut tally = Tally::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    let spec = Spec {
                        uri: ctx.proxy_url.clone(),
                        conversation: Some(format!("rss-{batch}-{i}")),
                        persist_false: false,
                        extra_headers: &[],
                        stream: false,
                        expect_memory: Some("stored"),
                    };
                    let n = ctx.counter.fetch_add(1, Ordering::Relaxed);
                    let result = match chat_request(&spec, small_body(&ctx, &spec, n)) {
                        Ok(request) => {
                            tokio::time::timeout(REQUEST_TIMEOUT, send(&ctx.client, request)).await
                        }
                        Err(err) => Ok(Err(err)),
                    };
                    tally.observe(&spec, Instant::now(), window, result);
                }
                tally.errors
            })
        })
        .collect();
    let mut errors = 0;
    for task in tasks {
        errors += task.await.unwrap_or(1);
    }
    errors
}

fn report_log(name: &str, log: &str) {
    let notable: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.contains("panicked"))
        .collect();
    println!(
        "{name} stderr: {} lines, {} warnings/errors",
        log.lines().count(),
        notable.len()
    );
    let mut seen = BTreeMap::new();
    for line in &notable {
        // Group by the message, without the timestamp.
        let key: String = line
            .split_whitespace()
            .skip(2)
            .collect::<Vec<_>>()
            .join(" ");
        *seen
            .entry(key.chars().take(160).collect::<String>())
            .or_insert(0u64) += 1;
    }
    for (line, count) in seen.iter().take(8) {
        println!("  {count} x {line}");
    }
}

fn baseline_of<'a>(r: &RunResult, all: &'a [RunResult]) -> Option<&'a RunResult> {
    all.iter()
        .find(|b| b.scenario == r.baseline && b.mode == r.mode)
}

fn result_json(r: &RunResult, all: &[RunResult]) -> Value {
    let t = &r.output.tally;
    let q = |h: &Histogram<u64>| {
        json!({
            "count": h.len(), "p50": quantile(h, 0.5), "p90": quantile(h, 0.9), "p99": quantile(h, 0.99),
            "p999": quantile(h, 0.999), "max": (!h.is_empty()).then(|| h.max()), "mean": (!h.is_empty()).then(|| h.mean()),
        })
    };
    let base = baseline_of(r, all);
    json!({
        "scenario": r.scenario,
        "mode": r.mode.label(),
        "conversation": r.conversation,
        "stream": r.stream,
        "throughput_rps": r.throughput,
        "completed": t.completed,
        "errors": t.errors,
        "error_samples": t.samples,
        "latency_us": q(&t.latency),
        "latency_kind": if r.stream { "time to first body byte" } else { "whole response" },
        "total_latency_us": q(&t.total),
        "baseline": r.baseline,
        "added_p50_us": base.and_then(|b| Some(quantile(&t.latency, 0.5)? as i64 - quantile(&b.output.tally.latency, 0.5)? as i64)),
        "added_p99_us": base.and_then(|b| Some(quantile(&t.latency, 0.99)? as i64 - quantile(&b.output.tally.latency, 0.99)? as i64)),
        "cpu_percent": {"memproxy": r.output.cpu.proxy, "memproxy_system": r.output.cpu.proxy_sys, "mock": r.output.cpu.mock, "generator": r.output.cpu.generator, "other_processes": r.output.cpu.other},
        "proxy_rss_kb": r.proxy_rss_kb,
        "proxy_peak_rss_kb": r.proxy_hwm_kb,
        "mock_rss_kb": r.mock_rss_kb,
        "conversation_messages_at_end": t.turns,
        "x_memory_retrieved": t.retrieved,
        "x_memory_prompt_tokens": t.prompt_tokens,
        "x_memory_summary": t.summary,
        "open_loop_send_lag_us": r.output.lag.as_ref().map(q),
    })
}

fn print_report(results: &[RunResult], measure_s: f64) {
    println!();
    println!(
        "Results ({measure_s} s measured per row; latency in µs; stream rows: time to first body byte; +p50/+p99: minus the baseline in the same mode; CPU in % of one core over the measured window, sys% = the part of proxy% spent in the kernel, other% = every other process on the machine; RSS of memproxy after the run)"
    );
    let header = format!(
        "{:<19} {:<9} {:>8} {:>7} {:>7} {:>7} {:>8} {:>7} {:>7} {:>5} {:>6} {:>5} {:>5} {:>5} {:>6} {:>7} {:>7} {:>6}",
        "scenario",
        "mode",
        "req/s",
        "p50",
        "p90",
        "p99",
        "p99.9",
        "+p50",
        "+p99",
        "errs",
        "proxy%",
        "sys%",
        "mock%",
        "gen%",
        "other%",
        "RSS MiB",
        "HWM MiB",
        "conv"
    );
    println!("{header}");
    println!("{}", "-".repeat(header.chars().count()));
    for r in results {
        let t = &r.output.tally;
        let base = baseline_of(r, results);
        let (b50, b99) = base.map_or((None, None), |b| {
            (
                quantile(&b.output.tally.latency, 0.5),
                quantile(&b.output.tally.latency, 0.99),
            )
        });
        let is_base = r.scenario == r.baseline;
        println!(
            "{:<19} {:<9} {:>8.0} {:>7} {:>7} {:>7} {:>8} {:>7} {:>7} {:>5} {:>6} {:>5} {:>5} {:>5} {:>6} {:>7} {:>7} {:>6}",
            r.scenario,
            r.mode.label(),
            r.throughput,
            fmt_us(quantile(&t.latency, 0.5)),
            fmt_us(quantile(&t.latency, 0.9)),
            fmt_us(quantile(&t.latency, 0.99)),
            fmt_us(quantile(&t.latency, 0.999)),
            if is_base {
                "base".to_string()
            } else {
                fmt_delta(quantile(&t.latency, 0.5), b50)
            },
            if is_base {
                "base".to_string()
            } else {
                fmt_delta(quantile(&t.latency, 0.99), b99)
            },
            t.errors,
            fmt_pct(r.output.cpu.proxy),
            fmt_pct(r.output.cpu.proxy_sys),
            fmt_pct(r.output.cpu.mock),
            fmt_pct(r.output.cpu.generator),
            fmt_pct(r.output.cpu.other),
            mib(r.proxy_rss_kb),
            mib(r.proxy_hwm_kb),
            t.turns.map_or("-".to_string(), |n| n.to_string()),
        );
    }
    println!();
    println!(
        "CPU per request (µs of CPU time per completed request, over the measured window; the closed-loop rows):"
    );
    println!(
        "{:<19} {:<9} {:>9} {:>11} {:>8} {:>8}",
        "scenario", "mode", "memproxy", "of it sys", "mock", "gen"
    );
    for r in results.iter().filter(|r| matches!(r.mode, Mode::Closed(_))) {
        let per = |pct: f64| {
            if r.throughput > 0.0 && pct.is_finite() {
                format!("{:.1}", pct / 100.0 * 1e6 / r.throughput)
            } else {
                "-".to_string()
            }
        };
        let cpu = &r.output.cpu;
        println!(
            "{:<19} {:<9} {:>9} {:>11} {:>8} {:>8}",
            r.scenario,
            r.mode.label(),
            per(cpu.proxy),
            per(cpu.proxy_sys),
            per(cpu.mock),
            per(cpu.generator)
        );
    }
    if results.iter().any(|r| r.stream) {
        println!();
        println!("Streams, whole response (µs):");
        println!(
            "{:<19} {:<9} {:>7} {:>7} {:>8} {:>7} {:>7}",
            "scenario", "mode", "p50", "p99", "p99.9", "+p50", "+p99"
        );
        for r in results.iter().filter(|r| r.stream) {
            let t = &r.output.tally.total;
            let base = baseline_of(r, results);
            let (b50, b99) = base.map_or((None, None), |b| {
                (
                    quantile(&b.output.tally.total, 0.5),
                    quantile(&b.output.tally.total, 0.99),
                )
            });
            println!(
                "{:<19} {:<9} {:>7} {:>7} {:>8} {:>7} {:>7}",
                r.scenario,
                r.mode.label(),
                fmt_us(quantile(t, 0.5)),
                fmt_us(quantile(t, 0.99)),
                fmt_us(quantile(t, 0.999)),
                fmt_delta(quantile(t, 0.5), b50),
                fmt_delta(quantile(t, 0.99), b99)
            );
        }
    }
    let lags: Vec<&RunResult> = results.iter().filter(|r| r.output.lag.is_some()).collect();
    if !lags.is_empty() {
        println!();
        println!(
            "Open-loop scheduler lateness (µs, included in open-loop latency; same for every scenario):"
        );
        for r in lags {
            if let Some(lag) = &r.output.lag {
                println!(
                    "  {:<19} {:<9} p50 {:>5} p99 {:>6} max {:>7}",
                    r.scenario,
                    r.mode.label(),
                    fmt_us(quantile(lag, 0.5)),
                    fmt_us(quantile(lag, 0.99)),
                    (!lag.is_empty())
                        .then(|| lag.max())
                        .map_or("-".to_string(), |m| m.to_string())
                );
            }
        }
    }
}
