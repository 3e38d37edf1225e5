//! Which Python environment `ft-server` runs the worker from, and starting the embedded interpreter in it.
//!
//! The environment is `--python-env DIR`, else `$VIRTUAL_ENV`, else the interpreter ft-server was built with. The
//! interpreter starts as that environment's own `bin/python` would (`PyConfig.program_name` is its path: CPython
//! reads `pyvenv.cfg`, `site` adds the environment's site-packages and runs its `.pth` files, `sys.executable` is a
//! real interpreter for multiprocessing), whatever `PATH` holds. It must be of the embedded Python's minor version
//! (checked before starting: a foreign standard library would abort the start) and hold `freetoken` and `torch`;
//! otherwise one line says what is missing and how to fix it.

use pyo3::ffi;
use pyo3::prelude::*;
use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The Python `ft-server` embeds (`major.minor`, from the build interpreter).
pub const EMBEDDED_VERSION: &str = env!("FT_BUILD_PYTHON_VERSION");

/// The interpreter ft-server was built with.
const BUILD_PYTHON: &str = env!("FT_BUILD_PYTHON");

pub struct PythonEnv {
    /// The environment's interpreter, whose start-up the embedded one repeats.
    python: PathBuf,
    /// The environment's root (holds `lib/pythonX.Y`).
    root: PathBuf,
    /// Where the choice came from, for messages.
    source: &'static str,
}

/// Finds the environment and checks it is of the embedded Python's version; `Err` is the one-line reason.
pub fn locate(flag: Option<&Path>) -> Result<PythonEnv, String> {
    let env = match (flag, std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty())) {
        (Some(dir), _) => from_root(dir, "--python-env")?,
        (None, Some(dir)) => from_root(Path::new(&dir), "VIRTUAL_ENV")?,
        (None, None) => {
            let python = PathBuf::from(BUILD_PYTHON);
            let root = python.parent().and_then(Path::parent).map(Path::to_path_buf).unwrap_or_default();
            PythonEnv { python, root, source: "the interpreter ft-server was built with" }
        }
    };
    env.check_version()?;
    Ok(env)
}

fn from_root(dir: &Path, source: &'static str) -> Result<PythonEnv, String> {
    let root = dir.canonicalize().ok().filter(|d| d.is_dir()).ok_or_else(|| {
        format!(
            "{source} {}: no such directory (name a virtual environment holding freetoken and torch)",
            dir.display()
        )
    })?;
    let python = ["python3", "python"].iter().map(|name| root.join("bin").join(name)).find(|p| p.exists());
    let python = python.ok_or_else(|| format!("{source} {}: no bin/python3 in it", root.display()))?;
    Ok(PythonEnv { python, root, source })
}

impl PythonEnv {
    /// The environment's standard library and site-packages are of the embedded version.
    fn check_version(&self) -> Result<(), String> {
        if self.root.join("lib").join(format!("python{EMBEDDED_VERSION}")).is_dir() {
            return Ok(());
        }
        let found: Vec<String> = std::fs::read_dir(self.root.join("lib"))
            .map(|dir| dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let found: Vec<&String> = found.iter().filter(|n| n.starts_with("python3")).collect();
        Err(format!(
            "the Python environment {} (from {}) is not Python {EMBEDDED_VERSION} (it has {:?} in lib/): ft-server \
             embeds Python {EMBEDDED_VERSION}; make the environment with python{EMBEDDED_VERSION}, or build ft-server \
             with its interpreter (PYO3_PYTHON=ENV/bin/python cargo build --release -p ft-server)",
            self.root.display(),
            self.source,
            found
        ))
    }

    /// Starts the embedded interpreter as the environment's python, without Python's signal handlers (tokio owns
    /// SIGINT and SIGTERM) and with `sys.argv == ["ft-server"]`; the GIL is released when this returns.
    pub fn start_interpreter(&self) -> Result<(), String> {
        let program = CString::new(self.python.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
        let mut argv = [c"ft-server".as_ptr()];
        // SAFETY: the documented PyConfig sequence (init, set, initialize, clear) on a config we own, before any
        // other Python API call; PyEval_SaveThread then releases the GIL the initializing thread holds.
        unsafe {
            let mut config = std::mem::MaybeUninit::<ffi::PyConfig>::zeroed();
            ffi::PyConfig_InitPythonConfig(config.as_mut_ptr());
            let mut config = config.assume_init();
            config.install_signal_handlers = 0;
            config.parse_argv = 0;
            let mut status = ffi::PyConfig_SetBytesString(&mut config, &mut config.program_name, program.as_ptr());
            if ffi::PyStatus_Exception(status) == 0 {
                status = ffi::PyConfig_SetBytesArgv(&mut config, 1, argv.as_mut_ptr());
            }
            if ffi::PyStatus_Exception(status) == 0 {
                status = ffi::Py_InitializeFromConfig(&config);
            }
            ffi::PyConfig_Clear(&mut config);
            if ffi::PyStatus_Exception(status) != 0 {
                let why = if status.err_msg.is_null() {
                    "unknown".into()
                } else {
                    CStr::from_ptr(status.err_msg).to_string_lossy()
                };
                return Err(format!("cannot start Python as {}: {why}", self.python.display()));
            }
            ffi::PyEval_SaveThread();
        }
        Ok(())
    }

    /// The started interpreter sees `freetoken` and `torch`; `Err` is the one-line reason.
    pub fn check_packages(&self, py: Python<'_>) -> Result<(), String> {
        let find_spec = py.import("importlib.util").and_then(|m| m.getattr("find_spec")).map_err(|e| e.to_string())?;
        let missing: Vec<&str> = ["freetoken", "torch"]
            .into_iter()
            .filter(|name| find_spec.call1((*name,)).map_or(true, |spec| spec.is_none()))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(format!(
            "the Python environment {} (from {}) lacks {}: pip install the freetoken wheel there (torch comes with \
             it), or name another with --python-env DIR",
            self.root.display(),
            self.source,
            missing.join(" and ")
        ))
    }
}
