//! Dot products of NVFP4 weight rows (E2M1 codes and E4M3 block scales, ModelOpt's layout: element 2j in the low
//! nibble of byte j, one scale per 16 elements) with an f32 vector. The per-row global scale is the
//! caller's (`matrix.rs`).
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
static E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Where element `j` of x goes in the kernel's layout.
pub(crate) fn position(j: usize) -> usize {
    let (c, r) = (j / CHUNK, j % CHUNK);
    let (d, h, n) = (r / BLOCK, r % BLOCK / 8, r % 8);
    c * CHUNK + h * 128 + n * 16 + d
}

/// `sum over blocks of scale * dot(codes, x)` of one row: `codes` `k/2` bytes, `scales` `k/16` bytes (`k` a multiple
/// of 16), x laid out (`position`) and at least `k` rounded up to a chunk.
pub(crate) fn dot(codes: &[u8], scales: &[u8], x: &[f32], simd: bool) -> f32 {
    let blocks = scales.len();
    assert!(codes.len() == blocks * BLOCK / 2 && x.len() >= (blocks * BLOCK).div_ceil(CHUNK) * CHUNK, "lengths");
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only set where the Executor detected avx512f and avx512bw; the lengths are checked above.
        return unsafe { dot_avx512(codes, scales, x) };
    }
    let _ = simd;
    dot_portable(codes, scales, x)
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

#[cfg(target_arch = "x86_64")]
#[inline]
fn prefetch(p: *const u8) {
    // SAFETY: a prefetch is a hint: it reads nothing into the program and never faults, whatever the address
    unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn dot_avx512(codes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let blocks = scales.len();
    let full = blocks / 16;
    let lut = _mm512_loadu_ps(E2M1.as_ptr());
    let mut acc = _mm512_setzero_ps();
    for c in 0..full {
        // in bounds: chunk c is whole (128 code bytes, 16 scale bytes)
        let lo = _mm512_loadu_si512(codes.as_ptr().add(c * 128) as *const __m512i);
        let hi = _mm512_loadu_si512(codes.as_ptr().add(c * 128 + 64) as *const __m512i);
        let s = _mm_loadu_si128(scales.as_ptr().add(c * 16) as *const __m128i);
        prefetch(codes.as_ptr().wrapping_add(c * 128 + PREFETCH_CODES));
        prefetch(codes.as_ptr().wrapping_add(c * 128 + PREFETCH_CODES + 64));
        prefetch(scales.as_ptr().wrapping_add(c * 16 + PREFETCH_SCALES));
        acc = chunk(lo, hi, s, x.as_ptr().add(c * CHUNK), lut, acc);
    }
    let rest = blocks - full * 16;
    if rest > 0 {
        // the last, partial chunk: code dwords past the row's end are masked off (never read) and read as code 0,
        // the missing scales as 0, x is zero there
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
        acc = chunk(lo, hi, s, x.as_ptr().add(full * CHUNK), lut, acc);
    }
    _mm512_reduce_add_ps(acc)
}

/// One chunk: `lo`, `hi` its 128 code bytes, `scales` its 16 scale bytes, `x` its 256 laid-out elements. Returns
/// `acc + scales * (per-block dot products)`, lane d for block d.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn chunk(
    lo: std::arch::x86_64::__m512i,
    hi: std::arch::x86_64::__m512i,
    scales: std::arch::x86_64::__m128i,
    x: *const f32,
    lut: std::arch::x86_64::__m512,
    acc: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // dword 2d of (lo, hi) is block d's first half (elements 0..8), dword 2d+1 its second
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let first = _mm512_permutex2var_epi32(lo, even, hi);
    let second = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
    // nibble n of a half times x's vector of (half, n); four sums, so that the FMA chains are four deep
    let mut sums = [_mm512_setzero_ps(); 4];
    macro_rules! nibble {
        ($n:literal) => {
            let a = _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $n }>(first), lut);
            let b = _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $n }>(second), lut);
            sums[$n % 2] = _mm512_fmadd_ps(a, _mm512_loadu_ps(x.add(16 * $n)), sums[$n % 2]);
            sums[2 + $n % 2] = _mm512_fmadd_ps(b, _mm512_loadu_ps(x.add(128 + 16 * $n)), sums[2 + $n % 2]);
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
    let sum = _mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3]));
    _mm512_fmadd_ps(sum, crate::e4m3::decode16_avx512(scales), acc)
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
            let codes: Vec<Vec<u8>> = (0..4).map(|_| (0..k / 2).map(|_| rng.gen()).collect()).collect();
            let scales: Vec<Vec<u8>> = (0..4).map(|_| (0..k / 16).map(|_| rng.gen_range(0..0x7F)).collect()).collect();
            let xs: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut laid = vec![0f32; k.div_ceil(CHUNK) * CHUNK];
            for (j, v) in xs.iter().enumerate() {
                laid[position(j)] = *v;
            }
            for r in 0..4 {
                let portable = dot(&codes[r], &scales[r], &laid, false);
                let fast = dot(&codes[r], &scales[r], &laid, simd());
                let plain: f64 = (0..k)
                    .map(|j| {
                        let code = (codes[r][j / 2] >> (4 * (j % 2))) & 15;
                        E2M1[code as usize] as f64 * E4M3[scales[r][j / 16] as usize] as f64 * xs[j] as f64
                    })
                    .sum();
                let size: f64 = (0..k / 16).map(|b| (E4M3[scales[r][b] as usize] as f64).powi(2)).sum::<f64>().sqrt();
                let tol = 1e-5 * size * 6.0;
                assert!((portable as f64 - plain).abs() < tol, "k={k} portable {portable} vs {plain}");
                assert!(((fast - portable) as f64).abs() < tol, "k={k} simd {fast} vs {portable}");
            }
        }
    }
}
