//! Scheduler configuration: the handful of numbers that bound what one step and the whole engine may hold.
//!
//! The engine fills a [`SchedulerConfig`] from the `ft serve` flags (`--max-running-requests`,
//! `--max-prefill-length`, `--page-size`, `--cache-type`, ...) and from the memory plan (how many KV
//! tokens fit on the device), then hands it to [`crate::scheduler::Scheduler::new`]. Everything the
//! scheduler promises (no request waits forever, decode never runs out of KV, a step never exceeds its
//! token budget) is stated in terms of these fields.

/// How finished sequences are kept for reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheType {
    /// SGLang-style radix tree over token ids: finished sequences stay cached (evicted LRU when the pool
    /// needs room) and new prompts reuse their longest cached prefix.
    Radix,
    /// No prefix cache: every request computes its whole prompt and frees everything when it ends.
    Naive,
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
    /// Live recurrent-state slots for hybrid (Gated DeltaNet) models; each running request owns one.
    /// `0` means the model is not hybrid and plans carry `state_slot = -1`.
    pub num_state_slots: usize,
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
            seed: 0,
        }
    }
}

impl SchedulerConfig {
    /// Whole KV pages in the pool.
    pub fn kv_pages(&self) -> usize {
        self.kv_capacity_tokens / self.page_size.max(1)
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
        Ok(())
    }
}
