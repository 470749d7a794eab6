//! What one conversation's BM25 index costs a stored exchange, in the shape of
//! `scripts/perf.sh`'s stored row: `--conversations` indexes (64, as the row's) of 200
//! messages of 16–24 words drawn from loadbench's list, then exchanges of the same question (a
//! counter in it) and the same reply, taken round-robin over the conversations, each one a
//! search of every match (as hybrid recall asks) and two pushes, until each conversation holds
//! `--messages` documents. Many conversations' indexes do not all stay in the CPU's caches, as
//! in the row; one does.
//!
//! ```text
//! cargo run --release -p memproxy-core --example index_cost [-- --messages 1000 --runs 5 --conversations 64]
//! ```
//!
//! Prints, for the best of `--runs` runs, the time of the searches and of the pushes per
//! exchange, and the postings the searches read.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use memproxy_core::recall::index::Index;
use memproxy_core::recall::tokenize::{Lang, terms};

#[path = "../../../tests/support/rng.rs"]
mod rng;

const REPLY: &str = "We decided to keep the garden plan as drafted, hold the budget at the \
                     figure finance approved and book the tickets for the second week.";

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut messages, mut runs, mut conversations) = (1_000usize, 5usize, 64usize);
    while let Some(flag) = args.next() {
        let value = args.next().and_then(|v| v.parse().ok());
        match (flag.as_str(), value) {
            ("--messages", Some(v)) => messages = v,
            ("--runs", Some(v)) => runs = v,
            ("--conversations", Some(v)) => conversations = v.max(1),
            _ => {
                eprintln!("usage: index_cost [--messages N] [--runs N] [--conversations N]");
                std::process::exit(2);
            }
        }
    }
    let words: Vec<&str> = include_str!("../../../examples/loadbench/words.txt")
        .split_whitespace()
        .collect();
    let latin = Some(Lang::English);
    let mut best = (Duration::MAX, Duration::MAX, 0usize);
    for _ in 0..runs {
        let mut rng = rng::Rng::new(7);
        let mut indexes: Vec<(Index, u64)> = (0..conversations)
            .map(|_| {
                let mut index = Index::new();
                for turn in 0..199 {
                    let n = 16 + rng.below(9);
                    let text: Vec<&str> = (0..n).map(|_| words[rng.below(words.len())]).collect();
                    index.push(turn, terms(&text.join(" "), latin));
                }
                (index, 199)
            })
            .collect();
        let (mut searching, mut pushing, mut read) = (Duration::ZERO, Duration::ZERO, 0);
        let mut exchanges = 0u32;
        let mut counter = 0u64;
        while indexes[0].0.len() + 2 <= messages {
            for (index, turn) in &mut indexes {
                counter += 1;
                let question = format!(
                    "Question {counter} of thread 1: what did we decide about the garden plan, the budget and the tickets?"
                );
                let query = terms(&question, latin);
                let started = Instant::now();
                // The window (the newest 20 turns) is not searched.
                let hits = index.search(&query, turn.saturating_sub(20), usize::MAX);
                searching += started.elapsed();
                read += hits.len();
                std::hint::black_box(hits);
                let (asked, replied) = (terms(&question, latin), terms(REPLY, latin));
                let started = Instant::now();
                index.push(*turn, asked);
                index.push(*turn + 1, replied);
                pushing += started.elapsed();
                *turn += 2;
                exchanges += 1;
            }
        }
        let exchanges = exchanges.max(1);
        best = (
            best.0.min(searching / exchanges),
            best.1.min(pushing / exchanges),
            read / exchanges as usize,
        );
    }
    println!(
        "{conversations} conversations of {messages} messages at the end: search {:.2} µs, two pushes {:.2} µs an exchange (best of {runs}); {} turns matched a search on average",
        best.0.as_secs_f64() * 1e6,
        best.1.as_secs_f64() * 1e6,
        best.2
    );
}
