//! `CpuExpertMailbox`: the host half of the hybrid backend's GPU-to-CPU hand-off.
//!
//! A CUDA host node (`cuLaunchHostFunc`, the hand-off until 2026-12-07) cost ~17 us of driver latency a layer on the
//! step's critical path, even when the layer had nothing for the host. Here a thread of ours polls a small control
//! block in pinned memory instead, which the GPU writes and reads through UVA (`kernels/host_expert_mailbox.py`):
//!
//! - word 0, `request`: `(seq << 16) | call`, written by the GPU's pack kernel after the call's pinned inputs
//!   (`x`, `ids`, `weights`), and only when the layer has host pairs; `seq` grows by one a request;
//! - word 1, `done`: the request the host finished, written by this thread after the call's `out`;
//! - word 2, `fault`: set by the GPU when a wait for `done` timed out (read by `fault`, see the Python side).
//!
//! The GPU's wait kernel spins on `done` before it adds `out` to the layer's output. Calls are registered once
//! (`add_call`) with fixed buffers, so the kernels and their pointers sit in a decode CUDA graph. A failed call
//! writes zeros and keeps its error (`take_errors`); the thread always answers, so the GPU never waits on a failure
//! (a request naming no call is answered too, and reported).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::cpu_expert_call::{CpuExpertCall, ANY_FAILED};
use crate::cpu_experts::{CpuExpertBank, CpuExpertExecutor, StepBuffers};

/// Bits of a request that name the call.
const CALL_BITS: u32 = 16;
/// How long the thread spins after its last request before it polls asleep: longer than the host's gap between
/// decode steps, so a running batch never waits on a wake-up.
const SPIN: Duration = Duration::from_millis(50);
/// The poll interval once idle (the first layer after an idle spell waits up to this long).
const NAP: Duration = Duration::from_micros(100);

struct Shared {
    /// The control block: three i64 words of pinned memory (see the module docs), alive as long as the mailbox.
    control: usize,
    calls: Mutex<Vec<Arc<CpuExpertCall>>>,
    /// Requests that named no call (a corrupted request word), for `take_errors`.
    stray: Mutex<Vec<i64>>,
    stop: AtomicBool,
    answered: AtomicU64,
    /// Nanoseconds the thread spent running calls: beside the steps' time, whether the host is what a hybrid
    /// decode step waits on.
    busy_ns: AtomicU64,
}

impl Shared {
    fn word(&self, i: usize) -> &AtomicI64 {
        // SAFETY: `new` checked the address (8-aligned, non-null); the Python side keeps the block alive
        unsafe { &*((self.control + 8 * i) as *const AtomicI64) }
    }

    /// Runs request `request`'s call (zeros and an error when it fails or names no call) and answers it.
    fn answer(&self, request: i64) {
        let index = (request & ((1 << CALL_BITS) - 1)) as usize;
        let call = self.calls.lock().unwrap_or_else(|e| e.into_inner()).get(index).cloned();
        match call {
            Some(call) => {
                let start = Instant::now();
                let _ = call.run();
                self.busy_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            None => {
                self.stray.lock().unwrap_or_else(|e| e.into_inner()).push(request);
                ANY_FAILED.store(true, Ordering::Release);
            }
        }
        self.answered.fetch_add(1, Ordering::Relaxed);
        self.word(1).store(request, Ordering::Release);
    }

    fn poll(&self) {
        let mut last = self.word(1).load(Ordering::Acquire);
        let mut active = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let request = self.word(0).load(Ordering::Acquire);
            if request != last {
                last = request;
                self.answer(request);
                active = Instant::now();
            } else if active.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }
}

/// See the module docs.
#[pyclass(frozen, module = "freetoken._core")]
pub struct CpuExpertMailbox {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// What holds the control block (the pinned tensor): dropped after the thread is joined.
    _owner: PyObject,
}

#[pymethods]
impl CpuExpertMailbox {
    /// `control`: the address of three zeroed i64 words of pinned memory inside `owner` (the tensor, kept alive
    /// here). `start`: false leaves the polling thread off (tests: a host that never answers).
    #[new]
    #[pyo3(signature = (owner, control, start = true))]
    fn new(owner: PyObject, control: usize, start: bool) -> PyResult<Self> {
        if control == 0 || !control.is_multiple_of(8) {
            return Err(PyValueError::new_err(format!("control: address {control:#x} is not usable")));
        }
        let shared = Arc::new(Shared {
            control,
            calls: Mutex::new(Vec::new()),
            stray: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            answered: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
        });
        let thread = if start {
            let polled = shared.clone();
            let spawned =
                std::thread::Builder::new().name("ft-cpu-experts-mailbox".into()).spawn(move || polled.poll());
            Some(spawned.map_err(|e| PyRuntimeError::new_err(format!("mailbox thread: {e}")))?)
        } else {
            None
        };
        Ok(CpuExpertMailbox { shared, thread: Mutex::new(thread), _owner: owner })
    }

    /// Registers `bank`'s experts on `executor` over these buffers (as `CpuExpertExecutor.forward` takes them,
    /// fixed for the mailbox's life) and returns the call's index, the low bits of its requests.
    #[allow(clippy::too_many_arguments)]
    fn add_call(
        &self,
        executor: &CpuExpertExecutor,
        bank: &CpuExpertBank,
        x: usize,
        tokens: usize,
        ids: usize,
        weights: usize,
        k: usize,
        out: usize,
    ) -> PyResult<usize> {
        let step =
            StepBuffers::new(bank.shape.hidden, x, tokens, ids, weights, k, out).map_err(PyValueError::new_err)?;
        let call = CpuExpertCall::new(executor, bank, step);
        let mut calls = self.shared.calls.lock().unwrap_or_else(|e| e.into_inner());
        if calls.len() >= 1 << CALL_BITS {
            return Err(PyValueError::new_err(format!("a mailbox holds at most {} calls", 1 << CALL_BITS)));
        }
        calls.push(Arc::new(call));
        Ok(calls.len() - 1)
    }

    /// Runs call `index` here and now (the GIL released), as the thread would; raises ValueError on failure.
    fn run(&self, py: Python<'_>, index: usize) -> PyResult<()> {
        let call = self.shared.calls.lock().unwrap_or_else(|e| e.into_inner()).get(index).cloned();
        let call = call.ok_or_else(|| PyValueError::new_err(format!("no call {index}")))?;
        py.allow_threads(|| call.run()).map_err(PyValueError::new_err)
    }

    /// `(index, message)` of each call that failed since the last look, and of each request that named no call.
    fn take_errors(&self) -> Vec<(usize, String)> {
        let calls = self.shared.calls.lock().unwrap_or_else(|e| e.into_inner());
        let mut errors: Vec<_> = calls.iter().enumerate().filter_map(|(i, c)| c.take_error().map(|m| (i, m))).collect();
        let stray = std::mem::take(&mut *self.shared.stray.lock().unwrap_or_else(|e| e.into_inner()));
        let mask = (1 << CALL_BITS) - 1;
        errors.extend(stray.iter().map(|r| ((r & mask) as usize, format!("request {r:#x} names no call"))));
        errors
    }

    /// Requests answered so far.
    #[getter]
    fn answered(&self) -> u64 {
        self.shared.answered.load(Ordering::Relaxed)
    }

    /// Seconds the thread has spent running calls so far (the worker's `expert_host_busy_ms`).
    #[getter]
    fn busy_seconds(&self) -> f64 {
        self.shared.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9
    }

    /// Whether the polling thread runs.
    #[getter]
    fn polling(&self) -> bool {
        self.thread.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Stops the polling thread (also when the mailbox is dropped).
    fn close(&self, py: Python<'_>) {
        self.shared.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread {
            py.allow_threads(|| {
                let _ = thread.join();
            });
        }
    }
}

impl Drop for CpuExpertMailbox {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
    }
}
