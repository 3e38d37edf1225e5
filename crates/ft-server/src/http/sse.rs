//! The one response loop every generation endpoint shares: a request's [`TextStream`], parsed into [`Output`]
//! events (reasoning, text, tool calls: `output.rs`), turned into a whole response ([`collect`]) or into
//! server-sent events ([`sse`]) in the wire format of its API ([`StreamFormat`]: OpenAI chat, OpenAI
//! completions, Anthropic messages).
//!
//! The SSE body owns the `TextStream`, so hyper dropping the body (client gone) drops the stream, whose guard
//! aborts the request in the engine.

use super::logprobs::LogprobsUpdate;
use super::output::{Message, Output, OutputSpec};
use super::{Piece, TextStream};
use crate::http::openai_error::ApiError;
use crate::http::protocol::Usage;
use crate::text::tool_calls::CallCommit;
use axum::response::sse::{Event, KeepAlive, Sse};
use std::collections::VecDeque;
use std::convert::Infallible;

/// How a request ended, as every API needs to say it.
#[derive(Debug)]
pub(crate) struct Ending {
    /// OpenAI's finish reason (`stop`, `length`, `abort`, `tool_calls`).
    pub reason: &'static str,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    pub usage: Usage,
}

/// One API's spelling of a streamed response.
pub(crate) trait StreamFormat: Send + 'static {
    /// Events sent before any output (a role delta, `message_start`).
    fn start(&mut self) -> Vec<Event>;
    /// More output: text (never empty), reasoning, tool-call events (only where the route's [`OutputSpec`]
    /// parses them).
    fn output(&mut self, output: Output) -> Vec<Event>;
    /// Logprobs that came with the text about to be given to [`output`](Self::output) or
    /// [`finish`](Self::finish) (only for requests that asked for them): sent with the next event.
    fn logprobs(&mut self, _update: LogprobsUpdate) {}
    /// The request ended; the last events, `[DONE]` included where the API has one.
    fn finish(&mut self, ending: Ending) -> Vec<Event>;
    /// The request failed midway; the last events.
    fn error(&mut self, error: ApiError) -> Vec<Event>;
}

/// The whole output of a request, parsed by `spec` (a call counts only once it closed well-formed), or the
/// error that ended it.
pub(crate) async fn collect(ts: &mut TextStream, spec: &OutputSpec) -> Result<(Message, Ending), ApiError> {
    let mut parser = spec.parser(CallCommit::OnClose);
    let mut message = Message::default();
    loop {
        match ts.next().await {
            Some(Piece::Text(t)) => parser.push(&t).into_iter().for_each(|o| message.apply(o)),
            Some(Piece::Finish { text, reason, stop_string }) => {
                parser.push(&text).into_iter().chain(parser.finish()).for_each(|o| message.apply(o));
                if parser.saw_reasoning() && message.reasoning.is_none() {
                    message.reasoning = Some(String::new());
                }
                return Ok((message, Ending { reason: parser.finish_reason(reason), stop_string, usage: ts.usage() }));
            }
            Some(Piece::Error(e)) => return Err(e),
            None => return Err(ApiError::internal("the request ended without a result")),
        }
    }
}

/// The streamed response: `format`'s events for every output of `ts` parsed by `spec` (calls stream from
/// their header on), with SSE keep-alive comments.
pub(crate) fn sse<F: StreamFormat>(
    ts: TextStream,
    spec: &OutputSpec,
    mut format: F,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let queue: VecDeque<Event> = format.start().into();
    let parser = spec.parser(CallCommit::OnHeader);
    let body = futures::stream::unfold(
        (Some(ts), queue, format, parser),
        |(mut ts, mut queue, mut format, mut parser)| async move {
            loop {
                if let Some(ev) = queue.pop_front() {
                    return Some((Ok(ev), (ts, queue, format, parser)));
                }
                let stream = ts.as_mut()?;
                let piece = stream.next().await;
                if stream.wants_logprobs() {
                    format.logprobs(stream.take_logprobs());
                }
                match piece {
                    Some(Piece::Text(t)) => parser.push(&t).into_iter().for_each(|o| queue.extend(format.output(o))),
                    Some(Piece::Finish { text, reason, stop_string }) => {
                        let outputs: Vec<Output> = parser.push(&text).into_iter().chain(parser.finish()).collect();
                        outputs.into_iter().for_each(|o| queue.extend(format.output(o)));
                        let reason = parser.finish_reason(reason);
                        queue.extend(format.finish(Ending { reason, stop_string, usage: stream.usage() }));
                        ts = None;
                    }
                    Some(Piece::Error(e)) => {
                        queue.extend(format.error(e));
                        ts = None;
                    }
                    None => ts = None,
                }
            }
        },
    );
    Sse::new(body).keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
}

/// An SSE event whose data is `value` as JSON.
pub(crate) fn json_event<T: serde::Serialize>(value: &T) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_else(|_| "{}".into()))
}

/// OpenAI's stream terminator.
pub(crate) fn done_event() -> Event {
    Event::default().data("[DONE]")
}
