//! `CallTimes`: where the executor's calls spend their time, summed until taken (`Executor::take_times`).
//!
//! Why: on a GPU host's 16 cores a decode call of one token through one or two experts costs ~60-80 us where its
//! weights take ~15-30 us to read, and that cannot be profiled from the machines without a GPU (2 cores). These
//! sums say, from one benchmark run on the GPU host, which phase holds the rest and how the pool's hand-off behaves
//! (how many workers joined a broadcast, how often sleeping workers had to be woken, how long the caller waited for
//! the workers that joined). A call reads the clock six times; only the calling thread writes these counters.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// A call's phases, in order (`forward.rs`): its pairs grouped by expert, x laid out, gate|up, the activations laid
/// out, down.
pub const PHASES: [&str; 5] = ["group", "x", "gate_up", "acts", "down"];

#[derive(Default)]
pub(crate) struct CallTimes {
    calls: AtomicU64,
    phase_ns: [AtomicU64; PHASES.len()],
}

impl CallTimes {
    /// Records one call whose phases ended at `ends` (`start` first).
    pub(crate) fn record(&self, start: Instant, ends: [Instant; PHASES.len()]) {
        self.calls.fetch_add(1, Relaxed);
        let mut from = start;
        for (sum, end) in self.phase_ns.iter().zip(ends) {
            sum.fetch_add(end.saturating_duration_since(from).as_nanos() as u64, Relaxed);
            from = end;
        }
    }

    /// The sums so far, and zero again.
    pub(crate) fn take(&self) -> (u64, [u64; PHASES.len()]) {
        (self.calls.swap(0, Relaxed), std::array::from_fn(|p| self.phase_ns[p].swap(0, Relaxed)))
    }
}

/// The pool's hand-off, summed over broadcasts (one per parallel phase of a call with more than one task).
#[derive(Default)]
pub(crate) struct BroadcastCounts {
    pub(crate) broadcasts: AtomicU64,
    /// Workers that joined (took part in) a broadcast, summed.
    pub(crate) joined: AtomicU64,
    /// Broadcasts that found workers asleep and woke them.
    pub(crate) wakeups: AtomicU64,
    /// The caller's wait, after its own share of the tasks, for the workers that joined to finish theirs.
    pub(crate) wait_ns: AtomicU64,
}

impl BroadcastCounts {
    pub(crate) fn take(&self) -> (u64, u64, u64, u64) {
        (
            self.broadcasts.swap(0, Relaxed),
            self.joined.swap(0, Relaxed),
            self.wakeups.swap(0, Relaxed),
            self.wait_ns.swap(0, Relaxed),
        )
    }
}

/// What `Executor::take_times` returns: sums since the last take.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallTimesTaken {
    pub calls: u64,
    /// Nanoseconds in each of `PHASES`, summed over the calls.
    pub phase_ns: [u64; PHASES.len()],
    pub broadcasts: u64,
    pub joined: u64,
    pub wakeups: u64,
    pub wait_ns: u64,
}
