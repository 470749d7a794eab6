//! A damaged store never takes the proxy down (issue 11, item 7): with store files sled cannot
//! open, or conversation keys lost, memproxy starts, passes requests through, answers chat
//! requests without memory (`X-Memory-Status: degraded`, the client's own messages upstream),
//! and says why in `/readyz` (503) while `/healthz` stays 200. `memproxy store check` names
//! the damage (exit 1) without changing a byte of the data directory, and `memproxy store
//! repair --into NEW_DIR` writes what can be read into a store a fresh proxy serves: for a
//! whole store, everything.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::support::admin::*;
use crate::support::cli::{memproxy, memproxy_on, stdout};
use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

/// Every file under `dir` and its bytes: to show a command changed nothing.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    files(dir).into_iter().collect()
}

/// Runs `memproxy store repair` on `data_dir` into a new directory: the temporary directory
/// that holds it, its path, and the report.
fn repair(data_dir: &Path) -> (tempfile::TempDir, PathBuf, String) {
    let parent = tempfile::tempdir().unwrap();
    let into = parent.path().join("data");
    let repaired = memproxy(
        data_dir,
        &["store", "repair", "--into", into.to_str().unwrap()],
    );
    let report = stdout(&repaired);
    assert!(repaired.status.success(), "{report}");
    (parent, into, report)
}

/// Two exchanges in each of `conversations`, with a TTL; returns each conversation's history
/// as the client holds it.
async fn converse(proxy: &Proxy, conversations: &[&str]) -> BTreeMap<String, Vec<Value>> {
    let mut histories = BTreeMap::new();
    for conversation in conversations {
        let mut history = Vec::new();
        for turn in 1..=2 {
            history.push(user(&format!("{conversation} question {turn}")));
            let answer = chat(
                proxy,
                conversation,
                &body(&history),
                &[("x-memory-ttl", "P30D")],
            )
            .await;
            assert_eq!(answer.status, 200);
            assert_eq!(answer.header("x-memory-status"), "stored");
            history.push(reply_message(&answer));
        }
        histories.insert(conversation.to_string(), history);
    }
    histories
}

/// What a client sees from a proxy whose memory is off for `conversation`: pass-through and
/// health work, a chat request goes upstream as the client sent it, without memory.
async fn assert_served_without_memory(
    proxy: &Proxy,
    mock: &MockUpstream,
    conversation: &str,
    reason: &str,
) {
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
    assert_eq!(models.status, 200, "pass-through works");
    let own = vec![
        user("an earlier question"),
        assistant("an earlier answer"),
        user("the new question"),
    ];
    let answer = chat(proxy, conversation, &body(&own), &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-memory-status"), "degraded");
    assert_eq!(answer.header("x-memory-reason"), reason);
    assert_eq!(
        mock.last_messages(),
        own,
        "the client's own messages went upstream"
    );
}

#[tokio::test]
async fn a_store_sled_cannot_open_leaves_the_proxy_serving_without_memory() {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Two lives: the second open writes sled's snapshot of the first's writes, so damage
    // among them is found when the store opens (see `store/sled_engine.rs`).
    for life in ["one", "two"] {
        let proxy = Harness::new().admin().proxy_on(&mock, dir.path()).await;
        converse(&proxy, &[&format!("{life}-a"), &format!("{life}-b")]).await;
        proxy.stop().await;
    }
    let db = dir.path().join("store").join("db");
    let mut bytes = std::fs::read(&db).unwrap();
    bytes[64..96].fill(0xab);
    std::fs::write(&db, bytes).unwrap();

    let proxy = Harness::new().admin().proxy_on(&mock, dir.path()).await;
    assert!(proxy.state.memory().is_none(), "started without memory");
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 503);
    let ready = ready.json();
    assert_eq!(ready["status"], "unavailable");
    assert_eq!(ready["store"], false);
    let reason = ready["reason"].as_str().unwrap();
    assert!(reason.contains("damaged"), "{reason}");
    assert_served_without_memory(&proxy, &mock, "one-a", "store-unavailable").await;
    let answer = chat(&proxy, "a-new-one", &body(&[user("hello")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "degraded");

    // The admin API has no store to work on: 503, OpenAI-shaped; metrics still answer.
    let listed = admin(&proxy, "GET", "/admin/v1/conversations", "").await;
    assert_eq!(listed.status, 503);
    assert_eq!(listed.json()["error"]["code"], "store_unavailable");
    let metrics = send("GET", &proxy.url("/metrics"), &[], "").await;
    assert_eq!(metrics.status, 200);
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(text.contains("memproxy_store_up 0"), "{text}");
    assert!(text.contains("memproxy_requests_total"), "{text}");
    proxy.stop().await;

    // The check names the damage and changes nothing.
    let before = snapshot(dir.path());
    let checked = memproxy(dir.path(), &["store", "check"]);
    let report = stdout(&checked);
    assert_eq!(checked.status.code(), Some(1), "{report}");
    assert!(report.contains("damaged"), "{report}");
    assert!(report.contains("sled would not open the store"), "{report}");

    // The repair writes what sled can still read into a fresh store a proxy serves.
    let (_repaired, into, report) = repair(dir.path());
    assert!(report.contains("repaired"), "{report}");
    assert_eq!(
        snapshot(dir.path()),
        before,
        "the damaged directory is unchanged"
    );
    let checked = memproxy(&into, &["store", "check"]);
    assert_eq!(checked.status.code(), Some(0), "{}", stdout(&checked));

    let proxy = Proxy::start(&mock, &into, "").await;
    assert_eq!(
        send("GET", &proxy.url("/readyz"), &[], "").await.status,
        200
    );
    let answer = chat(&proxy, "after-repair", &body(&[user("hello again")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    proxy.stop().await;
}

#[tokio::test]
async fn a_lost_or_garbled_key_turns_memory_off_for_its_conversation_only() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().start().await;
    let histories = converse(&proxy, &["missing", "garbled", "kept"]).await;
    let store = proxy.store();
    let key_file = |name: &str| {
        let id = store.meta(&key(Some(TOKEN), name)).unwrap().unwrap().id;
        dir.path().join("keys").join(format!("{id:016x}.key"))
    };
    let (missing, garbled) = (key_file("missing"), key_file("garbled"));
    proxy.stop().await;
    std::fs::remove_file(&missing).unwrap();
    std::fs::write(&garbled, b"garbage, not a key").unwrap();

    let proxy = Proxy::start(&mock, dir.path(), "").await;
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 503);
    let reason = ready.json()["reason"].as_str().unwrap().to_string();
    assert!(
        reason.contains("2 conversation(s) cannot be read"),
        "{reason}"
    );
    assert!(reason.contains("key files"), "{reason}");
    assert_served_without_memory(&proxy, &mock, "missing", "store-error").await;
    assert_served_without_memory(&proxy, &mock, "garbled", "store-error").await;
    // The other conversations keep their memory: a newest-only client gets its history.
    let answer = chat(&proxy, "kept", &body(&[user("kept question 3")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    let forwarded = mock.last_messages();
    assert_eq!(forwarded[..4], histories["kept"][..]);
    proxy.stop().await;

    let before = snapshot(dir.path());
    let checked = memproxy(dir.path(), &["store", "check"]);
    let report = stdout(&checked);
    assert_eq!(checked.status.code(), Some(1), "{report}");
    assert!(
        report.contains(
            "/default/missing: none of its 4 messages can be kept (its key file is missing)"
        ),
        "{report}"
    );
    assert!(
        report.contains(
            "/default/garbled: none of its 4 messages can be kept (its key file is malformed)"
        ),
        "{report}"
    );
    assert!(report.contains("is malformed"), "{report}");
    assert!(
        !report.contains("question"),
        "no message text in the report: {report}"
    );

    let (_repaired, into, report) = repair(dir.path());
    assert!(
        report.contains("conversations: 3 found, 1 salvaged, 2 lost"),
        "{report}"
    );
    assert_eq!(
        snapshot(dir.path()),
        before,
        "the damaged directory is unchanged"
    );

    // A fresh proxy on the repaired store: ready, the kept conversation's whole history in
    // memory, the lost ones starting afresh.
    let proxy = Proxy::start(&mock, &into, "").await;
    assert_eq!(
        send("GET", &proxy.url("/readyz"), &[], "").await.status,
        200
    );
    let answer = chat(&proxy, "kept", &body(&[user("kept question 4")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(answer.header("x-memory-turns"), "8");
    assert_eq!(mock.last_messages()[..4], histories["kept"][..]);
    let answer = chat(&proxy, "missing", &body(&[user("from scratch")]), &[]).await;
    assert_eq!(answer.header("x-memory-turns"), "2");
    assert_eq!(mock.last_messages(), vec![user("from scratch")]);
    proxy.stop().await;
}

/// A summary small enough to be made after a few exchanges (as `tests/it/compression.rs`).
const SUMMARIES: &str = "[memory]\nrecent_n = 4\ncompression_threshold_tokens = 150\ncompression_async = false\nrelevance_enabled = false\n";

#[tokio::test]
async fn a_repair_of_a_whole_store_keeps_everything() {
    repair_whole_into("sled").await;
}

/// How a sled store moves to fjall: a repair into a fjall store keeps everything, as into
/// sled; a proxy on fjall pointed at the sled directory refuses to start its memory empty.
#[tokio::test]
async fn a_repair_into_fjall_moves_a_sled_store_and_fjall_never_starts_empty_beside_sled() {
    repair_whole_into("fjall").await;
}

/// Writes a store with summaries, TTLs and a closed branch, repairs it into a new directory
/// with `engine`, and compares.
async fn repair_whole_into(engine: &str) {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().config(SUMMARIES).start().await;
    let mut history = Vec::new();
    for i in 0..8 {
        history.push(user(&format!(
            "Fact number {i}: the blue lantern stands on shelf {i} in the north storeroom"
        )));
        let answer = chat(&proxy, "long", &body(&history), &[("x-memory-ttl", "P7D")]).await;
        assert_eq!(answer.header("x-memory-status"), "stored");
        history.push(reply_message(&answer));
    }
    let short = converse(&proxy, &["short"]).await;
    // The client edits its second question: the stored line after it becomes a closed branch.
    let mut edited = short["short"][..2].to_vec();
    edited.push(user("short question 2, edited"));
    let answer = chat(&proxy, "short", &body(&edited), &[("x-memory-ttl", "P30D")]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    proxy.stop().await;

    let checked = memproxy(dir.path(), &["store", "check"]);
    let report = stdout(&checked);
    assert_eq!(checked.status.code(), Some(0), "{report}");
    assert!(report.contains("no problem found"), "{report}");
    let into = dir.path().join("repaired");
    let repaired = memproxy(
        dir.path(),
        &[
            "store",
            "repair",
            "--into",
            into.to_str().unwrap(),
            "--engine",
            engine,
        ],
    );
    assert!(repaired.status.success(), "{}", stdout(&repaired));
    assert!(stdout(&repaired).contains("everything was salvaged"));
    assert!(stdout(&repaired).contains(&format!("({engine})")));
    let folder = if engine == "fjall" { "fjall" } else { "store" };
    assert!(into.join(folder).is_dir());

    // Messages, turn numbers, times, token counts, summaries and TTLs, as they were.
    for conversation in ["long", "short"] {
        let address = format!("{}/default/{conversation}", tenant(TOKEN));
        let show = |dir: &Path| -> Value {
            let output = memproxy(dir, &["conversations", "show", &address]);
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            serde_json::from_slice(&output.stdout).unwrap()
        };
        let show_on = |dir: &Path| -> Value {
            let output = memproxy_on(dir, engine, &["conversations", "show", &address]);
            assert!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            serde_json::from_slice(&output.stdout).unwrap()
        };
        let (old, new) = (show(dir.path()), show_on(&into));
        assert_eq!(old, new, "{conversation}");
        assert!(new["ttl"].is_string(), "{new}");
        if conversation == "long" {
            assert_eq!(new["ttl"], json!("P7D"));
            assert!(!new["summaries"].as_array().unwrap().is_empty(), "{new}");
        } else {
            assert_eq!(new["branches"].as_array().unwrap().len(), 1, "{new}");
        }
    }
    // Sealed as before (the keys came along): the store's files hold no message text. The
    // summaries' Markdown copies for people came along too.
    let files = snapshot(&into);
    assert!(files.keys().any(|p| p.starts_with(into.join("keys"))));
    for (path, bytes) in &files {
        if path.starts_with(into.join(folder)) {
            assert!(!bytes.windows(12).any(|w| w == b"blue lantern"), "{path:?}");
        }
    }
    assert!(files.keys().any(|p| p.starts_with(into.join("workspaces"))));

    // And a fresh proxy goes on from there.
    let storage = format!("backend = \"{engine}\"\n");
    if engine == "fjall" {
        // check and repair read sled stores, and say so.
        let checked = memproxy_on(&into, "fjall", &["store", "check"]);
        assert_eq!(checked.status.code(), Some(2));
        let said = String::from_utf8_lossy(&checked.stderr);
        assert!(said.contains("read a sled store"), "{said}");
        // Not on the sled directory: it would start empty beside the conversations there.
        let beside = Proxy::start_config(test_config_with_storage(
            &mock,
            dir.path(),
            "",
            &storage,
            "",
        ))
        .await;
        let ready = send("GET", &beside.url("/readyz"), &[], "").await;
        assert_eq!(ready.status, 503);
        let reason = ready.json()["reason"].as_str().unwrap().to_string();
        assert!(reason.contains("holds a sled store"), "{reason}");
        assert!(reason.contains("--engine fjall"), "{reason}");
        assert_served_without_memory(&beside, &mock, "short", "store-unavailable").await;
        beside.stop().await;
        assert!(
            !dir.path().join("fjall").exists(),
            "nothing written beside it"
        );
    }
    let proxy = Proxy::start_config(test_config_with_storage(
        &mock, &into, "", &storage, SUMMARIES,
    ))
    .await;
    let answer = chat(&proxy, "short", &body(&[user("short question 3")]), &[]).await;
    assert_eq!(answer.header("x-memory-status"), "stored");
    assert_eq!(answer.header("x-memory-turns"), "6");
    proxy.stop().await;
}
