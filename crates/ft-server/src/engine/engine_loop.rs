//! The engine loop, on the engine thread (the only thread that takes the GIL):
//!
//! ```text
//!   loop { drain commands into the scheduler; plan = scheduler.next_step(); out = worker.execute(plan);
//!          scheduler.commit(plan, out) or fail_step; send events; status lines; publish stats }
//! ```
//!
//! With overlap scheduling (the default; `--disable-overlap-schedule` or `DISABLE_OVERLAP_SCHEDULING=1` turn it
//! off) a step is launched and collected in two calls, and a decode step's successor is planned and launched
//! between them (`overlap.rs`), so the GPU runs step N+1 while the host commits step N.

mod overlap;

use super::stats::EngineStats;
use super::watchdog::RunningStep;
use super::{Command, EngineConfig, Shared};
use crate::backend::HealthState;
use crate::engine::status_log::StatusLog;
use crate::metrics::{EngineGauges, Metrics};
use ft_core::request::{FinishReason, RequestEvent};
use ft_core::scheduler::{PlanSummary, Scheduler};
use ft_core::step::{StepKind, StepOutput, StepPlan, Worker, WorkerError};
use std::sync::atomic::Ordering;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(super) struct EngineLoop {
    worker: Box<dyn Worker>,
    scheduler: Scheduler,
    shared: Arc<Shared>,
    status: StatusLog,
    metrics: Arc<Metrics>,
    planned_workspace_bytes: Option<u64>,
    /// The largest transient workspace any step has allocated (CUDA), to check the memory plan against.
    max_step_workspace_bytes: u64,
    /// Expert-cache lookups since start (`--moe-backend offload`): routed experts found resident / copied in.
    expert_hits: u64,
    expert_misses: u64,
    expert_host_misses: u64,
    expert_host_busy_ms: f64,
    prefill_experts_from_cache: u64,
    prefill_experts_from_host: u64,
    /// Decode-only steps so far, with the worker's own time for them and the engine's whole time (planning,
    /// the worker call, commit and handing tokens to the HTTP side): benchmarks read the per-token cost of each
    /// layer from these (`/v1/stats`).
    decode_steps: u64,
    decode_forward_ms: f64,
    decode_engine_ms: f64,
    /// Plan the next decode step while this one runs (launch / collect) instead of `execute`.
    overlap: bool,
    /// Steps launched ahead of the commit of the step before them (`/v1/stats`).
    overlapped_steps: u64,
    /// The step launched and not yet collected (overlap only).
    in_flight: Option<overlap::Launched>,
    /// When the last step was committed: with overlap a step's engine time runs from there, not from when it
    /// was planned (its planning overlapped the step before).
    last_commit: Option<Instant>,
    /// The engine went idle and has not checked its cache bookkeeping since: the check waits for a quiet moment
    /// (`INTEGRITY_CHECK_QUIET`), because an agent's next turn usually arrives within milliseconds of the last
    /// answer and the allocator's walk over every free KV page (millions on a large card) would delay it.
    integrity_check_due: bool,
    integrity_checks: u64,
    /// `(new tokens, engine ms, worker ms, device ms, host launch ms)` of the last step that computed prompt tokens.
    last_prefill: (u64, f64, f64, f64, f64),
}

/// How long the engine must stay idle before it checks the cache bookkeeping.
const INTEGRITY_CHECK_QUIET: Duration = Duration::from_millis(250);

impl EngineLoop {
    pub(super) fn new(worker: Box<dyn Worker>, config: EngineConfig, shared: Arc<Shared>) -> Self {
        EngineLoop {
            worker,
            scheduler: Scheduler::new(config.scheduler.clone()),
            shared,
            status: StatusLog::new(config.decode_log_interval),
            metrics: config.metrics.clone(),
            planned_workspace_bytes: config.planned_workspace_bytes,
            max_step_workspace_bytes: 0,
            expert_hits: 0,
            expert_misses: 0,
            expert_host_misses: 0,
            expert_host_busy_ms: 0.0,
            prefill_experts_from_cache: 0,
            prefill_experts_from_host: 0,
            decode_steps: 0,
            decode_forward_ms: 0.0,
            decode_engine_ms: 0.0,
            overlap: config.overlap,
            overlapped_steps: 0,
            in_flight: None,
            last_commit: None,
            integrity_check_due: false,
            integrity_checks: 0,
            last_prefill: (0, 0.0, 0.0, 0.0, 0.0),
        }
    }

    pub(super) fn run(mut self, commands: std_mpsc::Receiver<Command>) {
        loop {
            // Block while idle; otherwise take whatever arrived since the last step.
            if self.is_idle() {
                self.publish_stats();
                let wait = if self.integrity_check_due { INTEGRITY_CHECK_QUIET } else { Duration::from_secs(60) };
                match commands.recv_timeout(wait) {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return self.stop("the server is shutting down");
                        }
                    }
                    Err(std_mpsc::RecvTimeoutError::Timeout) => {
                        if self.integrity_check_due {
                            self.check_integrity();
                        } else {
                            tracing::debug!("Scheduler is idle, waiting for new reqs...");
                        }
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
            if self.is_idle() {
                self.integrity_check_due = true;
                tracing::info!("Scheduler is idle, waiting for new reqs...");
            }
        }
    }

    /// Checks the cache bookkeeping (allocator, state slots, tree) of an idle engine; a failure is logged, not fatal.
    fn check_integrity(&mut self) {
        self.integrity_check_due = false;
        self.integrity_checks += 1;
        if let Err(e) = self.scheduler.check_integrity() {
            tracing::error!("cache integrity check failed while idle: {e}");
        }
    }

    /// Nothing queued, running or on the device.
    fn is_idle(&self) -> bool {
        self.scheduler.is_idle() && self.in_flight.is_none()
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

    /// One step committed. Errors only for a fatal worker failure.
    fn step(&mut self) -> Result<(), WorkerError> {
        if self.overlap {
            self.step_overlapped()
        } else {
            self.step_sync()
        }
    }

    /// One forward pass, planned, run and committed in turn.
    fn step_sync(&mut self) -> Result<(), WorkerError> {
        let began = Instant::now();
        let Some(plan) = self.scheduler.next_step() else {
            self.dispatch_events();
            return Ok(());
        };
        self.dispatch_events();
        let summary = self.scheduler.plan_summary(&plan);
        let started = Instant::now();
        self.watch(Some((plan.step_id, started)));
        let result = self.worker.execute(&plan);
        self.watch(None);
        self.finish_step(&plan, &summary, result, began)
    }

    /// Tells the watchdog which step the worker runs now, and since when.
    fn watch(&self, step: Option<(u64, Instant)>) {
        *self.shared.current_step.lock().unwrap() = step.map(|(step_id, started)| RunningStep { step_id, started });
    }

    /// Commits (or fails) a step whose worker answer is `result`; `began` is when its planning began. Errors
    /// only for a fatal worker failure.
    fn finish_step(
        &mut self,
        plan: &StepPlan,
        summary: &PlanSummary,
        result: Result<StepOutput, WorkerError>,
        began: Instant,
    ) -> Result<(), WorkerError> {
        if self.shared.stalled.load(Ordering::SeqCst) {
            // The watchdog already answered everyone and the server is going down.
            return Err(WorkerError::Fatal("step overran --step-timeout".into()));
        }
        let from = self.last_commit.map_or(began, |t| t.max(began));
        let mut prefill_times = None;
        match result {
            Ok(out) => {
                self.commit(plan, summary, &out, from.elapsed());
                if plan.kind != StepKind::Decode {
                    prefill_times = Some((out.stats.forward_ms, out.stats.device_ms, out.stats.launch_ms));
                }
            }
            Err(WorkerError::Fatal(msg)) => {
                tracing::error!("Engine stopped: {msg}");
                // Clients and /health get the first line; the traceback is in the log.
                let why = format!("engine failed: {}", msg.lines().next().unwrap_or_default());
                // Unhealthy before any client hears of the failure, so none of them sees /health 200 after.
                self.shared.set_health(HealthState::Unhealthy(why.clone()));
                self.scheduler.fail_all(&why);
                self.dispatch_events();
                return Err(WorkerError::Fatal(msg));
            }
            Err(e) => {
                tracing::error!("Step {} failed, failing its {} request(s): {e}", plan.step_id, plan.seqs.len());
                self.scheduler.fail_step(plan, &e.to_string());
            }
        }
        self.dispatch_events();
        let step_time = from.elapsed().as_secs_f64();
        self.last_commit = Some(Instant::now());
        if plan.kind == StepKind::Decode {
            self.decode_engine_ms += step_time * 1e3;
        }
        if let Some((forward_ms, device_ms, launch_ms)) = prefill_times {
            let new_tokens = summary.new_tokens as u64;
            self.last_prefill = (new_tokens, step_time * 1e3, forward_ms, device_ms, launch_ms);
        }
        self.metrics.observe_step(plan.kind, step_time);
        self.publish_stats();
        Ok(())
    }

    /// Applies a step's output: the scheduler commits it, the counters take its statistics.
    fn commit(&mut self, plan: &StepPlan, summary: &PlanSummary, out: &StepOutput, elapsed: Duration) {
        if plan.kind == StepKind::Decode {
            self.decode_steps += 1;
            self.decode_forward_ms += out.stats.forward_ms;
        }
        self.max_step_workspace_bytes = self.max_step_workspace_bytes.max(out.stats.workspace_bytes);
        self.expert_hits += out.stats.expert_hits;
        self.expert_misses += out.stats.expert_misses;
        self.expert_host_misses += out.stats.expert_host_misses;
        self.expert_host_busy_ms += out.stats.expert_host_busy_ms;
        self.prefill_experts_from_cache += out.stats.prefill_experts_from_cache;
        self.prefill_experts_from_host += out.stats.prefill_experts_from_host;
        self.scheduler.commit(plan, out);
        self.status.record(summary, &self.scheduler.stats(), elapsed);
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
        let stats = EngineStats {
            requests_in_flight: self.shared.in_flight.load(Ordering::SeqCst),
            prefill_throughput: self.status.last_prefill_throughput(),
            decode_throughput: self.status.last_decode_throughput(),
            planned_workspace_bytes: self.planned_workspace_bytes,
            max_step_workspace_bytes: self.max_step_workspace_bytes,
            expert_hits: self.expert_hits,
            expert_misses: self.expert_misses,
            expert_host_misses: self.expert_host_misses,
            expert_host_busy_ms: self.expert_host_busy_ms,
            prefill_experts_from_cache: self.prefill_experts_from_cache,
            prefill_experts_from_host: self.prefill_experts_from_host,
            decode_steps: self.decode_steps,
            decode_forward_ms_total: self.decode_forward_ms,
            decode_engine_ms_total: self.decode_engine_ms,
            overlapped_steps: self.overlapped_steps,
            integrity_checks: self.integrity_checks,
            last_prefill_tokens: self.last_prefill.0,
            last_prefill_engine_ms: self.last_prefill.1,
            last_prefill_forward_ms: self.last_prefill.2,
            last_prefill_device_ms: self.last_prefill.3,
            last_prefill_launch_ms: self.last_prefill.4,
            ..EngineStats::from_scheduler(&self.scheduler.stats())
        };
        self.metrics.set_gauges(EngineGauges {
            running_requests: stats.running_requests as u64,
            queued_requests: stats.queued_requests as u64,
            kv_used_tokens: stats.kv_used_tokens as u64,
            kv_capacity_tokens: stats.kv_capacity_tokens as u64,
            state_slots: (stats.state_slots_total > 0)
                .then_some((stats.state_slots_used as u64, stats.state_slots_total as u64)),
        });
        self.metrics.set_expert_cache_totals(self.expert_hits, self.expert_misses, self.expert_host_misses);
        *self.shared.stats.lock().unwrap() = stats;
    }

    /// Fails everything still pending so no client waits forever.
    fn stop(mut self, why: &str) {
        if self.integrity_check_due && self.is_idle() {
            // (a server stopped right after its last answer still checks what that answer left behind)
            self.check_integrity();
        }
        self.scheduler.fail_all(why);
        self.dispatch_events();
        self.shared.fail_every_client(why);
    }
}
