//! `OfflineEngine`: the production scheduler and worker, stepped from Python (the caller holds the GIL, so the
//! worker runs inline). `freetoken.LLM` is built on it, so offline results exercise the same scheduling, chunking,
//! caching and overlap scheduling (a decode step launched before the one ahead of it is committed, unless
//! `disable_overlap_schedule`) as `ft serve`.

use crate::py_worker::PyWorker;
use ft_core::request::{FinishReason, NewRequest, RequestEvent, SamplingParams};
use ft_core::scheduler::Scheduler;
use ft_core::step::{StepOutput, StepPlan, Worker, WorkerError};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

#[pyclass(unsendable)]
pub struct OfflineEngine {
    scheduler: Scheduler,
    worker: PyWorker,
    /// What requests are validated against, as `ft serve` validates them.
    limits: ft_server::validation::Limits,
    /// Launch the next decode step before committing this one (the server's default).
    overlap: bool,
    /// The step launched and not yet collected (overlap only).
    in_flight: Option<StepPlan>,
    /// Steps launched ahead of the commit of the step before them.
    overlapped_steps: u64,
}

fn event_tuple(py: Python<'_>, ev: RequestEvent) -> PyResult<PyObject> {
    Ok(match ev {
        RequestEvent::Started { id, prompt_tokens, cached_tokens, .. } => {
            ("started", id, prompt_tokens, cached_tokens).into_pyobject(py)?.into_any().unbind()
        }
        RequestEvent::Token { id, token, logprob, .. } => {
            ("token", id, token, logprob).into_pyobject(py)?.into_any().unbind()
        }
        RequestEvent::PromptLogprobs { id, start, logprobs, .. } => {
            ("prompt_logprobs", id, start, logprobs).into_pyobject(py)?.into_any().unbind()
        }
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
    /// `worker`: a `freetoken.worker.Worker`. The scheduler is configured exactly as `ft serve` configures it,
    /// from the worker's settings (`worker.args`: every `ft serve` flag) and its engine description.
    #[new]
    fn new(py: Python<'_>, worker: PyObject) -> PyResult<Self> {
        let w = worker.bind(py);
        let info = crate::engine_description(w.call_method0("info")?.downcast::<PyDict>()?)?;
        let json: String = py.import("json")?.getattr("dumps")?.call1((w.getattr("args")?,))?.extract()?;
        let args: ft_server::cli::ServeArgs =
            serde_json::from_str(&json).map_err(|e| PyValueError::new_err(format!("worker settings: {e}")))?;
        // The same refusals as `ft serve`: a setting that would do nothing is an error here too.
        if let Some(msg) = args.validate().err().or_else(|| ft_server::cli::unsupported_feature(&args)) {
            return Err(PyValueError::new_err(msg));
        }
        let cfg = ft_server::launch::scheduler_config(&args, &info);
        let limits = ft_server::validation::Limits::new(&info, &args);
        let overlap = !args.disable_overlap_schedule;
        Ok(OfflineEngine {
            scheduler: Scheduler::new(cfg),
            worker: PyWorker::new(worker),
            limits,
            overlap,
            in_flight: None,
            overlapped_steps: 0,
        })
    }

    /// Queues a request. `sampling`: the OpenAI-named sampling and budget fields (`temperature`, `top_p`, `top_k`,
    /// `min_p`, `presence_penalty`, `frequency_penalty`, `seed`, `max_tokens`, `stop_token_ids`, `ignore_eos`),
    /// checked by the server's own validation layer: a bad value raises `ValueError` naming the field.
    fn add_request(&mut self, py: Python<'_>, id: u64, prompt: Vec<u32>, sampling: &Bound<'_, PyDict>) -> PyResult<()> {
        let json: String = py.import("json")?.getattr("dumps")?.call1((sampling,))?.extract()?;
        let fields: ft_server::http::protocol::SamplingFields =
            serde_json::from_str(&json).map_err(|e| PyValueError::new_err(format!("sampling: {e}")))?;
        let bad = |e: ft_server::http::openai_error::ApiError| PyValueError::new_err(e.message);
        let v = ft_server::validation::sampling(&fields, &SamplingParams::default()).map_err(bad)?;
        let prepared = ft_server::validation::request(&self.limits, prompt, v, "prompt").map_err(bad)?;
        let r = prepared.req;
        let req = NewRequest {
            id,
            prompt: r.prompt,
            max_new_tokens: r.max_new_tokens,
            sampling: r.sampling,
            stop_token_ids: r.stop_token_ids,
            ignore_eos: r.ignore_eos,
        };
        self.scheduler.add_request(req).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    fn abort(&mut self, id: u64) {
        self.scheduler.finish(id, FinishReason::Abort);
    }

    /// Runs one step; returns the events as tuples: ("started", id, prompt_tokens, cached_tokens),
    /// ("token", id, token, logprob), ("prompt_logprobs", id, start, logprobs), ("finished", id, reason, completion_tokens), ("failed", id, message, 0).
    fn step(&mut self, py: Python<'_>) -> PyResult<Vec<PyObject>> {
        let done = if self.overlap { self.step_overlapped() } else { self.step_sync() };
        done.map_err(PyRuntimeError::new_err)?;
        self.scheduler.drain_events().into_iter().map(|ev| event_tuple(py, ev)).collect()
    }

    fn is_idle(&self) -> bool {
        self.scheduler.is_idle() && self.in_flight.is_none()
    }

    /// Scheduler counters (running, queued, KV use, cached tokens, hybrid radix snapshots) as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.scheduler.stats();
        let d = PyDict::new(py);
        d.set_item("running", s.running)?;
        d.set_item("queued", s.queued)?;
        d.set_item("kv_used_tokens", s.kv_used_tokens)?;
        d.set_item("kv_capacity_tokens", s.kv_capacity_tokens)?;
        d.set_item("cached_tokens_in_tree", s.cached_tokens_in_tree)?;
        d.set_item("evictable_tokens", s.evictable_tokens)?;
        d.set_item("snapshot_slots_total", s.snapshot_slots_total)?;
        d.set_item("snapshot_slots_used", s.snapshot_slots_used)?;
        d.set_item("evictable_snapshots", s.evictable_snapshots)?;
        d.set_item("snapshot_hits", s.snapshot_hits)?;
        d.set_item("snapshot_hit_tokens", s.snapshot_hit_tokens)?;
        d.set_item("overlapped_steps", self.overlapped_steps)?;
        Ok(d)
    }

    fn check_integrity(&self) -> PyResult<()> {
        if self.in_flight.is_some() {
            return Ok(()); // checked when nothing is on the device
        }
        self.scheduler.check_integrity().map_err(PyRuntimeError::new_err)
    }
}

impl OfflineEngine {
    /// Plans, runs and commits one step. Errors with the message of a fatal worker failure.
    fn step_sync(&mut self) -> Result<(), String> {
        let Some(plan) = self.scheduler.next_step() else { return Ok(()) };
        let result = self.worker.execute(&plan);
        self.apply(&plan, result)
    }

    /// Commits one step, its successor already launched when the scheduler allows (as the server's loop).
    fn step_overlapped(&mut self) -> Result<(), String> {
        let current = match self.in_flight.take() {
            Some(plan) => plan,
            None => match self.scheduler.next_step() {
                Some(plan) => match self.worker.launch(&plan) {
                    Ok(()) => plan,
                    Err(e) => return self.apply(&plan, Err(e)),
                },
                None => return Ok(()),
            },
        };
        if let Some(next) = self.scheduler.next_step_ahead(&current) {
            match self.worker.launch(&next) {
                Ok(()) => {
                    self.in_flight = Some(next);
                    self.overlapped_steps += 1;
                }
                Err(e) => self.apply(&next, Err(e))?,
            }
        }
        let result = self.worker.collect();
        self.apply(&current, result)
    }

    /// Commits `plan` or fails it (a fatal failure fails everything and is returned).
    fn apply(&mut self, plan: &StepPlan, result: Result<StepOutput, WorkerError>) -> Result<(), String> {
        match result {
            Ok(out) => self.scheduler.commit(plan, &out),
            Err(WorkerError::Fatal(m)) => {
                self.scheduler.fail_all(&m);
                self.in_flight = None;
                return Err(m);
            }
            Err(e) => self.scheduler.fail_step(plan, &e.to_string()),
        }
        Ok(())
    }
}
