//! `POST /v1/chat/completions`: template the messages, submit, answer whole or as SSE chunks.
//!
//! Stream shape (per OpenAI, and what compatibility suites check): a first chunk whose delta carries
//! `role: "assistant"`, content chunks, exactly one chunk with a `finish_reason`, a usage chunk with empty
//! `choices` when `stream_options.include_usage`, then `data: [DONE]`. A failure midway sends
//! `data: {"error": {...}}` and then `[DONE]`.

use super::{off_the_async_workers, prepare, submit, response_id, unix_now, OpenAiJson, Piece, Prepared, TextStream};
use crate::openai_error::ApiError;
use crate::protocol::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatMessageOut,
};
use crate::server::AppState;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::collections::VecDeque;
use std::convert::Infallible;

pub async fn chat_completions(
    State(state): State<AppState>,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let streaming = req.stream.unwrap_or(false);
    let include_usage = req.include_usage();
    let st = state.clone();
    let prepared = off_the_async_workers(&state, move || prepare_chat(&st, &req)).await?;
    let text_stream = submit(&state, &prepared, "chat completion")?;
    let id = response_id("chatcmpl");
    let model = state.served_model_name();
    if streaming {
        Ok(stream_response(text_stream, id, model, include_usage).into_response())
    } else {
        whole_response(text_stream, id, model).await
    }
}

/// Validation, template and tokenizer: everything before submit (CPU-bound for long prompts).
fn prepare_chat(state: &AppState, req: &ChatCompletionRequest) -> Result<Prepared, ApiError> {
    req.check_unsupported()?;
    let sampling = req.sampling.validate(&state.default_sampling)?;
    let messages = req.template_messages()?;
    let tools = match req.tool_choice.as_ref().and_then(|c| c.as_str()) {
        Some("none") => None,
        _ => req.tools.as_deref().filter(|t| !t.is_empty()),
    };
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(effort) = &req.reasoning_effort {
        kwargs.entry("reasoning_effort").or_insert_with(|| serde_json::Value::String(effort.clone()));
    }
    let prompt_text = state
        .chat_template
        .render(&messages, tools, req.add_generation_prompt.unwrap_or(true), Some(&kwargs))
        .map_err(|e| ApiError::invalid_param("messages", e.0))?;
    // The template writes BOS and special tokens itself.
    let prompt = state
        .tokenizer
        .encode(&prompt_text, false)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    prepare(state, prompt, sampling)
}

async fn whole_response(mut ts: TextStream, id: String, model: String) -> Result<Response, ApiError> {
    let mut content = String::new();
    let finish_reason = loop {
        match ts.next().await {
            Some(Piece::Text(t)) => content.push_str(&t),
            Some(Piece::Finish { text, reason, .. }) => {
                content.push_str(&text);
                break reason;
            }
            Some(Piece::Error(e)) => return Err(e),
            None => return Err(ApiError::internal("the request ended without a result")),
        }
    };
    let body = ChatCompletionResponse {
        id,
        object: "chat.completion",
        created: unix_now(),
        model,
        choices: vec![ChatChoice {
            index: 0,
            message: ChatMessageOut { role: "assistant", content },
            logprobs: None,
            finish_reason,
        }],
        usage: ts.usage(),
    };
    Ok(Json(body).into_response())
}

/// The SSE body. Its state owns the `TextStream`, so hyper dropping the body (client gone) aborts the request.
fn stream_response(ts: TextStream, id: String, model: String, include_usage: bool) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let created = unix_now();
    let chunk = move |delta: ChatDelta, finish_reason: Option<&'static str>| ChatCompletionChunk {
        id: id.clone(),
        object: "chat.completion.chunk",
        created,
        model: model.clone(),
        choices: vec![ChatChunkChoice { index: 0, delta, logprobs: None, finish_reason }],
        usage: None,
    };
    let mut first = VecDeque::new();
    first.push_back(json_event(&chunk(ChatDelta { role: Some("assistant"), content: Some(String::new()) }, None)));
    let state = StreamState { ts: Some(ts), queue: first, chunk, include_usage };
    let body = futures::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(ev) = st.queue.pop_front() {
                return Some((Ok(ev), st));
            }
            let ts = st.ts.as_mut()?;
            match ts.next().await {
                Some(Piece::Text(t)) => st.queue.push_back(json_event(&(st.chunk)(ChatDelta { content: Some(t), ..Default::default() }, None))),
                Some(Piece::Finish { text, reason, .. }) => {
                    if !text.is_empty() {
                        st.queue.push_back(json_event(&(st.chunk)(ChatDelta { content: Some(text), ..Default::default() }, None)));
                    }
                    st.queue.push_back(json_event(&(st.chunk)(ChatDelta::default(), Some(reason))));
                    if st.include_usage {
                        let mut usage_chunk = (st.chunk)(ChatDelta::default(), None);
                        usage_chunk.choices.clear();
                        usage_chunk.usage = Some(ts.usage());
                        st.queue.push_back(json_event(&usage_chunk));
                    }
                    st.queue.push_back(Event::default().data("[DONE]"));
                    st.ts = None;
                }
                Some(Piece::Error(e)) => {
                    st.queue.push_back(json_event(&e.body()));
                    st.queue.push_back(Event::default().data("[DONE]"));
                    st.ts = None;
                }
                None => st.ts = None,
            }
        }
    });
    Sse::new(body).keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
}

struct StreamState<F> {
    ts: Option<TextStream>,
    queue: VecDeque<Event>,
    chunk: F,
    include_usage: bool,
}

pub(crate) fn json_event<T: serde::Serialize>(value: &T) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_else(|_| "{}".into()))
}
