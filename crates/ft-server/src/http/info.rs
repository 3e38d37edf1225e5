//! `/health`, `/v1/models`, `/v1/stats`, `/v1` and the 404 fallback. None of these touches the engine
//! thread beyond the backend's cheap `health()` / `stats()`, so they answer while a step runs.

use crate::backend::HealthState;
use crate::http::openai_error::ApiError;
use crate::http::state::AppState;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// 200 `{"status": "ok", ...}` while serving; 503 with the state and reason otherwise.
pub async fn health(State(state): State<AppState>) -> Response {
    let uptime_s = state.started_at.elapsed().as_secs_f64();
    let model = state.served_model_name();
    let health = if state.drain.is_draining() { HealthState::ShuttingDown } else { state.backend.health() };
    let (status, reason) = match &health {
        HealthState::Serving => {
            return (StatusCode::OK, Json(json!({"status": "ok", "model": model, "uptime_s": uptime_s})))
                .into_response();
        }
        HealthState::Loading => ("loading", health.refusal().unwrap_or_default()),
        HealthState::Unhealthy(reason) => ("unhealthy", reason.clone()),
        HealthState::ShuttingDown => ("shutting_down", health.refusal().unwrap_or_default()),
    };
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": status, "reason": reason, "model": model, "uptime_s": uptime_s})),
    )
        .into_response()
}

pub async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    let max = state.max_context();
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.served_model_name(),
            "object": "model",
            "created": state.created,
            "owned_by": "freetoken",
            "root": state.served_model_name(),
            "max_model_len": max,
            "context_length": max,
        }]
    }))
}

/// The OpenAPI 3 description of the HTTP API (`crates/ft-server/openapi.json`, kept by hand next to
/// `protocol.rs`, whose validation it describes).
pub const OPENAPI_JSON: &str = include_str!("../../openapi.json");

pub async fn openapi() -> Response {
    ([(axum::http::header::CONTENT_TYPE, "application/json")], OPENAPI_JSON).into_response()
}

pub async fn stats(State(state): State<AppState>) -> Json<crate::engine::stats::EngineStats> {
    let mut stats = state.backend.stats();
    if let Some((hits, misses, bytes)) = state.tokenizer.segment_counters() {
        (stats.tokenizer_cache_hits, stats.tokenizer_cache_misses) = (hits, misses);
        stats.tokenizer_cache_bytes = bytes as u64;
    }
    Json(stats)
}

/// `GET|POST /v1`: a liveness answer some clients probe before listing models.
pub async fn v1_root() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(format!("no route for {}", uri.path()))
}

/// A known route called with the wrong method: 405 in OpenAI's error shape.
pub async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

/// `GET /metrics`: Prometheus' text format (`crate::metrics`). The health series is refreshed from the
/// backend here, so a scrape sees what `/health` would answer (draining included).
pub async fn metrics(State(state): State<AppState>) -> Response {
    let health = if state.drain.is_draining() { HealthState::ShuttingDown } else { state.backend.health() };
    state.metrics.set_health(&health);
    ([(axum::http::header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], state.metrics.render()).into_response()
}
