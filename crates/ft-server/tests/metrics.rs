//! `GET /metrics` on the real router against a scripted backend: every generation request is counted once by
//! outcome (served, rejected before the engine, failed in it, timed out, aborted), token counters and latency
//! histograms move, and the route sits behind `--api-key` unless `--metrics-without-api-key`.

mod common;

use common::*;
use ft_core::request::FinishReason;
use ft_server::backend::{HealthState, SubmitError};
use futures::StreamExt;
use serde_json::json;
use std::time::Duration;

async fn scrape(s: &TestServer) -> String {
    let resp = s.client.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let ct = resp.headers().get("content-type").unwrap().to_str().unwrap().to_string();
    assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8");
    resp.text().await.unwrap()
}

/// The value of the one sample `name{...}` carrying every label in `labels`.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split('{').next() == Some(name))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(found.len(), 1, "{name} {labels:?} in\n{text}");
    found[0]
}

fn outcome(text: &str, o: &str) -> f64 {
    value(text, "freetoken_requests_total", &[("outcome", o)])
}

/// Polls /metrics until `outcome` reaches `n` (an SSE body or a dropped request ends after its response).
async fn wait_outcome(s: &TestServer, o: &str, n: f64) -> String {
    for _ in 0..500 {
        let text = scrape(s).await;
        if outcome(&text, o) >= n {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("requests_total{{outcome={o}}} never reached {n}:\n{}", scrape(s).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_move_with_every_outcome() {
    let s = TestServer::start().await;
    let text = scrape(&s).await;
    for o in ["stop", "length", "abort", "timeout", "error", "rejected"] {
        assert_eq!(outcome(&text, o), 0.0, "{o}");
    }
    assert_eq!(value(&text, "freetoken_engine_health", &[("state", "serving")]), 1.0);
    assert!(text.contains("model_name=\"test-model\""));

    // Served: chat (whole), one stop; its tokens and latencies counted.
    let (status, body) = s.post("/v1/chat/completions", chat_body("Hi")).await;
    assert_eq!(status, 200, "{body}");
    let generated = body["usage"]["completion_tokens"].as_f64().unwrap();
    let prompt = body["usage"]["prompt_tokens"].as_f64().unwrap();
    let text = scrape(&s).await;
    assert_eq!(outcome(&text, "stop"), 1.0);
    assert_eq!(value(&text, "freetoken_generation_tokens_total", &[]), generated);
    assert_eq!(value(&text, "freetoken_prompt_tokens_total", &[]), prompt);
    assert_eq!(value(&text, "freetoken_time_to_first_token_seconds_count", &[]), 1.0);
    assert_eq!(value(&text, "freetoken_inter_token_latency_seconds_count", &[]), generated - 1.0);
    assert_eq!(value(&text, "freetoken_e2e_request_latency_seconds_count", &[]), 1.0);
    assert_eq!(value(&text, "freetoken_request_queue_time_seconds_count", &[]), 1.0);
    assert_eq!(value(&text, "freetoken_request_generation_tokens_sum", &[]), generated);

    // Streamed completion cut by max_tokens: length. Anthropic messages: stop. Prefix-cache hits from Started.
    s.backend.set_script(|_| {
        let mut sc = Script::reply("one two three four five six");
        sc.cached_tokens = 3;
        Ok(sc)
    });
    let (status, _) =
        s.post_sse("/v1/completions", json!({"prompt": "x y z w", "max_tokens": 2, "stream": true})).await;
    assert_eq!(status, 200);
    let text = wait_outcome(&s, "length", 1.0).await;
    assert_eq!(value(&text, "freetoken_prefix_cache_hits_total", &[]), 3.0);
    let (status, body) = s
        .post(
            "/v1/messages",
            json!({"model": "test-model", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(outcome(&scrape(&s).await, "stop"), 2.0);

    // Rejected before the engine: invalid (400), unreadable JSON (400), queue full (429), not serving (503).
    let mut bad = chat_body("x");
    bad["temperature"] = json!(-1);
    assert_eq!(s.post("/v1/chat/completions", bad).await.0, 400);
    assert_eq!(s.post_raw("/v1/completions", "{not json").await.0, 400);
    s.backend.set_script(|_| Err(SubmitError::Overloaded("queue is full".into())));
    assert_eq!(s.post("/v1/chat/completions", chat_body("x")).await.0, 429);
    s.backend.set_script(|_| Ok(Script::reply("ok")));
    s.backend.set_health(HealthState::Unhealthy("step 3 overran --step-timeout".into()));
    assert_eq!(
        s.post(
            "/v1/messages",
            json!({"model": "test-model", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})
        )
        .await
        .0,
        503
    );
    let text = scrape(&s).await;
    assert_eq!(outcome(&text, "rejected"), 4.0);
    assert_eq!(value(&text, "freetoken_engine_health", &[("state", "unhealthy")]), 1.0);
    assert_eq!(value(&text, "freetoken_engine_health", &[("state", "serving")]), 0.0);
    s.backend.set_health(HealthState::Serving);

    // Failed in the engine: error.
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: vec![b'a' as u32],
            end: End::Fail("CUDA error".into()),
            delay: Duration::ZERO,
            cached_tokens: 0,
        })
    });
    assert_eq!(s.post("/v1/chat/completions", chat_body("x")).await.0, 500);
    assert_eq!(outcome(&scrape(&s).await, "error"), 1.0);

    // Not generation requests: not counted.
    s.post("/v1/messages/count_tokens", json!({"model": "test-model", "messages": [{"role": "user", "content": "x"}]}))
        .await;
    s.get("/v1/models").await;
    let text = scrape(&s).await;
    let total: f64 =
        ["stop", "length", "abort", "timeout", "error", "rejected"].iter().map(|o| outcome(&text, o)).sum();
    assert_eq!(total, 8.0, "{text}");
    assert_eq!(outcome(&text, "abort"), 0.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_and_disconnect_are_counted() {
    let s = TestServer::start_with(&["--request-timeout", "0.2"], engine_description()).await;
    s.backend.set_script(|_| {
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay: Duration::from_millis(5), cached_tokens: 0 })
    });
    assert_eq!(s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 100000})).await.0, 408);
    assert_eq!(outcome(&scrape(&s).await, "timeout"), 1.0);

    // A streaming client that goes away: abort.
    let mut body = chat_body("x");
    body["stream"] = json!(true);
    let resp = s.client.post(s.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    let mut bytes = resp.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("\"content\":\"a\"") {
        seen.push_str(&String::from_utf8_lossy(&bytes.next().await.unwrap().unwrap()));
    }
    drop(bytes);
    let text = wait_outcome(&s, "abort", 1.0).await;
    assert_eq!(outcome(&text, "timeout"), 1.0);
    assert!(value(&text, "freetoken_generation_tokens_total", &[]) >= 1.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_finish_reasons_map_to_outcomes() {
    let s = TestServer::start().await;
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: vec![b'a' as u32],
            end: End::Finish(FinishReason::Abort),
            delay: Duration::ZERO,
            cached_tokens: 0,
        })
    });
    assert_eq!(s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 8})).await.0, 200);
    assert_eq!(outcome(&scrape(&s).await, "abort"), 1.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_needs_the_api_key_unless_configured() {
    let s = TestServer::start_with(&["--api-key", "sekret"], engine_description()).await;
    let resp = s.client.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    // A request refused for its key is not counted.
    assert_eq!(s.post("/v1/chat/completions", chat_body("x")).await.0, 401);
    let resp = s.client.get(s.url("/metrics")).bearer_auth("sekret").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(outcome(&resp.text().await.unwrap(), "rejected"), 0.0);
    s.stop().await;

    let s = TestServer::start_with(&["--api-key", "sekret", "--metrics-without-api-key"], engine_description()).await;
    let text = scrape(&s).await;
    assert_eq!(outcome(&text, "stop"), 0.0);
    assert_eq!(s.get("/v1/models").await.0, 401);
    s.stop().await;
}
