"""NVFP4 / FP8 kernel benchmark (issue 11) at Qwen3.6-35B-A3B's shapes, each beside a BF16 run of the same shape on
the same card. Prints a table per group and writes JSON.

    python bench/nvfp4_kernel_bench.py --out bench/out/nvfp4_kernels.json             # CUDA
    python bench/nvfp4_kernel_bench.py --smoke                                         # CPU, interpreter, tiny

Groups, each per M (rows of x; tokens for the MoE) in 1, 2, 4, 8, 16, 64, 256, 1024, 4096, 8192:
- ``linear``: the W4A16 NVFP4 Linears (``kernels/nvfp4_linear.py``): the shared expert's gate (512 x 2048) and
  down (2048 x 512), lm_head (248320 x 2048); beside each, ``torch.mm`` in BF16 (cuBLAS) over the same shape. At
  M <= 8 every path is timed (the CUDA-core GEMV in fp32, up to 4 rows its packed-half form, and tensor cores):
  where they cross is ``nvfp4_linear.pick_path``.
- ``moe``: the routed experts of one layer, 256 experts of gate|up 2 x 512 x 2048 and down 2048 x 512, top-8
  (``layers/nvfp4_experts.run_nvfp4_experts``: decode GEMVs up to 64 pairs, grouped kernels above), under uniform
  and Zipf routing (``--routing``, default ``FREETOKEN_BENCH_ROUTING`` or both; the draws of
  ``moe/bench_routing.py``), with the number of distinct experts the step touches; beside it the BF16 kernels
  (``layers/moe.run_experts``) on the same routing over a BF16 bank. Above the decode sizes both grouped paths
  are timed, each by itself: the NVFP4 grouped kernel at its block size (``pick_nvfp4_block_m``; at prefill sizes
  also at 64 rows), and ``dequant`` (the whole bank dequantized, then the BF16 kernel); ``*`` marks the path
  ``run_nvfp4_experts`` takes (``layers/nvfp4_experts.DEQUANT_MIN_PAIRS``).
- ``sweep`` (not in the default groups): the ``linear`` shapes at M <= 16 under each launch setting of ``SWEEP``
  (``nvfp4_linear_triton(..., tune=...)``: GEMV tile bytes, warps, pipeline stages; tensor-core BLOCK_N, BLOCK_K,
  warps, stages), to retune the defaults in ``kernels/nvfp4_linear.py``.
- ``moesweep`` (not in the default groups): the grouped kernel at prefill sizes (M >= 1024) under each launch
  setting of ``MOE_SWEEP`` (``nvfp4_fused_moe_triton(..., tune=...)``: rows per block, gate|up and down tiles, warps,
  stages, gate and up rows in one tile), uniform routing, beside the BF16 kernel: to retune ``grouped_config``.
- ``decsweep`` (not in the default groups): the MoE decode GEMVs at decode sizes (M * k <= 256 pairs), with the
  shared expert's NVFP4 down projection in the down kernel's epilogue as a Qwen3.6 layer runs them, under each launch
  setting of ``DECODE_SWEEP`` (``nvfp4_moe_decode_triton(..., tune=...)``: rows per program, words per step, warps,
  stages, the down kernel's pairs as a tile axis or one after another), uniform routing, beside the BF16 decode
  kernels: to retune ``decode_config``.
- ``bf16sweep`` (not in the default groups): the BF16 grouped kernels (``fused_moe_triton``, ``--moe-backend
  fused`` at prefill) at prefill sizes under each launch setting of ``BF16_MOE_SWEEP`` (rows per block, tiles, warps,
  stages), per routing; ``vs bf16`` is the default setting's time over this one's: to retune
  ``fused_moe.grouped_bf16_config``.
- ``grouped_mm`` (not in the default groups): the BF16 grouped MoE through ``torch._grouped_mm`` (CUTLASS's grouped
  kernel on sm_90; ``kernels/moe_grouped_mm.py``: the pair sort, the row gather, two grouped GEMMs, SiLU-and-mul,
  the combine), whole and its two GEMMs alone, beside ``fused_moe_triton``'s default (``vs bf16``: the Triton
  time over this one's), per routing, with the largest difference between the two outputs.
- ``mixed`` (decode sizes, M <= 32): the projections of nvidia/Qwen3.6-35B-A3B-NVFP4 whose parts mix BF16, FP8 and
  NVFP4 (the MoE block's router | shared gate | shared gate|up, the GDN in_proj qkv | z | b | a, attention q | k | v)
  and the lone FP8 / few-row NVFP4 Linears, through the layers (``layers/mixed_projection.py``): the layer's own
  path (``mixed gemv``: the one-launch GEMV of ``kernels/mixed_gemv.py`` up to 2-4 rows of x; ``mixed dot``: its
  tensor-core twin ``kernels/mixed_dot.py`` up to 32) beside the per-part path they replace (``per part``: a kernel
  per part, FP8 as W8A8 with its activation quantization, then a concatenation), and beside one BF16 GEMM of the
  whole shape.
- ``fp8``: the FP8 per-tensor projections (``kernels/fp8_linear.py``: Triton quantization + tensor-wise
  ``_scaled_mm``): GDN in_proj_qkv (8192 x 2048), out_proj (2048 x 4096), attention k (512 x 2048), beside
  ``torch.mm`` in BF16.

Columns: time (us, per call, from CUDA-graph replays of many calls, so launch overhead from Python is not counted),
GB/s (the bytes the call must move: weights read once, distinct experts for the MoE, activations in and out) and
its fraction of the measured HBM copy bandwidth (``bench/hardware_bandwidth.py``: a 1 GiB device-to-device
copy, bytes read + written, the figure decode_bench divides by too), TFLOP/s,
and ``vs bf16`` = BF16 time / our time (above 1: faster). Small weights are cycled through enough copies to
exceed L2, so every call reads HBM. Targets on the H200: decode (M <= 16) >= 70 % of the copy bandwidth; the
grouped MoE at prefill sizes no slower than BF16.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

from report import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MS = [1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096, 8192]
GEMV_PAST_CUT_MAX_PAIRS = 512  # the MoE group also times the decode GEMVs past their cut, up to this many pairs
L2_BYTES = 256 << 20  # cycle small weights through this many bytes of copies (H200 L2: 50 MiB)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "nvfp4_kernels.json"))
    p.add_argument("--groups", default="linear,moe,fp8,mixed")
    p.add_argument("--ms", default=None, help="comma-separated M values (default: the issue's list)")
    env_routing = os.environ.get("FREETOKEN_BENCH_ROUTING", "")
    p.add_argument("--routing", default=env_routing if env_routing not in ("", "off") else "uniform,zipf")
    p.add_argument("--reps", type=int, default=20, help="calls per timed CUDA-graph replay")
    p.add_argument(
        "--sweep-only",
        default="",
        help="sweep / bf16sweep / moesweep: only the settings whose label contains one of these '|'-separated texts "
        "(and the default), e.g. 'tail=16|down_block_k=128'",
    )
    p.add_argument(
        "--mixed-block-k", type=int, default=None, help="the mixed GEMV's K step (weights) at every size, for A/B runs"
    )
    p.add_argument(
        "--mixed-dot-sweep",
        action="store_true",
        help="also time mixed_dot under each MIXED_DOT_SWEEP setting (warps, K step, rows a program) where it runs",
    )
    a = p.parse_args(argv)
    a.groups = a.groups.split(",")
    a.routing = a.routing.split(",")
    a.ms = [int(m) for m in a.ms.split(",")] if a.ms else ([1, 3, 40] if a.smoke else MS)
    if a.smoke:
        a.reps = 1  # the interpreter runs a call in seconds
    return a


def shapes(smoke: bool) -> dict:
    """The benchmark's shapes: Qwen3.6-35B-A3B's, or tiny ones for ``--smoke``."""
    if smoke:
        return dict(
            linear={"shared gate": (40, 64), "shared down": (64, 48), "lm_head": (200, 64)},
            moe=dict(E=8, k=2, H=64, I=32),
            fp8={"in_proj_qkv": (64, 32), "out_proj": (32, 64)},
            mixed={"moe router|shared": ([("d", 9), ("d", 1), ("n", 16), ("n", 16)], 64), "o_proj": ([("f", 32)], 64)},
        )
    return dict(
        linear={"shared gate": (512, 2048), "shared down": (2048, 512), "lm_head": (248320, 2048)},
        moe=dict(E=256, k=8, H=2048, I=512),
        fp8={"in_proj_qkv": (8192, 2048), "out_proj": (2048, 4096), "attn k": (512, 2048)},
        mixed={
            "moe router|shared": ([("d", 256), ("d", 1), ("n", 512), ("n", 512)], 2048),
            "gdn in_proj": ([("f", 8192), ("f", 4096), ("d", 32), ("d", 32)], 2048),
            "attn q|k|v": ([("f", 8192), ("f", 512), ("f", 512)], 2048),
            "o_proj": ([("f", 2048)], 4096),
            "shared down": ([("n", 2048)], 512),
        },
    )


# ----------------------------------------------------------------------------------------------------------------------
# timing and the hardware
# ----------------------------------------------------------------------------------------------------------------------


def time_calls(calls, device) -> float:
    """Seconds per call of ``calls`` (a list of closures, each on its own copy of the weights). CUDA: all of them
    captured in one CUDA graph, replayed; CPU: wall clock."""
    import torch

    if device.type != "cuda":  # (the interpreter compiles nothing: no warm-up)
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls)
    for c in calls[:2]:
        c()  # compile / warm up outside any capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Bytes/s of a device copy (read + written): on CUDA ``hardware_bandwidth.measure_bandwidth`` (the figure
    every benchmark divides by), on the CPU a 64 MiB copy by the wall clock."""
    import torch

    if device.type == "cuda":
        from hardware_bandwidth import measure_bandwidth

        return measure_bandwidth()["hbm_copy_gb_s"] * 1e9
    n = 64 << 20
    src, dst = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    t = min(time_calls([lambda: dst.copy_(src)] * 3, device) for _ in range(3))
    return 2 * n / t


def copies_for(nbytes: int, smoke: bool) -> int:
    """How many copies of a weight of ``nbytes`` to cycle through so that the set exceeds L2."""
    return 1 if smoke else max(2, min(512, math.ceil(L2_BYTES / max(1, nbytes))))


def cycled(fn, items: list, reps: int) -> list:
    """``max(reps, len(items))`` calls of ``fn(item)``, cycling through ``items`` (weight copies, routings)."""
    return [lambda item=items[i % len(items)]: fn(item) for i in range(max(reps, len(items)))]


def row(group, name, M, t, nbytes, flops, bw, t_bf16, **extra) -> dict:
    r = dict(group=group, name=name, M=M, time_us=t * 1e6, gb_s=nbytes / t / 1e9, frac_hbm=nbytes / t / bw)
    r.update(tflops=flops / t / 1e12, bf16_time_us=t_bf16 * 1e6, vs_bf16=t_bf16 / t, **extra)
    return r


# ----------------------------------------------------------------------------------------------------------------------
# the groups
# ----------------------------------------------------------------------------------------------------------------------


def nvfp4_weights(n, k, copies, device):
    """``copies`` NVFP4 weights ``[n, k]`` in the ``--dummy-weight`` layout (random codes, scales in [1, 2))."""
    import torch

    from freetoken.layers.quantized_linear import fill_nvfp4_dummy

    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(copies):
        w = torch.empty(n, k // 2, dtype=torch.uint8, device=device)
        s = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn, device=device)
        s2 = torch.empty((), dtype=torch.float32, device=device)
        fill_nvfp4_dummy(w, s, s2, 0.02, g)
        out.append((w, s, s2))
    return out


def linear_cases(a, device, dtype, max_m: int):
    """Each linear shape at each M (up to ``max_m``): ``(name, M, x, weights, nbytes, flops, t_bf16)``, the
    NVFP4 weights cycled past L2 and the BF16 GEMM of the same shape timed beside them."""
    import torch

    for name, (n, k) in shapes(a.smoke)["linear"].items():
        nbytes_w = n * k // 2 + n * k // 16
        weights = nvfp4_weights(n, k, copies_for(nbytes_w, a.smoke), device)
        bf16 = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies_for(2 * n * k, a.smoke))]
        for M in [m for m in a.ms if m <= max_m]:
            if n * M > (1 << 31):  # lm_head at 8192 rows: a 4 GB output, the BF16 GEMM alone
                continue
            x = torch.randn(M, k, device=device, dtype=dtype)
            nbytes = nbytes_w + (M * k + M * n) * x.element_size()
            t_bf16 = time_calls(cycled(lambda w: torch.mm(x, w.t()), bf16, a.reps), device)
            yield name, M, x, weights, nbytes, 2 * M * n * k, t_bf16


def linear_paths(M: int, dtype) -> list:
    """The ``nvfp4_linear_triton`` paths that take ``M`` rows of x in ``dtype``."""
    import torch

    from freetoken.kernels.nvfp4_half_gemv import HALF_MAX_M

    paths = ["gemv"] if M <= 8 else []
    sixteen_bit = dtype in (torch.bfloat16, torch.float16)
    if M <= HALF_MAX_M and sixteen_bit:
        paths.append("half")
    return paths + ["dot"] + (["half_dot"] if sixteen_bit else [])


def bench_linear(a, device, dtype, bw) -> list:
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton, pick_path

    rows = []
    for name, M, x, weights, nbytes, flops, t_bf16 in linear_cases(a, device, dtype, max(a.ms)):
        for path in linear_paths(M, dtype):
            t = time_calls(cycled(lambda w, p=path: nvfp4_linear_triton(x, *w, path=p), weights, a.reps), device)
            w0 = weights[0][0]
            auto = path == pick_path(M, w0.shape[0], 2 * w0.shape[1], x.dtype)
            rows.append(row("linear", name, M, t, nbytes, flops, bw, t_bf16, path=path, auto=auto))
    return rows


# launch settings --groups sweep times beside the default pick ({} = the default), per path
# (the 2026-12-02 H200 sweeps moved the defaults to tile 8192, and 32 rows on 2 warps for M <= 16; these are their
# neighbours)
SWEEP = {
    "gemv": [{}, {"tile": 16384}, {"stages": 4}, {"tile": 4096}],
    # the half GEMV's times are bimodal in the tile's shape (2026-12-04): rows x words neighbours of the defaults
    "half": [
        {},
        {"tile": 8192, "words": 32},
        {"tile": 16384, "words": 64},
        {"tile": 8192, "words": 64},
        {"tile": 16384, "words": 32},
        {"stages": 4},
        {"warps": 8},
    ],
    # the fp16 tiles (2026-12-04): 2 warps of mma.sync at 16 rows of x; wider tiles, deeper K, wgmma at 4 warps.
    # 128 weight rows a program halve the x bytes each weight byte brings from L2 (at 16 rows of x the x tile of a K
    # step is as large as the weight tile; 124-150 registers, no spills, sm_90). The K step went 128 -> 256 on the
    # 2026-12-06 H100 sweep (83-84 % of HBM against 68-70 %): its neighbours
    "half_dot": [
        {},
        {"block_k": 128},
        {"block_n": 32},
        {"block_n": 128},
        {"block_n": 128, "warps": 4},
        {"stages": 2},
        {"stages": 4},
        {"block_n": 32, "block_k": 512, "warps": 4},
        # programs walking 2-8 N tiles in one pipelined loop (written 2026-12-07 without a GPU): lm_head's K is 8
        # steps of 256, so a one-tile program spends a fair share of its life filling and draining its pipeline.
        # At 5, lm_head's 3,880 tiles make 776 programs: one wave at 6 programs an SM (sm_90, 35 KiB of shared
        # memory each)
        {"walk": 2},
        {"walk": 4},
        {"walk": 5},
        {"walk": 8},
    ],
    "dot": [
        {},
        {"block_n": 16, "warps": 1},
        {"block_n": 64, "warps": 2},
        {"block_n": 32, "warps": 1},
        {"block_k": 256},
        {"stages": 4},
        {"block_n": 64, "warps": 4},
    ],
}


def bench_sweep(a, device, dtype, bw) -> list:
    """The linear shapes at decode sizes (M <= 16) under each of ``SWEEP``'s launch settings: where the default
    pick leaves bandwidth behind (the issue's target: >= 70 % of HBM at M = 1..16)."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton

    rows = []
    for name, M, x, weights, nbytes, flops, t_bf16 in linear_cases(a, device, dtype, 16):
        for path in linear_paths(M, dtype):
            for tune in SWEEP[path]:
                label = ",".join(f"{key}{v}" for key, v in tune.items()) or "default"
                if tune and not sweep_selected(label, a.sweep_only):
                    continue
                call = lambda w, p=path, c=tune: nvfp4_linear_triton(x, *w, path=p, tune=c)  # noqa: E731
                t = time_calls(cycled(call, weights, a.reps), device)
                rows.append(row("sweep", f"{name} {path} {label}", M, t, nbytes, flops, bw, t_bf16))
    return rows


# launch settings --groups moesweep times ({} = the default, grouped_config)
MOE_SWEEP = [
    {},
    {"fuse_gate_up": True},
    {"fuse_gate_up": True, "gu_block_n": 32},
    {"fuse_gate_up": True, "gu_block_k": 64},
    {"fuse_gate_up": True, "stages": 4},
    {"fuse_gate_up": True, "block_m": 64, "warps": 4},
    {"gu_block_k": 64, "down_block_k": 64},
    {"block_m": 64, "warps": 4},
    {"down_block_n": 64},
    {"stages": 2},
    # tail row tiles (nvfp4_moe's TAIL, written 2026-12-05 without a GPU): an expert of up to block_m + tail rows
    # decodes its weight tiles once (64-row blocks decode them twice for 65-80 rows)
    {"tail": 16},
    {"tail": 32},
    {"block_m": 64, "warps": 4, "tail": 16},
    # the down kernel's K step: 64 weights on blocks of 64 rows and more since 2026-12-05 (H100 and H200: 4-10 %
    # faster from 1k to 8k tokens; 128 with a tail tile spills on sm_90): 128, the former default, for the A/B
    {"down_block_k": 128},
    # (256-row blocks, each weight tile decoded once at 8,192 tokens, measured no faster there on the H100 and 3-12x
    # slower below: dropped, bench/results/2026-12-05-h100-qwen3.6-35b-a3b-nvfp4-moesweep-down-k64.txt)
    # down programs walking N tiles in one pipelined loop (nvfp4_moe._nvfp4_down_walk_rows): a one-tile program
    # streams only 36 KiB of codes and scales. H100 2026-12-05 night: no gain at 2,048 tokens, 5-7 % slower at 8,192
    {"down_walk": 2},
    {"down_walk": 4},
    {"down_walk": 16},
    {"down_walk": 4, "stages": 4},
]


def sweep_selected(label: str, only: str) -> bool:
    """Whether a sweep setting's label is among ``--sweep-only``'s '|'-separated texts (all when it is empty)."""
    return not only or any(part in label for part in only.split("|"))


def bench_moe_sweep(a, device, dtype, bw) -> list:
    """The grouped NVFP4 kernel at prefill sizes under each of ``MOE_SWEEP``'s launch settings (the issue's target:
    no slower than BF16), uniform routing."""
    import torch

    from freetoken.kernels.nvfp4_moe import nvfp4_fused_moe_triton
    from freetoken.layers.moe import run_experts

    s = shapes(a.smoke)["moe"]
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    bank, (w13, w2) = moe_banks(s, device, dtype)
    expert_bytes = 3 * H * I // 2 + 3 * H * I // 16 + 4 * (2 * I + H)
    rows = []
    for T in [m for m in a.ms if m * k > 64] or a.ms[-1:]:
        x = torch.randn(T, H, device=device, dtype=dtype)
        reps = max(1, a.reps // 4)
        routes = [_routing("uniform", T, E, k, device) for _ in range(reps)]
        distinct = statistics.mean(int(torch.unique(ids).numel()) for ids, _ in routes)
        nbytes = distinct * expert_bytes + 2 * T * H * x.element_size()
        flops = 6 * T * k * H * I
        t_bf16 = time_calls(cycled(lambda r: run_experts("triton", x, w13, w2, *r), routes, reps), device)
        for tune in MOE_SWEEP:
            label = ",".join(f"{key}={v}" for key, v in tune.items()) or "default"
            if tune and not sweep_selected(label, a.sweep_only):
                continue
            call = lambda r, c=tune: nvfp4_fused_moe_triton(x, *bank, *r, tune=c)  # noqa: E731
            try:
                t = time_calls(cycled(call, routes, reps), device)
            except Exception as e:  # a setting that does not compile (registers, shared memory) is reported
                print(f"moesweep M={T} {label}: {type(e).__name__}: {str(e)[:160]}")
                continue
            rows.append(row("moesweep", f"grouped {label}", T, t, nbytes, flops, bw, t_bf16, kernel=""))
    return rows


# launch settings --groups bf16sweep times ({} = the default, fused_moe.grouped_bf16_config)
BF16_MOE_SWEEP = [
    {},
    {"block_m": 128, "warps": 8},
    {"block_m": 32},
    {"warps": 8},
    {"stages": 4},
    {"stages": 3, "warps": 8},
    {"gu_block_n": 128, "down_block_n": 128, "warps": 8},
    {"gu_block_k": 128, "down_block_k": 128, "stages": 3},
    {"down_block_n": 128, "down_block_k": 128, "warps": 8, "stages": 3},
    {"block_m": 128, "gu_block_n": 128, "down_block_n": 128, "warps": 8, "stages": 3},
    # the down kernel alone (gate|up as the default): it streamed its weights at ~55 % of HBM where gate|up
    # reached ~80 % (agent turn, 2026-12-03 night profile)
    {"down_block_n": 128},
    {"down_block_n": 128, "down_warps": 8},
    {"down_block_n": 256, "down_warps": 8},
    {"down_block_k": 128},
    {"down_block_k": 32},
    {"down_stages": 4},
    {"down_stages": 2},
    {"down_block_n": 128, "down_block_k": 128, "down_warps": 8, "down_stages": 2},
    # large tiles for long chunks (8k tokens: ~256 rows an expert), where 64 x 64 tiles ran ~210 TFLOP/s
    {"block_m": 128, "gu_block_n": 128, "down_block_n": 128, "warps": 8, "stages": 4},
    {"block_m": 64, "gu_block_n": 128, "down_block_n": 128, "warps": 4, "stages": 4},
    {"block_m": 128, "gu_block_n": 64, "down_block_n": 128, "warps": 4, "stages": 3},
    # tail row tiles (fused_moe's TAIL, written 2026-12-05 without a GPU): an expert of 65-80 rows (the agent turn's
    # ~68) in one program reading each weight tile once, where 64-row blocks take two and 128-row blocks pad 60
    {"tail": 16},
    {"tail": 16, "warps": 8},
    {"tail": 32},
    {"tail": 32, "warps": 8},
    {"block_m": 32, "tail": 32},
    {"tail": 16, "down_warps": 8},
    {"block_m": 128, "gu_block_n": 128, "down_block_n": 256, "warps": 8, "down_stages": 3, "stages": 3},
    # down programs walking N tiles in one pipelined loop (fused_moe._down_walk_rows, 4 pipeline stages unless set):
    # the next tile's weights stream while this tile's rows are stored. H100 2026-12-05 night: a walk of 4 ran
    # 1.02-1.08x of one tile a program, but the served session did not move (2026-12-06): the default stays one tile
    {"down_walk": 2},
    {"down_walk": 4},
    {"down_walk": 16},
    {"down_walk": 4, "down_stages": None},
    {"down_walk": 8, "down_block_n": 64},
    {"down_walk": 4, "down_warps": 8},
]


def prefill_moe_cases(a, s, device, dtype):
    """The grouped MoE's prefill cases of ``bf16sweep`` and ``grouped_mm``: per routing and token count (the ``--ms``
    with more than 64 pairs), ``(mode, T, x, reps, routes, distinct, nbytes, flops)``: ``reps`` routings drawn for
    the timed calls, the mean number of distinct experts they touch, the bytes a call must move (the distinct
    experts' BF16 weights once, activations in and out) and its FLOPs."""
    import torch

    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    for mode in a.routing:
        for T in [m for m in a.ms if m * k > 64] or a.ms[-1:]:
            x = torch.randn(T, H, device=device, dtype=dtype)
            reps = max(1, a.reps // 4)
            routes = [_routing(mode, T, E, k, device) for _ in range(reps)]
            distinct = statistics.mean(int(torch.unique(ids).numel()) for ids, _ in routes)
            nbytes = distinct * 3 * H * I * x.element_size() + 2 * T * H * x.element_size()
            yield mode, T, x, reps, routes, distinct, nbytes, 6 * T * k * H * I


def bench_bf16_moe_sweep(a, device, dtype, bw) -> list:
    """The BF16 grouped kernels (``fused_moe_triton``, what ``--moe-backend fused`` runs at prefill) at prefill
    sizes under each of ``BF16_MOE_SWEEP``'s launch settings, per routing: where the default leaves the HBM
    bandwidth behind (bytes: the distinct experts' BF16 weights once, activations in and out)."""
    from freetoken.kernels.fused_moe import fused_moe_triton

    s = shapes(a.smoke)["moe"]
    _, (w13, w2) = moe_banks(s, device, dtype)
    rows = []
    for mode, T, x, reps, routes, distinct, nbytes, flops in prefill_moe_cases(a, s, device, dtype):
        t_default = None
        for tune in BF16_MOE_SWEEP:
            label = ",".join(f"{key}={v}" for key, v in tune.items()) or "default"
            if tune and not sweep_selected(label, a.sweep_only):
                continue
            call = lambda r, c=tune: fused_moe_triton(x, w13, w2, *r, tune=c)  # noqa: E731
            try:
                t = time_calls(cycled(call, routes, reps), device)
            except Exception as e:  # a setting that does not compile (registers, shared memory) is reported
                print(f"bf16sweep M={T} {label}: {type(e).__name__}: {str(e)[:160]}")
                continue
            t_default = t_default or t  # "vs bf16" here: the default setting's time over this one's
            rows.append(row("bf16sweep", f"bf16 {mode} {label}", T, t, nbytes, flops, bw, t_default,
                            distinct_experts=distinct))  # fmt: skip
    return rows


def bench_grouped_mm(a, device, dtype, bw) -> list:
    """``--groups grouped_mm``: the library route against our grouped kernels at prefill sizes (bytes as
    ``bench_bf16_moe_sweep`` counts them)."""
    import torch

    from freetoken.kernels.fused_moe import fused_moe_triton
    from freetoken.kernels.moe_grouped_mm import fused_moe_grouped_mm, grouped_mm_supported, sort_pairs_by_expert

    s = shapes(a.smoke)["moe"]
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    _, (w13, w2) = moe_banks(s, device, dtype)
    if not grouped_mm_supported(torch.empty(1, H, dtype=dtype, device=device), w13, w2):
        print(f"grouped_mm: torch._grouped_mm does not take {dtype} on {device} (torch {torch.__version__})")
        return []
    rows = []
    for mode, T, x, reps, routes, distinct, nbytes, flops in prefill_moe_cases(a, s, device, dtype):
        diff = (fused_moe_grouped_mm(x, w13, w2, *routes[0]) - fused_moe_triton(x, w13, w2, *routes[0])).abs()
        t_triton = time_calls(cycled(lambda r: fused_moe_triton(x, w13, w2, *r), routes, reps), device)
        t_lib = time_calls(cycled(lambda r: fused_moe_grouped_mm(x, w13, w2, *r), routes, reps), device)
        # the two GEMMs alone, on rows already gathered in expert order
        sorted_routes = []
        for ids, _ in routes:
            order, ends, _ = sort_pairs_by_expert(ids, E)
            inter = torch.randn(T * k, I, device=device, dtype=dtype)
            sorted_routes.append((x.index_select(0, order // k), ends, inter))

        def gemms(r):
            xs, ends, inter = r
            torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
            torch._grouped_mm(inter, w2.transpose(1, 2), offs=ends)

        t_gemms = time_calls(cycled(gemms, sorted_routes, reps), device)
        extra = dict(distinct_experts=distinct, max_diff_vs_triton=diff.max().item())
        rows.append(row("grouped_mm", f"bf16 {mode} triton", T, t_triton, nbytes, flops, bw, t_triton, **extra))
        rows.append(row("grouped_mm", f"bf16 {mode} grouped_mm", T, t_lib, nbytes, flops, bw, t_triton, **extra))
        rows.append(row("grouped_mm", f"bf16 {mode} 2 GEMMs", T, t_gemms, nbytes, flops, bw, t_triton, **extra))
        print(f"grouped_mm {mode} M={T}: largest |grouped_mm - triton| {extra['max_diff_vs_triton']:.3g}")
    return rows


# launch settings --groups decsweep times ({} = the default, nvfp4_moe.decode_config)
DECODE_SWEEP = [
    {},
    {"gu_half": True},  # the gate|up GEMV in packed half precision (the default from 64 pairs)
    {"gu_half": False},
    {"gu_half": True, "gu_block_w": 32},
    {"down_half": True},  # the down GEMV in packed half precision (the default from 64 pairs)
    {"down_half": False},
    {"down_half": True, "down_block_w": 32},
    {"tile_pairs": False},  # the down kernel's pairs one after another (the default before 2026-12-03)
    {"down_block_n": 4},
    {"down_block_n": 16},
    {"down_warps": 8},
    {"gu_block_n": 8},
    {"gu_block_w": 32},
    {"gu_warps": 2},
    {"stages": 4},
]


def bench_decode_sweep(a, device, dtype, bw) -> list:
    """The NVFP4 MoE decode GEMVs (``nvfp4_moe_decode_triton``, with the shared expert's NVFP4 down projection in
    the down kernel's epilogue, as an NVFP4 Qwen3.6 layer runs it) at decode sizes under each of ``DECODE_SWEEP``'s
    launch settings, uniform routing; plus the default without the shared expert (what the epilogue costs). The
    issue's target: >= 70 % of HBM."""
    import torch

    from freetoken.kernels.nvfp4_moe import DECODE_MAX_PAIRS, nvfp4_moe_decode_triton
    from freetoken.layers.moe import run_experts
    from freetoken.quant.nvfp4 import Nvfp4Tensor

    s = shapes(a.smoke)["moe"]
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    Is = I  # Qwen3.6's shared expert is one more expert's size
    bank, (w13, w2) = moe_banks(s, device, dtype)
    sd_w, sd_s, sd_s2 = nvfp4_weights(H, Is, 1, device)[0]
    shared_down = Nvfp4Tensor(sd_w, sd_s, sd_s2)
    expert_bytes = 3 * H * I // 2 + 3 * H * I // 16 + 4 * (2 * I + H)
    rows = []
    for T in [m for m in a.ms if m * k <= DECODE_MAX_PAIRS]:
        x = torch.randn(T, H, device=device, dtype=dtype)
        gu = torch.randn(T, 1 + 2 * Is, device=device, dtype=dtype)  # [gate logit | gate|up] of the fused projection
        shared = dict(shared_gate=gu[:, :1], shared_gate_up=gu[:, 1:], shared_down_nvfp4=shared_down)
        routes = [_routing("uniform", T, E, k, device) for _ in range(a.reps)]
        distinct = statistics.mean(int(torch.unique(ids).numel()) for ids, _ in routes)
        # the routed experts, the shared expert's down weight, activations in and out
        nbytes = distinct * expert_bytes + H * Is * 9 // 16 + 4 + 2 * T * H * x.element_size()
        flops = 6 * T * k * H * I + 2 * T * H * Is
        t_bf16 = time_calls(cycled(lambda r: run_experts("triton", x, w13, w2, *r), routes, a.reps), device)
        for tune in DECODE_SWEEP + [None]:
            label = ",".join(f"{key}={v}" for key, v in (tune or {}).items()) or "default"
            kw = shared if tune is not None else {}
            if tune is None:
                label = "default, no shared expert"
            call = lambda r, c=tune, kw=kw: nvfp4_moe_decode_triton(x, *bank, *r, tune=c, **kw)  # noqa: E731
            try:
                t = time_calls(cycled(call, routes, a.reps), device)
            except Exception as e:  # a setting that does not compile (registers, shared memory) is reported
                print(f"decsweep M={T} {label}: {type(e).__name__}: {str(e)[:160]}")
                continue
            rows.append(row("decsweep", f"decode {label}", T, t, nbytes, flops, bw, t_bf16, distinct_experts=distinct))
    return rows


def _routing(mode, T, E, k, device):
    """Expert ids ``[T, k]`` drawn as ``moe/bench_routing.py`` draws them (``mode`` uniform or zipf) and weights."""
    import torch

    from freetoken.moe import bench_routing

    bench_routing.set_mode(mode)
    ids = bench_routing.override(torch.zeros(T, k, dtype=torch.int64, device=device), 0, E)
    bench_routing.set_mode("off")
    w = torch.rand(T, k, device=device)
    return ids, w / w.sum(-1, keepdim=True)


def moe_banks(s, device, dtype):
    """An NVFP4 bank (``--dummy-weight`` layout) and a BF16 bank of the same experts' shapes."""
    import torch

    from freetoken.layers.nvfp4_experts import Nvfp4Experts

    ex = Nvfp4Experts(s["E"], s["H"], s["I"], device=device)
    ex.fill_dummy(0.02, torch.Generator(device=device).manual_seed(0))
    w13 = torch.randn(s["E"], 2 * s["I"], s["H"], device=device, dtype=dtype) * 0.02
    w2 = torch.randn(s["E"], s["H"], s["I"], device=device, dtype=dtype) * 0.02
    return ex.bank(), (w13, w2)


def bench_moe(a, device, dtype, bw) -> list:
    import torch

    from freetoken.kernels.nvfp4_dequant import nvfp4_dequant_moe
    from freetoken.kernels.nvfp4_moe import (
        DECODE_MAX_PAIRS,
        grouped_config,
        grouped_half,
        nvfp4_fused_moe_triton,
        nvfp4_moe_decode_triton,
        pick_nvfp4_block_m,
    )
    from freetoken.layers.moe import run_experts
    from freetoken.layers.nvfp4_experts import DEQUANT_MIN_PAIRS, run_nvfp4_experts

    s = shapes(a.smoke)["moe"]
    E, k, H, I = s["E"], s["k"], s["H"], s["I"]
    bank, (w13, w2) = moe_banks(s, device, dtype)
    expert_bytes = 3 * H * I // 2 + 3 * H * I // 16 + 4 * (2 * I + H)  # codes, block scales, per-row globals
    rows = []
    for mode in a.routing:
        for T in a.ms:
            x = torch.randn(T, H, device=device, dtype=dtype)
            # a fresh routing per call: a decode step's few experts would otherwise stay in L2 from the last call
            reps = max(1, a.reps if T * k <= 64 else a.reps // 4)
            routes = [_routing(mode, T, E, k, device) for _ in range(reps)]
            distinct = statistics.mean(int(torch.unique(ids).numel()) for ids, _ in routes)
            nbytes = distinct * expert_bytes + 2 * T * H * x.element_size()
            t_bf16 = time_calls(cycled(lambda r: run_experts("triton", x, w13, w2, *r), routes, reps), device)
            flops = 6 * T * k * H * I
            name = f"experts {mode}"
            if T * k <= DECODE_MAX_PAIRS:  # the decode GEMVs
                t = time_calls(cycled(lambda r: run_nvfp4_experts(x, bank, *r), routes, reps), device)
                rows.append(row("moe", name, T, t, nbytes, flops, bw, t_bf16, distinct_experts=distinct))
                continue
            if T * k <= GEMV_PAST_CUT_MAX_PAIRS:  # the decode GEMVs past their cut: where the cut should sit
                t = time_calls(cycled(lambda r: nvfp4_moe_decode_triton(x, *bank, *r), routes, reps), device)
                rows.append(row("moe", f"{name} gemv", T, t, nbytes, flops, bw, t_bf16, distinct_experts=distinct))
            # every grouped path, each timed by itself; * marks the one run_nvfp4_experts takes at this size
            picked_dequant = T * k >= DEQUANT_MIN_PAIRS
            bm = pick_nvfp4_block_m(T * k, E)
            paths = [(f"grouped bm{bm}", bm, not picked_dequant)]
            if bm != 64:
                paths.append(("grouped bm64", 64, False))
            for label, block_m, picked in paths:
                # the weight tiles the default takes at this size (``grouped_half``)
                half = grouped_half(grouped_config(T * k, E, H, I, block_m), x.dtype, None)
                label += " fp16 tiles" if half else ""
                t = time_calls(
                    cycled(lambda r: nvfp4_fused_moe_triton(x, *bank, *r, block_m=block_m), routes, reps), device
                )
                rows.append(
                    row("moe", f"{name} {label}{'*' if picked else ''}", T, t, nbytes, flops, bw, t_bf16,
                        distinct_experts=distinct)
                )  # fmt: skip
            # the bank dequantized, then the BF16 kernel (reads and writes the whole bank: distinct = E)
            t_deq = time_calls(cycled(lambda r: nvfp4_dequant_moe(x, *bank, *r), routes, reps), device)
            rows.append(
                row("moe", f"{name} dequant{'*' if picked_dequant else ''}", T, t_deq, nbytes, flops, bw, t_bf16,
                    distinct_experts=E)
            )  # fmt: skip
    return rows


def bench_fp8(a, device, dtype, bw) -> list:
    import torch

    from freetoken.kernels.fp8_linear import fp8_linear, scaled_mm_supported
    from freetoken.quant import fp8

    rows = []
    for name, (n, k) in shapes(a.smoke)["fp8"].items():
        wq, ws = fp8.quantize(torch.randn(n, k, device=device) * 0.02)
        x_scale = torch.tensor(0.01, device=device)
        wb = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies_for(2 * n * k, a.smoke))]
        wqs = [wq.clone() for _ in range(copies_for(n * k, a.smoke))]
        for M in a.ms:
            x = torch.randn(M, k, device=device, dtype=dtype)
            kernel = "scaled_mm" if scaled_mm_supported(x, wq) else "reference"
            nbytes = n * k + (M * k + M * n) * x.element_size()
            t = time_calls(cycled(lambda q: fp8_linear(x, q, ws, x_scale), wqs, a.reps), device)
            t_bf16 = time_calls(cycled(lambda w: torch.mm(x, w.t()), wb, a.reps), device)
            rows.append(row("fp8", name, M, t, nbytes, 2 * M * n * k, bw, t_bf16, kernel=kernel))
    return rows


def mixed_projection(spec, k, device, dtype, seed):
    """A layer as the model has it for ``spec`` (``[(format letter d/f/n, rows), ...]``, ``--dummy-weight``
    values): a fused projection of the parts, or the lone quantized Linear. Returns ``(module, per-part call)``."""
    import torch

    from freetoken.layers.fused_linear import fuse_linears
    from freetoken.layers.quantized_linear import Fp8Linear, Nvfp4Linear

    g = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for f, n in spec:
        if f == "d":
            p = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
            torch.nn.init.normal_(p.weight, 0.0, 0.02, generator=g)
        else:
            p = (Fp8Linear if f == "f" else Nvfp4Linear)(k, n, dtype=dtype, device=device)
            p.fill_dummy(0.02, g)
        parts.append(p)
    if len(parts) == 1:
        lone = parts[0]
        if isinstance(lone, Fp8Linear):  # what ran before: the W8A8 GEMM with its quantization
            from freetoken.kernels.fp8_linear import fp8_linear

            return lone, lambda x: fp8_linear(x, lone.weight, lone.weight_scale, lone.input_scale)
        from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton

        return lone, lambda x: nvfp4_linear_triton(x, lone.weight, lone.weight_scale, lone.weight_scale_2)
    fused = fuse_linears(*parts)
    return fused, fused.forward_parts


def lone_rows(layer):
    """The ``MixedRows`` a lone quantized Linear's forward builds (the kernels' dispatch reads them)."""
    from freetoken.kernels.mixed_gemv import MixedRows
    from freetoken.layers.quantized_linear import Fp8Linear

    if isinstance(layer, Fp8Linear):
        return MixedRows(layer.in_features, fp8_weight=layer.weight, fp8_scale=layer.weight_scale)
    return MixedRows(
        layer.in_features, nvfp4_weight=layer.weight, nvfp4_scale=layer.weight_scale, nvfp4_global=layer.weight_scale_2
    )


# launch settings of kernels/mixed_dot.py the --mixed-dot-sweep times: (warps, weights a K step (None: the
# kernel's rule), most rows a program). The last two test a suspect (2026-12-05, from the sm_90 builds alone): GDN
# in_proj's 386 programs of 32 rows (~3 an SM) leave ~6 warps an SM to hide the FP8 conversions' latency. With each
# projection compiling only its formats (mixed_gemv.format_flags) its programs take 118 registers and 32 KB at
# 256-weight steps, so 16-row programs (772, ~6 an SM: 96 registers, 24 KB) now fit beside each other
MIXED_DOT_SWEEP = [
    (2, None, 64),
    (4, None, 64),
    (2, 128, 64),
    (2, 256, 64),
    (2, None, 32),
    (2, 512, 16),
    (2, 256, 16),
    (2, 128, 32),
    (2, 128, 16),
]


def time_mixed_dot_settings(a, layers, x, device) -> list:
    """``[(label, us)]``: the layer path under each ``MIXED_DOT_SWEEP`` setting (the module's launch constants set
    for the call, then restored)."""
    from freetoken.kernels import mixed_dot

    saved = mixed_dot._WARPS, mixed_dot._BLOCK_K, mixed_dot._MAX_BLOCK_N
    out = []
    try:
        for warps, bk, bn in MIXED_DOT_SWEEP:
            mixed_dot._WARPS, mixed_dot._BLOCK_K, mixed_dot._MAX_BLOCK_N = warps, bk, bn
            t = time_calls(cycled(lambda layer: layer[0](x), layers, a.reps), device)
            out.append((f"mixed dot warps={warps},block_k={bk},block_n<={bn}", t))
    finally:
        mixed_dot._WARPS, mixed_dot._BLOCK_K, mixed_dot._MAX_BLOCK_N = saved
    return out


def bench_mixed(a, device, dtype, bw) -> list:
    import torch

    from freetoken.kernels import mixed_dot

    if a.mixed_block_k:
        from freetoken.kernels import mixed_gemv

        mixed_gemv._block_k = lambda block_n: a.mixed_block_k

    bytes_per = {"d": 2.0, "f": 1.0, "n": 0.5625}
    rows = []
    for name, (spec, k) in shapes(a.smoke)["mixed"].items():
        n = sum(r for _, r in spec)
        nbytes_w = int(sum(bytes_per[f] * r * k for f, r in spec))
        layers = [mixed_projection(spec, k, device, dtype, i) for i in range(copies_for(nbytes_w, a.smoke))]
        bf16 = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(copies_for(2 * n * k, a.smoke))]
        for M in [m for m in a.ms if m <= mixed_dot.MAX_M]:
            x = torch.randn(M, k, device=device, dtype=dtype)
            fused = hasattr(layers[0][0], "mixed")  # a lone Linear takes the GEMV only (quantized_linear.py)
            mixed = layers[0][0].mixed if fused else lone_rows(layers[0][0])
            kernel = mixed_dot.mixed_kernel(x, mixed) if fused else mixed_dot.use_mixed_gemv(x, mixed) or None
            kernel = mixed_dot.mixed_gemv_triton if kernel is True else kernel
            nbytes = nbytes_w + (M * k + M * n) * x.element_size()
            t_bf16 = time_calls(cycled(lambda w: torch.mm(x, w.t()), bf16, a.reps), device)
            t_mixed = time_calls(cycled(lambda layer: layer[0](x), layers, a.reps), device)
            t_parts = time_calls(cycled(lambda layer: layer[1](x), layers, a.reps), device)
            flops = 2 * M * n * k
            label = {mixed_dot.mixed_gemv_triton: "mixed gemv", mixed_dot.mixed_dot_triton: "mixed dot"}.get(kernel)
            rows.append(
                row("mixed", name, M, t_mixed, nbytes, flops, bw, t_bf16, kernel=label or "per part (layer)",
                    vs_parts=t_parts / t_mixed)
            )  # fmt: skip
            rows.append(row("mixed", name, M, t_parts, nbytes, flops, bw, t_bf16, kernel="per part"))
            if a.mixed_dot_sweep and kernel is mixed_dot.mixed_dot_triton:
                for label, t in time_mixed_dot_settings(a, layers, x, device):
                    rows.append(row("mixed", name, M, t, nbytes, flops, bw, t_bf16, kernel=label))
            if not fused and mixed_dot.use_mixed_dot(x, mixed):  # what the lone Linear leaves out, timed
                t_dot = time_calls(cycled(lambda layer: mixed_dot.mixed_dot_triton(x, lone_rows(layer[0])), layers,
                                          a.reps), device)  # fmt: skip
                rows.append(row("mixed", name, M, t_dot, nbytes, flops, bw, t_bf16, kernel="mixed dot (not taken)"))
    return rows


# ----------------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------------


def print_rows(rows: list, bw: float) -> None:
    print(f"HBM copy bandwidth: {bw / 1e9:.0f} GB/s (read + write of a device copy)")
    group = None
    for r in rows:
        if r["group"] != group:
            group = r["group"]
            print(f"\n{group:42s} {'M':>5s} {'time us':>10s} {'GB/s':>8s} {'%HBM':>6s} {'TFLOP/s':>8s} {'vs bf16':>8s}")
        tag = r.get("path", "") + ("*" if r.get("auto") else "") if "path" in r else r.get("kernel", "")
        if "distinct_experts" in r:
            tag = f"{r['distinct_experts']:.0f} experts"
        label = f"{r['name']} {tag}".strip()
        print(
            f"{label:42s} {r['M']:5d} {r['time_us']:10.1f} {r['gb_s']:8.0f} {100 * r['frac_hbm']:5.0f}% "
            f"{r['tflops']:8.1f} {r['vs_bf16']:7.2f}x"
        )
    print("\n(* the path nvfp4_linear / run_nvfp4_experts takes at that M; vs bf16 = BF16 time / ours)")


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles anything
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's bf16 tl.dot is wrong
    bw = copy_bandwidth(device)
    rows = []
    for group, fn in (
        ("linear", bench_linear),
        ("moe", bench_moe),
        ("fp8", bench_fp8),
        ("mixed", bench_mixed),
        ("sweep", bench_sweep),
        ("moesweep", bench_moe_sweep),
        ("decsweep", bench_decode_sweep),
        ("bf16sweep", bench_bf16_moe_sweep),
        ("grouped_mm", bench_grouped_mm),
    ):
        if group in a.groups:
            rows += fn(a, device, dtype, bw)
    print_rows(rows, bw)
    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__)
    from freetoken.kernels.pdl import pdl_mode

    info["pdl"] = pdl_mode()  # programmatic dependent launch (kernels/pdl.py; sm_90+ only)
    result = dict(info, smoke=a.smoke, hbm_copy_gb_s=bw / 1e9, rows=rows)
    write_report(a.out, result)
    return result


if __name__ == "__main__":
    main()
