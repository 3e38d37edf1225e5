//! Log-probabilities on the wire: what a request's [`TextStream`](super::TextStream) collects per position
//! ([`PositionLogprob`]) and its two OpenAI spellings.
//!
//! ```text
//!   chat         {"content": [{"token": " Paris", "logprob": -0.01, "bytes": [32, 80, ...],
//!                              "top_logprobs": [{"token", "logprob", "bytes"}, ...  (top_logprobs of them)]}]}
//!   completions  {"tokens": [" Paris"], "token_logprobs": [-0.01], "text_offset": [0],
//!                 "top_logprobs": [{" Paris": -0.01, " Lyon": -5.2, ...}]}   (the chosen token always in the dict)
//! ```
//!
//! With `echo`, completions list the prompt's tokens first, the first one with `null` logprob and alternatives
//! (nothing predicts it). Values are the model's raw distribution (temperature 1, before penalties and top-k/p
//! filtering), as OpenAI and vLLM report them; `-inf` (a masked token) is sent as -9999 (vLLM's stand-in), JSON
//! has no infinity.

use crate::text::token_text::{token_bytes, token_text};
use crate::text::tokenizer::Tokenizer;
use crate::validation::LogprobsAsk;
use ft_core::request::TopLogprob;
use serde_json::{json, Map, Value as Json};

/// One position's token, its logprob (`None`: the prompt's first token) and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PositionLogprob {
    pub token: u32,
    pub logprob: Option<f32>,
    pub top: Vec<TopLogprob>,
    /// Characters of output text before this token (for prompt positions: set by the route that echoes them).
    pub text_offset: usize,
}

/// A finite JSON number for a logprob.
fn finite(lp: f32) -> f64 {
    if lp.is_finite() {
        lp as f64
    } else {
        -9999.0
    }
}

/// Chat's `logprobs` object over `entries` (each has a logprob: chat has no prompt positions).
pub(crate) fn chat_logprobs(tokenizer: &Tokenizer, entries: &[PositionLogprob]) -> Json {
    let item = |token: u32, logprob: f32| json!({"token": token_text(tokenizer, token), "logprob": finite(logprob), "bytes": token_bytes(tokenizer, token)});
    let content: Vec<Json> = entries
        .iter()
        .map(|e| {
            let mut v = item(e.token, e.logprob.unwrap_or(0.0));
            v["top_logprobs"] = e.top.iter().map(|t| item(t.token, t.logprob)).collect();
            v
        })
        .collect();
    json!({"content": content})
}

/// The legacy completions `logprobs` object over `entries`.
pub(crate) fn completion_logprobs(tokenizer: &Tokenizer, entries: &[PositionLogprob]) -> Json {
    let mut tokens = Vec::with_capacity(entries.len());
    let mut token_logprobs = Vec::with_capacity(entries.len());
    let mut top_logprobs = Vec::with_capacity(entries.len());
    let mut text_offset = Vec::with_capacity(entries.len());
    for e in entries {
        let text = token_text(tokenizer, e.token);
        tokens.push(Json::String(text.clone()));
        token_logprobs.push(e.logprob.map_or(Json::Null, |lp| json!(finite(lp))));
        text_offset.push(json!(e.text_offset));
        let Some(lp) = e.logprob else {
            top_logprobs.push(Json::Null);
            continue;
        };
        let mut dict = Map::new();
        for t in &e.top {
            dict.entry(token_text(tokenizer, t.token)).or_insert_with(|| json!(finite(t.logprob)));
        }
        dict.entry(text).or_insert_with(|| json!(finite(lp))); // the chosen token, always
        top_logprobs.push(Json::Object(dict));
    }
    json!({
        "tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset
    })
}

/// Where each of `ids` starts in their decoded text, in characters (a token that completes a split character
/// starts where the character does).
pub(crate) fn text_offsets(tokenizer: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> Vec<usize> {
    let mut detok = crate::text::detokenizer::IncrementalDetokenizer::new(&[], skip_special_tokens);
    let mut chars = 0;
    ids.iter()
        .map(|&id| {
            let at = chars;
            chars += detok.push(tokenizer, id).map(|t| t.chars().count()).unwrap_or(0);
            at
        })
        .collect()
}

/// What a request collected since the last [`LogprobsCollector::take`]: the prompt's entries once they are all
/// in (first token sampled, or the request ended), then output entries as they come.
#[derive(Debug, Default)]
pub(crate) struct LogprobsUpdate {
    pub prompt: Option<Vec<PositionLogprob>>,
    pub tokens: Vec<PositionLogprob>,
}

/// The logprobs of one request, collected from its events as they arrive.
pub(crate) struct LogprobsCollector {
    /// One entry per prompt token (logprobs filled in by `PromptLogprobs` events); `None` unless asked.
    prompt: Option<Vec<PositionLogprob>>,
    /// Every prompt event is in: the first token came (they all precede it) or the request ended.
    prompt_complete: bool,
    /// Output entries not yet taken.
    tokens: Vec<PositionLogprob>,
}

impl LogprobsCollector {
    pub fn new(ask: LogprobsAsk, prompt: &[u32]) -> Self {
        let entry = |&token| PositionLogprob { token, logprob: None, top: Vec::new(), text_offset: 0 };
        LogprobsCollector {
            prompt: ask.prompt.then(|| prompt.iter().map(entry).collect()),
            prompt_complete: false,
            tokens: Vec::new(),
        }
    }

    /// One chunk's prompt logprobs: positions `start..`.
    pub fn prompt_chunk(&mut self, start: u32, logprobs: Vec<f32>, top: Vec<Vec<TopLogprob>>) {
        let Some(prompt) = self.prompt.as_mut() else { return };
        for ((lp, top), e) in logprobs.into_iter().zip(top).zip(prompt.iter_mut().skip(start as usize)) {
            e.logprob = Some(lp);
            e.top = top;
        }
    }

    /// A token was sampled: the prompt's entries are complete.
    pub fn sampled(&mut self) {
        self.prompt_complete = true;
    }

    /// An output token that is part of the text.
    pub fn token(&mut self, entry: PositionLogprob) {
        self.tokens.push(entry);
    }

    pub fn take(&mut self) -> LogprobsUpdate {
        let prompt = if self.prompt_complete { self.prompt.take() } else { None };
        LogprobsUpdate { prompt, tokens: std::mem::take(&mut self.tokens) }
    }
}
