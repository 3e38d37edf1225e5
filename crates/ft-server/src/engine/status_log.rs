//! FreeToken's status lines, so existing log readers keep working (REFERENCES §4.11):
//!
//! ```text
//! Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.12, #running-req: 0, #queue-req: 0, input throughput (token/s): 6712.34
//! Decode batch, #running-req: 1, #token: 9000, token usage: 0.13, gen throughput (token/s): 80.12, #queue-req: 0
//! ```
//!
//! Models with recurrent state (Gated DeltaNet) add FreeToken's `#mamba-slot: used/total, mamba usage: r, `
//! after `token usage` in both lines (used: live slots of running requests plus snapshots locked or being
//! captured; cached snapshots nothing locks count as free, as evictable KV does in `token usage`).
//!
//! One Prefill line per step that computes prompt tokens; one Decode line every `decode_log_interval` decode
//! steps. Throughput = tokens since the previous line of the same kind / wall time since that line.

use ft_core::scheduler::{PlanSummary, SchedulerStats};
use std::time::{Duration, Instant};

pub struct StatusLog {
    decode_log_interval: usize,
    decode_steps: usize,
    decode_tokens_since: u64,
    last_decode_line: Instant,
    last_prefill_line: Instant,
    prefill_tps: f64,
    decode_tps: f64,
}

impl StatusLog {
    pub fn new(decode_log_interval: usize) -> Self {
        let now = Instant::now();
        StatusLog {
            decode_log_interval,
            decode_steps: 0,
            decode_tokens_since: 0,
            last_decode_line: now,
            last_prefill_line: now,
            prefill_tps: 0.0,
            decode_tps: 0.0,
        }
    }

    /// Records a committed step and prints the lines that are due.
    pub fn record(&mut self, summary: &PlanSummary, stats: &SchedulerStats, elapsed: Duration) {
        if summary.new_tokens > 0 {
            // A prefill line covers exactly this step's forward: the wall gap since the previous line would
            // count idle time between requests.
            let secs = elapsed.as_secs_f64().max(1e-9);
            self.prefill_tps = summary.new_tokens as f64 / secs;
            self.last_prefill_line = Instant::now();
            tracing::info!(
                "Prefill batch, #new-seq: {}, #new-token: {}, #cached-token: {}, token usage: {:.2}, {}#running-req: {}, #queue-req: {}, input throughput (token/s): {:.2}",
                summary.new_seqs,
                summary.new_tokens,
                summary.cached_tokens,
                stats.token_usage,
                mamba_part(stats),
                stats.running,
                stats.queued,
                self.prefill_tps
            );
        }
        if summary.decode_tokens > 0 {
            if self.decode_steps == 0 && self.decode_tokens_since == 0 {
                self.last_decode_line = Instant::now() - elapsed;
            }
            self.decode_steps += 1;
            self.decode_tokens_since += summary.decode_tokens as u64;
            if self.decode_log_interval > 0 && self.decode_steps.is_multiple_of(self.decode_log_interval) {
                let secs = self.last_decode_line.elapsed().as_secs_f64().max(1e-9);
                self.decode_tps = self.decode_tokens_since as f64 / secs;
                tracing::info!(
                    "Decode batch, #running-req: {}, #token: {}, token usage: {:.2}, {}gen throughput (token/s): {:.2}, #queue-req: {}",
                    stats.running,
                    stats.kv_used_tokens,
                    stats.token_usage,
                    mamba_part(stats),
                    self.decode_tps,
                    stats.queued
                );
                self.decode_tokens_since = 0;
                self.last_decode_line = Instant::now();
            }
        }
    }

    pub fn last_prefill_throughput(&self) -> f64 {
        self.prefill_tps
    }

    pub fn last_decode_throughput(&self) -> f64 {
        self.decode_tps
    }
}

/// FreeToken's `#mamba-slot: used/total, mamba usage: r, ` for models with recurrent state, empty otherwise.
pub fn mamba_part(stats: &SchedulerStats) -> String {
    if stats.state_slots_total == 0 {
        return String::new();
    }
    format!(
        "#mamba-slot: {}/{}, mamba usage: {:.2}, ",
        stats.state_slots_used,
        stats.state_slots_total,
        stats.mamba_usage()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(used: usize, total: usize) -> SchedulerStats {
        SchedulerStats {
            running: 1,
            queued: 0,
            kv_used_tokens: 0,
            kv_capacity_tokens: 1,
            token_usage: 0.0,
            cached_tokens_in_tree: 0,
            evictable_tokens: 0,
            free_rows: 0,
            free_state_slots: 0,
            state_slots_total: total,
            state_slots_used: used,
            snapshot_slots_total: 0,
            snapshot_slots_used: 0,
            evictable_snapshots: 0,
            snapshot_hits: 0,
            snapshot_hit_tokens: 0,
        }
    }

    #[test]
    fn mamba_slots_only_for_models_with_recurrent_state() {
        assert_eq!(mamba_part(&stats(0, 0)), "");
        assert_eq!(mamba_part(&stats(3, 12)), "#mamba-slot: 3/12, mamba usage: 0.25, ");
    }
}
