//! Tool calls and reasoning through both APIs, against the scripted backend: OpenAI `tool_calls`,
//! `reasoning_content` and `finish_reason: "tool_calls"` (whole and as deltas), Anthropic `thinking` /
//! `tool_use` blocks and `stop_reason: "tool_use"`, `tool_choice` none / auto / required / named, parallel
//! calls, malformed calls staying text, and completions staying raw.
//!
//! The tokenizer is the tests' byte-level BPE plus `<tool_call>`, `</tool_call>`, `<think>`, `</think>` as
//! added (non-special) tokens, as Qwen's tokenizers have them: the scripted outputs use those ids, so the
//! detokenizer has to keep them for the parsers.

mod common;

use common::tool_model::*;
use common::*;
use serde_json::{json, Value};

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "test-model", "max_tokens": 200, "tools": tools(),
                          "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn data(events: &[SseData]) -> Vec<Value> {
    assert_eq!(events.last(), Some(&SseData::Done));
    events.iter().filter_map(|e| if let SseData::Json(v) = e { Some(v.clone()) } else { None }).collect()
}

/// A tool call as (id, name, arguments).
type Call = (String, String, String);

/// A streamed chat answer folded back: (reasoning, content, calls, finish reasons).
fn fold_chat_stream(chunks: &[Value]) -> (String, String, Vec<Call>, Vec<String>) {
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (mut reasoning, mut content, mut calls, mut reasons) =
        (String::new(), String::new(), Vec::<(String, String, String)>::new(), vec![]);
    for c in chunks {
        let Some(choice) = c["choices"].get(0) else { continue };
        let d = &choice["delta"];
        reasoning += d["reasoning_content"].as_str().unwrap_or("");
        content += d["content"].as_str().unwrap_or("");
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let index = tc["index"].as_u64().unwrap() as usize;
            if let Some(id) = tc["id"].as_str() {
                // The first delta of a call: index in order, id, type, name, empty arguments.
                assert_eq!(index, calls.len(), "{tc}");
                assert_eq!(tc["type"], "function");
                assert_eq!(tc["function"]["arguments"], "", "{tc}");
                calls.push((id.to_string(), tc["function"]["name"].as_str().unwrap().to_string(), String::new()));
            } else {
                assert!(tc.get("type").is_none() && tc["function"].get("name").is_none(), "{tc}");
                calls[index].2 += tc["function"]["arguments"].as_str().unwrap();
            }
        }
        if let Some(r) = choice["finish_reason"].as_str() {
            reasons.push(r.to_string());
        }
    }
    (reasoning, content, calls, reasons)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_tool_call_with_reasoning_whole_and_streamed() {
    let s = server(&[]).await;
    let args = r#"{"city": "Paris", "days": 3}"#;
    says(&s, &format!("<think>\nThe user wants weather.\n</think>\n\n{}", call("get_weather", args)));
    let (status, b) = s.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(status, 200, "{b}");
    assert!(
        prompt(&s).contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
        "{}",
        prompt(&s)
    );
    let choice = &b["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let m = &choice["message"];
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["content"], Value::Null);
    assert_eq!(m["reasoning_content"], "The user wants weather.");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let parsed: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(parsed, json!({"city": "Paris", "days": 3}));

    let (status, events) = s
        .post_sse("/v1/chat/completions", chat(json!({"stream": true, "stream_options": {"include_usage": true}})))
        .await;
    assert_eq!(status, 200);
    let chunks = data(&events);
    let (reasoning, content, calls, reasons) = fold_chat_stream(&chunks);
    assert_eq!((reasoning.as_str(), content.as_str()), ("The user wants weather.", ""));
    assert_eq!(calls.len(), 1);
    assert!(calls[0].0.starts_with("call_"));
    assert_eq!(calls[0].1, "get_weather");
    assert_eq!(serde_json::from_str::<Value>(&calls[0].2).unwrap(), json!({"city": "Paris", "days": 3}));
    assert_eq!(reasons, ["tool_calls"]);
    // The arguments came as several deltas (streamed as the model wrote them), then the usage chunk.
    let arg_deltas = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str().is_some_and(|a| !a.is_empty())
        })
        .count();
    assert!(arg_deltas > 1, "{chunks:?}");
    assert!(chunks.last().unwrap()["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_around_calls_and_parallel_calls() {
    let s = server(&[]).await;
    let text = format!(
        "Checking both.\n{}\n{}",
        call("get_weather", r#"{"city": "Paris"}"#),
        call("get_time", r#"{"tz": "CET"}"#)
    );
    says(&s, &text);
    let (_, b) = s.post("/v1/chat/completions", chat(json!({}))).await;
    let m = &b["choices"][0]["message"];
    assert_eq!(m["content"], "Checking both.");
    assert!(m.get("reasoning_content").is_none(), "{m}");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(
        calls.iter().map(|c| c["function"]["name"].as_str().unwrap()).collect::<Vec<_>>(),
        ["get_weather", "get_time"]
    );
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(b["choices"][0]["finish_reason"], "tool_calls");

    let (_, events) = s.post_sse("/v1/chat/completions", chat(json!({"stream": true}))).await;
    let (_, content, calls, reasons) = fold_chat_stream(&data(&events));
    assert_eq!(content, "Checking both.");
    assert_eq!(
        calls.iter().map(|c| (c.1.as_str(), c.2.as_str())).collect::<Vec<_>>(),
        [("get_weather", r#"{"city": "Paris"}"#), ("get_time", r#"{"tz": "CET"}"#)]
    );
    assert_eq!(reasons, ["tool_calls"]);

    // parallel_tool_calls: false keeps the first call only.
    let (_, b) = s.post("/v1/chat/completions", chat(json!({"parallel_tool_calls": false}))).await;
    assert_eq!(b["choices"][0]["message"]["tool_calls"].as_array().unwrap().len(), 1);
    let (_, events) =
        s.post_sse("/v1/chat/completions", chat(json!({"parallel_tool_calls": false, "stream": true}))).await;
    assert_eq!(fold_chat_stream(&data(&events)).2.len(), 1);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_or_unknown_calls_stay_text() {
    let s = server(&[]).await;
    let malformed = r#"<tool_call>
{"name": "get_weather", "arguments": {"city": }
</tool_call>"#;
    let unknown = call("launch_rockets", "{}");
    for text in [malformed.to_string(), unknown.clone(), "I would use <tool_call> here.".to_string()] {
        says(&s, &text);
        let (_, b) = s.post("/v1/chat/completions", chat(json!({}))).await;
        let choice = &b["choices"][0];
        assert_eq!(choice["message"]["content"], text.as_str(), "{b}");
        assert!(choice["message"].get("tool_calls").is_none(), "{b}");
        assert_eq!(choice["finish_reason"], "stop");
    }
    // Streamed: a call naming an unknown tool never starts; the text arrives whole.
    says(&s, &unknown);
    let (_, events) = s.post_sse("/v1/chat/completions", chat(json!({"stream": true}))).await;
    let (_, content, calls, reasons) = fold_chat_stream(&data(&events));
    assert_eq!((content, calls.len(), reasons), (unknown, 0, vec!["stop".to_string()]));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_split_and_enable_thinking() {
    let s = server(&[]).await;
    // The template opens the block when thinking is on: the output only closes it.
    says(&s, "Two plus two.\n</think>\n\nIt is 4.");
    let body =
        json!({"messages": [{"role": "user", "content": "2+2?"}], "chat_template_kwargs": {"enable_thinking": true}});
    let (_, b) = s.post("/v1/chat/completions", body.clone()).await;
    assert!(prompt(&s).ends_with("<|im_start|>assistant\n<think>\n"), "{}", prompt(&s));
    assert_eq!(b["choices"][0]["message"]["reasoning_content"], "Two plus two.");
    assert_eq!(b["choices"][0]["message"]["content"], "It is 4.");
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, events) = s.post_sse("/v1/chat/completions", streamed).await;
    let chunks = data(&events);
    let (reasoning, content, _, reasons) = fold_chat_stream(&chunks);
    assert_eq!(
        (reasoning.as_str(), content.as_str(), reasons),
        ("Two plus two.", "It is 4.", vec!["stop".to_string()])
    );
    // Reasoning deltas all come before content deltas.
    let first_content = chunks
        .iter()
        .position(|c| c["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty()))
        .unwrap();
    assert!(chunks[first_content..].iter().all(|c| c["choices"][0]["delta"].get("reasoning_content").is_none()));
    // A model that writes the whole block; no block at all: no reasoning_content.
    says(&s, "<think>hmm</think>Yes.");
    let (_, b) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(
        (b["choices"][0]["message"]["reasoning_content"].as_str(), b["choices"][0]["message"]["content"].as_str()),
        (Some("hmm"), Some("Yes."))
    );
    says(&s, "Plain <think> answer.");
    let (_, b) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert!(b["choices"][0]["message"].get("reasoning_content").is_none(), "{b}");
    assert_eq!(b["choices"][0]["message"]["content"], "Plain <think> answer.");
    // Completions are raw text.
    says(&s, "<think>hmm</think>Yes.");
    let (_, b) = s.post("/v1/completions", json!({"prompt": "x"})).await;
    assert_eq!(b["choices"][0]["text"], "<think>hmm</think>Yes.");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_none_required_and_named() {
    let s = server(&[]).await;
    let weather = call("get_weather", r#"{"city": "Paris"}"#);
    // none: the template gets no tools and a call is text.
    says(&s, &weather);
    let (_, b) = s.post("/v1/chat/completions", chat(json!({"tool_choice": "none"}))).await;
    assert!(!prompt(&s).contains("<tools>"));
    assert_eq!(
        (b["choices"][0]["message"]["content"].as_str(), b["choices"][0]["finish_reason"].as_str()),
        (Some(weather.as_str()), Some("stop"))
    );

    // required: the prompt ends with the call's opening, the output continues it.
    says(&s, "{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>");
    let (_, b) = s.post("/v1/chat/completions", chat(json!({"tool_choice": "required"}))).await;
    assert!(prompt(&s).ends_with("<|im_start|>assistant\n<tool_call>\n"), "{}", prompt(&s));
    assert!(prompt(&s).contains("get_weather") && prompt(&s).contains("get_time"));
    assert_eq!(b["choices"][0]["finish_reason"], "tool_calls", "{b}");
    assert_eq!(b["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_time");
    assert_eq!(b["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], r#"{"tz": "UTC"}"#);

    // named: the template sees that tool only, the prompt ends with its header.
    says(&s, "{\"city\": \"Oslo\"}}\n</tool_call>");
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    for stream in [false, true] {
        let mut body = chat(named.clone());
        body["stream"] = json!(stream);
        let (name, args, reason) = if stream {
            let (_, events) = s.post_sse("/v1/chat/completions", body).await;
            let (_, _, calls, reasons) = fold_chat_stream(&data(&events));
            (calls[0].1.clone(), calls[0].2.clone(), reasons[0].clone())
        } else {
            let (_, b) = s.post("/v1/chat/completions", body).await;
            let c = &b["choices"][0];
            (
                c["message"]["tool_calls"][0]["function"]["name"].as_str().unwrap().to_string(),
                c["message"]["tool_calls"][0]["function"]["arguments"].as_str().unwrap().to_string(),
                c["finish_reason"].as_str().unwrap().to_string(),
            )
        };
        assert_eq!(
            (name.as_str(), args.as_str(), reason.as_str()),
            ("get_weather", r#"{"city": "Oslo"}"#, "tool_calls")
        );
        let p = prompt(&s);
        assert!(
            p.ends_with("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ") && !p.contains("get_time"),
            "{p}"
        );
    }
    // A model that ignores the forced opening answers with text.
    says(&s, "no.");
    let (_, b) = s.post("/v1/chat/completions", chat(named.clone())).await;
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    assert!(b["choices"][0]["message"]["content"].as_str().unwrap().ends_with("no."), "{b}");

    // 400s: a named tool that is not there, required without tools.
    let submitted = s.backend.submitted().len();
    for bad in [
        chat(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})),
        json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}),
    ] {
        let (status, b) = s.post("/v1/chat/completions", bad).await;
        assert_eq!(status, 400, "{b}");
        assert_eq!(b["error"]["param"], "tool_choice", "{b}");
    }
    assert_eq!(s.backend.submitted().len(), submitted);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parser_off_and_no_parser_for_the_model() {
    // --tool-call-parser off: calls are text; forcing one is refused.
    let s = server(&["--tool-call-parser", "off", "--reasoning-parser", "off"]).await;
    let text = format!("<think>x</think>{}", call("get_weather", "{}"));
    says(&s, &text);
    let (_, b) = s.post("/v1/chat/completions", chat(json!({}))).await;
    assert_eq!(b["choices"][0]["message"]["content"], text.as_str());
    assert!(prompt(&s).contains("<tools>"), "the template still gets the tools");
    let (status, b) = s.post("/v1/chat/completions", chat(json!({"tool_choice": "required"}))).await;
    assert_eq!(status, 400, "{b}");
    assert!(b["error"]["message"].as_str().unwrap().contains("--tool-call-parser"), "{b}");
    s.stop().await;
    // A model whose template and architecture name no format (the tests' ChatML fallback, "test"): no parser.
    let s = TestServer::start_with(&[], engine_description()).await;
    s.backend.set_script(|_| Ok(Script::reply("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>")));
    let (_, b) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}]}),
        )
        .await;
    assert!(b["choices"][0]["message"]["content"].as_str().unwrap().starts_with("<tool_call>"), "{b}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_parser_name_fails_start_up() {
    use ft_server::http::server::AppState;
    let args = ft_server::cli::ServeArgs { tool_call_parser: Some("nonsense_xyz".into()), ..Default::default() };
    let err = AppState::new(args, ScriptedBackend::new(), info()).err().unwrap().to_string();
    assert!(err.contains("nonsense_xyz") && err.contains("qwen3_coder") && !err.contains('\n'), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen3_coder_arguments_typed_by_the_schema() {
    let s = server(&["--tool-call-parser", "qwen3_coder"]).await;
    let text = "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>";
    says(&s, text);
    let (_, b) = s.post("/v1/chat/completions", chat(json!({}))).await;
    let m = &b["choices"][0]["message"];
    assert_eq!(m["content"], "Let me look.");
    assert_eq!(m["tool_calls"][0]["function"]["arguments"], r#"{"city": "New York", "days": 5}"#);
    let (_, events) = s.post_sse("/v1/chat/completions", chat(json!({"stream": true}))).await;
    let (_, content, calls, reasons) = fold_chat_stream(&data(&events));
    assert_eq!(
        (content.as_str(), calls[0].2.as_str(), reasons[0].as_str()),
        ("Let me look.", r#"{"city": "New York", "days": 5}"#, "tool_calls")
    );
    // Named choice in this format: the header is prefilled.
    says(&s, "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>");
    let (_, b) = s
        .post(
            "/v1/chat/completions",
            chat(json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})),
        )
        .await;
    assert!(prompt(&s).ends_with("<tool_call>\n<function=get_weather>\n"));
    assert_eq!(b["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], r#"{"city": "Rome"}"#);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_cut_off_by_max_tokens() {
    let s = server(&[]).await;
    let text = call("get_weather", r#"{"city": "Paris", "days": 3}"#);
    let tokens = tool_tokenizer().encode(&text, false).unwrap();
    let cut = tokens.len() - 8;
    says(&s, &text);
    // Whole: a call that did not close is text.
    let (_, b) = s.post("/v1/chat/completions", chat(json!({"max_tokens": cut}))).await;
    assert_eq!(b["choices"][0]["finish_reason"], "length");
    assert!(b["choices"][0]["message"].get("tool_calls").is_none());
    assert!(b["choices"][0]["message"]["content"].as_str().unwrap().starts_with("<tool_call>"));
    // Streamed: the call had started; it is closed with what was parsed, still `length`.
    let (_, events) = s.post_sse("/v1/chat/completions", chat(json!({"max_tokens": cut, "stream": true}))).await;
    let (_, _, calls, reasons) = fold_chat_stream(&data(&events));
    assert_eq!(reasons, ["length"]);
    assert_eq!(calls.len(), 1);
    assert!(serde_json::from_str::<Value>(&calls[0].2).unwrap().is_object(), "{}", calls[0].2);
    s.stop().await;
}

// ---- Anthropic ------------------------------------------------------------------------------------------

fn anthropic_tools() -> Value {
    json!([{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
           {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}])
}

fn message(extra: Value) -> Value {
    let mut body = json!({"model": "test-model", "max_tokens": 200, "tools": anthropic_tools(),
                          "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The named events of a streamed `/v1/messages` answer (200).
async fn post_events(s: &TestServer, body: Value) -> Vec<(String, Value)> {
    let (status, events) = post_named_events(s, "/v1/messages", body).await;
    assert_eq!(status, 200);
    events
}

/// A message stream folded back into content blocks, checking the block protocol on the way: blocks open in
/// index order, deltas go to the open block, every block is closed before the next opens.
fn fold_message_stream(events: &[(String, Value)]) -> (Vec<Value>, Value) {
    assert_eq!(events[0].0, "message_start");
    assert_eq!(events.last().unwrap().0, "message_stop");
    let mut blocks: Vec<Value> = vec![];
    let mut open: Option<usize> = None;
    let mut json_parts = String::new();
    let mut delta = Value::Null;
    for (name, d) in events {
        assert_eq!(d["type"], name.as_str());
        match name.as_str() {
            "content_block_start" => {
                assert_eq!(open, None, "a block is still open");
                assert_eq!(d["index"], blocks.len());
                open = Some(blocks.len());
                blocks.push(d["content_block"].clone());
                json_parts.clear();
            }
            "content_block_delta" => {
                let i = open.expect("a delta outside a block");
                assert_eq!(d["index"], i);
                let b = &mut blocks[i];
                match d["delta"]["type"].as_str().unwrap() {
                    "text_delta" => {
                        b["text"] =
                            json!(b["text"].as_str().unwrap().to_string() + d["delta"]["text"].as_str().unwrap())
                    }
                    "thinking_delta" => {
                        b["thinking"] = json!(
                            b["thinking"].as_str().unwrap().to_string() + d["delta"]["thinking"].as_str().unwrap()
                        )
                    }
                    "input_json_delta" => json_parts += d["delta"]["partial_json"].as_str().unwrap(),
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                let i = open.take().expect("stop without a block");
                assert_eq!(d["index"], i);
                if blocks[i]["type"] == "tool_use" {
                    blocks[i]["input"] = serde_json::from_str(&json_parts).unwrap();
                }
            }
            "message_delta" => delta = d["delta"].clone(),
            _ => {}
        }
    }
    assert_eq!(open, None);
    (blocks, delta)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_thinking_text_and_tool_use_blocks() {
    let s = server(&[]).await;
    says(
        &s,
        &format!("<think>\nNeed the weather.\n</think>\n\nChecking.\n{}", call("get_weather", r#"{"city": "Paris"}"#)),
    );
    let (status, b) = s.post("/v1/messages", message(json!({}))).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["stop_reason"], "tool_use");
    assert_eq!(b["stop_sequence"], Value::Null);
    let content = b["content"].as_array().unwrap();
    assert_eq!(content.len(), 3, "{b}");
    assert_eq!(content[0], json!({"type": "thinking", "thinking": "Need the weather.", "signature": ""}));
    assert_eq!(content[1], json!({"type": "text", "text": "Checking."}));
    assert_eq!((content[2]["type"].as_str(), content[2]["name"].as_str()), (Some("tool_use"), Some("get_weather")));
    assert!(content[2]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(content[2]["input"], json!({"city": "Paris"}));

    let events = post_events(&s, message(json!({"stream": true}))).await;
    assert_eq!(events[1].0, "ping");
    let (blocks, delta) = fold_message_stream(&events);
    assert_eq!(
        blocks.iter().map(|b| b["type"].as_str().unwrap()).collect::<Vec<_>>(),
        ["thinking", "text", "tool_use"]
    );
    assert_eq!(blocks[0]["thinking"], "Need the weather.");
    assert_eq!(blocks[1]["text"], "Checking.");
    assert_eq!(blocks[2]["input"], json!({"city": "Paris"}));
    assert!(blocks[2]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(delta["stop_reason"], "tool_use");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_parallel_calls_tool_choice_and_plain_text() {
    let s = server(&[]).await;
    let two = format!("{}\n{}", call("get_weather", r#"{"city": "Paris"}"#), call("get_time", "{}"));
    says(&s, &two);
    let events = post_events(&s, message(json!({"stream": true}))).await;
    let (blocks, delta) = fold_message_stream(&events);
    assert_eq!(blocks.iter().map(|b| b["name"].as_str().unwrap()).collect::<Vec<_>>(), ["get_weather", "get_time"]);
    assert_eq!(blocks[1]["input"], json!({}));
    assert_eq!(delta["stop_reason"], "tool_use");
    let (_, b) = s
        .post("/v1/messages", message(json!({"tool_choice": {"type": "auto", "disable_parallel_tool_use": true}})))
        .await;
    assert_eq!(b["content"].as_array().unwrap().len(), 1, "{b}");

    // any / tool: started for the model.
    says(&s, "{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>");
    let (_, b) = s.post("/v1/messages", message(json!({"tool_choice": {"type": "any"}}))).await;
    assert!(prompt(&s).ends_with("assistant\n<tool_call>\n"));
    assert_eq!((b["content"][0]["name"].as_str(), b["stop_reason"].as_str()), (Some("get_time"), Some("tool_use")));
    says(&s, "{\"city\": \"Rome\"}}\n</tool_call>");
    let (_, b) = s.post("/v1/messages", message(json!({"tool_choice": {"type": "tool", "name": "get_weather"}}))).await;
    assert_eq!(b["content"][0]["input"], json!({"city": "Rome"}));
    let (status, b) = s.post("/v1/messages", message(json!({"tool_choice": {"type": "tool", "name": "nope"}}))).await;
    assert_eq!((status, b["error"]["type"].as_str()), (400, Some("invalid_request_error")));
    // none: text.
    says(&s, &two);
    let (_, b) = s.post("/v1/messages", message(json!({"tool_choice": {"type": "none"}}))).await;
    assert_eq!(b["content"], json!([{"type": "text", "text": two}]));
    assert_eq!(b["stop_reason"], "end_turn");

    // thinking enabled: the prompt opens the block, thinking comes back as its own block; an empty output
    // still has one (empty) text block.
    says(&s, "Simple.\n</think>\n\nHello.");
    let (_, b) = s
        .post(
            "/v1/messages",
            json!({"max_tokens": 50, "thinking": {"type": "enabled", "budget_tokens": 100},
        "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(
        b["content"],
        json!([{"type": "thinking", "thinking": "Simple.", "signature": ""}, {"type": "text", "text": "Hello."}])
    );
    says(&s, "");
    let (_, b) =
        s.post("/v1/messages", json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(b["content"], json!([{"type": "text", "text": ""}]));
    let events =
        post_events(&s, json!({"max_tokens": 5, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
            .await;
    let (blocks, _) = fold_message_stream(&events);
    assert_eq!(blocks, [json!({"type": "text", "text": ""})]);
    s.stop().await;
}
