//! The offline CLI, run as the real binary on a data directory a stopped memproxy left:
//! list, show, export, delete, import, and a clear error while a server holds the store;
//! `check-config` prints the effective settings.

use std::process::Output;

use serde_json::Value;

use crate::support::admin::*;
use crate::support::cli::memproxy;
use crate::support::*;

fn stdout_json(output: &Output) -> Value {
    assert!(
        output.status.success(),
        "{:?}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[tokio::test]
async fn conversations_commands_work_on_a_stopped_servers_data() {
    let Started {
        mock, dir, proxy, ..
    } = Harness::new().start().await;
    for (id, text) in [
        ("one", "first conversation"),
        ("two", "second conversation"),
    ] {
        let answer = chat(&proxy, id, &body(&[user(text)]), &[]).await;
        assert_eq!(answer.status, 200);
    }

    // While the server holds the store, the CLI refuses clearly.
    let locked = memproxy(dir.path(), &["conversations", "list"]);
    assert!(!locked.status.success());
    let message = String::from_utf8_lossy(&locked.stderr);
    assert!(message.contains("one process at a time"), "{message}");
    proxy.stop().await;

    let listed = stdout_json(&memproxy(dir.path(), &["conversations", "list"]));
    let ids: Vec<&str> = listed["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["one", "two"]);
    let paged = stdout_json(&memproxy(
        dir.path(),
        &["conversations", "list", "--limit", "1"],
    ));
    let cursor = paged["next_cursor"].as_str().unwrap().to_string();
    let rest = stdout_json(&memproxy(
        dir.path(),
        &["conversations", "list", "--limit", "1", "--cursor", &cursor],
    ));
    assert_eq!(rest["conversations"][0]["id"], "two");

    let address = format!("{}/default/one", tenant(TOKEN));
    let shown = stdout_json(&memproxy(dir.path(), &["conversations", "show", &address]));
    assert_eq!(shown["messages"][0]["content"], "first conversation");

    let export_file = dir.path().join("one.json");
    let exported = memproxy(
        dir.path(),
        &[
            "conversations",
            "export",
            &address,
            "--output",
            export_file.to_str().unwrap(),
        ],
    );
    assert!(exported.status.success());
    let deleted = stdout_json(&memproxy(
        dir.path(),
        &["conversations", "delete", &address],
    ));
    assert_eq!(deleted["deleted"]["messages"], 2);
    let missing = memproxy(dir.path(), &["conversations", "show", &address]);
    assert_eq!(missing.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no conversation"));

    let imported = stdout_json(&memproxy(
        dir.path(),
        &[
            "conversations",
            "import",
            &address,
            "--input",
            export_file.to_str().unwrap(),
        ],
    ));
    assert_eq!(imported["added"], 2);
    let shown_again = stdout_json(&memproxy(dir.path(), &["conversations", "show", &address]));
    assert_eq!(shown_again, shown);

    let bad = memproxy(dir.path(), &["conversations", "show", "not-an-address"]);
    assert_eq!(bad.status.code(), Some(2));
    let tenant_gone = stdout_json(&memproxy(
        dir.path(),
        &["conversations", "delete", "--tenant", &tenant(TOKEN)],
    ));
    assert_eq!(tenant_gone["deleted_conversations"], 2);

    // The server starts again on what the CLI left.
    let proxy = Proxy::start(&mock, dir.path(), "").await;
    assert!(proxy.stored(Some(TOKEN), "one").is_empty());
    proxy.stop().await;

    let nowhere = memproxy(&dir.path().join("nothing-here"), &["conversations", "list"]);
    assert!(!nowhere.status.success());
    assert!(String::from_utf8_lossy(&nowhere.stderr).contains("does not exist"));
}

/// `check-config`'s output for `toml` written to `config`, which must pass.
fn checked_with(dir: &std::path::Path, config: &std::path::Path, toml: &str) -> String {
    std::fs::write(config, toml).unwrap();
    let output = memproxy(dir, &["--config", config.to_str().unwrap(), "check-config"]);
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn check_config_prints_the_effective_settings_per_agent() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("m.toml");
    std::fs::write(
        &config,
        "[memory]\nttl = \"P30D\"\n[agents.support]\nttl = \"PT1H\"\n[sweeper]\ninterval = \"PT5M\"\n",
    )
    .unwrap();
    let output = memproxy(
        dir.path(),
        &["--config", config.to_str().unwrap(), "check-config"],
    );
    assert!(output.status.success());
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(text.contains("config OK"));
    assert!(text.contains("[agents.support]"));
    assert!(text.contains("ttl = P30D"), "{text}");
    assert!(text.contains("ttl = PT1H"));
    assert!(text.contains("admin API = off"));
    assert!(text.contains("sweeper = every PT5M"));
    assert!(
        text.contains("clients = at most 1024 connections; head within PT10S, body within PT30S, idle for PT1M"),
        "{text}"
    );
    assert!(text.contains("JSON answer PT5M, idle PT2M"), "{text}");

    // What a sled store needs of the budget, for a few sizes and for the store on disk (told
    // from its size: 2.4 GB on disk, about 4 million messages, more than the default reserve),
    // with the default static embedder's 17 MiB set aside first.
    assert!(text.contains("the embedder 17 MiB"), "{text}");
    assert!(
        text.contains("budget a sled store needs so the caches keep their shares: 100000 messages 145 MiB, 1000000 messages 180 MiB"),
        "{text}"
    );
    assert!(!text.contains("store on disk"), "{text}");
    std::fs::create_dir_all(dir.path().join("store")).unwrap();
    let file = std::fs::File::create(dir.path().join("store/db")).unwrap();
    file.set_len(2_400_000_000).unwrap();
    let grown = memproxy(
        dir.path(),
        &["--config", config.to_str().unwrap(), "check-config"],
    );
    let text = String::from_utf8(grown.stdout).unwrap();
    assert!(
        text.contains("store on disk = 2289 MiB, about 4000000 messages: sled needs about 54 MiB past its page cache, the budget reserves 28 MiB; the caches give up 26 MiB: a budget of 294 MiB would leave them whole"),
        "{text}"
    );

    assert!(
        text.contains(
            "sled page cache 13 MiB, the storage engine beyond its cache 27 MiB, recall cache"
        ),
        "{text}"
    );

    // The provider's vectors are stored beside each message (the static table's are not): a
    // second key a message, 18 bytes more each past 3 MiB more (no embedder in the process, so
    // the default budget's reserve is 32 MiB).
    let text = checked_with(
        dir.path(),
        &config,
        "[embedding]\nembedder = \"upstream\"\nupstream_model = \"text-embedding-3-small\"\n",
    );
    assert!(
        text.contains("budget a sled store needs so the caches keep their shares, each message with the upstream embedder's vector: 100000 messages 147 MiB, 1000000 messages 243 MiB, 10000000 messages 1205 MiB"),
        "{text}"
    );
    assert!(
        text.contains("store on disk = 2289 MiB, about 4000000 messages: sled needs about 125 MiB past its page cache, the budget reserves 32 MiB; the caches give up 93 MiB: a budget of 564 MiB would leave them whole"),
        "{text}"
    );

    // With Redis no engine runs in the process: no cache or reserve of one is named.
    let text = checked_with(
        dir.path(),
        &config,
        "[storage]\nbackend = \"redis\"\nredis_url = \"redis://127.0.0.1:1\"\n",
    );
    assert!(
        text.contains("no storage engine in the process (Redis), recall cache"),
        "{text}"
    );
    assert!(!text.contains("sled"), "{text}");

    std::fs::write(&config, "[memory]\nttl = \"sometimes\"\n").unwrap();
    let bad = memproxy(
        dir.path(),
        &["--config", config.to_str().unwrap(), "check-config"],
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("memory.ttl"));
}

#[tokio::test]
async fn users_commands_correct_export_import_and_delete_a_users_memory() {
    let Started { dir, proxy, .. } = Harness::new().start().await;
    let said = chat(
        &proxy,
        "trip",
        &body(&[user("My favourite city is Lisbon")]),
        &[("x-memory-user-id", "ana")],
    )
    .await;
    assert_eq!(said.status, 200);
    proxy.stop().await;
    let address = format!("{}/ana", tenant(TOKEN));

    let created = stdout_json(&memproxy(
        dir.path(),
        &[
            "users",
            "create",
            &address,
            r#"{"text": "The user prefers aisle seats", "type": "preference"}"#,
        ],
    ));
    let id = created["id"].as_u64().unwrap().to_string();
    let corrected = stdout_json(&memproxy(
        dir.path(),
        &[
            "users",
            "update",
            &address,
            &id,
            r#"{"text": "The user prefers window seats"}"#,
        ],
    ));
    assert_eq!(corrected["source"], "corrected_memory");
    assert_eq!(
        corrected["history"][0]["text"],
        "The user prefers aisle seats"
    );
    let searched = stdout_json(&memproxy(
        dir.path(),
        &["users", "memories", &address, "--query", "which seats"],
    ));
    assert_eq!(
        searched["memories"][0]["memory"]["text"],
        "The user prefers window seats"
    );
    let shown = stdout_json(&memproxy(dir.path(), &["users", "get", &address, &id]));
    assert_eq!(shown["version"], 2);

    let file = dir.path().join("ana.json");
    let exported = memproxy(
        dir.path(),
        &["users", "export", &address, "-o", file.to_str().unwrap()],
    );
    assert!(exported.status.success());
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("window seats") && text.contains("Lisbon"));

    let deleted = stdout_json(&memproxy(dir.path(), &["users", "delete", &address]));
    assert_eq!(deleted["deleted_conversations"], 1);
    let gone = memproxy(dir.path(), &["users", "memories", &address]);
    assert_eq!(gone.status.code(), Some(3));
    let conversation = format!("{}/default/trip", tenant(TOKEN));
    let no_conversation = memproxy(dir.path(), &["conversations", "show", &conversation]);
    assert_eq!(no_conversation.status.code(), Some(3));

    let imported = stdout_json(&memproxy(
        dir.path(),
        &["users", "import", &address, "-i", file.to_str().unwrap()],
    ));
    assert_eq!(imported["memories_added"], 1);
    assert_eq!(imported["conversations_added"], 1);
    let forgotten = stdout_json(&memproxy(
        dir.path(),
        &[
            "users",
            "forget",
            &address,
            &imported_id(&memproxy(dir.path(), &["users", "memories", &address])),
        ],
    ));
    assert!(forgotten["deleted"].is_u64());
    let bad = memproxy(dir.path(), &["users", "memories", "not-an-address"]);
    assert_eq!(bad.status.code(), Some(2));
}

/// The id of the first memory listed.
fn imported_id(listed: &Output) -> String {
    stdout_json(listed)["memories"][0]["id"]
        .as_u64()
        .unwrap()
        .to_string()
}
