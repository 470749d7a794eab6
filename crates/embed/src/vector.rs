//! The arithmetic the embedders and recall share: L2 normalisation, dot products and sums in
//! f32, and the integer dot products of a query's bytes with many stored vectors' (recall's
//! scoring, compiled for the CPU's widest integer vectors). Owns no state.

/// Scales `vector` to length 1 in place; a vector of length 0 (nothing to embed) stays zero.
pub fn normalize(vector: &mut [f32]) {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        for x in vector.iter_mut() {
            *x /= norm;
        }
    }
}

/// Lanes of the sums below: eight partial sums, which the compiler keeps in vector registers
/// (a single running sum it may not reorder, so it cannot vectorise one).
const LANES: usize = 8;

/// The dot product: the cosine of two unit-length vectors.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut lanes = [0.0f32; LANES];
    let (a_body, b_body) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_body
        .remainder()
        .iter()
        .zip(b_body.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_body.zip(b_body) {
        for l in 0..LANES {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The sum of `values`, in [`LANES`] partial sums.
#[inline(always)]
pub fn sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let body = values.chunks_exact(LANES);
    let tail: f32 = body.remainder().iter().sum();
    for x in body {
        for l in 0..LANES {
            lanes[l] += x[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// The largest of `values` (negative infinity for none), in [`LANES`] partial maxima so that
/// it vectorises (a fold of `f32::max` is one long dependency chain).
#[inline(always)]
pub fn max(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let body = values.chunks_exact(LANES);
    let tail = body
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for x in body {
        for (l, &v) in lanes.iter_mut().zip(x) {
            *l = l.max(v);
        }
    }
    lanes.iter().copied().fold(tail, f32::max)
}

/// Lanes of the integer products: one AVX-512 register of i32 sums.
const BYTE_LANES: usize = 16;

/// `out[i]` = the dot product of `query` with the `i`-th row of `rows` (rows of
/// `query.len()` bytes, back to back; a last partial row is ignored), in exact integer
/// arithmetic. Compiled for AVX-512 or AVX2 where the CPU has them: recall scores every
/// stored turn's vector on each request: 10,000 of 256 bytes in 0.094 ms on AVX-512 instead
/// of the plain loop's 0.464 (`embed_cost`).
pub fn dots_i8(rows: &[i8], query: &[i8], out: &mut Vec<i32>) {
    out.clear();
    if query.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    return wide::dots_i8(rows, query, out);
    #[cfg(not(target_arch = "x86_64"))]
    dots_i8_plain(rows, query, out)
}

/// [`dots_i8`] as plain code, vectorised to the build target's width (SSE2 on a default
/// x86-64 build): what runs where `wide` has no path.
#[inline(always)]
fn dots_i8_plain(rows: &[i8], query: &[i8], out: &mut Vec<i32>) {
    let dims = query.len();
    out.extend(rows.chunks_exact(dims).map(|row| {
        let mut lanes = [0i32; BYTE_LANES];
        let (body, q_body) = (row.chunks_exact(BYTE_LANES), query.chunks_exact(BYTE_LANES));
        let tail: i32 = body
            .remainder()
            .iter()
            .zip(q_body.remainder())
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum();
        for (a, b) in body.zip(q_body) {
            for l in 0..BYTE_LANES {
                lanes[l] += i32::from(a[l]) * i32::from(b[l]);
            }
        }
        lanes.iter().sum::<i32>() + tail
    }));
}

/// [`dots_i8`] on the widest the CPU has: with AVX-512 VNNI and a width that is a multiple of
/// 64, 64 bytes of a row at a time by `vpdpbusd` (`vnni` below); else on AVX-512BW or AVX2, 32
/// (or 16) bytes of a row widened to i16 and multiplied with the query's (widened once) by
/// `vpmaddwd`, which sums pairs into i32 lanes. The rows' width must be a multiple of 32 here;
/// other widths take the plain code.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod wide {
    use std::arch::x86_64::*;

    pub(super) fn dots_i8(rows: &[i8], query: &[i8], out: &mut Vec<i32>) {
        let dims = query.len();
        if !dims.is_multiple_of(32) {
            return super::dots_i8_plain(rows, query, out);
        }
        let count = rows.len() / dims;
        out.reserve(count);
        if vnni_takes(dims) {
            // SAFETY: the CPU has AVX-512F, BW and VNNI; every load below is inside `rows` or
            // `query` (`count` whole rows of `dims`, a multiple of 64, bytes).
            unsafe { vnni(&rows[..count * dims], query, out) }
        } else if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: the CPU has AVX-512F and BW; every load below is inside `rows` or
            // `query` (`count` whole rows of `dims`, a multiple of 32, bytes).
            unsafe { avx512(&rows[..count * dims], query, out) }
        } else if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2; the loads are inside the slices, as above.
            unsafe { avx2(&rows[..count * dims], query, out) }
        } else {
            super::dots_i8_plain(rows, query, out)
        }
    }

    /// Whether [`vnni`] runs here for rows of `dims` bytes: the CPU has it, and the width is
    /// a multiple of its 64-byte step.
    fn vnni_takes(dims: usize) -> bool {
        dims.is_multiple_of(64)
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vnni")
    }

    /// What each path this CPU runs gives (the tests compare them).
    #[cfg(test)]
    pub(super) fn every_path(rows: &[i8], query: &[i8]) -> Vec<Vec<i32>> {
        let mut outs = Vec::new();
        let whole = &rows[..rows.len() / query.len() * query.len()];
        if vnni_takes(query.len()) {
            let mut out = Vec::new();
            // SAFETY: as in `dots_i8`.
            unsafe { vnni(whole, query, &mut out) };
            outs.push(out);
        }
        if query.len().is_multiple_of(32) {
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
            {
                let mut out = Vec::new();
                // SAFETY: as in `dots_i8`.
                unsafe { avx512(whole, query, &mut out) };
                outs.push(out);
            }
            if std::is_x86_feature_detected!("avx2") {
                let mut out = Vec::new();
                // SAFETY: as in `dots_i8`.
                unsafe { avx2(whole, query, &mut out) };
                outs.push(out);
            }
        }
        outs
    }

    /// With VNNI, `vpdpbusd` multiplies 64 bytes of a row with the query's and sums each four
    /// products into an i32 lane in one instruction (no widening to i16). It takes one side
    /// unsigned: each row byte is flipped to `row + 128` (its top bit toggled), and `128 × the
    /// query's sum` taken off each total, exactly. Four rows at a time, their sums reduced
    /// together (one horizontal sum of a 512-bit register costs about what a row's products
    /// do).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn vnni(rows: &[i8], query: &[i8], out: &mut Vec<i32>) {
        let dims = query.len();
        let chunks = dims / 64;
        let bias = 128 * query.iter().map(|&q| i32::from(q)).sum::<i32>();
        // SAFETY: the loads read 64 bytes at offsets below `dims` (a multiple of 64) of
        // `query` and of each whole row of `rows`.
        unsafe {
            let flip = _mm512_set1_epi8(i8::MIN);
            let q: Vec<__m512i> = (0..chunks)
                .map(|c| _mm512_loadu_si512(query.as_ptr().add(c * 64).cast()))
                .collect();
            let products = |row: *const i8| {
                let mut acc = _mm512_setzero_si512();
                for (c, qv) in q.iter().enumerate() {
                    let r = _mm512_xor_si512(_mm512_loadu_si512(row.add(c * 64).cast()), flip);
                    acc = _mm512_dpbusd_epi32(acc, r, *qv);
                }
                acc
            };
            let mut fours = rows.chunks_exact(4 * dims);
            for four in &mut fours {
                let p = four.as_ptr();
                let (a, b, c, d) = (
                    products(p),
                    products(p.add(dims)),
                    products(p.add(2 * dims)),
                    products(p.add(3 * dims)),
                );
                // Pairs interleaved, then quads: each 128-bit lane holds a partial sum of
                // a, b, c and d in that order; the four lanes summed.
                let ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
                let cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
                let abcd =
                    _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
                let half = _mm256_add_epi32(
                    _mm512_castsi512_si256(abcd),
                    _mm512_extracti64x4_epi64::<1>(abcd),
                );
                let sums = _mm_add_epi32(
                    _mm256_castsi256_si128(half),
                    _mm256_extracti128_si256::<1>(half),
                );
                let sums = _mm_sub_epi32(sums, _mm_set1_epi32(bias));
                let mut four_sums = [0i32; 4];
                _mm_storeu_si128(four_sums.as_mut_ptr().cast(), sums);
                out.extend_from_slice(&four_sums);
            }
            for row in fours.remainder().chunks_exact(dims) {
                out.push(_mm512_reduce_add_epi32(products(row.as_ptr())) - bias);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn avx512(rows: &[i8], query: &[i8], out: &mut Vec<i32>) {
        let dims = query.len();
        // SAFETY: the loads read 32 bytes at offsets below `dims` (a multiple of 32) of
        // `query` and of each whole row of `rows`.
        unsafe {
            let q: Vec<__m512i> = (0..dims / 32)
                .map(|c| {
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256(query.as_ptr().add(c * 32).cast()))
                })
                .collect();
            for row in rows.chunks_exact(dims) {
                let mut acc = _mm512_setzero_si512();
                for (c, qv) in q.iter().enumerate() {
                    let r =
                        _mm512_cvtepi8_epi16(_mm256_loadu_si256(row.as_ptr().add(c * 32).cast()));
                    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(r, *qv));
                }
                out.push(_mm512_reduce_add_epi32(acc));
            }
        }
    }

    #[target_feature(enable = "avx2")]
    unsafe fn avx2(rows: &[i8], query: &[i8], out: &mut Vec<i32>) {
        let dims = query.len();
        // SAFETY: the loads read 16 bytes at offsets below `dims` of `query` and of each
        // whole row of `rows`.
        unsafe {
            let q: Vec<__m256i> = (0..dims / 16)
                .map(|c| _mm256_cvtepi8_epi16(_mm_loadu_si128(query.as_ptr().add(c * 16).cast())))
                .collect();
            for row in rows.chunks_exact(dims) {
                let mut acc = _mm256_setzero_si256();
                for (c, qv) in q.iter().enumerate() {
                    let r = _mm256_cvtepi8_epi16(_mm_loadu_si128(row.as_ptr().add(c * 16).cast()));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(r, *qv));
                }
                // The eight lanes summed.
                let half = _mm_add_epi32(
                    _mm256_castsi256_si128(acc),
                    _mm256_extracti128_si256(acc, 1),
                );
                let pairs = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0b01_00_11_10));
                let one = _mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0b10_11_00_01));
                out.push(_mm_cvtsi128_si32(one));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_finds_the_largest_in_the_lanes_and_the_tail() {
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        for len in [1, 7, 8, 9, 25] {
            for at in 0..len {
                let values: Vec<f32> = (0..len)
                    .map(|i| if i == at { 3.5 } else { -(i as f32) })
                    .collect();
                assert_eq!(max(&values), 3.5, "{len} values, largest at {at}");
            }
        }
    }

    #[test]
    fn a_normalised_vector_has_length_one() {
        let mut v = vec![3.0, 4.0];
        normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        assert!((dot(&v, &v) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn lane_sums_match_plain_sums_past_a_multiple_of_eight() {
        for n in [0, 1, 7, 8, 9, 32, 37] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let plain: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - plain).abs() < 1e-5, "{n}");
            assert!((sum(&a) - a.iter().sum::<f32>()).abs() < 1e-5, "{n}");
        }
    }

    #[test]
    fn byte_products_are_exact_at_every_width() {
        for dims in [1usize, 15, 16, 17, 32, 256, 384] {
            let query: Vec<i8> = (0..dims)
                .map(|i| ((i * 37 % 255) as i32 - 127) as i8)
                .collect();
            let rows: Vec<i8> = (0..dims * 5 + 3)
                .map(|i| ((i * 91 % 255) as i32 - 127) as i8)
                .collect();
            let mut out = vec![7];
            dots_i8(&rows, &query, &mut out);
            #[cfg(target_arch = "x86_64")]
            for other in wide::every_path(&rows, &query) {
                assert_eq!(other, out, "{dims}");
            }
            let want = plain_products(&rows, &query);
            assert_eq!(out, want, "{dims}");
        }
        let mut out = vec![1];
        dots_i8(&[1, 2], &[], &mut out);
        assert!(out.is_empty());
    }

    /// Each whole row of `rows` times `query`, one product at a time.
    fn plain_products(rows: &[i8], query: &[i8]) -> Vec<i32> {
        rows.chunks_exact(query.len())
            .map(|row| {
                row.iter()
                    .zip(query)
                    .map(|(&a, &b)| i32::from(a) * i32::from(b))
                    .sum()
            })
            .collect()
    }

    /// Every path, at widths its fast paths take, for every count of rows around their groups
    /// of four, with the bytes' extremes (−128 too, which the quantiser never makes).
    #[test]
    fn byte_products_are_exact_for_every_count_of_rows_and_the_extremes() {
        for dims in [64usize, 128, 256, 384] {
            let query: Vec<i8> = (0..dims)
                .map(|i| match i % 5 {
                    0 => i8::MIN,
                    1 => i8::MAX,
                    _ => ((i * 53 % 256) as i32 - 128) as i8,
                })
                .collect();
            for count in 0..10 {
                let rows: Vec<i8> = (0..dims * count)
                    .map(|i| match i % 7 {
                        0 => i8::MIN,
                        3 => i8::MAX,
                        _ => ((i * 29 % 256) as i32 - 128) as i8,
                    })
                    .collect();
                let want = plain_products(&rows, &query);
                let mut out = Vec::new();
                dots_i8(&rows, &query, &mut out);
                assert_eq!(out, want, "{dims} dimensions, {count} rows");
                #[cfg(target_arch = "x86_64")]
                for other in wide::every_path(&rows, &query) {
                    assert_eq!(other, want, "{dims} dimensions, {count} rows");
                }
            }
        }
    }

    #[test]
    fn a_zero_vector_stays_zero() {
        let mut v = vec![0.0; 3];
        normalize(&mut v);
        assert_eq!(v, vec![0.0; 3]);
    }
}
