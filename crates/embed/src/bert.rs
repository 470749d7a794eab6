//! all-MiniLM-L6-v2's forward pass written out for one text at a time: BERT's six layers, the
//! matrix products on the fastest kernel this CPU runs ([`crate::products`]: int8 or bf16
//! weights) and the activations, sums, softmax and layer norms in f32. The pass is plain code
//! inlined into copies compiled for AVX-512 or AVX2 (`simd::step`), with an `exp` of its own so
//! that GELU and softmax vectorise.
//!
//! Each layer is two steps (the projections to queries, keys and values; then the attention
//! and the rest of the layer), each step two halves of the rows, which [`crate::team`] lets a
//! second thread share: a pass offered to the request that waits for it
//! ([`Bert::mean_pooled_assisted`]) splits its rows evenly; one nobody is offered keeps them all
//! in the first half. A row's sums are the same whichever half or thread computes them, so the
//! vector is the same to the bit.
//!
//! One text at a time needs no padding and no attention mask. Self-attention lays a head's keys
//! out by dimension and takes four queries at a time, so its sums stay in registers. Each pass
//! takes its scratch from a small pool (`Scratch`): a question's buffers are over the
//! allocator's threshold for a mapping of their own, so fresh ones were mapped, faulted in and
//! unmapped every time.
//!
//! `embed_cost` on a 2-core Xeon with AVX-512 VNNI and no AMX: a 12-word question 1.16 ms, a
//! 22-word one (loadbench's length) 2.14 ms, a 40-word message 3.52 ms (4.38 / 8.40 / 16.24 ms
//! on `vdpbf16ps` on the same machine, before the int8 kernel, the attention's rewrite and the
//! pooled scratch); on the AMX machine of the previous figures, 1.47 ms and 4.84 ms for 12 and
//! 40 words with bf16 tiles. The products are about half of it.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use crate::EmbedError;
pub use crate::products::{Kernel, Precision};
use crate::products::{Packed, Workspace, bf16, from_bf16};
use crate::team::{Assist, Help, Team};
use crate::vector::{dot, max, sum};

/// The model's shape, from its `config.json`.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Shape {
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
}

fn default_eps() -> f64 {
    1e-12
}

struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

impl LayerNorm {
    #[inline(always)]
    fn apply(&self, x: &mut [f32], eps: f32, centred: &mut Vec<f32>) {
        let d = self.weight.len();
        centred.clear();
        centred.resize(d, 0.0);
        for row in x.chunks_exact_mut(d) {
            let mean = sum(row) / d as f32;
            for (c, v) in centred.iter_mut().zip(row.iter()) {
                *c = v - mean;
            }
            let var = dot(centred, centred) / d as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
                *v = (*v - mean) * inv * w + b;
            }
        }
    }
}

struct Layer {
    qkv: Packed,
    attention_out: Packed,
    attention_norm: LayerNorm,
    intermediate: Packed,
    output: Packed,
    output_norm: LayerNorm,
}

/// The model: embeddings (word rows as bf16) and the layers.
pub struct Bert {
    shape: Shape,
    words: Vec<u16>,
    positions: Vec<f32>,
    token_type: Vec<f32>,
    embedding_norm: LayerNorm,
    layers: Vec<Layer>,
    scratch: Mutex<Vec<Scratch>>,
}

impl std::fmt::Debug for Bert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bert")
            .field("layers", &self.layers.len())
            .field("hidden", &self.shape.hidden_size)
            .finish_non_exhaustive()
    }
}

/// The rows of one half of a pass (the first `split` word pieces, or the rest) and the buffers
/// only they use.
#[derive(Default)]
struct Rows {
    x: Vec<f32>,
    qkv: Vec<f32>,
    context: Vec<f32>,
    projected: Vec<f32>,
    wide: Vec<f32>,
}

/// What each thread in a pass has of its own.
#[derive(Default)]
struct Own {
    work: Workspace,
    scores: Vec<f32>,
    centred: Vec<f32>,
}

/// Every row's keys and values, which the attention of either half reads: a dimension's keys
/// side by side (`keys[c * padded + row]`, each dimension padded with zeros to a multiple of
/// 16 rows) and the values row by row.
#[derive(Default)]
struct KeysValues {
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// Scratch space of one forward pass, pooled in [`Bert`] so that a pass allocates nothing
/// (the buffers of a 25-piece question are up to 150 KiB, over the allocator's threshold for
/// a mapping of its own, so each would be mapped, faulted in page by page and unmapped).
#[derive(Default)]
struct Scratch {
    halves: [Rows; 2],
    kv: KeysValues,
    own: Own,
    partner: Own,
}

/// One pass in two halves of rows ([`team`](crate::team)): the rows' buffers behind locks,
/// so that a partner thread may run the second half of a step while the lead runs the first.
/// Each lock is taken by one thread at a time (a step's halves touch their own rows, and the
/// keys and values are written only between the attention that reads them).
struct Halves {
    ids: Vec<u32>,
    /// Where the second half's rows begin.
    split: usize,
    /// The rows' count rounded up to a multiple of 16 (the keys' layout).
    padded: usize,
    rows: [Mutex<Rows>; 2],
    kv: RwLock<KeysValues>,
    partner: Mutex<Own>,
    team: Team,
}

fn locked<T>(lock: &Mutex<T>) -> MutexGuard<'_, T> {
    lock.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Halves {
    /// The halves of a pass over `ids`: a pass on offer splits the rows evenly, since its
    /// halves may run at once; a pass run alone keeps them all in the first half (the second
    /// is empty, never stepped), so that each product reads its weights once, as one product
    /// of every row.
    fn new(ids: &[u32], h: usize, offered: bool, s: Scratch) -> (Halves, Own) {
        let n = ids.len();
        let split = if offered { n.div_ceil(2) } else { n };
        let padded = n.div_ceil(16) * 16;
        let Scratch {
            halves: [mut first, mut second],
            mut kv,
            own,
            partner,
        } = s;
        // A half with no rows is never stepped: nothing of a last pass's may stay in it.
        first.x.clear();
        second.x.clear();
        kv.keys.clear();
        kv.keys.resize(h * padded, 0.0);
        kv.values.clear();
        kv.values.resize(n * h, 0.0);
        let halves = Halves {
            ids: ids.to_vec(),
            split,
            padded,
            rows: [Mutex::new(first), Mutex::new(second)],
            kv: RwLock::new(kv),
            partner: Mutex::new(partner),
            team: Team::default(),
        };
        (halves, own)
    }

    /// The first row and the count of rows of `half`.
    fn rows(&self, half: usize) -> (usize, usize) {
        match half {
            0 => (0, self.split),
            _ => (self.split, self.ids.len() - self.split),
        }
    }

    /// The buffers back, for the next pass (a partner still holding the pass finds them empty).
    fn into_scratch(self: &Halves, own: Own) -> Scratch {
        let take = |half: usize| std::mem::take(&mut *locked(&self.rows[half]));
        Scratch {
            halves: [take(0), take(1)],
            kv: std::mem::take(&mut *self.kv.write().unwrap_or_else(PoisonError::into_inner)),
            own,
            // A partner that has not yet seen the pass finished keeps its own (not waited for).
            partner: match self.partner.try_lock() {
                Ok(mut own) => std::mem::take(&mut *own),
                Err(_) => Own::default(),
            },
        }
    }
}

/// A pass on offer to a partner ([`crate::team::Help`]).
struct Partner {
    bert: Arc<Bert>,
    halves: Arc<Halves>,
}

impl Help for Partner {
    /// One partner at a time: a second finds the partner's scratch taken and leaves at once.
    fn help(&self) -> usize {
        let Ok(mut own) = self.halves.partner.try_lock() else {
            return 0;
        };
        self.halves.team.follow(|step, half| {
            self.bert.run_step(&self.halves, step, half, &mut own);
        })
    }
}

/// Scratch spaces kept for reuse: at most this many (one per thread that embeds at once in a
/// sidecar: the background's one thread and a request's question)…
const SCRATCH_KEPT: usize = 2;
/// …and only those last used for at most this many word pieces (about 1.1–1.3 MiB each by the
/// buffers' sizes, at most twice that as they grew by doubling), so a long message's scratch is
/// not kept.
const SCRATCH_PIECES: usize = 64;

impl Bert {
    /// Reads the weights from `safetensors` bytes (the model's `model.safetensors`).
    /// The products run on the fastest kernel this CPU runs at `precision`.
    pub fn from_safetensors(
        bytes: &[u8],
        shape: Shape,
        precision: Precision,
    ) -> Result<Bert, EmbedError> {
        let tensors = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| EmbedError::Unavailable(format!("model.safetensors: {e}")))?;
        let get = |name: &str, len: usize| -> Result<Vec<f32>, EmbedError> {
            let view = tensors
                .tensor(name)
                .map_err(|e| EmbedError::Unavailable(format!("model.safetensors: {name}: {e}")))?;
            if view.dtype() != safetensors::Dtype::F32 || view.data().len() != len * 4 {
                return Err(EmbedError::Unavailable(format!(
                    "model.safetensors: {name} is not {len} f32 values"
                )));
            }
            Ok(view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect())
        };
        let (h, i) = (shape.hidden_size, shape.intermediate_size);
        if shape.num_attention_heads == 0
            || !h.is_multiple_of(shape.num_attention_heads)
            || !(h / shape.num_attention_heads).is_multiple_of(16)
            || shape.vocab_size == 0
            || shape.max_position_embeddings == 0
        {
            return Err(EmbedError::Unavailable(format!(
                "config.json: {h} dimensions over {} heads (a multiple of 16 each), {} words, {} positions is not a model this pass reads",
                shape.num_attention_heads, shape.vocab_size, shape.max_position_embeddings
            )));
        }
        let norm = |prefix: &str| -> Result<LayerNorm, EmbedError> {
            Ok(LayerNorm {
                weight: get(&format!("{prefix}.weight"), h)?,
                bias: get(&format!("{prefix}.bias"), h)?,
            })
        };
        let words = get("embeddings.word_embeddings.weight", shape.vocab_size * h)?
            .into_iter()
            .map(bf16)
            .collect();
        let positions = get(
            "embeddings.position_embeddings.weight",
            shape.max_position_embeddings * h,
        )?;
        let token_type = get("embeddings.token_type_embeddings.weight", 2 * h)?;
        let embedding_norm = norm("embeddings.LayerNorm")?;
        let mut layers = Vec::with_capacity(shape.num_hidden_layers);
        for l in 0..shape.num_hidden_layers {
            let p = format!("encoder.layer.{l}");
            let mut qkv_w = Vec::with_capacity(3 * h * h);
            let mut qkv_b = Vec::with_capacity(3 * h);
            for part in ["query", "key", "value"] {
                qkv_w.extend(get(&format!("{p}.attention.self.{part}.weight"), h * h)?);
                qkv_b.extend(get(&format!("{p}.attention.self.{part}.bias"), h)?);
            }
            layers.push(Layer {
                qkv: Packed::new(&qkv_w, qkv_b, 3 * h, h, precision)?,
                attention_out: Packed::new(
                    &get(&format!("{p}.attention.output.dense.weight"), h * h)?,
                    get(&format!("{p}.attention.output.dense.bias"), h)?,
                    h,
                    h,
                    precision,
                )?,
                attention_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                intermediate: Packed::new(
                    &get(&format!("{p}.intermediate.dense.weight"), i * h)?,
                    get(&format!("{p}.intermediate.dense.bias"), i)?,
                    i,
                    h,
                    precision,
                )?,
                output: Packed::new(
                    &get(&format!("{p}.output.dense.weight"), h * i)?,
                    get(&format!("{p}.output.dense.bias"), h)?,
                    h,
                    i,
                    precision,
                )?,
                output_norm: norm(&format!("{p}.output.LayerNorm"))?,
            });
        }
        Ok(Bert {
            shape,
            words,
            positions,
            token_type,
            embedding_norm,
            layers,
            scratch: Mutex::default(),
        })
    }

    /// The width of the output.
    pub fn dims(&self) -> usize {
        self.shape.hidden_size
    }

    /// The most word pieces one pass reads.
    pub fn max_pieces(&self) -> usize {
        self.shape.max_position_embeddings
    }

    /// The mean over the pieces of the last layer's output for `ids` (the word-piece ids with
    /// `[CLS]` and `[SEP]`; at most [`Bert::max_pieces`], more are cut). Not normalised.
    pub fn mean_pooled(&self, ids: &[u32]) -> Vec<f32> {
        let ids = &ids[..ids.len().min(self.max_pieces())];
        let (halves, mut own) = Halves::new(ids, self.dims(), false, self.take_scratch());
        let pooled = self.pass(&halves, &mut own);
        self.keep_scratch(halves.into_scratch(own), ids.len());
        pooled
    }

    /// [`Bert::mean_pooled`], with the pass offered to a thread that waits for it
    /// ([`Assist::help`]): that thread runs the second half of the rows of each step it
    /// joins. The same vector, to the bit, whoever runs which half.
    pub fn mean_pooled_assisted(self: &Arc<Self>, ids: &[u32], assist: &Assist) -> Vec<f32> {
        let ids = &ids[..ids.len().min(self.max_pieces())];
        let (halves, mut own) = Halves::new(ids, self.dims(), true, self.take_scratch());
        let halves = Arc::new(halves);
        assist.offer(Arc::new(Partner {
            bert: Arc::clone(self),
            halves: Arc::clone(&halves),
        }));
        let pooled = self.pass(&halves, &mut own);
        self.keep_scratch(halves.into_scratch(own), ids.len());
        pooled
    }

    /// The pass: every layer in two steps (the projections to queries, keys and values; then
    /// the attention and the rest of the layer), each step in two halves of the rows, which
    /// [`Team::lead`] runs here or offers to a partner; then the mean.
    fn pass(&self, halves: &Halves, own: &mut Own) -> Vec<f32> {
        let h = self.dims();
        let n = halves.ids.len();
        // No steps for no pieces, but led all the same: a partner is told the pass is done.
        let steps = if n == 0 { 0 } else { 2 * self.layers.len() };
        halves.team.lead(steps, |step, half| {
            self.run_step(halves, step, half, own);
        });
        if n == 0 {
            return vec![0.0; h];
        }
        let mut pooled = vec![0.0f32; h];
        for half in &halves.rows {
            for row in locked(half).x.chunks_exact(h) {
                for (p, v) in pooled.iter_mut().zip(row) {
                    *p += v;
                }
            }
        }
        for p in &mut pooled {
            *p /= n as f32;
        }
        pooled
    }

    /// [`Bert::step`] compiled for the widest vectors the CPU has.
    fn run_step(&self, halves: &Halves, step: usize, half: usize, own: &mut Own) {
        #[cfg(target_arch = "x86_64")]
        simd::step(self, halves, step, half, own);
        #[cfg(not(target_arch = "x86_64"))]
        self.step(halves, step, half, own);
    }

    /// One half of one step: for an even step, the layer's projections of the half's rows
    /// (after their embeddings, for the first layer); for an odd one, the rest of the layer.
    /// Inlined into copies compiled for wider vectors (`simd::step`): the activations,
    /// softmax, GELU and layer norms are loops over slices that the compiler vectorises to
    /// the target's width.
    #[inline(always)]
    fn step(&self, halves: &Halves, step: usize, half: usize, own: &mut Own) {
        let (first, count) = halves.rows(half);
        if count == 0 {
            return;
        }
        let layer = &self.layers[step / 2];
        let mut rows = locked(&halves.rows[half]);
        if step % 2 == 1 {
            return self.rest_of_layer(layer, halves, count, &mut rows, own);
        }
        let h = self.dims();
        if step == 0 {
            self.embeddings(&halves.ids[first..first + count], first, &mut rows.x, own);
        }
        let Rows { x, qkv, .. } = &mut *rows;
        layer.qkv.apply(x, count, qkv, &mut own.work);
        let mut kv = halves.kv.write().unwrap_or_else(PoisonError::into_inner);
        let KeysValues { keys, values } = &mut *kv;
        for (j, row) in qkv.chunks_exact(3 * h).enumerate() {
            let at = first + j;
            for (c, &k) in row[h..2 * h].iter().enumerate() {
                keys[c * halves.padded + at] = k;
            }
            values[at * h..(at + 1) * h].copy_from_slice(&row[2 * h..]);
        }
    }

    /// The rows of the pieces `ids`, which begin at position `first`, into `x`, normalised.
    #[inline(always)]
    fn embeddings(&self, ids: &[u32], first: usize, x: &mut Vec<f32>, own: &mut Own) {
        let h = self.dims();
        x.clear();
        x.resize(ids.len() * h, 0.0);
        for (t, (&id, row)) in ids.iter().zip(x.chunks_exact_mut(h)).enumerate() {
            let id = (id as usize).min(self.shape.vocab_size - 1);
            let word = &self.words[id * h..(id + 1) * h];
            let position = &self.positions[(first + t) * h..(first + t + 1) * h];
            for (j, v) in row.iter_mut().enumerate() {
                *v = from_bf16(word[j]) + position[j] + self.token_type[j];
            }
        }
        self.embedding_norm.apply(x, self.eps(), &mut own.centred);
    }

    fn eps(&self) -> f32 {
        self.shape.layer_norm_eps as f32
    }

    /// The pool's lock (a pass that panicked holding it left nothing half done in it).
    fn kept(&self) -> MutexGuard<'_, Vec<Scratch>> {
        self.scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn take_scratch(&self) -> Scratch {
        self.kept().pop().unwrap_or_default()
    }

    /// Keeps `s`, just used for `n` word pieces, for the next pass, unless the pool is full or
    /// the text was long.
    fn keep_scratch(&self, s: Scratch, n: usize) {
        if n > SCRATCH_PIECES {
            return;
        }
        let mut kept = self.kept();
        if kept.len() < SCRATCH_KEPT {
            kept.push(s);
        }
    }

    /// The kernel of the products (for logs).
    pub fn kernel(&self) -> Kernel {
        self.layers
            .first()
            .map_or(Kernel::best(), |layer| layer.qkv.kernel())
    }

    /// The attention of the half's `count` rows over every row's keys and values, then the
    /// rest of the layer for them.
    #[inline(always)]
    fn rest_of_layer(
        &self,
        layer: &Layer,
        halves: &Halves,
        count: usize,
        rows: &mut Rows,
        own: &mut Own,
    ) {
        let eps = self.eps();
        {
            let kv = halves.kv.read().unwrap_or_else(PoisonError::into_inner);
            let n = halves.ids.len();
            self.attention(
                &rows.qkv,
                count,
                n,
                halves.padded,
                &kv,
                own,
                &mut rows.context,
            );
        }
        let Rows {
            x,
            context,
            projected,
            wide,
            ..
        } = rows;
        layer
            .attention_out
            .apply(context, count, projected, &mut own.work);
        for (v, a) in x.iter_mut().zip(projected.iter()) {
            *v += a;
        }
        layer.attention_norm.apply(x, eps, &mut own.centred);
        layer.intermediate.apply(x, count, wide, &mut own.work);
        for v in wide.iter_mut() {
            *v = gelu(*v);
        }
        layer.output.apply(wide, count, projected, &mut own.work);
        for (v, a) in x.iter_mut().zip(projected.iter()) {
            *v += a;
        }
        layer.output_norm.apply(x, eps, &mut own.centred);
    }

    /// Self-attention of the `count` rows of `qkv` (each row a query, a key and a value of
    /// `h`; the queries are what is read) over all `n` rows' keys and values in `kv`, into
    /// `context`. The keys are laid out by dimension, each dimension's `n` values padded to
    /// `padded` with zeros, so that scores against 16 keys are whole-vector multiply-adds;
    /// probabilities then weigh the values 16 dimensions at a time (a head's width is a
    /// multiple of 16, checked at load). Four queries go together, so each load of keys or
    /// values meets four sums held in registers.
    #[allow(clippy::too_many_arguments)] // One call, the step's buffers spelled out.
    #[inline(always)]
    fn attention(
        &self,
        qkv: &[f32],
        count: usize,
        n: usize,
        padded: usize,
        kv: &KeysValues,
        own: &mut Own,
        context: &mut Vec<f32>,
    ) {
        const CHUNK: usize = 16;
        const GROUP: usize = 4;
        let h = self.shape.hidden_size;
        let heads = self.shape.num_attention_heads;
        let d = h / heads;
        let scale = 1.0 / (d as f32).sqrt();
        context.clear();
        context.resize(count * h, 0.0);
        let scores = &mut own.scores;
        scores.clear();
        scores.resize(GROUP * padded, 0.0);
        for hd in 0..heads {
            let keys = &kv.keys[hd * d * padded..(hd + 1) * d * padded];
            for first in (0..count).step_by(GROUP) {
                // Past the last query, the group repeats it (and drops what it computes).
                let queries: [&[f32]; GROUP] = std::array::from_fn(|r| {
                    let at = (first + r).min(count - 1) * 3 * h + hd * d;
                    &qkv[at..at + d]
                });
                for c in 0..padded / CHUNK {
                    let mut acc = [[0.0f32; CHUNK]; GROUP];
                    for (dd, key) in keys.chunks_exact(padded).enumerate() {
                        let key = &key[c * CHUNK..(c + 1) * CHUNK];
                        for (sums, q) in acc.iter_mut().zip(&queries) {
                            let qv = q[dd] * scale;
                            for (a, k) in sums.iter_mut().zip(key) {
                                *a += qv * k;
                            }
                        }
                    }
                    for (r, sums) in acc.iter().enumerate() {
                        scores[r * padded + c * CHUNK..r * padded + (c + 1) * CHUNK]
                            .copy_from_slice(sums);
                    }
                }
                for row in scores.chunks_exact_mut(padded) {
                    let scores = &mut row[..n];
                    let max = max(scores);
                    for score in scores.iter_mut() {
                        *score = exp(*score - max);
                    }
                    let inverse = 1.0 / sum(scores);
                    for score in scores.iter_mut() {
                        *score *= inverse;
                    }
                }
                for c in 0..d / CHUNK {
                    let at = hd * d + c * CHUNK;
                    let mut acc = [[0.0f32; CHUNK]; GROUP];
                    for (j, row) in kv.values.chunks_exact(h).enumerate() {
                        let value = &row[at..at + CHUNK];
                        for (r, sums) in acc.iter_mut().enumerate() {
                            let p = scores[r * padded + j];
                            for (a, v) in sums.iter_mut().zip(value) {
                                *a += p * v;
                            }
                        }
                    }
                    for (r, sums) in acc.iter().enumerate().take(count - first) {
                        let to = (first + r) * h + hd * d + c * CHUNK;
                        context[to..to + CHUNK].copy_from_slice(sums);
                    }
                }
            }
        }
    }
}

/// GELU as BERT computes it: `x · Φ(x)`, with erf from Abramowitz and Stegun 7.1.26
/// (absolute error under 1.5e-7).
#[inline(always)]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

#[inline(always)]
fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
    (1.0 - poly * exp(-a * a)).copysign(x)
}

/// e^x in plain f32 arithmetic, with no call, so that the loops over GELU's and softmax's
/// slices vectorise (a call to libm's `expf` per value kept them scalar): x = k·ln 2 + r with
/// |r| ≤ ln 2 / 2 (ln 2 in two parts, Cody and Waite's), e^r by its Taylor polynomial to
/// degree 7 (relative error under 1e-8 before rounding), 2^k put into the exponent. Inputs
/// are clamped to −87..88, where 2^k stays a normal number.
#[inline(always)]
fn exp(x: f32) -> f32 {
    // Adding 1.5 · 2²³ rounds to an integer (the sum has no bits below the unit).
    const ROUND: f32 = 12_582_912.0;
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let rounded = x * std::f32::consts::LOG2_E + ROUND;
    let k = rounded - ROUND;
    let r = x - k * LN2_HIGH - k * LN2_LOW;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // k itself is in the low bits of `rounded` (its bits are ROUND's plus k), so 2^k is had
    // with integer arithmetic alone (a float-to-integer cast saturates, which does not
    // vectorise as well).
    let two_to_k = rounded
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127)
        << 23;
    p * f32::from_bits(two_to_k)
}

/// The pass compiled for wider vectors: with `products::simd` and `vector::wide` the crate's
/// only unsafe code, functions compiled for CPU features and called only once the check beside
/// the call found them.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use super::{Bert, Halves, Own};

    /// One half of a step ([`Bert::step`]) compiled for AVX-512 or for AVX2 and FMA, whichever
    /// the CPU has (16 or 8 lanes a vector instead of SSE2's 4), else as built.
    pub(super) fn step(bert: &Bert, halves: &Halves, step: usize, half: usize, own: &mut Own) {
        if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA; the body is safe code.
            unsafe { step_avx512(bert, halves, step, half, own) }
        } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA; the body is safe code.
            unsafe { step_avx2(bert, halves, step, half, own) }
        } else {
            bert.step(halves, step, half, own);
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    fn step_avx512(bert: &Bert, halves: &Halves, step: usize, half: usize, own: &mut Own) {
        bert.step(halves, step, half, own);
    }

    #[target_feature(enable = "avx2,fma")]
    fn step_avx2(bert: &Bert, halves: &Halves, step: usize, half: usize, own: &mut Own) {
        bert.step(halves, step, half, own);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_units_in_the_last_place_of_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            assert!(
                ((got - want) / want).abs() < 4e-7,
                "exp({x}) = {got}, libm {want}"
            );
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1e-37 && exp(-1000.0) >= 0.0);
    }

    #[test]
    fn erf_matches_known_values() {
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_9),
            (1.0, 0.842_700_8),
            (-2.0, -0.995_322_3),
        ] {
            assert!((erf(x) - want).abs() < 1e-6, "erf({x}) = {}", erf(x));
        }
    }
}
