//! The server in-process with the Python worker, whichever side owns the process: `ft serve` (the interpreter
//! hosts the Rust server through the `freetoken._core` extension, crates/ft-py) and the `ft-server` binary (Rust
//! hosts an embedded interpreter, src/bin/ft-server). Both run [`serve`].
//!
//! - `worker`: the Python worker behind ft-core's `Worker` trait, one call per step (the file lives in ft-py,
//!   where the step contract's Python side is edited with it, and is compiled here once for both)
//! - `description`: the worker's engine description, read strictly; building the worker
//! - `serve`: bind, load, run, with start-up failures in one line
//! - `version`: the `--version` report (the Rust build, the Python packages, the CUDA driver)

#[path = "../../../ft-py/src/py_worker.rs"]
pub mod worker;

pub mod description;
mod serve;
pub mod version;

pub use description::{build_worker, engine_description};
pub use serve::serve;
pub use worker::PyWorker;
