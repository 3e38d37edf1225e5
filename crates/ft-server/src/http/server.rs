//! The axum server: the router and the listener with graceful shutdown. Handlers share [`AppState`]
//! (`state.rs`).

use crate::backend::{Backend, EngineDescription};
use crate::cli::ServeArgs;
use crate::http::openai_error::ApiError;
pub use crate::http::state::AppState;

use anyhow::Context;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::future::FutureExt;
use std::future::Future;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

/// All routes, with the body limit, optional API key and CORS.
pub fn build_router(state: AppState) -> Router {
    use axum::handler::Handler;
    // Generation routes: every request counted in /metrics once, however it ends (request_metrics.rs).
    let tracked = || middleware::from_fn_with_state(state.clone(), crate::http::request_metrics::track);
    let mut api = Router::new()
        .route("/v1/chat/completions", post(crate::http::chat::chat_completions.layer(tracked())))
        .route("/v1/completions", post(crate::http::completions::completions.layer(tracked())))
        .route("/v1/messages", post(crate::http::messages::messages.layer(tracked())))
        .route("/v1/messages/count_tokens", post(crate::http::messages::count_tokens))
        .route("/v1/responses", post(crate::http::responses::create_response.layer(tracked())))
        .route(
            "/v1/responses/{id}",
            get(crate::http::responses::get_response).delete(crate::http::responses::delete_response),
        )
        .route("/v1/responses/{id}/cancel", post(crate::http::responses::cancel_response))
        .route("/v1/models", get(crate::http::info::models))
        .route("/v1/stats", get(crate::http::info::stats))
        .route("/v1", get(crate::http::info::v1_root).post(crate::http::info::v1_root));
    // /metrics needs --api-key like the API unless --metrics-without-api-key.
    let mut open = Router::new().route("/health", get(crate::http::info::health));
    if state.args.metrics_without_api_key {
        open = open.route("/metrics", get(crate::http::info::metrics));
    } else {
        api = api.route("/metrics", get(crate::http::info::metrics));
    }
    let api = api
        .fallback(crate::http::info::not_found)
        .method_not_allowed_fallback(crate::http::info::method_not_allowed)
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    let mut router = open
        .route("/openapi.json", get(crate::http::info::openapi))
        .merge(api)
        .layer(DefaultBodyLimit::max(state.args.max_request_body_bytes))
        .with_state(state.clone());
    if let Some(cors) = cors_layer(&state.args) {
        router = router.layer(cors);
    }
    router
}

/// `--api-key`: `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but `/health` (and `/metrics`
/// under `--metrics-without-api-key`).
async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = state.args.api_key.as_deref() else {
        return next.run(req).await;
    };
    let headers = req.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    if bearer == Some(key) || x_api_key == Some(key) {
        next.run(req).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

fn cors_layer(args: &ServeArgs) -> Option<CorsLayer> {
    let origins = args.cors_origin_list();
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::from(Any)
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
            .allow_headers(Any),
    )
}

/// After the listener is told to close: how long the last responses get to flush before the server returns
/// anyway (every request has its answer by then; a client that does not read it must not hold us).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the server stops.
enum StopReason {
    /// The caller's `shutdown` future resolved (in `ft serve`: the engine died, every client is answered).
    Requested,
    /// SIGTERM or SIGINT: drain first.
    Signal(&'static str),
}

/// Serves `state` on an already bound listener until `shutdown` resolves or SIGINT / SIGTERM arrives.
///
/// `shutdown` stops at once. A signal drains (see [`crate::http::drain`]): new generation requests and `/health`
/// get 503 while in-flight requests run on for up to `--shutdown-grace` seconds; then the rest are cancelled
/// with an error, the listener closes, and this returns `Ok`.
pub async fn serve_listener(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(
        "Serving model {} (max context {}, tokenizer vocab {})",
        state.served_model_name(),
        state.max_context(),
        state.tokenizer.vocab_size()
    );
    let app = build_router(state.clone());
    tracing::info!("API server is ready to serve on {}", addr);
    let (close_tx, close_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(async move {
            let _ = close_rx.await;
        })
        .into_future();
    tokio::pin!(server);
    let shutdown = shutdown.fuse();
    tokio::pin!(shutdown);
    let reason = tokio::select! {
        r = &mut server => {
            // The server stopped by itself: only an I/O error does that.
            r.context("HTTP server failed")?;
            return Ok(());
        }
        _ = &mut shutdown => StopReason::Requested,
        sig = next_signal() => StopReason::Signal(sig),
    };
    match reason {
        StopReason::Requested => tracing::info!("Shutdown requested"),
        StopReason::Signal(sig) => {
            drain(&state, sig, &mut shutdown, &mut server).await;
        }
    }
    // Whatever still waits (a request that slipped past the gate) gives up now.
    state.drain.cancel_live();
    let _ = close_tx.send(());
    match tokio::time::timeout(CLOSE_TIMEOUT, &mut server).await {
        Ok(r) => r.context("HTTP server failed")?,
        Err(_) => tracing::warn!("Connections still open {} s after shutdown; closing them", CLOSE_TIMEOUT.as_secs()),
    }
    tracing::info!("API server stopped");
    Ok(())
}

/// The grace period after a signal: refuse new requests, wait for the live ones, cancel the rest.
async fn drain<S, F>(
    state: &AppState,
    sig: &str,
    shutdown: &mut std::pin::Pin<&mut S>,
    server: &mut std::pin::Pin<&mut F>,
) where
    S: Future<Output = ()> + futures::future::FusedFuture,
    F: Future<Output = std::io::Result<()>>,
{
    let grace = Duration::from_secs_f64(state.args.shutdown_grace);
    state.drain.start_draining();
    let live = state.drain.live();
    tracing::info!(
        "{sig} received, shutting down: refusing new requests, waiting up to {:.1} s (--shutdown-grace) for {live} in-flight request(s)",
        grace.as_secs_f64()
    );
    let outcome = tokio::select! {
        _ = state.drain.wait_idle() => "every in-flight request finished",
        _ = tokio::time::sleep(grace) => "the grace period ended",
        sig = next_signal() => if sig == "SIGINT" { "a second SIGINT arrived" } else { "a second SIGTERM arrived" },
        _ = shutdown.as_mut(), if !shutdown.is_terminated() => "the engine stopped",
        r = server.as_mut() => {
            if let Err(e) = r {
                tracing::error!("HTTP server failed while draining: {e}");
            }
            "the HTTP server stopped"
        }
    };
    let left = state.drain.live();
    if left > 0 {
        tracing::warn!("Shutdown: {outcome}; cancelling {left} request(s) still in flight");
    } else {
        tracing::info!("Shutdown: {outcome}");
    }
}

/// Binds `--host:--port` and serves until `shutdown` resolves or SIGINT / SIGTERM arrives (see
/// [`serve_listener`]).
pub async fn run_server(
    args: ServeArgs,
    backend: Arc<dyn Backend>,
    info: EngineDescription,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    serve_on_bind_address(AppState::new(args, backend, info)?, shutdown).await
}

/// [`run_server`] with a state already built (`ft serve` shares its metrics registry with the engine).
pub async fn serve_on_bind_address(
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let bind = format!("{}:{}", state.args.host, state.args.port);
    let listener = tokio::net::TcpListener::bind(&bind).await.with_context(|| format!("cannot listen on {bind}"))?;
    serve_listener(listener, state, shutdown).await
}

/// The next SIGINT or SIGTERM, by name. Each call installs fresh listeners (tokio keeps its handler once
/// installed, so a signal never kills the process by default action after the first).
async fn next_signal() -> &'static str {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => "SIGINT",
        _ = terminate => "SIGTERM",
    }
}
