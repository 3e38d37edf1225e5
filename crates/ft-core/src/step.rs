//! The step contract between the Rust engine and the Python worker.
//!
//! Once per step the engine hands the worker one [`StepPlan`]; the worker runs one forward pass and answers
//! with one [`StepOutput`] (or a typed [`WorkerError`]). `ft-py` flattens a plan into the flat int/float
//! arrays described in `python/freetoken/engine/step_plan.py`; both sides check [`STEP_CONTRACT_VERSION`]
//! at start-up, so a change here must bump it and change that file in the same commit.
//!
//! Page table: the worker keeps `req_to_token[row, position] -> KV slot` on the device. A plan only sends
//! the entries a sequence gained since its last step (`table_from..context_len`), so a decode step sends one
//! slot per sequence, and the first chunk of a prompt that hit the prefix cache also sends the cached
//! prefix's slots.
//!
//! Recurrent state (hybrid models): each running sequence owns one live state slot. `state_copies` run
//! before the forward (restore a snapshot into a live slot: copy-on-write), `snapshots` after it.
//!
//! Overlap (placeholder inputs): the engine may plan and launch step N+1 before it has collected step N's
//! tokens ([`Worker::launch`] / [`Worker::collect`]). A decode sequence of N+1 then says
//! `input_from_prev: Some(r)`: its one input token is the token the worker sampled for sampled row `r`
//! (plan order) of the step launched just before, taken on the device; its `new_tokens` holds a placeholder.
//!
//! ```text
//!   launch(N)   launch(N+1: row b's input = N's sampled row r)   collect(N)   launch(N+2)   collect(N+1) ...
//! ```
//!
//! Logprobs: every sampled token comes back with its raw logprob. A sampled row with `num_top_logprobs > 0`
//! also gets the most likely tokens at its position, and a sequence with `prompt_logprobs` gets the logprob
//! (and alternatives) of each of its new tokens after the first, plus of `next_token` when the chunk does not
//! end the prompt: the chunk's logits at every position, not only the last.
//!
//! ```text
//!   chunk of prompt positions 4..8 (tokens t4..t7), next_token t8:   logits at 4 5 6 7
//!                                                                    predict    t5 t6 t7 t8  -> 4 entries
//!   final chunk 8..10 (t8 t9), sampled:                             logits at 8 9
//!                                                                    predict    t9 (sampled)  -> 1 entry
//! ```

use crate::request::TopLogprob;

/// Bumped on every change to [`StepPlan`] / [`StepOutput`] or their flat encoding.
pub const STEP_CONTRACT_VERSION: u32 = 4;

/// What `new_tokens` holds where the input comes from the previous step on the device (`input_from_prev`).
pub const PLACEHOLDER_TOKEN: u32 = 0;

/// How a sequence samples its next token this step.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleSpec {
    /// 0.0 means greedy (argmax).
    pub temperature: f32,
    /// 1.0 disables nucleus filtering.
    pub top_p: f32,
    /// 0 (or < 0) disables top-k filtering.
    pub top_k: i32,
    /// 0.0 disables min-p filtering.
    pub min_p: f32,
    /// OpenAI's presence and frequency penalties over the tokens the request generated (0.0 disables).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Seed of this draw: derived from the request seed and the output position, so a seeded request
    /// samples the same tokens whatever the batch it runs in.
    pub seed: u64,
    /// Most likely tokens to report beside the sampled one (0: none).
    pub num_top_logprobs: u32,
}

/// A prompt chunk whose tokens' logprobs are wanted (a request with `prompt_logprobs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLogprobsSpec {
    /// Most likely tokens to report at each position (0: none).
    pub num_top: u32,
    /// The prompt token after this chunk (`None`: the chunk ends the prompt; its last position's logits
    /// predict the sampled token instead).
    pub next_token: Option<u32>,
}

/// One sequence scheduled in a step.
#[derive(Clone, Debug, PartialEq)]
pub struct ScheduledSeq {
    pub request_id: u64,
    /// Page-table row owned by the request for its whole life (`0..max_running_requests`).
    pub row: u32,
    /// Tokens already in the KV cache (and folded into the recurrent state) before this step.
    pub prefix_len: u32,
    /// The tokens computed this step, at positions `prefix_len..prefix_len + new_tokens.len()`.
    pub new_tokens: Vec<u32>,
    /// Overlap: the one new token is the token sampled for sampled row `r` of the step launched just before
    /// this one (not yet collected); `new_tokens` then holds [`PLACEHOLDER_TOKEN`].
    pub input_from_prev: Option<u32>,
    /// First position whose KV slot is sent in `table_slots`.
    pub table_from: u32,
    /// KV slots for positions `table_from..prefix_len + new_tokens.len()` of this row.
    pub table_slots: Vec<u32>,
    /// Live recurrent-state slot for hybrid models, -1 otherwise.
    pub state_slot: i32,
    /// Present when this step ends the sequence's prompt (or is a decode step): sample one token.
    pub sample: Option<SampleSpec>,
    /// Present on prompt chunks of requests that want prompt logprobs.
    pub prompt_logprobs: Option<PromptLogprobsSpec>,
}

impl ScheduledSeq {
    pub fn context_len(&self) -> u32 {
        self.prefix_len + self.new_tokens.len() as u32
    }
    /// Prompt positions this sequence gets logprobs for: its new tokens after the first, and `next_token`.
    pub fn prompt_logprob_count(&self) -> usize {
        self.prompt_logprobs.map_or(0, |p| self.new_tokens.len() - 1 + p.next_token.is_some() as usize)
    }
}

/// Copy one recurrent-state slot into another before the forward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateCopy {
    pub src: i32,
    pub dst: i32,
}

/// Capture a sequence's recurrent state after `upto` tokens into `slot` (a point on the snapshot grid that
/// falls inside this step's new tokens, or its end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotCapture {
    /// Index into [`StepPlan::seqs`].
    pub seq_index: u32,
    pub upto: u32,
    pub slot: i32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// Only prompt chunks.
    Prefill,
    /// Only one-token decode sequences.
    Decode,
    /// Prompt chunks and decode tokens in one forward (decode not starved by long prompts).
    Mixed,
}

#[derive(Clone, Debug, PartialEq)]
pub struct StepPlan {
    pub step_id: u64,
    pub kind: StepKind,
    pub seqs: Vec<ScheduledSeq>,
    pub state_copies: Vec<StateCopy>,
    pub snapshots: Vec<SnapshotCapture>,
}

impl StepPlan {
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.new_tokens.len()).sum()
    }
    pub fn num_sampled(&self) -> usize {
        self.seqs.iter().filter(|s| s.sample.is_some()).count()
    }
    /// Prompt positions whose logprobs the step returns (all sequences).
    pub fn num_prompt_logprobs(&self) -> usize {
        self.seqs.iter().map(ScheduledSeq::prompt_logprob_count).sum()
    }
}

/// What the worker measured during a step (for status lines, `/v1/stats` and benchmarks).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    pub forward_ms: f64,
    pub expert_hits: u64,
    pub expert_misses: u64,
    /// Of the misses, those computed on the host CPU (`--moe-backend hybrid` / `cpu`), and the host's time on them
    /// (its experts' calls reported since the last step, whichever step they served).
    pub expert_host_misses: u64,
    pub expert_host_busy_ms: f64,
    /// Experts the prefill stream copied whole into its buffers: from the expert cache's slots on the device
    /// (`--moe-prefill-hit-d2d`) and over PCIe.
    pub prefill_experts_from_cache: u64,
    pub prefill_experts_from_host: u64,
    /// Peak transient device bytes the step allocated above what was allocated before it (CUDA; 0 where not
    /// measured). The engine reports the largest beside the memory plan's workspace in `/v1/stats`.
    pub workspace_bytes: u64,
    /// The span of the step on the device's timeline, from CUDA events recorded before its first kernel and after
    /// its last (eager steps; 0 where not measured). It includes gaps where the device waited for the host's next
    /// launch; `forward_ms` minus it is host time before the first kernel and after the last.
    pub device_ms: f64,
    /// The host's time to enqueue the forward (every layer's launches; eager steps, 0 where not measured). On
    /// CUDA the launches run ahead of the device, so a value near `device_ms` says the host set the step's pace.
    pub launch_ms: f64,
}

/// The most likely tokens at a number of positions: `k` per position, most likely first, row-major.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TopLogprobs {
    /// Entries per position (0: none computed). At least what any position asked for; a position uses its
    /// first `n`.
    pub k: usize,
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
}

impl TopLogprobs {
    /// The first `n` entries of position `row`.
    pub fn row(&self, row: usize, n: usize) -> Vec<TopLogprob> {
        let at = row * self.k;
        (at..at + n).map(|i| TopLogprob { token: self.ids[i], logprob: self.logprobs[i] }).collect()
    }
    fn check(&self, what: &str, rows: usize, asked: usize) -> Result<(), String> {
        if asked > self.k || self.ids.len() != rows * self.k || self.logprobs.len() != self.ids.len() {
            return Err(format!(
                "worker returned {} {what} top logprobs (k = {}) for {rows} positions asking up to {asked}",
                self.ids.len(),
                self.k
            ));
        }
        Ok(())
    }
}

/// The worker's answer: one token (and its logprob) per sequence with a `sample`, in plan order; the top
/// logprobs of those rows when one asked, and the prompt logprobs of the sequences that asked, in plan order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// One row per sampled sequence when any of them has `num_top_logprobs > 0`, else empty.
    pub top_logprobs: TopLogprobs,
    /// [`StepPlan::num_prompt_logprobs`] values.
    pub prompt_logprobs: Vec<f32>,
    /// One row per prompt logprob when any of those sequences has `num_top > 0`, else empty.
    pub prompt_top_logprobs: TopLogprobs,
    pub stats: StepStats,
}

impl StepOutput {
    /// Whether the output has the shape `plan` asks for (a mismatch fails the step's requests).
    pub fn check(&self, plan: &StepPlan) -> Result<(), String> {
        let sampled = plan.num_sampled();
        if self.tokens.len() != sampled || !(self.logprobs.is_empty() || self.logprobs.len() == sampled) {
            return Err(format!(
                "worker returned {} tokens and {} logprobs for a step with {sampled} sampling sequences",
                self.tokens.len(),
                self.logprobs.len()
            ));
        }
        let top = plan.seqs.iter().filter_map(|s| s.sample.as_ref()).map(|p| p.num_top_logprobs).max();
        if top.unwrap_or(0) > 0 {
            self.top_logprobs.check("sampled", sampled, top.unwrap_or(0) as usize)?;
        }
        let prompt = plan.num_prompt_logprobs();
        if self.prompt_logprobs.len() != prompt {
            return Err(format!("worker returned {} prompt logprobs for {prompt}", self.prompt_logprobs.len()));
        }
        let prompt_top = plan.seqs.iter().filter_map(|s| s.prompt_logprobs).map(|p| p.num_top).max().unwrap_or(0);
        if prompt_top > 0 && prompt > 0 {
            self.prompt_top_logprobs.check("prompt", prompt, prompt_top as usize)?;
        }
        Ok(())
    }
}

/// Typed failures of a step. The engine fails the step's requests on `OutOfMemory` and `InvalidPlan` and
/// goes on; on `Fatal` it fails everything and shuts down.
#[derive(Clone, Debug, PartialEq)]
pub enum WorkerError {
    OutOfMemory(String),
    InvalidPlan(String),
    Fatal(String),
}

impl std::fmt::Display for WorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerError::OutOfMemory(m) => write!(f, "out of memory during a step: {m}"),
            WorkerError::InvalidPlan(m) => write!(f, "invalid step plan: {m}"),
            WorkerError::Fatal(m) => write!(f, "worker failed: {m}"),
        }
    }
}

impl std::error::Error for WorkerError {}

/// The one seam between the engine loop and whatever runs the model: the PyO3 worker in production,
/// scripted fakes in tests.
///
/// `execute` runs one step to the end (the synchronous loop). `launch` starts one without waiting for its
/// tokens and `collect` waits for the oldest launched step's output: the overlap loop keeps at most two
/// launched, `launch(N+1)` before `collect(N)`, so a plan with `input_from_prev` follows the step whose
/// tokens it reads. An error from `launch` means the step did not start (nothing to collect).
pub trait Worker: Send {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutput, WorkerError>;
    fn launch(&mut self, plan: &StepPlan) -> Result<(), WorkerError>;
    fn collect(&mut self) -> Result<StepOutput, WorkerError>;
}
