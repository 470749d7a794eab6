//! Load benchmark: memproxy against the mock upstream, side by side with the mock alone.
//!
//! ```text
//! cargo run --release --example loadbench                 # 5 s per run, 1 s warm-up
//! cargo run --release --example loadbench -- --quick      # 1 s per run (CI smoke)
//! cargo run --release --example loadbench -- --seconds 10 --rate 1000 --json bench.json
//! cargo run --release --example loadbench -- --scenarios direct,passthrough,mem-1k --modes c1,c64
//! target/release/examples/loadbench --soak --duration 180   # the memory soak (`soak.rs`)
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
//! - `mem-1k-words`, `mem-10k-words`: `mem-1k`, `mem-10k` recalling by words alone
//!   (`X-Memory-Relevance-Semantic: false`); the memory rows recall by words and meaning;
//! - `mem-10k-norecall`, `mem-10k-nocompress`: `mem-10k` with `X-Memory-Relevance-Enabled:
//!   false` or `X-Memory-Compression-Enabled: false` (diagnostics: how much of the 10k cost is
//!   recall, and the summary);
//! - `stream-direct`, `stream-passthrough`, `stream-mem-1k`: `"stream": true`; the latency
//!   columns are the time to the first body chunk; full-stream latency is printed separately;
//! - `mem-spread-persist`: each closed-loop task stores in a conversation of its own (64
//!   clients over 64 conversations at c64);
//! - `redis-mem-1k`, `redis-mem-1k-persist`, `redis-mem-spread-persist`: the same against a
//!   second memproxy with memory in Redis (a redis-server the benchmark starts; append-only,
//!   fsync always), beside sled's rows in the same run, and Redis's `used_memory` per 1,000
//!   stored messages;
//! - `responses-direct`, `responses-mem-1k`, `responses-mem-1k-persist`, `messages-direct`,
//!   `messages-mem-1k`, `messages-mem-1k-persist`: the same for the Responses API and the
//!   Anthropic Messages API (the mock speaks both), each against its own direct baseline.
//!
//! Modes (`--modes`, default `c1,c64,open`): closed loop with N concurrent tasks (`cN`), and an
//! open loop at `--rate` requests/s (`open`) whose latency counts from each request's scheduled
//! send time (no coordinated omission). "+p50"/"+p99" are the scenario minus its baseline
//! (`direct` or `stream-direct`) in the same mode.
//!
//! # Layout
//!
//! - [`args`]: the flags, and the modes and scenarios they select;
//! - [`children`]: the two child processes (the mock upstream and memproxy) and their guard;
//! - [`machine`]: what is read of the machine and its processes (`/proc`, git);
//! - [`text`]: the synthetic message text (the word list is `words.txt`), drawn with [`rng`],
//!   the seeded generator the benches and examples share;
//! - [`client`]: one benchmark request, sent and read whole;
//! - [`tally`]: what a run's answers add up to (latency histograms, errors);
//! - [`load`]: the closed and open load loops, and CPU use over a run;
//! - [`scenarios`]: the scenario table and the pre-filling of conversations;
//! - [`bench`]: one whole benchmark, from starting the processes to the summary;
//! - [`soak`]: the memory soak (`--soak`): the memproxy binary under mixed traffic for a
//!   while, its RSS sampled every second against its memory budget;
//! - [`report`]: the result tables and the JSON.
// Allowed: a benchmark run by hand prints its result tables, and a step that fails ends it
// (expect) rather than let it report figures from half a run.
#![allow(clippy::print_stdout, clippy::expect_used)]

mod args;
mod bench;
mod children;
mod client;
mod load;
mod machine;
#[path = "../../tests/support/mock_upstream.rs"]
mod mock_upstream;
#[path = "../../tests/support/redis_server.rs"]
mod redis_server;
mod report;
#[path = "../../tests/support/rng.rs"]
mod rng;
mod scenarios;
mod soak;
mod tally;
mod text;

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use crate::args::Args;
use crate::bench::bench;
use crate::children::{serve_mock, serve_proxy};
use crate::soak::soak;

fn main() -> ExitCode {
    let args = Args::parse();
    if args.serve_mock {
        return serve_mock();
    }
    if let Some(config) = &args.serve_proxy {
        // The allocator set up as memproxy's own `main` does.
        memproxy::allocator::configure();
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
    if args.soak {
        let result = runtime.block_on(soak(&args));
        runtime.shutdown_timeout(Duration::from_secs(2));
        return match result {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(err) => {
                eprintln!("loadbench soak: {err}");
                ExitCode::from(2)
            }
        };
    }
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
