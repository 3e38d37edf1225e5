//! The one response loop every generation endpoint shares: a request's [`TextStream`], parsed into [`Output`]
//! events (reasoning, text, tool calls: `output.rs`), turned into a whole response ([`collect`]) or into
//! server-sent events ([`sse`]) in the wire format of its API ([`StreamFormat`]: OpenAI chat, OpenAI
//! completions, Anthropic messages, Responses). OpenAI's `n` choices ([`sse_choices`], `http::choices`) go
//! through the same loop, one format and parser per choice, their events interleaved as they come.
//!
//! The SSE body owns the `TextStream`s, so hyper dropping the body (client gone) drops them, whose guards
//! abort the requests in the engine.

use super::choices::{items, total_usage, Choice, ChoiceItem};
use super::logprobs::LogprobsUpdate;
use super::output::{Message, Output, OutputParser, OutputSpec};
use super::{Piece, TextStream};
use crate::http::openai_error::ApiError;
use crate::http::protocol::Usage;
use crate::text::tool_calls::CallCommit;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::stream::{select_all, BoxStream, SelectAll};
use futures::StreamExt;
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
    /// The request (or this choice of it) ended; its last events, `[DONE]` included where the API has one
    /// and no [`end`](Self::end).
    fn finish(&mut self, ending: Ending) -> Vec<Event>;
    /// The outputs of the text that came with the end (a stop-string prefix held back, the detokenizer's
    /// tail), then the end. OpenAI's formats put that last text in the finish chunk, as vLLM does.
    fn finish_with(&mut self, outputs: Vec<Output>, ending: Ending) -> Vec<Event> {
        let mut events: Vec<Event> = outputs.into_iter().flat_map(|o| self.output(o)).collect();
        events.extend(self.finish(ending));
        events
    }
    /// Every choice ended (asked of the first choice's format), with their usage summed: the closing events
    /// of APIs with several choices (the usage chunk, `[DONE]`).
    fn end(&mut self, _usage: Usage) -> Vec<Event> {
        vec![]
    }
    /// The request failed midway; the last events.
    fn error(&mut self, error: ApiError) -> Vec<Event>;
}

/// The outputs that came with the end as `format`'s events, but a trailing text held back and returned: the
/// formats that put the last text in their finish chunk ([`StreamFormat::finish_with`]) send it there.
pub(crate) fn events_before_trailing_text<F: StreamFormat + ?Sized>(
    format: &mut F,
    mut outputs: Vec<Output>,
) -> (Vec<Event>, Option<String>) {
    let text = match outputs.pop() {
        Some(Output::Text(t)) => Some(t),
        Some(other) => {
            outputs.push(other);
            None
        }
        None => None,
    };
    (outputs.into_iter().flat_map(|o| format.output(o)).collect(), text)
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

/// The streamed response of one request: `format`'s events for every output of `ts` parsed by `spec`.
pub(crate) fn sse<F: StreamFormat>(
    ts: TextStream,
    spec: &OutputSpec,
    format: F,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    sse_choices(vec![Choice::single(ts)], spec, vec![format])
}

/// The streamed response of several choices (`http::choices`), `formats[k]` speaking for `choices[k]`: each
/// choice's outputs parsed by its own `spec` parser (calls stream from their header on) as they come,
/// interleaved; after the last choice finished, [`StreamFormat::end`] with their usage. The first error
/// ends the stream (and, dropped, the other choices). SSE keep-alive comments while nothing comes.
pub(crate) fn sse_choices<F: StreamFormat>(
    choices: Vec<Choice>,
    spec: &OutputSpec,
    mut formats: Vec<F>,
) -> Sse<impl futures::Stream<Item = Result<Event, Infallible>>> {
    let queue: VecDeque<Event> = formats.iter_mut().flat_map(|f| f.start()).collect();
    let run = Run {
        parsers: formats.iter().map(|_| spec.parser(CallCommit::OnHeader)).collect(),
        prompts: choices.iter().map(|c| c.prompt).collect(),
        streams: Some(select_all(choices.into_iter().enumerate().map(|(slot, c)| items(slot, c)))),
        usages: Vec::new(),
        formats,
        queue,
    };
    let body = futures::stream::unfold(run, |mut run| async move {
        loop {
            if let Some(ev) = run.queue.pop_front() {
                return Some((Ok(ev), run));
            }
            match run.streams.as_mut()?.next().await {
                Some(item) => run.apply(item),
                None => run.end(),
            }
        }
    });
    Sse::new(body).keep_alive(KeepAlive::new().interval(std::time::Duration::from_secs(15)))
}

/// The SSE loop's state: one format and parser per choice, the events not sent yet.
struct Run<F> {
    formats: Vec<F>,
    parsers: Vec<OutputParser>,
    /// The prompt each choice answers (usage counts each once).
    prompts: Vec<usize>,
    /// `None` once the response is over.
    streams: Option<SelectAll<BoxStream<'static, ChoiceItem>>>,
    /// `(prompt, usage)` of each finished choice.
    usages: Vec<(usize, Usage)>,
    queue: VecDeque<Event>,
}

impl<F: StreamFormat> Run<F> {
    /// One choice's piece: its outputs, its finish, or the error that ends the response.
    fn apply(&mut self, item: ChoiceItem) {
        let Run { formats, parsers, queue, .. } = self;
        let (format, parser) = (&mut formats[item.slot], &mut parsers[item.slot]);
        if let Some(update) = item.logprobs {
            format.logprobs(update);
        }
        match item.piece {
            Piece::Text(t) => parser.push(&t).into_iter().for_each(|o| queue.extend(format.output(o))),
            Piece::Finish { text, reason, stop_string } => {
                let outputs: Vec<Output> = parser.push(&text).into_iter().chain(parser.finish()).collect();
                let reason = parser.finish_reason(reason);
                let usage = item.usage.unwrap_or_else(|| total_usage(&[]));
                self.usages.push((self.prompts[item.slot], usage.clone()));
                self.queue.extend(format.finish_with(outputs, Ending { reason, stop_string, usage }));
            }
            Piece::Error(e) => {
                queue.extend(format.error(e));
                self.streams = None;
            }
        }
    }

    /// Every choice finished: the closing events.
    fn end(&mut self) {
        self.streams = None;
        let usage = total_usage(&self.usages);
        if let Some(format) = self.formats.first_mut() {
            self.queue.extend(format.end(usage));
        }
    }
}

/// An SSE event whose data is `value` as JSON.
pub(crate) fn json_event<T: serde::Serialize>(value: &T) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_else(|_| "{}".into()))
}

/// OpenAI's stream terminator.
pub(crate) fn done_event() -> Event {
    Event::default().data("[DONE]")
}
