//! Start-up around the model load: bind the listener first ([`bind_listener`]: a busy port fails at once), then,
//! once the worker is loaded ([`crate::python::serve`]), start the engine thread around it, serve HTTP until a
//! signal or the engine's death, and stop the engine ([`run`]). The exit code is 0 after a requested shutdown,
//! 1 when the engine died (so a supervisor restarts the server; every waiting client has been answered with an
//! error by then).

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

/// Binds `--host:--port` before anything is loaded, so a busy port or a bad address fails in a second with
/// one line rather than after the model load. Connections that arrive while the model loads wait in the
/// listen backlog and are answered once the server runs.
pub fn bind_listener(args: &ServeArgs) -> Result<std::net::TcpListener, String> {
    let addr = bind_address(&args.host, args.port);
    let bound = std::net::TcpListener::bind(&addr).and_then(|l| l.set_nonblocking(true).map(|()| l));
    bound.map_err(|e| {
        let hint =
            if e.kind() == std::io::ErrorKind::AddrInUse { " (another server? pick another --port)" } else { "" };
        format!("cannot listen on {addr}: {e}{hint}")
    })
}

/// `host:port`, with an IPv6 host in brackets.
fn bind_address(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Serves the loaded model on `listener` (from [`bind_listener`]) until a signal or the engine's death, then
/// stops the engine. Returns the process exit code.
pub fn run(args: ServeArgs, listener: std::net::TcpListener, worker: Box<dyn Worker>, info: EngineDescription) -> i32 {
    for note in unused_flag_notes(&args, &info) {
        tracing::warn!("{note}");
    }
    // One registry for the whole server: the routes time requests, the engine sets its gauges.
    let metrics = Arc::new(crate::metrics::Metrics::new(&info.served_model_name));
    let engine = EngineBackend::spawn(worker, engine_config(&args, &info, metrics.clone()));
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("ft-http").build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("cannot start the async runtime: {e}");
            engine.shutdown();
            return 1;
        }
    };
    let served = runtime.block_on(async {
        // before anything listens: a handler a library left on SIGTERM / SIGINT would end the process (stop_signals)
        let reset = crate::stop_signals::claim();
        if !reset.is_empty() {
            tracing::debug!("reset the handlers a library had installed on {}", reset.join(", "));
        }
        serve_http(args, listener, engine.clone(), info, metrics).await
    });
    exit_code(&engine, served)
}

fn engine_config(args: &ServeArgs, info: &EngineDescription, metrics: Arc<crate::metrics::Metrics>) -> EngineConfig {
    EngineConfig {
        scheduler: scheduler_config(args, info),
        decode_log_interval: args.decode_log_interval,
        max_queued_requests: args.max_queued_requests,
        step_timeout: Duration::from_secs_f64(args.step_timeout),
        planned_workspace_bytes: info.planned_workspace_bytes,
        overlap: !args.disable_overlap_schedule,
        metrics,
    }
}

/// The HTTP server on the runtime, until a signal (drain) or the engine's death; the service manager hears
/// READY once the API answers and STOPPING when the drain starts (`notify`).
async fn serve_http(
    args: ServeArgs,
    listener: std::net::TcpListener,
    engine: Arc<EngineBackend>,
    info: EngineDescription,
    metrics: Arc<crate::metrics::Metrics>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    if crate::notify::enabled() {
        let status = format!("Serving {} on {}", info.served_model_name, listener.local_addr()?);
        tokio::spawn(crate::readiness::notify_ready_when_answering(listener.local_addr()?, status));
        tokio::spawn(crate::readiness::notify_stopping_on_signal());
    }
    let watched = engine.clone();
    let engine_died = async move {
        while !watched.is_finished() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let backend: Arc<dyn Backend> = engine;
    let state = crate::http::state::AppState::new(args, backend, info)?.with_metrics(metrics);
    crate::http::server::serve_listener(listener, state, engine_died).await
}

/// Stops the engine and says why the server ended: 0 after a requested shutdown, 1 when the engine died or
/// stalled (so a supervisor restarts the server; every client has its answer by then).
fn exit_code(engine: &EngineBackend, served: anyhow::Result<()>) -> i32 {
    let died = engine.is_finished();
    if engine.is_stalled() {
        // The engine thread is stuck inside the worker (it may hold the GIL): every client has its answer,
        // so leave now rather than wait for it.
        tracing::error!("The engine is stuck in a step; exiting with status 1 so a supervisor can restart the server");
        crate::notify::stopping("The engine stalled; exiting with status 1");
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
            crate::notify::stopping("The engine stopped; exiting with status 1");
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

    #[test]
    fn a_busy_port_fails_at_once_in_one_line() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let args = crate::cli::parse_serve_args(["--port".to_string(), port.to_string()]).unwrap();
        let msg = bind_listener(&args).unwrap_err();
        assert!(msg.starts_with(&format!("cannot listen on 127.0.0.1:{port}: ")), "{msg}");
        assert!(msg.contains("--port") && !msg.contains('\n'), "{msg}");
        let free = crate::cli::parse_serve_args(["--port", "0"]).unwrap();
        assert!(bind_listener(&free).is_ok());
        assert_eq!(bind_address("::1", 80), "[::1]:80");
        assert_eq!(bind_address("0.0.0.0", 80), "0.0.0.0:80");
    }
}
