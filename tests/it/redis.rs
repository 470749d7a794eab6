//! Replicas sharing one memory in Redis, through the real proxy: two memproxy instances (in
//! this process, each with its own caches) on one real redis-server started by the test.
//! Conversations written by one are served by the other, concurrent commits across replicas
//! store each exchange once and in order, a due summary is made once, a Redis that goes away
//! makes requests `degraded` (never failed) until it is back, and deletes leave no key.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::support;
use crate::support::child::{ChildProxy, ask};
use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::redis_server::RedisServer;
use crate::support::*;

/// Two replicas on `redis` in front of one mock, each with its own data directory (which it
/// keeps).
async fn replicas(redis: &RedisServer, extra_toml: &str) -> (Arc<MockUpstream>, Proxy, Proxy) {
    let replica = || Harness::new().redis(redis).config(extra_toml);
    let Started { mock, proxy: a, .. } = replica().start().await;
    let dir_b = tempfile::tempdir().unwrap();
    let b = replica().proxy_on(&mock, dir_b.path()).await.keeping(dir_b);
    (mock, a, b)
}

fn stored(proxy: &Proxy, conversation: &str) -> Vec<String> {
    summarize(&stored_now(proxy.store(), &key(Some(TOKEN), conversation)))
}

fn forwarded_text(messages: &[Value]) -> String {
    messages
        .iter()
        .map(|m| m["content"].as_str().unwrap_or("").to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

async fn wait_for(what: &str, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_replica_serves_what_the_other_committed_after_caching_the_conversation() {
    let redis = RedisServer::start();
    let (mock, a, b) = replicas(&redis, "").await;

    // A caches the conversation (its state and, through a search, its recall index).
    let first = chat(&a, "c", &body(&[user("hello from a")]), &[]).await;
    assert_eq!(first.header("x-memory-status"), "stored");
    // B commits three exchanges A has not seen.
    for i in 1..=3 {
        let answer = chat(&b, "c", &body(&[user(&format!("fact {i} via b"))]), &[]).await;
        assert_eq!(answer.header("x-memory-turns"), (2 + 2 * i).to_string());
    }
    // A's next prompt carries them, in order, and A stores after them.
    let answer = chat(&a, "c", &body(&[user("back on a")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(answer.header("x-memory-turns"), "10");
    let forwarded: Vec<String> = mock.last_messages().iter().map(role_content).collect();
    assert_eq!(
        forwarded,
        [
            "user:hello from a",
            "assistant:reply to: hello from a",
            "user:fact 1 via b",
            "assistant:reply to: fact 1 via b",
            "user:fact 2 via b",
            "assistant:reply to: fact 2 via b",
            "user:fact 3 via b",
            "assistant:reply to: fact 3 via b",
            "user:back on a",
        ]
    );
    assert_eq!(stored(&b, "c").len(), 10);
    assert_eq!(stored(&a, "c"), stored(&b, "c"));
}

#[tokio::test]
async fn two_replicas_alternating_30_turns_store_60_messages_once_and_recall_turn_3() {
    let redis = RedisServer::start();
    let (mock, a, b) = replicas(&redis, "").await;

    // The SDK habit (the whole history every time), each turn on the other replica.
    let mut history = vec![json!({"role": "system", "content": "be brief"})];
    for turn in 1..=30 {
        let text = match turn {
            3 => "My locker code is 7291 and my cat is called Quillfeather.".to_string(),
            30 => "What is my cat called?".to_string(),
            n => format!("Small talk number {n} about the weather"),
        };
        history.push(user(&text));
        let proxy = if turn % 2 == 1 { &a } else { &b };
        let answer = chat(proxy, "alt", &body(&history), &[]).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.header("x-memory-status"), "stored", "turn {turn}");
        assert_eq!(answer.header("x-memory-turns"), (2 * turn).to_string());
        history.push(reply_message(&answer));
    }
    let all = stored(&a, "alt");
    assert_eq!(all.len(), 60);
    assert_eq!(all, stored(&b, "alt"));
    for turn in 1..=30 {
        assert!(all[2 * (turn - 1)].starts_with("user:"), "{all:?}");
        assert!(all[2 * turn - 1].starts_with("assistant:reply to: "));
    }
    // Turn 30 was served by B; the fact of turn 3 (long out of the window) was recalled.
    let forwarded = forwarded_text(&mock.last_messages());
    assert!(forwarded.contains("Quillfeather"), "{forwarded}");
}

#[tokio::test]
async fn concurrent_requests_across_replicas_store_each_exchange_once_in_order() {
    let redis = RedisServer::start();
    let (_mock, a, b) = replicas(&redis, "").await;
    let (a, b) = (std::sync::Arc::new(a), std::sync::Arc::new(b));

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..20 {
        let proxy = std::sync::Arc::clone(if i % 2 == 0 { &a } else { &b });
        tasks.spawn(async move {
            let answer = chat(&proxy, "burst", &body(&[user(&format!("q{i}"))]), &[]).await;
            assert_eq!(answer.status, 200);
            answer.header("x-memory-status").to_string()
        });
    }
    while let Some(status) = tasks.join_next().await {
        assert_eq!(status.unwrap(), "stored");
    }
    let all = stored(&a, "burst");
    assert_eq!(all.len(), 40, "{all:?}");
    let mut questions = Vec::new();
    for pair in all.chunks(2) {
        let question = pair[0].strip_prefix("user:").unwrap();
        assert_eq!(pair[1], format!("assistant:reply to: {question}"));
        questions.push(question.to_string());
    }
    questions.sort();
    questions.dedup();
    assert_eq!(questions.len(), 20);
}

#[tokio::test]
async fn a_summary_due_with_both_replicas_serving_is_made_once() {
    let redis = RedisServer::start();
    let settings =
        "[memory]\nrecent_n = 4\ncompression_threshold_tokens = 150\nrelevance_enabled = false\n";
    let (mock, a, b) = replicas(&redis, settings).await;
    // The summary call takes a while: both replicas want it while it runs.
    for _ in 0..4 {
        mock.push_summary(Reply::Delay(
            Duration::from_millis(800),
            Box::new(Reply::Auto),
        ));
    }
    let line =
        |i: usize| format!("Fact {i}: the blue lantern stands on shelf {i} in the north storeroom");
    for round in 0..6 {
        let (one, two) = (
            body(&[user(&line(2 * round))]),
            body(&[user(&line(2 * round + 1))]),
        );
        let (first, second) = tokio::join!(chat(&a, "sum", &one, &[]), chat(&b, "sum", &two, &[]));
        assert_eq!(first.status, 200);
        assert_eq!(second.status, 200);
        if !mock.summary_requests().is_empty() {
            break;
        }
    }
    // Both keep serving while the one summary call runs.
    for i in 0..3 {
        chat(&a, "sum", &body(&[user(&format!("more {i}"))]), &[]).await;
        chat(&b, "sum", &body(&[user(&format!("again {i}"))]), &[]).await;
    }
    let key = key(Some(TOKEN), "sum");
    wait_for("the summary record", async || {
        let store = a.store();
        let id = store.meta(&key).unwrap().unwrap().id;
        store
            .latest_summary(&key, id)
            .unwrap()
            .is_some_and(|r| !r.heuristic)
    })
    .await;
    assert_eq!(mock.summary_requests().len(), 1);
    // The record lives in Redis: the other replica reads it, and no Markdown copy was written.
    let id = b.store().meta(&key).unwrap().unwrap().id;
    assert!(b.store().latest_summary(&key, id).unwrap().is_some());
    assert!(!memproxy::store::workspace_dir(b.store().data_dir(), &key).exists());
    assert!(!memproxy::store::workspace_dir(a.store().data_dir(), &key).exists());
}

#[tokio::test]
async fn redis_going_away_makes_requests_degraded_and_memory_comes_back_with_nothing_lost() {
    let mut redis = RedisServer::start();
    let Started { mock, proxy, .. } = Harness::new().redis(&redis).start().await;
    for i in 0..5 {
        let answer = chat(&proxy, "d", &body(&[user(&format!("before {i}"))]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }

    redis.kill();
    for i in 0..3 {
        let answer = chat(&proxy, "d", &body(&[user(&format!("while down {i}"))]), &[]).await;
        assert_eq!(
            answer.status, 200,
            "a memory failure never fails the request"
        );
        assert_eq!(answer.header("x-memory-status"), "degraded");
        assert!(!answer.header("x-memory-reason").is_empty());
        // The client's own messages went upstream.
        assert_eq!(
            forwarded_text(&mock.last_messages()),
            format!("while down {i}")
        );
    }
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 503);
    assert!(
        String::from_utf8_lossy(&ready.body).contains("cannot be reached"),
        "{:?}",
        ready.body
    );
    // Pass-through is unaffected.
    let models = send(
        "GET",
        &proxy.url("/v1/models"),
        &[("authorization", "Bearer sk-test-one")],
        "",
    )
    .await;
    assert_eq!(models.status, 200);

    // Restarted with `appendfsync always`: everything acknowledged is there, and memory is
    // back on its own.
    redis.restart();
    wait_for("memory to come back", async || {
        let answer = chat(&proxy, "d", &body(&[user("after")]), &[]).await;
        answer.header("x-memory-status") == "stored"
    })
    .await;
    let all = stored(&proxy, "d");
    let questions: Vec<&String> = all.iter().filter(|m| m.starts_with("user:")).collect();
    assert_eq!(
        questions,
        [
            "user:before 0",
            "user:before 1",
            "user:before 2",
            "user:before 3",
            "user:before 4",
            "user:after"
        ]
    );
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 200);
}

#[tokio::test]
async fn a_replica_started_while_redis_is_down_gets_memory_once_it_is_up() {
    let mut redis = RedisServer::start();
    redis.kill();
    let Started { proxy, .. } = Harness::new().redis(&redis).start().await;
    let answer = chat(&proxy, "late", &body(&[user("anyone there?")]), &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "degraded");
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 503);

    redis.restart();
    wait_for("memory to come back", async || {
        let answer = chat(&proxy, "late", &body(&[user("now?")]), &[]).await;
        answer.header("x-memory-status") == "stored"
    })
    .await;
    assert_eq!(
        send("GET", &proxy.url("/readyz"), &[], "").await.status,
        200
    );
}

/// Every key in the Redis server (the whole keyspace, not only memproxy's prefix).
fn all_keys(redis: &RedisServer) -> String {
    redis.command("KEYS *")
}

#[tokio::test]
async fn conversation_and_tenant_deletes_leave_no_key_in_redis() {
    let redis = RedisServer::start();
    let Started { proxy, .. } = Harness::new()
        .admin()
        .storage(&format!(
            "backend = \"redis\"\nredis_url = \"{}\"\nredis_key_prefix = \"mp:\"\n",
            redis.url()
        ))
        .start()
        .await;
    let ttl = [("x-memory-ttl", "P1D")];
    for conversation in ["one", "two"] {
        for i in 0..3 {
            let answer = chat(
                &proxy,
                conversation,
                &body(&[user(&format!("{conversation} {i}"))]),
                &ttl,
            )
            .await;
            assert_eq!(answer.header("x-memory-status"), "stored");
        }
    }
    let branchy = [user("a"), assistant("b"), user("c")];
    chat(&proxy, "one", &body(&branchy), &[]).await;
    let before = all_keys(&redis);
    assert!(before.contains("mp:{"), "{before}");
    assert!(before.contains("mp:idx:conv"), "{before}");
    assert!(before.contains("mp:idx:ttl"), "{before}");

    let path = support::admin::conversation_path(TOKEN, "default", "one");
    let deleted = support::admin::admin(&proxy, "DELETE", &path, "").await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);
    let tenant = format!("/admin/v1/tenants/{}", support::admin::tenant(TOKEN));
    let deleted = support::admin::admin(&proxy, "DELETE", &tenant, "").await;
    assert_eq!(deleted.status, 200, "{:?}", deleted.body);

    // Only the id counter is left: no conversation key, no index entry, no key.
    let after = all_keys(&redis);
    assert!(!after.contains("mp:{"), "{after}");
    assert!(!after.contains("idx"), "{after}");
    assert!(after.contains("mp:ids"), "{after}");
}

/// The real binary as a replica (a child process, so it can be killed with SIGKILL), on
/// `redis` with the tests' key prefix.
fn replica(dir: &std::path::Path, mock: &MockUpstream, redis: &RedisServer) -> ChildProxy {
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\n[storage]\ndata_dir = \"{}\"\nbackend = \"redis\"\nredis_url = \"{}\"\nredis_key_prefix = \"mp:\"\n",
        mock.base_url(),
        dir.join("data").display(),
        redis.url()
    );
    ChildProxy::start(dir, &toml)
}

#[tokio::test]
async fn every_exchange_a_killed_replica_acknowledged_is_readable_through_the_other() {
    let mock = MockUpstream::start().await.unwrap();
    let redis = RedisServer::start();
    let killed_dir = tempfile::tempdir().unwrap();
    let mut killed = replica(killed_dir.path(), &mock, &redis);
    killed.ready().await;
    let dir = tempfile::tempdir().unwrap();
    let other = Proxy::start_redis(&mock, dir.path(), &redis.url(), "").await;

    // Eight clients, each asking in its own conversation, one question after the other.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..8 {
        let (base, stop) = (killed.url.clone(), std::sync::Arc::clone(&stop));
        clients.spawn(async move {
            let mut acknowledged = Vec::new();
            for i in 0..200 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let question = format!("client {c} question {i}");
                if ask(&base, &format!("burst-{c}"), &question).await {
                    acknowledged.push(question);
                } else {
                    break;
                }
            }
            (c, acknowledged)
        });
    }
    tokio::time::sleep(Duration::from_millis(700)).await;
    // kill -9 in the middle of the burst.
    killed.kill();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let mut total = 0;
    while let Some(done) = clients.join_next().await {
        let (c, acknowledged) = done.unwrap();
        total += acknowledged.len();
        let conversation = format!("burst-{c}");
        let stored = stored(&other, &conversation);
        for question in &acknowledged {
            let at = stored
                .iter()
                .position(|m| *m == format!("user:{question}"))
                .unwrap_or_else(|| panic!("{question} was acknowledged but is not stored"));
            assert_eq!(stored[at + 1], format!("assistant:reply to: {question}"));
        }
        // The survivor goes on with the conversation.
        let answer = chat(&other, &conversation, &body(&[user("after the kill")]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    assert!(
        total > 8,
        "the burst reached the replica: {total} exchanges"
    );
}

#[tokio::test]
async fn a_response_id_answered_by_one_replica_chains_on_the_other() {
    let redis = RedisServer::start();
    let (mock, a, b) = replicas(&redis, "").await;
    let post = |proxy: &Proxy, conversation: Option<&str>, body: Value| {
        let url = proxy.url("/v1/responses");
        let conversation = conversation.map(str::to_string);
        async move {
            let auth = format!("Bearer {TOKEN}");
            let mut headers = vec![
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ];
            if let Some(c) = &conversation {
                headers.push(("x-memory-conversation-id", c.as_str()));
            }
            send("POST", &url, &headers, body.to_string()).await
        }
    };
    let first = post(
        &a,
        Some("shared-chain"),
        json!({"model": "m", "input": "the code word is kestrel"}),
    )
    .await;
    let id = first.json()["id"].as_str().unwrap().to_string();
    let chained = post(
        &b,
        None,
        json!({"model": "m", "input": "the code word?", "previous_response_id": id}),
    )
    .await;
    assert_eq!(chained.header("x-memory-status"), "stored");
    assert_eq!(chained.header("x-memory-conversation-id"), "shared-chain");
    let forwarded = mock.responses_requests().last().unwrap().json().to_string();
    assert!(forwarded.contains("kestrel"));
    assert_eq!(stored(&a, "shared-chain").len(), 4);
    // Another tenant presenting the id gets nothing.
    let other = send(
        "POST",
        &b.url("/v1/responses"),
        &[
            ("authorization", "Bearer sk-someone-else"),
            ("content-type", "application/json"),
        ],
        json!({"model": "m", "input": "x", "previous_response_id": id}).to_string(),
    )
    .await;
    assert_eq!(other.header("x-memory-reason"), "unknown-previous-response");
    // A delete through one replica leaves no key of the ids behind.
    let second = chained.json()["id"].as_str().unwrap().to_string();
    a.state
        .memory()
        .unwrap()
        .delete_conversation(&key(Some(TOKEN), "shared-chain"))
        .unwrap()
        .unwrap();
    let keys = all_keys(&redis);
    assert!(!keys.contains(":rid:"), "{keys}");
    assert!(!keys.contains(":r:"), "{keys}");
    let after = post(
        &b,
        None,
        json!({"model": "m", "input": "x", "previous_response_id": second}),
    )
    .await;
    assert_eq!(after.header("x-memory-reason"), "unknown-previous-response");
}
