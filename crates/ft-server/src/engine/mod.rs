//! The engine thread: the only thread that drives the worker (and so the only one that takes the GIL).
//!
//! ```text
//!  HTTP tasks ──Submit/Abort──▶ command channel ──▶ engine thread
//!      ▲                                              loop {
//!      │ per-request event channels                     drain commands into the scheduler
//!      └──────────────────────────────────────────────  plan = scheduler.next_step()
//!                                                        out  = worker.execute(plan)  (or launch / collect,
//!                                                               the next decode launched in between: overlap)
//!                                                        scheduler.commit(plan, out) / fail_step
//!                                                        send events, log status lines }
//! ```
//!
//! `EngineBackend` is the [`Backend`] the routes talk to: submitting validates what can be validated without
//! the scheduler (health, queue length, context length) so those answers come back at once, and everything
//! else arrives as events on the request's own channel.

mod engine_loop;
pub mod stats;
pub mod status_log;
mod watchdog;

use crate::backend::{AbortOnDrop, Backend, GenerateRequest, HealthState, RequestStream, SubmitError};
use crate::metrics::Metrics;
use engine_loop::EngineLoop;
use ft_core::config::SchedulerConfig;
use ft_core::request::{FinishReason, NewRequest, RequestEvent};
use ft_core::step::Worker;
use stats::EngineStats;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::mpsc;
use watchdog::{watchdog, RunningStep};

/// Settings of the engine loop itself (the scheduler's are in [`SchedulerConfig`]).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// One `Decode batch` line every this many decode steps (0 = never).
    pub decode_log_interval: usize,
    /// Requests waiting for admission beyond this are refused with 429.
    pub max_queued_requests: usize,
    /// A step running longer than this is a stall: the watchdog fails every request and the engine is dead.
    pub step_timeout: Duration,
    /// The memory plan's prefill workspace (CUDA), reported beside the largest step workspace seen.
    pub planned_workspace_bytes: Option<u64>,
    /// Overlap scheduling: plan and launch the next decode step while this one runs (`--disable-overlap-schedule`
    /// turns it off).
    pub overlap: bool,
    /// `/metrics`, shared with the HTTP side: the engine sets the gauges and step times after every step and
    /// the health where it changes.
    pub metrics: Arc<Metrics>,
}

pub(crate) enum Command {
    /// The request's event channel is already in `Shared::senders` (see [`EngineBackend::submit`]).
    Submit {
        req: NewRequest,
    },
    Finish {
        id: u64,
        reason: FinishReason,
    },
    Shutdown,
}

/// State shared between the engine thread, the watchdog and the HTTP side.
pub(crate) struct Shared {
    /// Written through [`Shared::set_health`] only, so `/metrics` sees every change.
    health: Mutex<HealthState>,
    metrics: Arc<Metrics>,
    stats: Mutex<EngineStats>,
    /// Submitted but not yet finished (queued + running), for the 429 check.
    in_flight: AtomicUsize,
    /// Each live request's event channel, registered by `submit` before the command is sent. Shared so the
    /// watchdog can answer every client, those whose `Submit` still waits in the command channel included,
    /// even while the engine thread is stuck inside the worker.
    senders: Mutex<HashMap<u64, mpsc::UnboundedSender<RequestEvent>>>,
    current_step: Mutex<Option<RunningStep>>,
    /// Set by the watchdog: the engine thread is stuck and will not be waited for.
    stalled: AtomicBool,
}

impl Shared {
    fn set_health(&self, health: HealthState) {
        let mut h = self.health.lock().unwrap();
        self.metrics.set_health(&health);
        *h = health;
    }

    /// Sends `Failed` to every live request and forgets them.
    fn fail_every_client(&self, message: &str) {
        let senders: Vec<_> = self.senders.lock().unwrap().drain().collect();
        for (id, tx) in senders {
            let _ = tx.send(RequestEvent::Failed { id, message: message.to_string() });
        }
        self.in_flight.store(0, Ordering::SeqCst);
    }
}

pub struct EngineBackend {
    commands: std_mpsc::Sender<Command>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    max_context: usize,
    max_queued: usize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl EngineBackend {
    /// Starts the engine thread around `worker`.
    pub fn spawn(worker: Box<dyn Worker>, config: EngineConfig) -> Arc<EngineBackend> {
        let (tx, rx) = std_mpsc::channel();
        config.metrics.set_health(&HealthState::Serving);
        let shared = Arc::new(Shared {
            health: Mutex::new(HealthState::Serving),
            metrics: config.metrics.clone(),
            stats: Mutex::new(EngineStats::default()),
            in_flight: AtomicUsize::new(0),
            senders: Mutex::new(HashMap::new()),
            current_step: Mutex::new(None),
            stalled: AtomicBool::new(false),
        });
        let watched = shared.clone();
        let timeout = config.step_timeout;
        std::thread::Builder::new()
            .name("ft-watchdog".into())
            .spawn(move || watchdog(watched, timeout))
            .expect("spawn watchdog thread");
        let max_context = config.scheduler.max_context;
        let max_queued = config.max_queued_requests + config.scheduler.max_running_requests;
        let loop_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ft-engine".into())
            .spawn(move || EngineLoop::new(worker, config, loop_shared).run(rx))
            .expect("spawn engine thread");
        Arc::new(EngineBackend {
            commands: tx,
            shared,
            next_id: AtomicU64::new(1),
            max_context,
            max_queued,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Fails every request still queued or running and joins the engine thread (unless it is stalled:
    /// a thread stuck in the worker is never waited for).
    pub fn shutdown(&self) {
        if !self.is_stalled() {
            let mut health = self.shared.health.lock().unwrap();
            if *health == HealthState::Serving {
                *health = HealthState::ShuttingDown;
                self.shared.metrics.set_health(&health);
            }
        }
        let _ = self.commands.send(Command::Shutdown);
        if self.is_stalled() {
            return;
        }
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }

    /// True once the engine can no longer serve: its thread stopped (fatal worker error, shutdown) or the
    /// watchdog found it stuck.
    pub fn is_finished(&self) -> bool {
        self.is_stalled() || self.thread.lock().unwrap().as_ref().is_none_or(|t| t.is_finished())
    }

    /// The watchdog found a step stuck past --step-timeout.
    pub fn is_stalled(&self) -> bool {
        self.shared.stalled.load(Ordering::SeqCst)
    }
}

impl Backend for EngineBackend {
    fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        if let Some(why) = self.health().refusal() {
            return Err(SubmitError::Unavailable(why));
        }
        // validated at the HTTP edge (validation.rs)
        debug_assert!(!req.prompt.is_empty() && req.prompt.len() < self.max_context, "an unvalidated request");
        if self.shared.in_flight.load(Ordering::SeqCst) >= self.max_queued {
            return Err(SubmitError::Overloaded(format!(
                "too many requests in flight (limit {}); retry later",
                self.max_queued
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let new = NewRequest {
            id,
            prompt: req.prompt,
            max_new_tokens: req.max_new_tokens,
            sampling: req.sampling,
            stop_token_ids: req.stop_token_ids,
            ignore_eos: req.ignore_eos,
        };
        self.shared.in_flight.fetch_add(1, Ordering::SeqCst);
        self.shared.senders.lock().unwrap().insert(id, events_tx);
        // Whoever stops the engine sets the health before failing every registered client: if it changed
        // since the check above, our channel may have missed that sweep, so back out.
        let backed_out = |why: String| {
            if self.shared.senders.lock().unwrap().remove(&id).is_some() {
                self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            }
            Err(SubmitError::Unavailable(why))
        };
        if let Some(why) = self.health().refusal() {
            return backed_out(why);
        }
        if self.commands.send(Command::Submit { req: new }).is_err() {
            return backed_out("the engine has stopped".into());
        }
        let commands = self.commands.clone();
        let guard = AbortOnDrop::new(move || {
            let _ = commands.send(Command::Finish { id, reason: FinishReason::Abort });
        });
        Ok(RequestStream { id, events: events_rx, guard })
    }

    fn abort(&self, id: u64) {
        let _ = self.commands.send(Command::Finish { id, reason: FinishReason::Abort });
    }

    fn health(&self) -> HealthState {
        self.shared.health.lock().unwrap().clone()
    }

    fn stats(&self) -> EngineStats {
        self.shared.stats.lock().unwrap().clone()
    }
}
