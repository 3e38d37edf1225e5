//! The response object and its output items, in the shapes the `openai` client's `types/responses` parse:
//! `reasoning` items (the reasoning as `content: [{"type": "reasoning_text"}]`, `summary: []`: raw reasoning,
//! not a summary), `message` items (`output_text` content), `function_call` items (`call_id`, `name`,
//! `arguments` as JSON text), `usage` with `input_tokens_details.cached_tokens` (counted under
//! `--enable-cache-report`, else 0) and `output_tokens_details.reasoning_tokens` (the reasoning text
//! re-encoded, at most the output tokens).

use crate::http::output::Message;
use crate::http::protocol::Usage;
use serde_json::{json, Value as Json};

/// A fresh id: `resp`, `msg`, `rs`, `fc` and 32 hex digits.
pub(crate) fn new_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

/// How a response ended (`in_progress` is the skeleton's own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Completed,
    /// The output budget ran out (`incomplete_details.reason: "max_output_tokens"`).
    Incomplete,
    Cancelled,
    Failed,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            Status::Incomplete => "incomplete",
            Status::Cancelled => "cancelled",
            Status::Failed => "failed",
        }
    }

    /// How a request that finished with OpenAI's finish `reason` ended (`cancelled`: `cancel` was asked for).
    pub fn of_finish(reason: &str, cancelled: bool) -> Status {
        match reason {
            _ if cancelled => Status::Cancelled,
            "length" => Status::Incomplete,
            _ => Status::Completed,
        }
    }

    /// The status of an output item that was still open when the response ended with this one.
    pub fn open_item_status(self) -> &'static str {
        match self {
            Status::Completed => "completed",
            _ => "incomplete",
        }
    }

    /// The stream's last event for a response that ended with this status.
    pub fn final_event(self) -> &'static str {
        match self {
            Status::Completed => "response.completed",
            Status::Failed => "response.failed",
            Status::Incomplete | Status::Cancelled => "response.incomplete",
        }
    }
}

/// A reasoning item; `text` `None`: no content part yet (as `output_item.added` announces it).
pub(crate) fn reasoning_item(id: &str, text: Option<&str>, status: &str) -> Json {
    let content: Vec<Json> = text.map(reasoning_part).into_iter().collect();
    json!({"id": id, "type": "reasoning", "summary": [], "content": content, "status": status})
}

pub(crate) fn reasoning_part(text: &str) -> Json {
    json!({"type": "reasoning_text", "text": text})
}

/// An assistant message item; `text` `None`: no content part yet.
pub(crate) fn message_item(id: &str, text: Option<&str>, status: &str) -> Json {
    let content: Vec<Json> = text.map(output_text).into_iter().collect();
    json!({"id": id, "type": "message", "role": "assistant", "status": status, "content": content})
}

pub(crate) fn output_text(text: &str) -> Json {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

pub(crate) fn function_call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Json {
    json!({"id": id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
           "status": status})
}

/// A whole output as items: reasoning, the message, then the calls (an empty message when there is nothing
/// else). The last item is `incomplete` when the response is not `completed`.
pub(crate) fn output_items(message: Message, status: Status) -> Vec<Json> {
    let mut items = vec![];
    if let Some(reasoning) = message.reasoning.filter(|r| !r.is_empty()) {
        items.push(reasoning_item(&new_id("rs"), Some(&reasoning), "completed"));
    }
    if !message.content.is_empty() || message.calls.is_empty() {
        items.push(message_item(&new_id("msg"), Some(&message.content), "completed"));
    }
    for call in message.calls {
        items.push(function_call_item(&new_id("fc"), &call.id, &call.name, &call.arguments, "completed"));
    }
    if let Some(last) = items.last_mut() {
        last["status"] = json!(status.open_item_status());
    }
    items
}

/// `usage` in the Responses' shape.
pub(crate) fn usage(u: &Usage, reasoning_tokens: u32) -> Json {
    let cached = u.prompt_tokens_details.as_ref().map_or(0, |d| d.cached_tokens);
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens.min(u.completion_tokens)},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// An in-progress response object: its id, creation time and model, then `echo` (the request's fields,
/// `ResponsesRequest::echo`), no output yet.
pub(crate) fn skeleton(id: &str, model: &str, echo: Json) -> Json {
    let mut r = json!({
        "id": id, "object": "response", "created_at": crate::http::unix_now(), "status": "in_progress",
        "completed_at": null, "error": null, "incomplete_details": null, "model": model,
    });
    if let (Some(r), Json::Object(echo)) = (r.as_object_mut(), echo) {
        r.extend(echo);
    }
    r["output"] = json!([]);
    r["usage"] = Json::Null;
    r
}

/// `skeleton` ended: its status, output, usage and, for a failure, the error.
pub(crate) fn ended(skeleton: &Json, status: Status, output: Vec<Json>, usage: Json, error: Option<&str>) -> Json {
    let mut r = skeleton.clone();
    r["status"] = json!(status.as_str());
    if status == Status::Completed {
        r["completed_at"] = json!(crate::http::unix_now());
    }
    if status == Status::Incomplete {
        r["incomplete_details"] = json!({"reason": "max_output_tokens"});
    }
    if let Some(message) = error {
        r["error"] = json!({"code": "server_error", "message": message});
    }
    r["output"] = Json::Array(output);
    r["usage"] = usage;
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::tool_calls::ParsedToolCall;

    #[test]
    fn whole_outputs_in_order() {
        let call = ParsedToolCall { id: "call_1".into(), name: "f".into(), arguments: "{}".into(), complete: true };
        let m = Message { content: String::new(), reasoning: Some("hm".into()), calls: vec![call] };
        let items = output_items(m, Status::Completed);
        let kinds: Vec<&str> = items.iter().map(|i| i["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["reasoning", "function_call"]);
        assert_eq!(items[0]["content"][0], json!({"type": "reasoning_text", "text": "hm"}));
        assert_eq!((items[1]["call_id"].as_str(), items[1]["status"].as_str()), (Some("call_1"), Some("completed")));
        assert!(items[1]["id"].as_str().unwrap().starts_with("fc_"));
        let cut = output_items(Message { content: "par".into(), ..Default::default() }, Status::Incomplete);
        assert_eq!((cut.len(), cut[0]["status"].as_str()), (1, Some("incomplete")));
        assert_eq!(cut[0]["content"][0]["text"], "par");
        assert_eq!(output_items(Message::default(), Status::Completed)[0]["content"][0]["text"], "");
    }

    #[test]
    fn object_and_usage() {
        let s = skeleton("resp_1", "m", json!({"store": true, "tools": []}));
        assert_eq!(
            (s["status"].as_str(), s["store"].as_bool(), s["usage"].is_null()),
            (Some("in_progress"), Some(true), true)
        );
        let u = Usage { prompt_tokens: 10, completion_tokens: 4, total_tokens: 14, prompt_tokens_details: None };
        let r = ended(&s, Status::Incomplete, vec![], usage(&u, 9), None);
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 4);
        assert_eq!(r["usage"]["total_tokens"], 14);
        let f = ended(&s, Status::Failed, vec![], Json::Null, Some("boom"));
        assert_eq!((f["status"].as_str(), f["error"]["message"].as_str()), (Some("failed"), Some("boom")));
        assert_eq!(Status::of_finish("length", false), Status::Incomplete);
        assert_eq!(Status::of_finish("stop", true), Status::Cancelled);
        assert_eq!(Status::of_finish("tool_calls", false), Status::Completed);
    }
}
