//! The axum server: shared state, the router, and the listener with graceful shutdown.

use crate::backend::{Backend, ModelInfo};
use crate::chat_template::ChatTemplate;
use crate::cli::{SamplingDefaults, ServeArgs};
use crate::openai_error::ApiError;
use crate::routes;
use crate::tokenizer::Tokenizer;
use anyhow::Context;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use ft_core::request::SamplingParams;
use std::future::Future;
use std::net::SocketAddr;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;
use tower_http::cors::{AllowOrigin, Any, CorsLayer};

/// Everything a handler needs. Cheap to clone (one `Arc`); configure it before handing it to the router.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<AppStateInner>,
}

pub struct AppStateInner {
    pub backend: Arc<dyn Backend>,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    pub info: ModelInfo,
    pub args: ServeArgs,
    /// Sampling values for fields a request leaves out (see [`AppState::with_default_sampling`]).
    pub default_sampling: SamplingParams,
    pub started_at: Instant,
    /// Unix time the server started (`created` of `/v1/models`).
    pub created: u64,
}

impl Deref for AppState {
    type Target = AppStateInner;
    fn deref(&self) -> &AppStateInner {
        &self.inner
    }
}

impl AppState {
    /// Loads the tokenizer from `info.tokenizer_path` and compiles `info.chat_template` (ChatML if none).
    pub fn new(args: ServeArgs, backend: Arc<dyn Backend>, info: ModelInfo) -> anyhow::Result<Self> {
        let tokenizer = Tokenizer::from_file(&info.tokenizer_path)?;
        let chat_template = ChatTemplate::new(info.chat_template.as_deref(), info.bos_token.clone(), info.eos_token.clone())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Self::from_parts(args, backend, info, tokenizer, chat_template))
    }

    /// From an already loaded tokenizer and template.
    pub fn from_parts(
        args: ServeArgs,
        backend: Arc<dyn Backend>,
        info: ModelInfo,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
    ) -> Self {
        // `--sampling-defaults none`: greedy. `model`: OpenAI's defaults until the model's
        // generation_config values are given through `with_default_sampling`.
        let default_sampling = match args.sampling_defaults {
            SamplingDefaults::None => SamplingParams::default(),
            SamplingDefaults::Model => SamplingParams { temperature: 1.0, ..SamplingParams::default() },
        };
        AppState {
            inner: Arc::new(AppStateInner {
                backend,
                tokenizer,
                chat_template,
                info,
                args,
                default_sampling,
                started_at: Instant::now(),
                created: routes::unix_now(),
            }),
        }
    }

    /// Sets the sampling defaults (the model's `generation_config.json`). Ignored under
    /// `--sampling-defaults none`. Panics if the state was already cloned.
    pub fn with_default_sampling(mut self, sampling: SamplingParams) -> Self {
        let inner = Arc::get_mut(&mut self.inner).expect("configure AppState before cloning it");
        if inner.args.sampling_defaults == SamplingDefaults::Model {
            inner.default_sampling = sampling;
        }
        self
    }

    /// `--served-model-name`, else the worker's name for the model, else the model path's basename.
    pub fn served_model_name(&self) -> String {
        if let Some(name) = &self.args.served_model_name {
            return name.clone();
        }
        if !self.info.served_model_name.is_empty() {
            return self.info.served_model_name.clone();
        }
        self.args.default_served_model_name()
    }

    /// Longest prompt + output the engine takes.
    pub fn max_context(&self) -> usize {
        match (self.info.max_context, self.args.max_seq_len_override) {
            (0, Some(n)) => n,
            (0, None) => usize::MAX / 2,
            (n, _) => n,
        }
    }
}

/// All routes, with the body limit, optional API key and CORS.
pub fn build_router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .route("/v1/completions", post(routes::completions::completions))
        .route("/v1/models", get(routes::info::models))
        .route("/v1/stats", get(routes::info::stats))
        .route("/v1", get(routes::info::v1_root).post(routes::info::v1_root))
        .fallback(routes::info::not_found)
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    let mut router = Router::new()
        .route("/health", get(routes::info::health))
        .merge(api)
        .layer(DefaultBodyLimit::max(state.args.max_request_body_bytes))
        .with_state(state.clone());
    if let Some(cors) = cors_layer(&state.args) {
        router = router.layer(cors);
    }
    router
}

/// `--api-key`: `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but `/health`.
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

/// Serves `state` on an already bound listener until `shutdown` resolves (or SIGINT / SIGTERM), then
/// finishes in-flight requests and returns.
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
    let app = build_router(state);
    tracing::info!("API server is ready to serve on {}", addr);
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(shutdown_signal(shutdown))
        .await
        .context("HTTP server failed")?;
    tracing::info!("API server stopped");
    Ok(())
}

/// Binds `--host:--port` and serves until `shutdown` resolves or SIGINT / SIGTERM arrives.
pub async fn run_server(
    args: ServeArgs,
    backend: Arc<dyn Backend>,
    info: ModelInfo,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let state = AppState::new(args, backend, info)?;
    let bind = format!("{}:{}", state.args.host, state.args.port);
    let listener = tokio::net::TcpListener::bind(&bind).await.with_context(|| format!("cannot listen on {bind}"))?;
    serve_listener(listener, state, shutdown).await
}

async fn shutdown_signal(shutdown: impl Future<Output = ()> + Send + 'static) {
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
        _ = shutdown => tracing::info!("Shutdown requested"),
        _ = ctrl_c => tracing::info!("SIGINT received, shutting down"),
        _ = terminate => tracing::info!("SIGTERM received, shutting down"),
    }
}
