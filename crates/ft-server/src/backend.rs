//! The one seam between HTTP and the engine (TGI's `Backend` shape): routes only ever see this trait, so
//! they are tested against scripted backends and served by the engine thread in production.

use ft_core::request::{AdmissionError, RequestEvent, SamplingParams};
use std::path::PathBuf;
use tokio::sync::mpsc;

/// What the worker reports about the loaded model and its pools, once at start-up (its `info()`, defined in
/// `python/freetoken/engine/description.py`, versioned with the step contract). Every fact the server needs
/// about the model comes from here; nothing re-derives one.
#[derive(Clone, Debug, Default)]
pub struct EngineDescription {
    /// The id `/v1/models` lists (`--served-model-name`'s first name, else the model path's basename).
    pub served_model_name: String,
    /// Other names requests may use (`--served-model-name`'s further names; `demo` for the demo model).
    pub model_aliases: Vec<String>,
    /// Architecture name, for logs (`LlamaForCausalLM`, `Qwen3_5MoeForConditionalGeneration`, ...).
    pub architecture: String,
    /// Longest sequence (prompt + output) the engine accepts.
    pub max_context: usize,
    /// Embedding rows: token ids at or past it are refused.
    pub vocab_size: usize,
    /// KV capacity in tokens (slots the scheduler owns).
    pub kv_capacity_tokens: usize,
    /// Recurrent-state slots the scheduler owns (0: not a hybrid model), of which `num_snapshot_slots` may hold
    /// prefix-cache snapshots (the rest are live slots, one per running request).
    pub num_state_slots: usize,
    pub num_snapshot_slots: usize,
    /// The tool-call opener's token id (`<tool_call>`), if the tokenizer has one.
    pub tool_call_token_id: Option<u32>,
    /// Prefix caches the model supports (`radix` or `hybrid_radix`, and `naive`).
    pub cache_types: Vec<String>,
    /// A `tokenizer.json` the HF `tokenizers` crate loads (the worker writes one for GGUF models).
    pub tokenizer_path: PathBuf,
    /// The model's own Jinja chat template, if it has one.
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Token ids that end generation (EOS and end-of-turn).
    pub eos_token_ids: Vec<u32>,
    /// Prepend BOS when encoding raw completion prompts.
    pub add_bos_token: bool,
    pub bos_token_id: Option<u32>,
    /// The memory plan's transient workspace for the largest prefill chunk, measured at start-up (CUDA only).
    pub planned_workspace_bytes: Option<u64>,
    /// Decode batch sizes replayed from CUDA graphs (empty: every step eager).
    pub cuda_graph_sizes: Vec<usize>,
    pub dtype: String,
    pub device: String,
    /// Sampling values from the model's `generation_config.json` (used under `--sampling-defaults model`
    /// for fields a request leaves out).
    pub generation_defaults: Option<SamplingParams>,
}

/// A generation request after tokenization and validation.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: u32,
    pub sampling: SamplingParams,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

/// Why a request was refused before it was queued.
#[derive(Clone, Debug, PartialEq)]
pub enum SubmitError {
    /// Maps to HTTP 400 (`context_length_exceeded` and friends).
    Admission(AdmissionError),
    /// The queue is full: HTTP 429.
    Overloaded(String),
    /// The engine is not serving (loading, failed, shutting down): HTTP 503.
    Unavailable(String),
}

impl std::fmt::Display for SubmitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SubmitError::Admission(e) => write!(f, "{e}"),
            SubmitError::Overloaded(m) | SubmitError::Unavailable(m) => write!(f, "{m}"),
        }
    }
}

/// Aborts its request when dropped, so a client that goes away (stream or not) frees the request's slots.
pub struct AbortOnDrop {
    pub(crate) abort: Option<Box<dyn FnOnce() + Send>>,
}

impl AbortOnDrop {
    pub fn new(abort: impl FnOnce() + Send + 'static) -> Self {
        AbortOnDrop { abort: Some(Box::new(abort)) }
    }
    /// The request ended by itself: nothing to abort.
    pub fn disarm(&mut self) {
        self.abort = None;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(abort) = self.abort.take() {
            abort();
        }
    }
}

/// The events of one request, in order, ending with `Finished` or `Failed`. Dropping it aborts the request.
pub struct RequestStream {
    pub id: u64,
    pub events: mpsc::UnboundedReceiver<RequestEvent>,
    pub guard: AbortOnDrop,
}

impl RequestStream {
    /// The next event; `None` only if the engine vanished (callers turn that into an error, never a hang).
    pub async fn next(&mut self) -> Option<RequestEvent> {
        let ev = self.events.recv().await;
        if matches!(ev, Some(RequestEvent::Finished { .. }) | Some(RequestEvent::Failed { .. })) {
            self.guard.disarm();
        }
        ev
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HealthState {
    Loading,
    Serving,
    /// A step overran its deadline or the worker died: not serving, with the reason.
    Unhealthy(String),
    ShuttingDown,
}

impl HealthState {
    /// Why generation is refused in this state (`None` while serving): the one wording every refusal, 503 and
    /// `/health` answer uses.
    pub fn refusal(&self) -> Option<String> {
        match self {
            HealthState::Serving => None,
            HealthState::Loading => Some("the model is still loading".into()),
            HealthState::ShuttingDown => Some("the server is shutting down".into()),
            HealthState::Unhealthy(why) => Some(format!("the engine is unhealthy: {why}")),
        }
    }
}

pub trait Backend: Send + Sync + 'static {
    fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError>;
    /// Ends a request early (stop string matched, client gone). Idempotent.
    fn abort(&self, id: u64);
    fn health(&self) -> HealthState;
    /// Counters for `/v1/stats` (running, queued, token usage, throughput ...).
    fn stats(&self) -> crate::engine::stats::EngineStats;
}
