"""Quick timing of the Triton kernels against their torch references at Qwen3.6-35B-A3B / Qwen3-30B-A3B shapes.

PYTHONPATH=python python -m freetoken.kernels.bench      (CUDA only)
"""

from __future__ import annotations

import torch


def _time(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e3  # us


def bench_moe():
    from freetoken.kernels.fused_moe import fused_moe_torch, fused_moe_triton

    print("MoE (bf16)          T     triton_us    torch_us   weight-read GB/s (triton)")
    for E, k, H, I in ((256, 8, 2048, 512), (128, 8, 2048, 768)):
        w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
        for T in (1, 8, 64, 512, 2048):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            p = torch.softmax(torch.randn(T, E, device="cuda"), -1)
            w, ids = torch.topk(p, k, -1)
            w = (w / w.sum(-1, keepdim=True)).bfloat16()
            t1 = _time(lambda: fused_moe_triton(x, w13, w2, ids, w))
            t2 = _time(lambda: fused_moe_torch(x, w13, w2, ids, w), iters=3)
            hit = int(torch.unique(ids).numel())
            gbs = hit * 3 * I * H * 2 / (t1 * 1e-6) / 1e9
            print(f"  E{E} I{I}  {T:6d}  {t1:10.1f}  {t2:10.1f}   {gbs:8.0f}")


def bench_attention():
    from freetoken.kernels.attention import (
        decode_attention_triton,
        extend_attention_torch,
        extend_attention_triton,
        pick_num_kv_splits,
    )

    print("attention (bf16)    shape                         triton_us   torch_us")
    for nh, nkv, D in ((16, 2, 256), (32, 4, 128)):
        for B, ctx in ((1, 8192), (32, 2048), (128, 1024)):
            slots = B * ctx
            kc = torch.randn(slots, nkv, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn(slots, nkv, D, device="cuda", dtype=torch.bfloat16)
            r2t = torch.arange(slots, device="cuda", dtype=torch.int32).view(B, ctx)
            rows = torch.arange(B, device="cuda")
            q = torch.randn(B, nh, D, device="cuda", dtype=torch.bfloat16)
            cl = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
            S = pick_num_kv_splits(B, nkv, ctx)
            t = _time(lambda: decode_attention_triton(q, kc, vc, r2t, rows, cl, D**-0.5, num_kv_splits=S))
            gbs = slots * nkv * D * 2 * 2 / (t * 1e-6) / 1e9
            print(f"  decode nh{nh} D{D} B{B} ctx{ctx} S{S}   {t:9.1f}   KV read {gbs:6.0f} GB/s")
        for n, pre in ((2048, 0), (2048, 6144), (8192, 0)):
            ctx = n + pre
            kc = torch.randn(ctx, nkv, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn(ctx, nkv, D, device="cuda", dtype=torch.bfloat16)
            r2t = torch.arange(ctx, device="cuda", dtype=torch.int32).view(1, ctx)
            rows = torch.zeros(1, dtype=torch.int64, device="cuda")
            q = torch.randn(n, nh, D, device="cuda", dtype=torch.bfloat16)
            cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
            pl = torch.tensor([pre], device="cuda", dtype=torch.int32)
            t = _time(lambda: extend_attention_triton(q, kc, vc, r2t, rows, cu, pl, D**-0.5, max_extend_len=n), 5)
            flops = 4 * nh * D * n * (pre + n / 2)
            t2 = (
                _time(lambda: extend_attention_torch(q, kc, vc, r2t, rows, cu, pl, D**-0.5), 2)
                if n <= 2048
                else float("nan")
            )
            print(
                f"  extend nh{nh} D{D} n{n} prefix{pre}   {t:9.1f}  {t2:9.1f}   {flops / (t * 1e-6) / 1e12:5.0f} TFLOP/s"
            )


if __name__ == "__main__":
    bench_moe()
    bench_attention()
