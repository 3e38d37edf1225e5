//! `CpuExpertBank` and `CpuExpertExecutor`: `ft_cpu_experts` for Python (`freetoken.moe.cpu_experts.CpuExperts`
//! is the interface; use that).
//!
//! A bank is its tensors' addresses (torch's `data_ptr()`), element counts and expert strides, taken as they are:
//! the expert banks are large tensors torch owns, often pinned, never copied. What makes the slices built from them
//! sound is the wrapper's contract: it checks each tensor (CPU, dtype, shape, row-major inside an expert) and keeps
//! it alive as long as the bank object. Here every address is checked for alignment and every extent against the
//! layer's shape; a call checks every token and expert id and runs with the GIL released.

use std::collections::HashMap;
use std::sync::Arc;

use ft_cpu_experts::{experts_forward, Bank, Executor, Kernels, Nvfp4Projection, Pair, Shape, Strided, PHASES};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// One tensor: `(address, elements from the address to the end of the last expert, stride(0) in elements)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Raw {
    addr: usize,
    len: usize,
    expert_stride: usize,
}

impl Raw {
    fn new(name: &str, (addr, len, expert_stride): (usize, usize, usize), elem: usize) -> PyResult<Raw> {
        if addr == 0 || addr % elem != 0 || len.checked_mul(elem).is_none_or(|b| b > isize::MAX as usize) {
            return Err(PyValueError::new_err(format!("{name}: address {addr:#x} of {len} elements is not usable")));
        }
        Ok(Raw { addr, len, expert_stride })
    }

    /// SAFETY: the memory is a live tensor of `len` elements of `T` that nothing writes while the slice is used
    /// (the wrapper's contract, see the module docs); `new` checked the alignment.
    unsafe fn strided<'a, T>(&self) -> Strided<'a, T> {
        Strided { data: std::slice::from_raw_parts(self.addr as *const T, self.len), expert_stride: self.expert_stride }
    }
}

/// A MoE layer's expert bank in host memory (see the module docs).
#[pyclass(frozen, module = "freetoken._core")]
pub struct CpuExpertBank {
    pub(crate) shape: Shape,
    /// BF16: gate_up, down. NVFP4: w13, w13_scale, w13_global, w2, w2_scale, w2_global.
    pub(crate) tensors: Vec<Raw>,
}

impl CpuExpertBank {
    /// SAFETY: as `Raw::strided`.
    pub(crate) unsafe fn bank(&self) -> Bank<'_> {
        match self.tensors[..] {
            [gate_up, down] => Bank::Bf16 { gate_up: gate_up.strided(), down: down.strided() },
            [w13, s13, g13, w2, s2, g2] => Bank::Nvfp4 {
                gate_up: Nvfp4Projection { codes: w13.strided(), scales: s13.strided(), globals: g13.strided() },
                down: Nvfp4Projection { codes: w2.strided(), scales: s2.strided(), globals: g2.strided() },
            },
            _ => unreachable!("built with two or six tensors"),
        }
    }

    fn checked(shape: Shape, tensors: Vec<Raw>) -> PyResult<CpuExpertBank> {
        let bank = CpuExpertBank { shape, tensors };
        // SAFETY: only the lengths are looked at
        unsafe { bank.bank() }.check(shape).map_err(PyValueError::new_err)?;
        Ok(bank)
    }
}

type Tensor = (usize, usize, usize);

#[pymethods]
impl CpuExpertBank {
    /// BF16 `gate_up [E, 2I, H]` and `down [E, H, I]`: each `(address, elements, stride(0))`.
    #[staticmethod]
    fn bf16(experts: usize, hidden: usize, intermediate: usize, gate_up: Tensor, down: Tensor) -> PyResult<Self> {
        let shape = Shape { experts, hidden, intermediate };
        Self::checked(shape, vec![Raw::new("gate_up", gate_up, 2)?, Raw::new("down", down, 2)?])
    }

    /// NVFP4 (ModelOpt's layout): `w13` u8 `[E, 2I, H/2]`, `w13_scale` E4M3 bits `[E, 2I, H/16]`, `w13_global` f32
    /// `[E, 2I]`, and `w2`, `w2_scale`, `w2_global` for `[E, H, I]`; each `(address, elements, stride(0))`.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    fn nvfp4(
        experts: usize,
        hidden: usize,
        intermediate: usize,
        w13: Tensor,
        w13_scale: Tensor,
        w13_global: Tensor,
        w2: Tensor,
        w2_scale: Tensor,
        w2_global: Tensor,
    ) -> PyResult<Self> {
        let shape = Shape { experts, hidden, intermediate };
        let tensors = vec![
            Raw::new("w13", w13, 1)?,
            Raw::new("w13_scale", w13_scale, 1)?,
            Raw::new("w13_global", w13_global, 4)?,
            Raw::new("w2", w2, 1)?,
            Raw::new("w2_scale", w2_scale, 1)?,
            Raw::new("w2_global", w2_global, 4)?,
        ];
        Self::checked(shape, tensors)
    }

    #[getter]
    fn experts(&self) -> usize {
        self.shape.experts
    }
}

/// The thread pool and kernels the experts run on; one serves every layer.
#[pyclass(frozen, module = "freetoken._core")]
pub struct CpuExpertExecutor {
    /// Shared with the calls made from it (`cpu_expert_call.rs`).
    pub(crate) exec: Arc<Executor>,
}

#[pymethods]
impl CpuExpertExecutor {
    /// `threads`: 0 for the available parallelism; `portable`: the portable kernels even where AVX-512 runs.
    #[new]
    #[pyo3(signature = (threads = 0, portable = false))]
    fn new(threads: usize, portable: bool) -> PyResult<Self> {
        Ok(CpuExpertExecutor { exec: Arc::new(Executor::new(threads, portable).map_err(PyRuntimeError::new_err)?) })
    }

    #[getter]
    fn threads(&self) -> usize {
        self.exec.threads()
    }

    /// Whether the AVX-512 kernels run.
    #[getter]
    fn simd(&self) -> bool {
        self.exec.simd()
    }

    /// The kernels calls run: "portable", "avx512", "avx512_vnni" (int16 dot products for NVFP4 rows) or
    /// "avx512_bf16" (VNNI's for NVFP4 rows, AVX512-BF16's for BF16 rows).
    #[getter]
    fn kernels(&self) -> &'static str {
        match self.exec.kernels() {
            Kernels::Portable => "portable",
            Kernels::Avx512 => "avx512",
            Kernels::Avx512Vnni => "avx512_vnni",
            Kernels::Avx512Bf16 => "avx512_bf16",
        }
    }

    /// Sums since the last take, and zero again: `calls`, `<phase>_ns` for each phase of a call (`group`, `x`,
    /// `gate_up`, `acts`, `down`), and the pool's hand-off: `broadcasts`, `joined` (workers that took part, summed),
    /// `wakeups` (broadcasts that woke sleeping workers), `wait_ns` (the caller waiting for those that joined).
    fn take_call_times(&self) -> HashMap<String, u64> {
        let t = self.exec.take_times();
        let mut out: HashMap<String, u64> =
            PHASES.iter().zip(t.phase_ns).map(|(p, ns)| (format!("{p}_ns"), ns)).collect();
        for (name, v) in [
            ("calls", t.calls),
            ("broadcasts", t.broadcasts),
            ("joined", t.joined),
            ("wakeups", t.wakeups),
            ("wait_ns", t.wait_ns),
        ] {
            out.insert(name.to_string(), v);
        }
        out
    }

    /// `out[t] += w * expert(x[t])` for each routed pair. Addresses of contiguous CPU tensors: `x` bf16
    /// `[tokens, H]`, `ids` int64 `[tokens, k]` (an id < 0 is no pair), `weights` f32 `[tokens, k]`, `out` f32
    /// `[tokens, H]`. An id at or past the bank's experts is a ValueError, and `out` is left as it was.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        bank: &CpuExpertBank,
        x: usize,
        tokens: usize,
        ids: usize,
        weights: usize,
        k: usize,
        out: usize,
    ) -> PyResult<()> {
        let step =
            StepBuffers::new(bank.shape.hidden, x, tokens, ids, weights, k, out).map_err(PyValueError::new_err)?;
        let exec = &*self.exec;
        // SAFETY: the caller passes live, contiguous tensors of these sizes and dtypes (checked by the wrapper);
        // the bank's tensors are held by the wrapper
        py.allow_threads(|| unsafe { step.run(bank, exec, false) }).map_err(PyValueError::new_err)
    }
}

/// A step's inputs and output: addresses of contiguous CPU tensors, `x` bf16 `[tokens, H]`, `ids` int64
/// `[tokens, k]` (an id < 0 is no pair), `weights` f32 `[tokens, k]`, `out` f32 `[tokens, H]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepBuffers {
    x: usize,
    ids: usize,
    weights: usize,
    out: usize,
    tokens: usize,
    k: usize,
    hidden: usize,
}

impl StepBuffers {
    /// Checks the sizes and the addresses' alignment.
    pub(crate) fn new(
        hidden: usize,
        x: usize,
        tokens: usize,
        ids: usize,
        weights: usize,
        k: usize,
        out: usize,
    ) -> Result<Self, String> {
        let (n, elems) = (tokens.checked_mul(k), tokens.checked_mul(hidden));
        let (Some(_), Some(_), true) = (n, elems, tokens <= u32::MAX as usize) else {
            return Err(format!("{tokens} tokens of {k} pairs are too many"));
        };
        for (name, addr, align) in [("x", x, 2), ("topk_ids", ids, 8), ("topk_weights", weights, 4), ("out", out, 4)] {
            if addr == 0 || addr % align != 0 {
                return Err(format!("{name}: address {addr:#x} is not usable"));
            }
        }
        Ok(StepBuffers { x, ids, weights, out, tokens, k, hidden })
    }

    /// `out[t] += w * expert(x[t])` for each routed pair (`out` zeroed first when `overwrite`). An id at or past the
    /// bank's experts is an error, and `out` is left as it was.
    ///
    /// SAFETY: the addresses are live tensors of these sizes and dtypes that nothing else touches during the call,
    /// `out` aliased by none of the others, and the bank's tensors are live (the wrappers' contracts).
    pub(crate) unsafe fn run(&self, bank: &CpuExpertBank, exec: &Executor, overwrite: bool) -> Result<(), String> {
        let (n, elems) = (self.tokens * self.k, self.tokens * self.hidden);
        let x = std::slice::from_raw_parts(self.x as *const u16, elems);
        let ids = std::slice::from_raw_parts(self.ids as *const i64, n);
        let weights = std::slice::from_raw_parts(self.weights as *const f32, n);
        let out = std::slice::from_raw_parts_mut(self.out as *mut f32, elems);
        let pairs = routed_pairs(ids, weights, self.k, bank.shape.experts)?;
        if overwrite {
            out.fill(0.0);
        }
        experts_forward(&bank.bank(), bank.shape, x, &pairs, out, exec)
    }
}

impl StepBuffers {
    /// `out = 0`. SAFETY: as `run`.
    pub(crate) unsafe fn zero_out(&self) {
        std::slice::from_raw_parts_mut(self.out as *mut f32, self.tokens * self.hidden).fill(0.0);
    }
}

/// The pairs of `ids [tokens, k]` (an id < 0 is no pair); an id at or past `experts` is an error.
fn routed_pairs(ids: &[i64], weights: &[f32], k: usize, experts: usize) -> Result<Vec<Pair>, String> {
    let mut pairs = Vec::with_capacity(ids.len());
    for (j, (&id, &weight)) in ids.iter().zip(weights).enumerate() {
        if id < 0 {
            continue;
        }
        if id as u64 >= experts as u64 {
            let (t, slot) = (j / k, j % k);
            return Err(format!("topk_ids[{t}, {slot}] = {id} is outside the bank's {experts} experts"));
        }
        pairs.push(Pair { token: (j / k) as u32, expert: id as u32, weight });
    }
    Ok(pairs)
}
