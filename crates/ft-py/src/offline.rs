//! `OfflineEngine`: the production scheduler and worker, stepped synchronously from Python (the caller holds
//! the GIL, so the worker runs inline). `freetoken.LLM` is built on it, so offline results exercise the same
//! scheduling, chunking and caching as `ft serve`.

use crate::py_worker::PyWorker;
use ft_core::config::{CacheType, SchedulerConfig};
use ft_core::request::{FinishReason, NewRequest, RequestEvent, SamplingParams};
use ft_core::scheduler::Scheduler;
use ft_core::step::{Worker, WorkerError};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

#[pyclass(unsendable)]
pub struct OfflineEngine {
    scheduler: Scheduler,
    worker: PyWorker,
}

fn event_tuple(py: Python<'_>, ev: RequestEvent) -> PyResult<PyObject> {
    Ok(match ev {
        RequestEvent::Started { id, prompt_tokens, cached_tokens, .. } => {
            ("started", id, prompt_tokens, cached_tokens).into_pyobject(py)?.into_any().unbind()
        }
        RequestEvent::Token { id, token, logprob } => ("token", id, token, logprob).into_pyobject(py)?.into_any().unbind(),
        RequestEvent::Finished { id, reason, completion_tokens } => {
            let r = match reason {
                FinishReason::Stop => "stop",
                FinishReason::Length => "length",
                FinishReason::Abort => "abort",
            };
            ("finished", id, r, completion_tokens).into_pyobject(py)?.into_any().unbind()
        }
        RequestEvent::Failed { id, message } => ("failed", id, message, 0u32).into_pyobject(py)?.into_any().unbind(),
    })
}

#[pymethods]
impl OfflineEngine {
    /// `worker`: a `freetoken.worker.Worker`; `config`: scheduler settings (max_running_requests,
    /// max_prefill_tokens, kv_capacity_tokens, page_size, max_context, cache_type "radix"|"naive",
    /// mixed_decode, decode_interleave_every, num_state_slots, seed). Missing keys keep the defaults.
    #[new]
    fn new(worker: PyObject, config: &Bound<'_, PyDict>) -> PyResult<Self> {
        let mut cfg = SchedulerConfig::default();
        macro_rules! set {
            ($field:ident, $ty:ty) => {
                if let Some(v) = config.get_item(stringify!($field))? {
                    cfg.$field = v.extract::<$ty>()?;
                }
            };
        }
        set!(max_running_requests, usize);
        set!(max_prefill_tokens, usize);
        set!(kv_capacity_tokens, usize);
        set!(page_size, usize);
        set!(max_context, usize);
        set!(mixed_decode, bool);
        set!(decode_interleave_every, usize);
        set!(num_state_slots, usize);
        set!(seed, u64);
        if let Some(v) = config.get_item("cache_type")? {
            cfg.cache_type = match v.extract::<String>()?.as_str() {
                "radix" => CacheType::Radix,
                "naive" => CacheType::Naive,
                other => return Err(PyValueError::new_err(format!("unknown cache_type {other:?}"))),
            };
        }
        Ok(OfflineEngine { scheduler: Scheduler::new(cfg), worker: PyWorker::new(worker) })
    }

    #[pyo3(signature = (id, prompt, max_new_tokens, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, stop_token_ids=vec![], ignore_eos=false))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        max_new_tokens: u32,
        temperature: f32,
        top_p: f32,
        top_k: i32,
        min_p: f32,
        seed: Option<u64>,
        stop_token_ids: Vec<u32>,
        ignore_eos: bool,
    ) -> PyResult<()> {
        let req = NewRequest {
            id,
            prompt,
            max_new_tokens,
            sampling: SamplingParams { temperature, top_p, top_k, min_p, seed },
            stop_token_ids,
            ignore_eos,
        };
        self.scheduler.add_request(req).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn abort(&mut self, id: u64) {
        self.scheduler.finish(id, FinishReason::Abort);
    }

    /// Runs one step; returns the events as tuples: ("started", id, prompt_tokens, cached_tokens),
    /// ("token", id, token, logprob), ("finished", id, reason, completion_tokens), ("failed", id, message, 0).
    fn step(&mut self, py: Python<'_>) -> PyResult<Vec<PyObject>> {
        if let Some(plan) = self.scheduler.next_step() {
            match self.worker.execute(&plan) {
                Ok(out) => self.scheduler.commit(&plan, &out),
                Err(WorkerError::Fatal(m)) => {
                    self.scheduler.fail_all(&m);
                    return Err(PyRuntimeError::new_err(m));
                }
                Err(e) => self.scheduler.fail_step(&plan, &e.to_string()),
            }
        }
        self.scheduler.drain_events().into_iter().map(|ev| event_tuple(py, ev)).collect()
    }

    fn is_idle(&self) -> bool {
        self.scheduler.is_idle()
    }

    /// Scheduler counters (running, queued, KV use, cached tokens) as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.scheduler.stats();
        let d = PyDict::new(py);
        d.set_item("running", s.running)?;
        d.set_item("queued", s.queued)?;
        d.set_item("kv_used_tokens", s.kv_used_tokens)?;
        d.set_item("kv_capacity_tokens", s.kv_capacity_tokens)?;
        d.set_item("cached_tokens_in_tree", s.cached_tokens_in_tree)?;
        d.set_item("evictable_tokens", s.evictable_tokens)?;
        Ok(d)
    }

    fn check_integrity(&self) -> PyResult<()> {
        self.scheduler.check_integrity().map_err(PyRuntimeError::new_err)
    }
}
