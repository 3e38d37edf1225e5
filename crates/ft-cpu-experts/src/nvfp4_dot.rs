//! Dot products of NVFP4 weight rows (E2M1 codes and E4M3 block scales, ModelOpt's layout: element 2j in the low
//! nibble of byte j, one scale per 16 elements) with a few f32 vectors (the tokens routed to one expert):
//! each chunk is decoded once for all of them. The per-row global scale is the caller's (`matrix.rs`).
//!
//! The AVX-512 path works on chunks of 16 blocks (256 elements, 128 code bytes, 16 scale bytes). Two 64-byte loads
//! are de-interleaved into A (lane d: the first 4 bytes of block d) and B (its last 4), so that lane d of every
//! vector below belongs to block d: the 16 scales are one vector, decoded once a chunk. Nibble n of A (a shift by
//! 4n) indexes a 16-entry `_mm512_permutexvar_ps` table of the E2M1 values (the permute reads the low 4 bits of
//! each lane, so no mask either). x is laid out to match (`position`): chunk c's element `16d + 8h + n` (block d,
//! half h, nibble n) at `256c + 128h + 16n + d`, zero-padded to whole chunks.

use crate::e4m3::E4M3;

/// Elements per block (one E4M3 scale each).
pub(crate) const BLOCK: usize = 16;
/// Elements per chunk of x's layout (16 blocks).
pub(crate) const CHUNK: usize = 256;

/// The E2M1 value of each 4-bit code (bit 3 the sign).
pub(crate) static E2M1: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Where element `j` of x goes in the kernel's layout.
pub(crate) fn position(j: usize) -> usize {
    let (c, r) = (j / CHUNK, j % CHUNK);
    let (d, h, n) = (r / BLOCK, r % BLOCK / 8, r % 8);
    c * CHUNK + h * 128 + n * 16 + d
}

/// `out[t] = sum over blocks of scale * dot(codes, xs[t])` of one row: `codes` `k/2` bytes, `scales` `k/16` bytes
/// (`k` a multiple of 16), each x laid out (`position`) and at least `k` rounded up to a chunk.
pub(crate) fn dot_many(codes: &[u8], scales: &[u8], xs: &[&[f32]], out: &mut [f32], simd: bool) {
    let blocks = scales.len();
    let padded = (blocks * BLOCK).div_ceil(CHUNK) * CHUNK;
    assert!(
        codes.len() == blocks * BLOCK / 2 && out.len() == xs.len() && xs.iter().all(|x| x.len() >= padded),
        "lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if simd {
        // the tokens four at a time, each chunk decoded once for them (as many FMA chains as fit the registers)
        for (xs, out) in xs.chunks(4).zip(out.chunks_mut(4)) {
            // SAFETY: `simd` is only set where the Executor detected avx512f and avx512bw; lengths checked above.
            unsafe {
                match xs.len() {
                    4 => out.copy_from_slice(&dot_avx512::<4>(codes, scales, [xs[0], xs[1], xs[2], xs[3]])),
                    3 => out.copy_from_slice(&dot_avx512::<3>(codes, scales, [xs[0], xs[1], xs[2]])),
                    2 => out.copy_from_slice(&dot_avx512::<2>(codes, scales, [xs[0], xs[1]])),
                    _ => out.copy_from_slice(&dot_avx512::<1>(codes, scales, [xs[0]])),
                }
            }
        }
        return;
    }
    let _ = simd;
    for (x, o) in xs.iter().zip(out) {
        *o = dot_portable(codes, scales, x);
    }
}

/// The portable path, block by block in the same layout.
fn dot_portable(codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, (block, scale)) in codes.chunks_exact(BLOCK / 2).zip(scales).enumerate() {
        let xc = &x[b / 16 * CHUNK + b % 16..];
        let mut sum = 0f32;
        for (i, byte) in block.iter().enumerate() {
            let (h, n) = (i / 4, 2 * (i % 4)); // elements 2i and 2i+1 of the block: half h, nibbles n and n+1
            sum += E2M1[(byte & 15) as usize] * xc[h * 128 + n * 16]
                + E2M1[(byte >> 4) as usize] * xc[h * 128 + (n + 1) * 16];
        }
        acc += sum * E4M3[*scale as usize];
    }
    acc
}

/// How far ahead of the chunk being read the AVX-512 loop prefetches (bytes): the hardware prefetcher alone leaves
/// the loop waiting on memory part of the time (measured: about 7 GB/s from memory on one core, 9 with these; the
/// rows a task reads are consecutive, so the lines ahead are the next rows'). A prefetch never faults, so the
/// addresses may run past the bank.
const PREFETCH_CODES: usize = 2048;
const PREFETCH_SCALES: usize = 512;

/// Prefetches what chunk `c` of the row is `PREFETCH_CODES` / `PREFETCH_SCALES` bytes ahead of.
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn prefetch_chunk(codes: &[u8], scales: &[u8], c: usize) {
    let codes = codes.as_ptr().wrapping_add(c * 128 + PREFETCH_CODES);
    for p in [codes, codes.wrapping_add(64), scales.as_ptr().wrapping_add(c * 16 + PREFETCH_SCALES)] {
        // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults, whatever the address
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8) }
    }
}

/// A chunk's 128 code bytes (`lo`, `hi`) as two vectors whose lane d belongs to block d: its first half (elements
/// 0..8, dword 2d of (lo, hi)) and its second (dword 2d + 1). Both NVFP4 kernels start a chunk with it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn by_block(
    lo: std::arch::x86_64::__m512i,
    hi: std::arch::x86_64::__m512i,
) -> (std::arch::x86_64::__m512i, std::arch::x86_64::__m512i) {
    use std::arch::x86_64::*;
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let first = _mm512_permutex2var_epi32(lo, even, hi);
    (first, _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi))
}

/// One chunk: `$lo`, `$hi` its 128 code bytes, `$scales` its 16 scale bytes; each x's 256 laid-out elements at
/// `$at`. Adds `scales * (per-block dot products)` to `$acc[t]`, lane d for block d. A macro, not a function: with
/// four tokens LLVM left a function out of line (its vectors through memory), and `#[inline(always)]` is not
/// allowed on `#[target_feature]` functions.
#[cfg(target_arch = "x86_64")]
macro_rules! chunk {
    ($lo:expr, $hi:expr, $scales:expr, $xs:expr, $at:expr, $lut:expr, $acc:expr) => {{
        let (first, second) = crate::nvfp4_dot::by_block($lo, $hi);
        // nibble n of a half times each x's vector of (half, n); four sums a token, so the FMA chains are short
        let mut sums = [[_mm512_setzero_ps(); 4]; N];
        macro_rules! nibble {
            ($n:literal) => {
                let a = _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $n }>(first), $lut);
                let b = _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $n }>(second), $lut);
                for t in 0..N {
                    let x = $xs[t].as_ptr().add($at);
                    sums[t][$n % 2] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x.add(16 * $n)), sums[t][$n % 2]);
                    sums[t][2 + $n % 2] =
                        _mm512_fmadd_ps(b, _mm512_loadu_ps(x.add(128 + 16 * $n)), sums[t][2 + $n % 2]);
                }
            };
        }
        nibble!(0);
        nibble!(1);
        nibble!(2);
        nibble!(3);
        nibble!(4);
        nibble!(5);
        nibble!(6);
        nibble!(7);
        let s = crate::e4m3::decode16_avx512($scales);
        for t in 0..N {
            let [p, q, r, u] = sums[t];
            $acc[t] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(p, q), _mm512_add_ps(r, u)), s, $acc[t]);
        }
    }};
}

/// One row's walk over its chunks, shared by both NVFP4 kernels (this one and `nvfp4_int16_dot.rs`): each whole
/// chunk with a prefetch of the ones ahead, then the last, partial chunk, whose code dwords past the row's end are
/// masked off (never read, read as code 0) and whose missing scales are 0 (x is zero there); then each token's sum.
/// `$chunk` is the kernel's chunk macro, `$lut` its code table, `$acc` its `N` accumulators. Expands to `[f32; N]`.
#[cfg(target_arch = "x86_64")]
macro_rules! walk_row {
    ($chunk:ident, $codes:expr, $scales:expr, $xs:expr, $lut:expr, $acc:ident) => {{
        let (codes, scales): (&[u8], &[u8]) = ($codes, $scales);
        let blocks = scales.len();
        let full = blocks / 16;
        for c in 0..full {
            // in bounds: chunk c is whole (128 code bytes, 16 scale bytes)
            let lo = _mm512_loadu_si512(codes.as_ptr().add(c * 128) as *const __m512i);
            let hi = _mm512_loadu_si512(codes.as_ptr().add(c * 128 + 64) as *const __m512i);
            let s = _mm_loadu_si128(scales.as_ptr().add(c * 16) as *const __m128i);
            crate::nvfp4_dot::prefetch_chunk(codes, scales, c);
            $chunk!(lo, hi, s, $xs, c * CHUNK, $lut, $acc);
        }
        let rest = blocks - full * 16;
        if rest > 0 {
            let dwords = 2 * rest;
            let base = codes.as_ptr().add(full * 128);
            let lo = _mm512_maskz_loadu_epi32(((1u32 << dwords.min(16)) - 1) as u16, base as *const i32);
            let hi_mask = ((1u32 << dwords.saturating_sub(16)) - 1) as u16;
            // the high half's address is only formed when some of it is in the row
            let hi = if hi_mask == 0 {
                _mm512_setzero_si512()
            } else {
                _mm512_maskz_loadu_epi32(hi_mask, base.add(64) as *const i32)
            };
            let mut tail = [0u8; 16];
            tail[..rest].copy_from_slice(&scales[full * 16..]);
            let s = _mm_loadu_si128(tail.as_ptr() as *const __m128i);
            $chunk!(lo, hi, s, $xs, full * CHUNK, $lut, $acc);
        }
        let mut out = [0f32; N];
        for t in 0..N {
            out[t] = _mm512_reduce_add_ps($acc[t]);
        }
        out
    }};
}
#[cfg(target_arch = "x86_64")]
pub(crate) use walk_row;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn dot_avx512<const N: usize>(codes: &[u8], scales: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    use std::arch::x86_64::*;
    let lut = _mm512_loadu_ps(E2M1.as_ptr());
    let mut acc = [_mm512_setzero_ps(); N];
    walk_row!(chunk, codes, scales, xs, lut, acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn simd() -> bool {
        cfg!(target_arch = "x86_64") && crate::executor::has_avx512()
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
    fn simd_equals_portable_and_the_plain_sum() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for k in [16usize, 32, 128, 144, 240, 256, 272, 512, 2048, 2064, 4096 + 128] {
            let codes: Vec<u8> = (0..k / 2).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..k / 16).map(|_| rng.gen_range(0..0x7F)).collect();
            let xs: Vec<Vec<f32>> = (0..6).map(|_| (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect()).collect();
            let laid: Vec<Vec<f32>> = xs
                .iter()
                .map(|x| {
                    let mut l = vec![0f32; k.div_ceil(CHUNK) * CHUNK];
                    x.iter().enumerate().for_each(|(j, v)| l[position(j)] = *v);
                    l
                })
                .collect();
            let size: f64 = scales.iter().map(|s| (E4M3[*s as usize] as f64).powi(2)).sum::<f64>().sqrt();
            let tol = 1e-5 * size * 6.0;
            for n in 1..=6 {
                let refs: Vec<&[f32]> = laid[..n].iter().map(|l| &l[..]).collect();
                let (mut portable, mut fast) = (vec![0f32; n], vec![0f32; n]);
                dot_many(&codes, &scales, &refs, &mut portable, false);
                dot_many(&codes, &scales, &refs, &mut fast, simd());
                for t in 0..n {
                    let plain: f64 = (0..k)
                        .map(|j| {
                            let code = (codes[j / 2] >> (4 * (j % 2))) & 15;
                            E2M1[code as usize] as f64 * E4M3[scales[j / 16] as usize] as f64 * xs[t][j] as f64
                        })
                        .sum();
                    let (p, f) = (portable[t], fast[t]);
                    assert!((p as f64 - plain).abs() < tol, "k={k} portable {p} vs {plain}");
                    assert!(((f - p) as f64).abs() < tol, "k={k} simd {f} vs {p}");
                }
            }
        }
    }
}
