//! `freetoken._core`: the Rust half of FreeToken inside the Python process.
//!
//! - `serve(argv)` runs `ft serve`: parses the flags (ft-server's CLI), builds the Python worker, then
//!   releases the GIL and runs the HTTP server; the engine thread takes the GIL once per step.
//! - `OfflineEngine` runs the same scheduler and worker synchronously for `freetoken.LLM` (tests, notebooks).

mod offline;
mod py_worker;

use ft_server::backend::EngineDescription;
use ft_server::cli::Command;
use py_worker::PyWorker;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Reads the worker's `info()` dict (its engine description) strictly: a key that is missing or of the wrong
/// type is a start-up error naming it, never a default.
pub(crate) fn engine_description(info: &Bound<'_, PyDict>) -> PyResult<EngineDescription> {
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
pub(crate) fn build_worker(py: Python<'_>, args: &Bound<'_, PyDict>) -> PyResult<(PyWorker, EngineDescription)> {
    let worker = py.import("freetoken.worker")?.getattr("Worker")?.call1((args,))?;
    let info_obj = worker.call_method0("info")?;
    let description = engine_description(info_obj.downcast::<PyDict>()?)?;
    Ok((PyWorker::new(worker.unbind()), description))
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
    let (worker, info) = match build_worker(py, args_dict) {
        Ok(x) => x,
        Err(e) => {
            // Load failures (unsupported model, missing file) are the user's to fix: one clear line, exit 1.
            let msg = e.value(py).to_string();
            let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
            // UnsupportedModel and its subclasses (MissingConfigKey: a key config.json lacks).
            let unsupported = py
                .import("freetoken.errors")
                .and_then(|m| m.getattr("UnsupportedModel"))
                .is_ok_and(|cls| e.is_instance(py, &cls));
            if unsupported || kind == "FileNotFoundError" || kind == "ValueError" {
                tracing::error!("{msg}");
                eprintln!("error: {msg}");
                return Ok(1);
            }
            return Err(e);
        }
    };
    let worker = worker.with_stack_dump(args.step_timeout);
    let code = py.allow_threads(move || ft_server::launch::run(args, Box::new(worker), info));
    Ok(code)
}

/// Every `ft serve` flag with its default, as JSON (snake_case keys): the Python side's defaults, so they are
/// declared once, on the flags.
#[pyfunction]
fn serve_defaults() -> PyResult<String> {
    let cli = ft_server::cli::parse_cli(vec!["ft".into(), "serve".into()])
        .map_err(|(msg, _)| pyo3::exceptions::PyRuntimeError::new_err(msg))?;
    let Command::Serve(args) = cli.command;
    serde_json::to_string(&args).map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("STEP_CONTRACT_VERSION", ft_core::step::STEP_CONTRACT_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(serve_defaults, m)?)?;
    m.add_class::<offline::OfflineEngine>()?;
    Ok(())
}
