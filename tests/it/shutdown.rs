//! Shutdown that loses nothing: streams in flight at SIGTERM finish and are stored before the
//! store closes; a stream still open when the grace period ends is cut and stores nothing.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::json;

use crate::support::mock_upstream::MockOptions;
use crate::support::*;

async fn open_stream(proxy: &Proxy, conversation: &str) -> hyper::body::Incoming {
    let body = json!({"model": "gpt-4o-mini", "stream": true,
        "messages": [user(&format!("question of {conversation}"))]});
    let request = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("x-memory-conversation-id", conversation)
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-memory-status"], "stored");
    response.into_body()
}

#[tokio::test]
async fn twenty_streams_in_flight_at_sigterm_all_complete_and_are_stored() {
    let options = MockOptions {
        stream_chunks: 8,
        chunk_delay: Duration::from_millis(100),
        record: false,
        strict: true,
    };
    let Started { dir, proxy, .. } = Harness::new()
        .mock(options)
        .config("shutdown_grace = \"PT20S\"\n")
        .start()
        .await;

    let mut bodies = Vec::new();
    for i in 0..20 {
        let mut body = open_stream(&proxy, &format!("s{i}")).await;
        // Each stream is under way: its first frame has arrived.
        assert!(body.frame().await.unwrap().unwrap().data_ref().is_some());
        bodies.push(body);
    }
    // SIGTERM with all 20 in flight.
    let stopping = tokio::spawn(proxy.stop());
    let readers: Vec<_> = bodies
        .into_iter()
        .map(|body| tokio::spawn(async move { body.collect().await.unwrap().to_bytes() }))
        .collect();
    for reader in readers {
        let rest = reader.await.unwrap();
        assert!(
            rest.ends_with(b"data: [DONE]\n\n"),
            "every stream ran to its end"
        );
    }
    stopping.await.unwrap();

    let store = reopen(dir.path());
    for i in 0..20 {
        let conversation = format!("s{i}");
        assert_eq!(
            summarize(&stored_in(&store, Some(TOKEN), &conversation)),
            [
                format!("user:question of {conversation}"),
                format!("assistant:reply to: question of {conversation}")
            ],
            "{conversation}"
        );
    }
    store.close().await.unwrap();
}

#[tokio::test]
async fn a_stream_open_past_the_grace_period_is_cut_and_stores_nothing() {
    let options = MockOptions {
        stream_chunks: 20,
        chunk_delay: Duration::from_millis(300),
        record: false,
        strict: true,
    };
    let Started { dir, proxy, .. } = Harness::new()
        .mock(options)
        .config("shutdown_grace = \"PT1S\"\n")
        .start()
        .await;

    let mut body = open_stream(&proxy, "slow").await;
    assert!(body.frame().await.unwrap().unwrap().data_ref().is_some());
    let started = Instant::now();
    let stopping = tokio::spawn(proxy.stop());
    // The client sees the stream cut, never its end.
    let rest = body.collect().await;
    assert!(
        rest.is_err() || !rest.unwrap().to_bytes().ends_with(b"data: [DONE]\n\n"),
        "the stream was cut"
    );
    stopping.await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "shutdown waited for the grace period only, not for the stream ({:?})",
        started.elapsed()
    );
    let store = reopen(dir.path());
    assert!(stored_in(&store, Some(TOKEN), "slow").is_empty());
    store.close().await.unwrap();
}
