//! Conversation TTL through the real proxy: the `ttl` setting and `X-Memory-Ttl`, the sweeper
//! with a clock moved forward instead of sleeping, bounded passes, and the background task.

use std::time::Duration;

use memproxy::config;
use memproxy::ttl::{Cursor, sweep_pass};

use crate::support::admin::*;
use crate::support::*;

fn no_env(_: &str) -> Option<String> {
    None
}

async fn store_one(proxy: &Proxy, id: &str, text: &str, extra: &[(&str, &str)]) {
    let answer = chat(proxy, id, &body(&[user(text)]), extra).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.header("x-memory-status"), "stored");
}

fn exists(proxy: &Proxy, agent: &str, id: &str) -> bool {
    let key = key_for(Some(TOKEN), agent, id);
    proxy.store().meta(&key).unwrap().is_some()
}

#[test]
fn ttl_is_a_setting_and_the_sweeper_is_configured() {
    let config = config::from_toml(
        "[memory]\nttl = \"P30D\"\n[agents.short]\nttl = \"PT1H\"\n[agents.keep]\nttl = \"none\"\n[sweeper]\ninterval = \"PT10S\"\nmax_scanned = 50\nmax_deleted = 5\n",
        &no_env,
    )
    .unwrap();
    assert_eq!(config.memory.ttl, Some(Duration::from_secs(30 * 86_400)));
    assert_eq!(config.profile("short").ttl, Some(Duration::from_secs(3600)));
    assert_eq!(config.profile("keep").ttl, None);
    assert_eq!(config.sweeper.interval, Duration::from_secs(10));
    assert_eq!(
        (config.sweeper.max_scanned, config.sweeper.max_deleted),
        (50, 5)
    );
    let defaults = config::from_toml("", &no_env).unwrap();
    assert_eq!(defaults.memory.ttl, None);
    assert_eq!(defaults.sweeper.max_scanned, 1000);
    assert_eq!(defaults.sweeper.max_deleted, 100);

    let err = config::from_toml(
        "[memory]\nttl = \"PT0S\"\n[sweeper]\ninterval = \"soon\"\nmax_deleted = 0\n[admin]\ntoken_env = \"NOT_SET\"\n",
        &no_env,
    )
    .unwrap_err();
    let all = err.problems.join("\n");
    for needle in [
        "memory.ttl",
        "sweeper.interval",
        "sweeper.max_deleted",
        "admin.token_env",
    ] {
        assert!(all.contains(needle), "{needle} missing in {all}");
    }
    let named = config::from_toml("[admin]\ntoken_env = \"MY_ADMIN\"\n", &|name| {
        (name == "MY_ADMIN").then(|| "s3cret".to_string())
    })
    .unwrap();
    assert_eq!(named.admin_token.unwrap().0, "s3cret");
    let unprotectable =
        config::from_toml("[admin]\nprotect_metrics = true\n", &no_env).unwrap_err();
    assert!(unprotectable.problems[0].contains("admin.protect_metrics"));
    assert!(
        !format!(
            "{:?}",
            config::from_toml("", &|_| Some("xyz-token".into())).unwrap()
        )
        .contains("xyz-token")
    );
}

#[tokio::test]
async fn a_bad_ttl_header_is_a_400_naming_it() {
    let Started { mock, proxy, .. } = Harness::new().start().await;
    for bad in ["forever", "PT0S", "P1M", "-PT1H"] {
        let answer = chat(&proxy, "c", &body(&[user("hi")]), &[("x-memory-ttl", bad)]).await;
        assert_eq!(answer.status, 400, "{bad}");
        assert_eq!(answer.error_param(), "x-memory-ttl");
    }
    assert_eq!(mock.recorded().len(), 0);
}

#[tokio::test]
async fn idle_conversations_are_deleted_once_past_their_ttl() {
    let Started { proxy, .. } = Harness::new()
        .admin()
        .config("[agents.short]\nttl = \"PT1H\"\n")
        .start()
        .await;
    let state = &proxy.state;
    store_one(
        &proxy,
        "profile-ttl",
        "short-lived secret",
        &[("x-memory-agent", "short")],
    )
    .await;
    store_one(
        &proxy,
        "header-ttl",
        "day-long secret",
        &[("x-memory-ttl", "P1D")],
    )
    .await;
    store_one(&proxy, "forever", "kept forever", &[]).await;
    // A header overrides the agent's profile, and is remembered for the conversation.
    store_one(
        &proxy,
        "override",
        "overridden",
        &[("x-memory-agent", "short"), ("x-memory-ttl", "P7D")],
    )
    .await;
    let listed = admin(&proxy, "GET", "/admin/v1/conversations", "")
        .await
        .json();
    let ttl_of = |id: &str| {
        listed["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap()["ttl"]
            .clone()
    };
    assert_eq!(ttl_of("header-ttl"), "P1D");
    assert_eq!(ttl_of("override"), "P7D");
    assert_eq!(ttl_of("forever"), serde_json::Value::Null);

    let mut cursor = Cursor::default();
    let pass = sweep_pass(state.memory().unwrap(), &state.config, &mut cursor).unwrap();
    assert_eq!((pass.scanned, pass.deleted), (4, 0));

    state
        .memory()
        .unwrap()
        .clock
        .advance(Duration::from_secs(2 * 3600));
    let pass = sweep_pass(state.memory().unwrap(), &state.config, &mut cursor).unwrap();
    assert_eq!(pass.deleted, 1);
    assert!(!exists(&proxy, "short", "profile-ttl"));
    assert!(
        !store_contains(state, "short-lived secret"),
        "deleted completely"
    );
    assert!(exists(&proxy, "default", "header-ttl"));
    assert!(exists(&proxy, "short", "override"));

    state
        .memory()
        .unwrap()
        .clock
        .advance(Duration::from_secs(86_400));
    sweep_pass(state.memory().unwrap(), &state.config, &mut cursor).unwrap();
    assert!(!exists(&proxy, "default", "header-ttl"));
    assert!(!store_contains(state, "day-long secret"));
    assert!(exists(&proxy, "short", "override"));
    assert!(exists(&proxy, "default", "forever"));

    state
        .memory()
        .unwrap()
        .clock
        .advance(Duration::from_secs(7 * 86_400));
    sweep_pass(state.memory().unwrap(), &state.config, &mut cursor).unwrap();
    assert!(!exists(&proxy, "short", "override"));
    state
        .memory()
        .unwrap()
        .clock
        .advance(Duration::from_secs(3650 * 86_400));
    sweep_pass(state.memory().unwrap(), &state.config, &mut cursor).unwrap();
    assert!(exists(&proxy, "default", "forever"), "no TTL: kept forever");

    // A deleted conversation's id starts afresh.
    let answer = chat(&proxy, "header-ttl", &body(&[user("again")]), &[]).await;
    assert_eq!(answer.header("x-memory-turns"), "2");

    let metrics = send("GET", &proxy.url("/metrics"), &[], "").await;
    let text = String::from_utf8(metrics.body.to_vec()).unwrap();
    assert!(text.contains("memproxy_ttl_deletions_total 3"), "{text}");
    assert!(text.contains("memproxy_ttl_sweeps_total 5"));
}

#[tokio::test]
async fn a_conversation_used_again_is_not_swept() {
    let Started { proxy, .. } = Harness::new()
        .config("[memory]\nttl = \"PT1H\"\n")
        .start()
        .await;
    store_one(&proxy, "c", "first", &[]).await;
    let key = key_for(Some(TOKEN), "default", "c");
    let before = proxy.store().meta(&key).unwrap().unwrap().last_activity_ms;
    // The sweeper decided from an old read; the delete checks idleness again and keeps it.
    assert!(
        proxy
            .store()
            .delete_idle_conversation(&key, before)
            .unwrap()
            .is_none()
    );
    assert!(exists(&proxy, "default", "c"));
    assert!(
        proxy
            .store()
            .delete_idle_conversation(&key, before + 1)
            .unwrap()
            .is_some()
    );
    assert!(!exists(&proxy, "default", "c"));
}

#[tokio::test]
async fn each_pass_is_bounded_and_the_walk_resumes() {
    let Started { proxy, .. } = Harness::new()
        .config("[memory]\nttl = \"PT1M\"\n[sweeper]\nmax_scanned = 3\nmax_deleted = 2\n")
        .start()
        .await;
    for i in 0..7 {
        store_one(&proxy, &format!("c{i}"), &format!("message {i}"), &[]).await;
    }
    proxy
        .state
        .memory()
        .unwrap()
        .clock
        .advance(Duration::from_secs(120));
    let mut cursor = Cursor::default();
    let mut passes = 0;
    while (0..7).any(|i| exists(&proxy, "default", &format!("c{i}"))) {
        let pass = sweep_pass(
            proxy.state.memory().unwrap(),
            &proxy.state.config,
            &mut cursor,
        )
        .unwrap();
        assert!(pass.scanned <= 3 && pass.deleted <= 2, "{pass:?}");
        passes += 1;
        assert!(passes < 20, "the sweeper makes progress");
    }
    assert!(
        passes >= 4,
        "7 deletions at 2 per pass take 4 passes, took {passes}"
    );
}

#[tokio::test]
async fn the_background_sweeper_runs_on_its_interval_and_stops_with_the_server() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new()
        .config("[memory]\nttl = \"PT1H\"\n[sweeper]\ninterval = \"PT0.05S\"\n")
        .start()
        .await;
    store_one(&proxy, "c", "background", &[]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(exists(&proxy, "default", "c"), "not idle long enough yet");
    proxy
        .state
        .memory()
        .unwrap()
        .clock
        .advance(Duration::from_secs(2 * 3600));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while exists(&proxy, "default", "c") {
        assert!(
            std::time::Instant::now() < deadline,
            "the sweeper did not run"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Shutdown stops the sweeper before the store is closed: the data dir reopens cleanly.
    proxy.stop().await;
    let again = Proxy::start(&mock, dir.path(), "").await;
    assert!(!exists(&again, "default", "c"));
    again.stop().await;
}

/// The background sweeper on tokio's paused clock: nothing happens before its interval, and
/// the pass at the interval deletes what is past its TTL.
#[tokio::test(start_paused = true)]
async fn the_sweeper_waits_for_its_interval_on_a_paused_clock() {
    use memproxy::identity::{ConversationKey, TenantId};
    use memproxy::store::{ImportMeta, Origin, StoredMessage};

    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        "[storage]\ndata_dir = \"{}\"\n[memory]\nttl = \"PT1H\"\n[sweeper]\ninterval = \"PT10M\"\n",
        dir.path().display()
    );
    let state =
        memproxy::state::AppState::build(config::from_toml(&text, &no_env).unwrap()).unwrap();
    let key = ConversationKey {
        tenant: TenantId::from_token(Some(TOKEN)),
        agent: "default".into(),
        conversation: "paused".into(),
    };
    let message = StoredMessage {
        turn: 1,
        role: memproxy::message::Role::User,
        origin: Origin::Client,
        at_ms: state.memory().unwrap().clock.now_ms(),
        tokens: 5,
        fingerprint: 42,
        message: serde_json::value::RawValue::from_string(
            r#"{"role":"user","content":"paused secret"}"#.into(),
        )
        .unwrap(),
        exchange: None,
    };
    let hint = ImportMeta {
        last_activity_ms: Some(state.memory().unwrap().clock.now_ms()),
        ..ImportMeta::default()
    };
    state
        .memory()
        .unwrap()
        .store
        .import_conversation(&key, vec![message], vec![], vec![], hint)
        .unwrap();
    // Idle for two hours by the sweeper's clock, past the one-hour TTL.
    state
        .memory()
        .unwrap()
        .clock
        .advance(Duration::from_secs(2 * 3600));

    let sweeper = state.start_sweeper().unwrap();
    tokio::time::sleep(Duration::from_secs(9 * 60)).await;
    assert!(
        state.memory().unwrap().store.meta(&key).unwrap().is_some(),
        "no pass before the interval"
    );
    tokio::time::sleep(Duration::from_secs(2 * 60)).await;
    let mut waited = 0;
    while state.memory().unwrap().store.meta(&key).unwrap().is_some() {
        waited += 1;
        assert!(waited < 100_000, "the pass at the interval did not delete");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        !state
            .memory()
            .unwrap()
            .store
            .any_trace_of(b"paused secret")
            .unwrap()
    );
    sweeper.stop().await;
    state.memory().unwrap().store.close().await.unwrap();
}

/// True when the store holds anything of conversation `id`: its TTL record, its record, its
/// messages (the id is in every key).
fn any_trace(proxy: &Proxy, id: &str) -> bool {
    proxy.store().any_trace_of(id.as_bytes()).unwrap()
}

fn ttl_record(proxy: &Proxy, id: &str) -> Option<memproxy::store::TtlRecord> {
    let key = key_for(Some(TOKEN), "default", id);
    proxy.store().ttl_of(&key).unwrap()
}

#[tokio::test]
async fn a_refused_or_failed_request_writes_no_ttl() {
    use crate::support::mock_upstream::Reply;

    let Started { mock, proxy, .. } = Harness::new().start().await;
    let ttl = [("x-memory-ttl", "P36500D")];

    // Bodies memproxy refuses: nothing is planned, forwarded or written.
    for (i, malformed) in [
        r#"{"messages": [oops"#,
        r#"{"model":"m"}"#,
        r#"{"messages":[{"content":"no role"}]}"#,
        r#"{"messages":[],"stream":"yes"}"#,
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("ttl-malformed-{i}");
        let answer = send(
            "POST",
            &proxy.url("/v1/chat/completions"),
            &[
                ("authorization", &format!("Bearer {TOKEN}")),
                ("x-memory-conversation-id", &id),
                ("x-memory-ttl", "P36500D"),
            ],
            malformed,
        )
        .await;
        assert_eq!(answer.status, 400, "{malformed}");
        assert_eq!(ttl_record(&proxy, &id), None, "{malformed}");
        assert!(!any_trace(&proxy, &id), "{malformed}");
    }
    assert!(mock.recorded().is_empty());

    // Bodies memproxy can parse but the upstream refuses or fails on.
    for status in [400, 500] {
        let id = format!("ttl-upstream-{status}");
        mock.push(Reply::Status(
            status,
            r#"{"error":{"message":"no"}}"#.into(),
        ));
        let failed = chat(&proxy, &id, &body(&[user("hi")]), &ttl).await;
        assert_eq!(failed.status, status);
        assert_eq!(failed.header("x-memory-status"), "not-stored");
        assert_eq!(ttl_record(&proxy, &id), None, "{status}");
        assert!(!exists(&proxy, "default", &id), "{status}");
        assert!(!any_trace(&proxy, &id), "{status}");
    }

    // A stream that ends without finishing stores nothing, so no TTL either.
    mock.push(Reply::UnfinishedStream);
    let mut streamed = body(&[user("hi")]);
    streamed["stream"] = serde_json::Value::Bool(true);
    let unfinished = chat(&proxy, "ttl-cut-stream", &streamed, &ttl).await;
    assert_eq!(unfinished.status, 200);
    assert_eq!(ttl_record(&proxy, "ttl-cut-stream"), None);
    assert!(!any_trace(&proxy, "ttl-cut-stream"));

    // persist=false stores nothing, so no TTL either.
    let ephemeral = chat(
        &proxy,
        "ttl-ephemeral",
        &body(&[user("hi")]),
        &[("x-memory-ttl", "P36500D"), ("x-memory-persist", "false")],
    )
    .await;
    assert_eq!(ephemeral.status, 200);
    assert!(!any_trace(&proxy, "ttl-ephemeral"));

    // A request that stores its exchange, JSON or stream, records its TTL with it.
    store_one(&proxy, "ttl-stored", "hi", &ttl).await;
    let record = ttl_record(&proxy, "ttl-stored").unwrap();
    assert_eq!(record.ttl_ms, Some(36_500 * 86_400_000));
    let stream = chat(&proxy, "ttl-stream", &streamed, &ttl).await;
    assert_eq!(stream.status, 200);
    assert_eq!(stream.header("x-memory-status"), "stored");
    assert_eq!(
        ttl_record(&proxy, "ttl-stream").unwrap().ttl_ms,
        Some(36_500 * 86_400_000)
    );
}
