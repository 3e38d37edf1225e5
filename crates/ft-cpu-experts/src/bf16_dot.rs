//! Dot products of a BF16 weight row with a few vectors (the tokens routed to one expert): the row is read and
//! converted once for all of them.
//!
//! f32 x (`dot_many`) is laid out for the kernel (`position`): each chunk of 32 elements as its 16 even elements,
//! then its 16 odd ones, zero-padded to whole chunks. A 64-byte load of 32 BF16 weights is 16 dwords of (even, odd)
//! pairs: the even weights become f32 with a left shift by 16, the odd ones with a mask, so the AVX-512 loop has no
//! shuffle at all. BF16 x (`dot_many_bf16`, the gate|up projection's input as it is, on AVX512-BF16) stays in
//! order, zero-padded: `_mm512_dpbf16_ps` multiplies the 32 weights of a load by it directly (products of two BF16
//! are exact in f32), twice the multiply-adds an instruction.

/// Elements per chunk of x's layout.
pub(crate) const CHUNK: usize = 32;

/// Where element `j` of x goes in the kernel's layout.
pub(crate) fn position(j: usize) -> usize {
    j / CHUNK * CHUNK + (j % 2) * (CHUNK / 2) + (j % CHUNK) / 2
}

fn to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `out[t] = dot(row, xs[t])`: `row` `k` BF16 weights, each x laid out (`position`) and at least `k` rounded up to
/// a chunk.
pub(crate) fn dot_many(row: &[u16], xs: &[&[f32]], out: &mut [f32], simd: bool) {
    assert!(out.len() == xs.len() && xs.iter().all(|x| x.len() >= row.len().div_ceil(CHUNK) * CHUNK), "x lengths");
    #[cfg(target_arch = "x86_64")]
    if simd {
        // the tokens four at a time (as many FMA chains as fit the registers)
        for (xs, out) in xs.chunks(4).zip(out.chunks_mut(4)) {
            // SAFETY: `simd` is only set where the Executor detected avx512f and avx512bw; lengths checked above.
            unsafe {
                match xs.len() {
                    4 => out.copy_from_slice(&dot_avx512::<4>(row, [xs[0], xs[1], xs[2], xs[3]])),
                    3 => out.copy_from_slice(&dot_avx512::<3>(row, [xs[0], xs[1], xs[2]])),
                    2 => out.copy_from_slice(&dot_avx512::<2>(row, [xs[0], xs[1]])),
                    _ => out.copy_from_slice(&dot_avx512::<1>(row, [xs[0]])),
                }
            }
        }
        return;
    }
    let _ = simd;
    for (x, o) in xs.iter().zip(out) {
        *o = dot_portable(row, x);
    }
}

/// `out[t] = dot(row, xs[t])` with BF16 x, in order and zero-padded to whole chunks. Only where
/// `executor::has_avx512_bf16()`.
pub(crate) fn dot_many_bf16(row: &[u16], xs: &[&[u16]], out: &mut [f32]) {
    assert!(out.len() == xs.len() && xs.iter().all(|x| x.len() >= row.len().div_ceil(CHUNK) * CHUNK), "x lengths");
    assert!(crate::executor::has_avx512_bf16(), "AVX512-BF16 kernels on a CPU without them");
    #[cfg(target_arch = "x86_64")]
    for (xs, out) in xs.chunks(4).zip(out.chunks_mut(4)) {
        // SAFETY: the features are checked above, and the lengths.
        unsafe {
            match xs.len() {
                4 => out.copy_from_slice(&dot_bf16_avx512::<4>(row, [xs[0], xs[1], xs[2], xs[3]])),
                3 => out.copy_from_slice(&dot_bf16_avx512::<3>(row, [xs[0], xs[1], xs[2]])),
                2 => out.copy_from_slice(&dot_bf16_avx512::<2>(row, [xs[0], xs[1]])),
                _ => out.copy_from_slice(&dot_bf16_avx512::<1>(row, [xs[0]])),
            }
        }
    }
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
unsafe fn dot_avx512<const N: usize>(row: &[u16], xs: [&[f32]; N]) -> [f32; N] {
    use std::arch::x86_64::*;
    let k = row.len();
    let full = k / CHUNK;
    // two chunks a step into separate sums: four FMA chains a token
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let mut c = 0;
    while c + 2 <= full {
        // in bounds: chunks c and c+1 are whole
        let w0 = _mm512_loadu_si512(row.as_ptr().add(c * CHUNK) as *const __m512i);
        let w1 = _mm512_loadu_si512(row.as_ptr().add((c + 1) * CHUNK) as *const __m512i);
        accumulate(w0, xs, c * CHUNK, &mut acc, 0);
        accumulate(w1, xs, (c + 1) * CHUNK, &mut acc, 2);
        c += 2;
    }
    if c < full {
        let w = _mm512_loadu_si512(row.as_ptr().add(c * CHUNK) as *const __m512i);
        accumulate(w, xs, c * CHUNK, &mut acc, 0);
    }
    let rest = k - full * CHUNK;
    if rest > 0 {
        // the last, partial chunk: the weights past the row's end are masked off (never read), x is zero there
        let w = _mm512_maskz_loadu_epi16((1u32 << rest) - 1, row.as_ptr().add(full * CHUNK) as *const i16);
        accumulate(w, xs, full * CHUNK, &mut acc, 2);
    }
    let mut out = [0f32; N];
    for t in 0..N {
        let [a, b, c, d] = acc[t];
        out[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_bf16_avx512<const N: usize>(row: &[u16], xs: [&[u16]; N]) -> [f32; N] {
    use std::arch::x86_64::*;
    let k = row.len();
    let full = k / CHUNK;
    // two chunks a step into separate sums: two dot-product chains a token
    let mut acc = [[_mm512_setzero_ps(); 2]; N];
    let mut c = 0;
    while c + 2 <= full {
        // in bounds: chunks c and c+1 are whole
        let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(row.as_ptr().add(c * CHUNK) as *const __m512i));
        let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(row.as_ptr().add((c + 1) * CHUNK) as *const __m512i));
        for t in 0..N {
            let x = xs[t].as_ptr().add(c * CHUNK);
            let x0: __m512bh = std::mem::transmute(_mm512_loadu_si512(x as *const __m512i));
            let x1: __m512bh = std::mem::transmute(_mm512_loadu_si512(x.add(CHUNK) as *const __m512i));
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, x0);
            acc[t][1] = _mm512_dpbf16_ps(acc[t][1], w1, x1);
        }
        c += 2;
    }
    // the odd chunk and the partial one: the weights past the row's end are masked off (never read), x is zero there
    while c * CHUNK < k {
        let mask: __mmask32 = if k - c * CHUNK >= CHUNK { u32::MAX } else { (1u32 << (k - c * CHUNK)) - 1 };
        let w: __m512bh =
            std::mem::transmute(_mm512_maskz_loadu_epi16(mask, row.as_ptr().add(c * CHUNK) as *const i16));
        for t in 0..N {
            let x: __m512bh = std::mem::transmute(_mm512_loadu_si512(xs[t].as_ptr().add(c * CHUNK) as *const __m512i));
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w, x);
        }
        c += 1;
    }
    let mut out = [0f32; N];
    for t in 0..N {
        out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
    }
    out
}

/// One chunk: `w` its 32 weights; each x's chunk at `at` (16 even then 16 odd elements) into the token's (even,
/// odd) sums `acc[t][sums]`, `acc[t][sums + 1]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn accumulate<const N: usize>(
    w: std::arch::x86_64::__m512i,
    xs: [&[f32]; N],
    at: usize,
    acc: &mut [[std::arch::x86_64::__m512; 4]; N],
    sums: usize,
) {
    use std::arch::x86_64::*;
    let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
    let odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xFFFF_0000u32 as i32)));
    for t in 0..N {
        let x = xs[t].as_ptr().add(at);
        acc[t][sums] = _mm512_fmadd_ps(even, _mm512_loadu_ps(x), acc[t][sums]);
        acc[t][sums + 1] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x.add(16)), acc[t][sums + 1]);
    }
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
            let row: Vec<u16> = (0..k).map(|_| (rng.gen_range(-1.0f32..1.0).to_bits() >> 16) as u16).collect();
            let xs: Vec<Vec<f32>> = (0..6).map(|_| (0..k).map(|_| rng.gen_range(-1.0..1.0)).collect()).collect();
            let laid: Vec<Vec<f32>> = xs
                .iter()
                .map(|x| {
                    let mut l = vec![0f32; k.div_ceil(CHUNK) * CHUNK];
                    x.iter().enumerate().for_each(|(j, v)| l[position(j)] = *v);
                    l
                })
                .collect();
            // BF16 x (the same values) through the AVX512-BF16 kernel
            let in_order: Vec<Vec<u16>> = xs
                .iter()
                .map(|x| {
                    let mut l: Vec<u16> = x.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                    l.resize(k.div_ceil(CHUNK) * CHUNK, 0);
                    l
                })
                .collect();
            for n in 1..=6 {
                let refs: Vec<&[f32]> = laid[..n].iter().map(|l| &l[..]).collect();
                let (mut portable, mut fast) = (vec![0f32; n], vec![0f32; n]);
                dot_many(&row, &refs, &mut portable, false);
                dot_many(&row, &refs, &mut fast, simd());
                let mut bf16x = vec![0f32; n];
                if crate::executor::has_avx512_bf16() {
                    dot_many_bf16(&row, &in_order[..n].iter().map(|l| &l[..]).collect::<Vec<_>>(), &mut bf16x);
                }
                for t in 0..n {
                    if crate::executor::has_avx512_bf16() {
                        let plain: f64 =
                            row.iter().zip(&in_order[t]).map(|(w, x)| to_f32(*w) as f64 * to_f32(*x) as f64).sum();
                        let tol = 1e-5 * (1.0 + (k as f64).sqrt());
                        assert!((bf16x[t] as f64 - plain).abs() < tol, "k={k} bf16 x {} vs {plain}", bf16x[t]);
                    }
                    let plain: f64 = row.iter().zip(&xs[t]).map(|(w, x)| to_f32(*w) as f64 * *x as f64).sum();
                    let tol = 1e-5 * (1.0 + (k as f64).sqrt());
                    assert!((portable[t] as f64 - plain).abs() < tol, "k={k} portable {} vs {plain}", portable[t]);
                    assert!(((fast[t] - portable[t]) as f64).abs() <= tol, "k={k} simd {} vs {}", fast[t], portable[t]);
                }
            }
        }
    }
}
