//! OpenAI wire types (`/v1/chat/completions`, `/v1/completions`) and their validation.
//!
//! Requests deserialize leniently (unknown fields are ignored, `null` means absent) and are then checked
//! field by field, so every refusal names the field at fault in an OpenAI-shaped 400. Fields whose shape
//! varies (`messages`, `content`, `stop`, `prompt`) are taken as raw JSON and checked by hand for the same
//! reason. The sampling and budget fields every API shares are checked in `validation.rs`.

use crate::http::openai_error::ApiError;
use crate::http::output::ToolChoice;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

/// Sampling and budget fields shared by both endpoints.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    /// A string or a list of strings.
    pub stop: Option<Json>,
    /// Extra token ids that end the request (vLLM extension).
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub logit_bias: Option<Json>,
    /// OpenAI's penalties over the tokens generated so far, in [-2, 2].
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// Only 1 (off) is served.
    pub repetition_penalty: Option<f64>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    /// Any value is accepted: one model is served.
    pub model: Option<String>,
    pub messages: Json,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Json>>,
    pub reasoning_effort: Option<String>,
    /// vLLM extension; default true.
    pub add_generation_prompt: Option<bool>,
    pub response_format: Option<Json>,
    pub function_call: Option<Json>,
    pub functions: Option<Json>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub user: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, a list of token ids, or a list of either (a batch: `n` choices each).
    pub prompt: Json,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    pub logprobs: Option<i64>,
    pub user: Option<String>,
}

/// The prompt of a completion request, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

impl ChatCompletionRequest {
    /// Refuses what FreeToken does not serve (REFERENCES 4.10).
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if let Some(rf) = &self.response_format {
            let kind = rf.get("type").and_then(Json::as_str).unwrap_or("");
            if !rf.is_null() && kind != "text" {
                return Err(ApiError::invalid_param(
                    "response_format",
                    format!("response_format {:?} is not supported (only \"text\")", kind),
                ));
            }
        }
        if self.function_call.as_ref().is_some_and(|v| !v.is_null())
            || self.functions.as_ref().is_some_and(|v| !v.is_null())
        {
            return Err(ApiError::invalid_param(
                "function_call",
                "legacy function_call / functions are not supported; use tools",
            ));
        }
        for (i, tool) in self.tools.iter().flatten().enumerate() {
            check_tool(tool, &format!("tools[{i}]"))?;
        }
        match &self.tool_choice {
            None | Some(Json::Null) => {}
            Some(Json::String(s)) if matches!(s.as_str(), "none" | "auto" | "required") => {}
            Some(choice @ Json::Object(_)) if choice.get("type").and_then(Json::as_str) == Some("function")
                && choice.get("function").and_then(|f| f.get("name")).is_some_and(Json::is_string) => {}
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        }
        Ok(())
    }

    /// `tool_choice` (its shape is checked by [`check_unsupported`](Self::check_unsupported)); absent means
    /// `auto` (with no tools, nothing to call).
    pub(crate) fn tool_choice(&self) -> ToolChoice {
        match &self.tool_choice {
            Some(Json::String(s)) if s == "none" => ToolChoice::None,
            Some(Json::String(s)) if s == "required" => ToolChoice::Required,
            Some(c @ Json::Object(_)) => match c.get("function").and_then(|f| f.get("name")).and_then(Json::as_str) {
                Some(name) => ToolChoice::Named(name.to_string()),
                None => ToolChoice::Auto,
            },
            _ => ToolChoice::Auto,
        }
    }

    /// The messages as the chat template wants them: roles checked (`developer` becomes `system`), text
    /// parts joined into one string, `null` assistant content as `""`, tool-call arguments given as JSON
    /// strings parsed into objects (HF templates iterate over them).
    pub fn template_messages(&self) -> Result<Vec<Json>, ApiError> {
        let items = match &self.messages {
            Json::Array(items) => items,
            _ => return Err(ApiError::invalid_param("messages", "messages must be a list of message objects")),
        };
        if items.is_empty() {
            return Err(ApiError::invalid_param("messages", "messages must not be empty"));
        }
        items.iter().enumerate().map(|(i, m)| template_message(m, &format!("messages[{i}]"))).collect()
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }
}

/// One message (`param` names it in errors) as the chat template wants it; checked in the order role,
/// content, `name` / `tool_call_id`, `tool_calls`.
fn template_message(m: &Json, param: &str) -> Result<Json, ApiError> {
    let Json::Object(obj) = m else {
        return Err(ApiError::invalid_param(param, format!("{param} must be an object")));
    };
    let mut obj = obj.clone();
    let role = message_role(&obj, param)?;
    obj.insert("role".into(), Json::String(role.clone()));
    let content = message_content(&obj, &role, param)?;
    obj.insert("content".into(), Json::String(content));
    for key in ["name", "tool_call_id"] {
        if !matches!(obj.get(key), None | Some(Json::Null) | Some(Json::String(_))) {
            return Err(ApiError::invalid_param(&format!("{param}.{key}"), format!("{param}.{key} must be a string")));
        }
    }
    check_tool_calls(&obj, param)?;
    parse_tool_call_arguments(&mut obj);
    Ok(Json::Object(obj))
}

/// The message's role, checked; `developer` as `system`.
fn message_role(obj: &Map<String, Json>, param: &str) -> Result<String, ApiError> {
    let role_param = format!("{param}.role");
    let role = match obj.get("role") {
        Some(Json::String(r)) => r,
        Some(_) => return Err(ApiError::invalid_param(&role_param, format!("{param}.role must be a string"))),
        None => return Err(ApiError::invalid_param(&role_param, format!("{param}.role is required"))),
    };
    match role.as_str() {
        "system" | "user" | "assistant" | "tool" => Ok(role.clone()),
        "developer" => Ok("system".to_string()),
        other => Err(ApiError::invalid_param(
            &role_param,
            format!("unknown role {other:?} in {param} (expected system, developer, user, assistant or tool)"),
        )),
    }
}

/// The message's content as one string: text parts joined, absent or `null` as `""` (assistant messages only).
fn message_content(obj: &Map<String, Json>, role: &str, param: &str) -> Result<String, ApiError> {
    match obj.get("content") {
        None | Some(Json::Null) => {
            if role != "assistant" {
                return Err(ApiError::invalid_param(
                    &format!("{param}.content"),
                    format!("{param}.content is required"),
                ));
            }
            Ok(String::new())
        }
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => text_parts(parts, param),
        Some(_) => Err(ApiError::invalid_param(
            &format!("{param}.content"),
            format!("{param}.content must be a string or a list of text parts"),
        )),
    }
}

/// A content list's text parts, joined with newlines; any other kind of part is refused.
fn text_parts(parts: &[Json], param: &str) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Json::as_str).unwrap_or("");
        match (kind, part.get("text")) {
            ("text" | "input_text" | "output_text", Some(Json::String(t))) => texts.push(t.as_str()),
            _ => {
                return Err(ApiError::invalid_param(
                    &format!("{param}.content[{j}]"),
                    format!(
                        "{param}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"
                    ),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// `tool_calls`, when present, is a list of well-formed calls.
fn check_tool_calls(obj: &Map<String, Json>, param: &str) -> Result<(), ApiError> {
    match obj.get("tool_calls") {
        None | Some(Json::Null) => Ok(()),
        Some(Json::Array(calls)) => {
            for (j, call) in calls.iter().enumerate() {
                check_tool_call(call, &format!("{param}.tool_calls[{j}]"))?;
            }
            Ok(())
        }
        Some(_) => {
            Err(ApiError::invalid_param(&format!("{param}.tool_calls"), format!("{param}.tool_calls must be a list")))
        }
    }
}

/// Tool-call arguments given as JSON text that parses to an object become that object (HF templates iterate
/// over them); other text is left as it is.
fn parse_tool_call_arguments(obj: &mut Map<String, Json>) {
    let Some(Json::Array(calls)) = obj.get_mut("tool_calls") else { return };
    for call in calls.iter_mut() {
        if let Some(args) = call.get_mut("function").and_then(|f| f.get_mut("arguments")) {
            if let Json::String(s) = args {
                if let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(s) {
                    *args = parsed;
                }
            }
        }
    }
}

/// A tool definition as OpenAI takes it: `{"type": "function", "function": {"name": "...", "description"?: "...",
/// "parameters"?: {JSON Schema object}}}`. Templates iterate over these, so garbage is refused here with a 400
/// rather than left to fail (or silently render) inside the template.
pub(crate) fn check_tool(tool: &Json, param: &str) -> Result<(), ApiError> {
    let bad = |what: &str| Err(ApiError::invalid_param(param, format!("{param}: {what}")));
    let Json::Object(t) = tool else {
        return bad("a tool must be an object {\"type\": \"function\", \"function\": {...}}");
    };
    if t.get("type").and_then(Json::as_str) != Some("function") {
        return bad("type must be \"function\"");
    }
    let Some(Json::Object(f)) = t.get("function") else {
        return bad("function must be an object with a name");
    };
    if !f.get("name").is_some_and(Json::is_string) {
        return bad("function.name must be a string");
    }
    if !matches!(f.get("description"), None | Some(Json::Null) | Some(Json::String(_))) {
        return bad("function.description must be a string");
    }
    if !matches!(f.get("parameters"), None | Some(Json::Null) | Some(Json::Object(_))) {
        return bad("function.parameters must be a JSON Schema object");
    }
    Ok(())
}

/// An assistant message's tool call: `{"id"?, "type"?: "function", "function": {"name", "arguments"}}`, the
/// arguments as JSON text (OpenAI) or an object.
fn check_tool_call(call: &Json, param: &str) -> Result<(), ApiError> {
    let bad = |what: &str| Err(ApiError::invalid_param(param, format!("{param}: {what}")));
    let Json::Object(c) = call else {
        return bad("a tool call must be an object");
    };
    if !matches!(c.get("id"), None | Some(Json::Null) | Some(Json::String(_))) {
        return bad("id must be a string");
    }
    if !matches!(c.get("type").map(|t| t.as_str()), None | Some(Some("function"))) {
        return bad("type must be \"function\"");
    }
    let Some(Json::Object(f)) = c.get("function") else {
        return bad("function must be an object with a name and arguments");
    };
    if !f.get("name").is_some_and(Json::is_string) {
        return bad("function.name must be a string");
    }
    if !matches!(f.get("arguments"), None | Some(Json::String(_)) | Some(Json::Object(_))) {
        return bad("function.arguments must be a JSON string (or an object)");
    }
    Ok(())
}

impl CompletionRequest {
    /// `best_of` is checked with `n` in `validation.rs`.
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
        }
        Ok(())
    }

    /// The prompts of the batch: a string, a list of token ids, or a list of either (one choice set each).
    pub fn prompt_inputs(&self) -> Result<Vec<PromptInput>, ApiError> {
        let bad = || {
            ApiError::invalid_param(
                "prompt",
                "prompt must be a string, a list of token ids, or a list of strings or of token-id lists",
            )
        };
        let ids = |items: &[Json]| -> Result<Vec<u32>, ApiError> {
            items
                .iter()
                .map(|v| v.as_u64().filter(|&x| x <= u32::MAX as u64).map(|x| x as u32).ok_or_else(bad))
                .collect()
        };
        match &self.prompt {
            Json::String(s) => Ok(vec![PromptInput::Text(s.clone())]),
            Json::Array(items) if items.is_empty() => {
                Err(ApiError::invalid_param("prompt", "prompt must not be empty"))
            }
            Json::Array(items) if items.iter().all(Json::is_number) => Ok(vec![PromptInput::Tokens(ids(items)?)]),
            Json::Array(items) => items
                .iter()
                .map(|item| match item {
                    Json::String(s) => Ok(PromptInput::Text(s.clone())),
                    Json::Array(inner) if !inner.is_empty() => Ok(PromptInput::Tokens(ids(inner)?)),
                    _ => Err(bad()),
                })
                .collect(),
            _ => Err(bad()),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }
}

// ---- responses -------------------------------------------------------------------------------------------

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// Only with `--enable-cache-report`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` when the answer is only tool calls.
    pub content: Option<String>,
    /// What the reasoning parser split out of a `<think>` block (absent when there was none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

/// A tool call the model made: `arguments` is the JSON object as text.
#[derive(Clone, Debug, Serialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Clone, Debug, Serialize)]
pub struct FunctionCallOut {
    pub name: String,
    pub arguments: String,
}

/// One streamed piece of a tool call: the first names it (`id`, `type`, `function.name`, `arguments: ""`),
/// the next ones add to its `arguments`.
#[derive(Clone, Debug, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallDelta,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessageOut,
    pub logprobs: Option<Json>,
    pub finish_reason: &'static str,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<Json>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Clone, Debug, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<Json>,
    pub finish_reason: Option<&'static str>,
}

/// Both the whole `/v1/completions` answer and its stream chunks (same shape, `usage` only where due).
#[derive(Clone, Debug, Serialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Json) -> ChatCompletionRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn message_normalisation() {
        let r = chat(json!({"messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "content": "42", "tool_call_id": "1"}
        ]}));
        let m = r.template_messages().unwrap();
        assert_eq!(m[0]["role"], "system");
        assert_eq!(m[1]["content"], "a\nb");
        assert_eq!(m[2]["content"], "");
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(m[3]["tool_call_id"], "1");
        for bad in [
            json!({"messages": []}),
            json!({"messages": "hi"}),
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            json!({"messages": [{"content": "x"}]}),
            json!({"messages": [{"role": "user"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            json!({"messages": [{"role": "user", "content": 5}]}),
        ] {
            assert_eq!(chat(bad.clone()).template_messages().unwrap_err().status.as_u16(), 400, "{bad}");
        }
        assert!(chat(json!({"messages": [], "response_format": {"type": "json_object"}})).check_unsupported().is_err());
        assert!(chat(json!({"messages": [], "response_format": {"type": "text"}})).check_unsupported().is_ok());
        assert!(chat(json!({"messages": [], "function_call": "auto"})).check_unsupported().is_err());
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}});
        assert!(chat(json!({"messages": [], "tools": [tool], "tool_choice": "auto"})).check_unsupported().is_ok());
        assert!(chat(json!({"messages": [], "tool_choice": {"type": "function", "function": {"name": "f"}}}))
            .check_unsupported()
            .is_ok());
        for bad in [
            json!({"messages": [], "tools": [5]}),
            json!({"messages": [], "tools": [{"type": "function"}]}),
            json!({"messages": [], "tools": [{"function": {"name": "f"}}]}),
            json!({"messages": [], "tools": [{"type": "function", "function": {"name": 5}}]}),
            json!({"messages": [], "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            json!({"messages": [], "tool_choice": "sometimes"}),
            json!({"messages": [], "tool_choice": 5}),
        ] {
            assert_eq!(chat(bad.clone()).check_unsupported().unwrap_err().status.as_u16(), 400, "{bad}");
        }
        for bad in [
            json!({"messages": [{"role": "user", "content": "x", "name": 5}]}),
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": 5}]}),
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [5]}]}),
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"arguments": "{}"}}]}]}),
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]}),
        ] {
            assert_eq!(chat(bad.clone()).template_messages().unwrap_err().status.as_u16(), 400, "{bad}");
        }
    }

    #[test]
    fn prompt_forms() {
        let p = |v: Json| serde_json::from_value::<CompletionRequest>(json!({"prompt": v})).unwrap().prompt_inputs();
        let text = |t: &str| PromptInput::Text(t.into());
        assert_eq!(p(json!("hi")).unwrap(), vec![text("hi")]);
        assert_eq!(p(json!(["hi"])).unwrap(), vec![text("hi")]);
        assert_eq!(p(json!([1, 2])).unwrap(), vec![PromptInput::Tokens(vec![1, 2])]);
        assert_eq!(p(json!([[1, 2]])).unwrap(), vec![PromptInput::Tokens(vec![1, 2])]);
        assert_eq!(p(json!(["a", "b"])).unwrap(), vec![text("a"), text("b")]);
        assert_eq!(p(json!(["a", [3]])).unwrap(), vec![text("a"), PromptInput::Tokens(vec![3])]);
        assert!(p(json!([[1], []])).is_err());
        assert!(p(json!([["a"]])).is_err());
        assert!(p(json!([])).is_err());
        assert!(p(json!([-1])).is_err());
        assert!(p(json!(5)).is_err());
    }
}
