//! The Python worker seen from Rust: flattens a [`StepPlan`] into the flat arrays that
//! `python/freetoken/engine/step_plan.py` decodes, calls `worker.execute(plan)` once per step (or, in the
//! overlap loop, `worker.launch(plan)` and later `worker.collect()`), and maps the worker's typed exceptions
//! onto [`WorkerError`].

use ft_core::step::{StepKind, StepOutput, StepPlan, TopLogprobs, Worker, WorkerError, STEP_CONTRACT_VERSION};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

pub struct PyWorker {
    obj: Py<PyAny>,
    /// Plans launched and not yet collected, oldest first (the output is checked against its plan).
    launched: std::collections::VecDeque<StepPlan>,
    /// When set, `faulthandler` dumps every Python thread's stack if a step runs this long (the engine's
    /// watchdog fires at the same deadline).
    stack_dump_after_s: Option<f64>,
}

impl PyWorker {
    pub fn new(obj: Py<PyAny>) -> Self {
        PyWorker { obj, launched: Default::default(), stack_dump_after_s: None }
    }

    pub fn with_stack_dump(mut self, seconds: f64) -> Self {
        self.stack_dump_after_s = Some(seconds);
        self
    }
}

fn i32_bytes(values: impl IntoIterator<Item = i64>) -> Vec<u8> {
    values.into_iter().flat_map(|v| (v as i32).to_le_bytes()).collect()
}

fn i64_bytes(values: impl IntoIterator<Item = i64>) -> Vec<u8> {
    values.into_iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32_bytes(values: impl IntoIterator<Item = f32>) -> Vec<u8> {
    values.into_iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The flat encoding of `plan` (see the module doc of `step_plan.py`).
pub fn flatten_plan<'py>(py: Python<'py>, plan: &StepPlan) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let put = |key: &str, bytes: Vec<u8>| d.set_item(key, PyBytes::new(py, &bytes));
    d.set_item("version", STEP_CONTRACT_VERSION)?;
    d.set_item("step_id", plan.step_id)?;
    d.set_item(
        "kind",
        match plan.kind {
            StepKind::Prefill => "prefill",
            StepKind::Decode => "decode",
            StepKind::Mixed => "mixed",
        },
    )?;
    let seqs = &plan.seqs;
    put("request_ids", i64_bytes(seqs.iter().map(|s| s.request_id as i64)))?;
    put("input_ids", i32_bytes(seqs.iter().flat_map(|s| s.new_tokens.iter().map(|&t| t as i64))))?;
    put("input_from_prev", i32_bytes(seqs.iter().map(|s| s.input_from_prev.map_or(-1, |r| r as i64))))?;
    let mut cu = vec![0i64];
    let mut ti = vec![0i64];
    for s in seqs {
        cu.push(cu.last().unwrap() + s.new_tokens.len() as i64);
        ti.push(ti.last().unwrap() + s.table_slots.len() as i64);
    }
    put("cu_seqlens", i32_bytes(cu))?;
    put("table_indptr", i32_bytes(ti))?;
    put("prefix_lens", i32_bytes(seqs.iter().map(|s| s.prefix_len as i64)))?;
    put("rows", i32_bytes(seqs.iter().map(|s| s.row as i64)))?;
    put("table_from", i32_bytes(seqs.iter().map(|s| s.table_from as i64)))?;
    put("table_slots", i32_bytes(seqs.iter().flat_map(|s| s.table_slots.iter().map(|&t| t as i64))))?;
    put("state_slots", i32_bytes(seqs.iter().map(|s| s.state_slot as i64)))?;
    put_sampling(&d, plan)?;
    put("copy_src", i32_bytes(plan.state_copies.iter().map(|c| c.src as i64)))?;
    put("copy_dst", i32_bytes(plan.state_copies.iter().map(|c| c.dst as i64)))?;
    put("snap_seq", i32_bytes(plan.snapshots.iter().map(|c| c.seq_index as i64)))?;
    put("snap_upto", i32_bytes(plan.snapshots.iter().map(|c| c.upto as i64)))?;
    put("snap_slot", i32_bytes(plan.snapshots.iter().map(|c| c.slot as i64)))?;
    Ok(d)
}

/// The sampled rows' settings and the prompt-logprob chunks of `plan`, into `d`.
fn put_sampling(d: &Bound<'_, PyDict>, plan: &StepPlan) -> PyResult<()> {
    let py = d.py();
    let put = |key: &str, bytes: Vec<u8>| d.set_item(key, PyBytes::new(py, &bytes));
    let seqs = &plan.seqs;
    let sampled: Vec<(usize, &ft_core::step::SampleSpec)> =
        seqs.iter().enumerate().filter_map(|(i, s)| s.sample.as_ref().map(|p| (i, p))).collect();
    put("sample_index", i32_bytes(sampled.iter().map(|(i, _)| *i as i64)))?;
    put("temperature", f32_bytes(sampled.iter().map(|(_, p)| p.temperature)))?;
    put("top_p", f32_bytes(sampled.iter().map(|(_, p)| p.top_p)))?;
    put("top_k", i32_bytes(sampled.iter().map(|(_, p)| p.top_k as i64)))?;
    put("min_p", f32_bytes(sampled.iter().map(|(_, p)| p.min_p)))?;
    put("presence_penalty", f32_bytes(sampled.iter().map(|(_, p)| p.presence_penalty)))?;
    put("frequency_penalty", f32_bytes(sampled.iter().map(|(_, p)| p.frequency_penalty)))?;
    put("seeds", i64_bytes(sampled.iter().map(|(_, p)| p.seed as i64)))?;
    put("num_top_logprobs", i32_bytes(sampled.iter().map(|(_, p)| p.num_top_logprobs as i64)))?;
    let prompt: Vec<(usize, ft_core::step::PromptLogprobsSpec)> =
        seqs.iter().enumerate().filter_map(|(i, s)| s.prompt_logprobs.map(|p| (i, p))).collect();
    put("plp_seq", i32_bytes(prompt.iter().map(|(i, _)| *i as i64)))?;
    put("plp_next", i32_bytes(prompt.iter().map(|(_, p)| p.next_token.map_or(-1, |t| t as i64))))?;
    put("plp_top", i32_bytes(prompt.iter().map(|(_, p)| p.num_top as i64)))?;
    Ok(())
}

/// Maps a Python exception to the contract's error kinds by the worker's exception classes
/// (`freetoken.errors`); anything unexpected is fatal, with its traceback.
pub fn classify_error(py: Python<'_>, err: PyErr) -> WorkerError {
    let type_name = err.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
    let message = err.value(py).to_string();
    match type_name.as_str() {
        "WorkerOutOfMemory" | "OutOfMemoryError" => WorkerError::OutOfMemory(message),
        "InvalidPlan" => WorkerError::InvalidPlan(message),
        _ => {
            let tb = err.traceback(py).and_then(|tb| tb.format().ok()).unwrap_or_default();
            WorkerError::Fatal(format!("{type_name}: {message}\n{tb}"))
        }
    }
}

/// `execute`'s answer: `(tokens, logprobs, stats, logprobs_extra)` (see `step_plan.py`).
fn parse_output(ret: Bound<'_, PyAny>) -> PyResult<StepOutput> {
    let (tokens, logprobs, stats, extra): (Vec<u32>, Vec<f32>, Bound<'_, PyAny>, Bound<'_, PyDict>) = ret.extract()?;
    let mut out = StepOutput { tokens, logprobs, ..Default::default() };
    if let Ok(d) = stats.downcast::<PyDict>() {
        let get_f = |k: &str| d.get_item(k).ok().flatten().and_then(|v| v.extract::<f64>().ok());
        out.stats.forward_ms = get_f("forward_ms").unwrap_or(0.0);
        out.stats.expert_hits = get_f("expert_hits").unwrap_or(0.0) as u64;
        out.stats.expert_misses = get_f("expert_misses").unwrap_or(0.0) as u64;
        out.stats.expert_host_misses = get_f("expert_host_misses").unwrap_or(0.0) as u64;
        out.stats.expert_host_busy_ms = get_f("expert_host_busy_ms").unwrap_or(0.0);
        out.stats.prefill_experts_from_cache = get_f("prefill_experts_from_cache").unwrap_or(0.0) as u64;
        out.stats.prefill_experts_from_host = get_f("prefill_experts_from_host").unwrap_or(0.0) as u64;
        out.stats.workspace_bytes = get_f("workspace_bytes").unwrap_or(0.0) as u64;
        out.stats.device_ms = get_f("device_ms").unwrap_or(0.0);
        out.stats.launch_ms = get_f("launch_ms").unwrap_or(0.0);
    }
    out.top_logprobs = top_logprobs(&extra, "top")?;
    out.prompt_logprobs = f32s(&extra, "prompt_logprobs")?;
    out.prompt_top_logprobs = top_logprobs(&extra, "prompt_top")?;
    Ok(out)
}

/// Little-endian 4-byte values under `key` (absent: none).
fn le4<T>(d: &Bound<'_, PyDict>, key: &str, from: fn([u8; 4]) -> T) -> PyResult<Vec<T>> {
    let Some(v) = d.get_item(key)? else { return Ok(vec![]) };
    let bytes: Vec<u8> = v.extract()?;
    Ok(bytes.chunks_exact(4).map(|c| from([c[0], c[1], c[2], c[3]])).collect())
}

fn f32s(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Vec<f32>> {
    le4(d, key, f32::from_le_bytes)
}

/// `{prefix}_k`, `{prefix}_ids` (i32) and `{prefix}_logprobs` (f32).
fn top_logprobs(d: &Bound<'_, PyDict>, prefix: &str) -> PyResult<TopLogprobs> {
    let k = match d.get_item(format!("{prefix}_k"))? {
        Some(v) => v.extract::<usize>()?,
        None => 0,
    };
    let ids = le4(d, &format!("{prefix}_ids"), |b| i32::from_le_bytes(b) as u32)?;
    Ok(TopLogprobs { k, ids, logprobs: f32s(d, &format!("{prefix}_logprobs"))? })
}

impl PyWorker {
    /// Calls `method(plan)` (or `method()`) on the Python worker with `faulthandler` armed for the stack-dump
    /// deadline.
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        plan: Option<Bound<'py, PyDict>>,
    ) -> Result<Bound<'py, PyAny>, WorkerError> {
        let faulthandler = match self.stack_dump_after_s {
            Some(secs) => {
                let fh = py.import("faulthandler").map_err(|e| classify_error(py, e))?;
                fh.call_method1("dump_traceback_later", (secs,)).map_err(|e| classify_error(py, e))?;
                Some(fh)
            }
            None => None,
        };
        let obj = self.obj.bind(py);
        let ret = match plan {
            Some(flat) => obj.call_method1(method, (flat,)),
            None => obj.call_method0(method),
        };
        if let Some(fh) = faulthandler {
            let _ = fh.call_method0("cancel_dump_traceback_later");
        }
        ret.map_err(|e| classify_error(py, e))
    }
}

/// A step's answer, parsed and checked against its plan (a malformed answer is fatal).
fn step_output(ret: Bound<'_, PyAny>, plan: &StepPlan) -> Result<StepOutput, WorkerError> {
    let out = parse_output(ret).map_err(|e| WorkerError::Fatal(format!("bad worker output: {e}")))?;
    out.check(plan).map_err(WorkerError::Fatal)?;
    Ok(out)
}

impl Worker for PyWorker {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutput, WorkerError> {
        Python::with_gil(|py| {
            let flat = flatten_plan(py, plan).map_err(|e| classify_error(py, e))?;
            step_output(self.call(py, "execute", Some(flat))?, plan)
        })
    }

    fn launch(&mut self, plan: &StepPlan) -> Result<(), WorkerError> {
        Python::with_gil(|py| {
            let flat = flatten_plan(py, plan).map_err(|e| classify_error(py, e))?;
            self.call(py, "launch", Some(flat))?;
            self.launched.push_back(plan.clone());
            Ok(())
        })
    }

    fn collect(&mut self) -> Result<StepOutput, WorkerError> {
        let plan =
            self.launched.pop_front().ok_or_else(|| WorkerError::Fatal("collect without a launched step".into()))?;
        Python::with_gil(|py| step_output(self.call(py, "collect", None)?, &plan))
    }
}
