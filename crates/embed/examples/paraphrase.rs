//! The paraphrase set (`tests/it/paraphrase_set.rs`) for the contextual embedder and the static
//! variants: top-1 and top-5 accuracy of 30 questions against 30 facts and 30 distractors, and
//! how long the distillation took. The README's figures come from
//!
//!     scripts/fetch-model.sh
//!     cargo run --release -p memproxy-embed --example paraphrase

// Allowed: an example prints its report.
#![allow(clippy::print_stdout, clippy::unwrap_used)]

#[path = "../tests/it/paraphrase_set.rs"]
mod paraphrase_set;

use std::time::Instant;

use memproxy_embed::table::{Distillation, TokenRows, Weighting};
use memproxy_embed::{Contextual, Embed, ModelFiles};

fn main() {
    let files = ModelFiles::locate(None).unwrap();
    let model = Contextual::load(&files, None).unwrap();
    let (top1, top5) = paraphrase_set::accuracy(&|texts| model.embed(texts).unwrap());
    println!("{:<44} top-1 {top1:.3}  top-5 {top5:.3}", model.id());
    let start = Instant::now();
    let rows = TokenRows::from_model(&model).unwrap();
    println!("token rows: {:.1} s", start.elapsed().as_secs_f64());
    for pca in [false, true] {
        for dims in [384, 256, 128, 64] {
            if !pca && dims != 384 {
                continue;
            }
            for weighting in [Weighting::Uniform, Weighting::Zipf] {
                let distillation = Distillation {
                    pca,
                    dims,
                    weighting,
                };
                let start = Instant::now();
                let table = rows.table(&distillation);
                let took = start.elapsed().as_secs_f64();
                let (top1, top5) = paraphrase_set::accuracy(&|texts| table.embed(texts).unwrap());
                println!(
                    "{:<44} top-1 {top1:.3}  top-5 {top5:.3}  (table made in {took:.1} s)",
                    table.id()
                );
            }
        }
    }
}
