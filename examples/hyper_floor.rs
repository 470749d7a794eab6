//! The floor under memproxy's pass-through: a reverse proxy made of nothing but the parts
//! memproxy's pass-through is built on (tokio, hyper's HTTP/1.1 server, hyper-util's pooled
//! client, the same allocator), with none of memproxy's own work (no routing, header rules,
//! watchdog, metrics or logging). `scripts/perf.sh --floor` measures it beside nginx and
//! memproxy in one run: what it leaves between itself and nginx is the stack's, what memproxy
//! leaves between itself and it is memproxy's.
//!
//! ```text
//! cargo build --release --example hyper_floor
//! target/release/examples/hyper_floor --listen 127.0.0.1:8081 --upstream 127.0.0.1:9000
//! ```
//!
//! `--runtime multi` (the default, as memproxy): one multi-thread runtime of `--threads`
//! workers. `--runtime per-thread`: `--threads` single-thread runtimes, each with its own
//! listener on the same port (`SO_REUSEPORT`, the kernel spreads the connections) and its own
//! connection pool, so a request never leaves the thread that accepted it (nginx's model).
//! Every address is the caller's; it serves until killed.

// A command-line tool: it prints its one line.
#![allow(clippy::print_stdout)]

use std::convert::Infallible;
use std::net::SocketAddr;

use clap::{Parser, ValueEnum};
use http::{Request, Response, Uri};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

// Linked for memproxy's global allocator (jemalloc with its options), so the floor allocates
// as memproxy does, and for its per-thread binding (`server::bind_per_thread`).

type Body = UnsyncBoxBody<bytes::Bytes, hyper::Error>;
type Upstream = Client<HttpConnector, Body>;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum RuntimeKind {
    Multi,
    PerThread,
}

#[derive(Debug, Parser)]
#[command(
    name = "hyper_floor",
    about = "A bare hyper reverse proxy: the floor under memproxy's pass-through"
)]
struct Args {
    #[arg(long)]
    listen: SocketAddr,
    /// The upstream's address (HTTP/1.1, plain).
    #[arg(long)]
    upstream: SocketAddr,
    #[arg(long, value_enum, default_value = "multi")]
    runtime: RuntimeKind,
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

fn client() -> Upstream {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new()).build(connector)
}

async fn serve(listener: TcpListener, upstream: SocketAddr, client: Upstream) {
    let origin = format!("http://{upstream}");
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let client = client.clone();
        let origin = origin.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let client = client.clone();
                let origin = origin.clone();
                async move {
                    let (mut parts, body) = request.into_parts();
                    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                    parts.uri = format!("{origin}{path}").parse::<Uri>().unwrap_or_default();
                    parts.headers.remove(http::header::HOST);
                    let request = Request::from_parts(parts, body.boxed_unsync());
                    let response = match client.request(request).await {
                        Ok(response) => response.map(BodyExt::boxed_unsync),
                        Err(_) => {
                            let mut bad = Response::new(
                                http_body_util::Empty::new()
                                    .map_err(|never| match never {})
                                    .boxed_unsync(),
                            );
                            *bad.status_mut() = http::StatusCode::BAD_GATEWAY;
                            bad
                        }
                    };
                    Ok::<_, Infallible>(response)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn main() -> std::io::Result<()> {
    let args = Args::parse();
    match args.runtime {
        RuntimeKind::Multi => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(args.threads)
                .enable_all()
                .build()?;
            runtime.block_on(async {
                let listener = TcpListener::bind(args.listen).await?;
                println!("listening on {}", listener.local_addr()?);
                serve(listener, args.upstream, client()).await;
                Ok(())
            })
        }
        RuntimeKind::PerThread => {
            // memproxy's own binding for its runtime per thread: one port, a listener each
            // (made within a runtime, and taken off it for the threads' own).
            let listeners = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()?
                .block_on(async { memproxy::server::bind_per_thread(args.listen, args.threads) })?;
            if let Some(first) = listeners.first() {
                println!("listening on {}", first.local_addr()?);
            }
            let threads: Vec<_> = listeners
                .into_iter()
                .map(|listener| {
                    let upstream = args.upstream;
                    std::thread::spawn(move || {
                        tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()?
                            .block_on(async move {
                                serve(TcpListener::from_std(listener)?, upstream, client()).await;
                                Ok::<_, std::io::Error>(())
                            })
                    })
                })
                .collect();
            for thread in threads {
                let _ = thread.join();
            }
            Ok(())
        }
    }
}
