//! NVFP4 rows times BF16 vectors with AVX512-BF16's dot-product instruction: the gate|up projection, whose x is the
//! step's BF16 hidden state as it is (the down projection's input is f32 and goes through `nvfp4_dot.rs`).
//!
//! E2M1 values are exact in BF16 and so are their products with a BF16 x in f32, so `_mm512_dpbf16_ps` (32
//! products summed into 16 f32 lanes) computes what the f32 kernel does, in half the instructions: a code byte
//! pair (a 16-bit word: four codes) is shifted by 4m and looked up in a 32-entry `_mm512_permutexvar_epi16` table
//! (the permute reads the low 5 bits: the table is the 16 values twice), 32 weights at a time. The chunks, the
//! de-interleaving into A and B (lane d: block d) and the scales are `nvfp4_dot.rs`'s. In A, word 2d holds block
//! d's elements 0..4 and word 2d+1 its elements 4..8, so nibble m gives lane d elements m and 4+m; x is laid out to
//! match (`position`): chunk c's element `16d + 8h + 4s + m` (block d, half h, word s, nibble m) at
//! `256c + 128h + 32m + 2d + s`, zero-padded to whole chunks.

use crate::nvfp4_dot::{BLOCK, CHUNK, E2M1};

/// Where element `j` of x goes in the kernel's layout.
pub(crate) fn position(j: usize) -> usize {
    let (c, r) = (j / CHUNK, j % CHUNK);
    let (d, e) = (r / BLOCK, r % BLOCK);
    let (h, s, m) = (e / 8, e % 8 / 4, e % 4);
    c * CHUNK + h * 128 + m * 32 + 2 * d + s
}

/// Whether this CPU has the instruction (and the AVX-512 the rest of the kernel needs).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::executor::has_avx512() && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[t] = sum over blocks of scale * dot(codes, xs[t])` of one row, as `nvfp4_dot::dot_many`, each x BF16 bits
/// laid out (`position`). Only where `available()`.
pub(crate) fn dot_many(codes: &[u8], scales: &[u8], xs: &[&[u16]], out: &mut [f32]) {
    let blocks = scales.len();
    let padded = (blocks * BLOCK).div_ceil(CHUNK) * CHUNK;
    assert!(
        codes.len() == blocks * BLOCK / 2 && out.len() == xs.len() && xs.iter().all(|x| x.len() >= padded),
        "lengths"
    );
    assert!(available(), "AVX512-BF16 kernels on a CPU without them");
    #[cfg(target_arch = "x86_64")]
    for (xs, out) in xs.chunks(4).zip(out.chunks_mut(4)) {
        // SAFETY: the features are checked above, and the lengths.
        unsafe {
            match xs.len() {
                4 => out.copy_from_slice(&dot_avx512::<4>(codes, scales, [xs[0], xs[1], xs[2], xs[3]])),
                3 => out.copy_from_slice(&dot_avx512::<3>(codes, scales, [xs[0], xs[1], xs[2]])),
                2 => out.copy_from_slice(&dot_avx512::<2>(codes, scales, [xs[0], xs[1]])),
                _ => out.copy_from_slice(&dot_avx512::<1>(codes, scales, [xs[0]])),
            }
        }
    }
}

/// One chunk, as `nvfp4_dot`'s `chunk!` (a macro for the same reason).
#[cfg(target_arch = "x86_64")]
macro_rules! chunk {
    ($lo:expr, $hi:expr, $scales:expr, $xs:expr, $at:expr, $lut:expr, $acc:expr) => {{
        let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        let first = _mm512_permutex2var_epi32($lo, even, $hi);
        let second = _mm512_permutex2var_epi32($lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), $hi);
        let mut sums = [[_mm512_setzero_ps(); 4]; N];
        macro_rules! nibble {
            ($m:literal) => {
                let a: __m512bh =
                    std::mem::transmute(_mm512_permutexvar_epi16(_mm512_srli_epi16::<{ 4 * $m }>(first), $lut));
                let b: __m512bh =
                    std::mem::transmute(_mm512_permutexvar_epi16(_mm512_srli_epi16::<{ 4 * $m }>(second), $lut));
                for t in 0..N {
                    let x = $xs[t].as_ptr().add($at);
                    let xa: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.add(32 * $m) as *const __m512i));
                    let xb: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.add(128 + 32 * $m) as *const __m512i));
                    sums[t][$m % 2] = _mm512_dpbf16_ps(sums[t][$m % 2], a, xa);
                    sums[t][2 + $m % 2] = _mm512_dpbf16_ps(sums[t][2 + $m % 2], b, xb);
                }
            };
        }
        nibble!(0);
        nibble!(1);
        nibble!(2);
        nibble!(3);
        let s = crate::e4m3::decode16_avx512($scales);
        for t in 0..N {
            let [p, q, r, u] = sums[t];
            $acc[t] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(p, q), _mm512_add_ps(r, u)), s, $acc[t]);
        }
    }};
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_avx512<const N: usize>(codes: &[u8], scales: &[u8], xs: [&[u16]; N]) -> [f32; N] {
    use crate::nvfp4_dot::walk_row;
    use std::arch::x86_64::*;
    let mut table = [0u16; 32];
    for (i, t) in table.iter_mut().enumerate() {
        *t = (E2M1[i % 16].to_bits() >> 16) as u16; // exact: E2M1 values have two significant bits
    }
    let lut = _mm512_loadu_si512(table.as_ptr() as *const __m512i);
    let mut acc = [_mm512_setzero_ps(); N];
    walk_row!(chunk, codes, scales, xs, lut, acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

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
    fn equals_the_f32_kernel() {
        if !available() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for k in [16usize, 48, 256, 272, 512, 2048, 2064] {
            let codes: Vec<u8> = (0..k / 2).map(|_| rng.gen()).collect();
            let scales: Vec<u8> = (0..k / 16).map(|_| rng.gen_range(0..0x7F)).collect();
            let xs: Vec<Vec<u16>> = (0..6)
                .map(|_| (0..k).map(|_| (rng.gen_range(-1.0f32..1.0).to_bits() >> 16) as u16).collect())
                .collect();
            let pad = k.div_ceil(CHUNK) * CHUNK;
            let lay = |x: &Vec<u16>| {
                let (mut b, mut f) = (vec![0u16; pad], vec![0f32; pad]);
                for (j, v) in x.iter().enumerate() {
                    b[position(j)] = *v;
                    f[crate::nvfp4_dot::position(j)] = f32::from_bits((*v as u32) << 16);
                }
                (b, f)
            };
            let (bf, f32s): (Vec<_>, Vec<_>) = xs.iter().map(lay).unzip();
            let size: f64 = scales.iter().map(|s| (crate::e4m3::E4M3[*s as usize] as f64).powi(2)).sum::<f64>().sqrt();
            for n in 1..=6 {
                let (b, f): (Vec<&[u16]>, Vec<&[f32]>) = (0..n).map(|t| (&bf[t][..], &f32s[t][..])).unzip();
                let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
                dot_many(&codes, &scales, &b, &mut got);
                crate::nvfp4_dot::dot_many(&codes, &scales, &f, &mut want, false);
                for t in 0..n {
                    assert!(((got[t] - want[t]) as f64).abs() < 1e-5 * 6.0 * size, "k={k}: {} vs {}", got[t], want[t]);
                }
            }
        }
    }
}
