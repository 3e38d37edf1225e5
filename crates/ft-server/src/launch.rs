//! `ft serve` after the model is loaded: start the engine thread around the worker, serve HTTP until a
//! signal or the engine's death, then stop the engine. Returns the process exit code: 0 after a requested
//! shutdown, 1 when the engine died (so a supervisor restarts the server; every waiting client has been
//! answered with an error by then).

use crate::backend::{Backend, EngineDescription};
use crate::cli::ServeArgs;
use crate::engine::{EngineBackend, EngineConfig};
use ft_core::config::{CacheType, SchedulerConfig};
use ft_core::step::Worker;
use std::sync::Arc;
use std::time::Duration;

/// The scheduler settings for `args` and the loaded model. The prefix cache is the one asked for, resolved for the
/// model (radix on a hybrid model is `hybrid_radix`: KV plus recurrent-state snapshots) when the model supports
/// it (its description lists the cache types), else none.
pub fn scheduler_config(args: &ServeArgs, info: &EngineDescription) -> SchedulerConfig {
    let asked = if args.cache_type == "naive" { CacheType::Naive } else { CacheType::Radix };
    let mut cache_type = CacheType::resolve(asked, info.num_state_slots > 0);
    if !info.cache_types.iter().any(|c| c == cache_type.as_str()) {
        tracing::warn!("cache_type {} -> naive: the model does not support it", cache_type.as_str());
        cache_type = CacheType::Naive;
    }
    let snapshots = if cache_type == CacheType::HybridRadix { info.num_snapshot_slots } else { 0 };
    SchedulerConfig {
        max_running_requests: args.max_running_requests,
        max_prefill_tokens: args.max_prefill_length,
        kv_capacity_tokens: info.kv_capacity_tokens,
        page_size: args.page_size,
        max_context: info.max_context,
        cache_type,
        // `--decode-interleave-every N` selects interleaved decode steps; by default decodes ride along in
        // prefill steps.
        mixed_decode: args.decode_interleave_every == 0,
        decode_interleave_every: args.decode_interleave_every,
        num_state_slots: info.num_state_slots,
        num_snapshot_slots: snapshots,
        snapshot_interval: ft_core::config::GDN_CHUNK_TOKENS,
        snapshot_token_id: if args.enable_special_token_ckpt { info.tool_call_token_id } else { None },
        seed: rand::random(),
    }
}

/// Flags that are valid but have nothing to act on for this model or device, said once at start-up (the CLI
/// refuses the ones that could never work; these depend on what was loaded).
pub fn unused_flag_notes(args: &ServeArgs, info: &EngineDescription) -> Vec<String> {
    let mut notes = Vec::new();
    if args.disable_pynccl {
        notes.push("--disable-pynccl: nothing to disable (one rank, no NCCL)".to_string());
    }
    if let Some(bs) = args.cuda_graph_max_bs.filter(|bs| *bs > 0) {
        if info.cuda_graph_sizes.is_empty() && !args.disable_cuda_graph {
            notes.push(format!(
                "--cuda-graph-max-bs {bs}: no decode CUDA graphs on {} (every step runs eagerly)",
                info.device
            ));
        }
    }
    if info.num_state_slots == 0 {
        if let Some(n) = args.num_snapshot_slots {
            notes.push(format!("--num-snapshot-slots {n}: no effect, the model has no recurrent state"));
        }
        if args.enable_special_token_ckpt {
            notes.push(
                "--enable-special-token-ckpt: no effect, the model has no recurrent state to snapshot".to_string(),
            );
        }
    } else if args.enable_special_token_ckpt && info.tool_call_token_id.is_none() {
        notes.push("--enable-special-token-ckpt: no effect, the tokenizer has no tool-call opener token".to_string());
    }
    notes
}

pub fn run(args: ServeArgs, worker: Box<dyn Worker>, info: EngineDescription) -> i32 {
    for note in unused_flag_notes(&args, &info) {
        tracing::warn!("{note}");
    }
    // One registry for the whole server: the routes time requests, the engine sets its gauges.
    let metrics = Arc::new(crate::metrics::Metrics::new(&info.served_model_name));
    let config = EngineConfig {
        scheduler: scheduler_config(&args, &info),
        decode_log_interval: args.decode_log_interval,
        max_queued_requests: args.max_queued_requests,
        step_timeout: Duration::from_secs_f64(args.step_timeout),
        planned_workspace_bytes: info.planned_workspace_bytes,
        metrics: metrics.clone(),
    };
    let engine = EngineBackend::spawn(worker, config);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("ft-http").build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("cannot start the async runtime: {e}");
            engine.shutdown();
            return 1;
        }
    };
    let watched = engine.clone();
    let engine_died = async move {
        while !watched.is_finished() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let backend: Arc<dyn Backend> = engine.clone();
    let served = runtime.block_on(async move {
        let state = crate::http::state::AppState::new(args, backend, info)?.with_metrics(metrics);
        crate::http::server::serve_on_bind_address(state, engine_died).await
    });
    let died = engine.is_finished();
    if engine.is_stalled() {
        // The engine thread is stuck inside the worker (it may hold the GIL): every client has its answer,
        // so leave now rather than wait for it.
        tracing::error!("The engine is stuck in a step; exiting with status 1 so a supervisor can restart the server");
        use std::io::Write;
        let _ = std::io::stderr().flush();
        let _ = std::io::stdout().flush();
        // _exit, not exit: atexit handlers (CUDA's among them) can block on a device that is really stuck.
        // SAFETY: ends the process at once; nothing after this runs.
        unsafe { libc::_exit(1) };
    }
    engine.shutdown();
    match served {
        Err(e) => {
            tracing::error!("server error: {e:#}");
            1
        }
        Ok(()) if died => {
            tracing::error!("The engine stopped; exiting so a supervisor can restart the server");
            1
        }
        Ok(()) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_with_nothing_to_act_on_are_noted() {
        let args = |flags: &[&str]| crate::cli::parse_serve_args(flags.iter().copied()).unwrap();
        let dense_cpu = EngineDescription { device: "cpu".into(), ..Default::default() };
        assert!(unused_flag_notes(&args(&[]), &dense_cpu).is_empty());
        let notes = unused_flag_notes(
            &args(&[
                "--disable-pynccl",
                "--cuda-graph-max-bs",
                "8",
                "--num-snapshot-slots",
                "4",
                "--enable-special-token-ckpt",
            ]),
            &dense_cpu,
        );
        let text = notes.join("\n");
        for flag in
            ["--disable-pynccl", "--cuda-graph-max-bs 8", "--num-snapshot-slots 4", "--enable-special-token-ckpt"]
        {
            assert!(text.contains(flag), "{text}");
        }
        // On CUDA with graphs captured, a hybrid model with a tool-call token: nothing to note.
        let hybrid_cuda = EngineDescription {
            device: "cuda:0".into(),
            cuda_graph_sizes: vec![1, 2, 4, 8],
            num_state_slots: 12,
            tool_call_token_id: Some(151657),
            ..Default::default()
        };
        assert!(unused_flag_notes(&args(&["--cuda-graph-max-bs", "8", "--enable-special-token-ckpt"]), &hybrid_cuda)
            .is_empty());
    }
}
