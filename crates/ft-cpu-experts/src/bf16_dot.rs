//! Dot products of a BF16 weight row with an f32 vector.
//!
//! x is laid out for the kernel (`position`): each chunk of 32 elements as its 16 even elements, then its 16 odd
//! ones, zero-padded to whole chunks. A 64-byte load of 32 BF16 weights is 16 dwords of (even, odd) pairs: the even
//! weights become f32 with a left shift by 16, the odd ones with a mask, so the AVX-512 loop has no shuffle at all.

/// Elements per chunk of x's layout.
pub(crate) const CHUNK: usize = 32;

/// Where element `j` of x goes in the kernel's layout.
pub(crate) fn position(j: usize) -> usize {
    j / CHUNK * CHUNK + (j % 2) * (CHUNK / 2) + (j % CHUNK) / 2
}

fn to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `dot(row, x)`: `row` `k` BF16 weights, `x` laid out (`position`) and at least `k` rounded up to a chunk.
pub(crate) fn dot(row: &[u16], x: &[f32], simd: bool) -> f32 {
    assert!(x.len() >= row.len().div_ceil(CHUNK) * CHUNK, "x too short");
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: `simd` is only set where the Executor detected avx512f and avx512bw; x's length is checked above.
        return unsafe { dot_avx512(row, x) };
    }
    let _ = simd;
    dot_portable(row, x)
}

/// The portable path: 16 lanes of partial sums, as the AVX-512 one keeps them (LLVM vectorizes the lane loops).
fn dot_portable(row: &[u16], x: &[f32]) -> f32 {
    let (mut even, mut odd) = ([0f32; 16], [0f32; 16]);
    let full = row.len() / CHUNK;
    for (w, xc) in row.chunks_exact(CHUNK).zip(x.chunks_exact(CHUNK)) {
        for d in 0..CHUNK / 2 {
            even[d] += to_f32(w[2 * d]) * xc[d];
            odd[d] += to_f32(w[2 * d + 1]) * xc[CHUNK / 2 + d];
        }
    }
    let tail: f32 = (full * CHUNK..row.len()).map(|j| to_f32(row[j]) * x[position(j)]).sum();
    even.iter().zip(&odd).map(|(e, o)| e + o).sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn dot_avx512(row: &[u16], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let k = row.len();
    let full = k / CHUNK;
    // two chunks a step into separate sums: four FMA chains
    let (mut a, mut b) = ([_mm512_setzero_ps(); 2], [_mm512_setzero_ps(); 2]);
    let mut c = 0;
    while c + 2 <= full {
        // in bounds: chunks c and c+1 are whole
        let w0 = _mm512_loadu_si512(row.as_ptr().add(c * CHUNK) as *const __m512i);
        let w1 = _mm512_loadu_si512(row.as_ptr().add((c + 1) * CHUNK) as *const __m512i);
        accumulate(w0, x.as_ptr().add(c * CHUNK), &mut a);
        accumulate(w1, x.as_ptr().add((c + 1) * CHUNK), &mut b);
        c += 2;
    }
    if c < full {
        let w = _mm512_loadu_si512(row.as_ptr().add(c * CHUNK) as *const __m512i);
        accumulate(w, x.as_ptr().add(c * CHUNK), &mut a);
    }
    let rest = k - full * CHUNK;
    if rest > 0 {
        // the last, partial chunk: the weights past the row's end are masked off (never read), x is zero there
        let w = _mm512_maskz_loadu_epi16((1u32 << rest) - 1, row.as_ptr().add(full * CHUNK) as *const i16);
        accumulate(w, x.as_ptr().add(full * CHUNK), &mut b);
    }
    _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(b[0], b[1])))
}

/// One chunk: `w` its 32 weights, `x` its 16 even then 16 odd elements, into (even, odd) sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn accumulate(w: std::arch::x86_64::__m512i, x: *const f32, acc: &mut [std::arch::x86_64::__m512; 2]) {
    use std::arch::x86_64::*;
    let odd_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    acc[0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(w)), _mm512_loadu_ps(x), acc[0]);
    acc[1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, odd_mask)), _mm512_loadu_ps(x.add(16)), acc[1]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn simd() -> bool {
        cfg!(target_arch = "x86_64") && crate::executor::has_avx512()
    }

    #[test]
    fn simd_equals_portable_and_the_plain_sum() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for k in [1usize, 7, 16, 31, 32, 33, 64, 100, 2048, 2051] {
            let rows: Vec<Vec<u16>> = (0..4)
                .map(|_| (0..k).map(|_| (rng.gen_range(-1.0f32..1.0).to_bits() >> 16) as u16).collect())
                .collect();
            let xs: Vec<f32> = (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut laid = vec![0f32; k.div_ceil(CHUNK) * CHUNK];
            for (j, v) in xs.iter().enumerate() {
                laid[position(j)] = *v;
            }
            for row in &rows {
                let (portable, fast) = (dot(row, &laid, false), dot(row, &laid, simd()));
                let plain: f64 = row.iter().zip(&xs).map(|(w, x)| to_f32(*w) as f64 * *x as f64).sum();
                let tol = 1e-5 * (1.0 + (k as f64).sqrt());
                assert!((portable as f64 - plain).abs() < tol, "k={k} portable {portable} vs {plain}");
                assert!(((fast - portable) as f64).abs() <= tol, "k={k} simd {fast} vs {portable}");
            }
        }
    }
}
