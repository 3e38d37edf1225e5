//! The `ft` command line: every `ft serve` flag FreeToken has (REFERENCES 4.3), parsed and validated here and
//! nowhere else. `ServeArgs` serializes to JSON so the Python worker sees exactly what the user typed.
//!
//! Errors: clap's own parse errors exit 2; cross-flag checks ([`ServeArgs::validate`]) and flags whose feature
//! is not built yet ([`unsupported_feature`]) exit 2 with a one-line `error: ...`.

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

/// `--max-output-tokens` when not given.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u32 = 32768;

// `ft serve --help` groups the flags by topic, in this order.
const MODEL: &str = "Model and device";
const MEMORY: &str = "Memory and batching";
const MOE: &str = "Mixture of experts";
const CACHE: &str = "Prefix cache";
const API: &str = "API";
const RELIABILITY: &str = "Reliability and logging";

#[derive(Parser, Debug, Clone, Serialize)]
#[command(
    name = "ft",
    version,
    about = "FreeToken: serve large Mixture-of-Experts models on one GPU",
    subcommand_required = true,
    arg_required_else_help = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: no point boxing the large serve flags.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug, Clone, Serialize)]
pub enum Command {
    /// Start the OpenAI-compatible API server.
    Serve(ServeArgs),
    /// Quantize a BF16/FP16/FP32 checkpoint into a ModelOpt-format NVFP4 (or mixed NVFP4/FP8) checkpoint.
    Quantize(QuantizeArgs),
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum QuantScheme {
    /// ModelOpt W4A16_NVFP4: every Linear but ModelOpt's default-disabled ones (routers, GDN conv1d / in_proj_a/b,
    /// shared_expert_gate, lm_head, embeddings) in NVFP4, weights only.
    #[value(name = "w4a16-nvfp4")]
    W4a16Nvfp4,
    /// ModelOpt NVFP4 (W4A4): the same weights plus static input scales from calibration (served as W4A16).
    #[value(name = "nvfp4")]
    Nvfp4,
    /// NVIDIA's Qwen3.6-35B-A3B-NVFP4 recipe: NVFP4 experts, shared experts and lm_head; FP8 attention and GDN
    /// projections with calibrated input scales.
    #[value(name = "mixed-qwen3.6")]
    MixedQwen36,
}

/// `ft quantize`: the flags of `freetoken.quant.quantize_checkpoint` (the Python quantizer runs it).
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct QuantizeArgs {
    /// The BF16/FP16/FP32 Hugging Face checkpoint directory to quantize.
    #[arg(long = "model-path", visible_alias = "model")]
    pub model_path: String,

    /// The directory to write (safetensors, config.json with quantization_config, hf_quant_config.json).
    #[arg(long, visible_alias = "out")]
    pub output: String,

    /// What to quantize and how.
    #[arg(long, value_enum)]
    pub scheme: QuantScheme,

    /// Tokens run through the model to calibrate static input scales (nvfp4, mixed-qwen3.6).
    #[arg(long, default_value_t = 512)]
    pub calib_tokens: usize,

    /// Where calibration runs; auto = CUDA when a device is present, else CPU.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,
}

impl QuantizeArgs {
    /// The argument list of `freetoken.quant.quantize_checkpoint.main`.
    pub fn python_argv(&self) -> Vec<String> {
        let scheme = self.scheme.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default();
        [
            "--model-path",
            &self.model_path,
            "--out",
            &self.output,
            "--scheme",
            &scheme,
            "--calib-tokens",
            &self.calib_tokens.to_string(),
            "--device",
            &self.device.as_str(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Auto,
    Float16,
    Bfloat16,
    Float32,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoeBackend {
    Auto,
    Fused,
    Offload,
    Cpu,
    Hybrid,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Nvfp4Backend {
    /// triton on CUDA, torch elsewhere.
    Auto,
    /// Our W4A16 Triton kernels (NVFP4 Linear, MoE decode GEMVs, grouped prefill); CUDA.
    Triton,
    /// The reference: dequantize, then the BF16 matmul (any device; slow).
    Torch,
    /// vLLM's Marlin FP4 kernels: not built.
    Marlin,
    /// FlashInfer's FP4 GEMMs (FP4 tensor cores, Blackwell): not built.
    Flashinfer,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionBackend {
    Auto,
    Triton,
    Torch,
    Fi,
    Fa,
    Trtllm,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheType {
    Radix,
    Naive,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplingDefaults {
    /// temperature / top_k / top_p from the model's `generation_config.json`.
    Model,
    /// Greedy unless the request says otherwise.
    None,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MoeCachePolicy {
    Lru,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelSource {
    Huggingface,
    Modelscope,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExpertLoad {
    Auto,
    Serial,
    Parallel,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

/// `cache_type == "naive"` and the like: every value enum compares with its flag spelling.
macro_rules! eq_flag_spelling {
    ($($t:ty),*) => {$(
        impl PartialEq<&str> for $t {
            fn eq(&self, other: &&str) -> bool {
                self.to_possible_value().is_some_and(|v| v.matches(other, false))
            }
        }
        impl $t {
            /// The flag spelling of this value.
            pub fn as_str(&self) -> String {
                self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
            }
        }
    )*};
}
eq_flag_spelling!(
    Dtype,
    MoeBackend,
    Nvfp4Backend,
    AttentionBackend,
    CacheType,
    SamplingDefaults,
    MoeCachePolicy,
    Device,
    ModelSource,
    ExpertLoad
);

/// Every `ft serve` flag. Field names are the Python side's names (snake_case of the long flag). Deserializable
/// so the offline engine (`freetoken.LLM`) reads the worker's settings back as the same struct.
#[derive(Args, Debug, Clone, Serialize, Deserialize)]
pub struct ServeArgs {
    /// A local model: an HF-layout directory (config.json + safetensors) or a GGUF file (default: the built-in
    /// demo model). Nothing is downloaded: HF repo ids and FTW directories are refused.
    #[arg(help_heading = MODEL, long = "model-path", visible_alias = "model")]
    pub model_path: Option<String>,

    /// Weight and activation dtype; auto = the checkpoint's (GGUF: float32 on CPU, bfloat16 on CUDA).
    #[arg(help_heading = MODEL, long, value_enum, default_value_t = Dtype::Auto)]
    pub dtype: Dtype,

    /// Where the model runs; auto = CUDA when a device is present, else CPU.
    #[arg(help_heading = MODEL, long, value_enum, default_value_t = Device::Auto)]
    pub device: Device,

    /// Longest sequence (prompt + output); default = the model's rope table.
    #[arg(help_heading = MODEL, long)]
    pub max_seq_len_override: Option<usize>,

    /// Random weights (benchmarks, smoke tests).
    #[arg(help_heading = MODEL, long)]
    pub dummy_weight: bool,

    /// Where HF repo ids are downloaded from; nothing is downloaded (--model-path is a local path), so only
    /// the default is accepted.
    #[arg(help_heading = MODEL, long, value_enum, default_value_t = ModelSource::Huggingface)]
    pub model_source: ModelSource,

    /// Attention kernels; auto = Triton on CUDA, torch on CPU.
    #[arg(help_heading = MODEL, long = "attention-backend", visible_alias = "attn", value_enum, default_value_t = AttentionBackend::Auto)]
    pub attention_backend: AttentionBackend,

    /// What runs NVFP4 layers and experts: auto = triton on CUDA (our W4A16 Triton kernels), torch elsewhere (the
    /// dequantizing reference); triton or torch pin one (triton needs CUDA); marlin and flashinfer are not built.
    #[arg(help_heading = MODEL, long, value_enum, default_value_t = Nvfp4Backend::Auto)]
    pub nvfp4_backend: Nvfp4Backend,

    /// Largest decode batch captured in a CUDA graph: buckets 1, 2, 4, 8, 16, 24, ... up to it (default =
    /// --max-running-requests; 0 disables). Larger decode batches and prefill steps run eagerly.
    #[arg(help_heading = MODEL, long = "cuda-graph-max-bs", visible_alias = "graph")]
    pub cuda_graph_max_bs: Option<usize>,

    /// Run every step eagerly: no decode CUDA graphs (SGLang's spelling; same as --cuda-graph-max-bs 0).
    #[arg(help_heading = MODEL, long)]
    pub disable_cuda_graph: bool,

    /// Hybrid models on CUDA: one sequence's Gated DeltaNet prefill pieces up to this many tokens replay CUDA
    /// graphs captured at start-up by padded length (the host cost of fla's launches, ~1 ms a layer, is most of a
    /// short cached turn's step); 0 (or --disable-cuda-graph) runs them eagerly.
    #[arg(help_heading = MODEL, long, default_value_t = 4096)]
    pub gdn_prefill_graph_tokens: usize,

    /// Resident MoE experts on CUDA: steps of up to this many tokens run each sparse MoE block (router, shared
    /// expert, grouped experts, combine: ~9 launches) as one CUDA graph captured at start-up by padded token count,
    /// padding rows routed to no expert; 0 (or --disable-cuda-graph) runs them eagerly.
    #[arg(help_heading = MODEL, long, default_value_t = 4096)]
    pub moe_prefill_graph_tokens: usize,

    /// Skip the start-up prefill warm-up: on CUDA a few prompt chunks of other shapes than the dry run's (short,
    /// medium, a chunk after a long prefix) run before the server answers, so that the first requests do not wait
    /// for Triton to compile their kernels (seconds on a cold cache).
    #[arg(help_heading = MODEL, long)]
    pub skip_prefill_warmup: bool,

    /// Commit each step before planning the next (SGLang's spelling; also DISABLE_OVERLAP_SCHEDULING=1): by default
    /// a decode step is planned and launched while the one before it still runs on the GPU.
    #[arg(help_heading = MODEL, long, env = "DISABLE_OVERLAP_SCHEDULING", value_parser = clap::builder::BoolishValueParser::new())]
    pub disable_overlap_schedule: bool,

    /// Tensor-parallel ranks (only 1 is built).
    #[arg(help_heading = MODEL, long = "tensor-parallel-size", visible_alias = "tp-size", default_value_t = 1)]
    pub tensor_parallel_size: usize,

    /// Kept so FreeToken launch lines work: FreeToken runs one rank, so there is no NCCL to disable (logged).
    #[arg(help_heading = MODEL, long)]
    pub disable_pynccl: bool,

    /// Fraction of the free VRAM for weights + MoE cache + KV, in (0, 1].
    #[arg(help_heading = MEMORY, long, default_value_t = 0.9)]
    pub memory_ratio: f64,

    /// VRAM (MiB) kept free after the start-up dry run (default: none).
    #[arg(help_heading = MEMORY, long)]
    pub vram_reserve_mb: Option<u64>,

    /// Concurrent running requests (the page table has this + 1 rows).
    #[arg(help_heading = MEMORY, long, default_value_t = 4)]
    pub max_running_requests: usize,

    /// Chunked-prefill chunk size in tokens.
    #[arg(help_heading = MEMORY, long = "max-prefill-length", visible_aliases = ["max-extend-length", "max-extend-tokens"], default_value_t = 8192)]
    pub max_prefill_length: usize,

    /// Run a decode step after every N prefill chunks while decoders wait (0 = prefill first).
    #[arg(help_heading = MEMORY, long, default_value_t = 0)]
    pub decode_interleave_every: usize,

    /// Tokens per KV page.
    #[arg(help_heading = MEMORY, long, default_value_t = 1)]
    pub page_size: usize,

    /// KV capacity in pages, exclusive with --num-tokens (default: sized from free memory).
    #[arg(help_heading = MEMORY, long, conflicts_with = "num_tokens")]
    pub num_pages: Option<usize>,

    /// KV capacity in tokens, a multiple of --page-size, exclusive with --num-pages (default: sized from free
    /// memory).
    #[arg(help_heading = MEMORY, long, conflicts_with = "num_pages")]
    pub num_tokens: Option<usize>,

    /// KV floor in tokens before --moe-cache-auto fills the rest with experts.
    #[arg(help_heading = MEMORY, long, default_value_t = 8192)]
    pub kv_reserve_tokens: usize,

    /// Where routed experts live: fused keeps all on the device, offload in pinned host memory behind a GPU
    /// cache; auto = offload when the model does not fit, else fused.
    #[arg(help_heading = MOE, long, value_enum, default_value_t = MoeBackend::Auto)]
    pub moe_backend: MoeBackend,

    /// GPU expert slots (default: sized from free VRAM after the KV floor).
    #[arg(help_heading = MOE, long, conflicts_with_all = ["moe_cache_rate", "moe_cache_auto"])]
    pub moe_cache_size: Option<usize>,

    /// GPU expert slots as a fraction of all experts, in (0, 1] (default: see --moe-cache-size).
    #[arg(help_heading = MOE, long, conflicts_with_all = ["moe_cache_size", "moe_cache_auto"])]
    pub moe_cache_rate: Option<f64>,

    /// Size the expert cache from free VRAM after the KV floor (--kv-reserve-tokens).
    #[arg(help_heading = MOE, long, conflicts_with_all = ["moe_cache_size", "moe_cache_rate"])]
    pub moe_cache_auto: bool,

    /// Expert-cache eviction policy (LRU, the only one).
    #[arg(help_heading = MOE, long, value_enum, default_value_t = MoeCachePolicy::Lru)]
    pub moe_cache_policy: MoeCachePolicy,

    /// Turn off the two-buffer MoE prefill copy overlap.
    #[arg(help_heading = MOE, long)]
    pub disable_moe_prefill_overlap: bool,

    /// Prefill: copy the experts the GPU expert cache holds device-to-device into the stream buffers (only the
    /// others cross PCIe); one host sync per streamed forward. The default (FreeToken's opt-in flag is accepted).
    #[arg(help_heading = MOE, long)]
    pub moe_prefill_hit_d2d: bool,

    /// Prefill: stream every expert over PCIe, those the GPU expert cache holds too.
    #[arg(help_heading = MOE, long, conflicts_with = "moe_prefill_hit_d2d")]
    pub disable_moe_prefill_hit_d2d: bool,

    /// How host expert banks are read (FreeToken: serial / parallel O_DIRECT); only auto (the checkpoint
    /// reader's own) is built.
    #[arg(help_heading = MOE, long, value_enum, default_value_t = ExpertLoad::Auto)]
    pub expert_load: ExpertLoad,

    /// CPU expert-executor threads of --moe-backend hybrid / cpu (0 = the physical cores less 4 for the engine).
    #[arg(help_heading = MOE, long, default_value_t = 0)]
    pub moe_cpu_threads: usize,

    /// MoE layers decoded on the CPU expert executor (default: none; not built: refused).
    #[arg(help_heading = MOE, long)]
    pub moe_cpu_layers: Option<String>,

    /// Hybrid backend: most expert misses fetched over PCIe per layer per decode step, the rest computed on the
    /// CPU (-1 = auto: 2 at a one-token step, else at least 3, more by the PCIe and CPU bandwidths measured at
    /// start-up; 0 = never, as --moe-backend cpu).
    #[arg(help_heading = MOE, long, default_value_t = -1, allow_negative_numbers = true)]
    pub moe_hybrid_max_fetch: i64,

    /// Prefix cache: radix (hybrid_radix on Gated DeltaNet models) or naive (none).
    #[arg(help_heading = CACHE, long, value_enum, default_value_t = CacheType::Radix)]
    pub cache_type: CacheType,

    /// Report cached prompt tokens in usage (`prompt_tokens_details.cached_tokens`).
    #[arg(help_heading = CACHE, long)]
    pub enable_cache_report: bool,

    /// Hybrid models (hybrid_radix): recurrent-state snapshot slots per running request (FreeToken's
    /// `linear_state_cache_ratio`), at least 16 in all; 0 keeps no snapshots.
    #[arg(help_heading = CACHE, long, default_value_t = 2.0)]
    pub linear_state_cache_ratio: f64,

    /// Hybrid models: recurrent-state snapshot slots in all (default: --linear-state-cache-ratio x
    /// --max-running-requests, at least 16).
    #[arg(help_heading = CACHE, long)]
    pub num_snapshot_slots: Option<usize>,

    /// Hybrid models: also snapshot the recurrent state right after the tool-call opener token, so a client that
    /// re-renders the call recomputes only the call.
    #[arg(help_heading = CACHE, long)]
    pub enable_special_token_ckpt: bool,

    /// Address the API listens on (bound before the model loads).
    #[arg(help_heading = API, long, default_value = "127.0.0.1")]
    pub host: String,

    /// Port the API listens on.
    #[arg(help_heading = API, long, default_value_t = 1919)]
    pub port: u16,

    /// The names the API serves the model under, comma-separated; the first is the id `/v1/models` lists
    /// (default: the model path's basename; the demo model also answers to `demo`). Requests naming another
    /// model get 404 `model_not_found`.
    #[arg(help_heading = API, long)]
    pub served_model_name: Option<String>,

    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every route but /health (and /metrics
    /// with --metrics-without-api-key) (default: none, no key needed). Also read from FREETOKEN_API_KEY, which
    /// keeps the key out of the process list (the systemd unit's environment file sets it).
    #[arg(help_heading = API, long, env = "FREETOKEN_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Serve `GET /metrics` without --api-key (for a scraper that sends no key); by default it needs the key
    /// like every other route.
    #[arg(help_heading = API, long)]
    pub metrics_without_api_key: bool,

    /// Allowed CORS origins, comma separated ('' disables, '*' allows all).
    #[arg(help_heading = API, long, default_value = "tauri://localhost,http://tauri.localhost,http://localhost:1420")]
    pub cors_origins: String,

    /// Output budget of a request that names none (default: 32768).
    #[arg(help_heading = API, long)]
    pub max_output_tokens: Option<u32>,

    /// Sampling values of a request that names none.
    #[arg(help_heading = API, long, value_enum, default_value_t = SamplingDefaults::Model)]
    pub sampling_defaults: SamplingDefaults,

    /// Tool-call parser: qwen3_coder, qwen, qwen25, hermes, auto (default: chosen from the model), off.
    #[arg(help_heading = API, long)]
    pub tool_call_parser: Option<String>,

    /// Reasoning parser: qwen3, deepseek_r1, auto (default: chosen from the model), off.
    #[arg(help_heading = API, long)]
    pub reasoning_parser: Option<String>,

    /// Requests templated and tokenized at once, on the blocking pool (0 = one per core, 2 to 16).
    #[arg(help_heading = API, long = "num-tokenizer", visible_alias = "tokenizer-count", default_value_t = 0)]
    pub num_tokenizer: usize,

    /// Responses-API responses kept in memory for `GET /v1/responses/{id}` and `previous_response_id`; the least
    /// recently used is forgotten first. 0 stores none.
    #[arg(help_heading = API, long, default_value_t = 1024)]
    pub max_stored_responses: usize,

    /// Largest accepted request body; larger ones get 413.
    #[arg(help_heading = API, long, default_value_t = 8 * 1024 * 1024)]
    pub max_request_body_bytes: usize,

    /// Seconds one step may run before the watchdog declares the engine unhealthy.
    #[arg(help_heading = RELIABILITY, long, default_value_t = 600.0)]
    pub step_timeout: f64,

    /// Seconds a request may take, queued time included, before it is aborted and answered with an error
    /// (408, or an SSE error event); 0 = no limit.
    #[arg(help_heading = RELIABILITY, long, default_value_t = 0.0)]
    pub request_timeout: f64,

    /// Seconds SIGTERM / SIGINT waits for in-flight requests (new ones get 503) before cancelling them.
    #[arg(help_heading = RELIABILITY, long, default_value_t = 30.0)]
    pub shutdown_grace: f64,

    /// Requests waiting for admission before new ones get 429.
    #[arg(help_heading = RELIABILITY, long, default_value_t = 256)]
    pub max_queued_requests: usize,

    /// One "Decode batch" log line every N decode steps.
    #[arg(help_heading = RELIABILITY, long, default_value_t = 40)]
    pub decode_log_interval: usize,

    /// trace, debug, info, warning (warn) or error.
    #[arg(help_heading = RELIABILITY, long, default_value = "info", value_parser = ["trace", "debug", "info", "warning", "warn", "error"])]
    pub log_level: String,
}

impl ServeArgs {
    /// The output budget of a request that names none.
    pub fn max_output_tokens(&self) -> u32 {
        self.max_output_tokens.unwrap_or(DEFAULT_MAX_OUTPUT_TOKENS)
    }

    /// The CORS origins; empty = CORS disabled.
    pub fn cors_origin_list(&self) -> Vec<String> {
        self.cors_origins.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
    }

    /// Cross-flag checks clap cannot express. `Err` is the message (without the `error: ` prefix). The groups
    /// run in this order, and the first failing check is the one reported.
    pub fn validate(&self) -> Result<(), String> {
        self.check_parser_names()?;
        self.check_fractions()?;
        self.check_counts()?;
        self.check_durations()?;
        at_least_one(self.max_request_body_bytes == 0, "--max-request-body-bytes")?;
        self.check_cache_settings()?;
        self.check_names()
    }

    /// Parser names (which one fits the model is resolved once it is loaded: `AppState`).
    fn check_parser_names(&self) -> Result<(), String> {
        crate::text::tool_calls::ToolCallFormat::resolve(self.tool_call_parser.as_deref(), "", None)?;
        crate::text::reasoning::ReasoningFormat::resolve(self.reasoning_parser.as_deref(), "", None)?;
        Ok(())
    }

    /// The flags that are fractions in (0, 1].
    fn check_fractions(&self) -> Result<(), String> {
        let in_unit = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        if !in_unit(self.memory_ratio) {
            return Err(format!("--memory-ratio must be in (0, 1], got {}", self.memory_ratio));
        }
        if let Some(rate) = self.moe_cache_rate {
            if !in_unit(rate) {
                return Err(format!("--moe-cache-rate must be in (0, 1], got {rate}"));
            }
        }
        Ok(())
    }

    /// Sizes and counts that must be positive (`--num-tokens` also a multiple of `--page-size`).
    fn check_counts(&self) -> Result<(), String> {
        at_least_one(self.max_running_requests == 0, "--max-running-requests")?;
        at_least_one(self.max_prefill_length == 0, "--max-prefill-length")?;
        at_least_one(self.page_size == 0, "--page-size")?;
        at_least_one(self.max_seq_len_override == Some(0), "--max-seq-len-override")?;
        at_least_one(self.max_output_tokens == Some(0), "--max-output-tokens")?;
        at_least_one(self.tensor_parallel_size == 0, "--tensor-parallel-size")?;
        at_least_one(self.num_pages == Some(0), "--num-pages")?;
        if let Some(tokens) = self.num_tokens {
            if tokens == 0 || tokens % self.page_size != 0 {
                return Err(format!(
                    "--num-tokens must be a positive multiple of --page-size ({}), got {tokens}",
                    self.page_size
                ));
            }
        }
        at_least_one(self.moe_cache_size == Some(0), "--moe-cache-size")?;
        at_least_one(self.decode_log_interval == 0, "--decode-log-interval")
    }

    /// The timeouts and the shutdown grace, in seconds.
    fn check_durations(&self) -> Result<(), String> {
        if !(self.step_timeout.is_finite() && self.step_timeout > 0.0) {
            return Err(format!("--step-timeout must be a positive number of seconds, got {}", self.step_timeout));
        }
        if !(self.request_timeout.is_finite() && self.request_timeout >= 0.0) {
            return Err(format!(
                "--request-timeout must be 0 (none) or a positive number of seconds, got {}",
                self.request_timeout
            ));
        }
        if !(self.shutdown_grace.is_finite() && self.shutdown_grace >= 0.0) {
            return Err(format!(
                "--shutdown-grace must be a non-negative number of seconds, got {}",
                self.shutdown_grace
            ));
        }
        Ok(())
    }

    /// The recurrent-state snapshot and expert-offload settings.
    fn check_cache_settings(&self) -> Result<(), String> {
        if !self.linear_state_cache_ratio.is_finite() || self.linear_state_cache_ratio < 0.0 {
            return Err(format!("--linear-state-cache-ratio must be >= 0, got {}", self.linear_state_cache_ratio));
        }
        if self.moe_backend == MoeBackend::Fused {
            // Offload settings under a backend that keeps every expert on the device would do nothing.
            let offload_flag = [
                (self.moe_cache_size.is_some(), "--moe-cache-size"),
                (self.moe_cache_rate.is_some(), "--moe-cache-rate"),
                (self.moe_cache_auto, "--moe-cache-auto"),
                (self.disable_moe_prefill_overlap, "--disable-moe-prefill-overlap"),
                (self.moe_prefill_hit_d2d, "--moe-prefill-hit-d2d"),
                (self.disable_moe_prefill_hit_d2d, "--disable-moe-prefill-hit-d2d"),
            ]
            .into_iter()
            .find_map(|(set, flag)| set.then_some(flag));
            if let Some(flag) = offload_flag {
                return Err(format!(
                    "{flag} applies to expert offload, but --moe-backend fused keeps every expert on the device (use offload or auto)"
                ));
            }
        }
        if self.moe_hybrid_max_fetch < -1 {
            return Err(format!("--moe-hybrid-max-fetch must be -1 (auto) or >= 0, got {}", self.moe_hybrid_max_fetch));
        }
        if self.moe_hybrid_max_fetch != -1 && self.moe_backend != MoeBackend::Hybrid {
            return Err(format!(
                "--moe-hybrid-max-fetch applies to --moe-backend hybrid, not {} (cpu fetches none)",
                self.moe_backend.as_str()
            ));
        }
        if self.moe_cpu_threads != 0 && !matches!(self.moe_backend, MoeBackend::Hybrid | MoeBackend::Cpu) {
            return Err(format!(
                "--moe-cpu-threads applies to --moe-backend hybrid or cpu, not {}",
                self.moe_backend.as_str()
            ));
        }
        Ok(())
    }

    /// String flags that must not be empty when given.
    fn check_names(&self) -> Result<(), String> {
        if self.host.trim().is_empty() {
            return Err("--host must not be empty".into());
        }
        if let Some(name) = &self.served_model_name {
            if name.trim().is_empty() {
                return Err("--served-model-name must not be empty".into());
            }
        }
        if let Some(key) = &self.api_key {
            if key.is_empty() {
                return Err("--api-key must not be empty".into());
            }
        }
        Ok(())
    }
}

/// `Err("{flag} must be at least 1")` when `is_zero`.
fn at_least_one(is_zero: bool, flag: &str) -> Result<(), String> {
    if is_zero {
        return Err(format!("{flag} must be at least 1"));
    }
    Ok(())
}

/// The flag values whose feature is not built yet, as a one-line message naming it; `None` when everything
/// asked for exists. This list shrinks as features land: delete a check when its feature ships. The groups
/// run in this order, and the first flag found is the one reported.
pub fn unsupported_feature(args: &ServeArgs) -> Option<String> {
    unsupported_parallelism_or_kernel(args)
        .or_else(|| unsupported_expert_execution(args))
        .or_else(|| unsupported_loading(args))
}

/// Tensor parallelism, attention backends and NVFP4 kernels that are not built.
fn unsupported_parallelism_or_kernel(args: &ServeArgs) -> Option<String> {
    if args.tensor_parallel_size > 1 {
        return Some(format!(
            "--tensor-parallel-size {} is not supported yet: tensor parallelism is not built (use 1)",
            args.tensor_parallel_size
        ));
    }
    if matches!(args.attention_backend, AttentionBackend::Fi | AttentionBackend::Fa | AttentionBackend::Trtllm) {
        let name = args.attention_backend.as_str();
        return Some(format!("--attention-backend {name} is not supported yet: only auto, triton and torch are built"));
    }
    match args.nvfp4_backend {
        Nvfp4Backend::Marlin => {
            return Some(
                "--nvfp4-backend marlin is not supported: it needs vLLM's Marlin FP4 kernels, which are not built (use auto, triton or torch)".into(),
            )
        }
        Nvfp4Backend::Flashinfer => {
            return Some(
                "--nvfp4-backend flashinfer is not supported: it needs FlashInfer's FP4 GEMMs (FP4 tensor cores, Blackwell), which are not built (use auto, triton or torch)".into(),
            )
        }
        Nvfp4Backend::Auto | Nvfp4Backend::Triton | Nvfp4Backend::Torch => {}
    }
    None
}

/// Expert-execution knobs that are not built.
fn unsupported_expert_execution(args: &ServeArgs) -> Option<String> {
    if let Some(layers) = &args.moe_cpu_layers {
        return Some(format!(
            "--moe-cpu-layers {layers} is not supported yet: whole layers are not pinned to the CPU (--moe-backend cpu runs every decode miss there)"
        ));
    }
    None
}

/// Ways of reading or fetching the checkpoint that are not built.
fn unsupported_loading(args: &ServeArgs) -> Option<String> {
    if args.expert_load != ExpertLoad::Auto {
        return Some(format!(
            "--expert-load {} is not supported yet: host expert banks are read one way (the checkpoint reader's; leave it auto)",
            args.expert_load.as_str()
        ));
    }
    if args.model_source != ModelSource::Huggingface {
        return Some(format!(
            "--model-source {} is not supported: nothing is downloaded (--model-path is a local directory or GGUF file)",
            args.model_source.as_str()
        ));
    }
    None
}

/// Parses `argv` (program name first). `Err((message, exit_code))`: print the message (stdout for 0, stderr
/// otherwise) and exit with the code: 0 for `--help`, `--version` and `ft` alone (a person typing `ft` wants the
/// subcommands), 2 for bad flags and values.
pub fn parse_cli(argv: Vec<String>) -> Result<Cli, (String, i32)> {
    let cli = Cli::try_parse_from(argv).map_err(clap_outcome)?;
    match &cli.command {
        Command::Serve(args) => check_serve_args(args)?,
        Command::Quantize(_) => {}
    }
    Ok(cli)
}

/// clap's early exits as `(message, exit code)`: help and version in full, errors in one line.
pub fn clap_outcome(e: clap::Error) -> (String, i32) {
    let text = e.render().to_string().trim_end().to_string();
    match e.kind() {
        clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => (text, 0),
        clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => (text, 0),
        _ => (one_line(&text), e.exit_code()),
    }
}

/// The checks `ft serve` runs on its flags after clap (also `ft-server`'s): cross-flag rules, then features
/// that are not built. `Err` is the one-line message and exit code 2.
pub fn check_serve_args(args: &ServeArgs) -> Result<(), (String, i32)> {
    if let Err(msg) = args.validate() {
        return Err((format!("error: {msg}"), 2));
    }
    if let Some(msg) = unsupported_feature(args) {
        return Err((format!("error: {msg}"), 2));
    }
    Ok(())
}

/// Prints a [`parse_cli`] outcome (stdout for exit code 0, stderr otherwise; the message has no trailing
/// newline) and returns the exit code. A closed pipe (`ft serve --help | head`) is not an error.
pub fn print_outcome(message: &str, code: i32) -> i32 {
    use std::io::Write;
    let _ = if code == 0 { writeln!(std::io::stdout(), "{message}") } else { writeln!(std::io::stderr(), "{message}") };
    code
}

/// `ft --version` / `ft -V`: answered with the long version report (`crate::version`), not clap's one line.
pub fn wants_version(argv: &[String]) -> bool {
    argv.len() == 2 && matches!(argv[1].as_str(), "--version" | "-V")
}

/// clap's multi-line error as one line: the error and its details, without the usage and help hints.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Parses `ft serve ...` and returns the serve arguments (test and embedding convenience).
pub fn parse_serve_args<I: IntoIterator<Item = S>, S: Into<String>>(args: I) -> Result<ServeArgs, (String, i32)> {
    let mut argv = vec!["ft".to_string(), "serve".to_string()];
    argv.extend(args.into_iter().map(Into::into));
    match parse_cli(argv)?.command {
        Command::Serve(a) => Ok(a),
        Command::Quantize(_) => unreachable!("argv starts with serve"),
    }
}

impl Default for ServeArgs {
    /// The defaults of `ft serve` with no flags.
    fn default() -> Self {
        parse_serve_args(Vec::<String>::new()).expect("defaults parse")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(args: &[&str]) -> Result<ServeArgs, (String, i32)> {
        parse_serve_args(args.iter().copied())
    }

    #[test]
    fn launch_line_parses_as_written() {
        let argv = "ft serve --model-path M --max-running-requests 1 --max-seq-len-override 32768 --moe-backend offload --moe-cache-size 1024 --host 0.0.0.0 --port 1920";
        let cli = parse_cli(argv.split(' ').map(String::from).collect()).unwrap();
        let Command::Serve(a) = cli.command else { panic!("serve") };
        assert_eq!(a.model_path.as_deref(), Some("M"));
        assert_eq!(a.max_running_requests, 1);
        assert_eq!(a.max_seq_len_override, Some(32768));
        assert_eq!(a.moe_backend, MoeBackend::Offload);
        assert_eq!(a.moe_cache_size, Some(1024));
        assert_eq!(a.host, "0.0.0.0");
        assert_eq!(a.port, 1920);
    }

    #[test]
    fn defaults() {
        let a = ServeArgs::default();
        assert_eq!(a.model_path, None);
        assert_eq!(a.host, "127.0.0.1");
        assert_eq!(a.port, 1919);
        assert_eq!(a.max_running_requests, 4);
        assert_eq!(a.max_output_tokens(), 32768);
        assert_eq!(a.memory_ratio, 0.9);
        assert_eq!(a.max_prefill_length, 8192);
        assert_eq!(a.page_size, 1);
        assert_eq!(a.decode_log_interval, 40);
        assert_eq!(a.decode_interleave_every, 0);
        assert_eq!(a.tensor_parallel_size, 1);
        assert_eq!(a.step_timeout, 600.0);
        assert_eq!(a.max_queued_requests, 256);
        assert_eq!(a.request_timeout, 0.0);
        assert_eq!(a.shutdown_grace, 30.0);
        assert_eq!(a.max_request_body_bytes, 8 * 1024 * 1024);
        assert_eq!(a.kv_reserve_tokens, 8192);
        assert_eq!(a.gdn_prefill_graph_tokens, 4096);
        assert_eq!(serve(&["--gdn-prefill-graph-tokens", "0"]).unwrap().gdn_prefill_graph_tokens, 0);
        assert_eq!(a.moe_prefill_graph_tokens, 4096);
        assert_eq!(serve(&["--moe-prefill-graph-tokens", "0"]).unwrap().moe_prefill_graph_tokens, 0);
        assert_eq!(a.moe_hybrid_max_fetch, -1);
        assert_eq!(a.cache_type, CacheType::Radix);
        assert_eq!(a.sampling_defaults, SamplingDefaults::Model);
        assert_eq!(a.log_level, "info");
        assert!(a.cache_type == "radix");
        assert_eq!(a.cors_origin_list().len(), 3);
    }

    #[test]
    fn aliases() {
        let a = serve(&[
            "--model",
            "/m/Qwen3-0.6B/",
            "--max-extend-length",
            "4096",
            "--attn",
            "triton",
            "--tp-size",
            "1",
            "--graph",
            "8",
        ])
        .unwrap();
        assert_eq!(a.model_path.as_deref(), Some("/m/Qwen3-0.6B/"));
        assert_eq!(a.max_prefill_length, 4096);
        assert_eq!(a.attention_backend, AttentionBackend::Triton);
        assert_eq!(a.cuda_graph_max_bs, Some(8));
        let a = serve(&["--max-extend-tokens", "2048", "--num-tokens", "1000"]).unwrap();
        assert_eq!(a.max_prefill_length, 2048);
        assert_eq!(a.num_tokens, Some(1000));
        let a = serve(&["--model-path", "x/y", "--served-model-name", "mine", "--log-level", "warn"]).unwrap();
        assert_eq!(a.served_model_name.as_deref(), Some("mine"));
        assert_eq!(a.log_level, "warn");
    }

    #[test]
    fn serializes_for_python() {
        let a = serve(&["--moe-backend", "offload", "--moe-cache-rate", "0.5", "--dtype", "bfloat16"]).unwrap();
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(v["moe_backend"], "offload");
        assert_eq!(v["moe_cache_rate"], 0.5);
        assert_eq!(v["dtype"], "bfloat16");
        assert_eq!(v["max_running_requests"], 4);
        assert_eq!(v["max_prefill_length"], 8192);
        assert!(v["model_path"].is_null());
        assert_eq!(v["log_level"], "info");
        assert_eq!(v["cache_type"], "radix");
    }

    #[test]
    fn bad_values_exit_2() {
        for bad in [
            &["--memory-ratio", "1.5"][..],
            &["--memory-ratio", "0"],
            &["--moe-cache-rate", "2"],
            &["--moe-cache-size", "10", "--moe-cache-auto"],
            &["--moe-cache-size", "10", "--moe-cache-rate", "0.5"],
            &["--num-pages", "10", "--num-tokens", "10"],
            &["--page-size", "16", "--num-tokens", "100"],
            &["--dtype", "int8"],
            &["--moe-backend", "magic"],
            &["--port", "70000"],
            &["--max-running-requests", "0"],
            &["--cache-type", "hybrid"],
            &["--step-timeout", "0"],
            &["--request-timeout", "-1"],
            &["--shutdown-grace", "inf"],
            &["--no-such-flag"],
        ] {
            let err = serve(bad).unwrap_err();
            assert_eq!(err.1, 2, "{bad:?}: {}", err.0);
            assert!(err.0.starts_with("error:"), "{bad:?}: {}", err.0);
        }
        for bad in [
            &["--memory-ratio", "1.5"][..],
            &["--dtype", "int8"],
            &["--num-pages", "1", "--num-tokens", "1"],
            &["--bogus"],
        ] {
            let (msg, _) = serve(bad).unwrap_err();
            assert_eq!(msg.lines().count(), 1, "{msg}");
        }
        let (msg, _) = serve(&["--dtype", "int8"]).unwrap_err();
        assert!(msg.contains("possible values: auto, float16, bfloat16, float32"), "{msg}");
    }

    #[test]
    fn hybrid_and_cpu_backends_take_their_knobs_and_nothing_else_does() {
        let a = serve(&["--moe-backend", "hybrid", "--moe-hybrid-max-fetch", "3", "--moe-cpu-threads", "8"]).unwrap();
        assert_eq!((a.moe_backend.as_str(), a.moe_hybrid_max_fetch, a.moe_cpu_threads), ("hybrid".to_string(), 3, 8));
        let a = serve(&["--moe-backend", "cpu", "--moe-cpu-threads", "4", "--moe-cache-size", "64"]).unwrap();
        assert_eq!((a.moe_backend.as_str(), a.moe_cpu_threads), ("cpu".to_string(), 4));
        for (flags, needle) in [
            (&["--moe-backend", "offload", "--moe-hybrid-max-fetch", "2"][..], "applies to --moe-backend hybrid"),
            (&["--moe-backend", "cpu", "--moe-hybrid-max-fetch", "2"], "cpu fetches none"),
            (&["--moe-backend", "offload", "--moe-cpu-threads", "8"], "applies to --moe-backend hybrid or cpu"),
            (&["--moe-backend", "hybrid", "--moe-hybrid-max-fetch", "-2"], "-1 (auto) or >= 0"),
        ] {
            let (msg, code) = serve(flags).unwrap_err();
            assert_eq!(code, 2, "{msg}");
            assert!(msg.contains(needle), "{msg}");
        }
    }

    #[test]
    fn unbuilt_features_are_rejected_by_name() {
        for (flags, needle) in [
            (&["--tp-size", "2"][..], "--tensor-parallel-size"),
            (&["--attn", "fi"], "--attention-backend fi"),
            (&["--attention-backend", "trtllm"], "--attention-backend trtllm"),
            (&["--attention-backend", "fa"], "--attention-backend fa"),
            (&["--nvfp4-backend", "marlin"], "--nvfp4-backend marlin"),
            (&["--nvfp4-backend", "flashinfer"], "--nvfp4-backend flashinfer"),
            (&["--moe-cpu-layers", "3,7"], "--moe-cpu-layers 3,7"),
            (&["--expert-load", "parallel"], "--expert-load parallel"),
            (&["--model-source", "modelscope"], "--model-source modelscope"),
        ] {
            let (msg, code) = serve(flags).unwrap_err();
            assert_eq!(code, 2);
            assert!(msg.contains(needle), "{msg}");
            assert!(msg.contains("not supported"), "{msg}");
            assert_eq!(msg.lines().count(), 1);
        }
        // Accepted values of the same flags (their defaults, spelled out; NVFP4 kernels that exist).
        for backend in ["triton", "torch"] {
            assert_eq!(serve(&["--nvfp4-backend", backend]).unwrap().nvfp4_backend.as_str(), backend);
        }
        serve(&[
            "--attn",
            "triton",
            "--nvfp4-backend",
            "auto",
            "--moe-backend",
            "fused",
            "--tp-size",
            "1",
            "--moe-cpu-threads",
            "0",
            "--moe-hybrid-max-fetch",
            "-1",
            "--expert-load",
            "auto",
            "--model-source",
            "huggingface",
            "--moe-cache-policy",
            "lru",
        ])
        .unwrap();
    }

    #[test]
    fn offload_flags_under_fused_are_refused() {
        for flags in [
            &["--moe-backend", "fused", "--moe-cache-size", "64"][..],
            &["--moe-backend", "fused", "--moe-cache-rate", "0.5"],
            &["--moe-backend", "fused", "--moe-cache-auto"],
            &["--moe-backend", "fused", "--disable-moe-prefill-overlap"],
            &["--moe-backend", "fused", "--moe-prefill-hit-d2d"],
            &["--moe-backend", "fused", "--disable-moe-prefill-hit-d2d"],
        ] {
            let (msg, code) = serve(flags).unwrap_err();
            assert_eq!(code, 2);
            assert!(msg.contains(flags[2]) && msg.contains("--moe-backend fused"), "{msg}");
            assert_eq!(msg.lines().count(), 1);
        }
        for backend in ["offload", "auto"] {
            serve(&["--moe-backend", backend, "--moe-cache-size", "64", "--disable-moe-prefill-overlap"]).unwrap();
            serve(&["--moe-backend", backend, "--moe-prefill-hit-d2d"]).unwrap();
            let off = serve(&["--moe-backend", backend, "--disable-moe-prefill-hit-d2d"]).unwrap();
            assert!(off.disable_moe_prefill_hit_d2d && !off.moe_prefill_hit_d2d);
        }
        // on by default: neither flag set; both at once is a contradiction
        let a = serve(&["--moe-backend", "offload"]).unwrap();
        assert!(!a.moe_prefill_hit_d2d && !a.disable_moe_prefill_hit_d2d);
        let (msg, code) = serve(&["--moe-prefill-hit-d2d", "--disable-moe-prefill-hit-d2d"]).unwrap_err();
        assert_eq!(code, 2);
        assert!(msg.contains("cannot be used with"), "{msg}");
    }

    #[test]
    fn compatibility_flags_that_work() {
        let a = serve(&["--num-tokenizer", "3", "--disable-pynccl", "--metrics-without-api-key"]).unwrap();
        assert_eq!(a.num_tokenizer, 3);
        assert!(a.disable_pynccl && a.metrics_without_api_key);
        assert_eq!(serve(&["--tokenizer-count", "2"]).unwrap().num_tokenizer, 2);
        let d = ServeArgs::default();
        assert_eq!((d.num_tokenizer, d.disable_pynccl, d.metrics_without_api_key), (0, false, false));
        // --help says what --model-path takes, and promises no download.
        let (help, _) = parse_cli(vec!["ft".into(), "serve".into(), "--help".into()]).unwrap_err();
        assert!(help.contains("Nothing is downloaded"), "{help}");
        assert!(!help.contains("HF repo id or"), "{help}");
    }

    #[test]
    fn serve_help_is_grouped_by_topic_with_every_default() {
        use clap::CommandFactory;
        let topics = [MODEL, MEMORY, MOE, CACHE, API, RELIABILITY];
        let cli = Cli::command();
        let serve = cli.find_subcommand("serve").unwrap();
        for arg in serve.get_arguments() {
            let name = arg.get_long().unwrap_or_default();
            assert!(arg.get_help_heading().is_some_and(|h| topics.contains(&h)), "--{name} has no topic");
            let help = arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
            // A flag that takes a value shows its default: clap's `[default: ...]`, or its text says it.
            if arg.get_action().takes_values() && arg.get_default_values().is_empty() {
                assert!(help.contains("default"), "--{name}: no default shown in {help:?}");
            }
        }
        let (help, code) = parse_cli(vec!["ft".into(), "serve".into(), "--help".into()]).unwrap_err();
        assert_eq!(code, 0);
        let at: Vec<usize> = topics.iter().map(|t| help.find(&format!("\n{t}:\n")).expect(t)).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "topics out of order: {at:?}");
        assert!(help.contains("[default: 1919]") && help.contains("[default: 0.9]"), "{help}");
    }

    #[test]
    fn help_and_version_exit_0() {
        let (msg, code) = parse_cli(vec!["ft".into(), "--version".into()]).unwrap_err();
        assert_eq!(code, 0);
        assert_eq!(msg.trim(), format!("ft {}", env!("CARGO_PKG_VERSION")));
        let (msg, code) = parse_cli(vec!["ft".into(), "serve".into(), "--help".into()]).unwrap_err();
        assert_eq!(code, 0);
        assert!(msg.contains("--max-running-requests"));
        // `ft` alone lists the subcommands, like `ft --help`, and is not an error.
        let (msg, code) = parse_cli(vec!["ft".into()]).unwrap_err();
        assert_eq!(code, 0);
        assert!(msg.contains("serve") && msg.contains("Usage:"), "{msg}");
        assert!(!msg.ends_with('\n'), "printed with println: no blank line after");
        assert!(wants_version(&["ft".into(), "-V".into()]) && !wants_version(&["ft".into(), "serve".into()]));
    }

    #[test]
    fn output_parser_names_are_checked() {
        let (msg, code) = serve(&["--tool-call-parser", "nonsense_xyz"]).unwrap_err();
        assert_eq!(code, 2);
        assert_eq!(
            msg,
            "error: unknown --tool-call-parser \"nonsense_xyz\" (valid: qwen3_coder, qwen, qwen25, hermes, auto, off)"
        );
        let (msg, code) = serve(&["--reasoning-parser", "glm"]).unwrap_err();
        assert_eq!(code, 2);
        assert_eq!(msg, "error: unknown --reasoning-parser \"glm\" (valid: qwen3, deepseek_r1, auto, off)");
        for flags in [
            &["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3"][..],
            &["--tool-call-parser", "auto", "--reasoning-parser", "auto"],
            &["--tool-call-parser", "off", "--reasoning-parser", "off"],
            &["--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_r1"],
        ] {
            serve(flags).unwrap();
        }
    }
    #[test]
    fn quantize_takes_the_python_quantizers_flags() {
        let argv = "ft quantize --model-path IN --output OUT --scheme mixed-qwen3.6";
        let Command::Quantize(q) = parse_cli(argv.split(' ').map(String::from).collect()).unwrap().command else {
            panic!("quantize")
        };
        assert_eq!(q.scheme, QuantScheme::MixedQwen36);
        let want = "--model-path IN --out OUT --scheme mixed-qwen3.6 --calib-tokens 512 --device auto";
        assert_eq!(q.python_argv().join(" "), want);
        let argv = "ft quantize --model IN --out OUT --scheme w4a16-nvfp4 --calib-tokens 64 --device cpu";
        let Command::Quantize(q) = parse_cli(argv.split(' ').map(String::from).collect()).unwrap().command else {
            panic!("quantize")
        };
        assert_eq!(q.python_argv()[5], "w4a16-nvfp4");
        assert_eq!(&q.python_argv()[6..], ["--calib-tokens", "64", "--device", "cpu"]);
        let (help, code) = parse_cli(vec!["ft".into(), "quantize".into(), "--help".into()]).unwrap_err();
        assert_eq!(code, 0);
        for needle in ["--model-path", "--output", "--scheme", "w4a16-nvfp4", "mixed-qwen3.6", "[default: 512]"] {
            assert!(help.contains(needle), "{needle}: {help}");
        }
        let (msg, code) =
            parse_cli(vec!["ft".into(), "quantize".into(), "--scheme".into(), "int4".into()]).unwrap_err();
        assert_eq!(code, 2);
        assert_eq!(msg.lines().count(), 1, "{msg}");
        let (msg, code) = parse_cli(vec!["ft".into()]).unwrap_err();
        assert!(code == 0 && msg.contains("quantize"), "{msg}");
    }
}
