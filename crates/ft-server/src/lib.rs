//! ft-server: everything between the socket and the engine thread, grouped by concern:
//!
//! - `cli` the flags, `launch` start-up, `stop_signals` SIGTERM / SIGINT kept for the drain, `logging`; `python`
//!   the server in-process with the Python worker (for `ft serve` and the `ft-server` binary); `notify` and
//!   `readiness` systemd's notify protocol;
//! - `http` the server, routes, the shared SSE loop, wire types and errors; `validation` the one place that
//!   checks a request's content and builds what the engine runs;
//! - `text` tokenizer, chat template, detokenizer, stop strings, tool-call and reasoning parsers;
//! - `engine` the engine thread, its watchdog and status lines; `backend` the seam between HTTP and engine;
//!   `metrics` the Prometheus registry.

pub mod backend;
pub mod cli;
pub mod engine;
pub mod http;
pub mod launch;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod python;
pub mod readiness;
pub mod stop_signals;
pub mod text;
pub mod validation;
