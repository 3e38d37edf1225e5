//! The Responses request (`POST /v1/responses`) and its mapping onto the chat pipeline: `max_output_tokens`,
//! `temperature`, `top_p` (and `top_k`, an extension) become the shared sampling fields, the flat function
//! tools (`{"type": "function", "name", "description", "parameters"}`) the OpenAI chat definitions the
//! templates iterate over, `tool_choice` the shared [`ToolChoice`], `reasoning.effort` the template's
//! `enable_thinking` (`none`: off, any other effort: on, also passed as `reasoning_effort`). The input items
//! are converted in `input.rs`.
//!
//! Refused with a 400: `conversation`, `prompt` (stored prompts), `text.format` other than `text`,
//! `top_logprobs` above 0, tools other than functions, `background` with `stream` or without `store`.

use crate::http::openai_error::ApiError;
use crate::http::output::ToolChoice;
use crate::http::protocol::{check_tool, SamplingFields};
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

#[derive(Clone, Debug, Deserialize)]
pub struct ResponsesRequest {
    /// Any served name (or none).
    pub model: Option<String>,
    /// A string (one user message) or a list of input items.
    pub input: Option<Json>,
    /// A system message before the input (not carried over by `previous_response_id`).
    pub instructions: Option<Json>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    /// Default true.
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    /// `{"effort": ..., "summary": ...}`.
    pub reasoning: Option<Json>,
    /// `{"format": {"type": "text"}}` only.
    pub text: Option<Json>,
    pub truncation: Option<Json>,
    pub metadata: Option<Map<String, Json>>,
    pub user: Option<String>,
    pub background: Option<bool>,
    pub conversation: Option<Json>,
    pub prompt: Option<Json>,
    pub top_logprobs: Option<i64>,
}

/// Reasoning efforts OpenAI's clients send.
const EFFORTS: [&str; 7] = ["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// The body as a [`ResponsesRequest`] (400 for anything else).
pub(crate) fn parse(body: Result<crate::http::OpenAiJson<Json>, ApiError>) -> Result<ResponsesRequest, ApiError> {
    let crate::http::OpenAiJson(raw) = body?;
    if !raw.is_object() {
        return Err(ApiError::invalid("the request body must be a JSON object"));
    }
    serde_json::from_value(raw).map_err(|e| ApiError::invalid(format!("invalid request: {e}")))
}

fn present(v: &Option<Json>) -> Option<&Json> {
    v.as_ref().filter(|v| !v.is_null())
}

impl ResponsesRequest {
    /// Refuses what is not served (see the module doc).
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.background() && (self.stream == Some(true) || self.store == Some(false)) {
            return Err(ApiError::invalid_param(
                "background",
                "a background response is stored and not streamed (poll GET /v1/responses/{id})",
            ));
        }
        for (name, v) in [("conversation", &self.conversation), ("prompt", &self.prompt)] {
            if present(v).is_some() {
                return Err(ApiError::invalid_param(name, format!("{name} is not supported")));
            }
        }
        if let Some(text) = present(&self.text) {
            let kind = text.get("format").filter(|f| !f.is_null()).map(|f| f.get("type").and_then(Json::as_str));
            if !text.is_object() || matches!(kind, Some(k) if k != Some("text")) {
                return Err(ApiError::invalid_param("text", "only text.format {\"type\": \"text\"} is supported"));
            }
        }
        if let Some(t) = present(&self.truncation) {
            if !matches!(t.as_str(), Some("auto" | "disabled")) {
                return Err(ApiError::invalid_param("truncation", "truncation must be \"auto\" or \"disabled\""));
            }
        }
        if self.top_logprobs.is_some_and(|n| n != 0) {
            return Err(ApiError::invalid_param("top_logprobs", "top_logprobs is not supported"));
        }
        match present(&self.instructions) {
            None | Some(Json::String(_)) => Ok(()),
            Some(_) => Err(ApiError::invalid_param("instructions", "instructions must be a string")),
        }
    }

    /// `background`: answered at once (`in_progress`), generated on, polled with `GET`.
    pub fn background(&self) -> bool {
        self.background == Some(true)
    }

    /// `instructions`, if any.
    pub fn instructions(&self) -> Option<&str> {
        present(&self.instructions).and_then(Json::as_str)
    }

    /// The sampling fields for `validation::sampling` (`max_output_tokens` checked here to name it).
    pub fn sampling_fields(&self) -> Result<SamplingFields, ApiError> {
        if let Some(m) = self.max_output_tokens.filter(|&m| m < 1) {
            return Err(ApiError::invalid_param(
                "max_output_tokens",
                format!("max_output_tokens must be at least 1, got {m}"),
            ));
        }
        Ok(SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            max_tokens: self.max_output_tokens,
            ..Default::default()
        })
    }

    /// `tools` as OpenAI chat definitions, checked; `None` when there are none.
    pub fn chat_tools(&self) -> Result<Option<Vec<Json>>, ApiError> {
        let Some(tools) = self.tools.as_ref().filter(|t| !t.is_empty()) else { return Ok(None) };
        tools.iter().enumerate().map(|(i, t)| chat_tool(t, &format!("tools[{i}]"))).collect::<Result<_, _>>().map(Some)
    }

    /// `tool_choice`: `none`, `auto` (default), `required` or `{"type": "function", "name": ...}`.
    pub(crate) fn tool_choice(&self) -> Result<ToolChoice, ApiError> {
        match present(&self.tool_choice) {
            None => Ok(ToolChoice::Auto),
            Some(Json::String(s)) if s == "none" => Ok(ToolChoice::None),
            Some(Json::String(s)) if s == "auto" => Ok(ToolChoice::Auto),
            Some(Json::String(s)) if s == "required" => Ok(ToolChoice::Required),
            Some(c) if c.get("type").and_then(Json::as_str) == Some("function") => match c.get("name") {
                Some(Json::String(name)) => Ok(ToolChoice::Named(name.clone())),
                _ => Err(ApiError::invalid_param("tool_choice", "tool_choice of type \"function\" needs a \"name\"")),
            },
            Some(_) => Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
            )),
        }
    }

    /// Template keyword arguments from `reasoning.effort`.
    pub fn template_kwargs(&self) -> Result<Map<String, Json>, ApiError> {
        let mut kwargs = Map::new();
        let Some(reasoning) = present(&self.reasoning) else { return Ok(kwargs) };
        let bad = |what: &str| Err(ApiError::invalid_param("reasoning", what.to_string()));
        if !reasoning.is_object() {
            return bad("reasoning must be an object {\"effort\": ...}");
        }
        for key in ["summary", "generate_summary"] {
            if !matches!(reasoning.get(key), None | Some(Json::Null) | Some(Json::String(_))) {
                return bad(&format!("reasoning.{key} must be a string"));
            }
        }
        match reasoning.get("effort") {
            None | Some(Json::Null) => {}
            Some(Json::String(e)) if EFFORTS.contains(&e.as_str()) => {
                kwargs.insert("enable_thinking".into(), Json::Bool(e != "none"));
                kwargs.insert("reasoning_effort".into(), Json::String(e.clone()));
            }
            Some(_) => return bad(&format!("reasoning.effort must be one of {}", EFFORTS.join(", "))),
        }
        Ok(kwargs)
    }

    /// The fields every response object repeats from its request (`tools` in the request's flat shape).
    pub fn echo(&self, tools: &Option<Vec<Json>>, choice: &ToolChoice) -> Json {
        let tools: Vec<Json> = tools.iter().flatten().map(flat_tool).collect();
        let tool_choice = match choice {
            ToolChoice::None => json!("none"),
            ToolChoice::Auto => json!("auto"),
            ToolChoice::Required => json!("required"),
            ToolChoice::Named(name) => json!({"type": "function", "name": name}),
        };
        let effort = present(&self.reasoning).and_then(|r| r.get("effort")).cloned().unwrap_or(Json::Null);
        let summary = present(&self.reasoning).and_then(|r| r.get("summary")).cloned().unwrap_or(Json::Null);
        json!({
            "instructions": self.instructions(),
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata.clone().unwrap_or_default(),
            "parallel_tool_calls": self.parallel_tool_calls.unwrap_or(true),
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": effort, "summary": summary},
            "store": self.store.unwrap_or(true),
            "temperature": self.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": tools,
            "top_p": self.top_p,
            "truncation": present(&self.truncation).cloned().unwrap_or(json!("disabled")),
            "user": self.user,
            "background": self.background(),
        })
    }
}

/// A Responses function tool (`param` names it in errors) as an OpenAI chat definition, checked.
fn chat_tool(t: &Json, param: &str) -> Result<Json, ApiError> {
    match t.get("type").and_then(Json::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ApiError::invalid_param(param, format!("{param}: tools of type {other:?} are not supported")))
        }
        None => return Err(ApiError::invalid_param(param, format!("{param}: a tool needs a \"type\""))),
    }
    if !matches!(t.get("strict"), None | Some(Json::Null) | Some(Json::Bool(_))) {
        return Err(ApiError::invalid_param(param, format!("{param}: strict must be a boolean")));
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters"] {
        if let Some(v) = t.get(key) {
            function.insert(key.into(), v.clone());
        }
    }
    let tool = json!({"type": "function", "function": function});
    check_tool(&tool, param)?;
    Ok(tool)
}

/// A chat definition back in the Responses' flat shape (for the response object).
fn flat_tool(chat: &Json) -> Json {
    let f = &chat["function"];
    json!({"type": "function", "name": f["name"], "description": f.get("description").cloned().unwrap_or(Json::Null),
           "parameters": f.get("parameters").cloned().unwrap_or(Json::Null), "strict": Json::Null})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Json) -> ResponsesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn tools_choice_and_reasoning() {
        let r =
            req(json!({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}],
                           "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"effort": "none"}}));
        let tools = r.chat_tools().unwrap();
        assert_eq!(
            tools.as_ref().unwrap()[0],
            json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})
        );
        assert_eq!(r.tool_choice().unwrap(), ToolChoice::Named("f".into()));
        assert_eq!(r.template_kwargs().unwrap()["enable_thinking"], json!(false));
        let echo = r.echo(&tools, &ToolChoice::Named("f".into()));
        assert_eq!(echo["tools"][0]["name"], "f");
        assert_eq!(echo["tool_choice"], json!({"type": "function", "name": "f"}));
        assert_eq!((echo["store"].clone(), echo["parallel_tool_calls"].clone()), (json!(true), json!(true)));
        let high = req(json!({"reasoning": {"effort": "high"}}));
        assert_eq!(high.template_kwargs().unwrap()["enable_thinking"], json!(true));
        assert_eq!(high.template_kwargs().unwrap()["reasoning_effort"], json!("high"));
        assert!(req(json!({})).template_kwargs().unwrap().is_empty());
        assert_eq!(req(json!({"tool_choice": "required"})).tool_choice().unwrap(), ToolChoice::Required);
    }

    #[test]
    fn refusals_name_their_field() {
        for (bad, param) in [
            (json!({"tools": [{"type": "web_search"}]}), "tools[0]"),
            (json!({"tools": [{"type": "function"}]}), "tools[0]"),
            (json!({"tools": [{"type": "function", "name": "f", "parameters": 3}]}), "tools[0]"),
            (json!({"tool_choice": "sometimes"}), "tool_choice"),
            (json!({"tool_choice": {"type": "function"}}), "tool_choice"),
            (json!({"reasoning": {"effort": "extreme"}}), "reasoning"),
            (json!({"background": true, "stream": true}), "background"),
            (json!({"text": {"format": {"type": "json_schema"}}}), "text"),
            (json!({"truncation": "sometimes"}), "truncation"),
            (json!({"instructions": 5}), "instructions"),
            (json!({"max_output_tokens": 0}), "max_output_tokens"),
            (json!({"top_logprobs": 3}), "top_logprobs"),
        ] {
            let r = req(bad.clone());
            let e = r
                .check_unsupported()
                .and(r.chat_tools().map(drop))
                .and(r.tool_choice().map(drop))
                .and(r.template_kwargs().map(drop))
                .and(r.sampling_fields().map(drop))
                .unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{bad}");
        }
        let ok = req(json!({"text": {"format": {"type": "text"}}, "truncation": "auto", "background": false}));
        assert!(ok.check_unsupported().is_ok());
    }
}
