//! all-MiniLM-L6-v2's full forward pass: BERT (6 layers, 384 dims) over at most 256 word
//! pieces, mean pooled, L2 normalised, as sentence-transformers computes it. The pass itself is
//! [`Bert`] (`bert.rs`; its weights int8 or bf16, `products.rs`); this owns it, the tokenizer and, when told
//! a thread count, its own thread pool. It never downloads anything (see [`ModelFiles`]).

use std::num::NonZeroUsize;
use std::sync::Arc;

use rayon::prelude::*;

use crate::bert::{Bert, Precision, Shape};
use crate::tokenize::WordPieces;
use crate::vector::normalize;
use crate::{Assist, Embed, EmbedError, ModelFiles};

/// The vector space's name.
pub const CONTEXTUAL_ID: &str = "all-MiniLM-L6-v2/384";

/// The most word pieces the model reads, `[CLS]` and `[SEP]` included (sentence-transformers'
/// `max_seq_length` for this model); the rest of a longer text is cut.
pub const MAX_PIECES: usize = 256;

/// The contextual embedder.
pub struct Contextual {
    model: Arc<Bert>,
    pieces: WordPieces,
    /// `None`: the global rayon pool (one thread per core, or `RAYON_NUM_THREADS`).
    pool: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for Contextual {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contextual")
            .field("id", &CONTEXTUAL_ID)
            .field("dims", &self.model.dims())
            .field("kernel", &self.model.kernel().name())
            .field(
                "threads",
                &self.pool.as_ref().map(|p| p.current_num_threads()),
            )
            .finish_non_exhaustive()
    }
}

fn failed(err: impl std::fmt::Display) -> EmbedError {
    EmbedError::Failed(err.to_string())
}

impl Contextual {
    /// Loads the weights, config and tokenizer from `files`. `threads` is how many texts are
    /// embedded at once (its own pool); `None` leaves it to the global rayon pool (one thread
    /// per core, or `RAYON_NUM_THREADS`). A single text is embedded on the caller's thread.
    pub fn load(files: &ModelFiles, threads: Option<NonZeroUsize>) -> Result<Self, EmbedError> {
        Contextual::load_at(files, threads, Precision::Fastest)
    }

    /// [`Contextual::load`] with the products at `precision`: [`Precision::Bf16`] for the
    /// static table's distillation, with bf16 products on every machine (int8 on AVX-512 VNNI
    /// distilled a table that recalled 0.818 on LoCoMo against 0.821).
    pub fn load_at(
        files: &ModelFiles,
        threads: Option<NonZeroUsize>,
        precision: Precision,
    ) -> Result<Self, EmbedError> {
        let unavailable = |what: &std::path::Path, err: &dyn std::fmt::Display| -> EmbedError {
            EmbedError::Unavailable(format!("cannot read {}: {err}", what.display()))
        };
        let config_path = files.config();
        let config_text =
            std::fs::read_to_string(&config_path).map_err(|e| unavailable(&config_path, &e))?;
        let shape: Shape =
            serde_json::from_str(&config_text).map_err(|e| unavailable(&config_path, &e))?;
        let weights_path = files.weights();
        let bytes = std::fs::read(&weights_path).map_err(|e| unavailable(&weights_path, &e))?;
        let model = Arc::new(Bert::from_safetensors(&bytes, shape, precision)?);
        drop(bytes);
        let pieces = WordPieces::load(files)?;
        let pool = threads
            .map(|n| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n.get())
                    .thread_name(|i| format!("memproxy-embed-{i}"))
                    .build()
            })
            .transpose()
            .map_err(failed)?;
        Ok(Self {
            model,
            pieces,
            pool,
        })
    }

    /// The tokenizer the model reads with.
    pub fn word_pieces(&self) -> &WordPieces {
        &self.pieces
    }

    /// The mean-pooled (not normalised) output for each input, each a list of word-piece ids
    /// with its special tokens: one input on the caller's thread, more on the embedder's
    /// threads, each its own forward pass (no padding).
    pub fn mean_pooled(&self, inputs: &[Vec<u32>]) -> Vec<Vec<f32>> {
        match inputs {
            [one] => vec![self.model.mean_pooled(one)],
            _ => {
                let run = || {
                    inputs
                        .par_iter()
                        .map(|ids| self.model.mean_pooled(ids))
                        .collect()
                };
                match &self.pool {
                    Some(pool) => pool.install(run),
                    None => run(),
                }
            }
        }
    }
}

impl Embed for Contextual {
    fn id(&self) -> &str {
        CONTEXTUAL_ID
    }

    fn dims(&self) -> usize {
        self.model.dims()
    }

    /// A forward pass: 1 to 4 ms for a question on one core.
    fn worth_a_thread(&self) -> bool {
        true
    }

    /// An empty text is `[CLS] [SEP]`, embedded as the model embeds it (as
    /// sentence-transformers does), so its vector is not zero.
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let inputs = texts
            .iter()
            .map(|text| self.pieces.model_input(text, MAX_PIECES))
            .collect::<Result<Vec<_>, _>>()?;
        let mut vectors = self.mean_pooled(&inputs);
        for vector in &mut vectors {
            normalize(vector);
        }
        Ok(vectors)
    }

    /// One pass, shared with the thread that waits for it while it helps.
    fn embed_assisted(&self, text: &str, assist: &Assist) -> Result<Vec<Vec<f32>>, EmbedError> {
        let input = self.pieces.model_input(text, MAX_PIECES)?;
        let mut vector = self.model.mean_pooled_assisted(&input, assist);
        normalize(&mut vector);
        Ok(vec![vector])
    }
}
