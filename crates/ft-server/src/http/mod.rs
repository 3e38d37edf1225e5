//! The HTTP side: the axum server and its shared state (`server`), the routes (OpenAI chat and completions,
//! Anthropic messages, OpenAI Responses, info), the one response loop they share (`sse`), a request's output as text
//! (`text_stream`) and that text parsed into reasoning, content and tool calls (`output`), the wire types and
//! errors of both APIs, and the graceful-shutdown drain.
//!
//! Content is validated before any of this submits a request (`crate::validation`).

pub mod anthropic;
pub mod chat;
pub(crate) mod choices;
pub mod completions;
pub mod drain;
pub mod info;
pub(crate) mod logprobs;
pub mod messages;
pub mod openai_error;
pub(crate) mod output;
pub mod protocol;
pub(crate) mod request_metrics;
pub mod responses;
pub mod server;
pub(crate) mod sse;
pub mod state;
pub(crate) mod text_stream;

pub(crate) use text_stream::{off_the_async_workers, response_id, submit, unix_now, OpenAiJson, Piece, TextStream};
