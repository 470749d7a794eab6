//! `server.memory_budget` through the real proxy: past the high-water mark a chat request is
//! served with memory off (forwarded untouched, `X-Memory-Status: degraded`, nothing stored)
//! and counted; admin operations that read or build a whole body get 503 with `Retry-After`;
//! once the RSS is under the mark again, memory is back. The RSS is pretended through the
//! memory guard's seam (`MemoryGuard::pretend_resident`), so no test depends on how much
//! memory the test process really holds.

use serde_json::{Value, json};

use crate::support::admin::*;
use crate::support::child::{ChildProxy, try_send};
use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

const MIB: u64 = 1024 * 1024;

/// `server.memory_budget` of these tests: 128 MiB, whose high-water mark is 120 MiB.
const BUDGET: &str = "memory_budget = \"128MiB\"\n";
const HIGH_WATER: u64 = 120 * MIB;

/// The value of one sample of the scrape: the line `name{labels} value`.
async fn metric(proxy: &Proxy, line_start: &str) -> f64 {
    let answer = send("GET", &proxy.url("/metrics"), &[], "").await;
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(line_start)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample `{line_start}` in:\n{text}"))
}

async fn refused(proxy: &Proxy, action: &str, reason: &str) -> f64 {
    metric(
        proxy,
        &format!("memproxy_admission_refused_total{{action=\"{action}\",reason=\"{reason}\"}}"),
    )
    .await
}

fn contents(messages: &[Value]) -> Vec<String> {
    messages.iter().map(role_content).collect()
}

#[tokio::test]
async fn past_the_high_water_mark_chat_goes_on_with_memory_off_and_comes_back_under_it() {
    let Started { mock, proxy, .. } = Harness::new().config(BUDGET).start().await;
    let guard = &proxy.state.memory_guard;
    assert_eq!(guard.budget().high_water, HIGH_WATER);

    // Under the mark: memory on.
    guard.pretend_resident(Some(64 * MIB));
    let first = chat(&proxy, "c1", &body(&[user("one")]), &[]).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-memory-status"), "stored");
    assert_eq!(proxy.stored(Some(TOKEN), "c1").len(), 2);

    // At the mark: the client's own request goes upstream untouched, nothing is stored, the
    // answer is the upstream's, JSON and stream alike.
    guard.pretend_resident(Some(HIGH_WATER));
    let sent = json!({"model": "gpt-4o-mini", "messages": [user("two")], "temperature": 0.5});
    let degraded = chat(&proxy, "c1", &sent, &[]).await;
    assert_eq!(degraded.status, 200);
    assert_eq!(degraded.header("x-memory-status"), "degraded");
    assert_eq!(degraded.header("x-memory-conversation-id"), "c1");
    assert_eq!(
        degraded.json()["choices"][0]["message"]["content"],
        "reply to: two"
    );
    let forwarded = mock.chat_requests().last().unwrap().clone();
    assert_eq!(forwarded.json(), sent, "forwarded untouched");
    assert!(forwarded.headers.get("x-memory-conversation-id").is_none());

    let mut streamed = body(&[user("three")]);
    streamed["stream"] = Value::Bool(true);
    let stream = chat(&proxy, "c1", &streamed, &[]).await;
    assert_eq!(stream.status, 200);
    assert_eq!(stream.header("x-memory-status"), "degraded");
    assert!(stream.body.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(contents(&mock.last_messages()), ["user:three"]);
    assert_eq!(proxy.stored(Some(TOKEN), "c1").len(), 2, "nothing stored");

    assert_eq!(refused(&proxy, "degraded", "resident").await, 2.0);
    assert_eq!(refused(&proxy, "degraded", "in_flight").await, 0.0);
    assert_eq!(
        metric(&proxy, "memproxy_resident_memory_bytes").await,
        HIGH_WATER as f64
    );
    assert_eq!(
        metric(&proxy, "memproxy_memory_budget_bytes").await,
        (128 * MIB) as f64
    );
    assert_eq!(
        metric(&proxy, "memproxy_memory_high_water_bytes").await,
        HIGH_WATER as f64
    );

    // Under the mark, but not with this request's body: memory off for it alone.
    guard.pretend_resident(Some(HIGH_WATER - 2 * MIB));
    let big = "x".repeat(MIB as usize);
    let answer = chat(&proxy, "c1", &body(&[user(&big)]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "degraded");
    assert_eq!(refused(&proxy, "degraded", "in_flight").await, 1.0);
    let small = chat(&proxy, "c1", &body(&[user("four")]), &[]).await;
    assert_eq!(small.header("x-memory-status"), "stored");

    // Under it again: memory is back, the stored history with it.
    guard.pretend_resident(Some(64 * MIB));
    let back = chat(&proxy, "c1", &body(&[user("five")]), &[]).await;
    assert_eq!(back.header("x-memory-status"), "stored");
    let prompt = contents(&mock.last_messages());
    assert_eq!(
        prompt,
        [
            "user:one",
            "assistant:reply to: one",
            "user:four",
            "assistant:reply to: four",
            "user:five"
        ]
    );
    assert_eq!(proxy.stored(Some(TOKEN), "c1").len(), 6);
    // Every reservation was given back with its response.
    assert_eq!(guard.reserved_bytes(), 0);
    assert_eq!(metric(&proxy, "memproxy_memory_in_flight_bytes").await, 0.0);
    proxy.stop().await;
}

#[tokio::test]
async fn past_the_high_water_mark_admin_bodies_get_503_and_the_rest_is_served() {
    let Started { proxy, .. } = Harness::new().admin().config(BUDGET).start().await;
    let guard = &proxy.state.memory_guard;
    guard.pretend_resident(Some(64 * MIB));
    assert_eq!(
        chat(&proxy, "c1", &body(&[user("one")]), &[])
            .await
            .header("x-memory-status"),
        "stored"
    );
    let path = format!("/admin/v1/conversations/{}/default/c1", tenant(TOKEN));

    guard.pretend_resident(Some(HIGH_WATER + MIB));
    let preview_body = body(&[user("two")]).to_string();
    for (method, action, body) in [
        ("POST", "/preview", preview_body.as_str()),
        ("GET", "/export", ""),
        ("POST", "/import", "{}"),
    ] {
        let answer = admin(&proxy, method, &format!("{path}{action}"), body).await;
        assert_eq!(answer.status, 503, "{action}");
        assert_eq!(answer.header("retry-after"), "1", "{action}");
        assert_eq!(
            answer.json()["error"]["code"],
            "memory_budget_exceeded",
            "{action}"
        );
    }
    assert_eq!(refused(&proxy, "unavailable", "resident").await, 3.0);
    // What reads little is served: show, stats, health, pass-through.
    assert_eq!(admin(&proxy, "GET", &path, "").await.status, 200);
    assert_eq!(
        admin(&proxy, "GET", &format!("{path}/stats"), "")
            .await
            .status,
        200
    );
    assert_eq!(
        send("GET", &proxy.url("/healthz"), &[], "").await.status,
        200
    );
    let models = send(
        "GET",
        &proxy.url("/v1/models"),
        &[("authorization", "Bearer sk-test-one")],
        "",
    )
    .await;
    assert_eq!(models.status, 200);

    guard.pretend_resident(Some(64 * MIB));
    let preview = admin(&proxy, "POST", &format!("{path}/preview"), &preview_body).await;
    assert_eq!(preview.status, 200);
    assert_eq!(refused(&proxy, "unavailable", "resident").await, 3.0);
    proxy.stop().await;
}

/// Polls the scrape until `line_start`'s sample satisfies `ok` (the relief thread ticks every
/// 250 ms), for at most 5 s; returns the last value.
async fn metric_until(proxy: &Proxy, line_start: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let mut value = metric(proxy, line_start).await;
    for _ in 0..50 {
        if ok(value) {
            return value;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        value = metric(proxy, line_start).await;
    }
    panic!("`{line_start}` never got there: {value}")
}

/// A request that would fit under the mark with the RSS alone, short of room only for what the
/// requests in flight reserved, waits for them to give it back and gets memory; held past
/// `server.memory_wait` (1 s by default), it goes with memory off, as one refused at once does.
#[tokio::test]
async fn a_request_short_of_room_for_the_requests_in_flight_waits_for_them() {
    let Started { mock, proxy, .. } = Harness::new().config(BUDGET).start().await;
    let guard = &proxy.state.memory_guard;
    guard.pretend_resident(Some(64 * MIB));
    let all_but_a_little = HIGH_WATER - 64 * MIB - 64 * 1024;
    let held = guard.admit(all_but_a_little).unwrap();
    let proxy_ref = &proxy;
    let one = body(&[user("one")]);
    let (answer, ()) = tokio::join!(chat(&proxy, "c1", &one, &[]), async move {
        metric_until(proxy_ref, "memproxy_memory_waiting ", |v| v == 1.0).await;
        drop(held);
    });
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(proxy.stored(Some(TOKEN), "c1").len(), 2);
    let waited = |result: &str| format!("memproxy_admission_waited_total{{result=\"{result}\"}}");
    assert_eq!(metric(&proxy, &waited("admitted")).await, 1.0);
    assert_eq!(metric(&proxy, &waited("refused")).await, 0.0);
    assert_eq!(refused(&proxy, "degraded", "in_flight").await, 0.0);
    assert_eq!(metric(&proxy, "memproxy_memory_waiting ").await, 0.0);

    // Never given back within the wait: memory off, the request forwarded as sent.
    let held = guard.admit(all_but_a_little).unwrap();
    let started = std::time::Instant::now();
    let sent = json!({"model": "gpt-4o-mini", "messages": [user("two")]});
    let answer = chat(&proxy, "c1", &sent, &[]).await;
    assert!(started.elapsed() >= memproxy::config::DEFAULT_MEMORY_WAIT);
    assert_eq!(answer.header("x-memory-status"), "degraded");
    assert_eq!(mock.chat_requests().last().unwrap().json(), sent);
    assert_eq!(metric(&proxy, &waited("refused")).await, 1.0);
    assert_eq!(refused(&proxy, "degraded", "in_flight").await, 1.0);
    // The RSS itself at the mark: refused at once, never waiting.
    guard.pretend_resident(Some(HIGH_WATER));
    let started = std::time::Instant::now();
    let answer = chat(&proxy, "c1", &body(&[user("three")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "degraded");
    assert!(started.elapsed() < memproxy::config::DEFAULT_MEMORY_WAIT);
    assert_eq!(metric(&proxy, &waited("refused")).await, 1.0);
    drop(held);
    guard.pretend_resident(Some(64 * MIB));
    assert_eq!(
        chat(&proxy, "c1", &body(&[user("four")]), &[])
            .await
            .header("x-memory-status"),
        "stored"
    );
    assert_eq!(proxy.stored(Some(TOKEN), "c1").len(), 4);
    proxy.stop().await;
}

/// `server.memory_wait` sets the wait: `PT0S` never waits, a shorter one gives up sooner.
#[tokio::test]
async fn memory_wait_sets_how_long_a_request_waits_for_room() {
    for (wait, waited) in [("PT0S", 0.0), ("PT0.2S", 1.0)] {
        let config = format!("{BUDGET}memory_wait = \"{wait}\"\n");
        let Started { proxy, .. } = Harness::new().config(&config).start().await;
        let guard = &proxy.state.memory_guard;
        guard.pretend_resident(Some(64 * MIB));
        let held = guard.admit(HIGH_WATER - 64 * MIB - 64 * 1024).unwrap();
        let started = std::time::Instant::now();
        let answer = chat(&proxy, "c1", &body(&[user("one")]), &[]).await;
        let took = started.elapsed();
        assert_eq!(answer.header("x-memory-status"), "degraded", "{wait}");
        assert!(took >= proxy.state.config.memory_wait, "{wait}: {took:?}");
        assert_eq!(
            metric(
                &proxy,
                "memproxy_admission_waited_total{result=\"refused\"}"
            )
            .await,
            waited,
            "{wait}"
        );
        assert_eq!(refused(&proxy, "degraded", "in_flight").await, 1.0);
        drop(held);
        proxy.stop().await;
    }
}

#[tokio::test]
async fn nearing_the_mark_the_caches_give_memory_back_least_recently_used_first_and_grow_again() {
    // A state cache of 64 KiB (floor 8 KiB), so a few conversations fill it.
    let Started { proxy, .. } = Harness::new()
        .config(BUDGET)
        .storage("state_cache_bytes = \"64KiB\"\n")
        .start()
        .await;
    let guard = &proxy.state.memory_guard;
    let memory = proxy.state.memory.as_ref().unwrap();
    let marks = guard.relief().marks();
    assert!(marks.aim < marks.shrink_above && marks.shrink_above < HIGH_WATER);
    guard.pretend_resident(Some(64 * MIB));

    // 40 conversations: more than the state cache's floor.
    for i in 0..40 {
        let answer = chat(&proxy, &format!("c{i}"), &body(&[user("hello")]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    // The stored messages' vectors are made in the background, which reads their
    // conversations: done before the caches shrink, so it cannot bring an old one back in
    // after (on a loaded machine it could, and c39 was then evicted by c0's job).
    crate::recall_meaning::embedded(&proxy).await;
    let state = "{cache=\"state\"}";
    let capacity = metric(&proxy, &format!("memproxy_cache_limit_bytes{state}")).await;
    assert_eq!(capacity, memory.store.state_cache().capacity() as f64);
    let full = metric(&proxy, &format!("memproxy_cache_bytes{state}")).await;
    assert!(full > capacity / 8.0 * 1.5, "{full} of {capacity}");
    assert_eq!(metric(&proxy, "memproxy_memory_pressure").await, 0.0);

    // Past the mark where the caches shrink, still under the high-water mark: the caches go
    // down to their floors (the pretended RSS never falls), and memory stays on.
    guard.pretend_resident(Some(marks.shrink_above + MIB));
    metric_until(&proxy, "memproxy_memory_pressure", |v| v == 2.0).await;
    let limit = metric(&proxy, &format!("memproxy_cache_limit_bytes{state}")).await;
    assert_eq!(limit, capacity / 8.0);
    let held = metric(&proxy, &format!("memproxy_cache_bytes{state}")).await;
    assert!(held <= limit, "{held} over {limit}");
    assert!(metric(&proxy, &format!("memproxy_cache_shrunk_bytes_total{state}")).await > 0.0);
    assert!(metric(&proxy, "memproxy_memory_shrinks_total").await >= 1.0);
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.json()["memory"], "on");
    // The least recently used went first: the newest conversation is still cached, the
    // oldest is read from the store again.
    let (_, misses) = memory.store.cache_counts();
    let newest = chat(&proxy, "c39", &body(&[user("still here?")]), &[]).await;
    assert_eq!(newest.header("x-memory-status"), "stored");
    assert_eq!(memory.store.cache_counts().1, misses, "c39 was cached");
    let oldest = chat(&proxy, "c0", &body(&[user("and you?")]), &[]).await;
    assert_eq!(oldest.header("x-memory-status"), "stored");
    assert_eq!(memory.store.cache_counts().1, misses + 1, "c0 was evicted");
    assert_eq!(proxy.stored(Some(TOKEN), "c0").len(), 4, "nothing lost");

    // At the high-water mark with nothing left to give: refused, and /readyz says why.
    guard.pretend_resident(Some(HIGH_WATER + MIB));
    let refused_now = chat(&proxy, "c1", &body(&[user("now?")]), &[]).await;
    assert_eq!(refused_now.header("x-memory-status"), "degraded");
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(
        ready.status, 200,
        "memory off is no reason to take the pod out"
    );
    assert_eq!(ready.json()["memory"], "off");
    let reason = ready.json()["memory_reason"].as_str().unwrap().to_string();
    assert!(reason.contains("high-water mark 120 MiB"), "{reason}");
    assert!(reason.contains("floors"), "{reason}");

    // Room again: memory on at once, and the limits grow back to the caches' sizes.
    guard.pretend_resident(Some(64 * MIB));
    let back = chat(&proxy, "c1", &body(&[user("back")]), &[]).await;
    assert_eq!(back.header("x-memory-status"), "stored");
    metric_until(&proxy, &format!("memproxy_cache_limit_bytes{state}"), |v| {
        v == capacity
    })
    .await;
    assert_eq!(metric(&proxy, "memproxy_memory_pressure").await, 0.0);
    assert_eq!(
        send("GET", &proxy.url("/readyz"), &[], "").await.json()["memory"],
        "on"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn the_store_s_share_grows_with_the_messages_it_counts() {
    let Started { proxy, .. } = Harness::new().config(BUDGET).start().await;
    proxy.state.memory_guard.pretend_resident(Some(64 * MIB));
    assert_eq!(metric(&proxy, "memproxy_store_messages").await, 0.0);
    for (conversation, text) in [("c1", "one"), ("c1", "two"), ("c2", "three")] {
        let answer = chat(&proxy, conversation, &body(&[user(text)]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    // Each exchange stored its question and its reply.
    metric_until(&proxy, "memproxy_store_messages", |v| v == 6.0).await;
    let share = metric(&proxy, "memproxy_store_memory_share_bytes").await;
    assert_eq!(
        share,
        proxy.state.memory_guard.budget().engine_reserve as f64,
        "six messages fit the reserve"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn fjall_s_messages_are_counted_and_its_share_stays_its_reserve() {
    let Started { proxy, .. } = Harness::new()
        .storage("backend = \"fjall\"\n")
        .config(BUDGET)
        .start()
        .await;
    let guard = &proxy.state.memory_guard;
    guard.pretend_resident(Some(64 * MIB));
    for (conversation, text) in [("c1", "one"), ("c2", "two")] {
        let answer = chat(&proxy, conversation, &body(&[user(text)]), &[]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
    }
    metric_until(&proxy, "memproxy_store_messages", |v| v == 4.0).await;
    // Its caches bound its memory: as many messages as would take sled past its reserve
    // leave fjall's share where it was.
    let reserve = guard.budget().engine_reserve as f64;
    guard.pretend_stored_messages(Some(300_000));
    metric_until(&proxy, "memproxy_store_messages", |v| v == 300_000.0).await;
    assert_eq!(
        metric(&proxy, "memproxy_store_memory_share_bytes").await,
        reserve
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_store_with_the_providers_vectors_has_a_larger_share_than_its_messages_alone() {
    // The provider's vectors are stored beside the messages (the static table's are not): the
    // same count of messages needs more of the budget.
    let Started { proxy, .. } = Harness::new()
        .config(&format!(
            "{BUDGET}[embedding]\nembedder = \"upstream\"\nupstream_model = \"text-embedding-3-small\"\n"
        ))
        .start()
        .await;
    let guard = &proxy.state.memory_guard;
    guard.pretend_resident(Some(64 * MIB));
    let budget = *guard.budget();
    assert_eq!(
        budget.store_growth,
        memproxy::config::StoreGrowth::WITH_VECTORS
    );
    guard.pretend_stored_messages(Some(1_000_000));
    let need = budget.engine_need(1_000_000) as f64;
    let share = metric_until(&proxy, "memproxy_store_memory_share_bytes", |v| v == need).await;
    let messages_alone = memproxy::config::StoreGrowth::MESSAGES.need(1_000_000) as f64;
    assert!(
        share > messages_alone + 10.0 * MIB as f64,
        "{share} against {messages_alone}"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_store_grown_past_its_reserve_takes_the_difference_from_the_caches() {
    let Started { proxy, .. } = Harness::new().config(BUDGET).start().await;
    let guard = &proxy.state.memory_guard;
    guard.pretend_resident(Some(64 * MIB));
    let state = "{cache=\"state\"}";
    let recall = "{cache=\"recall\"}";
    let capacity = metric(&proxy, &format!("memproxy_cache_limit_bytes{state}")).await;
    let reserve = guard.budget().engine_reserve as f64;
    assert_eq!(
        metric(&proxy, "memproxy_store_memory_share_bytes").await,
        reserve
    );

    // 1,000,000 messages: sled needs 15 MiB + 10 bytes each, past the 16 MiB reserve of a
    // 128 MiB budget by about 8.5 MiB, which the caches give up in proportion to their sizes.
    guard.pretend_stored_messages(Some(1_000_000));
    let need = guard.budget().engine_need(1_000_000) as f64;
    metric_until(&proxy, "memproxy_store_memory_share_bytes", |v| v == need).await;
    let overdraft = need - reserve;
    let limit = metric_until(&proxy, &format!("memproxy_cache_limit_bytes{state}"), |v| {
        v < capacity
    })
    .await;
    let caches = guard.relief().caches();
    let sizes: f64 = caches.iter().map(|c| c.capacity() as f64).sum();
    let expected = capacity - (overdraft * capacity / sizes).floor();
    assert!(
        (limit - expected).abs() <= 1.0,
        "{limit} against {expected}"
    );
    let recall_size = caches
        .iter()
        .find(|c| c.name() == "recall")
        .unwrap()
        .capacity();
    assert!(
        metric(&proxy, &format!("memproxy_cache_limit_bytes{recall}")).await < recall_size as f64
    );

    // Memory off at the high-water mark with the store past its reserve: /readyz says that
    // the store is why, and what budget holds it.
    guard.pretend_resident(Some(HIGH_WATER + MIB));
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.json()["memory"], "off");
    let reason = ready.json()["memory_reason"].as_str().unwrap().to_string();
    let holds = guard.budget().budget_for_messages(1_000_000) >> 20;
    assert!(
        reason.contains(&format!(
            "the store's 1000000 messages need about {} MiB past sled's page cache where the budget reserves 16 MiB: server.memory_budget = \"{holds}MiB\" holds them",
            guard.budget().engine_need(1_000_000) >> 20
        )),
        "{reason}"
    );
    guard.pretend_resident(Some(64 * MIB));

    // The store emptied: the caches grow back to their sizes.
    guard.pretend_stored_messages(Some(0));
    metric_until(&proxy, &format!("memproxy_cache_limit_bytes{state}"), |v| {
        v == capacity
    })
    .await;
    assert_eq!(
        metric(&proxy, "memproxy_store_memory_share_bytes").await,
        reserve
    );
    proxy.stop().await;
}

/// hyper grows an HTTP/1.1 connection's read buffer while reads fill it and keeps it for as
/// long as the connection lives; capped (`body::READ_BUFFER_MAX`), 24 kept-alive connections
/// that each streamed a 2.5 MiB body through hold a little more of the child's heap, not the
/// ~400 KiB each of hyper's default (under the soak, the burst's connections kept 15.5 MB).
#[tokio::test]
async fn kept_alive_connections_do_not_hold_what_a_large_body_grew() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CONNECTIONS: usize = 24;
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\n[storage]\ndata_dir = \"{}\"\n",
        mock.base_url(),
        dir.path().join("data").display()
    );
    let child = ChildProxy::start(dir.path(), &toml);
    child.ready().await;
    let in_use = || async {
        let answer = try_send("GET", &format!("{}/metrics", child.url), &[], String::new())
            .await
            .unwrap();
        let text = String::from_utf8(answer.body.to_vec()).unwrap();
        text.lines()
            .find_map(|line| {
                line.strip_prefix("memproxy_allocator_bytes{state=\"in_use\"}")?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .expect("the default build's jemalloc gives its figures")
    };
    // An embeddings request of 2.5 MiB that the provider accepts: 256 inputs of 10 KiB.
    let input: Vec<String> = (0..256).map(|_| "word ".repeat(2048)).collect();
    let body =
        serde_json::to_vec(&json!({"model": "text-embedding-3-small", "input": input})).unwrap();
    let address = child.url.trim_start_matches("http://").to_string();
    let before = in_use().await;
    let mut kept = Vec::new();
    for _ in 0..CONNECTIONS {
        let mut connection = tokio::net::TcpStream::connect(&address).await.unwrap();
        let head = format!(
            "POST /v1/embeddings HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\nauthorization: Bearer sk-test\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        connection.write_all(head.as_bytes()).await.unwrap();
        connection.write_all(&body).await.unwrap();
        // The answer's head, then its body by its length; the connection stays open.
        let mut read = Vec::new();
        let mut chunk = [0u8; 16 << 10];
        let (head_end, length) = loop {
            let n = connection.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the proxy closed the connection");
            read.extend_from_slice(&chunk[..n]);
            if let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&read[..end]).to_ascii_lowercase();
                assert!(head.starts_with("http/1.1 200"), "{head}");
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .expect("a JSON answer with its length")
                    .trim()
                    .parse()
                    .unwrap();
                break (end + 4, length);
            }
        };
        while read.len() < head_end + length {
            let n = connection.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the proxy closed the connection");
            read.extend_from_slice(&chunk[..n]);
        }
        kept.push(connection);
    }
    let grown = in_use().await - before;
    assert!(
        grown < 4.0 * MIB as f64,
        "{CONNECTIONS} kept-alive connections hold {grown} bytes more"
    );
    drop(kept);
}
