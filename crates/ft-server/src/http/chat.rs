//! `POST /v1/chat/completions`: template the messages, submit, answer whole or as SSE chunks.
//!
//! The output goes through the reasoning and tool-call parsers (`output.rs`): `reasoning_content`,
//! `tool_calls` (ids, `type: "function"`, arguments as JSON text) and `finish_reason: "tool_calls"`.
//!
//! Stream shape (per OpenAI, and what compatibility suites check): a first chunk whose delta carries
//! `role: "assistant"`, then `reasoning_content` / `content` deltas and tool-call deltas (a call's first delta has
//! its `index`, `id`, `type` and `function.name` with `arguments: ""`, the next ones add to `arguments`),
//! exactly one chunk with a `finish_reason`, a usage chunk with empty `choices` when
//! `stream_options.include_usage`, then `data: [DONE]`. A failure midway sends `data: {"error": {...}}` and
//! then `[DONE]`.
//!
//! With `n > 1` (`http::choices`) every choice has its own `index`, role delta, deltas and one finish chunk,
//! interleaved as they come; the usage chunk and `[DONE]` follow the last of them.

use super::choices::{collect_choices, submit_choices, total_usage, Collected, ResponseHead};
use super::logprobs::{chat_logprobs, LogprobsUpdate, PositionLogprob};
use super::output::{Output, OutputSpec};
use super::sse::{done_event, events_before_trailing_text, json_event, sse_choices, Ending, StreamFormat};
use super::{off_the_async_workers, response_id, unix_now, OpenAiJson};
use crate::http::openai_error::ApiError;
use crate::http::protocol::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatMessageOut, FunctionCallDelta, FunctionCallOut, ToolCallDelta, ToolCallOut, Usage,
};
use crate::http::state::AppState;
use crate::validation::{self, Prepared};
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::Json;

pub async fn chat_completions(
    State(state): State<AppState>,
    OpenAiJson(req): OpenAiJson<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let streaming = req.stream.unwrap_or(false);
    let include_usage = req.include_usage();
    let st = state.clone();
    let (prepared, spec) = off_the_async_workers(&state, move || prepare_chat(&st, &req)).await?;
    let choices = submit_choices(&state, std::slice::from_ref(&prepared), "chat completion")?;
    let head = ResponseHead { id: response_id("chatcmpl"), model: state.served_model_name(), created: unix_now() };
    if streaming {
        let formats = choices
            .iter()
            .map(|c| ChatFormat {
                index: c.index as u32,
                head: head.clone(),
                include_usage,
                state: state.clone(),
                pending: prepared.logprobs.map(|_| Vec::new()),
            })
            .collect();
        Ok(sse_choices(choices, &spec, formats).into_response())
    } else {
        let collected = collect_choices(choices, &spec).await?;
        let usage = total_usage(&collected.iter().map(|c| (c.prompt, c.ending.usage.clone())).collect::<Vec<_>>());
        let choices = collected.into_iter().map(|c| chat_choice(&state, c)).collect();
        let body = ChatCompletionResponse {
            id: head.id,
            object: "chat.completion",
            created: head.created,
            model: head.model,
            choices,
            usage,
        };
        Ok(Json(body).into_response())
    }
}

/// Validation, template and tokenizer: everything before submit (CPU-bound for long prompts); also how the
/// output is parsed.
fn prepare_chat(state: &AppState, req: &ChatCompletionRequest) -> Result<(Prepared, OutputSpec), ApiError> {
    validation::model(state, req.model.as_deref())?;
    req.check_unsupported()?;
    let sampling = validation::chat_sampling(&req.sampling, req.logprobs, req.top_logprobs, &state.default_sampling)?;
    let messages = req.template_messages()?;
    let tools =
        validation::tools(state, req.tools.clone(), req.tool_choice(), req.parallel_tool_calls.unwrap_or(true))?;
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(effort) = &req.reasoning_effort {
        kwargs.entry("reasoning_effort").or_insert_with(|| serde_json::Value::String(effort.clone()));
    }
    let template_tools = tools.template_tools();
    let mut prompt_text = state
        .chat_template
        .render(&messages, template_tools.as_deref(), req.add_generation_prompt.unwrap_or(true), Some(&kwargs))
        .map_err(|e| ApiError::invalid_param("messages", e.0))?;
    let (spec, forced) = OutputSpec::for_chat(state.reasoning_format, &tools, &prompt_text);
    prompt_text.push_str(&forced);
    // The template writes BOS and special tokens itself.
    let prompt =
        state.tokenizer.encode(&prompt_text, false).map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    Ok((validation::request(&state.limits, prompt, sampling, "messages")?, spec))
}

/// One finished choice of a whole response.
fn chat_choice(state: &AppState, mut c: Collected) -> ChatChoice {
    let logprobs = c.ts.wants_logprobs().then(|| chat_logprobs(&state.tokenizer, &c.ts.take_logprobs().tokens));
    let tool_calls: Vec<ToolCallOut> = c
        .message
        .calls
        .into_iter()
        .map(|c| ToolCallOut {
            id: c.id,
            kind: "function",
            function: FunctionCallOut { name: c.name, arguments: c.arguments },
        })
        .collect();
    let content = c.message.content;
    let content = if content.is_empty() && !tool_calls.is_empty() { None } else { Some(content) };
    ChatChoice {
        index: c.index as u32,
        message: ChatMessageOut {
            role: "assistant",
            content,
            reasoning_content: c.message.reasoning,
            tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
        },
        logprobs,
        finish_reason: c.ending.reason,
    }
}

/// One choice's chat completion chunks: a first delta with the role, content deltas, one chunk with the finish
/// reason; after every choice's, the usage chunk (empty `choices`) when asked for, `[DONE]`.
struct ChatFormat {
    index: u32,
    head: ResponseHead,
    include_usage: bool,
    state: AppState,
    /// Logprobs not sent yet (`None`: not asked); they ride on the next chunk.
    pending: Option<Vec<PositionLogprob>>,
}

impl ChatFormat {
    fn chunk(&mut self, delta: ChatDelta, finish_reason: Option<&'static str>) -> ChatCompletionChunk {
        let entries = self.pending.as_mut().map(std::mem::take).filter(|p| !p.is_empty());
        ChatCompletionChunk {
            id: self.head.id.clone(),
            object: "chat.completion.chunk",
            created: self.head.created,
            model: self.head.model.clone(),
            choices: vec![ChatChunkChoice {
                index: self.index,
                delta,
                logprobs: entries.map(|e| chat_logprobs(&self.state.tokenizer, &e)),
                finish_reason,
            }],
            usage: None,
        }
    }
}

impl StreamFormat for ChatFormat {
    fn start(&mut self) -> Vec<Event> {
        vec![json_event(
            &self
                .chunk(ChatDelta { role: Some("assistant"), content: Some(String::new()), ..Default::default() }, None),
        )]
    }

    fn output(&mut self, output: Output) -> Vec<Event> {
        let delta = match output {
            Output::Text(text) => ChatDelta { content: Some(text), ..Default::default() },
            Output::Reasoning(text) => ChatDelta { reasoning_content: Some(text), ..Default::default() },
            Output::CallStart { index, id, name } => call_delta(ToolCallDelta {
                index,
                id: Some(id),
                kind: Some("function"),
                function: FunctionCallDelta { name: Some(name), arguments: Some(String::new()) },
            }),
            Output::CallArguments { index, delta } => call_delta(ToolCallDelta {
                index,
                id: None,
                kind: None,
                function: FunctionCallDelta { name: None, arguments: Some(delta) },
            }),
            Output::CallEnd { .. } => return vec![],
        };
        vec![json_event(&self.chunk(delta, None))]
    }

    fn logprobs(&mut self, update: LogprobsUpdate) {
        if let Some(p) = self.pending.as_mut() {
            p.extend(update.tokens);
        }
    }

    fn finish(&mut self, ending: Ending) -> Vec<Event> {
        self.finish_with(vec![], ending)
    }

    /// Text that came with the end rides in the finish chunk.
    fn finish_with(&mut self, outputs: Vec<Output>, ending: Ending) -> Vec<Event> {
        let (mut events, content) = events_before_trailing_text(self, outputs);
        events.push(json_event(&self.chunk(ChatDelta { content, ..Default::default() }, Some(ending.reason))));
        events
    }

    fn end(&mut self, usage: Usage) -> Vec<Event> {
        let mut events = vec![];
        if self.include_usage {
            let mut usage_chunk = self.chunk(ChatDelta::default(), None);
            usage_chunk.choices.clear();
            usage_chunk.usage = Some(usage);
            events.push(json_event(&usage_chunk));
        }
        events.push(done_event());
        events
    }

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        vec![json_event(&error.body()), done_event()]
    }
}

fn call_delta(call: ToolCallDelta) -> ChatDelta {
    ChatDelta { tool_calls: Some(vec![call]), ..Default::default() }
}
