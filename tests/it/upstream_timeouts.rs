//! An upstream that sends its head, then stalls, through the real proxy: a JSON answer is a 504
//! and stores nothing; an SSE stream or a pass-through body is cut (the client's body ends with
//! an error, no `[DONE]`) and stores nothing. Limits are set short and each outcome is awaited
//! within a generous bound: nothing here measures speed, it proves nothing hangs.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use crate::support;
use crate::support::mock_upstream::Reply;
use crate::support::*;

/// How long any answer may take before the test calls it a hang.
const BOUND: Duration = Duration::from_secs(10);

/// A short whole-answer deadline, a long idle timeout: a JSON stall is caught by the deadline.
const SHORT_READ: &str = "read_timeout = \"PT1S\"\nidle_timeout = \"PT30S\"\n";
/// A short idle timeout: a stream that stops is cut.
const SHORT_IDLE: &str = "read_timeout = \"PT30S\"\nidle_timeout = \"PT1S\"\n";

fn stream_body(text: &str) -> Value {
    json!({"model": "gpt-4o-mini", "stream": true, "messages": [user(text)]})
}

/// Sends a request and reads its body frame by frame: the status, the bytes received, and
/// whether the body ended with an error. Fails the test if the body has not ended within
/// [`BOUND`].
async fn send_and_read(
    proxy: &Proxy,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, Vec<u8>, bool) {
    let mut request = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    tokio::time::timeout(BOUND, async {
        let response = client().request(request).await.unwrap();
        let status = response.status().as_u16();
        let mut body = response.into_body();
        let mut bytes = Vec::new();
        loop {
            match body.frame().await {
                None => return (status, bytes, false),
                Some(Err(_)) => return (status, bytes, true),
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        bytes.extend_from_slice(data);
                    }
                }
            }
        }
    })
    .await
    .expect("the answer was still open")
}

#[tokio::test]
async fn a_json_answer_that_stalls_after_its_head_is_a_504_and_stores_nothing() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().upstream(SHORT_READ).start().await;

    chat(&proxy, "j", &body(&[user("first")]), &[]).await;
    mock.push(Reply::Stall { chunks: 1 });
    let answer = tokio::time::timeout(BOUND, chat(&proxy, "j", &body(&[user("second")]), &[]))
        .await
        .expect("no answer in time");
    assert_eq!(answer.status, 504, "{:?}", answer.body);
    let error = answer.json();
    assert_eq!(error["error"]["code"], "upstream_timeout");
    assert_eq!(error["error"]["type"], "upstream_error");
    assert_eq!(
        summarize(&proxy.stored(Some(TOKEN), "j")),
        ["user:first", "assistant:reply to: first"]
    );

    // A stall caught by the idle timeout is the same 504.
    let idle =
        Proxy::start_with_upstream(&mock, dir.path().join("idle").as_path(), SHORT_IDLE, "").await;
    mock.push(Reply::Stall { chunks: 0 });
    let answer = tokio::time::timeout(BOUND, chat(&idle, "k", &body(&[user("q")]), &[]))
        .await
        .expect("no answer in time");
    assert_eq!(answer.status, 504, "{:?}", answer.body);
    assert_eq!(answer.json()["error"]["code"], "upstream_timeout");
    assert!(idle.stored(Some(TOKEN), "k").is_empty());
}

#[tokio::test]
async fn a_stream_that_stalls_is_cut_without_done_and_stores_nothing() {
    let Started { mock, proxy, .. } = Harness::new().upstream(SHORT_IDLE).start().await;

    mock.push(Reply::Stall { chunks: 2 });
    let (status, bytes, failed) = send_and_read(
        &proxy,
        &[("x-memory-conversation-id", "s")],
        &stream_body("tell me"),
    )
    .await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.contains("part1 "), "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    assert!(failed, "the cut stream ended cleanly: {text}");
    assert!(proxy.stored(Some(TOKEN), "s").is_empty());

    // The conversation is unharmed: the next exchange is stored as usual.
    let answer = chat(&proxy, "s", &body(&[user("again")]), &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        summarize(&proxy.stored(Some(TOKEN), "s")),
        ["user:again", "assistant:reply to: again"]
    );
}

#[tokio::test]
async fn a_passthrough_answer_that_stalls_is_cut() {
    let Started { mock, proxy, .. } = Harness::new().upstream(SHORT_IDLE).start().await;

    // No conversation id: forwarded untouched, the body streamed through.
    mock.push(Reply::Stall { chunks: 1 });
    let (status, bytes, failed) = send_and_read(&proxy, &[], &body(&[user("q")])).await;
    assert_eq!(status, 200);
    assert!(failed, "the stalled body ended cleanly");
    assert!(String::from_utf8_lossy(&bytes).starts_with("{\"id\""));

    mock.push(Reply::Stall { chunks: 3 });
    let (status, bytes, failed) = send_and_read(&proxy, &[], &stream_body("q")).await;
    assert_eq!(status, 200);
    assert!(failed, "the stalled stream ended cleanly");
    assert!(!String::from_utf8_lossy(&bytes).contains("[DONE]"));
}

#[tokio::test]
async fn a_slow_but_steady_stream_is_not_cut() {
    let options = support::mock_upstream::MockOptions {
        stream_chunks: 6,
        chunk_delay: Duration::from_millis(500),
        record: true,
        strict: true,
    };
    let two_seconds = "read_timeout = \"PT30S\"\nidle_timeout = \"PT2S\"\n";
    let Started { proxy, .. } = Harness::new()
        .mock(options)
        .upstream(two_seconds)
        .start()
        .await;

    // About 4 s in all, longer than the 2 s idle timeout, but 500 ms between two chunks.
    let (status, bytes, failed) = send_and_read(
        &proxy,
        &[("x-memory-conversation-id", "steady")],
        &stream_body("slowly"),
    )
    .await;
    assert_eq!(status, 200);
    assert!(!failed);
    assert!(bytes.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(proxy.stored(Some(TOKEN), "steady").len(), 2);
}

#[tokio::test]
async fn a_summary_call_that_stalls_fails_at_the_read_timeout_and_chat_goes_on() {
    // Summaries made on the request's path (sync), due after a few exchanges; the summary
    // call's own timeout (`compression.timeout`, 2 minutes) is far longer than the bound.
    let memory = "[memory]\nrecent_n = 4\ncompression_threshold_tokens = 150\nrelevance_enabled = false\ncompression_async = false\ncompression_interval = \"PT0S\"\n";
    let Started { mock, proxy, .. } = Harness::new()
        .upstream(SHORT_READ)
        .config(memory)
        .start()
        .await;

    mock.push_summary(Reply::Stall { chunks: 1 });
    let mut stand_in_seen = false;
    for i in 0..12 {
        let text = format!("Fact number {i}: the blue lantern stands on shelf {i}");
        let answer = tokio::time::timeout(BOUND, chat(&proxy, "sum", &body(&[user(&text)]), &[]))
            .await
            .expect("a chat request waited on a stalled summary call");
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("x-memory-status"), "stored");
        if answer.header("x-memory-summary").ends_with("heuristic") {
            stand_in_seen = true;
            break;
        }
    }
    assert!(stand_in_seen, "the stalled summary call never failed");
    assert_eq!(mock.summary_requests().len(), 1);
}
