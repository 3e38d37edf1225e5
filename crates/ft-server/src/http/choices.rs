//! `n` choices per prompt (and the several prompts of a `/v1/completions` batch): one engine request per
//! choice, merged back into one response.
//!
//! The prompt is computed once. A prompt's first choice (its leader) is submitted at once; the other `n - 1`
//! wait for the leader's first sampled token, by when the prompt's KV is in the prefix cache (the radix cache
//! takes a prompt as soon as it is computed), and then resume from it. With the cache off
//! (`--cache-type naive`) they still work, each computing the prompt again. Choice `i` is seeded `seed + i`
//! ([`Prepared::choice`]), so seeded choices are reproducible and differ from each other.
//!
//! Cancellation: every choice's stream, and every choice not submitted yet, lives in the response future or
//! the SSE body; a client that goes away drops them all, which aborts the submitted ones and never submits
//! the others.
//!
//! Usage is summed as OpenAI does: each prompt's tokens once, every choice's completion tokens. `/metrics`
//! counts each choice as an engine request (the first one timed from the HTTP request's arrival, the others
//! from their submission).

use super::output::{Message, OutputSpec};
use super::sse::{collect, Ending};
use super::{submit, Piece, TextStream};
use crate::http::logprobs::LogprobsUpdate;
use crate::http::openai_error::ApiError;
use crate::http::protocol::{PromptTokensDetails, Usage};
use crate::http::state::AppState;
use crate::validation::Prepared;
use futures::stream::BoxStream;
use futures::StreamExt;
use std::collections::BTreeMap;
use tokio::sync::watch;

/// What every chunk and whole response of one request shares.
#[derive(Clone, Debug)]
pub(crate) struct ResponseHead {
    pub id: String,
    pub model: String,
    pub created: u64,
}

/// One choice: its index in the response, the prompt it answers, and its request.
pub(crate) struct Choice {
    pub index: usize,
    pub prompt: usize,
    source: Source,
}

enum Source {
    Submitted(TextStream),
    /// Submitted once the prompt's leader says it sampled its first token.
    AfterLeader {
        state: AppState,
        prepared: Prepared,
        leader: watch::Receiver<bool>,
        what: &'static str,
    },
}

impl Choice {
    /// The one choice of a request submitted as `ts`.
    pub fn single(ts: TextStream) -> Choice {
        Choice { index: 0, prompt: 0, source: Source::Submitted(ts) }
    }

    /// Its text stream: submitted already, or submitted now that the leader's prompt is cached.
    pub async fn stream(self) -> Result<TextStream, ApiError> {
        match self.source {
            Source::Submitted(ts) => Ok(ts),
            Source::AfterLeader { state, prepared, mut leader, what } => {
                // Closed unsent: the leader ended without a token (it failed, and its error ends the response).
                let _ = leader.wait_for(|sampled| *sampled).await;
                submit(&state, &prepared, what)
            }
        }
    }
}

/// Submits each prompt's leader (a refusal, 429 or 503, answers the whole request) and lines up its other
/// choices behind it: choice `i` of `prompts[p]` is index `p * n + i`.
pub(crate) fn submit_choices(
    state: &AppState,
    prompts: &[Prepared],
    what: &'static str,
) -> Result<Vec<Choice>, ApiError> {
    let mut choices = Vec::new();
    for (p, prepared) in prompts.iter().enumerate() {
        let n = prepared.n as usize;
        let mut leader = submit(state, &prepared.choice(0), what)?;
        let (tx, rx) = watch::channel(false);
        if n > 1 {
            leader.notify_first_token(tx);
        }
        choices.push(Choice { index: p * n, prompt: p, source: Source::Submitted(leader) });
        for i in 1..n {
            let (state, prepared, leader) = (state.clone(), prepared.choice(i as u32), rx.clone());
            let source = Source::AfterLeader { state, prepared, leader, what };
            choices.push(Choice { index: p * n + i, prompt: p, source });
        }
    }
    Ok(choices)
}

/// A finished choice: its stream (for its logprobs), its parsed output and how it ended.
pub(crate) struct Collected {
    pub index: usize,
    pub prompt: usize,
    pub ts: TextStream,
    pub message: Message,
    pub ending: Ending,
}

/// Every choice's whole output, in index order. The first error answers the request; the other choices are
/// dropped with it, which aborts them.
pub(crate) async fn collect_choices(choices: Vec<Choice>, spec: &OutputSpec) -> Result<Vec<Collected>, ApiError> {
    futures::future::try_join_all(choices.into_iter().map(|c| async move {
        let (index, prompt) = (c.index, c.prompt);
        let mut ts = c.stream().await?;
        let (message, ending) = collect(&mut ts, spec).await?;
        Ok(Collected { index, prompt, ts, message, ending })
    }))
    .await
}

/// OpenAI's usage of several choices (`(prompt, usage)` each): each prompt's tokens once, every choice's
/// completion tokens. A prompt's cached tokens are the most any of its choices found cached (its leader
/// computed the prompt; the others resumed from it).
pub(crate) fn total_usage(choices: &[(usize, Usage)]) -> Usage {
    let mut prompts: BTreeMap<usize, (u32, Option<u32>)> = BTreeMap::new();
    let mut completion_tokens = 0;
    for (p, u) in choices {
        completion_tokens += u.completion_tokens;
        let cached = u.prompt_tokens_details.as_ref().map(|d| d.cached_tokens);
        let entry = prompts.entry(*p).or_insert((u.prompt_tokens, None));
        entry.1 = entry.1.max(cached);
    }
    let prompt_tokens = prompts.values().map(|(n, _)| n).sum();
    let reported = prompts.values().any(|(_, c)| c.is_some());
    Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
        prompt_tokens_details: reported
            .then(|| PromptTokensDetails { cached_tokens: prompts.values().filter_map(|(_, c)| *c).sum() }),
    }
}

/// What a choice's stream gives the SSE loop: a piece of its output, the logprobs that came with it (when
/// asked) and, with `Finish`, its usage. `slot` is the choice's position in the request's list.
pub(crate) struct ChoiceItem {
    pub slot: usize,
    pub piece: Piece,
    pub logprobs: Option<LogprobsUpdate>,
    pub usage: Option<Usage>,
}

/// A choice as the stream of its pieces, ending after `Finish` or `Error` (a refused submission included).
pub(crate) fn items(slot: usize, choice: Choice) -> BoxStream<'static, ChoiceItem> {
    enum Stage {
        Waiting(Choice),
        Running(TextStream),
        Over,
    }
    let item = move |piece, logprobs, usage| ChoiceItem { slot, piece, logprobs, usage };
    futures::stream::unfold(Stage::Waiting(choice), move |stage| async move {
        let mut ts = match stage {
            Stage::Over => return None,
            Stage::Running(ts) => ts,
            Stage::Waiting(c) => match c.stream().await {
                Ok(ts) => ts,
                Err(e) => return Some((item(Piece::Error(e), None, None), Stage::Over)),
            },
        };
        let piece = ts.next().await?;
        let logprobs = ts.wants_logprobs().then(|| ts.take_logprobs());
        if matches!(piece, Piece::Finish { .. } | Piece::Error(_)) {
            let usage = Some(ts.usage());
            return Some((item(piece, logprobs, usage), Stage::Over));
        }
        Some((item(piece, logprobs, None), Stage::Running(ts)))
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(prompt: u32, completion: u32, cached: Option<u32>) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: cached.map(|cached_tokens| PromptTokensDetails { cached_tokens }),
        }
    }

    #[test]
    fn usage_counts_each_prompt_once() {
        let u = total_usage(&[(0, usage(6, 3, None)), (0, usage(6, 4, None)), (1, usage(2, 1, None))]);
        assert_eq!((u.prompt_tokens, u.completion_tokens, u.total_tokens), (8, 8, 16));
        assert!(u.prompt_tokens_details.is_none());
        let u = total_usage(&[(0, usage(6, 3, Some(0))), (0, usage(6, 4, Some(5)))]);
        assert_eq!(u.prompt_tokens_details, Some(PromptTokensDetails { cached_tokens: 5 }));
        assert_eq!(u.prompt_tokens, 6);
    }
}
