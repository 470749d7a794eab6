//! `GET /metrics` through the real proxy: the text parses with a Prometheus parser, every
//! required family is there, counters move as requests flow, and no label carries a
//! conversation id, a tenant, a token or message text.

use prometheus_parse::{Scrape, Value};
use serde_json::json;

use crate::support::admin::*;
use crate::support::mock_upstream::Reply;
use crate::support::*;

async fn scrape(proxy: &Proxy) -> (Scrape, String) {
    let answer = send("GET", &proxy.url("/metrics"), &[], "").await;
    assert_eq!(answer.status, 200);
    assert!(
        answer
            .header("content-type")
            .starts_with("application/openmetrics-text")
    );
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    assert!(text.trim_end().ends_with("# EOF"), "a complete exposition");
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    (scrape, text)
}

/// The value of a counter, gauge or untyped sample with exactly these labels (0 if absent).
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            _ => panic!("{metric} is not a single value"),
        })
        .sum()
}

/// The observation count of a histogram (with these labels).
fn observations(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    value(scrape, &format!("{metric}_count"), labels)
}

fn has_histogram(scrape: &Scrape, metric: &str) -> bool {
    scrape
        .samples
        .iter()
        .any(|s| s.metric == metric && matches!(s.value, Value::Histogram(_)))
}

#[tokio::test]
async fn metrics_parse_and_move_as_requests_flow() {
    let Started { proxy, .. } = Harness::new().admin().start().await;

    let (before, _) = scrape(&proxy).await;
    for family in [
        "memproxy_upstream_latency_seconds",
        "memproxy_added_time_seconds",
        "memproxy_stage_duration_seconds",
        "memproxy_retrieved_turns",
    ] {
        assert!(has_histogram(&before, family), "{family} missing");
    }
    for stage in ["reconcile", "recall", "assemble", "commit"] {
        assert!(
            before
                .samples
                .iter()
                .any(|s| s.metric == "memproxy_stage_duration_seconds"
                    && s.labels.get("stage") == Some(stage)),
            "stage {stage} missing"
        );
    }
    for family in [
        "memproxy_summaries_total",
        "memproxy_summary_input_tokens_total",
        "memproxy_summary_output_tokens_total",
        "memproxy_prompt_tokens_forwarded_total",
        "memproxy_history_tokens_total",
        "memproxy_store_size_bytes",
        "memproxy_cache_lookups_total",
        "memproxy_cache_misses_total",
        "memproxy_ttl_deletions_total",
        "memproxy_ttl_sweeps_total",
        "memproxy_admin_deletions_total",
    ] {
        assert!(
            before.samples.iter().any(|s| s.metric == family),
            "{family} missing"
        );
    }
    assert_eq!(
        value(&before, "memproxy_requests_total", &[("route", "chat")]),
        0.0
    );

    // Traffic: 12 chat exchanges (enough for recall), a pass-through, health checks, an admin
    // call.
    let secret_text = "the-private-message-text";
    let mut history = Vec::new();
    for i in 1..=12 {
        history.push(user(&format!("{secret_text} number {i}")));
        let answer = chat(
            &proxy,
            "metrics-conversation-id",
            &body(&history),
            &[("x-memory-recent-n", "4")],
        )
        .await;
        assert_eq!(answer.status, 200);
        history.push(reply_message(&answer));
    }
    let models = send(
        "GET",
        &proxy.url("/v1/models"),
        &[("authorization", "Bearer x")],
        "",
    )
    .await;
    assert_eq!(models.status, 200);
    send("GET", &proxy.url("/healthz"), &[], "").await;
    send("GET", &proxy.url("/nope"), &[], "").await;
    admin(&proxy, "GET", "/admin/v1/conversations", "").await;

    let (after, text) = scrape(&proxy).await;
    let count = |route: &str, status: &str| {
        value(
            &after,
            "memproxy_requests_total",
            &[("route", route), ("status", status)],
        )
    };
    assert_eq!(count("chat", "200"), 12.0);
    assert_eq!(count("passthrough", "200"), 1.0);
    assert_eq!(count("health", "200"), 1.0);
    assert_eq!(count("other", "404"), 1.0);
    assert_eq!(count("admin", "200"), 1.0);
    assert_eq!(count("metrics", "200"), 1.0, "the first scrape counted");
    assert_eq!(
        observations(&after, "memproxy_upstream_latency_seconds", &[]),
        13.0
    );
    assert_eq!(
        observations(&after, "memproxy_added_time_seconds", &[]),
        13.0
    );
    assert_eq!(observations(&after, "memproxy_retrieved_turns", &[]), 12.0);
    let forwarded = value(&after, "memproxy_prompt_tokens_forwarded_total", &[]);
    let history_tokens = value(&after, "memproxy_history_tokens_total", &[]);
    assert!(forwarded > 0.0);
    assert!(
        history_tokens > forwarded,
        "recent_n = 4 forwards less than the history: {history_tokens} vs {forwarded}"
    );
    assert!(value(&after, "memproxy_store_size_bytes", &[]) > 0.0);
    // glibc's figures (the default build): this test process has a heap in use.
    assert!(value(&after, "memproxy_allocator_bytes", &[("state", "in_use")]) > 1e6);
    assert!(value(&after, "memproxy_allocator_bytes", &[("state", "free")]) >= 0.0);
    assert!(
        value(
            &after,
            "memproxy_cache_lookups_total",
            &[("cache", "conversation")]
        ) >= 12.0
    );
    assert!(
        value(
            &after,
            "memproxy_cache_misses_total",
            &[("cache", "conversation")]
        ) >= 1.0
    );

    // Privacy and cardinality: nothing request-specific in any label or name.
    let tenant_id = tenant(TOKEN);
    for needle in [
        "metrics-conversation-id",
        secret_text,
        TOKEN,
        tenant_id.as_str(),
        ADMIN_TOKEN,
    ] {
        assert!(!text.contains(needle), "{needle} leaked into /metrics");
    }
    let allowed = [
        "route", "status", "stage", "cache", "result", "le", "action", "reason", "agent", "task",
        "state", "place",
    ];
    for sample in &after.samples {
        let labels = format!("{:?}", sample.labels);
        for part in labels.split('"').skip(1).step_by(4) {
            assert!(
                allowed.contains(&part),
                "unexpected label {part} on {}",
                sample.metric
            );
        }
    }

    // The agent label is a closed set: no agent is named in this config, so all are `other`.
    for sample in &after.samples {
        if let Some(agent) = sample.labels.get("agent") {
            assert_eq!(agent, "other", "{}", sample.metric);
        }
        if let Some(task) = sample.labels.get("task") {
            assert!(task == "summary" || task == "extraction", "{task}");
        }
    }
    assert!(
        value(
            &after,
            "memproxy_ledger_forwarded_tokens_total",
            &[("agent", "other")]
        ) > 0.0
    );

    // More traffic moves the counters again.
    let answer = chat(&proxy, "another", &body(&[user("hello")]), &[]).await;
    assert_eq!(answer.status, 200);
    let (later, _) = scrape(&proxy).await;
    assert_eq!(
        value(
            &later,
            "memproxy_requests_total",
            &[("route", "chat"), ("status", "200")]
        ),
        13.0
    );
    assert!(value(&later, "memproxy_prompt_tokens_forwarded_total", &[]) > forwarded);
    assert_eq!(
        value(&later, "memproxy_requests_total", &[("route", "metrics")]),
        2.0
    );
}

#[tokio::test]
async fn metrics_can_require_the_admin_token() {
    let Started { proxy, .. } = Harness::new()
        .admin()
        .config("[admin]\nprotect_metrics = true\n")
        .start()
        .await;
    let open = send("GET", &proxy.url("/metrics"), &[], "").await;
    assert_eq!(open.status, 401);
    let wrong = send(
        "GET",
        &proxy.url("/metrics"),
        &[("authorization", "Bearer nope")],
        "",
    )
    .await;
    assert_eq!(wrong.status, 401);
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let ok = send(
        "GET",
        &proxy.url("/metrics"),
        &[("authorization", &auth)],
        "",
    )
    .await;
    assert_eq!(ok.status, 200);
    assert!(String::from_utf8_lossy(&ok.body).contains("memproxy_requests_total"));
    let _ = json!({});
}

#[tokio::test]
async fn summaries_made_are_counted_with_their_tokens() {
    let Started { proxy, .. } = Harness::new().start().await;
    let headers = [
        ("x-memory-recent-n", "2"),
        ("x-memory-compression-threshold-tokens", "20"),
        ("x-memory-compression-async", "false"),
        ("x-memory-compression-interval", "PT0S"),
    ];
    let mut history = Vec::new();
    for i in 1..=8 {
        history.push(user(&format!(
            "a long enough message number {i} about the garden"
        )));
        let answer = chat(&proxy, "summarized", &body(&history), &headers).await;
        assert_eq!(answer.status, 200);
        history.push(reply_message(&answer));
    }
    let (scrape, _) = scrape(&proxy).await;
    let made = value(&scrape, "memproxy_summaries_total", &[("result", "made")]);
    assert!(made >= 1.0, "no summary counted");
    assert_eq!(
        value(&scrape, "memproxy_summaries_total", &[("result", "failed")]),
        0.0
    );
    // The mock reports a usage of one prompt and one completion token per call.
    assert_eq!(
        value(&scrape, "memproxy_summary_input_tokens_total", &[]),
        made
    );
    assert_eq!(
        value(&scrape, "memproxy_summary_output_tokens_total", &[]),
        made
    );
}

/// Waits (bounded) until a scrape shows `metric{labels}` at `expected`.
async fn scraped(proxy: &Proxy, metric: &str, labels: &[(&str, &str)], expected: f64) -> Scrape {
    for _ in 0..100 {
        let (scrape, _) = scrape(proxy).await;
        if value(&scrape, metric, labels) == expected {
            return scrape;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("{metric} {labels:?} never reached {expected}");
}

#[tokio::test]
async fn extractions_are_counted_with_what_they_did_to_the_memories() {
    use crate::support::mock_upstream::Reply;
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let (before, _) = scrape(&proxy).await;
    for result in ["done", "failed", "dropped"] {
        assert!(
            before
                .samples
                .iter()
                .any(|s| s.metric == "memproxy_extractions_total"
                    && s.labels.get("result") == Some(result)),
            "{result}: every series exists from the start"
        );
    }
    let extra = [
        ("x-memory-user-id", "ana"),
        ("x-memory-extraction-every", "1"),
    ];
    let memory = |text: &str, supersedes: Vec<u64>| {
        json!({"text": text, "type": "profile", "scope": "private", "importance": 0.8,
               "confidence": 0.9, "tags": [], "source_turns": [1], "supersedes": supersedes})
    };
    // A bad answer, then one with a new memory, a rejected one (no type known) and a
    // near-duplicate of the new one.
    mock.push_extraction(Reply::Text("not json".into()));
    mock.push_extraction(Reply::Text(
        json!({"memories": [
            memory("The user lives in Lisbon", vec![]),
            {"text": "x", "type": "mood", "scope": "private", "importance": 0.5,
             "confidence": 0.9, "tags": [], "source_turns": [], "supersedes": []},
            memory("The user lives in Lisbon", vec![]),
        ]})
        .to_string(),
    ));
    let answer = chat(&proxy, "a", &body(&[user("I live in Lisbon")]), &extra).await;
    assert_eq!(answer.status, 200);
    let after = scraped(
        &proxy,
        "memproxy_extractions_total",
        &[("result", "done")],
        1.0,
    )
    .await;
    let memories = |scrape: &Scrape, result: &str| {
        value(
            scrape,
            "memproxy_extracted_memories_total",
            &[("result", result)],
        )
    };
    assert_eq!(memories(&after, "added"), 1.0);
    assert_eq!(memories(&after, "rejected"), 1.0);
    assert_eq!(memories(&after, "ignored"), 1.0);
    assert_eq!(
        value(&after, "memproxy_extraction_bad_answers_total", &[]),
        1.0
    );
    assert_eq!(value(&after, "memproxy_extraction_retries_total", &[]), 1.0);
    // A move the model names as superseding the first memory; then the model down.
    let store = proxy.store();
    let owner = memproxy::store::OwnerKey::user(&key(Some(TOKEN), "a").tenant, "ana");
    let handle = store.owner(&owner, false).unwrap().unwrap();
    let id = memproxy::longterm::memories::all(store, &handle).unwrap()[0].id;
    mock.push_extraction(Reply::Text(
        json!({"memories": [memory("The user lives in Berlin", vec![id])]}).to_string(),
    ));
    chat(&proxy, "a", &body(&[user("I moved to Berlin")]), &extra).await;
    let after = scraped(
        &proxy,
        "memproxy_extracted_memories_total",
        &[("result", "superseded")],
        1.0,
    )
    .await;
    assert_eq!(memories(&after, "updated"), 0.0);
    for _ in 0..3 {
        mock.push_extraction(Reply::Status(503, "{}".into()));
    }
    chat(&proxy, "a", &body(&[user("I like jazz")]), &extra).await;
    let after = scraped(
        &proxy,
        "memproxy_extractions_total",
        &[("result", "failed")],
        1.0,
    )
    .await;
    assert_eq!(value(&after, "memproxy_extraction_retries_total", &[]), 3.0);
    assert_eq!(
        value(&after, "memproxy_extractions_total", &[("result", "done")]),
        2.0
    );
}

/// A small request of a short conversation memproxy has cached and nobody else holds is planned
/// on the request's own thread (`memproxy_plans_total{place="request"}`), whether its exchange
/// is stored or not; a conversation not cached yet, a body over 16 KiB and a user's long-term
/// memory are planned on the blocking pool (`place="pool"`). The prompt is the same either
/// way: it holds what was stored.
#[tokio::test]
async fn small_requests_of_cached_conversations_are_planned_where_they_arrive() {
    let Started { proxy, mock, .. } = Harness::new().start().await;
    let plans = |scrape: &Scrape| {
        let at = |place| value(scrape, "memproxy_plans_total", &[("place", place)]);
        (at("pool"), at("request"))
    };
    let read_only = [("x-memory-persist", "false")];
    let last_prompt = || serde_json::to_string(&mock.last_messages()).unwrap();
    let (before, _) = scrape(&proxy).await;
    assert_eq!(plans(&before), (0.0, 0.0));

    // Not cached yet: loaded and planned on the pool.
    let answer = chat(
        &proxy,
        "near",
        &body(&[user("My sister lives in Porto.")]),
        &[],
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(plans(&scrape(&proxy).await.0), (1.0, 0.0));

    // Cached now, and stored: where it arrived.
    let answer = chat(&proxy, "near", &body(&[user("I live in Lisbon.")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(plans(&scrape(&proxy).await.0), (1.0, 1.0));

    // Cached, small, stores nothing: planned where it arrived, with the stored turns in its
    // prompt.
    let question = body(&[user("Where does my sister live?")]);
    let answer = chat(&proxy, "near", &question, &read_only).await;
    assert_eq!(answer.status, 200);
    assert_eq!(plans(&scrape(&proxy).await.0), (1.0, 2.0));
    let forwarded = last_prompt();
    assert!(
        forwarded.contains("My sister lives in Porto."),
        "{forwarded}"
    );
    assert!(forwarded.contains("I live in Lisbon."), "{forwarded}");
    assert!(
        forwarded.contains("Where does my sister live?"),
        "{forwarded}"
    );

    // A body over 16 KiB: on the pool.
    let long = format!(
        "{} What was the city?",
        "Some filler words here. ".repeat(800)
    );
    let answer = chat(&proxy, "near", &body(&[user(&long)]), &read_only).await;
    assert_eq!(answer.status, 200);
    assert_eq!(plans(&scrape(&proxy).await.0), (2.0, 2.0));

    // A user's long-term memory takes part: on the pool.
    let as_ana = [("x-memory-persist", "false"), ("x-memory-user-id", "ana")];
    let answer = chat(&proxy, "near", &body(&[user("And my brother?")]), &as_ana).await;
    assert_eq!(answer.status, 200);
    assert_eq!(plans(&scrape(&proxy).await.0), (3.0, 2.0));
    let forwarded = last_prompt();
    assert!(
        forwarded.contains("My sister lives in Porto."),
        "{forwarded}"
    );

    // Small, cached, stores nothing again: where it arrived; nothing of the read-only requests
    // was stored.
    let answer = chat(&proxy, "near", &body(&[user("Thanks.")]), &read_only).await;
    assert_eq!(answer.status, 200);
    assert_eq!(plans(&scrape(&proxy).await.0), (3.0, 3.0));
    let forwarded = last_prompt();
    assert!(
        !forwarded.contains("Where does my sister live?"),
        "{forwarded}"
    );
}

/// A small exchange of a conversation nobody else holds, in a store of this process's own, is
/// written where its answer arrived (`memproxy_commits_total{place="request"}`), JSON and
/// streamed alike; one over 16 KiB and one copied into a user's long-term memory are written
/// on the blocking pool (`place="pool"`). Every one of them is stored: the next prompt holds
/// them all.
/// `memproxy_commits_total` by place: (on the pool, where the answer arrived).
fn commits(scrape: &Scrape) -> (f64, f64) {
    let at = |place| value(scrape, "memproxy_commits_total", &[("place", place)]);
    (at("pool"), at("request"))
}

#[tokio::test]
async fn small_exchanges_are_stored_where_their_answer_arrives() {
    let Started { proxy, mock, .. } = Harness::new().start().await;
    assert_eq!(commits(&scrape(&proxy).await.0), (0.0, 0.0));

    let answer = chat(
        &proxy,
        "here",
        &body(&[user("My sister lives in Porto.")]),
        &[],
    )
    .await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(commits(&scrape(&proxy).await.0), (0.0, 1.0));

    let mut streamed = body(&[user("My brother lives in Faro.")]);
    streamed["stream"] = json!(true);
    let answer = chat(&proxy, "here", &streamed, &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(commits(&scrape(&proxy).await.0), (0.0, 2.0));

    let long = format!(
        "{} I live in Lisbon.",
        "Some filler words here. ".repeat(800)
    );
    let answer = chat(&proxy, "here", &body(&[user(&long)]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(commits(&scrape(&proxy).await.0), (1.0, 2.0));

    let as_ana = [("x-memory-user-id", "ana")];
    let answer = chat(&proxy, "here", &body(&[user("My cat is Tom.")]), &as_ana).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(commits(&scrape(&proxy).await.0), (2.0, 2.0));

    let answer = chat(
        &proxy,
        "here",
        &body(&[user("Where do they all live?")]),
        &[("x-memory-persist", "false")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let forwarded = serde_json::to_string(&mock.last_messages()).unwrap();
    for said in [
        "My sister lives in Porto.",
        "My brother lives in Faro.",
        "I live in Lisbon.",
        "My cat is Tom.",
    ] {
        assert!(forwarded.contains(said), "{said}: {forwarded}");
    }
    assert_eq!(commits(&scrape(&proxy).await.0), (2.0, 2.0));
}

/// One exchange stored in `conversation` where its answer arrived, then a second one planned
/// and forwarded whose answer the mock holds back `delay_ms`: its task (with when its answer
/// ended), once the mock has the request.
async fn a_late_second_exchange(
    proxy: &std::sync::Arc<Proxy>,
    mock: &crate::support::mock_upstream::MockUpstream,
    conversation: &'static str,
    delay_ms: u64,
) -> tokio::task::JoinHandle<(Answer, std::time::Instant)> {
    let first = chat(
        proxy,
        conversation,
        &body(&[user("My sister lives in Porto.")]),
        &[],
    )
    .await;
    assert_eq!(first.header("x-memory-status"), "stored");
    assert_eq!(commits(&scrape(proxy).await.0), (0.0, 1.0));

    mock.push(Reply::Delay(
        std::time::Duration::from_millis(delay_ms),
        Box::new(Reply::Auto),
    ));
    let asking = std::sync::Arc::clone(proxy);
    let late = tokio::spawn(async move {
        let answer = chat(
            &asking,
            conversation,
            &body(&[user("My brother lives in Faro.")]),
            &[],
        )
        .await;
        (answer, std::time::Instant::now())
    });
    // Planned and forwarded (the plan needs the conversation's lock too).
    for _ in 0..500 {
        if mock.chat_requests().len() == 2 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(mock.chat_requests().len(), 2);
    late
}

/// An answer that arrives while its conversation is held (here by the test; in use, by a
/// request planning it) is not waited for on the runtime's thread: its commit goes to the
/// blocking pool, which waits for the lock, and the exchange is stored all the same, before the
/// answer ends.
#[tokio::test]
async fn an_answer_whose_conversation_is_held_is_stored_from_the_pool() {
    let Started { proxy, mock, .. } = Harness::new().start().await;
    let proxy = std::sync::Arc::new(proxy);
    // The answer is 200 ms away.
    let request = a_late_second_exchange(&proxy, &mock, "held", 200).await;
    let handle = proxy.store().cached(&key(Some(TOKEN), "held")).unwrap();
    let (locked, told) = std::sync::mpsc::channel();
    let holder = std::thread::spawn(move || {
        let held = handle.lock().unwrap();
        locked.send(()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(1500));
        drop(held);
        std::time::Instant::now()
    });
    told.recv().unwrap();
    let (answer, ended) = request.await.unwrap();
    let released = holder.join().unwrap();
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert!(
        ended > released,
        "the answer ended after its commit, after the lock"
    );
    assert_eq!(commits(&scrape(&proxy).await.0), (1.0, 1.0));
    let stored = proxy.stored(Some(TOKEN), "held");
    assert_eq!(stored.len(), 4, "{stored:?}");
}

/// An answer whose conversation changed in the store behind the handle its request planned
/// with (the handle evicted from the cache under memory pressure, and another request's
/// exchange committed through a new one meanwhile) finds its write stale where it arrived:
/// nothing is written there, and the pool reads the conversation again and stores the
/// exchange after the other.
#[tokio::test]
async fn an_answer_whose_conversation_changed_behind_it_is_stored_from_the_pool() {
    let Started { proxy, mock, .. } = Harness::new().start().await;
    let proxy = std::sync::Arc::new(proxy);
    let slow = a_late_second_exchange(&proxy, &mock, "moved", 300).await;
    // The conversations' cache emptied, as the memory guard does under pressure; the next
    // request loads the conversation afresh and commits through that.
    let state = proxy
        .state
        .memory_guard
        .relief()
        .caches()
        .into_iter()
        .find(|cache| cache.name() == "state")
        .unwrap();
    state.evict_to(0);
    let fast = chat(&proxy, "moved", &body(&[user("My cat is Tom.")]), &[]).await;
    assert_eq!(fast.header("x-memory-status"), "stored");
    assert_eq!(commits(&scrape(&proxy).await.0), (0.0, 2.0));

    let (slow, _) = slow.await.unwrap();
    assert_eq!(slow.header("x-memory-status"), "stored");
    assert_eq!(commits(&scrape(&proxy).await.0), (1.0, 2.0));
    let stored = summarize(&proxy.stored(Some(TOKEN), "moved"));
    let asked: Vec<&String> = stored.iter().filter(|m| m.starts_with("user:")).collect();
    assert_eq!(
        asked,
        [
            "user:My sister lives in Porto.",
            "user:My cat is Tom.",
            "user:My brother lives in Faro."
        ],
        "each exchange once, the late one after the other: {stored:?}"
    );
    assert_eq!(stored.len(), 6, "{stored:?}");
}
