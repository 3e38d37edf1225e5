//! A fake worker and a driver that run the [`Scheduler`] the way the engine thread does
//! (`next_step` → execute → `commit` / `fail_step`), checking the step contract on every plan.
//!
//! The fake worker keeps what the real one keeps: a page table per row and a KV pool. Each KV slot holds
//! a hash of the whole token prefix it was computed for, so reading a slot tells whether it holds the
//! right K/V: a stale slot, one overwritten by another request, or a wrong prefix-cache hit shows up
//! as a hash mismatch the next time any sequence reads that position. Sampled tokens are a function of
//! the plan's `SampleSpec.seed` only (or scripted per request), so seeded requests are reproducible.
//!
//! For hybrid models it also keeps the recurrent-state slots: each holds `(tokens folded in, hash of those
//! tokens)`, or nothing. It runs a plan the way the real worker does (state copies, then the forward, then
//! the snapshot captures) and checks that every sequence continuing from its live slot (`prefix_len > 0`)
//! finds exactly the state after its `prefix_len` tokens there: a restore from the wrong snapshot, a
//! capture at the wrong `upto`, a snapshot slot handed out while still live, or a live slot reused too
//! early shows up as a mismatch.

use std::collections::{HashMap, HashSet};

use ft_core::config::SchedulerConfig;
use ft_core::request::{FinishReason, NewRequest, RequestEvent, SamplingParams};
use ft_core::scheduler::{splitmix64_mix, Scheduler};
use ft_core::step::{StepKind, StepOutput, StepPlan};

/// What the fake worker knows about one request.
#[derive(Clone, Debug, Default)]
struct WorkerSeq {
    prompt_len: usize,
    /// Prompt + tokens sampled so far.
    tokens: Vec<u32>,
    /// `prefix_hash[i]`: hash of `tokens[..=i]`.
    prefix_hash: Vec<u64>,
    /// Positions whose KV this worker computed or found cached.
    kv_len: usize,
    /// Whether its first chunk has run (its row's table belongs to it).
    started: bool,
    /// Sampling seeds seen, in order.
    seeds: Vec<u64>,
}

impl WorkerSeq {
    fn hash_upto(&mut self, n: usize) {
        while self.prefix_hash.len() < n {
            let i = self.prefix_hash.len();
            let prev = if i == 0 { 0x1234_5678 } else { self.prefix_hash[i - 1] };
            self.prefix_hash.push(splitmix64_mix(prev ^ (self.tokens[i] as u64).wrapping_mul(0x9E37_79B9)));
        }
    }
}

/// The fake worker: page table, KV pool contents, deterministic sampling.
#[derive(Debug)]
pub struct FakeWorker {
    seqs: HashMap<u64, WorkerSeq>,
    /// `table[row]`: KV slot of each position of the row's current request.
    table: Vec<Vec<u32>>,
    /// `row_owner[row]`.
    row_owner: Vec<Option<u64>>,
    /// Requests that ended: a plan already in flight when one ended still runs on the device (its KV and
    /// state writes land in slots the scheduler has freed), but nothing checks or keeps its row.
    gone: HashSet<u64>,
    /// `pool[slot]`: prefix hash of the K/V written there.
    pool: Vec<Option<u64>>,
    /// `states[slot]`: `(tokens folded in, hash of them)` of the recurrent state in each state slot.
    states: Vec<Option<(usize, u64)>>,
    /// Tokens per KV page, the snapshot grid and the special-token checkpoint, to check capture points.
    page_size: usize,
    grid: usize,
    snapshot_token_id: Option<u32>,
    /// State copies and snapshot captures run so far (anchor: off the grid, after the special token).
    pub copies: usize,
    pub captures: usize,
    pub anchor_captures: usize,
    /// A token sampled one draw in eight (to exercise `--enable-special-token-ckpt`), if set.
    pub favourite: Option<u32>,
    /// Scripted tokens: `(request id, output index) -> token`.
    pub script: HashMap<(u64, usize), u32>,
    /// The tokens the last step sampled: what a sequence with `input_from_prev` reads (overlap).
    last_sampled: Vec<u32>,
}

impl FakeWorker {
    pub fn new(cfg: &SchedulerConfig) -> Self {
        FakeWorker {
            seqs: HashMap::new(),
            table: vec![Vec::new(); cfg.max_running_requests],
            row_owner: vec![None; cfg.max_running_requests],
            gone: HashSet::new(),
            pool: vec![None; cfg.kv_capacity_tokens],
            states: vec![None; cfg.num_state_slots],
            page_size: cfg.page_size,
            grid: cfg.snapshot_grid(),
            snapshot_token_id: cfg.snapshot_token_id,
            copies: 0,
            captures: 0,
            anchor_captures: 0,
            favourite: None,
            script: HashMap::new(),
            last_sampled: Vec::new(),
        }
    }

    pub fn register(&mut self, req: &NewRequest) {
        self.seqs.insert(
            req.id,
            WorkerSeq { prompt_len: req.prompt.len(), tokens: req.prompt.clone(), ..Default::default() },
        );
    }

    /// The request ended: its row is free again.
    pub fn forget(&mut self, id: u64) {
        for o in self.row_owner.iter_mut() {
            if *o == Some(id) {
                *o = None;
            }
        }
        self.gone.insert(id);
    }

    /// Sampling seeds the request saw, in order.
    pub fn seeds(&self, id: u64) -> &[u64] {
        &self.seqs[&id].seeds
    }

    /// The state a slot holds: `(tokens folded in, their hash)`.
    pub fn state(&self, slot: i32) -> Option<(usize, u64)> {
        self.states[slot as usize]
    }

    /// Prompt logprobs of a chunk that asks: each target position `q` gets logprob `-q` (so the driver can
    /// check which positions the events cover), its top rows the target token. Checks `next_token`.
    fn prompt_logprobs(seq: &ft_core::step::ScheduledSeq, s: &WorkerSeq, out: &mut StepOutput) {
        let Some(spec) = seq.prompt_logprobs else { return };
        let ctx = seq.context_len() as usize;
        assert!(ctx <= s.prompt_len, "prompt logprobs asked for a decode step");
        assert_eq!(spec.next_token, s.tokens[..s.prompt_len].get(ctx).copied(), "next_token");
        let end = if spec.next_token.is_some() { ctx + 1 } else { ctx };
        for q in seq.prefix_len as usize + 1..end {
            out.prompt_logprobs.push(-(q as f32));
            let k = out.prompt_top_logprobs.k;
            out.prompt_top_logprobs.ids.extend(std::iter::repeat_n(s.tokens[q], k));
            out.prompt_top_logprobs.logprobs.extend(std::iter::repeat_n(-(q as f32), k));
        }
    }

    /// The sequence's new tokens, a placeholder replaced by the previous step's sampled token (overlap).
    fn input_tokens(&self, seq: &ft_core::step::ScheduledSeq) -> Vec<u32> {
        match seq.input_from_prev {
            Some(r) => {
                assert_eq!(seq.new_tokens.len(), 1, "a placeholder input in a sequence of several tokens");
                vec![self.last_sampled[r as usize]]
            }
            None => seq.new_tokens.clone(),
        }
    }

    /// Runs a plan: state copies first, then checks it against the page table, the KV pool and the state
    /// slots, writes the new K/V and states, samples; snapshot captures last.
    pub fn execute(&mut self, plan: &StepPlan) -> StepOutput {
        let mut out = StepOutput::default();
        let sampled = plan.seqs.iter().filter_map(|s| s.sample.as_ref());
        out.top_logprobs.k = sampled.map(|p| p.num_top_logprobs as usize).max().unwrap_or(0);
        let prompt = plan.seqs.iter().filter_map(|s| s.prompt_logprobs);
        out.prompt_top_logprobs.k = prompt.map(|p| p.num_top as usize).max().unwrap_or(0);
        // Restores: copy-on-write of a snapshot into a live slot, before the forward.
        for c in &plan.state_copies {
            let src = self.states[c.src as usize];
            assert!(src.is_some(), "state copy from slot {} that holds no state", c.src);
            self.states[c.dst as usize] = src;
            self.copies += 1;
        }
        let mut final_states = Vec::new();
        for seq in &plan.seqs {
            let id = seq.request_id;
            let row = seq.row as usize;
            let ctx = seq.context_len() as usize;
            let new_tokens = self.input_tokens(seq);
            let s = self.seqs.get_mut(&id).unwrap_or_else(|| panic!("plan schedules unknown request {id}"));
            if self.gone.contains(&id) {
                // Ended while this plan was in flight: the device still writes its KV and states.
                s.hash_upto(ctx);
                for (k, pos) in (seq.table_from as usize..ctx).enumerate() {
                    if pos >= seq.prefix_len as usize {
                        self.pool[seq.table_slots[k] as usize] = Some(s.prefix_hash[pos]);
                    }
                }
                if seq.state_slot >= 0 {
                    final_states.push((seq.state_slot, (ctx, s.prefix_hash[ctx - 1])));
                }
                if seq.sample.is_some() {
                    out.tokens.push(0);
                    out.logprobs.push(0.0);
                }
                continue;
            }
            if !s.started {
                assert_eq!(seq.table_from, 0, "request {id}'s first chunk must send its whole table");
                assert!(
                    self.row_owner[row].is_none(),
                    "request {id} starts in row {row} still owned by {:?}",
                    self.row_owner[row]
                );
                assert!((seq.prefix_len as usize) < s.prompt_len, "a cache hit must leave a token to compute");
                self.row_owner[row] = Some(id);
                self.table[row].clear();
                s.kv_len = seq.prefix_len as usize;
                s.started = true;
            } else {
                assert_eq!(self.row_owner[row], Some(id), "request {id} moved rows");
                assert_eq!(seq.table_from as usize, self.table[row].len(), "table_from skips or repeats positions");
            }
            assert_eq!(seq.prefix_len as usize, s.kv_len, "prefix_len is not the KV the worker holds");
            assert_eq!(seq.table_slots.len(), ctx - seq.table_from as usize, "table_slots length");
            self.table[row].extend_from_slice(&seq.table_slots);
            assert_eq!(self.table[row].len(), ctx);
            assert!(ctx <= s.tokens.len(), "request {id} computes tokens it does not have");
            assert_eq!(&new_tokens[..], &s.tokens[seq.prefix_len as usize..ctx], "new_tokens of request {id}");
            assert!(!seq.new_tokens.is_empty());
            s.hash_upto(ctx);
            // Every position read must hold this request's own prefix.
            for pos in 0..seq.prefix_len as usize {
                let slot = self.table[row][pos] as usize;
                assert_eq!(
                    self.pool[slot],
                    Some(s.prefix_hash[pos]),
                    "request {id} position {pos} reads slot {slot} holding someone else's K/V"
                );
            }
            let mut written = HashSet::new();
            for pos in seq.prefix_len as usize..ctx {
                let slot = self.table[row][pos] as usize;
                assert!(written.insert(slot), "two positions of one sequence share slot {slot}");
                self.pool[slot] = Some(s.prefix_hash[pos]);
            }
            s.kv_len = ctx;
            if seq.state_slot >= 0 {
                let p = seq.prefix_len as usize;
                if p > 0 {
                    let want = Some((p, s.prefix_hash[p - 1]));
                    assert_eq!(
                        self.states[seq.state_slot as usize], want,
                        "request {id} continues at {p} from live slot {} holding another state",
                        seq.state_slot
                    );
                }
                final_states.push((seq.state_slot, (ctx, s.prefix_hash[ctx - 1])));
            }
            Self::prompt_logprobs(seq, s, &mut out);
            let final_or_decode = ctx >= s.prompt_len;
            assert_eq!(seq.sample.is_some(), final_or_decode, "sample must be set exactly on the final chunk / decode");
            if let Some(spec) = &seq.sample {
                assert_eq!(ctx, s.tokens.len(), "sampling before the previous token was fed back");
                let n = s.tokens.len() - s.prompt_len;
                let drawn = splitmix64_mix(spec.seed);
                let drawn = match self.favourite {
                    Some(t) if drawn.is_multiple_of(8) => t,
                    _ => 100 + (drawn % 1000) as u32,
                };
                let token = self.script.get(&(id, n)).copied().unwrap_or(drawn);
                s.seeds.push(spec.seed);
                s.tokens.push(token);
                out.tokens.push(token);
                out.logprobs.push(-0.5);
                out.top_logprobs.ids.extend((0..out.top_logprobs.k).map(|r| token + r as u32));
                out.top_logprobs.logprobs.extend((0..out.top_logprobs.k).map(|r| -0.5 - r as f32));
            }
        }
        for (slot, state) in final_states {
            self.states[slot as usize] = Some(state);
        }
        // Snapshots: the state after `upto` tokens of the sequence, after the forward.
        for c in &plan.snapshots {
            let seq = &plan.seqs[c.seq_index as usize];
            let s = &self.seqs[&seq.request_id];
            let upto = c.upto as usize;
            assert!(upto > seq.prefix_len as usize && upto <= seq.context_len() as usize, "capture outside the step");
            assert!(upto.is_multiple_of(self.page_size), "capture at {upto}: not a page boundary");
            let anchor = self.snapshot_token_id.is_some_and(|t| s.tokens[upto - 1] == t);
            assert!(
                upto.is_multiple_of(self.grid) || anchor,
                "capture at {upto}: off the grid and not after the anchor token"
            );
            self.states[c.slot as usize] = Some((upto, s.prefix_hash[upto - 1]));
            self.captures += 1;
            if !upto.is_multiple_of(self.grid) {
                self.anchor_captures += 1;
            }
        }
        self.last_sampled = out.tokens.clone();
        out
    }
}

/// Everything observed about one request.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub events: Vec<RequestEvent>,
    pub tokens: Vec<u32>,
    /// Step index of each token.
    pub token_steps: Vec<u64>,
    pub started_step: Option<u64>,
    pub cached_tokens: Option<u32>,
    pub max_new_tokens: Option<u32>,
    pub finished: Option<FinishReason>,
    pub failed: Option<String>,
    pub added_step: u64,
    /// The request asked for prompt logprobs; the prompt position they cover up to (exclusive).
    pub wants_prompt_logprobs: bool,
    pub prompt_logprobs_upto: u32,
}

impl Outcome {
    pub fn ended(&self) -> bool {
        self.finished.is_some() || self.failed.is_some()
    }
    /// Largest number of steps between consecutive tokens.
    pub fn max_token_gap(&self) -> u64 {
        self.token_steps.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
    }
}

/// The engine loop over the scheduler and the fake worker, with per-step checks.
pub struct Sim {
    pub sched: Scheduler,
    pub worker: FakeWorker,
    pub cfg: SchedulerConfig,
    pub steps: u64,
    pub outcomes: HashMap<u64, Outcome>,
    /// Ids in the order `Started` was seen.
    pub start_order: Vec<u64>,
    /// Ids in the order they were added.
    pub add_order: Vec<u64>,
    pub plans: Vec<StepPlan>,
    pub keep_plans: bool,
    /// Check integrity after every step (O(pool)); on by default.
    pub check_every_step: bool,
    /// Drive the overlap loop: [`Sim::step`] plans N+1 with `next_step_ahead` before committing N.
    pub overlap: bool,
    /// The step "on the device" (already run by the fake worker, not yet committed), overlap only.
    pub in_flight: Option<(StepPlan, StepOutput)>,
    /// Plans made ahead (overlap).
    pub ahead_plans: Vec<StepPlan>,
}

pub fn request(id: u64, prompt: Vec<u32>, max_new: u32) -> NewRequest {
    NewRequest {
        id,
        prompt,
        max_new_tokens: max_new,
        sampling: SamplingParams::default(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
    }
}

impl Sim {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Sim {
            sched: Scheduler::new(cfg.clone()),
            worker: FakeWorker::new(&cfg),
            cfg,
            steps: 0,
            outcomes: HashMap::new(),
            start_order: Vec::new(),
            add_order: Vec::new(),
            plans: Vec::new(),
            keep_plans: false,
            check_every_step: true,
            overlap: false,
            in_flight: None,
            ahead_plans: Vec::new(),
        }
    }

    pub fn add(&mut self, req: NewRequest) -> Result<(), ft_core::request::AdmissionError> {
        self.sched.add_request(req.clone())?;
        self.worker.register(&req);
        self.add_order.push(req.id);
        let wants_prompt_logprobs = req.sampling.prompt_logprobs;
        self.outcomes.insert(req.id, Outcome { added_step: self.steps, wants_prompt_logprobs, ..Default::default() });
        Ok(())
    }

    pub fn outcome(&self, id: u64) -> &Outcome {
        &self.outcomes[&id]
    }

    fn absorb_events(&mut self) {
        for e in self.sched.drain_events() {
            let id = e.request_id();
            let o = self.outcomes.get_mut(&id).unwrap_or_else(|| panic!("event for unknown request {id}"));
            assert!(!o.ended(), "event {e:?} after the request ended");
            match &e {
                RequestEvent::Started { cached_tokens, max_new_tokens, .. } => {
                    assert!(o.started_step.is_none(), "request {id} started twice");
                    o.started_step = Some(self.steps);
                    o.cached_tokens = Some(*cached_tokens);
                    o.max_new_tokens = Some(*max_new_tokens);
                    self.start_order.push(id);
                }
                RequestEvent::PromptLogprobs { start, logprobs, top_logprobs, .. } => {
                    assert!(o.wants_prompt_logprobs && o.tokens.is_empty(), "prompt logprobs unasked or after a token");
                    assert_eq!(*start, o.prompt_logprobs_upto.max(1), "prompt logprobs skip or repeat positions");
                    assert_eq!(o.cached_tokens, Some(0), "a request wanting prompt logprobs hit the prefix cache");
                    for (q, (lp, top)) in logprobs.iter().zip(top_logprobs).enumerate() {
                        assert_eq!(*lp, -((*start as usize + q) as f32), "prompt logprob of the wrong position");
                        assert!(top.iter().all(|t| t.logprob == *lp));
                    }
                    o.prompt_logprobs_upto = start + logprobs.len() as u32;
                }
                RequestEvent::Token { token, top_logprobs, .. } => {
                    assert!(o.started_step.is_some(), "token before Started");
                    assert!(top_logprobs.first().is_none_or(|t| t.token == *token), "top logprobs of another token");
                    if o.wants_prompt_logprobs && o.tokens.is_empty() {
                        assert_eq!(
                            o.prompt_logprobs_upto as usize, self.worker.seqs[&id].prompt_len,
                            "prompt logprobs"
                        );
                    }
                    o.tokens.push(*token);
                    o.token_steps.push(self.steps);
                    assert!(o.tokens.len() as u32 <= o.max_new_tokens.unwrap(), "more tokens than max_new_tokens");
                }
                RequestEvent::Finished { reason, completion_tokens, .. } => {
                    assert_eq!(*completion_tokens as usize, o.tokens.len(), "completion_tokens");
                    o.finished = Some(*reason);
                    self.worker.forget(id);
                }
                RequestEvent::Failed { message, .. } => {
                    o.failed = Some(message.clone());
                    self.worker.forget(id);
                }
            }
            o.events.push(e);
        }
    }

    /// Plans one step and checks the plan against the config. Does not execute it.
    pub fn plan(&mut self) -> Option<StepPlan> {
        let plan = self.sched.next_step()?;
        self.check_plan(&plan);
        Some(plan)
    }

    /// The per-plan checks of [`Sim::plan`] (and of plans made ahead).
    fn check_plan(&mut self, plan: &StepPlan) {
        let c = &self.cfg;
        let decode = plan.seqs.iter().filter(|s| s.prefix_len as usize >= self.worker_prompt_len(s.request_id)).count();
        let prefill = plan.seqs.len() - decode;
        match plan.kind {
            StepKind::Decode => assert!(prefill == 0 && decode > 0, "Decode step with prompt chunks"),
            StepKind::Prefill => assert!(decode == 0 && prefill > 0, "Prefill step with decodes"),
            StepKind::Mixed => assert!(decode > 0 && prefill > 0 && c.mixed_decode, "bad Mixed step"),
        }
        if plan.kind != StepKind::Decode {
            assert!(plan.num_tokens() <= c.max_prefill_tokens, "step of {} tokens > budget", plan.num_tokens());
        }
        assert!(plan.seqs.len() <= c.max_running_requests);
        let mut rows = HashSet::new();
        let mut ids = HashSet::new();
        let mut states = HashSet::new();
        for s in &plan.seqs {
            assert!((s.row as usize) < c.max_running_requests && rows.insert(s.row), "row reused or out of range");
            assert!(ids.insert(s.request_id), "request twice in one step");
            if c.num_state_slots == 0 {
                assert_eq!(s.state_slot, -1);
            } else {
                assert!(
                    s.state_slot >= 0 && (s.state_slot as usize) < c.num_state_slots && states.insert(s.state_slot)
                );
            }
        }
        let live: HashSet<i32> = plan.seqs.iter().map(|s| s.state_slot).filter(|&s| s >= 0).collect();
        let mut dsts = HashSet::new();
        for c in &plan.state_copies {
            assert!(
                c.src >= 0 && (c.src as usize) < self.cfg.num_state_slots && !live.contains(&c.src),
                "bad copy source"
            );
            let seq =
                plan.seqs.iter().find(|s| s.state_slot == c.dst).expect("a copy restores a live slot of the plan");
            assert!(seq.table_from == 0 && seq.prefix_len > 0, "a restore outside a request's first chunk");
            assert!(dsts.insert(c.dst), "two restores into one live slot");
        }
        let mut snap_slots = HashSet::new();
        for c in &plan.snapshots {
            assert!((c.seq_index as usize) < plan.seqs.len());
            assert!(
                c.slot >= 0 && (c.slot as usize) < self.cfg.num_state_slots && !live.contains(&c.slot),
                "bad capture slot"
            );
            assert!(snap_slots.insert(c.slot), "two captures into one slot");
        }
        let st = self.sched.stats();
        assert!(st.kv_used_tokens + st.evictable_tokens <= st.kv_capacity_tokens);
        assert!(st.running <= c.max_running_requests);
        self.absorb_events();
    }

    fn worker_prompt_len(&self, id: u64) -> usize {
        self.worker.seqs[&id].prompt_len
    }

    /// Executes and commits a plan from [`Sim::plan`].
    pub fn execute(&mut self, plan: &StepPlan) {
        let out = self.worker.execute(plan);
        self.commit(plan, &out);
    }

    /// Commits a step the fake worker ran, with the per-step checks.
    pub fn commit(&mut self, plan: &StepPlan, out: &StepOutput) {
        self.sched.commit(plan, out);
        self.steps += 1;
        self.absorb_events();
        if self.keep_plans {
            self.plans.push(plan.clone());
        }
        if self.check_every_step {
            self.sched.check_integrity().unwrap_or_else(|e| panic!("after step {}: {e}", self.steps));
        }
    }

    /// Fails a plan instead of executing it.
    pub fn fail(&mut self, plan: &StepPlan, msg: &str) {
        self.sched.fail_step(plan, msg);
        self.steps += 1;
        self.absorb_events();
        self.sched.check_integrity().unwrap();
    }

    /// One engine iteration; false when the scheduler had nothing to do.
    pub fn step(&mut self) -> bool {
        if self.overlap {
            return self.step_overlapped();
        }
        match self.plan() {
            Some(p) => {
                self.execute(&p);
                true
            }
            None => false,
        }
    }

    /// One iteration of the overlap loop: the step in flight (or a new one, run at once), then N+1 planned
    /// ahead and run by the worker (the device runs it after N) before N is committed.
    fn step_overlapped(&mut self) -> bool {
        let (plan, out) = match self.in_flight.take() {
            Some(f) => f,
            None => match self.plan() {
                Some(p) => {
                    let out = self.worker.execute(&p);
                    (p, out)
                }
                None => return false,
            },
        };
        if let Some(next) = self.sched.next_step_ahead(&plan) {
            self.check_plan(&next);
            assert!(next.seqs.iter().all(|s| s.input_from_prev.is_some()), "ahead plans read the previous step");
            let out = self.worker.execute(&next);
            self.ahead_plans.push(next.clone());
            self.in_flight = Some((next, out));
        }
        self.commit(&plan, &out);
        true
    }

    pub fn finish(&mut self, id: u64, reason: FinishReason) {
        self.sched.finish(id, reason);
        self.absorb_events();
        self.sched.check_integrity().unwrap();
    }

    /// Steps until idle (panics after `max_steps`).
    pub fn run_until_idle(&mut self, max_steps: u64) {
        let start = self.steps;
        while self.step() {
            assert!(self.steps - start <= max_steps, "not idle after {max_steps} steps");
        }
        assert!(self.sched.is_idle(), "no step to run but the scheduler is not idle");
    }

    /// After everything ended: bookkeeping intact, nothing held but the cache, and flushing the cache
    /// returns the whole pool.
    pub fn assert_clean(&mut self) {
        assert!(self.sched.is_idle());
        for (id, o) in &self.outcomes {
            assert!(o.ended(), "request {id} never ended");
        }
        self.sched.check_integrity().unwrap();
        let st = self.sched.stats();
        assert_eq!(st.kv_used_tokens, 0, "an idle scheduler holds KV outside the cache");
        assert_eq!(st.free_rows, self.cfg.max_running_requests);
        assert_eq!(st.free_state_slots, self.cfg.live_state_slots());
        assert_eq!(st.evictable_tokens, st.cached_tokens_in_tree, "idle: every cached token is evictable");
        assert_eq!(st.state_slots_used, 0, "an idle scheduler holds state slots outside the cache");
        assert_eq!(st.snapshot_slots_used, st.evictable_snapshots, "idle: every snapshot is evictable");
        assert_eq!(st.snapshot_slots_used, self.sched.kv_cache().tree().num_snapshots(), "snapshots outside the tree");
        self.sched.flush_cache();
        let st = self.sched.stats();
        assert_eq!(st.cached_tokens_in_tree, 0);
        assert_eq!(st.snapshot_slots_used, 0);
        assert_eq!(self.sched.kv_cache().states().free_ids(), self.cfg.num_state_slots, "state slots not all free");
        assert_eq!(
            self.sched.kv_cache().allocator().free_pages(),
            self.sched.kv_cache().allocator().total_pages(),
            "pool not full after flushing the cache"
        );
        self.sched.check_integrity().unwrap();
    }
}
