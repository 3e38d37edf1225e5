//! The real router on 127.0.0.1:0 against a scripted backend, driven with reqwest.

mod common;

use common::*;
use ft_core::request::{AdmissionError, FinishReason};
use ft_server::backend::EngineDescription;
use ft_server::backend::{HealthState, SubmitError};
use futures::StreamExt;
use serde_json::{json, Value};
use std::time::Duration;

fn assert_openai_error(body: &Value) {
    let err = body.get("error").unwrap_or_else(|| panic!("no error object: {body}"));
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(err["type"].is_string(), "{body}");
    assert!(err.get("param").is_some() && err.get("code").is_some(), "{body}");
}

fn chunks(events: &[SseData]) -> Vec<Value> {
    events.iter().filter_map(|e| if let SseData::Json(v) = e { Some(v.clone()) } else { None }).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_non_streaming() {
    let s = TestServer::start().await;
    let (status, body) = s.post("/v1/chat/completions", chat_body("Hi")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["model"], "test-model");
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "Hello 😀 world");
    assert_eq!(choice["finish_reason"], "stop");
    // The prompt is the ChatML fallback rendering, tokenized with its special tokens.
    let tok = tokenizer();
    let expected = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", false).unwrap();
    let sub = s.backend.submitted();
    assert_eq!(sub[0].prompt, expected);
    assert_eq!(sub[0].prompt[0], IM_START);
    assert_eq!(sub[0].stop_token_ids, vec![IM_END, ENDOFTEXT]);
    // 64-token context: the output budget is clamped to what the prompt leaves.
    assert_eq!(sub[0].max_new_tokens as usize, 64 - expected.len());
    let completion = Script::reply("Hello 😀 world").tokens.len();
    assert_eq!(body["usage"]["prompt_tokens"], expected.len());
    assert_eq!(body["usage"]["completion_tokens"], completion);
    assert_eq!(body["usage"]["total_tokens"], expected.len() + completion);
    assert!(body["usage"].get("prompt_tokens_details").is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_framing() {
    let s = TestServer::start().await;
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, events) = s.post_sse("/v1/chat/completions", body).await;
    assert_eq!(status, 200);
    assert_eq!(events.last(), Some(&SseData::Done));
    assert_eq!(events.iter().filter(|e| **e == SseData::Done).count(), 1);
    let chunks = chunks(&events);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut content = String::new();
    let mut finishes = 0;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], "test-model");
        assert_eq!(c["id"], chunks[0]["id"]);
        for choice in c["choices"].as_array().unwrap() {
            if let Some(t) = choice["delta"]["content"].as_str() {
                assert!(!t.contains('\u{FFFD}'), "split character emitted: {t:?}");
                content.push_str(t);
            }
            if !choice["finish_reason"].is_null() {
                finishes += 1;
                assert_eq!(choice["finish_reason"], "stop");
            }
        }
    }
    assert_eq!(content, "Hello 😀 world");
    assert_eq!(finishes, 1);
    // The usage chunk: last JSON chunk, empty choices.
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    let u = &usage["usage"];
    assert_eq!(u["completion_tokens"], Script::reply("Hello 😀 world").tokens.len());
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    // Only the usage chunk carries usage.
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c.get("usage").is_none()));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streaming_without_usage_and_with_cache_report() {
    let s = TestServer::start_with(&["--enable-cache-report"], engine_description()).await;
    s.backend.set_script(|_| Ok(Script { cached_tokens: 3, ..Script::reply("ok") }));
    let mut body = chat_body("Hi");
    body["stream"] = json!(true);
    let (_, events) = s.post_sse("/v1/chat/completions", body.clone()).await;
    let chunks = chunks(&events);
    assert!(chunks.iter().all(|c| c.get("usage").is_none() && c["choices"].as_array().unwrap().len() == 1));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    // Non-streaming with --enable-cache-report.
    body["stream"] = json!(false);
    let (status, resp) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200);
    assert_eq!(resp["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
    assert_eq!(resp["choices"][0]["message"]["content"], "ok");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_uses_model_template_and_sampling_fields() {
    let mut info = engine_description();
    info.chat_template = Some("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}".into());
    info.max_context = 4096;
    let s = TestServer::start_with(&["--max-output-tokens", "100"], info).await;
    let body = json!({
        "model": "test-model",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "temperature": 0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 42,
        "ignore_eos": true, "stop_token_ids": [7], "presence_penalty": 0.5
    });
    let (status, resp) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{resp}");
    let sub = &s.backend.submitted()[0];
    let expected = tokenizer()
        .encode("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", false)
        .unwrap();
    assert_eq!(sub.prompt, expected);
    assert_eq!(sub.sampling.temperature, 0.0);
    assert_eq!(sub.sampling.top_p, 0.9);
    assert_eq!(sub.sampling.top_k, 5);
    assert!((sub.sampling.min_p - 0.1).abs() < 1e-6);
    assert_eq!(sub.sampling.seed, Some(42));
    assert!(sub.ignore_eos);
    assert_eq!(sub.stop_token_ids, vec![IM_END, ENDOFTEXT, 7]);
    assert_eq!(sub.max_new_tokens, 100);
    // With ignore_eos the EOS token is ordinary output (it decodes to nothing: special tokens are skipped).
    assert_eq!(resp["choices"][0]["message"]["content"], "Hello 😀 world");
    // max_tokens wins over the server default; defaults otherwise (--sampling-defaults model: temperature 1).
    let (status, _) =
        s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})).await;
    assert_eq!(status, 200);
    let sub = &s.backend.submitted()[1];
    assert_eq!(sub.max_new_tokens, 3);
    assert_eq!(sub.sampling.temperature, 1.0);
    assert!(!sub.ignore_eos);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_defaults_none_is_greedy() {
    let s = TestServer::start_with(&["--sampling-defaults", "none"], engine_description()).await;
    let (status, _) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 200);
    assert_eq!(s.backend.submitted()[0].sampling.temperature, 0.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_while_the_engine_is_unhealthy_is_503() {
    let s = TestServer::start().await;
    // The engine dies (the watchdog or a fatal error marks it unhealthy first) while a request is in flight.
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: vec![b'a' as u32],
            end: End::Fail("engine stalled: step 3".into()),
            delay: Duration::from_millis(300),
            cached_tokens: 0,
        })
    });
    let backend = s.backend.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        backend.set_health(HealthState::Unhealthy("engine stalled: step 3".into()));
    });
    let (status, body) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 503, "{body}");
    assert_openai_error(&body);
    assert!(body["error"]["message"].as_str().unwrap().contains("engine stalled"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finish_length_and_failures() {
    let s = TestServer::start().await;
    // Length: the backend stops at max_tokens.
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay: Duration::ZERO, cached_tokens: 0 })
    });
    let (status, body) =
        s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "aaaa");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 4);

    // Failed: 500 in error shape without streaming...
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: tokenizer().encode("partial", false).unwrap(),
            end: End::Fail("CUDA out of memory in step 7".into()),
            delay: Duration::ZERO,
            cached_tokens: 0,
        })
    });
    let (status, body) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 500);
    assert_openai_error(&body);
    assert!(body["error"]["message"].as_str().unwrap().contains("CUDA out of memory"));
    // ...and an error event then [DONE] when streaming.
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: tokenizer().encode("partial", false).unwrap(),
            end: End::Fail("worker died".into()),
            delay: Duration::ZERO,
            cached_tokens: 0,
        })
    });
    let mut body = chat_body("x");
    body["stream"] = json!(true);
    let (status, events) = s.post_sse("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(events.last(), Some(&SseData::Done));
    let chunks = chunks(&events);
    let err = chunks.last().unwrap();
    assert_openai_error(err);
    assert!(err["error"]["message"].as_str().unwrap().contains("worker died"));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "partial");
    // An engine that vanishes mid-request is an error too, never a hang.
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![b'x' as u32], end: End::Vanish, delay: Duration::ZERO, cached_tokens: 0 })
    });
    let (status, body) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 500);
    assert_openai_error(&body);
    let (_, events) = s
        .post_sse("/v1/chat/completions", {
            let mut b = chat_body("x");
            b["stream"] = json!(true);
            b
        })
        .await;
    assert_eq!(events.last(), Some(&SseData::Done));
    assert_openai_error(chunks_last(&events));
    s.stop().await;
}

fn chunks_last(events: &[SseData]) -> &Value {
    events.iter().rev().find_map(|e| if let SseData::Json(v) = e { Some(v) } else { None }).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_across_token_boundaries() {
    let s = TestServer::start().await;
    s.backend
        .set_script(|_| Ok(Script { delay: Duration::from_millis(1), ..Script::reply("Hello world, Hello world") }));
    // "lo wo" spans the tokens "Hello", "Ġw", "or".
    let mut body = chat_body("x");
    body["stop"] = json!(["zzz", "lo wo"]);
    let (status, resp) = s.post("/v1/chat/completions", body.clone()).await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["choices"][0]["message"]["content"], "Hel");
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    let first_id = 1;
    s.backend.wait_for("abort on stop string", |b| b.aborted().contains(&first_id)).await;

    body["stream"] = json!(true);
    let (_, events) = s.post_sse("/v1/chat/completions", body).await;
    let chunks = chunks(&events);
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "Hel");
    let finishes: Vec<_> = chunks.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).collect();
    assert_eq!(finishes.len(), 1);
    assert_eq!(finishes[0]["choices"][0]["finish_reason"], "stop");
    assert_eq!(events.last(), Some(&SseData::Done));
    s.backend.wait_for("abort on stop string (stream)", |b| b.aborted().contains(&2)).await;

    // A stop string that never completes is released at the end; the emoji never comes out split.
    let (_, resp) = s.post("/v1/completions", json!({"prompt": "x", "stop": "world!"})).await;
    assert_eq!(resp["choices"][0]["text"], "Hello world, Hello world");
    assert_eq!(resp["choices"][0]["finish_reason"], "stop");
    s.backend.set_script(|_| Ok(Script::reply("a 😀 b")));
    let (_, resp) = s.post("/v1/completions", json!({"prompt": "x", "stop": "\u{1F600}"})).await;
    assert_eq!(resp["choices"][0]["text"], "a ");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_text_ids_echo_and_stream() {
    let s = TestServer::start().await;
    let (status, body) =
        s.post("/v1/completions", json!({"model": "test-model", "prompt": "Hello world", "max_tokens": 20})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["choices"][0]["text"], "Hello 😀 world");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert!(body["choices"][0]["logprobs"].is_null());
    let tok = tokenizer();
    assert_eq!(s.backend.submitted()[0].prompt, tok.encode("Hello world", false).unwrap());
    assert_eq!(s.backend.submitted()[0].max_new_tokens, 20);
    assert_eq!(body["usage"]["prompt_tokens"], 4);

    // Token ids, plain and nested, with echo.
    let (status, body) = s.post("/v1/completions", json!({"prompt": [[262, 256, 257, 258]], "echo": true})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(s.backend.submitted()[1].prompt, vec![262, 256, 257, 258]);
    assert_eq!(body["choices"][0]["text"], "Hello worldHello 😀 world");

    // Streaming, with usage.
    let (status, events) = s
        .post_sse(
            "/v1/completions",
            json!({"prompt": [72, 105], "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(events.last(), Some(&SseData::Done));
    let chunks = chunks(&events);
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|x| x["text"].as_str())).collect();
    assert_eq!(text, "Hello 😀 world");
    let finishes = chunks.iter().filter(|c| c["choices"].get(0).is_some_and(|x| !x["finish_reason"].is_null())).count();
    assert_eq!(finishes, 1);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["prompt_tokens"], 2);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));

    // Bad prompts.
    for bad in [
        json!({"prompt": ["a", []]}),
        json!({"prompt": []}),
        json!({"prompt": [999999]}),
        json!({"prompt": {"x": 1}}),
        json!({}),
    ] {
        let (status, body) = s.post("/v1/completions", bad.clone()).await;
        assert_eq!(status, 400, "{bad} -> {body}");
        assert_openai_error(&body);
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_stats_and_404() {
    let s = TestServer::start().await;
    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["id"], "test-model");
    assert_eq!(body["data"][0]["object"], "model");
    assert_eq!(body["data"][0]["max_model_len"], 64);

    let (status, body) = s.get("/health").await;
    assert_eq!(status, 200);
    assert_eq!(body["status"], "ok");

    let (status, body) = s.get("/v1/stats").await;
    assert_eq!(status, 200);
    assert_eq!(body["queued_requests"], 0);
    assert_eq!(body["running_requests"], 0);

    s.backend.set_health(HealthState::Unhealthy("step 12 ran past its 600 s deadline".into()));
    let (status, body) = s.get("/health").await;
    assert_eq!(status, 503);
    assert_eq!(body["status"], "unhealthy");
    assert!(body["reason"].as_str().unwrap().contains("deadline"));
    let (status, body) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 503);
    assert_openai_error(&body);
    s.backend.set_health(HealthState::Loading);
    let (status, body) = s.get("/health").await;
    assert_eq!(status, 503);
    assert_eq!(body["status"], "loading");
    s.backend.set_health(HealthState::Serving);

    let (status, body) = s.get("/v1/nope").await;
    assert_eq!(status, 404);
    assert_openai_error(&body);
    let (status, body) = s.get("/v1").await;
    assert_eq!((status, body), (200, json!({"status": "ok"})));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_invalid_requests_get_openai_400() {
    let s = TestServer::start().await;
    for raw in [
        "{not json",
        "",
        "[1,2]",
        "{\"messages\": \"hi\"}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"temperature\": \"hot\"}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream\": 3}",
    ] {
        let (status, body) = s.post_raw("/v1/chat/completions", raw.to_string()).await;
        assert_eq!(status, 400, "{raw} -> {body}");
        assert_openai_error(&body);
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    // Invalid UTF-8 in the body.
    let (status, body) = s
        .post_raw("/v1/chat/completions", b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec())
        .await;
    assert_eq!(status, 400);
    assert_openai_error(&body);
    // No content-type header: still JSON.
    let resp = s.client.post(s.url("/v1/chat/completions")).body(chat_body("x").to_string()).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);

    let user = json!([{"role": "user", "content": "x"}]);
    for (extra, param) in [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"temperature": -1}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"n": 0}), "n"),
        (json!({"n": 129}), "n"),
        (json!({"logit_bias": {"5": 1}}), "logit_bias"),
        (json!({"response_format": {"type": "json_object"}}), "response_format"),
        (json!({"response_format": {"type": "json_schema", "json_schema": {}}}), "response_format"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
        (json!({"messages": []}), "messages"),
    ] {
        let mut body = json!({"messages": user});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, resp) = s.post("/v1/chat/completions", body.clone()).await;
        assert_eq!(status, 400, "{body} -> {resp}");
        assert_openai_error(&resp);
        assert_eq!(resp["error"]["param"], param, "{resp}");
    }
    assert_eq!(s.backend.submitted().len(), 1, "nothing invalid reaches the backend");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn context_length_and_submit_errors() {
    let s = TestServer::start().await;
    let long = "a b ".repeat(40); // ~80 tokens > 64 context
    let (status, body) = s.post("/v1/chat/completions", chat_body(&long)).await;
    assert_eq!(status, 400, "{body}");
    assert_openai_error(&body);
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert_eq!(body["error"]["param"], "messages");
    let (status, body) = s.post("/v1/completions", json!({"prompt": long})).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    assert_eq!(body["error"]["param"], "prompt");
    assert!(s.backend.submitted().is_empty());

    // The engine's own admission errors map the same way.
    s.backend.set_script(|_| {
        Err(SubmitError::Admission(AdmissionError::ContextLengthExceeded { prompt_tokens: 10, max_context: 8 }))
    });
    let (status, body) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "context_length_exceeded");
    s.backend.set_script(|_| Err(SubmitError::Overloaded("queue is full (256 waiting)".into())));
    let (status, body) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 429);
    assert_openai_error(&body);
    assert!(body["error"]["message"].as_str().unwrap().contains("queue is full"));
    s.backend.set_script(|_| Err(SubmitError::Unavailable("engine failed".into())));
    let (status, body) = s.post("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(status, 503);
    assert_openai_error(&body);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_is_413() {
    let s = TestServer::start_with(&["--max-request-body-bytes", "1024"], engine_description()).await;
    let body = chat_body(&"x".repeat(4096));
    let (status, resp) = s.post_raw("/v1/chat/completions", body.to_string()).await;
    assert_eq!(status, 413);
    assert_openai_error(&resp);
    // Chunked (no content-length) too.
    let stream = futures::stream::iter(vec![Ok::<_, std::io::Error>(body.to_string().into_bytes())]);
    let resp = s.client.post(s.url("/v1/completions")).body(reqwest::Body::wrap_stream(stream)).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 413);
    assert_openai_error(&resp.json::<Value>().await.unwrap());
    // Small bodies still work.
    let (status, _) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_streams() {
    let s = TestServer::start().await;
    s.backend.set_script(|_| Ok(Script { delay: Duration::from_millis(2), ..Script::reply("Hello 😀 world") }));
    let mut tasks = vec![];
    for i in 0..16 {
        let client = s.client.clone();
        let url = s.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            let body = json!({"messages": [{"role": "user", "content": format!("req {i}")}], "stream": true, "stream_options": {"include_usage": true}});
            let resp = client.post(url).json(&body).send().await.unwrap();
            assert_eq!(resp.status().as_u16(), 200);
            parse_sse(&resp.text().await.unwrap())
        }));
    }
    for t in tasks {
        let events = t.await.unwrap();
        assert_eq!(events.last(), Some(&SseData::Done));
        let chunks = chunks(&events);
        let text: String =
            chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|x| x["delta"]["content"].as_str())).collect();
        assert_eq!(text, "Hello 😀 world");
        assert_eq!(
            chunks.iter().filter(|c| c["choices"].get(0).is_some_and(|x| !x["finish_reason"].is_null())).count(),
            1
        );
    }
    assert_eq!(s.backend.submitted().len(), 16);
    assert!(s.backend.guard_fired().is_empty(), "finished requests are not aborted");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_stream_aborts() {
    let s = TestServer::start().await;
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay: Duration::from_millis(5), cached_tokens: 0 })
    });
    let mut body = chat_body("x");
    body["stream"] = json!(true);
    let resp = s.client.post(s.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    let mut bytes = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("\"content\":\"a\"") {
        let chunk = bytes.next().await.unwrap().unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(bytes);
    s.backend.wait_for("the guard to fire", |b| b.guard_fired() == vec![1]).await;
    s.backend.wait_for("the request to end", |b| b.record.finished.lock().unwrap().contains(&1)).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_while_waiting_non_streaming_aborts() {
    let mut info = engine_description();
    info.max_context = 100000;
    let s = TestServer::start_with(&[], info).await;
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay: Duration::from_millis(5), cached_tokens: 0 })
    });
    let client = s.client.clone();
    let url = s.url("/v1/completions");
    let req =
        tokio::spawn(async move { client.post(url).json(&json!({"prompt": "x", "max_tokens": 1000000})).send().await });
    s.backend.wait_for("the request to start", |b| b.submitted().len() == 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    req.abort();
    s.backend.wait_for("the guard to fire", |b| b.guard_fired() == vec![1]).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_guards_everything_but_health() {
    let s = TestServer::start_with(&["--api-key", "sekret"], engine_description()).await;
    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 401);
    assert_openai_error(&body);
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 200);
    let resp = s.client.get(s.url("/v1/models")).bearer_auth("sekret").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let resp = s
        .client
        .post(s.url("/v1/chat/completions"))
        .header("x-api-key", "sekret")
        .json(&chat_body("x"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflight() {
    let s = TestServer::start().await;
    let resp = s
        .client
        .request(reqwest::Method::OPTIONS, s.url("/v1/chat/completions"))
        .header("origin", "http://localhost:1420")
        .header("access-control-request-method", "POST")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers().get("access-control-allow-origin").unwrap(), "http://localhost:1420");
    let resp = s.client.get(s.url("/v1/models")).header("origin", "http://evil.example").send().await.unwrap();
    assert!(resp.headers().get("access-control-allow-origin").is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_server_binds_and_shuts_down() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let args = ft_server::cli::parse_serve_args(["--port".to_string(), port.to_string()]).unwrap();
    let backend = ScriptedBackend::new();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    // the worker names the model (its engine description); the server lists that name
    let info = EngineDescription { served_model_name: "named".into(), ..engine_description() };
    let server = tokio::spawn(ft_server::http::server::run_server(args, backend.clone(), info, async move {
        let _ = rx.await;
    }));
    let client = reqwest::Client::new();
    let mut ok = false;
    for _ in 0..200 {
        if let Ok(r) = client.get(format!("http://127.0.0.1:{port}/v1/models")).send().await {
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["data"][0]["id"], "named");
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ok, "server came up");
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), server).await.unwrap().unwrap().unwrap();
    assert!(client.get(format!("http://127.0.0.1:{port}/health")).send().await.is_err());
    let _ = FinishReason::Stop;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_is_404_and_aliases_are_served() {
    let info = EngineDescription { model_aliases: vec!["alias".into()], ..engine_description() };
    let s = TestServer::start_with(&[], info).await;
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/messages"] {
        let body = json!({"model": "gpt-nonexistent", "prompt": "x", "max_tokens": 2,
                          "messages": [{"role": "user", "content": "x"}]});
        let (status, resp) = s.post(path, body).await;
        assert_eq!(status, 404, "{path}: {resp}");
        let code = if path == "/v1/messages" { &resp["error"]["type"] } else { &resp["error"]["code"] };
        assert!(code == "model_not_found" || code == "not_found_error", "{path}: {resp}");
    }
    assert!(s.backend.submitted().is_empty());
    for model in [json!("test-model"), json!("alias"), Value::Null] {
        let (status, resp) = s.post("/v1/completions", json!({"model": model, "prompt": "x", "max_tokens": 2})).await;
        assert_eq!(status, 200, "{model}: {resp}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_method_is_405_in_openai_shape() {
    let s = TestServer::start().await;
    let (status, body) = s.get("/v1/chat/completions").await;
    assert_eq!(status, 405, "{body}");
    assert_openai_error(&body);
    assert_eq!(body["error"]["code"], "method_not_allowed");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_sent_again_reuses_its_tokenized_history() {
    let mut info = engine_description();
    info.chat_template = Some("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}".into());
    info.max_context = 4096;
    let s = TestServer::start_with(&[], info).await;
    let history = "Hello world, or ld. ".repeat(30);
    let mut messages = vec![json!({"role": "user", "content": history})];
    for turn in 0..2 {
        let body = json!({"model": "test-model", "messages": messages, "max_tokens": 2});
        let (status, resp) = s.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{resp}");
        let text = format!(
            "{}<|im_start|>assistant\n",
            messages
                .iter()
                .map(|m| format!(
                    "<|im_start|>{}\n{}<|im_end|>\n",
                    m["role"].as_str().unwrap(),
                    m["content"].as_str().unwrap()
                ))
                .collect::<String>()
        );
        // the prompt the engine got is the tokenizer's own encoding of the rendered conversation
        assert_eq!(s.backend.submitted()[turn].prompt, tokenizer().encode_plain(&text, false).unwrap(), "turn {turn}");
        messages.push(json!({"role": "assistant", "content": "Hello"}));
        messages.push(json!({"role": "user", "content": format!("turn {turn}")}));
    }
    let (_, stats) = s.get("/v1/stats").await;
    // turn 2 found the first message's text (and the short pieces the turns share) instead of encoding it again
    assert!(stats["tokenizer_cache_hits"].as_u64().unwrap() >= 2, "{stats}");
    assert!(stats["tokenizer_cache_bytes"].as_u64().unwrap() >= history.len() as u64, "{stats}");
    s.stop().await;
}
