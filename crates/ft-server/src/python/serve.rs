//! `ft serve` and `ft-server` after their flags are parsed:
//!
//! ```text
//!  bind --host:--port ─▶ load the worker (Python) ─▶ launch::run (engine thread + HTTP, GIL released)
//!   busy port: one line,    unsupported model, missing file, too little host memory: one line,
//!   exit 1, nothing loaded  exit 1; anything else: the Python traceback
//! ```
//!
//! Each start-up failure is said once: an `error: ...` line on stderr (also the service manager's status).

use super::worker::PyWorker;
use crate::backend::EngineDescription;
use crate::cli::ServeArgs;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Serves `args` until shutdown; returns the process exit code. `Err` only for an unexpected Python failure
/// while loading (its traceback is the message).
pub fn serve(py: Python<'_>, args: ServeArgs) -> PyResult<i32> {
    crate::logging::init_logging(&args.log_level);
    let listener = match crate::launch::bind_listener(&args) {
        Ok(listener) => listener,
        Err(msg) => return Ok(start_up_failed(&msg)),
    };
    if let Ok(addr) = listener.local_addr() {
        crate::notify::status(&format!("Loading the model (the API will answer on {addr})"));
    }
    let (worker, info) = match load_worker(py, &args)? {
        Ok(loaded) => loaded,
        Err(msg) => return Ok(start_up_failed(&msg)),
    };
    let worker = worker.with_stack_dump(args.step_timeout);
    Ok(py.allow_threads(move || crate::launch::run(args, listener, Box::new(worker), info)))
}

/// Says why start-up failed, once, and returns exit code 1.
fn start_up_failed(msg: &str) -> i32 {
    eprintln!("error: {msg}");
    crate::notify::status(&format!("Start-up failed: {msg}"));
    1
}

/// Builds the worker. `Ok(Err(message))` for failures the user fixes (an unsupported model, a missing file, a
/// bad value, too little memory); `Err` for anything else.
fn load_worker(py: Python<'_>, args: &ServeArgs) -> PyResult<Result<(PyWorker, EngineDescription), String>> {
    let json = serde_json::to_string(args).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    let args_dict = py.import("json")?.getattr("loads")?.call1((json,))?;
    match super::build_worker(py, args_dict.downcast::<PyDict>()?) {
        Ok(loaded) => Ok(Ok(loaded)),
        Err(e) if is_users_to_fix(py, &e) => Ok(Err(e.value(py).to_string())),
        Err(e) => Err(e),
    }
}

/// Load failures that are the user's to fix, said in one line: `freetoken.errors.UnsupportedModel` and its
/// subclasses (a key config.json lacks), `StartupRefused` (too little host memory), a missing file, a bad value.
fn is_users_to_fix(py: Python<'_>, e: &PyErr) -> bool {
    let is = |name: &str| {
        py.import("freetoken.errors").and_then(|m| m.getattr(name)).is_ok_and(|cls| e.is_instance(py, &cls))
    };
    let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
    let missing_file = e.is_instance_of::<pyo3::exceptions::PyFileNotFoundError>(py); // the demo model's too
    is("UnsupportedModel") || is("StartupRefused") || missing_file || kind == "ValueError"
}
