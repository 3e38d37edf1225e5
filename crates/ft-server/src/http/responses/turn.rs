//! One response's life, shared by the whole and the streamed path: stored as `in_progress` when it is
//! submitted (under `store`), then stored once more when it ends, with its final object and the conversation
//! a later `previous_response_id` continues (earlier turns, this input, this output).
//!
//! A response that is dropped before it ends (the client went away, so the request was aborted) is stored
//! as `cancelled`, as is one whose `cancel` arrived while it ran.

use super::object::{self, Status};
use super::store::{Conversation, Entry, Live};
use crate::http::openai_error::ApiError;
use crate::http::protocol::Usage;
use crate::http::state::AppState;
use serde_json::Value as Json;
use std::sync::Arc;

/// What preparing a request decided about its response (everything but the engine's request id).
pub(crate) struct TurnPlan {
    /// The in-progress response object (`object::skeleton`).
    pub skeleton: Json,
    /// `store`.
    pub store: bool,
    /// The conversation `previous_response_id` continues.
    pub parent: Option<Arc<Conversation>>,
    /// This request's input items.
    pub input: Vec<Json>,
}

pub(crate) struct Turn {
    state: AppState,
    plan: TurnPlan,
    live: Arc<Live>,
    ended: bool,
}

impl Turn {
    /// The response of engine request `request_id` begins (stored as `in_progress` under `store`).
    pub fn start(state: &AppState, plan: TurnPlan, request_id: u64) -> Turn {
        let live = Live::new(request_id);
        if plan.store {
            let entry = Entry { response: plan.skeleton.clone(), conversation: None, live: Some(live.clone()) };
            state.responses.put(&id_of(&plan.skeleton), entry);
        }
        Turn { state: state.clone(), plan, live, ended: false }
    }

    /// The response object so far (`in_progress`, no output).
    pub fn in_progress(&self) -> &Json {
        &self.plan.skeleton
    }

    /// The status for OpenAI's finish `reason`.
    pub fn status(&self, reason: &str) -> Status {
        Status::of_finish(reason, self.live.is_cancelled())
    }

    /// The request finished with `status`: the final object (stored), with `reasoning`'s tokens counted.
    pub fn end(&mut self, status: Status, usage: &Usage, output: Vec<Json>, reasoning: &str) -> Json {
        let reasoning_tokens = match reasoning {
            "" => 0,
            text => self.state.tokenizer.encode(text, false).map_or(0, |ids| ids.len() as u32),
        };
        let response = object::ended(&self.plan.skeleton, status, output, object::usage(usage, reasoning_tokens), None);
        self.record(&response);
        response
    }

    /// The request failed: the final object (stored), `failed` with the error.
    pub fn fail(&mut self, error: &ApiError, output: Vec<Json>) -> Json {
        let response = object::ended(&self.plan.skeleton, Status::Failed, output, Json::Null, Some(&error.message));
        self.record(&response);
        response
    }

    /// Stores the final object and the conversation through its output; wakes a waiting `cancel`.
    fn record(&mut self, response: &Json) {
        self.ended = true;
        if self.plan.store {
            let mut items = std::mem::take(&mut self.plan.input);
            items.extend(response["output"].as_array().into_iter().flatten().cloned());
            let conversation = Conversation::new(self.plan.parent.take(), items);
            let entry = Entry { response: response.clone(), conversation: Some(conversation), live: None };
            self.state.responses.update(&id_of(response), entry);
        }
        self.live.mark_ended();
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if !self.ended {
            let response = object::ended(&self.plan.skeleton, Status::Cancelled, vec![], Json::Null, None);
            self.record(&response);
        }
    }
}

fn id_of(response: &Json) -> String {
    response["id"].as_str().unwrap_or_default().to_string()
}
