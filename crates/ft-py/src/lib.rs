//! `freetoken._core`: the Rust half of FreeToken inside the Python process.
//!
//! - `main(argv)` is the `ft` command: parses the flags (ft-server's CLI) and runs `ft serve` through
//!   `ft_server::python::serve` (bind, build the Python worker, then release the GIL and run the HTTP server; the
//!   engine thread takes the GIL once per step), the same path as the `ft-server` binary.
//! - `ft quantize` runs the Python quantizer (`freetoken.quant.quantize_checkpoint.main`) with the parsed flags.
//! - `OfflineEngine` runs the same scheduler and worker synchronously for `freetoken.LLM` (tests, notebooks).
//! - `CpuExpertExecutor` and `CpuExpertBank` run MoE routed experts on the host CPU (`ft-cpu-experts`) for
//!   `freetoken.moe.cpu_experts`; `CpuExpertMailbox` runs one layer's call of them (`cpu_expert_call.rs`) when the
//!   GPU asks, from a thread polling pinned memory (the hybrid backend's hand-off).

mod cpu_expert_call;
mod cpu_expert_mailbox;
mod cpu_experts;
mod offline;

// The worker adapter and the engine description are ft-server's (`ft_server::python`), shared with the
// `ft-server` binary.
pub(crate) use ft_server::python::engine_description;
pub(crate) use ft_server::python::worker as py_worker;

use ft_server::cli::Command;
use pyo3::prelude::*;

/// The commit this extension was built from (build.rs).
const GIT_COMMIT: &str = env!("FT_GIT_COMMIT");

/// `ft ...`: returns the process exit code. `ft --version` answers with the long report
/// (`ft_server::python::version`), help and errors as the CLI renders them.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    if ft_server::cli::wants_version(&argv) {
        let first = format!("ft {} (commit {GIT_COMMIT})", env!("CARGO_PKG_VERSION"));
        println!("{}", ft_server::python::version::report(py, &first, false));
        return Ok(0);
    }
    let cli = match ft_server::cli::parse_cli(argv) {
        Ok(cli) => cli,
        Err((message, code)) => return Ok(ft_server::cli::print_outcome(&message, code)),
    };
    match cli.command {
        Command::Serve(args) => ft_server::python::serve(py, args),
        Command::Quantize(args) => Ok(quantize(py, &args)),
    }
}

/// `ft quantize`: the quantizer's own exit code; an exception is one `error:` line and exit 1.
fn quantize(py: Python<'_>, args: &ft_server::cli::QuantizeArgs) -> i32 {
    let run = || -> PyResult<i32> {
        let main = py.import("freetoken.quant.quantize_checkpoint")?.getattr("main")?;
        main.call1((args.python_argv(),))?.extract()
    };
    run().unwrap_or_else(|e| {
        let message = e.value(py).to_string();
        ft_server::cli::print_outcome(&format!("error: {}", message.lines().next().unwrap_or_default()), 1)
    })
}

/// Every `ft serve` flag with its default, as JSON (snake_case keys): the Python side's defaults, so they are
/// declared once, on the flags.
#[pyfunction]
fn serve_defaults() -> PyResult<String> {
    let cli = ft_server::cli::parse_cli(vec!["ft".into(), "serve".into()])
        .map_err(|(msg, _)| pyo3::exceptions::PyRuntimeError::new_err(msg))?;
    let Command::Serve(args) = cli.command else { unreachable!("argv is ft serve") };
    serde_json::to_string(&args).map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("STEP_CONTRACT_VERSION", ft_core::step::STEP_CONTRACT_VERSION)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("GIT_COMMIT", GIT_COMMIT)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(serve_defaults, m)?)?;
    m.add_class::<offline::OfflineEngine>()?;
    m.add_class::<cpu_experts::CpuExpertBank>()?;
    m.add_class::<cpu_experts::CpuExpertExecutor>()?;
    // the phases `CpuExpertExecutor.take_call_times` times (`<phase>_ns`), in a call's order
    m.add("CPU_EXPERT_PHASES", ft_cpu_experts::PHASES.to_vec())?;
    m.add_function(wrap_pyfunction!(cpu_expert_call::cpu_expert_call_failed, m)?)?;
    m.add_class::<cpu_expert_mailbox::CpuExpertMailbox>()?;
    Ok(())
}
