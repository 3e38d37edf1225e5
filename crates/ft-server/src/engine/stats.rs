//! `/v1/stats`: what the engine publishes after every step, typed. The scheduler's counters and the engine's own
//! (throughput, memory peaks, expert-cache and decode timings), one struct the HTTP side serializes as is.

use ft_core::scheduler::SchedulerStats;
use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct EngineStats {
    /// Requests admitted and not finished / waiting for admission.
    pub running_requests: usize,
    pub queued_requests: usize,
    /// Submitted and not finished (queued + running), as the 429 check counts them.
    pub requests_in_flight: usize,
    /// KV slots used by running requests and the prefixes they lock, out of the pool.
    pub kv_used_tokens: usize,
    pub kv_capacity_tokens: usize,
    pub token_usage: f64,
    /// Prefix-cache tokens held by the radix tree, and those nothing locks.
    pub cached_tokens_in_tree: usize,
    pub evictable_tokens: usize,
    pub free_rows: usize,
    /// Recurrent-state slots (hybrid models): live ones free, all in use, total; snapshots held, evictable, most.
    pub free_state_slots: usize,
    pub state_slots_used: usize,
    pub state_slots_total: usize,
    pub snapshot_slots_used: usize,
    pub snapshot_slots_total: usize,
    pub evictable_snapshots: usize,
    /// Requests that resumed from a recurrent-state snapshot, and the prompt tokens they skipped.
    pub snapshot_hits: u64,
    pub snapshot_hit_tokens: u64,
    /// Tokens per second of the last `Prefill batch` / `Decode batch` status line.
    pub prefill_throughput: f64,
    pub decode_throughput: f64,
    /// The memory plan's step workspace (prefill chunk + sampling) and the largest any step allocated (CUDA).
    pub planned_workspace_bytes: Option<u64>,
    pub max_step_workspace_bytes: u64,
    /// Expert-cache lookups since start (`--moe-backend offload`): found resident / copied in (or, of those,
    /// computed on the host CPU: `--moe-backend hybrid` / `cpu`).
    pub expert_hits: u64,
    pub expert_misses: u64,
    pub expert_host_misses: u64,
    /// The host CPU's time on those (ms since start): beside the decode steps' time, whether the host is what a
    /// hybrid step waits on.
    pub expert_host_busy_ms: f64,
    /// Experts the prefill stream copied since start: from the expert cache's slots (`--moe-prefill-hit-d2d`)
    /// and over PCIe.
    pub prefill_experts_from_cache: u64,
    pub prefill_experts_from_host: u64,
    /// Decode-only steps since start, the worker's time in them and the engine's whole time (planning, the worker
    /// call, commit, handing tokens to HTTP): the per-token cost of each layer of the stack.
    pub decode_steps: u64,
    pub decode_forward_ms_total: f64,
    pub decode_engine_ms_total: f64,
    /// Steps launched while the step before them was still running (overlap scheduling), since start.
    pub overlapped_steps: u64,
    /// Checks of the cache bookkeeping run while idle (each after `INTEGRITY_CHECK_QUIET` without a request).
    pub integrity_checks: u64,
    /// The last step that computed prompt tokens (prefill or mixed): its new tokens, the engine's whole time for
    /// it (planning, the worker call, commit, handing tokens to HTTP), the worker's own time and the device's
    /// (0 where not measured). Benchmarks split a time to first token with these.
    pub last_prefill_tokens: u64,
    pub last_prefill_engine_ms: f64,
    pub last_prefill_forward_ms: f64,
    pub last_prefill_device_ms: f64,
    /// The host's time to enqueue that step's forward (`StepStats::launch_ms`): near the device's, the host set
    /// the pace.
    pub last_prefill_launch_ms: f64,
    /// The tokenizer's segment cache (`text::segment_cache`; the HTTP side fills these in): pieces of prompt text
    /// whose ids were found, pieces encoded and kept, bytes kept. Zero where the cache is off.
    pub tokenizer_cache_hits: u64,
    pub tokenizer_cache_misses: u64,
    pub tokenizer_cache_bytes: u64,
}

impl EngineStats {
    /// The scheduler's part; the engine fills in its own counters.
    pub fn from_scheduler(s: &SchedulerStats) -> Self {
        EngineStats {
            running_requests: s.running,
            queued_requests: s.queued,
            kv_used_tokens: s.kv_used_tokens,
            kv_capacity_tokens: s.kv_capacity_tokens,
            token_usage: s.token_usage,
            cached_tokens_in_tree: s.cached_tokens_in_tree,
            evictable_tokens: s.evictable_tokens,
            free_rows: s.free_rows,
            free_state_slots: s.free_state_slots,
            state_slots_used: s.state_slots_used,
            state_slots_total: s.state_slots_total,
            snapshot_slots_used: s.snapshot_slots_used,
            snapshot_slots_total: s.snapshot_slots_total,
            evictable_snapshots: s.evictable_snapshots,
            snapshot_hits: s.snapshot_hits,
            snapshot_hit_tokens: s.snapshot_hit_tokens,
            ..Default::default()
        }
    }
}
