//! What a request is to the scheduler: its prompt, its budget and how it samples; and the events the
//! scheduler reports back about it.

/// Sampling settings a request keeps for its whole life (validated by the server before it gets here).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    /// Subtracted from the logit of every token the request generated before (OpenAI's presence penalty).
    pub presence_penalty: f32,
    /// Times how often the request generated each token before (OpenAI's frequency penalty).
    pub frequency_penalty: f32,
    /// `None`: the scheduler draws a random seed at admission.
    pub seed: Option<u64>,
    /// Most likely alternatives reported beside each sampled token (`0..=MAX_TOP_LOGPROBS`; 0: the sampled
    /// token's own logprob only, which every token carries).
    pub top_logprobs: u32,
    /// Report the log-probability of every prompt token after the first, with `top_logprobs` alternatives
    /// (`echo` with `logprobs`, what loglikelihood evaluations ask). Such a request computes its whole prompt:
    /// it never starts from a prefix-cache hit, whose positions would have no logits.
    pub prompt_logprobs: bool,
}

/// Most alternatives a request may ask for per position (OpenAI's limit for `top_logprobs` and `logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            top_logprobs: 0,
            prompt_logprobs: false,
        }
    }
}

/// A request as the server hands it to the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct NewRequest {
    pub id: u64,
    pub prompt: Vec<u32>,
    /// Output budget asked for; the scheduler clamps it to what the context leaves.
    pub max_new_tokens: u32,
    pub sampling: SamplingParams,
    /// Token ids that end the request (EOS, end of turn). Ignored when `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled (it is reported, then the request ends).
    Stop,
    /// The output budget (or the context) is used up.
    Length,
    /// The client went away or the server ended it (stop string, shutdown).
    Abort,
}

impl FinishReason {
    pub fn as_openai(&self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::Abort => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Why a request could not be admitted at all.
#[derive(Clone, Debug, PartialEq)]
pub enum AdmissionError {
    /// The prompt leaves no room for a single output token: OpenAI `context_length_exceeded`.
    ContextLengthExceeded { prompt_tokens: usize, max_context: usize },
    /// The prompt is empty.
    EmptyPrompt,
    /// The request alone needs more KV than the whole pool holds.
    TooLargeForCache { needed_tokens: usize, capacity_tokens: usize },
    /// A request with this id is already known.
    DuplicateId(u64),
}

impl std::fmt::Display for AdmissionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AdmissionError::ContextLengthExceeded { prompt_tokens, max_context } => write!(
                f,
                "prompt is too long: {prompt_tokens} tokens > {} maximum (context length {max_context} leaves no room for output)",
                max_context.saturating_sub(1)
            ),
            AdmissionError::EmptyPrompt => write!(f, "prompt is empty"),
            AdmissionError::TooLargeForCache { needed_tokens, capacity_tokens } => write!(
                f,
                "request needs {needed_tokens} KV tokens but the cache holds only {capacity_tokens}"
            ),
            AdmissionError::DuplicateId(id) => write!(f, "duplicate request id {id}"),
        }
    }
}

impl std::error::Error for AdmissionError {}

/// One alternative at a position: a token and its log-probability under the model's raw distribution
/// (`log_softmax` of the logits at temperature 1, before penalties and filtering: what OpenAI and vLLM report).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// What happened to a request during one commit (or abort / failure).
#[derive(Clone, Debug, PartialEq)]
pub enum RequestEvent {
    /// The prompt is admitted; `cached_tokens` of it came from the prefix cache.
    Started { id: u64, prompt_tokens: u32, cached_tokens: u32, max_new_tokens: u32 },
    /// One generated token, its raw log-probability and the `top_logprobs` most likely alternatives (most
    /// likely first; empty unless asked).
    Token { id: u64, token: u32, logprob: f32, top_logprobs: Vec<TopLogprob> },
    /// Log-probabilities of prompt tokens `start..start + logprobs.len()` (positions; `start >= 1`: the first
    /// prompt token has none), each with its `top_logprobs` alternatives. One event per prompt chunk, in order,
    /// all before the first `Token` (only for requests with `prompt_logprobs`).
    PromptLogprobs { id: u64, start: u32, logprobs: Vec<f32>, top_logprobs: Vec<Vec<TopLogprob>> },
    /// The request is over and its slots are released.
    Finished { id: u64, reason: FinishReason, completion_tokens: u32 },
    /// The request failed (its step failed); its slots are released.
    Failed { id: u64, message: String },
}

impl RequestEvent {
    pub fn request_id(&self) -> u64 {
        match self {
            RequestEvent::Started { id, .. }
            | RequestEvent::Token { id, .. }
            | RequestEvent::PromptLogprobs { id, .. }
            | RequestEvent::Finished { id, .. }
            | RequestEvent::Failed { id, .. } => *id,
        }
    }
}
