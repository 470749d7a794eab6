//! Streaming through the real proxy: SSE is teed chunk by chunk, byte-identical, and stored
//! only when it completes.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use crate::support::mock_upstream::{MockOptions, Reply};
use crate::support::*;

fn stream_body(text: &str) -> Value {
    json!({"model": "gpt-4o-mini", "stream": true, "stream_options": {"include_usage": true}, "messages": [user(text)]})
}

async fn open_stream(
    proxy: &Proxy,
    conversation: &str,
    body: &Value,
) -> http::Response<hyper::body::Incoming> {
    let request = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("accept", "application/json")
        .header("x-memory-conversation-id", conversation)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    client().request(request).await.unwrap()
}

#[tokio::test]
async fn a_stream_reaches_the_client_byte_identical_and_is_stored() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    let response = open_stream(&proxy, "s", &stream_body("tell me")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-memory-status"], "stored");
    assert_eq!(response.headers()["x-memory-turns"], "2");
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let through_proxy = response.into_body().collect().await.unwrap().to_bytes();
    // Stored by the time the client saw the end of the stream: no waiting.
    assert_eq!(
        summarize(&proxy.stored(Some(TOKEN), "s")),
        ["user:tell me", "assistant:reply to: tell me"]
    );

    // The same forwarded request sent straight to the mock gives the same bytes.
    let forwarded = mock.chat_requests().pop().unwrap();
    let direct = send(
        "POST",
        &format!("{}/chat/completions", mock.base_url()),
        &[],
        forwarded.body.clone(),
    )
    .await;
    assert_eq!(through_proxy, direct.body);
    assert!(through_proxy.ends_with(b"data: [DONE]\n\n"));
}

#[tokio::test]
async fn chunks_arrive_as_the_upstream_sends_them() {
    let options = MockOptions {
        stream_chunks: 6,
        chunk_delay: Duration::from_millis(150),
        record: true,
        strict: true,
    };
    let Started { proxy, .. } = Harness::new().mock(options).start().await;

    let started = Instant::now();
    let mut body = open_stream(&proxy, "slow", &stream_body("one two three four five six"))
        .await
        .into_body();
    let mut arrivals = Vec::new();
    while let Some(frame) = body.frame().await {
        if frame.unwrap().data_ref().is_some() {
            arrivals.push(started.elapsed());
        }
    }
    // Nine events sent 150 ms apart. Buffering would hand them over together; streamed, they
    // arrive spread over about as long as the upstream took to send them. (Measured from the
    // first frame, so a slow start on a busy machine does not matter.)
    assert!(arrivals.len() >= 6, "{arrivals:?}");
    let spread = *arrivals.last().unwrap() - arrivals[0];
    assert!(
        spread >= Duration::from_millis(600),
        "frames arrived within {spread:?}: {arrivals:?}"
    );
    assert_eq!(proxy.stored(Some(TOKEN), "slow").len(), 2);
}

#[tokio::test]
async fn streamed_tool_calls_are_merged_and_stored() {
    let Started { mock, proxy, .. } = Harness::new().start().await;
    mock.push(Reply::ToolCalls(vec![
        (
            "call_1".into(),
            "get_weather".into(),
            r#"{"city":"Paris","unit":"c"}"#.into(),
        ),
        ("call_2".into(), "get_time".into(), r#"{"tz":"CET"}"#.into()),
    ]));
    let body = open_stream(&proxy, "tools", &stream_body("weather?"))
        .await
        .into_body();
    body.collect().await.unwrap();
    let stored = proxy.stored(Some(TOKEN), "tools");
    let reply: Value = serde_json::from_str(stored[1].message.get()).unwrap();
    assert_eq!(
        reply["tool_calls"][0]["function"]["arguments"],
        r#"{"city":"Paris","unit":"c"}"#
    );
    assert_eq!(reply["tool_calls"][1]["id"], "call_2");

    // The client continues with the tool results (full re-send habit, JSON this time).
    let history = json!({"model": "m", "messages": [
        user("weather?"),
        {"role": "assistant", "content": null, "tool_calls": reply["tool_calls"]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "10:00"},
    ]});
    let answer = chat(&proxy, "tools", &history, &[]).await;
    assert_eq!(answer.header("x-memory-turns"), "5");
    memproxy::message::check_tool_sequence(&mock.last_messages()).unwrap();
}

#[tokio::test]
async fn a_stream_cut_midway_or_unfinished_stores_nothing() {
    // Paced, so the client holds the first chunks before the cut.
    let options = MockOptions {
        chunk_delay: Duration::from_millis(50),
        ..MockOptions::default()
    };
    let Started { mock, proxy, .. } = Harness::new().mock(options).start().await;

    mock.push(Reply::CutStream { chunks: 2 });
    let mut body = open_stream(&proxy, "cut", &stream_body("hi"))
        .await
        .into_body();
    let mut failed = false;
    let mut received = 0;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(_) => received += 1,
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    assert!(received >= 1, "the first chunks arrived");
    assert!(failed, "the client sees the stream break");

    mock.push(Reply::UnfinishedStream);
    open_stream(&proxy, "cut", &stream_body("hi"))
        .await
        .into_body()
        .collect()
        .await
        .unwrap();
    assert!(proxy.stored(Some(TOKEN), "cut").is_empty());

    // The conversation is intact: the next exchange stores normally.
    open_stream(&proxy, "cut", &stream_body("hi"))
        .await
        .into_body()
        .collect()
        .await
        .unwrap();
    assert_eq!(proxy.stored(Some(TOKEN), "cut").len(), 2);
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_stores_nothing() {
    let options = MockOptions {
        stream_chunks: 8,
        chunk_delay: Duration::from_millis(100),
        record: true,
        strict: true,
    };
    let Started { proxy, .. } = Harness::new().mock(options).start().await;

    let mut body = open_stream(&proxy, "gone", &stream_body("a long answer please"))
        .await
        .into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some());
    drop(body);
    // Longer than the whole stream would have taken.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(proxy.stored(Some(TOKEN), "gone").is_empty());
}

#[tokio::test]
async fn persist_false_streams_without_storing() {
    // It sends no credential: memory for such requests must be allowed.
    let Started { proxy, .. } = Harness::new().config(ANONYMOUS_MEMORY).start().await;
    let request = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("x-memory-conversation-id", "p")
        .header("x-memory-persist", "false")
        .body(Full::new(Bytes::from(stream_body("x").to_string())))
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.headers()["x-memory-status"], "not-stored");
    response.into_body().collect().await.unwrap();
    assert!(proxy.stored(None, "p").is_empty());
}

#[tokio::test]
async fn shutdown_lets_a_stream_in_flight_finish_and_stores_it() {
    let options = MockOptions {
        stream_chunks: 6,
        chunk_delay: Duration::from_millis(100),
        record: true,
        strict: true,
    };
    let Started { proxy, .. } = Harness::new().mock(options).start().await;
    let state = std::sync::Arc::clone(&proxy.state);
    let addr = proxy.addr;

    let mut body = open_stream(&proxy, "drain", &stream_body("finish me please"))
        .await
        .into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some());
    // SIGTERM arrives mid-stream.
    let stopping = tokio::spawn(proxy.stop());
    let rest = body.collect().await.unwrap().to_bytes();
    assert!(
        rest.ends_with(b"data: [DONE]\n\n"),
        "the stream ran to its end"
    );
    stopping.await.unwrap();
    assert_eq!(
        summarize(&stored_in(
            &state.memory().unwrap().store,
            Some(TOKEN),
            "drain"
        )),
        [
            "user:finish me please",
            "assistant:reply to: finish me please"
        ]
    );
    // No longer accepting.
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}
