//! `Executor`: the thread pool the experts run on, the kernels (AVX-512 or portable) and the scratch memory a call
//! reuses. Build one per process (or per thread count) and keep it: every MoE layer shares it.

use std::sync::Mutex;

use crate::aligned::Int16Lines;
use crate::call_times::{CallTimes, CallTimesTaken};
use crate::matrix::Layout;
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

/// Whether this CPU has AVX512-BF16's dot-product instruction (and the AVX-512 the BF16 kernels need beside it).
pub(crate) fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx512() && std::is_x86_feature_detected!("avx512bf16")
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
    /// AVX-512F/BW, f32 arithmetic (`bf16_dot.rs`, `nvfp4_dot.rs`).
    Avx512,
    /// AVX-512 and VNNI: NVFP4 rows take int16 dot products (`nvfp4_int16_dot.rs`), BF16 rows the f32 kernel.
    Avx512Vnni,
    /// AVX-512, VNNI and AVX512-BF16: NVFP4 rows as `Avx512Vnni`, BF16 rows the BF16 dot-product instruction
    /// (`bf16_dot::dot_many_bf16`).
    Avx512Bf16,
}

/// How a call hands its vectors (x, then the activations) to the kernels of a weight layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    F32,
    /// BF16 bits (BF16 rows on AVX512-BF16).
    Bf16,
    /// Int16 blocks (NVFP4 rows on VNNI, `nvfp4_int16_dot::quantize`).
    Int16,
}

impl Kernels {
    /// The fastest this CPU runs.
    pub fn best() -> Kernels {
        [Kernels::Avx512Bf16, Kernels::Avx512Vnni, Kernels::Avx512]
            .into_iter()
            .find(|k| k.runs_here())
            .unwrap_or(Kernels::Portable)
    }

    fn runs_here(self) -> bool {
        match self {
            Kernels::Portable => true,
            Kernels::Avx512 => has_avx512(),
            Kernels::Avx512Vnni => crate::nvfp4_int16_dot::available(),
            Kernels::Avx512Bf16 => crate::nvfp4_int16_dot::available() && has_avx512_bf16(),
        }
    }

    /// The vectors' form for rows in `layout` (`Layout::Bf16` or `Layout::Nvfp4`). Every form but f32 has the
    /// activations rounded to BF16 before the down projection, as the GPU's kernels round their intermediate rows.
    pub(crate) fn form(self, layout: Layout) -> Form {
        match (self, layout) {
            (Kernels::Avx512Vnni | Kernels::Avx512Bf16, Layout::Nvfp4) => Form::Int16,
            (Kernels::Avx512Bf16, Layout::Bf16) => Form::Bf16,
            _ => Form::F32,
        }
    }
}

pub struct Executor {
    pub(crate) pool: Pool,
    pub(crate) kernels: Kernels,
    /// Buffers reused across calls (sized by the largest call so far), so that a decode step allocates nothing.
    pub(crate) scratch: Mutex<Scratch>,
    /// Where calls spend their time (`call_times.rs`).
    pub(crate) times: CallTimes,
}

#[derive(Default)]
pub(crate) struct Scratch {
    /// Each token's x in f32, laid out for the gate|up kernels: `[T, padded(H)]`.
    pub(crate) x: Vec<f32>,
    /// The same as BF16 bits, in order, for the AVX512-BF16 kernels (BF16 banks).
    pub(crate) x_bf16: Vec<u16>,
    /// The same as int16 blocks and their factors, for the VNNI kernels (NVFP4 banks): `[T, padded(H)]`,
    /// `[T, padded(H) / 16]`.
    pub(crate) x_i16: Int16Lines,
    pub(crate) x_factors: Vec<f32>,
    /// Phase 1's output, `silu(gate) * up` of every pair, by row chunk (`forward.rs`): `[P * I]`.
    pub(crate) act: Vec<f32>,
    /// The same, one laid-out vector a pair for the down kernels: `[P, padded(I)]`.
    pub(crate) act_laid: Vec<f32>,
    /// The same rounded to BF16, for the AVX512-BF16 kernels (BF16 banks).
    pub(crate) act_bf16: Vec<u16>,
    /// The same rounded to BF16, as int16 blocks and their factors, for the VNNI kernels (NVFP4 banks).
    pub(crate) act_i16: Int16Lines,
    pub(crate) act_factors: Vec<f32>,
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
        Ok(Executor { pool, kernels, scratch: Mutex::new(Scratch::default()), times: CallTimes::default() })
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

    /// Where the calls since the last take spent their time, and the pool's hand-off over them; zero again after.
    pub fn take_times(&self) -> CallTimesTaken {
        let (calls, phase_ns) = self.times.take();
        let (broadcasts, joined, wakeups, wait_ns) = self.pool.take_counts();
        CallTimesTaken { calls, phase_ns, broadcasts, joined, wakeups, wait_ns }
    }
}
