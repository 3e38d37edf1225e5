//! ft-server: everything between the socket and the engine thread.

pub mod anthropic;
pub mod backend;
pub mod engine;
pub mod chat_template;
pub mod cli;
pub mod detokenizer;
pub mod drain;
pub mod launch;
pub mod logging;
pub mod metrics;
pub mod openai_error;
pub mod protocol;
pub mod routes;
pub mod server;
pub mod status_log;
pub mod stop_strings;
pub mod text;
pub mod tokenizer;
