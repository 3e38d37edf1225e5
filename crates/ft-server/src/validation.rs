//! The validation layer: the one place that answers a request's content with a 4xx, and the only builder of the
//! request the engine runs ([`GenerateRequest`], which the engine turns into ft-core's request).
//!
//! ```text
//!   OpenAI / Anthropic body ──wire types (protocol.rs, anthropic.rs)──▶ SamplingFields ──sampling()──▶
//!   ValidatedSampling ──(template, tokenizer)──▶ prompt ids ──request()──▶ Prepared { GenerateRequest, stops }
//! ```
//!
//! Every limit is checked here once: the model name, sampling ranges, `max_tokens >= 1`, stop strings, the prompt
//! against the vocabulary, the context length and the KV pool, and the output budget clamped to what they leave.
//! Behind this layer the engine, the scheduler and the worker assert these invariants instead of re-checking
//! them. The offline engine (`freetoken.LLM`) validates through the same [`sampling`] and [`request`].

use crate::backend::{EngineDescription, GenerateRequest};
use crate::cli::ServeArgs;
use crate::http::openai_error::ApiError;
use crate::http::output::{tool_name, ToolChoice, ToolRequest};
use crate::http::protocol::SamplingFields;
use crate::http::server::AppState;
use ft_core::request::{SamplingParams, MAX_TOP_LOGPROBS};
use serde_json::Value as Json;

/// Below this a temperature means greedy.
const GREEDY_TEMPERATURE: f64 = 1e-5;

/// The most choices one request may ask for: `n`, times the prompts of a `/v1/completions` batch. Each choice
/// is a request in the engine (they queue past `--max-running-requests`); the bound keeps one HTTP request
/// from filling the queue.
pub const MAX_CHOICES: u32 = 128;

/// Sampling fields after validation, before the prompt is known.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidatedSampling {
    pub sampling: SamplingParams,
    /// What the client asked for (`None`: the server default).
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Log-probabilities to report (`None`: the response's `logprobs` is null).
    pub logprobs: Option<LogprobsAsk>,
    /// `echo` with `max_tokens: 0` (loglikelihood evaluations): the prompt alone comes back. The engine still
    /// samples one token (from the logits the prompt's last chunk computes anyway); nobody sees it.
    pub prompt_only: bool,
    /// Choices per prompt (`n`, `1..=MAX_CHOICES`).
    pub n: u32,
}

/// The log-probabilities a request asked for (validated; also in its [`SamplingParams`] for the engine).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogprobsAsk {
    /// Most likely alternatives per position (`0..=MAX_TOP_LOGPROBS`).
    pub top: u32,
    /// The prompt's tokens too (`echo` with `logprobs` on `/v1/completions`).
    pub prompt: bool,
}

/// A validated request, ready to submit.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub req: GenerateRequest,
    pub stop: Vec<String>,
    pub logprobs: Option<LogprobsAsk>,
    pub prompt_only: bool,
    /// Choices to generate from this prompt; each is submitted as [`Prepared::choice`].
    pub n: u32,
}

impl Prepared {
    /// Choice `i` of `n`: the same request, seeded `seed + i` when a seed was given, so every choice is
    /// reproducible and (at a temperature above 0) differs from the others; unseeded choices get the
    /// scheduler's random seeds.
    pub fn choice(&self, i: u32) -> Prepared {
        let mut c = self.clone();
        c.req.sampling.seed = self.req.sampling.seed.map(|s| s.wrapping_add(i as u64));
        c.n = 1;
        c
    }
}

/// Checks every sampling and budget field; unset ones take `defaults`.
pub fn sampling(f: &SamplingFields, defaults: &SamplingParams) -> Result<ValidatedSampling, ApiError> {
    unsupported_choices(f)?;
    let mut s = defaults.clone();
    if let Some(t) = f.temperature {
        s.temperature = in_range("temperature", t, 0.0, 2.0, "between 0 and 2")? as f32;
    }
    if let Some(p) = f.top_p {
        if !p.is_finite() || p <= 0.0 || p > 1.0 {
            return Err(ApiError::invalid_param("top_p", format!("top_p must be in (0, 1], got {p}")));
        }
        // The worker checks the f32 value: a positive f64 below f32's range (1e-300) would round to 0 and fail the
        // whole step it rides in. Clamped, it keeps its meaning: only the most likely token.
        s.top_p = (p as f32).max(f32::MIN_POSITIVE);
    }
    if let Some(k) = f.top_k {
        if k < -1 || k > i32::MAX as i64 {
            return Err(ApiError::invalid_param(
                "top_k",
                format!("top_k must be -1, 0 (disabled) or positive, got {k}"),
            ));
        }
        s.top_k = k.max(0) as i32;
    }
    if let Some(m) = f.min_p {
        s.min_p = in_range("min_p", m, 0.0, 1.0, "in [0, 1]")? as f32;
    }
    if let Some(seed) = f.seed {
        s.seed = Some(seed as u64);
    }
    if (s.temperature as f64) < GREEDY_TEMPERATURE {
        s.temperature = 0.0;
    }
    if let Some(p) = f.presence_penalty {
        s.presence_penalty = in_range("presence_penalty", p, -2.0, 2.0, "between -2 and 2")? as f32;
    }
    if let Some(p) = f.frequency_penalty {
        s.frequency_penalty = in_range("frequency_penalty", p, -2.0, 2.0, "between -2 and 2")? as f32;
    }
    if let Some(r) = f.repetition_penalty.filter(|&r| r != 1.0) {
        return Err(ApiError::invalid_param(
            "repetition_penalty",
            format!("repetition_penalty {r} is not supported (only 1); use presence_penalty / frequency_penalty"),
        ));
    }
    Ok(ValidatedSampling {
        sampling: s,
        max_tokens: max_tokens(f)?,
        stop: stop_strings(f.stop.as_ref())?,
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs: None,
        prompt_only: false,
        n: 1,
    })
}

/// Chat's `logprobs` (bool) and `top_logprobs` (`0..=20`, only with `logprobs: true`) on top of [`sampling`].
pub fn chat_sampling(
    f: &SamplingFields,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    defaults: &SamplingParams,
) -> Result<ValidatedSampling, ApiError> {
    let top = top_logprobs.map(|n| top_count("top_logprobs", n)).transpose()?.unwrap_or(0);
    let wanted = logprobs.unwrap_or(false);
    if top > 0 && !wanted {
        return Err(ApiError::invalid_param("top_logprobs", "top_logprobs needs logprobs set to true"));
    }
    let n = choice_count(f.n, 1, None)?;
    let mut v = sampling(&SamplingFields { n: None, ..f.clone() }, defaults)?;
    v.n = n;
    if wanted {
        v.sampling.top_logprobs = top;
        v.logprobs = Some(LogprobsAsk { top, prompt: false });
    }
    Ok(v)
}

/// What a `/v1/completions` request asks on top of the shared sampling fields.
#[derive(Clone, Copy, Debug, Default)]
pub struct CompletionAsk {
    /// `logprobs`: alternatives per position.
    pub logprobs: Option<i64>,
    pub echo: bool,
    /// Prompts in the batch (choices are `prompts * n`).
    pub prompts: usize,
    pub best_of: Option<i64>,
}

/// Completions' `logprobs` (`0..=20` alternatives), `echo`, `n` and `best_of` on top of [`sampling`]: `echo`
/// with `logprobs` reports the prompt's tokens too, and `echo` allows `max_tokens: 0` (the prompt alone, as
/// loglikelihood evaluations ask).
pub fn completion_sampling(
    f: &SamplingFields,
    ask: CompletionAsk,
    defaults: &SamplingParams,
) -> Result<ValidatedSampling, ApiError> {
    let CompletionAsk { logprobs, echo, prompts, best_of } = ask;
    let top = logprobs.map(|n| top_count("logprobs", n)).transpose()?;
    let n = choice_count(f.n, prompts, best_of)?;
    let prompt_only = echo && f.max_completion_tokens.is_none() && f.max_tokens == Some(0);
    let max_tokens = if prompt_only { Some(1) } else { f.max_tokens };
    let mut v = sampling(&SamplingFields { max_tokens, n: None, ..f.clone() }, defaults)?;
    v.prompt_only = prompt_only;
    v.n = n;
    if let Some(top) = top {
        v.sampling.top_logprobs = top;
        v.sampling.prompt_logprobs = echo;
        v.logprobs = Some(LogprobsAsk { top, prompt: echo });
    }
    Ok(v)
}

/// A count of alternatives per position: `0..=MAX_TOP_LOGPROBS`.
fn top_count(name: &str, n: i64) -> Result<u32, ApiError> {
    if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) {
        return Err(ApiError::invalid_param(name, format!("{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {n}")));
    }
    Ok(n as u32)
}

/// `n` choices per prompt: `1..=MAX_CHOICES`, at most [`MAX_CHOICES`] over all `prompts` of a batch; `best_of`
/// only equal to `n` (nothing ranks extra candidates).
fn choice_count(n: Option<i64>, prompts: usize, best_of: Option<i64>) -> Result<u32, ApiError> {
    let n = n.unwrap_or(1);
    if !(1..=MAX_CHOICES as i64).contains(&n) {
        return Err(ApiError::invalid_param("n", format!("n must be between 1 and {MAX_CHOICES}, got {n}")));
    }
    if prompts.saturating_mul(n as usize) > MAX_CHOICES as usize {
        let param = if n == 1 { "prompt" } else { "n" };
        return Err(ApiError::invalid_param(
            param,
            format!("{prompts} prompts x n = {n} is more than {MAX_CHOICES} choices in one request"),
        ));
    }
    if let Some(b) = best_of.filter(|&b| b != n) {
        return Err(ApiError::invalid_param(
            "best_of",
            format!("best_of must equal n ({n}): candidates are not ranked on the server, got {b}"),
        ));
    }
    Ok(n as u32)
}

/// `n` other than 1 (in APIs with one choice: chat and completions take `n` through [`choice_count`]) and a
/// non-empty `logit_bias` are refused.
fn unsupported_choices(f: &SamplingFields) -> Result<(), ApiError> {
    if let Some(n) = f.n.filter(|&n| n != 1) {
        return Err(ApiError::invalid_param("n", format!("n must be 1 here (one choice per request), got {n}")));
    }
    if let Some(lb) = &f.logit_bias {
        if !(lb.is_null() || lb.as_object().is_some_and(|m| m.is_empty())) {
            return Err(ApiError::invalid_param("logit_bias", "logit_bias is not supported"));
        }
    }
    Ok(())
}

fn in_range(name: &str, v: f64, lo: f64, hi: f64, spelled: &str) -> Result<f64, ApiError> {
    if !v.is_finite() || v < lo || v > hi {
        return Err(ApiError::invalid_param(name, format!("{name} must be {spelled}, got {v}")));
    }
    Ok(v)
}

/// `max_completion_tokens` (preferred) or `max_tokens`: at least 1 when given.
fn max_tokens(f: &SamplingFields) -> Result<Option<u32>, ApiError> {
    let asked = match (f.max_completion_tokens, f.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", m),
        (None, Some(m)) => ("max_tokens", m),
        (None, None) => return Ok(None),
    };
    match asked {
        (name, m) if m < 1 => Err(ApiError::invalid_param(
            name,
            format!("{name} must be at least 1, got {m} (0 only with echo on /v1/completions)"),
        )),
        (_, m) => Ok(Some(m.min(u32::MAX as i64) as u32)),
    }
}

/// A string or a list of strings, none empty.
fn stop_strings(stop: Option<&Json>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid_param("stop", "stop must be a string or a list of strings");
    let stop = match stop {
        None | Some(Json::Null) => vec![],
        Some(Json::String(s)) => vec![s.clone()],
        Some(Json::Array(items)) => {
            items.iter().map(|i| i.as_str().map(String::from).ok_or_else(bad)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(bad()),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid_param("stop", "stop strings must not be empty"));
    }
    Ok(stop)
}

/// What a request is checked against: the engine description's limits and the server's output default.
#[derive(Clone, Debug)]
pub struct Limits {
    pub vocab_size: usize,
    pub max_context: usize,
    pub kv_capacity_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    /// `--max-output-tokens`: the budget of a request that names none.
    pub default_max_output: u32,
}

impl Limits {
    pub fn new(info: &EngineDescription, args: &ServeArgs) -> Self {
        Limits {
            vocab_size: info.vocab_size,
            max_context: info.max_context,
            kv_capacity_tokens: info.kv_capacity_tokens,
            eos_token_ids: info.eos_token_ids.clone(),
            default_max_output: args.max_output_tokens(),
        }
    }
}

/// The model a request names: the served name or an alias; none named means the served model.
pub(crate) fn model(state: &AppState, name: Option<&str>) -> Result<(), ApiError> {
    match name {
        Some(n) if !state.serves_model(n) => Err(ApiError::model_not_found(n)),
        _ => Ok(()),
    }
}

/// A request's tools against its `tool_choice` and the server's tool-call parser: `required` and a named
/// tool need tools (the named one among them) and a parser (they are started for the model, see
/// `http::output`); `none` keeps the tools from the template and the output. `tools` are checked already
/// (`protocol::check_tool`).
pub(crate) fn tools(
    state: &AppState,
    tools: Option<Vec<Json>>,
    choice: ToolChoice,
    parallel: bool,
) -> Result<ToolRequest, ApiError> {
    let tools = tools.unwrap_or_default();
    let forced = match &choice {
        ToolChoice::Required => Some("\"required\"".to_string()),
        ToolChoice::Named(name) => Some(format!("naming {name:?}")),
        _ => None,
    };
    if let Some(what) = forced {
        if tools.is_empty() {
            return Err(bad_choice(format!("tool_choice {what} needs tools, and the request has none")));
        }
        if let ToolChoice::Named(name) = &choice {
            if !tools.iter().any(|t| tool_name(t) == Some(name.as_str())) {
                return Err(bad_choice(format!("tool_choice names {name:?}, which is not one of the tools")));
            }
        }
        if state.tool_call_format.is_none() {
            return Err(bad_choice(format!(
                "tool_choice {what} cannot be served: this server parses no tool calls for its model (start it with --tool-call-parser)")));
        }
    }
    let format = if choice == ToolChoice::None { None } else { state.tool_call_format };
    Ok(ToolRequest { tools, choice, parallel, format })
}

/// A `tool_choice` the request's tools or the server cannot satisfy (`invalid_tool_choice`: what a static
/// schema cannot say).
fn bad_choice(message: String) -> ApiError {
    ApiError::invalid_param("tool_choice", message).with_code("invalid_tool_choice")
}

/// The prompt against the vocabulary, the context and the KV pool, the output budget clamped to what both leave,
/// the model's stop tokens added: the request the engine runs. `param` names the field holding the prompt.
pub fn request(limits: &Limits, prompt: Vec<u32>, v: ValidatedSampling, param: &str) -> Result<Prepared, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(param, "the prompt is empty"));
    }
    // The model's embedding rows bound what the worker takes (it would reject the whole step, failing every
    // request batched with this one).
    let vocab = limits.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(param, format!("token id {bad} is out of the vocabulary (size {vocab})")));
    }
    // the room for output: what the context leaves, and what the whole KV pool leaves
    let room = limits.max_context.min(limits.kv_capacity_tokens).saturating_sub(prompt.len());
    if room == 0 {
        let max = limits.max_context.min(limits.kv_capacity_tokens);
        return Err(ApiError::context_length_exceeded(param, format!(
            "This model's maximum context length is {max} tokens. However, your prompt has {} tokens, which leaves no room for output. Please shorten your prompt.",
            prompt.len()
        )));
    }
    let asked = v.max_tokens.unwrap_or(limits.default_max_output);
    let mut stop_token_ids = limits.eos_token_ids.clone();
    for t in v.stop_token_ids {
        if !stop_token_ids.contains(&t) {
            stop_token_ids.push(t);
        }
    }
    let req = GenerateRequest {
        prompt,
        max_new_tokens: asked.min(room.min(u32::MAX as usize) as u32).max(1),
        sampling: v.sampling,
        stop_token_ids,
        ignore_eos: v.ignore_eos,
    };
    Ok(Prepared { req, stop: v.stop, logprobs: v.logprobs, prompt_only: v.prompt_only, n: v.n })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: Json) -> SamplingFields {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn sampling_validation() {
        let d = SamplingParams { temperature: 0.7, ..Default::default() };
        let v = sampling(&fields(json!({})), &d).unwrap();
        assert_eq!(v.sampling.temperature, 0.7);
        assert_eq!(v.max_tokens, None);
        let v = sampling(
            &fields(json!({"temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 7, "max_tokens": 3, "stop": "x"})),
            &d,
        )
        .unwrap();
        assert_eq!(v.sampling, SamplingParams { temperature: 0.0, top_p: 0.5, seed: Some(7), ..Default::default() });
        assert_eq!(v.max_tokens, Some(3));
        assert_eq!(v.stop, vec!["x".to_string()]);
        let v = sampling(&fields(json!({"top_p": 1e-300})), &d).unwrap();
        assert!(v.sampling.top_p > 0.0);
        let v =
            sampling(&fields(json!({"max_tokens": 3, "max_completion_tokens": 5, "stop": ["a", "b"]})), &d).unwrap();
        assert_eq!(v.max_tokens, Some(5));
        assert_eq!(v.stop.len(), 2);
        for (bad, param) in [
            (json!({"temperature": -0.1}), "temperature"),
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.1}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"min_p": 2}), "min_p"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_completion_tokens": -1}), "max_completion_tokens"),
            (json!({"n": 2}), "n"),
            (json!({"logit_bias": {"1": 5}}), "logit_bias"),
            (json!({"stop": 5}), "stop"),
            (json!({"stop": ["a", 1]}), "stop"),
            (json!({"stop": [""]}), "stop"),
            (json!({"presence_penalty": 2.5}), "presence_penalty"),
            (json!({"frequency_penalty": -3}), "frequency_penalty"),
            (json!({"repetition_penalty": 1.2}), "repetition_penalty"),
        ] {
            let e = sampling(&fields(bad.clone()), &d).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
            assert_eq!(e.param.as_deref(), Some(param), "{bad}");
        }
        assert!(sampling(&fields(json!({"logit_bias": {}, "n": 1, "repetition_penalty": 1.0})), &d).is_ok());
        let v = sampling(&fields(json!({"presence_penalty": 0.5, "frequency_penalty": -1.5})), &d).unwrap();
        assert_eq!((v.sampling.presence_penalty, v.sampling.frequency_penalty), (0.5, -1.5));
    }

    #[test]
    fn choices_validation() {
        let d = SamplingParams::default();
        let chat = |v: Json| {
            let r: crate::http::protocol::ChatCompletionRequest = serde_json::from_value(v).unwrap();
            chat_sampling(&r.sampling, r.logprobs, r.top_logprobs, &d)
        };
        assert_eq!(chat(json!({"messages": [], "n": 2})).unwrap().n, 2);
        assert_eq!(chat(json!({"messages": []})).unwrap().n, 1);
        assert_eq!(chat(json!({"messages": [], "n": 128})).unwrap().n, 128);
        for bad in
            [json!({"messages": [], "n": 0}), json!({"messages": [], "n": 129}), json!({"messages": [], "n": -1})]
        {
            let e = chat(bad.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("n")), "{bad}");
        }
        let completion = |n: i64, prompts: usize, best_of: Option<i64>| {
            let f = fields(json!({"n": n}));
            completion_sampling(&f, CompletionAsk { prompts, best_of, ..Default::default() }, &d)
        };
        assert_eq!(completion(2, 2, Some(2)).unwrap().n, 2);
        assert_eq!(completion(1, 128, None).unwrap().n, 1);
        for (n, prompts, best_of, param) in
            [(2, 65, None, "n"), (1, 129, None, "prompt"), (2, 1, Some(3), "best_of"), (1, 1, Some(2), "best_of")]
        {
            let e = completion(n, prompts, best_of).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{n} {prompts} {best_of:?}");
        }
        // APIs with one choice refuse any other n.
        assert_eq!(sampling(&fields(json!({"n": 2})), &d).unwrap_err().param.as_deref(), Some("n"));
        // Choice i is seeded seed + i; unseeded choices stay unseeded (the scheduler draws each a seed).
        let limits = Limits {
            vocab_size: 10,
            max_context: 10,
            kv_capacity_tokens: 10,
            eos_token_ids: vec![],
            default_max_output: 4,
        };
        let p = request(&limits, vec![1, 2], chat(json!({"messages": [], "n": 3, "seed": 7})).unwrap(), "m").unwrap();
        let seeds: Vec<_> = (0..3).map(|i| p.choice(i).req.sampling.seed).collect();
        assert_eq!(seeds, vec![Some(7), Some(8), Some(9)]);
        assert_eq!(p.choice(1).n, 1);
        let p = request(&limits, vec![1, 2], chat(json!({"messages": [], "n": 3})).unwrap(), "m").unwrap();
        assert_eq!(p.choice(2).req.sampling.seed, None);
    }

    #[test]
    fn logprobs_validation() {
        let d = SamplingParams::default();
        let chat = |v: Json| {
            let r: crate::http::protocol::ChatCompletionRequest = serde_json::from_value(v).unwrap();
            chat_sampling(&r.sampling, r.logprobs, r.top_logprobs, &d)
        };
        let v = chat(json!({"messages": [], "logprobs": true, "top_logprobs": 20})).unwrap();
        assert_eq!((v.logprobs, v.sampling.top_logprobs), (Some(LogprobsAsk { top: 20, prompt: false }), 20));
        assert_eq!(chat(json!({"messages": [], "logprobs": true})).unwrap().logprobs, Some(LogprobsAsk::default()));
        let v = chat(json!({"messages": [], "logprobs": false, "top_logprobs": 0})).unwrap();
        assert_eq!((v.logprobs, v.sampling.top_logprobs), (None, 0));
        for (bad, param) in [
            (json!({"messages": [], "logprobs": true, "top_logprobs": 21}), "top_logprobs"),
            (json!({"messages": [], "logprobs": true, "top_logprobs": 1000000}), "top_logprobs"),
            (json!({"messages": [], "logprobs": true, "top_logprobs": -1}), "top_logprobs"),
            (json!({"messages": [], "top_logprobs": 3}), "top_logprobs"),
            (json!({"messages": [], "logprobs": false, "top_logprobs": 3}), "top_logprobs"),
            (json!({"messages": [], "logprobs": true, "max_tokens": 0}), "max_tokens"),
        ] {
            let e = chat(bad.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{bad}");
        }
        let completion = |v: Json| {
            let r: crate::http::protocol::CompletionRequest = serde_json::from_value(v).unwrap();
            let ask =
                CompletionAsk { logprobs: r.logprobs, echo: r.echo.unwrap_or(false), prompts: 1, best_of: r.best_of };
            completion_sampling(&r.sampling, ask, &d)
        };
        let v = completion(json!({"prompt": "x", "logprobs": 5, "echo": true, "max_tokens": 0})).unwrap();
        assert_eq!(
            (v.logprobs, v.prompt_only, v.max_tokens),
            (Some(LogprobsAsk { top: 5, prompt: true }), true, Some(1))
        );
        assert!(v.sampling.prompt_logprobs && v.sampling.top_logprobs == 5);
        let v = completion(json!({"prompt": "x", "logprobs": 0, "max_tokens": 3})).unwrap();
        assert_eq!(
            (v.logprobs, v.prompt_only, v.sampling.prompt_logprobs),
            (Some(LogprobsAsk::default()), false, false)
        );
        assert!(completion(json!({"prompt": "x", "echo": true, "max_tokens": 0})).unwrap().prompt_only);
        for (bad, param) in [
            (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "x", "logprobs": -1}), "logprobs"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "echo": true, "max_tokens": -1}), "max_tokens"),
        ] {
            let e = completion(bad.clone()).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{bad}");
        }
    }
}
