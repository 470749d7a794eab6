//! all-MiniLM-L6-v2's full forward pass: BERT (6 layers, 384 dims) over at most 256 word
//! pieces, mean pooled over the attention mask, L2 normalised, as sentence-transformers
//! computes it. Owns the weights (about 90 MB of f32) and, when told a thread count, its own
//! thread pool; it never downloads anything (see [`ModelFiles`]).

use std::num::NonZeroUsize;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::{BertModel, Config};

use crate::tokenize::WordPieces;
use crate::vector::normalize;
use crate::{Embed, EmbedError, ModelFiles};

/// The vector space's name.
pub const CONTEXTUAL_ID: &str = "all-MiniLM-L6-v2/384";

/// The most word pieces the model reads, `[CLS]` and `[SEP]` included (sentence-transformers'
/// `max_seq_length` for this model); the rest of a longer text is cut.
pub const MAX_PIECES: usize = 256;

/// Texts per forward pass. Texts are sorted by length first, so a batch pads little.
pub const BATCH: usize = 32;

/// The contextual embedder.
pub struct Contextual {
    model: BertModel,
    pieces: WordPieces,
    dims: usize,
    /// `None`: candle's default, the global rayon pool (one thread per core).
    pool: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for Contextual {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contextual")
            .field("id", &CONTEXTUAL_ID)
            .field("dims", &self.dims)
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
    /// Loads the weights, config and tokenizer from `files`. `threads` is how many threads a
    /// forward pass may use (its own pool); `None` leaves it to candle (the global rayon pool,
    /// one thread per core, or `RAYON_NUM_THREADS`).
    pub fn load(files: &ModelFiles, threads: Option<NonZeroUsize>) -> Result<Self, EmbedError> {
        let unavailable = |what: &std::path::Path, err: &dyn std::fmt::Display| -> EmbedError {
            EmbedError::Unavailable(format!("cannot read {}: {err}", what.display()))
        };
        let config_path = files.config();
        let config_text =
            std::fs::read_to_string(&config_path).map_err(|e| unavailable(&config_path, &e))?;
        let config: Config =
            serde_json::from_str(&config_text).map_err(|e| unavailable(&config_path, &e))?;
        let device = Device::Cpu;
        let weights_path = files.weights();
        let tensors = candle_core::safetensors::load(&weights_path, &device)
            .map_err(|e| unavailable(&weights_path, &e))?;
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &device);
        let model = BertModel::load(vb, &config).map_err(|e| unavailable(&weights_path, &e))?;
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
            dims: config.hidden_size,
            pool,
        })
    }

    /// The tokenizer the model reads with.
    pub fn word_pieces(&self) -> &WordPieces {
        &self.pieces
    }

    /// The mean-pooled (not normalised) output for each input, each a list of word-piece ids
    /// with its special tokens, run in batches of [`BATCH`] on the embedder's threads.
    pub fn mean_pooled(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EmbedError> {
        self.mean_pooled_in_batches(inputs, BATCH)
    }

    /// [`Contextual::mean_pooled`] with `batch` texts per forward pass.
    pub fn mean_pooled_in_batches(
        &self,
        inputs: &[Vec<u32>],
        batch: usize,
    ) -> Result<Vec<Vec<f32>>, EmbedError> {
        let mut order: Vec<usize> = (0..inputs.len()).collect();
        order.sort_by_key(|&i| inputs[i].len());
        let mut out = vec![Vec::new(); inputs.len()];
        self.on_threads(|| {
            for chunk in order.chunks(batch.max(1)) {
                let batch: Vec<&[u32]> = chunk.iter().map(|&i| inputs[i].as_slice()).collect();
                for (&i, vector) in chunk.iter().zip(self.forward(&batch)?) {
                    out[i] = vector;
                }
            }
            Ok::<(), EmbedError>(())
        })?;
        Ok(out)
    }

    fn on_threads<R: Send>(&self, work: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(work),
            None => work(),
        }
    }

    /// One forward pass over texts padded to the longest, mean pooled over the mask.
    fn forward(&self, batch: &[&[u32]]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let rows = batch.len();
        let width = batch.iter().map(|ids| ids.len()).max().unwrap_or(0);
        if rows == 0 || width == 0 {
            return Ok(vec![vec![0.0; self.dims]; rows]);
        }
        let mut ids = vec![0u32; rows * width];
        let mut mask = vec![0u32; rows * width];
        for (row, input) in batch.iter().enumerate() {
            ids[row * width..row * width + input.len()].copy_from_slice(input);
            mask[row * width..row * width + input.len()].fill(1);
        }
        let device = Device::Cpu;
        let ids = Tensor::from_vec(ids, (rows, width), &device).map_err(failed)?;
        let mask = Tensor::from_vec(mask, (rows, width), &device).map_err(failed)?;
        let types = ids.zeros_like().map_err(failed)?;
        let hidden = self
            .model
            .forward(&ids, &types, Some(&mask))
            .map_err(failed)?;
        let pooled = (|| {
            let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
            let sum = hidden.broadcast_mul(&mask)?.sum(1)?;
            let count = mask.sum(1)?;
            sum.broadcast_div(&count)?.to_vec2::<f32>()
        })();
        pooled.map_err(failed)
    }
}

impl Embed for Contextual {
    fn id(&self) -> &str {
        CONTEXTUAL_ID
    }

    fn dims(&self) -> usize {
        self.dims
    }

    /// An empty text is `[CLS] [SEP]`, embedded as the model embeds it (as
    /// sentence-transformers does), so its vector is not zero.
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let inputs = texts
            .iter()
            .map(|text| self.pieces.model_input(text, MAX_PIECES))
            .collect::<Result<Vec<_>, _>>()?;
        let mut vectors = self.mean_pooled(&inputs)?;
        for vector in &mut vectors {
            normalize(vector);
        }
        Ok(vectors)
    }
}
