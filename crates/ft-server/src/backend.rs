//! The one seam between HTTP and the engine (TGI's `Backend` shape): routes only ever see this trait, so
//! they are tested against scripted backends and served by the engine thread in production.

use ft_core::request::{AdmissionError, RequestEvent, SamplingParams};
use std::path::PathBuf;
use tokio::sync::mpsc;

/// What the worker reported about the loaded model; everything the HTTP side needs to know about it.
#[derive(Clone, Debug, Default)]
pub struct ModelInfo {
    /// The id `/v1/models` lists (`--served-model-name`, else the model path's basename).
    pub served_model_name: String,
    /// Architecture name, for logs (`llama`, `qwen3_5_moe`, ...).
    pub architecture: String,
    /// Longest sequence (prompt + output) the engine accepts.
    pub max_context: usize,
    pub vocab_size: usize,
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
    /// KV capacity in tokens, for logs and `/v1/stats`.
    pub kv_capacity_tokens: usize,
    /// The memory plan's transient workspace for the largest prefill chunk, measured at start-up (CUDA only).
    pub planned_workspace_bytes: Option<u64>,
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

pub trait Backend: Send + Sync + 'static {
    fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError>;
    /// Ends a request early (stop string matched, client gone). Idempotent.
    fn abort(&self, id: u64);
    fn health(&self) -> HealthState;
    /// Counters for `/v1/stats` (running, queued, token usage, throughput ...).
    fn stats(&self) -> serde_json::Value;
}
