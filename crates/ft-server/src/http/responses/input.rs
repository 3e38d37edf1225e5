//! Responses input items as chat template messages.
//!
//! ```text
//!   message (user / system / developer)      ─▶ {"role": user | system, "content": text}
//!   reasoning, message (assistant),          ─▶ one {"role": "assistant", "reasoning_content", "content",
//!     function_call … (in a row)                      "tool_calls": [{"id": call_id, "function": {name, arguments}}]}
//!   function_call_output                      ─▶ {"role": "tool", "tool_call_id": call_id, "content": output}
//! ```
//!
//! `instructions` and the system / developer messages before the first other item become one leading system
//! message (templates such as Qwen's accept a system message only first). Text parts (`input_text`,
//! `output_text`, `text`, `refusal`) are joined with newlines; images, files and audio are refused (text-only
//! model), as are item types other than these four.

use crate::http::openai_error::ApiError;
use serde_json::{json, Value as Json};

/// The request's `input` as items: a string is one user message; a list must not be empty.
pub(crate) fn input_items(input: Option<&Json>) -> Result<Vec<Json>, ApiError> {
    match input {
        Some(Json::String(s)) => Ok(vec![json!({"type": "message", "role": "user", "content": s})]),
        Some(Json::Array(items)) if !items.is_empty() => Ok(items.clone()),
        Some(Json::Array(_)) => Err(ApiError::invalid_param("input", "input must not be empty")),
        None | Some(Json::Null) => Err(ApiError::invalid_param("input", "input is required")),
        Some(_) => Err(ApiError::invalid_param("input", "input must be a string or a list of input items")),
    }
}

/// The template messages for `instructions` and a conversation's `items`, each item checked (named
/// `input[i]` in errors).
pub(crate) fn template_messages(instructions: Option<&str>, items: &[Json]) -> Result<Vec<Json>, ApiError> {
    let mut b = Builder::default();
    for (i, item) in items.iter().enumerate() {
        b.add(item, &format!("input[{i}]"))?;
    }
    Ok(b.finish(instructions))
}

#[derive(Default)]
struct Builder {
    out: Vec<Json>,
    /// The assistant message being assembled from reasoning, assistant message and function_call items.
    assistant: Option<Assistant>,
}

#[derive(Default)]
struct Assistant {
    reasoning: Vec<String>,
    texts: Vec<String>,
    calls: Vec<Json>,
}

impl Builder {
    fn add(&mut self, item: &Json, p: &str) -> Result<(), ApiError> {
        match item_type(item, p)? {
            "message" => {
                let (role, text) = message(item, p)?;
                if role == "assistant" {
                    self.assistant(|a| !a.calls.is_empty()).texts.push(text);
                } else {
                    self.flush();
                    self.out.push(json!({"role": role, "content": text}));
                }
            }
            "reasoning" => {
                let text = reasoning_text(item, p)?;
                self.assistant(|a| !a.texts.is_empty() || !a.calls.is_empty()).reasoning.push(text);
            }
            "function_call" => {
                let call = function_call(item, p)?;
                self.assistant(|_| false).calls.push(call);
            }
            "function_call_output" => {
                let message = tool_message(item, p)?;
                self.flush();
                self.out.push(message);
            }
            other => return Err(item_error(p, &format!("input items of type {other:?} are not supported"))),
        }
        Ok(())
    }

    /// The assistant message to add to: the pending one, unless `starts_anew` says this item begins another.
    fn assistant(&mut self, starts_anew: impl Fn(&Assistant) -> bool) -> &mut Assistant {
        if self.assistant.as_ref().is_some_and(starts_anew) {
            self.flush();
        }
        self.assistant.get_or_insert_with(Assistant::default)
    }

    fn flush(&mut self) {
        let Some(a) = self.assistant.take() else { return };
        let mut m = json!({"role": "assistant", "content": a.texts.join("\n")});
        if !a.reasoning.is_empty() {
            m["reasoning_content"] = Json::String(a.reasoning.join("\n"));
        }
        if !a.calls.is_empty() {
            m["tool_calls"] = Json::Array(a.calls);
        }
        self.out.push(m);
    }

    fn finish(mut self, instructions: Option<&str>) -> Vec<Json> {
        self.flush();
        let leading = self.out.iter().take_while(|m| m["role"] == "system").count();
        let mut texts: Vec<String> = instructions.map(String::from).into_iter().collect();
        texts.extend(self.out.drain(..leading).map(|m| m["content"].as_str().unwrap_or_default().to_string()));
        if !texts.is_empty() {
            self.out.insert(0, json!({"role": "system", "content": texts.join("\n\n")}));
        }
        self.out
    }
}

/// The item's `type`; a typeless item with a `role` is a message.
fn item_type<'a>(item: &'a Json, p: &str) -> Result<&'a str, ApiError> {
    if !item.is_object() {
        return Err(item_error(p, "an input item must be an object"));
    }
    match item.get("type") {
        Some(Json::String(t)) => Ok(t),
        None | Some(Json::Null) if item.get("role").is_some() => Ok("message"),
        _ => Err(item_error(p, "an input item needs a string \"type\" (or a \"role\", for a message)")),
    }
}

/// A message's role (`developer` as `system`) and its text.
fn message(item: &Json, p: &str) -> Result<(&'static str, String), ApiError> {
    let role = match item.get("role").and_then(Json::as_str) {
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some("system" | "developer") => "system",
        _ => return Err(item_error(p, "a message's role must be user, assistant, system or developer")),
    };
    let text = match item.get("content") {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => text_parts(parts, &format!("{p}.content"))?,
        _ => return Err(item_error(p, "a message's content must be a string or a list of content parts")),
    };
    Ok((role, text))
}

/// The text of a list of content parts, joined with newlines.
fn text_parts(parts: &[Json], p: &str) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Json::as_str);
        let key = if kind == Some("refusal") { "refusal" } else { "text" };
        match (kind, part.get(key)) {
            (Some("input_text" | "output_text" | "text" | "refusal"), Some(Json::String(t))) => texts.push(t.as_str()),
            (Some(k @ ("input_image" | "input_file" | "input_audio")), _) => {
                return Err(item_error(&format!("{p}[{j}]"), &format!("{k} parts are not supported (text-only model)")))
            }
            _ => return Err(item_error(&format!("{p}[{j}]"), "a content part must be a text part with a string text")),
        }
    }
    Ok(texts.join("\n"))
}

/// A `function_call` item as a chat tool call (arguments that parse to an object as that object, as
/// templates iterate over them).
fn function_call(item: &Json, p: &str) -> Result<Json, ApiError> {
    let (Some(Json::String(call_id)), Some(Json::String(name))) = (item.get("call_id"), item.get("name")) else {
        return Err(item_error(p, "a function_call needs string \"call_id\" and \"name\""));
    };
    let Some(Json::String(arguments)) = item.get("arguments") else {
        return Err(item_error(p, "a function_call's arguments must be a JSON string"));
    };
    let arguments = match serde_json::from_str::<Json>(arguments) {
        Ok(parsed @ Json::Object(_)) => parsed,
        _ => Json::String(arguments.clone()),
    };
    Ok(json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}

/// A `function_call_output` item as a `tool` message.
fn tool_message(item: &Json, p: &str) -> Result<Json, ApiError> {
    let Some(Json::String(call_id)) = item.get("call_id") else {
        return Err(item_error(p, "a function_call_output needs a string \"call_id\""));
    };
    let output = match item.get("output") {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Array(parts)) => text_parts(parts, &format!("{p}.output"))?,
        _ => return Err(item_error(p, "a function_call_output's output must be a string or a list of text parts")),
    };
    Ok(json!({"role": "tool", "tool_call_id": call_id, "content": output}))
}

/// A `reasoning` item's text: its `content` (reasoning_text parts), else its `summary` (summary_text parts).
fn reasoning_text(item: &Json, p: &str) -> Result<String, ApiError> {
    let texts = |key: &str, kind: &str| -> Result<Option<String>, ApiError> {
        match item.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Array(parts)) => {
                let mut out = Vec::with_capacity(parts.len());
                for part in parts {
                    match (part.get("type").and_then(Json::as_str), part.get("text")) {
                        (Some(k), Some(Json::String(t))) if k == kind => out.push(t.as_str()),
                        _ => return Err(item_error(p, &format!("reasoning {key} parts must be {kind} parts"))),
                    }
                }
                Ok((!out.is_empty()).then(|| out.join("\n")))
            }
            Some(_) => Err(item_error(p, &format!("a reasoning item's {key} must be a list"))),
        }
    };
    let content = texts("content", "reasoning_text")?;
    let summary = texts("summary", "summary_text")?;
    Ok(content.or(summary).unwrap_or_default())
}

fn item_error(p: &str, what: &str) -> ApiError {
    ApiError::invalid_param(p, format!("{p}: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_loop_becomes_chat_messages() {
        let items = vec![
            json!({"role": "developer", "content": "Be brief."}),
            json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}),
            json!({"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "call it"}]}),
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]}),
            json!({"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}),
            json!({"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "not json"}),
            json!({"type": "function_call_output", "call_id": "call_1", "output": "sunny"}),
            json!({"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]}),
        ];
        let m = template_messages(Some("You are helpful."), &items).unwrap();
        assert_eq!(
            m,
            vec![
                json!({"role": "system", "content": "You are helpful.\n\nBe brief."}),
                json!({"role": "user", "content": "Weather?"}),
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "call it", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}),
                json!({"role": "tool", "tool_call_id": "call_1", "content": "sunny"}),
                json!({"role": "tool", "tool_call_id": "call_2", "content": "noon"}),
            ]
        );
        // Reasoning after an answer starts the next assistant message; a later system message stays where it is.
        let items = vec![
            json!({"role": "user", "content": "a"}),
            json!({"role": "assistant", "content": "b"}),
            json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}),
            json!({"role": "system", "content": "c"}),
        ];
        let m = template_messages(None, &items).unwrap();
        assert_eq!(m[2], json!({"role": "assistant", "content": "", "reasoning_content": "s"}));
        assert_eq!(m[3], json!({"role": "system", "content": "c"}));
    }

    #[test]
    fn input_forms_and_refusals() {
        assert_eq!(input_items(Some(&json!("hi"))).unwrap()[0]["role"], "user");
        for bad in [json!([]), json!(5), Json::Null] {
            assert_eq!(input_items(Some(&bad)).unwrap_err().param.as_deref(), Some("input"), "{bad}");
        }
        for (bad, param) in [
            (json!(5), "input[0]"),
            (json!({"content": "x"}), "input[0]"),
            (json!({"role": "wizard", "content": "x"}), "input[0]"),
            (json!({"role": "user", "content": 5}), "input[0]"),
            (json!({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}), "input[0].content[0]"),
            (json!({"type": "function_call", "name": "f", "arguments": "{}"}), "input[0]"),
            (json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}), "input[0]"),
            (json!({"type": "function_call_output", "call_id": "c", "output": 5}), "input[0]"),
            (json!({"type": "reasoning", "summary": [{"type": "reasoning_text", "text": "x"}]}), "input[0]"),
            (json!({"type": "web_search_call", "id": "x"}), "input[0]"),
        ] {
            let e = template_messages(None, std::slice::from_ref(&bad)).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{bad}");
        }
    }
}
