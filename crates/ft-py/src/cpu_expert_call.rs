//! `CpuExpertCall`: one MoE layer's CPU experts over fixed buffers, what the hybrid backend's mailbox thread
//! (`cpu_expert_mailbox.rs`) runs when the GPU asks.
//!
//! The addresses, sizes and bank are fixed at construction, so the GPU's side of the hand-off sits in a decode CUDA
//! graph. A failed call leaves `out` zero and keeps its message for `take_error` (the worker checks after each step;
//! the thread cannot raise). Until 2026-12-07 a CUDA host node (`cuLaunchHostFunc`) could run it too; the mailbox
//! decoded 23-96 % faster on an H100 (bench/results/2026-12-07-h100-qwen3.6-35b-a3b-nvfp4-decode-hybrid-mailbox.txt)
//! and the host node is gone.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ft_cpu_experts::Executor;
use pyo3::prelude::*;

use crate::cpu_experts::{CpuExpertBank, CpuExpertExecutor, StepBuffers};

/// Set by any failed call: the worker's per-step check reads this flag, and looks at the calls only when it is set.
pub(crate) static ANY_FAILED: AtomicBool = AtomicBool::new(false);

/// Whether a call failed since the last look (and clears the flag); the mailbox's `take_errors` says which and why.
#[pyfunction]
pub fn cpu_expert_call_failed() -> bool {
    ANY_FAILED.swap(false, Ordering::AcqRel)
}

/// One layer's experts over fixed buffers (see the module docs).
pub(crate) struct CpuExpertCall {
    exec: Arc<Executor>,
    bank: CpuExpertBank,
    step: StepBuffers,
    error: Mutex<Option<String>>,
}

impl CpuExpertCall {
    /// The call of `bank`'s experts on `executor` over `step`'s buffers (pinned, for the GPU's kernels).
    pub(crate) fn new(executor: &CpuExpertExecutor, bank: &CpuExpertBank, step: StepBuffers) -> CpuExpertCall {
        let bank = CpuExpertBank { shape: bank.shape, tensors: bank.tensors.clone() };
        CpuExpertCall { exec: executor.exec.clone(), bank, step, error: Mutex::new(None) }
    }

    /// The message of the last failed run since the last look, if any.
    pub(crate) fn take_error(&self) -> Option<String> {
        self.error.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// `out = sum over pairs` (zeroed first; zero on failure), the error kept.
    pub(crate) fn run(&self) -> Result<(), String> {
        // SAFETY: the Python side keeps the bank's tensors and the step buffers alive as long as this object, and
        // the hand-off's order keeps anything else from touching them meanwhile (the GPU writes them before its
        // request and reads `out` after the answer)
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
