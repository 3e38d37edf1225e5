//! `POST /v1/completions`: a raw prompt (text or token ids), no template; whole or streamed. The output is raw
//! text (no reasoning or tool-call parsing).

use super::output::{Output, OutputSpec};
use super::sse::{collect, done_event, json_event, sse, Ending, StreamFormat};
use super::{off_the_async_workers, response_id, submit, unix_now, OpenAiJson};
use crate::http::openai_error::ApiError;
use crate::http::protocol::{CompletionChoice, CompletionRequest, CompletionResponse, PromptInput, Usage};
use crate::http::state::AppState;
use crate::validation::{self, Prepared};
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
    let (prepared, echo) = off_the_async_workers(&state, move || prepare_completion(&st, &req)).await?;
    let mut ts = submit(&state, &prepared, "completion")?;
    let format = CompletionFormat {
        id: response_id("cmpl"),
        model: state.served_model_name(),
        created: unix_now(),
        include_usage,
        echo,
    };
    if streaming {
        return Ok(sse(ts, &OutputSpec::raw(), format).into_response());
    }
    let (message, ending) = collect(&mut ts, &OutputSpec::raw()).await?;
    let text = format.echo.clone() + &message.content;
    Ok(Json(format.response(text, Some(ending.reason), Some(ending.usage))).into_response())
}

/// Completion chunks: the echoed prompt first (when asked), text chunks, the last one with the finish reason,
/// the usage chunk (empty `choices`) when asked for, `[DONE]`.
struct CompletionFormat {
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    echo: String,
}

impl CompletionFormat {
    fn response(&self, text: String, finish_reason: Option<&'static str>, usage: Option<Usage>) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices: vec![CompletionChoice { index: 0, text, logprobs: None, finish_reason }],
            usage,
        }
    }
}

impl StreamFormat for CompletionFormat {
    fn start(&mut self) -> Vec<Event> {
        if self.echo.is_empty() {
            return vec![];
        }
        let echo = std::mem::take(&mut self.echo);
        vec![json_event(&self.response(echo, None, None))]
    }

    /// Raw text only ([`OutputSpec::raw`] parses nothing out of it).
    fn output(&mut self, output: Output) -> Vec<Event> {
        match output {
            Output::Text(text) | Output::Reasoning(text) => vec![json_event(&self.response(text, None, None))],
            Output::CallStart { .. } | Output::CallArguments { .. } | Output::CallEnd { .. } => vec![],
        }
    }

    fn finish(&mut self, ending: Ending) -> Vec<Event> {
        let mut events = vec![json_event(&self.response(String::new(), Some(ending.reason), None))];
        if self.include_usage {
            let mut last = self.response(String::new(), None, Some(ending.usage));
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

/// Validation and tokenizer (CPU-bound for long prompts); also the echoed prompt text.
fn prepare_completion(state: &AppState, req: &CompletionRequest) -> Result<(Prepared, String), ApiError> {
    validation::model(state, req.model.as_deref())?;
    req.check_unsupported()?;
    let sampling = validation::sampling(&req.sampling, &state.default_sampling)?;
    let (prompt, prompt_text) = match req.prompt_input()? {
        PromptInput::Text(text) => {
            let bos = if state.info.add_bos_token { state.info.bos_token_id } else { None };
            let ids = state
                .tokenizer
                .encode_with_bos(&text, bos)
                .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?;
            (ids, text)
        }
        PromptInput::Tokens(ids) => (ids, String::new()),
    };
    let prepared = validation::request(&state.limits, prompt, sampling, "prompt")?;
    let echo = if req.echo.unwrap_or(false) {
        if prompt_text.is_empty() {
            state
                .tokenizer
                .decode(&prepared.req.prompt, false)
                .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?
        } else {
            prompt_text
        }
    } else {
        String::new()
    };
    Ok((prepared, echo))
}
