//! The static table's cache file: what is written is what is read, and a file of another
//! table, or cut short, is refused.

use memproxy_embed::table::{Distillation, Weighting};
use memproxy_embed::{Embed, Static};

use crate::model_files;

#[test]
fn a_saved_table_loads_with_the_same_vectors_and_another_is_refused() {
    let files = model_files();
    let distillation = Distillation::default();
    let table = Static::load_or_distill(&files, &Static::default_cache_path(&files, &distillation))
        .unwrap();
    assert_eq!(table.dims(), 256);
    // int8 rows with an f32 scale each.
    assert_eq!(table.table_bytes(), 30_522 * (256 + 4));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("static.bin");
    table.save(&files, &path).unwrap();
    let again = Static::load(&files, &path, &distillation).unwrap();
    let texts = ["I drive a silver Volvo.", "", "東京タワー 🙂"];
    assert_eq!(table.embed(&texts).unwrap(), again.embed(&texts).unwrap());
    assert_eq!(again.id(), table.id());

    let other = Distillation {
        weighting: Weighting::Uniform,
        ..distillation
    };
    let err = Static::load(&files, &path, &other).unwrap_err().to_string();
    assert!(err.contains("is not this table"), "{err}");

    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
    let err = Static::load(&files, &path, &distillation)
        .unwrap_err()
        .to_string();
    assert!(err.contains("bytes of table"), "{err}");
}

#[test]
fn static_vectors_are_unit_length_and_an_empty_text_is_zero() {
    let files = model_files();
    let table = Static::load_or_distill(
        &files,
        &Static::default_cache_path(&files, &Distillation::default()),
    )
    .unwrap();
    let vectors = table.embed(&["a short query", "", "   "]).unwrap();
    let norm: f32 = vectors[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    assert!(vectors[1].iter().chain(&vectors[2]).all(|x| *x == 0.0));
}
