//! `ft-cpu-experts`: Mixture-of-Experts routed experts computed on the host CPU for a few tokens (decode), reading
//! the expert weights where they live in (pinned) host memory. The first piece of `--moe-backend hybrid|cpu`:
//! an expert the GPU's cache misses is computed here instead of fetched over PCIe.
//!
//! A decode-sized expert step is a few GEMVs over weights that are not in any cache, so it is bound by how fast
//! the host reads memory. torch's CPU BF16 matmul reads expert weights at about a third of the host's bandwidth;
//! these kernels aim at all of it: BF16 rows become f32 with a shift and a mask (`bf16_dot.rs`), NVFP4 rows decode
//! 16 E2M1 codes with one `_mm512_permutexvar_ps` and one E4M3 scale a block (`nvfp4_dot.rs`), on AVX-512 where
//! the CPU has it (detected at run time) and portable Rust elsewhere. A task reads its rows one after another (one
//! linear run of memory, which the prefetchers follow) and decodes each row once for all the tokens routed to the
//! expert.
//!
//! ```text
//! experts_forward(bank, shape, x [T, H] bf16, pairs [(token, expert, weight)], out [T, H] f32, executor)
//!     out[t] += weight * down_e(silu(gate_e x_t) * up_e x_t)     for every pair (t, e, weight), in f32
//! ```
//!
//! Where the CPU has VNNI, NVFP4 rows decode to exact int16 (twice the E2M1 values) and meet x cut into int16 blocks
//! (`vpdpwssd`); where it has AVX512-BF16, BF16 rows take the BF16 dot-product instruction. On both the activations
//! `silu(gate) * up` are rounded to BF16 before the down projection, as the GPU's kernels round their intermediate
//! rows.
//!
//! - `bank.rs`: `Bank` (BF16 `gate_up [E, 2I, H]` and `down [E, H, I]`, or NVFP4 in ModelOpt's layout: codes, E4M3
//!   block scales, per-row globals), each tensor a slice with its expert stride; `Shape`.
//! - `executor.rs`: `Executor`, the thread pool (keep one: every layer shares it), the kernel path, the scratch.
//! - `pool.rs`: the threads, with the caller's, and the low-latency hand-off a decode step needs.
//! - `call_times.rs`: where calls spend their time, by phase, and the pool's hand-off (for benchmarks).
//! - `forward.rs`: the two phases (gate|up by expert and row chunk, then down by chunk of output rows).
//! - `plan.rs`: pairs grouped by expert (each expert's rows read once for all its tokens), rows cut into tasks.
//! - `matrix.rs`: one expert's projection and the layout of the vectors its kernels take.
//! - `bf16_dot.rs`, `nvfp4_dot.rs`, `nvfp4_int16_dot.rs`, `e4m3.rs`: the kernels and the scale decoding.
//! - `aligned.rs`: the int16 vectors' buffers, on whole cache lines.
//!
//! NVFP4 banks need H and I to be multiples of 16 (one scale block); BF16 banks take any size.

mod aligned;
mod bank;
mod bf16_dot;
mod call_times;
mod e4m3;
mod executor;
mod forward;
mod matrix;
mod nvfp4_dot;
mod nvfp4_int16_dot;
mod plan;
mod pool;

pub use bank::{Bank, Nvfp4Projection, Shape, Strided};
pub use call_times::{CallTimesTaken, PHASES};
pub use executor::{Executor, Kernels};
pub use forward::experts_forward;

/// One routed (token, expert) pair of a step: token `token` of x goes through expert `expert`, its output scaled by
/// `weight`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pair {
    pub token: u32,
    pub expert: u32,
    pub weight: f32,
}

#[cfg(test)]
mod tests;
