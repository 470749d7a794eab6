//! What the embedders cost: time per text (p50 and p90 over many runs) for a 12-word query and
//! a 22-word question like loadbench's and a 40-word message, for the static table and the contextual forward pass on one thread and
//! on the default threads; the table's size on disk and in memory; the contextual model's
//! resident memory (the RSS it adds when loaded); and, with `--distill`, the distillation.
//!
//!     scripts/fetch-model.sh
//!     cargo run --release -p memproxy-embed --example embed_cost [-- --distill | --contextual]
//!
//! `--contextual` measures the contextual pass on one thread alone, and shared with a thread
//! that waits for it.

// Allowed: an example prints its report.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Instant;

use memproxy_embed::bert::Precision;
use memproxy_embed::table::{self, Distillation};
use memproxy_embed::{Assist, Contextual, Embed, ModelFiles, Static};

const QUERY: &str = "What did we decide about the staging database reset schedule last week?";
/// A question like loadbench's (16 to 24 common words), 22 words.
const LOADBENCH_QUESTION: &str = "Please summarize the latest changes in the deployment pipeline and \
explain why the project deadline moved before the customer meeting next week.";
const MESSAGE: &str = "I looked into the failing deploy again this morning: the script needs the \
VPN to reach the artifact store, so until that bucket moves into the public subnet please \
connect before running it, and tell me if anything else breaks.";

/// The process's resident set, in bytes (Linux; 0 elsewhere).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// p50 and p90 of `runs` single-text embeddings, in milliseconds, after a few warm-up runs.
fn time(embedder: &dyn Embed, text: &str, runs: usize) -> (f64, f64) {
    for _ in 0..5 {
        embedder.embed(&[text]).unwrap();
    }
    let mut samples: Vec<f64> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            embedder.embed(&[text]).unwrap();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    (samples[runs / 2], samples[runs * 9 / 10])
}

/// p50 and p90 of `runs` single-text embeddings shared with a thread that waits for each
/// ([`Assist::help`], as a request waits for its question embedded ahead), and the share of
/// the pass's halves that thread ran.
fn time_shared(embedder: &dyn Embed, text: &str, runs: usize) -> (f64, f64, f64) {
    let (to_helper, offers) = std::sync::mpsc::channel::<Arc<Assist>>();
    let (to_main, helped) = std::sync::mpsc::channel::<usize>();
    let helper = std::thread::spawn(move || {
        for assist in offers {
            to_main.send(assist.help()).unwrap();
        }
    });
    let mut samples = Vec::with_capacity(runs);
    let mut halves = 0;
    for run in 0..runs + 5 {
        let assist = Arc::new(Assist::default());
        to_helper.send(Arc::clone(&assist)).unwrap();
        let start = Instant::now();
        embedder.embed_assisted(text, &assist).unwrap();
        let took = start.elapsed().as_secs_f64() * 1e3;
        assist.close();
        let ran = helped.recv().unwrap();
        if run >= 5 {
            samples.push(took);
            halves += ran;
        }
    }
    drop(to_helper);
    helper.join().unwrap();
    samples.sort_by(f64::total_cmp);
    // 12 steps of two halves in a pass of the 6-layer model.
    let share = halves as f64 / (runs * 24) as f64;
    (samples[runs / 2], samples[runs * 9 / 10], share)
}

fn report_shared(name: &str, embedder: &dyn Embed, runs: usize) {
    for (what, text) in [
        ("12-word query", QUERY),
        ("22-word question", LOADBENCH_QUESTION),
        ("40-word message", MESSAGE),
    ] {
        let (p50, p90, share) = time_shared(embedder, text, runs);
        println!(
            "{name:<34} {what:<16} p50 {p50:8.3} ms  p90 {p90:8.3} ms  ({runs} runs; the waiting thread ran {:.0}% of the halves)",
            share * 100.0
        );
    }
}

fn report(name: &str, embedder: &dyn Embed, runs: usize) {
    for (what, text) in [
        ("12-word query", QUERY),
        ("22-word question", LOADBENCH_QUESTION),
        ("40-word message", MESSAGE),
    ] {
        let (p50, p90) = time(embedder, text, runs);
        println!("{name:<34} {what:<16} p50 {p50:8.3} ms  p90 {p90:8.3} ms  ({runs} runs)");
    }
}

/// Recall's scoring: one query's bytes against 10,000 stored vectors' (256 dimensions), with
/// `vector::dots_i8` and with the plain loop it replaced; p50 over 200 runs, in ms.
fn scoring() {
    let dims = 256;
    let rows: Vec<i8> = (0..10_000 * dims)
        .map(|i| ((i * 91 % 255) as i32 - 127) as i8)
        .collect();
    let query: Vec<i8> = (0..dims)
        .map(|i| ((i * 37 % 255) as i32 - 127) as i8)
        .collect();
    let p50 = |f: &mut dyn FnMut() -> i64| {
        let mut samples: Vec<f64> = (0..200)
            .map(|_| {
                let start = Instant::now();
                std::hint::black_box(f());
                start.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        samples.sort_by(f64::total_cmp);
        samples[100]
    };
    let mut out = Vec::new();
    let wide = p50(&mut || {
        memproxy_embed::vector::dots_i8(&rows, &query, &mut out);
        out.iter().map(|&d| i64::from(d)).sum()
    });
    let plain = p50(&mut || {
        rows.chunks_exact(dims)
            .map(|row| {
                let dot: i32 = row
                    .iter()
                    .zip(&query)
                    .map(|(&b, &q)| i32::from(b) * i32::from(q))
                    .sum();
                i64::from(dot)
            })
            .sum()
    });
    println!(
        "recall scoring, 10,000 vectors of 256 bytes: dots_i8 p50 {wide:.3} ms, the plain loop {plain:.3} ms"
    );
}

fn main() {
    scoring();
    assert_eq!(QUERY.split_whitespace().count(), 12);
    assert_eq!(LOADBENCH_QUESTION.split_whitespace().count(), 22);
    assert_eq!(MESSAGE.split_whitespace().count(), 40);
    let files = ModelFiles::locate(None).unwrap();
    if std::env::args().any(|arg| arg == "--contextual") {
        // The contextual pass on one thread alone (for a profile or a quick comparison).
        let one = Contextual::load(&files, NonZeroUsize::new(1)).unwrap();
        report("contextual, 1 thread", &one, 1000);
        report_shared("contextual, shared with a waiter", &one, 1000);
        return;
    }
    let distillation = Distillation::default();
    let cache = Static::default_cache_path(&files, &distillation);

    let before = rss();
    let start = Instant::now();
    let table = Static::load_or_distill(&files, &cache).unwrap();
    println!(
        "static table {}: loaded in {:.0} ms; {:.1} MiB on disk ({}), {:.1} MiB in memory, RSS +{:.1} MiB",
        table.id(),
        start.elapsed().as_secs_f64() * 1e3,
        std::fs::metadata(&cache).unwrap().len() as f64 / 1048576.0,
        cache.display(),
        table.table_bytes() as f64 / 1048576.0,
        rss().saturating_sub(before) as f64 / 1048576.0
    );
    report("static", &table, 2000);
    drop(table);

    let before = rss();
    let start = Instant::now();
    let one = Contextual::load(&files, NonZeroUsize::new(1)).unwrap();
    println!(
        "contextual model: loaded in {:.0} ms, RSS +{:.1} MiB",
        start.elapsed().as_secs_f64() * 1e3,
        rss().saturating_sub(before) as f64 / 1048576.0
    );
    report("contextual, 1 thread", &one, 200);
    report_shared("contextual, shared with a waiter", &one, 200);
    drop(one);
    let default = Contextual::load(&files, None).unwrap();
    report("contextual, default threads", &default, 200);
    let threads = NonZeroUsize::new(2).unwrap();
    let two = Contextual::load(&files, Some(threads)).unwrap();
    report("contextual, 2 threads (own pool)", &two, 200);

    if std::env::args().any(|arg| arg == "--distill") {
        // As the table is distilled: with bf16 products on every machine.
        let default = Contextual::load_at(&files, None, Precision::Bf16).unwrap();
        let two = Contextual::load_at(&files, Some(threads), Precision::Bf16).unwrap();
        for (name, model) in [("default threads", &default), ("2 threads", &two)] {
            let start = Instant::now();
            table::distill(model, &distillation).unwrap();
            println!(
                "distillation ({name}): {:.1} s",
                start.elapsed().as_secs_f64()
            );
        }
    }
}
