//! What every generation route shares: the JSON extractor that answers bad bodies in OpenAI's shape, the
//! serving check, preparation on the blocking pool, [`submit`], and [`TextStream`], which turns a request's
//! token events into text (incremental detokenizer + stop strings) for both the streaming and the
//! non-streaming paths.
//!
//! Cancellation: every handler owns its [`RequestStream`] (inside `TextStream`) for as long as it waits on
//! it, in the handler future or in the SSE body. A client that disconnects makes hyper drop that future or
//! body, which drops the stream, whose guard aborts the request in the engine.

use crate::backend::{HealthState, RequestStream};
use crate::http::drain::LiveGuard;
use crate::http::logprobs::{LogprobsCollector, LogprobsUpdate, PositionLogprob};
use crate::http::openai_error::ApiError;
use crate::http::protocol::{PromptTokensDetails, Usage};
use crate::http::state::AppState;
use crate::metrics::{RequestOutcome, RequestTimer};
use crate::text::detokenizer::IncrementalDetokenizer;
use crate::text::stop_strings::{StopOutcome, StopStringMatcher};
use crate::validation::Prepared;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use ft_core::request::{FinishReason, RequestEvent, TopLogprob};
use serde::de::DeserializeOwned;

/// `Json<T>` that rejects in OpenAI's shape: 400 for unreadable or mistyped JSON, 413 past the body limit.
pub struct OpenAiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for OpenAiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rej| {
            if rej.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::payload_too_large(state.args.max_request_body_bytes)
            } else {
                ApiError::invalid(format!("cannot read the request body: {}", rej.body_text()))
            }
        })?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(ApiError::invalid("the request body is empty; expected a JSON object"));
        }
        serde_json::from_slice(&bytes).map(OpenAiJson).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
    }
}

/// 503 unless the engine is serving and the server is not draining for shutdown.
pub(crate) fn ensure_serving(state: &AppState) -> Result<(), ApiError> {
    if state.drain.is_draining() {
        return Err(ApiError::unavailable(HealthState::ShuttingDown.refusal().unwrap_or_default()));
    }
    match state.backend.health().refusal() {
        None => Ok(()),
        Some(why) => Err(ApiError::unavailable(why)),
    }
}

/// Runs request preparation (template rendering, tokenization: seconds of CPU for a prompt of megabytes) on
/// the blocking pool, so the async workers stay free for `/health`, streaming and everyone else; at most
/// [`AppState::prepare_slots`] at once, which also bounds the memory that huge prompts can take together.
pub(crate) async fn off_the_async_workers<T: Send + 'static>(
    state: &AppState,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let permit = state
        .prepare_slots
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work()
    })
    .await
    .map_err(|e| ApiError::internal(format!("request preparation failed: {e}")))?
}

/// Submits a prepared request (503 first if the engine is not serving) and returns its text stream.
pub(crate) fn submit(state: &AppState, prepared: &Prepared, what: &str) -> Result<TextStream, ApiError> {
    ensure_serving(state)?;
    let stream = state.backend.submit(prepared.req.clone())?;
    tracing::debug!(id = stream.id, prompt_tokens = prepared.req.prompt.len(), "{what} submitted");
    Ok(TextStream::new(state.clone(), stream, prepared))
}

/// What a [`TextStream`] yields.
#[derive(Debug)]
pub(crate) enum Piece {
    /// More output text (never empty).
    Text(String),
    /// The request is over: the last text (may be empty), the OpenAI finish reason and, when a stop string
    /// ended it, which one.
    Finish { text: String, reason: &'static str, stop_string: Option<String> },
    /// The request failed (engine error, --request-timeout, shutdown); the error is for the client.
    Error(ApiError),
}

/// What ended [`TextStream::wait`].
enum Wakeup {
    /// The engine's next event (`None`: the engine dropped the stream).
    Event(Option<RequestEvent>),
    /// `--request-timeout` passed.
    TimedOut,
    /// A shutdown cancelled the request at the end of its grace period.
    Cancelled,
}

/// One request's events as text. Owns the [`RequestStream`]: dropping this aborts an unfinished request.
/// Also where a request gives up waiting: at `--request-timeout`, or when a shutdown cancels it.
pub(crate) struct TextStream {
    state: AppState,
    stream: RequestStream,
    /// `--request-timeout` after submission.
    deadline: Option<tokio::time::Instant>,
    /// Counts the request as live for a graceful shutdown.
    _live: LiveGuard,
    detok: IncrementalDetokenizer,
    stops: StopStringMatcher,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    /// `/metrics`: this request's timings and how it ended (timed from arrival, see `request_metrics`).
    timer: RequestTimer,
    prompt_tokens: u32,
    cached_tokens: u32,
    completion_tokens: u32,
    done: bool,
    /// The logprobs the request asked for, as they arrive (`None`: not asked).
    logprobs: Option<LogprobsCollector>,
    /// `echo` with `max_tokens: 0`: the one token the engine samples is hidden (no text, no usage).
    prompt_only: bool,
    /// Characters of text the detokenizer has given out: the next token's `text_offset`.
    emitted_chars: usize,
    /// Told `true` at the first sampled token (`http::choices`: the other choices of this prompt wait for it).
    first_token: Option<tokio::sync::watch::Sender<bool>>,
}

impl TextStream {
    pub fn new(state: AppState, stream: RequestStream, prepared: &Prepared) -> Self {
        let timeout = state.args.request_timeout;
        let deadline =
            (timeout > 0.0).then(|| tokio::time::Instant::now() + std::time::Duration::from_secs_f64(timeout));
        TextStream {
            deadline,
            _live: state.drain.track(),
            detok: IncrementalDetokenizer::new(&prepared.req.prompt, true),
            stops: StopStringMatcher::new(prepared.stop.clone()),
            stop_token_ids: prepared.req.stop_token_ids.clone(),
            ignore_eos: prepared.req.ignore_eos,
            timer: crate::http::request_metrics::timer_for_stream(&state.metrics),
            prompt_tokens: prepared.req.prompt.len() as u32,
            cached_tokens: 0,
            completion_tokens: 0,
            done: false,
            logprobs: prepared.logprobs.map(|ask| LogprobsCollector::new(ask, &prepared.req.prompt)),
            prompt_only: prepared.prompt_only,
            emitted_chars: 0,
            first_token: None,
            state,
            stream,
        }
    }

    /// Says `true` on `tx` when the request samples its first token: its prompt's KV is computed by then (and
    /// in the radix cache), so the prompt's other choices, submitted then, reuse it. Dropped unsent if the
    /// request ends without one.
    pub fn notify_first_token(&mut self, tx: tokio::sync::watch::Sender<bool>) {
        self.first_token = Some(tx);
    }

    /// Whether the request asked for logprobs.
    pub fn wants_logprobs(&self) -> bool {
        self.logprobs.is_some()
    }

    /// The logprobs collected since the last call (see [`LogprobsCollector::take`]).
    pub fn take_logprobs(&mut self) -> LogprobsUpdate {
        self.logprobs.as_mut().map(LogprobsCollector::take).unwrap_or_default()
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.output_tokens(),
            total_tokens: self.prompt_tokens + self.output_tokens(),
            prompt_tokens_details: self
                .state
                .args
                .enable_cache_report
                .then_some(PromptTokensDetails { cached_tokens: self.cached_tokens }),
        }
    }

    /// Output tokens the client sees (none when `prompt_only`).
    fn output_tokens(&self) -> u32 {
        if self.prompt_only {
            0
        } else {
            self.completion_tokens
        }
    }

    /// The next piece of output; `None` after `Finish` or `Error`.
    pub async fn next(&mut self) -> Option<Piece> {
        if self.done {
            return None;
        }
        loop {
            let event = match self.wait().await {
                Wakeup::Event(Some(event)) => event,
                Wakeup::Event(None) => return Some(self.engine_gone()),
                Wakeup::TimedOut => return Some(self.timed_out()),
                Wakeup::Cancelled => return Some(self.cancelled()),
            };
            let piece = match event {
                RequestEvent::Started { prompt_tokens, cached_tokens, .. } => {
                    self.prompt_tokens = prompt_tokens;
                    self.cached_tokens = cached_tokens;
                    self.timer.started(prompt_tokens, cached_tokens);
                    None
                }
                RequestEvent::Token { token, logprob, top_logprobs, .. } => self.on_token(token, logprob, top_logprobs),
                RequestEvent::PromptLogprobs { start, logprobs, top_logprobs, .. } => {
                    if let Some(c) = self.logprobs.as_mut() {
                        c.prompt_chunk(start, logprobs, top_logprobs);
                    }
                    None
                }
                RequestEvent::Finished { reason, completion_tokens, .. } => {
                    Some(self.on_finished(reason, completion_tokens))
                }
                RequestEvent::Failed { message, .. } => Some(self.on_failed(message)),
            };
            if piece.is_some() {
                return piece;
            }
        }
    }

    /// Waits for the engine's next event, `--request-timeout` or a shutdown's cancellation, whichever is first.
    async fn wait(&mut self) -> Wakeup {
        let deadline = self.deadline;
        let timed_out = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        let cancelled = self.state.drain.cancelled();
        // `biased`: an event that is already there wins over a deadline that passed at the same time.
        tokio::select! {
            biased;
            ev = self.stream.next() => Wakeup::Event(ev),
            _ = timed_out => Wakeup::TimedOut,
            _ = cancelled => Wakeup::Cancelled,
        }
    }

    /// `--request-timeout` passed: the request is aborted with a 408.
    fn timed_out(&mut self) -> Piece {
        let secs = self.state.args.request_timeout;
        tracing::warn!(id = self.stream.id, "request timed out after {secs} s (--request-timeout); aborting it");
        self.timer.finish_at(RequestOutcome::Timeout, std::time::Instant::now());
        self.fail(ApiError::request_timeout(format!(
            "the request did not finish within {secs} s (--request-timeout) and was aborted"
        )))
    }

    /// A shutdown's grace period ended: the request is cancelled with a 503.
    fn cancelled(&mut self) -> Piece {
        self.timer.finish_at(RequestOutcome::Abort, std::time::Instant::now());
        self.fail(ApiError::unavailable(
            "the server is shutting down; the request was cancelled at the end of the --shutdown-grace period",
        ))
    }

    /// The engine dropped the stream without finishing the request.
    fn engine_gone(&mut self) -> Piece {
        self.done = true;
        self.timer.finish_at(RequestOutcome::Error, std::time::Instant::now());
        Piece::Error(ApiError::internal("the engine stopped before the request finished"))
    }

    /// One generated token: its text, if any is ready (`None`: nothing to yield yet).
    fn on_token(&mut self, token: u32, logprob: f32, top: Vec<TopLogprob>) -> Option<Piece> {
        if let Some(tx) = self.first_token.take() {
            let _ = tx.send(true);
        }
        self.completion_tokens += 1;
        self.timer.token();
        if let Some(c) = self.logprobs.as_mut() {
            c.sampled();
        }
        // A stop token ends the turn; it is not part of the text. Nor is the token of a `prompt_only` request.
        if (!self.ignore_eos && self.stop_token_ids.contains(&token)) || self.prompt_only {
            return None;
        }
        if let Some(c) = self.logprobs.as_mut() {
            c.token(PositionLogprob { token, logprob: Some(logprob), top, text_offset: self.emitted_chars });
        }
        let text = match self.detok.push(&self.state.tokenizer, token) {
            Ok(t) => t,
            Err(e) => return Some(self.fail(ApiError::internal(e.to_string()))),
        };
        self.emitted_chars += text.chars().count();
        if text.is_empty() {
            return None;
        }
        match self.stops.push(&text) {
            StopOutcome::Continue(t) if t.is_empty() => None,
            StopOutcome::Continue(t) => Some(Piece::Text(t)),
            StopOutcome::Stopped(t) => {
                // The backend finishes the request (FinishReason::Abort); we stop listening.
                self.state.backend.abort(self.stream.id);
                self.stream.guard.disarm();
                self.done = true;
                Some(self.stopped(t))
            }
        }
    }

    /// The engine finished the request: the detokenizer's and the stop matcher's tails go out with it.
    fn on_finished(&mut self, reason: FinishReason, completion_tokens: u32) -> Piece {
        self.done = true;
        self.completion_tokens = self.completion_tokens.max(completion_tokens);
        if let Some(c) = self.logprobs.as_mut() {
            c.sampled();
        }
        // `prompt_only` asked for no output: its budget is used up, whatever the hidden token was.
        let reason = if self.prompt_only { FinishReason::Length } else { reason };
        let tail = match self.detok.finish(&self.state.tokenizer) {
            Ok(t) => t,
            Err(e) => return self.fail(ApiError::internal(e.to_string())),
        };
        match self.stops.push(&tail) {
            StopOutcome::Stopped(t) => self.stopped(t),
            StopOutcome::Continue(mut t) => {
                t.push_str(&self.stops.finish());
                self.timer.finish_at(RequestOutcome::from_finish(reason), std::time::Instant::now());
                Piece::Finish { text: t, reason: reason.as_openai(), stop_string: None }
            }
        }
    }

    /// A stop string ended the request; `text` is the output before it.
    fn stopped(&mut self, text: String) -> Piece {
        self.timer.finish_at(RequestOutcome::Stop, std::time::Instant::now());
        Piece::Finish { text, reason: "stop", stop_string: self.stops.matched().map(String::from) }
    }

    /// The request failed in the engine.
    fn on_failed(&mut self, message: String) -> Piece {
        self.done = true;
        self.timer.finish_at(RequestOutcome::Error, std::time::Instant::now());
        // A dead or stalled engine is the server's state, not the request's fault: 503 tells the client (and a
        // load balancer) to retry elsewhere. A step that failed alone stays 500.
        let error = match self.state.backend.health() {
            HealthState::Unhealthy(_) => ApiError::unavailable(message),
            _ => ApiError::internal(message),
        };
        Piece::Error(error)
    }

    /// Ends the request with `error` (counted as an error unless the caller already counted it otherwise).
    fn fail(&mut self, error: ApiError) -> Piece {
        self.timer.finish_at(RequestOutcome::Error, std::time::Instant::now());
        self.state.backend.abort(self.stream.id);
        self.stream.guard.disarm();
        self.done = true;
        Piece::Error(error)
    }
}

/// A fresh response id with the given prefix (`chatcmpl`, `cmpl`).
pub(crate) fn response_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
