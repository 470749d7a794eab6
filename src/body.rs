//! The body type every response and forwarded request uses, and small constructors.
//!
//! Bodies are boxed streams of frames: nothing here collects a body into memory except
//! [`collect_limited`], which the chat pipeline uses for request bodies it must parse, with a
//! hard size limit.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, Limited, combinators::UnsyncBoxBody};

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

/// Why [`collect_limited`] failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error("body is larger than {limit} bytes")]
    TooLarge { limit: usize },
    #[error("body could not be read")]
    Read(#[source] BoxError),
}

/// Reads a whole body, failing once it passes `limit` bytes.
pub async fn collect_limited<B>(body: B, limit: usize) -> Result<Bytes, CollectError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => {
            Err(CollectError::TooLarge { limit })
        }
        Err(err) => Err(CollectError::Read(err)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn collect_limited_enforces_the_limit() {
        let ok = collect_limited(full("hello"), 5).await.unwrap();
        assert_eq!(ok, Bytes::from("hello"));
        let err = collect_limited(full("hello!"), 5).await.unwrap_err();
        assert!(matches!(err, CollectError::TooLarge { limit: 5 }));
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
