//! `Executor`: the thread pool the experts run on, the kernels (AVX-512 or portable) and the scratch memory a call
//! reuses. Build one per process (or per thread count) and keep it: every MoE layer shares it.

use std::sync::Mutex;

use crate::pool::Pool;

/// Whether this CPU runs the AVX-512 kernels (AVX-512F for the arithmetic, BW for the masked 16-bit tail loads).
pub(crate) fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which kernels a call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// Plain Rust (any CPU).
    Portable,
    /// AVX-512F/BW (`bf16_dot.rs`, `nvfp4_dot.rs`).
    Avx512,
    /// AVX-512 and, for the gate|up projection (its x is BF16), AVX512-BF16's dot products (`nvfp4_bf16_dot.rs`,
    /// `bf16_dot.rs`).
    Avx512Bf16,
}

impl Kernels {
    /// The fastest this CPU runs.
    pub fn best() -> Kernels {
        if crate::nvfp4_bf16_dot::available() {
            Kernels::Avx512Bf16
        } else if has_avx512() {
            Kernels::Avx512
        } else {
            Kernels::Portable
        }
    }

    fn runs_here(self) -> bool {
        match self {
            Kernels::Portable => true,
            Kernels::Avx512 => has_avx512(),
            Kernels::Avx512Bf16 => crate::nvfp4_bf16_dot::available(),
        }
    }
}

pub struct Executor {
    pub(crate) pool: Pool,
    pub(crate) kernels: Kernels,
    /// Buffers reused across calls (sized by the largest call so far), so that a decode step allocates nothing.
    pub(crate) scratch: Mutex<Scratch>,
}

#[derive(Default)]
pub(crate) struct Scratch {
    /// Each token's x in f32, laid out for the gate|up kernels: `[T, padded(H)]`.
    pub(crate) x: Vec<f32>,
    /// The same as BF16 bits, for the AVX512-BF16 kernels (NVFP4 banks).
    pub(crate) x_bf16: Vec<u16>,
    /// Phase 1's output, `silu(gate) * up` of every pair, by row chunk (`forward.rs`): `[P * I]`.
    pub(crate) act: Vec<f32>,
    /// The same, one laid-out vector a pair for the down kernels: `[P, padded(I)]`.
    pub(crate) act_laid: Vec<f32>,
    /// The same rounded to BF16, for the AVX512-BF16 kernels.
    pub(crate) act_bf16: Vec<u16>,
}

impl Executor {
    /// `threads` threads, the caller's included (0: the available parallelism); `portable` forces the portable
    /// kernels (tests, and hosts where AVX-512 is slow).
    pub fn new(threads: usize, portable: bool) -> Result<Executor, String> {
        Executor::with_kernels(threads, if portable { Kernels::Portable } else { Kernels::best() })
    }

    /// As `new`, with these kernels (an error where the CPU lacks them).
    pub fn with_kernels(threads: usize, kernels: Kernels) -> Result<Executor, String> {
        if !kernels.runs_here() {
            return Err(format!("this CPU cannot run the {kernels:?} kernels"));
        }
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let pool = Pool::new(threads).map_err(|e| format!("cannot start {threads} CPU expert threads: {e}"))?;
        Ok(Executor { pool, kernels, scratch: Mutex::new(Scratch::default()) })
    }

    /// Threads a call runs on (the caller's included).
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    /// Whether calls run the AVX-512 kernels.
    pub fn simd(&self) -> bool {
        self.kernels != Kernels::Portable
    }
}
