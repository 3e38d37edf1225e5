//! SIGTERM and SIGINT belong to the server: they start the drain (`http::server`).
//!
//! Libraries the worker loads can leave handlers of their own on them. LLVM, inside Triton's compiler, installs one
//! the first time it compiles a kernel: it puts back the action it found and raises the signal again. Python leaves
//! its own on SIGINT. tokio, when it first listens for a signal, keeps the handler it finds and calls it after its
//! own, so on a GPU server that had compiled kernels at start-up a SIGTERM was seen by tokio and then killed the
//! process by the default action before the drain ran (exit -15, no drain line). [`claim`] puts the default action
//! back and makes tokio listen at once, so tokio's is the only handler. A library that installs one later (a
//! kernel compiled while serving) finds tokio's and, like LLVM, hands the signal back to it.

/// Resets an inherited handler on SIGTERM / SIGINT to the default action (an ignored signal stays ignored), then
/// registers tokio's listeners. Call once per process, inside the runtime, before anything listens for these signals
/// (a second call would find tokio's own handler and reset it). Returns the signals whose handler was reset.
/// Tested in `tests/stop_signals.rs` (its own process).
pub fn claim() -> Vec<&'static str> {
    let mut reset = Vec::new();
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        // SAFETY: sigaction with a null new action only reads the current one into `old`; signal() installs the
        // default action, which needs no handler code.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && old.sa_sigaction != libc::SIG_DFL
                && old.sa_sigaction != libc::SIG_IGN
            {
                libc::signal(sig, libc::SIG_DFL);
                reset.push(name);
            }
        }
    }
    // Creating the streams installs tokio's handlers now (dropping them keeps the handlers for the process).
    use tokio::signal::unix::{signal, SignalKind};
    for kind in [SignalKind::terminate(), SignalKind::interrupt()] {
        if let Err(e) = signal(kind) {
            tracing::warn!("cannot listen for {kind:?}: {e}");
        }
    }
    reset
}
