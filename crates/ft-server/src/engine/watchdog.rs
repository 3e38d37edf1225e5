//! The step watchdog: a thread that watches the step the worker runs and, past `--step-timeout`, marks the engine
//! unhealthy, answers every client with an error naming the stall and lets the server exit (non-zero, so its
//! supervisor restarts it). The Python stacks are dumped by `faulthandler`, armed by the worker wrapper for the
//! same deadline.

use super::Shared;
use crate::backend::HealthState;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The step the worker is running now, for the watchdog.
pub(super) struct RunningStep {
    pub step_id: u64,
    pub started: Instant,
}

/// How long the watchdog waits, after answering every client, before it lets the server exit.
const STACK_DUMP_GRACE: Duration = Duration::from_secs(1);

/// Watches the running step; on overrun marks the engine unhealthy and answers every client with an error.
/// The Python stacks are dumped by `faulthandler`, armed by the worker wrapper for the same deadline.
///
/// Under systemd (`WatchdogSec=`) it also pings the service manager on every round in which no step has overrun,
/// and stops pinging once one has: systemd restarts an engine that stalls even if the exit below never comes.
pub(super) fn watchdog(shared: Arc<Shared>, timeout: Duration) {
    let tick = (timeout / 20).clamp(Duration::from_millis(10), Duration::from_millis(500));
    let mut pinger = crate::notify::WatchdogPinger::from_env();
    loop {
        std::thread::sleep(tick);
        if Arc::strong_count(&shared) == 1 {
            return; // engine and backend are gone
        }
        let overrun = {
            let step = shared.current_step.lock().unwrap();
            step.as_ref().filter(|s| s.started.elapsed() > timeout).map(|s| (s.step_id, s.started.elapsed()))
        };
        let Some((step_id, elapsed)) = overrun else {
            pinger.tick();
            continue;
        };
        let why = format!(
            "engine stalled: step {step_id} has run for {:.1} s, past --step-timeout {:.1} s",
            elapsed.as_secs_f64(),
            timeout.as_secs_f64()
        );
        tracing::error!("{why}; failing every request and stopping the server");
        // Health first: a submit that races with us either is drained below or sees it and backs out.
        shared.set_health(HealthState::Unhealthy(why.clone()));
        shared.fail_every_client(&why);
        // `stalled` makes the server exit without waiting for the stuck thread. Give faulthandler, armed
        // for the same deadline, a moment to write the Python stacks to the log first (and /health a
        // moment to say 503 to whoever polls it).
        std::thread::sleep(STACK_DUMP_GRACE);
        shared.stalled.store(true, Ordering::SeqCst);
        return;
    }
}
