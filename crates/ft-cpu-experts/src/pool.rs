//! `Pool`: worker threads that, with the calling thread, run a call's tasks, and spin for a while between calls.
//!
//! A decode step calls the executor once per MoE layer and each call is two short parallel phases (tens of
//! microseconds of work each), so what matters is the hand-off: the caller runs tasks itself (no wait for a worker
//! to pick the call up; one thread is no thread at all), and workers that finished a phase spin for `SPIN` before
//! they sleep, so the next phase and the next layer find them awake. Measured on this crate's first host (2 vCPUs,
//! KVM), a call of a tiny bank cost 28-34 us through a rayon pool of one thread and 15 us of two; 8-9 us here.
//!
//! A call waits only for the workers that joined it (`Shared::entry`), not for all of them: beside a GPU the pool
//! shares its cores with the engine, and a worker the OS has not run yet (asleep, or preempted) would otherwise hold
//! every call of a decode step until its next time slice, while the caller and the others can take its tasks.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::call_times::BroadcastCounts;

/// How long an idle worker spins before it sleeps: longer than the gap between the phases of a call and between
/// the MoE layers of a decode step, short enough not to hold cores through a whole idle step.
/// `FREETOKEN_CPU_EXPERTS_SPIN_US` sets it (microseconds) for A/B runs.
const SPIN: Duration = Duration::from_micros(200);

const SPIN_VAR: &str = "FREETOKEN_CPU_EXPERTS_SPIN_US";

/// `SPIN`, or `value` (the environment's `SPIN_VAR`) in microseconds; anything else is refused, not ignored.
fn spin_from(value: Option<&str>) -> std::io::Result<Duration> {
    let Some(v) = value else { return Ok(SPIN) };
    v.trim().parse::<u64>().map(Duration::from_micros).map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{SPIN_VAR}={v:?}: expected microseconds"))
    })
}
/// Spin-loop hints between two looks at the clock: a spinning thread that reads the clock at every turn keeps its
/// core's issue slots busy (two thirds of a spinning worker's samples were in the clock, 2026-12-07), which a
/// hyperthread sibling doing the call's work would rather have.
const SPINS_PER_CLOCK: u32 = 64;

/// The job of the current broadcast: the address of a `&dyn Fn` on the caller's stack (a thin pointer, so that it
/// fits one atomic word; its lifetime erased, see `broadcast`).
type Job = *const &'static (dyn Fn() + Sync);

/// `Shared::entry`'s low 32 bits: no worker joins a closed broadcast; a join adds `JOIN`, one to the workers in the
/// job (`IN_JOB`, which a worker leaving takes back) and one to those that joined it at all (`EVER`, for
/// `call_times.rs`).
const CLOSED: u64 = 1 << 31;
const EVER_SHIFT: u32 = 15;
const IN_JOB: u64 = (1 << EVER_SHIFT) - 1;
const EVER: u64 = (CLOSED - 1) & !IN_JOB;
const JOIN: u64 = 1 + (1 << EVER_SHIFT);

/// `entry`'s epoch bits, open and with nobody joined, for broadcast `epoch`.
fn open_entry(epoch: u64) -> u64 {
    (epoch & 0xffff_ffff) << 32
}

/// A value on its own cache line (two, for the adjacent-line prefetcher): the counters that every worker polls or
/// writes at each phase would otherwise share one line, bouncing it between all the pool's cores.
#[repr(align(128))]
struct Line<T>(T);

struct Shared {
    /// Bumped once a broadcast's job is in `job`; a worker runs the job of each value it sees.
    epoch: Line<AtomicU64>,
    /// Read by each worker once it sees a new epoch: an atomic word, not a lock that 15 workers waking at once
    /// would queue on.
    job: AtomicPtr<&'static (dyn Fn() + Sync)>,
    /// The current broadcast's gate, one word so that joining is one compare-and-swap: its epoch (high 32 bits),
    /// `CLOSED` once the caller has run out of tasks, and the workers that joined (`EVER`) and have not returned
    /// (`IN_JOB`).
    entry: Line<AtomicU64>,
    panicked: AtomicBool,
    /// Workers asleep (or about to be) on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    /// `SPIN`, or the environment's
    spin: Duration,
    /// Written by the broadcasting thread only (`busy`), read by `take_counts`.
    counts: BroadcastCounts,
}

pub(crate) struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One broadcast at a time (there is one job slot).
    busy: Mutex<()>,
    /// The process that started the workers: a forked child has none of them, and runs every task itself.
    pid: u32,
}

impl Pool {
    /// A pool of `threads` threads: the caller and `threads - 1` workers.
    pub(crate) fn new(threads: usize) -> std::io::Result<Pool> {
        let spin = spin_from(std::env::var(SPIN_VAR).ok().as_deref())?;
        let shared = Arc::new(Shared {
            epoch: Line(AtomicU64::new(0)),
            job: AtomicPtr::new(std::ptr::null_mut()),
            entry: Line(AtomicU64::new(CLOSED)),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            spin,
            counts: BroadcastCounts::default(),
        });
        let mut pool = Pool { shared, workers: Vec::new(), busy: Mutex::new(()), pid: std::process::id() };
        for i in 1..threads.max(1) {
            let shared = pool.shared.clone();
            // on an error the pool's drop ends the workers already started
            let worker =
                std::thread::Builder::new().name(format!("ft-cpu-experts-{i}")).spawn(move || work(&shared))?;
            pool.workers.push(worker);
        }
        Ok(pool)
    }

    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// The hand-off's counts since the last take: (broadcasts, workers joined, wakeups, caller's wait in ns).
    pub(crate) fn take_counts(&self) -> (u64, u64, u64, u64) {
        self.shared.counts.take()
    }

    /// `f(task)` for every task, spread over the pool's threads (the caller's included); returns when all are done.
    pub(crate) fn for_each<T: Send>(&self, tasks: Vec<T>, f: impl Fn(T) + Sync) {
        if tasks.len() <= 1 || self.workers.is_empty() || std::process::id() != self.pid {
            return tasks.into_iter().for_each(f);
        }
        // each index is taken by one thread (the counter), so the locks are never contended
        let slots: Vec<Mutex<Option<T>>> = tasks.into_iter().map(|t| Mutex::new(Some(t))).collect();
        let next = AtomicUsize::new(0);
        self.broadcast(&|| {
            while let Some(slot) = slots.get(next.fetch_add(1, Ordering::Relaxed)) {
                if let Some(task) = slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    f(task);
                }
            }
        });
    }

    /// Runs `job` on every thread of the pool at once, the caller's included; returns when all have returned.
    fn broadcast(&self, job: &(dyn Fn() + Sync)) {
        let _one = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        s.counts.broadcasts.fetch_add(1, Ordering::Relaxed);
        // SAFETY (the lifetime erased here): this function returns, or unwinds, only once the broadcast is closed
        // and no worker that joined it is still in the job (`join`); a worker that did not join never reads it.
        // `erased` lives on this frame until then.
        let erased: &'static (dyn Fn() + Sync) = unsafe { std::mem::transmute(job) };
        let job_ptr: Job = &erased;
        s.job.store(job_ptr as *mut _, Ordering::Release);
        let epoch = s.epoch.0.load(Ordering::Relaxed).wrapping_add(1);
        s.entry.0.store(open_entry(epoch), Ordering::Release);
        s.epoch.0.store(epoch, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            s.counts.wakeups.fetch_add(1, Ordering::Relaxed);
            let _g = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        // the job returns once every task is taken; then no worker may join, and those that did are awaited
        let mine = catch_unwind(AssertUnwindSafe(job));
        let closed = s.entry.0.fetch_or(CLOSED, Ordering::AcqRel);
        s.counts.joined.fetch_add((closed & EVER) >> EVER_SHIFT, Ordering::Relaxed);
        let (start, mut spins, mut spinning) = (Instant::now(), 0u32, true);
        while s.entry.0.load(Ordering::Acquire) & IN_JOB > 0 {
            spins = spins.wrapping_add(1);
            if spinning && spins.is_multiple_of(SPINS_PER_CLOCK) {
                spinning = start.elapsed() < s.spin;
            }
            if spinning {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        s.counts.wait_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if let Err(panic) = mine {
            std::panic::resume_unwind(panic);
        }
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a CPU expert task panicked on a worker thread");
        }
    }
}

/// A worker: waits for each new epoch (spinning for `SPIN`, then asleep) and runs its job.
fn work(s: &Shared) {
    let mut seen = 0;
    loop {
        let (start, mut spins) = (Instant::now(), 0u32);
        while s.epoch.0.load(Ordering::SeqCst) == seen {
            if s.shutdown.load(Ordering::SeqCst) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(SPINS_PER_CLOCK) || start.elapsed() < s.spin {
                std::hint::spin_loop();
                continue;
            }
            // sleep; counted first, so that a broadcast bumping the epoch after this check sees a sleeper to wake
            let mut guard = s.sleep.lock().unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.0.load(Ordering::SeqCst) == seen && !s.shutdown.load(Ordering::SeqCst) {
                guard = s.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        seen = s.epoch.0.load(Ordering::SeqCst);
        if !join(s, seen) {
            continue; // late: the caller and the others took every task
        }
        let job: Job = s.job.load(Ordering::Acquire);
        // SAFETY: the broadcast that set this job (before opening its entry) waits, before the closure and the
        // reference to it go away, until every worker that joined has left, and sets no other job before then
        if catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() })).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.entry.0.fetch_sub(1, Ordering::Release); // (IN_JOB's one; EVER keeps its)
    }
}

/// Joins broadcast `epoch` if it is still the current one and open; false once it has moved on or closed.
fn join(s: &Shared, epoch: u64) -> bool {
    let open = open_entry(epoch);
    let mut entry = s.entry.0.load(Ordering::Acquire);
    while entry & !(IN_JOB | EVER) == open {
        match s.entry.0.compare_exchange_weak(entry, entry + JOIN, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(now) => entry = now,
        }
    }
    false
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _g = self.shared.sleep.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_on_any_pool_size() {
        for threads in [1, 2, 5] {
            let pool = Pool::new(threads).unwrap();
            assert_eq!(pool.threads(), threads);
            for round in 0..200 {
                let mut out = vec![0usize; 37];
                let tasks: Vec<(usize, &mut usize)> = out.iter_mut().enumerate().collect();
                pool.for_each(tasks, |(i, o)| *o += i + round);
                assert!(out.iter().enumerate().all(|(i, o)| *o == i + round));
                if round == 100 {
                    std::thread::sleep(SPIN * 3); // the workers fall asleep and are woken
                }
            }
        }
    }

    #[test]
    fn late_and_slow_workers_neither_lose_nor_repeat_a_task() {
        // more threads than this host has cores, tasks of uneven length and gaps around the spin: workers join late,
        // miss whole broadcasts (closed, or moved on) or are asleep when one starts; every task still runs once, and
        // no call returns while a task it handed out is still running (the counts are read right after)
        let pool = Pool::new(7).unwrap();
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        for round in 0..300 {
            let runs: Vec<AtomicUsize> = (0..1 + next() % 40).map(|_| AtomicUsize::new(0)).collect();
            let spins: Vec<usize> = runs.iter().map(|_| next() % 3 * 2000).collect();
            pool.for_each((0..runs.len()).collect(), |i: usize| {
                (0..spins[i]).for_each(|_| std::hint::spin_loop());
                runs[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(runs.iter().all(|r| r.load(Ordering::Relaxed) == 1), "round {round}");
            match next() % 10 {
                0 => std::thread::sleep(SPIN * 2), // everyone asleep
                1 => std::thread::sleep(SPIN / 2), // some still spinning
                _ => {}
            }
        }
        let (broadcasts, joined, _, _) = pool.take_counts();
        assert!(broadcasts > 0 && joined <= 6 * broadcasts);
    }

    #[test]
    fn a_worker_joins_only_the_open_current_broadcast() {
        let pool = Pool::new(1).unwrap();
        let s = &*pool.shared;
        s.entry.0.store(open_entry(7), Ordering::SeqCst);
        assert!(join(s, 7) && join(s, 7));
        assert!(!join(s, 6), "an older epoch");
        let entry = s.entry.0.load(Ordering::SeqCst);
        assert_eq!((entry & IN_JOB, (entry & EVER) >> EVER_SHIFT), (2, 2));
        s.entry.0.fetch_sub(1, Ordering::SeqCst); // one left the job: still counted as joined
        let entry = s.entry.0.load(Ordering::SeqCst);
        assert_eq!((entry & IN_JOB, (entry & EVER) >> EVER_SHIFT), (1, 2));
        s.entry.0.fetch_or(CLOSED, Ordering::SeqCst);
        assert!(!join(s, 7), "closed: the caller is out of tasks");
        s.entry.0.store(open_entry(8 + (1 << 32)), Ordering::SeqCst);
        assert!(join(s, 8) && !join(s, 7), "the epoch's low 32 bits");
    }

    #[test]
    fn the_spin_variable_is_read_or_refused() {
        assert_eq!(spin_from(None).unwrap(), SPIN);
        assert_eq!(spin_from(Some(" 2000 ")).unwrap(), Duration::from_micros(2000));
        let err = spin_from(Some("2ms")).unwrap_err().to_string();
        assert!(err.contains(SPIN_VAR) && err.contains("2ms"), "{err}");
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(3).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| pool.for_each((0..50).collect(), |i: i32| assert!(i != 17))));
        assert!(r.is_err());
        let sum = AtomicUsize::new(0);
        pool.for_each((0..50).collect(), |i: usize| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), 49 * 50 / 2);
    }
}
