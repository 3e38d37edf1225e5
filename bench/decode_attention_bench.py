"""The Triton split-K decode attention (``kernels/attention.py``: stage 1 per (sequence, KV head, split), stage 2
merging the splits) at Qwen3.6-35B-A3B's attention shape (16 query heads, 2 KV heads, head dim 256, bf16, page size
1, the KV slots scattered) over decode steps a server runs: batch 1, 8 and 32 at short and long contexts, each with
the split count its CUDA graph was captured with (``pick_num_kv_splits`` of the server's ``--max-seq-len-override``,
not of the step's context: a graph serves every context) beside other split counts and stage-1 tiles
(``--configs``). Why: the batch-1 profile of 2026-12-03 shows stage 1 at ~22 us a layer for a 512-token context
(1 MB of KV; ``...-nvfp4-profile-decode-bs1-down-tiled.txt``), against ~10 us at batch 32 over 64 tokens.

Per case and config: us per call (both stages, ``nvfp4_kernel_bench.time_calls``: CUDA-graph replays of many calls, so
no host launch time is counted), the KV bytes read over it as GB/s and as a fraction of the measured HBM copy
bandwidth, and the largest difference from the torch reference. Beside them, torch's ``scaled_dot_product_attention``
(``--baselines``) over the same keys stored contiguously (no page table: a bound for what a library kernel gives, not
a drop-in). Writes JSON.

    python bench/decode_attention_bench.py --out bench/out/decode_attention.json      # CUDA
    python bench/decode_attention_bench.py --smoke                                    # CPU, interpreter, tiny
"""

from __future__ import annotations

import argparse
import os
import sys

from report import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (batch, context of every sequence, --max-seq-len-override the graph's split count is picked for)
CASES = [(1, 512, 32768), (1, 4096, 32768), (1, 30000, 32768), (8, 4096, 32768), (32, 64, 4096), (32, 4096, 32768)]
SMOKE_CASES = [(1, 40, 512), (3, 70, 256)]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument(
        "--configs",
        default="graph,s1,s4,s8,s16,graph:n64,graph:n16,graph:w2,graph:w8,graph:st1,s8:n64",
        help="sN: N splits, graph: the graph's split count; :nB stage 1's BLOCK_N, :wW warps, :stS stages",
    )
    ap.add_argument("--baselines", default="sdpa-flash,sdpa-efficient,sdpa-cudnn")
    ap.add_argument("--reps", type=int, default=50, help="calls per timed CUDA-graph replay (CUDA)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "decode_attention.json"))
    return ap.parse_args(argv)


def parse_config(name: str, graph_splits: int, max_len_splits: int) -> tuple[int, dict]:
    """``graph:n64,w8`` -> (splits, stage-1 overrides); split counts are capped by what the context allows."""
    head, _, rest = name.partition(":")
    splits = graph_splits if head == "graph" else int(head.removeprefix("s"))
    cfg = {}
    for part in filter(None, rest.split(",")):
        key = {"n": "block_n", "w": "warps", "st": "stages"}["st" if part.startswith("st") else part[0]]
        cfg[key] = int(part.removeprefix("st") if part.startswith("st") else part[1:])
    return max(1, min(splits, max_len_splits)), cfg


def sdpa_decode(q, k, v, backend: str):
    """One query per sequence over contiguous keys ``[B, nkv, ctx, D]`` through ``scaled_dot_product_attention``."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend.removeprefix("sdpa-")]  # fmt: skip
    with sdpa_kernel([which]):
        return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)[:, :, 0]


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles anything
    sys.path.insert(0, os.path.join(ROOT, "python"))
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import torch
    from nvfp4_kernel_bench import copy_bandwidth, time_calls

    from freetoken.kernels.attention import decode_attention_torch, decode_attention_triton, pick_num_kv_splits

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    nh, nkv, D = (16, 2, 256) if not a.smoke else (4, 2, 32)
    bw = copy_bandwidth(device) / 1e9 if device.type == "cuda" else None  # GB/s
    reps = a.reps if device.type == "cuda" else 1  # the interpreter runs a call in seconds
    rows = []
    for B, ctx, max_len in SMOKE_CASES if a.smoke else CASES:
        g = torch.Generator(device="cpu").manual_seed(B * 100003 + ctx)
        total = B * ctx + 8
        kc = torch.randn(total, nkv, D, generator=g).to(device, dt)
        vc = torch.randn(total, nkv, D, generator=g).to(device, dt)
        r2t = torch.randperm(total, generator=g)[: B * ctx].view(B, ctx).to(device, torch.int32)  # scattered slots
        q = torch.randn(B, nh, D, generator=g).to(device, dt)
        r = torch.arange(B, dtype=torch.int32, device=device)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        scale = D**-0.5
        ref = decode_attention_torch(q, kc, vc, r2t, r, lens, scale).float()
        kv_bytes = B * ctx * nkv * 2 * D * kc.element_size()
        graph_splits = pick_num_kv_splits(B, nkv, max_len)
        max_len_splits = max(1, -(-max_len // 32))
        for name in a.configs.split(",") + ([b for b in a.baselines.split(",") if b] if device.type == "cuda" else []):
            row = {"batch": B, "context": ctx, "max_len": max_len, "config": name, "graph_splits": graph_splits}
            try:
                if name.startswith("sdpa-"):
                    k = kc[r2t.long()].permute(0, 2, 1, 3).contiguous()  # [B, nkv, ctx, D], outside the timed call
                    v = vc[r2t.long()].permute(0, 2, 1, 3).contiguous()

                    def call(name=name, k=k, v=v):
                        return sdpa_decode(q, k, v, name)

                else:
                    splits, cfg = parse_config(name, graph_splits, max_len_splits)
                    row.update(splits=splits, **cfg)

                    def call(splits=splits, cfg=cfg):
                        return decode_attention_triton(q, kc, vc, r2t, r, lens, scale, num_kv_splits=splits, config=cfg)

                out = call()
                row["max_abs_diff"] = (out.float() - ref).abs().max().item()
                us = time_calls([call] * reps, device) * 1e6
                row.update(us=us, gb_s=kv_bytes / us / 1e3, frac_hbm=(kv_bytes / us / 1e3 / bw) if bw else None)
            except Exception as exc:  # a config that does not fit (shared memory, registers), a backend torch lacks
                row["error"] = str(exc).splitlines()[0][:100]
            rows.append(row)
    if bw:
        print(f"HBM copy bandwidth: {bw:.0f} GB/s (read + write of a device copy)")
    print(f"{'batch x context (max len)':<28}{'config':<18}{'splits':>7}{'us':>9}{'GB/s':>8}{'%HBM':>6}  max|diff|")
    for row in rows:
        case = f"{row['batch']} x {row['context']} ({row['max_len']})"
        if "error" in row:
            print(f"{case:<28}{row['config']:<18}  failed: {row['error']}")
            continue
        frac = f"{100 * row['frac_hbm']:5.0f}%" if row.get("frac_hbm") is not None else "     -"
        splits = str(row.get("splits", "-"))
        print(
            f"{case:<28}{row['config']:<18}{splits:>7}{row['us']:>9.1f}{row['gb_s']:>8.0f}{frac}"
            f"  {row['max_abs_diff']:.3g}"
        )
    result = dict(device=str(device), heads=nh, kv_heads=nkv, head_dim=D, hbm_copy_gb_s=bw, rows=rows)
    write_report(a.out, result)
    return result


if __name__ == "__main__":
    main()
