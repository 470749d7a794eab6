//! What one request may add to memory: the per-request limits (413, nothing stored), a commit
//! that never leaves more than `max_messages`, and long trims done in bounded batches.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use memproxy::message::Role;
use memproxy::store::{ImportMeta, Origin, StoredMessage, now_ms};
use serde_json::Value;
use serde_json::value::RawValue;
use support::mock_upstream::MockUpstream;
use support::*;

/// `n` alternating user/assistant messages, numbered.
fn history(n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| {
            if i % 2 == 0 {
                user(&format!("question {i}"))
            } else {
                assistant(&format!("answer {i}"))
            }
        })
        .collect()
}

#[tokio::test]
async fn a_request_over_the_new_message_limit_is_413_and_stores_nothing() {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(
        &mock,
        dir.path(),
        "[limits]\nmax_new_messages = 50\nmax_new_tokens = 100000\n",
    )
    .await;
    // Within the limit: stored.
    let mut messages = history(40);
    messages.push(user("the new one"));
    let answer = chat(&proxy, "c", &body(&messages), &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-turns"), "42");

    // A full-history client re-sending what is stored adds only its new messages: fine.
    messages.push(reply_message(&answer));
    messages.push(user("one more"));
    let answer = chat(&proxy, "c", &body(&messages), &[]).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);

    // 60 new messages at once: refused, naming the limit; nothing stored, nothing forwarded.
    let forwarded = mock.chat_requests().len();
    let mut flood = history(59);
    flood.push(user("flood"));
    let answer = chat(&proxy, "other", &body(&flood), &[]).await;
    assert_eq!(answer.status, 413);
    let error = answer.json();
    assert_eq!(error["error"]["code"], "too_many_new_messages");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    assert_eq!(error["error"]["param"], "messages");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("limits.max_new_messages") && message.contains("60"),
        "{message}"
    );
    assert!(proxy.stored(Some(TOKEN), "other").is_empty());
    assert_eq!(mock.chat_requests().len(), forwarded);
}

#[tokio::test]
async fn a_request_over_the_new_token_limit_is_413() {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(&mock, dir.path(), "[limits]\nmax_new_tokens = 200\n").await;
    let long = "word ".repeat(300);
    let answer = chat(&proxy, "c", &body(&[user(&long)]), &[]).await;
    assert_eq!(answer.status, 413);
    assert_eq!(answer.json()["error"]["code"], "too_many_new_tokens");
    assert!(
        answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limits.max_new_tokens")
    );
    assert!(proxy.stored(Some(TOKEN), "c").is_empty());
    let answer = chat(&proxy, "c", &body(&[user("short")]), &[]).await;
    assert_eq!(answer.status, 200);
}

#[tokio::test]
async fn a_commit_never_leaves_more_than_max_messages() {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(&mock, dir.path(), "").await;
    // 30 new messages into a conversation allowed 10: the exchange's own oldest rounds go.
    let mut messages = history(29);
    messages.push(user("last question"));
    let answer = chat(
        &proxy,
        "c",
        &body(&messages),
        &[("x-memory-max-messages", "10")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let stored = proxy.stored(Some(TOKEN), "c");
    assert!(stored.len() <= 10, "{} stored", stored.len());
    assert_eq!(answer.header("x-memory-turns"), stored.len().to_string());
    assert_eq!(stored[0].role, Role::User, "a whole round first");
    let last = summarize(&stored);
    assert_eq!(
        last[last.len() - 2..],
        ["user:last question", "assistant:reply to: last question"]
    );
}

#[tokio::test]
async fn a_conversation_far_over_max_messages_is_trimmed_to_it_and_goes_on() {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(&mock, dir.path(), "").await;
    // A conversation far over the limit it will be used with (stored before the limit
    // was lowered): 1,500 messages.
    let key = key(Some(TOKEN), "long");
    let messages: Vec<StoredMessage> = history(1500)
        .iter()
        .enumerate()
        .map(|(i, m)| StoredMessage {
            turn: i as u64 + 1,
            role: if i % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            },
            origin: Origin::Client,
            at_ms: now_ms(),
            tokens: 3,
            fingerprint: i as u64 + 1,
            message: RawValue::from_string(m.to_string()).unwrap(),
        })
        .collect();
    proxy
        .store()
        .import_conversation(&key, messages, vec![], vec![], ImportMeta::default())
        .unwrap();
    let answer = chat(
        &proxy,
        "long",
        &body(&[user("question 4 again")]),
        &[("x-memory-max-messages", "100")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let stored = proxy.stored(Some(TOKEN), "long");
    assert!(stored.len() <= 100, "{} stored", stored.len());
    assert_eq!(stored[0].role, Role::User);
    assert_eq!(
        summarize(&stored[stored.len() - 2..]),
        [
            "user:question 4 again",
            "assistant:reply to: question 4 again"
        ]
    );
    // The conversation goes on as usual, its recall index in step with what is stored.
    let answer = chat(
        &proxy,
        "long",
        &body(&[user("question 1490")]),
        &[("x-memory-max-messages", "100")],
    )
    .await;
    assert_eq!(answer.status, 200);
    assert!(proxy.stored(Some(TOKEN), "long").len() <= 100);
}
