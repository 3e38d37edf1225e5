"""The worker's pools, planned at start-up (``memory_plan.py``), after the model is loaded
(``loading/model_loader.py``):

    recurrent-state pool (hybrid models) ─▶ memory plan ─▶ GDN prefill CUDA graphs (hybrid models on CUDA,
    ``layers/gdn_prefill_graphs.py``) ─▶ MoE prefill CUDA graphs (resident experts on CUDA,
    ``layers/moe_prefill_graphs.py``) ─▶ dry runs on CUDA: the largest prefill chunk and the
    largest decode graph bucket measure their transient memory ─▶ expert cache (offload) ─▶ KV pool (the rest) ─▶
    decode CUDA graphs captured ─▶ the plan logged as a table

Rust owns the indices into every pool (KV slots, page-table rows, state slots); past them the worker keeps a scratch
page-table row, ``_SCRATCH_TOKENS`` KV slots and one state slot for dry runs, ``forward_logits`` and graph padding.
Log lines follow FreeToken's (``Allocating N tokens for KV cache, K + V = X GiB``, ``Start capturing CUDA graphs with
sizes: [...]``, ``Free memory after initialization: X GiB``).
"""

from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Optional

import torch

from .cache.kv_pool import KVCachePool
from .cache.output_counts import OutputTokenCounts
from .errors import WorkerOutOfMemory
from .loading.model_loader import free_memory_bytes
from .log import get_logger
from .memory_plan import MemoryPlan, measure_peak_bytes
from .startup_progress import phase

if TYPE_CHECKING:
    from .engine.decode_graphs import DecodeGraphs
    from .worker import Worker

logger = get_logger(__name__)

GiB = 1 << 30
# forward_logits / dry-run scratch region (past the Rust-owned slots); also bounds its sequence length
_SCRATCH_TOKENS = 8192
# CPU KV pool by default: one full context, or every row at full context while that is at most
# _CPU_KV_DEFAULT_TOKENS; never more than _CPU_KV_TOKEN_CAP (--num-tokens / --num-pages size it exactly)
_CPU_KV_DEFAULT_TOKENS = 8192
_CPU_KV_TOKEN_CAP = 1 << 17


def allocate_pools(w: "Worker") -> None:
    """Sizes and allocates every pool of ``w`` (its model already loaded) and captures the decode graphs."""
    a = w.args
    used_by_loading = w.loaded.free_before - free_memory_bytes(w.device)
    layout = w.model.kv_layout
    bpt = KVCachePool.bytes_per_token(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, w.dtype, layout.v_head_dim
    )
    w.scratch_tokens = min(w.max_context, _SCRATCH_TOKENS)
    w.scratch_row = w.max_running_requests  # the page table's spare row
    state_bytes = _allocate_state_pool(w)
    w.token_counts = OutputTokenCounts(w.max_running_requests + 1, w.vocab_size, w.device)
    w.memory_plan = plan = MemoryPlan(
        device=str(w.device),
        free_before=w.loaded.free_before,
        memory_ratio=float(a["memory_ratio"]),
        weights=w.loaded.weights_bytes,
        state_bytes=state_bytes,
        token_count_bytes=w.token_counts.nbytes,
        live_state_slots=w.max_running_requests if w.state is not None else 0,
        snapshot_slots=w.num_snapshot_slots,
        scratch_kv_bytes=w.scratch_tokens * bpt,
        workspace=None,
        workspace_tokens=min(w.max_prefill_length, w.scratch_tokens),
        reserve=int(a["vram_reserve_mb"] or 0) * 2**20,
    )
    plan.gdn_graph_bytes, plan.gdn_graph_sizes = capture_gdn_prefill_graphs(w)
    plan.moe_graph_bytes, plan.moe_graph_sizes = capture_moe_prefill_graphs(w)
    if w.device.type == "cuda":
        # dry runs on the scratch slots alone, before the KV pool exists
        w.kv_capacity_tokens = 0
        w.kv = make_kv_pool(w, w.scratch_tokens)
        phase(f"Dry run: a {plan.workspace_tokens}-token prefill chunk measures the workspace")
        plan.workspace = measure_peak_bytes(w.device, lambda: w.dry_run(plan.workspace_tokens))
        plan.sampling_rows = w.max_running_requests
        plan.sampling_workspace = measure_sampling_workspace(w, plan.sampling_rows)
        if w.graph_max_bs:
            plan.graph_bytes = plan_decode_graphs(w)
        w.kv = None
        torch.cuda.empty_cache()
    if w.offload is not None:
        _allocate_expert_cache(w, plan, used_by_loading, bpt)
        _cap_graphs_to_the_expert_cache(w)
    w.kv_capacity_tokens = _kv_tokens(w, bpt, plan, used_by_loading)
    w.kv = make_kv_pool(w, w.kv_capacity_tokens + w.scratch_tokens)
    plan.kv_tokens, plan.kv_bytes = w.kv_capacity_tokens, w.kv_capacity_tokens * bpt
    logger.info(f"Allocating {w.kv_capacity_tokens} tokens for KV cache, K + V = {plan.kv_bytes / GiB:.2f} GiB")
    w.graphs = capture_decode_graphs(w) if w.graph_max_bs else None
    plan.free_after = free_memory_bytes(w.device)
    logger.info(plan.table())
    logger.info(f"Free memory after initialization: {plan.free_after / GiB:.2f} GiB")


# FreeToken's ratio alone gives a one-request server 2 snapshots, and a request takes up to 2 (its prompt's grid
# point, its finished answer): on the H200 the second of three alternating prompts already found its snapshot
# evicted (radix_offload_scenario, 2026-12-01). 16 Qwen3.6 snapshots are ~1 GiB.
MIN_SNAPSHOT_SLOTS = 16


def _allocate_state_pool(w: "Worker") -> int:
    """Hybrid models: one live recurrent-state slot per running request, snapshot slots for the hybrid radix
    cache (``--num-snapshot-slots``, else ``--linear-state-cache-ratio`` per running request and at least
    ``MIN_SNAPSHOT_SLOTS`` (ratio 0: none); none without a prefix cache), Rust owning 0..num_state_slots, and one
    scratch slot past them. Returns the pool's bytes."""
    w.state, w.num_state_slots, w.num_snapshot_slots = None, 0, 0
    stl = w.model.state_layout
    if stl is None:
        return 0
    from .cache.state_pool import RecurrentStatePool

    a = w.args
    if a["cache_type"] != "naive":
        count, ratio = a["num_snapshot_slots"], float(a["linear_state_cache_ratio"])
        if count is not None:
            w.num_snapshot_slots = int(count)
        elif ratio != 0:
            w.num_snapshot_slots = max(MIN_SNAPSHOT_SLOTS, math.ceil(ratio * w.max_running_requests))
    w.num_state_slots = w.max_running_requests + w.num_snapshot_slots
    w.state = RecurrentStatePool.from_layout(stl, w.num_state_slots + 1, w.dtype, w.device)
    nbytes = w.state.nbytes()
    logger.info(
        f"Allocating {w.num_state_slots} recurrent-state slots ({w.num_snapshot_slots} for prefix-cache "
        f"snapshots), {nbytes / GiB:.2f} GiB"
    )
    return nbytes


def make_kv_pool(w: "Worker", num_slots: int) -> KVCachePool:
    layout = w.model.kv_layout
    return KVCachePool(
        layout.num_layers,
        num_slots,
        layout.num_kv_heads,
        layout.head_dim,
        w.dtype,
        w.device,
        max_rows=w.max_running_requests,
        max_context=(w.max_context + 31) // 32 * 32,
        v_head_dim=layout.v_head_dim,
    )


def _allocate_expert_cache(w: "Worker", plan: MemoryPlan, used_by_loading: int, bpt: int) -> None:
    """The GPU expert cache, sized by the flags or (auto) by what the plan leaves above the KV floor."""
    off = w.offload
    budget = None
    if w.device.type == "cuda":
        budget = plan.kv_budget(used_by_loading) - w.loaded.kv_floor_tokens * bpt
    slots, how = off.cache_slots(w.args, budget)
    off.allocate_cache(slots)
    plan.expert_slots, plan.expert_cache_bytes = slots, off.cache.nbytes
    plan.host_expert_bytes, plan.expert_stream_bytes = off.host_bytes, off.stream.nbytes
    plan.expert_format = off.format
    if how == "auto":
        logger.info(f"--moe-cache-auto resolved moe_cache_size={slots}")
    logger.info(
        f"Expert cache: {slots} of {off.total_experts} experts on the device ({off.cache.nbytes / GiB:.2f} GiB, {how}, "
        f"evicting {off.cache.policy})"
    )
    if slots < min(off.min_useful_slots, off.total_experts):
        logger.warning(
            f"The expert cache has {slots} slots, under 3 x top_k per MoE layer "
            f"({off.min_useful_slots}): expect almost every decode expert to miss"
        )


def _cap_graphs_to_the_expert_cache(w: "Worker") -> None:
    """Decode batches whose experts may not fit the slot cache stream each layer whole, which a CUDA graph cannot
    capture (copy-stream events): those batches run eagerly."""
    fits = w.offload.max_cached_batch()
    if w.graph_max_bs > fits:
        logger.info(
            f"Decode CUDA graphs up to batch {fits} (asked {w.graph_max_bs}): a larger batch's {w.offload.top_k} "
            f"experts a token may not fit the {w.offload.cache.num_slots}-slot expert cache and streams each MoE "
            "layer, eagerly"
        )
        w.graph_max_bs = fits


def _kv_tokens(w: "Worker", bytes_per_token: int, plan: MemoryPlan, used_by_loading: int) -> int:
    a = w.args
    if a["num_pages"] is not None:
        tokens = int(a["num_pages"]) * w.page_size
    elif a["num_tokens"] is not None:
        tokens = int(a["num_tokens"])
    elif w.device.type == "cuda":
        # memory_ratio of what was free before loading, minus what loading took (REFERENCES 4.6 step 5), the state
        # pool, the measured workspaces and the reserve
        tokens = int(plan.kv_budget(used_by_loading) // bytes_per_token)
    else:
        # Host memory is shared with everything else on the machine: take one full context (every row at full
        # context only while that stays under _CPU_KV_DEFAULT_TOKENS; more rows share what is free: admission
        # waits), at most _CPU_KV_TOKEN_CAP tokens, and never more than half of memory_ratio x available memory
        # (the pool is zero-filled lazily, but filled as it is used). The demo model (8,192-token context):
        # 8,192 tokens, not 4 x 8,192.
        want = max(w.max_context, min(w.max_running_requests * w.max_context, _CPU_KV_DEFAULT_TOKENS))
        budget = (
            0.5 * a["memory_ratio"] * free_memory_bytes(w.device)
            - plan.scratch_kv_bytes
            - plan.state_bytes
            - plan.token_count_bytes
        )
        tokens = min(want, _CPU_KV_TOKEN_CAP, int(budget // bytes_per_token))
    tokens = tokens // w.page_size * w.page_size
    if tokens <= 0:
        raise WorkerOutOfMemory(
            "no memory left for the KV cache (weights took it all); lower the model size or raise --memory-ratio"
        )
    if tokens < w.max_context:
        logger.warning(f"KV cache ({tokens} tokens) is smaller than the context length ({w.max_context})")
    return tokens


# ------------------------------------------------------------------------------------------- GDN prefill graphs


def capture_gdn_prefill_graphs(w: "Worker") -> tuple[int, tuple[int, ...]]:
    """Hybrid models on CUDA with fla: one sequence's Gated DeltaNet prefill replays CUDA graphs by padded length
    (``layers/gdn_prefill_graphs.py``) up to ``--gdn-prefill-graph-tokens`` (0 or ``--disable-cuda-graph``: none).
    Captured before the KV pool is sized. Returns (device bytes they hold, bucket sizes). A value other than the
    default with nothing to act on (no GDN layers, no CUDA, no fla) is said once in the log, as other such flags."""
    from .layers.gated_deltanet import (
        GatedDeltaNet,
        _fla_direct_ops,
        _fla_direct_varlen,
        fla_direct_prefill,
        gdn_backend,
    )
    from .serve_defaults import serve_defaults

    layers = [m for m in w.model.modules() if isinstance(m, GatedDeltaNet)]
    tokens = int(w.args.get("gdn_prefill_graph_tokens") or 0)
    if tokens <= 0 or w.args["disable_cuda_graph"]:
        return 0, ()
    why = (
        "the model has no Gated DeltaNet layers"
        if not layers
        else f"not on {w.device} (CUDA with fla only)"
        if w.device.type != "cuda" or gdn_backend(w.device) != "fla" or _fla_direct_ops() is None
        else None
    )
    if why is not None:
        if tokens != serve_defaults()["gdn_prefill_graph_tokens"]:
            logger.warning(f"--gdn-prefill-graph-tokens {tokens}: no effect, {why}")
        return 0, ()
    from .layers.gdn_batch_graphs import capture_batch_graphs
    from .layers.gdn_prefill_graphs import GdnPrefillGraphs

    first = layers[0]
    phase("Capturing the Gated DeltaNet prefill CUDA graphs")
    torch.cuda.synchronize(w.device)
    torch.cuda.empty_cache()  # loading's cached blocks: not the graphs'
    before = torch.cuda.memory_reserved(w.device)
    graphs = GdnPrefillGraphs(
        fla_direct_prefill,
        first.num_k_heads,
        first.num_v_heads,
        first.head_k_dim,
        first.head_v_dim,
        w.dtype,
        w.device,
        tokens,
    )
    graphs.capture()
    if _fla_direct_varlen():  # steps of several sequences, by (sequence count, chunk count) bucket
        graphs.batch = capture_batch_graphs(fla_direct_prefill, graphs, w.max_running_requests)
    torch.cuda.empty_cache()  # the warm-up runs' blocks, outside the graphs' pool
    held = torch.cuda.memory_reserved(w.device) - before
    for layer in layers:
        layer.prefill_graphs = graphs
    several = (
        f", and {len(graphs.batch.replay_fns)} for steps of up to {graphs.batch.seq_sizes[-1] - 1} sequences"
        if graphs.batch is not None and graphs.batch.replay_fns
        else ""
    )
    logger.info(
        f"Captured Gated DeltaNet prefill CUDA graphs for {len(graphs.sizes)} lengths up to {graphs.sizes[-1]} "
        f"tokens{several} ({held / GiB:.2f} GiB)"
    )
    return held, tuple(graphs.sizes)


# ------------------------------------------------------------------------------------------- MoE prefill graphs


def capture_moe_prefill_graphs(w: "Worker") -> tuple[int, tuple[int, ...]]:
    """Resident MoE blocks on CUDA: prefill-sized steps replay CUDA graphs by padded token count
    (``layers/moe_prefill_graphs.py``) up to ``--moe-prefill-graph-tokens`` (0 or ``--disable-cuda-graph``: none;
    emulated on the CPU with ``emulate_cuda_graphs``). Captured before the KV pool is sized, then checked against
    the eager block: a capture or a check that fails is logged as an error and the blocks run eagerly. Returns
    (device bytes they hold, bucket sizes)."""
    from .layers.moe import SparseMoeBlock
    from .layers.moe_prefill_graphs import MoePrefillGraphs, graphs_switched_on
    from .serve_defaults import serve_defaults

    tokens = int(w.args.get("moe_prefill_graph_tokens") or 0)
    if tokens <= 0 or w.args["disable_cuda_graph"]:
        return 0, ()
    if not graphs_switched_on():
        logger.info("FREETOKEN_MOE_PREFILL_GRAPHS=0: no MoE prefill CUDA graphs captured")
        return 0, ()
    emulate = w.device.type != "cuda"
    blocks = [m for m in w.model.modules() if isinstance(m, SparseMoeBlock)]
    # emulated on the CPU: the blocks CUDA would capture (the CPU runs their torch reference in the stand-in)
    target = torch.device("cuda") if emulate else w.device
    capturable = [b for b in blocks if b.experts.prefill_capturable(target)]
    why = (
        "the model has no sparse MoE blocks"
        if not blocks
        else "its experts are not resident on the device (--moe-backend offload / hybrid)"
        if not capturable
        else f"not on {w.device} (CUDA only)"
        if emulate and not w.args.get("emulate_cuda_graphs")
        else None
    )
    if why is not None:
        if tokens != serve_defaults()["moe_prefill_graph_tokens"]:
            logger.warning(f"--moe-prefill-graph-tokens {tokens}: no effect, {why}")
        return 0, ()
    min_tokens = max(b.experts.decode_max_pairs() // b.top_k + 1 for b in capturable)
    phase("Capturing the MoE prefill CUDA graphs")
    if not emulate:
        torch.cuda.synchronize(w.device)
        torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(w.device) if not emulate else 0
    hidden = capturable[0].hidden_size
    graphs = MoePrefillGraphs(hidden, w.dtype, w.device, tokens, min_tokens, emulate=emulate)
    if not graphs.sizes:
        return 0, ()
    try:
        graphs.capture(capturable)
        for block in capturable:
            block.prefill_graphs = graphs
        graphs.check(capturable[0])
    except Exception as e:  # an optimisation: the server still runs, eagerly, and says so
        for block in capturable:
            block.prefill_graphs = None
        del graphs
        if not emulate:
            torch.cuda.synchronize(w.device)
            torch.cuda.empty_cache()
        logger.error(f"MoE prefill CUDA graphs failed, the MoE blocks run eagerly: {type(e).__name__}: {e}")
        return 0, ()
    if not emulate:
        torch.cuda.empty_cache()  # the warm-up runs' blocks, outside the graphs' pool
    held = torch.cuda.memory_reserved(w.device) - before if not emulate else 0
    logger.info(
        f"Captured MoE prefill CUDA graphs for {len(graphs.sizes)} lengths from {graphs.sizes[0]} to "
        f"{graphs.sizes[-1]} tokens in {len(capturable)} layers ({held / GiB:.2f} GiB)"
    )
    return held, tuple(graphs.sizes)


# ---------------------------------------------------------------------------------------------------- decode graphs


def graph_max_bs(a: dict, device: torch.device, max_running_requests: int) -> int:
    """Largest decode batch run from a CUDA graph (0: none). Graphs need CUDA (or the test emulation)."""
    if a["disable_cuda_graph"] or not (device.type == "cuda" or a["emulate_cuda_graphs"]):
        return 0
    want = a["cuda_graph_max_bs"]
    return min(max_running_requests, max_running_requests if want is None else int(want))


def make_decode_graphs(w: "Worker", emulate: bool) -> "DecodeGraphs":
    from .engine.decode_graphs import DecodeGraphs, PaddingTargets

    padding = PaddingTargets(
        row=w.scratch_row, kv_slot=w.kv_capacity_tokens, state_slot=w.num_state_slots if w.state is not None else -1
    )
    return DecodeGraphs(
        w.model,
        w.kv,
        w.attn,
        w.state,
        w.device,
        w.graph_max_bs,
        w.max_context,
        padding,
        w.token_counts,
        expert_offload=w.offload,
        emulate=emulate,
        audit=bool(w.args["emulate_cuda_graphs"]),
    )


def plan_decode_graphs(w: "Worker") -> int:
    """Device memory the decode graphs will hold, measured before the KV pool exists: the transient peak of one
    eager decode step at the largest bucket (sampling included, every row padding), with a margin, plus the logits
    each smaller bucket's graph keeps."""
    graphs = make_decode_graphs(w, emulate=True)
    bs = graphs.max_bs

    def dry() -> None:
        graphs._stage_padding(0)
        with torch.inference_mode():
            graphs._forward_fn(bs)()
            graphs._sampler_fn(bs)()

    peak = measure_peak_bytes(w.device, dry, reserved=True) or 0  # segments, as the graphs' private pool holds them
    kept = sum(b * w.vocab_size * 4 for b in graphs.sizes[:-1])
    # capture runs on two streams of its own (the warm-up stream, the capture stream), and cuBLAS keeps a workspace
    # for each for good: on a tiny model they are the whole pool (2 x 32 MiB on the H200 against 2 MiB planned)
    return int(1.25 * peak) + kept + 2 * cublas_workspace_bytes(w.device)


def cublas_workspace_bytes(device: torch.device) -> int:
    """The workspace cuBLAS takes per stream, by torch's rule: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT``
    pairs) when set, else 32 MiB on sm_90 and 8 MiB + 128 KiB elsewhere."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    major, minor = torch.cuda.get_device_capability(device)
    return 4096 * 8 * 1024 if (major, minor) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def measure_sampling_workspace(w: "Worker", rows: int) -> Optional[int]:
    """Transient bytes of sampling ``rows`` rows at once, as a step that ends ``rows`` prompts does: the logits
    (model dtype, then fp32), penalties, the filtered draw (softmax, sort, cumulative sums over the vocabulary) and
    the logprobs; the most expensive path, whatever the requests ask. CUDA only (None elsewhere)."""
    from .layers.sampler import apply_penalties, sample

    dev, vocab = w.device, w.vocab_size
    if dev.type != "cuda":
        return None

    def run() -> None:
        with torch.inference_mode():
            logits = torch.randn(rows, vocab, device=dev, dtype=w.dtype).float()
            ones = torch.ones(rows, device=dev)
            counts = w.token_counts.rows(torch.zeros(rows, dtype=torch.int64, device=dev))  # gathered, as a step does
            logits = apply_penalties(logits, counts, ones * 0.5, ones * 0.5)
            top_k = torch.full((rows,), 50, device=dev)
            sample(logits, ones, ones * 0.9, top_k, ones * 0.05, torch.arange(rows, device=dev), all_greedy=False)

    return measure_peak_bytes(dev, run)


def capture_decode_graphs(w: "Worker") -> "DecodeGraphs":
    graphs = make_decode_graphs(w, emulate=w.device.type != "cuda" or bool(w.args["emulate_cuda_graphs"]))
    logger.info(f"Start capturing CUDA graphs with sizes: {graphs.sizes}")
    phase(f"Capturing CUDA graphs with sizes: {graphs.sizes}", log=False)
    graphs.capture()
    w.memory_plan.graph_pool_bytes = graphs.pool_bytes
    logger.info(graphs.describe())
    planned = w.memory_plan.graph_bytes
    if planned is not None and graphs.pool_bytes > planned:
        logger.warning(
            f"The CUDA graph pool ({graphs.pool_bytes / GiB:.2f} GiB) is larger than planned "
            f"({planned / GiB:.2f} GiB); raise --vram-reserve-mb if memory runs short"
        )
    return graphs
