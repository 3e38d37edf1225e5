//! Request deadlines (`--request-timeout`), the drain gate, and `/openapi.json`, against the scripted backend.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn trickle(
    delay_ms: u64,
) -> impl Fn(&ft_server::backend::GenerateRequest) -> Result<Script, ft_server::backend::SubmitError> {
    move |_| {
        Ok(Script {
            tokens: vec![],
            end: End::Trickle(b'a' as u32),
            delay: Duration::from_millis(delay_ms),
            cached_tokens: 0,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_aborts_with_408_or_an_sse_error() {
    let mut info = engine_description();
    info.max_context = 1_000_000;
    let s = TestServer::start_with(&["--request-timeout", "0.5"], info).await;
    s.backend.set_script(trickle(5));

    let t = Instant::now();
    let (status, body) = s
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}))
        .await;
    let took = t.elapsed();
    assert_eq!(status, 408, "{body}");
    assert_eq!(body["error"]["code"], "request_timeout");
    assert!(body["error"]["message"].as_str().unwrap().contains("--request-timeout"), "{body}");
    assert!(took >= Duration::from_millis(450) && took < Duration::from_secs(5), "{took:?}");
    s.backend.wait_for("the request to be aborted", |b| b.aborted() == vec![1]).await;
    s.backend.wait_for("the request to end", |b| b.record.finished.lock().unwrap().contains(&1)).await;

    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = if path == "/v1/completions" {
            json!({"prompt": "x", "max_tokens": 100000, "stream": true})
        } else {
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000, "stream": true})
        };
        let (status, events) = s.post_sse(path, body).await;
        assert_eq!(status, 200);
        assert_eq!(events.last(), Some(&SseData::Done), "{path}");
        let SseData::Json(err) = &events[events.len() - 2] else { panic!("{events:?}") };
        assert_eq!(err["error"]["code"], "request_timeout", "{path}: {err}");
        // tokens came before the deadline
        assert!(events.len() > 3, "{path}: {events:?}");
    }
    // A request that finishes in time is untouched.
    s.backend.set_script(|_| Ok(Script::reply("Hello")));
    let (status, body) = s.post("/v1/chat/completions", chat_body("x")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], "Hello");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_timeout_by_default() {
    let s = TestServer::start().await;
    s.backend.set_script(|_| {
        Ok(Script {
            tokens: vec![],
            end: End::Trickle(b'a' as u32),
            delay: Duration::from_millis(100),
            cached_tokens: 0,
        })
    });
    let (status, body) = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": 12})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_document_lists_the_routes() {
    let s = TestServer::start_with(&["--api-key", "k"], engine_description()).await;
    // Public, like /health.
    let (status, doc) = s.get("/openapi.json").await;
    assert_eq!(status, 200);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for (path, method) in [
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/v1/models", "get"),
        ("/v1/stats", "get"),
        ("/health", "get"),
    ] {
        assert!(doc["paths"][path][method].is_object(), "{path} {method}");
    }
    let chat = &doc["components"]["schemas"]["ChatCompletionRequest"];
    assert_eq!(chat["required"], json!(["messages"]));
    assert_eq!(chat["properties"]["temperature"]["maximum"], json!(2));
    assert_eq!(doc["components"]["schemas"]["CompletionRequest"]["required"], json!(["prompt"]));
    // Every $ref resolves.
    fn refs<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    if k == "$ref" {
                        out.push(x.as_str().unwrap());
                    } else {
                        refs(x, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| refs(x, out)),
            _ => {}
        }
    }
    let mut all = vec![];
    refs(&doc, &mut all);
    assert!(!all.is_empty());
    for r in all {
        let name = r.strip_prefix("#/components/schemas/").unwrap();
        assert!(doc["components"]["schemas"][name].is_object(), "{r}");
    }
    s.stop().await;
}
