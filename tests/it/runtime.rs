//! `server.runtime`: single-thread runtimes, each accepting on the port itself (`"per-thread"`,
//! the default on Linux), and one runtime whose workers share every connection (`"shared"`)
//! serve pass-through, memory (JSON and streamed) and drain on stop alike.

use std::time::Duration;

use serde_json::json;
use tokio::task::JoinSet;

use crate::support::*;

/// The serving threads of a runtime per thread alive in this process (nextest runs each test in
/// its own), by their names.
#[cfg(target_os = "linux")]
fn serving_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("memproxy-srv-"))
        .count()
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_runtime_per_thread_serves_memory_and_pass_through_and_drains_on_stop() {
    serves_memory_and_pass_through_and_drains("per-thread", 3).await;
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_shared_runtime_serves_memory_and_pass_through_and_drains_on_stop() {
    serves_memory_and_pass_through_and_drains("shared", 0).await;
}

#[test]
fn the_default_shape_is_a_runtime_per_thread_on_linux_and_shared_elsewhere() {
    let config = memproxy::config::from_toml("", &|_| None).unwrap();
    let expected = if cfg!(target_os = "linux") {
        memproxy::config::RuntimeShape::PerThread
    } else {
        memproxy::config::RuntimeShape::Shared
    };
    assert_eq!(config.runtime, expected);
}

/// Three serving threads in `shape`, `threads` of them named as a runtime per thread's.
#[cfg(target_os = "linux")]
async fn serves_memory_and_pass_through_and_drains(shape: &str, threads: usize) {
    let Started { dir, proxy, .. } = Harness::new()
        .config(&format!(
            "runtime = \"{shape}\"\nworker_threads = 3\nshutdown_grace = \"PT10S\"\n"
        ))
        .start()
        .await;
    // The threads start once the server's task runs.
    for _ in 0..100 {
        if serving_threads() == threads {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(serving_threads(), threads);

    // Pass-through from 24 clients at once, each on a connection of its own (the kernel spreads
    // them over the three listeners).
    let url = proxy.url("/v1/chat/completions");
    let mut clients = JoinSet::new();
    for i in 0..24 {
        let url = url.clone();
        clients.spawn(async move {
            let body = json!({"model": "gpt-4o-mini", "messages": [user(&format!("hello {i}"))]});
            send(
                "POST",
                &url,
                &[
                    ("authorization", &format!("Bearer {TOKEN}")),
                    ("content-type", "application/json"),
                ],
                body.to_string(),
            )
            .await
        });
    }
    while let Some(answer) = clients.join_next().await {
        let answer = answer.unwrap();
        assert_eq!(answer.status, 200);
        assert!(answer.headers.get("x-memory-status").is_none());
    }

    // Memory: eight conversations at once, two turns each, the second a full history.
    let mut conversations = JoinSet::new();
    for c in 0..8 {
        let proxy_url = proxy.url("");
        conversations.spawn(async move {
            let conversation = format!("pt-{c}");
            let headers = |id: &str| {
                vec![
                    ("authorization".to_string(), format!("Bearer {TOKEN}")),
                    ("content-type".to_string(), "application/json".to_string()),
                    ("x-memory-conversation-id".to_string(), id.to_string()),
                ]
            };
            let post = |messages: Vec<serde_json::Value>| {
                let url = format!("{proxy_url}/v1/chat/completions");
                let headers = headers(&conversation);
                async move {
                    let headers: Vec<(&str, &str)> = headers
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    send("POST", &url, &headers, body(&messages).to_string()).await
                }
            };
            let first = post(vec![user(&format!("my locker is number {c}"))]).await;
            assert_eq!(first.status, 200);
            assert_eq!(first.headers["x-memory-status"], "stored");
            let second = post(vec![
                user(&format!("my locker is number {c}")),
                reply_message(&first),
                user("which locker is mine?"),
            ])
            .await;
            assert_eq!(second.status, 200);
            assert_eq!(second.headers["x-memory-status"], "stored");
            assert_eq!(second.headers["x-memory-turns"], "4");
        });
    }
    while let Some(done) = conversations.join_next().await {
        done.unwrap();
    }

    // A stream, stored once it completes.
    let streamed = chat(
        &proxy,
        "pt-stream",
        &json!({"model": "gpt-4o-mini", "stream": true, "messages": [user("stream this")]}),
        &[],
    )
    .await;
    assert_eq!(streamed.status, 200);
    assert_eq!(streamed.headers["x-memory-status"], "stored");
    assert!(streamed.body.ends_with(b"data: [DONE]\n\n"));

    tokio::time::timeout(Duration::from_secs(30), proxy.stop())
        .await
        .expect("the runtimes drain and the store flushes within the grace period");
    assert_eq!(serving_threads(), 0, "every serving thread ended");

    // What was acknowledged is in the store, opened again as a restart would.
    let store = reopen(dir.path());
    for c in 0..8 {
        assert_eq!(stored_in(&store, Some(TOKEN), &format!("pt-{c}")).len(), 4);
    }
    assert_eq!(stored_in(&store, Some(TOKEN), "pt-stream").len(), 2);
}

#[test]
fn a_runtime_shape_memproxy_does_not_know_is_refused_naming_the_setting() {
    let err =
        memproxy::config::from_toml("[server]\nruntime = \"fibers\"\n", &|_| None).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("server.runtime"), "{text}");
    assert!(text.contains("per-thread"), "{text}");
}
