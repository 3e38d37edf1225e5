//! SIGTERM drains: new requests get 503, /health says shutting_down, in-flight requests run on until the
//! `--shutdown-grace` period ends and are then cancelled with an error, and the server returns `Ok`.
//! Its own test binary: the signal goes to the whole process.

mod common;

use common::*;
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_then_cancels_after_the_grace_period() {
    let mut info = engine_description();
    info.max_context = 1_000_000;
    let s = TestServer::start_with(&["--shutdown-grace", "1.5"], info).await;
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 200);
    // One request that would never end, one that ends within the grace period.
    s.backend.set_script(|req| {
        let delay = Duration::from_millis(if req.max_new_tokens == 20 { 25 } else { 5 });
        Ok(Script { tokens: vec![], end: End::Trickle(b'a' as u32), delay, cached_tokens: 0 })
    });
    let endless = {
        let client = s.client.clone();
        let url = s.url("/v1/chat/completions");
        tokio::spawn(async move {
            let body = json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000, "stream": true});
            let resp = client.post(url).json(&body).send().await.unwrap();
            parse_sse(&resp.text().await.unwrap())
        })
    };
    let short = {
        let client = s.client.clone();
        let url = s.url("/v1/completions");
        tokio::spawn(async move {
            let resp = client.post(url).json(&json!({"prompt": "x", "max_tokens": 20})).send().await.unwrap();
            (resp.status().as_u16(), resp.json::<serde_json::Value>().await.unwrap())
        })
    };
    s.backend.wait_for("both requests to start", |b| b.submitted().len() == 2).await;
    let t = Instant::now();
    unsafe {
        libc::kill(libc::getpid(), libc::SIGTERM);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, body) = s.get("/health").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "shutting_down");
    let (status, body) = s.post("/v1/chat/completions", chat_body("late")).await;
    assert_eq!(status, 503, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("shutting down"));

    let (status, body) = tokio::time::timeout(Duration::from_secs(5), short).await.unwrap().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert!(t.elapsed() < Duration::from_millis(1400), "the short request finished inside the grace period");

    let events = tokio::time::timeout(Duration::from_secs(10), endless).await.unwrap().unwrap();
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(1400) && took < Duration::from_secs(6), "{took:?}");
    assert_eq!(events.last(), Some(&SseData::Done));
    let SseData::Json(err) = &events[events.len() - 2] else { panic!("{events:?}") };
    assert!(err["error"]["message"].as_str().unwrap().contains("shutting down"), "{err}");
    s.backend
        .wait_for("the cancelled request to end in the backend", |b| b.record.finished.lock().unwrap().len() == 2)
        .await;
    // The server returns by itself (no `shutdown` future needed).
    s.wait_stopped(Duration::from_secs(10)).await;
}
