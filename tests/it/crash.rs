//! What a kill -9 leaves of an embedded store: every exchange acknowledged as stored is there
//! after it, whole and in order. With sled, the appends, the trims and the vectors are written
//! without sled's transactions (`crates/store/src/sled_engine.rs::SledEngine::append`); with
//! fjall, each write is one transaction into its journal
//! (`crates/store/src/fjall_engine.rs`).

use std::time::Duration;

use tokio::task::JoinSet;

use crate::support::child::{ChildProxy, ask};
use crate::support::mock_upstream::MockUpstream;
use crate::support::*;

const CLIENTS: usize = 8;
const KILLS: u64 = 3;
/// Past the first four exchanges of a conversation, every exchange trims its oldest round.
const MAX_MESSAGES: usize = 8;

fn question(client: usize, n: usize) -> String {
    format!("client {client} question {n}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_exchange_acknowledged_before_a_kill_is_stored_whole_after_it() {
    kill_and_read("sled").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_exchange_acknowledged_before_a_kill_is_stored_whole_after_it_with_fjall() {
    kill_and_read("fjall").await;
}

/// Kills a memproxy storing with `backend` three times while eight clients converse, then
/// reads what is stored.
async fn kill_and_read(backend: &str) {
    let mock = MockUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let toml = format!(
        "[upstream]\nbase_url = \"{}\"\n[storage]\nbackend = \"{backend}\"\ndata_dir = \"{}\"\n[memory]\nmax_messages = {MAX_MESSAGES}\n",
        mock.base_url(),
        data.display()
    );
    let mut child = ChildProxy::start(dir.path(), &toml);
    // Per client: the next question's number, the numbers acknowledged as stored, and those
    // a kill cut (stored or not).
    let mut next = [0usize; CLIENTS];
    let mut acknowledged: Vec<Vec<usize>> = vec![Vec::new(); CLIENTS];
    let mut cut: Vec<Vec<usize>> = vec![Vec::new(); CLIENTS];
    for kill in 0..KILLS {
        if kill > 0 {
            child.restart();
        }
        child.ready().await;
        let mut clients = JoinSet::new();
        for (c, from) in next.iter().copied().enumerate() {
            let base = child.url.clone();
            clients.spawn(async move {
                let mut acked = Vec::new();
                // Bounded: the kill comes long before the last one.
                for n in from..from + 2_000 {
                    if !ask(&base, &format!("crash-{c}"), &question(c, n)).await {
                        return (c, acked, Some(n));
                    }
                    acked.push(n);
                }
                (c, acked, None)
            });
        }
        // kill -9 in the middle of the exchanges, a different moment each time.
        tokio::time::sleep(Duration::from_millis(500 + 300 * kill)).await;
        child.kill();
        while let Some(done) = clients.join_next().await {
            let (c, acked, failed) = done.unwrap();
            next[c] = failed.map_or(next[c] + 2_000, |n| n + 1);
            acknowledged[c].extend(acked);
            // Never asked again.
            cut[c].extend(failed);
        }
    }

    // Read with memproxy in this process, on the same data directory.
    let storage = format!("backend = \"{backend}\"\n");
    let proxy = Proxy::start_config(test_config_with_storage(&mock, &data, "", &storage, "")).await;
    assert_eq!(proxy.state.config.backend.name(), backend);
    let mut total = 0;
    for (c, acked) in acknowledged.iter().enumerate() {
        total += acked.len();
        let stored = stored_now(proxy.store(), &key(Some(TOKEN), &format!("crash-{c}")));
        let stored = summarize(&stored);
        assert!(stored.len() <= MAX_MESSAGES, "client {c}: {stored:?}");
        assert!(
            stored.len().is_multiple_of(2),
            "client {c}: a torn exchange: {stored:?}"
        );
        // Whole exchanges, in the order asked, each question with its own reply.
        let numbers: Vec<usize> = stored
            .chunks(2)
            .map(|pair| {
                let asked = pair[0]
                    .strip_prefix("user:")
                    .unwrap_or_else(|| panic!("client {c}: not a question: {stored:?}"));
                assert_eq!(
                    pair[1],
                    format!("assistant:reply to: {asked}"),
                    "{stored:?}"
                );
                let n = asked.rsplit(' ').next().unwrap();
                n.parse().unwrap()
            })
            .collect();
        assert!(
            numbers.windows(2).all(|w| w[0] < w[1]),
            "client {c}: {numbers:?}"
        );
        // Nothing stored that was not asked, and every acknowledged exchange there unless
        // newer ones trimmed it: all of them while the conversation is not full, and from the
        // oldest kept on when it is.
        for n in &numbers {
            assert!(
                acked.contains(n) || cut[c].contains(n),
                "client {c}: {n} stored, never asked"
            );
        }
        let oldest_kept = if stored.len() < MAX_MESSAGES {
            0
        } else {
            numbers[0]
        };
        for n in acked.iter().filter(|n| **n >= oldest_kept) {
            assert!(
                numbers.contains(n),
                "client {c}: {n} was acknowledged and is lost: {numbers:?}"
            );
        }
        assert!(!acked.is_empty(), "client {c} had exchanges acknowledged");
    }
    assert!(
        total > CLIENTS * 8,
        "the clients were answered: {total} exchanges"
    );
}
