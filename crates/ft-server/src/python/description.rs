//! The worker's engine description (`Worker.info()`: the model's facts, read once at start-up and strictly: a
//! missing or mistyped key is a start-up error naming it, never a default) and building the worker.

use super::worker::PyWorker;
use crate::backend::EngineDescription;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Reads the worker's `info()` dict (its engine description) strictly: a key that is missing or of the wrong
/// type is a start-up error naming it, never a default.
pub fn engine_description(info: &Bound<'_, PyDict>) -> PyResult<EngineDescription> {
    fn req<'py, T: FromPyObject<'py>>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<T> {
        let v = d.get_item(k)?.ok_or_else(|| {
            pyo3::exceptions::PyKeyError::new_err(format!("the worker's engine description lacks {k:?}"))
        })?;
        v.extract().map_err(|e| pyo3::exceptions::PyTypeError::new_err(format!("engine description {k:?}: {e}")))
    }
    let version: u32 = req(info, "step_contract_version")?;
    if version != ft_core::step::STEP_CONTRACT_VERSION {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "step contract mismatch: worker speaks version {version}, engine {}",
            ft_core::step::STEP_CONTRACT_VERSION
        )));
    }
    Ok(EngineDescription {
        served_model_name: req(info, "served_model_name")?,
        model_aliases: req(info, "model_aliases")?,
        architecture: req(info, "architecture")?,
        max_context: req(info, "max_context")?,
        vocab_size: req(info, "vocab_size")?,
        kv_capacity_tokens: req(info, "kv_capacity_tokens")?,
        num_state_slots: req(info, "num_state_slots")?,
        num_snapshot_slots: req(info, "num_snapshot_slots")?,
        tool_call_token_id: req(info, "tool_call_token_id")?,
        cache_types: req(info, "cache_types")?,
        tokenizer_path: req::<String>(info, "tokenizer_path")?.into(),
        chat_template: req(info, "chat_template")?,
        bos_token: req(info, "bos_token")?,
        eos_token: req(info, "eos_token")?,
        eos_token_ids: req(info, "eos_token_ids")?,
        add_bos_token: req(info, "add_bos_token")?,
        bos_token_id: req(info, "bos_token_id")?,
        planned_workspace_bytes: req(info, "planned_workspace_bytes")?,
        cuda_graph_sizes: req(info, "cuda_graph_sizes")?,
        dtype: req(info, "dtype")?,
        device: req(info, "device")?,
        generation_defaults: generation_defaults(&req(info, "generation_config")?)?,
    })
}

/// The model's `generation_config.json` sampling values (temperature, top_p, top_k, min_p), if it has any.
fn generation_defaults(gen: &Bound<'_, PyDict>) -> PyResult<Option<ft_core::request::SamplingParams>> {
    let f = |k: &str| -> PyResult<Option<f64>> {
        match gen.get_item(k)? {
            Some(v) if !v.is_none() => Ok(v.extract::<f64>().ok()),
            _ => Ok(None),
        }
    };
    let (t, p, k, m) = (f("temperature")?, f("top_p")?, f("top_k")?, f("min_p")?);
    if t.is_none() && p.is_none() && k.is_none() && m.is_none() {
        return Ok(None);
    }
    Ok(Some(ft_core::request::SamplingParams {
        temperature: t.unwrap_or(1.0) as f32,
        top_p: p.unwrap_or(1.0) as f32,
        top_k: k.unwrap_or(0.0) as i32,
        min_p: m.unwrap_or(0.0) as f32,
        ..Default::default()
    }))
}

/// Builds the worker for `args` (a dict of the `ft serve` flags) and returns it with its engine description.
pub fn build_worker(py: Python<'_>, args: &Bound<'_, PyDict>) -> PyResult<(PyWorker, EngineDescription)> {
    let worker = py.import("freetoken.worker")?.getattr("Worker")?.call1((args,))?;
    let info_obj = worker.call_method0("info")?;
    let description = engine_description(info_obj.downcast::<PyDict>()?)?;
    Ok((PyWorker::new(worker.unbind()), description))
}
