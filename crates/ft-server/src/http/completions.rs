//! `POST /v1/completions`: a raw prompt (text or token ids), no template; whole or streamed. The output is raw
//! text (no reasoning or tool-call parsing).
//!
//! `logprobs: N` answers in the legacy shape (`http/logprobs.rs`); with `echo` the prompt's tokens come first
//! (what loglikelihood evaluations read: `echo: true, logprobs: N, max_tokens: 0`, the prompt alone). Streamed,
//! the echoed prompt is the first chunk; when it carries logprobs it waits for them (they come with the first
//! sampled token).
//!
//! A list of prompts is a batch: `n` choices each (`http::choices`), choice `i` of prompt `p` at index
//! `p * n + i`, each echoing its own prompt.

use super::choices::{collect_choices, submit_choices, total_usage, Collected, ResponseHead};
use super::logprobs::{completion_logprobs, text_offsets, LogprobsUpdate, PositionLogprob};
use super::output::{Output, OutputSpec};
use super::sse::{done_event, events_before_trailing_text, json_event, sse_choices, Ending, StreamFormat};
use super::{off_the_async_workers, response_id, unix_now, OpenAiJson};
use crate::http::openai_error::ApiError;
use crate::http::protocol::{CompletionChoice, CompletionRequest, CompletionResponse, PromptInput, Usage};
use crate::http::state::AppState;
use crate::validation::{self, CompletionAsk, Prepared};
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub async fn completions(
    State(state): State<AppState>,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let streaming = req.stream.unwrap_or(false);
    let include_usage = req.include_usage();
    let st = state.clone();
    let (prompts, echoes): (Vec<Prepared>, Vec<Echo>) =
        off_the_async_workers(&state, move || prepare_completion(&st, &req)).await?.into_iter().unzip();
    let choices = submit_choices(&state, &prompts, "completion")?;
    let head = ResponseHead { id: response_id("cmpl"), model: state.served_model_name(), created: unix_now() };
    let format = |index: usize, prompt: usize| CompletionFormat {
        index: index as u32,
        head: head.clone(),
        include_usage,
        logprobs: prompts[prompt].logprobs.map(|_| Vec::new()),
        echo_chars: echoes[prompt].text.chars().count(),
        echo: Some(echoes[prompt].clone()),
        state: state.clone(),
    };
    if streaming {
        let formats = choices.iter().map(|c| format(c.index, c.prompt)).collect();
        return Ok(sse_choices(choices, &OutputSpec::raw(), formats).into_response());
    }
    let collected = collect_choices(choices, &OutputSpec::raw()).await?;
    let usage = total_usage(&collected.iter().map(|c| (c.prompt, c.ending.usage.clone())).collect::<Vec<_>>());
    let choices = collected.into_iter().map(|c| format(c.index, c.prompt).whole(c)).collect();
    let body = CompletionResponse {
        id: head.id,
        object: "text_completion",
        created: head.created,
        model: head.model,
        choices,
        usage: Some(usage),
    };
    Ok(Json(body).into_response())
}

/// The echoed prompt: its text and, when its logprobs are asked, its entries (offsets in that text).
#[derive(Clone)]
struct Echo {
    text: String,
    ids: Vec<u32>,
    /// How `text` decodes special tokens (a text prompt is the client's text; token ids decode them).
    skip_special_tokens: bool,
    /// The prompt's logprobs once they are all in (`None`: not yet, or not asked).
    logprobs: Option<Vec<PositionLogprob>>,
}

/// One choice's completion chunks: the echoed prompt first (when asked), text chunks, the last one with the
/// finish reason; after every choice's, the usage chunk (empty `choices`) when asked for, `[DONE]`. Also
/// the choice of a whole response ([`CompletionFormat::whole`]).
struct CompletionFormat {
    index: u32,
    head: ResponseHead,
    include_usage: bool,
    state: AppState,
    /// Output logprobs not sent yet (`None`: not asked).
    logprobs: Option<Vec<PositionLogprob>>,
    /// Not sent yet (`None`: sent).
    echo: Option<Echo>,
    /// Characters of the echoed prompt: where the output's text offsets start.
    echo_chars: usize,
}

impl CompletionFormat {
    fn response(&self, text: String, finish_reason: Option<&'static str>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            id: self.head.id.clone(),
            object: "text_completion",
            created: self.head.created,
            model: self.head.model.clone(),
            choices: vec![CompletionChoice { index: self.index, text, logprobs: None, finish_reason }],
            usage,
        }
    }

    /// The finished choice `c` of a whole response: echo, text and all their logprobs.
    fn whole(mut self, mut c: Collected) -> CompletionChoice {
        self.logprobs(c.ts.take_logprobs());
        let (echo, mut logprobs) = self.take_echo();
        logprobs.extend(self.pending());
        let logprobs = self.logprobs.is_some().then(|| completion_logprobs(&self.state.tokenizer, &logprobs));
        CompletionChoice {
            index: self.index,
            text: echo + &c.message.content,
            logprobs,
            finish_reason: Some(c.ending.reason),
        }
    }

    /// The output logprobs not sent yet.
    fn pending(&mut self) -> Vec<PositionLogprob> {
        self.logprobs.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// A chunk of `text` with the logprobs not sent yet (`finish_reason` on the last).
    fn chunk(&mut self, text: String, finish_reason: Option<&'static str>) -> Event {
        let mut chunk = self.response(text, finish_reason, None);
        if self.logprobs.is_some() {
            let pending = self.pending();
            chunk.choices[0].logprobs = Some(completion_logprobs(&self.state.tokenizer, &pending));
        }
        json_event(&chunk)
    }

    /// The echoed text and the prompt's logprobs (empty unless asked); the echo counts as sent.
    fn take_echo(&mut self) -> (String, Vec<PositionLogprob>) {
        self.echo.take().map(|e| (e.text, e.logprobs.unwrap_or_default())).unwrap_or_default()
    }

    /// The echo chunk, unless sent already, empty, or still waiting for the prompt's logprobs (`ready`: they
    /// will not come, the request ended).
    fn echo_event(&mut self, ready: bool) -> Vec<Event> {
        let waiting = self.echo.as_ref().is_some_and(|e| e.logprobs.is_none() && self.logprobs.is_some());
        if self.echo.as_ref().is_none_or(|e| e.text.is_empty()) || (waiting && !ready) {
            return vec![];
        }
        let (text, logprobs) = self.take_echo();
        let mut chunk = self.response(text, None, None);
        if self.logprobs.is_some() {
            chunk.choices[0].logprobs = Some(completion_logprobs(&self.state.tokenizer, &logprobs));
        }
        vec![json_event(&chunk)]
    }
}

impl StreamFormat for CompletionFormat {
    fn start(&mut self) -> Vec<Event> {
        self.echo_event(false)
    }

    /// Raw text only ([`OutputSpec::raw`] parses nothing out of it).
    fn output(&mut self, output: Output) -> Vec<Event> {
        let mut events = self.echo_event(false);
        match output {
            Output::Text(text) | Output::Reasoning(text) => events.push(self.chunk(text, None)),
            Output::CallStart { .. } | Output::CallArguments { .. } | Output::CallEnd { .. } => {}
        }
        events
    }

    /// Output entries move past the echoed prompt; the prompt's entries get their offsets in its text.
    fn logprobs(&mut self, update: LogprobsUpdate) {
        let shift = self.echo_chars;
        if let Some(p) = self.logprobs.as_mut() {
            p.extend(update.tokens.into_iter().map(|e| PositionLogprob { text_offset: e.text_offset + shift, ..e }));
        }
        if let (Some(echo), Some(mut prompt)) = (self.echo.as_mut(), update.prompt) {
            let offsets = text_offsets(&self.state.tokenizer, &echo.ids, echo.skip_special_tokens);
            prompt.iter_mut().zip(offsets).for_each(|(e, at)| e.text_offset = at);
            echo.logprobs = Some(prompt);
        }
    }

    fn finish(&mut self, ending: Ending) -> Vec<Event> {
        self.finish_with(vec![], ending)
    }

    /// Text that came with the end (with its logprobs) rides in the finish chunk.
    fn finish_with(&mut self, outputs: Vec<Output>, ending: Ending) -> Vec<Event> {
        let (mut events, last) = events_before_trailing_text(self, outputs);
        events.extend(self.echo_event(true));
        events.push(self.chunk(last.unwrap_or_default(), Some(ending.reason)));
        events
    }

    fn end(&mut self, usage: Usage) -> Vec<Event> {
        let mut events = vec![];
        if self.include_usage {
            let mut last = self.response(String::new(), None, Some(usage));
            last.choices.clear();
            events.push(json_event(&last));
        }
        events.push(done_event());
        events
    }

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        vec![json_event(&error.body()), done_event()]
    }
}

/// Validation and tokenizer (CPU-bound for long prompts), per prompt of the batch; also each echoed prompt
/// (empty text unless `echo`).
fn prepare_completion(state: &AppState, req: &CompletionRequest) -> Result<Vec<(Prepared, Echo)>, ApiError> {
    validation::model(state, req.model.as_deref())?;
    req.check_unsupported()?;
    let echo = req.echo.unwrap_or(false);
    let inputs = req.prompt_inputs()?;
    let ask = CompletionAsk { logprobs: req.logprobs, echo, prompts: inputs.len(), best_of: req.best_of };
    let sampling = validation::completion_sampling(&req.sampling, ask, &state.default_sampling)?;
    inputs.into_iter().map(|input| prepare_prompt(state, input, sampling.clone(), echo)).collect()
}

/// One prompt of the batch, tokenized and validated, and its echo.
fn prepare_prompt(
    state: &AppState,
    input: PromptInput,
    sampling: validation::ValidatedSampling,
    echo: bool,
) -> Result<(Prepared, Echo), ApiError> {
    let (prompt, prompt_text) = match input {
        PromptInput::Text(text) => {
            let bos = if state.info.add_bos_token { state.info.bos_token_id } else { None };
            let ids = state
                .tokenizer
                .encode_with_bos(&text, bos)
                .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?;
            (ids, Some(text))
        }
        PromptInput::Tokens(ids) => (ids, None),
    };
    let prepared = validation::request(&state.limits, prompt, sampling, "prompt")?;
    let skip_special_tokens = prompt_text.is_some();
    let text = match (echo, prompt_text) {
        (false, _) => String::new(),
        (true, Some(text)) => text,
        (true, None) => state
            .tokenizer
            .decode(&prepared.req.prompt, false)
            .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?,
    };
    let ids = if echo { prepared.req.prompt.clone() } else { Vec::new() };
    Ok((prepared, Echo { text, ids, skip_special_tokens, logprobs: None }))
}
