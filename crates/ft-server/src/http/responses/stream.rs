//! The Responses stream: named server-sent events, each with its `type` and a `sequence_number` counting from 0.
//!
//! ```text
//!   response.created, response.in_progress                       (the in-progress object, no output)
//!   per output item, in output order, at output_index 0, 1, ...:
//!     reasoning:      output_item.added, content_part.added (reasoning_text),
//!                     reasoning_text.delta …, reasoning_text.done, content_part.done, output_item.done
//!     message:        output_item.added, content_part.added (output_text),
//!                     output_text.delta …, output_text.done, content_part.done, output_item.done
//!     function_call:  output_item.added, function_call_arguments.delta …, function_call_arguments.done,
//!                     output_item.done
//!   response.completed | response.incomplete (max_output_tokens, or cancelled) | response.failed
//! ```
//!
//! An item opens with its first output and closes when the next one opens or the response ends. No
//! `[DONE]` (the Responses API has none).

use super::object::{self, new_id, Status};
use super::turn::Turn;
use crate::http::openai_error::ApiError;
use crate::http::output::Output;
use crate::http::sse::{Ending, StreamFormat};
use axum::response::sse::Event;
use serde_json::{json, Value as Json};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Message,
    Call,
}

/// The output item being streamed.
struct OpenItem {
    kind: Kind,
    /// Its `output_index`.
    index: usize,
    id: String,
    /// Its text so far (a call's arguments).
    text: String,
    /// A call's `call_id` and name.
    call: Option<(String, String)>,
}

pub(crate) struct ResponsesFormat {
    turn: Turn,
    /// The next event's `sequence_number`.
    seq: u64,
    /// The items done, in output order.
    items: Vec<Json>,
    open: Option<OpenItem>,
    /// All the reasoning text (for `reasoning_tokens`).
    reasoning: String,
}

impl ResponsesFormat {
    pub fn new(turn: Turn) -> Self {
        ResponsesFormat { turn, seq: 0, items: vec![], open: None, reasoning: String::new() }
    }

    /// An event of type `kind` with `fields`, numbered.
    fn event(&mut self, kind: &str, fields: Json) -> Event {
        let mut data = json!({"type": kind, "sequence_number": self.seq});
        self.seq += 1;
        if let (Some(data), Json::Object(fields)) = (data.as_object_mut(), fields) {
            data.extend(fields);
        }
        Event::default().event(kind).data(data.to_string())
    }

    /// Makes an item of `kind` the open one (the open one goes on unless it is another kind, or a call).
    fn open(&mut self, kind: Kind, call: Option<(String, String)>, events: &mut Vec<Event>) {
        if self.open.as_ref().is_some_and(|o| o.kind == kind && kind != Kind::Call) {
            return;
        }
        self.close("completed", events);
        let index = self.items.len();
        let (item, part) = match (kind, &call) {
            (Kind::Reasoning, _) => {
                let id = new_id("rs");
                (object::reasoning_item(&id, None, "in_progress"), Some(object::reasoning_part("")))
            }
            (Kind::Message, _) => {
                (object::message_item(&new_id("msg"), None, "in_progress"), Some(object::output_text("")))
            }
            (Kind::Call, Some((call_id, name))) => {
                (object::function_call_item(&new_id("fc"), call_id, name, "", "in_progress"), None)
            }
            (Kind::Call, None) => return,
        };
        let id = item["id"].as_str().unwrap_or_default().to_string();
        events.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
        if let Some(part) = part {
            let fields = json!({"item_id": id, "output_index": index, "content_index": 0, "part": part});
            events.push(self.event("response.content_part.added", fields));
        }
        self.open = Some(OpenItem { kind, index, id, text: String::new(), call });
    }

    /// Closes the open item, if any, as `status`.
    fn close(&mut self, status: &str, events: &mut Vec<Event>) {
        let Some(o) = self.open.take() else { return };
        let at = json!({"item_id": o.id, "output_index": o.index});
        let (done, part, item) = match (o.kind, &o.call) {
            (Kind::Reasoning, _) => (
                ("response.reasoning_text.done", "text"),
                Some(object::reasoning_part(&o.text)),
                object::reasoning_item(&o.id, Some(&o.text), status),
            ),
            (Kind::Message, _) => (
                ("response.output_text.done", "text"),
                Some(object::output_text(&o.text)),
                object::message_item(&o.id, Some(&o.text), status),
            ),
            (Kind::Call, call) => {
                let (call_id, name) = call.clone().unwrap_or_default();
                let item = object::function_call_item(&o.id, &call_id, &name, &o.text, status);
                (("response.function_call_arguments.done", "arguments"), None, item)
            }
        };
        let mut fields = at.clone();
        fields[done.1] = json!(o.text);
        if part.is_some() {
            fields["content_index"] = json!(0);
            if o.kind == Kind::Message {
                fields["logprobs"] = json!([]);
            }
        }
        events.push(self.event(done.0, fields));
        if let Some(part) = part {
            let mut fields = at.clone();
            fields["content_index"] = json!(0);
            fields["part"] = part;
            events.push(self.event("response.content_part.done", fields));
        }
        events.push(self.event("response.output_item.done", json!({"output_index": o.index, "item": item.clone()})));
        self.items.push(item);
    }

    /// A delta event for the open item: `kind` with `delta` (and the content index for content parts).
    fn delta(&mut self, kind: &str, delta: String, events: &mut Vec<Event>) {
        let Some(o) = self.open.as_mut() else { return };
        o.text.push_str(&delta);
        let mut fields = json!({"item_id": o.id, "output_index": o.index, "delta": delta});
        if o.kind != Kind::Call {
            fields["content_index"] = json!(0);
        }
        if o.kind == Kind::Message {
            fields["logprobs"] = json!([]);
        }
        events.push(self.event(kind, fields));
    }
}

impl StreamFormat for ResponsesFormat {
    fn start(&mut self) -> Vec<Event> {
        let response = self.turn.in_progress().clone();
        vec![
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
        ]
    }

    fn output(&mut self, output: Output) -> Vec<Event> {
        let mut events = vec![];
        match output {
            Output::Reasoning(text) => {
                self.open(Kind::Reasoning, None, &mut events);
                self.reasoning.push_str(&text);
                self.delta("response.reasoning_text.delta", text, &mut events);
            }
            Output::Text(text) => {
                self.open(Kind::Message, None, &mut events);
                self.delta("response.output_text.delta", text, &mut events);
            }
            Output::CallStart { id, name, .. } => self.open(Kind::Call, Some((id, name)), &mut events),
            Output::CallArguments { delta, .. } => {
                if self.open.as_ref().is_some_and(|o| o.kind == Kind::Call) {
                    self.delta("response.function_call_arguments.delta", delta, &mut events);
                }
            }
            Output::CallEnd { complete, .. } => {
                self.close(if complete { "completed" } else { "incomplete" }, &mut events)
            }
        }
        events
    }

    fn finish(&mut self, ending: Ending) -> Vec<Event> {
        let mut events = vec![];
        if self.items.is_empty() && self.open.is_none() {
            self.open(Kind::Message, None, &mut events);
        }
        let status = self.turn.status(ending.reason);
        self.close(status.open_item_status(), &mut events);
        let response = self.turn.end(status, &ending.usage, self.items.clone(), &self.reasoning);
        events.push(self.event(status.final_event(), json!({"response": response})));
        events
    }

    fn error(&mut self, error: ApiError) -> Vec<Event> {
        let mut events = vec![];
        self.close(Status::Failed.open_item_status(), &mut events);
        let response = self.turn.fail(&error, self.items.clone());
        events.push(self.event(Status::Failed.final_event(), json!({"response": response})));
        events
    }
}
