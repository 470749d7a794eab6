//! What one conversation's BM25 index costs a stored exchange, in the shape of
//! `scripts/perf.sh`'s stored row: `--conversations` indexes (64, as the row's) of 200
//! messages of 16–24 words drawn from loadbench's list, then exchanges of the same question (a
//! counter in it) and the same reply, taken round-robin over the conversations, each one a
//! search of every match (as hybrid recall asks) and two pushes, until each conversation holds
//! `--messages` documents. Many conversations' indexes do not all stay in the CPU's caches, as
//! in the row; one does.
//!
//! With `--trim N`, a conversation past N documents has its oldest dropped after each exchange
//! (as a commit trims whole rounds at `max_messages`, 1,000 by default), and `--exchanges`
//! exchanges are made in each (default: as many as grow it from 200 to `--messages`). With
//! `--dims D`, each conversation also holds its messages' vectors (`DocVectors`, D wide, of
//! random values), two inserted and the trimmed ones removed at each exchange, as the recall
//! cache's `apply` does.
//!
//! ```text
//! cargo run --release -p memproxy-core --example index_cost [-- --messages 1000 --runs 5 --conversations 64]
//! cargo run --release -p memproxy-core --example index_cost -- --messages 1000 --trim 1000 --exchanges 600 --dims 256
//! ```
//!
//! Prints, for the best of `--runs` runs, the time of the searches and of the pushes (with the
//! trims and vectors) per exchange, and the postings the searches read.

#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::time::{Duration, Instant};

use memproxy_core::recall::index::Index;
use memproxy_core::recall::tokenize::{Lang, terms};
use memproxy_core::recall::vectors::DocVectors;

#[path = "../../../tests/support/rng.rs"]
mod rng;

const REPLY: &str = "We decided to keep the garden plan as drafted, hold the budget at the \
                     figure finance approved and book the tickets for the second week.";

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut messages, mut runs, mut conversations) = (1_000usize, 5usize, 64usize);
    let (mut trim, mut exchanges_each, mut dims) = (0usize, None, 0usize);
    while let Some(flag) = args.next() {
        let value = args.next().and_then(|v| v.parse().ok());
        match (flag.as_str(), value) {
            ("--messages", Some(v)) => messages = v,
            ("--runs", Some(v)) => runs = v,
            ("--conversations", Some(v)) => conversations = v.max(1),
            ("--trim", Some(v)) => trim = v,
            ("--exchanges", Some(v)) => exchanges_each = Some(v),
            ("--dims", Some(v)) => dims = v,
            _ => {
                eprintln!(
                    "usage: index_cost [--messages N] [--runs N] [--conversations N] [--trim N] [--exchanges N] [--dims D]"
                );
                std::process::exit(2);
            }
        }
    }
    let exchanges_each = exchanges_each.unwrap_or(messages.saturating_sub(200) / 2);
    let mut vector_rng = rng::Rng::new(11);
    let mut vector = move || -> Vec<f32> {
        (0..dims)
            .map(|_| vector_rng.below(2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let words: Vec<&str> = include_str!("../../../examples/loadbench/words.txt")
        .split_whitespace()
        .collect();
    let latin = Some(Lang::English);
    let mut best = (Duration::MAX, Duration::MAX, 0usize);
    for _ in 0..runs {
        let mut rng = rng::Rng::new(7);
        let mut indexes: Vec<(Index, u64, DocVectors)> = (0..conversations)
            .map(|_| {
                let mut index = Index::new();
                let mut vectors = DocVectors::new(dims);
                for turn in 0..199 {
                    let n = 16 + rng.below(9);
                    let text: Vec<&str> = (0..n).map(|_| words[rng.below(words.len())]).collect();
                    index.push(turn, terms(&text.join(" "), latin));
                    if dims > 0 {
                        vectors.insert(turn, &vector());
                    }
                }
                (index, 199, vectors)
            })
            .collect();
        let (mut searching, mut pushing, mut read) = (Duration::ZERO, Duration::ZERO, 0);
        let mut exchanges = 0u32;
        let mut counter = 0u64;
        for _ in 0..exchanges_each {
            for (index, turn, vectors) in &mut indexes {
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
                let added = (dims > 0).then(|| (vector(), vector()));
                let started = Instant::now();
                index.push(*turn, asked);
                index.push(*turn + 1, replied);
                if trim > 0 && index.len() > trim {
                    let over = index.len() - trim;
                    if dims > 0 {
                        let gone: Vec<u64> = vectors.turns().iter().copied().take(over).collect();
                        vectors.remove(&gone);
                    }
                    index.drop_front(over);
                }
                if let Some((a, b)) = &added {
                    vectors.insert(*turn, a);
                    vectors.insert(*turn + 1, b);
                }
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
        "{conversations} conversations, {exchanges_each} exchanges each from 200 messages (trim at {trim}, vectors of {dims}): search {:.2} µs, two pushes (and the trim, the vectors) {:.2} µs an exchange (best of {runs}); {} turns matched a search on average",
        best.0.as_secs_f64() * 1e6,
        best.1.as_secs_f64() * 1e6,
        best.2
    );
}
