//! What every handler shares: the backend, the tokenizer and chat template, the engine description and the
//! limits requests are validated against, the flags, and the shutdown drain. Cheap to clone (one `Arc`).

use crate::backend::{Backend, EngineDescription};
use crate::cli::{SamplingDefaults, ServeArgs};
use crate::http::drain::Drain;
use crate::http::responses::store::ResponseStore;
use crate::metrics::Metrics;
use crate::text::chat_template::ChatTemplate;
use crate::text::reasoning::ReasoningFormat;
use crate::text::tokenizer::Tokenizer;
use crate::text::tool_calls::ToolCallFormat;
use ft_core::request::SamplingParams;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Instant;

/// Everything a handler needs. Cheap to clone (one `Arc`); configure it before handing it to the router.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<AppStateInner>,
}

pub struct AppStateInner {
    pub backend: Arc<dyn Backend>,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    pub info: EngineDescription,
    pub args: ServeArgs,
    /// `--tool-call-parser` resolved for the model (`None`: tool calls stay text).
    pub tool_call_format: Option<ToolCallFormat>,
    /// `--reasoning-parser` resolved for the model (`None`: no reasoning is split out).
    pub reasoning_format: Option<ReasoningFormat>,
    /// What requests are validated against (from `info` and `args`).
    pub limits: crate::validation::Limits,
    /// Sampling values for fields a request leaves out (see [`AppState::with_default_sampling`]).
    pub default_sampling: SamplingParams,
    pub started_at: Instant,
    /// Unix time the server started (`created` of `/v1/models`).
    pub created: u64,
    /// Graceful shutdown: refuses new requests, counts and cancels live ones.
    pub drain: Arc<Drain>,
    /// Requests being templated and tokenized at once (`--num-tokenizer`, else one per core).
    pub prepare_slots: Arc<tokio::sync::Semaphore>,
    /// What `GET /metrics` serves; shared with the engine (see [`AppState::with_metrics`]).
    pub metrics: Arc<Metrics>,
    /// Stored Responses-API responses (`--max-stored-responses`).
    pub(crate) responses: Arc<ResponseStore>,
}

impl Deref for AppState {
    type Target = AppStateInner;
    fn deref(&self) -> &AppStateInner {
        &self.inner
    }
}

impl AppState {
    /// Loads the tokenizer from `info.tokenizer_path` and compiles `info.chat_template` (ChatML if none).
    pub fn new(args: ServeArgs, backend: Arc<dyn Backend>, info: EngineDescription) -> anyhow::Result<Self> {
        let tokenizer = Tokenizer::from_file(&info.tokenizer_path)?;
        let chat_template =
            ChatTemplate::new(info.chat_template.as_deref(), info.bos_token.clone(), info.eos_token.clone())
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        Self::from_parts(args, backend, info, tokenizer, chat_template)
    }

    /// From an already loaded tokenizer and template. Resolves the output parsers for the model (an unknown
    /// parser name is an error; `ServeArgs::validate` refuses one before the model loads).
    pub fn from_parts(
        args: ServeArgs,
        backend: Arc<dyn Backend>,
        info: EngineDescription,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
    ) -> anyhow::Result<Self> {
        let template = info.chat_template.as_deref();
        let tool_call_format = ToolCallFormat::resolve(args.tool_call_parser.as_deref(), &info.architecture, template)
            .map_err(|e| anyhow::anyhow!(e))?;
        let reasoning_format = ReasoningFormat::resolve(args.reasoning_parser.as_deref(), &info.architecture, template)
            .map_err(|e| anyhow::anyhow!(e))?;
        tracing::info!(
            "Output parsers: tool calls {}, reasoning {}",
            tool_call_format.map_or("off", |f| f.name()),
            reasoning_format.map_or("off", |f| f.name())
        );
        // `--sampling-defaults none`: greedy. `model`: the model's generation_config values, else OpenAI's
        // defaults (temperature 1).
        let default_sampling = match args.sampling_defaults {
            SamplingDefaults::None => SamplingParams::default(),
            SamplingDefaults::Model => info
                .generation_defaults
                .clone()
                .unwrap_or(SamplingParams { temperature: 1.0, ..SamplingParams::default() }),
        };
        let prepare_slots = match args.num_tokenizer {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).clamp(2, 16),
            n => n,
        };
        let metrics = Arc::new(Metrics::new(&info.served_model_name));
        let responses = Arc::new(ResponseStore::new(args.max_stored_responses));
        Ok(AppState {
            inner: Arc::new(AppStateInner {
                backend,
                tokenizer,
                chat_template,
                tool_call_format,
                reasoning_format,
                limits: crate::validation::Limits::new(&info, &args),
                info,
                args,
                default_sampling,
                started_at: Instant::now(),
                created: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0),
                drain: Arc::new(Drain::default()),
                prepare_slots: Arc::new(tokio::sync::Semaphore::new(prepare_slots)),
                metrics,
                responses,
            }),
        })
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

    /// Serves `metrics` (the registry the engine also writes to) instead of a registry of its own. Panics if
    /// the state was already cloned.
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        Arc::get_mut(&mut self.inner).expect("configure AppState before cloning it").metrics = metrics;
        self
    }

    /// The id `/v1/models` lists and responses name (the engine description's).
    pub fn served_model_name(&self) -> String {
        self.info.served_model_name.clone()
    }

    /// Whether requests may name the model `name`: its served name or one of its aliases.
    pub fn serves_model(&self, name: &str) -> bool {
        self.info.served_model_name == name || self.info.model_aliases.iter().any(|a| a == name)
    }

    /// Longest prompt + output the engine takes (the engine description's; nobody re-derives it).
    pub fn max_context(&self) -> usize {
        self.info.max_context
    }
}
