//! The tee: an upstream SSE body passed to the client frame by frame while the assistant's
//! reply is read from the same frames.
//!
//! A stream is teed: each frame goes to the client as it arrives while its bytes feed the SSE
//! parser. When the upstream ends the stream properly, the commit runs before the end of the
//! body is given to the client, so a client that saw the end can rely on the exchange being
//! stored. An upstream error, a cut stream or a client that goes away (the body is dropped)
//! stores nothing; a dropped body tells the exchange's ledger (and its receipt:
//! `client_gone`) with the usage read so far ([`Metering`]'s drop).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tracing::Instrument;

use crate::body::BoxError;
use crate::metrics::ReplyKind;
use crate::pipeline::commit::Exchange;
use crate::reply::ReplyReader;
use crate::sse::SseParser;
use crate::state::AppState;
use crate::summary::DeferredSummary;
use crate::wire::usage::UsageReader;

use super::exchange_ledger::ExchangeLedger;
use crate::wire::Api;

type CommitFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a completed stream commits.
pub struct Pending {
    pub state: Arc<AppState>,
    pub exchange: Exchange,
}

pin_project! {
    /// An upstream SSE body passed through frame by frame, with the reply read on the way.
    pub struct TeeBody<B> {
        #[pin]
        inner: B,
        parser: SseParser,
        reply: ReplyReader,
        // What to commit when the stream completes; `None` when nothing is to be stored.
        pending: Option<Pending>,
        // A due summary, queued once the stream is committed, or when the body is dropped.
        deferred: Option<DeferredSummary>,
        // The exchange's ledger and receipt, told the usage when the stream ends.
        metering: Metering,
        committing: Option<CommitFuture>,
        span: tracing::Span,
        done: bool,
    }
}

/// What a tee reads at most: an SSE line or event of `max_event_bytes`, an assembled reply of
/// `max_reply_bytes`. Past either the stream still reaches the client whole, and nothing is
/// stored.
#[derive(Debug, Clone, Copy)]
pub struct TeeLimits {
    pub max_event_bytes: usize,
    pub max_reply_bytes: usize,
}

impl<B> TeeBody<B> {
    /// Tees `inner`, reading the reply within `limits`.
    pub fn new(
        inner: B,
        api: Api,
        pending: Option<Pending>,
        deferred: Option<DeferredSummary>,
        limits: TeeLimits,
    ) -> TeeBody<B> {
        TeeBody {
            inner,
            parser: SseParser::with_limit(limits.max_event_bytes),
            reply: ReplyReader::new(api, limits.max_reply_bytes),
            pending,
            deferred,
            metering: Metering {
                ledger: None,
                usage: UsageReader::new(api),
            },
            committing: None,
            span: tracing::Span::current(),
            done: false,
        }
    }
}

impl<B> TeeBody<B> {
    /// Reads the stream's usage too, for `ledger` (the cached tokens, the receipt).
    pub fn with_ledger(mut self, ledger: ExchangeLedger) -> TeeBody<B> {
        self.metering.ledger = Some(ledger);
        self
    }
}

/// The exchange's ledger and the usage read so far. Dropped with the body before the stream
/// ended (the client went away), it tells the ledger so, with that usage.
struct Metering {
    ledger: Option<ExchangeLedger>,
    usage: UsageReader,
}

impl Metering {
    /// The stream ended (`complete` or not) with the usage read.
    fn ended(&mut self, complete: bool) -> Option<ExchangeLedger> {
        let ledger = self.ledger.take()?;
        ledger.ended(complete, self.usage.usage());
        Some(ledger)
    }
}

impl Drop for Metering {
    fn drop(&mut self) {
        if let Some(ledger) = self.ledger.take() {
            ledger.gone(self.usage.usage());
        }
    }
}

impl<B> Body for TeeBody<B>
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
        loop {
            if let Some(commit) = this.committing.as_mut() {
                ready!(commit.as_mut().poll(cx));
                *this.committing = None;
                *this.done = true;
            }
            if *this.done {
                return Poll::Ready(None);
            }
            match ready!(this.inner.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let storing = this.pending.is_some();
                    if let Some(data) = frame.data_ref()
                        && (storing || this.metering.ledger.is_some())
                    {
                        let reply = &mut *this.reply;
                        let usage = &mut this.metering.usage;
                        this.parser.feed(data, |event| {
                            if storing {
                                reply.on_event(event);
                            }
                            usage.on_event(event);
                        });
                        if this.parser.overflowed() {
                            reply.fail();
                        }
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
                Some(Err(err)) => {
                    *this.done = true;
                    this.metering.ended(false);
                    if this.pending.take().is_some() {
                        tracing::warn!(parent: &*this.span, "upstream stream failed midway; nothing stored");
                    }
                    return Poll::Ready(Some(Err(err.into())));
                }
                None => match this.pending.take() {
                    Some(Pending {
                        state,
                        mut exchange,
                    }) if this.reply.is_complete() => {
                        let usage = this.metering.usage.usage();
                        exchange.cached_tokens = usage.map_or(0, |u| u.cached_tokens);
                        let ledger = this.metering.ended(true);
                        let reply = this.reply.to_message();
                        let deferred = this.deferred.take();
                        let commit = async move {
                            match super::commit(&state, exchange, reply, ReplyKind::Stream).await {
                                Ok(count) => tracing::debug!(messages = count, "exchange stored"),
                                // Said in the receipt: the stream's head said `stored` already.
                                Err(reason) => {
                                    if let Some(ledger) = &ledger {
                                        ledger.degraded(reason);
                                    }
                                }
                            }
                            // The stream is over but for its end: a due summary starts now.
                            drop(deferred);
                        };
                        *this.committing = Some(Box::pin(commit.instrument(this.span.clone())));
                    }
                    Some(_) => {
                        tracing::warn!(parent: &*this.span, "upstream stream ended without a finish; nothing stored");
                        this.metering.ended(false);
                        *this.done = true;
                    }
                    None => {
                        // Nothing to store: the stream's end is its end.
                        this.metering.ended(true);
                        *this.done = true;
                    }
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.committing.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
