//! `POST /v1/messages` and `/v1/messages/count_tokens` against a scripted backend: the Anthropic response and
//! stream shapes, stop reasons, the prompt the template builds, and errors in Anthropic's shape.

mod common;

use common::*;
use ft_server::backend::HealthState;
use serde_json::{json, Value};
use std::time::Duration;

async fn server() -> TestServer {
    let mut info = engine_description();
    info.max_context = 4096;
    TestServer::start_with(&[], info).await
}

fn body(content: &str) -> Value {
    json!({"model": "test-model", "max_tokens": 16, "messages": [{"role": "user", "content": content}]})
}

/// `(event name, data)` pairs of an SSE body with named events.
async fn post_events(s: &TestServer, body: Value) -> (u16, Vec<(String, Value)>) {
    let resp = s.client.post(s.url("/v1/messages")).json(&body).send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let mut out = vec![];
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = String::new();
        let mut data = Value::Null;
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = serde_json::from_str(d).unwrap();
            }
        }
        if !name.is_empty() {
            out.push((name, data));
        }
    }
    (status, out)
}

fn assert_anthropic_error(body: &Value, kind: &str) {
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_message_with_usage_and_end_turn() {
    let s = server().await;
    let (status, b) = s.post("/v1/messages", body("hi")).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["type"], "message");
    assert_eq!(b["role"], "assistant");
    assert_eq!(b["model"], "test-model");
    assert!(b["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(b["content"], json!([{"type": "text", "text": "Hello 😀 world"}]));
    assert_eq!(b["stop_reason"], "end_turn");
    assert_eq!(b["stop_sequence"], Value::Null);
    let submitted = s.backend.submitted();
    assert_eq!(b["usage"]["input_tokens"], submitted[0].prompt.len());
    assert_eq!(b["usage"]["output_tokens"], tokenizer().encode("Hello 😀 world", false).unwrap().len() + 1);
    assert_eq!(submitted[0].max_new_tokens, 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_reasons_max_tokens_and_stop_sequence() {
    let s = server().await;
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay: Duration::ZERO, cached_tokens: 0 })
    });
    let (_, b) = s.post("/v1/messages", body("x")).await;
    assert_eq!(
        (b["stop_reason"].as_str(), b["content"][0]["text"].as_str()),
        (Some("max_tokens"), Some("aaaaaaaaaaaaaaaa"))
    );
    s.backend.set_script(|_| Ok(Script::reply("one two three four")));
    let mut req = body("x");
    req["stop_sequences"] = json!(["zzz", "three"]);
    let (_, b) = s.post("/v1/messages", req).await;
    assert_eq!(b["stop_reason"], "stop_sequence");
    assert_eq!(b["stop_sequence"], "three");
    assert_eq!(b["content"][0]["text"], "one two ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_events_in_anthropic_order() {
    let s = server().await;
    let mut req = body("hi");
    req["stream"] = json!(true);
    let (status, events) = post_events(&s, req).await;
    assert_eq!(status, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    assert!(names[3..names.len() - 3].iter().all(|n| *n == "content_block_delta"));
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello 😀 world");
    let start = &events[0].1["message"];
    assert_eq!((start["role"].as_str(), start["usage"]["output_tokens"].as_u64()), (Some("assistant"), Some(0)));
    assert!(start["usage"]["input_tokens"].as_u64().unwrap() > 0);
    let delta = &events[names.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    // each event's data names its own type
    assert!(events.iter().all(|(n, d)| d["type"] == *n));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_midstream_is_an_error_event() {
    let s = server().await;
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: tokenizer().encode("part", false).unwrap(),
            end: End::Fail("worker died".into()),
            delay: Duration::ZERO,
            cached_tokens: 0,
        })
    });
    let mut req = body("x");
    req["stream"] = json!(true);
    let (_, events) = post_events(&s, req.clone()).await;
    let (name, data) = events.last().unwrap();
    assert_eq!(name, "error");
    assert_anthropic_error(data, "api_error");
    req["stream"] = json!(false);
    let (status, b) = s.post("/v1/messages", req).await;
    assert_eq!(status, 500);
    assert_anthropic_error(&b, "api_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_tool_results_and_thinking_reach_the_template() {
    let s = server().await;
    let req = json!({"max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "call it", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "thanks"}]}],
        "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object", "properties": {}}}]});
    let (status, b) = s.post("/v1/messages", req.clone()).await;
    assert_eq!(status, 200, "{b}");
    let prompt = tokenizer().decode(&s.backend.submitted()[0].prompt, false).unwrap();
    for part in [
        "<|im_start|>system\nBe brief.<|im_end|>",
        "<|im_start|>user\nweather?<|im_end|>",
        "<|im_start|>tool\nsunny<|im_end|>",
        "<|im_start|>user\nthanks<|im_end|>",
        "<|im_start|>assistant\n",
    ] {
        assert!(prompt.contains(part), "{part:?} missing from {prompt:?}");
    }
    assert!(prompt.find("tool\nsunny").unwrap() < prompt.find("user\nthanks").unwrap());
    let (status, count) = s.post("/v1/messages/count_tokens", req).await;
    assert_eq!(status, 200, "{count}");
    assert_eq!(count["input_tokens"], s.backend.submitted()[0].prompt.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_anthropic_shaped_4xx() {
    let s = server().await;
    let cases = [
        json!({"messages": [{"role": "user", "content": "x"}]}), // no max_tokens
        json!({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "messages": []}),
        json!({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}), // system is top-level
        json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
        json!({"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}),
        json!({"max_tokens": 4, "system": 5, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "stop_sequences": "END", "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "temperature": -1, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "tools": [{"description": "no name"}], "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "tool_choice": {"type": "sometimes"}, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "thinking": {"type": "maybe"}, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": "4", "messages": [{"role": "user", "content": "x"}]}),
        // fields the server does not use are still checked, so the schema in /openapi.json tells the truth
        json!({"max_tokens": 4, "tool_choice": {"type": "any", "name": false}, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": "x"}, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "metadata": 5, "messages": [{"role": "user", "content": "x"}]}),
        json!({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": 1}]}]}),
        json!({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": 2}]}]}),
        json!({"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": []}]}]}),
        json!([1, 2]),
    ];
    for case in cases {
        let (status, b) = s.post("/v1/messages", case.clone()).await;
        assert_eq!(status, 400, "{case} -> {b}");
        assert_anthropic_error(&b, "invalid_request_error");
    }
    let (status, b) = s.post_raw("/v1/messages", "{\"max_tokens\": 4, ").await;
    assert_eq!(status, 400);
    assert_anthropic_error(&b, "invalid_request_error");
    assert!(s.backend.submitted().is_empty());
    // an engine that is down: 503 overloaded_error
    s.backend.set_health(HealthState::Unhealthy("stalled".into()));
    let (status, b) = s.post("/v1/messages", body("x")).await;
    assert_eq!(status, 503);
    assert_anthropic_error(&b, "overloaded_error");
}
