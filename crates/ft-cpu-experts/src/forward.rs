//! `experts_forward`: one MoE layer's routed experts for a few tokens, in two phases on the executor's pool.
//!
//! Phase 1, gate|up: a task per (expert, chunk of the I gate rows) computes those gate rows and the matching up rows
//! for every token routed to the expert and writes `silu(gate) * up`. The activations are then laid out a vector a
//! pair for the down kernels. Phase 2, down: a task per chunk of the H output rows goes over every expert's down
//! rows of that chunk and accumulates `weight * value` into `out`, so no two threads write one element of `out` and
//! nothing is summed after. Every output buffer is cut into the tasks' disjoint slices beforehand (`pool.rs` runs
//! the tasks; x is laid out for the kernels first, `matrix.rs`).

use crate::executor::{Form, Scratch};
use crate::matrix::{Layout, Matrix, Vectors};
use crate::nvfp4_dot::BLOCK;
use crate::nvfp4_int16_dot::{quantize, Quantized};
use crate::plan::{group_by_expert, rows_per_task, Group};
use crate::pool::Pool;
use crate::{Bank, Executor, Pair, Shape};
use std::time::Instant;

/// `out[t] += sum over pairs (t, e, w) of w * down_e(silu(gate_e x_t) * up_e x_t)`, in f32.
///
/// `x` is `[T, H]` BF16 bits, `out` `[T, H]` f32. Every length, token and expert is checked first; an error
/// leaves `out` as it was.
pub fn experts_forward(
    bank: &Bank,
    shape: Shape,
    x: &[u16],
    pairs: &[Pair],
    out: &mut [f32],
    exec: &Executor,
) -> Result<(), String> {
    bank.check(shape)?;
    let (h, i) = (shape.hidden, shape.intermediate);
    if !x.len().is_multiple_of(h) {
        return Err(format!("x has {} elements, not a whole number of rows of hidden size {h}", x.len()));
    }
    let tokens = x.len() / h;
    if out.len() != x.len() {
        return Err(format!("out has {} elements, x {} (both [T, H])", out.len(), x.len()));
    }
    if let Some((n, p)) = pairs.iter().enumerate().find(|(_, p)| p.token as usize >= tokens) {
        return Err(format!("pair {n}: token {} is outside the {tokens} tokens of x", p.token));
    }
    if let Some((n, p)) = pairs.iter().enumerate().find(|(_, p)| p.expert as usize >= shape.experts) {
        return Err(format!("pair {n}: expert {} is outside the bank's {} experts", p.expert, shape.experts));
    }
    if pairs.is_empty() {
        return Ok(());
    }
    let start = Instant::now();
    let layout = bank.layout();
    let (order, groups) = group_by_expert(pairs);
    let mut scratch = exec.scratch.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let Scratch { x: x_f32, x_bf16, x_i16, x_factors, act, act_laid, act_bf16, act_i16, act_factors } = &mut *scratch;
    let (hp, ip, np) = (layout.padded(h), layout.padded(i), pairs.len());
    act.resize(np * i, 0.0);
    let threads = exec.threads();
    let rows1 = rows_per_task(i, groups.len(), threads);
    let run = Run { bank, shape, pairs, order: &order, simd: exec.simd() };
    let pool = &exec.pool;
    let form = exec.kernels.form(layout);
    // x as the gate|up kernels take it: int16 blocks (NVFP4 on VNNI), BF16 bits as they are (BF16 on AVX512-BF16),
    // else f32
    let grouped = Instant::now();
    let x_laid = match form {
        Form::Int16 => {
            let values = x_i16.first(tokens * hp);
            x_factors.resize(tokens * hp / BLOCK, 0.0);
            let to_quantize: Vec<_> =
                values.chunks_mut(hp).zip(x_factors.chunks_mut(hp / BLOCK)).zip(x.chunks(h)).collect();
            pool.for_each(to_quantize, |((v, f), src)| quantize(h, src.iter().map(|b| bf16_to_f32(*b)), v, f));
            Laid::Int16 { values, factors: x_factors }
        }
        Form::Bf16 => {
            x_bf16.resize(tokens * hp, 0);
            let to_lay_out: Vec<_> = x_bf16.chunks_mut(hp).zip(x.chunks(h)).collect();
            pool.for_each(to_lay_out, |(dst, src)| Layout::Bf16Pairs.lay_out(h, src.iter().copied(), dst));
            Laid::Bf16(x_bf16)
        }
        Form::F32 => {
            x_f32.resize(tokens * hp, 0.0);
            let to_lay_out: Vec<_> = x_f32.chunks_mut(hp).zip(x.chunks(h)).collect();
            pool.for_each(to_lay_out, |(dst, src)| layout.lay_out(h, src.iter().map(|b| bf16_to_f32(*b)), dst));
            Laid::F32(x_f32)
        }
    };
    let x_done = Instant::now();
    run.gate_up(pool, &groups, rows1, &x_laid, hp, act);
    let gate_up_done = Instant::now();
    // the activations by pair, laid out for the down kernels. Outside the f32 form they are rounded to BF16, as the
    // GPU's kernels round their intermediate rows. Pair q's, in order: chunk a's region is [np, len] from np * a, so
    // its run there is contiguous
    let act: &[f32] = act;
    let row = move |q: usize| {
        (0..i).step_by(rows1).flat_map(move |a| {
            let len = rows1.min(i - a);
            act[np * a + q * len..][..len].iter().copied()
        })
    };
    let acts = match form {
        Form::Int16 => {
            let values = act_i16.first(np * ip);
            act_factors.resize(np * ip / BLOCK, 0.0);
            let to_quantize: Vec<_> =
                values.chunks_mut(ip).zip(act_factors.chunks_mut(ip / BLOCK)).enumerate().collect();
            let rounded = |q| row(q).map(|v| bf16_to_f32(round_to_bf16(v)));
            pool.for_each(to_quantize, |(q, (v, f))| quantize(i, rounded(q), v, f));
            Laid::Int16 { values, factors: act_factors }
        }
        Form::Bf16 => {
            act_bf16.resize(np * ip, 0);
            let to_lay_out: Vec<_> = act_bf16.chunks_mut(ip).enumerate().collect();
            pool.for_each(to_lay_out, |(q, dst)| Layout::Bf16Pairs.lay_out(i, row(q).map(round_to_bf16), dst));
            Laid::Bf16(act_bf16)
        }
        Form::F32 => {
            act_laid.resize(np * ip, 0.0);
            let to_lay_out: Vec<_> = act_laid.chunks_mut(ip).enumerate().collect();
            pool.for_each(to_lay_out, |(q, dst)| layout.lay_out(i, row(q), dst));
            Laid::F32(act_laid)
        }
    };
    let acts_done = Instant::now();
    run.down(pool, &groups, rows_per_task(h, 1, threads), &acts, ip, out, tokens);
    exec.times.record(start, [grouped, x_done, gate_up_done, acts_done, Instant::now()]);
    Ok(())
}

fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// BF16 bits of `v`, rounded to nearest even (the activations are finite).
pub(crate) fn round_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) as u16
}

/// Every token's x, or every pair's activations, laid out (`[rows, padded]`; int16 factors `[rows, padded / 16]`).
enum Laid<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Int16 { values: &'a [i16], factors: &'a [f32] },
}

impl<'a> Laid<'a> {
    /// The vectors of these rows (tokens of x, pairs of the activations).
    fn tokens(&self, tokens: impl Iterator<Item = usize>, hp: usize) -> Vectors<'a> {
        match *self {
            Laid::F32(x) => Vectors::F32(tokens.map(|t| &x[t * hp..(t + 1) * hp]).collect()),
            Laid::Bf16(x) => Vectors::Bf16(tokens.map(|t| &x[t * hp..(t + 1) * hp]).collect()),
            Laid::Int16 { values, factors } => Vectors::Int16(
                tokens
                    .map(|t| Quantized {
                        values: &values[t * hp..(t + 1) * hp],
                        factors: &factors[t * hp / BLOCK..(t + 1) * hp / BLOCK],
                    })
                    .collect(),
            ),
        }
    }
}

/// What both phases read.
struct Run<'a> {
    bank: &'a Bank<'a>,
    shape: Shape,
    pairs: &'a [Pair],
    order: &'a [usize],
    simd: bool,
}

fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

impl Run<'_> {
    /// Phase 1: `act`, cut by chunks of `rows` gate rows (chunk a: `[pairs, len]` at `pairs * a`, by group inside).
    fn gate_up(&self, pool: &Pool, groups: &[Group], rows: usize, x_laid: &Laid, hp: usize, act: &mut [f32]) {
        let i = self.shape.intermediate;
        let mut tasks = Vec::with_capacity(groups.len() * i.div_ceil(rows));
        let mut rest = act;
        for a in (0..i).step_by(rows) {
            let len = rows.min(i - a);
            for g in groups {
                let (region, tail) = rest.split_at_mut((g.end - g.start) * len);
                rest = tail;
                tasks.push((g, a, len, region));
            }
        }
        pool.for_each(tasks, |(g, a, len, region)| {
            // a row at a time, for all the expert's tokens at once; the gate rows, then the up rows: the task reads
            // two linear runs of memory (rows read interleaved came in at under half the rate on the first host)
            let m = self.bank.gate_up(g.expert, self.shape);
            let xs = x_laid.tokens(self.order[g.start..g.end].iter().map(|&p| self.pairs[p].token as usize), hp);
            let n = xs.len();
            let mut values = vec![0f32; len * n];
            for (part, first) in [(0, a), (1, i + a)] {
                m.dot_rows(first, &xs, &mut values, self.simd);
                for (r, row) in values.chunks(n).enumerate() {
                    for (q, v) in row.iter().enumerate() {
                        let o = &mut region[q * len + r];
                        *o = if part == 0 { *v } else { silu(*o) * v };
                    }
                }
            }
        });
    }

    /// Phase 2: `out[t, rows of the chunk] += weight * down rows . act` for every pair, a task per chunk of `rows`.
    #[allow(clippy::too_many_arguments)]
    fn down(&self, pool: &Pool, groups: &[Group], rows: usize, acts: &Laid, ip: usize, out: &mut [f32], tokens: usize) {
        let h = self.shape.hidden;
        // out's pieces ordered by chunk, then token: a task takes `tokens` consecutive ones
        let mut by_token: Vec<_> = out.chunks_mut(h).map(|row| row.chunks_mut(rows)).collect();
        let mut pieces: Vec<&mut [f32]> = Vec::with_capacity(tokens * h.div_ceil(rows));
        for _ in 0..h.div_ceil(rows) {
            pieces.extend(by_token.iter_mut().map(|row| row.next().expect("one piece a chunk")));
        }
        pool.for_each(pieces.chunks_mut(tokens).enumerate().collect(), |(c, outs): (usize, &mut [&mut [f32]])| {
            let (a, len) = (c * rows, outs[0].len());
            for g in groups {
                self.down_group(self.bank.down(g.expert, self.shape), g, a, len, acts, ip, outs);
            }
        });
    }

    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // r: a row of every token's piece
    fn down_group(&self, m: Matrix, g: &Group, a: usize, len: usize, acts: &Laid, ip: usize, outs: &mut [&mut [f32]]) {
        let xs = acts.tokens(g.start..g.end, ip);
        let mut values = vec![0f32; len * xs.len()];
        m.dot_rows(a, &xs, &mut values, self.simd);
        for (r, row) in values.chunks(xs.len()).enumerate() {
            for (q, v) in (g.start..g.end).zip(row) {
                let p = &self.pairs[self.order[q]];
                outs[p.token as usize][r] += p.weight * v;
            }
        }
    }
}
