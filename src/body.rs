//! The body type every response and forwarded request uses, and small constructors.
//!
//! Bodies are boxed streams of frames: nothing here collects a body into memory except
//! [`collect_limited`], which the chat pipeline uses for request bodies it must parse and JSON
//! answers it reads, with a hard size limit and a deadline. [`IdleTimeout`] bounds the pause
//! between two frames of a body that streams through, in either direction.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full, Limited, combinators::UnsyncBoxBody};
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

/// The most an HTTP/1.1 connection's read buffer grows to (hyper's default is about 400 KiB),
/// and so the longest request head it takes. hyper grows a connection's buffer while reads
/// fill it and keeps what it grew to for as long as the connection lives: under the soak
/// (64 clients, 128 MiB), the four clients of the burst of 20 MiB bodies left 15.5 MB of grown
/// buffers on their kept-alive connections (jemalloc's heap profile before and after), still
/// 5.6 MB a minute later, and the RSS that held kept memory off for ordinary requests after
/// the burst. A body is read in pieces of at most this size either way.
pub const READ_BUFFER_MAX: usize = 64 * 1024;

/// The error type carried by bodies: whatever the source (hyper, a cut stream, a limit).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A streamed body, boxed so that pass-through, buffered and teed bodies share one type.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// A body made of one buffer.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> ProxyBody {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// Any body, boxed.
pub fn boxed<B>(body: B) -> ProxyBody
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// A body that runs `then` once it is dropped: after it was sent, or when the client went
/// away. Work that must not compete with sending the response starts there.
pub struct OnDrop {
    inner: ProxyBody,
    then: Option<Box<dyn FnOnce() + Send>>,
}

impl OnDrop {
    pub fn new(inner: ProxyBody, then: impl FnOnce() + Send + 'static) -> OnDrop {
        OnDrop {
            inner,
            then: Some(Box::new(then)),
        }
    }
}

impl http_body::Body for OnDrop {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(then) = self.then.take() {
            then();
        }
    }
}

/// The error of a body whose next frame did not come in time ([`IdleTimeout`]).
#[derive(Debug, thiserror::Error)]
#[error("no data for {} seconds", .idle.as_secs_f64())]
pub struct Stalled {
    pub idle: Duration,
}

impl Stalled {
    /// The [`Stalled`] that `err` is, or was caused by: a stalled body seen
    /// through the errors of the client that was sending it.
    pub fn caused<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a Stalled> {
        std::iter::successors(Some(err), |err| err.source())
            .take(16)
            .find_map(|err| err.downcast_ref::<Stalled>())
    }
}

pin_project! {
    /// A body that fails with [`Stalled`] when its next frame takes longer than `idle` to come.
    ///
    /// The clock runs only while the body's reader is waiting for a frame: a reader that is
    /// slow to ask (a client reading slowly, a connection applying back-pressure) never makes
    /// the body look stalled. It is started when the body first has no frame ready, so a body
    /// whose frames are all at hand (most request bodies, and answers that come with their
    /// head) never touches the runtime's timer wheel, whose lock two workers would share.
    pub struct IdleTimeout<B> {
        #[pin]
        inner: B,
        #[pin]
        sleep: Sleep,
        idle: Duration,
        // The reader is waiting since the sleep was last reset.
        waiting: bool,
    }
}

impl<B> IdleTimeout<B> {
    pub fn new(inner: B, idle: Duration) -> IdleTimeout<B> {
        IdleTimeout {
            inner,
            sleep: tokio::time::sleep(idle),
            idle,
            waiting: false,
        }
    }
}

impl<B> Body for IdleTimeout<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(frame) => {
                *this.waiting = false;
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending => {
                if !*this.waiting {
                    this.sleep.as_mut().reset(Instant::now() + *this.idle);
                    *this.waiting = true;
                }
                match this.sleep.poll(cx) {
                    Poll::Ready(()) => {
                        *this.waiting = false;
                        Poll::Ready(Some(Err(Box::new(Stalled { idle: *this.idle }))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Why [`collect_limited`] failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error("body is larger than {limit} bytes")]
    TooLarge { limit: usize },
    /// The whole body did not come within the deadline, or it stalled ([`Stalled`]).
    #[error("body was not received within {} seconds", .within.as_secs_f64())]
    TimedOut { within: Duration },
    #[error("body could not be read")]
    Read(#[source] BoxError),
}

/// Reads a whole body within `within`, failing once it passes `limit` bytes. A body that
/// announces more than `limit` bytes (`Content-Length`) fails at once, before any wait.
pub async fn collect_limited<B>(
    body: B,
    limit: usize,
    within: Duration,
) -> Result<Bytes, CollectError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(CollectError::TooLarge { limit });
    }
    match tokio::time::timeout(within, Limited::new(body, limit).collect()).await {
        Err(_) => Err(CollectError::TimedOut { within }),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(err)) if err.is::<http_body_util::LengthLimitError>() => {
            Err(CollectError::TooLarge { limit })
        }
        Ok(Err(err)) => match Stalled::caused(err.as_ref()) {
            Some(stalled) => Err(CollectError::TimedOut {
                within: stalled.idle,
            }),
            None => Err(CollectError::Read(err)),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_secs(3600);

    /// A body that sends `sent` as one frame, then nothing, forever; it announces
    /// `announced` bytes.
    struct Stalling {
        sent: Option<Bytes>,
        announced: u64,
    }

    impl Body for Stalling {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            match self.sent.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => Poll::Pending,
            }
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.announced)
        }
    }

    fn stalling(sent: &'static str, announced: u64) -> Stalling {
        Stalling {
            sent: Some(Bytes::from(sent)),
            announced,
        }
    }

    #[tokio::test]
    async fn collect_limited_enforces_the_limit() {
        let ok = collect_limited(full("hello"), 5, LONG).await.unwrap();
        assert_eq!(ok, Bytes::from("hello"));
        let err = collect_limited(full("hello!"), 5, LONG).await.unwrap_err();
        assert!(matches!(err, CollectError::TooLarge { limit: 5 }));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_announcing_more_than_the_limit_fails_before_any_wait() {
        let started = Instant::now();
        let err = collect_limited(stalling("", 1_000_000_000_000), 5, LONG)
            .await
            .unwrap_err();
        assert!(matches!(err, CollectError::TooLarge { limit: 5 }));
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn collect_limited_gives_up_at_its_deadline() {
        let within = Duration::from_secs(30);
        let started = Instant::now();
        let err = collect_limited(stalling("0123456789", 100), 1000, within)
            .await
            .unwrap_err();
        assert!(matches!(err, CollectError::TimedOut { within: w } if w == within));
        assert_eq!(started.elapsed(), within);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_timeout_fails_a_stalled_body_and_counts_as_timed_out() {
        let idle = Duration::from_secs(2);
        let mut body = std::pin::pin!(IdleTimeout::new(stalling("first", 100), idle));
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), Bytes::from("first"));
        let started = Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(started.elapsed(), idle);
        assert!(Stalled::caused(err.as_ref()).is_some(), "{err}");

        let err = collect_limited(IdleTimeout::new(stalling("x", 100), idle), 1000, LONG)
            .await
            .unwrap_err();
        assert!(matches!(err, CollectError::TimedOut { within } if within == idle));
    }

    #[tokio::test(start_paused = true)]
    async fn the_idle_clock_runs_only_while_the_reader_waits() {
        let idle = Duration::from_secs(2);
        let mut body = std::pin::pin!(IdleTimeout::new(full("late reader"), idle));
        // The reader comes back long after the body was made: the frame is there, no error.
        tokio::time::sleep(idle * 10).await;
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(frame.into_data().unwrap(), Bytes::from("late reader"));
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn on_drop_runs_once_after_the_body_and_keeps_its_length() {
        use http_body::Body;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let runs = std::sync::Arc::new(AtomicUsize::new(0));
        let counter = std::sync::Arc::clone(&runs);
        let body = OnDrop::new(full("hello"), move || {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(body.size_hint().exact(), Some(5));
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes, Bytes::from("hello"));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
