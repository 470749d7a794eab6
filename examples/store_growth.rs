//! What the embedded store costs in resident memory as it grows: sled's page table and write
//! buffers grow with what is stored, past its page cache (`--engine fjall`: fjall's, which its
//! caches bound). This commits exchanges (a user
//! message and a reply, the sizes of the soak's) through `Store::commit`, round-robin over
//! `--conversations`, with sled's page cache at the default budget's share and the
//! conversation state cache at 64 KiB (so it is not what is measured), and prints the RSS
//! every `--every` messages. The figures set `config::memory_budget::STORE_BYTES_PER_MESSAGE`
//! (README, "Sizing the sidecar").
//!
//! ```sh
//! cargo run --example store_growth -- --messages 1000000
//! ```
//!
//! (a debug build measures the same memory, only slower: 32 minutes for a million messages on
//! the shared development machine). One run, at commit 8521b53:
//!
//! ```text
//! | messages | RSS MiB | over opened MiB | bytes per message | on disk MiB | s |
//! | 100000 | 61.9 | 31.8 | 334 | 73.5 | 230 |
//! | 400000 | 75.8 | 45.7 | 120 | 260.5 | 466 |
//! | 600000 | 86.2 | 56.2 | 98 | 387.0 | 788 |
//! | 1000000 | 107.3 | 77.2 | 81 | 586.5 | 1910 |
//! ```

// A command-line report: its output is the point.
#![allow(clippy::print_stdout)]

#[path = "support/rss.rs"]
mod rss;

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use memproxy::identity::{ConversationKey, TenantId};
use memproxy::message::Role;
use memproxy::store::{
    Change, Durability, Embedded, LedgerTotals, Origin, Store, StoreOptions, StoredMessage,
};
use serde_json::value::RawValue;

#[derive(Debug, Parser)]
#[command(
    name = "store_growth",
    about = "an embedded engine's resident memory per stored message"
)]
struct Args {
    /// Messages to store in all.
    #[arg(long, default_value_t = 1_000_000)]
    messages: u64,
    /// Conversations they are spread over.
    #[arg(long, default_value_t = 20_000)]
    conversations: u64,
    /// Print a line every this many messages.
    #[arg(long, default_value_t = 100_000)]
    every: u64,
    /// sled's page cache in MiB (default: the default budget's share).
    #[arg(long)]
    page_cache_mib: Option<u64>,
    /// Also store a vector of this many dimensions for each message, as recall by meaning
    /// does with an embedder whose vectors are stored (the contextual model's: 384; the
    /// provider's `text-embedding-3-small`: 1536; the default static table's, 256, are derived
    /// and not stored; 0: none).
    #[arg(long, default_value_t = 0)]
    vector_dims: usize,
    /// The embedded engine: `sled` (the default) or `fjall`.
    #[arg(long, default_value = "sled", value_parser = ["sled", "fjall"])]
    engine: String,
    /// Commit each exchange with its token ledger, as the proxy does (the conversation's
    /// totals, and the exchange's own figures).
    #[arg(long)]
    ledger: bool,
}

fn message(role: Role, text: String) -> Result<StoredMessage, String> {
    let role_name = if role == Role::User {
        "user"
    } else {
        "assistant"
    };
    Ok(StoredMessage {
        turn: 0,
        role,
        origin: Origin::Client,
        at_ms: 0,
        tokens: (text.len() / 4) as u32,
        fingerprint: text.len() as u64,
        message: RawValue::from_string(
            serde_json::json!({"role": role_name, "content": text}).to_string(),
        )
        .map_err(|e| e.to_string())?,
        exchange: None,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), String> {
    let args = Args::parse();
    let split = memproxy::config::split_memory_budget(memproxy::config::DEFAULT_MEMORY_BUDGET);
    let page_cache = args.page_cache_mib.map_or(split.store_cache, |m| m << 20);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let idle = rss::rss_kib();
    let options = StoreOptions {
        durability: Durability::Interval(Duration::from_secs(1)),
        page_cache_bytes: page_cache,
        state_cache_bytes: 64 << 10,
    };
    let engine = Embedded::named(&args.engine).unwrap_or(Embedded::Sled);
    let store =
        Arc::new(Store::open_embedded(dir.path(), engine, options).map_err(|e| e.to_string())?);
    let opened = rss::rss_kib();
    println!(
        "store_growth: {} with a page (block) cache of {} MiB; {} conversations; vectors of {} dimensions; RSS before opening {} MiB, opened {} MiB",
        args.engine,
        page_cache >> 20,
        args.conversations,
        args.vector_dims,
        idle / 1024,
        opened / 1024
    );
    println!(
        "| messages | RSS MiB | over opened MiB | bytes per message | heap in use MiB | on disk MiB | s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    let tenant = TenantId::from_token(Some("sk-growth"));
    let started = Instant::now();
    let mut stored = 0u64;
    let mut exchange = 0u64;
    while stored < args.messages {
        let n = exchange % args.conversations;
        let key = ConversationKey {
            tenant: tenant.clone(),
            agent: "default".into(),
            conversation: format!("growth-{n}"),
        };
        let handle = store.conversation(&key).map_err(|e| e.to_string())?;
        let mut conversation = memproxy::store::lock(&handle);
        let turn = exchange / args.conversations;
        let user = format!(
            "Message {turn} of conversation {n}: tell me more about the plan for the quarter, the budget and who is on the team this time."
        );
        let reply = format!(
            "Reply {turn}: here is what I know of the plan for the quarter. The budget is set, the team is the same as last time with two more people, and the first milestone is at the end of next month. {n}"
        );
        store
            .commit(
                &mut conversation,
                Change {
                    add: vec![message(Role::User, user)?, message(Role::Assistant, reply)?],
                    tokens_forwarded: if args.ledger { 900 + turn } else { 0 },
                    ledger: LedgerTotals {
                        exchanges: u64::from(args.ledger),
                        history_tokens: if args.ledger { 60 * (turn + 1) } else { 0 },
                        ..LedgerTotals::default()
                    },
                    ..Change::default()
                },
            )
            .map_err(|e| e.to_string())?;
        if args.vector_dims > 0 {
            let vectors: Vec<(u64, Vec<f32>)> = conversation
                .entries
                .iter()
                .rev()
                .take(2)
                .map(|e| {
                    let v = (0..args.vector_dims)
                        .map(|i| ((e.turn as usize * 31 + i * 7) % 97) as f32 / 97.0 - 0.5)
                        .collect();
                    (e.turn, v)
                })
                .collect();
            store
                .put_vectors(&conversation, "growth:static", &vectors)
                .map_err(|e| e.to_string())?;
        }
        drop(conversation);
        store.touch(&key, &handle);
        stored += 2;
        exchange += 1;
        if stored.is_multiple_of(args.every) {
            let rss = rss::rss_kib();
            let over = rss.saturating_sub(opened);
            let in_use = memproxy::allocator::held().map_or(0, |h| h.in_use);
            println!(
                "| {stored} | {:.1} | {:.1} | {:.0} | {:.1} | {:.1} | {:.0} |",
                rss as f64 / 1024.0,
                over as f64 / 1024.0,
                over as f64 * 1024.0 / stored as f64,
                in_use as f64 / (1 << 20) as f64,
                store.size_on_disk() as f64 / (1 << 20) as f64,
                started.elapsed().as_secs_f64()
            );
        }
    }
    store.close().await.map_err(|e| e.to_string())?;
    Ok(())
}
