//! Clients that stall, through the real proxy with raw TCP clients: a half-sent head, a silent
//! connection, a body stalled midway (collected or streamed through), a `Content-Length` far
//! past the limit with no body, an idle kept-alive connection (HTTP/1.1 and h2c), and more
//! connections than `server.max_connections`. Each limit is set short (1 s) and each answer or
//! close is awaited within a generous bound, so nothing here measures speed: it proves that
//! nothing hangs.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support;
use crate::support::*;

/// How long any answer or close may take before the test calls it a hang.
const BOUND: Duration = Duration::from_secs(10);

/// A proxy whose head timeout is short and idle timeout long.
const SHORT_HEAD: &str = "header_read_timeout = \"PT1S\"\nidle_timeout = \"PT30S\"\n";
/// A proxy whose body timeout is short (and the others long).
const SHORT_BODY: &str =
    "header_read_timeout = \"PT30S\"\nbody_read_timeout = \"PT1S\"\nidle_timeout = \"PT30S\"\n";

async fn connect(proxy: &Proxy) -> TcpStream {
    TcpStream::connect(proxy.addr).await.unwrap()
}

/// What a raw connection received until the server closed it (EOF or reset), and when.
struct Closed {
    bytes: Vec<u8>,
    after: Duration,
}

impl Closed {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// The status code of the HTTP/1.1 answer received.
    fn status(&self) -> u16 {
        let text = self.text();
        let line = text.lines().next().unwrap_or_default();
        line.split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("no HTTP answer in {text:?}"))
    }

    fn head(&self) -> String {
        let text = self.text();
        text.split("\r\n\r\n")
            .next()
            .unwrap_or_default()
            .to_lowercase()
    }

    /// The JSON body of the answer (sent with `Content-Length`).
    fn json(&self) -> Value {
        let text = self.text();
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        serde_json::from_str(body).unwrap_or_else(|_| panic!("no JSON body in {text:?}"))
    }
}

/// Reads until the server closes the connection; fails the test if it is still open after
/// [`BOUND`].
async fn read_until_closed(stream: &mut TcpStream) -> Closed {
    let started = Instant::now();
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    let outcome = tokio::time::timeout(BOUND, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => bytes.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        outcome.is_ok(),
        "the connection was still open after {BOUND:?}; received {:?}",
        String::from_utf8_lossy(&bytes)
    );
    Closed {
        bytes,
        after: started.elapsed(),
    }
}

/// A whole `GET /healthz` request.
const HEALTH: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: memproxy\r\n\r\n";

/// Asks `/healthz` on a kept-alive connection; the answer must be a 200.
async fn ask_health(stream: &mut TcpStream) {
    stream.write_all(HEALTH).await.unwrap();
    let answer = read_answer(stream).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// The server closed the connection without an answer, and not at once: after a timeout.
fn assert_closed_silently(closed: &Closed) {
    assert!(closed.bytes.is_empty(), "{}", closed.text());
    assert!(
        closed.after >= Duration::from_millis(500),
        "closed after {:?}",
        closed.after
    );
}

/// Opens a connection, sends `bytes`, then nothing, and reads until the server closes it.
async fn send_then_wait_for_close(proxy: &Proxy, bytes: &[u8]) -> Closed {
    let mut stream = connect(proxy).await;
    stream.write_all(bytes).await.unwrap();
    read_until_closed(&mut stream).await
}

/// Reads one HTTP/1.1 answer with a `Content-Length` body, leaving the connection open.
async fn read_answer(stream: &mut TcpStream) -> String {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(BOUND, async {
        loop {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before a whole answer: {bytes:?}");
            bytes.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&bytes).into_owned();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head
                    .lines()
                    .find_map(|l| {
                        l.to_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    })
                    .unwrap_or(0);
                if body.len() >= length {
                    return text;
                }
            }
        }
    })
    .await
    .expect("no whole answer in time")
}

fn chat_head(content_length: u64) -> String {
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: memproxy\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\nx-memory-conversation-id: stalled\r\ncontent-length: {content_length}\r\n\r\n"
    )
}

fn passthrough_head(content_length: u64) -> String {
    format!(
        "POST /v1/files HTTP/1.1\r\nhost: memproxy\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/octet-stream\r\ncontent-length: {content_length}\r\n\r\n"
    )
}

/// Sends `head` and the first bytes of its body, then nothing: the answer must be an
/// OpenAI-shaped 408 that closes the connection.
async fn stall_body_and_expect_408(proxy: &Proxy, head: &str, start: &[u8]) {
    let closed = send_then_wait_for_close(proxy, &[head.as_bytes(), start].concat()).await;
    assert_eq!(closed.status(), 408, "{}", closed.text());
    assert!(
        closed.head().contains("connection: close"),
        "{}",
        closed.head()
    );
    let error = closed.json();
    assert_eq!(error["error"]["code"], "request_timeout");
    assert_eq!(error["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn a_half_sent_head_is_closed_after_the_head_timeout() {
    let Started { mock, proxy, .. } = Harness::new().config(SHORT_HEAD).start().await;

    let closed = send_then_wait_for_close(
        &proxy,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: memproxy\r\ncontent-ty",
    )
    .await;
    assert_closed_silently(&closed);
    assert!(mock.recorded().is_empty());
}

#[tokio::test]
async fn a_silent_connection_is_closed_after_the_head_timeout() {
    let Started { proxy, .. } = Harness::new().config(SHORT_HEAD).start().await;

    // Not a byte: hyper's protocol detection would wait for one forever.
    let mut stream = connect(&proxy).await;
    let closed = read_until_closed(&mut stream).await;
    assert_closed_silently(&closed);
}

#[tokio::test]
async fn a_kept_alive_connection_is_closed_once_idle_and_a_late_head_is_timed_out_too() {
    let idle = "header_read_timeout = \"PT30S\"\nidle_timeout = \"PT1S\"\n";
    let Started { mock, proxy, .. } = Harness::new().config(idle).start().await;

    let mut stream = connect(&proxy).await;
    ask_health(&mut stream).await;
    // Idle: no request in flight, no byte sent.
    let closed = read_until_closed(&mut stream).await;
    assert_closed_silently(&closed);

    // After an answer, the first byte of a next request starts the head timeout.
    let late_dir = tempfile::tempdir().unwrap();
    let late = Proxy::start(&mock, late_dir.path(), SHORT_HEAD).await;
    let mut stream = connect(&late).await;
    ask_health(&mut stream).await;
    stream.write_all(b"GET /heal").await.unwrap();
    let closed = read_until_closed(&mut stream).await;
    assert_closed_silently(&closed);
}

#[tokio::test]
async fn a_request_in_flight_outlives_the_idle_timeout() {
    let options = support::mock_upstream::MockOptions {
        stream_chunks: 6,
        chunk_delay: Duration::from_millis(400),
        record: true,
        strict: true,
    };
    let short = "header_read_timeout = \"PT1S\"\nidle_timeout = \"PT1S\"\n";
    let Started { proxy, .. } = Harness::new().mock(options).config(short).start().await;

    // A stream of about 3 s through a proxy that closes idle connections after 1 s.
    let body = serde_json::json!({"model": "m", "stream": true, "messages": [user("long one")]});
    let answer = chat(&proxy, "long", &body, &[]).await;
    assert_eq!(answer.status, 200);
    assert!(answer.body.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(proxy.stored(Some(TOKEN), "long").len(), 2);
}

#[tokio::test]
async fn an_idle_h2c_connection_is_closed_after_the_idle_timeout() {
    let idle = "header_read_timeout = \"PT30S\"\nidle_timeout = \"PT1S\"\n";
    let Started { proxy, .. } = Harness::new().config(idle).start().await;

    let stream = connect(&proxy).await;
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    let connection = tokio::spawn(connection);
    let request = http::Request::get(format!("http://{}/healthz", proxy.addr))
        .body(Empty::<Bytes>::new())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), http::Version::HTTP_2);
    response.into_body().collect().await.unwrap();

    let started = Instant::now();
    // The server says GOAWAY and closes: the client's connection task ends.
    tokio::time::timeout(BOUND, connection)
        .await
        .expect("the idle h2c connection was still open")
        .unwrap()
        .ok();
    assert!(started.elapsed() >= Duration::from_millis(500));
}

#[tokio::test]
async fn a_chat_body_stalled_midway_gets_408_and_nothing_is_forwarded() {
    let Started { mock, proxy, .. } = Harness::new().config(SHORT_BODY).start().await;

    stall_body_and_expect_408(&proxy, &chat_head(100), b"{\"model\":").await;
    assert!(mock.recorded().is_empty());
    assert!(
        proxy
            .store()
            .meta(&key(Some(TOKEN), "stalled"))
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn an_admin_body_stalled_midway_gets_408() {
    let Started { proxy, .. } = Harness::new().admin().config(SHORT_BODY).start().await;

    let head = format!(
        "POST /admin/v1/conversations/anonymous/default/c/import HTTP/1.1\r\nhost: memproxy\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n",
        support::admin::ADMIN_TOKEN
    );
    stall_body_and_expect_408(&proxy, &head, b"{\"messages").await;
}

#[tokio::test]
async fn a_passthrough_body_stalled_midway_cuts_the_upstream_request_and_gets_408() {
    let Started { proxy, .. } = Harness::new().config(SHORT_BODY).start().await;

    stall_body_and_expect_408(&proxy, &passthrough_head(100), b"0123456789").await;
}

#[tokio::test]
async fn a_huge_content_length_with_no_body_is_answered() {
    let Started { mock, proxy, .. } = Harness::new().config(SHORT_BODY).start().await;

    // Chat with memory: past `body_limit_bytes`, so 413 before any byte of the body is awaited.
    let closed = send_then_wait_for_close(&proxy, chat_head(1_000_000_000_000).as_bytes()).await;
    assert_eq!(closed.status(), 413, "{}", closed.text());
    assert_eq!(closed.json()["error"]["code"], "request_too_large");
    assert!(mock.recorded().is_empty());

    // Pass-through: streamed, so the body timeout answers.
    let head = passthrough_head(1_000_000_000_000);
    let closed = send_then_wait_for_close(&proxy, head.as_bytes()).await;
    assert_eq!(closed.status(), 408, "{}", closed.text());
}

#[tokio::test]
async fn past_max_connections_a_new_connection_gets_503_and_the_others_still_work() {
    let capped = "max_connections = 2\nheader_read_timeout = \"PT30S\"\nidle_timeout = \"PT30S\"\n";
    let Started { proxy, .. } = Harness::new().config(capped).start().await;

    // Two connections held open, each served once so that it is accepted before the next
    // connects: with a runtime per thread each serving thread accepts from its own listener,
    // so connections made one after the other are not accepted in that order.
    let mut first = connect(&proxy).await;
    ask_health(&mut first).await;
    let mut second = connect(&proxy).await;
    ask_health(&mut second).await;

    let refused = send_then_wait_for_close(&proxy, HEALTH).await;
    assert_eq!(refused.status(), 503, "{}", refused.text());
    let head = refused.head();
    assert!(head.contains("retry-after: 1"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    let error = refused.json();
    assert_eq!(error["error"]["code"], "server_overloaded");
    assert_eq!(error["error"]["type"], "server_error");

    for held in [&mut first, &mut second] {
        ask_health(held).await;
    }

    // One closes: its slot is free again (once the server has seen the close).
    drop(first);
    let mut served = false;
    // Raw, not through an HTTP client: a refusal's 503 can come before the request is written,
    // which a client takes for a broken exchange.
    let health_then_close = b"GET /healthz HTTP/1.1\r\nhost: memproxy\r\nconnection: close\r\n\r\n";
    for _ in 0..100 {
        let answer = send_then_wait_for_close(&proxy, health_then_close).await;
        if answer.status() == 200 {
            served = true;
            break;
        }
        assert_eq!(answer.status(), 503, "{}", answer.text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(served, "a freed slot was never used again");
}
