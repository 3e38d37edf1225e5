//! `POST /v1/messages` (Anthropic Messages) and `POST /v1/messages/count_tokens`, over the same template,
//! tokenizer, [`TextStream`] and engine as chat completions.
//!
//! Stream shape (Anthropic's): `message_start`, `content_block_start` (one text block), `ping`,
//! `content_block_delta` × n (`text_delta`), `content_block_stop`, `message_delta` (`stop_reason`, output
//! tokens), `message_stop`. A failure midway sends an `error` event and ends the stream.

use super::{off_the_async_workers, prepare, submit, OpenAiJson, Piece, Prepared, TextStream};
use crate::anthropic::{stop_reason, usage, AnthropicError, MessagesRequest};
use crate::openai_error::ApiError;
use crate::server::AppState;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;

pub async fn messages(
    State(state): State<AppState>,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Result<Response, AnthropicError> {
    let req = parse(body)?;
    let streaming = req.stream.unwrap_or(false);
    let st = state.clone();
    let prepared = off_the_async_workers(&state, move || prepare_messages(&st, &req)).await?;
    let ts = submit(&state, &prepared, "message")?;
    let id = format!("msg_{:024x}", rand::random::<u128>() >> 32);
    let model = state.served_model_name();
    if streaming {
        Ok(stream_response(ts, id, model).into_response())
    } else {
        whole_response(ts, id, model).await
    }
}

pub async fn count_tokens(
    State(state): State<AppState>,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Result<Response, AnthropicError> {
    let req = parse(body)?;
    // The same checks as /v1/messages, so a body counts here exactly when it would be served there
    // (`max_tokens` aside: counting does not need it).
    req.sampling_fields(false)?.validate(&state.default_sampling)?;
    let st = state.clone();
    let prompt = off_the_async_workers(&state, move || render(&st, &req)).await?;
    Ok(Json(json!({"input_tokens": prompt.len()})).into_response())
}

fn parse(body: Result<OpenAiJson<Value>, ApiError>) -> Result<MessagesRequest, AnthropicError> {
    let OpenAiJson(raw) = body?;
    if !raw.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object").into());
    }
    serde_json::from_value(raw).map_err(|e| ApiError::invalid(format!("invalid request: {e}")).into())
}

/// The prompt's token ids: template over `system`, `messages` and `tools`, then the tokenizer.
fn render(state: &AppState, req: &MessagesRequest) -> Result<Vec<u32>, ApiError> {
    let messages = req.template_messages()?;
    let tools = req.openai_tools()?;
    let kwargs = req.template_kwargs()?;
    let text = state
        .chat_template
        .render(&messages, tools.as_deref(), true, Some(&kwargs))
        .map_err(|e| ApiError::invalid_param("messages", e.0))?;
    state.tokenizer.encode(&text, false).map_err(|e| ApiError::invalid_param("messages", e.to_string()))
}

fn prepare_messages(state: &AppState, req: &MessagesRequest) -> Result<Prepared, ApiError> {
    let sampling = req.sampling_fields(true)?.validate(&state.default_sampling)?;
    let prompt = render(state, req)?;
    prepare(state, prompt, sampling)
}

async fn whole_response(mut ts: TextStream, id: String, model: String) -> Result<Response, AnthropicError> {
    let mut text = String::new();
    let (reason, stop_string) = loop {
        match ts.next().await {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::Finish { text: t, reason, stop_string }) => {
                text.push_str(&t);
                break (reason, stop_string);
            }
            Some(Piece::Error(e)) => return Err(e.into()),
            None => return Err(ApiError::internal("the request ended without a result").into()),
        }
    };
    let (stop_reason, stop_sequence) = stop_reason(reason, stop_string);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(&ts.usage()),
    }))
    .into_response())
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// The SSE body. Its state owns the `TextStream`, so hyper dropping the body (client gone) aborts the request.
fn stream_response(ts: TextStream, id: String, model: String) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let mut start_usage = usage(&ts.usage());
    start_usage["output_tokens"] = json!(0);
    let mut queue = VecDeque::new();
    queue.push_back(event("message_start", json!({"type": "message_start", "message": {
        "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": null, "stop_sequence": null, "usage": start_usage}})));
    queue.push_back(event("content_block_start", json!({"type": "content_block_start", "index": 0,
        "content_block": {"type": "text", "text": ""}})));
    queue.push_back(event("ping", json!({"type": "ping"})));
    let delta = |text: String| event("content_block_delta", json!({"type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": text}}));
    let body = futures::stream::unfold((Some(ts), queue), move |(mut ts, mut queue)| async move {
        loop {
            if let Some(ev) = queue.pop_front() {
                return Some((Ok(ev), (ts, queue)));
            }
            let stream = ts.as_mut()?;
            match stream.next().await {
                Some(Piece::Text(t)) => queue.push_back(delta(t)),
                Some(Piece::Finish { text, reason, stop_string }) => {
                    if !text.is_empty() {
                        queue.push_back(delta(text));
                    }
                    let (stop_reason, stop_sequence) = stop_reason(reason, stop_string);
                    let u = usage(&stream.usage());
                    queue.push_back(event("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                    queue.push_back(event("message_delta", json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": u["output_tokens"]}})));
                    queue.push_back(event("message_stop", json!({"type": "message_stop"})));
                    ts = None;
                }
                Some(Piece::Error(e)) => {
                    queue.push_back(event("error", AnthropicError(e).body()));
                    ts = None;
                }
                None => ts = None,
            }
        }
    });
    Sse::new(body).keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
}
