//! A MoE layer's expert bank as the executor reads it: the tensors where they live, one expert per index of their
//! leading dim, checked against the layer's shape once a call.

use crate::matrix::{Layout, Matrix};

/// A layer's sizes: `experts` (E), `hidden` (H), `intermediate` (I).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub experts: usize,
    pub hidden: usize,
    pub intermediate: usize,
}

/// One tensor of a bank: expert `e`'s elements (row-major, contiguous) start at `data[e * expert_stride]`. The
/// stride is the tensor's `stride(0)`: the expert size for a plain `[E, ...]` tensor, more for views into rows of a
/// wider layout (`python/freetoken/moe/nvfp4_rows.py`, the offload host bank of NVFP4 experts).
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a, T> {
    pub data: &'a [T],
    pub expert_stride: usize,
}

impl<'a, T> Strided<'a, T> {
    /// A plain `[experts, ...]` tensor.
    pub fn contiguous(data: &'a [T], experts: usize) -> Self {
        Strided { data, expert_stride: data.len() / experts.max(1) }
    }

    /// That `experts` experts of `per_expert` elements each are inside `data`.
    fn check(&self, name: &str, experts: usize, per_expert: usize) -> Result<(), String> {
        let span = (experts - 1).checked_mul(self.expert_stride).and_then(|s| s.checked_add(per_expert));
        let (stride, len) = (self.expert_stride, self.data.len());
        match span {
            Some(span) if span <= len => Ok(()),
            _ => Err(format!(
                "{name}: {experts} experts of {per_expert} elements at stride {stride} need more than {len}"
            )),
        }
    }

    fn expert(&self, e: usize, per_expert: usize) -> &'a [T] {
        &self.data[e * self.expert_stride..e * self.expert_stride + per_expert]
    }
}

/// One NVFP4 projection of every expert (`[E, N, K]` weights): `codes` u8 `[E, N, K/2]` (element 2j in the low
/// nibble of byte j), `scales` E4M3 bits `[E, N, K/16]`, `globals` f32 `[E, N]`.
/// `W[e, n, k] = e2m1(code) * e4m3(scales[e, n, k / 16]) * globals[e, n]`.
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4Projection<'a> {
    pub codes: Strided<'a, u8>,
    pub scales: Strided<'a, u8>,
    pub globals: Strided<'a, f32>,
}

impl<'a> Nvfp4Projection<'a> {
    fn check(&self, name: &str, experts: usize, rows: usize, k: usize) -> Result<(), String> {
        self.codes.check(name, experts, rows * k / 2)?;
        self.scales.check(&format!("{name}_scale"), experts, rows * k / 16)?;
        self.globals.check(&format!("{name}_global"), experts, rows)
    }

    fn expert(&self, e: usize, rows: usize, k: usize) -> Matrix<'a> {
        Matrix::Nvfp4 {
            codes: self.codes.expert(e, rows * k / 2),
            scales: self.scales.expert(e, rows * k / 16),
            globals: self.globals.expert(e, rows),
            k,
        }
    }
}

/// A layer's routed experts. `gate_up` is `[E, 2I, H]` (rows: gate 0..I, then up I..2I), `down` `[E, H, I]`.
#[derive(Clone, Copy, Debug)]
pub enum Bank<'a> {
    /// BF16 weights as their bits.
    Bf16 { gate_up: Strided<'a, u16>, down: Strided<'a, u16> },
    /// NVFP4 (ModelOpt's layout); H and I must be multiples of 16 (one scale block).
    Nvfp4 { gate_up: Nvfp4Projection<'a>, down: Nvfp4Projection<'a> },
}

impl<'a> Bank<'a> {
    /// That the shape is one this bank's format supports and every tensor holds every expert.
    pub fn check(&self, shape: Shape) -> Result<(), String> {
        let Shape { experts: e, hidden: h, intermediate: i } = shape;
        if e == 0 || h == 0 || i == 0 {
            return Err(format!("empty layer shape: {e} experts, hidden {h}, intermediate {i}"));
        }
        // every size below is at most this product
        if [h, i, 2].iter().try_fold(e, |acc, v| acc.checked_mul(*v)).is_none_or(|n| n > isize::MAX as usize) {
            return Err(format!("layer shape too large: {e} experts, hidden {h}, intermediate {i}"));
        }
        match self {
            Bank::Bf16 { gate_up, down } => {
                gate_up.check("gate_up", e, 2 * i * h)?;
                down.check("down", e, h * i)
            }
            Bank::Nvfp4 { gate_up, down } => {
                if h % 16 != 0 || i % 16 != 0 {
                    return Err(format!(
                        "NVFP4 experts need hidden ({h}) and intermediate ({i}) sizes divisible by 16"
                    ));
                }
                gate_up.check("w13", e, 2 * i, h)?;
                down.check("w2", e, h, i)
            }
        }
    }

    pub(crate) fn layout(&self) -> Layout {
        match self {
            Bank::Bf16 { .. } => Layout::Bf16,
            Bank::Nvfp4 { .. } => Layout::Nvfp4,
        }
    }

    /// Expert `e`'s gate|up projection `[2I, H]` (after `check`).
    pub(crate) fn gate_up(&self, e: usize, shape: Shape) -> Matrix<'a> {
        let (h, i) = (shape.hidden, shape.intermediate);
        match self {
            Bank::Bf16 { gate_up, .. } => Matrix::Bf16 { weights: gate_up.expert(e, 2 * i * h), k: h },
            Bank::Nvfp4 { gate_up, .. } => gate_up.expert(e, 2 * i, h),
        }
    }

    /// Expert `e`'s down projection `[H, I]` (after `check`).
    pub(crate) fn down(&self, e: usize, shape: Shape) -> Matrix<'a> {
        let (h, i) = (shape.hidden, shape.intermediate);
        match self {
            Bank::Bf16 { down, .. } => Matrix::Bf16 { weights: down.expert(e, h * i), k: i },
            Bank::Nvfp4 { down, .. } => down.expert(e, h, i),
        }
    }
}
