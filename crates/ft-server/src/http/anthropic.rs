//! Anthropic Messages wire types (`POST /v1/messages`, `/v1/messages/count_tokens`) and their mapping onto the
//! chat pipeline: `system` + `messages` (text, `tool_use`, `tool_result` and `thinking` blocks) become chat
//! template messages, `tools` become OpenAI-style tool definitions (what the templates iterate over),
//! `max_tokens` / `stop_sequences` / `temperature` / `top_p` / `top_k` become the shared sampling fields,
//! `tool_choice` (`auto` / `any` / `tool` / `none`, `disable_parallel_tool_use`) the shared [`ToolChoice`].
//! The output comes back as `thinking`, `text` and `tool_use` blocks (`messages.rs`). Errors use Anthropic's shape:
//! `{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`.

use crate::http::openai_error::ApiError;
use crate::http::output::ToolChoice;
use crate::http::protocol::{check_tool, SamplingFields, Usage};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

/// An [`ApiError`] answered in Anthropic's shape (same status).
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl AnthropicError {
    pub fn body(&self) -> Json {
        json!({"type": "error", "error": {"type": error_type(self.0.status), "message": self.0.message}})
    }
}

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl From<crate::backend::SubmitError> for AnthropicError {
    fn from(e: crate::backend::SubmitError) -> Self {
        AnthropicError(e.into())
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.0.status, axum::Json(self.body())).into_response()
    }
}

/// Anthropic's error `type` for an HTTP status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 => "timeout_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct MessagesRequest {
    /// Any value is accepted: one model is served.
    pub model: Option<String>,
    pub messages: Json,
    /// A string or a list of text blocks.
    pub system: Option<Json>,
    /// Required by `/v1/messages`, ignored by `count_tokens`.
    pub max_tokens: Option<i64>,
    pub stop_sequences: Option<Json>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    /// `{"type": "enabled", "budget_tokens": N}` or `{"type": "disabled"}`: the template's `enable_thinking`
    /// (the budget is not enforced).
    pub thinking: Option<Json>,
    pub metadata: Option<Map<String, Json>>,
}

impl MessagesRequest {
    /// The sampling fields for [`SamplingFields::validate`]; `max_tokens` positive, and present when
    /// `require_max_tokens` (`/v1/messages`; counting tokens does not need it).
    pub fn sampling_fields(&self, require_max_tokens: bool) -> Result<SamplingFields, ApiError> {
        // (its range is checked with every other API's in validation.rs)
        if require_max_tokens && self.max_tokens.is_none() {
            return Err(ApiError::invalid_param("max_tokens", "max_tokens is required"));
        }
        let stop = match &self.stop_sequences {
            None | Some(Json::Null) => None,
            Some(s @ Json::Array(items)) if items.iter().all(Json::is_string) => Some(s.clone()),
            Some(_) => {
                return Err(ApiError::invalid_param("stop_sequences", "stop_sequences must be a list of strings"))
            }
        };
        Ok(SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_tokens: self.max_tokens,
            stop,
            ..Default::default()
        })
    }

    /// `system` and `messages` as chat template messages.
    pub fn template_messages(&self) -> Result<Vec<Json>, ApiError> {
        let mut out = Vec::new();
        match &self.system {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) => out.push(json!({"role": "system", "content": s})),
            Some(Json::Array(blocks)) => {
                let text = text_blocks(blocks, "system")?;
                out.push(json!({"role": "system", "content": text}));
            }
            Some(_) => {
                return Err(ApiError::invalid_param("system", "system must be a string or a list of text blocks"))
            }
        }
        let items = match &self.messages {
            Json::Array(items) if !items.is_empty() => items,
            Json::Array(_) => return Err(ApiError::invalid_param("messages", "messages must not be empty")),
            _ => return Err(ApiError::invalid_param("messages", "messages must be a list of message objects")),
        };
        for (i, m) in items.iter().enumerate() {
            let param = format!("messages[{i}]");
            let role = match m.get("role") {
                Some(Json::String(r)) if r == "user" || r == "assistant" => r.as_str(),
                Some(Json::String(r)) => {
                    return Err(ApiError::invalid_param(
                        &format!("{param}.role"),
                        format!("unknown role {r:?} (expected user or assistant)"),
                    ))
                }
                _ => {
                    return Err(ApiError::invalid_param(
                        &format!("{param}.role"),
                        format!("{param}.role must be \"user\" or \"assistant\""),
                    ))
                }
            };
            match m.get("content") {
                Some(Json::String(s)) => out.push(json!({"role": role, "content": s})),
                Some(Json::Array(blocks)) => convert_blocks(role, blocks, &param, &mut out)?,
                _ => {
                    return Err(ApiError::invalid_param(
                        &format!("{param}.content"),
                        format!("{param}.content must be a string or a list of content blocks"),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// `tools` as OpenAI-style definitions, checked; `None` when absent or `tool_choice` is `none`.
    pub fn openai_tools(&self) -> Result<Option<Vec<Json>>, ApiError> {
        if self.checked_tool_choice_type()? == Some("none") {
            return Ok(None);
        }
        let Some(tools) = self.tools.as_ref().filter(|t| !t.is_empty()) else { return Ok(None) };
        let tools = tools.iter().enumerate().map(|(i, t)| openai_tool(t, &format!("tools[{i}]")));
        tools.collect::<Result<Vec<_>, _>>().map(Some)
    }

    /// `tool_choice`'s shape checked; its `type` (`None` when absent).
    fn checked_tool_choice_type(&self) -> Result<Option<&str>, ApiError> {
        let choice = self.tool_choice.as_ref();
        let kind = choice.and_then(|c| c.get("type")).and_then(Json::as_str);
        match kind {
            None if choice.is_some_and(|c| !c.is_null()) => {
                Err(ApiError::invalid_param("tool_choice", "tool_choice must be an object with a \"type\""))
            }
            _ if !choice.and_then(|c| c.get("name")).is_none_or(|n| n.is_null() || n.is_string()) => {
                Err(ApiError::invalid_param("tool_choice", "tool_choice.name must be a string"))
            }
            _ if !choice
                .and_then(|c| c.get("disable_parallel_tool_use"))
                .is_none_or(|d| d.is_null() || d.is_boolean()) =>
            {
                Err(ApiError::invalid_param("tool_choice", "tool_choice.disable_parallel_tool_use must be a boolean"))
            }
            Some("tool") if !choice.and_then(|c| c.get("name")).is_some_and(Json::is_string) => {
                Err(ApiError::invalid_param("tool_choice", "tool_choice of type \"tool\" needs the tool's \"name\""))
            }
            None | Some("auto" | "any" | "tool" | "none") => Ok(kind),
            Some(other) => Err(ApiError::invalid_param(
                "tool_choice",
                format!("unknown tool_choice type {other:?} (auto, any, tool or none)"),
            )),
        }
    }

    /// `tool_choice` as the shared choice, and whether parallel calls are allowed (not
    /// `disable_parallel_tool_use`). Its shape is checked by [`openai_tools`](Self::openai_tools).
    pub(crate) fn tool_choice(&self) -> (ToolChoice, bool) {
        let c = self.tool_choice.as_ref().filter(|c| !c.is_null());
        let parallel = !c.and_then(|c| c.get("disable_parallel_tool_use")).and_then(Json::as_bool).unwrap_or(false);
        let choice = match c.and_then(|c| c.get("type")).and_then(Json::as_str) {
            Some("none") => ToolChoice::None,
            Some("any") => ToolChoice::Required,
            Some("tool") => match c.and_then(|c| c.get("name")).and_then(Json::as_str) {
                Some(name) => ToolChoice::Named(name.to_string()),
                None => ToolChoice::Auto,
            },
            _ => ToolChoice::Auto,
        };
        (choice, parallel)
    }

    /// Template keyword arguments: `enable_thinking` from `thinking`.
    pub fn template_kwargs(&self) -> Result<Map<String, Json>, ApiError> {
        let mut kwargs = Map::new();
        match self.thinking.as_ref().filter(|t| !t.is_null()).map(|t| t.get("type").and_then(Json::as_str)) {
            None => {}
            Some(Some("enabled")) => {
                kwargs.insert("enable_thinking".into(), Json::Bool(true));
            }
            Some(Some("disabled")) => {
                kwargs.insert("enable_thinking".into(), Json::Bool(false));
            }
            Some(_) => {
                return Err(ApiError::invalid_param("thinking", "thinking.type must be \"enabled\" or \"disabled\""))
            }
        }
        if let Some(budget) = self.thinking.as_ref().and_then(|t| t.get("budget_tokens")) {
            if !(budget.is_null() || budget.is_i64() || budget.is_u64()) {
                return Err(ApiError::invalid_param("thinking", "thinking.budget_tokens must be an integer"));
            }
        }
        Ok(kwargs)
    }
}

/// The text of a list of `{"type": "text", "text": ...}` blocks, joined.
fn text_blocks(blocks: &[Json], param: &str) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        match (b.get("type").and_then(Json::as_str), b.get("text")) {
            (Some("text"), Some(Json::String(t))) => texts.push(t.as_str()),
            _ => {
                return Err(ApiError::invalid_param(
                    &format!("{param}[{j}]"),
                    format!("{param}[{j}] must be a text block {{\"type\": \"text\", \"text\": ...}}"),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// One Anthropic tool (`param` names it in errors) as an OpenAI-style definition, checked.
fn openai_tool(t: &Json, param: &str) -> Result<Json, ApiError> {
    let name = t
        .get("name")
        .and_then(Json::as_str)
        .ok_or_else(|| ApiError::invalid_param(param, format!("{param}.name must be a string")))?;
    let mut function = Map::new();
    function.insert("name".into(), Json::String(name.to_string()));
    if let Some(d) = t.get("description") {
        function.insert("description".into(), d.clone());
    }
    if let Some(s) = t.get("input_schema") {
        function.insert("parameters".into(), s.clone());
    }
    let tool = json!({"type": "function", "function": function});
    check_tool(&tool, param)?;
    Ok(tool)
}

/// One message's content blocks as template messages: text joined; an assistant's `tool_use` blocks as
/// `tool_calls` and its `thinking` as `reasoning_content`; a user's `tool_result` blocks as `tool` messages
/// (before the user's own text, which follows them in the conversation).
fn convert_blocks(role: &str, blocks: &[Json], param: &str, out: &mut Vec<Json>) -> Result<(), ApiError> {
    let mut parts = MessageParts::default();
    for (j, b) in blocks.iter().enumerate() {
        convert_block(role, b, &format!("{param}.content[{j}]"), &mut parts, out)?;
    }
    if let Some(msg) = parts.into_message(role) {
        out.push(msg);
    }
    Ok(())
}

/// What one message's blocks add to its own template message.
#[derive(Default)]
struct MessageParts {
    texts: Vec<String>,
    calls: Vec<Json>,
    reasoning: Vec<String>,
}

impl MessageParts {
    /// The message, or `None` for a user message that was only tool results.
    fn into_message(self, role: &str) -> Option<Json> {
        if self.texts.is_empty() && self.calls.is_empty() && self.reasoning.is_empty() && role == "user" {
            return None;
        }
        let mut msg = json!({"role": role, "content": self.texts.join("\n")});
        if !self.calls.is_empty() {
            msg["tool_calls"] = Json::Array(self.calls);
        }
        if !self.reasoning.is_empty() {
            msg["reasoning_content"] = Json::String(self.reasoning.join("\n"));
        }
        Some(msg)
    }
}

/// One content block (`p` names it in errors): into `parts`, or, a `tool_result`, straight to `out`.
fn convert_block(role: &str, b: &Json, p: &str, parts: &mut MessageParts, out: &mut Vec<Json>) -> Result<(), ApiError> {
    match (role, b.get("type").and_then(Json::as_str)) {
        (_, Some("text")) => match b.get("text") {
            Some(Json::String(t)) => parts.texts.push(t.clone()),
            _ => return Err(block_error(p, "a text block needs a string \"text\"")),
        },
        ("assistant", Some("tool_use")) => parts.calls.push(tool_use_call(b, p)?),
        ("assistant", Some("thinking")) => match (b.get("thinking"), optional_string(b, "signature")) {
            (Some(Json::String(t)), true) => parts.reasoning.push(t.clone()),
            _ => {
                return Err(block_error(
                    p,
                    "a thinking block needs a string \"thinking\" (and a string \"signature\", if any)",
                ))
            }
        },
        ("assistant", Some("redacted_thinking")) if optional_string(b, "data") => {}
        ("assistant", Some("redacted_thinking")) => {
            return Err(block_error(p, "redacted_thinking.data must be a string"))
        }
        ("user", Some("tool_result")) => out.push(tool_result_message(b, p)?),
        (_, Some(kind @ ("image" | "document"))) => {
            return Err(block_error(p, &format!("{kind} blocks are not supported (text-only model)")))
        }
        (_, kind) => {
            let what = format!("unsupported content block type {:?} for role {role}", kind.unwrap_or("?"));
            return Err(block_error(p, &what));
        }
    }
    Ok(())
}

/// An assistant's `tool_use` block as an OpenAI-style tool call.
fn tool_use_call(b: &Json, p: &str) -> Result<Json, ApiError> {
    let (Some(Json::String(id)), Some(Json::String(name))) = (b.get("id"), b.get("name")) else {
        return Err(block_error(p, "a tool_use block needs string \"id\" and \"name\""));
    };
    let input = match b.get("input") {
        Some(v @ Json::Object(_)) => v.clone(),
        None | Some(Json::Null) => json!({}),
        Some(_) => return Err(block_error(p, "tool_use.input must be an object")),
    };
    Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": input}}))
}

/// A user's `tool_result` block as a `tool` message.
fn tool_result_message(b: &Json, p: &str) -> Result<Json, ApiError> {
    let Some(Json::String(id)) = b.get("tool_use_id") else {
        return Err(block_error(p, "a tool_result block needs a string \"tool_use_id\""));
    };
    if !matches!(b.get("is_error"), None | Some(Json::Null) | Some(Json::Bool(_))) {
        return Err(block_error(p, "tool_result.is_error must be a boolean"));
    }
    let content = match b.get("content") {
        None | Some(Json::Null) => String::new(),
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => text_blocks(parts, &format!("{p}.content"))?,
        Some(_) => return Err(block_error(p, "tool_result.content must be a string or a list of text blocks")),
    };
    Ok(json!({"role": "tool", "tool_call_id": id, "content": content}))
}

/// The 400 for content block `p`: `"{p}: {what}"`.
fn block_error(p: &str, what: &str) -> ApiError {
    ApiError::invalid_param(p, format!("{p}: {what}"))
}

/// `key` is absent, null or a string.
fn optional_string(block: &Json, key: &str) -> bool {
    matches!(block.get(key), None | Some(Json::Null) | Some(Json::String(_)))
}

/// Anthropic's `stop_reason` and `stop_sequence` for an OpenAI finish reason and the stop string that matched.
pub fn stop_reason(reason: &str, stop_string: Option<String>) -> (&'static str, Option<String>) {
    match (reason, stop_string) {
        ("length", _) => ("max_tokens", None),
        ("tool_calls", _) => ("tool_use", None),
        (_, Some(s)) => ("stop_sequence", Some(s)),
        _ => ("end_turn", None),
    }
}

/// `usage` in Anthropic's shape. With `--enable-cache-report`, `input_tokens` excludes the cached prefix and
/// `cache_read_input_tokens` counts it.
pub fn usage(u: &Usage) -> Json {
    match &u.prompt_tokens_details {
        Some(d) => json!({
            "input_tokens": u.prompt_tokens.saturating_sub(d.cached_tokens),
            "cache_read_input_tokens": d.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": u.completion_tokens,
        }),
        None => json!({"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Json) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn blocks_become_openai_style_template_messages() {
        let r = req(json!({"max_tokens": 4, "system": "S", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "42"}]}]}));
        assert_eq!(
            r.template_messages().unwrap(),
            vec![
                json!({"role": "system", "content": "S"}),
                json!({"role": "user", "content": "a\nb"}),
                json!({"role": "assistant", "content": "calling", "reasoning_content": "hm",
                   "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}),
                json!({"role": "tool", "tool_call_id": "t1", "content": "42"}),
            ]
        );
    }

    #[test]
    fn tools_thinking_and_stop_reasons() {
        let r = req(json!({"messages": [], "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                           "thinking": {"type": "enabled", "budget_tokens": 100}}));
        assert_eq!(
            r.openai_tools().unwrap().unwrap(),
            vec![json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})]
        );
        assert_eq!(r.template_kwargs().unwrap().get("enable_thinking"), Some(&Json::Bool(true)));
        let none = req(json!({"messages": [], "tools": [{"name": "f"}], "tool_choice": {"type": "none"}}));
        assert_eq!(none.openai_tools().unwrap(), None);
        assert_eq!(stop_reason("length", None), ("max_tokens", None));
        assert_eq!(stop_reason("stop", Some("END".into())), ("stop_sequence", Some("END".into())));
        assert_eq!(stop_reason("stop", None), ("end_turn", None));
        assert_eq!(stop_reason("tool_calls", Some("x".into())), ("tool_use", None));
        assert_eq!(r.tool_choice(), (ToolChoice::Auto, true));
        let any = req(json!({"messages": [], "tool_choice": {"type": "any", "disable_parallel_tool_use": true}}));
        assert_eq!(any.tool_choice(), (ToolChoice::Required, false));
        let named =
            req(json!({"messages": [], "tools": [{"name": "f"}], "tool_choice": {"type": "tool", "name": "f"}}));
        assert_eq!(named.tool_choice(), (ToolChoice::Named("f".into()), true));
        assert_eq!(none.tool_choice(), (ToolChoice::None, true));
        for bad in [json!({"type": "tool"}), json!({"type": "auto", "disable_parallel_tool_use": "yes"})] {
            let r = req(json!({"messages": [], "tools": [{"name": "f"}], "tool_choice": bad}));
            assert!(r.openai_tools().is_err(), "{bad}");
        }
        assert_eq!(error_type(StatusCode::SERVICE_UNAVAILABLE), "overloaded_error");
        assert_eq!(error_type(StatusCode::PAYLOAD_TOO_LARGE), "request_too_large");
    }
}
