//! The one response loop every generation endpoint shares: a request's [`TextStream`] turned into a whole
//! response ([`collect`]) or into server-sent events ([`sse`]) in the wire format of its API
//! ([`StreamFormat`]: OpenAI chat, OpenAI completions, Anthropic messages).
//!
//! The SSE body owns the `TextStream`, so hyper dropping the body (client gone) drops the stream, whose guard
//! aborts the request in the engine.

use super::{Piece, TextStream};
use crate::http::openai_error::ApiError;
use crate::http::protocol::Usage;
use axum::response::sse::{Event, KeepAlive, Sse};
use std::collections::VecDeque;
use std::convert::Infallible;

/// How a request ended, as every API needs to say it.
#[derive(Debug)]
pub(crate) struct Ending {
    /// OpenAI's finish reason (`stop`, `length`, `abort`).
    pub reason: &'static str,
    /// The stop string that ended it, if one did.
    pub stop_string: Option<String>,
    pub usage: Usage,
}

/// One API's spelling of a streamed response.
pub(crate) trait StreamFormat: Send + 'static {
    /// Events sent before any output (a role delta, `message_start`).
    fn start(&mut self) -> Vec<Event>;
    /// More output text (never empty).
    fn text(&mut self, text: String) -> Vec<Event>;
    /// The request ended; the last events, `[DONE]` included where the API has one.
    fn finish(&mut self, ending: Ending) -> Vec<Event>;
    /// The request failed midway; the last events.
    fn error(&mut self, error: ApiError) -> Vec<Event>;
}

/// The whole output of a request, or the error that ended it.
pub(crate) async fn collect(ts: &mut TextStream) -> Result<(String, Ending), ApiError> {
    let mut text = String::new();
    loop {
        match ts.next().await {
            Some(Piece::Text(t)) => text.push_str(&t),
            Some(Piece::Finish { text: t, reason, stop_string }) => {
                text.push_str(&t);
                return Ok((text, Ending { reason, stop_string, usage: ts.usage() }));
            }
            Some(Piece::Error(e)) => return Err(e),
            None => return Err(ApiError::internal("the request ended without a result")),
        }
    }
}

/// The streamed response: `format`'s events for every piece of `ts`, with SSE keep-alive comments.
pub(crate) fn sse<F: StreamFormat>(ts: TextStream, mut format: F) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let queue: VecDeque<Event> = format.start().into();
    let body = futures::stream::unfold((Some(ts), queue, format), |(mut ts, mut queue, mut format)| async move {
        loop {
            if let Some(ev) = queue.pop_front() {
                return Some((Ok(ev), (ts, queue, format)));
            }
            let stream = ts.as_mut()?;
            match stream.next().await {
                Some(Piece::Text(t)) => queue.extend(format.text(t)),
                Some(Piece::Finish { text, reason, stop_string }) => {
                    if !text.is_empty() {
                        queue.extend(format.text(text));
                    }
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
    });
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
