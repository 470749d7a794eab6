//! Disk full (issue 11, "Also"): with the data directory on a small filesystem that fills up,
//! chat keeps working (200, `X-Memory-Status: degraded` while nothing can be stored), nothing
//! is half-written, `/readyz` says why, and memory resumes once space is freed.
//!
//! The test makes its own filesystem: an 8 MiB tmpfs mounted on a temporary directory, and
//! unmounted by a drop guard whatever happens. Mounting needs root (CAP_SYS_ADMIN): where it
//! is not permitted, the test prints that it is skipped and passes.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

/// A tmpfs of a fixed size, unmounted (and its mount point removed) when dropped.
struct SmallFilesystem {
    dir: tempfile::TempDir,
}

impl SmallFilesystem {
    fn mount(size: &str) -> Option<SmallFilesystem> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output();
        match mounted {
            Ok(output) if output.status.success() => Some(SmallFilesystem { dir }),
            Ok(output) => {
                eprintln!(
                    "skipped: cannot mount a tmpfs here (root is needed): {}",
                    String::from_utf8_lossy(&output.stderr).trim()
                );
                None
            }
            Err(err) => {
                eprintln!("skipped: cannot run mount: {err}");
                None
            }
        }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for SmallFilesystem {
    fn drop(&mut self) {
        let unmounted = Command::new("umount").arg(self.dir.path()).status();
        if !unmounted.is_ok_and(|s| s.success()) {
            // Still busy (a test that failed midway holds files open): detach it anyway.
            let _ = Command::new("umount")
                .arg("-l")
                .arg(self.dir.path())
                .status();
        }
    }
}

/// Fills the filesystem of `dir` with one file; returns its path.
fn fill(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("filler");
    let mut file = std::fs::File::create(&path).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    while file.write_all(&chunk).is_ok() {}
    // What is left is less than a chunk: fill it byte by byte up to a page.
    let small = [0u8; 512];
    while file.write_all(&small).is_ok() {}
    path
}

/// A full-history client of one conversation.
struct Client {
    conversation: String,
    history: Vec<Value>,
    /// The questions whose exchange was answered `stored`.
    stored: Vec<String>,
}

impl Client {
    fn new(conversation: &str) -> Client {
        Client {
            conversation: conversation.to_string(),
            history: Vec::new(),
            stored: Vec::new(),
        }
    }

    /// One exchange; returns its `X-Memory-Status`. Never a server error.
    async fn ask(&mut self, proxy: &Proxy, question: &str) -> String {
        self.history.push(user(question));
        let answer = chat(proxy, &self.conversation, &body(&self.history), &[]).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        self.history.push(reply_message(&answer));
        let status = answer.header("x-memory-status").to_string();
        match status.as_str() {
            "stored" => self.stored.push(question.to_string()),
            "degraded" => {
                let reason = answer.header("x-memory-reason");
                assert!(
                    reason == "store-unwritable" || reason == "commit-failed",
                    "{reason}"
                );
            }
            other => panic!("unexpected X-Memory-Status {other}"),
        }
        status
    }
}

/// The stored conversation is whole exchanges only (each question with its reply), and holds
/// every exchange that was answered `stored`.
fn assert_whole(proxy: &Proxy, client: &Client) {
    let stored = summarize(&proxy.stored(Some(TOKEN), &client.conversation));
    assert!(stored.len().is_multiple_of(2), "{stored:?}");
    for pair in stored.chunks(2) {
        let question = pair[0].strip_prefix("user:").unwrap();
        assert_eq!(
            pair[1],
            format!("assistant:reply to: {question}"),
            "{stored:?}"
        );
    }
    for question in &client.stored {
        assert!(
            stored.contains(&format!("user:{question}")),
            "{question} was answered as stored: {stored:?}"
        );
    }
}

/// The proxy is ready, and every client's conversation is stored whole.
async fn assert_ready_and_whole(proxy: &Proxy, clients: &[&Client]) {
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 200, "{:?}", ready.body);
    for client in clients {
        assert_whole(proxy, client);
    }
}

#[tokio::test]
async fn a_full_disk_turns_memory_off_until_space_is_freed() {
    let Some(filesystem) = SmallFilesystem::mount("8m") else {
        return;
    };
    let data = filesystem.path().join("data");
    let mock = MockUpstream::start().await.unwrap();
    let proxy = Proxy::start(&mock, &data, "").await;
    let mut clients: Vec<Client> = (0..4).map(|i| Client::new(&format!("c{i}"))).collect();
    for round in 0..2 {
        for client in &mut clients {
            let question = format!("{} before {round}", client.conversation);
            assert_eq!(client.ask(&proxy, &question).await, "stored");
        }
    }

    let filler = fill(filesystem.path());
    let mut statuses = BTreeMap::<String, usize>::new();
    for round in 0..4 {
        for client in &mut clients {
            // Long enough that no exchange fits in what sled's file has left.
            let question = format!(
                "{} while full {round}: {}",
                client.conversation,
                "padding ".repeat(200)
            );
            *statuses
                .entry(client.ask(&proxy, &question).await)
                .or_default() += 1;
        }
    }
    // A new conversation needs a key file: there is no room for one either.
    let mut newcomer = Client::new("newcomer");
    assert_eq!(
        newcomer.ask(&proxy, "newcomer while full").await,
        "degraded"
    );
    // A stream, whatever the store does, streams.
    let streamed = chat(
        &proxy,
        "streamer",
        &serde_json::json!({"model": "m", "stream": true, "messages": [user("streamed while full")]}),
        &[],
    )
    .await;
    assert_eq!(streamed.status, 200);
    assert!(String::from_utf8_lossy(&streamed.body).contains("[DONE]"));

    assert!(
        statuses.get("degraded").copied().unwrap_or(0) > 0,
        "{statuses:?}"
    );
    let ready = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(ready.status, 503);
    let reason = ready.json()["reason"].as_str().unwrap().to_string();
    assert!(
        reason.contains("could not be written") || reason.contains("No space left"),
        "{reason}"
    );
    assert_eq!(
        send("GET", &proxy.url("/healthz"), &[], "").await.status,
        200
    );

    // Space again: memory resumes (the store retries once a second).
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let question = format!("c0 after freeing {attempt}");
        if clients[0].ask(&proxy, &question).await == "stored" {
            break;
        }
        assert!(Instant::now() < deadline, "memory did not resume");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for client in clients.iter_mut().skip(1) {
        let question = format!("{} after freeing", client.conversation);
        assert_eq!(client.ask(&proxy, &question).await, "stored");
    }
    assert_eq!(
        newcomer.ask(&proxy, "newcomer after freeing").await,
        "stored"
    );
    let everyone: Vec<&Client> = clients.iter().chain([&newcomer]).collect();
    assert_ready_and_whole(&proxy, &everyone).await;

    // And all of it is on disk: after a restart, the same whole exchanges.
    proxy.stop().await;
    let proxy = Proxy::start(&mock, &data, "").await;
    assert_ready_and_whole(&proxy, &everyone).await;
    proxy.stop().await;
    drop(filesystem);
}
