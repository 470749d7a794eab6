//! What hybrid recall costs once the question's vector is made: the similarities of every
//! stored turn's vector with it, their smoothing over neighbours and the fusion with the words'
//! scores, twice with relevance feedback, as `Recall::search` runs them.
//!
//! ```text
//! cargo run --release -p memproxy-core --example recall_cost
//! ```
//!
//! Synthetic vectors (384 dimensions, the full model's width) and words' hits on one turn in
//! five; prints, for 1,000 and 10,000 stored turns, the minimum and the median of each part
//! over 300 runs.

#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use memproxy_core::recall::hybrid::{Fusion, fuse, fuse_with_feedback, smooth};
use memproxy_core::recall::index::Hit;
use memproxy_core::recall::vectors::DocVectors;

const DIMS: usize = 384;
const RUNS: usize = 300;

#[path = "../../../tests/support/rng.rs"]
mod rng;

fn main() {
    let mut rng = rng::Rng::new(12345);
    let mut unit = move || {
        let mut v: Vec<f32> = (0..DIMS)
            .map(|_| rng.below(20001) as f32 / 10000.0 - 1.0)
            .collect();
        memproxy_embed::vector::normalize(&mut v);
        v
    };
    let query = unit();
    for turns in [1_000u64, 10_000] {
        let mut vectors = DocVectors::new(DIMS);
        for turn in 0..turns {
            vectors.insert(turn, &unit());
        }
        let hits: Vec<Hit> = (0..turns)
            .filter(|t| t % 5 == 0)
            .map(|turn| Hit {
                turn,
                score: (turn % 17) as f32,
            })
            .collect();
        let fusion = Fusion {
            floor: 0.05,
            relative_floor: 0.4,
            feedback: true,
            ..Fusion::default()
        };
        let before = turns - 10;
        let ranked = |semantic: Option<&[(u64, f32)]>, k: usize| {
            fuse(&hits, 30.0, semantic, |t| t < before, None, fusion, k)
        };
        let mut similarities = Vec::new();
        let scan = time(|| vectors.similarities_into(&query, &mut similarities));
        // Smoothed again and again in place: each run costs what the first does.
        let mut smoothed = similarities.clone();
        let smoothing = time(|| smooth(&mut smoothed));
        let fusing = time(|| {
            ranked(Some(&similarities), 10);
        });
        let whole = time(|| {
            vectors.smoothed_into(&query, &mut similarities);
            fuse_with_feedback(
                Some(&mut similarities),
                fusion,
                10,
                ranked,
                |best, again| vectors.feedback_into(&query, best, again),
            );
        });
        println!(
            "{turns:>6} turns: similarities {} · smoothing {} · one fusion {} · all with feedback {}",
            show(scan),
            show(smoothing),
            show(fusing),
            show(whole)
        );
    }
}

/// The minimum and the median of `RUNS` runs of `f`.
fn time(mut f: impl FnMut()) -> (Duration, Duration) {
    let mut times: Vec<Duration> = (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort();
    (times[0], times[RUNS / 2])
}

fn show((min, median): (Duration, Duration)) -> String {
    format!(
        "{:.1} / {:.1} µs",
        min.as_secs_f64() * 1e6,
        median.as_secs_f64() * 1e6
    )
}
