//! Test fixtures: a tiny real byte-level BPE tokenizer, a scripted `Backend`, and a running server.
#![allow(dead_code)]

pub mod tool_model;

use ft_core::request::{FinishReason, RequestEvent, TopLogprob};
use ft_server::backend::{
    AbortOnDrop, Backend, EngineDescription, GenerateRequest, HealthState, RequestStream, SubmitError,
};
use ft_server::cli::{parse_serve_args, ServeArgs};
use ft_server::http::server::{serve_listener, AppState};
use ft_server::text::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

pub const ENDOFTEXT: u32 = 263;
pub const IM_START: u32 = 264;
pub const IM_END: u32 = 265;
pub const VOCAB: usize = 266;

/// GPT-2's byte → printable-char table (byte-level BPE symbols).
pub fn byte_to_char() -> Vec<char> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![' '; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        table[b as usize] = char::from_u32(c).unwrap();
    }
    table
}

/// A byte-level BPE `tokenizer.json`: ids 0..256 are the bytes, a few merges spell "Hello", " w", "or",
/// "ld", and three ChatML special tokens. Multi-byte characters (emoji) stay split over byte tokens.
pub fn tokenizer_json() -> String {
    let table = byte_to_char();
    let mut vocab = serde_json::Map::new();
    for (b, c) in table.iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let merges = [("Ġ", "w"), ("o", "r"), ("l", "d"), ("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o")];
    for (i, (a, b)) in merges.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), json!(256 + i));
    }
    let special = |id: u32, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(ENDOFTEXT, "<|endoftext|>"), special(IM_START, "<|im_start|>"), special(IM_END, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>(),
        }
    })
    .to_string()
}

pub fn tokenizer() -> Tokenizer {
    Tokenizer::from_json(&tokenizer_json()).unwrap()
}

/// Writes the tokenizer into a fresh temp dir and returns its path.
pub fn write_tokenizer() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "ft-server-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer_json()).unwrap();
    path
}

pub fn engine_description() -> EngineDescription {
    EngineDescription {
        served_model_name: "test-model".into(),
        architecture: "test".into(),
        max_context: 64,
        vocab_size: VOCAB,
        tokenizer_path: write_tokenizer(),
        chat_template: None,
        bos_token: None,
        eos_token: Some("<|im_end|>".into()),
        eos_token_ids: vec![IM_END, ENDOFTEXT],
        add_bos_token: false,
        bos_token_id: None,
        kv_capacity_tokens: 4096,
        planned_workspace_bytes: None,
        generation_defaults: None,
        ..Default::default()
    }
}

/// How a scripted request ends after its tokens.
#[derive(Clone, Debug)]
pub enum End {
    Finish(FinishReason),
    Fail(String),
    /// Keeps sending this token every `delay` until aborted (a model that never stops).
    Trickle(u32),
    /// Drops the event channel without a final event (an engine that vanished).
    Vanish,
}

#[derive(Clone, Debug)]
pub struct Script {
    pub tokens: Vec<u32>,
    pub end: End,
    pub delay: Duration,
    pub cached_tokens: u32,
}

impl Script {
    pub fn reply(text: &str) -> Script {
        let mut tokens = tokenizer().encode(text, false).unwrap();
        tokens.push(IM_END);
        Script { tokens, end: End::Finish(FinishReason::Stop), delay: Duration::ZERO, cached_tokens: 0 }
    }
}

type ScriptFn = Box<dyn Fn(&GenerateRequest) -> Result<Script, SubmitError> + Send + Sync>;

#[derive(Default)]
pub struct Record {
    pub submitted: Mutex<Vec<GenerateRequest>>,
    /// Ids passed to `Backend::abort`.
    pub aborted: Mutex<Vec<u64>>,
    /// Ids whose `RequestStream` guard fired (dropped before the end).
    pub guard_fired: Mutex<Vec<u64>>,
    pub finished: Mutex<Vec<u64>>,
    flags: Mutex<HashMap<u64, Arc<AtomicBool>>>,
}

impl Record {
    fn flag(&self, id: u64) -> Arc<AtomicBool> {
        self.flags.lock().unwrap().entry(id).or_default().clone()
    }
}

/// A `Backend` that answers every request from a script (by default: "Hello 😀 world" then EOS).
pub struct ScriptedBackend {
    pub script: Mutex<ScriptFn>,
    pub health: Mutex<HealthState>,
    pub record: Arc<Record>,
    next_id: AtomicU64,
}

impl ScriptedBackend {
    pub fn new() -> Arc<Self> {
        Arc::new(ScriptedBackend {
            script: Mutex::new(Box::new(|_| Ok(Script::reply("Hello 😀 world")))),
            health: Mutex::new(HealthState::Serving),
            record: Arc::new(Record::default()),
            next_id: AtomicU64::new(1),
        })
    }

    pub fn set_script(&self, f: impl Fn(&GenerateRequest) -> Result<Script, SubmitError> + Send + Sync + 'static) {
        *self.script.lock().unwrap() = Box::new(f);
    }

    pub fn set_health(&self, h: HealthState) {
        *self.health.lock().unwrap() = h;
    }

    pub fn submitted(&self) -> Vec<GenerateRequest> {
        self.record.submitted.lock().unwrap().clone()
    }

    pub fn aborted(&self) -> Vec<u64> {
        self.record.aborted.lock().unwrap().clone()
    }

    pub fn guard_fired(&self) -> Vec<u64> {
        self.record.guard_fired.lock().unwrap().clone()
    }

    /// Waits up to 5 s for `cond`.
    pub async fn wait_for(&self, what: &str, cond: impl Fn(&Self) -> bool) {
        for _ in 0..500 {
            if cond(self) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }
}

impl Backend for ScriptedBackend {
    fn submit(&self, req: GenerateRequest) -> Result<RequestStream, SubmitError> {
        let script = (self.script.lock().unwrap())(&req)?;
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        self.record.submitted.lock().unwrap().push(req.clone());
        let (tx, rx) = mpsc::unbounded_channel();
        let record = self.record.clone();
        let aborted = record.flag(id);
        let prompt_tokens = req.prompt.len() as u32;
        tokio::spawn(async move {
            let _ = tx.send(RequestEvent::Started {
                id,
                prompt_tokens,
                cached_tokens: script.cached_tokens,
                max_new_tokens: req.max_new_tokens,
            });
            for ev in prompt_logprobs(id, &req) {
                let _ = tx.send(ev);
            }
            let mut n = 0u32;
            let finish = |n: u32, reason| RequestEvent::Finished { id, reason, completion_tokens: n };
            let mut tokens = script.tokens.clone().into_iter();
            loop {
                if !script.delay.is_zero() {
                    tokio::time::sleep(script.delay).await;
                }
                if aborted.load(Ordering::SeqCst) {
                    let _ = tx.send(finish(n, FinishReason::Abort));
                    break;
                }
                let next = match tokens.next() {
                    Some(t) => t,
                    None => match &script.end {
                        End::Trickle(t) => *t,
                        End::Finish(reason) => {
                            let _ = tx.send(finish(n, *reason));
                            break;
                        }
                        End::Fail(message) => {
                            let _ = tx.send(RequestEvent::Failed { id, message: message.clone() });
                            break;
                        }
                        End::Vanish => break,
                    },
                };
                n += 1;
                let top_logprobs = scripted_top(next, -0.5, req.sampling.top_logprobs);
                if tx.send(RequestEvent::Token { id, token: next, logprob: -0.5, top_logprobs }).is_err() {
                    break;
                }
                if n >= req.max_new_tokens {
                    let _ = tx.send(finish(n, FinishReason::Length));
                    break;
                }
                if !req.ignore_eos && req.stop_token_ids.contains(&next) {
                    let _ = tx.send(finish(n, FinishReason::Stop));
                    break;
                }
            }
            record.finished.lock().unwrap().push(id);
        });
        let record = self.record.clone();
        let guard = AbortOnDrop::new(move || {
            record.guard_fired.lock().unwrap().push(id);
            record.flag(id).store(true, Ordering::SeqCst);
        });
        Ok(RequestStream { id, events: rx, guard })
    }

    fn abort(&self, id: u64) {
        self.record.aborted.lock().unwrap().push(id);
        self.record.flag(id).store(true, Ordering::SeqCst);
    }

    fn health(&self) -> HealthState {
        self.health.lock().unwrap().clone()
    }

    fn stats(&self) -> ft_server::engine::stats::EngineStats {
        ft_server::engine::stats::EngineStats {
            requests_in_flight: self.record.submitted.lock().unwrap().len(),
            ..Default::default()
        }
    }
}

/// Scripted alternatives of `token` (logprob `lp`): itself first, then byte tokens `token + 1, token + 2, ...`
/// (wrapping inside the byte range), each one less likely.
pub fn scripted_top(token: u32, lp: f32, n: u32) -> Vec<TopLogprob> {
    let id = |i: u32| if i == 0 { token } else { (token + i) % 256 };
    (0..n).map(|i| TopLogprob { token: id(i), logprob: lp - i as f32 }).collect()
}

/// Scripted prompt logprobs (when asked): prompt position `q` gets `-0.1 * q`, in two chunks as chunked prefill
/// reports them.
pub fn prompt_logprobs(id: u64, req: &GenerateRequest) -> Vec<RequestEvent> {
    if !req.sampling.prompt_logprobs || req.prompt.len() < 2 {
        return vec![];
    }
    let n = req.prompt.len() as u32;
    let half = 1 + (n - 1) / 2;
    [(1, half), (half, n)]
        .into_iter()
        .filter(|(a, b)| a < b)
        .map(|(start, end)| {
            let lp = |q: u32| -0.1 * q as f32;
            let top = (start..end).map(|q| scripted_top(req.prompt[q as usize], lp(q), req.sampling.top_logprobs));
            RequestEvent::PromptLogprobs {
                id,
                start,
                logprobs: (start..end).map(lp).collect(),
                top_logprobs: top.collect(),
            }
        })
        .collect()
}

pub struct TestServer {
    pub base: String,
    pub backend: Arc<ScriptedBackend>,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    pub async fn start() -> TestServer {
        Self::start_with(&[], engine_description()).await
    }

    /// `flags`: extra `ft serve` flags.
    pub async fn start_with(flags: &[&str], info: EngineDescription) -> TestServer {
        let args: ServeArgs = parse_serve_args(flags.iter().copied()).unwrap();
        let backend = ScriptedBackend::new();
        let state = AppState::new(args, backend.clone(), info).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(serve_listener(listener, state, async move {
            let _ = rx.await;
        }));
        TestServer { base, backend, client: reqwest::Client::new(), shutdown: Some(tx), handle: Some(handle) }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let resp = self.client.post(self.url(path)).json(&body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
    }

    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let resp = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let resp = self.client.get(self.url(path)).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
    }

    /// POSTs and reads an SSE body to its end: the `data:` payloads in order (`[DONE]` kept as a string).
    pub async fn post_sse(&self, path: &str, body: Value) -> (u16, Vec<SseData>) {
        let resp = self.client.post(self.url(path)).json(&body).send().await.unwrap();
        let status = resp.status().as_u16();
        if status == 200 {
            let ct = resp.headers().get("content-type").unwrap().to_str().unwrap().to_string();
            assert!(ct.starts_with("text/event-stream"), "{ct}");
        }
        let text = resp.text().await.unwrap();
        (status, parse_sse(&text))
    }

    /// Waits for the server to return by itself (after a signal), without asking it to stop.
    pub async fn wait_stopped(mut self, within: Duration) {
        let h = self.handle.take().unwrap();
        tokio::time::timeout(within, h).await.expect("server returned by itself").unwrap().unwrap();
    }

    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.handle.take() {
            tokio::time::timeout(Duration::from_secs(10), h).await.expect("server shut down").unwrap().unwrap();
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum SseData {
    Json(Value),
    Done,
}

/// Splits an SSE body into events; every event must be one `data:` line (keep-alive comments skipped).
pub fn parse_sse(text: &str) -> Vec<SseData> {
    let mut out = vec![];
    for block in text.split("\n\n") {
        if block.trim().is_empty() {
            continue;
        }
        let lines: Vec<&str> = block.lines().filter(|l| !l.starts_with(':')).collect();
        if lines.is_empty() {
            continue;
        }
        assert_eq!(lines.len(), 1, "one data line per event: {block:?}");
        let data = lines[0].strip_prefix("data: ").unwrap_or_else(|| panic!("not a data line: {:?}", lines[0]));
        if data == "[DONE]" {
            out.push(SseData::Done);
        } else {
            out.push(SseData::Json(serde_json::from_str(data).unwrap_or_else(|e| panic!("bad JSON {e}: {data}"))));
        }
    }
    out
}

pub fn chat_body(content: &str) -> Value {
    json!({"model": "test-model", "messages": [{"role": "user", "content": content}]})
}
