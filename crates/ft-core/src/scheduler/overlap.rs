//! Overlap scheduling: step N+1 planned while step N still runs on the device.
//!
//! ```text
//!   engine:  plan N ─ launch N ─ plan N+1 (ahead) ─ launch N+1 ─ collect N ─ commit N ─ plan N+2 (ahead) ...
//!   device:          [──────── N ────────]           [──────── N+1 ────────]           [──────── N+2 ...
//! ```
//!
//! Only a decode-only step follows a decode-only step this way (the steady state): a plan that admits or
//! prefills, restores or captures a state, or needs prompt logprobs waits for N's tokens (the engine collects
//! and commits N first, then calls [`Scheduler::next_step`]). The ahead plan is optimistic: every sequence of
//! N that is not certain to end with N's token (its output budget, the context) decodes once more, its input
//! the token N samples for it (`ScheduledSeq::input_from_prev`, taken on the device), its seed that of the
//! next output position, its KV slot allocated from its reservation. When commit(N) then finds the sequence
//! ended by a stop token, its `Finished` event goes out at once, and the request stays (`ended`) until N+1 is
//! committed: N+1's token is discarded, and only then are its row, KV and state released, so nothing the
//! device still writes is handed to another request. Its live state then holds exactly prompt + output (N+1
//! fed the last sampled token), the tokens whose KV exists, so a hybrid radix donation stays consistent.

use super::{Ending, PlanSummary, RunningRequest, Scheduler};
use crate::config::CacheType;
use crate::request::{FinishReason, RequestEvent};
use crate::step::{ScheduledSeq, StepKind, StepPlan, PLACEHOLDER_TOKEN};

impl Scheduler {
    /// Step N+1 planned while `prev` (step N, the latest plan, not yet committed) runs, or `None` when the
    /// next step must wait for N's tokens (see the module docs). Answer it like any plan, after `prev`.
    pub fn next_step_ahead(&mut self, prev: &StepPlan) -> Option<StepPlan> {
        if !self.can_plan_ahead(prev) {
            return None;
        }
        let step_id = self.next_step_id;
        let mut seqs = Vec::new();
        for (row, seq) in prev.seqs.iter().enumerate() {
            let Some(i) = self.in_plan(seq.request_id, prev.step_id) else { continue };
            if self.running[i].ended.is_none() && !self.ends_with_pending_token(&self.running[i]) {
                seqs.push(self.schedule_decode_ahead(i, step_id, row as u32));
            }
        }
        if seqs.is_empty() {
            return None;
        }
        self.next_step_id += 1;
        self.prefill_streak = 0;
        self.record_summary(step_id, PlanSummary { decode_tokens: seqs.len(), ..Default::default() });
        Some(StepPlan { step_id, kind: StepKind::Decode, seqs, state_copies: Vec::new(), snapshots: Vec::new() })
    }

    /// The steady state: `prev` decodes every running request, each sampling (so sampled row = sequence
    /// index), nothing could be admitted now, and no sampled token decides what the step captures.
    fn can_plan_ahead(&self, prev: &StepPlan) -> bool {
        let anchors = self.cfg.snapshot_token_id.is_some() && self.cfg.cache_type == CacheType::HybridRadix;
        let hybrid = self.cfg.num_state_slots > 0;
        let could_admit =
            !self.queue.is_empty() && self.rows.available() > 0 && (!hybrid || self.kv.states().live_available() > 0);
        prev.kind == StepKind::Decode
            && prev.step_id + 1 == self.next_step_id
            && prev.seqs.iter().all(|s| s.sample.is_some())
            && !anchors
            && !could_admit
            && self.running.iter().all(|r| r.ended.is_some() || r.in_flight == [prev.step_id])
    }

    /// Whether the token in flight for `r` is certainly its last (output budget or context): nothing to plan.
    fn ends_with_pending_token(&self, r: &RunningRequest) -> bool {
        let generated = r.output.len() + 1;
        generated >= r.max_new_tokens as usize || r.prompt_len() + generated >= self.cfg.max_context
    }

    /// A one-token decode of request `i` fed by sampled row `row` of the step in flight.
    fn schedule_decode_ahead(&mut self, i: usize, step_id: u64, row: u32) -> ScheduledSeq {
        let pos = self.running[i].scheduled_len;
        self.ensure_slots(i, pos + 1);
        let r = &mut self.running[i];
        debug_assert_eq!(pos, r.prompt_len() + r.output.len(), "one sampled token in flight");
        let seq = ScheduledSeq {
            request_id: r.id,
            row: r.row,
            prefix_len: pos as u32,
            new_tokens: vec![PLACEHOLDER_TOKEN],
            input_from_prev: Some(row),
            table_from: r.table_sent as u32,
            table_slots: r.slots[r.table_sent..pos + 1].to_vec(),
            state_slot: r.state_slot,
            sample: Some(r.sample_spec_at(r.output.len() + 1)),
            prompt_logprobs: None,
        };
        r.scheduled_len = pos + 1;
        r.table_sent = pos + 1;
        r.in_flight.push(step_id);
        seq
    }

    /// Request `i` ends with the token just committed: released now, or, while a step planned ahead of it is
    /// in flight, reported now and released when that step is committed.
    pub(super) fn finish_committed(&mut self, i: usize, reason: FinishReason) {
        let r = &mut self.running[i];
        if r.in_flight.is_empty() {
            return self.end_running(i, Ending::Finished(reason));
        }
        r.ended = Some(reason);
        let (id, completion_tokens) = (r.id, r.output.len() as u32);
        self.events.push(RequestEvent::Finished { id, reason, completion_tokens });
    }

    /// Releases request `i` if it ended while its last step was in flight (now committed); true if it did.
    pub(super) fn release_if_ended(&mut self, i: usize) -> bool {
        let Some(reason) = self.running[i].ended else { return false };
        if self.running[i].in_flight.is_empty() {
            self.end_running(i, Ending::Finished(reason));
        }
        true
    }
}
