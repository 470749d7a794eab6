//! all-MiniLM-L6-v2's forward pass written out for one text at a time: BERT's six layers with
//! the weights of every matrix product held as bfloat16 (half the memory of f32) and the
//! activations, sums, softmax and layer norms in f32. On a CPU with AVX-512 BF16 the products
//! run on `vdpbf16ps` (two multiply-adds per lane per instruction, no reductions: the weights
//! are packed so a broadcast pair of inputs meets sixteen outputs' pairs of weights); elsewhere
//! on the same layout in f32 arithmetic, compiled for AVX2 and FMA where the CPU has them
//! ([`Kernel`]).
//!
//! One text at a time needs no padding and no attention mask. On the project's machine a
//! 12-word question takes 4.4 ms and a 40-word message 15.6 ms (candle's batched pass, which
//! this replaced: 11–16 ms for a 10- to 15-piece question); the products are about 60% of it in
//! a `perf` profile, attention, GELU and layer norms most of the rest.

use crate::EmbedError;

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

/// Lanes of one packed block: the outputs one AVX-512 register holds.
const LANES: usize = 16;
/// Output blocks computed together (64 outputs).
const BLOCKS: usize = 4;
/// Input rows computed together.
const ROWS: usize = 4;

/// A weight matrix `n × k` (PyTorch's `out × in`) packed for the products: for each block of
/// 16 outputs, for each pair of inputs, the 16 outputs' two weights side by side, as bf16.
struct Packed {
    n: usize,
    k: usize,
    data: Vec<u16>,
    bias: Vec<f32>,
}

/// `x` rounded to the nearest bfloat16, ties to even (a NaN may come out as another NaN or an
/// infinity; the model has none).
fn bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

fn from_bf16(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

impl Packed {
    /// Packs row-major `weights` (`n × k`); `n` a multiple of 64, `k` even.
    fn new(weights: &[f32], bias: Vec<f32>, n: usize, k: usize) -> Result<Packed, EmbedError> {
        if !n.is_multiple_of(LANES * BLOCKS)
            || !k.is_multiple_of(2)
            || weights.len() != n * k
            || bias.len() != n
        {
            return Err(EmbedError::Unavailable(format!(
                "a weight matrix of {n} × {k} ({} values, {} biases) is not this model's",
                weights.len(),
                bias.len()
            )));
        }
        let mut data = Vec::with_capacity(n * k);
        for block in 0..n / LANES {
            for pair in 0..k / 2 {
                for lane in 0..LANES {
                    let row = (block * LANES + lane) * k;
                    data.push(bf16(weights[row + 2 * pair]));
                    data.push(bf16(weights[row + 2 * pair + 1]));
                }
            }
        }
        Ok(Packed { n, k, data, bias })
    }

    /// `out[m][..n] = x[m][..k] · Wᵀ + b` for the `rows` rows of `x`.
    fn apply(&self, x: &[f32], rows: usize, out: &mut Vec<f32>) {
        out.clear();
        out.resize(rows * self.n, 0.0);
        // The inputs as bf16 pairs (one u32 each), as the products read them.
        let pairs: Vec<u32> = x
            .chunks_exact(2)
            .map(|p| u32::from(bf16(p[0])) | (u32::from(bf16(p[1])) << 16))
            .collect();
        self.products(Kernel::best(), &pairs, rows, out);
        self.add_bias(out);
    }

    /// The products alone (no bias) with `kernel`, which must be available.
    fn products(&self, kernel: Kernel, pairs: &[u32], rows: usize, out: &mut [f32]) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => simd::bf16_products(self, pairs, rows, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => simd::fma_products(self, pairs, rows, out),
            _ => portable::products::<false>(self, pairs, rows, out),
        }
    }

    fn add_bias(&self, out: &mut [f32]) {
        for row in out.chunks_exact_mut(self.n) {
            for (o, b) in row.iter_mut().zip(&self.bias) {
                *o += b;
            }
        }
    }
}

/// Which code computes the matrix products, the fastest the CPU has (chosen once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 BF16's `vdpbf16ps`: 32 multiply-adds an instruction.
    Avx512Bf16,
    /// AVX2 and FMA: the bf16 weights widened to f32, 8 multiply-adds an instruction.
    Avx2Fma,
    /// Plain arithmetic, as the compiler vectorises it for the target.
    Plain,
}

impl Kernel {
    /// The fastest kernel this CPU runs.
    pub fn best() -> Kernel {
        use std::sync::OnceLock;
        static BEST: OnceLock<Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            [Kernel::Avx512Bf16, Kernel::Avx2Fma]
                .into_iter()
                .find(|k| k.available())
                .unwrap_or(Kernel::Plain)
        })
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => {
                std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
            Kernel::Plain => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Its name, for logs and the README's figures.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Avx512Bf16 => "avx512-bf16",
            Kernel::Avx2Fma => "avx2-fma",
            Kernel::Plain => "plain",
        }
    }
}

mod portable {
    use super::{LANES, Packed, from_bf16};

    /// The products in f32 from the packed bf16 weights, block by block; with `FMA` each
    /// step a fused multiply-add (only where the CPU has it: elsewhere `mul_add` is a call).
    #[inline(always)]
    pub(super) fn products<const FMA: bool>(
        w: &Packed,
        pairs: &[u32],
        rows: usize,
        out: &mut [f32],
    ) {
        let half = w.k / 2;
        let block_len = half * LANES * 2;
        for (block, packed) in w.data.chunks_exact(block_len).enumerate() {
            for m in 0..rows {
                let mut acc = [0.0f32; LANES];
                let x = &pairs[m * half..(m + 1) * half];
                for (p, lanes) in packed.chunks_exact(LANES * 2).enumerate() {
                    let (x0, x1) = (from_bf16(x[p] as u16), from_bf16((x[p] >> 16) as u16));
                    for (a, ws) in acc.iter_mut().zip(lanes.chunks_exact(2)) {
                        let (w0, w1) = (from_bf16(ws[0]), from_bf16(ws[1]));
                        *a = if FMA {
                            x1.mul_add(w1, x0.mul_add(w0, *a))
                        } else {
                            *a + x0 * w0 + x1 * w1
                        };
                    }
                }
                out[m * w.n + block * LANES..m * w.n + (block + 1) * LANES].copy_from_slice(&acc);
            }
        }
    }
}

/// The products on x86-64's vector extensions. The crate's only unsafe code: functions
/// compiled for CPU features, called only once [`Kernel::available`] found them, and
/// intrinsics on indices inside slices whose lengths are checked first.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::x86_64::*;

    use super::{BLOCKS, Kernel, LANES, Packed, ROWS, portable};

    /// [`portable::products`] compiled for AVX2 and FMA.
    pub(super) fn fma_products(w: &Packed, pairs: &[u32], rows: usize, out: &mut [f32]) {
        assert!(Kernel::Avx2Fma.available());
        // SAFETY: the CPU has the features; the body is safe code.
        unsafe { fma_body(w, pairs, rows, out) }
    }

    #[target_feature(enable = "avx2,fma")]
    fn fma_body(w: &Packed, pairs: &[u32], rows: usize, out: &mut [f32]) {
        portable::products::<true>(w, pairs, rows, out);
    }

    /// The products on `vdpbf16ps`: 4 rows × 64 outputs at a time in 16 accumulators.
    pub(super) fn bf16_products(w: &Packed, pairs: &[u32], rows: usize, out: &mut [f32]) {
        let half = w.k / 2;
        assert!(Kernel::Avx512Bf16.available());
        assert!(pairs.len() >= rows * half && out.len() >= rows * w.n);
        assert!(w.data.len() == w.n * w.k && w.n.is_multiple_of(LANES * BLOCKS));
        // SAFETY: the CPU has the features (checked above), and every index `blocks` reads
        // or writes is inside the slices whose lengths were checked above.
        unsafe { blocks(w, pairs, rows, out) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn blocks(w: &Packed, pairs: &[u32], rows: usize, out: &mut [f32]) {
        let half = w.k / 2;
        let block_len = half * LANES * 2;
        for group in 0..w.n / (LANES * BLOCKS) {
            let mut m = 0;
            while m < rows {
                let take = (rows - m).min(ROWS);
                // SAFETY: every index is inside `pairs`, `w.data` and `out` by construction.
                unsafe {
                    match take {
                        4 => tile::<4>(w, pairs, m, group, half, block_len, out),
                        3 => tile::<3>(w, pairs, m, group, half, block_len, out),
                        2 => tile::<2>(w, pairs, m, group, half, block_len, out),
                        _ => tile::<1>(w, pairs, m, group, half, block_len, out),
                    }
                }
                m += take;
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    unsafe fn tile<const R: usize>(
        w: &Packed,
        pairs: &[u32],
        m: usize,
        group: usize,
        half: usize,
        block_len: usize,
        out: &mut [f32],
    ) {
        // SAFETY: the caller checked the features and the slices' lengths.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); BLOCKS]; R];
            let base = w.data.as_ptr().add(group * BLOCKS * block_len);
            let x = pairs.as_ptr().add(m * half);
            for p in 0..half {
                let mut ws = [_mm512_setzero_si512(); BLOCKS];
                for (b, wv) in ws.iter_mut().enumerate() {
                    *wv = _mm512_loadu_si512(base.add(b * block_len + p * LANES * 2).cast());
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let xv = _mm512_set1_epi32(*x.add(r * half + p) as i32);
                    for (a, wv) in row.iter_mut().zip(&ws) {
                        *a = _mm512_dpbf16_ps(
                            *a,
                            std::mem::transmute::<__m512i, __m512bh>(xv),
                            std::mem::transmute::<__m512i, __m512bh>(*wv),
                        );
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                let dst = out.as_mut_ptr().add((m + r) * w.n + group * BLOCKS * LANES);
                for (b, a) in row.iter().enumerate() {
                    _mm512_storeu_ps(dst.add(b * LANES), *a);
                }
            }
        }
    }
}

struct LayerNorm {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

impl LayerNorm {
    fn apply(&self, x: &mut [f32], eps: f32) {
        let d = self.weight.len();
        for row in x.chunks_exact_mut(d) {
            let mean = row.iter().sum::<f32>() / d as f32;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
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
}

impl std::fmt::Debug for Bert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bert")
            .field("layers", &self.layers.len())
            .field("hidden", &self.shape.hidden_size)
            .finish_non_exhaustive()
    }
}

/// Scratch space of one forward pass.
#[derive(Default)]
struct Scratch {
    qkv: Vec<f32>,
    context: Vec<f32>,
    projected: Vec<f32>,
    wide: Vec<f32>,
    scores: Vec<f32>,
}

impl Bert {
    /// Reads the weights from `safetensors` bytes (the model's `model.safetensors`).
    pub fn from_safetensors(bytes: &[u8], shape: Shape) -> Result<Bert, EmbedError> {
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
            || shape.vocab_size == 0
            || shape.max_position_embeddings == 0
        {
            return Err(EmbedError::Unavailable(format!(
                "config.json: {h} dimensions over {} heads, {} words, {} positions is not a model this pass reads",
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
                qkv: Packed::new(&qkv_w, qkv_b, 3 * h, h)?,
                attention_out: Packed::new(
                    &get(&format!("{p}.attention.output.dense.weight"), h * h)?,
                    get(&format!("{p}.attention.output.dense.bias"), h)?,
                    h,
                    h,
                )?,
                attention_norm: norm(&format!("{p}.attention.output.LayerNorm"))?,
                intermediate: Packed::new(
                    &get(&format!("{p}.intermediate.dense.weight"), i * h)?,
                    get(&format!("{p}.intermediate.dense.bias"), i)?,
                    i,
                    h,
                )?,
                output: Packed::new(
                    &get(&format!("{p}.output.dense.weight"), h * i)?,
                    get(&format!("{p}.output.dense.bias"), h)?,
                    h,
                    i,
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
        let h = self.shape.hidden_size;
        let ids = &ids[..ids.len().min(self.max_pieces())];
        let n = ids.len();
        if n == 0 {
            return vec![0.0; h];
        }
        let eps = self.shape.layer_norm_eps as f32;
        let mut x = vec![0.0f32; n * h];
        for (t, (&id, row)) in ids.iter().zip(x.chunks_exact_mut(h)).enumerate() {
            let id = (id as usize).min(self.shape.vocab_size - 1);
            let word = &self.words[id * h..(id + 1) * h];
            let position = &self.positions[t * h..(t + 1) * h];
            for (j, v) in row.iter_mut().enumerate() {
                *v = from_bf16(word[j]) + position[j] + self.token_type[j];
            }
        }
        self.embedding_norm.apply(&mut x, eps);
        let mut s = Scratch::default();
        for layer in &self.layers {
            self.layer(layer, &mut x, n, eps, &mut s);
        }
        let mut pooled = vec![0.0f32; h];
        for row in x.chunks_exact(h) {
            for (p, v) in pooled.iter_mut().zip(row) {
                *p += v;
            }
        }
        for p in &mut pooled {
            *p /= n as f32;
        }
        pooled
    }

    fn layer(&self, layer: &Layer, x: &mut [f32], n: usize, eps: f32, s: &mut Scratch) {
        let h = self.shape.hidden_size;
        let heads = self.shape.num_attention_heads;
        let d = h / heads;
        let scale = 1.0 / (d as f32).sqrt();
        layer.qkv.apply(x, n, &mut s.qkv);
        s.context.clear();
        s.context.resize(n * h, 0.0);
        s.scores.resize(n, 0.0);
        let q_at = |t: usize, hd: usize| t * 3 * h + hd * d;
        for hd in 0..heads {
            for i in 0..n {
                let q = &s.qkv[q_at(i, hd)..q_at(i, hd) + d];
                let mut max = f32::NEG_INFINITY;
                for (j, score) in s.scores.iter_mut().enumerate() {
                    let k = &s.qkv[q_at(j, hd) + h..q_at(j, hd) + h + d];
                    *score = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(*score);
                }
                let mut total = 0.0;
                for score in s.scores.iter_mut() {
                    *score = (*score - max).exp();
                    total += *score;
                }
                let out = &mut s.context[i * h + hd * d..i * h + (hd + 1) * d];
                for (j, score) in s.scores.iter().enumerate() {
                    let p = score / total;
                    let v = &s.qkv[q_at(j, hd) + 2 * h..q_at(j, hd) + 2 * h + d];
                    for (o, v) in out.iter_mut().zip(v) {
                        *o += p * v;
                    }
                }
            }
        }
        layer.attention_out.apply(&s.context, n, &mut s.projected);
        for (v, a) in x.iter_mut().zip(&s.projected) {
            *v += a;
        }
        layer.attention_norm.apply(x, eps);
        layer.intermediate.apply(x, n, &mut s.wide);
        for v in s.wide.iter_mut() {
            *v = gelu(*v);
        }
        layer.output.apply(&s.wide, n, &mut s.projected);
        for (v, a) in x.iter_mut().zip(&s.projected) {
            *v += a;
        }
        layer.output_norm.apply(x, eps);
    }
}

/// GELU as BERT computes it: `x · Φ(x)`, with erf from Abramowitz and Stegun 7.1.26
/// (absolute error under 1.5e-7).
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

fn erf(x: f32) -> f32 {
    let sign = x.signum();
    let x = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * x);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
    sign * (1.0 - poly * (-x * x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn bf16_rounds_to_nearest_ties_to_even() {
        assert_eq!(bf16(1.0), 0x3f80);
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: to the even one, 1.
        assert_eq!(bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // A hair above halfway: up.
        assert_eq!(bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        // 1 + 3·2⁻⁸ is halfway between 0x3f81 and 0x3f82: to the even one.
        assert_eq!(bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(from_bf16(bf16(-2.5)), -2.5);
        assert!((from_bf16(bf16(0.1)) - 0.1).abs() < 0.001);
    }

    /// Every kernel this CPU runs agrees with a plain f32 product of the bf16-rounded values,
    /// rows past a multiple of four included.
    #[test]
    fn every_kernel_matches_a_plain_product() {
        let (n, k) = (128, 96);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let b: Vec<f32> = (0..n).map(|i| i as f32 / 10.0).collect();
        let packed = Packed::new(&w, b.clone(), n, k).unwrap();
        let kernels = [Kernel::Avx512Bf16, Kernel::Avx2Fma, Kernel::Plain];
        for rows in [1, 4, 7] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
                .collect();
            let pairs: Vec<u32> = x
                .chunks_exact(2)
                .map(|p| u32::from(bf16(p[0])) | (u32::from(bf16(p[1])) << 16))
                .collect();
            let mut through_apply = Vec::new();
            packed.apply(&x, rows, &mut through_apply);
            let mut outs = vec![through_apply];
            for kernel in kernels.into_iter().filter(|k| k.available()) {
                let mut out = vec![0.0; rows * n];
                packed.products(kernel, &pairs, rows, &mut out);
                packed.add_bias(&mut out);
                outs.push(out);
            }
            for m in 0..rows {
                for j in 0..n {
                    let want: f32 = (0..k)
                        .map(|i| from_bf16(bf16(x[m * k + i])) * from_bf16(bf16(w[j * k + i])))
                        .sum::<f32>()
                        + b[j];
                    for out in &outs {
                        let got = out[m * n + j];
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "{rows} rows, {m},{j}: {got} vs {want}"
                        );
                    }
                }
            }
        }
        assert!(Kernel::best().available());
    }
}
