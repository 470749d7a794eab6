//! The server: accept connections (HTTP/1.1 and h2c), serve each with the router, and shut
//! down gracefully.
//!
//! Every connection is a task in one `JoinSet` the server owns: none outlives it. At most
//! `server.max_connections` are served at once; a connection past that is answered 503 and
//! closed on a short task of its own (`admission.rs`), so the accept loop never waits. Each
//! served connection is watched for the client time limits (`connection.rs`: the head, idle
//! keep-alive; request bodies are bounded in `body.rs`).
//!
//! Shutdown order, when the `shutdown` future completes:
//! 1. stop accepting (the listener is dropped);
//! 2. stop the TTL sweeper (a pass in progress finishes);
//! 3. drain: every connection is told to shut down gracefully, finishes its in-flight requests
//!    and streams (a stream commits before its end reaches the client) and closes, up to the
//!    grace period; a connection still open then is cut, and its stream is not stored
//!    (nothing half-stored: a commit is one atomic write, made before any await that could be
//!    cut);
//! 4. let background summary jobs finish, up to the grace period, or cancel them;
//! 5. flush and close the store, last, once no task can write to it.
//!
//! The drain is a `watch` channel each connection task listens to, not hyper-util's
//! `GracefulShutdown`: a connection's task also shuts it down gracefully when it goes idle,
//! which needs the connection itself, not a watcher wrapped around it.

mod admission;
mod connection;

use std::future::Future;
use std::sync::Arc;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use self::admission::{Admission, Admit};
use crate::config::Config;
use crate::state::AppState;
use crate::store::StoreError;

/// The tokio runtime: `server.worker_threads` threads, or one per CPU.
pub fn runtime(worker_threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = worker_threads {
        builder.worker_threads(threads);
    }
    builder.enable_all().build()
}

/// The HTTP/1.1 + h2c connection builder. hyper's own HTTP/1.1 head timeout stays off: it
/// would also close idle kept-alive connections after the head timeout; `connection.rs`
/// applies both limits apart. h2c connections are pinged every `idle_timeout`.
fn http_builder(config: &Config) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().header_read_timeout(None);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(config.idle_timeout)
        .keep_alive_timeout(connection::H2_PING_TIMEOUT);
    builder
}

/// Serves until `shutdown` completes, then drains and flushes.
pub async fn run(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StoreError> {
    let builder = http_builder(&state.config);
    let mut admission = Admission::new(state.config.max_connections);
    let (stop, stopping) = watch::channel(false);
    let mut connections: JoinSet<()> = JoinSet::new();
    let sweeper = state.start_sweeper();
    // The tokenizer loads now, not on the first request; `/readyz` says ready once it has.
    // Building it frees what it was built from (tiktoken-rs's encoding, about 40 MiB): give
    // those pages back at once.
    let warming = tokio::task::spawn_blocking(|| {
        crate::tokens::warm();
        crate::allocator::release();
    });
    tokio::pin!(shutdown);

    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors and the like: back off briefly, keep serving.
                        tracing::warn!(error = %err, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                // Connections that ended are let go of before another starts: while new ones
                // keep arriving, `select!` picks this branch or the reaping one at random, and
                // that one alone would leave ended connections' tasks held (as the summary
                // worker once did, `memproxy_core::worker`).
                while connections.try_join_next().is_some() {}
                match admission.admit() {
                    Admit::Serve(slot) => {
                        let state = Arc::clone(&state);
                        connections.spawn(connection::serve(&builder, stream, state, stopping.clone(), slot));
                    }
                    Admit::Refuse(refusal) => {
                        connections.spawn(refusal.answer(stream));
                    }
                    Admit::Close => drop(stream),
                }
            }
            // Finished connections are reaped as they end.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut shutdown => break,
        }
    }

    // 1. Stop accepting.
    drop(listener);
    // 2. Stop deleting idle conversations (and let the tokenizer's load end).
    if let Some(sweeper) = sweeper {
        sweeper.stop().await;
    }
    let _ = warming.await;
    // 3. Drain within the grace period: connections finish what they are serving and close.
    let grace = state.config.shutdown_grace;
    tracing::info!(
        grace_s = grace.as_secs(),
        connections = connections.len(),
        "shutting down: draining connections"
    );
    let _ = stop.send(true);
    let drain = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(grace, drain).await.is_ok() {
        tracing::info!("all connections closed");
    } else {
        tracing::warn!(
            remaining = connections.len(),
            "grace period over; cutting the remaining connections (their open streams are not stored)"
        );
        connections.abort_all();
        while connections.join_next().await.is_some() {}
    }
    // 4. and 5. Let summary jobs in flight finish (or cancel them), then flush the store last.
    if let Some(memory) = state.memory() {
        memory.shutdown(grace).await?;
        tracing::info!("store flushed; bye");
    }
    Ok(())
}

/// Completes on SIGTERM or SIGINT: the shutdown future `main` passes to [`run`].
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
