//! `[server]` (the listener, body limits, client timeouts and the connection cap, shutdown,
//! threads, the memory budget) and `[log]`.

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::values::{RawSize, at_least_one, duration, nonzero_duration, size};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const DEFAULT_BODY_LIMIT_BYTES: usize = 32 * 1024 * 1024;
/// The largest upstream JSON (non-streaming) chat response memproxy reads to capture a reply.
pub const DEFAULT_RESPONSE_LIMIT_BYTES: usize = 64 * 1024 * 1024;
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Time a client has to send a whole request head, from the connection's start or from the
/// first byte of the next request on a kept-alive connection.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a client has to send a body memproxy reads whole, and the longest pause between two
/// pieces of a body it streams through.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a connection with no request in flight stays open.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Connections served at once; past it a new connection is answered 503 and closed.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// What the whole process may take in memory (RSS): the caches take their shares of it and
/// admission control keeps requests in flight under it (`config/memory_budget.rs`).
pub const DEFAULT_MEMORY_BUDGET: u64 = 192 * 1024 * 1024;
/// How long a chat request that would fit under the memory budget's high-water mark with the
/// RSS alone waits for the requests in flight to give back what they reserved before it goes
/// with memory off (`server.memory_wait`; `PT0S`: never waits). Under 64 clients a request's
/// reservation lasts tens of milliseconds; refused at once instead, 64 clients at 128 MiB with
/// Redis went without memory for 0.02–4.3% of their requests over 30 minutes (the plannings of
/// 64 grown conversations at once reserved 11–15 MiB with the caches at their floors); waiting
/// up to a second, none (22,824 waited, every one admitted; README, "64 clients").
pub const DEFAULT_MEMORY_WAIT: Duration = Duration::from_secs(1);
/// The longest `server.memory_wait` accepted.
pub const MAX_MEMORY_WAIT: Duration = Duration::from_secs(60);
/// The largest `max_connections` accepted: far past what one sidecar's file descriptors allow.
const MAX_MAX_CONNECTIONS: usize = 1_000_000;
/// Threads for blocking work (the store's reads and writes, the embedder) with an embedded
/// store, unless `server.blocking_threads` says otherwise; with Redis, the pool's connections
/// and [`BLOCKING_THREADS_PAST_POOL`] more. tokio's own limit is 512: under a steady load the
/// pool grew to about 50 threads, each caching freed memory of its own (about 11 MiB in all
/// under the soak at 128 MiB), though the store's writes run one at a time.
pub const DEFAULT_BLOCKING_THREADS: usize = 16;
/// With Redis, the blocking threads past the connection pool's size: each store call holds a
/// connection, so more than the pool's threads would only wait for one.
pub const BLOCKING_THREADS_PAST_POOL: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    listen: Option<String>,
    body_limit_bytes: Option<u64>,
    response_limit_bytes: Option<u64>,
    shutdown_grace: Option<String>,
    worker_threads: Option<u64>,
    blocking_threads: Option<u64>,
    runtime: Option<String>,
    header_read_timeout: Option<String>,
    body_read_timeout: Option<String>,
    idle_timeout: Option<String>,
    max_connections: Option<u64>,
    memory_budget: Option<RawSize>,
    memory_wait: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLog {
    format: Option<String>,
}

/// `[server]`, checked.
pub(super) struct Server {
    pub listen: SocketAddr,
    pub body_limit_bytes: usize,
    pub response_limit_bytes: usize,
    pub shutdown_grace: Duration,
    pub worker_threads: Option<usize>,
    /// `server.blocking_threads`; `None`: chosen with the store (`Config::blocking_threads`).
    pub blocking_threads: Option<usize>,
    pub runtime: RuntimeShape,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    /// `memory_budget` in bytes, checked against the caches in `memory_budget.rs`.
    pub memory_budget: u64,
    /// `memory_wait` ([`DEFAULT_MEMORY_WAIT`]).
    pub memory_wait: Duration,
}

/// How the threads serving requests are arranged (`server.runtime`). The default is
/// [`RuntimeShape::PerThread`] on Linux, where `SO_REUSEPORT` spreads new connections over the
/// threads' listeners, and [`RuntimeShape::Shared`] elsewhere (macOS and the BSDs give every
/// connection to one of the sockets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuntimeShape {
    /// One tokio runtime whose `worker_threads` workers share every connection (work-stealing).
    Shared,
    /// `worker_threads` single-thread runtimes, each accepting on the port itself
    /// (`SO_REUSEPORT`) and keeping its own upstream connections, so a request is served on
    /// the thread that accepted it; background work runs on a runtime of its own.
    PerThread,
}

impl Default for RuntimeShape {
    fn default() -> RuntimeShape {
        if cfg!(target_os = "linux") {
            RuntimeShape::PerThread
        } else {
            RuntimeShape::Shared
        }
    }
}

/// Checks `[server]`; `listen` (from a flag or the environment) wins over the file.
pub(super) fn check_server(
    raw: RawServer,
    listen: Option<String>,
    problems: &mut Vec<String>,
) -> Server {
    let listen_text = listen
        .or(raw.listen)
        .unwrap_or_else(|| DEFAULT_LISTEN.to_string());
    let listen = listen_text.parse::<SocketAddr>().unwrap_or_else(|_| {
        problems.push(format!(
            "server.listen: `{listen_text}` is not an address such as 127.0.0.1:8080"
        ));
        SocketAddr::from(([127, 0, 0, 1], 8080))
    });

    let body_limit_bytes = raw
        .body_limit_bytes
        .map_or(DEFAULT_BODY_LIMIT_BYTES, |n| n as usize);
    if body_limit_bytes == 0 {
        problems.push("server.body_limit_bytes: must be at least 1".to_string());
    }
    let response_limit_bytes = raw
        .response_limit_bytes
        .map_or(DEFAULT_RESPONSE_LIMIT_BYTES, |n| n as usize);
    let shutdown_grace = duration(
        "server.shutdown_grace",
        raw.shutdown_grace,
        DEFAULT_SHUTDOWN_GRACE,
        problems,
    );
    let mut memory_wait = duration(
        "server.memory_wait",
        raw.memory_wait,
        DEFAULT_MEMORY_WAIT,
        problems,
    );
    if memory_wait > MAX_MEMORY_WAIT {
        problems.push(format!(
            "server.memory_wait: {} s is too long (at most {} s; PT0S: a request short of room goes with memory off at once)",
            memory_wait.as_secs_f64(),
            MAX_MEMORY_WAIT.as_secs()
        ));
        memory_wait = DEFAULT_MEMORY_WAIT;
    }
    let worker_threads = thread_count(
        "server.worker_threads",
        raw.worker_threads,
        "one per CPU",
        problems,
    );
    let blocking_threads = thread_count(
        "server.blocking_threads",
        raw.blocking_threads,
        "chosen with the store",
        problems,
    );
    let runtime = match raw.runtime.as_deref() {
        None => RuntimeShape::default(),
        Some("shared") => RuntimeShape::Shared,
        Some("per-thread") => RuntimeShape::PerThread,
        Some(other) => {
            problems.push(format!(
                "server.runtime: {other:?} is not a runtime shape (\"shared\" or \"per-thread\")"
            ));
            RuntimeShape::Shared
        }
    };
    let mut max_connections = at_least_one(
        "server.max_connections",
        raw.max_connections,
        DEFAULT_MAX_CONNECTIONS,
        problems,
    );
    if max_connections > MAX_MAX_CONNECTIONS {
        problems.push(format!(
            "server.max_connections: {max_connections} is too many (at most {MAX_MAX_CONNECTIONS})"
        ));
        max_connections = DEFAULT_MAX_CONNECTIONS;
    }
    Server {
        listen,
        body_limit_bytes,
        response_limit_bytes,
        shutdown_grace,
        worker_threads,
        blocking_threads,
        runtime,
        header_read_timeout: nonzero_duration(
            "server.header_read_timeout",
            raw.header_read_timeout,
            DEFAULT_HEADER_READ_TIMEOUT,
            problems,
        ),
        body_read_timeout: nonzero_duration(
            "server.body_read_timeout",
            raw.body_read_timeout,
            DEFAULT_BODY_READ_TIMEOUT,
            problems,
        ),
        idle_timeout: nonzero_duration(
            "server.idle_timeout",
            raw.idle_timeout,
            DEFAULT_IDLE_TIMEOUT,
            problems,
        ),
        max_connections,
        memory_budget: size("server.memory_budget", raw.memory_budget, problems)
            .unwrap_or(DEFAULT_MEMORY_BUDGET),
        memory_wait,
    }
}

/// A count of threads from 1 to 1024; `None` when unset or 0 (which means `zero`), or when
/// too many (a problem).
fn thread_count(
    key: &str,
    raw: Option<u64>,
    zero: &str,
    problems: &mut Vec<String>,
) -> Option<usize> {
    match raw {
        None | Some(0) => None,
        Some(n @ 1..=1024) => Some(n as usize),
        Some(n) => {
            problems.push(format!("{key}: {n} is too many (0 = {zero}, at most 1024)"));
            None
        }
    }
}

/// Checks `[log]`; `format` (from a flag or the environment) wins over the file.
pub(super) fn check_log(
    raw: RawLog,
    format: Option<String>,
    problems: &mut Vec<String>,
) -> LogFormat {
    let format_text = format.or(raw.format).unwrap_or_else(|| "text".to_string());
    match format_text.as_str() {
        "text" => LogFormat::Text,
        "json" => LogFormat::Json,
        other => {
            problems.push(format!(
                "log.format: `{other}` must be \"text\" or \"json\""
            ));
            LogFormat::Text
        }
    }
}
