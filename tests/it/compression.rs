//! Compression through the real proxy: progressive summaries made when the unsummarized older
//! pool passes the threshold, in sync and async mode, throttled, with a heuristic stand-in when
//! the summarizer fails, and never stored as turns.

use std::time::{Duration, Instant};

use memproxy::store::workspace_dir;
use memproxy::summary;
use serde_json::{Value, json};

use crate::support::mock_upstream::Reply;
use crate::support::*;

/// A small threshold so a few exchanges cross it.
const SETTINGS: &str =
    "[memory]\nrecent_n = 4\ncompression_threshold_tokens = 150\nrelevance_enabled = false\n";

/// [`SETTINGS`] with compression in sync mode: the summary is made before the answer.
fn sync_mode() -> Harness {
    Harness::new()
        .config(SETTINGS)
        .config("compression_async = false\n")
}

fn line(i: usize) -> String {
    format!("Fact number {i}: the blue lantern stands on shelf {i} in the north storeroom")
}

fn summary_message(messages: &[Value]) -> Option<String> {
    messages
        .iter()
        .find(|m| {
            m["role"] == "system"
                && m["content"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with("[Summary of earlier conversation")
        })
        .map(|m| m["content"].as_str().unwrap().to_string())
}

/// A whole backlog at once (a client that re-sends a long history on its first call): `facts`
/// exchanges, then one more question.
async fn send_backlog(proxy: &Proxy, conversation: &str, facts: usize) {
    let mut request: Vec<Value> = (0..facts)
        .flat_map(|i| [user(&line(i)), assistant(&format!("Noted {i}."))])
        .collect();
    request.push(user("go on"));
    chat(proxy, conversation, &body(&request), &[]).await;
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn sync_mode_summarizes_on_the_turn_that_crosses_the_threshold() {
    let Started {
        mock, dir, proxy, ..
    } = sync_mode().start().await;

    let mut crossed_at = None;
    for i in 0..12 {
        let system = json!({"role": "system", "content": "Be terse."});
        let answer = chat(&proxy, "sync", &body(&[system, user(&line(i))]), &[]).await;
        assert_eq!(answer.status, 200);
        if answer.header("x-memory-summary") != "none" {
            crossed_at = Some(i);
            assert!(!answer.header("x-memory-summary").contains("heuristic"));
            let forwarded = mock.last_messages();
            // The client's system message first, then the summary.
            assert_eq!(forwarded[0]["content"], "Be terse.");
            let summary = summary_message(&forwarded).unwrap();
            assert_eq!(forwarded[1]["content"].as_str().unwrap(), summary);
            assert!(summary.contains("Summary of"), "{summary}");
            break;
        }
    }
    let crossed_at = crossed_at.expect("a summary was made");
    assert_eq!(mock.summary_requests().len(), 1);

    // The summary call is not a turn; it went out with the client's credentials and the model.
    assert_eq!(
        proxy.stored(Some(TOKEN), "sync").len(),
        2 * (crossed_at + 1)
    );
    let call = &mock.summary_requests()[0];
    assert_eq!(call.headers["authorization"], format!("Bearer {TOKEN}"));
    assert_eq!(call.json()["model"], "gpt-4o-mini");
    let prompt = call.json()["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(prompt.contains("Previous summary:\n(none yet)"));
    assert!(prompt.contains("[earlier turn #1 at "));

    // The record and its Markdown copy.
    let store = proxy.store();
    let handle = store.conversation(&key(Some(TOKEN), "sync")).unwrap();
    let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
    let record = store
        .latest_summary(&key(Some(TOKEN), "sync"), id)
        .unwrap()
        .unwrap();
    assert_eq!(record.from_turn, 1);
    assert!(record.original_tokens > 150 && record.ratio > 0.0);
    let file = workspace_dir(dir.path(), &key(Some(TOKEN), "sync"))
        .join("memory")
        .join(format!("summary-1-{}.md", record.to_turn));
    assert!(
        std::fs::read_to_string(file)
            .unwrap()
            .contains(&record.text)
    );
}

#[tokio::test]
async fn async_mode_summarizes_off_the_hot_path_and_uses_it_next_turn() {
    let Started { mock, proxy, .. } = Harness::new().config(SETTINGS).start().await;
    // The summarizer is slow: the triggering turn must not wait for it.
    mock.push_summary(Reply::Delay(
        Duration::from_secs(3),
        Box::new(Reply::Text("Lanterns are on shelves 0 to 5.".into())),
    ));

    let conversation = key(Some(TOKEN), "async");
    let mut triggered = None;
    for i in 0..12 {
        let started = Instant::now();
        let answer = chat(&proxy, "async", &body(&[user(&line(i))]), &[]).await;
        let took = started.elapsed();
        if proxy
            .state
            .memory()
            .unwrap()
            .summarizer
            .in_flight(&conversation)
        {
            // The triggering turn only queued the job: it neither waited for the model nor
            // made the stand-in itself.
            assert!(
                took < Duration::from_millis(2500),
                "the triggering turn waited {took:?}"
            );
            assert_eq!(answer.header("x-memory-summary"), "none");
            triggered = Some(i);
            break;
        }
    }
    let triggered = triggered.expect("the threshold was crossed");
    // While the model works, the worker's heuristic stand-in is in the prompt.
    wait_for("the stand-in", || {
        let store = proxy.store();
        let handle = store.conversation(&conversation).unwrap();
        let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
        store.latest_summary(&conversation, id).unwrap().is_some()
    })
    .await;
    let answer = chat(&proxy, "async", &body(&[user(&line(triggered + 1))]), &[]).await;
    assert!(answer.header("x-memory-summary").ends_with("heuristic"));
    wait_for("the summary record", || {
        let store = proxy.store();
        let handle = store.conversation(&key(Some(TOKEN), "async")).unwrap();
        let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
        store
            .latest_summary(&key(Some(TOKEN), "async"), id)
            .unwrap()
            .is_some_and(|r| !r.heuristic)
    })
    .await;
    let answer = chat(
        &proxy,
        "async",
        &body(&[user("where are the lanterns?")]),
        &[],
    )
    .await;
    assert!(!answer.header("x-memory-summary").contains("heuristic"));
    assert!(
        summary_message(&mock.last_messages())
            .unwrap()
            .contains("Lanterns are on shelves 0 to 5.")
    );
}

#[tokio::test]
async fn summaries_are_throttled_and_progressive() {
    // Throttled: one summary per hour.
    let Started { mock, proxy, .. } = sync_mode().start().await;
    for i in 0..30 {
        chat(&proxy, "slow", &body(&[user(&line(i))]), &[]).await;
    }
    assert_eq!(
        mock.summary_requests().len(),
        1,
        "throttled to one per interval"
    );

    // No throttle: each time the uncovered pool passes the threshold, a new summary follows
    // from the previous one and only the messages that aged out since.
    let Started { mock, proxy, .. } = sync_mode()
        .config("compression_interval = \"PT0S\"\n")
        .start()
        .await;
    for i in 0..30 {
        chat(&proxy, "fast", &body(&[user(&line(i))]), &[]).await;
    }
    let calls = mock.summary_requests();
    assert!(calls.len() >= 3, "{} summaries", calls.len());
    let prompt = |n: usize| {
        calls[n].json()["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let turns_in = |text: &str| -> Vec<u64> {
        text.lines()
            .filter_map(|l| l.strip_prefix("[earlier turn #"))
            .map(|l| l.split(' ').next().unwrap().parse().unwrap())
            .collect()
    };
    let first_turns = turns_in(&prompt(0));
    let second = prompt(1);
    let second_turns = turns_in(&second);
    // The second prompt carries the first summary's text and only later turns.
    let store = proxy.store();
    let handle = store.conversation(&key(Some(TOKEN), "fast")).unwrap();
    let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
    let records: Vec<_> = store
        .summaries(&key(Some(TOKEN), "fast"), id)
        .unwrap()
        .into_iter()
        .filter(|r| !r.heuristic)
        .collect();
    assert!(
        second.contains(&records[0].text),
        "previous summary in the input"
    );
    assert!(
        second_turns
            .iter()
            .all(|t| t > first_turns.iter().max().unwrap())
    );
    assert_eq!(*second_turns.first().unwrap(), records[0].to_turn + 1);
    assert_eq!(
        records[1].from_turn, 1,
        "each summary covers the whole history so far"
    );
}

#[tokio::test]
async fn a_failing_summarizer_leaves_chat_working_with_a_heuristic_stand_in() {
    let Started { mock, proxy, .. } = sync_mode()
        .config("compression_interval = \"PT0S\"\n[compression]\nretry_backoff = \"PT0.2S\"\n")
        .start()
        .await;
    mock.push_summary(Reply::Status(500, r#"{"error":{"message":"boom"}}"#.into()));
    let mut heuristic_seen = false;
    for i in 0..12 {
        let answer = chat(&proxy, "fail", &body(&[user(&line(i))]), &[]).await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("x-memory-status"), "stored");
        if answer.header("x-memory-summary").ends_with("heuristic") {
            heuristic_seen = true;
            let summary = summary_message(&mock.last_messages()).unwrap();
            assert!(
                summary.contains("heuristic")
                    && summary.contains("first user message: Fact number 0"),
                "{summary}"
            );
            break;
        }
    }
    assert!(heuristic_seen);
    assert_eq!(
        proxy
            .state
            .memory()
            .unwrap()
            .summarizer
            .counters
            .failed
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    // After the back-off the job is tried again and a model summary replaces the stand-in.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answer = chat(&proxy, "fail", &body(&[user("next")]), &[]).await;
    let label = answer.header("x-memory-summary");
    assert!(!label.contains("heuristic") && label != "none", "{label}");
}

#[tokio::test]
async fn shutdown_waits_for_a_summary_in_flight() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().config(SETTINGS).start().await;
    mock.push_summary(Reply::Delay(
        Duration::from_millis(500),
        Box::new(Reply::Text("Kept through shutdown.".into())),
    ));
    for i in 0..12 {
        chat(&proxy, "bye", &body(&[user(&line(i))]), &[]).await;
        if !mock.summary_requests().is_empty() {
            break;
        }
    }
    wait_for("the summary call", || !mock.summary_requests().is_empty()).await;
    let stopping = Instant::now();
    proxy.stop().await;
    assert!(stopping.elapsed() < Duration::from_secs(5));
    // Reopen the store: the summary the job was making is there.
    let config = memproxy::config::from_toml(
        &format!(
            "[storage]\ndata_dir = \"{}\"\n[upstream]\nbase_url = \"{}\"\n",
            dir.path().display(),
            mock.base_url()
        ),
        &|_| None,
    )
    .unwrap();
    let state = memproxy::state::AppState::build(config).unwrap();
    let handle = state
        .memory()
        .unwrap()
        .store
        .conversation(&key(Some(TOKEN), "bye"))
        .unwrap();
    let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
    let texts: Vec<String> = state
        .memory()
        .unwrap()
        .store
        .summaries(&key(Some(TOKEN), "bye"), id)
        .unwrap()
        .into_iter()
        .map(|r| r.text)
        .collect();
    assert!(
        texts.iter().any(|t| t == "Kept through shutdown."),
        "{texts:?}"
    );
}

#[tokio::test]
async fn workspace_files_stay_inside_the_data_directory() {
    let Started {
        mock, dir, proxy, ..
    } = sync_mode().start().await;
    // ".." is a valid conversation id by the header rules; the file layer must still be safe.
    for i in 0..12 {
        chat(&proxy, "..", &body(&[user(&line(i))]), &[]).await;
    }
    assert_eq!(mock.summary_requests().len(), 1);
    let mut found = Vec::new();
    let mut stack = vec![dir.path().to_path_buf()];
    while let Some(folder) = stack.pop() {
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                found.push(path);
            }
        }
    }
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with(dir.path().join("workspaces")));
    // Hostile ids never get that far: the header rules refuse them.
    let answer = chat(&proxy, "../../etc", &body(&[user("x")]), &[]).await;
    assert_eq!(answer.status, 400);
}

#[tokio::test]
async fn backlogs_are_summarized_in_bounded_calls_and_summaries_are_capped() {
    let Started { mock, proxy, .. } = sync_mode()
        .config("compression_interval = \"PT0S\"\n")
        .config("[compression]\nmax_input_tokens = 100\nmax_summary_tokens = 40\n")
        .start()
        .await;
    // A whole backlog arrives at once (a client that re-sends a long history on its first call).
    send_backlog(&proxy, "backlog", 30).await;
    // The next request finds the pool over the threshold: the first call reads at most ~100
    // tokens of it, not the whole backlog.
    mock.push_summary(Reply::Text("word ".repeat(500)));
    let answer = chat(&proxy, "backlog", &body(&[user("and?")]), &[]).await;
    assert_ne!(answer.header("x-memory-summary"), "none");
    let call = &mock.summary_requests()[0];
    let prompt = call.json()["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let lines = prompt
        .lines()
        .filter(|l| l.starts_with("[earlier turn #"))
        .count();
    assert!((1..=8).contains(&lines), "{lines} messages in one call");
    assert!(prompt.contains("under 40 tokens"));
    let store = proxy.store();
    let handle = store.conversation(&key(Some(TOKEN), "backlog")).unwrap();
    let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
    let record = store
        .latest_summary(&key(Some(TOKEN), "backlog"), id)
        .unwrap()
        .unwrap();
    assert!(record.tokens <= 40, "{} tokens kept", record.tokens);
    assert!(
        record.to_turn < 50,
        "the backlog is left for later calls: {}",
        record.to_turn
    );
    // Later requests carry on through the backlog, oldest first.
    chat(&proxy, "backlog", &body(&[user("more")]), &[]).await;
    let next = store
        .latest_summary(&key(Some(TOKEN), "backlog"), id)
        .unwrap()
        .unwrap();
    assert!(next.to_turn > record.to_turn);
}

#[tokio::test]
async fn a_backlog_larger_than_one_call_is_worked_through_despite_the_interval() {
    // The default interval (one summary an hour) applies, but each call reads ~100 tokens.
    let Started { proxy, .. } = sync_mode()
        .config("[compression]\nmax_input_tokens = 100\n")
        .start()
        .await;
    send_backlog(&proxy, "catch-up", 30).await;

    let store = proxy.store();
    let handle = store.conversation(&key(Some(TOKEN), "catch-up")).unwrap();
    let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
    // Bounded: 62 messages at about 20 tokens, 100 tokens per call. Each request makes the
    // next summary until what is left is under the threshold.
    let mut made = Vec::new();
    for i in 0..40 {
        chat(
            &proxy,
            "catch-up",
            &body(&[user(&format!("and {i}?"))]),
            &[],
        )
        .await;
        let records = store.summaries(&key(Some(TOKEN), "catch-up"), id).unwrap();
        if records.len() == made.len() {
            break;
        }
        let latest = records.last().unwrap().clone();
        assert!(!latest.heuristic);
        if let Some(previous) = made.last() {
            let previous: &summary::SummaryRecord = previous;
            assert!(
                previous.partial(),
                "only a partial summary skips the interval"
            );
            assert!(latest.to_turn > previous.to_turn, "each call goes further");
        }
        made.push(latest);
    }
    assert!(
        made.len() >= 3,
        "{} summaries within one compression_interval",
        made.len()
    );
    // Worked through: the 62 messages the first request brought are summarized, not only the
    // ~100 tokens one call reads.
    let last = made.last().unwrap();
    assert!(
        last.to_turn >= 62,
        "the summaries stop at turn {}",
        last.to_turn
    );
}

#[tokio::test]
async fn a_summary_due_on_a_failed_request_is_still_made() {
    let Started { mock, proxy, .. } = Harness::new().config(SETTINGS).start().await;
    send_backlog(&proxy, "failed", 12).await;
    mock.clear();
    // The next request finds a summary due, and the upstream fails it.
    mock.push(Reply::Status(500, r#"{"error":{"message":"boom"}}"#.into()));
    let answer = chat(&proxy, "failed", &body(&[user("and?")]), &[]).await;
    assert_eq!(answer.status, 500);
    // The job went to the worker anyway: the stand-in, then the model's summary.
    wait_for("the summary call", || !mock.summary_requests().is_empty()).await;
    let store = proxy.store();
    let handle = store.conversation(&key(Some(TOKEN), "failed")).unwrap();
    let id = memproxy::store::lock(&handle).meta.as_ref().unwrap().id;
    wait_for("the model summary", || {
        store
            .latest_summary(&key(Some(TOKEN), "failed"), id)
            .unwrap()
            .is_some_and(|r| !r.heuristic)
    })
    .await;
    assert!(
        store.summaries(&key(Some(TOKEN), "failed"), id).unwrap()[0].heuristic,
        "the stand-in came first"
    );
}
