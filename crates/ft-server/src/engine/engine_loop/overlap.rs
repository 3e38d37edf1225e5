//! The overlap loop: step N+1 planned and launched while step N runs on the device.
//!
//! ```text
//!   iteration:  [take N in flight, or plan + launch a new N] ─ plan N+1 ahead ─ launch N+1 ─ collect N ─ commit N
//!   device:      ... N ..........................................  N+1 ........................
//! ```
//!
//! The scheduler decides what may run ahead (`Scheduler::next_step_ahead`: decode after decode, nothing to
//! admit); anything else is planned only after N is committed, as in the synchronous loop. For the watchdog a
//! step runs from its launch to the end of its collect, whatever was planned or launched in between.

use super::EngineLoop;
use ft_core::scheduler::PlanSummary;
use ft_core::step::{StepPlan, WorkerError};
use std::time::Instant;

/// A step launched on the worker and not yet collected.
pub(in crate::engine) struct Launched {
    plan: StepPlan,
    summary: PlanSummary,
    /// When its planning began.
    began: Instant,
    /// When it was launched: the watchdog times it from here.
    launched: Instant,
}

impl EngineLoop {
    /// One step committed, its successor (when the scheduler allows) already on the device.
    pub(super) fn step_overlapped(&mut self) -> Result<(), WorkerError> {
        let current = match self.in_flight.take() {
            Some(step) => step,
            None => {
                let began = Instant::now();
                let Some(plan) = self.scheduler.next_step() else {
                    self.dispatch_events();
                    return Ok(());
                };
                self.dispatch_events();
                match self.launch(plan, began)? {
                    Some(step) => step,
                    None => return Ok(()),
                }
            }
        };
        let began = Instant::now();
        if let Some(next) = self.scheduler.next_step_ahead(&current.plan) {
            self.in_flight = self.launch(next, began)?;
            self.overlapped_steps += self.in_flight.is_some() as u64;
        }
        self.watch(Some((current.plan.step_id, current.launched)));
        let result = self.worker.collect();
        self.watch(self.in_flight.as_ref().map(|next| (next.plan.step_id, next.launched)));
        self.finish_step(&current.plan, &current.summary, result, current.began)
    }

    /// Launches `plan`. A launch that fails fails the plan's requests (nothing to collect): `Ok(None)`; a fatal
    /// failure is an error.
    fn launch(&mut self, plan: StepPlan, began: Instant) -> Result<Option<Launched>, WorkerError> {
        let summary = self.scheduler.plan_summary(&plan);
        let launched = Instant::now();
        let watched = self.shared.current_step.lock().unwrap().is_some();
        if !watched {
            self.watch(Some((plan.step_id, launched)));
        }
        match self.worker.launch(&plan) {
            Ok(()) => Ok(Some(Launched { plan, summary, began, launched })),
            Err(e) => {
                if !watched {
                    self.watch(None);
                }
                self.finish_step(&plan, &summary, Err(e), began).map(|()| None)
            }
        }
    }
}
