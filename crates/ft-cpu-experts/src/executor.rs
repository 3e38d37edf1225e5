//! `Executor`: the thread pool the experts run on, the kernel path (AVX-512 or portable) and the scratch memory a
//! call reuses. Build one per process (or per thread count) and keep it: every MoE layer shares it.

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

pub struct Executor {
    pub(crate) pool: Pool,
    /// The AVX-512 kernels: detected at construction, off when `portable` was asked for.
    pub(crate) simd: bool,
    /// Buffers reused across calls (sized by the largest call so far), so that a decode step allocates nothing.
    pub(crate) scratch: Mutex<Scratch>,
}

#[derive(Default)]
pub(crate) struct Scratch {
    /// Each token's x in f32, laid out for the gate|up kernels: `[T, padded(H)]`.
    pub(crate) x: Vec<f32>,
    /// Phase 1's output, `silu(gate) * up` of every pair, by row chunk (`forward.rs`): `[P * I]`.
    pub(crate) act: Vec<f32>,
    /// The same, one laid-out vector a pair for the down kernels: `[P, padded(I)]`.
    pub(crate) act_laid: Vec<f32>,
}

impl Executor {
    /// `threads` threads, the caller's included (0: the available parallelism); `portable` forces the portable
    /// kernels (tests, and hosts where AVX-512 is slow).
    pub fn new(threads: usize, portable: bool) -> Result<Executor, String> {
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let pool = Pool::new(threads).map_err(|e| format!("cannot start {threads} CPU expert threads: {e}"))?;
        Ok(Executor { pool, simd: !portable && has_avx512(), scratch: Mutex::new(Scratch::default()) })
    }

    /// Threads a call runs on (the caller's included).
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Whether calls run the AVX-512 kernels.
    pub fn simd(&self) -> bool {
        self.simd
    }
}
