//! Both embedders on the paraphrase set (`paraphrase_set.rs`): the accuracies measured when
//! the default static table was chosen (README, "Recall by meaning: the embedding model"),
//! less a margin of three questions of the thirty, are the floor.

use memproxy_embed::learn::{learned_path, load_learned};
use memproxy_embed::table::Distillation;
use memproxy_embed::{Contextual, Embed, Static};

use crate::model_files;
use crate::paraphrase_set::accuracy;

/// Measured: top-1 0.967, top-5 1.000.
#[test]
fn contextual_finds_the_paraphrased_facts() {
    let model = Contextual::load(&model_files(), None).unwrap();
    let (top1, top5) = accuracy(&|texts| model.embed(texts).unwrap());
    assert!(top1 >= 0.86, "top-1 {top1}");
    assert!(top5 >= 0.90, "top-5 {top5}");
}

/// Measured (256 dims, Zipf weights): top-1 0.667, top-5 0.867.
#[test]
fn the_static_table_finds_most_paraphrased_facts() {
    let files = model_files();
    let cache = Static::default_cache_path(&files, &Distillation::default());
    let table = Static::load_or_distill(&files, &cache).unwrap();
    let (top1, top5) = accuracy(&|texts| table.embed(texts).unwrap());
    assert!(top1 >= 0.56, "top-1 {top1}");
    assert!(top5 >= 0.76, "top-5 {top5}");
}

/// Measured (the learned table, `memproxy model learn`): top-1 0.767, top-5 0.933, above the
/// distilled table's 0.667 and 0.867.
#[test]
fn the_learned_table_finds_more_paraphrased_facts_than_the_distilled_one() {
    let files = model_files();
    let path = learned_path(&files);
    let table = load_learned(&files, &path).unwrap_or_else(|err| {
        panic!(
            "{err}: the learned table is made by `cargo run --bin memproxy -- model learn` \
             (needs Debian's wordnet-base; scripts/test.sh runs it first)"
        )
    });
    let (top1, top5) = accuracy(&|texts| table.embed(texts).unwrap());
    assert!(top1 >= 0.66, "top-1 {top1}");
    assert!(top5 >= 0.83, "top-5 {top5}");
}
