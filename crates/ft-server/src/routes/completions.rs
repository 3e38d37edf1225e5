//! `POST /v1/completions`: a raw prompt (text or token ids), no template; whole or streamed.

use super::chat::json_event;
use super::{off_the_async_workers, prepare, submit, response_id, unix_now, OpenAiJson, Piece, Prepared};
use crate::openai_error::ApiError;
use crate::protocol::{CompletionChoice, CompletionRequest, CompletionResponse, PromptInput};
use crate::server::AppState;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::collections::VecDeque;

pub async fn completions(
    State(state): State<AppState>,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let streaming = req.stream.unwrap_or(false);
    let include_usage = req.include_usage();
    let st = state.clone();
    let (prepared, echo) = off_the_async_workers(&state, move || prepare_completion(&st, &req)).await?;
    let mut ts = submit(&state, &prepared, "completion")?;
    let id = response_id("cmpl");
    let model = state.served_model_name();
    let created = unix_now();
    let response = move |text: String, finish_reason: Option<&'static str>, usage| CompletionResponse {
        id: id.clone(),
        object: "text_completion",
        created,
        model: model.clone(),
        choices: vec![CompletionChoice { index: 0, text, logprobs: None, finish_reason }],
        usage,
    };

    if !streaming {
        let mut text = echo;
        let reason = loop {
            match ts.next().await {
                Some(Piece::Text(t)) => text.push_str(&t),
                Some(Piece::Finish { text: t, reason, .. }) => {
                    text.push_str(&t);
                    break reason;
                }
                Some(Piece::Error(e)) => return Err(e),
                None => return Err(ApiError::internal("the request ended without a result")),
            }
        };
        return Ok(Json(response(text, Some(reason), Some(ts.usage()))).into_response());
    }

    let mut queue = VecDeque::new();
    if !echo.is_empty() {
        queue.push_back(json_event(&response(echo, None, None)));
    }
    let body = futures::stream::unfold((Some(ts), queue, response), move |(mut ts, mut queue, response)| async move {
        loop {
            if let Some(ev) = queue.pop_front() {
                return Some((Ok::<Event, std::convert::Infallible>(ev), (ts, queue, response)));
            }
            let t = ts.as_mut()?;
            match t.next().await {
                Some(Piece::Text(text)) => queue.push_back(json_event(&response(text, None, None))),
                Some(Piece::Finish { text, reason, .. }) => {
                    queue.push_back(json_event(&response(text, Some(reason), None)));
                    if include_usage {
                        let mut last = response(String::new(), None, Some(t.usage()));
                        last.choices.clear();
                        queue.push_back(json_event(&last));
                    }
                    queue.push_back(Event::default().data("[DONE]"));
                    ts = None;
                }
                Some(Piece::Error(e)) => {
                    queue.push_back(json_event(&e.body()));
                    queue.push_back(Event::default().data("[DONE]"));
                    ts = None;
                }
                None => ts = None,
            }
        }
    });
    Ok(Sse::new(body).keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15))).into_response())
}

/// Validation and tokenizer (CPU-bound for long prompts); also the echoed prompt text.
fn prepare_completion(state: &AppState, req: &CompletionRequest) -> Result<(Prepared, String), ApiError> {
    req.check_unsupported()?;
    let sampling = req.sampling.validate(&state.default_sampling)?;
    let (prompt, prompt_text) = match req.prompt_input()? {
        PromptInput::Text(text) => {
            let bos = if state.info.add_bos_token { state.info.bos_token_id } else { None };
            let ids = state.tokenizer.encode_with_bos(&text, bos).map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?;
            (ids, text)
        }
        PromptInput::Tokens(ids) => (ids, String::new()),
    };
    let prepared = prepare(state, prompt, sampling)?;
    let echo = if req.echo.unwrap_or(false) {
        if prompt_text.is_empty() {
            state.tokenizer.decode(&prepared.req.prompt, false).map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?
        } else {
            prompt_text
        }
    } else {
        String::new()
    };
    Ok((prepared, echo))
}
