//! Which Python environment `ft-server` runs the worker from: `--python-env DIR`, else `$VIRTUAL_ENV`, else the
//! interpreter it was built with (its virtual environment when it is one, else its own installation). The
//! environment must be of the embedded Python's minor version (torch's compiled modules are built per version)
//! and hold `freetoken` and `torch`; otherwise one line says what is missing and how to fix it.

use pyo3::ffi::c_str;
use pyo3::prelude::*;
use std::path::{Path, PathBuf};

/// The Python `ft-server` embeds (`major.minor`, from the build interpreter).
pub const EMBEDDED_VERSION: &str = env!("FT_BUILD_PYTHON_VERSION");

/// The interpreter ft-server was built with.
const BUILD_PYTHON: &str = env!("FT_BUILD_PYTHON");

pub struct PythonEnv {
    /// The environment's root (holds `lib/pythonX.Y/site-packages`); `None`: the embedded installation's own.
    root: Option<PathBuf>,
    /// Where the choice came from, for messages.
    source: &'static str,
}

/// Finds the environment; `Err` is the one-line reason.
pub fn locate(flag: Option<&Path>) -> Result<PythonEnv, String> {
    if let Some(dir) = flag {
        return existing(dir, "--python-env");
    }
    if let Some(dir) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        return existing(Path::new(&dir), "VIRTUAL_ENV");
    }
    let venv = Path::new(BUILD_PYTHON).parent().and_then(Path::parent).filter(|d| d.join("pyvenv.cfg").is_file());
    Ok(PythonEnv { root: venv.map(Path::to_path_buf), source: "the interpreter ft-server was built with" })
}

fn existing(dir: &Path, source: &'static str) -> Result<PythonEnv, String> {
    match dir.canonicalize() {
        Ok(root) if root.is_dir() => Ok(PythonEnv { root: Some(root), source }),
        _ => Err(format!(
            "{source} {}: no such directory (name a virtual environment that holds freetoken and torch)",
            dir.display()
        )),
    }
}

impl PythonEnv {
    /// In the freshly started interpreter: imports come from this environment, as if its own `bin/python`
    /// ran (`activate_env.py`), and it holds freetoken and torch. `Err` is the one-line reason.
    pub fn activate(&self, py: Python<'_>) -> Result<(), String> {
        let code = c_str!(include_str!("activate_env.py"));
        let module = PyModule::from_code(py, code, c"activate_env.py", c"ft_server_activate_env")
            .map_err(|e| e.value(py).to_string())?;
        let root = self.root.as_ref().map(|p| p.to_string_lossy().into_owned());
        module.call_method1("activate", (root, self.source)).map(|_| ()).map_err(|e| e.value(py).to_string())
    }
}
