//! Admission: at most `server.max_connections` connections are served at once. A connection
//! past that is answered at once with a 503 and closed, on a small task of its own, so the
//! accept loop never waits for it and it never waits for a free slot.
//!
//! The answer is written as plain HTTP/1.1 bytes before the request is read (a server may
//! answer early; `Connection: close` says nothing more will be read). Then what the client
//! sends is read and dropped, briefly and up to a bound: closing a socket with unread data
//! resets the connection, and the client could lose the answer before reading it. A prior-
//! knowledge h2c client cannot parse an HTTP/1.1 answer: it sees the connection closed. Every
//! step is bounded in time, and at most [`MAX_REFUSING`] refusals run at once; past that a
//! connection is closed at once.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{ProxyError, body_of, respond};

/// Refusals answered at once; past it a connection is closed with no answer.
pub const MAX_REFUSING: usize = 64;

/// Time to write the answer.
const WRITE_WITHIN: Duration = Duration::from_secs(2);

/// Time to read what the client sent, before closing.
const LINGER: Duration = Duration::from_secs(1);

/// The most bytes read from a refused client before closing.
const LINGER_BYTES: usize = 64 * 1024;

/// What to do with a connection just accepted.
pub enum Admit {
    /// Serve it, holding this slot until it closes.
    Serve(OwnedSemaphorePermit),
    /// Answer it 503 and close it ([`RefusedConnection::answer`]).
    Refuse(RefusedConnection),
    /// Close it at once: too many refusals are running already.
    Close,
}

/// The slots of `server.max_connections`, and of the refusals running.
#[derive(Clone)]
pub struct Admission {
    max_connections: usize,
    slots: Arc<Semaphore>,
    refusals: Arc<Semaphore>,
    answer: Bytes,
    /// Connections refused since the cap was last reached: logged once per episode, not once
    /// per connection, so an overload does not flood the log too.
    refused: u64,
}

impl Admission {
    pub fn new(max_connections: usize) -> Admission {
        Admission {
            max_connections,
            slots: Arc::new(Semaphore::new(max_connections)),
            refusals: Arc::new(Semaphore::new(MAX_REFUSING)),
            answer: answer(max_connections),
            refused: 0,
        }
    }

    /// Admits a connection just accepted, or says how to refuse it.
    pub fn admit(&mut self) -> Admit {
        if let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() {
            if self.refused > 0 {
                tracing::info!(refused = self.refused, "below the connection cap again");
                self.refused = 0;
            }
            return Admit::Serve(slot);
        }
        if self.refused == 0 {
            tracing::warn!(
                max_connections = self.max_connections,
                "connection cap reached; answering new connections 503"
            );
        }
        self.refused += 1;
        match Arc::clone(&self.refusals).try_acquire_owned() {
            Ok(permit) => Admit::Refuse(RefusedConnection {
                answer: self.answer.clone(),
                _permit: permit,
            }),
            Err(_) => Admit::Close,
        }
    }
}

/// One refusal: the 503's bytes and its place among the refusals running.
pub struct RefusedConnection {
    answer: Bytes,
    _permit: OwnedSemaphorePermit,
}

impl RefusedConnection {
    /// Writes the 503 to `stream` and closes it, within a few seconds.
    pub async fn answer(self, mut stream: TcpStream) {
        let written = tokio::time::timeout(WRITE_WITHIN, async {
            stream.write_all(&self.answer).await?;
            stream.shutdown().await
        })
        .await;
        if !matches!(written, Ok(Ok(()))) {
            return;
        }
        let mut sink = [0u8; 4096];
        let _ = tokio::time::timeout(LINGER, async {
            let mut read = 0;
            while read < LINGER_BYTES {
                match stream.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => read += n,
                }
            }
        })
        .await;
    }
}

/// The bytes of the 503 answer: an OpenAI-shaped body with `Retry-After` and
/// `Connection: close`, the same for every refusal.
fn answer(max_connections: usize) -> Bytes {
    let err = ProxyError::Overloaded {
        max: max_connections,
    };
    let response = respond(&err);
    let body = body_of(&err);
    let status = response.status();
    let mut out = format!(
        "HTTP/1.1 {} {}\r\n",
        status.as_str(),
        status.canonical_reason().unwrap_or("")
    )
    .into_bytes();
    for (name, value) in response.headers() {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    out.extend_from_slice(&body);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_cap_connections_are_refused_and_past_the_refusals_closed() {
        let mut admission = Admission::new(1);
        let Admit::Serve(slot) = admission.admit() else {
            panic!("the first connection was not served");
        };
        let mut refusals = Vec::new();
        for _ in 0..MAX_REFUSING {
            match admission.admit() {
                Admit::Refuse(refusal) => refusals.push(refusal),
                _ => panic!("a connection past the cap was not refused"),
            }
        }
        assert!(matches!(admission.admit(), Admit::Close));
        drop(refusals);
        assert!(matches!(admission.admit(), Admit::Refuse(_)));
        drop(slot);
        assert!(matches!(admission.admit(), Admit::Serve(_)));
        assert_eq!(admission.refused, 0);
    }

    #[test]
    fn the_answer_is_a_whole_openai_shaped_503() {
        let bytes = answer(2);
        let text = std::str::from_utf8(&bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nretry-after: 1"), "{head}");
        assert!(head.contains("\r\nconnection: close"), "{head}");
        assert!(
            head.contains("\r\ncontent-type: application/json"),
            "{head}"
        );
        assert!(
            head.contains(&format!("\r\ncontent-length: {}", body.len())),
            "{head}"
        );
        let value: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(value["error"]["code"], "server_overloaded");
        assert!(value["error"]["message"].as_str().unwrap().contains('2'));
    }
}
