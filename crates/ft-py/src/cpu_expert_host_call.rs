//! `CpuExpertHostCall`: one MoE layer's CPU experts over fixed buffers, callable as a CUDA host function.
//!
//! The hybrid backend (`freetoken.moe.hybrid_experts`) puts the CPU's share of a decode step's experts inside the
//! step's CUDA graph: a host node (`cuLaunchHostFunc`, enqueued from Python) calls `function_address` with
//! `context_address`, after the copies that fill the pinned `x`, `ids` and `weights` buffers and before the copy that
//! reads `out`. The driver runs it on its own thread, without the GIL, and it cannot report an error: a failed call
//! leaves `out` zero and keeps its message for `take_error` (the worker checks after each step). The addresses,
//! sizes and bank are fixed at construction; the Python object must outlive every graph that calls it.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ft_cpu_experts::Executor;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cpu_experts::{CpuExpertBank, CpuExpertExecutor, StepBuffers};

/// Set by any failed call: the worker's per-step check reads this flag, and looks at the calls only when it is set.
pub(crate) static ANY_FAILED: AtomicBool = AtomicBool::new(false);

/// Whether a host call failed since the last look (and clears the flag); `take_error` says which and why.
#[pyfunction]
pub fn cpu_expert_host_call_failed() -> bool {
    ANY_FAILED.swap(false, Ordering::AcqRel)
}

/// One layer's experts over fixed buffers: what a host node (here) or the mailbox's thread
/// (`cpu_expert_mailbox.rs`) runs.
pub(crate) struct Context {
    exec: Arc<Executor>,
    bank: CpuExpertBank,
    step: StepBuffers,
    error: Mutex<Option<String>>,
}

impl Context {
    /// Checks the buffers against the bank (see `CpuExpertHostCall::new`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        executor: &CpuExpertExecutor,
        bank: &CpuExpertBank,
        x: usize,
        tokens: usize,
        ids: usize,
        weights: usize,
        k: usize,
        out: usize,
    ) -> PyResult<Context> {
        let step =
            StepBuffers::new(bank.shape.hidden, x, tokens, ids, weights, k, out).map_err(PyValueError::new_err)?;
        let bank = CpuExpertBank { shape: bank.shape, tensors: bank.tensors.clone() };
        Ok(Context { exec: executor.exec.clone(), bank, step, error: Mutex::new(None) })
    }

    /// The message of the last failed run since the last look, if any.
    pub(crate) fn take_error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// `out = sum over pairs` (zeroed first; zero on failure), the error kept.
    pub(crate) fn run(&self) -> Result<(), String> {
        // SAFETY: the Python side keeps the bank's tensors and the step buffers alive as long as this object, and
        // the hand-off's order keeps anything else from touching them meanwhile (a host node: the copies, this
        // call, the copy out on one stream; the mailbox: the GPU writes them before its request and reads `out`
        // after the answer)
        let result = catch_unwind(AssertUnwindSafe(|| unsafe { self.step.run(&self.bank, &self.exec, true) }))
            .unwrap_or_else(|_| Err("the CPU expert executor panicked".to_string()));
        if let Err(message) = &result {
            // SAFETY: as above
            unsafe { self.step.zero_out() };
            *self.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(message.clone());
            ANY_FAILED.store(true, Ordering::Release);
        }
        result
    }
}

/// The CUDA host function: `void (*)(void *)`.
extern "C" fn host_function(context: *mut c_void) {
    // SAFETY: `context` is the address of a live `Context` (`context_address`; the object outlives its graphs)
    let context = unsafe { &*(context as *const Context) };
    let _ = context.run();
}

/// See the module docs.
#[pyclass(frozen, module = "freetoken._core")]
pub struct CpuExpertHostCall {
    context: Box<Context>,
}

#[pymethods]
impl CpuExpertHostCall {
    /// The call of `bank`'s experts on `executor` over these buffers (addresses of contiguous pinned CPU
    /// tensors: `x` bf16 `[tokens, H]`, `ids` int64 `[tokens, k]`, `weights` f32 `[tokens, k]`, `out` f32
    /// `[tokens, H]`).
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        executor: &CpuExpertExecutor,
        bank: &CpuExpertBank,
        x: usize,
        tokens: usize,
        ids: usize,
        weights: usize,
        k: usize,
        out: usize,
    ) -> PyResult<Self> {
        Ok(CpuExpertHostCall { context: Box::new(Context::new(executor, bank, x, tokens, ids, weights, k, out)?) })
    }

    /// The host function's address (`void (*)(void *)`), the same for every call.
    #[getter]
    fn function_address(&self) -> usize {
        host_function as extern "C" fn(*mut c_void) as usize
    }

    /// What the host function takes: this call.
    #[getter]
    fn context_address(&self) -> usize {
        &*self.context as *const Context as usize
    }

    /// Runs the call here and now (the GIL released), as the host function would; raises ValueError on failure.
    fn run(&self, py: Python<'_>) -> PyResult<()> {
        let context = &*self.context;
        py.allow_threads(|| context.run()).map_err(PyValueError::new_err)
    }

    /// The message of the last failed call since the last look, if any.
    fn take_error(&self) -> Option<String> {
        self.context.take_error()
    }
}
