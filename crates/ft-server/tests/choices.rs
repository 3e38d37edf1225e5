//! `n > 1` choices (and a batch of prompts on `/v1/completions`) against the scripted backend: indexes, one
//! finish per choice, usage counted as OpenAI does, the other choices submitted after the leader's first
//! token, seeds `seed + i`, errors and disconnects ending every choice.

mod common;

use common::*;
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn chunks(events: &[SseData]) -> Vec<Value> {
    events.iter().filter_map(|e| if let SseData::Json(v) = e { Some(v.clone()) } else { None }).collect()
}

fn chat(n: u32) -> Value {
    json!({"messages": [{"role": "user", "content": "Hi"}], "n": n, "max_tokens": 20})
}

/// Tokens of the default script's reply ("Hello 😀 world" and its end-of-turn token).
fn reply_tokens() -> u32 {
    Script::reply("Hello 😀 world").tokens.len() as u32
}

/// Per choice index: its chunks' choice objects, in order.
fn by_index(chunks: &[Value]) -> BTreeMap<u64, Vec<Value>> {
    let mut out: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
    for c in chunks {
        for choice in c["choices"].as_array().unwrap() {
            out.entry(choice["index"].as_u64().unwrap()).or_default().push(choice.clone());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_whole_n_choices() {
    let s = TestServer::start().await;
    let (status, one) = s.post("/v1/chat/completions", chat(1)).await;
    assert_eq!(status, 200, "{one}");
    let (status, body) =
        s.post("/v1/chat/completions", chat(3).merge(json!({"seed": 5, "logprobs": true, "top_logprobs": 2}))).await;
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i as u64);
        assert_eq!(c["finish_reason"], "stop");
        assert_eq!(c["message"]["role"], "assistant");
        assert_eq!(c["message"]["content"], "Hello 😀 world");
        assert_eq!(c["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().len(), 2);
    }
    // The prompt counts once, every choice's output counts.
    let prompt = one["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], prompt);
    assert_eq!(body["usage"]["completion_tokens"], 3 * reply_tokens());
    assert_eq!(body["usage"]["total_tokens"], prompt + 3 * reply_tokens() as u64);
    let seeds: Vec<_> = s.backend.submitted()[1..].iter().map(|r| r.sampling.seed).collect();
    assert_eq!(seeds, vec![Some(5), Some(6), Some(7)]);
    s.stop().await;
}

/// `json!` objects merged (the right side's keys win); keeps the test bodies short.
trait Merge {
    fn merge(self, other: Value) -> Value;
}

impl Merge for Value {
    fn merge(mut self, other: Value) -> Value {
        for (k, v) in other.as_object().unwrap() {
            self[k] = v.clone();
        }
        self
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_batch_of_prompts_times_n() {
    let s = TestServer::start().await;
    let body = json!({"prompt": ["Hello", [72, 105, 33]], "n": 2, "echo": true, "logprobs": 1, "max_tokens": 20});
    let (status, body) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let hello = tokenizer().encode("Hello", false).unwrap().len() as u32;
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i as u64);
        assert_eq!(c["finish_reason"], "stop");
        let echo = if i < 2 { "Hello" } else { "Hi!" };
        assert_eq!(c["text"], format!("{echo}Hello 😀 world"), "{c}");
        let tokens = c["logprobs"]["tokens"].as_array().unwrap();
        assert!(c["logprobs"]["token_logprobs"][0].is_null(), "the echoed prompt's first token has none");
        assert_eq!(tokens.len() as u32, if i < 2 { hello } else { 3 } + reply_tokens() - 1, "{c}");
    }
    assert_eq!(body["usage"]["prompt_tokens"], hello + 3, "each prompt once");
    assert_eq!(body["usage"]["completion_tokens"], 4 * reply_tokens());
    let prompts: Vec<_> = s.backend.submitted().iter().map(|r| r.prompt.len() as u64).collect();
    assert_eq!(prompts.iter().filter(|&&p| p == hello as u64).count(), 2);
    assert_eq!(prompts.iter().filter(|&&p| p == 3).count(), 2);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streamed_n_choices() {
    let s = TestServer::start().await;
    s.backend.set_script(|_| Ok(Script { delay: Duration::from_millis(2), ..Script::reply("Hello 😀 world") }));
    let body = chat(3).merge(json!({"stream": true, "stream_options": {"include_usage": true}, "logprobs": true}));
    let (status, events) = s.post_sse("/v1/chat/completions", body).await;
    assert_eq!(status, 200);
    assert_eq!(events.last(), Some(&SseData::Done));
    let chunks = chunks(&events);
    let per_choice = by_index(&chunks);
    assert_eq!(per_choice.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
    for (i, choice) in &per_choice {
        assert_eq!(choice[0]["delta"]["role"], "assistant", "choice {i}: the role comes first");
        assert_eq!(choice.iter().filter(|c| c["delta"].get("role").is_some()).count(), 1);
        let finishes: Vec<_> = choice.iter().filter(|c| !c["finish_reason"].is_null()).collect();
        assert_eq!(finishes.len(), 1, "choice {i}: exactly one finish_reason");
        assert_eq!(finishes[0]["finish_reason"], "stop");
        assert!(choice.last().unwrap()["finish_reason"] == "stop", "choice {i}: the finish is its last chunk");
        let text: String = choice.iter().filter_map(|c| c["delta"]["content"].as_str()).collect();
        assert_eq!(text, "Hello 😀 world");
        let lp: usize = choice.iter().filter_map(|c| c["logprobs"]["content"].as_array()).map(Vec::len).sum();
        assert_eq!(lp as u32, reply_tokens() - 1, "choice {i}: one entry per token of text");
    }
    // Usage only in the last chunk, with empty choices, summed.
    let usage: Vec<&Value> = chunks.iter().filter(|c| c.get("usage").is_some_and(|u| !u.is_null())).collect();
    assert_eq!(usage.len(), 1);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 3 * reply_tokens());
    assert_eq!(last["usage"]["prompt_tokens"], s.backend.submitted()[0].prompt.len() as u64);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_streamed_n_choices() {
    let s = TestServer::start().await;
    let body = json!({"prompt": "Hello", "n": 2, "echo": true, "stream": true, "max_tokens": 20,
                      "stream_options": {"include_usage": true}});
    let (status, events) = s.post_sse("/v1/completions", body).await;
    assert_eq!(status, 200);
    assert_eq!(events.last(), Some(&SseData::Done));
    let chunks = chunks(&events);
    let per_choice = by_index(&chunks);
    assert_eq!(per_choice.len(), 2);
    for (i, choice) in &per_choice {
        assert_eq!(choice[0]["text"], "Hello", "choice {i}: the echo first");
        let text: String = choice.iter().filter_map(|c| c["text"].as_str()).collect();
        assert_eq!(text, "HelloHello 😀 world");
        assert_eq!(choice.iter().filter(|c| !c["finish_reason"].is_null()).count(), 1);
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 2 * reply_tokens());
    s.stop().await;
}

/// The other choices are submitted once the leader sampled its first token (its prompt is cached by then), and
/// report the cached prompt; usage says how much of the prompt was cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_choices_wait_for_the_leaders_first_token() {
    let s = TestServer::start_with(&["--enable-cache-report"], engine_description()).await;
    let submissions = Arc::new(AtomicUsize::new(0));
    let count = submissions.clone();
    s.backend.set_script(move |req| {
        let leader = count.fetch_add(1, Ordering::SeqCst) == 0;
        let delay = Duration::from_millis(if leader { 150 } else { 1 });
        let cached_tokens = if leader { 0 } else { req.prompt.len() as u32 - 1 };
        Ok(Script { delay, cached_tokens, ..Script::reply("Hello 😀 world") })
    });
    let (client, url) = (s.client.clone(), s.url("/v1/chat/completions"));
    let req = tokio::spawn(async move { client.post(url).json(&chat(3)).send().await.unwrap().json::<Value>().await });
    tokio::time::sleep(Duration::from_millis(80)).await;
    assert_eq!(s.backend.submitted().len(), 1, "only the leader before its first token");
    let body = req.await.unwrap().unwrap();
    assert_eq!(s.backend.submitted().len(), 3);
    let prompt = s.backend.submitted()[0].prompt.len() as u64;
    assert_eq!(body["usage"]["prompt_tokens"], prompt);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], prompt - 1);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_choices_are_equal_and_one_failure_fails_the_request() {
    let s = TestServer::start().await;
    let (status, body) = s.post("/v1/chat/completions", chat(2).merge(json!({"temperature": 0}))).await;
    assert_eq!(status, 200);
    assert_eq!(body["choices"][0]["message"], body["choices"][1]["message"]);
    assert!(s.backend.submitted().iter().all(|r| r.sampling.temperature == 0.0));

    // The second choice fails: the whole response is the error, streamed or not.
    let submissions = Arc::new(AtomicUsize::new(0));
    let count = submissions.clone();
    s.backend.set_script(move |_| {
        if count.fetch_add(1, Ordering::SeqCst) % 2 == 1 {
            let tokens = tokenizer().encode("Hel", false).unwrap();
            return Ok(Script { tokens, end: End::Fail("boom".into()), ..Script::reply("") });
        }
        Ok(Script::reply("Hello 😀 world"))
    });
    let (status, body) = s.post("/v1/chat/completions", chat(2)).await;
    assert_eq!(status, 500, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("boom"));
    let (status, events) = s.post_sse("/v1/chat/completions", chat(2).merge(json!({"stream": true}))).await;
    assert_eq!(status, 200);
    assert_eq!(events.last(), Some(&SseData::Done));
    let chunks = chunks(&events);
    assert!(chunks.iter().any(|c| c["error"]["message"].as_str().is_some_and(|m| m.contains("boom"))));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_while_waiting_for_a_whole_response_aborts_every_choice() {
    let mut info = engine_description();
    info.max_context = 100000;
    let s = TestServer::start_with(&[], info).await;
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay: Duration::from_millis(5), cached_tokens: 0 })
    });
    let (client, url) = (s.client.clone(), s.url("/v1/completions"));
    let body = json!({"prompt": ["x", "y"], "n": 2, "max_tokens": 1000000});
    let req = tokio::spawn(async move { client.post(url).json(&body).send().await });
    s.backend.wait_for("every choice to start", |b| b.submitted().len() == 4).await;
    req.abort();
    s.backend.wait_for("every choice's guard to fire", |b| b.guard_fired().len() == 4).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_aborts_every_choice() {
    let mut info = engine_description();
    info.max_context = 100000;
    let s = TestServer::start_with(&[], info).await;
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay: Duration::from_millis(5), cached_tokens: 0 })
    });
    let body = chat(3).merge(json!({"stream": true, "max_tokens": 10000}));
    let resp = s.client.post(s.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    let mut bytes = resp.bytes_stream();
    let mut seen = String::new();
    while !(seen.contains("\"index\":2") && seen.contains("\"content\":\"a\"")) {
        let chunk = bytes.next().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(bytes);
    s.backend.wait_for("every choice's guard to fire", |b| b.guard_fired().len() == 3).await;
    s.stop().await;
}
