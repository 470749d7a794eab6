//! The matrix products of the contextual model's pass (`x · Wᵀ + b` for a few rows of
//! activations at a time), with the weights packed once at load for the fastest [`Kernel`]
//! this CPU runs:
//!
//! - **AMX tiles** where the CPU has AMX-BF16 (`tdpbf16ps`, 16 rows × 16 outputs × 32 inputs
//!   an instruction; the bf16 weights are packed so that a block of them is already a tile);
//! - **AVX-512 VNNI** (`vpdpbusd`, 64 multiply-adds of bytes an instruction, 7.5 times
//!   `vdpbf16ps`'s rate here): the weights as int8 with a scale per output, the activations
//!   quantized to bytes per row as they come, with a scale and a zero point ([`Int8`]);
//! - **AVX-512 BF16**'s `vdpbf16ps` (a broadcast pair of inputs meets sixteen outputs' pairs of
//!   weights), else the same bf16 layout widened to f32, compiled for AVX2 and FMA, else plain.
//!
//! All of them lay a matrix out the same way: for each block of 16 outputs, for each group of
//! inputs (a pair of bf16 or four int8, 4 bytes), the 16 outputs' weights side by side (64
//! bytes), so that a group of inputs broadcast to 16 lanes meets a block in one instruction.

use crate::EmbedError;

/// Lanes of one packed block: the outputs one AVX-512 register holds.
const LANES: usize = 16;
/// Output blocks computed together (64 outputs).
const BLOCKS: usize = 4;
/// Input rows computed together by `vdpbf16ps`.
const ROWS: usize = 4;
/// Input rows computed together by `vpdpbusd` (24 accumulators and 4 blocks of weights).
const INT8_ROWS: usize = 6;

/// A weight matrix `n × k` (PyTorch's `out × in`) and its bias, packed for one kernel.
pub(crate) struct Packed {
    kernel: Kernel,
    weights: Weights,
    bias: Vec<f32>,
}

enum Weights {
    Bf16(Bf16),
    Int8(Int8),
}

/// The weights as bf16: for each block of 16 outputs, for each pair of inputs, the 16 outputs'
/// two weights side by side.
struct Bf16 {
    n: usize,
    k: usize,
    data: Vec<u16>,
}

/// The weights as int8, each output's scaled to ±127 by its own scale (`scales[j]`, the
/// largest magnitude over 127); for each block of 16 outputs, for each four inputs, the 16
/// outputs' four weights side by side. `vpdpbusd` multiplies unsigned bytes by signed ones:
/// the activations are the unsigned side, each row quantized to 0..=255 with a scale `s` and
/// a zero point `z` ([`QuantizedRows`]), so a product is `scales[j] · s · (Σ q · w − z · Σ w)`
/// with each output's `Σ w` kept in `sums`.
struct Int8 {
    n: usize,
    k: usize,
    data: Vec<i8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
}

/// `x` rounded to the nearest bfloat16, ties to even (a NaN may come out as another NaN or an
/// infinity; the model has none).
pub(crate) fn bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

pub(crate) fn from_bf16(x: u16) -> f32 {
    f32::from_bits(u32::from(x) << 16)
}

impl Packed {
    /// Packs row-major `weights` (`n × k`, `n` a multiple of 64, `k` of 4) for the fastest
    /// kernel this CPU runs at this width; with `precision` [`Precision::Bf16`], the fastest
    /// with bf16 weights.
    pub(crate) fn new(
        weights: &[f32],
        bias: Vec<f32>,
        n: usize,
        k: usize,
        precision: Precision,
    ) -> Result<Packed, EmbedError> {
        Packed::for_kernel(Kernel::best_for(k, precision), weights, bias, n, k)
    }

    fn for_kernel(
        kernel: Kernel,
        weights: &[f32],
        bias: Vec<f32>,
        n: usize,
        k: usize,
    ) -> Result<Packed, EmbedError> {
        if !n.is_multiple_of(LANES * BLOCKS)
            || !k.is_multiple_of(4)
            || weights.len() != n * k
            || bias.len() != n
        {
            return Err(EmbedError::Unavailable(format!(
                "a weight matrix of {n} × {k} ({} values, {} biases) is not this model's",
                weights.len(),
                bias.len()
            )));
        }
        let weights = match kernel {
            Kernel::Avx512Vnni => Weights::Int8(Int8::new(weights, n, k)),
            _ => Weights::Bf16(Bf16::new(weights, n, k)),
        };
        Ok(Packed {
            kernel,
            weights,
            bias,
        })
    }

    /// The kernel the weights were packed for.
    pub(crate) fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Outputs.
    pub(crate) fn n(&self) -> usize {
        match &self.weights {
            Weights::Bf16(w) => w.n,
            Weights::Int8(w) => w.n,
        }
    }

    /// Inputs.
    pub(crate) fn k(&self) -> usize {
        match &self.weights {
            Weights::Bf16(w) => w.k,
            Weights::Int8(w) => w.k,
        }
    }

    /// `out[m][..n] = x[m][..k] · Wᵀ + b` for the `rows` rows of `x`, with `work` for the
    /// inputs in the kernel's form.
    #[inline(always)]
    pub(crate) fn apply(&self, x: &[f32], rows: usize, out: &mut Vec<f32>, work: &mut Workspace) {
        out.clear();
        out.resize(rows * self.n(), 0.0);
        self.products(&x[..rows * self.k()], rows, out, work);
        self.add_bias(out);
    }

    /// The products alone (no bias), with the kernel the weights were packed for.
    #[inline(always)]
    fn products(&self, x: &[f32], rows: usize, out: &mut [f32], work: &mut Workspace) {
        let w = match &self.weights {
            Weights::Int8(w) => return w.products(x, rows, out, &mut work.quantized),
            Weights::Bf16(w) => w,
        };
        #[cfg(target_arch = "x86_64")]
        if self.kernel == Kernel::Amx {
            return simd::amx_products(w, x, rows, out);
        }
        // The inputs as bf16 pairs (one u32 each), as the other kernels read them.
        let pairs = &mut work.pairs;
        pairs.clear();
        pairs.extend(
            x.chunks_exact(2)
                .map(|p| u32::from(bf16(p[0])) | (u32::from(bf16(p[1])) << 16)),
        );
        match self.kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => simd::bf16_products(w, pairs, rows, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2Fma => simd::fma_products(w, pairs, rows, out),
            _ => portable::products::<false>(w, pairs, rows, out),
        }
    }

    #[inline(always)]
    fn add_bias(&self, out: &mut [f32]) {
        for row in out.chunks_exact_mut(self.n()) {
            for (o, b) in row.iter_mut().zip(&self.bias) {
                *o += b;
            }
        }
    }
}

impl Bf16 {
    fn new(weights: &[f32], n: usize, k: usize) -> Bf16 {
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
        Bf16 { n, k, data }
    }
}

impl Int8 {
    fn new(weights: &[f32], n: usize, k: usize) -> Int8 {
        let scales: Vec<f32> = weights
            .chunks_exact(k)
            .map(|row| {
                let largest = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                if largest > 0.0 { largest / 127.0 } else { 1.0 }
            })
            .collect();
        let quantized =
            |j: usize, i: usize| (weights[j * k + i] / scales[j]).round_ties_even() as i8;
        let sums = (0..n)
            .map(|j| (0..k).map(|i| i32::from(quantized(j, i))).sum())
            .collect();
        let mut data = Vec::with_capacity(n * k);
        for block in 0..n / LANES {
            for quad in 0..k / 4 {
                for lane in 0..LANES {
                    let j = block * LANES + lane;
                    data.extend((4 * quad..4 * quad + 4).map(|i| quantized(j, i)));
                }
            }
        }
        Int8 {
            n,
            k,
            data,
            scales,
            sums,
        }
    }

    /// The products for `rows` rows of `x`: each row quantized to bytes by its own scale and
    /// zero point, then multiplied on AVX-512 VNNI (the only kernel that packs int8).
    fn products(&self, x: &[f32], rows: usize, out: &mut [f32], q: &mut QuantizedRows) {
        #[cfg(target_arch = "x86_64")]
        if Kernel::Avx512Vnni.available() {
            simd::quantize_rows(q, x, rows, self.k);
            return simd::vnni_products(self, q, rows, out);
        }
        q.fill(x, rows, self.k);
        portable::int8_products(self, q, rows, out);
    }
}

/// The scale and zero point that map `lowest..=highest` (widened to hold 0) onto 0..=255:
/// `v ≈ scale · (q − zero)`. A row of zeros, or one whose range is too small for its scale's
/// inverse to be finite, has scale 1 and zero point 0 (its values round to 0).
#[inline(always)]
fn range_of(lowest: f32, highest: f32) -> (f32, i32) {
    let (lowest, highest) = (lowest.min(0.0), highest.max(0.0));
    let scale = (highest - lowest) / 255.0;
    if scale > 0.0 && (1.0 / scale).is_finite() {
        (scale, (-lowest / scale).round_ties_even() as i32)
    } else {
        (1.0, 0)
    }
}

/// Room for a product's inputs in the kernel's form, kept from one product to the next (and
/// from one pass to the next: [`crate::bert`] pools them) so that none is allocated per call.
#[derive(Default)]
pub(crate) struct Workspace {
    quantized: QuantizedRows,
    pairs: Vec<u32>,
}

/// Rows of activations quantized to bytes, each by its own scale and zero point
/// ([`range_of`]): `q = round(v / scale) + zero`, within 0..=255.
#[derive(Default)]
struct QuantizedRows {
    values: Vec<u8>,
    scales: Vec<f32>,
    zeros: Vec<i32>,
}

impl QuantizedRows {
    #[inline(always)]
    fn fill(&mut self, x: &[f32], rows: usize, k: usize) {
        self.values.clear();
        self.values.resize(rows * k, 0);
        self.scales.clear();
        self.zeros.clear();
        for (row, q) in x[..rows * k]
            .chunks_exact(k)
            .zip(self.values.chunks_exact_mut(k))
        {
            let lowest = row.iter().copied().fold(0.0f32, f32::min);
            let highest = row.iter().copied().fold(0.0f32, f32::max);
            let (scale, zero) = range_of(lowest, highest);
            let inverse = 1.0 / scale;
            for (q, v) in q.iter_mut().zip(row) {
                let value = (v * inverse).round_ties_even() as i32;
                *q = value.saturating_add(zero).clamp(0, 255) as u8;
            }
            self.scales.push(scale);
            self.zeros.push(zero);
        }
    }
}

/// How closely the products follow the model's f32 arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// The fastest kernel: int8 weights and activations where the CPU has AVX-512 VNNI and no
    /// AMX (within a cosine of 0.99 of f32, 0.999 for most texts; recall as with bf16).
    Fastest,
    /// bf16 weights, f32 sums (within a cosine of 0.9999 of f32): what the static table is
    /// distilled with on every machine (AMX, `vdpbf16ps` or f32 FMA sum in other orders, so
    /// the tables are close, not identical).
    Bf16,
}

/// Which code computes the matrix products, the fastest the CPU has (chosen once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AMX (Advanced Matrix Extensions) tiles: `tdpbf16ps` multiplies 16 rows by 16 outputs
    /// over 32 inputs (8,192 multiply-adds) an instruction, and each weight is read once per
    /// 16 rows of input. Needs AMX-BF16 and Linux's leave to use the tiles.
    Amx,
    /// AVX-512 VNNI's `vpdpbusd`: 64 multiply-adds of bytes an instruction, on int8 weights
    /// and activations ([`Int8`]).
    Avx512Vnni,
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
        [Kernel::Avx512Vnni, Kernel::Avx512Bf16, Kernel::Avx2Fma]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Kernel::Plain)
    }

    /// The fastest kernel this CPU runs for a matrix `k` inputs wide at `precision`: AMX's
    /// tiles take 32 inputs at a time, so a width that is not a multiple of 32 takes the next
    /// best.
    fn best_for(k: usize, precision: Precision) -> Kernel {
        if Kernel::best() == Kernel::Amx && k.is_multiple_of(32) {
            return Kernel::Amx;
        }
        match precision {
            Precision::Fastest => Kernel::best_without_tiles(),
            Precision::Bf16 => [Kernel::Avx512Bf16, Kernel::Avx2Fma]
                .into_iter()
                .find(|k| k.available())
                .unwrap_or(Kernel::Plain),
        }
    }

    /// Whether this CPU runs it.
    pub fn available(self) -> bool {
        match self {
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            Kernel::Amx => simd::amx_permitted(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
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
            Kernel::Avx512Vnni => "avx512-vnni",
            Kernel::Avx512Bf16 => "avx512-bf16",
            Kernel::Avx2Fma => "avx2-fma",
            Kernel::Plain => "plain",
        }
    }
}

mod portable {
    use super::{Bf16, Int8, LANES, QuantizedRows, from_bf16};

    /// The products in f32 from the packed bf16 weights, block by block; with `FMA` each
    /// step a fused multiply-add (only where the CPU has it: elsewhere `mul_add` is a call).
    #[inline(always)]
    pub(super) fn products<const FMA: bool>(w: &Bf16, pairs: &[u32], rows: usize, out: &mut [f32]) {
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

    /// The int8 products in plain integer arithmetic (where AVX-512 VNNI is missing: the
    /// weights are packed as int8 only for it, so this runs in tests and nowhere else).
    pub(super) fn int8_products(w: &Int8, x: &QuantizedRows, rows: usize, out: &mut [f32]) {
        let block_len = w.k * LANES;
        for (block, packed) in w.data.chunks_exact(block_len).enumerate() {
            for m in 0..rows {
                let mut acc = [0i32; LANES];
                let q = &x.values[m * w.k..(m + 1) * w.k];
                for (quad, lanes) in packed.chunks_exact(4 * LANES).enumerate() {
                    for (a, ws) in acc.iter_mut().zip(lanes.chunks_exact(4)) {
                        for (wb, qb) in ws.iter().zip(&q[4 * quad..4 * quad + 4]) {
                            *a += i32::from(*wb) * i32::from(*qb);
                        }
                    }
                }
                for (lane, a) in acc.iter().enumerate() {
                    let j = block * LANES + lane;
                    out[m * w.n + j] =
                        (a - x.zeros[m] * w.sums[j]) as f32 * (x.scales[m] * w.scales[j]);
                }
            }
        }
    }
}

/// The products on x86-64's vector extensions and AMX tiles. With `bert::simd` and
/// `vector::wide` the crate's only unsafe code: functions compiled for CPU features, called
/// only once [`Kernel::available`] found them; intrinsics and tile loads and stores on indices
/// inside slices whose lengths are checked first; one `arch_prctl` call.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod simd {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{
        BLOCKS, Bf16, INT8_ROWS, Int8, Kernel, LANES, QuantizedRows, ROWS, bf16, portable,
    };

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
    pub(super) fn amx_products(w: &Bf16, x: &[f32], rows: usize, out: &mut [f32]) {
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
    unsafe fn amx_rows(w: &Bf16, a: &[u32], chunks: usize, c: &mut [f32]) {
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

    /// [`QuantizedRows::fill`] compiled for AVX-512 (rounding is an instruction there, a call
    /// to libm's `rintf` in the baseline).
    pub(super) fn quantize_rows(q: &mut QuantizedRows, x: &[f32], rows: usize, k: usize) {
        assert!(Kernel::Avx512Vnni.available());
        // SAFETY: the CPU has AVX-512F and BW (checked above); the body is safe code.
        unsafe { quantize_rows_avx512(q, x, rows, k) }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    fn quantize_rows_avx512(q: &mut QuantizedRows, x: &[f32], rows: usize, k: usize) {
        if !k.is_multiple_of(LANES) {
            return q.fill(x, rows, k);
        }
        q.values.clear();
        q.values.resize(rows * k, 0);
        q.scales.clear();
        q.zeros.clear();
        for (row, values) in x[..rows * k]
            .chunks_exact(k)
            .zip(q.values.chunks_exact_mut(k))
        {
            // SAFETY: every load reads 16 values inside `row`, every store writes 16 bytes
            // inside `values` (both `k` long, a multiple of 16).
            unsafe {
                let (mut lowest, mut highest) = (_mm512_setzero_ps(), _mm512_setzero_ps());
                for chunk in row.chunks_exact(LANES) {
                    let v = _mm512_loadu_ps(chunk.as_ptr());
                    lowest = _mm512_min_ps(lowest, v);
                    highest = _mm512_max_ps(highest, v);
                }
                let (scale, zero) =
                    super::range_of(_mm512_reduce_min_ps(lowest), _mm512_reduce_max_ps(highest));
                let inverse = _mm512_set1_ps(1.0 / scale);
                let (zero_v, top) = (_mm512_set1_epi32(zero), _mm512_set1_epi32(255));
                for (chunk, out) in row.chunks_exact(LANES).zip(values.chunks_exact_mut(LANES)) {
                    // Rounded to nearest, ties to even (the default rounding mode).
                    let v =
                        _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(chunk.as_ptr()), inverse));
                    let v = _mm512_add_epi32(v, zero_v);
                    let v = _mm512_min_epi32(_mm512_max_epi32(v, _mm512_setzero_si512()), top);
                    _mm_storeu_si128(out.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(v));
                }
                q.scales.push(scale);
                q.zeros.push(zero);
            }
        }
    }

    /// The int8 products on `vpdpbusd`: 6 rows × 64 outputs at a time in 24 accumulators,
    /// each group of 64 outputs' weights read from the caches once per 6 rows.
    pub(super) fn vnni_products(w: &Int8, x: &QuantizedRows, rows: usize, out: &mut [f32]) {
        assert!(Kernel::Avx512Vnni.available());
        assert!(x.values.len() >= rows * w.k && x.scales.len() >= rows && x.zeros.len() >= rows);
        assert!(out.len() >= rows * w.n && w.data.len() == w.n * w.k);
        assert!(w.scales.len() == w.n && w.sums.len() == w.n);
        assert!(w.n.is_multiple_of(LANES * BLOCKS) && w.k.is_multiple_of(4));
        // SAFETY: the CPU has the features (checked above), and every index `vnni_blocks`
        // reads or writes is inside the slices whose lengths were checked above.
        unsafe { vnni_blocks(w, x, rows, out) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni_blocks(w: &Int8, x: &QuantizedRows, rows: usize, out: &mut [f32]) {
        let block_len = w.k * LANES;
        for group in 0..w.n / (LANES * BLOCKS) {
            let mut m = 0;
            while m < rows {
                let take = (rows - m).min(INT8_ROWS);
                // SAFETY: every index is inside `x`, `w` and `out` by construction.
                unsafe {
                    match take {
                        6 => vnni_tile::<6>(w, x, m, group, block_len, out),
                        5 => vnni_tile::<5>(w, x, m, group, block_len, out),
                        4 => vnni_tile::<4>(w, x, m, group, block_len, out),
                        3 => vnni_tile::<3>(w, x, m, group, block_len, out),
                        2 => vnni_tile::<2>(w, x, m, group, block_len, out),
                        _ => vnni_tile::<1>(w, x, m, group, block_len, out),
                    }
                }
                m += take;
            }
        }
    }

    /// Rows `m..m + R` × outputs `64·group..64·group + 64`: for each four inputs, the four
    /// blocks' weights loaded once and each row's four bytes broadcast to meet them; then the
    /// sums unscaled to f32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn vnni_tile<const R: usize>(
        w: &Int8,
        x: &QuantizedRows,
        m: usize,
        group: usize,
        block_len: usize,
        out: &mut [f32],
    ) {
        // SAFETY: the caller checked the features and the slices' lengths.
        unsafe {
            let mut acc = [[_mm512_setzero_si512(); BLOCKS]; R];
            let base = w.data.as_ptr().add(group * BLOCKS * block_len);
            let q = x.values.as_ptr().add(m * w.k);
            for quad in 0..w.k / 4 {
                let mut ws = [_mm512_setzero_si512(); BLOCKS];
                for (b, wv) in ws.iter_mut().enumerate() {
                    *wv = _mm512_loadu_si512(base.add(b * block_len + quad * 64).cast());
                }
                for (r, row) in acc.iter_mut().enumerate() {
                    let four = q.add(r * w.k + 4 * quad).cast::<i32>().read_unaligned();
                    let xv = _mm512_set1_epi32(four);
                    for (a, wv) in row.iter_mut().zip(&ws) {
                        *a = _mm512_dpbusd_epi32(*a, xv, *wv);
                    }
                }
            }
            let first = group * BLOCKS * LANES;
            for (r, row) in acc.iter().enumerate() {
                let zero = _mm512_set1_epi32(x.zeros[m + r]);
                let scale = _mm512_set1_ps(x.scales[m + r]);
                let dst = out.as_mut_ptr().add((m + r) * w.n + first);
                for (b, a) in row.iter().enumerate() {
                    let scales = _mm512_loadu_ps(w.scales.as_ptr().add(first + b * LANES));
                    let sums = _mm512_loadu_si512(w.sums.as_ptr().add(first + b * LANES).cast());
                    let offset = _mm512_mullo_epi32(zero, sums);
                    let sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(*a, offset));
                    _mm512_storeu_ps(
                        dst.add(b * LANES),
                        _mm512_mul_ps(sum, _mm512_mul_ps(scale, scales)),
                    );
                }
            }
        }
    }

    /// [`portable::products`] compiled for AVX2 and FMA.
    pub(super) fn fma_products(w: &Bf16, pairs: &[u32], rows: usize, out: &mut [f32]) {
        assert!(Kernel::Avx2Fma.available());
        // SAFETY: the CPU has the features; the body is safe code.
        unsafe { fma_body(w, pairs, rows, out) }
    }

    #[target_feature(enable = "avx2,fma")]
    fn fma_body(w: &Bf16, pairs: &[u32], rows: usize, out: &mut [f32]) {
        portable::products::<true>(w, pairs, rows, out);
    }

    /// The products on `vdpbf16ps`: 4 rows × 64 outputs at a time in 16 accumulators.
    pub(super) fn bf16_products(w: &Bf16, pairs: &[u32], rows: usize, out: &mut [f32]) {
        let half = w.k / 2;
        assert!(Kernel::Avx512Bf16.available());
        assert!(pairs.len() >= rows * half && out.len() >= rows * w.n);
        assert!(w.data.len() == w.n * w.k && w.n.is_multiple_of(LANES * BLOCKS));
        // SAFETY: the CPU has the features (checked above), and every index `blocks` reads
        // or writes is inside the slices whose lengths were checked above.
        unsafe { blocks(w, pairs, rows, out) }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn blocks(w: &Bf16, pairs: &[u32], rows: usize, out: &mut [f32]) {
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
        w: &Bf16,
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
#[cfg(test)]
mod tests {
    use super::*;

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

    /// A matrix of 128 outputs × 96 inputs, its bias, and `rows` rows of input.
    fn example(rows: usize) -> (usize, usize, Vec<f32>, Vec<f32>, Vec<f32>) {
        let (n, k) = (128, 96);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let b: Vec<f32> = (0..n).map(|i| i as f32 / 10.0).collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
            .collect();
        (n, k, w, b, x)
    }

    /// Rows past a multiple of four, of six (every tile of 1 to 6 rows) and of sixteen.
    const ROW_COUNTS: [usize; 9] = [1, 2, 4, 6, 7, 8, 16, 17, 33];

    /// Every bf16 kernel this CPU runs agrees with a plain f32 product of the bf16-rounded
    /// values.
    #[test]
    fn every_bf16_kernel_matches_a_plain_product() {
        let kernels = [
            Kernel::Amx,
            Kernel::Avx512Bf16,
            Kernel::Avx2Fma,
            Kernel::Plain,
        ];
        // AMX: 16 rows a tile; 8 blocks of outputs are two groups of three and two alone;
        // 96 inputs are a pair of tiles and one alone.
        for rows in ROW_COUNTS {
            let (n, k, w, b, x) = example(rows);
            let mut outs = Vec::new();
            for kernel in kernels.into_iter().filter(|k| k.available()) {
                let packed = Packed::for_kernel(kernel, &w, b.clone(), n, k).unwrap();
                let mut out = Vec::new();
                packed.apply(&x, rows, &mut out, &mut Workspace::default());
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
    }

    /// AVX-512 VNNI's products equal the plain integer ones exactly (the same sums, unscaled
    /// in the same order), and both are within the quantization's error of the f32 product.
    /// (Where the CPU lacks VNNI, `apply` runs the plain products too, so only the second half
    /// tests anything there.)
    #[test]
    fn int8_products_match_plain_integers_and_stay_near_f32() {
        for rows in ROW_COUNTS {
            let (n, k, w, b, x) = example(rows);
            let packed = Packed::for_kernel(Kernel::Avx512Vnni, &w, b.clone(), n, k).unwrap();
            let Weights::Int8(int8) = &packed.weights else {
                panic!("packed as int8")
            };
            let mut q = QuantizedRows::default();
            q.fill(&x, rows, k);
            let mut plain = vec![0.0; rows * n];
            portable::int8_products(int8, &q, rows, &mut plain);
            let mut out = Vec::new();
            packed.apply(&x, rows, &mut out, &mut Workspace::default());
            for m in 0..rows {
                let largest_x = x[m * k..(m + 1) * k]
                    .iter()
                    .fold(0f32, |a, v| a.max(v.abs()));
                for j in 0..n {
                    assert_eq!(
                        out[m * n + j],
                        plain[m * n + j] + b[j],
                        "{rows} rows, {m},{j}"
                    );
                    let want: f32 = (0..k).map(|i| x[m * k + i] * w[j * k + i]).sum::<f32>();
                    let largest_w = w[j * k..(j + 1) * k]
                        .iter()
                        .fold(0f32, |a, v| a.max(v.abs()));
                    // Each factor within half a step (largest / 254) of its value.
                    let bound =
                        k as f32 * largest_x * largest_w * (2.0 / 254.0 + 1.0 / 254.0 / 254.0);
                    assert!(
                        (plain[m * n + j] - want).abs() <= bound,
                        "{rows} rows, {m},{j}: {} vs {want} (bound {bound})",
                        plain[m * n + j]
                    );
                }
            }
        }
    }

    #[test]
    fn quantized_rows_span_their_range_and_hold_zero_exactly() {
        // 1.0 in the last row is 127.5 steps, a hair under in f32: 127.
        let x = [
            0.0, 0.5, -1.27, 0.011, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 0.5, 0.25,
        ];
        let mut q = QuantizedRows::default();
        q.fill(&x, 3, 4);
        // Row 0: −1.27..0.5 onto 0..=255; 0 is the zero point; each value within half a step.
        assert_eq!(q.zeros[0], 183);
        assert_eq!(&q.values[..4], &[183, 255, 0, 185]);
        for (v, &b) in x[..4].iter().zip(&q.values[..4]) {
            let back = q.scales[0] * (i32::from(b) - q.zeros[0]) as f32;
            assert!(
                (back - v).abs() <= q.scales[0] / 2.0 + 1e-6,
                "{v} came back {back}"
            );
        }
        // A row of zeros: scale 1, zero point 0.
        assert_eq!((q.scales[1], q.zeros[1]), (1.0, 0));
        assert_eq!(&q.values[4..8], &[0, 0, 0, 0]);
        // All positive: the range is widened to hold 0, which is then 0.
        assert_eq!(q.zeros[2], 0);
        assert_eq!(&q.values[8..], &[255, 127, 64, 32]);
    }

    /// The AVX-512 quantizer gives `fill`'s bytes, scales and zero points: ties, all-negative
    /// rows, zeros, values at both ends, a range too small to invert, at widths of 16 and 32.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_quantizer_gives_the_plain_bytes() {
        if !Kernel::Avx512Vnni.available() {
            eprintln!("no AVX-512 VNNI here: the AVX-512 quantizer is not run");
            return;
        }
        let mut rows: Vec<Vec<f32>> = vec![
            (0..32).map(|i| (i as f32 - 10.0) * 0.5).collect(),
            (0..32).map(|i| -(i as f32) - 1.0).collect(),
            vec![0.0; 32],
            (0..32)
                .map(|i| if i % 2 == 0 { 255.0 } else { 0.0 })
                .collect(),
            (0..32).map(|i| i as f32 * 1e-39).collect(),
            (0..32)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect(),
        ];
        // Exact ties: 0..=255 steps of a row spanning 0 to 255 hit .5 after the scale.
        rows.push((0..32).map(|i| i as f32 * 8.5).collect());
        for k in [16, 32] {
            let x: Vec<f32> = rows.iter().flat_map(|r| r[..k].iter().copied()).collect();
            let (mut plain, mut wide) = (QuantizedRows::default(), QuantizedRows::default());
            plain.fill(&x, rows.len(), k);
            simd::quantize_rows(&mut wide, &x, rows.len(), k);
            assert_eq!(plain.values, wide.values, "k = {k}");
            assert_eq!(plain.scales, wide.scales, "k = {k}");
            assert_eq!(plain.zeros, wide.zeros, "k = {k}");
        }
    }
}
