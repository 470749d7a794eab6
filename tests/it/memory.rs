//! Conversation memory through the real proxy: client habits, retries, the window, tool-call
//! groups, tenants, settings and restarts.

use memproxy::message::check_tool_sequence;
use serde_json::{Value, json};

use crate::support::mock_upstream::Reply;
use crate::support::*;

#[tokio::test]
async fn both_client_habits_store_the_same_60_messages() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    // SDK habit: the whole history every time.
    let mut history = vec![json!({"role": "system", "content": "be brief"})];
    for i in 1..=30 {
        history.push(user(&format!("question {i}")));
        let answer = chat(&proxy, "sdk", &body(&history), &[]).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.header("x-memory-status"), "stored");
        assert_eq!(answer.header("x-memory-turns"), (2 * i).to_string());
        history.push(reply_message(&answer));
    }
    // Front-end habit: only the newest message.
    for i in 1..=30 {
        let messages = [
            json!({"role": "system", "content": "be brief"}),
            user(&format!("question {i}")),
        ];
        let answer = chat(&proxy, "frontend", &body(&messages), &[]).await;
        assert_eq!(answer.header("x-memory-turns"), (2 * i).to_string());
    }

    let sdk = summarize(&proxy.stored(Some(TOKEN), "sdk"));
    let frontend = summarize(&proxy.stored(Some(TOKEN), "frontend"));
    assert_eq!(sdk.len(), 60);
    assert_eq!(sdk, frontend);
    assert_eq!(sdk[0], "user:question 1");
    assert_eq!(sdk[59], "assistant:reply to: question 30");
    assert!(
        sdk.iter().all(|m| !m.starts_with("system:")),
        "instructions are not turns"
    );

    // The forwarded prompt is the system message, the last 10 stored (exchanges this short
    // stay under the provider's cache minimum, so `window_step = "auto"` slides), recalled
    // older turns, then the new message.
    let forwarded = mock.last_messages();
    let recalled = usize::from(forwarded[forwarded.len() - 2]["role"] == "system");
    assert_eq!(forwarded.len(), 1 + 10 + recalled + 1);
    assert_eq!(role_content(&forwarded[0]), "system:be brief");
    assert_eq!(role_content(&forwarded[1]), "user:question 25");
    assert_eq!(
        role_content(&forwarded[10]),
        "assistant:reply to: question 29"
    );
    assert_eq!(role_content(&forwarded[11 + recalled]), "user:question 30");
}

#[tokio::test]
async fn retries_store_nothing_twice() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    let first = body(&[user("hello")]);
    chat(&proxy, "r", &first, &[]).await;
    // The identical request again, twice (an SDK retry after a timeout).
    for _ in 0..2 {
        mock.push(Reply::Text("second answer".into()));
        let answer = chat(&proxy, "r", &first, &[]).await;
        assert_eq!(answer.header("x-memory-turns"), "2");
    }
    // The retry's reply replaced the first one: the store holds what the client saw last.
    assert_eq!(
        summarize(&proxy.stored(Some(TOKEN), "r")),
        ["user:hello", "assistant:second answer"]
    );
    // The forwarded retry did not repeat the question.
    let forwarded = mock.last_messages();
    assert_eq!(forwarded.len(), 1, "{forwarded:?}");

    // A full re-send retry, after more turns.
    let mut history = vec![user("hello"), assistant("second answer"), user("more")];
    let answer = chat(&proxy, "r", &body(&history), &[]).await;
    history.push(reply_message(&answer));
    let again = chat(&proxy, "r", &body(&history[..3]), &[]).await;
    assert_eq!(again.header("x-memory-turns"), "4");
    assert_eq!(proxy.stored(Some(TOKEN), "r").len(), 4);
}

#[tokio::test]
async fn the_window_follows_recent_n_and_never_splits_tool_groups() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    // An agent loop: each round has a tool call, its results, then a final answer.
    let mut history: Vec<Value> = Vec::new();
    for round in 0..12 {
        history.push(user(&format!("task {round}")));
        mock.push(Reply::ToolCalls(vec![
            (
                format!("call_{round}_a"),
                "lookup".into(),
                format!("{{\"q\":{round}}}"),
            ),
            (format!("call_{round}_b"), "fetch".into(), "{}".into()),
        ]));
        let answer = chat(&proxy, "agent", &body(&history), &[]).await;
        let call = reply_message(&answer);
        assert_eq!(call["tool_calls"].as_array().unwrap().len(), 2);
        history.push(call);
        history.push(json!({"role": "tool", "tool_call_id": format!("call_{round}_a"), "content": "result a"}));
        history.push(json!({"role": "tool", "tool_call_id": format!("call_{round}_b"), "content": "result b"}));
        let answer = chat(&proxy, "agent", &body(&history), &[]).await;
        history.push(reply_message(&answer));
        check_tool_sequence(&mock.last_messages()).unwrap();
    }
    assert_eq!(proxy.stored(Some(TOKEN), "agent").len(), history.len());

    // Every window size gives a valid list that starts at a user message.
    for recent_n in 0..=12 {
        let n = recent_n.to_string();
        let mut request = history.clone();
        request.push(user("next"));
        chat(
            &proxy,
            "agent",
            &body(&request),
            &[("x-memory-recent-n", &n), ("x-memory-persist", "false")],
        )
        .await;
        let forwarded = mock.last_messages();
        check_tool_sequence(&forwarded).unwrap_or_else(|e| panic!("recent_n {recent_n}: {e}"));
        assert_eq!(forwarded[0]["role"], "user", "recent_n {recent_n}");
        assert!(
            forwarded.len() > recent_n,
            "recent_n {recent_n}: {}",
            forwarded.len()
        );
    }

    // Tool results arriving as the only new messages bring their call along, even with a
    // window of zero.
    history.push(user("one more"));
    mock.push(Reply::ToolCalls(vec![(
        "call_last".into(),
        "lookup".into(),
        "{}".into(),
    )]));
    let answer = chat(&proxy, "agent", &body(&history), &[]).await;
    history.push(reply_message(&answer));
    let results = [json!({"role": "tool", "tool_call_id": "call_last", "content": "done"})];
    chat(
        &proxy,
        "agent",
        &body(&results),
        &[("x-memory-recent-n", "0")],
    )
    .await;
    let forwarded = mock.last_messages();
    check_tool_sequence(&forwarded).unwrap();
    let first_turn = forwarded.iter().find(|m| m["role"] != "system").unwrap();
    assert_eq!(role_content(first_turn), "user:one more");
}

#[tokio::test]
async fn two_tokens_with_one_conversation_id_see_separate_histories() {
    let Started { mock, proxy, .. } = Harness::new().start().await;

    chat_as(
        &proxy,
        "sk-alice",
        "shared",
        &body(&[user("alice's secret is 42")]),
        &[],
    )
    .await;
    let answer = chat_as(
        &proxy,
        "sk-bob",
        "shared",
        &body(&[user("what is the secret?")]),
        &[],
    )
    .await;
    assert_eq!(answer.header("x-memory-turns"), "2");
    let forwarded = mock.last_messages();
    assert_eq!(forwarded.len(), 1);
    assert!(!forwarded.iter().any(|m| m.to_string().contains("42")));
    assert_eq!(proxy.stored(Some("sk-alice"), "shared").len(), 2);
    assert_eq!(proxy.stored(Some("sk-bob"), "shared").len(), 2);
}

#[tokio::test]
async fn history_survives_a_restart() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().start().await;
    for i in 0..3 {
        chat(&proxy, "keep", &body(&[user(&format!("fact {i}"))]), &[]).await;
    }
    proxy.stop().await;
    let proxy = Proxy::start(&mock, dir.path(), "").await;
    let answer = chat(&proxy, "keep", &body(&[user("what did I say?")]), &[]).await;
    assert_eq!(answer.header("x-memory-turns"), "8");
    let forwarded: Vec<String> = mock.last_messages().iter().map(role_content).collect();
    assert_eq!(
        forwarded,
        [
            "user:fact 0",
            "assistant:reply to: fact 0",
            "user:fact 1",
            "assistant:reply to: fact 1",
            "user:fact 2",
            "assistant:reply to: fact 2",
            "user:what did I say?"
        ]
    );
}

#[tokio::test]
async fn settings_from_config_and_headers_take_effect() {
    let Started { mock, proxy, .. } = Harness::new()
        .config("[agents.short]\nrecent_n = 2\nwindow_step = 0\nmax_messages = 6\n[agents.off]\nenabled = false\n")
        .start()
        .await;

    for i in 0..5 {
        chat(
            &proxy,
            "s",
            &body(&[user(&format!("m{i}"))]),
            &[("x-memory-agent", "short")],
        )
        .await;
        assert!(mock.last_messages().len() <= 3);
    }
    // max_messages trims whole rounds from the front.
    let stored = summarize(&proxy.stored_agent("short", "s"));
    assert_eq!(
        stored,
        [
            "user:m2",
            "assistant:reply to: m2",
            "user:m3",
            "assistant:reply to: m3",
            "user:m4",
            "assistant:reply to: m4"
        ]
    );

    // persist=false uses memory but stores nothing.
    let answer = chat(
        &proxy,
        "s",
        &body(&[user("ephemeral")]),
        &[("x-memory-agent", "short"), ("x-memory-persist", "false")],
    )
    .await;
    assert_eq!(answer.header("x-memory-status"), "not-stored");
    assert_eq!(answer.header("x-memory-turns"), "6");
    assert_eq!(mock.last_messages().len(), 3);

    // An agent with memory off forwards the request untouched.
    let raw = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":1}"#;
    let answer = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[
            ("x-memory-conversation-id", "o"),
            ("x-memory-agent", "off"),
            ("content-type", "application/json"),
        ],
        raw,
    )
    .await;
    assert_eq!(answer.header("x-memory-status"), "off");
    assert_eq!(mock.chat_requests().last().unwrap().body, raw.as_bytes());
}

#[tokio::test]
async fn system_messages_go_first_and_are_not_stored() {
    let Started { mock, proxy, .. } = Harness::new().start().await;
    chat(
        &proxy,
        "sys",
        &body(&[json!({"role": "system", "content": "S"}), user("a")]),
        &[],
    )
    .await;
    let messages = [
        json!({"role": "system", "content": "S"}),
        json!({"role": "developer", "content": "D"}),
        user("a"),
        assistant("reply to: a"),
        user("b"),
    ];
    chat(&proxy, "sys", &body(&messages), &[]).await;
    let forwarded: Vec<String> = mock.last_messages().iter().map(role_content).collect();
    assert_eq!(
        forwarded,
        [
            "system:S",
            "developer:D",
            "user:a",
            "assistant:reply to: a",
            "user:b"
        ]
    );
    assert_eq!(proxy.stored(Some(TOKEN), "sys").len(), 4);
}

#[tokio::test]
async fn concurrent_requests_on_one_conversation_store_each_message_once() {
    let Started { proxy, .. } = Harness::new().start().await;
    let proxy = std::sync::Arc::new(proxy);
    let mut joins = Vec::new();
    for i in 0..8 {
        let proxy = std::sync::Arc::clone(&proxy);
        joins.push(tokio::spawn(async move {
            chat(
                &proxy,
                "busy",
                &body(&[user(&format!("parallel {i}"))]),
                &[],
            )
            .await
        }));
    }
    for join in joins {
        assert_eq!(join.await.unwrap().status, 200);
    }
    let stored = summarize(&proxy.stored(Some(TOKEN), "busy"));
    assert_eq!(stored.len(), 16);
    for i in 0..8 {
        assert_eq!(
            stored
                .iter()
                .filter(|m| **m == format!("user:parallel {i}"))
                .count(),
            1
        );
    }
}
