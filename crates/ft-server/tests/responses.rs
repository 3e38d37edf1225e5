//! `POST /v1/responses`, `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and `DELETE` against the
//! scripted backend with the tool-calling test model (`common::tool_model`): output items (reasoning, message,
//! function_call), statuses, usage, the stream's event order and sequence numbers, `previous_response_id`
//! continuing a stored conversation, cancelling whole and streamed responses, and 400 / 404 in OpenAI's shape.

mod common;

use common::tool_model::*;
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

fn body(extra: Value) -> Value {
    let mut b = json!({"model": "test-model", "input": "Weather in Paris?", "max_output_tokens": 200});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn kinds(r: &Value) -> Vec<&str> {
    r["output"].as_array().unwrap().iter().map(|i| i["type"].as_str().unwrap()).collect()
}

/// A model that says `tokens` one every `delay`, then keeps going until aborted.
fn trickles(s: &TestServer, delay: Duration) {
    s.backend.set_script(move |_| Ok(Script { tokens: vec![72, 105], end: End::Trickle(33), delay, cached_tokens: 0 }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_response_with_usage_stored_and_retrieved() {
    let s = server(&[]).await;
    says(&s, "It is sunny.");
    let (status, r) = s.post("/v1/responses", body(json!({"instructions": "Be brief."}))).await;
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!((r["object"].as_str(), r["status"].as_str()), (Some("response"), Some("completed")));
    assert_eq!(r["model"], "test-model");
    assert_eq!(kinds(&r), ["message"]);
    let msg = &r["output"][0];
    assert_eq!((msg["role"].as_str(), msg["status"].as_str()), (Some("assistant"), Some("completed")));
    assert_eq!(
        msg["content"],
        json!([{"type": "output_text", "text": "It is sunny.", "annotations": [], "logprobs": []}])
    );
    let u = &r["usage"];
    let prompt_len = s.backend.submitted()[0].prompt.len() as u64;
    assert_eq!(u["input_tokens"].as_u64(), Some(prompt_len));
    assert_eq!(
        u["output_tokens"].as_u64(),
        Some(tool_tokenizer().encode("It is sunny.", false).unwrap().len() as u64 + 1)
    );
    assert_eq!(u["total_tokens"].as_u64(), Some(prompt_len + u["output_tokens"].as_u64().unwrap()));
    assert_eq!(
        (u["input_tokens_details"]["cached_tokens"].as_u64(), u["output_tokens_details"]["reasoning_tokens"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(
        (r["instructions"].as_str(), r["store"].as_bool(), r["max_output_tokens"].as_u64()),
        (Some("Be brief."), Some(true), Some(200))
    );
    assert!(
        prompt(&s).starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?"),
        "{}",
        prompt(&s)
    );
    let id = r["id"].as_str().unwrap();
    let (status, got) = s.get(&format!("/v1/responses/{id}")).await;
    assert_eq!((status, &got), (200, &r));
    // store: false is not kept.
    let (_, r) = s.post("/v1/responses", body(json!({"store": false}))).await;
    let (status, e) = s.get(&format!("/v1/responses/{}", r["id"].as_str().unwrap())).await;
    assert_eq!((status, e["error"]["code"].as_str()), (404, Some("response_not_found")));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_and_function_call_items() {
    let s = server(&[]).await;
    says(&s, &format!("<think>\nNeed weather.\n</think>\n\n{}", call("get_weather", r#"{"city": "Paris"}"#)));
    let req = body(json!({"tools": [weather_tool()], "reasoning": {"effort": "high"}}));
    let (status, r) = s.post("/v1/responses", req).await;
    assert_eq!(status, 200, "{r}");
    assert!(
        prompt(&s).contains("\"name\":\"get_weather\"") || prompt(&s).contains("\"name\": \"get_weather\""),
        "{}",
        prompt(&s)
    );
    assert!(
        prompt(&s).ends_with("<|im_start|>assistant\n<think>\n"),
        "enable_thinking from reasoning.effort: {}",
        prompt(&s)
    );
    assert_eq!(r["status"], "completed");
    assert_eq!(kinds(&r), ["reasoning", "function_call"]);
    let rs = &r["output"][0];
    assert!(rs["id"].as_str().unwrap().starts_with("rs_"));
    assert_eq!(
        (rs["summary"].clone(), rs["content"].clone()),
        (json!([]), json!([{"type": "reasoning_text", "text": "Need weather."}]))
    );
    let fc = &r["output"][1];
    assert!(fc["id"].as_str().unwrap().starts_with("fc_") && fc["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!((fc["name"].as_str(), fc["status"].as_str()), (Some("get_weather"), Some("completed")));
    assert_eq!(serde_json::from_str::<Value>(fc["arguments"].as_str().unwrap()).unwrap(), json!({"city": "Paris"}));
    let reasoning_tokens = r["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
    assert_eq!(reasoning_tokens, tool_tokenizer().encode("Need weather.", false).unwrap().len() as u64);
    assert_eq!(r["tools"][0]["name"], "get_weather");
    assert_eq!((r["tool_choice"].as_str(), r["reasoning"]["effort"].as_str()), (Some("auto"), Some("high")));
    // effort none: thinking off.
    says(&s, "ok");
    let (_, r) = s.post("/v1/responses", body(json!({"reasoning": {"effort": "none"}}))).await;
    assert_eq!(r["status"], "completed");
    assert!(prompt(&s).ends_with("<|im_start|>assistant\n"), "{}", prompt(&s));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incomplete_at_max_output_tokens() {
    let s = server(&[]).await;
    says(&s, "A long answer that goes on and on.");
    let (status, r) = s.post("/v1/responses", body(json!({"max_output_tokens": 3}))).await;
    assert_eq!(status, 200);
    assert_eq!(
        (r["status"].as_str(), r["incomplete_details"]["reason"].as_str()),
        (Some("incomplete"), Some("max_output_tokens"))
    );
    assert_eq!(
        (r["output"][0]["status"].as_str(), r["usage"]["output_tokens"].as_u64()),
        (Some("incomplete"), Some(3))
    );
    s.stop().await;
}

/// The stream's events checked against the documented protocol, folded back into the final output items:
/// types match event names, sequence numbers count from 0, items open, stream and close in order, and the
/// final response repeats the items streamed.
fn fold_stream(events: &[(String, Value)]) -> Value {
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["response.created", "response.in_progress"]);
    for (i, (name, d)) in events.iter().enumerate() {
        assert_eq!((d["type"].as_str(), d["sequence_number"].as_u64()), (Some(name.as_str()), Some(i as u64)), "{d}");
    }
    let mut items: Vec<Value> = vec![];
    let mut open: Option<(Value, String)> = None; // the item as added, its streamed text
    for (name, d) in &events[2..events.len() - 1] {
        match name.as_str() {
            "response.output_item.added" => {
                assert!(open.is_none(), "{d}");
                assert_eq!(d["output_index"].as_u64(), Some(items.len() as u64));
                assert_eq!(d["item"]["status"], "in_progress");
                open = Some((d["item"].clone(), String::new()));
            }
            "response.content_part.added" | "response.content_part.done" => {
                assert_eq!(d["item_id"], open.as_ref().unwrap().0["id"]);
                assert_eq!(d["content_index"], 0);
            }
            "response.output_text.delta"
            | "response.reasoning_text.delta"
            | "response.function_call_arguments.delta" => {
                let (item, text) = open.as_mut().unwrap();
                assert_eq!((&d["item_id"], d["output_index"].as_u64()), (&item["id"], Some(items.len() as u64)));
                text.push_str(d["delta"].as_str().unwrap());
            }
            "response.output_text.done" | "response.reasoning_text.done" => {
                assert_eq!(d["text"].as_str(), Some(open.as_ref().unwrap().1.as_str()));
            }
            "response.function_call_arguments.done" => {
                assert_eq!(d["arguments"].as_str(), Some(open.as_ref().unwrap().1.as_str()));
            }
            "response.output_item.done" => {
                let (item, _) = open.take().unwrap();
                assert_eq!((&d["item"]["id"], &d["item"]["type"]), (&item["id"], &item["type"]));
                items.push(d["item"].clone());
            }
            other => panic!("unexpected event {other}: {d}"),
        }
    }
    assert!(open.is_none());
    let last = &events.last().unwrap().1;
    assert_eq!(last["response"]["output"], Value::Array(items));
    last["response"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_events_in_order() {
    let s = server(&[]).await;
    let text =
        format!("<think>\nNeed weather.\n</think>\n\nLet me check.\n{}", call("get_weather", r#"{"city": "Paris"}"#));
    says(&s, &text);
    let req = body(json!({"stream": true, "tools": [weather_tool()], "reasoning": {"effort": "medium"}}));
    let (status, events) = post_named_events(&s, "/v1/responses", req).await;
    assert_eq!(status, 200);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let mut expected = vec!["response.created", "response.in_progress"];
    expected.extend(["response.output_item.added", "response.content_part.added"]);
    let reasoning_deltas = names.iter().filter(|n| **n == "response.reasoning_text.delta").count();
    expected.extend(std::iter::repeat_n("response.reasoning_text.delta", reasoning_deltas));
    expected.extend(["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]);
    expected.extend(["response.output_item.added", "response.content_part.added"]);
    let text_deltas = names.iter().filter(|n| **n == "response.output_text.delta").count();
    expected.extend(std::iter::repeat_n("response.output_text.delta", text_deltas));
    expected.extend(["response.output_text.done", "response.content_part.done", "response.output_item.done"]);
    expected.push("response.output_item.added");
    let arg_deltas = names.iter().filter(|n| **n == "response.function_call_arguments.delta").count();
    expected.extend(std::iter::repeat_n("response.function_call_arguments.delta", arg_deltas));
    expected.extend(["response.function_call_arguments.done", "response.output_item.done", "response.completed"]);
    assert_eq!(names, expected);
    assert!(reasoning_deltas > 0 && text_deltas > 0 && arg_deltas > 1, "{names:?}");
    let r = fold_stream(&events);
    assert_eq!(events[0].1["response"]["status"], "in_progress");
    assert_eq!(events[0].1["response"]["output"], json!([]));
    assert_eq!(r["status"], "completed");
    assert_eq!(kinds(&r), ["reasoning", "message", "function_call"]);
    assert_eq!(r["output"][0]["content"][0]["text"], "Need weather.");
    assert_eq!(r["output"][1]["content"][0]["text"], "Let me check.");
    assert_eq!(
        serde_json::from_str::<Value>(r["output"][2]["arguments"].as_str().unwrap()).unwrap(),
        json!({"city": "Paris"})
    );
    assert!(r["usage"]["output_tokens"].as_u64().unwrap() > 0);
    // The stored response is the final one.
    let (_, got) = s.get(&format!("/v1/responses/{}", r["id"].as_str().unwrap())).await;
    assert_eq!(got, r);
    // A plain answer cut off by the budget: one message item, response.incomplete.
    says(&s, "A long answer that goes on and on.");
    let (_, events) =
        post_named_events(&s, "/v1/responses", body(json!({"stream": true, "max_output_tokens": 3}))).await;
    let r = fold_stream(&events);
    assert_eq!(events.last().unwrap().0, "response.incomplete");
    assert_eq!(
        (r["status"].as_str(), kinds(&r), r["output"][0]["status"].as_str()),
        (Some("incomplete"), vec!["message"], Some("incomplete"))
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_failure_is_response_failed() {
    let s = server(&[]).await;
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: vec![72, 105],
            end: End::Fail("worker out of memory".into()),
            delay: Duration::ZERO,
            cached_tokens: 0,
        })
    });
    let (_, events) = post_named_events(&s, "/v1/responses", body(json!({"stream": true}))).await;
    let (name, d) = events.last().unwrap();
    assert_eq!(name, "response.failed");
    assert_eq!(
        (d["response"]["status"].as_str(), d["response"]["error"]["code"].as_str()),
        (Some("failed"), Some("server_error"))
    );
    assert!(d["response"]["error"]["message"].as_str().unwrap().contains("out of memory"));
    let (_, got) = s.get(&format!("/v1/responses/{}", d["response"]["id"].as_str().unwrap())).await;
    assert_eq!(got["status"], "failed");
    // Whole: an HTTP error, and the stored response says failed.
    let (status, e) = s.post("/v1/responses", body(json!({}))).await;
    assert_eq!((status, e["error"]["type"].as_str()), (500, Some("server_error")));
    s.stop().await;
}

/// The tool model's template, also showing each assistant message's reasoning and tool calls.
const CONVERSATION_TEMPLATE: &str = r#"{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.id }} {{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}<|im_start|>assistant
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_response_id_continues_the_conversation() {
    let mut conversation_info = info();
    conversation_info.chat_template = Some(CONVERSATION_TEMPLATE.into());
    let s = TestServer::start_with(&[], conversation_info).await;
    says(&s, &format!("<think>\nCall it.\n</think>\n\n{}", call("get_weather", r#"{"city": "Paris"}"#)));
    let tools = json!([weather_tool()]);
    let first = body(json!({"tools": tools, "instructions": "Be brief."}));
    let (_, first) = s.post("/v1/responses", first).await;
    assert_eq!(kinds(&first), ["reasoning", "function_call"]);
    let fc = first["output"][1].clone();
    says(&s, "It is sunny in Paris.");
    let output = json!([{"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny, 21 C"}]);
    let next = body(json!({"tools": tools, "previous_response_id": first["id"], "input": output}));
    let (status, second) = s.post("/v1/responses", next).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!((&second["previous_response_id"], second["status"].as_str()), (&first["id"], Some("completed")));
    assert_eq!(second["output"][0]["content"][0]["text"], "It is sunny in Paris.");
    // The prompt replays turn one (its input, then its reasoning and call as one assistant message) and the
    // tool result; the first turn's instructions are not carried over.
    let call_id = fc["call_id"].as_str().unwrap();
    let expected = format!(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>Call it.</think>\
         <tool_call>{call_id} {{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}</tool_call><|im_end|>\n\
         <|im_start|>tool\nsunny, 21 C<|im_end|>\n<|im_start|>assistant"
    );
    assert_eq!(prompt(&s), expected);
    // Chained again, from the second: all three turns, in order.
    says(&s, "You're welcome.");
    let (_, r) = s.post("/v1/responses", body(json!({"previous_response_id": second["id"], "input": "Thanks!"}))).await;
    assert_eq!(r["status"], "completed");
    let tail = "<|im_start|>assistant\nIt is sunny in Paris.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n";
    assert_eq!(
        prompt(&s),
        format!("{}{tail}<|im_start|>assistant", expected.strip_suffix("<|im_start|>assistant").unwrap())
    );
    s.stop().await;
}

/// Opens a streamed response and reads up to its first event; returns the open body and the response id.
async fn open_stream(s: &TestServer, req: Value) -> (reqwest::Response, String) {
    let mut resp = s.client.post(s.url("/v1/responses")).json(&req).send().await.unwrap();
    let mut text = String::new();
    while !text.contains("\n\n") {
        text.push_str(&String::from_utf8_lossy(&resp.chunk().await.unwrap().unwrap()));
    }
    let created: Value = serde_json::from_str(text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
    assert_eq!(created["type"], "response.created");
    (resp, created["response"]["id"].as_str().unwrap().to_string())
}

/// Polls `GET` until the response is no longer in progress; returns it.
async fn wait_ended(s: &TestServer, id: &str) -> Value {
    for _ in 0..500 {
        let (_, r) = s.get(&format!("/v1/responses/{id}")).await;
        if r["status"] != "in_progress" {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{id} still in progress");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_responses_run_on_and_can_be_cancelled() {
    let s = server(&[]).await;
    says(&s, "It is sunny.");
    let (status, r) = s.post("/v1/responses", body(json!({"background": true}))).await;
    assert_eq!((status, r["status"].as_str(), r["background"].as_bool()), (200, Some("in_progress"), Some(true)));
    let done = wait_ended(&s, r["id"].as_str().unwrap()).await;
    assert_eq!(
        (done["status"].as_str(), done["output"][0]["content"][0]["text"].as_str()),
        (Some("completed"), Some("It is sunny."))
    );
    // A completed response cannot be cancelled.
    let (status, e) = s.post(&format!("/v1/responses/{}/cancel", r["id"].as_str().unwrap()), json!({})).await;
    assert_eq!((status, e["error"]["type"].as_str()), (400, Some("invalid_request_error")));

    trickles(&s, Duration::from_millis(5));
    let (_, r) = s.post("/v1/responses", body(json!({"background": true, "max_output_tokens": 100000}))).await;
    let id = r["id"].as_str().unwrap();
    let (status, got) = s.get(&format!("/v1/responses/{id}")).await;
    assert_eq!((status, got["status"].as_str(), got["output"].clone()), (200, Some("in_progress"), json!([])));
    let (status, cancelled) = s.post(&format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!((status, cancelled["status"].as_str()), (200, Some("cancelled")), "{cancelled}");
    assert_eq!(s.backend.aborted().len(), 1);
    assert_eq!(s.get(&format!("/v1/responses/{id}")).await.1["status"], "cancelled");
    // Cancelling it again returns it.
    let (status, again) = s.post(&format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!((status, again["status"].as_str()), (200, Some("cancelled")));
    for (bad, param) in [
        (json!({"background": true, "stream": true}), "background"),
        (json!({"background": true, "store": false}), "background"),
    ] {
        let (status, e) = s.post("/v1/responses", body(bad)).await;
        assert_eq!((status, e["error"]["param"].as_str()), (400, Some(param)));
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_a_streamed_response() {
    let s = server(&[]).await;
    trickles(&s, Duration::from_millis(5));
    let (resp, id) = open_stream(&s, body(json!({"stream": true, "max_output_tokens": 100000}))).await;
    assert_eq!(s.get(&format!("/v1/responses/{id}")).await.1["status"], "in_progress");
    let (status, cancelled) = s.post(&format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!((status, cancelled["status"].as_str()), (200, Some("cancelled")));
    let text = resp.text().await.unwrap();
    let last = text.split("\n\n").filter(|b| !b.trim().is_empty()).last().unwrap();
    assert!(last.starts_with("event: response.incomplete\n"), "{last}");
    assert!(last.contains("\"status\":\"cancelled\""), "{last}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_client_leaves_a_cancelled_response_and_delete_forgets() {
    let s = server(&[]).await;
    trickles(&s, Duration::from_millis(5));
    let (resp, id) = open_stream(&s, body(json!({"stream": true, "max_output_tokens": 100000}))).await;
    drop(resp);
    s.backend.wait_for("the abort", |b| !b.guard_fired().is_empty()).await;
    assert_eq!(wait_ended(&s, &id).await["status"], "cancelled");
    let resp = s.client.delete(s.url(&format!("/v1/responses/{id}"))).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.json::<Value>().await.unwrap(), json!({"id": id, "object": "response", "deleted": true}));
    assert_eq!(s.get(&format!("/v1/responses/{id}")).await.0, 404);
    let resp = s.client.delete(s.url(&format!("/v1/responses/{id}"))).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 404);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_are_bounded() {
    let s = server(&["--max-stored-responses", "2"]).await;
    let mut ids = vec![];
    for _ in 0..3 {
        says(&s, "ok");
        ids.push(s.post("/v1/responses", body(json!({}))).await.1["id"].as_str().unwrap().to_string());
    }
    let mut found = vec![];
    for id in &ids {
        found.push(s.get(&format!("/v1/responses/{id}")).await.0);
    }
    assert_eq!(found, [404, 200, 200]);
    let (status, e) = s.post("/v1/responses", body(json!({"previous_response_id": ids[0]}))).await;
    assert_eq!(
        (status, e["error"]["code"].as_str(), e["error"]["param"].as_str()),
        (404, Some("previous_response_not_found"), Some("previous_response_id"))
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_400_and_unknown_ids_404() {
    let s = server(&[]).await;
    for (bad, param) in [
        (json!({"input": []}), "input"),
        (json!({"input": 5}), "input"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0]",
        ),
        (json!({"input": [{"type": "function_call", "name": "f"}]}), "input[0]"),
        (json!({"input": [{"type": "file_search_call", "id": "x"}]}), "input[0]"),
        (json!({"max_output_tokens": 0}), "max_output_tokens"),
        (json!({"temperature": 3}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0]"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": [weather_tool()], "tool_choice": {"type": "function", "name": "nope"}}), "tool_choice"),
        (json!({"reasoning": {"effort": "extreme"}}), "reasoning"),
        (json!({"text": {"format": {"type": "json_object"}}}), "text"),
    ] {
        let (status, e) = s.post("/v1/responses", body(bad.clone())).await;
        assert_eq!((status, e["error"]["param"].as_str()), (400, Some(param)), "{bad}: {e}");
        assert_eq!(e["error"]["type"], "invalid_request_error");
    }
    let (status, e) = s.post("/v1/responses", json!({"input": "x", "model": "other"})).await;
    assert_eq!((status, e["error"]["code"].as_str()), (404, Some("model_not_found")));
    let (status, e) = s.post("/v1/responses", body(json!({"previous_response_id": "resp_nope"}))).await;
    assert_eq!((status, e["error"]["code"].as_str()), (404, Some("previous_response_not_found")));
    let (status, e) = s.get("/v1/responses/resp_nope").await;
    assert_eq!((status, e["error"]["code"].as_str()), (404, Some("response_not_found")));
    let (status, _) = s.post("/v1/responses/resp_nope/cancel", json!({})).await;
    assert_eq!(status, 404);
    let (status, e) = s.get("/v1/responses/%ff").await;
    assert_eq!((status, e["error"]["type"].as_str()), (400, Some("invalid_request_error")));
    let (status, _) = s.post_raw("/v1/responses", "[1]").await;
    assert_eq!(status, 400);
    assert!(s.backend.submitted().is_empty());
    s.stop().await;
}
