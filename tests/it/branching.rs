//! Branching histories through the real proxy: a full-history client whose user regenerates an
//! earlier reply or edits an earlier message sends its history up to there; that history is
//! the truth. The stored messages past the shared run leave the main line as a closed branch
//! (shown by the admin API, exported, deleted with the conversation), the request is forwarded
//! as the client's branch, and every message is stored once. The other habits (sliding window,
//! newest only, retries, a regenerated last answer) never branch.

use std::time::Duration;

use memproxy::message::check_tool_sequence;
use serde_json::{Value, json};

use crate::support::admin::*;
use crate::support::mock_upstream::{MockUpstream, Reply};
use crate::support::*;

/// What each of the five stored exchanges is about.
const TOPICS: [&str; 5] = ["apples", "bananas", "cherries", "dates", "elderberries"];

fn question(i: usize) -> Value {
    user(&format!("question {i} about {}", TOPICS[i - 1]))
}

/// Five exchanges stored by a full-history client; returns its history (10 messages).
async fn five_exchanges(proxy: &Proxy, id: &str, headers: &[(&str, &str)]) -> Vec<Value> {
    let mut history = Vec::new();
    for i in 1..=5 {
        history.push(question(i));
        let answer = chat(proxy, id, &body(&history), headers).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.header("x-memory-turns"), (2 * i).to_string());
        history.push(reply_message(&answer));
    }
    history
}

/// The forwarded messages as `role:content`, and the whole forwarded list as one string.
fn forwarded(mock: &MockUpstream) -> (Vec<String>, String) {
    let messages = mock.last_messages();
    check_tool_sequence(&messages).unwrap();
    let text = Value::Array(messages.clone()).to_string();
    (messages.iter().map(role_content).collect(), text)
}

/// The conversation messages of a forwarded list (memproxy's system messages left out).
fn turns_of(forwarded: &[String]) -> Vec<String> {
    forwarded
        .iter()
        .filter(|m| !m.starts_with("system:"))
        .cloned()
        .collect()
}

fn contents(messages: &[Value]) -> Vec<String> {
    messages.iter().map(role_content).collect()
}

fn assert_each_once(stored: &[String]) {
    for message in stored {
        assert_eq!(
            stored.iter().filter(|m| *m == message).count(),
            1,
            "{message} stored more than once: {stored:?}"
        );
    }
}

/// The conversation as the admin API shows it.
async fn shown(proxy: &Proxy, id: &str) -> Value {
    let answer = admin(proxy, "GET", &conversation_path(TOKEN, "default", id), "").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    answer.json()
}

/// `memproxy_branches_closed_total`, scraped.
async fn branches_closed(proxy: &Proxy) -> u64 {
    let text = send("GET", &proxy.url("/metrics"), &[], "").await.body;
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|line| line.strip_prefix("memproxy_branches_closed_total "))
        .unwrap()
        .parse()
        .unwrap()
}

fn shown_contents(messages: &Value) -> Vec<String> {
    messages
        .as_array()
        .unwrap()
        .iter()
        .map(|m| role_content(&m["message"]))
        .collect()
}

#[tokio::test]
async fn regenerating_an_earlier_reply_branches_and_stores_each_message_once() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let history = five_exchanges(&proxy, "regen", &[]).await;
    let old_line = contents(&history);

    // Reply 3 regenerated: the client sends u1 r1 u2 r2 u3.
    mock.push(Reply::Text("reply 3 regenerated".into()));
    let answer = chat(&proxy, "regen", &body(&history[..5]), &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(answer.header("x-memory-turns"), "6");
    let (sent, text) = forwarded(&mock);
    assert_eq!(turns_of(&sent), old_line[..5], "{sent:?}");
    assert_eq!(sent.last().unwrap(), "user:question 3 about cherries");
    for abandoned in ["reply to: question 3", "dates", "elderberries"] {
        assert!(!text.contains(abandoned), "{abandoned} forwarded: {text}");
    }
    let mut line = old_line[..5].to_vec();
    line.push("assistant:reply 3 regenerated".into());
    assert_eq!(summarize(&proxy.stored(Some(TOKEN), "regen")), line);

    // The next full-history turn stores its question and the reply, once.
    let mut next = history[..5].to_vec();
    next.push(assistant("reply 3 regenerated"));
    next.push(user("question 6 about figs"));
    let answer = chat(&proxy, "regen", &body(&next), &[]).await;
    assert_eq!(answer.header("x-memory-turns"), "8");
    let (sent, text) = forwarded(&mock);
    assert_eq!(turns_of(&sent), contents(&next));
    assert!(!text.contains("dates") && !text.contains("reply to: question 3"));
    line.push("user:question 6 about figs".into());
    line.push("assistant:reply to: question 6 about figs".into());
    let stored = summarize(&proxy.stored(Some(TOKEN), "regen"));
    assert_eq!(stored, line);
    assert_each_once(&stored);

    // One closed branch holds the old r3 u4 r4 u5 r5, as they were stored (turns 6-10).
    let shown = shown(&proxy, "regen").await;
    assert_eq!(shown["message_count"], 8);
    let branches = shown["branches"].as_array().unwrap();
    assert_eq!(branches.len(), 1, "{shown}");
    assert_eq!(branches[0]["number"], 1);
    assert_eq!(branches[0]["forked_after_turn"], 5);
    assert_eq!(shown_contents(&branches[0]["messages"]), old_line[5..]);
    let turns: Vec<u64> = branches[0]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["turn"].as_u64().unwrap())
        .collect();
    assert_eq!(turns, [6, 7, 8, 9, 10]);
    let main_turns: Vec<u64> = shown["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["turn"].as_u64().unwrap())
        .collect();
    assert_eq!(main_turns, [1, 2, 3, 4, 5, 11, 12, 13]);
    assert_eq!(branches_closed(&proxy).await, 1);
}

#[tokio::test]
async fn editing_an_earlier_message_branches_and_survives_a_restart() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().admin().start().await;
    let history = five_exchanges(&proxy, "edit", &[]).await;
    let old_line = contents(&history);

    // User 3 edited: the client sends u1 r1 u2 r2 u3-EDITED.
    let mut edited = history[..4].to_vec();
    edited.push(user("question 3 EDITED about figs"));
    let answer = chat(&proxy, "edit", &body(&edited), &[]).await;
    assert_eq!(answer.header("x-memory-turns"), "6");
    let (sent, text) = forwarded(&mock);
    assert_eq!(turns_of(&sent), contents(&edited));
    for abandoned in ["cherries", "dates", "elderberries"] {
        assert!(!text.contains(abandoned), "{abandoned} forwarded: {text}");
    }
    let mut line = contents(&edited);
    line.push("assistant:reply to: question 3 EDITED about figs".into());
    assert_eq!(summarize(&proxy.stored(Some(TOKEN), "edit")), line);

    // The next turn stores each message once, and forwards none twice.
    edited.push(reply_message(&answer));
    edited.push(user("question 6 about grapes"));
    chat(&proxy, "edit", &body(&edited), &[]).await;
    let (sent, _) = forwarded(&mock);
    assert_eq!(turns_of(&sent), contents(&edited));
    line.push("user:question 6 about grapes".into());
    line.push("assistant:reply to: question 6 about grapes".into());
    let stored = summarize(&proxy.stored(Some(TOKEN), "edit"));
    assert_eq!(stored, line);
    assert_each_once(&stored);

    // After a restart the main line and the branch read back the same.
    proxy.stop().await;
    let proxy = Harness::new().admin().proxy_on(&mock, dir.path()).await;
    assert_eq!(summarize(&proxy.stored(Some(TOKEN), "edit")), line);
    let shown = shown(&proxy, "edit").await;
    let branches = shown["branches"].as_array().unwrap();
    assert_eq!(branches.len(), 1);
    assert_eq!(branches[0]["forked_after_turn"], 4);
    assert_eq!(shown_contents(&branches[0]["messages"]), old_line[4..]);
    edited.push(reply_message(
        &chat(&proxy, "edit", &body(&edited), &[]).await,
    ));
    let (sent, _) = forwarded(&mock);
    assert!(!sent.iter().any(|m| m.contains("cherries")), "{sent:?}");
}

#[tokio::test]
async fn a_closed_branch_is_never_recalled_and_goes_with_export_import_and_delete() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    // A small window, so recall searches the older pool.
    let small = [("x-memory-recent-n", "2")];
    let history = five_exchanges(&proxy, "recall", &small).await;
    // Reply 2 regenerated: the branch takes r2 … r5.
    mock.push(Reply::Text("reply 2 regenerated".into()));
    let mut line = history[..3].to_vec();
    let answer = chat(&proxy, "recall", &body(&line), &small).await;
    line.push(reply_message(&answer));
    // Questions about the abandoned topics recall nothing of them.
    for topic in ["dates", "elderberries", "cherries"] {
        line.push(user(&format!("what about {topic}?")));
        let answer = chat(&proxy, "recall", &body(&line), &small).await;
        let (_, text) = forwarded(&mock);
        let abandoned = ["question 3 about", "question 4 about", "question 5 about"];
        for marker in abandoned {
            assert!(!text.contains(marker), "{marker} recalled: {text}");
        }
        line.push(reply_message(&answer));
    }
    assert_each_once(&summarize(&proxy.stored(Some(TOKEN), "recall")));

    // The export carries the branch; an import into an empty conversation gives it back.
    let path = conversation_path(TOKEN, "default", "recall");
    let export = admin(&proxy, "GET", &format!("{path}/export"), "").await;
    let export_json = export.json();
    assert_eq!(export_json["branches"].as_array().unwrap().len(), 1);
    assert_eq!(
        export_json["branches"][0]["messages"]
            .as_array()
            .unwrap()
            .len(),
        7
    );
    let copy = conversation_path(TOKEN, "default", "copy");
    let body_text = String::from_utf8(export.body.to_vec()).unwrap();
    let imported = admin(&proxy, "POST", &format!("{copy}/import"), &body_text).await;
    assert_eq!(imported.status, 200, "{:?}", imported.body);
    assert_eq!(imported.json()["branches_added"], 1);
    let original = shown(&proxy, "recall").await;
    let copied = shown(&proxy, "copy").await;
    assert_eq!(copied["branches"], original["branches"]);
    assert_eq!(copied["messages"], original["messages"]);
    // Importing again adds nothing, branches included.
    let again = admin(&proxy, "POST", &format!("{copy}/import"), &body_text).await;
    assert_eq!(again.json()["branches_skipped"], 1);
    assert_eq!(
        shown(&proxy, "copy").await["branches"],
        original["branches"]
    );

    // A delete leaves nothing of the branch.
    let deleted = admin(&proxy, "DELETE", &path, "").await;
    assert_eq!(deleted.json()["deleted"]["branches"], 1);
    admin(&proxy, "DELETE", &copy, "").await;
    for marker in ["elderberries", "question 4 about"] {
        assert!(!store_contains(&proxy.state, marker), "{marker}");
    }
}

#[tokio::test]
async fn summaries_of_abandoned_turns_are_not_used_for_the_branch() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    for i in 1..=30 {
        mock.push_summary(Reply::Text(format!("SUMMARY-{i:02}")));
    }
    let headers = [
        ("x-memory-recent-n", "2"),
        ("x-memory-window-step", "0"),
        ("x-memory-compression-threshold-tokens", "15"),
        ("x-memory-compression-async", "false"),
        ("x-memory-compression-interval", "PT0S"),
        ("x-memory-relevance-enabled", "false"),
    ];
    let history = five_exchanges(&proxy, "summed", &headers).await;
    let before = shown(&proxy, "summed").await;
    let summaries = before["summaries"].as_array().unwrap().clone();
    let to_turn = |s: &Value| s["record"]["to_turn"].as_u64().unwrap();
    let text_of = |s: &Value| s["record"]["text"].as_str().unwrap().to_string();
    assert!(
        summaries.iter().any(|s| to_turn(s) >= 6) && summaries.iter().any(|s| to_turn(s) < 6),
        "the test needs summaries on both sides of turn 6: {summaries:?}"
    );

    // Reply 3 regenerated: turns 6-10 leave the main line, and so do the summaries that
    // reach them; the newest older one still applies.
    mock.push(Reply::Text("reply 3 regenerated".into()));
    let mut line = history[..5].to_vec();
    let answer = chat(&proxy, "summed", &body(&line), &headers).await;
    assert_eq!(answer.status, 200);
    let closed: Vec<String> = summaries
        .iter()
        .filter(|s| to_turn(s) >= 6)
        .map(text_of)
        .collect();
    let kept = summaries
        .iter()
        .filter(|s| to_turn(s) < 6)
        .map(text_of)
        .next_back()
        .unwrap();
    let (_, text) = forwarded(&mock);
    for summary in &closed {
        assert!(
            !text.contains(summary.as_str()),
            "{summary} forwarded: {text}"
        );
    }
    assert!(text.contains(kept.as_str()), "{kept} not forwarded: {text}");
    let after = shown(&proxy, "summed").await;
    let branch_summaries: Vec<String> = after["branches"][0]["summaries"]
        .as_array()
        .unwrap()
        .iter()
        .map(text_of)
        .collect();
    assert_eq!(branch_summaries, closed);
    assert!(
        after["summaries"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| to_turn(s) < 6)
    );

    // The next turn does not carry them either, and summarizes only the main line.
    let summary_calls = mock.summary_requests().len();
    line.push(reply_message(&answer));
    line.push(user("question 6 about figs"));
    chat(&proxy, "summed", &body(&line), &headers).await;
    let (_, text) = forwarded(&mock);
    for summary in &closed {
        assert!(
            !text.contains(summary.as_str()),
            "{summary} forwarded: {text}"
        );
    }
    for call in &mock.summary_requests()[summary_calls..] {
        let prompt = String::from_utf8_lossy(&call.body);
        for abandoned in ["reply to: question 3", "question 4 about", "elderberries"] {
            assert!(
                !prompt.contains(abandoned),
                "{abandoned} summarized: {prompt}"
            );
        }
    }
    assert_each_once(&summarize(&proxy.stored(Some(TOKEN), "summed")));
}

#[tokio::test]
async fn a_sliding_window_client_never_branches() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    for window in [2, 3, 4] {
        let id = format!("window-{window}");
        let mut history: Vec<Value> = Vec::new();
        for i in 1..=8 {
            history.push(user(&format!("message {i} in a window of {window}")));
            let tail = &history[history.len().saturating_sub(window)..];
            let answer = chat(&proxy, &id, &body(tail), &[]).await;
            assert_eq!(answer.header("x-memory-turns"), (2 * i).to_string());
            history.push(reply_message(&answer));
        }
        assert_eq!(
            summarize(&proxy.stored(Some(TOKEN), &id)),
            contents(&history)
        );
        assert_eq!(shown(&proxy, &id).await["branches"], json!([]));
    }
    assert_eq!(branches_closed(&proxy).await, 0);
}

#[tokio::test]
async fn retries_and_a_regenerated_last_answer_never_branch() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let mut history = five_exchanges(&proxy, "retry", &[]).await;

    // The identical last request twice (an SDK retry): the reply is replaced, no branch.
    for attempt in 1..=2 {
        mock.push(Reply::Text(format!("reply 5, attempt {attempt}")));
        let answer = chat(&proxy, "retry", &body(&history[..9]), &[]).await;
        assert_eq!(answer.header("x-memory-turns"), "10");
        let (sent, _) = forwarded(&mock);
        assert_eq!(turns_of(&sent), contents(&history[..9]));
    }
    history[9] = assistant("reply 5, attempt 2");
    assert_eq!(
        summarize(&proxy.stored(Some(TOKEN), "retry")),
        contents(&history)
    );

    // The client keeps a regenerated last answer and goes on: it replaces ours.
    history[9] = assistant("reply 5 as the client regenerated it");
    history.push(user("question 6 about figs"));
    let answer = chat(&proxy, "retry", &body(&history), &[]).await;
    assert_eq!(answer.header("x-memory-turns"), "12");
    history.push(reply_message(&answer));
    let stored = summarize(&proxy.stored(Some(TOKEN), "retry"));
    assert_eq!(stored, contents(&history));
    assert_each_once(&stored);
    assert_eq!(shown(&proxy, "retry").await["branches"], json!([]));
    assert_eq!(branches_closed(&proxy).await, 0);
}

#[tokio::test]
async fn a_newest_only_client_repeating_an_earlier_message_never_branches() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let mut expected = Vec::new();
    let repeats = [1, 3, 1];
    for i in (1..=5).chain(repeats) {
        let message = question(i);
        let answer = chat(&proxy, "newest", &body(std::slice::from_ref(&message)), &[]).await;
        assert_eq!(answer.status, 200);
        expected.push(role_content(&message));
        expected.push(role_content(&reply_message(&answer)));
        assert_eq!(answer.header("x-memory-turns"), expected.len().to_string());
        // The stored line before it is forwarded (its recent window), then the message:
        // nothing was abandoned.
        let (sent, _) = forwarded(&mock);
        let sent = turns_of(&sent);
        assert!(sent.len() >= (expected.len() - 1).min(11), "{sent:?}");
        assert!(expected[..expected.len() - 1].ends_with(&sent), "{sent:?}");
    }
    assert_eq!(summarize(&proxy.stored(Some(TOKEN), "newest")), expected);
    assert_eq!(shown(&proxy, "newest").await["branches"], json!([]));
    assert_eq!(branches_closed(&proxy).await, 0);
}

#[tokio::test]
async fn a_streamed_branch_reports_the_messages_it_stores() {
    let Started { proxy, .. } = Harness::new().admin().start().await;
    let history = five_exchanges(&proxy, "stream", &[]).await;
    let mut request = body(&history[..3]);
    request["stream"] = json!(true);
    let answer = chat(&proxy, "stream", &request, &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-turns"), "4");
    let stored = summarize(&proxy.stored(Some(TOKEN), "stream"));
    assert_eq!(stored.len(), 4);
    assert_eq!(stored[..3], contents(&history[..3]));
    let shown = shown(&proxy, "stream").await;
    assert_eq!(
        shown["branches"][0]["messages"].as_array().unwrap().len(),
        7
    );
}

/// Two full-history requests planned on the same stored line, each adding its own question:
/// the one that commits second is appended, and never closes the other's exchange as a
/// branch (a branch is closed only when the plan found one).
#[tokio::test]
async fn concurrent_continuations_never_close_each_other() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let proxy = std::sync::Arc::new(proxy);
    let history = five_exchanges(&proxy, "race", &[]).await;
    mock.push(Reply::Delay(
        Duration::from_millis(400),
        Box::new(Reply::Auto),
    ));
    let mut slow = history.clone();
    slow.push(user("the slow question"));
    let slow_proxy = std::sync::Arc::clone(&proxy);
    let slow_request =
        tokio::spawn(async move { chat(&slow_proxy, "race", &body(&slow), &[]).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut fast = history.clone();
    fast.push(user("the fast question"));
    assert_eq!(chat(&proxy, "race", &body(&fast), &[]).await.status, 200);
    assert_eq!(slow_request.await.unwrap().status, 200);
    let stored = summarize(&proxy.stored(Some(TOKEN), "race"));
    assert_eq!(stored.len(), 14, "{stored:?}");
    for question in ["user:the slow question", "user:the fast question"] {
        assert!(stored.iter().any(|m| m == question), "{stored:?}");
    }
    assert_eq!(shown(&proxy, "race").await["branches"], json!([]));
    assert_eq!(branches_closed(&proxy).await, 0);
}

/// A branch in a conversation far over `max_messages`: the trim goes in batches before the
/// exchange's own write, and the branch still closes exactly the abandoned messages.
#[tokio::test]
async fn a_branch_far_over_max_messages_trims_in_batches_and_still_closes() {
    let Started { mock, proxy, .. } = Harness::new().admin().start().await;
    let history: Vec<Value> = (1..=600)
        .flat_map(|i| {
            [
                user(&format!("long {i}")),
                assistant(&format!("answer {i}")),
            ]
        })
        .collect();
    let export = json!({"format": "memproxy.conversation.v1", "messages": history});
    let path = conversation_path(TOKEN, "default", "long");
    let imported = admin(
        &proxy,
        "POST",
        &format!("{path}/import"),
        &export.to_string(),
    )
    .await;
    assert_eq!(imported.json()["added"], 1200);

    // Reply 550 regenerated, with max_messages 100: about 1,000 messages are trimmed (in
    // batches) and the 101 after user 550 leave the main line.
    mock.push(Reply::Text("answer 550 regenerated".into()));
    let answer = chat(
        &proxy,
        "long",
        &body(&history[..1099]),
        &[("x-memory-max-messages", "100")],
    )
    .await;
    assert_eq!(answer.status, 200);
    let stored = summarize(&proxy.stored(Some(TOKEN), "long"));
    assert!(stored.len() <= 100, "{} stored", stored.len());
    assert_eq!(
        stored[stored.len() - 2..],
        ["user:long 550", "assistant:answer 550 regenerated"]
    );
    assert_eq!(stored[0].split(' ').next(), Some("user:long"));
    let shown = shown(&proxy, "long").await;
    let closed = shown_contents(&shown["branches"][0]["messages"]);
    assert_eq!(closed.len(), 101);
    assert_eq!(closed[0], "assistant:answer 550");
    assert_eq!(closed[100], "assistant:answer 600");
}
