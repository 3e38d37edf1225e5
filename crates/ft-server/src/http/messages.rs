//! `POST /v1/messages` (Anthropic Messages) and `POST /v1/messages/count_tokens`, over the same template,
//! tokenizer, [`TextStream`] and engine as chat completions.
//!
//! Stream shape (Anthropic's): `message_start`, `content_block_start` (one text block), `ping`,
//! `content_block_delta` × n (`text_delta`), `content_block_stop`, `message_delta` (`stop_reason`, output
//! tokens), `message_stop`. A failure midway sends an `error` event and ends the stream.

use super::sse::{collect, sse, Ending, StreamFormat};
use super::{off_the_async_workers, submit, OpenAiJson, TextStream};
use crate::validation::{self, Prepared};
use crate::http::anthropic::{stop_reason, usage, AnthropicError, MessagesRequest};
use crate::http::openai_error::ApiError;
use crate::http::state::AppState;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

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
        let mut start_usage = usage(&ts.usage());
        start_usage["output_tokens"] = json!(0);
        Ok(sse(ts, MessagesFormat { id, model, start_usage }).into_response())
    } else {
        whole_response(ts, id, model).await
    }
}

pub async fn count_tokens(
    State(state): State<AppState>,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Result<Response, AnthropicError> {
    let req = parse(body)?;
    validation::model(&state, req.model.as_deref())?;
    // The same checks as /v1/messages, so a body counts here exactly when it would be served there
    // (`max_tokens` aside: counting does not need it).
    validation::sampling(&req.sampling_fields(false)?, &state.default_sampling)?;
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
    validation::model(state, req.model.as_deref())?;
    let sampling = validation::sampling(&req.sampling_fields(true)?, &state.default_sampling)?;
    let prompt = render(state, req)?;
    validation::request(&state.limits, prompt, sampling, "messages")
}

async fn whole_response(mut ts: TextStream, id: String, model: String) -> Result<Response, AnthropicError> {
    let (text, ending) = collect(&mut ts).await?;
    let (stop_reason, stop_sequence) = stop_reason(ending.reason, ending.stop_string);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(&ending.usage),
    }))
    .into_response())
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// Anthropic's message stream: `message_start`, one text block (`content_block_start`, `ping`, `text_delta`s,
/// `content_block_stop`), `message_delta` with the stop reason and output tokens, `message_stop`; a failure is
/// one `error` event.
struct MessagesFormat {
    id: String,
    model: String,
    start_usage: Value,
}

impl StreamFormat for MessagesFormat {
    fn start(&mut self) -> Vec<Event> {
        vec![
            event("message_start", json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": self.start_usage}})),
            event("content_block_start", json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}})),
            event("ping", json!({"type": "ping"})),
        ]
    }

    fn text(&mut self, text: String) -> Vec<Event> {
        vec![event("content_block_delta", json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": text}}))]
    }

    fn finish(&mut self, ending: Ending) -> Vec<Event> {
        let (stop_reason, stop_sequence) = stop_reason(ending.reason, ending.stop_string);
        let u = usage(&ending.usage);
        vec![
            event("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            event("message_delta", json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": u["output_tokens"]}})),
            event("message_stop", json!({"type": "message_stop"})),
        ]
    }

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        vec![event("error", AnthropicError(error).body())]
    }
}
