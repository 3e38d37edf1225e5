//! Scheduler configuration: the handful of numbers that bound what one step and the whole engine may hold.
//!
//! The engine fills a [`SchedulerConfig`] from the `ft serve` flags (`--max-running-requests`,
//! `--max-prefill-length`, `--page-size`, `--cache-type` resolved by [`CacheType::resolve`], ...) and from
//! the memory plan (how many KV tokens and recurrent-state slots fit on the device), then hands it to
//! [`crate::scheduler::Scheduler::new`]. Everything the scheduler promises (no request waits forever,
//! decode never runs out of KV, a step never exceeds its token budget) is stated in terms of these fields.

/// How finished sequences are kept for reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheType {
    /// SGLang-style radix tree over token ids: finished sequences stay cached (evicted LRU when the pool
    /// needs room) and new prompts reuse their longest cached prefix.
    Radix,
    /// The radix tree plus recurrent-state snapshots, for hybrid (Gated DeltaNet) models: a prompt reuses
    /// its longest cached prefix *that ends at a snapshot* and restores that state into its live slot
    /// (FreeToken's `hybrid_radix`; see [`crate::radix`] and [`crate::scheduler::kv_cache`]).
    HybridRadix,
    /// No prefix cache: every request computes its whole prompt and frees everything when it ends.
    Naive,
}

impl CacheType {
    /// The spelling of the `Resolved config` line and the `--cache-type` flag.
    pub fn as_str(&self) -> &'static str {
        match self {
            CacheType::Radix => "radix",
            CacheType::HybridRadix => "hybrid_radix",
            CacheType::Naive => "naive",
        }
    }

    /// The cache a model runs with when the user asked for `requested` (FreeToken's rewrite): radix on a
    /// model with recurrent state becomes `hybrid_radix` (a KV-only hit would resume the linear-attention
    /// layers from the wrong state), `hybrid_radix` on a model without becomes plain radix, naive stays.
    pub fn resolve(requested: CacheType, has_recurrent_state: bool) -> CacheType {
        match (requested, has_recurrent_state) {
            (CacheType::Naive, _) => CacheType::Naive,
            (_, true) => CacheType::HybridRadix,
            (_, false) => CacheType::Radix,
        }
    }

    /// Whether finished sequences are kept in the tree.
    pub fn caches(&self) -> bool {
        !matches!(self, CacheType::Naive)
    }
}

/// The GDN chunk size of the fla kernels: hybrid radix snapshots sit on multiples of it (see
/// [`SchedulerConfig::snapshot_interval`]).
pub const GDN_CHUNK_TOKENS: usize = 64;

/// FreeToken's `linear_state_cache_ratio`: snapshot slots per running request by default.
pub const DEFAULT_LINEAR_STATE_CACHE_RATIO: f64 = 2.0;

/// Snapshot slots for the hybrid radix cache: `count` when given (an absolute override), else
/// `ceil(ratio * max_running_requests)` (FreeToken: `ceil(2.0 * max_running_req)` extra slots). The worker
/// backs `max_running_requests + snapshot_slots_for(..)` state slots in all.
pub fn snapshot_slots_for(max_running_requests: usize, ratio: f64, count: Option<usize>) -> usize {
    count.unwrap_or_else(|| (ratio.max(0.0) * max_running_requests as f64).ceil() as usize)
}

/// The limits the scheduler works within.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Concurrent requests, which is also the number of page-table rows (`0..max_running_requests`).
    pub max_running_requests: usize,
    /// Token budget of one prefill or mixed step (`--max-prefill-length`): prompt chunks plus the decode
    /// tokens mixed in. Long prompts are chunked to fit. A pure decode step is bounded by
    /// `max_running_requests` instead.
    pub max_prefill_tokens: usize,
    /// KV slots in the device pool, in tokens; slot ids are `0..kv_capacity_tokens` (rounded down to
    /// whole pages).
    pub kv_capacity_tokens: usize,
    /// Tokens per KV page (>= 1). With pages > 1, KV is allocated a page at a time (slot ids of a page are
    /// contiguous and start at a multiple of `page_size`) and the prefix cache keys are page-aligned.
    pub page_size: usize,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_context: usize,
    /// Prefix cache flavour.
    pub cache_type: CacheType,
    /// `true`: running decodes ride along in prefill steps ([`crate::step::StepKind::Mixed`]), so a long
    /// prompt never pauses token streams.
    pub mixed_decode: bool,
    /// Only when `mixed_decode` is false: after this many consecutive prefill steps during which decodes
    /// were waiting, run one decode step. `0` means prefill-first (FreeToken 0.1.2 behaviour: decodes
    /// wait until no prompt is left to prefill).
    pub decode_interleave_every: usize,
    /// Recurrent-state slot ids the worker backs for hybrid (Gated DeltaNet) models, `0..num_state_slots`:
    /// live slots (each running request owns one) and snapshot slots together. `0` means the model is not
    /// hybrid and plans carry `state_slot = -1`.
    pub num_state_slots: usize,
    /// How many of `num_state_slots` may hold hybrid radix snapshots at a time; the other
    /// `num_state_slots - num_snapshot_slots` are live slots (at least 1 when `num_state_slots > 0`).
    /// Sized by [`snapshot_slots_for`] (`linear_state_cache_ratio` x `max_running_requests` by default, or
    /// an absolute count). Only [`CacheType::HybridRadix`] takes snapshots; with another cache type these
    /// ids stay unused.
    pub num_snapshot_slots: usize,
    /// Snapshot grid in tokens ([`GDN_CHUNK_TOKENS`] by default; rounded up to a multiple of the page size,
    /// see [`SchedulerConfig::snapshot_grid`]). Prefill chunks of a hybrid radix request end on the grid
    /// when the budget cuts them, and each chunk captures the state at its last grid point at most
    /// `prompt_len - 1` (what a later identical prompt can match).
    pub snapshot_interval: usize,
    /// `--enable-special-token-ckpt`: when a request samples this token (the tool-call opener), the decode
    /// step that feeds it back also captures the state after it, so a client re-rendering the call body
    /// resumes right after the opener. `None`: off.
    pub snapshot_token_id: Option<u32>,
    /// Seeds the splitmix64 stream that gives a seed to every request that arrives without one.
    pub seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_running_requests: 4,
            max_prefill_tokens: 8192,
            kv_capacity_tokens: 65536,
            page_size: 1,
            max_context: 32768,
            cache_type: CacheType::Radix,
            mixed_decode: true,
            decode_interleave_every: 0,
            num_state_slots: 0,
            num_snapshot_slots: 0,
            snapshot_interval: GDN_CHUNK_TOKENS,
            snapshot_token_id: None,
            seed: 0,
        }
    }
}

impl SchedulerConfig {
    /// Whole KV pages in the pool.
    pub fn kv_pages(&self) -> usize {
        self.kv_capacity_tokens / self.page_size.max(1)
    }

    /// Live recurrent-state slots: at most this many hybrid requests run at a time.
    pub fn live_state_slots(&self) -> usize {
        self.num_state_slots.saturating_sub(self.num_snapshot_slots)
    }

    /// Where snapshots may sit: multiples of `lcm(snapshot_interval, page_size)` tokens (a snapshot belongs
    /// to the tree node ending there, and nodes end on pages).
    pub fn snapshot_grid(&self) -> usize {
        let (a, b) = (self.snapshot_interval.max(1), self.page_size.max(1));
        let gcd = |mut x: usize, mut y: usize| {
            while y != 0 {
                (x, y) = (y, x % y);
            }
            x
        };
        a / gcd(a, b) * b
    }

    /// Checks the fields make a workable scheduler; the engine calls this before building one so a bad
    /// flag is a clear start-up error rather than a panic in [`crate::scheduler::Scheduler::new`].
    pub fn validate(&self) -> Result<(), String> {
        if self.max_running_requests == 0 {
            return Err("max_running_requests must be at least 1".into());
        }
        if self.max_running_requests > u32::MAX as usize {
            return Err("max_running_requests does not fit a u32 page-table row".into());
        }
        if self.page_size == 0 {
            return Err("page_size must be at least 1".into());
        }
        if self.kv_capacity_tokens < self.page_size {
            return Err(format!(
                "the KV pool ({} tokens) holds less than one page ({} tokens)",
                self.kv_capacity_tokens, self.page_size
            ));
        }
        if self.kv_capacity_tokens > u32::MAX as usize {
            return Err("kv_capacity_tokens does not fit u32 slot ids".into());
        }
        if self.max_context < 2 {
            return Err("max_context must be at least 2 (one prompt token and one output token)".into());
        }
        if self.max_prefill_tokens == 0 {
            return Err("max_prefill_tokens must be at least 1".into());
        }
        if self.mixed_decode && self.max_prefill_tokens <= self.max_running_requests {
            return Err(format!(
                "with mixed decode, max_prefill_tokens ({}) must exceed max_running_requests ({}) so a \
                 step that carries every decode still has room for a prompt chunk",
                self.max_prefill_tokens, self.max_running_requests
            ));
        }
        if self.num_state_slots > i32::MAX as usize {
            return Err("num_state_slots does not fit i32 state slot ids".into());
        }
        if self.num_state_slots > 0 && self.live_state_slots() == 0 {
            return Err(format!(
                "num_snapshot_slots ({}) leaves no live recurrent-state slot of {}",
                self.num_snapshot_slots, self.num_state_slots
            ));
        }
        if self.cache_type == CacheType::HybridRadix {
            if self.num_state_slots == 0 {
                return Err("cache_type hybrid_radix needs a model with recurrent state (num_state_slots > 0)".into());
            }
            if self.num_snapshot_slots == 0 {
                return Err("cache_type hybrid_radix needs snapshot slots (num_snapshot_slots > 0)".into());
            }
            if self.snapshot_interval == 0 {
                return Err("snapshot_interval must be at least 1".into());
            }
        }
        Ok(())
    }
}
