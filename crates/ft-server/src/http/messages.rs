//! `POST /v1/messages` (Anthropic Messages) and `POST /v1/messages/count_tokens`, over the same template,
//! tokenizer, [`TextStream`] and engine as chat completions.
//!
//! The output goes through the reasoning and tool-call parsers (`output.rs`) and comes back as content blocks:
//! `thinking` (the reasoning), `text`, `tool_use` (`toolu_` ids, `input` an object), with `stop_reason:
//! "tool_use"` when the model called a tool.
//!
//! Stream shape (Anthropic's): `message_start`, `ping`, then each block in output order with its index
//! (`content_block_start`, `content_block_delta` × n: `thinking_delta`, `text_delta` or `input_json_delta`,
//! `content_block_stop`), `message_delta` (`stop_reason`, output tokens), `message_stop`. An output with no
//! block at all still gets one empty text block. A failure midway sends an `error` event and ends the stream.

use super::output::{anthropic_tool_id, Message, Output, OutputSpec};
use super::sse::{collect, sse, Ending, StreamFormat};
use super::{off_the_async_workers, submit, OpenAiJson, TextStream};
use crate::http::anthropic::{stop_reason, usage, AnthropicError, MessagesRequest};
use crate::http::openai_error::ApiError;
use crate::http::state::AppState;
use crate::validation::{self, Prepared};
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
    let (prepared, spec) = off_the_async_workers(&state, move || prepare_messages(&st, &req)).await?;
    let ts = submit(&state, &prepared, "message")?;
    let id = format!("msg_{:024x}", rand::random::<u128>() >> 32);
    let model = state.served_model_name();
    if streaming {
        let mut start_usage = usage(&ts.usage());
        start_usage["output_tokens"] = json!(0);
        Ok(sse(ts, &spec, MessagesFormat { id, model, start_usage, open: None, blocks: 0 }).into_response())
    } else {
        whole_response(ts, &spec, id, model).await
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
    let (prompt, _) = off_the_async_workers(&state, move || render(&st, &req)).await?;
    Ok(Json(json!({"input_tokens": prompt.len()})).into_response())
}

fn parse(body: Result<OpenAiJson<Value>, ApiError>) -> Result<MessagesRequest, AnthropicError> {
    let OpenAiJson(raw) = body?;
    if !raw.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object").into());
    }
    serde_json::from_value(raw).map_err(|e| ApiError::invalid(format!("invalid request: {e}")).into())
}

/// The prompt's token ids (template over `system`, `messages` and `tools`, then the tokenizer) and how the
/// output is parsed.
fn render(state: &AppState, req: &MessagesRequest) -> Result<(Vec<u32>, OutputSpec), ApiError> {
    let messages = req.template_messages()?;
    let (choice, parallel) = req.tool_choice();
    let tools = validation::tools(state, req.openai_tools()?, choice, parallel)?;
    let kwargs = req.template_kwargs()?;
    let mut text = state
        .chat_template
        .render(&messages, tools.template_tools().as_deref(), true, Some(&kwargs))
        .map_err(|e| ApiError::invalid_param("messages", e.0))?;
    let (spec, forced) = OutputSpec::for_chat(state.reasoning_format, &tools, &text);
    text.push_str(&forced);
    let prompt =
        state.tokenizer.encode(&text, false).map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    Ok((prompt, spec))
}

fn prepare_messages(state: &AppState, req: &MessagesRequest) -> Result<(Prepared, OutputSpec), ApiError> {
    validation::model(state, req.model.as_deref())?;
    let sampling = validation::sampling(&req.sampling_fields(true)?, &state.default_sampling)?;
    let (prompt, spec) = render(state, req)?;
    Ok((validation::request(&state.limits, prompt, sampling, "messages")?, spec))
}

async fn whole_response(
    mut ts: TextStream,
    spec: &OutputSpec,
    id: String,
    model: String,
) -> Result<Response, AnthropicError> {
    let (message, ending) = collect(&mut ts, spec).await?;
    let (stop_reason, stop_sequence) = stop_reason(ending.reason, ending.stop_string);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(message),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(&ending.usage),
    }))
    .into_response())
}

/// A whole output as content blocks: thinking, text, then the tool calls; one empty text block if nothing else.
fn content_blocks(message: Message) -> Vec<Value> {
    let mut blocks = vec![];
    if let Some(thinking) = message.reasoning.filter(|r| !r.is_empty()) {
        blocks.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
    }
    if !message.content.is_empty() {
        blocks.push(json!({"type": "text", "text": message.content}));
    }
    for call in message.calls {
        // The parser's arguments are always a JSON object; an unreadable one would be a parser bug.
        let input =
            serde_json::from_str::<Value>(&call.arguments).ok().filter(Value::is_object).unwrap_or_else(|| json!({}));
        blocks.push(json!({"type": "tool_use", "id": anthropic_tool_id(&call.id), "name": call.name, "input": input}));
    }
    if blocks.is_empty() {
        blocks.push(json!({"type": "text", "text": ""}));
    }
    blocks
}

fn event(name: &str, data: Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// Anthropic's message stream: `message_start` and `ping`, then the blocks in output order, each opened when
/// its first output arrives and closed when the next one opens (or at the end), `message_delta` with the stop
/// reason and output tokens, `message_stop`; a failure is one `error` event.
struct MessagesFormat {
    id: String,
    model: String,
    start_usage: Value,
    /// The open block: its index and kind.
    open: Option<(usize, BlockKind)>,
    /// Blocks opened so far (the next one's index).
    blocks: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    ToolUse,
}

impl MessagesFormat {
    /// Closes the open block, if any.
    fn close(&mut self, events: &mut Vec<Event>) {
        if let Some((index, _)) = self.open.take() {
            events.push(event("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        }
    }

    /// Makes a block of `kind` the open one (a new block unless one of that kind is open and may go on;
    /// tool-use blocks never go on), and returns its index.
    fn open(&mut self, kind: BlockKind, block: Value, events: &mut Vec<Event>) -> usize {
        if let Some((index, open)) = self.open {
            if open == kind && kind != BlockKind::ToolUse {
                return index;
            }
        }
        self.close(events);
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, kind));
        events.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        index
    }

    fn delta(index: usize, delta: Value) -> Event {
        event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": delta}))
    }
}

impl StreamFormat for MessagesFormat {
    fn start(&mut self) -> Vec<Event> {
        vec![
            event(
                "message_start",
                json!({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": null, "stop_sequence": null, "usage": self.start_usage}}),
            ),
            event("ping", json!({"type": "ping"})),
        ]
    }

    fn output(&mut self, output: Output) -> Vec<Event> {
        let mut events = vec![];
        match output {
            Output::Reasoning(text) => {
                let index = self.open(
                    BlockKind::Thinking,
                    json!({"type": "thinking", "thinking": "", "signature": ""}),
                    &mut events,
                );
                events.push(Self::delta(index, json!({"type": "thinking_delta", "thinking": text})));
            }
            Output::Text(text) => {
                let index = self.open(BlockKind::Text, json!({"type": "text", "text": ""}), &mut events);
                events.push(Self::delta(index, json!({"type": "text_delta", "text": text})));
            }
            Output::CallStart { id, name, .. } => {
                let block = json!({"type": "tool_use", "id": anthropic_tool_id(&id), "name": name, "input": {}});
                self.open(BlockKind::ToolUse, block, &mut events);
            }
            Output::CallArguments { delta, .. } => {
                if let Some((index, BlockKind::ToolUse)) = self.open {
                    events.push(Self::delta(index, json!({"type": "input_json_delta", "partial_json": delta})));
                }
            }
            Output::CallEnd { .. } => self.close(&mut events),
        }
        events
    }

    fn finish(&mut self, ending: Ending) -> Vec<Event> {
        let mut events = vec![];
        if self.blocks == 0 {
            self.open(BlockKind::Text, json!({"type": "text", "text": ""}), &mut events);
        }
        self.close(&mut events);
        let (stop_reason, stop_sequence) = stop_reason(ending.reason, ending.stop_string);
        let u = usage(&ending.usage);
        events.push(event(
            "message_delta",
            json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": u["output_tokens"]}}),
        ));
        events.push(event("message_stop", json!({"type": "message_stop"})));
        events
    }

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        vec![event("error", AnthropicError(error).body())]
    }
}
