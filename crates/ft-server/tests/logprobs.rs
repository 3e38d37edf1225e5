//! Logprobs through the real router against the scripted backend (`common`: every token's logprob is -0.5, its
//! alternatives itself then the next ids, prompt position `q` gets -0.1·q in two chunks): chat's `content` list
//! with `bytes`, completions' legacy shape with `echo`, streamed equal to whole, and the 400s.

mod common;

use common::*;
use serde_json::{json, Value};

fn chunks(events: &[SseData]) -> Vec<Value> {
    events.iter().filter_map(|e| if let SseData::Json(v) = e { Some(v.clone()) } else { None }).collect()
}

/// The chat `content` entries of a streamed answer, concatenated over its chunks.
fn streamed_chat_content(events: &[SseData]) -> Vec<Value> {
    chunks(events)
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|ch| ch["logprobs"]["content"].as_array()).cloned())
        .flatten()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_whole_and_streamed() {
    let s = TestServer::start().await;
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": 3});
    let (status, whole) = s.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    // one entry per token of the text (the stop token is not text); the bytes spell it exactly, the emoji
    // included although it is split over byte tokens whose own text is U+FFFD
    let bytes: Vec<u8> = content
        .iter()
        .flat_map(|e| e["bytes"].as_array().unwrap().clone())
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    assert_eq!(String::from_utf8(bytes).unwrap(), "Hello 😀 world");
    assert_eq!(content.len(), Script::reply("Hello 😀 world").tokens.len() - 1);
    assert_eq!(content[0]["token"], "Hello");
    for e in &content {
        assert_eq!(e["logprob"], -0.5);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!((&top[0]["token"], &top[0]["logprob"], &top[0]["bytes"]), (&e["token"], &e["logprob"], &e["bytes"]));
        assert_eq!(top[2]["logprob"], -2.5);
    }
    let sub = &s.backend.submitted()[0];
    assert_eq!((sub.sampling.top_logprobs, sub.sampling.prompt_logprobs), (3, false));
    let (status, events) = s.post_sse("/v1/chat/completions", with(&body, "stream", json!(true))).await;
    assert_eq!(status, 200);
    assert_eq!(streamed_chat_content(&events), content);
    // not asked: null, whole and streamed
    let (_, plain) = s.post("/v1/chat/completions", chat_body("Hi")).await;
    assert!(plain["choices"][0]["logprobs"].is_null());
    let (_, events) = s.post_sse("/v1/chat/completions", with(&chat_body("Hi"), "stream", json!(true))).await;
    assert!(chunks(&events).iter().all(|c| c["choices"].get(0).is_none_or(|ch| ch["logprobs"].is_null())));
    s.stop().await;
}

/// `body` with `key` set to `value`.
fn with(body: &Value, key: &str, value: Value) -> Value {
    let mut b = body.clone();
    b[key] = value;
    b
}

/// The legacy `logprobs` object of a streamed completion, its lists concatenated over the chunks.
fn streamed_completion_logprobs(events: &[SseData]) -> Value {
    let mut all = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in chunks(events) {
        let Some(lp) = c["choices"].get(0).map(|ch| &ch["logprobs"]).filter(|l| !l.is_null()) else { continue };
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let items = lp[key].as_array().unwrap().clone();
            all[key].as_array_mut().unwrap().extend(items);
        }
    }
    all
}

fn streamed_text(events: &[SseData]) -> String {
    chunks(events)
        .iter()
        .filter_map(|c| c["choices"].get(0).and_then(|ch| ch["text"].as_str()).map(String::from))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_logprobs_legacy_shape() {
    let s = TestServer::start().await;
    let body = json!({"prompt": "Hi", "logprobs": 2, "max_tokens": 20});
    let (status, whole) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{whole}");
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(text, "Hello 😀 world");
    let lp = &whole["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens[0], "Hello");
    assert!(lp["token_logprobs"].as_array().unwrap().iter().all(|v| v == -0.5));
    let offsets: Vec<usize> =
        lp["text_offset"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as usize).collect();
    assert_eq!(offsets[0], 0);
    let chars: Vec<char> = text.chars().collect();
    for (tok, &at) in tokens.iter().zip(&offsets) {
        let tok = tok.as_str().unwrap();
        if !tok.contains('\u{FFFD}') {
            assert_eq!(chars[at..at + tok.chars().count()].iter().collect::<String>(), tok, "offset {at}");
        }
    }
    for top in lp["top_logprobs"].as_array().unwrap() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}"); // 2 alternatives, the chosen token among them
    }
    let (_, events) = s.post_sse("/v1/completions", with(&body, "stream", json!(true))).await;
    assert_eq!(streamed_text(&events), text);
    assert_eq!(&streamed_completion_logprobs(&events), lp);
    s.stop().await;
}

/// What loglikelihood evaluations send: `echo`, `logprobs`, `max_tokens: 0`. The prompt alone comes back with its
/// tokens' logprobs (the first null), nothing generated shows; streamed equals whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_prompt_logprobs_with_max_tokens_zero() {
    let s = TestServer::start().await;
    let body = json!({"prompt": "Hello world", "echo": true, "logprobs": 1, "max_tokens": 0});
    let (status, whole) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{whole}");
    let choice = &whole["choices"][0];
    assert_eq!((&choice["text"], &choice["finish_reason"]), (&json!("Hello world"), &json!("length")));
    assert_eq!(whole["usage"]["completion_tokens"], 0);
    let prompt = tokenizer().encode("Hello world", false).unwrap();
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(tokens.concat(), "Hello world");
    assert_eq!(tokens.len(), prompt.len());
    let want: Vec<Value> =
        (0..prompt.len()).map(|q| if q == 0 { Value::Null } else { json!(-0.1 * q as f32) }).collect();
    assert_eq!(lp["token_logprobs"].as_array().unwrap(), &want);
    assert!(lp["top_logprobs"][0].is_null());
    assert_eq!(lp["top_logprobs"][1].as_object().unwrap().len(), 1);
    assert_eq!(lp["text_offset"][0], 0);
    let sub = &s.backend.submitted()[0];
    assert_eq!((sub.max_new_tokens, sub.sampling.prompt_logprobs, sub.sampling.top_logprobs), (1, true, 1));
    let (_, events) = s.post_sse("/v1/completions", with(&body, "stream", json!(true))).await;
    assert_eq!(streamed_text(&events), "Hello world");
    assert_eq!(&streamed_completion_logprobs(&events), lp);
    // echo and logprobs with output: the prompt's entries, then the output's, offsets past the prompt
    let (_, whole) = s.post("/v1/completions", with(&body, "max_tokens", json!(5))).await;
    let lp = &whole["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), prompt.len() + 5);
    assert_eq!(lp["text_offset"][prompt.len()], "Hello world".len());
    assert_eq!(lp["token_logprobs"][prompt.len()], -0.5);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_logprobs_are_400() {
    let s = TestServer::start().await;
    let msg = json!([{"role": "user", "content": "Hi"}]);
    for (path, body, param) in [
        ("/v1/chat/completions", json!({"messages": msg, "logprobs": true, "top_logprobs": 1000000}), "top_logprobs"),
        ("/v1/chat/completions", json!({"messages": msg, "logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        ("/v1/chat/completions", json!({"messages": msg, "top_logprobs": 2}), "top_logprobs"),
        ("/v1/completions", json!({"prompt": "Hi", "logprobs": 21}), "logprobs"),
        ("/v1/completions", json!({"prompt": "Hi", "logprobs": -1}), "logprobs"),
        ("/v1/completions", json!({"prompt": "Hi", "max_tokens": 0}), "max_tokens"),
    ] {
        let (status, err) = s.post(path, body.clone()).await;
        assert_eq!(status, 400, "{body}: {err}");
        assert_eq!((&err["error"]["type"], &err["error"]["param"]), (&json!("invalid_request_error"), &json!(param)));
    }
    assert!(s.backend.submitted().is_empty());
    s.stop().await;
}
