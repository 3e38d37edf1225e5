//! The metrics `GET /metrics` serves, in Prometheus' text format (version 0.0.4, what vLLM and SGLang
//! serve and every scraper reads).
//!
//! Names follow vLLM's (`vllm:time_to_first_token_seconds` is `freetoken_time_to_first_token_seconds`
//! here), so dashboards and alerts written for vLLM carry over with the prefix changed; every series carries
//! `model_name` as vLLM's do. Counters end in `_total`, times are in seconds, usage gauges are fractions.
//!
//! | name | type | fed by |
//! |---|---|---|
//! | `freetoken_requests_total{outcome}` | counter | routes: [`RequestTimer::finish`] (stop, length, abort, timeout, error, rejected) |
//! | `freetoken_time_to_first_token_seconds` | histogram | [`RequestTimer::token`] |
//! | `freetoken_inter_token_latency_seconds` | histogram | [`RequestTimer::token`] |
//! | `freetoken_e2e_request_latency_seconds` | histogram | [`RequestTimer::finish`] |
//! | `freetoken_request_queue_time_seconds` | histogram | [`RequestTimer::started`] |
//! | `freetoken_request_prompt_tokens`, `_generation_tokens` | histogram | [`RequestTimer::finish`] |
//! | `freetoken_prompt_tokens_total`, `freetoken_generation_tokens_total` | counter | [`RequestTimer`] |
//! | `freetoken_prefix_cache_queries_total`, `_hits_total` | counter (tokens) | [`RequestTimer::started`] |
//! | `freetoken_num_requests_running`, `_waiting` | gauge | engine: [`Metrics::set_gauges`] |
//! | `freetoken_kv_cache_usage_perc`, `_used_tokens`, `_capacity_tokens` | gauge | [`Metrics::set_gauges`] |
//! | `freetoken_state_slot_usage_perc` (recurrent-state models only) | gauge | [`Metrics::set_gauges`] |
//! | `freetoken_expert_cache_hits_total`, `_misses_total`, `_host_misses_total` | counter | engine: [`Metrics::set_expert_cache_totals`] |
//! | `freetoken_step_time_seconds{kind}` | histogram | engine: [`Metrics::observe_step`] |
//! | `freetoken_engine_health{state}` | gauge (1 for the current state) | [`Metrics::set_health`] (the watchdog's verdict shows as `unhealthy`) |
//!
//! Written by hand rather than through a metrics crate: the set is fixed and small, the format is a few
//! lines of text, and a registry owned by the server (not a process-global recorder, as the `metrics`
//! crate's exporter needs) keeps tests that run many servers in one process apart. Writers take a
//! per-metric atomic or a short lock (a histogram's buckets, so a scrape never sees them disagree with
//! their count); nothing is held while rendering more than one metric.

use crate::backend::HealthState;
use ft_core::step::StepKind;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `Content-Type` of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How a request ended, as `freetoken_requests_total{outcome}` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// A stop token or stop string (tool calls included).
    Stop,
    /// `max_tokens` or the context ran out.
    Length,
    /// The client went away, or the server cancelled it (shutdown).
    Abort,
    /// `--request-timeout` (408).
    Timeout,
    /// Failed in the engine (a step's error, a dead or stalled engine: 5xx).
    Error,
    /// Refused before it was queued (invalid, too long, queue full, not serving: 4xx/503).
    Rejected,
}

impl RequestOutcome {
    const ALL: [RequestOutcome; 6] = [
        RequestOutcome::Stop,
        RequestOutcome::Length,
        RequestOutcome::Abort,
        RequestOutcome::Timeout,
        RequestOutcome::Error,
        RequestOutcome::Rejected,
    ];

    pub fn label(self) -> &'static str {
        match self {
            RequestOutcome::Stop => "stop",
            RequestOutcome::Length => "length",
            RequestOutcome::Abort => "abort",
            RequestOutcome::Timeout => "timeout",
            RequestOutcome::Error => "error",
            RequestOutcome::Rejected => "rejected",
        }
    }

    /// From the engine's finish reason.
    pub fn from_finish(reason: ft_core::request::FinishReason) -> Self {
        match reason {
            ft_core::request::FinishReason::Stop => RequestOutcome::Stop,
            ft_core::request::FinishReason::Length => RequestOutcome::Length,
            ft_core::request::FinishReason::Abort => RequestOutcome::Abort,
        }
    }
}

/// Engine-wide levels, published by the engine after each step (`/v1/stats` has the same numbers).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineGauges {
    pub running_requests: u64,
    pub queued_requests: u64,
    pub kv_used_tokens: u64,
    pub kv_capacity_tokens: u64,
    /// Recurrent-state slots `(used, total)`, for models that have them (Gated DeltaNet).
    pub state_slots: Option<(u64, u64)>,
}

// Bucket bounds, in seconds or tokens. vLLM's where they fit; finer at the low end for latencies a
// resident decode step reaches (a few milliseconds per token).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 10.0, 20.0, 40.0, 80.0,
];
const REQUEST_TIME_BUCKETS: &[f64] = &[
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];
const STEP_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
    200000.0, 500000.0, 1000000.0,
];

const STEP_KINDS: [(StepKind, &str); 3] =
    [(StepKind::Prefill, "prefill"), (StepKind::Decode, "decode"), (StepKind::Mixed, "mixed")];

struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistogramData>,
}

#[derive(Clone)]
struct HistogramData {
    /// Per bucket (not cumulative); the last is above every bound.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]));
        Histogram { bounds, inner: Mutex::new(HistogramData { counts: vec![0; bounds.len() + 1], sum: 0.0 }) }
    }

    fn observe(&self, v: f64) {
        if !v.is_finite() || v < 0.0 {
            return;
        }
        // Bucket `le` counts v <= bound.
        let i = self.bounds.partition_point(|b| *b < v);
        let mut d = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        d.counts[i] += 1;
        d.sum += v;
    }

    fn snapshot(&self) -> HistogramData {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The server's metrics; one per server, shared behind an `Arc`.
pub struct Metrics {
    model_name: String,
    requests: [AtomicU64; 6],
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue_time: Histogram,
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    prefix_cache_queries: AtomicU64,
    prefix_cache_hits: AtomicU64,
    expert_cache_hits: AtomicU64,
    expert_cache_misses: AtomicU64,
    expert_cache_host_misses: AtomicU64,
    steps: [Histogram; 3],
    gauges: Mutex<EngineGauges>,
    health: Mutex<HealthState>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("model_name", &self.model_name).finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        Metrics {
            model_name: model_name.to_string(),
            requests: Default::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(REQUEST_TIME_BUCKETS),
            queue_time: Histogram::new(REQUEST_TIME_BUCKETS),
            request_prompt_tokens: Histogram::new(TOKEN_BUCKETS),
            request_generation_tokens: Histogram::new(TOKEN_BUCKETS),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            expert_cache_hits: AtomicU64::new(0),
            expert_cache_misses: AtomicU64::new(0),
            expert_cache_host_misses: AtomicU64::new(0),
            steps: [Histogram::new(STEP_BUCKETS), Histogram::new(STEP_BUCKETS), Histogram::new(STEP_BUCKETS)],
            gauges: Mutex::new(EngineGauges::default()),
            health: Mutex::new(HealthState::Loading),
        }
    }

    pub fn inc_request(&self, outcome: RequestOutcome) {
        let i = RequestOutcome::ALL.iter().position(|o| *o == outcome).unwrap_or(0);
        self.requests[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    pub fn observe_inter_token(&self, seconds: f64) {
        self.itl.observe(seconds);
    }

    pub fn observe_e2e(&self, seconds: f64) {
        self.e2e.observe(seconds);
    }

    pub fn observe_queue_time(&self, seconds: f64) {
        self.queue_time.observe(seconds);
    }

    /// One finished request's sizes (the per-request histograms; the `_total` counters move as tokens go).
    pub fn observe_request_tokens(&self, prompt: u64, generated: u64) {
        self.request_prompt_tokens.observe(prompt as f64);
        self.request_generation_tokens.observe(generated as f64);
    }

    pub fn add_prompt_tokens(&self, n: u64) {
        self.prompt_tokens.fetch_add(n, Ordering::Relaxed);
    }

    pub fn add_generation_tokens(&self, n: u64) {
        self.generation_tokens.fetch_add(n, Ordering::Relaxed);
    }

    /// A prompt looked up in the prefix cache: `queried` tokens, `hit` of them found.
    pub fn add_prefix_cache(&self, queried: u64, hit: u64) {
        self.prefix_cache_queries.fetch_add(queried, Ordering::Relaxed);
        self.prefix_cache_hits.fetch_add(hit.min(queried), Ordering::Relaxed);
    }

    /// The expert cache's running totals, as the engine counts them (a counter never goes back, so a
    /// smaller value, e.g. after a reset, is ignored).
    pub fn set_expert_cache_totals(&self, hits: u64, misses: u64, host_misses: u64) {
        self.expert_cache_hits.fetch_max(hits, Ordering::Relaxed);
        self.expert_cache_misses.fetch_max(misses, Ordering::Relaxed);
        self.expert_cache_host_misses.fetch_max(host_misses, Ordering::Relaxed);
    }

    /// One engine step's wall time.
    pub fn observe_step(&self, kind: StepKind, seconds: f64) {
        let i = STEP_KINDS.iter().position(|(k, _)| *k == kind).unwrap_or(0);
        self.steps[i].observe(seconds);
    }

    pub fn set_gauges(&self, gauges: EngineGauges) {
        *self.gauges.lock().unwrap_or_else(|e| e.into_inner()) = gauges;
    }

    pub fn set_health(&self, health: &HealthState) {
        *self.health.lock().unwrap_or_else(|e| e.into_inner()) = health.clone();
    }

    /// Everything, in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut w = Writer { out: String::with_capacity(16 * 1024), model: escape_label(&self.model_name) };
        self.render_counters(&mut w);
        self.render_histograms(&mut w);
        self.render_gauges(&mut w);
        self.render_health(&mut w);
        w.out
    }

    /// Requests by outcome, then the token and cache counters.
    fn render_counters(&self, w: &mut Writer) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        w.family(
            "freetoken_requests_total",
            "counter",
            "Requests ended, by outcome (stop, length, abort, timeout, error, rejected).",
        );
        for (o, n) in RequestOutcome::ALL.iter().zip(&self.requests) {
            w.sample("freetoken_requests_total", &[("outcome", o.label())], load(n));
        }
        let counters = [
            ("freetoken_prompt_tokens_total", "Prompt tokens of the requests started.", &self.prompt_tokens),
            ("freetoken_generation_tokens_total", "Tokens generated.", &self.generation_tokens),
            (
                "freetoken_prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
                &self.prefix_cache_queries,
            ),
            ("freetoken_prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", &self.prefix_cache_hits),
            (
                "freetoken_expert_cache_hits_total",
                "Routed-expert lookups served from the GPU expert cache.",
                &self.expert_cache_hits,
            ),
            (
                "freetoken_expert_cache_misses_total",
                "Routed-expert lookups read from host memory.",
                &self.expert_cache_misses,
            ),
            (
                "freetoken_expert_cache_host_misses_total",
                "Of the misses, those computed on the host CPU (--moe-backend hybrid / cpu).",
                &self.expert_cache_host_misses,
            ),
        ];
        for (name, help, value) in counters {
            w.counter(name, help, load(value));
        }
    }

    /// The per-request latency and size histograms, then step time by kind.
    fn render_histograms(&self, w: &mut Writer) {
        let histograms = [
            ("freetoken_time_to_first_token_seconds", "Time from a request's arrival to its first token.", &self.ttft),
            ("freetoken_inter_token_latency_seconds", "Time between consecutive tokens of a request.", &self.itl),
            ("freetoken_e2e_request_latency_seconds", "Time from a request's arrival to its end.", &self.e2e),
            (
                "freetoken_request_queue_time_seconds",
                "Time from a request's arrival to its admission.",
                &self.queue_time,
            ),
            ("freetoken_request_prompt_tokens", "Prompt tokens per finished request.", &self.request_prompt_tokens),
            (
                "freetoken_request_generation_tokens",
                "Generated tokens per finished request.",
                &self.request_generation_tokens,
            ),
        ];
        for (name, help, h) in histograms {
            w.histogram(name, help, &[], h);
        }
        w.family(
            "freetoken_step_time_seconds",
            "histogram",
            "Wall time of one engine step, by kind (prefill, decode, mixed).",
        );
        for ((_, kind), h) in STEP_KINDS.iter().zip(&self.steps) {
            w.histogram_samples("freetoken_step_time_seconds", &[("kind", kind)], h);
        }
    }

    /// The engine's levels as last published ([`Metrics::set_gauges`]).
    fn render_gauges(&self, w: &mut Writer) {
        let g = self.gauges.lock().unwrap_or_else(|e| e.into_inner()).clone();
        w.gauge("freetoken_num_requests_running", "Requests in the running batch.", g.running_requests as f64);
        w.gauge("freetoken_num_requests_waiting", "Requests queued for admission.", g.queued_requests as f64);
        let kv_usage =
            if g.kv_capacity_tokens > 0 { g.kv_used_tokens as f64 / g.kv_capacity_tokens as f64 } else { 0.0 };
        w.gauge("freetoken_kv_cache_usage_perc", "Fraction of the KV cache in use (0 to 1).", kv_usage);
        w.gauge("freetoken_kv_cache_used_tokens", "KV cache tokens in use.", g.kv_used_tokens as f64);
        w.gauge("freetoken_kv_cache_capacity_tokens", "KV cache capacity in tokens.", g.kv_capacity_tokens as f64);
        if let Some((used, total)) = g.state_slots {
            let usage = if total > 0 { used as f64 / total as f64 } else { 0.0 };
            w.gauge("freetoken_state_slot_usage_perc", "Fraction of the recurrent-state slots in use (0 to 1).", usage);
        }
    }

    /// One series per health state, 1 for the current one (so a dashboard can plot every state).
    fn render_health(&self, w: &mut Writer) {
        let health = self.health.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let current = match health {
            HealthState::Loading => "loading",
            HealthState::Serving => "serving",
            HealthState::Unhealthy(_) => "unhealthy",
            HealthState::ShuttingDown => "shutting_down",
        };
        w.family(
            "freetoken_engine_health",
            "gauge",
            "1 for the engine's current state (unhealthy: a step overran --step-timeout or the worker died).",
        );
        for state in ["loading", "serving", "unhealthy", "shutting_down"] {
            w.sample("freetoken_engine_health", &[("state", state)], if state == current { 1.0 } else { 0.0 });
        }
    }
}

/// Text output with the shared `model_name` label.
struct Writer {
    out: String,
    /// Escaped already.
    model: String,
}

impl Writer {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        let _ = write!(self.out, "{name}{{model_name=\"{}\"", self.model);
        for (k, v) in labels {
            let _ = write!(self.out, ",{k}=\"{}\"", escape_label(v));
        }
        let _ = writeln!(self.out, "}} {}", format_value(value));
    }

    fn counter(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, "counter", help);
        self.sample(name, &[], value);
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, "gauge", help);
        self.sample(name, &[], value);
    }

    fn histogram(&mut self, name: &str, help: &str, labels: &[(&str, &str)], h: &Histogram) {
        self.family(name, "histogram", help);
        self.histogram_samples(name, labels, h);
    }

    fn histogram_samples(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) {
        let d = h.snapshot();
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (i, n) in d.counts.iter().enumerate() {
            cumulative += n;
            let le = h.bounds.get(i).map_or_else(|| "+Inf".to_string(), |b| format_value(*b));
            let mut l = labels.to_vec();
            l.push(("le", &le));
            self.sample(&bucket, &l, cumulative as f64);
        }
        self.sample(&format!("{name}_sum"), labels, d.sum);
        self.sample(&format!("{name}_count"), labels, cumulative as f64);
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A sample value as Prometheus (and Python's client) writes it: `1.0`, `0.25`, `1e-07` style, `+Inf`.
fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v:?}")
    }
}

/// One request's timings, from its arrival to its end. Routes make one per request and report its events;
/// dropped without [`RequestTimer::finish`] (the client went away and the response future was dropped), it
/// counts the request as aborted, so no request goes uncounted.
pub struct RequestTimer {
    metrics: Arc<Metrics>,
    arrived: Instant,
    last_token: Option<Instant>,
    prompt_tokens: u64,
    generated: u64,
    done: bool,
}

impl RequestTimer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self::arrived_at(metrics, Instant::now())
    }

    pub fn arrived_at(metrics: Arc<Metrics>, arrived: Instant) -> Self {
        RequestTimer { metrics, arrived, last_token: None, prompt_tokens: 0, generated: 0, done: false }
    }

    /// The engine admitted the prompt (`RequestEvent::Started`).
    pub fn started(&mut self, prompt_tokens: u32, cached_tokens: u32) {
        self.started_at(prompt_tokens, cached_tokens, Instant::now());
    }

    pub fn started_at(&mut self, prompt_tokens: u32, cached_tokens: u32, now: Instant) {
        self.prompt_tokens = prompt_tokens as u64;
        self.metrics.observe_queue_time(secs(now.saturating_duration_since(self.arrived)));
        self.metrics.add_prompt_tokens(prompt_tokens as u64);
        self.metrics.add_prefix_cache(prompt_tokens as u64, cached_tokens as u64);
    }

    /// One generated token (`RequestEvent::Token`).
    pub fn token(&mut self) {
        self.token_at(Instant::now());
    }

    pub fn token_at(&mut self, now: Instant) {
        match self.last_token {
            None => self.metrics.observe_ttft(secs(now.saturating_duration_since(self.arrived))),
            Some(prev) => self.metrics.observe_inter_token(secs(now.saturating_duration_since(prev))),
        }
        self.last_token = Some(now);
        self.generated += 1;
        self.metrics.add_generation_tokens(1);
    }

    /// The request ended.
    pub fn finish(mut self, outcome: RequestOutcome) {
        self.finish_at(outcome, Instant::now());
    }

    pub fn finish_at(&mut self, outcome: RequestOutcome, now: Instant) {
        if self.done {
            return;
        }
        self.done = true;
        self.metrics.inc_request(outcome);
        if outcome != RequestOutcome::Rejected {
            self.metrics.observe_e2e(secs(now.saturating_duration_since(self.arrived)));
            self.metrics.observe_request_tokens(self.prompt_tokens, self.generated);
        }
    }
}

impl Drop for RequestTimer {
    fn drop(&mut self) {
        self.finish_at(RequestOutcome::Abort, Instant::now());
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    /// One parsed sample: name, labels, value.
    type Sample = (String, Vec<(String, String)>, f64);

    /// A strict reader of the text format: HELP and TYPE before a family's samples, names and label
    /// syntax, escapes, values; every sample belongs to the family declared last. Returns the samples and
    /// each family's type.
    fn parse(text: &str) -> (Vec<Sample>, HashMap<String, String>) {
        let name_ok = |n: &str| {
            let mut cs = n.chars();
            cs.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
                && cs.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        };
        let mut types = HashMap::new();
        let mut helped = HashSet::new();
        let mut samples = Vec::new();
        let mut family: Option<(String, String)> = None;
        assert!(text.ends_with('\n'));
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, _) = rest.split_once(' ').unwrap();
                assert!(name_ok(name) && helped.insert(name.to_string()), "{line}");
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(helped.contains(name), "TYPE before HELP: {line}");
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
                assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "family declared twice: {line}");
                family = Some((name.to_string(), kind.to_string()));
                continue;
            }
            assert!(!line.starts_with('#') && !line.is_empty(), "{line:?}");
            let brace = line.find('{').unwrap();
            let name = &line[..brace];
            assert!(name_ok(name), "{line}");
            let (labels, used) = parse_labels(&line[brace + 1..]);
            for (k, _) in &labels {
                assert!(name_ok(k), "{line}");
            }
            let end = brace + used;
            let value_text = line[end + 1..].strip_prefix(' ').unwrap();
            let value: f64 = match value_text {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                "NaN" => f64::NAN,
                v => v.parse().unwrap_or_else(|_| panic!("value {v:?} in {line}")),
            };
            let (fname, kind) = family.clone().expect("sample before any TYPE");
            let belongs = match kind.as_str() {
                "histogram" => [format!("{fname}_bucket"), format!("{fname}_sum"), format!("{fname}_count")]
                    .contains(&name.to_string()),
                _ => name == fname,
            };
            assert!(belongs, "{name} is not in family {fname}");
            samples.push((name.to_string(), labels, value));
        }
        (samples, types)
    }

    /// `k="v",...}` (after the `{`): the labels, and the bytes up to and including the `}`.
    fn parse_labels(s: &str) -> (Vec<(String, String)>, usize) {
        let mut labels = Vec::new();
        let mut it = s.char_indices().peekable();
        loop {
            if let Some(&(i, '}')) = it.peek() {
                return (labels, i + 1);
            }
            let mut key = String::new();
            loop {
                match it.next().expect("unterminated label").1 {
                    '=' => break,
                    c => key.push(c),
                }
            }
            assert_eq!(it.next().map(|(_, c)| c), Some('"'), "{s}");
            let mut value = String::new();
            loop {
                match it.next().expect("unterminated value").1 {
                    '"' => break,
                    '\\' => match it.next().unwrap().1 {
                        '\\' => value.push('\\'),
                        '"' => value.push('"'),
                        'n' => value.push('\n'),
                        other => panic!("bad escape \\{other} in {s}"),
                    },
                    c => value.push(c),
                }
            }
            labels.push((key, value));
            match it.peek() {
                Some(&(_, ',')) => {
                    it.next();
                }
                Some(&(_, '}')) => {}
                other => panic!("unexpected {other:?} in {s}"),
            }
        }
    }

    fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
        let found: Vec<_> = samples
            .iter()
            .filter(|(n, l, _)| n == name && labels.iter().all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v)))
            .collect();
        assert_eq!(found.len(), 1, "{name} {labels:?}: {found:?}");
        found[0].2
    }

    #[test]
    fn renders_valid_text_with_every_family() {
        let m = Metrics::new("demo");
        let (samples, types) = parse(&m.render());
        for (name, kind) in [
            ("freetoken_requests_total", "counter"),
            ("freetoken_prompt_tokens_total", "counter"),
            ("freetoken_generation_tokens_total", "counter"),
            ("freetoken_prefix_cache_hits_total", "counter"),
            ("freetoken_expert_cache_misses_total", "counter"),
            ("freetoken_time_to_first_token_seconds", "histogram"),
            ("freetoken_inter_token_latency_seconds", "histogram"),
            ("freetoken_e2e_request_latency_seconds", "histogram"),
            ("freetoken_step_time_seconds", "histogram"),
            ("freetoken_num_requests_running", "gauge"),
            ("freetoken_num_requests_waiting", "gauge"),
            ("freetoken_kv_cache_usage_perc", "gauge"),
            ("freetoken_engine_health", "gauge"),
        ] {
            assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
        }
        // Every outcome is there from the start (at 0), every series carries model_name, no series twice.
        for o in RequestOutcome::ALL {
            assert_eq!(value(&samples, "freetoken_requests_total", &[("outcome", o.label())]), 0.0);
        }
        let mut seen = HashSet::new();
        for (name, labels, _) in &samples {
            assert!(name.starts_with("freetoken_"));
            assert_eq!(labels[0], ("model_name".to_string(), "demo".to_string()));
            assert!(seen.insert(format!("{name}{labels:?}")), "duplicate {name} {labels:?}");
        }
        // No state-slot gauge for a model without recurrent state.
        assert!(!types.contains_key("freetoken_state_slot_usage_perc"));
        assert_eq!(value(&samples, "freetoken_engine_health", &[("state", "loading")]), 1.0);
    }

    #[test]
    fn histograms_are_cumulative_and_counted() {
        let m = Metrics::new("m");
        for v in [0.0005, 0.001, 0.003, 0.2, 7.0, 1e6, -1.0, f64::NAN] {
            m.observe_ttft(v);
        }
        let (samples, _) = parse(&m.render());
        let buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|(n, _, _)| n == "freetoken_time_to_first_token_seconds_bucket")
            .map(|(_, l, v)| {
                let le = &l.iter().find(|(k, _)| k == "le").unwrap().1;
                (if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap() }, *v)
            })
            .collect();
        assert_eq!(buckets.len(), TTFT_BUCKETS.len() + 1);
        assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
        // le is inclusive: 0.001 falls in the 0.001 bucket. Negative and NaN are ignored.
        assert_eq!(buckets[0], (0.001, 2.0));
        assert_eq!(buckets[1], (0.005, 3.0));
        assert_eq!(buckets.last().unwrap(), &(f64::INFINITY, 6.0));
        assert_eq!(value(&samples, "freetoken_time_to_first_token_seconds_count", &[]), 6.0);
        let sum = value(&samples, "freetoken_time_to_first_token_seconds_sum", &[]);
        assert!((sum - (0.0005 + 0.001 + 0.003 + 0.2 + 7.0 + 1e6)).abs() < 1e-6);
        // Bounds print as Python's client prints them.
        assert!(
            m.render().contains("le=\"1.0\"")
                && m.render().contains("le=\"0.001\"")
                && m.render().contains("le=\"+Inf\"")
        );
    }

    #[test]
    fn engine_side_values() {
        let m = Metrics::new("m");
        m.set_gauges(EngineGauges {
            running_requests: 3,
            queued_requests: 2,
            kv_used_tokens: 250,
            kv_capacity_tokens: 1000,
            state_slots: Some((1, 4)),
        });
        m.set_expert_cache_totals(90, 10, 4);
        m.set_expert_cache_totals(80, 5, 2); // older totals do not move a counter back
        m.observe_step(StepKind::Decode, 0.004);
        m.observe_step(StepKind::Prefill, 0.5);
        m.set_health(&HealthState::Unhealthy("step 7 overran --step-timeout".into()));
        let (samples, _) = parse(&m.render());
        assert_eq!(value(&samples, "freetoken_num_requests_running", &[]), 3.0);
        assert_eq!(value(&samples, "freetoken_num_requests_waiting", &[]), 2.0);
        assert_eq!(value(&samples, "freetoken_kv_cache_usage_perc", &[]), 0.25);
        assert_eq!(value(&samples, "freetoken_state_slot_usage_perc", &[]), 0.25);
        assert_eq!(value(&samples, "freetoken_expert_cache_hits_total", &[]), 90.0);
        assert_eq!(value(&samples, "freetoken_expert_cache_misses_total", &[]), 10.0);
        assert_eq!(value(&samples, "freetoken_expert_cache_host_misses_total", &[]), 4.0);
        assert_eq!(value(&samples, "freetoken_step_time_seconds_count", &[("kind", "decode")]), 1.0);
        assert_eq!(value(&samples, "freetoken_step_time_seconds_count", &[("kind", "prefill")]), 1.0);
        assert_eq!(value(&samples, "freetoken_step_time_seconds_count", &[("kind", "mixed")]), 0.0);
        assert_eq!(value(&samples, "freetoken_engine_health", &[("state", "unhealthy")]), 1.0);
        assert_eq!(value(&samples, "freetoken_engine_health", &[("state", "serving")]), 0.0);
    }

    #[test]
    fn request_timer_records_a_request() {
        let m = Arc::new(Metrics::new("m"));
        let t0 = Instant::now();
        let mut t = RequestTimer::arrived_at(m.clone(), t0);
        t.started_at(100, 64, t0 + Duration::from_millis(20));
        t.token_at(t0 + Duration::from_millis(50));
        t.token_at(t0 + Duration::from_millis(60));
        t.token_at(t0 + Duration::from_millis(75));
        t.finish_at(RequestOutcome::Length, t0 + Duration::from_millis(80));
        drop(t); // already finished: not counted again
        let (s, _) = parse(&m.render());
        assert_eq!(value(&s, "freetoken_requests_total", &[("outcome", "length")]), 1.0);
        assert_eq!(value(&s, "freetoken_requests_total", &[("outcome", "abort")]), 0.0);
        assert_eq!(value(&s, "freetoken_prompt_tokens_total", &[]), 100.0);
        assert_eq!(value(&s, "freetoken_generation_tokens_total", &[]), 3.0);
        assert_eq!(value(&s, "freetoken_prefix_cache_queries_total", &[]), 100.0);
        assert_eq!(value(&s, "freetoken_prefix_cache_hits_total", &[]), 64.0);
        assert!((value(&s, "freetoken_time_to_first_token_seconds_sum", &[]) - 0.05).abs() < 1e-9);
        assert_eq!(value(&s, "freetoken_inter_token_latency_seconds_count", &[]), 2.0);
        assert!((value(&s, "freetoken_inter_token_latency_seconds_sum", &[]) - 0.025).abs() < 1e-9);
        assert!((value(&s, "freetoken_e2e_request_latency_seconds_sum", &[]) - 0.08).abs() < 1e-9);
        assert!((value(&s, "freetoken_request_queue_time_seconds_sum", &[]) - 0.02).abs() < 1e-9);
        assert_eq!(value(&s, "freetoken_request_generation_tokens_sum", &[]), 3.0);
        assert_eq!(value(&s, "freetoken_request_prompt_tokens_bucket", &[("le", "100.0")]), 1.0);
        assert_eq!(value(&s, "freetoken_request_prompt_tokens_bucket", &[("le", "50.0")]), 0.0);

        // A timer dropped unfinished (client gone) counts an abort; a rejected request has no latency.
        drop(RequestTimer::new(m.clone()));
        RequestTimer::new(m.clone()).finish(RequestOutcome::Rejected);
        let (s, _) = parse(&m.render());
        assert_eq!(value(&s, "freetoken_requests_total", &[("outcome", "abort")]), 1.0);
        assert_eq!(value(&s, "freetoken_requests_total", &[("outcome", "rejected")]), 1.0);
        assert_eq!(value(&s, "freetoken_e2e_request_latency_seconds_count", &[]), 2.0);
    }

    #[test]
    fn label_values_are_escaped() {
        let m = Metrics::new("a \"quoted\" \\ model\nname");
        let (samples, _) = parse(&m.render());
        assert_eq!(samples[0].1[0].1, "a \"quoted\" \\ model\nname");
    }

    #[test]
    fn value_formatting() {
        assert_eq!(format_value(1.0), "1.0");
        assert_eq!(format_value(0.25), "0.25");
        assert_eq!(format_value(3.0), "3.0");
        assert_eq!(format_value(f64::INFINITY), "+Inf");
        assert_eq!(format_value(f64::NAN), "NaN");
        assert_eq!(format_value(1e-7).parse::<f64>().unwrap(), 1e-7);
        assert_eq!(format_value(1e300).parse::<f64>().unwrap(), 1e300);
    }

    #[test]
    fn concurrent_writers() {
        let m = Arc::new(Metrics::new("m"));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        m.observe_inter_token(i as f64 * 1e-4);
                        m.add_generation_tokens(1);
                        m.inc_request(RequestOutcome::Stop);
                    }
                })
            })
            .collect();
        for _ in 0..20 {
            parse(&m.render());
        }
        for t in threads {
            t.join().unwrap();
        }
        let (s, _) = parse(&m.render());
        assert_eq!(value(&s, "freetoken_generation_tokens_total", &[]), 4000.0);
        assert_eq!(value(&s, "freetoken_inter_token_latency_seconds_count", &[]), 4000.0);
        assert_eq!(value(&s, "freetoken_requests_total", &[("outcome", "stop")]), 4000.0);
    }
}
