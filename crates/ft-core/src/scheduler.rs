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
//! With overlap scheduling the engine also calls [`Scheduler::next_step_ahead`] while a decode step is in flight:
//! the next decode step, planned before the one ahead of it is committed (`scheduler/overlap.rs`).
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
//! too (`table_from = 0`). With [`CacheType::Radix`] its prompt (whole pages) goes into the radix tree as soon
//! as its KV is computed; when it ends, the tokens whose KV exists (prompt plus all but the last sampled
//! token) do; see [`kv_cache`].
//!
//! **Hybrid models** (`num_state_slots > 0`): each running request owns one live recurrent-state slot
//! (`ScheduledSeq::state_slot`); a sequence whose first chunk has `prefix_len == 0` starts from a zeroed
//! state. A prefix hit must resume from a state snapshot, so with [`CacheType::Radix`] or
//! [`CacheType::Naive`] a hybrid request matches nothing; [`CacheType::HybridRadix`] keeps snapshots in
//! the tree on a fixed grid (`snapshot_grid()`, the 64-token GDN chunk):
//!
//! ```text
//!   prompt of 300 tokens, grid 64, budget 128/step:   chunk       captures (state after upto tokens)
//!                                                     0..128      upto 128  (chunk cut down to the grid)
//!                                                     128..256    upto 256
//!                                                     256..300    upto 256? no: last grid point in
//!   the same prompt again matches prompt[..299]:                  (256, min(300, 299)] is none
//!   deepest snapshot <= 299 is 256 -> StateCopy{snap -> live}, prefix_len 256, computes 256..300
//! ```
//!
//! * A chunk cut by the step budget ends on the grid (if that leaves it a token), and each chunk captures
//!   (`StepPlan::snapshots`, run by the worker after the forward) the state at its last grid point `g`
//!   with `start < g <= min(end, prompt_len - 1)`: a chunk end, or inside the final chunk. Captures at
//!   the end of a non-final chunk are *cold* (the next chunk supersedes them): they are the first
//!   snapshots evicted, so a long prompt's chunk ends never push out the end of another conversation. Because the
//!   bound is `prompt_len - 1`, the same prompt sent again (which matches `prompt[..len - 1]`) always finds
//!   the snapshot at the last grid point below its length: SGLang's n-1 mid-edge miss (sglang#22935)
//!   cannot happen. At commit each capture goes into the tree at once ([`KvCache::cache_snapshot`]), so
//!   requests sharing a system prompt reuse it while the first one still runs. (KV pages of the request
//!   that the tree held already stay the request's until it ends: its page table is never resent, and a
//!   plan sends `table_from == 0` only in a request's first step.)
//! * Branch points are snapshotted deliberately: when the tree holds more of a new prompt's KV than the
//!   snapshot it resumes from (`PrefixMatch::kv_len`: another cached sequence shares the prompt up to
//!   there, then branches off), the request also captures the last grid point `<= kv_len`. The first
//!   request after a shared system prompt captured only past it (a chunk's last grid point lies in its
//!   own question); the second captures the branch point; every later one resumes there.
//! * When a request ends normally its live state is donated (no copy) to the node ending at its computed
//!   length (module docs of [`kv_cache`]), so the next turn of a conversation resumes at the end of the
//!   previous answer.
//! * With `snapshot_token_id` (`--enable-special-token-ckpt`), the decode step that feeds back that
//!   sampled token captures the state right after it.
//! * A match is cut back to the deepest node owning a snapshot; the request's first step carries
//!   `StateCopy { src: snapshot, dst: live slot }` (`StepPlan::state_copies`, run before the forward) and
//!   starts at that node's length. The snapshot stays locked until that step is committed.
//!
//! **Prompt logprobs** (`SamplingParams::prompt_logprobs`): such a request matches nothing in the prefix cache
//! (a cached position has no logits: the whole prompt is computed; what it computed is cached when it ends
//! like any other request's), its chunks carry [`PromptLogprobsSpec`] (the worker computes logits at every
//! position of the chunk) and are cut to [`PROMPT_LOGPROBS_CHUNK`] tokens, which bounds those logits
//! (`[chunk, vocab]` fp32) whatever `max_prefill_tokens` is. Each chunk's logprobs are reported as a
//! `PromptLogprobs` event when it commits.
//!
//! **Sampling seeds**: every draw gets `sample_seed(request seed, tokens generated so far)`, so a seeded
//! request samples the same tokens whatever else is in its batch.

pub mod kv_cache;
mod overlap;

use std::collections::VecDeque;

use crate::allocator::IdPool;
use crate::config::{CacheType, SchedulerConfig};
use crate::request::{AdmissionError, FinishReason, NewRequest, RequestEvent, SamplingParams};
use crate::step::{
    PromptLogprobsSpec, SampleSpec, ScheduledSeq, SnapshotCapture, StateCopy, StepKind, StepOutput, StepPlan,
};
use kv_cache::{CachedPrefix, Holders, KvCache, LiveState, PrefixMatch};

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
    /// Recurrent-state slots the worker backs, live and snapshot (0 for non-hybrid models).
    pub state_slots_total: usize,
    /// State slots neither free nor evictable: running requests' live slots, snapshots being captured or
    /// about to be restored (FreeToken's `#mamba-slot: used/total`; cached snapshots nothing locks do not
    /// count, as evictable KV does not count in `kv_used_tokens`).
    pub state_slots_used: usize,
    /// Most snapshots the hybrid radix cache may hold (0 unless `hybrid_radix`).
    pub snapshot_slots_total: usize,
    /// Snapshots held: owned by tree nodes or being captured.
    pub snapshot_slots_used: usize,
    /// Cached snapshots nothing locks (reclaimable on demand).
    pub evictable_snapshots: usize,
    /// Requests admitted with a snapshot restore (hybrid radix hits), since start.
    pub snapshot_hits: u64,
    /// Prompt tokens those requests skipped, since start.
    pub snapshot_hit_tokens: u64,
}

impl SchedulerStats {
    /// `state_slots_used / state_slots_total` (FreeToken's `mamba usage`), 0 without state slots.
    pub fn mamba_usage(&self) -> f64 {
        if self.state_slots_total == 0 {
            0.0
        } else {
            self.state_slots_used as f64 / self.state_slots_total as f64
        }
    }
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
    /// Whether the live slot holds the state after `computed_len` tokens (a step has been committed).
    /// Until then a hybrid radix hit's first step restores its snapshot into it.
    state_valid: bool,
    /// Snapshots the step in flight captures for this request, `(upto, slot, cold)` ascending (cold: an
    /// intermediate chunk end, see [`crate::radix::RadixTree::set_snapshot`]).
    pending_snapshots: Vec<(usize, u32, bool)>,
    /// Hybrid radix: a grid point past the restored prefix up to which the tree already held this prompt's
    /// KV (another cached sequence branches off there); captured by the chunk that crosses it.
    branch_point: Option<usize>,
    /// The locked cached prefix: where the request's tree-owned KV ends. It starts as the match and moves
    /// down each time a snapshot of the request is cached while it runs.
    prefix: CachedPrefix,
    /// KV slot of each position (what the worker's page table holds), whole pages: `slots[prefix.len..]`
    /// are the request's; below `prefix.len` they are the tree's, except `duplicates`.
    slots: Vec<u32>,
    /// Pages below `prefix.len` the request computed itself although the tree held them too (found when a
    /// snapshot of it was cached): still in its page table, the request's own, freed when it ends.
    duplicates: Vec<u32>,
    /// Positions whose computation has been put in a plan.
    scheduled_len: usize,
    /// Positions whose KV the worker has written (committed steps only).
    computed_len: usize,
    /// Positions whose slots the worker's page table has received.
    table_sent: usize,
    /// Pages still to allocate to reach the whole budget (prompt + output); reserved at admission.
    reserved_pages: usize,
    /// The steps this request is part of, oldest first, until each is committed or failed (two while the
    /// overlap loop has planned step N+1 before committing step N, see `scheduler/overlap.rs`).
    in_flight: Vec<u64>,
    /// Finished (its `Finished` event sent) while a later step of it was still in flight: released when that
    /// step is committed or failed, so its KV and state slots are never reused before the device is done.
    ended: Option<FinishReason>,
}

impl RunningRequest {
    /// The request `q` admitted onto page-table `row` and live state slot `state_slot`, resuming after the
    /// locked cached prefix of `m`, with `reserved_pages` of KV set aside for the rest.
    fn start(
        q: QueuedRequest,
        row: u32,
        state_slot: i32,
        m: PrefixMatch,
        reserved_pages: usize,
        branch_point: Option<usize>,
    ) -> Self {
        RunningRequest {
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
            state_valid: false,
            pending_snapshots: Vec::new(),
            branch_point,
            prefix: m.prefix,
            slots: m.slots,
            duplicates: Vec::new(),
            scheduled_len: m.prefix.len,
            computed_len: m.prefix.len,
            table_sent: 0,
            reserved_pages,
            in_flight: Vec::new(),
            ended: None,
        }
    }

    fn prompt_len(&self) -> usize {
        self.prompt.len()
    }
    /// The first `n` tokens (prompt, then output).
    fn tokens(&self, n: usize) -> Vec<u32> {
        self.prompt.iter().chain(self.output.iter()).copied().take(n).collect()
    }
    fn wants_prefill(&self) -> bool {
        self.in_flight.is_empty() && self.scheduled_len < self.prompt.len()
    }
    fn wants_decode(&self) -> bool {
        self.in_flight.is_empty() && !self.output.is_empty()
    }
    fn sample_spec(&self) -> SampleSpec {
        self.sample_spec_at(self.output.len())
    }
    /// The draw of output token number `generated` (the overlap loop plans one token ahead of `output`).
    fn sample_spec_at(&self, generated: usize) -> SampleSpec {
        let s = &self.sampling;
        SampleSpec {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            seed: sample_seed(self.seed, generated as u64),
            num_top_logprobs: s.top_logprobs,
        }
    }
}

/// Most tokens in one prompt chunk of a request that wants prompt logprobs: the worker materializes that
/// chunk's logits (`[chunk, vocab]` fp32, 0.5 GB for a 248k vocabulary).
pub const PROMPT_LOGPROBS_CHUNK: usize = 512;

/// Plans kept for [`Scheduler::plan_summary`].
const SUMMARIES_KEPT: usize = 8;

/// Admission, step composition and commit of FreeToken's requests. See the module docs.
#[derive(Debug)]
pub struct Scheduler {
    /// Limits (validated).
    cfg: SchedulerConfig,
    /// KV pool, recurrent-state slots and prefix cache.
    kv: KvCache,
    /// Page-table rows.
    rows: IdPool,
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
    /// Admissions that restored a snapshot.
    snapshot_hits: u64,
    /// Prompt tokens those admissions skipped.
    snapshot_hit_tokens: u64,
}

impl Scheduler {
    /// A scheduler with an empty pool. Panics on a config [`SchedulerConfig::validate`] rejects.
    pub fn new(cfg: SchedulerConfig) -> Self {
        if let Err(e) = cfg.validate() {
            panic!("invalid scheduler config: {e}");
        }
        Scheduler {
            kv: KvCache::with_state_slots(
                cfg.kv_capacity_tokens,
                cfg.page_size,
                cfg.cache_type,
                cfg.live_state_slots(),
                cfg.num_state_slots - cfg.live_state_slots(),
            ),
            rows: IdPool::new(cfg.max_running_requests),
            queue: VecDeque::new(),
            running: Vec::new(),
            reserved_pages: 0,
            events: Vec::new(),
            next_step_id: 0,
            prefill_streak: 0,
            rng_state: cfg.seed,
            summaries: VecDeque::new(),
            snapshot_hits: 0,
            snapshot_hit_tokens: 0,
            cfg,
        }
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The KV pool, state slots and prefix cache (read-only; for tests and diagnostics).
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
        } else if let Some(i) = self.running.iter().position(|r| r.id == id && r.ended.is_none()) {
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
        self.record_summary(step_id, summary);
        // Hybrid: restores run before the forward, captures after it.
        let mut state_copies = Vec::new();
        let mut snapshots = Vec::new();
        if self.cfg.num_state_slots > 0 {
            for (k, seq) in seqs.iter().enumerate() {
                let r = self.running.iter().find(|r| r.id == seq.request_id).expect("scheduled requests run");
                if let (false, Some(src)) = (r.state_valid, r.prefix.restore) {
                    state_copies.push(StateCopy { src: src as i32, dst: r.state_slot });
                }
                for &(upto, slot, _) in &r.pending_snapshots {
                    snapshots.push(SnapshotCapture { seq_index: k as u32, upto: upto as u32, slot: slot as i32 });
                }
            }
        }
        Some(StepPlan { step_id, kind, seqs, state_copies, snapshots })
    }

    /// Keeps `summary` of plan `step_id` for [`Scheduler::plan_summary`].
    fn record_summary(&mut self, step_id: u64, summary: PlanSummary) {
        self.summaries.push_back((step_id, summary));
        if self.summaries.len() > SUMMARIES_KEPT {
            self.summaries.pop_front();
        }
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
        let hybrid = self.cfg.num_state_slots > 0;
        if self.rows.available() == 0 || (hybrid && self.kv.states().live_available() == 0) {
            return None;
        }
        let (m, need) = self.lock_head_prefix()?;
        let q = self.queue.pop_front().expect("head exists");
        let row = self.rows.alloc().expect("checked a row is free");
        let state_slot = if hybrid { self.kv.alloc_live().expect("checked a live slot is free") as i32 } else { -1 };
        if m.prefix.restore.is_some() {
            self.snapshot_hits += 1;
            self.snapshot_hit_tokens += m.prefix.len as u64;
        }
        let grid = self.cfg.snapshot_grid();
        let branch = m.kv_len / grid * grid;
        let branch_point = (self.cfg.cache_type == CacheType::HybridRadix && branch > m.prefix.len).then_some(branch);
        self.reserved_pages += need;
        self.events.push(RequestEvent::Started {
            id: q.req.id,
            prompt_tokens: q.req.prompt.len() as u32,
            cached_tokens: m.prefix.len as u32,
            max_new_tokens: q.max_new_tokens,
        });
        self.running.push(RunningRequest::start(q, row, state_slot, m, need, branch_point));
        Some(self.running.len() - 1)
    }

    /// Matches and locks the queue head's cached prefix and checks that the KV pages its prompt and output
    /// budget need beyond it are free; returns the match and that page count, or None (nothing held).
    fn lock_head_prefix(&mut self) -> Option<(PrefixMatch, usize)> {
        let head = self.queue.front()?;
        let p = head.req.prompt.len();
        let budget_tokens = p + head.max_new_tokens as usize - 1;
        // Hybrid models can only resume where a recurrent-state snapshot exists: the hybrid radix cache cuts
        // the match back to the deepest node owning one; any other cache type keeps none, so they match
        // nothing (reusing the KV without the state would run the linear-attention layers from a wrong
        // state).
        let hybrid = self.cfg.num_state_slots > 0;
        // A request that wants prompt logprobs computes its whole prompt: cached positions have no logits.
        let no_match = (hybrid && self.cfg.cache_type != CacheType::HybridRadix) || head.req.sampling.prompt_logprobs;
        let matchable = if no_match { 0 } else { p - 1 };
        // Lock the cached prefix first so the availability below cannot count it as evictable.
        let m = self.kv.match_prefix(&head.req.prompt[..matchable]);
        self.kv.lock(m.prefix);
        let need = self.kv.pages_for(budget_tokens) - m.prefix.len / self.cfg.page_size;
        if need > self.kv.available_pages().saturating_sub(self.reserved_pages) {
            self.kv.unlock(m.prefix);
            return None;
        }
        Some((m, need))
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

    /// The next chunk (at most `max_tokens`) of request `i`'s prompt. With the hybrid radix cache a chunk
    /// cut by `max_tokens` ends on the snapshot grid when that leaves it a token, and the chunk captures
    /// the state at its last grid point `g`, `start < g <= min(end, prompt_len - 1)`, and at the request's
    /// branch point if it crosses it (module docs).
    fn schedule_chunk(&mut self, i: usize, max_tokens: usize, step_id: u64) -> ScheduledSeq {
        let snapshots = self.cfg.cache_type == CacheType::HybridRadix;
        let grid = self.cfg.snapshot_grid();
        let (start, n) = (self.running[i].scheduled_len, self.running[i].prompt_len());
        let prompt_logprobs = self.running[i].sampling.prompt_logprobs;
        let max_tokens = if prompt_logprobs { max_tokens.min(PROMPT_LOGPROBS_CHUNK) } else { max_tokens };
        let mut end = n.min(start + max_tokens);
        if snapshots && end < n && end / grid * grid > start {
            end = end / grid * grid;
        }
        self.ensure_slots(i, end);
        let g = end.min(n - 1) / grid * grid;
        let branch = self.running[i].branch_point.filter(|&b| b > start && b <= end);
        // A non-final chunk's capture is an intermediate state, superseded by the next chunk's: cold.
        let points =
            [branch.filter(|&b| b != g).map(|b| (b, false)), (g > start).then_some((g, end < n && branch != Some(g)))];
        for (upto, cold) in points.into_iter().flatten().filter(|_| snapshots) {
            if let Some(slot) = self.kv.alloc_snapshot() {
                self.running[i].pending_snapshots.push((upto, slot, cold));
            }
        }
        if branch.is_some() {
            self.running[i].branch_point = None;
        }
        let r = &mut self.running[i];
        let seq = ScheduledSeq {
            request_id: r.id,
            row: r.row,
            prefix_len: start as u32,
            new_tokens: r.prompt[start..end].to_vec(),
            input_from_prev: None,
            table_from: r.table_sent as u32,
            table_slots: r.slots[r.table_sent..end].to_vec(),
            state_slot: r.state_slot,
            sample: (end == r.prompt_len()).then(|| r.sample_spec()),
            prompt_logprobs: prompt_logprobs.then(|| PromptLogprobsSpec {
                num_top: r.sampling.top_logprobs,
                next_token: r.prompt.get(end).copied(),
            }),
        };
        r.scheduled_len = end;
        r.table_sent = end;
        r.in_flight.push(step_id);
        seq
    }

    /// A one-token decode of request `i` (its last sampled token). With `snapshot_token_id` and the hybrid
    /// radix cache, feeding that token back also captures the state after it (if that length ends a page).
    fn schedule_decode(&mut self, i: usize, step_id: u64) -> ScheduledSeq {
        let pos = self.running[i].scheduled_len;
        self.ensure_slots(i, pos + 1);
        let anchor = self.cfg.snapshot_token_id.is_some_and(|t| self.running[i].output.last() == Some(&t));
        if anchor && (pos + 1).is_multiple_of(self.cfg.page_size) {
            if let Some(slot) = self.kv.alloc_snapshot() {
                self.running[i].pending_snapshots.push((pos + 1, slot, false));
            }
        }
        let r = &mut self.running[i];
        debug_assert_eq!(pos, r.prompt_len() + r.output.len() - 1);
        let seq = ScheduledSeq {
            request_id: r.id,
            row: r.row,
            prefix_len: pos as u32,
            new_tokens: vec![*r.output.last().expect("a decoding request has sampled")],
            input_from_prev: None,
            table_from: r.table_sent as u32,
            table_slots: r.slots[r.table_sent..pos + 1].to_vec(),
            state_slot: r.state_slot,
            sample: Some(r.sample_spec()),
            prompt_logprobs: None,
        };
        r.scheduled_len = pos + 1;
        r.table_sent = pos + 1;
        r.in_flight.push(step_id);
        seq
    }

    /// Applies a step's sampled tokens (plan order, one per sequence with `sample`). Each token is
    /// reported as a `Token` event; a request then ends on a stop token (unless `ignore_eos`), on its
    /// output budget or at `max_context`, and is released at once. Sequences of requests that ended
    /// meanwhile are skipped. A token count that does not match the plan fails the step's requests.
    pub fn commit(&mut self, plan: &StepPlan, out: &StepOutput) {
        if let Err(msg) = out.check(plan) {
            self.fail_step(plan, &msg);
            return;
        }
        let (mut k, mut p) = (0, 0);
        for seq in &plan.seqs {
            let sampled = seq.sample.as_ref().map(|spec| {
                k += 1;
                let top = out.top_logprobs.row(k - 1, spec.num_top_logprobs as usize);
                (out.tokens[k - 1], out.logprobs.get(k - 1).copied().unwrap_or(0.0), top)
            });
            let prompt = seq.prompt_logprobs.map(|spec| {
                let n = seq.prompt_logprob_count();
                p += n;
                let top = (p - n..p).map(|row| out.prompt_top_logprobs.row(row, spec.num_top as usize)).collect();
                (out.prompt_logprobs[p - n..p].to_vec(), top)
            });
            let Some(i) = self.in_plan(seq.request_id, plan.step_id) else { continue };
            self.commit_progress(i, seq, plan.step_id);
            if self.release_if_ended(i) {
                continue; // the token of a step planned past the request's end: discarded
            }
            let id = self.running[i].id;
            if let Some((logprobs, top_logprobs)) = prompt.filter(|(l, _)| !l.is_empty()) {
                self.events.push(RequestEvent::PromptLogprobs {
                    id,
                    start: seq.prefix_len + 1,
                    logprobs,
                    top_logprobs,
                });
            }
            let Some((token, logprob, top_logprobs)) = sampled else { continue };
            self.running[i].output.push(token);
            self.events.push(RequestEvent::Token { id, token, logprob, top_logprobs });
            if let Some(reason) = self.finish_reason(i, token) {
                self.finish_committed(i, reason);
            }
        }
    }

    /// Request `i`'s step `seq` is done: its KV and state are computed, its snapshot captures cached.
    fn commit_progress(&mut self, i: usize, seq: &ScheduledSeq, step_id: u64) {
        let r = &mut self.running[i];
        r.in_flight.retain(|&s| s != step_id);
        r.computed_len = seq.context_len() as usize;
        if r.state_slot >= 0 {
            r.state_valid = true;
            self.kv.restored(&mut r.prefix);
        }
        for (upto, slot, cold) in std::mem::take(&mut r.pending_snapshots) {
            let tokens = r.tokens(upto);
            let duplicates = self.kv.cache_snapshot(&tokens, &r.slots, &mut r.prefix, slot, cold);
            r.duplicates.extend(duplicates);
        }
        // Radix: the prompt is cached as soon as its KV is computed, not only when the request ends, so the
        // other choices of an `n > 1` request (submitted after this one's first token) reuse it. Hybrid
        // models share prompts through snapshots instead. Only when the tree holds nothing of it past the
        // request's prefix: locking KV the tree cached meanwhile would take evictable pages out of what
        // admission counted on, while the request keeps its duplicates of them.
        let whole_pages = r.prompt_len() - r.prompt_len() % self.cfg.page_size;
        if self.cfg.cache_type == CacheType::Radix
            && r.state_slot < 0
            && r.computed_len >= r.prompt_len()
            && whole_pages > r.prefix.len
        {
            let tokens = r.tokens(whole_pages);
            if self.kv.match_prefix(&tokens).prefix.len == r.prefix.len {
                let duplicates = self.kv.cache_prefix(&tokens, &r.slots, &mut r.prefix);
                debug_assert!(duplicates.is_empty());
            }
        }
    }

    /// Whether request `i` ends with the `token` it just sampled: a stop token (unless `ignore_eos`), its
    /// output budget or the context.
    fn finish_reason(&self, i: usize, token: u32) -> Option<FinishReason> {
        let r = &self.running[i];
        if !r.ignore_eos && r.stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if r.output.len() >= r.max_new_tokens as usize || r.prompt_len() + r.output.len() >= self.cfg.max_context
        {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Index of running request `id` if it is part of step `step_id`.
    fn in_plan(&self, id: u64, step_id: u64) -> Option<usize> {
        self.running.iter().position(|r| r.id == id && r.in_flight.contains(&step_id))
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

    /// Releases running request `i` and reports how it ended (unless it had already ended: see
    /// [`RunningRequest::ended`]). A finished hybrid radix request donates its live state unless a step of it is
    /// still in flight (that step would still advance the slot).
    fn end_running(&mut self, i: usize, ending: Ending) {
        let r = self.running.remove(i);
        let reported = r.ended.is_some();
        let insert = matches!(ending, Ending::Finished(_)) && self.cfg.cache_type.caches();
        let computed = r.tokens(if insert { r.computed_len } else { 0 });
        for &(_, slot, _) in &r.pending_snapshots {
            self.kv.free_snapshot(slot);
        }
        let valid = r.state_valid && r.in_flight.is_empty();
        let live = (r.state_slot >= 0).then_some(LiveState { slot: r.state_slot as u32, valid });
        self.kv.release(&computed, &r.slots, r.prefix, insert, live);
        self.kv.free_slots(&r.duplicates);
        self.reserved_pages -= r.reserved_pages;
        self.rows.free(r.row);
        if reported {
            return;
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
        let states = self.kv.states();
        let evictable_snapshots = self.kv.tree().evictable_snapshots();
        SchedulerStats {
            running: self.running.len(),
            queued: self.queue.len(),
            kv_used_tokens: used,
            kv_capacity_tokens: capacity,
            token_usage: used as f64 / capacity as f64,
            cached_tokens_in_tree: self.kv.tree().total_tokens(),
            evictable_tokens: evictable,
            free_rows: self.rows.available(),
            free_state_slots: states.live_available(),
            state_slots_total: states.capacity(),
            state_slots_used: states.capacity() - states.free_ids() - evictable_snapshots,
            snapshot_slots_total: if self.cfg.cache_type == CacheType::HybridRadix {
                states.snapshot_capacity()
            } else {
                0
            },
            snapshot_slots_used: states.snapshots_in_use(),
            evictable_snapshots,
            snapshot_hits: self.snapshot_hits,
            snapshot_hit_tokens: self.snapshot_hit_tokens,
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

    /// Evicts every cached sequence no running request uses, and every snapshot no restore is pending
    /// on; returns the KV tokens freed (for an admin `flush_cache` endpoint, and for tests that check the
    /// pools come back whole).
    pub fn flush_cache(&mut self) -> usize {
        self.kv.evict_snapshots(usize::MAX);
        self.kv.evict(usize::MAX)
    }

    /// Nothing queued and nothing running.
    pub fn is_idle(&self) -> bool {
        self.queue.is_empty() && self.running.is_empty()
    }

    /// Cross-checks all bookkeeping: every KV page is free, cached or owned by exactly one request; every
    /// state slot is free, a tree snapshot, a pending capture or a live slot of exactly one running
    /// request; tree lock and snapshot-lock counts equal the running requests' locks; token counters and
    /// eviction orders recount right; rows are owned by exactly the running requests; reservations add
    /// up and are covered by free + evictable KV. O(pool pages + state slots + tree nodes + requests);
    /// cheap enough when idle.
    pub fn check_integrity(&self) -> Result<(), String> {
        let ps = self.cfg.page_size;
        let holders = Holders {
            kv_slots: self.running.iter().flat_map(|r| [&r.slots[r.prefix.len..], &r.duplicates[..]]).collect(),
            locks: self.running.iter().map(|r| r.prefix.node).collect(),
            snapshot_locks: self.running.iter().filter(|r| r.prefix.restore.is_some()).map(|r| r.prefix.node).collect(),
            live_states: self.running.iter().filter(|r| r.state_slot >= 0).map(|r| r.state_slot as u32).collect(),
            pending_snapshots: self.running.iter().flat_map(|r| r.pending_snapshots.iter().map(|p| p.1)).collect(),
        };
        self.kv.check_integrity(&holders)?;
        self.rows.check_integrity()?;
        if self.rows.capacity() - self.rows.available() != self.running.len() {
            return Err("rows in use differ from running requests".into());
        }
        let hybrid = self.cfg.num_state_slots > 0;
        if hybrid && self.kv.states().live_in_use() != self.running.len() {
            return Err("live state slots in use differ from running requests".into());
        }
        let mut reserved = 0;
        for r in &self.running {
            if !self.rows.is_in_use(r.row) {
                return Err(format!("request {} holds row {} that is marked free", r.id, r.row));
            }
            if hybrid != (r.state_slot >= 0) {
                return Err(format!("request {} holds a bad state slot {}", r.id, r.state_slot));
            }
            if r.prefix.restore.is_some()
                && (r.state_valid || self.kv.tree().state_slot(r.prefix.node) != r.prefix.restore)
            {
                return Err(format!("request {} has a pending restore that is not its node's snapshot", r.id));
            }
            if !r.pending_snapshots.is_empty() && r.in_flight.is_empty() {
                return Err(format!("request {} holds snapshot captures outside a step in flight", r.id));
            }
            if r.ended.is_some() && r.in_flight.is_empty() {
                return Err(format!("request {} ended but is not released", r.id));
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
