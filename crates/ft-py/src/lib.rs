//! `freetoken._core`: the Rust half of FreeToken inside the Python process.
//!
//! - `serve(argv)` runs `ft serve`: parses the flags (ft-server's CLI), builds the Python worker, then
//!   releases the GIL and runs the HTTP server; the engine thread takes the GIL once per step.
//! - `OfflineEngine` runs the same scheduler and worker synchronously for `freetoken.LLM` (tests, notebooks).

mod offline;
mod py_worker;

use ft_server::backend::ModelInfo;
use ft_server::cli::Command;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use py_worker::PyWorker;

/// Reads the worker's `info()` dict into the HTTP side's [`ModelInfo`].
fn model_info(info: &Bound<'_, PyDict>) -> PyResult<ModelInfo> {
    fn get<'py, T: FromPyObject<'py>>(d: &Bound<'py, PyDict>, k: &str) -> PyResult<Option<T>> {
        match d.get_item(k)? {
            Some(v) if !v.is_none() => Ok(Some(v.extract()?)),
            _ => Ok(None),
        }
    }
    Ok(ModelInfo {
        served_model_name: get(info, "served_model_name")?.unwrap_or_default(),
        architecture: get(info, "architecture")?.unwrap_or_default(),
        max_context: get(info, "max_context")?.unwrap_or(4096),
        vocab_size: get(info, "vocab_size")?.unwrap_or(0),
        tokenizer_path: get::<String>(info, "tokenizer_path")?.unwrap_or_default().into(),
        chat_template: get(info, "chat_template")?,
        bos_token: get(info, "bos_token")?,
        eos_token: get(info, "eos_token")?,
        eos_token_ids: get(info, "eos_token_ids")?.unwrap_or_default(),
        add_bos_token: get(info, "add_bos_token")?.unwrap_or(false),
        bos_token_id: get(info, "bos_token_id")?,
        kv_capacity_tokens: get(info, "kv_capacity_tokens")?.unwrap_or(0),
        planned_workspace_bytes: get(info, "planned_workspace_bytes")?,
        generation_defaults: generation_defaults(info)?,
    })
}

/// The model's `generation_config.json` sampling values (temperature, top_p, top_k, min_p), if it has any.
fn generation_defaults(info: &Bound<'_, PyDict>) -> PyResult<Option<ft_core::request::SamplingParams>> {
    let Some(gen) = info.get_item("generation_config")? else { return Ok(None) };
    let Ok(gen) = gen.downcast::<PyDict>() else { return Ok(None) };
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
        seed: None,
    }))
}

/// Builds the worker for `args` (a dict of the `ft serve` flags) and returns it with its model info.
pub(crate) fn build_worker(py: Python<'_>, args: &Bound<'_, PyDict>) -> PyResult<(PyWorker, ModelInfo, usize)> {
    let worker = py.import("freetoken.worker")?.getattr("Worker")?.call1((args,))?;
    let info_obj = worker.call_method0("info")?;
    let info = info_obj.downcast::<PyDict>()?;
    let version: u32 = info.get_item("step_contract_version")?.map(|v| v.extract()).transpose()?.unwrap_or(0);
    if version != ft_core::step::STEP_CONTRACT_VERSION {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "step contract mismatch: worker speaks version {version}, engine {}",
            ft_core::step::STEP_CONTRACT_VERSION
        )));
    }
    let num_state_slots: usize = info.get_item("num_state_slots")?.map(|v| v.extract()).transpose()?.unwrap_or(0);
    Ok((PyWorker::new(worker.unbind()), model_info(info)?, num_state_slots))
}

/// `ft ...`: returns the process exit code.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    let cli = match ft_server::cli::parse_cli(argv) {
        Ok(cli) => cli,
        Err((message, code)) => {
            if code == 0 {
                println!("{message}");
            } else {
                eprintln!("{message}");
            }
            return Ok(code);
        }
    };
    match cli.command {
        Command::Serve(args) => serve(py, args),
    }
}

fn serve(py: Python<'_>, args: ft_server::cli::ServeArgs) -> PyResult<i32> {
    ft_server::logging::init_logging(&args.log_level);
    let json = serde_json::to_string(&args).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    let args_dict = py.import("json")?.getattr("loads")?.call1((json,))?;
    let args_dict = args_dict.downcast::<PyDict>()?;
    let (worker, info, num_state_slots) = match build_worker(py, args_dict) {
        Ok(x) => x,
        Err(e) => {
            // Load failures (unsupported model, missing file) are the user's to fix: one clear line, exit 1.
            let msg = e.value(py).to_string();
            let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
            if kind == "UnsupportedModel" || kind == "FileNotFoundError" || kind == "ValueError" {
                tracing::error!("{msg}");
                eprintln!("error: {msg}");
                return Ok(1);
            }
            return Err(e);
        }
    };
    let worker = worker.with_stack_dump(args.step_timeout);
    let code = py.allow_threads(move || ft_server::launch::run(args, Box::new(worker), info, num_state_slots));
    Ok(code)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("STEP_CONTRACT_VERSION", ft_core::step::STEP_CONTRACT_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_class::<offline::OfflineEngine>()?;
    Ok(())
}
