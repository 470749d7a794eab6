//! The learned static table: rows fitted so that a text's mean of rows points where the full
//! model's vector of the same text points, over a corpus of English definitions and examples
//! (WordNet's glosses), instead of each row being its word piece's vector alone
//! ([`crate::table::distill`]). Owns the corpus reading, the fit and the table's name; the
//! table is then an ordinary [`Static`] (same lookup, same cost per text).
//!
//! The fit (model2vec's "tokenlearn", in closed form):
//! - every corpus text goes through the full model (mean pooled, L2 normalised); the vectors
//!   are centred on their mean and reduced to [`LEARNED_DIMS`] axes by PCA: the targets `T`;
//! - every vocabulary entry's prior row is its own vector alone (`[CLS] t [SEP]`, as the
//!   distilled table starts from), normalised and projected the same way: `R0`;
//! - the rows `R` minimise `‖A·R − T‖² + λ‖R − R0‖²`, where row `s` of `A` averages text `s`'s
//!   word pieces (each `1 / pieces`). Conjugate gradients on the normal equations
//!   `(AᵀA + λI)·(R − R0) = Aᵀ(T − A·R0)`, each of the table's columns its own system; an
//!   entry the corpus never uses keeps its prior row.
//!
//! No weighting is applied afterwards: a row's length is what the fit gave it, which plays the
//! part of the distilled table's Zipf weights (common pieces end up short).
//!
//! Measured (README, "Recall by meaning"): LoCoMo recall_any@10 0.821 → 0.832 fused with the
//! words, the paraphrase test's facts 15 → 20 of 30, at the distilled table's cost.

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::bert::Precision;
use crate::contextual::{Contextual, MAX_PIECES};
use crate::files::MODEL_NAME;
use crate::pca::Pca;
use crate::table::{Static, TokenRows};
use crate::vector::normalize;
use crate::{EmbedError, ModelFiles};

/// Where Debian's `wordnet-base` puts WordNet's database.
pub const WORDNET_DIR: &str = "/usr/share/wordnet";

/// The learned table's width.
pub const LEARNED_DIMS: usize = 256;

/// Bumped whenever the corpus or the fit changes the rows.
pub const LEARNED_VERSION: u32 = 1;

/// The weight of the prior rows (`λ`). Recall was the same within 0.004 from 0.03 to 1
/// (README); 0.3 is the middle of that range.
const PRIOR_WEIGHT: f64 = 0.3;

/// Conjugate-gradient iterations at most, and the residual (relative to the first) at which
/// the fit stops earlier.
const MAX_ITERATIONS: usize = 100;
const TOLERANCE: f64 = 1e-4;

/// The learned table's vector space, e.g. `all-MiniLM-L6-v2/static-v1-learned-wordnet/256`.
pub fn learned_id() -> String {
    format!("{MODEL_NAME}/static-v{LEARNED_VERSION}-learned-wordnet/{LEARNED_DIMS}")
}

/// The learned table's file name in the model's directory.
pub const LEARNED_FILE: &str = "static-learned-256.bin";

/// Where the learned table is kept by default: beside the model, where the image carries it.
pub fn learned_path(files: &ModelFiles) -> PathBuf {
    files.dir().join(LEARNED_FILE)
}

/// The learned table in `path`, refused unless it is one made from these model files.
pub fn load_learned(files: &ModelFiles, path: &Path) -> Result<Static, EmbedError> {
    Static::load_as(files, path, &learned_id(), LEARNED_DIMS)
}

/// The static table in `path`: the learned one when the file holds it, else the distilled one
/// (distilled again and written there when the file is neither).
pub fn load_static(files: &ModelFiles, path: &Path) -> Result<Static, EmbedError> {
    load_learned(files, path).or_else(|_| Static::load_or_distill(files, path))
}

/// The texts of WordNet's database in `dir` (`data.noun`, `data.verb`, `data.adj`,
/// `data.adv`): each synset's definition and quoted examples of three words or more, and its
/// words when it has two or more (`car, auto, automobile, machine, motorcar`), each once, in
/// the files' order.
pub fn wordnet_texts(dir: &Path) -> Result<Vec<String>, EmbedError> {
    let mut texts = Vec::new();
    let mut seen = HashSet::new();
    for part in ["noun", "verb", "adj", "adv"] {
        let path = dir.join(format!("data.{part}"));
        let bytes = std::fs::read(&path).map_err(|err| {
            EmbedError::Unavailable(format!(
                "cannot read {}: {err}; WordNet's database is Debian's `wordnet-base` \
                 (apt-get install wordnet-base), or pass --wordnet DIR",
                path.display()
            ))
        })?;
        for line in String::from_utf8_lossy(&bytes).lines() {
            for text in synset_texts(line) {
                if seen.insert(text.clone()) {
                    texts.push(text);
                }
            }
        }
    }
    Ok(texts)
}

/// The texts of one line of a WordNet data file (none for the licence's lines, which start
/// with two spaces). A line is `offset lex_filenum ss_type w_cnt word lex_id … | gloss`, with
/// `w_cnt` in hexadecimal and the gloss's parts separated by `; `.
fn synset_texts(line: &str) -> Vec<String> {
    if line.starts_with("  ") {
        return Vec::new();
    }
    let Some((head, gloss)) = line.split_once(" | ") else {
        return Vec::new();
    };
    let fields: Vec<&str> = head.split_whitespace().collect();
    let count = fields
        .get(3)
        .and_then(|n| usize::from_str_radix(n, 16).ok())
        .unwrap_or(0);
    let words: Vec<String> = (0..count)
        .filter_map(|i| fields.get(4 + 2 * i))
        .map(|w| w.replace('_', " "))
        .collect();
    let mut texts = Vec::new();
    for piece in gloss.trim().split("; ") {
        let piece = piece.trim();
        let text = if piece.starts_with('"') {
            piece.trim_matches('"')
        } else {
            piece
        };
        if text.split_whitespace().count() >= 3 {
            texts.push(text.to_owned());
        }
    }
    if words.len() >= 2 {
        texts.push(words.join(", "));
    }
    texts
}

/// Learns the table from the model in `files` and `texts` on `threads` (default: one per
/// core): the vocabulary's rows with bf16 products, as the distillation makes them, the texts'
/// vectors with the fastest kernel the CPU has (their differences are far under what the fit
/// can use).
pub fn learn_from_model(
    files: &ModelFiles,
    texts: &[String],
    threads: Option<NonZeroUsize>,
) -> Result<Static, EmbedError> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.map_or(0, NonZeroUsize::get))
        .build()
        .map_err(|err| EmbedError::Failed(err.to_string()))?;
    pool.install(|| {
        let rows = TokenRows::from_model(&Contextual::load_at(files, threads, Precision::Bf16)?)?;
        let model = Contextual::load_at(files, threads, Precision::Fastest)?;
        learn(&model, &rows, texts)
    })
}

/// Learns the table from `rows` (every vocabulary entry through the model alone, as the
/// distillation makes them) and `model`'s vectors of `texts`. For WordNet's 221,921 texts on
/// two cores: 460 s in a release build, a peak RSS of 772 MB (README, "Costs").
pub fn learn(model: &Contextual, rows: &TokenRows, texts: &[String]) -> Result<Static, EmbedError> {
    let pieces = rows.pieces();
    let inputs: Vec<Vec<u32>> = texts
        .iter()
        .map(|text| pieces.model_input(text, MAX_PIECES))
        .collect::<Result<_, _>>()?;
    let mut vectors: Vec<Vec<f32>> = Vec::with_capacity(inputs.len());
    for chunk in inputs.chunks(4096) {
        for mut vector in model.mean_pooled(chunk) {
            normalize(&mut vector);
            vectors.push(vector);
        }
    }
    let width = vectors.first().map_or(0, Vec::len);
    let pca = Pca::fit(vectors.iter().map(Vec::as_slice), width, LEARNED_DIMS);
    let dims = LEARNED_DIMS.min(width);
    let mut targets = Vec::with_capacity(vectors.len() * dims);
    for vector in vectors.drain(..) {
        targets.extend(pca.project(&vector));
    }
    let mut prior = Vec::with_capacity(rows.rows().len() * dims);
    for (id, row) in rows.rows().iter().enumerate() {
        if rows.is_special(id) {
            prior.extend(std::iter::repeat_n(0.0, dims));
        } else {
            let mut unit = row.clone();
            normalize(&mut unit);
            prior.extend(pca.project(&unit));
        }
    }
    let texts = Averages::new(&inputs, |id| rows.is_special(id as usize));
    let fitted = fit(&texts, &targets, &prior, dims, PRIOR_WEIGHT);
    Ok(Static::from_rows(
        pieces.clone(),
        &fitted,
        dims,
        learned_id(),
    ))
}

/// The matrix `A`: each text's word pieces (special entries left out), each weighing
/// `1 / pieces`, row by row (a piece twice in a text is there twice).
struct Averages {
    /// Where each text's pieces start in `ids`; one more than there are texts.
    starts: Vec<usize>,
    ids: Vec<u32>,
}

impl Averages {
    fn new(inputs: &[Vec<u32>], special: impl Fn(u32) -> bool) -> Self {
        let mut starts = Vec::with_capacity(inputs.len() + 1);
        let mut ids = Vec::new();
        starts.push(0);
        for input in inputs {
            ids.extend(input.iter().copied().filter(|&id| !special(id)));
            starts.push(ids.len());
        }
        Self { starts, ids }
    }

    fn texts(&self) -> usize {
        self.starts.len() - 1
    }

    fn pieces(&self, text: usize) -> &[u32] {
        &self.ids[self.starts[text]..self.starts[text + 1]]
    }

    /// `Aᵀ·(B − A·X)` when `b` is given, else `Aᵀ·A·X`, for `X` of `dims` columns (row by row,
    /// one row per vocabulary entry), without holding `A·X`: each text's average is made,
    /// then spread back over its pieces. Texts are shared among the threads, each summing into
    /// its own result.
    fn normal(&self, x: &[f64], b: Option<&[f32]>, dims: usize) -> Vec<f64> {
        let len = x.len();
        let chunk = self
            .texts()
            .div_ceil(rayon::current_num_threads().max(1))
            .max(1);
        (0..self.texts())
            .into_par_iter()
            .with_min_len(chunk)
            .fold(
                || (vec![0.0f64; len], vec![0.0f64; dims]),
                |(mut out, mut average), text| {
                    let pieces = self.pieces(text);
                    if pieces.is_empty() {
                        return (out, average);
                    }
                    let share = 1.0 / pieces.len() as f64;
                    average.fill(0.0);
                    for &id in pieces {
                        let row = &x[id as usize * dims..(id as usize + 1) * dims];
                        for (a, r) in average.iter_mut().zip(row) {
                            *a += share * r;
                        }
                    }
                    if let Some(b) = b {
                        let target = &b[text * dims..(text + 1) * dims];
                        for (a, t) in average.iter_mut().zip(target) {
                            *a = f64::from(*t) - *a;
                        }
                    }
                    for &id in pieces {
                        let row = &mut out[id as usize * dims..(id as usize + 1) * dims];
                        for (o, a) in row.iter_mut().zip(&average) {
                            *o += share * a;
                        }
                    }
                    (out, average)
                },
            )
            .map(|(out, _)| out)
            .reduce(
                || vec![0.0f64; len],
                |mut a, b| {
                    for (x, y) in a.iter_mut().zip(&b) {
                        *x += y;
                    }
                    a
                },
            )
    }
}

/// The rows `R` minimising `‖A·R − T‖² + λ‖R − R0‖²` (see the module's doc), by conjugate
/// gradients, every column its own system (its own step lengths).
fn fit(a: &Averages, targets: &[f32], prior: &[f32], dims: usize, lambda: f64) -> Vec<f32> {
    let r0: Vec<f64> = prior.iter().map(|&x| f64::from(x)).collect();
    // The right-hand side Aᵀ(T − A·R0), which is also the first residual (X starts at zero).
    let mut residual = a.normal(&r0, Some(targets), dims);
    let mut direction = residual.clone();
    let mut x = vec![0.0f64; r0.len()];
    let column_sums = |m: &[f64], n: &[f64]| -> Vec<f64> {
        let mut sums = vec![0.0f64; dims];
        for (row_m, row_n) in m.chunks_exact(dims).zip(n.chunks_exact(dims)) {
            for ((s, p), q) in sums.iter_mut().zip(row_m).zip(row_n) {
                *s += p * q;
            }
        }
        sums
    };
    let mut squares = column_sums(&residual, &residual);
    let first: f64 = squares.iter().sum::<f64>().sqrt();
    if first == 0.0 {
        return prior.to_vec();
    }
    for _ in 0..MAX_ITERATIONS {
        let mut product = a.normal(&direction, None, dims);
        for (p, d) in product.iter_mut().zip(&direction) {
            *p += lambda * d;
        }
        let curvature = column_sums(&direction, &product);
        let steps: Vec<f64> = squares
            .iter()
            .zip(&curvature)
            .map(|(s, c)| if *c > 0.0 { s / c } else { 0.0 })
            .collect();
        for ((xr, rr), (dr, pr)) in x
            .chunks_exact_mut(dims)
            .zip(residual.chunks_exact_mut(dims))
            .zip(direction.chunks_exact(dims).zip(product.chunks_exact(dims)))
        {
            for j in 0..dims {
                xr[j] += steps[j] * dr[j];
                rr[j] -= steps[j] * pr[j];
            }
        }
        let next = column_sums(&residual, &residual);
        if next.iter().sum::<f64>().sqrt() < TOLERANCE * first {
            break;
        }
        let turns: Vec<f64> = next
            .iter()
            .zip(&squares)
            .map(|(n, s)| if *s > 0.0 { n / s } else { 0.0 })
            .collect();
        for (dr, rr) in direction
            .chunks_exact_mut(dims)
            .zip(residual.chunks_exact(dims))
        {
            for j in 0..dims {
                dr[j] = rr[j] + turns[j] * dr[j];
            }
        }
        squares = next;
    }
    r0.iter().zip(&x).map(|(p, d)| (p + d) as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_synset_line_gives_its_definition_examples_and_words() {
        let line = "02958343 06 n 05 car 0 auto 0 automobile 0 machine 4 motorcar 0 007 @ 03791235 n 0000 | a motor vehicle with four wheels; usually propelled by an internal combustion engine; \"he needs a car to get to work\"  ";
        assert_eq!(
            synset_texts(line),
            [
                "a motor vehicle with four wheels",
                "usually propelled by an internal combustion engine",
                "he needs a car to get to work",
                "car, auto, automobile, machine, motorcar",
            ]
        );
        // Short parts and one-word synsets give nothing; the licence's lines neither.
        assert_eq!(
            synset_texts("00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 | that which is"),
            ["that which is"]
        );
        assert!(synset_texts("00002 03 n 01 thing 0 000 | a ship").is_empty());
        assert!(synset_texts("  1 This software and database is being provided").is_empty());
    }

    #[test]
    fn the_fit_recovers_rows_that_explain_the_targets() {
        // Three entries, two columns; texts average them; targets made by known rows.
        let truth = [1.0f32, 0.0, 0.0, 1.0, -1.0, 2.0];
        let inputs = vec![vec![0, 1], vec![1, 2], vec![0, 2], vec![0], vec![2, 2, 1]];
        let a = Averages::new(&inputs, |_| false);
        let mut targets = Vec::new();
        for input in &inputs {
            let mut t = [0.0f32; 2];
            for &id in input {
                for j in 0..2 {
                    t[j] += truth[id as usize * 2 + j] / input.len() as f32;
                }
            }
            targets.extend(t);
        }
        let prior = [0.0f32; 6];
        let fitted = fit(&a, &targets, &prior, 2, 1e-9);
        for (f, t) in fitted.iter().zip(&truth) {
            assert!((f - t).abs() < 1e-3, "{fitted:?} against {truth:?}");
        }
        // A strong prior holds the rows near it; an entry no text uses keeps its prior.
        let held = fit(&a, &targets, &[5.0; 6], 2, 1e6);
        assert!(held.iter().all(|x| (x - 5.0).abs() < 0.01), "{held:?}");
        let unused = Averages::new(&[vec![0]], |id| id == 2);
        let kept = fit(
            &unused,
            &[1.0, 1.0],
            &[0.0, 0.0, 0.0, 0.0, 7.0, 7.0],
            2,
            0.1,
        );
        assert_eq!(&kept[4..], &[7.0, 7.0]);
    }

    #[test]
    fn special_entries_are_left_out_of_the_averages() {
        let a = Averages::new(&[vec![101, 7, 8, 102], vec![101, 102]], |id| id > 100);
        assert_eq!(a.texts(), 2);
        assert_eq!(a.pieces(0), [7, 8]);
        assert!(a.pieces(1).is_empty());
    }
}
