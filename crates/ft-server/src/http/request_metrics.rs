//! Every generation request counted once in `/metrics`, whatever route it took and however it ended.
//!
//! ```text
//!  request ──▶ [track] starts a RequestTimer at arrival, held in a task-local for the handler
//!                 │
//!                 ├─ handler submits ──▶ TextStream takes the timer (timer_for_stream): it reports Started /
//!                 │                      Token / Finished / Failed and the outcome, streaming or not
//!                 │
//!                 └─ handler answers without submitting (bad JSON, validation 4xx, 429, 503): the timer is
//!                    still here when the response comes back, and [track] counts it by status
//!                    (`rejected` for 4xx and 503, `error` for other 5xx)
//! ```
//!
//! A handler future dropped before it submitted (the client went away while its prompt was tokenized) drops
//! the timer, which counts an `abort`. Only the generation routes are tracked (chat, completions, messages);
//! requests the API key middleware refuses never reach [track].

use crate::http::state::AppState;
use crate::metrics::{Metrics, RequestOutcome, RequestTimer};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use std::cell::RefCell;
use std::sync::Arc;

tokio::task_local! {
    /// The timer of the request this task handles, until a `TextStream` takes it.
    static PENDING: RefCell<Option<RequestTimer>>;
}

/// Middleware of the generation routes: times the request from its arrival and counts it if it ends
/// before it reaches the engine.
pub(crate) async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let timer = RefCell::new(Some(RequestTimer::new(state.metrics.clone())));
    PENDING
        .scope(timer, async move {
            let response = next.run(req).await;
            if let Some(mut timer) = PENDING.with(|t| t.borrow_mut().take()) {
                let status = response.status();
                let outcome = if status.is_server_error() && status != axum::http::StatusCode::SERVICE_UNAVAILABLE {
                    RequestOutcome::Error
                } else {
                    // 4xx, 503, and (never expected) a success that submitted nothing.
                    RequestOutcome::Rejected
                };
                timer.finish_at(outcome, std::time::Instant::now());
            }
            response
        })
        .await
}

/// The request's timer for its `TextStream` (from arrival when [track] runs, else from now).
pub(crate) fn timer_for_stream(metrics: &Arc<Metrics>) -> RequestTimer {
    PENDING.try_with(|t| t.borrow_mut().take()).ok().flatten().unwrap_or_else(|| RequestTimer::new(metrics.clone()))
}
