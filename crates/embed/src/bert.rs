//! all-MiniLM-L6-v2's forward pass written out for one text at a time: BERT's six layers with
//! the weights of every matrix product held as bfloat16 (half the memory of f32) and the
//! activations, sums, softmax and layer norms in f32. The products run on the best of
//! [`Kernel`]: AMX tiles where the CPU has AMX-BF16 (`tdpbf16ps`, 16 rows × 16 outputs × 32
//! inputs an instruction; the weights are packed so that a block of them is already a tile),
//! else AVX-512 BF16's `vdpbf16ps` (two multiply-adds per lane per instruction, no reductions:
//! a broadcast pair of inputs meets sixteen outputs' pairs of weights), else the same layout in
//! f32 arithmetic, compiled for AVX2 and FMA where the CPU has them. The rest of the pass is
//! plain code inlined into copies compiled for AVX-512 or AVX2 (`simd::pass`), with an `exp`
//! of its own so that GELU and softmax vectorise.
//!
//! One text at a time needs no padding and no attention mask. On the project's machine (AMX) a
//! 12-word question takes about 1.5 ms and a 40-word message about 5 ms (`embed_cost`; 4.4 and
//! 15.6 ms on `vdpbf16ps` with the rest in SSE2, 19 and 38.5 ms with candle's batched pass,
//! which this replaced). The products are just under half of it in a `perf` profile.

use crate::EmbedError;
use crate::vector::{dot, sum};

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
        self.products(Kernel::best_for(self.k), &x[..rows * self.k], rows, out);
        self.add_bias(out);
    }

    /// The products alone (no bias) with `kernel`, which must be available.
    fn products(&self, kernel: Kernel, x: &[f32], rows: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if kernel == Kernel::Amx {
            return simd::amx_products(self, x, rows, out);
        }
        // The inputs as bf16 pairs (one u32 each), as the other kernels read them.
        let pairs: Vec<u32> = x
            .chunks_exact(2)
            .map(|p| u32::from(bf16(p[0])) | (u32::from(bf16(p[1])) << 16))
            .collect();
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => simd::bf16_products(self, &pairs, rows, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => simd::fma_products(self, &pairs, rows, out),
            _ => portable::products::<false>(self, &pairs, rows, out),
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
    /// AMX (Advanced Matrix Extensions) tiles: `tdpbf16ps` multiplies 16 rows by 16 outputs
    /// over 32 inputs (8,192 multiply-adds) an instruction, and each weight is read once per
    /// 16 rows of input. Needs AMX-BF16 and Linux's leave to use the tiles.
    Amx,
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
        *BEST.get_or_init(|| match Kernel::Amx.available() {
            true => Kernel::Amx,
            false => Kernel::best_without_tiles(),
        })
    }

    /// The fastest kernel this CPU runs other than AMX's tiles.
    fn best_without_tiles() -> Kernel {
        [Kernel::Avx512Bf16, Kernel::Avx2Fma]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Kernel::Plain)
    }

    /// The fastest kernel this CPU runs for a matrix `k` inputs wide: AMX's tiles take 32
    /// inputs at a time, so a width that is not a multiple of 32 takes the next best.
    fn best_for(k: usize) -> Kernel {
        match Kernel::best() {
            Kernel::Amx if !k.is_multiple_of(32) => Kernel::best_without_tiles(),
            best => best,
        }
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        match self {
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            Kernel::Amx => simd::amx_permitted(),
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
            Kernel::Amx => "amx-bf16",
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

/// The products on x86-64's vector extensions and AMX tiles, and the pass compiled for wider
/// vectors. With `vector::wide` the crate's only unsafe code: functions compiled for CPU
/// features, called only once [`Kernel::available`] (or the feature check beside the call)
/// found them; intrinsics and tile loads and stores on indices inside slices whose lengths are
/// checked first; one `arch_prctl` call.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{BLOCKS, Kernel, LANES, Packed, ROWS, bf16, portable};

    /// The forward pass ([`super::Bert::pass`]) compiled for AVX-512 or for AVX2 and FMA,
    /// whichever the CPU has (16 or 8 lanes a vector instead of SSE2's 4), else as built.
    pub(super) fn pass(bert: &super::Bert, ids: &[u32]) -> Vec<f32> {
        if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA; the body is safe code.
            unsafe { pass_avx512(bert, ids) }
        } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has AVX2 and FMA; the body is safe code.
            unsafe { pass_avx2(bert, ids) }
        } else {
            bert.pass(ids)
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    fn pass_avx512(bert: &super::Bert, ids: &[u32]) -> Vec<f32> {
        bert.pass(ids)
    }

    #[target_feature(enable = "avx2,fma")]
    fn pass_avx2(bert: &super::Bert, ids: &[u32]) -> Vec<f32> {
        bert.pass(ids)
    }

    /// Whether the CPU has AMX-BF16 and Linux lets this process use the tiles: their 8 KiB
    /// of state is saved only for processes that ask (`arch_prctl(ARCH_REQ_XCOMP_PERM)`),
    /// and a tile instruction without that leave is a SIGILL. Asked once, process-wide.
    #[cfg(target_os = "linux")]
    pub(super) fn amx_permitted() -> bool {
        use std::sync::OnceLock;
        static PERMITTED: OnceLock<bool> = OnceLock::new();
        *PERMITTED.get_or_init(|| {
            // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
            let leaf = __cpuid_count(7, 0);
            if leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: arch_prctl with these arguments only changes which state the kernel
            // saves for this process; it reads and writes no memory of ours.
            unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                ) == 0
            }
        })
    }

    /// The tile configuration: palette 1, tiles 0–7 each 16 rows of 64 bytes (16 f32 outputs,
    /// or 16 bf16 pairs).
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    impl TileConfig {
        fn rows_of_64_bytes() -> TileConfig {
            let mut c = [0u8; 64];
            c[0] = 1;
            for t in 0..8 {
                c[16 + 2 * t] = 64;
                c[48 + t] = 16;
            }
            TileConfig(c)
        }
    }

    /// Bytes of one tile: 16 rows of 64.
    const TILE: usize = 1024;

    /// The products on AMX tiles, 16 rows of `x` at a time. Each 16 rows are laid out as the
    /// A tiles read them (for each 32 inputs, the 16 rows' bf16 pairs side by side); the packed
    /// weights are already B tiles (16 pairs of inputs × 16 outputs, 64 bytes a pair). Rows
    /// past the end are zeros and their outputs are dropped.
    pub(super) fn amx_products(w: &Packed, x: &[f32], rows: usize, out: &mut [f32]) {
        assert!(Kernel::Amx.available());
        assert!(w.k.is_multiple_of(32) && w.n.is_multiple_of(LANES));
        assert!(w.data.len() == w.n * w.k && x.len() >= rows * w.k && out.len() >= rows * w.n);
        let chunks = w.k / 32;
        // One A tile per 32 inputs: 16 rows × 16 pairs.
        let mut a = vec![0u32; chunks * TILE / 4];
        let mut c = vec![0f32; 16 * w.n];
        let config = TileConfig::rows_of_64_bytes();
        // SAFETY: the CPU has AMX and Linux's leave (checked above); the config is 64 bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
        for m0 in (0..rows).step_by(16) {
            let take = (rows - m0).min(16);
            if take < 16 {
                a.fill(0);
            }
            for r in 0..take {
                let row = &x[(m0 + r) * w.k..(m0 + r + 1) * w.k];
                for (chunk, inputs) in row.chunks_exact(32).enumerate() {
                    let at = chunk * TILE / 4 + r * 16;
                    for (slot, p) in a[at..at + 16].iter_mut().zip(inputs.chunks_exact(2)) {
                        *slot = u32::from(bf16(p[0])) | (u32::from(bf16(p[1])) << 16);
                    }
                }
            }
            // SAFETY: `a` holds `chunks` A tiles, `w.data` `chunks` B tiles per block of 16
            // outputs (checked above), `c` 16 rows of `w.n` outputs.
            unsafe { amx_rows(w, &a, chunks, &mut c) };
            for r in 0..take {
                out[(m0 + r) * w.n..(m0 + r + 1) * w.n].copy_from_slice(&c[r * w.n..(r + 1) * w.n]);
            }
        }
        // SAFETY: as above; releases the tiles configured above.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// One input tile's step for three blocks of outputs: A tile `$a` loaded from `{a}`, and
    /// each block's B tile from `{w0}`, `{w1}`, `{w2}` (all `$offset` bytes on), multiplied
    /// into tiles 0–2.
    macro_rules! three_blocks {
        ($a:literal, $offset:literal) => {
            concat!(
                "tileloadd ",
                $a,
                ", [{a} + {s}*1 + ",
                $offset,
                "]\n",
                "tileloadd tmm5, [{w0} + {s}*1 + ",
                $offset,
                "]\n",
                "tdpbf16ps tmm0, ",
                $a,
                ", tmm5\n",
                "tileloadd tmm6, [{w1} + {s}*1 + ",
                $offset,
                "]\n",
                "tdpbf16ps tmm1, ",
                $a,
                ", tmm6\n",
                "tileloadd tmm7, [{w2} + {s}*1 + ",
                $offset,
                "]\n",
                "tdpbf16ps tmm2, ",
                $a,
                ", tmm7",
            )
        };
    }

    /// `c` (16 rows × `w.n`) = the A tiles of `a` × the weights, three blocks of 16 outputs
    /// at a time (tiles 0–2), two A tiles alternating (3 and 4) and one B tile per block (5–7),
    /// so a tile is loaded while the others multiply.
    ///
    /// # Safety
    ///
    /// The tiles are configured ([`TileConfig::rows_of_64_bytes`]); `a` holds `chunks` tiles,
    /// `w.data` `chunks` tiles per block and `c` 16 × `w.n` values.
    unsafe fn amx_rows(w: &Packed, a: &[u32], chunks: usize, c: &mut [f32]) {
        let blocks = w.n / LANES;
        let block_bytes = chunks * TILE;
        let a = a.as_ptr().cast::<u8>();
        let weights = w.data.as_ptr().cast::<u8>();
        let stride = 64usize;
        let c_stride = w.n * 4;
        let mut b = 0;
        // SAFETY (every block below): each load reads one tile inside `a` or inside block `b`
        // (or `b + 1`, `b + 2`) of `w.data`, each store writes 16 rows of 16 values inside `c`.
        unsafe {
            while b + 3 <= blocks {
                let w0 = weights.add(b * block_bytes);
                let w1 = weights.add((b + 1) * block_bytes);
                let w2 = weights.add((b + 2) * block_bytes);
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    options(nostack, nomem)
                );
                let mut kc = 0;
                while kc + 2 <= chunks {
                    let at = kc * TILE;
                    asm!(
                        three_blocks!("tmm3", "0"),
                        three_blocks!("tmm4", "1024"),
                        a = in(reg) a.add(at),
                        w0 = in(reg) w0.add(at),
                        w1 = in(reg) w1.add(at),
                        w2 = in(reg) w2.add(at),
                        s = in(reg) stride,
                        options(nostack, readonly),
                    );
                    kc += 2;
                }
                if kc < chunks {
                    let at = kc * TILE;
                    asm!(
                        three_blocks!("tmm3", "0"),
                        a = in(reg) a.add(at),
                        w0 = in(reg) w0.add(at),
                        w1 = in(reg) w1.add(at),
                        w2 = in(reg) w2.add(at),
                        s = in(reg) stride,
                        options(nostack, readonly),
                    );
                }
                let o = c.as_mut_ptr().add(b * LANES);
                asm!(
                    "tilestored [{o0} + {s}*1], tmm0",
                    "tilestored [{o1} + {s}*1], tmm1",
                    "tilestored [{o2} + {s}*1], tmm2",
                    o0 = in(reg) o,
                    o1 = in(reg) o.add(LANES),
                    o2 = in(reg) o.add(2 * LANES),
                    s = in(reg) c_stride,
                    options(nostack),
                );
                b += 3;
            }
            while b < blocks {
                let w0 = weights.add(b * block_bytes);
                asm!("tilezero tmm0", options(nostack, nomem));
                for kc in 0..chunks {
                    let at = kc * TILE;
                    asm!(
                        "tileloadd tmm3, [{a} + {s}*1]",
                        "tileloadd tmm5, [{w0} + {s}*1]",
                        "tdpbf16ps tmm0, tmm3, tmm5",
                        a = in(reg) a.add(at),
                        w0 = in(reg) w0.add(at),
                        s = in(reg) stride,
                        options(nostack, readonly),
                    );
                }
                asm!(
                    "tilestored [{o} + {s}*1], tmm0",
                    o = in(reg) c.as_mut_ptr().add(b * LANES),
                    s = in(reg) c_stride,
                    options(nostack),
                );
                b += 1;
            }
        }
    }

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
    #[inline(always)]
    fn apply(&self, x: &mut [f32], eps: f32) {
        let d = self.weight.len();
        let mut centred = vec![0.0f32; d];
        for row in x.chunks_exact_mut(d) {
            let mean = sum(row) / d as f32;
            for (c, v) in centred.iter_mut().zip(row.iter()) {
                *c = v - mean;
            }
            let var = dot(&centred, &centred) / d as f32;
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
        #[cfg(target_arch = "x86_64")]
        return simd::pass(self, ids);
        #[cfg(not(target_arch = "x86_64"))]
        self.pass(ids)
    }

    /// [`Bert::mean_pooled`]'s pass, inlined into copies compiled for wider vectors
    /// (`simd::pass`): the activations, softmax, GELU and layer norms are loops over slices
    /// that the compiler vectorises to the target's width.
    #[inline(always)]
    fn pass(&self, ids: &[u32]) -> Vec<f32> {
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

    #[inline(always)]
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
                for (j, score) in s.scores.iter_mut().enumerate() {
                    let k = &s.qkv[q_at(j, hd) + h..q_at(j, hd) + h + d];
                    *score = dot(q, k) * scale;
                }
                let max = s.scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for score in s.scores.iter_mut() {
                    *score = exp(*score - max);
                }
                let total = sum(&s.scores);
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
    /// rows past a multiple of four and of sixteen included.
    #[test]
    fn every_kernel_matches_a_plain_product() {
        let (n, k) = (128, 96);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let b: Vec<f32> = (0..n).map(|i| i as f32 / 10.0).collect();
        let packed = Packed::new(&w, b.clone(), n, k).unwrap();
        let kernels = [
            Kernel::Amx,
            Kernel::Avx512Bf16,
            Kernel::Avx2Fma,
            Kernel::Plain,
        ];
        // AMX: 16 rows a tile; 8 blocks of outputs are two groups of three and two alone;
        // 96 inputs are a pair of tiles and one alone.
        for rows in [1, 4, 7, 16, 17, 33] {
            let x: Vec<f32> = (0..rows * k)
                .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
                .collect();
            let mut through_apply = Vec::new();
            packed.apply(&x, rows, &mut through_apply);
            let mut outs = vec![through_apply];
            for kernel in kernels.into_iter().filter(|k| k.available()) {
                let mut out = vec![0.0; rows * n];
                packed.products(kernel, &x, rows, &mut out);
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
