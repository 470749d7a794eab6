//! One client connection: served by hyper (HTTP/1.1, or h2c), and watched for the time limits
//! hyper does not apply itself.
//!
//! hyper's own `header_read_timeout` (HTTP/1.1 only) also bounds the wait between two requests
//! of a kept-alive connection, so a short head timeout would close idle connections as soon;
//! and hyper-util's protocol detection reads a connection's first bytes with no limit at all.
//! So each connection has an [`Activity`] (its requests in flight, counted from the call of the
//! service until the response body is dropped; and the first byte of a next request, seen by
//! the IO) and a watchdog beside it:
//!
//! - no request in flight and a head begun (the connection has just opened, or a byte came
//!   after the last response): the head must be complete within `server.header_read_timeout`,
//!   or the connection is closed at once, with no answer (as hyper's own timeout does);
//! - no request in flight and nothing received: after `server.idle_timeout` the connection is
//!   shut down gracefully (HTTP/1.1: closed; h2c: a GOAWAY, then closed);
//! - a request in flight: no limit here. Its body is bounded by `server.body_read_timeout`
//!   (`body.rs`: collected whole, or between two frames streamed through), its answer by the
//!   upstream's limits.
//!
//! h2c: once a connection has served an HTTP/2 request, bytes between requests (pings, window
//! updates) do not begin a head: h2 streams are not read byte by byte. hyper pings an h2c
//! client every `server.idle_timeout` and closes the connection when a ping goes unanswered
//! for [`H2_PING_TIMEOUT`] (set in `server/mod.rs`).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Version};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{Notify, OwnedSemaphorePermit, watch};
use tokio::time::Instant;

use crate::body::{OnDrop, boxed};
use crate::config::Config;
use crate::router;
use crate::state::AppState;

/// How long an h2c client has to answer a keep-alive ping.
pub const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// The time limits a connection's watchdog applies.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read: Duration,
    pub idle: Duration,
}

impl Limits {
    pub fn of(config: &Config) -> Limits {
        Limits {
            header_read: config.header_read_timeout,
            idle: config.idle_timeout,
        }
    }
}

/// Serves one accepted connection until it ends, is timed out, or `stop` turns true (then it
/// finishes its requests in flight and closes). `slot` (one of `server.max_connections`) is
/// held until then.
pub fn serve(
    builder: &auto::Builder<TokioExecutor>,
    stream: TcpStream,
    state: Arc<AppState>,
    mut stop: watch::Receiver<bool>,
    slot: OwnedSemaphorePermit,
) -> impl Future<Output = ()> + Send + 'static {
    let limits = Limits::of(&state.config);
    let activity = Arc::new(Activity::new());
    let service_activity = Arc::clone(&activity);
    let service = service_fn(move |request: Request<Incoming>| {
        // In flight from here until the response body is dropped: sent, or abandoned.
        let in_flight = service_activity.request_started(request.version());
        let state = Arc::clone(&state);
        async move {
            let response = router::handle(state, request).await;
            Ok::<_, Infallible>(
                response.map(|body| boxed(OnDrop::new(body, move || drop(in_flight)))),
            )
        }
    });
    let io = TokioIo::new(Watched {
        io: stream,
        activity: Arc::clone(&activity),
    });
    let connection = builder.serve_connection(io, service).into_owned();
    async move {
        let _slot = slot;
        tokio::pin!(connection);
        let mut closing = false;
        // An idle connection shut down gracefully has this long to close (an h2c client that
        // never acknowledges the GOAWAY's ping would hold it); then it is dropped.
        let mut cut_at: Option<Instant> = None;
        let mut timer = Timer::new();
        loop {
            tokio::select! {
                result = connection.as_mut() => {
                    if let Err(err) = result {
                        tracing::debug!(error = %err, "connection ended with an error");
                    }
                    return;
                }
                expiry = activity.expired(limits, &mut timer), if !closing => match expiry {
                    Expiry::Head => {
                        tracing::debug!(timeout_s = limits.header_read.as_secs_f64(), "no complete request head in time; closing the connection");
                        return;
                    }
                    Expiry::Idle => {
                        tracing::debug!(timeout_s = limits.idle.as_secs_f64(), "connection idle; closing it");
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                        cut_at = Some(Instant::now() + limits.header_read);
                    }
                },
                () = tokio::time::sleep_until(cut_at.unwrap_or_else(Instant::now)), if cut_at.is_some() => {
                    tracing::debug!("idle connection did not close after its shutdown; dropping it");
                    return;
                }
                _ = stop.wait_for(|stop| *stop), if !closing => {
                    connection.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

/// Which limit a connection ran out of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// A request head begun and not completed within `header_read`.
    Head,
    /// No request and no byte within `idle`.
    Idle,
}

/// What a connection is doing, shared by its IO, its service and its watchdog.
pub struct Activity {
    state: Mutex<State>,
    changed: Notify,
    /// Set while an HTTP/1.1 connection waits for the first byte of its next request: the IO
    /// reports that byte. Read on every read, so an atomic rather than the lock.
    awaiting_first_byte: AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct State {
    in_flight: usize,
    /// With no request in flight: a head has begun (`true`) or the connection is idle.
    reading_head: bool,
    /// When the head began, or the connection went idle.
    since: Instant,
    /// The connection has served an HTTP/2 request.
    http2: bool,
}

impl Default for Activity {
    fn default() -> Self {
        Activity::new()
    }
}

impl Activity {
    /// A connection just opened: its first request's head is due within the head timeout.
    pub fn new() -> Activity {
        Activity {
            state: Mutex::new(State {
                in_flight: 0,
                reading_head: true,
                since: Instant::now(),
                http2: false,
            }),
            changed: Notify::new(),
            awaiting_first_byte: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A request's head is complete and its handling starts; it is in flight until the
    /// returned guard is dropped.
    pub fn request_started(self: &Arc<Self>, version: Version) -> InFlight {
        self.awaiting_first_byte.store(false, Ordering::Release);
        {
            let mut state = self.lock();
            state.in_flight += 1;
            state.http2 |= version == Version::HTTP_2;
        }
        self.changed.notify_waiters();
        InFlight(Arc::clone(self))
    }

    /// The IO read some bytes.
    fn received(&self) {
        if !self.awaiting_first_byte.load(Ordering::Acquire)
            || !self.awaiting_first_byte.swap(false, Ordering::AcqRel)
        {
            return;
        }
        {
            let mut state = self.lock();
            if state.in_flight == 0 && !state.reading_head {
                state.reading_head = true;
                state.since = Instant::now();
            }
        }
        self.changed.notify_waiters();
    }

    fn request_done(&self) {
        {
            let mut state = self.lock();
            state.in_flight = state.in_flight.saturating_sub(1);
            if state.in_flight == 0 {
                state.reading_head = false;
                state.since = Instant::now();
                self.awaiting_first_byte
                    .store(!state.http2, Ordering::Release);
            }
        }
        self.changed.notify_waiters();
    }

    /// When the connection runs out of time as things stand, and why; `None` while a request
    /// is in flight.
    fn deadline(&self, limits: Limits) -> Option<(Instant, Expiry)> {
        let state = *self.lock();
        if state.in_flight > 0 {
            None
        } else if state.reading_head {
            Some((state.since + limits.header_read, Expiry::Head))
        } else {
            Some((state.since + limits.idle, Expiry::Idle))
        }
    }

    /// Completes once the connection has run out of time: waits through every change of state
    /// (each one can move the deadline) until a deadline passes with nothing changed.
    pub async fn expired(&self, limits: Limits, timer: &mut Timer) -> Expiry {
        loop {
            // Registered before the state is read, so no change between the two is missed.
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.deadline(limits) {
                None => changed.await,
                Some((at, expiry)) => {
                    let now = Instant::now();
                    if at <= now {
                        return expiry;
                    }
                    timer.set(wake_at(at, expiry, limits, now));
                    tokio::select! {
                        () = changed => {}
                        () = timer.sleep.as_mut() => {}
                    }
                }
            }
        }
    }
}

/// A connection's one watchdog timer, moved as its deadline moves rather than made anew for each
/// request. Moved later, a timer still waiting in the runtime's wheel is only re-dated (no
/// lock); made anew or moved earlier, it takes the wheel's lock, which the workers share, and
/// that twice per request was a measurable part of pass-through's cost.
pub struct Timer {
    sleep: Pin<Box<tokio::time::Sleep>>,
}

impl Default for Timer {
    fn default() -> Self {
        Timer::new()
    }
}

impl Timer {
    pub fn new() -> Timer {
        Timer {
            sleep: Box::pin(tokio::time::sleep(Duration::from_secs(3600))),
        }
    }

    fn set(&mut self, at: Instant) {
        if self.sleep.deadline() != at {
            self.sleep.as_mut().reset(at);
        }
    }
}

/// When the watchdog wakes for a deadline `at`. An idle HTTP/1.1 connection's next head will
/// be due `header_read` after its first byte, which is earlier than the idle deadline: waking
/// at the earlier of the two while idle keeps each move of the timer a later one (the lock-free
/// kind); woken early, the watchdog finds the connection still idle and waits on to `at`.
fn wake_at(at: Instant, expiry: Expiry, limits: Limits, now: Instant) -> Instant {
    match expiry {
        Expiry::Head => at,
        Expiry::Idle => {
            let early = at - limits.idle + limits.header_read;
            if early > now && early < at { early } else { at }
        }
    }
}

/// A request in flight: dropping it tells the watchdog the request is done.
pub struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_done();
    }
}

/// A connection's IO that reports the first byte of each HTTP/1.1 request to its [`Activity`].
struct Watched<IO> {
    io: IO,
    activity: Arc<Activity>,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.received();
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        header_read: Duration::from_secs(10),
        idle: Duration::from_secs(60),
    };

    #[tokio::test(start_paused = true)]
    async fn a_new_connection_must_send_its_head_within_the_head_timeout() {
        let activity = Activity::new();
        let started = Instant::now();
        assert_eq!(
            activity.expired(LIMITS, &mut Timer::new()).await,
            Expiry::Head
        );
        assert_eq!(started.elapsed(), LIMITS.header_read);
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_is_never_timed_out_here_and_idle_follows_it() {
        let activity = Arc::new(Activity::new());
        let in_flight = activity.request_started(Version::HTTP_11);
        let watch = {
            let activity = Arc::clone(&activity);
            tokio::spawn(async move {
                (
                    activity.expired(LIMITS, &mut Timer::new()).await,
                    Instant::now(),
                )
            })
        };
        tokio::time::sleep(LIMITS.idle * 5).await;
        assert!(!watch.is_finished());
        let done_at = Instant::now();
        drop(in_flight);
        let (expiry, at) = watch.await.unwrap();
        assert_eq!(expiry, Expiry::Idle);
        assert_eq!(at - done_at, LIMITS.idle);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_watchdog_wakes_first_where_a_head_would_be_due_and_never_moves_earlier() {
        let now = Instant::now();
        let idle_at = now + LIMITS.idle;
        // Idle: woken at the head window, so a byte then moves the timer later, not earlier.
        assert_eq!(
            wake_at(idle_at, Expiry::Idle, LIMITS, now),
            now + LIMITS.header_read
        );
        let head_due = now + Duration::from_secs(3) + LIMITS.header_read;
        assert!(head_due > wake_at(idle_at, Expiry::Idle, LIMITS, now));
        // Woken there and still idle: on to the idle deadline itself.
        let later = now + LIMITS.header_read;
        assert_eq!(wake_at(idle_at, Expiry::Idle, LIMITS, later), idle_at);
        assert_eq!(wake_at(head_due, Expiry::Head, LIMITS, now), head_due);
        // A head timeout longer than the idle one: the idle deadline.
        let long_head = Limits {
            header_read: Duration::from_secs(90),
            idle: Duration::from_secs(60),
        };
        assert_eq!(wake_at(idle_at, Expiry::Idle, long_head, now), idle_at);
    }

    #[tokio::test(start_paused = true)]
    async fn a_byte_after_the_last_answer_starts_the_head_timeout_on_http1_only() {
        let activity = Arc::new(Activity::new());
        drop(activity.request_started(Version::HTTP_11));
        tokio::time::sleep(Duration::from_secs(5)).await;
        let byte_at = Instant::now();
        activity.received();
        assert_eq!(
            activity.expired(LIMITS, &mut Timer::new()).await,
            Expiry::Head
        );
        assert_eq!(Instant::now() - byte_at, LIMITS.header_read);

        let h2 = Arc::new(Activity::new());
        drop(h2.request_started(Version::HTTP_2));
        let idle_at = Instant::now();
        tokio::time::sleep(Duration::from_secs(5)).await;
        // A ping between requests: not the start of a head.
        h2.received();
        assert_eq!(h2.expired(LIMITS, &mut Timer::new()).await, Expiry::Idle);
        assert_eq!(Instant::now() - idle_at, LIMITS.idle);
    }
}
