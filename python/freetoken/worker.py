"""The worker: runs one step per ``execute(plan)`` call on the pools start-up built.

The Rust engine thread builds it once with the ``ft serve`` flags (a dict, snake_case keys), reads ``info()`` (the
engine description, version-checked with the step contract), then calls ``execute`` once per step, or, in the
overlap loop, ``launch`` (queued on the device, returns at once for a graph step) and later ``collect``:

    plan (flat dict) ──plain decode step?──▶ decode CUDA graph replay (engine/decode_graphs.py)
                     └─otherwise─▶ StepPlan.from_flat ─▶ checks ─▶ ForwardBatch.from_plan ─▶ model ─▶ sampler

Failures come back typed (``errors.py``): ``WorkerOutOfMemory`` (cached memory released, the next step works),
``InvalidPlan`` (checked before any device memory is touched), anything else is fatal. Loading is in
``loading/model_loader.py``, the pools and the memory plan in ``startup.py``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from . import startup
from .engine.allocator_events import read_counters, report_step_allocations
from .engine.decode_graphs import LaunchedDecode, decode_inputs
from .engine.description import EngineDescription
from .engine.forward_batch import ForwardBatch
from .engine.gc_control import freeze_startup_objects
from .engine.kernel_compiles import process_compile_watch, report_step_compiles
from .engine.logprobs import MAX_TOP_LOGPROBS, logit_rows, step_logprobs
from .engine.prefill_warmup import run_prefill_warmup, scratch_chunk_plan, warmup_enabled
from .engine.step_plan import StepPlan
from .engine.step_profiler import StepProfiler
from .errors import InvalidPlan, UnsupportedModel, WorkerOutOfMemory
from .fault_injection import FaultInjector
from .kernels.attention import lazy_rescale
from .kernels.attention_cudnn import extend_attention_choice
from .kernels.pdl import pdl_mode, pdl_requested
from .layers.attention import make_attention_backend
from .layers.moe import grouped_gemm_choice
from .layers.sampler import apply_penalties, sample, token_logprobs
from .loading.model_loader import load_model
from .log import get_logger
from .moe.bench_routing import BenchRoutingControl
from .scripted_output import force as force_scripted_tokens
from .serve_defaults import normalize_args
from .tuning_env import switch_from_env

logger = get_logger(__name__)

GiB = 1 << 30


@dataclass
class StepResult:
    tokens: list[int]
    logprobs: list[float]
    stats: dict
    logits: Optional[torch.Tensor] = None  # fp32; [T, V] with all_logits, else [S, V] of the sampled rows
    extra: dict = field(default_factory=dict)  # top and prompt logprobs (engine/logprobs.py), when asked


class Worker:
    def __init__(self, args: Optional[dict] = None):
        self.args = a = normalize_args(args)
        self.steps_executed = 0
        self._workspace_warned_at = 0
        self.faults = FaultInjector()
        self.bench_routing = BenchRoutingControl()
        if int(a["tensor_parallel_size"]) != 1:
            raise UnsupportedModel("tensor parallelism is not supported yet (--tp-size 1)")
        self.max_running_requests = int(a["max_running_requests"])
        self.max_prefill_length = int(a["max_prefill_length"])
        self.page_size = int(a["page_size"])
        if self.max_running_requests < 1 or self.max_prefill_length < 1 or self.page_size < 1:
            raise ValueError("max_running_requests, max_prefill_length and page_size must be positive")
        if a["num_tokens"] is not None and a["num_pages"] is not None:
            raise ValueError("--num-tokens and --num-pages are exclusive")
        self.loaded = m = load_model(a)
        self.device, self.dtype, self.model, self.offload = m.device, m.dtype, m.model, m.offload
        self.step_profiler = StepProfiler(self.device)  # FREETOKEN_PROFILE_STEPS (off by default)
        self.compiles = process_compile_watch()  # kernels a served step had to compile, logged
        self.max_context, self.vocab_size = m.max_context, int(m.config.vocab_size)
        # fails fast on fi / fa / trtllm and unknown names
        self.attn = make_attention_backend(a["attention_backend"], self.device)
        self.graph_max_bs = startup.graph_max_bs(a, self.device, self.max_running_requests)
        # hybrid models cache prefixes with recurrent-state snapshots (hybrid_radix), others KV alone (radix)
        self.cache_types = ["hybrid_radix" if self.model.state_layout else "radix", "naive"]
        self._launched: deque = deque()  # steps launched and not collected: StepResult or (LaunchedDecode, stats)
        self._prev_sampled: Optional[torch.Tensor] = None  # the last launched step's sampled tokens (device)
        # expert-cache (hits, misses, host misses) already reported in some step's statistics
        self._experts_reported = (0, 0, 0)
        self._streamed_reported = (0, 0)  # the same for experts streamed for prefill (from the cache, the host)
        self._host_busy_reported = 0.0  # and for the host's time on its experts (ms)
        self._log_resolved_config()
        startup.allocate_pools(self)
        if warmup_enabled(a, self.device):
            run_prefill_warmup(self)  # compiles the prefill kernels of the shapes requests bring, before serving
        self._skip_expert_counts()  # lookups of the dry run, the graph capture and the warm-up are nobody's
        freeze_startup_objects()  # full collections would walk all of start-up's objects inside some step

    def _log_resolved_config(self) -> None:
        a, gdn = self.args, ""
        cache_type = "naive" if a["cache_type"] == "naive" else self.cache_types[0]
        extend_attention_choice()  # a bad FREETOKEN_EXTEND_ATTENTION stops start-up here, not the first prefill
        lazy_rescale()  # FREETOKEN_EXTEND_LAZY_RESCALE, the same
        grouped_gemm_choice()  # FREETOKEN_BF16_MOE_GROUPED, the same
        for switch in ("FREETOKEN_MOE_PREFILL_GRAPHS", "FREETOKEN_EXTEND_SLOT_INT32"):
            switch_from_env(switch)  # an on/off switch that is not 0 or 1, the same
        # a bad FREETOKEN_PDL, the same; on by default, logged where the device takes it (sm_90+)
        if pdl_requested() and self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) >= (9, 0):
            logger.info(f"Programmatic dependent launch on for our kernels (FREETOKEN_PDL={pdl_mode()})")
        if self.model.state_layout:
            from .layers.gated_deltanet import batch_graphs_on, gdn_backend, gdn_conv_impl, stage_inputs

            gdn_conv_impl()  # a bad FREETOKEN_GDN_CONV_IMPL stops start-up here, not the first prefill
            stage_inputs(), batch_graphs_on()  # FREETOKEN_GDN_STAGE_INPUTS, FREETOKEN_GDN_BATCH_GRAPHS, the same
            gdn = f", gdn_backend={gdn_backend(self.device)!r}"
        overlap = not a.get("disable_overlap_schedule", False)
        logger.info(
            f"Resolved config: moe_backend={self.loaded.moe_backend!r}, attention_backend={self.attn.name!r}"
            f"{gdn}, nvfp4_backend={self.loaded.nvfp4_backend!r}, cache_type={cache_type!r}, page_size={self.page_size}"
            f", overlap_schedule={overlap}"
        )

    def dry_run(self, num_tokens: int) -> None:
        """One prompt chunk of ``num_tokens`` through the real step path on the scratch row and slots."""
        self.execute_plan(scratch_chunk_plan(self, 0, num_tokens), _allow_scratch=True)

    # ------------------------------------------------------------------ the step contract

    def info(self) -> dict:
        """The engine description (``engine/description.py``), as a dict for the Rust side."""
        m, t = self.loaded, self.loaded.tokenizer
        gen = {}
        if not m.is_gguf:
            g = m.checkpoint.generation_config()
            gen = {k: g[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in g}
        return EngineDescription(
            served_model_name=m.served_names[0],
            model_aliases=m.served_names[1:],
            architecture=(m.config.get("architectures") or [type(self.model).__name__])[0],
            max_context=self.max_context,
            vocab_size=self.vocab_size,
            kv_capacity_tokens=self.kv_capacity_tokens,
            num_state_slots=self.num_state_slots,
            num_snapshot_slots=self.num_snapshot_slots,
            cache_types=list(self.cache_types),
            tool_call_token_id=t.tool_call_token_id,
            tokenizer_path=str(t.tokenizer_path),
            chat_template=t.chat_template,
            bos_token=t.bos_token,
            eos_token=t.eos_token,
            bos_token_id=t.bos_token_id,
            eos_token_ids=[int(x) for x in t.eos_token_ids],
            add_bos_token=bool(t.add_bos_token),
            planned_workspace_bytes=self.memory_plan.step_workspace,
            cuda_graph_sizes=list(self.graphs.sizes) if self.graphs is not None else [],
            dtype=str(self.dtype).replace("torch.", ""),
            device=str(self.device),
            generation_config=gen,
        ).to_dict()

    def execute(self, plan: dict) -> tuple[list[int], list[float], dict, dict]:
        """One step from the flat plan the Rust side sends, to the end. Returns the sampled tokens and their
        logprobs in plan order (one per sampled sequence), step statistics and the top / prompt logprobs asked for
        (``step_plan.py``). Plain decode steps replay a CUDA graph."""
        self.launch(plan)
        return self.collect()

    def launch(self, plan: dict) -> None:
        """Starts one step (the overlap loop; ``collect`` answers it). A graph step returns once its replay and
        the copy of its tokens are queued; an eager step runs to the end here."""
        if not self._launched and self.bench_routing.poll() and self.graphs is not None:  # benchmarks switching
            self.graphs = None  # the routing mode, between steps
            self._release_cached_memory()
            self.graphs = startup.capture_decode_graphs(self)
            self._skip_expert_counts()
        decode = decode_inputs(plan, self.graph_max_bs) if self.graphs is not None else None
        if decode is not None:
            n = len(decode["rows"])
            run = lambda: self._launch_replay(decode)  # noqa: E731
            step, stats = self._guarded(int(plan["step_id"]), n, run, count_experts=False)  # counted at collect
            self._launched.append((step, stats))
        else:
            self._launched.append(self.execute_plan(StepPlan.from_flat(plan)))

    def collect(self) -> tuple[list[int], list[float], dict, dict]:
        """The oldest launched step's answer (``execute``'s), waiting for its tokens."""
        r = self._launched.popleft()
        if isinstance(r, StepResult):
            return r.tokens, r.logprobs, r.stats, r.extra
        step, stats = r
        t0 = time.perf_counter()
        out = self.graphs.collect(step)
        stats["forward_ms"] += (time.perf_counter() - t0) * 1e3
        if self.offload is not None:  # the counters copied out behind the step, else one read (a sync)
            new = self._new_expert_counts(out.expert_counts)
            stats["expert_hits"], stats["expert_misses"], stats["expert_host_misses"] = new
            stats["expert_host_busy_ms"] = self._new_host_busy_ms()
        return out.tokens, out.logprobs, stats, out.extra

    def _launch_replay(self, inputs: dict) -> LaunchedDecode:
        self._check_decode_inputs(inputs)
        n = len(inputs["rows"])
        step = self.graphs.launch(inputs, n, self._prev_sampled)
        self._prev_sampled = self.graphs.tokens[:n]
        if inputs["snap_dst"].size:  # the tool-call anchor: the live state after this token, kept as a snapshot
            self.state.copy(torch.from_numpy(inputs["snap_src"].copy()), torch.from_numpy(inputs["snap_dst"].copy()))
        return step

    def _feed_previous(self, plan: StepPlan) -> None:
        """Eager steps: sequences reading the previous step's sampled token (``input_from_prev``) get it on the
        host (the previous step ran to the end, or its tokens are waited for here)."""
        idx = plan.input_from_prev
        take = idx >= 0
        prev = self._prev_sampled
        if prev is None or int(idx.max()) >= prev.numel():
            raise InvalidPlan("input_from_prev reads a row the previous step did not sample")
        plan.input_ids[plan.cu_seqlens[:-1][take]] = prev.cpu()[idx[take]]

    def execute_plan(self, plan: StepPlan, all_logits: bool = False, _allow_scratch: bool = False) -> StepResult:
        """One step from a decoded plan (Python callers), always eager. ``all_logits`` also returns fp32 logits
        at every new token ``[T, V]``; otherwise ``logits`` holds the sampled rows ``[S, V]``."""
        if plan.input_from_prev is not None:
            self._feed_previous(plan)
        self._check_plan(plan, _allow_scratch)

        launch = {}

        def run():
            t_run = time.perf_counter()
            if self.state is not None and plan.copy_src.numel():
                self.state.copy(plan.copy_src, plan.copy_dst)  # restore snapshots before the forward
            self.token_counts.reset(plan.rows[plan.table_from == 0])  # requests starting this step
            rows = logit_rows(plan, all_logits)
            batch = ForwardBatch.from_plan(plan, self.kv, self.attn, state=self.state, logits_indices=rows.indices)
            logits = self.model(batch)
            launch["ms"] = (time.perf_counter() - t_run) * 1e3
            sampled = logits if rows.sampled is None else logits[rows.sampled.to(logits.device, non_blocking=True)]
            tokens, logprobs = self._sample(sampled, plan.sampling, plan.rows[plan.sampling.seq_index])
            self._prev_sampled = tokens
            extra = step_logprobs(logits, rows, plan.sampling.num_top_logprobs)
            return tokens.tolist(), logprobs.tolist(), logits if all_logits else sampled, extra

        run = self.step_profiler.wrap(plan.step_id, plan.num_tokens, run)
        result = self._guarded_step(plan.step_id, plan.num_tokens, run, count=not _allow_scratch)
        # the host's time to enqueue the forward (every layer's launches; on CUDA it returns before the device is
        # done): near device_ms, the step is bound by the host's launches, not by the device
        result.stats["launch_ms"] = launch.get("ms", 0.0)
        if not _allow_scratch:
            self._check_workspace(plan, result.stats["workspace_bytes"])
        return result

    def _sample(self, logits: torch.Tensor, s, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens for the sampled rows (penalties first, when any row has one) and their raw logprobs; each
        token is counted in its page-table row's output counts."""
        penalized = logits
        if bool((s.presence_penalty != 0).any() or (s.frequency_penalty != 0).any()):
            penalized = apply_penalties(
                logits,
                self.token_counts.rows(rows),
                s.presence_penalty.to(logits.device, non_blocking=True),
                s.frequency_penalty.to(logits.device, non_blocking=True),
            )
        tokens, logprobs = sample(penalized, s.temperature, s.top_p, s.top_k, s.min_p, s.seeds)
        tokens = force_scripted_tokens(tokens, rows, self.token_counts)  # tests only: FREETOKEN_TEST_SCRIPT
        if penalized is not logits:
            logprobs = token_logprobs(logits.float(), tokens)
        self.token_counts.add(rows, tokens)
        return tokens, logprobs

    def _guarded_step(self, step_id: int, num_tokens: int, run, count: bool = True) -> StepResult:
        """``_guarded`` for a step whose ``run`` returns ``(tokens, logprobs, logits, extra)``."""
        (tokens, logprobs, logits, extra), stats = self._guarded(step_id, num_tokens, run, count, time_device=True)
        return StepResult(tokens, logprobs, stats, logits, extra)

    def _skip_expert_counts(self) -> None:
        """Expert-cache lookups so far are reported by no step (start-up, graph capture)."""
        if self.offload is not None:
            self._experts_reported = self.offload.all_counters()
            self._streamed_reported = self.offload.streamed_counters()
            if self.offload.hybrid is not None:
                self._host_busy_reported = self.offload.hybrid.busy_seconds * 1e3

    def _new_expert_counts(self, cumulative: Optional[tuple[int, ...]] = None) -> tuple[int, int, int]:
        """Expert-cache (hits, misses, misses computed on the host) not yet reported, from the cache's cumulative
        counters (read now when not given). Each lookup is reported once, by the first step to see it."""
        if self.offload.hybrid is not None:  # a CPU expert call that failed wrote zeros: fail the step instead
            self.offload.hybrid.check_errors()
        now = cumulative if cumulative is not None else self.offload.all_counters()
        before = self._experts_reported
        self._experts_reported = tuple(max(b, n) for b, n in zip(before, now))
        return tuple(max(0, n - b) for b, n in zip(before, now))

    def _new_host_busy_ms(self) -> float:
        """Milliseconds the host spent on its experts' pairs (hybrid / cpu) since the last report: a counter the
        mailbox thread keeps, no sync."""
        hybrid = self.offload.hybrid
        if hybrid is None:
            return 0.0
        now = hybrid.busy_seconds * 1e3
        before, self._host_busy_reported = self._host_busy_reported, now
        return max(0.0, now - before)

    def _new_streamed_counts(self) -> tuple[int, int]:
        """Experts the prefill stream copied (from the cache's slots, over PCIe) since the last report: host
        counters, no sync."""
        now = self.offload.streamed_counters()
        before, self._streamed_reported = self._streamed_reported, now
        return now[0] - before[0], now[1] - before[1]

    def _guarded(
        self,
        step_id: int,
        num_tokens: int,
        run,
        count: bool = True,
        count_experts: bool = True,
        time_device: bool = False,
    ) -> tuple[object, dict]:
        """Runs one step: fault injection (tests), out-of-memory turned into ``WorkerOutOfMemory`` with the cached
        memory released, and the step's statistics (time, expert hits and misses, transient memory peak, and with
        ``time_device``, for a ``run`` that waits for its results, the device's time between CUDA events around it).
        Returns what ``run`` returned and the statistics."""
        t0 = time.perf_counter()
        oom = None
        on_cuda = self.device.type == "cuda"
        if on_cuda:  # the step's transient peak, checked against the memory plan (host-side counters, no sync)
            allocated_before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        events = allocator_before = None
        if on_cuda and time_device:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
            allocator_before = read_counters(self.device) if count else None
        if count:
            self.steps_executed += 1
        compiles_mark = self.compiles.mark()
        try:
            if count:
                self.faults.maybe_inject(self.steps_executed)  # tests only: FREETOKEN_FAULT
            with torch.inference_mode():
                value = run()
            if events is not None:
                events[1].record()
        except torch.OutOfMemoryError as e:
            oom = str(e).splitlines()[0]
        except RuntimeError as e:  # the CPU allocator's spelling of OOM
            if "can't allocate memory" not in str(e) and "out of memory" not in str(e).lower():
                raise
            oom = str(e).splitlines()[0]
        if oom is not None:  # outside the except block: the traceback's frames no longer pin the tensors
            self._release_cached_memory()
            raise WorkerOutOfMemory(f"step {step_id} ({num_tokens} tokens): {oom}")
        workspace = max(0, torch.cuda.max_memory_allocated(self.device) - allocated_before) if on_cuda else 0
        count_experts = count_experts and self.offload is not None
        hits, misses, host_misses = self._new_expert_counts() if count_experts else (0, 0, 0)
        host_busy_ms = self._new_host_busy_ms() if count_experts else 0.0
        from_cache, from_host = self._new_streamed_counts() if count_experts else (0, 0)
        step_ms = (time.perf_counter() - t0) * 1e3
        if count:
            report_step_compiles(self.compiles, compiles_mark, step_id, num_tokens, step_ms)
            if allocator_before is not None:
                report_step_allocations(allocator_before, read_counters(self.device), step_id, num_tokens, step_ms)
        stats = {
            "forward_ms": step_ms,
            "num_tokens": num_tokens,
            "expert_hits": hits,
            "expert_misses": misses,
            "expert_host_misses": host_misses,
            "expert_host_busy_ms": host_busy_ms,
            "prefill_experts_from_cache": from_cache,
            "prefill_experts_from_host": from_host,
            "workspace_bytes": workspace,
        }
        if events is not None:  # (run waited for its tokens: the end event is done, or nearly)
            events[1].synchronize()
            stats["device_ms"] = events[0].elapsed_time(events[1])
        return value, stats

    def _check_decode_inputs(self, d: dict) -> None:
        """``_check_plan`` for the graph path, on the plan's numpy arrays: every index lands inside the pools."""

        def bad(cond: np.ndarray) -> bool:
            return bool(np.any(cond))

        rows, slots, pos = d["rows"], d["out_cache_loc"], d["positions"]
        if bad((rows < 0) | (rows >= self.max_running_requests)) or np.unique(rows).size != rows.size:
            raise InvalidPlan(
                f"page-table rows out of range [0, {self.max_running_requests}) or repeated: {rows.tolist()}"
            )
        if bad((slots < 0) | (slots >= self.kv_capacity_tokens)):
            raise InvalidPlan(f"KV slot out of range [0, {self.kv_capacity_tokens})")
        if bad((pos < 1) | (pos >= self.max_context)):
            raise InvalidPlan(f"context length out of range (1, {self.max_context}]")
        if bad((d["input_ids"] < 0) | (d["input_ids"] >= self.vocab_size)):
            raise InvalidPlan(f"token id out of range [0, {self.vocab_size})")
        prev = self._prev_sampled
        if bad(d["input_from_prev"] >= (0 if prev is None else prev.numel())):
            raise InvalidPlan("input_from_prev reads a row the previous step did not sample")
        st = d["state_slots"]
        if self.state is not None and bad((st < 0) | (st >= self.num_state_slots)):
            raise InvalidPlan(f"state_slots out of range [0, {self.num_state_slots}): {st.tolist()}")
        snap = d["snap_dst"]
        if snap.size and (
            self.state is None
            or bad((snap < 0) | (snap >= self.num_state_slots))
            or np.intersect1d(snap, st).size
            or np.unique(snap).size != snap.size
        ):
            raise InvalidPlan(
                f"snap_slot out of range [0, {self.num_state_slots}), a live slot or repeated: {snap.tolist()}"
            )
        t, p, m = d["temperature"], d["top_p"], d["min_p"]
        if bad((d["num_top_logprobs"] < 0) | (d["num_top_logprobs"] > MAX_TOP_LOGPROBS)):
            raise InvalidPlan(f"num_top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if bad(~np.isfinite(t) | (t < 0)):
            raise InvalidPlan("temperature must be finite and >= 0")
        if bad(~(p > 0) | (p > 1)):
            raise InvalidPlan("top_p must be in (0, 1]")
        if bad(~(m >= 0) | (m > 1)):
            raise InvalidPlan("min_p must be in [0, 1]")

    def _check_workspace(self, plan: StepPlan, workspace: int) -> None:
        """Warns (once per new high) when a step needed more transient memory than the plan set aside."""
        planned = self.memory_plan.step_workspace
        if planned is None or workspace <= max(planned, self._workspace_warned_at):
            return
        self._workspace_warned_at = workspace
        logger.warning(
            f"Step {plan.step_id} ({plan.num_tokens} tokens) used {workspace / GiB:.2f} GiB of transient memory, "
            f"more than the planned workspace of {planned / GiB:.2f} GiB (prefill chunk and sampling); raise "
            "--vram-reserve-mb"
        )

    def _release_cached_memory(self) -> None:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_plan(self, plan: StepPlan, allow_scratch: bool = False) -> None:
        """Every index the plan carries must land inside our pools: checked on the host, before the page
        table or the KV pool is written."""

        def bad(cond: torch.Tensor) -> bool:
            return cond.numel() > 0 and bool(cond.any())

        max_rows = self.max_running_requests + (1 if allow_scratch else 0)
        max_slot = self.kv_capacity_tokens + (self.scratch_tokens if allow_scratch else 0)
        if bad((plan.rows < 0) | (plan.rows >= max_rows)):
            raise InvalidPlan(f"page-table row out of range [0, {max_rows}): {plan.rows.tolist()}")
        if plan.rows.numel() != plan.rows.unique().numel():
            raise InvalidPlan("a page-table row is scheduled twice in one step")
        if bad((plan.table_slots < 0) | (plan.table_slots >= max_slot)):
            raise InvalidPlan(f"KV slot out of range [0, {max_slot})")
        if bad(plan.context_lens > self.max_context):
            raise InvalidPlan(f"context length {int(plan.context_lens.max())} exceeds max_context {self.max_context}")
        if bad((plan.table_from < 0) | (plan.table_from > plan.prefix_lens)):
            raise InvalidPlan("table_from must lie in [0, prefix_len]: the new tokens' slots must be sent")
        if bad((plan.input_ids < 0) | (plan.input_ids >= self.vocab_size)):
            raise InvalidPlan(f"token id out of range [0, {self.vocab_size})")
        if self.state is None:
            if plan.copy_src.numel() or plan.snap_seq.numel():
                raise InvalidPlan("state copies / snapshots sent to a model without recurrent state")
        else:
            n_state = self.num_state_slots + (1 if allow_scratch else 0)
            for name in ("state_slots", "copy_src", "copy_dst", "snap_slot"):
                t = getattr(plan, name)
                if bad((t < 0) | (t >= n_state)):
                    raise InvalidPlan(f"{name} out of range [0, {n_state}): {t.tolist()}")
            if plan.copy_src.numel() != plan.copy_dst.numel():
                raise InvalidPlan("copy_src and copy_dst differ in length")
            if not (plan.snap_seq.numel() == plan.snap_upto.numel() == plan.snap_slot.numel()):
                raise InvalidPlan("snap_seq, snap_upto and snap_slot differ in length")
            if bad((plan.snap_seq < 0) | (plan.snap_seq >= plan.num_seqs)):
                raise InvalidPlan("snap_seq out of range")
            if plan.snap_seq.numel():
                ctx = plan.context_lens[plan.snap_seq]
                pre = plan.prefix_lens[plan.snap_seq]
                if bad((plan.snap_upto <= pre) | (plan.snap_upto > ctx)):
                    raise InvalidPlan("snapshot point outside the sequence's new tokens")
        self._check_logprobs(plan)
        s = plan.sampling
        if bad(~torch.isfinite(s.temperature) | (s.temperature < 0)):
            raise InvalidPlan("temperature must be finite and >= 0")
        if bad(~(s.top_p > 0) | (s.top_p > 1)):
            raise InvalidPlan("top_p must be in (0, 1]")
        if bad(~(s.min_p >= 0) | (s.min_p > 1)):
            raise InvalidPlan("min_p must be in [0, 1]")

    def _check_logprobs(self, plan: StepPlan) -> None:
        """Counts of alternatives within the limit, prompt-logprob targets inside the vocabulary."""
        for name, t in (("num_top_logprobs", plan.sampling.num_top_logprobs), ("plp_top", plan.plp_top)):
            if t.numel() and bool(((t < 0) | (t > MAX_TOP_LOGPROBS)).any()):
                raise InvalidPlan(f"{name} must be in [0, {MAX_TOP_LOGPROBS}]")
        if plan.plp_next.numel() and bool(((plan.plp_next < -1) | (plan.plp_next >= self.vocab_size)).any()):
            raise InvalidPlan(f"plp_next must be -1 or a token id in [0, {self.vocab_size})")

    # ------------------------------------------------------------------ offline helpers

    def forward_logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits ``[T, V]`` at every position of one sequence, computed in chunks of
        ``max_prefill_length`` on the page table's spare row and the scratch KV slots (never the slots the
        Rust side owns, so live requests are not disturbed)."""
        n = len(token_ids)
        if n == 0:
            return torch.empty(0, self.vocab_size)
        if n > self.scratch_tokens:
            raise ValueError(f"forward_logits handles at most {self.scratch_tokens} tokens, got {n}")
        slots = list(range(self.kv_capacity_tokens, self.kv_capacity_tokens + n))
        out = []
        for start in range(0, n, self.max_prefill_length):
            chunk = token_ids[start : start + self.max_prefill_length]
            plan = StepPlan.build(
                [
                    {
                        "tokens": chunk,
                        "prefix_len": start,
                        "row": self.scratch_row,
                        "table_from": start,
                        "table_slots": slots[start : start + len(chunk)],
                        "state_slot": self.num_state_slots if self.state is not None else -1,
                    }
                ]
            )
            out.append(self.execute_plan(plan, all_logits=True, _allow_scratch=True).logits)
        return torch.cat(out)
