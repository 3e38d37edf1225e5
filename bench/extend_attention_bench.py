"""The Triton extend (prefill) attention kernel at Qwen3.6-35B-A3B's attention shape (16 query heads, 2 KV heads,
head dim 256, bf16, page size 1) over the chunks a server runs: a fresh 8,192-token chunk, the last 8,192-token
chunk of a 30k prompt, and an agent turn's 2,184 new tokens after 27,816 cached ones (issue 12). Each chunk is
timed under the tile configs given (``--configs``; the default is the launcher's own pick first, then the big
tiles with the keys split 1..6 ways, then the old 32 x 32 tiles), printing ms, TFLOP/s over the causal work actually
done and the fraction of the H200's dense BF16 tensor-core peak (989 TFLOP/s), and the launcher's pick against the
unsplit big tiles. Beside them, torch's scaled-dot-product attention backends (``--baselines``: flash and cuDNN by
default; memory-efficient and flash with the KV heads expanded on request) on the same chunk with a lower-right
causal mask, the paged KV gathered into contiguous tensors inside the timed call: what a library kernel would give
if the extend path used it, each checked against our output (max |diff|; a backend this torch cannot run at the
shape is printed as failed). ``sdpa-cudnn-split`` / ``sdpa-flash-split`` (``-expanded``: KV heads repeated): the
prefix and the chunk's own keys in two calls merged by log-sum-exp (``sdpa_split``, the merge ``merge_two_torch``); ``cudnn``: the serving route
(``kernels/attention_cudnn.py``: the same split, its Triton merge). Writes JSON.

    python bench/extend_attention_bench.py --out bench/out/extend_attention.json
"""

from __future__ import annotations

import argparse
import os
import sys

from report import write_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHUNKS = [(8192, 0), (8192, 21808), (2184, 27816)]  # (new tokens, cached prefix)
H200_BF16_DENSE_TFLOPS = 989.0


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--configs",
        default="auto,128x64x8x2,128x64x8x2s2,128x64x8x2s3,128x64x8x2s4,128x64x8x2s6,32x32x4x2",
        help="BLOCK_MxBLOCK_Nxwarpsxstages, sN: N key splits (unsuffixed: one); auto: the launcher's pick",
    )
    ap.add_argument("--baselines", default="cudnn,sdpa-flash,sdpa-cudnn,sdpa-cudnn-split")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold-shapes", type=int, default=3, help="new chunk shapes whose first call is timed")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "extend_attention.json"))
    return ap.parse_args()


def causal_flops(ext: int, pre: int, nh: int, d: int, dv: int) -> float:
    """QKᵀ and PV over the keys each query sees (its prefix and the chunk up to itself)."""
    keys = ext * pre + ext * (ext + 1) / 2
    return 2.0 * keys * nh * (d + dv)


def sdpa_extend(q, kc, vc, slots, backend: str):
    """The chunk's attention through ``F.scaled_dot_product_attention``: KV gathered from the paged cache, queries
    aligned to the end of the keys (lower-right causal), GQA native or (``-expanded``) by repeating KV heads."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    name = backend.removeprefix("sdpa-").removesuffix("-expanded")
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]  # fmt: skip
    k, v = kc[slots].transpose(0, 1)[None], vc[slots].transpose(0, 1)[None]  # [1, nkv, ctx, D]
    qh = q.transpose(0, 1)[None]  # [1, nh, ext, D]
    gqa = not backend.endswith("-expanded")
    if not gqa:
        r = qh.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    mask = causal_lower_right(qh.shape[2], k.shape[2])
    with sdpa_kernel([which]):
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def sdpa_split(q, kc, vc, slots, pre: int, backend: str):
    """The chunk's attention in two library calls merged by their log-sum-exps, as an extend path built on a library
    kernel without lower-right masks would run it: the new tokens against the cached prefix (every query sees every
    key: no mask) and against themselves (square, so top-left causal is the right mask), through torch's internal
    cuDNN or flash SDPA ops (the public one returns no log-sum-exp). KV heads repeated where the op wants equal
    heads (``-expanded``)."""
    import torch

    from freetoken.kernels.attention_cudnn import merge_two_torch

    name = backend.removeprefix("sdpa-").removesuffix("-expanded").removesuffix("-split")
    k, v = kc[slots].transpose(0, 1)[None], vc[slots].transpose(0, 1)[None]  # [1, nkv, ctx, D]
    qh = q.transpose(0, 1)[None]  # [1, nh, ext, D]
    if backend.endswith("-expanded"):
        r = qh.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    scale = q.shape[-1] ** -0.5

    def attend(kk, vv, causal: bool):
        if name == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qh, kk, vv, None, True, 0.0, causal, False, scale=scale
            )
        else:
            res = torch.ops.aten._scaled_dot_product_flash_attention(qh, kk, vv, 0.0, causal, False, scale=scale)
        return res[0].float(), res[1].reshape(qh.shape[:3]).float()  # [1, nh, ext, D], natural-log lse [1, nh, ext]

    if pre == 0:
        return attend(k, v, True)[0][0].transpose(0, 1).to(q.dtype)
    o1, l1 = attend(k[:, :, :pre], v[:, :, :pre], False)
    o2, l2 = attend(k[:, :, pre:], v[:, :, pre:], True)
    return merge_two_torch(o1[0], l1[0], o2[0], l2[0]).to(q.dtype)


def first_call_ms(n: int, nh: int, nkv: int, D: int, dt, dev) -> list[dict]:
    """What a chunk length never seen before costs each route on its first call (a server meets a new length with
    almost every request): ``n`` new (new tokens, prefix) shapes near the agent turn's, each timed on its first call
    and again, after every kernel involved has run at other shapes."""
    import time

    import torch

    from freetoken.kernels.attention import extend_attention_triton
    from freetoken.kernels.attention_cudnn import extend_attention_cudnn

    out = []
    for i in range(n):
        ext, pre = 2184 + 40 * (i + 1) + 3, 27816 + 70 * (i + 1) + 5
        ctx = ext + pre
        kc = torch.randn(ctx, nkv, D, device=dev, dtype=dt)
        vc = torch.randn(ctx, nkv, D, device=dev, dtype=dt)
        # a page-table row as wide as a server's (its stride fixed, so no new Triton specialization by divisibility)
        table = torch.zeros(1, 32768, device=dev, dtype=torch.int32)
        table[0, :ctx] = torch.arange(ctx, device=dev, dtype=torch.int32)
        slots = table[0, :ctx]
        q = torch.randn(ext, nh, D, device=dev, dtype=dt)
        cu = torch.tensor([0, ext], dtype=torch.int32, device=dev)
        pl = torch.tensor([pre], dtype=torch.int32, device=dev)
        r = torch.zeros(1, dtype=torch.int32, device=dev)
        routes = {
            "triton": lambda: extend_attention_triton(q, kc, vc, table, r, cu, pl, D**-0.5, ext, max_context=ctx),
            "cudnn": lambda: extend_attention_cudnn(q, kc, vc, slots, pre, D**-0.5),
        }
        for route, call in routes.items():
            ms = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                ms.append((time.perf_counter() - t0) * 1e3)
            out.append({"route": route, "new": ext, "prefix": pre, "first_ms": ms[0], "again_ms": ms[1]})
    return out


def main() -> int:
    a = parse_args()
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    from hardware_bandwidth import median_device_ms

    from freetoken.kernels.attention import extend_attention_triton, extend_launch
    from freetoken.kernels.attention_cudnn import extend_attention_cudnn

    dev = torch.device("cuda")
    nh, nkv, D = 16, 2, 256
    dt = torch.bfloat16
    rows = []
    for ext, pre in CHUNKS:
        ctx = ext + pre
        kc = torch.randn(ctx + 8, nkv, D, device=dev, dtype=dt)
        vc = torch.randn(ctx + 8, nkv, D, device=dev, dtype=dt)
        r2t = torch.randperm(ctx + 8, device=dev)[:ctx].to(torch.int32).view(1, ctx)  # page size 1, scattered
        q = torch.randn(ext, nh, D, device=dev, dtype=dt)
        cu = torch.tensor([0, ext], dtype=torch.int32, device=dev)
        pl = torch.tensor([pre], dtype=torch.int32, device=dev)
        r = torch.zeros(1, dtype=torch.int32, device=dev)
        flops = causal_flops(ext, pre, nh, D, D)
        ours = torch.empty(0)
        slots = r2t[0].long()
        tiles_picked, splits_picked = extend_launch(q, kc, vc, ext, 1, ctx)
        auto = "x".join(map(str, tiles_picked)) + f"s{splits_picked}"
        for name in a.configs.split(",") + [b for b in a.baselines.split(",") if b]:
            baseline = name.startswith("sdpa-") or name == "cudnn"
            if name == "cudnn":  # the serving route (kernels/attention_cudnn.py): gather, two calls, the merge kernel
                label = name

                def call():
                    return extend_attention_cudnn(q, kc, vc, r2t[0], pre, D**-0.5)

            elif baseline:
                label = name

                def call(name=name):
                    if "-split" in name:
                        return sdpa_split(q, kc, vc, slots, pre, name)
                    return sdpa_extend(q, kc, vc, slots, name)

            else:
                tiles, _, splits = name.partition("s")
                cfg = None if name == "auto" else tuple(int(v) for v in tiles.split("x"))
                n_split = int(splits) if splits else (0 if name == "auto" else 1)
                label = name if cfg else "auto=" + auto

                def call(cfg=cfg, n_split=n_split):
                    return extend_attention_triton(
                        q, kc, vc, r2t, r, cu, pl, D**-0.5, ext, config=cfg, max_context=ctx, num_splits=n_split
                    )

            try:
                out = call()
                row = {"new": ext, "prefix": pre, "config": label}
                if name == "auto":
                    ours = out
                elif baseline:
                    row["max_abs_diff_vs_ours"] = (
                        (out.float() - ours.float()).abs().max().item() if ours.numel() else float("nan")
                    )
                ms = median_device_ms(call, a.reps)
                rows.append({**row, "ms": ms, "tflops": flops / ms / 1e9})
            except Exception as exc:  # a config that does not fit (shared memory, registers), a backend torch lacks
                rows.append({"new": ext, "prefix": pre, "config": label, "error": str(exc).splitlines()[0][:80]})
    cold = first_call_ms(a.cold_shapes, nh, nkv, D, dt, dev) if a.cold_shapes else []
    print(f"{'chunk':<24}{'config':<22}{'ms':>9}{'TFLOP/s':>10}{'of peak':>9}")
    for row in rows:
        chunk = f"{row['new']} after {row['prefix']}"
        if "error" in row:
            print(f"{chunk:<24}{row['config']:<22}  failed: {row['error']}")
            continue
        frac = row["tflops"] / H200_BF16_DENSE_TFLOPS
        diff = f"  max|diff| vs ours {row['max_abs_diff_vs_ours']:.3g}" if "max_abs_diff_vs_ours" in row else ""
        print(f"{chunk:<24}{row['config']:<22}{row['ms']:>9.2f}{row['tflops']:>10.1f}{frac:>9.2f}{diff}")
    for ext, pre in CHUNKS:
        got = {r["config"].split("=")[0]: r for r in rows if (r["new"], r["prefix"]) == (ext, pre) and "ms" in r}
        if "auto" in got and "128x64x8x2" in got:
            speedup = got["128x64x8x2"]["ms"] / got["auto"]["ms"]
            print(f"{ext} after {pre}: the launcher's pick ({got['auto']['config']}) {speedup:.2f}x unsplit 128x64")
    if cold:
        print("first call at a chunk shape not seen before (wall ms, synchronized), then the same shape again:")
        for c in cold:
            print(
                f"  {c['route']:<8} {c['new']} after {c['prefix']}: first {c['first_ms']:.1f} ms, again {c['again_ms']:.1f} ms"
            )
    write_report(a.out, {"gpu": torch.cuda.get_device_name(), "rows": rows, "first_calls": cold})
    return 0


if __name__ == "__main__":
    sys.exit(main())
