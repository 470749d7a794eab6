//! What sled's resident memory grows by per stored message, as a function of how many messages
//! share one key: the question behind a store layout with one key per exchange (its messages,
//! and their vectors, in one value) instead of one key per message and one per vector.
//!
//! It writes `--messages` values of `--value-bytes` each straight into one sled tree, `--per-key`
//! of them concatenated under each key, keys `conversation (u64 BE) ++ chunk (u64 BE)`
//! round-robin over `--conversations` (the soak's pattern: each conversation's keys in turn
//! order, every conversation touched in turn), with sled's page cache at `--page-cache-mib`,
//! and prints the RSS every `--every` messages. Run it once per layout; a fresh process each,
//! so the RSS is that layout's alone. It links the crate, so the allocator is memproxy's.
//!
//! ```sh
//! for n in 1 2 4; do cargo run --release --example sled_layout -- --per-key $n; done
//! ```
//!
//! sled 0.34 splits a leaf past 16 keys (`Node::should_split`); every leaf is a page, and every
//! page keeps its entry in the page table and the places of its fragments in the log when its
//! contents are evicted from the cache: that part grows with the keys. But `cache_capacity`
//! does not bound the pages of larger values held in the cache, so packing more under a key
//! trades that growth for a larger cache. One run (2026-11-29, release build, the AMD EPYC
//! development machine, 6 million messages of 300 bytes, page cache 16 MiB; RSS in MiB):
//!
//! | messages per key | at 1 M | at 6 M | growth from 1 M to 6 M, bytes a message |
//! |---:|---:|---:|---:|
//! | 1 | 76.8 | 157.6 | 16.9 |
//! | 2 | 80.0 | 119.5 | 8.3 |
//! | 4 | 112.9 | 111.8 | about 0 (98.8 to 116.4 between) |

// A command-line report: its output is the point.
#![allow(clippy::print_stdout)]

#[path = "support/rss.rs"]
mod rss;

use std::time::Instant;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "sled_layout",
    about = "sled's resident memory per message, by messages per key"
)]
struct Args {
    /// Messages to store in all.
    #[arg(long, default_value_t = 8_000_000)]
    messages: u64,
    /// Messages under one key (their values concatenated).
    #[arg(long, default_value_t = 1)]
    per_key: u64,
    /// Bytes of one message's value (the soak's sealed message is about 300).
    #[arg(long, default_value_t = 300)]
    value_bytes: usize,
    /// Conversations the keys are spread over.
    #[arg(long, default_value_t = 20_000)]
    conversations: u64,
    /// sled's page cache in MiB (default: the default budget's share, as memproxy opens it).
    #[arg(long)]
    page_cache_mib: Option<u64>,
    /// Print a line every this many messages.
    #[arg(long, default_value_t = 1_000_000)]
    every: u64,
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    let per_key = args.per_key.max(1);
    let split = memproxy::config::split_memory_budget(memproxy::config::DEFAULT_MEMORY_BUDGET);
    let page_cache = args.page_cache_mib.map_or(split.store_cache, |m| m << 20);
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let db = sled::Config::new()
        .path(dir.path())
        .cache_capacity(page_cache)
        .open()
        .map_err(|e| e.to_string())?;
    let tree = db.open_tree("messages").map_err(|e| e.to_string())?;
    let opened = rss::rss_kib();
    println!(
        "sled_layout: {per_key} message(s) of {} bytes per key; {} conversations; page cache {} MiB; opened {} MiB",
        args.value_bytes,
        args.conversations,
        page_cache >> 20,
        opened / 1024
    );
    println!("| messages | keys | RSS MiB | bytes per message since the previous line | s |");
    println!("|---:|---:|---:|---:|---:|");
    let started = Instant::now();
    let keys = args.messages / per_key;
    let every = (args.every / per_key).max(1);
    let mut previous = (0u64, opened);
    for i in 0..keys {
        let conversation = i % args.conversations;
        let chunk = i / args.conversations;
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&conversation.to_be_bytes());
        key[8..].copy_from_slice(&chunk.to_be_bytes());
        // Not all alike, as sealed values are not.
        let value: Vec<u8> = (0..args.value_bytes * per_key as usize)
            .map(|b| (b as u64 ^ i).to_le_bytes()[0])
            .collect();
        tree.insert(key, value).map_err(|e| e.to_string())?;
        if (i + 1) % every == 0 {
            let messages = (i + 1) * per_key;
            let rss = rss::rss_kib();
            let grown = rss.saturating_sub(previous.1) as f64 * 1024.0;
            println!(
                "| {messages} | {} | {:.1} | {:.1} | {:.0} |",
                i + 1,
                rss as f64 / 1024.0,
                grown / (messages - previous.0) as f64,
                started.elapsed().as_secs_f64()
            );
            previous = (messages, rss);
        }
    }
    db.flush().map_err(|e| e.to_string())?;
    Ok(())
}
