//! `ft-server`: FreeToken's server as one executable. The HTTP server, scheduler and engine loop are linked in;
//! the Python interpreter is embedded through PyO3 and runs the worker (torch, Triton) from a Python environment
//! that holds the `freetoken` package and torch:
//!
//! ```text
//!  ft-server [--python-env DIR] <ft serve's flags>
//!    flags (the same ServeArgs, the same checks) ─▶ find the environment and start the interpreter as its
//!    python (python_env.rs) ─▶ freetoken and torch there? ─▶ ft_server::python::serve
//! ```
//!
//! Exit codes as `ft serve`: 0 after a requested shutdown, 1 when start-up fails or the engine dies, 2 for bad
//! flags.

mod python_env;

use clap::Parser;
use ft_server::cli::ServeArgs;
use pyo3::prelude::*;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(name = "ft-server", about = "FreeToken's OpenAI-compatible server, one executable (the flags of `ft serve`)")]
struct ServerCli {
    /// The Python environment holding freetoken and torch: a virtual environment or a Python prefix (default:
    /// $VIRTUAL_ENV, else the interpreter ft-server was built with).
    #[arg(long, help_heading = "Python environment")]
    python_env: Option<PathBuf>,

    /// Print the version, the environment's freetoken, torch and triton, and the CUDA driver.
    #[arg(short = 'V', long)]
    version: bool,

    #[command(flatten)]
    serve: ServeArgs,
}

fn main() -> ExitCode {
    let cli = match ServerCli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return exit(ft_server::cli::clap_outcome(e)),
    };
    if !cli.version {
        if let Err(refused) = ft_server::cli::check_serve_args(&cli.serve) {
            return exit(refused);
        }
    }
    let env = match python_env::locate(cli.python_env.as_deref()) {
        Ok(env) => env,
        Err(msg) if cli.version => return exit((format!("{}\npython environment: {msg}", first_line()), 0)),
        Err(msg) => return exit((format!("error: {msg}"), 1)),
    };
    if let Err(msg) = env.start_interpreter() {
        return exit((format!("error: {msg}"), 1));
    }
    let code = Python::with_gil(|py| {
        if let Err(msg) = env.check_packages(py) {
            if cli.version {
                return ft_server::cli::print_outcome(&format!("{}\npython environment: {msg}", first_line()), 0);
            }
            return ft_server::cli::print_outcome(&format!("error: {msg}"), 1);
        }
        if cli.version {
            return ft_server::cli::print_outcome(&ft_server::python::version::report(py, &first_line(), true), 0);
        }
        ft_server::python::serve(py, cli.serve).unwrap_or_else(|e| {
            e.print(py);
            1
        })
    });
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// `ft-server 0.1.0 (embeds Python 3.11)`.
fn first_line() -> String {
    format!("ft-server {} (embeds Python {})", env!("CARGO_PKG_VERSION"), python_env::EMBEDDED_VERSION)
}

fn exit((message, code): (String, i32)) -> ExitCode {
    ExitCode::from(u8::try_from(ft_server::cli::print_outcome(&message, code)).unwrap_or(1))
}
