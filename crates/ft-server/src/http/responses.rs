//! OpenAI Responses: `POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`,
//! `DELETE /v1/responses/{id}`, over the same template, tokenizer, parsers, [`TextStream`] and engine as chat.
//!
//! ```text
//!   request (request.rs) ──input items (input.rs), previous_response_id's conversation (store.rs)──▶
//!   template messages ─▶ prompt ─▶ engine ─▶ Output events (output.rs) ─┬─ collect(): output items (object.rs)
//!                                                                       └─ sse(): events (stream.rs)
//!   Turn (turn.rs): stored in_progress at submit, stored with its output and conversation at the end
//! ```
//!
//! The output is `reasoning`, `message` and `function_call` items; `status` is `completed`, `incomplete`
//! (`max_output_tokens`), `cancelled` or `failed`. Stored responses (`store`, default true) live in memory,
//! at most `--max-stored-responses`, least recently used evicted first; `previous_response_id` prepends the
//! stored conversation (its input and output items, not its `instructions`). `background: true` answers at once
//! (`in_progress`) and generates on; `GET` polls it. `cancel` aborts a response that is still generating
//! (background or streamed); cancelling a cancelled one returns it, any other status is a 400.
//! Unknown ids are 404 (`response_not_found`, `previous_response_not_found`).

mod input;
mod object;
mod request;
pub(crate) mod store;
mod stream;
mod turn;

use super::output::OutputSpec;
use super::sse::{collect, sse};
use super::text_stream::ensure_serving;
use super::{off_the_async_workers, OpenAiJson, TextStream};
use crate::http::openai_error::ApiError;
use crate::http::state::AppState;
use crate::validation::{self, Prepared};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use request::ResponsesRequest;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use store::Conversation;
use turn::{Turn, TurnPlan};

/// How long `cancel` waits for the aborted response to end before it answers with what is stored.
const CANCEL_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

pub async fn create_response(
    State(state): State<AppState>,
    body: Result<OpenAiJson<Value>, ApiError>,
) -> Result<Response, ApiError> {
    let req = request::parse(body)?;
    let (streaming, background) = (req.stream.unwrap_or(false), req.background());
    let st = state.clone();
    let (prepared, spec, plan) = off_the_async_workers(&state, move || prepare(&st, &req)).await?;
    ensure_serving(&state)?;
    let stream = state.backend.submit(prepared.req.clone())?;
    let turn = Turn::start(&state, plan, stream.id);
    let ts = TextStream::new(state.clone(), stream, &prepared);
    if background {
        let response = turn.in_progress().clone();
        tokio::spawn(async move { whole_response(ts, &spec, turn).await });
        Ok(Json(response).into_response())
    } else if streaming {
        Ok(sse(ts, &spec, stream::ResponsesFormat::new(turn)).into_response())
    } else {
        whole_response(ts, &spec, turn).await
    }
}

/// Validation, the conversation, template and tokenizer: everything before submit.
fn prepare(state: &AppState, req: &ResponsesRequest) -> Result<(Prepared, OutputSpec, TurnPlan), ApiError> {
    validation::model(state, req.model.as_deref())?;
    req.check_unsupported()?;
    let sampling = validation::sampling(&req.sampling_fields()?, &state.default_sampling)?;
    let input = input::input_items(req.input.as_ref())?;
    // The new items alone first, so errors name them as the request does (`input[i]`).
    input::template_messages(None, &input)?;
    let parent = previous(state, req.previous_response_id.as_deref())?;
    let mut items = parent.as_ref().map(|c| c.items()).unwrap_or_default();
    items.extend(input.iter().cloned());
    let messages = input::template_messages(req.instructions(), &items)?;
    let choice = req.tool_choice()?;
    let chat_tools = req.chat_tools()?;
    let tools = validation::tools(state, chat_tools.clone(), choice.clone(), req.parallel_tool_calls.unwrap_or(true))?;
    let kwargs = req.template_kwargs()?;
    let (prompt, spec) = render(state, &messages, &tools, &kwargs)?;
    let prepared = validation::request(&state.limits, prompt, sampling, "input")?;
    let skeleton =
        object::skeleton(&object::new_id("resp"), &state.served_model_name(), req.echo(&chat_tools, &choice));
    Ok((prepared, spec, TurnPlan { skeleton, store: req.store.unwrap_or(true), parent, input }))
}

/// The conversation `previous_response_id` names (404 when it is not stored, 400 while it runs).
fn previous(state: &AppState, id: Option<&str>) -> Result<Option<Arc<Conversation>>, ApiError> {
    let Some(id) = id else { return Ok(None) };
    let entry = state.responses.get(id).ok_or_else(|| {
        ApiError::not_found(format!("Previous response with id '{id}' not found."))
            .with_param("previous_response_id")
            .with_code("previous_response_not_found")
    })?;
    match entry.conversation {
        Some(c) => Ok(Some(c)),
        None => Err(ApiError::invalid_param(
            "previous_response_id",
            format!("Previous response with id '{id}' is still in progress."),
        )),
    }
}

/// The prompt's token ids and how the output is parsed (as chat: a forced call's opening appended).
fn render(
    state: &AppState,
    messages: &[Value],
    tools: &crate::http::output::ToolRequest,
    kwargs: &Map<String, Value>,
) -> Result<(Vec<u32>, OutputSpec), ApiError> {
    let mut text = state
        .chat_template
        .render(messages, tools.template_tools().as_deref(), true, Some(kwargs))
        .map_err(|e| ApiError::invalid_param("input", e.0))?;
    let (spec, forced) = OutputSpec::for_chat(state.reasoning_format, tools, &text);
    text.push_str(&forced);
    let prompt = state.tokenizer.encode(&text, false).map_err(|e| ApiError::invalid_param("input", e.to_string()))?;
    Ok((prompt, spec))
}

async fn whole_response(mut ts: TextStream, spec: &OutputSpec, mut turn: Turn) -> Result<Response, ApiError> {
    match collect(&mut ts, spec).await {
        Ok((message, ending)) => {
            let status = turn.status(ending.reason);
            let reasoning = message.reasoning.clone().unwrap_or_default();
            let output = object::output_items(message, status);
            Ok(Json(turn.end(status, &ending.usage, output, &reasoning)).into_response())
        }
        Err(e) => {
            turn.fail(&e, vec![]);
            Err(e)
        }
    }
}

/// The `{id}` of the path (a 400 in OpenAI's shape for one that is not UTF-8).
type IdPath = Result<Path<String>, PathRejection>;

fn response_id(path: IdPath) -> Result<String, ApiError> {
    path.map(|Path(id)| id).map_err(|e| ApiError::invalid(format!("bad response id in the path: {}", e.body_text())))
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found.")).with_code("response_not_found")
}

pub async fn get_response(State(state): State<AppState>, path: IdPath) -> Result<Response, ApiError> {
    let id = response_id(path)?;
    let entry = state.responses.get(&id).ok_or_else(|| not_found(&id))?;
    Ok(Json(entry.response).into_response())
}

/// Aborts a response that is still generating and answers with it once it ended (`cancelled`).
pub async fn cancel_response(State(state): State<AppState>, path: IdPath) -> Result<Response, ApiError> {
    let id = response_id(path)?;
    let entry = state.responses.get(&id).ok_or_else(|| not_found(&id))?;
    if let Some(live) = entry.live {
        live.cancel();
        state.backend.abort(live.request_id);
        live.wait_ended(CANCEL_WAIT).await;
        let entry = state.responses.get(&id).ok_or_else(|| not_found(&id))?;
        return Ok(Json(entry.response).into_response());
    }
    match entry.response["status"].as_str() {
        Some("cancelled") => Ok(Json(entry.response).into_response()),
        status => Err(ApiError::invalid(format!(
            "Cannot cancel response '{id}': its status is {}; only an in-progress response can be cancelled.",
            status.unwrap_or("unknown")
        ))),
    }
}

/// Forgets a stored response (one still generating is cancelled too).
pub async fn delete_response(State(state): State<AppState>, path: IdPath) -> Result<Response, ApiError> {
    let id = response_id(path)?;
    let entry = state.responses.remove(&id).ok_or_else(|| not_found(&id))?;
    if let Some(live) = entry.live {
        live.cancel();
        state.backend.abort(live.request_id);
    }
    Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
}
