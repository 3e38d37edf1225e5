//! One expert's projection (`[rows, k]`, BF16 or NVFP4) and the layout of the vectors it multiplies.

use crate::nvfp4_int16_dot::{self, Quantized};
use crate::{bf16_dot, nvfp4_dot};

/// How the f32 and BF16 kernels of a weight format want x laid out (`bf16_dot.rs`, `nvfp4_dot.rs` say why); `Bf16`
/// and `Nvfp4` also name the weight formats (`Bank::layout`). The int16 vectors are laid out as they are quantized
/// (`nvfp4_int16_dot::quantize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    Bf16,
    Nvfp4,
    /// BF16 rows times BF16 x (AVX512-BF16): x in order.
    Bf16Pairs,
}

impl Layout {
    fn chunk(self) -> usize {
        match self {
            Layout::Bf16 | Layout::Bf16Pairs => bf16_dot::CHUNK,
            Layout::Nvfp4 => nvfp4_dot::CHUNK,
        }
    }

    /// Length of a laid-out vector of `k` elements (whole chunks).
    pub(crate) fn padded(self, k: usize) -> usize {
        k.div_ceil(self.chunk()) * self.chunk()
    }

    /// Where element `j` goes.
    pub(crate) fn position(self, j: usize) -> usize {
        match self {
            Layout::Bf16 => bf16_dot::position(j),
            Layout::Bf16Pairs => j,
            Layout::Nvfp4 => nvfp4_dot::position(j),
        }
    }

    /// `dst[position(j)]` = the `j`-th of `values` for `j < k`; the padding zeroed. `dst.len() == padded(k)`.
    pub(crate) fn lay_out<T: Copy + Default>(self, k: usize, values: impl Iterator<Item = T>, dst: &mut [T]) {
        debug_assert_eq!(dst.len(), self.padded(k));
        dst[k - k % self.chunk()..].fill(T::default());
        for (j, v) in values.take(k).enumerate() {
            dst[self.position(j)] = v;
        }
    }
}

/// One expert's `[rows, k]` weights, row-major; `Nvfp4` with its per-row global scales.
#[derive(Clone, Copy)]
pub(crate) enum Matrix<'a> {
    Bf16 { weights: &'a [u16], k: usize },
    Nvfp4 { codes: &'a [u8], scales: &'a [u8], globals: &'a [f32], k: usize },
}

/// The vectors a row multiplies (a task's tokens), laid out for its kernels (`executor::Form`): f32, BF16 bits
/// (`Layout::Bf16Pairs`) or int16 blocks (`nvfp4_int16_dot::quantize`).
pub(crate) enum Vectors<'a> {
    F32(Vec<&'a [f32]>),
    Bf16(Vec<&'a [u16]>),
    Int16(Vec<Quantized<'a>>),
}

impl Vectors<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Vectors::F32(v) => v.len(),
            Vectors::Bf16(v) => v.len(),
            Vectors::Int16(v) => v.len(),
        }
    }
}

impl Matrix<'_> {
    /// `out[r * n + t] = dot(row first + r, xs[t])` for `out.len() / n` rows, `n = xs.len()`; `simd`: the AVX-512
    /// kernels (BF16 and int16 vectors always take the AVX512-BF16 and VNNI ones). The int16 kernel takes the rows
    /// in one call; the others a row at a time.
    pub(crate) fn dot_rows(&self, first: usize, xs: &Vectors, out: &mut [f32], simd: bool) {
        let n = xs.len();
        if n == 0 {
            return;
        }
        let rows = first..first + out.len() / n;
        match (*self, xs) {
            (Matrix::Nvfp4 { codes, scales, globals, k }, xs) => {
                let (kc, ks) = (k / 2, k / nvfp4_dot::BLOCK);
                let (c, s) = (&codes[rows.start * kc..rows.end * kc], &scales[rows.start * ks..rows.end * ks]);
                match xs {
                    Vectors::Int16(xs) => nvfp4_int16_dot::dot_rows(c, s, k, xs, out),
                    Vectors::F32(xs) => {
                        for ((c, s), out) in c.chunks(kc).zip(s.chunks(ks)).zip(out.chunks_mut(n)) {
                            nvfp4_dot::dot_many(c, s, xs, out, simd);
                        }
                    }
                    Vectors::Bf16(_) => unreachable!("NVFP4 rows take f32 or int16 vectors (Kernels::form)"),
                }
                for (out, global) in out.chunks_mut(n).zip(&globals[rows]) {
                    out.iter_mut().for_each(|o| *o *= global);
                }
            }
            (Matrix::Bf16 { weights, k }, Vectors::F32(xs)) => {
                for (row, out) in rows.zip(out.chunks_mut(n)) {
                    bf16_dot::dot_many(&weights[row * k..(row + 1) * k], xs, out, simd)
                }
            }
            (Matrix::Bf16 { weights, k }, Vectors::Bf16(xs)) => {
                for (row, out) in rows.zip(out.chunks_mut(n)) {
                    bf16_dot::dot_many_bf16(&weights[row * k..(row + 1) * k], xs, out)
                }
            }
            (Matrix::Bf16 { .. }, Vectors::Int16(_)) => {
                unreachable!("BF16 rows take f32 or BF16 vectors (Kernels::form)")
            }
        }
    }
}
