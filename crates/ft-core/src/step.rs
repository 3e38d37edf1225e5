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

/// Bumped on every change to [`StepPlan`] / [`StepOutput`] or their flat encoding.
pub const STEP_CONTRACT_VERSION: u32 = 2;

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
    /// First position whose KV slot is sent in `table_slots`.
    pub table_from: u32,
    /// KV slots for positions `table_from..prefix_len + new_tokens.len()` of this row.
    pub table_slots: Vec<u32>,
    /// Live recurrent-state slot for hybrid models, -1 otherwise.
    pub state_slot: i32,
    /// Present when this step ends the sequence's prompt (or is a decode step): sample one token.
    pub sample: Option<SampleSpec>,
}

impl ScheduledSeq {
    pub fn context_len(&self) -> u32 {
        self.prefix_len + self.new_tokens.len() as u32
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
}

/// What the worker measured during a step (for status lines, `/v1/stats` and benchmarks).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepStats {
    pub forward_ms: f64,
    pub expert_hits: u64,
    pub expert_misses: u64,
    /// Peak transient device bytes the step allocated above what was allocated before it (CUDA; 0 where not
    /// measured). The engine reports the largest beside the memory plan's workspace in `/v1/stats`.
    pub workspace_bytes: u64,
}

/// The worker's answer: one token (and its logprob) per sequence with a `sample`, in plan order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub stats: StepStats,
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
pub trait Worker: Send {
    fn execute(&mut self, plan: &StepPlan) -> Result<StepOutput, WorkerError>;
}
