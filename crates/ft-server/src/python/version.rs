//! `ft --version` and `ft-server --version`: this build and what it would serve with, as a person asks it
//! before filing a bug:
//!
//! ```text
//! ft 0.1.0 (commit 1d14b10c2f3e)
//! python 3.11.7 (/srv/ft/.venv/bin/python)
//! torch 2.11.0+cu130 (CUDA 13.0 build)
//! triton 3.6.0
//! CUDA: driver 13.0, 1 device(s)
//! ```
//!
//! The Python lines come from `freetoken.version_info`, which reads package metadata and never imports torch.

use pyo3::prelude::*;

/// The report: `first_line` (the Rust build), then the Python side's lines (`with_package` adds the freetoken
/// package's own version, commit and location: `ft-server` runs whichever freetoken its environment holds).
pub fn report(py: Python<'_>, first_line: &str, with_package: bool) -> String {
    let python_side = py
        .import("freetoken.version_info")
        .and_then(|m| m.call_method1("describe", (with_package,)))
        .and_then(|text| text.extract::<String>());
    match python_side {
        Ok(text) => format!("{first_line}\n{}", text.trim_end()),
        Err(e) => format!("{first_line}\nfreetoken (Python): not importable: {}", e.value(py)),
    }
}
