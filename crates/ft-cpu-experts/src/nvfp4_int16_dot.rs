//! NVFP4 rows times vectors quantized to int16 a block at a time, with AVX512-VNNI's `vpdpwssd`: both projections
//! of an NVFP4 expert where the CPU has it.
//!
//! Why integers: an E2M1 value times 2 is an integer in [-12, 12], so a code decodes to an exact int16, and
//! `vpdpwssd` (32 int16 products summed into 16 int32 lanes) runs at two a cycle on the hosts measured, where the
//! BF16 dot-product instruction (`_mm512_dpbf16_ps`, the same 32 products) takes two cycles each (2026-12-07, a
//! Sapphire Rapids core: 0.136 vs 0.54 ns an instruction). With the rows of a task in one call and x on whole cache
//! lines, this kernel made the executor 29-49 % faster than the BF16 one on an H100's 16-core host
//! (`bench/results/2026-12-07-h100-host-cpu-expert-int16.txt`).
//!
//! x is cut into its 16-element blocks (the weights' scale blocks), each stored as int16 times one power of two
//! (`quantize`): the block's largest element keeps 15 bits, so every BF16 value within 2^7 of it is exact, and a
//! smaller one is off by at most 2^-15 of the largest (a BF16 rounding of the largest is 2^-9 of it). The integer
//! sums are exact; a block's sum becomes f32 once, times the weights' block scale and x's block factor.
//!
//! The chunks, the de-interleaving into A and B (lane d: block d) and the scales are `nvfp4_dot.rs`'s. A code byte
//! pair (a 16-bit word: four codes) is shifted by 4m and looked up in a 32-entry `_mm512_permutexvar_epi16` table
//! (the permute reads the low 5 bits: the table is the 16 values twice), 32 weights at a time. In A, word 2d holds
//! block d's elements 0..4 and word 2d+1 its elements 4..8, so nibble m gives lane d elements m and 4+m; x is laid
//! out to match (`position`): chunk c's element `16d + 8h + 4s + m` (block d, half h, word s, nibble m) at
//! `256c + 128h + 32m + 2d + s`, zero-padded to whole chunks; x's block factors are one f32 a block, in block order
//! (which is lane order: chunk c's factors at `16c`).

use crate::nvfp4_dot::{BLOCK, CHUNK};

/// Where element `j` of x goes in the kernel's layout (the definition; `quantize` writes it through `IN_BLOCK`).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn position(j: usize) -> usize {
    let (c, r) = (j / CHUNK, j % CHUNK);
    let (d, e) = (r / BLOCK, r % BLOCK);
    let (h, s, m) = (e / 8, e % 8 / 4, e % 4);
    c * CHUNK + h * 128 + m * 32 + 2 * d + s
}

/// Twice the E2M1 value of each 4-bit code, as int16, the 16 values twice (`vpermw` reads an index's low 5 bits).
static TWICE_E2M1: [i16; 32] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Whether this CPU has the instruction (and the AVX-512 the rest of the kernel needs).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::executor::has_avx512() && std::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One vector as the kernel takes it: `values` laid out (`position`, `padded` long), `factors` one a block
/// (`padded / 16`; a block's value is `values * factor`).
#[derive(Clone, Copy)]
pub(crate) struct Quantized<'a> {
    pub(crate) values: &'a [i16],
    pub(crate) factors: &'a [f32],
}

/// `k` elements (the first `k` of `value`, in order) into `values` (laid out, `padded(k)` long) and `factors`
/// (`padded(k) / 16`), the padding zero. The factor of a block is a power of two over 2 (the codes' table holds
/// twice the E2M1 values); a block holding a NaN or an infinity gets a NaN factor, so the dot products it enters
/// are NaN, as they would be.
pub(crate) fn quantize(k: usize, mut value: impl Iterator<Item = f32>, values: &mut [i16], factors: &mut [f32]) {
    debug_assert!(values.len() == k.div_ceil(CHUNK) * CHUNK && factors.len() * BLOCK == values.len());
    values.fill(0);
    factors.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    let simd = block_avx512_available();
    // a chunk's values gathered first, so the blocks are read as whole vectors from stores long retired (a block
    // read right after its 16 scalar stores waits on them)
    let mut chunk = [0f32; CHUNK];
    for (c, (out, chunk_factors)) in values.chunks_mut(CHUNK).zip(factors.chunks_mut(BLOCK)).enumerate() {
        let n = CHUNK.min(k.saturating_sub(c * CHUNK));
        for v in chunk[..n].iter_mut() {
            *v = value.next().expect("k values");
        }
        chunk[n..].fill(0.0); // the padding, zero as the values past k
        for (d, factor) in chunk_factors.iter_mut().enumerate().take(n.div_ceil(BLOCK)) {
            let block: &[f32; BLOCK] = chunk[d * BLOCK..(d + 1) * BLOCK].try_into().expect("a block");
            let out = &mut out[2 * d..]; // block d's lane (`position`)
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the CPU has AVX-512F/BW/VL (checked above)
                *factor = unsafe { quantize_block_avx512(block, out) };
                continue;
            }
            *factor = quantize_block(block, out);
        }
    }
}

/// One block (zero past its elements) into `out` at `IN_BLOCK`'s offsets; returns its factor (see `quantize`).
/// The reference `quantize_block_avx512` is tested against, bit for bit.
fn quantize_block(block: &[f32; BLOCK], out: &mut [i16]) -> f32 {
    let largest = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    if !largest.is_finite() || block.iter().any(|v| v.is_nan()) {
        return f32::NAN;
    }
    if largest == 0.0 {
        return 0.0;
    }
    let up = up_of(largest);
    for (v, offset) in block.iter().zip(IN_BLOCK) {
        out[offset] = round_ties_even(v * up) as i16;
    }
    0.5 / up
}

/// 2^(14 - e) for the largest's binary exponent e (its exponent bits): the largest lands in [2^14, 2^15); a block
/// whose largest is below 2^-100 keeps fewer bits, none for subnormals (the factor stays a normal f32).
fn up_of(largest: f32) -> f32 {
    let e = (((largest.to_bits() >> 23) & 0xFF) as i32 - 127).max(-100);
    f32::from_bits(((127 + 14 - e) as u32) << 23)
}

/// Whether this CPU has what `quantize_block_avx512` is compiled for.
#[cfg(target_arch = "x86_64")]
fn block_avx512_available() -> bool {
    crate::executor::has_avx512() && std::is_x86_feature_detected!("avx512vl")
}

/// `quantize_block` in a few AVX-512 instructions: a decode call's x and activations were ~2.6 ns a value through
/// the scalar block (5.3 us for Qwen3.6's 2,048 of x, 2026-12-07, this crate's 2-core host), about a tenth of a
/// one-token call's time on a GPU host's 16 cores. Elements i and i + 4 of the block share one 32-bit word of the
/// layout (`IN_BLOCK`), so the block is rounded, saturated to int16 as `as i16` does, paired and stored as 8 words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_block_avx512(block: &[f32; BLOCK], out: &mut [i16]) -> f32 {
    use std::arch::x86_64::*;
    let v = _mm512_loadu_ps(block.as_ptr());
    if _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0 {
        return f32::NAN;
    }
    let largest = _mm512_reduce_max_ps(_mm512_abs_ps(v));
    if !largest.is_finite() {
        return f32::NAN;
    }
    if largest == 0.0 {
        return 0.0;
    }
    let up = up_of(largest);
    let rounded = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        v,
        _mm512_set1_ps(up),
    ));
    // 16 int16, saturated; then word w holds elements (w / 4 * 8 + w % 4) and that + 4, low half first
    let halves = _mm512_cvtsepi32_epi16(rounded);
    let pairs =
        _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), halves);
    let mut words = [0u32; 8];
    _mm256_storeu_si256(words.as_mut_ptr() as *mut __m256i, pairs);
    for (w, word) in words.iter().enumerate() {
        let at = IN_BLOCK[w / 4 * 8 + w % 4]; // even: the word's first int16
        out[at] = *word as u16 as i16;
        out[at + 1] = (*word >> 16) as u16 as i16;
    }
    0.5 / up
}

/// Where element i of a block sits in its chunk, past the block's lane (`position` of `16d + i`, less `2d`).
const IN_BLOCK: [usize; BLOCK] = {
    let mut t = [0; BLOCK];
    let mut i = 0;
    while i < BLOCK {
        t[i] = i / 8 * 128 + i % 4 * 32 + i % 8 / 4;
        i += 1;
    }
    t
};

/// `v` (|v| < 2^15) to the nearest integer, ties to even as torch rounds: adding 1.5 * 2^23 leaves no fraction bits,
/// and the hardware's default rounding is to nearest even (`f32::round_ties_even` is a libm call on this target).
fn round_ties_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

/// `out[r * n + t] = sum over blocks of scale * dot(row r, xs[t])` for `n = xs.len()` vectors and the
/// `out.len() / n` rows stored one after another in `codes` (`k / 2` bytes a row) and `scales` (`k / 16`), each x
/// quantized (`quantize`); a row as `nvfp4_dot::dot_many`. Many rows a call: a decode step's down rows are short (two
/// chunks for Qwen3.6), and a call a row cost about a third of the kernel's time (2026-12-07, the local host). Only
/// where `available()`.
pub(crate) fn dot_rows(codes: &[u8], scales: &[u8], k: usize, xs: &[Quantized], out: &mut [f32]) {
    let n = xs.len();
    if n == 0 {
        return;
    }
    let rows = out.len() / n;
    let padded = k.div_ceil(CHUNK) * CHUNK;
    assert!(
        k.is_multiple_of(BLOCK)
            && out.len() == rows * n
            && codes.len() == rows * k / 2
            && scales.len() == rows * k / BLOCK
            && xs.iter().all(|x| x.values.len() >= padded && x.factors.len() * BLOCK >= padded),
        "lengths"
    );
    assert!(available(), "AVX512-VNNI kernels on a CPU without them");
    #[cfg(target_arch = "x86_64")]
    for (g, xs) in xs.chunks(4).enumerate() {
        // SAFETY: the features are checked above, and the lengths.
        unsafe {
            match xs.len() {
                4 => rows_avx512::<4>(codes, scales, k, [xs[0], xs[1], xs[2], xs[3]], out, n, 4 * g),
                3 => rows_avx512::<3>(codes, scales, k, [xs[0], xs[1], xs[2]], out, n, 4 * g),
                2 => rows_avx512::<2>(codes, scales, k, [xs[0], xs[1]], out, n, 4 * g),
                _ => rows_avx512::<1>(codes, scales, k, [xs[0]], out, n, 4 * g),
            }
        }
    }
}

/// One chunk, as `nvfp4_dot`'s `chunk!` (a macro for the same reason): integer sums a block, then one f32 product.
#[cfg(target_arch = "x86_64")]
macro_rules! chunk {
    ($lo:expr, $hi:expr, $scales:expr, $xs:expr, $at:expr, $lut:expr, $acc:expr) => {{
        let (first, second) = crate::nvfp4_dot::by_block($lo, $hi);
        let mut sums = [[_mm512_setzero_si512(); 2]; N];
        macro_rules! nibble {
            ($m:literal) => {
                let a = _mm512_permutexvar_epi16(_mm512_srli_epi16::<{ 4 * $m }>(first), $lut);
                let b = _mm512_permutexvar_epi16(_mm512_srli_epi16::<{ 4 * $m }>(second), $lut);
                for t in 0..N {
                    let x = $xs[t].values.as_ptr().add($at);
                    let xa = _mm512_loadu_si512(x.add(32 * $m) as *const __m512i);
                    let xb = _mm512_loadu_si512(x.add(128 + 32 * $m) as *const __m512i);
                    sums[t][0] = _mm512_dpwssd_epi32(sums[t][0], a, xa);
                    sums[t][1] = _mm512_dpwssd_epi32(sums[t][1], b, xb);
                }
            };
        }
        nibble!(0);
        nibble!(1);
        nibble!(2);
        nibble!(3);
        let s = crate::e4m3::decode16_avx512($scales);
        for t in 0..N {
            let [p, q] = sums[t];
            let total = _mm512_cvtepi32_ps(_mm512_add_epi32(p, q));
            let factors = _mm512_loadu_ps($xs[t].factors.as_ptr().add($at / BLOCK));
            $acc[t] = _mm512_fmadd_ps(total, _mm512_mul_ps(s, factors), $acc[t]);
        }
    }};
}

/// Every row against the `N` vectors `t0..t0 + N` of `n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_avx512<const N: usize>(
    codes: &[u8],
    scales: &[u8],
    k: usize,
    xs: [Quantized; N],
    out: &mut [f32],
    n: usize,
    t0: usize,
) {
    use crate::nvfp4_dot::walk_row;
    use std::arch::x86_64::*;
    let lut = _mm512_loadu_si512(TWICE_E2M1.as_ptr() as *const __m512i);
    let (kc, ks) = (k / 2, k / BLOCK);
    for r in 0..out.len() / n {
        let mut acc = [_mm512_setzero_ps(); N];
        let sums: [f32; N] =
            walk_row!(chunk, &codes[r * kc..(r + 1) * kc], &scales[r * ks..(r + 1) * ks], xs, lut, acc);
        out[r * n + t0..r * n + t0 + N].copy_from_slice(&sums);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn the_table_is_twice_e2m1() {
        for (i, v) in TWICE_E2M1.iter().enumerate() {
            assert_eq!(*v as f32, 2.0 * crate::nvfp4_dot::E2M1[i % 16]);
        }
    }

    #[test]
    fn the_block_offsets_are_positions() {
        for j in 0..2 * CHUNK {
            let b = j / BLOCK;
            assert_eq!(b / BLOCK * CHUNK + 2 * (b % BLOCK) + IN_BLOCK[j % BLOCK], position(j));
        }
        for (v, want) in [(0.5f32, 0.0f32), (1.5, 2.0), (2.5, 2.0), (-2.5, -2.0), (-3.5, -4.0), (32766.6, 32767.0)] {
            assert_eq!(round_ties_even(v), want, "{v}");
        }
    }

    #[test]
    fn position_is_a_permutation_of_each_chunk() {
        let mut seen = vec![false; 2 * CHUNK];
        for j in 0..2 * CHUNK {
            let p = position(j);
            assert!(p / CHUNK == j / CHUNK && !seen[p]);
            seen[p] = true;
        }
    }

    #[test]
    fn the_avx512_block_is_the_scalar_block_bit_for_bit() {
        if !block_avx512_available() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let specials = [0.0f32, -0.0, f32::NAN, f32::INFINITY, -f32::INFINITY, 1e-40, -3e-39, 65504.0, 3e38, 1e-30];
        for case in 0..4000 {
            let mut block = [0f32; BLOCK];
            for v in block.iter_mut() {
                *v = match rng.gen_range(0..10) {
                    0 => specials[rng.gen_range(0..specials.len())],
                    1 => 0.0,
                    _ => rng.gen_range(-1.0f32..1.0) * 2f32.powi(rng.gen_range(-130..120)),
                };
            }
            if case % 7 == 0 {
                block[rng.gen_range(0..BLOCK)] = 32767.5 / 32768.0; // rounds to 2^15 at the top: saturates
            }
            let (mut want, mut got) = ([7i16; CHUNK], [7i16; CHUNK]);
            let f = quantize_block(&block, &mut want);
            let g = unsafe { quantize_block_avx512(&block, &mut got) };
            assert!(f.to_bits() == g.to_bits() || (f.is_nan() && g.is_nan()), "{block:?}: {f} vs {g}");
            assert_eq!(want, got, "{block:?}");
        }
    }

    /// `quantize`'s output back to f32, in x's order.
    fn dequantize(k: usize, values: &[i16], factors: &[f32]) -> Vec<f32> {
        (0..k).map(|j| values[position(j)] as f32 * factors[j / BLOCK] * 2.0).collect()
    }

    #[test]
    fn quantize_keeps_bf16_values_within_2_to_the_7_of_the_largest() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for k in [16usize, 48, 256, 272] {
            let x: Vec<f32> = (0..k)
                .map(|j| {
                    let v = rng.gen_range(1.0f32..2.0) * 2f32.powi(rng.gen_range(-7..1)) * [1.0, -1.0][j % 2];
                    f32::from_bits(v.to_bits() & 0xFFFF_0000) // a BF16 value
                })
                .collect();
            let pad = k.div_ceil(CHUNK) * CHUNK;
            let (mut values, mut factors) = (vec![7i16; pad], vec![7f32; pad / BLOCK]);
            quantize(k, x.iter().copied(), &mut values, &mut factors);
            for (j, (got, want)) in dequantize(k, &values, &factors).iter().zip(&x).enumerate() {
                // exact where the block's largest is below 2^1 and the value at least 2^-7 of it
                assert_eq!(got, want, "k={k} j={j}");
            }
            assert!(
                (k..pad).all(|j| values[position(j)] == 0) && factors[k.div_ceil(BLOCK)..].iter().all(|f| *f == 0.0)
            );
        }
        // tiny values beside a large one: off by at most 2^-15 of the largest; a zero block; a NaN, an infinity
        let mut x = vec![0f32; 64];
        x[0] = 1000.0;
        x[1] = 1e-3;
        x[2] = -3.3e-2;
        x[40] = f32::NAN;
        x[50] = f32::NEG_INFINITY;
        let (mut values, mut factors) = (vec![0i16; 256], vec![0f32; 16]);
        quantize(64, x.iter().copied(), &mut values, &mut factors);
        let back = dequantize(64, &values, &factors);
        for j in 0..3 {
            assert!((back[j] - x[j]).abs() <= 1000.0 * 2f32.powi(-15), "{} vs {}", back[j], x[j]);
        }
        assert_eq!(factors[1], 0.0);
        assert!(factors[2].is_nan() && factors[3].is_nan());
    }

    #[test]
    fn equals_the_f32_kernel() {
        if !available() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let rows = 3;
        for k in [16usize, 48, 256, 272, 512, 2048, 2064] {
            let codes: Vec<u8> = (0..rows * k / 2).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..rows * k / 16).map(|_| rng.gen_range(0..0x7F)).collect();
            // BF16 values within 2^7 of each other: exact in int16, so the two kernels differ by f32 rounding only
            let xs: Vec<Vec<f32>> = (0..6)
                .map(|_| {
                    (0..k)
                        .map(|_| {
                            let v = rng.gen_range(-2.0f32..2.0);
                            let v = if v.abs() < 2f32.powi(-6) { 0.5 } else { v };
                            f32::from_bits(v.to_bits() & 0xFFFF_0000)
                        })
                        .collect()
                })
                .collect();
            let pad = k.div_ceil(CHUNK) * CHUNK;
            let lay = |x: &Vec<f32>| {
                let (mut v, mut f, mut l) = (vec![0i16; pad], vec![0f32; pad / BLOCK], vec![0f32; pad]);
                quantize(k, x.iter().copied(), &mut v, &mut f);
                x.iter().enumerate().for_each(|(j, x)| l[crate::nvfp4_dot::position(j)] = *x);
                (v, f, l)
            };
            let laid: Vec<_> = xs.iter().map(lay).collect();
            let size: f64 = scales.iter().map(|s| (crate::e4m3::E4M3[*s as usize] as f64).powi(2)).sum::<f64>().sqrt();
            for n in 1..=6 {
                let q: Vec<Quantized> = laid[..n].iter().map(|(v, f, _)| Quantized { values: v, factors: f }).collect();
                let f: Vec<&[f32]> = laid[..n].iter().map(|(_, _, l)| &l[..]).collect();
                let mut got = vec![0f32; rows * n];
                dot_rows(&codes, &scales, k, &q, &mut got);
                for r in 0..rows {
                    let mut want = vec![0f32; n];
                    let (c, s) = (&codes[r * k / 2..(r + 1) * k / 2], &scales[r * k / 16..(r + 1) * k / 16]);
                    crate::nvfp4_dot::dot_many(c, s, &f, &mut want, false);
                    for t in 0..n {
                        let g = got[r * n + t];
                        assert!(((g - want[t]) as f64).abs() < 1e-5 * 12.0 * size, "k={k} row {r}: {g} vs {}", want[t]);
                    }
                }
            }
        }
    }
}
