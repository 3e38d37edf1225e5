//! The scheduler: turns queued requests into one [`StepPlan`] per forward pass and applies each step's
//! sampled tokens.
//!
//! The engine thread drives it with four calls and nothing else decides anything:
//!
//! ```text
//!   add_request ─► queue ──(next_step: admission, FCFS)──► running ──(commit / finish / fail)──► gone
//!                                                           │  row, KV slots, state slot owned here
//!   loop { let plan = next_step()?; match worker.execute(&plan) { Ok(out) => commit(&plan, &out),
//!                                                                   Err(e) => fail_step(&plan, e) } }
//! ```
//!
//! **Admission** (in [`Scheduler::next_step`]): strictly first come, first served. The head of the queue
//! starts when a page-table row is free, a recurrent-state slot is free (hybrid models), and free +
//! evictable KV covers its uncached prompt plus its whole output budget on top of what the running
//! requests have reserved. Because the budget is reserved up front, decode never runs out of KV and no
//! request is ever preempted; because admission never skips the head, and a request too large for the
//! whole pool is refused in [`Scheduler::add_request`], every queued request eventually starts.
//!
//! **Step composition**: at most `max_prefill_tokens` tokens per prefill or mixed step.
//!
//! ```text
//!   mixed_decode = true (default)          mixed_decode = false, decode_interleave_every = 2
//!   step  decodes  prompt chunks           step  kind
//!    1    a b      L[0..8190]               1    Prefill  L[0..8192]        (a, b wait)
//!    2    a b      L[8190..16380]           2    Prefill  L[8192..16384]    (a, b wait)
//!    3    a b      L[16380..] + new M       3    Decode   a b               (after 2 prefill steps)
//! ```
//!
//! Decodes go first (one token each), then the chunked prompt that is already under way, then newly
//! admitted prompts; a prompt longer than the budget is cut into chunks across steps and only its last
//! chunk samples. Without mixed decode, prefill and decode steps alternate as `decode_interleave_every`
//! says (`0` = prefill first, decodes wait for every prompt: the FreeToken 0.1.2 behaviour).
//!
//! **Prefix cache**: a new request matches `prompt[..len - 1]` (at least one token must be computed to
//! get logits), locks the match and starts computing after it; its first chunk sends the cached slots
//! too (`table_from = 0`). When it ends, the tokens whose KV exists (prompt plus all but the last sampled
//! token) go into the radix tree; see [`kv_cache`].
//!
//! Hybrid models (`num_state_slots > 0`) get no prefix hits yet: a hit must resume from a recurrent-state
//! snapshot, and snapshots come with the hybrid radix cache (a later issue). Each running hybrid request
//! owns one live state slot (`ScheduledSeq::state_slot`); a sequence whose first chunk has
//! `prefix_len == 0` starts from a zeroed state.
//!
//! **Sampling seeds**: every draw gets `sample_seed(request seed, tokens generated so far)`, so a seeded
//! request samples the same tokens whatever else is in its batch.

pub mod kv_cache;

use std::collections::VecDeque;

use crate::allocator::IdPool;
use crate::config::{CacheType, SchedulerConfig};
use crate::request::{AdmissionError, FinishReason, NewRequest, RequestEvent, SamplingParams};
use crate::step::{SampleSpec, ScheduledSeq, StepKind, StepOutput, StepPlan};
use kv_cache::{CachedPrefix, KvCache};

/// splitmix64's output function: a strong 64-bit mix (Steele, Lea, Flood 2014).
pub fn splitmix64_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Seed of the draw that produces output token number `generated` (0-based) of a request seeded with
/// `request_seed`: element `generated + 1` of the splitmix64 stream started at `request_seed`. Depends
/// on nothing else, so batching never changes a seeded request's samples.
pub fn sample_seed(request_seed: u64, generated: u64) -> u64 {
    splitmix64_mix(request_seed.wrapping_add(generated.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)))
}

/// Counters for status lines, `/metrics` and `/v1/stats`.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerStats {
    /// Requests admitted and not finished.
    pub running: usize,
    /// Requests waiting for admission.
    pub queued: usize,
    /// KV slots not free and not evictable: running requests' own slots plus the cached prefixes they lock.
    pub kv_used_tokens: usize,
    /// KV slots in the pool (whole pages).
    pub kv_capacity_tokens: usize,
    /// `kv_used_tokens / kv_capacity_tokens` (evictable cache does not count as used).
    pub token_usage: f64,
    /// Tokens held by the radix tree (locked or not).
    pub cached_tokens_in_tree: usize,
    /// Cached tokens no running request locks (reclaimable on demand).
    pub evictable_tokens: usize,
    /// Page-table rows not owned by a request.
    pub free_rows: usize,
    /// Live recurrent-state slots not owned by a request (0 for non-hybrid models).
    pub free_state_slots: usize,
}

/// What a plan does, for the `Prefill batch, #new-seq: ..., #new-token: ..., #cached-token: ...` line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanSummary {
    /// Sequences whose first prompt chunk is in the plan.
    pub new_seqs: usize,
    /// Prompt tokens computed by the plan (all chunks, first or not).
    pub new_tokens: usize,
    /// Prefix-cache tokens of the sequences that start in this plan.
    pub cached_tokens: usize,
    /// Decode tokens (one per decoding sequence).
    pub decode_tokens: usize,
}

/// A request waiting for admission.
#[derive(Clone, Debug)]
struct QueuedRequest {
    /// The request as the server sent it.
    req: NewRequest,
    /// Output budget after clamping to the context and the pool.
    max_new_tokens: u32,
    /// The request's seed, or one drawn from the scheduler's stream.
    seed: u64,
}

/// A request that owns a row, KV slots and (hybrid) a state slot.
#[derive(Clone, Debug)]
struct RunningRequest {
    /// Request id.
    id: u64,
    /// Prompt token ids.
    prompt: Vec<u32>,
    /// Sampled tokens so far.
    output: Vec<u32>,
    /// Output budget (clamped).
    max_new_tokens: u32,
    /// Sampling settings.
    sampling: SamplingParams,
    /// Base of the per-draw seeds.
    seed: u64,
    /// Tokens that end the request (unless `ignore_eos`).
    stop_token_ids: Vec<u32>,
    /// Keep going past stop tokens.
    ignore_eos: bool,
    /// Page-table row, for the request's whole life.
    row: u32,
    /// Live recurrent-state slot, -1 for non-hybrid models.
    state_slot: i32,
    /// The locked cached prefix this request started from.
    prefix: CachedPrefix,
    /// KV slot of each position, whole pages: `slots[..prefix.len]` are the tree's, the rest the request's.
    slots: Vec<u32>,
    /// Positions whose computation has been put in a plan.
    scheduled_len: usize,
    /// Positions whose KV the worker has written (committed steps only).
    computed_len: usize,
    /// Positions whose slots the worker's page table has received.
    table_sent: usize,
    /// Pages still to allocate to reach the whole budget (prompt + output); reserved at admission.
    reserved_pages: usize,
    /// The step this request is part of, until it is committed or failed.
    in_flight: Option<u64>,
}

impl RunningRequest {
    fn prompt_len(&self) -> usize {
        self.prompt.len()
    }
    fn wants_prefill(&self) -> bool {
        self.in_flight.is_none() && self.scheduled_len < self.prompt.len()
    }
    fn wants_decode(&self) -> bool {
        self.in_flight.is_none() && !self.output.is_empty()
    }
    fn sample_spec(&self) -> SampleSpec {
        let s = &self.sampling;
        SampleSpec {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: sample_seed(self.seed, self.output.len() as u64),
        }
    }
}

/// Plans kept for [`Scheduler::plan_summary`].
const SUMMARIES_KEPT: usize = 8;

/// Admission, step composition and commit of FreeToken's requests. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    /// Limits (validated).
    cfg: SchedulerConfig,
    /// KV pool and prefix cache.
    kv: KvCache,
    /// Page-table rows.
    rows: IdPool,
    /// Live recurrent-state slots (empty pool for non-hybrid models).
    state_slots: IdPool,
    /// Waiting requests, first come first served.
    queue: VecDeque<QueuedRequest>,
    /// Admitted requests in admission order.
    running: Vec<RunningRequest>,
    /// Sum of the running requests' `reserved_pages`.
    reserved_pages: usize,
    /// Events not yet drained.
    events: Vec<RequestEvent>,
    /// Id of the next plan.
    next_step_id: u64,
    /// Consecutive prefill steps during which decodes were waiting (non-mixed mode).
    prefill_streak: usize,
    /// splitmix64 state for requests without a seed.
    rng_state: u64,
    /// Summaries of the latest plans, by step id.
    summaries: VecDeque<(u64, PlanSummary)>,
}

impl Scheduler {
    /// A scheduler with an empty pool. Panics on a config [`SchedulerConfig::validate`] rejects.
    pub fn new(cfg: SchedulerConfig) -> Self {
        if let Err(e) = cfg.validate() {
            panic!("invalid scheduler config: {e}");
        }
        Scheduler {
            kv: KvCache::new(cfg.kv_capacity_tokens, cfg.page_size, cfg.cache_type),
            rows: IdPool::new(cfg.max_running_requests),
            state_slots: IdPool::new(cfg.num_state_slots),
            queue: VecDeque::new(),
            running: Vec::new(),
            reserved_pages: 0,
            events: Vec::new(),
            next_step_id: 0,
            prefill_streak: 0,
            rng_state: cfg.seed,
            summaries: VecDeque::new(),
            cfg,
        }
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The KV pool and prefix cache (read-only; for tests and diagnostics).
    pub fn kv_cache(&self) -> &KvCache {
        &self.kv
    }

    fn next_random_seed(&mut self) -> u64 {
        self.rng_state = self.rng_state.wrapping_add(GOLDEN_GAMMA);
        splitmix64_mix(self.rng_state)
    }

    fn is_known(&self, id: u64) -> bool {
        self.queue.iter().any(|q| q.req.id == id) || self.running.iter().any(|r| r.id == id)
    }

    /// Validates and queues a request. Refuses an empty prompt, a duplicate id, a prompt of
    /// `max_context` tokens or more (`ContextLengthExceeded`) and a prompt the whole KV pool cannot hold
    /// (`TooLargeForCache`). Clamps `max_new_tokens` to `1..=max_context - prompt_len` and to what the pool
    /// can hold next to the prompt (as SGLang caps requests at the pool size), so every queued request
    /// can eventually be admitted.
    pub fn add_request(&mut self, req: NewRequest) -> Result<(), AdmissionError> {
        let p = req.prompt.len();
        if p == 0 {
            return Err(AdmissionError::EmptyPrompt);
        }
        if self.is_known(req.id) {
            return Err(AdmissionError::DuplicateId(req.id));
        }
        if p >= self.cfg.max_context {
            return Err(AdmissionError::ContextLengthExceeded { prompt_tokens: p, max_context: self.cfg.max_context });
        }
        let capacity = self.kv.allocator().capacity_tokens();
        // The prompt's KV plus one output token's worth of nothing: the last sampled token never needs KV.
        if p > capacity {
            return Err(AdmissionError::TooLargeForCache { needed_tokens: p, capacity_tokens: capacity });
        }
        // KV positions the request may fill: prompt + output - 1 <= capacity.
        let max_new = (req.max_new_tokens as usize).max(1).min(self.cfg.max_context - p).min(capacity + 1 - p);
        let seed = match req.sampling.seed {
            Some(s) => s,
            None => self.next_random_seed(),
        };
        self.queue.push_back(QueuedRequest { max_new_tokens: max_new as u32, seed, req });
        Ok(())
    }

    /// Ends a queued or running request now (`Abort` for a gone client, `Stop` for a matched stop string).
    /// A running request's computed tokens go into the prefix cache (radix) and its row, slots and state
    /// slot are released; a `Finished` event follows. Unknown ids are ignored. Safe while the request is
    /// part of a plan in flight: that plan's commit skips it.
    pub fn finish(&mut self, id: u64, reason: FinishReason) {
        if let Some(i) = self.queue.iter().position(|q| q.req.id == id) {
            self.queue.remove(i);
            self.events.push(RequestEvent::Finished { id, reason, completion_tokens: 0 });
        } else if let Some(i) = self.running.iter().position(|r| r.id == id) {
            self.end_running(i, Ending::Finished(reason));
        }
    }

    /// The next forward pass, or `None` when there is nothing to run (idle, or everything runnable is
    /// already in a plan in flight). Admits queued requests (emitting `Started`) as described in the
    /// module docs.
    ///
    /// Every plan must be answered with [`Scheduler::commit`] or [`Scheduler::fail_step`]: its requests
    /// are marked in flight until then and are not scheduled again (so a plan dropped unanswered would
    /// leave them waiting forever).
    pub fn next_step(&mut self) -> Option<StepPlan> {
        let step_id = self.next_step_id;
        let decoders: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].wants_decode()).collect();
        let budget = self.cfg.max_prefill_tokens;
        let mut summary = PlanSummary::default();
        let (kind, seqs) = if self.cfg.mixed_decode {
            let mut seqs: Vec<ScheduledSeq> = decoders.iter().map(|&i| self.schedule_decode(i, step_id)).collect();
            summary.decode_tokens = seqs.len();
            let prefill = self.schedule_prefill(budget.saturating_sub(seqs.len()), step_id, &mut summary);
            let kind = match (seqs.is_empty(), prefill.is_empty()) {
                (true, true) => return None,
                (false, true) => StepKind::Decode,
                (true, false) => StepKind::Prefill,
                (false, false) => StepKind::Mixed,
            };
            seqs.extend(prefill);
            (kind, seqs)
        } else {
            let every = self.cfg.decode_interleave_every;
            let decode_due = !decoders.is_empty() && every > 0 && self.prefill_streak >= every;
            let prefill = if decode_due { Vec::new() } else { self.schedule_prefill(budget, step_id, &mut summary) };
            if !prefill.is_empty() {
                self.prefill_streak = if decoders.is_empty() { 0 } else { self.prefill_streak + 1 };
                (StepKind::Prefill, prefill)
            } else if !decoders.is_empty() {
                self.prefill_streak = 0;
                summary.decode_tokens = decoders.len();
                (StepKind::Decode, decoders.iter().map(|&i| self.schedule_decode(i, step_id)).collect())
            } else {
                return None;
            }
        };
        self.next_step_id += 1;
        self.summaries.push_back((step_id, summary));
        if self.summaries.len() > SUMMARIES_KEPT {
            self.summaries.pop_front();
        }
        Some(StepPlan { step_id, kind, seqs, state_copies: Vec::new(), snapshots: Vec::new() })
    }

    /// Prompt chunks for a step with `budget` tokens: chunked prompts under way first, then newly
    /// admitted requests (FCFS) while budget is left.
    fn schedule_prefill(&mut self, mut budget: usize, step_id: u64, summary: &mut PlanSummary) -> Vec<ScheduledSeq> {
        let mut seqs = Vec::new();
        for i in 0..self.running.len() {
            if budget == 0 {
                return seqs;
            }
            if self.running[i].wants_prefill() {
                let seq = self.schedule_chunk(i, budget, step_id);
                budget -= seq.new_tokens.len();
                summary.new_tokens += seq.new_tokens.len();
                seqs.push(seq);
            }
        }
        while budget > 0 {
            let Some(i) = self.admit_head() else { break };
            let seq = self.schedule_chunk(i, budget, step_id);
            budget -= seq.new_tokens.len();
            summary.new_seqs += 1;
            summary.new_tokens += seq.new_tokens.len();
            summary.cached_tokens += seq.prefix_len as usize;
            seqs.push(seq);
        }
        seqs
    }

    /// Starts the head of the queue if a row, a state slot and enough KV are free; returns its index in
    /// `running`.
    fn admit_head(&mut self) -> Option<usize> {
        let head = self.queue.front()?;
        if self.rows.available() == 0 || (self.cfg.num_state_slots > 0 && self.state_slots.available() == 0) {
            return None;
        }
        let p = head.req.prompt.len();
        let budget_tokens = p + head.max_new_tokens as usize - 1;
        // Hybrid models can only resume where a recurrent-state snapshot exists (the match is truncated to
        // the deepest node holding one). None are captured yet, so they match nothing: reusing the KV
        // without the state would run the linear-attention layers from a wrong state.
        let matchable = if self.cfg.num_state_slots > 0 { 0 } else { p - 1 };
        // Lock the cached prefix first so the availability below cannot count it as evictable.
        let (prefix, cached_slots) = self.kv.match_prefix(&head.req.prompt[..matchable]);
        self.kv.lock(prefix);
        let need = self.kv.pages_for(budget_tokens) - prefix.len / self.cfg.page_size;
        if need > self.kv.available_pages().saturating_sub(self.reserved_pages) {
            self.kv.unlock(prefix);
            return None;
        }
        let q = self.queue.pop_front().expect("head exists");
        let row = self.rows.alloc().expect("checked a row is free");
        let state_slot = if self.cfg.num_state_slots > 0 {
            self.state_slots.alloc().expect("checked a state slot is free") as i32
        } else {
            -1
        };
        self.reserved_pages += need;
        self.events.push(RequestEvent::Started {
            id: q.req.id,
            prompt_tokens: p as u32,
            cached_tokens: prefix.len as u32,
            max_new_tokens: q.max_new_tokens,
        });
        self.running.push(RunningRequest {
            id: q.req.id,
            prompt: q.req.prompt,
            output: Vec::new(),
            max_new_tokens: q.max_new_tokens,
            sampling: q.req.sampling,
            seed: q.seed,
            stop_token_ids: q.req.stop_token_ids,
            ignore_eos: q.req.ignore_eos,
            row,
            state_slot,
            prefix,
            slots: cached_slots,
            scheduled_len: prefix.len,
            computed_len: prefix.len,
            table_sent: 0,
            reserved_pages: need,
            in_flight: None,
        });
        Some(self.running.len() - 1)
    }

    /// Makes sure request `i` has KV slots for positions `..end`, drawing on its reservation.
    fn ensure_slots(&mut self, i: usize, end: usize) {
        let r = &mut self.running[i];
        if r.slots.len() >= end {
            return;
        }
        let pages = self.kv.pages_for(end) - r.slots.len() / self.cfg.page_size;
        assert!(pages <= r.reserved_pages, "request {} outgrew its KV reservation", r.id);
        let slots = self.kv.allocate(pages).expect("reserved KV must always be allocatable");
        r.slots.extend_from_slice(&slots);
        r.reserved_pages -= pages;
        self.reserved_pages -= pages;
    }

    /// The next chunk (at most `max_tokens`) of request `i`'s prompt.
    fn schedule_chunk(&mut self, i: usize, max_tokens: usize, step_id: u64) -> ScheduledSeq {
        let (start, end) = {
            let r = &self.running[i];
            (r.scheduled_len, r.prompt_len().min(r.scheduled_len + max_tokens))
        };
        self.ensure_slots(i, end);
        let r = &mut self.running[i];
        let seq = ScheduledSeq {
            request_id: r.id,
            row: r.row,
            prefix_len: start as u32,
            new_tokens: r.prompt[start..end].to_vec(),
            table_from: r.table_sent as u32,
            table_slots: r.slots[r.table_sent..end].to_vec(),
            state_slot: r.state_slot,
            sample: (end == r.prompt_len()).then(|| r.sample_spec()),
        };
        r.scheduled_len = end;
        r.table_sent = end;
        r.in_flight = Some(step_id);
        seq
    }

    /// A one-token decode of request `i` (its last sampled token).
    fn schedule_decode(&mut self, i: usize, step_id: u64) -> ScheduledSeq {
        let pos = self.running[i].scheduled_len;
        self.ensure_slots(i, pos + 1);
        let r = &mut self.running[i];
        debug_assert_eq!(pos, r.prompt_len() + r.output.len() - 1);
        let seq = ScheduledSeq {
            request_id: r.id,
            row: r.row,
            prefix_len: pos as u32,
            new_tokens: vec![*r.output.last().expect("a decoding request has sampled")],
            table_from: r.table_sent as u32,
            table_slots: r.slots[r.table_sent..pos + 1].to_vec(),
            state_slot: r.state_slot,
            sample: Some(r.sample_spec()),
        };
        r.scheduled_len = pos + 1;
        r.table_sent = pos + 1;
        r.in_flight = Some(step_id);
        seq
    }

    /// Applies a step's sampled tokens (plan order, one per sequence with `sample`). Each token is
    /// reported as a `Token` event; a request then ends on a stop token (unless `ignore_eos`), on its
    /// output budget or at `max_context`, and is released at once. Sequences of requests that ended
    /// meanwhile are skipped. A token count that does not match the plan fails the step's requests.
    pub fn commit(&mut self, plan: &StepPlan, out: &StepOutput) {
        if out.tokens.len() != plan.num_sampled() {
            let msg = format!(
                "worker returned {} tokens for a step with {} sampling sequences",
                out.tokens.len(),
                plan.num_sampled()
            );
            self.fail_step(plan, &msg);
            return;
        }
        let mut k = 0;
        for seq in &plan.seqs {
            let sampled = seq.sample.as_ref().map(|_| {
                k += 1;
                (out.tokens[k - 1], out.logprobs.get(k - 1).copied().unwrap_or(0.0))
            });
            let Some(i) = self.in_plan(seq.request_id, plan.step_id) else { continue };
            let r = &mut self.running[i];
            r.in_flight = None;
            r.computed_len = seq.context_len() as usize;
            let Some((token, logprob)) = sampled else { continue };
            r.output.push(token);
            self.events.push(RequestEvent::Token { id: r.id, token, logprob });
            let reason = if !r.ignore_eos && r.stop_token_ids.contains(&token) {
                Some(FinishReason::Stop)
            } else if r.output.len() >= r.max_new_tokens as usize
                || r.prompt_len() + r.output.len() >= self.cfg.max_context
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                self.end_running(i, Ending::Finished(reason));
            }
        }
    }

    /// Index of running request `id` if it is part of step `step_id`.
    fn in_plan(&self, id: u64, step_id: u64) -> Option<usize> {
        self.running.iter().position(|r| r.id == id && r.in_flight == Some(step_id))
    }

    /// The step failed (out of memory, invalid plan): each of its requests gets `Failed { message }` and
    /// is released (nothing it computed is cached). Other requests are untouched.
    pub fn fail_step(&mut self, plan: &StepPlan, message: &str) {
        for seq in &plan.seqs {
            if let Some(i) = self.in_plan(seq.request_id, plan.step_id) {
                self.end_running(i, Ending::Failed(message.to_string()));
            }
        }
    }

    /// Fails every queued and running request (the engine is dying or shutting down).
    pub fn fail_all(&mut self, message: &str) {
        for q in std::mem::take(&mut self.queue) {
            self.events.push(RequestEvent::Failed { id: q.req.id, message: message.to_string() });
        }
        while !self.running.is_empty() {
            self.end_running(0, Ending::Failed(message.to_string()));
        }
    }

    /// Releases running request `i` and reports how it ended.
    fn end_running(&mut self, i: usize, ending: Ending) {
        let r = self.running.remove(i);
        let insert = matches!(ending, Ending::Finished(_)) && self.cfg.cache_type == CacheType::Radix;
        let computed: Vec<u32> =
            r.prompt.iter().chain(r.output.iter()).copied().take(if insert { r.computed_len } else { 0 }).collect();
        self.kv.release(&computed, &r.slots, r.prefix, insert);
        self.reserved_pages -= r.reserved_pages;
        self.rows.free(r.row);
        if r.state_slot >= 0 {
            self.state_slots.free(r.state_slot as u32);
        }
        self.events.push(match ending {
            Ending::Finished(reason) => {
                RequestEvent::Finished { id: r.id, reason, completion_tokens: r.output.len() as u32 }
            }
            Ending::Failed(message) => RequestEvent::Failed { id: r.id, message },
        });
    }

    /// Events since the last call, in the order they happened.
    pub fn drain_events(&mut self) -> Vec<RequestEvent> {
        std::mem::take(&mut self.events)
    }

    /// Current counters.
    pub fn stats(&self) -> SchedulerStats {
        let capacity = self.kv.allocator().capacity_tokens();
        let free = self.kv.allocator().free_pages() * self.cfg.page_size;
        let evictable = self.kv.tree().evictable_tokens();
        let used = capacity - free - evictable;
        SchedulerStats {
            running: self.running.len(),
            queued: self.queue.len(),
            kv_used_tokens: used,
            kv_capacity_tokens: capacity,
            token_usage: used as f64 / capacity as f64,
            cached_tokens_in_tree: self.kv.tree().total_tokens(),
            evictable_tokens: evictable,
            free_rows: self.rows.available(),
            free_state_slots: self.state_slots.available(),
        }
    }

    /// What `plan` (one of the latest plans of this scheduler) does, for status lines.
    pub fn plan_summary(&self, plan: &StepPlan) -> PlanSummary {
        if let Some((_, s)) = self.summaries.iter().find(|(id, _)| *id == plan.step_id) {
            return *s;
        }
        // An old plan: reconstruct from the plan alone (a first chunk sends the table from position 0;
        // a one-token sampled sequence that does not start at 0 counts as decode).
        let mut s = PlanSummary::default();
        for seq in &plan.seqs {
            if seq.table_from == 0 {
                s.new_seqs += 1;
                s.cached_tokens += seq.prefix_len as usize;
                s.new_tokens += seq.new_tokens.len();
            } else if seq.new_tokens.len() == 1 && seq.sample.is_some() {
                s.decode_tokens += 1;
            } else {
                s.new_tokens += seq.new_tokens.len();
            }
        }
        s
    }

    /// Evicts every cached sequence no running request uses; returns the tokens freed (for an admin
    /// `flush_cache` endpoint, and for tests that check the pool comes back whole).
    pub fn flush_cache(&mut self) -> usize {
        self.kv.evict(usize::MAX)
    }

    /// Nothing queued and nothing running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty()
    }

    /// Cross-checks all bookkeeping: every KV page is free, cached or owned by exactly one request; tree
    /// lock counts equal the running requests' locks; token counters and eviction order recount right;
    /// rows and state slots are owned by exactly the running requests; reservations add up and are
    /// covered by free + evictable KV. O(pool pages + tree nodes + requests); cheap enough when idle.
    pub fn check_integrity(&self) -> Result<(), String> {
        let ps = self.cfg.page_size;
        let own_slots: Vec<&[u32]> = self.running.iter().map(|r| &r.slots[r.prefix.len..]).collect();
        let locks: Vec<_> = self.running.iter().map(|r| r.prefix.node).collect();
        self.kv.check_integrity(own_slots, &locks)?;
        self.rows.check_integrity()?;
        self.state_slots.check_integrity()?;
        if self.rows.capacity() - self.rows.available() != self.running.len() {
            return Err("rows in use differ from running requests".into());
        }
        let hybrid = self.cfg.num_state_slots > 0;
        if hybrid && self.state_slots.capacity() - self.state_slots.available() != self.running.len() {
            return Err("state slots in use differ from running requests".into());
        }
        let mut reserved = 0;
        for r in &self.running {
            if !self.rows.is_in_use(r.row) {
                return Err(format!("request {} holds row {} that is marked free", r.id, r.row));
            }
            if hybrid != (r.state_slot >= 0) || (hybrid && !self.state_slots.is_in_use(r.state_slot as u32)) {
                return Err(format!("request {} holds a bad state slot {}", r.id, r.state_slot));
            }
            let budget = self.kv.pages_for(r.prompt_len() + r.max_new_tokens as usize - 1);
            if r.slots.len() % ps != 0 || r.slots.len() / ps + r.reserved_pages != budget {
                return Err(format!("request {} holds + reserves a different number of pages than its budget", r.id));
            }
            if !(r.prefix.len <= r.computed_len
                && r.computed_len <= r.scheduled_len
                && r.scheduled_len <= r.slots.len())
                || r.table_sent != r.scheduled_len
            {
                return Err(format!("request {} has inconsistent progress counters", r.id));
            }
            reserved += r.reserved_pages;
        }
        if reserved != self.reserved_pages {
            return Err(format!("reserved pages {} but requests reserve {reserved}", self.reserved_pages));
        }
        if self.reserved_pages > self.kv.available_pages() {
            return Err("reserved KV exceeds free + evictable KV: a decode could run out".into());
        }
        Ok(())
    }
}

/// How a running request ends.
enum Ending {
    /// Normally (stop, length, abort): its computed tokens are cached.
    Finished(FinishReason),
    /// Its step failed or the engine is going down: nothing is cached.
    Failed(String),
}
