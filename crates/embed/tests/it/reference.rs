//! `Contextual` against `reference.json`, the vectors and word-piece ids a plain numpy forward
//! pass of the model computed (`scripts/embed_reference.py`): a short sentence, a question,
//! accents, CJK, Greek, an emoji and a word over 100 characters (`[UNK]`), a text past 256
//! word pieces (truncated), and the empty text.

use memproxy_embed::bert::{Kernel, Precision};
use memproxy_embed::contextual::MAX_PIECES;
use memproxy_embed::{Contextual, Embed};
use serde::Deserialize;

use crate::model_files;

#[derive(Deserialize)]
struct Reference {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    vector: Vec<f32>,
}

fn reference() -> Reference {
    let text = include_str!("reference.json");
    serde_json::from_str(text).unwrap()
}

#[test]
fn word_pieces_are_the_reference_tokenizers() {
    let model = Contextual::load(&model_files(), None).unwrap();
    for case in reference().cases {
        let ids = model
            .word_pieces()
            .model_input(&case.text, MAX_PIECES)
            .unwrap();
        assert_eq!(ids, case.ids, "{:?}", case.text);
    }
}

/// The forward pass against the f32 reference at the precision the request path uses here
/// and at the one the static table is distilled with.
#[test]
fn contextual_vectors_are_the_reference_forward_pass() {
    let files = model_files();
    let int8 = Kernel::best() == Kernel::Avx512Vnni;
    check_against_reference(&Contextual::load(&files, None).unwrap(), int8);
    check_against_reference(
        &Contextual::load_at(&files, None, Precision::Bf16).unwrap(),
        false,
    );
}

/// With bf16 weights (each product's inputs rounded to bf16, sums in f32) the pass is within a
/// cosine of 0.9999 of the f32 reference, each element within 2e-3. With int8 weights and
/// activations (AVX-512 VNNI) it is within 0.998 and 0.015 (0.9989–0.9990 and at most 0.008 for
/// the texts here), and 0.99 and 0.03 for the empty text (0.992: two word pieces, where a
/// layer's rounding is shared by fewer).
fn check_against_reference(model: &Contextual, int8: bool) {
    let cases = reference().cases;
    let texts: Vec<&str> = cases.iter().map(|c| c.text.as_str()).collect();
    // All at once (on the pool's threads) and one by one (on this one).
    let together = model.embed(&texts).unwrap();
    let mut least = 1.0f32;
    for (case, got) in cases.iter().zip(&together) {
        let (least_cosine, most_apart) = match (int8, case.text.is_empty()) {
            (false, _) => (0.9999, 2e-3),
            (true, false) => (0.998, 0.015),
            (true, true) => (0.99, 0.03),
        };
        let alone = model.embed(&[case.text.as_str()]).unwrap().remove(0);
        assert_eq!(
            got, &alone,
            "{:?}: the same alone as with others",
            case.text
        );
        assert_eq!(got.len(), 384);
        let worst = got
            .iter()
            .zip(&case.vector)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        let cosine: f32 = got.iter().zip(&case.vector).map(|(a, b)| a * b).sum();
        least = least.min(cosine);
        assert!(worst <= most_apart, "{:?}: max abs diff {worst}", case.text);
        assert!(cosine >= least_cosine, "{:?}: cosine {cosine}", case.text);
    }
    eprintln!("least cosine with the reference ({:?}): {least}", model);
    assert!(
        cases.iter().any(|c| c.ids.len() == MAX_PIECES),
        "a truncated case"
    );
    assert!(cases.iter().any(|c| c.text.is_empty()), "the empty case");
}

#[test]
fn a_fixed_thread_count_gives_the_same_vectors() {
    let files = model_files();
    let default = Contextual::load(&files, None).unwrap();
    let one = Contextual::load(&files, std::num::NonZeroUsize::new(1)).unwrap();
    // Several texts, so each embedder runs them on its pool (one text runs on the caller's
    // thread), each vector back in its text's place.
    let texts = [
        "the thread pool must not change the numbers",
        "nor the order the vectors come back in",
        "a third, longer text about pools, threads and the order of their results",
    ];
    let (a, b) = (default.embed(&texts).unwrap(), one.embed(&texts).unwrap());
    let worst = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "{worst}");
}

/// The ASCII short path gives the general pipeline's pieces: on the reference texts, and on
/// generated ASCII text of every kind of byte (letters weighted as in prose, digits,
/// punctuation, the whitespace BERT knows, control bytes, words past 100 characters).
#[test]
fn the_ascii_path_splits_as_the_general_pipeline() {
    let model = Contextual::load(&model_files(), None).unwrap();
    let pieces = model.word_pieces();
    assert!(pieces.has_ascii_path());
    let mut texts: Vec<String> = reference()
        .cases
        .into_iter()
        .map(|c| c.text)
        .filter(|t| t.is_ascii())
        .collect();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for n in 0..3000 {
        let len = (next() % 240) as usize;
        let mut text = String::with_capacity(len);
        for _ in 0..len {
            let pick = next() % 100;
            let byte = match pick {
                0..=59 => b"etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLU"[(next() % 38) as usize],
                60..=69 => b' ',
                70..=76 => b"0123456789"[(next() % 10) as usize],
                77..=88 => b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"[(next() % 32) as usize],
                89..=93 => b"\t\n\r\x0b\x0c"[(next() % 5) as usize],
                _ => (next() % 128) as u8,
            };
            text.push(char::from(byte));
        }
        if n % 100 == 0 {
            text.push_str(&"abc".repeat(40));
        }
        texts.push(text);
    }
    for text in &texts {
        assert_eq!(
            pieces.pieces(text).unwrap(),
            pieces.general_pieces(text).unwrap(),
            "{text:?}"
        );
    }
}

/// A pass shared with a thread that waits for it (`Assist::help`: that thread runs the second
/// half of the rows of each step it joins) gives every reference text the same vector, to the
/// bit, as the pass alone: the rows' sums are the same sums, whichever thread runs them. The
/// helper joins as the pass begins (it waits for the offer) and again whenever it left for
/// want of work, so most passes are shared.
#[test]
fn a_pass_shared_with_a_waiting_thread_is_the_same_to_the_bit() {
    use memproxy_embed::Assist;
    use std::sync::Arc;
    let model = Arc::new(Contextual::load(&model_files(), None).unwrap());
    let mut shared_halves = 0;
    for case in reference().cases {
        let alone = model.embed(&[case.text.as_str()]).unwrap();
        for _ in 0..3 {
            let assist = Arc::new(Assist::default());
            let helper = {
                let assist = Arc::clone(&assist);
                std::thread::spawn(move || assist.help())
            };
            let shared = model.embed_assisted(&case.text, &assist).unwrap();
            assist.close();
            shared_halves += helper.join().unwrap();
            let bits = |vectors: &[Vec<f32>]| -> Vec<u32> {
                vectors.iter().flatten().map(|v| v.to_bits()).collect()
            };
            assert_eq!(bits(&shared), bits(&alone), "{:?}", case.text);
        }
    }
    assert!(
        shared_halves > 0,
        "the waiting thread ran no half of any pass"
    );
}
