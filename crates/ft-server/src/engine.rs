//! The engine thread: the only thread that drives the worker (and so the only one that takes the GIL).
//!
//! ```text
//!  HTTP tasks ──Submit/Abort──▶ command channel ──▶ engine thread
//!      ▲                                              loop {
//!      │ per-request event channels                     drain commands into the scheduler
//!      └──────────────────────────────────────────────  plan = scheduler.next_step()
//!                                                        out  = worker.execute(plan)
//!                                                        scheduler.commit(plan, out) / fail_step
//!                                                        send events, log status lines }
//! ```
//!
//! `EngineBackend` is the [`Backend`] the routes talk to: submitting validates what can be validated without
//! the scheduler (health, queue length, context length) so those answers come back at once, and everything
//! else arrives as events on the request's own channel.

use crate::backend::{AbortOnDrop, Backend, GenerateRequest, HealthState, RequestStream, SubmitError};
use crate::status_log::StatusLog;
use ft_core::config::SchedulerConfig;
use ft_core::request::{AdmissionError, FinishReason, NewRequest, RequestEvent};
use ft_core::scheduler::Scheduler;
use ft_core::step::{StepKind, Worker, WorkerError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

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
}

enum Command {
    /// The request's event channel is already in `Shared::senders` (see [`EngineBackend::submit`]).
    Submit { req: NewRequest },
    Finish { id: u64, reason: FinishReason },
    Shutdown,
}

/// The step the worker is running now, for the watchdog.
struct RunningStep {
    step_id: u64,
    started: Instant,
}

/// State shared between the engine thread, the watchdog and the HTTP side.
struct Shared {
    health: Mutex<HealthState>,
    stats: Mutex<serde_json::Value>,
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
    /// Sends `Failed` to every live request and forgets them.
    fn fail_every_client(&self, message: &str) {
        let senders: Vec<_> = self.senders.lock().unwrap().drain().collect();
        for (id, tx) in senders {
            let _ = tx.send(RequestEvent::Failed { id, message: message.to_string() });
        }
        self.in_flight.store(0, Ordering::SeqCst);
    }
}

/// How long the watchdog waits, after answering every client, before it lets the server exit.
const STACK_DUMP_GRACE: Duration = Duration::from_secs(1);

/// Watches the running step; on overrun marks the engine unhealthy and answers every client with an error.
/// The Python stacks are dumped by `faulthandler`, armed by the worker wrapper for the same deadline.
fn watchdog(shared: Arc<Shared>, timeout: Duration) {
    let tick = (timeout / 20).clamp(Duration::from_millis(10), Duration::from_millis(500));
    loop {
        std::thread::sleep(tick);
        if Arc::strong_count(&shared) == 1 {
            return; // engine and backend are gone
        }
        let overrun = {
            let step = shared.current_step.lock().unwrap();
            step.as_ref().filter(|s| s.started.elapsed() > timeout).map(|s| (s.step_id, s.started.elapsed()))
        };
        if let Some((step_id, elapsed)) = overrun {
            let why = format!(
                "engine stalled: step {step_id} has run for {:.1} s, past --step-timeout {:.1} s",
                elapsed.as_secs_f64(),
                timeout.as_secs_f64()
            );
            tracing::error!("{why}; failing every request and stopping the server");
            // Health first: a submit that races with us either is drained below or sees it and backs out.
            *shared.health.lock().unwrap() = HealthState::Unhealthy(why.clone());
            shared.fail_every_client(&why);
            // `stalled` makes the server exit without waiting for the stuck thread. Give faulthandler, armed
            // for the same deadline, a moment to write the Python stacks to the log first (and /health a
            // moment to say 503 to whoever polls it).
            std::thread::sleep(STACK_DUMP_GRACE);
            shared.stalled.store(true, Ordering::SeqCst);
            return;
        }
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
        let shared = Arc::new(Shared {
            health: Mutex::new(HealthState::Serving),
            stats: Mutex::new(serde_json::json!({})),
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
        self.is_stalled() || self.thread.lock().unwrap().as_ref().map_or(true, |t| t.is_finished())
    }

    /// The watchdog found a step stuck past --step-timeout.
    pub fn is_stalled(&self) -> bool {
        self.shared.stalled.load(Ordering::SeqCst)
    }
}

impl Backend for EngineBackend {
    fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        match self.health() {
            HealthState::Serving => {}
            HealthState::Loading => return Err(SubmitError::Unavailable("the model is still loading".into())),
            HealthState::ShuttingDown => return Err(SubmitError::Unavailable("the server is shutting down".into())),
            HealthState::Unhealthy(why) => return Err(SubmitError::Unavailable(format!("engine unavailable: {why}"))),
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::Admission(AdmissionError::EmptyPrompt));
        }
        if req.prompt.len() >= self.max_context {
            return Err(SubmitError::Admission(AdmissionError::ContextLengthExceeded {
                prompt_tokens: req.prompt.len(),
                max_context: self.max_context,
            }));
        }
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
        match self.health() {
            HealthState::Serving => {}
            HealthState::Unhealthy(why) => return backed_out(format!("engine unavailable: {why}")),
            _ => return backed_out("the server is shutting down".into()),
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

    fn stats(&self) -> serde_json::Value {
        self.shared.stats.lock().unwrap().clone()
    }
}

struct EngineLoop {
    worker: Box<dyn Worker>,
    scheduler: Scheduler,
    shared: Arc<Shared>,
    status: StatusLog,
    planned_workspace_bytes: Option<u64>,
    /// The largest transient workspace any step has allocated (CUDA), to check the memory plan against.
    max_step_workspace_bytes: u64,
    /// Expert-cache lookups since start (`--moe-backend offload`): routed experts found resident / copied in.
    expert_hits: u64,
    expert_misses: u64,
    /// Decode-only steps so far, with the worker's own time for them and the engine's whole time (planning,
    /// the worker call, commit and handing tokens to the HTTP side): benchmarks read the per-token cost of each
    /// layer from these (`/v1/stats`).
    decode_steps: u64,
    decode_forward_ms: f64,
    decode_engine_ms: f64,
}

impl EngineLoop {
    fn new(worker: Box<dyn Worker>, config: EngineConfig, shared: Arc<Shared>) -> Self {
        EngineLoop {
            worker,
            scheduler: Scheduler::new(config.scheduler.clone()),
            shared,
            status: StatusLog::new(config.decode_log_interval),
            planned_workspace_bytes: config.planned_workspace_bytes,
            max_step_workspace_bytes: 0,
            expert_hits: 0,
            expert_misses: 0,
            decode_steps: 0,
            decode_forward_ms: 0.0,
            decode_engine_ms: 0.0,
        }
    }

    fn run(mut self, commands: std_mpsc::Receiver<Command>) {
        loop {
            // Block while idle; otherwise take whatever arrived since the last step.
            if self.scheduler.is_idle() {
                self.publish_stats();
                match commands.recv_timeout(Duration::from_secs(60)) {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return self.stop("the server is shutting down");
                        }
                    }
                    Err(std_mpsc::RecvTimeoutError::Timeout) => {
                        tracing::debug!("Scheduler is idle, waiting for new reqs...");
                        continue;
                    }
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => return self.stop("the server is shutting down"),
                }
            }
            while let Ok(cmd) = commands.try_recv() {
                if !self.handle(cmd) {
                    return self.stop("the server is shutting down");
                }
            }
            if let Err(fatal) = self.step() {
                // (health is already Unhealthy: `step` sets it before failing anyone)
                return self.stop(&fatal.to_string());
            }
            if self.scheduler.is_idle() {
                if let Err(e) = self.scheduler.check_integrity() {
                    tracing::error!("cache integrity check failed while idle: {e}");
                }
                tracing::info!("Scheduler is idle, waiting for new reqs...");
            }
        }
    }

    /// Applies one command; false means shut down.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit { req } => {
                let id = req.id;
                if let Err(e) = self.scheduler.add_request(req) {
                    if let Some(events) = self.shared.senders.lock().unwrap().remove(&id) {
                        let _ = events.send(RequestEvent::Failed { id, message: e.to_string() });
                        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
            Command::Finish { id, reason } => {
                self.scheduler.finish(id, reason);
                self.dispatch_events();
            }
            Command::Shutdown => return false,
        }
        true
    }

    /// One forward pass. Errors only for a fatal worker failure.
    fn step(&mut self) -> Result<(), WorkerError> {
        let began = Instant::now();
        let Some(plan) = self.scheduler.next_step() else {
            self.dispatch_events();
            return Ok(());
        };
        self.dispatch_events();
        let summary = self.scheduler.plan_summary(&plan);
        let started = Instant::now();
        *self.shared.current_step.lock().unwrap() = Some(RunningStep { step_id: plan.step_id, started });
        let result = self.worker.execute(&plan);
        *self.shared.current_step.lock().unwrap() = None;
        let elapsed = started.elapsed();
        if self.shared.stalled.load(Ordering::SeqCst) {
            // The watchdog already answered everyone and the server is going down.
            return Err(WorkerError::Fatal("step overran --step-timeout".into()));
        }
        match result {
            Ok(out) => {
                if plan.kind == StepKind::Decode {
                    self.decode_steps += 1;
                    self.decode_forward_ms += out.stats.forward_ms;
                }
                self.max_step_workspace_bytes = self.max_step_workspace_bytes.max(out.stats.workspace_bytes);
                self.expert_hits += out.stats.expert_hits;
                self.expert_misses += out.stats.expert_misses;
                self.scheduler.commit(&plan, &out);
                self.status.record(&summary, &self.scheduler.stats(), elapsed);
            }
            Err(WorkerError::Fatal(msg)) => {
                tracing::error!("Engine stopped: {msg}");
                // Clients and /health get the first line; the traceback is in the log.
                let why = format!("engine failed: {}", msg.lines().next().unwrap_or_default());
                // Unhealthy before any client hears of the failure, so none of them sees /health 200 after.
                *self.shared.health.lock().unwrap() = HealthState::Unhealthy(why.clone());
                self.scheduler.fail_all(&why);
                self.dispatch_events();
                return Err(WorkerError::Fatal(msg));
            }
            Err(e) => {
                tracing::error!("Step {} failed, failing its {} request(s): {e}", plan.step_id, plan.seqs.len());
                self.scheduler.fail_step(&plan, &e.to_string());
            }
        }
        self.dispatch_events();
        if plan.kind == StepKind::Decode {
            self.decode_engine_ms += began.elapsed().as_secs_f64() * 1e3;
        }
        self.publish_stats();
        Ok(())
    }

    fn dispatch_events(&mut self) {
        let events = self.scheduler.drain_events();
        if events.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        {
            let mut senders = self.shared.senders.lock().unwrap();
            for ev in events {
                let id = ev.request_id();
                let ends = matches!(ev, RequestEvent::Finished { .. } | RequestEvent::Failed { .. });
                let delivered = senders.get(&id).map(|tx| tx.send(ev).is_ok()).unwrap_or(false);
                if ends {
                    if senders.remove(&id).is_some() {
                        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                    }
                } else if !delivered {
                    gone.push(id);
                }
            }
        }
        // A client that is gone: end its request now rather than compute for nobody (its Finished event,
        // dispatched next, releases its channel).
        if !gone.is_empty() {
            for id in gone {
                self.scheduler.finish(id, FinishReason::Abort);
            }
            self.dispatch_events();
        }
    }

    fn publish_stats(&self) {
        let s = self.scheduler.stats();
        *self.shared.stats.lock().unwrap() = serde_json::json!({
            "running_requests": s.running,
            "queued_requests": s.queued,
            "kv_used_tokens": s.kv_used_tokens,
            "kv_capacity_tokens": s.kv_capacity_tokens,
            "token_usage": s.token_usage,
            "cached_tokens_in_tree": s.cached_tokens_in_tree,
            "evictable_tokens": s.evictable_tokens,
            "free_rows": s.free_rows,
            "free_state_slots": s.free_state_slots,
            "requests_in_flight": self.shared.in_flight.load(Ordering::SeqCst),
            "prefill_throughput": self.status.last_prefill_throughput(),
            "decode_throughput": self.status.last_decode_throughput(),
            "planned_workspace_bytes": self.planned_workspace_bytes,
            "max_step_workspace_bytes": self.max_step_workspace_bytes,
            "expert_hits": self.expert_hits,
            "expert_misses": self.expert_misses,
            "decode_steps": self.decode_steps,
            "decode_forward_ms_total": self.decode_forward_ms,
            "decode_engine_ms_total": self.decode_engine_ms,
        });
    }

    /// Fails everything still pending so no client waits forever.
    fn stop(mut self, why: &str) {
        self.scheduler.fail_all(why);
        self.dispatch_events();
        self.shared.fail_every_client(why);
    }
}
