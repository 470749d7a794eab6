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
//! With `server.runtime = "per-thread"` ([`run_per_thread`]) each serving thread runs its own
//! accept loop, connections and drain on a single-thread runtime; the steps are the same, each
//! thread taking 1. and 3. for its own connections.
//!
//! The drain is a `watch` channel each connection task listens to, not hyper-util's
//! `GracefulShutdown`: a connection's task also shuts it down gracefully when it goes idle,
//! which needs the connection itself, not a watcher wrapped around it.

mod admission;
mod connection;

use std::future::Future;
use std::sync::Arc;

use std::net::SocketAddr;

use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio::task::JoinSet;

use self::admission::{Admission, Admit};
use crate::config::{Config, RuntimeShape};
use crate::state::AppState;
use crate::store::StoreError;

/// The runtime `main` runs in: with the shared shape `server.worker_threads` threads, or one
/// per CPU; with a runtime per thread it holds the background work alone (the summary and
/// embedding workers, the memory guard, the sweeper, signals) on one worker, and the threads
/// serving requests are [`run_per_thread`]'s. Its blocking pool holds at most
/// `config.blocking_threads` threads.
pub fn runtime(config: &Config) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    match config.runtime {
        RuntimeShape::Shared => {
            if let Some(threads) = config.worker_threads {
                builder.worker_threads(threads);
            }
        }
        RuntimeShape::PerThread => {
            builder.worker_threads(1);
        }
    }
    builder
        .max_blocking_threads(config.blocking_threads)
        .enable_all()
        .build()
}

/// The HTTP/1.1 + h2c connection builder. hyper's own HTTP/1.1 head timeout stays off: it
/// would also close idle kept-alive connections after the head timeout; `connection.rs`
/// applies both limits apart. h2c connections are pinged every `idle_timeout`.
fn http_builder(config: &Config) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .header_read_timeout(None)
        .max_buf_size(crate::body::READ_BUFFER_MAX);
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
    let background = Background::start(&state);
    let admission = Admission::new(state.config.max_connections);
    let connections = accept(listener, &state, admission, shutdown).await;
    // 1. The listener is dropped. 2. Stop deleting idle conversations.
    background.stop().await;
    // 3. Drain.
    drain(connections, &state).await;
    // 4. and 5.
    finish(&state).await
}

/// The background work of a serving process besides the memory core's own workers: the TTL
/// sweeper, and the tokenizer's load.
struct Background {
    sweeper: Option<crate::ttl::Sweeper>,
    warming: tokio::task::JoinHandle<()>,
}

impl Background {
    fn start(state: &Arc<AppState>) -> Background {
        let sweeper = state.start_sweeper();
        // The tokenizer loads now, not on the first request; `/readyz` says ready once it
        // has. Building it frees what it was built from (tiktoken-rs's encoding, about 40
        // MiB): give those pages back at once.
        let warming = tokio::task::spawn_blocking(|| {
            crate::tokens::warm();
            crate::allocator::release();
        });
        Background { sweeper, warming }
    }

    /// Stops the sweeper (a pass in progress finishes) and lets the tokenizer's load end.
    async fn stop(self) {
        if let Some(sweeper) = self.sweeper {
            sweeper.stop().await;
        }
        let _ = self.warming.await;
    }
}

/// The connections being served, and the channel that tells them to shut down.
struct Connections {
    tasks: JoinSet<()>,
    stop: watch::Sender<bool>,
}

/// Accepts and serves connections until `shutdown` completes; the listener is dropped on return.
async fn accept(
    listener: TcpListener,
    state: &Arc<AppState>,
    mut admission: Admission,
    shutdown: impl Future<Output = ()>,
) -> Connections {
    let builder = http_builder(&state.config);
    let (stop, stopping) = watch::channel(false);
    let mut connections: JoinSet<()> = JoinSet::new();
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
                        let state = Arc::clone(state);
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
    Connections {
        tasks: connections,
        stop,
    }
}

/// Drains within the grace period: connections finish what they are serving and close; those
/// still open then are cut (their open streams are not stored).
async fn drain(connections: Connections, state: &AppState) {
    let Connections {
        tasks: mut connections,
        stop,
    } = connections;
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
}

/// 4. and 5.: lets summary jobs in flight finish (or cancels them), then flushes the store last.
async fn finish(state: &AppState) -> Result<(), StoreError> {
    if let Some(memory) = state.memory() {
        memory.shutdown(state.config.shutdown_grace).await?;
        tracing::info!("store flushed; bye");
    }
    Ok(())
}

/// Where memproxy listens, bound for its runtime shape (`server.runtime`): one listener for the
/// shared runtime, one per serving thread (all on one port) for a runtime per thread. `main`,
/// the tests and the benchmarks bind and serve through it, whatever the shape.
pub enum Listeners {
    Shared(TcpListener),
    PerThread(Vec<std::net::TcpListener>),
}

impl Listeners {
    /// Binds `addr` (port 0: a free port) as `config.runtime` needs.
    pub async fn bind(config: &Config, addr: SocketAddr) -> std::io::Result<Listeners> {
        Ok(match config.runtime {
            RuntimeShape::Shared => Listeners::Shared(TcpListener::bind(addr).await?),
            RuntimeShape::PerThread => Listeners::PerThread(bind_per_thread(
                addr,
                serving_threads(config.worker_threads),
            )?),
        })
    }

    /// The address bound (every per-thread listener has the same).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match self {
            Listeners::Shared(listener) => listener.local_addr(),
            Listeners::PerThread(listeners) => listeners
                .first()
                .ok_or_else(|| std::io::Error::other("no listener"))?
                .local_addr(),
        }
    }

    /// Serves until `shutdown` completes, then drains and flushes ([`run`], [`run_per_thread`]).
    pub async fn serve(
        self,
        state: Arc<AppState>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), StoreError> {
        match self {
            Listeners::Shared(listener) => run(listener, state, shutdown).await,
            Listeners::PerThread(listeners) => run_per_thread(listeners, state, shutdown).await,
        }
    }
}

/// How many threads serve requests with a runtime per thread: `server.worker_threads`, or one
/// per CPU the process may use.
fn serving_threads(worker_threads: Option<usize>) -> usize {
    worker_threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
    })
}

/// Listeners for [`run_per_thread`]: `threads` sockets on one address (`SO_REUSEPORT`; the
/// kernel spreads new connections over them), the port of the first taken by the others when
/// `addr` names port 0. Bound and listening on return, so a refused bind is an error here.
/// Called within a tokio runtime (`TcpSocket::listen` registers with its reactor; `into_std`
/// takes each listener off it again, for the serving thread's own runtime).
pub fn bind_per_thread(
    addr: SocketAddr,
    threads: usize,
) -> std::io::Result<Vec<std::net::TcpListener>> {
    let mut listeners: Vec<std::net::TcpListener> = Vec::with_capacity(threads);
    let mut at = addr;
    for _ in 0..threads.max(1) {
        let socket = if at.is_ipv4() {
            TcpSocket::new_v4()?
        } else {
            TcpSocket::new_v6()?
        };
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(true)?;
        socket.bind(at)?;
        let listener = socket.listen(1024)?;
        at = listener.local_addr()?;
        listeners.push(listener.into_std()?);
    }
    Ok(listeners)
}

/// Serves with a runtime per thread (`server.runtime = "per-thread"`): each listener on a thread
/// of its own with a single-thread runtime, which accepts, serves and drains its connections
/// and keeps its own upstream connections (`upstream::own_pools_on_this_thread`), so nothing of
/// a request crosses threads but its plan and commit (the blocking pool, as with the shared
/// runtime). The connection cap (`server.max_connections`) is one for all threads. The
/// background work stays on the runtime this is called from. Shutdown as [`run`]'s: each thread
/// stops accepting, the sweeper stops, every thread drains within the grace period, then the
/// store is flushed, last.
async fn run_per_thread(
    listeners: Vec<std::net::TcpListener>,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StoreError> {
    let background = Background::start(&state);
    let admission = Admission::new(state.config.max_connections);
    let (stop_accepting, accepting) = watch::channel(false);
    let (may_drain, draining) = watch::channel(false);
    let mut threads = Vec::with_capacity(listeners.len());
    // The serving threads' runtimes share `blocking_threads` between them.
    let blocking_threads = state
        .config
        .blocking_threads
        .div_ceil(listeners.len().max(1))
        .max(2);
    for (n, listener) in listeners.into_iter().enumerate() {
        let state = Arc::clone(&state);
        let admission = admission.clone();
        let mut accepting = accepting.clone();
        let mut draining = draining.clone();
        let (accepted_done, accepted) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("memproxy-srv-{n}"))
            .spawn(move || {
                crate::upstream::own_pools_on_this_thread();
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .max_blocking_threads(blocking_threads)
                    .enable_all()
                    .build()
                {
                    Ok(runtime) => runtime,
                    Err(err) => {
                        tracing::error!(error = %err, "cannot start a serving thread's runtime");
                        return;
                    }
                };
                runtime.block_on(async move {
                    let listener = match TcpListener::from_std(listener) {
                        Ok(listener) => listener,
                        Err(err) => {
                            tracing::error!(error = %err, "a serving thread cannot take its listener");
                            return;
                        }
                    };
                    let stopped = async move {
                        let _ = accepting.wait_for(|stop| *stop).await;
                    };
                    let connections = accept(listener, &state, admission, stopped).await;
                    let _ = accepted_done.send(());
                    let _ = draining.wait_for(|go| *go).await;
                    drain(connections, &state).await;
                });
            });
        match thread {
            Ok(thread) => threads.push((thread, accepted)),
            Err(err) => tracing::error!(error = %err, "cannot start a serving thread"),
        }
    }
    shutdown.await;
    // 1. Every thread stops accepting.
    let _ = stop_accepting.send(true);
    for (_, accepted) in &mut threads {
        let _ = accepted.await;
    }
    // 2. Stop deleting idle conversations.
    background.stop().await;
    // 3. Every thread drains within the grace period.
    let _ = may_drain.send(true);
    for (thread, _) in threads {
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
    // 4. and 5.
    finish(&state).await
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
