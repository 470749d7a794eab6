//! Runs the mock OpenAI-compatible upstream of the tests (`tests/support/mock_upstream.rs`) as a
//! standalone server, for end-to-end tests with real SDKs (see `tests/e2e/`) and for trying
//! memproxy by hand.
//!
//! ```text
//! cargo run --example mock_upstream -- --listen 127.0.0.1:9000
//! listening on http://127.0.0.1:9000/v1
//! ```
//!
//! It prints exactly one line, `listening on http://ADDR/v1`, then serves until SIGINT or
//! SIGTERM. Chat completions, Responses (`/v1/responses`) and Anthropic Messages
//! (`/v1/messages`; an Anthropic SDK takes the base URL without `/v1`) are answered with
//! `reply to: <last user message text>` (JSON, or SSE when the request asks for a stream);
//! `GET /v1/models` lists `mock-model`. `GET /_mock/requests` lists what it received and
//! `POST /_mock/script` queues a reply (`{"text": ..}` or `{"tool_calls": [[id, name, args]]}`).
//!
//! It is strict: a model call the provider would refuse under its documented rules (tool calls
//! left unanswered, more than 4 Anthropic cache breakpoints, a changed thinking signature …) is
//! answered with the provider's 400 and listed by `GET /_mock/refusals`. `--lenient` (or
//! `POST /_mock/strict` with `{"strict": false}`) answers anything.

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

#[path = "../tests/support/mock_upstream.rs"]
mod mock_upstream;
use mock_upstream::{MockOptions, MockUpstream};

/// A mock OpenAI-compatible upstream for memproxy's end-to-end tests.
#[derive(Debug, Parser)]
#[command(name = "mock_upstream")]
struct Args {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Content chunks per streamed answer.
    #[arg(long, default_value_t = 4)]
    stream_chunks: usize,
    /// Pause between streamed chunks, in milliseconds.
    #[arg(long, default_value_t = 0)]
    chunk_delay_ms: u64,
    /// Do not keep the requests received (for load tests: memory stays flat).
    #[arg(long)]
    no_record: bool,
    /// Answer every request, even one the provider would refuse.
    #[arg(long)]
    lenient: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let options = MockOptions {
        stream_chunks: args.stream_chunks,
        chunk_delay: Duration::from_millis(args.chunk_delay_ms),
        record: !args.no_record,
        strict: !args.lenient,
    };
    let mock = match MockUpstream::start_with(options, Some(args.listen)).await {
        Ok(mock) => mock,
        Err(err) => {
            eprintln!("mock_upstream: cannot listen on {}: {err}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    if writeln!(stdout, "listening on {}", mock.base_url())
        .and_then(|()| stdout.flush())
        .is_err()
    {
        // Nobody reads our stdout any more; keep serving anyway.
        eprintln!("mock_upstream: listening on {}", mock.base_url());
    }
    drop(stdout);
    memproxy::server::shutdown_signal().await;
    // The e2e tests read the refusals over HTTP (`GET /_mock/refusals`); exiting is not the
    // place to fail on them.
    let _ = mock.take_refusals();
    drop(mock);
    ExitCode::SUCCESS
}
