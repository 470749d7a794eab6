//! The static embedder: one vector per word piece, distilled from [`Contextual`] the way
//! model2vec does it, so embedding a query costs a tokenization and a few additions, not a
//! forward pass. Owns the table, its distillation and its cache file; loads the model only to
//! distill.
//!
//! Distillation ([`distill`]): every vocabulary entry `t` goes through the model alone, as
//! `[CLS] t [SEP]`, mean pooled (the contextual embedder's pooling); the rows of the real
//! entries (not `[unused…]` or the special tokens) give a PCA that centres every row (the
//! shared component all of them carry, which otherwise dominates every sum) and keeps
//! [`Distillation::dims`] axes; each row is then scaled by its word piece's weight
//! ([`Weighting`]). A text's vector is the sum of its word pieces' rows (the weighted mean, up
//! to a scale the normalisation removes), L2 normalised; a text with no word pieces is zero.
//!
//! The cache file is a header (magic, the space's id, the vocabulary size, the width, the sizes
//! of the model's files it was distilled from) and the table as little-endian f32. A file whose
//! header does not match what would be distilled now is refused and distilled again.

use std::path::{Path, PathBuf};

use crate::bert::Precision;
use crate::contextual::Contextual;
use crate::files::MODEL_NAME;
use crate::pca::Pca;
use crate::tokenize::WordPieces;
use crate::vector::normalize;
use crate::{Embed, EmbedError, ModelFiles};

/// Bumped whenever the distillation changes the vectors for the same options.
pub const TABLE_VERSION: u32 = 1;

/// The model's width: the only width of a table without PCA.
pub const NO_PCA_DIMS: usize = 384;

const MAGIC: &[u8; 8] = b"MPXSTAT\0";

/// How a word piece's row is weighted in a text's sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weighting {
    /// Every word piece counts the same.
    Uniform,
    /// Smooth inverse frequency with frequencies from Zipf's law over the word piece's rank:
    /// `w = a / (a + p)`, `p = 1 / (rank · H)`, where the rank is the id's place among the
    /// vocabulary's words. In BERT's uncased vocabulary the words (from id 1996, "the", "of",
    /// "and" …) are roughly in order of frequency; the single characters before them are
    /// counted as the most frequent (rank 1).
    Zipf,
}

impl Weighting {
    fn name(self) -> &'static str {
        match self {
            Weighting::Uniform => "uniform",
            Weighting::Zipf => "zipf",
        }
    }
}

/// What the distillation makes: whether rows are centred and projected (PCA), the width, and
/// the weighting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Distillation {
    /// Centre the rows and keep the `dims` axes of most variance; without it the rows are the
    /// model's own, 384 wide, and `dims` must be 384.
    pub pca: bool,
    /// The width (at most the model's 384).
    pub dims: usize,
    pub weighting: Weighting,
}

impl Default for Distillation {
    /// The default: 256 axes, Zipf weights (the README's measurement).
    fn default() -> Self {
        Self {
            pca: true,
            dims: 256,
            weighting: Weighting::Zipf,
        }
    }
}

impl Distillation {
    /// The vector space's name, e.g. `all-MiniLM-L6-v2/static-v1-zipf/256` (`-nopca` after
    /// the weighting without PCA).
    pub fn id(&self) -> String {
        format!(
            "{MODEL_NAME}/static-v{TABLE_VERSION}-{}{}/{}",
            self.weighting.name(),
            if self.pca { "" } else { "-nopca" },
            self.dims
        )
    }

    /// The cache file's name in the model's directory: `static-256.bin` for the default,
    /// e.g. `static-uniform-nopca-384.bin` for another.
    pub fn file_name(&self) -> String {
        if *self == Self::default() {
            format!("static-{}.bin", self.dims)
        } else {
            format!(
                "static-{}{}-{}.bin",
                self.weighting.name(),
                if self.pca { "" } else { "-nopca" },
                self.dims
            )
        }
    }
}

/// The static embedder.
pub struct Static {
    pieces: WordPieces,
    /// `vocab × dims`, row by row, each row already weighted.
    table: Rows,
    dims: usize,
    id: String,
}

/// The table's rows held as int8 with a scale per row: a quarter of the memory of f32 (7.6 MiB
/// instead of 29.8 for the default table), which a sidecar's budget counts. Each element is
/// within half a step (1/254 of its row's largest magnitude) of the f32 the file holds, far
/// under what moves a cosine between texts.
#[derive(Debug, Default)]
struct Rows {
    codes: Vec<i8>,
    scales: Vec<f32>,
}

impl Rows {
    fn quantised(values: &[f32], dims: usize) -> Rows {
        let mut rows = Rows {
            codes: Vec::with_capacity(values.len()),
            scales: Vec::with_capacity(values.len() / dims.max(1)),
        };
        for row in values.chunks(dims.max(1)) {
            let max = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let scale = if max > 0.0 { max / 127.0 } else { 0.0 };
            rows.scales.push(scale);
            rows.codes.extend(row.iter().map(|x| {
                if scale > 0.0 {
                    (x / scale).round().clamp(-127.0, 127.0) as i8
                } else {
                    0
                }
            }));
        }
        rows
    }

    fn len(&self) -> usize {
        self.codes.len()
    }

    /// Adds row `id` to `sum` (nothing when there is no such row).
    fn add_to(&self, id: u32, sum: &mut [f32]) {
        let dims = sum.len();
        let Some(start) = usize::try_from(id).ok().and_then(|i| i.checked_mul(dims)) else {
            return;
        };
        let (Some(codes), Some(&scale)) = (
            self.codes.get(start..start + dims),
            self.scales.get(start / dims.max(1)),
        ) else {
            return;
        };
        for (s, &c) in sum.iter_mut().zip(codes) {
            *s += scale * f32::from(c);
        }
    }

    /// The rows as f32 again, for the file.
    fn values(&self, dims: usize) -> impl Iterator<Item = f32> + '_ {
        self.codes
            .chunks(dims.max(1))
            .zip(&self.scales)
            .flat_map(|(row, &scale)| row.iter().map(move |&c| scale * f32::from(c)))
    }

    fn heap_bytes(&self) -> usize {
        self.codes.capacity() + self.scales.capacity() * std::mem::size_of::<f32>()
    }
}

impl std::fmt::Debug for Static {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Static")
            .field("id", &self.id)
            .field("rows", &(self.table.len() / self.dims.max(1)))
            .finish_non_exhaustive()
    }
}

impl Static {
    /// Where the table of `distillation` is kept by default: in the model's directory
    /// (`static-256.bin` for the default), where the image carries it.
    pub fn default_cache_path(files: &ModelFiles, distillation: &Distillation) -> PathBuf {
        files.dir().join(distillation.file_name())
    }

    /// The default table ([`Distillation::default`]) from `cache_path`, or distilled from the
    /// model (a few seconds in a release build) and written there when the file is missing or
    /// does not match.
    pub fn load_or_distill(files: &ModelFiles, cache_path: &Path) -> Result<Self, EmbedError> {
        Self::load_or_distill_with(files, cache_path, &Distillation::default())
    }

    /// [`Static::load_or_distill`] for any distillation.
    pub fn load_or_distill_with(
        files: &ModelFiles,
        cache_path: &Path,
        distillation: &Distillation,
    ) -> Result<Self, EmbedError> {
        if !distillation.pca && distillation.dims != NO_PCA_DIMS {
            return Err(EmbedError::Failed(format!(
                "without PCA the table is the model's width, {NO_PCA_DIMS}, not {}",
                distillation.dims
            )));
        }
        if let Ok(table) = Self::load(files, cache_path, distillation) {
            return Ok(table);
        }
        let model = Contextual::load_at(files, None, Precision::Bf16)?;
        let table = distill(&model, distillation)?;
        table.save(files, cache_path)?;
        Ok(table)
    }

    /// The table in `path`, refused ([`EmbedError::Unavailable`]) unless its header says it is
    /// `distillation`'s, from these model files, and its size is the header's.
    pub fn load(
        files: &ModelFiles,
        path: &Path,
        distillation: &Distillation,
    ) -> Result<Self, EmbedError> {
        Self::load_as(files, path, &distillation.id(), distillation.dims)
    }

    /// The table in `path`, refused unless its header names the space `id`, `dims` wide, made
    /// from these model files (for tables not distilled, such as the learned one).
    pub(crate) fn load_as(
        files: &ModelFiles,
        path: &Path,
        id: &str,
        dims: usize,
    ) -> Result<Self, EmbedError> {
        let pieces = WordPieces::load(files)?;
        let bytes = std::fs::read(path).map_err(|err| {
            EmbedError::Unavailable(format!("cannot read {}: {err}", path.display()))
        })?;
        let header = Header::expected(files, &pieces, id, dims)?;
        let body = header.check(&bytes).map_err(|why| {
            EmbedError::Unavailable(format!("{} is not this table: {why}", path.display()))
        })?;
        let values: Vec<f32> = body
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(Self {
            pieces,
            table: Rows::quantised(&values, header.dims),
            dims: header.dims,
            id: header.id,
        })
    }

    /// A table of `rows` (`vocab × dims`, each already weighted) in the space `id`.
    pub(crate) fn from_rows(pieces: WordPieces, rows: &[f32], dims: usize, id: String) -> Self {
        Self {
            pieces,
            table: Rows::quantised(rows, dims),
            dims,
            id,
        }
    }

    /// Writes the table to `path` (a sibling file first, then renamed over it, so a reader
    /// never sees half a table).
    pub fn save(&self, files: &ModelFiles, path: &Path) -> Result<(), EmbedError> {
        let header = Header {
            id: self.id.clone(),
            vocab: self.table.len() / self.dims.max(1),
            dims: self.dims,
            sources: source_sizes(files)?,
        };
        let mut bytes = header.encode();
        bytes.reserve(self.table.len() * 4);
        for x in self.table.values(self.dims) {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        let cannot = |err: std::io::Error| {
            EmbedError::Failed(format!("cannot write {}: {err}", path.display()))
        };
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let partial = PathBuf::from(partial);
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(cannot)?;
        }
        std::fs::write(&partial, &bytes).map_err(cannot)?;
        std::fs::rename(&partial, path).map_err(cannot)
    }

    /// The table's size in memory, in bytes.
    pub fn table_bytes(&self) -> usize {
        self.table.heap_bytes()
    }
}

impl Embed for Static {
    fn id(&self) -> &str {
        &self.id
    }

    fn dims(&self) -> usize {
        self.dims
    }

    /// A text's whole text counts (no truncation); word pieces outside the table (none, for
    /// the model's own tokenizer) are passed over.
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        texts
            .iter()
            .map(|text| {
                let mut sum = vec![0.0f32; self.dims];
                for id in self.pieces.pieces(text)? {
                    self.table.add_to(id, &mut sum);
                }
                normalize(&mut sum);
                Ok(sum)
            })
            .collect()
    }

    /// A table's additions: made again from the text whenever an index is built.
    fn derived(&self) -> bool {
        true
    }
}

/// Distills `distillation`'s table from `model` (see the module's doc).
pub fn distill(model: &Contextual, distillation: &Distillation) -> Result<Static, EmbedError> {
    Ok(TokenRows::from_model(model)?.table(distillation))
}

/// The model's mean-pooled output for every vocabulary entry alone (`[CLS] t [SEP]`): the
/// distillation's costly half, from which tables of any [`Distillation`] are made.
pub struct TokenRows {
    pieces: WordPieces,
    rows: Vec<Vec<f32>>,
    kinds: Vec<Kind>,
}

impl std::fmt::Debug for TokenRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenRows")
            .field("rows", &self.rows.len())
            .finish_non_exhaustive()
    }
}

impl TokenRows {
    /// Runs every vocabulary entry through `model`, on its threads.
    pub fn from_model(model: &Contextual) -> Result<Self, EmbedError> {
        let pieces = model.word_pieces().clone();
        let vocab = pieces.vocab_size();
        let ids = 0..u32::try_from(vocab).map_err(|err| EmbedError::Failed(err.to_string()))?;
        let inputs: Vec<Vec<u32>> = ids.map(|id| vec![pieces.cls(), id, pieces.sep()]).collect();
        let rows = model.mean_pooled(&inputs);
        let kinds = (0..vocab).map(|id| kind_of(&pieces, id)).collect();
        Ok(Self {
            pieces,
            rows,
            kinds,
        })
    }

    /// The word pieces the rows are for.
    pub(crate) fn pieces(&self) -> &WordPieces {
        &self.pieces
    }

    /// Each vocabulary entry's mean-pooled output, by id.
    pub(crate) fn rows(&self) -> &[Vec<f32>] {
        &self.rows
    }

    /// Whether the entry `id` is special (`[CLS]`, `[unused…]` …): never part of a text's sum.
    pub(crate) fn is_special(&self, id: usize) -> bool {
        self.kinds.get(id).is_none_or(|kind| *kind == Kind::Special)
    }

    /// The table of `distillation`: rows projected, weighted, special entries zero.
    pub fn table(&self, distillation: &Distillation) -> Static {
        let width = self.rows.first().map_or(0, Vec::len);
        let dims = if distillation.pca {
            distillation.dims.min(width)
        } else {
            width
        };
        let real = self
            .rows
            .iter()
            .zip(&self.kinds)
            .filter(|(_, kind)| **kind != Kind::Special)
            .map(|(row, _)| row.as_slice());
        let pca = distillation.pca.then(|| Pca::fit(real, width, dims));
        let vocab = self.rows.len();
        let words_start = self
            .kinds
            .iter()
            .position(|k| *k == Kind::Word)
            .unwrap_or(0);
        let mut table = Vec::with_capacity(vocab * dims);
        for (id, (row, kind)) in self.rows.iter().zip(&self.kinds).enumerate() {
            let weight = match (kind, distillation.weighting) {
                (Kind::Special, _) => 0.0,
                (_, Weighting::Uniform) => 1.0,
                (Kind::Character, Weighting::Zipf) => zipf_weight(1, vocab),
                (Kind::Word, Weighting::Zipf) => zipf_weight(id + 1 - words_start, vocab),
            };
            let projected = match &pca {
                Some(pca) => pca.project(row),
                None => row.clone(),
            };
            table.extend(projected.into_iter().map(|x| x * weight));
        }
        Static {
            pieces: self.pieces.clone(),
            table: Rows::quantised(&table, dims),
            dims,
            id: distillation.id(),
        }
    }
}

/// What a vocabulary entry is, for its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `[PAD]`, `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`, `[unused…]`: never part of a sum.
    Special,
    /// The single characters (and their `##` forms) BERT's vocabulary lists before its words.
    Character,
    /// A word or word piece, roughly in order of frequency.
    Word,
}

fn kind_of(pieces: &WordPieces, id: usize) -> Kind {
    let token = u32::try_from(id)
        .ok()
        .and_then(|id| pieces.token(id))
        .unwrap_or_default();
    let bare = token.strip_prefix("##").unwrap_or(&token);
    if token.starts_with('[') && token.ends_with(']') {
        Kind::Special
    } else if bare.chars().count() == 1 {
        Kind::Character
    } else {
        Kind::Word
    }
}

/// Smooth inverse frequency of the word at `rank` (from 1) under Zipf's law over `vocab`
/// words: `a / (a + p)` with `p = 1 / (rank · H(vocab))` and `a = 1e-4`, the coefficient
/// model2vec uses.
fn zipf_weight(rank: usize, vocab: usize) -> f32 {
    const A: f64 = 1e-4;
    let harmonic = (vocab as f64).ln() + 0.577_215_664_9;
    let p = 1.0 / (rank.max(1) as f64 * harmonic);
    (A / (A + p)) as f32
}

/// The header of a cache file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Header {
    id: String,
    vocab: usize,
    dims: usize,
    /// The byte sizes of `model.safetensors` and `tokenizer.json`.
    sources: [u64; 2],
}

fn source_sizes(files: &ModelFiles) -> Result<[u64; 2], EmbedError> {
    let size = |path: PathBuf| {
        std::fs::metadata(&path).map(|m| m.len()).map_err(|err| {
            EmbedError::Unavailable(format!("cannot read {}: {err}", path.display()))
        })
    };
    Ok([size(files.weights())?, size(files.tokenizer())?])
}

impl Header {
    fn expected(
        files: &ModelFiles,
        pieces: &WordPieces,
        id: &str,
        dims: usize,
    ) -> Result<Self, EmbedError> {
        Ok(Self {
            id: id.to_owned(),
            vocab: pieces.vocab_size(),
            dims,
            sources: source_sizes(files)?,
        })
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        let id = self.id.as_bytes();
        out.extend_from_slice(&(id.len() as u64).to_le_bytes());
        out.extend_from_slice(id);
        for n in [
            self.vocab as u64,
            self.dims as u64,
            self.sources[0],
            self.sources[1],
        ] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out
    }

    /// The table's bytes, when `bytes` starts with this header and holds exactly its table.
    fn check<'a>(&self, bytes: &'a [u8]) -> Result<&'a [u8], String> {
        let header = self.encode();
        let Some(head) = bytes.get(..header.len()) else {
            return Err("shorter than its header".into());
        };
        if head != header.as_slice() {
            return Err(format!(
                "its header is not that of {} ({} × {}, from model files of {} and {} bytes)",
                self.id, self.vocab, self.dims, self.sources[0], self.sources[1]
            ));
        }
        let body = &bytes[header.len()..];
        if body.len() != self.vocab * self.dims * 4 {
            return Err(format!(
                "{} bytes of table, not {}",
                body.len(),
                self.vocab * self.dims * 4
            ));
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_rows_stay_within_half_a_step_and_requantise_to_themselves() {
        let values = [
            0.5, -0.25, 0.001, 0.0, /* second row */ 0.0, 0.0, 0.0, 0.0,
        ];
        let rows = Rows::quantised(&values, 4);
        let back: Vec<f32> = rows.values(4).collect();
        for (x, y) in values[..4].iter().zip(&back) {
            assert!((x - y).abs() <= 0.5 / 127.0 * 0.5 + 1e-7, "{x} {y}");
        }
        assert_eq!(&back[4..], &[0.0; 4]);
        let mut sum = vec![0.0; 4];
        rows.add_to(0, &mut sum);
        rows.add_to(7, &mut sum);
        assert_eq!(sum, back[..4]);
        let again = Rows::quantised(&back, 4);
        assert_eq!(again.codes, rows.codes);
        assert_eq!(rows.heap_bytes(), 8 + 2 * 4);
    }

    #[test]
    fn rare_words_weigh_more_than_common_ones() {
        let common = zipf_weight(1, 30_000);
        let middling = zipf_weight(1_000, 30_000);
        let rare = zipf_weight(25_000, 30_000);
        assert!(
            common < middling && middling < rare,
            "{common} {middling} {rare}"
        );
        assert!(rare <= 1.0);
    }

    #[test]
    fn the_id_names_version_weighting_and_width() {
        assert_eq!(
            Distillation::default().id(),
            format!("all-MiniLM-L6-v2/static-v{TABLE_VERSION}-zipf/256")
        );
        assert_eq!(Distillation::default().file_name(), "static-256.bin");
        let other = Distillation {
            pca: false,
            dims: 384,
            weighting: Weighting::Uniform,
        };
        assert_eq!(other.file_name(), "static-uniform-nopca-384.bin");
        assert_eq!(
            other.id(),
            format!("all-MiniLM-L6-v2/static-v{TABLE_VERSION}-uniform-nopca/384")
        );
    }

    #[test]
    fn a_header_refuses_another_id_or_size() {
        let header = Header {
            id: "m/static-v1-zipf/2".into(),
            vocab: 3,
            dims: 2,
            sources: [10, 20],
        };
        let mut file = header.encode();
        file.extend_from_slice(&[0u8; 24]);
        assert_eq!(header.check(&file).map(<[u8]>::len), Ok(24));
        assert!(header.check(&file[..file.len() - 4]).is_err());
        let other = Header {
            id: "m/static-v1-uniform/2".into(),
            ..header.clone()
        };
        assert!(other.check(&file).is_err());
        let resized = Header {
            sources: [11, 20],
            ..header
        };
        assert!(resized.check(&file).is_err());
    }
}
