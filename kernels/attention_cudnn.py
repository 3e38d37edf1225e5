"""One long prompt chunk's attention through cuDNN's fused attention (torch's SDPA op), beside our Triton extend.

cuDNN's Hopper attention outruns our Triton extend kernel on long chunks at Qwen3.5/3.6's head dim 256 (H200,
``bench/extend_attention_bench.py``, 2026-12-03, ms a layer): a fresh 8,192-token chunk 1.07 vs 1.65, 8,192 new
after 21,808 cached 5.73 vs 9.10, an agent turn's 2,184 after 27,816 2.25 vs 2.88. It has no lower-right causal
mask for a chunk after a cached prefix (through torch its masked form is 2-4x slower than ours), so a chunk runs as
two calls merged by their log-sum-exps: the new tokens against the cached prefix (every query sees every key: no
mask) and against themselves (a square, where top-left causal is the right mask). torch's public SDPA returns no
log-sum-exp, so this calls its internal cuDNN op (``aten::_scaled_dot_product_cudnn_attention``); a probe at first
use checks that the op exists and runs at the shape, else the Triton kernel keeps the work.

Opt-in (``FREETOKEN_EXTEND_ATTENTION=cudnn``; the default ``triton`` keeps every chunk on our kernel): cuDNN builds
an execution plan for every new (chunk, prefix) shape, and on the H200 the first call at a shape costs 150-170 ms
(``extend_attention_bench.py --cold-shapes``, 2026-12-03) where our kernel compiles a handful of specializations
once. A server meets a new chunk length with almost every request, so the route pays only where shapes repeat
(fixed-length batch jobs, benchmarks). When chosen, it takes one sequence of at least ``MIN_TOKENS`` new tokens in
16-bit on sm_90 (measured there), the KV of its context gathered from the paged pool into contiguous tensors first
(~30 MB a layer at 30k tokens: tens of microseconds).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

MIN_TOKENS = 1024  # shorter chunks stay on the Triton kernel (unmeasured below 2,184 new tokens)
CHOICES = ("triton", "cudnn")


def extend_attention_choice() -> str:
    """``FREETOKEN_EXTEND_ATTENTION`` (triton, the default, or cudnn); any other value is refused at start-up."""
    choice = os.environ.get("FREETOKEN_EXTEND_ATTENTION", "triton").lower()
    if choice not in CHOICES:
        raise ValueError(f"FREETOKEN_EXTEND_ATTENTION={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


def use_cudnn_extend(q: torch.Tensor, k_cache: torch.Tensor, num_seqs: int, new_tokens: int) -> bool:
    """Whether this extend step runs through cuDNN: chosen, one sequence of at least ``MIN_TOKENS`` on sm_90,
    16-bit, a head dim cuDNN takes, and the probe passing on this device."""
    if extend_attention_choice() != "cudnn" or num_seqs != 1 or new_tokens < MIN_TOKENS or not q.is_cuda:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k_cache.dtype != q.dtype:
        return False
    if q.shape[-1] % 8 or q.shape[-1] > 256 or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return cudnn_attention_works(q.device, q.shape[1], k_cache.shape[1], q.shape[-1], q.dtype)


def _cudnn_attend(q, k, v, causal: bool, scale: float):
    """``q [1, nh, n, D]``, ``k, v [1, nkv, m, D]`` (GQA native) -> ``(o [1, nh, n, D], lse [1, nh, n] fp32, natural
    log)``."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(q.shape[:3])


@functools.lru_cache(maxsize=None)
def cudnn_attention_works(device: torch.device, nh: int, nkv: int, D: int, dtype: torch.dtype) -> bool:
    """Runs both calls of ``extend_attention_cudnn`` once at a small size of this shape and checks them against a
    plain softmax: False (the Triton kernel then keeps the work) when the op is missing, refuses, or is wrong."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, nh, 64, D, device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, nkv, 192, D, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, nkv, 192, D, device=device, dtype=dtype, generator=gen)
        o, lse = _cudnn_attend(q, k, v, False, D**-0.5)
        oc, _ = _cudnn_attend(q, k[:, :, :64], v[:, :, :64], True, D**-0.5)
        kf, vf = (x.float().repeat_interleave(nh // nkv, dim=1) for x in (k, v))
        s = q.float() @ kf.transpose(-1, -2) * D**-0.5
        want = torch.softmax(s, -1) @ vf
        causal = torch.ones(64, 64, dtype=torch.bool, device=device).tril()
        want_c = torch.softmax(s[..., :64].masked_fill(~causal, float("-inf")), -1) @ vf[:, :, :64]
        return bool(
            (o.float() - want).abs().max() < 2e-2
            and (lse - torch.logsumexp(s, -1)).abs().max() < 1e-2
            and (oc.float() - want_c).abs().max() < 2e-2
        )
    except Exception:
        return False


if triton is not None:

    @triton.jit
    def _merge_two_kernel(
        o1_ptr,
        l1_ptr,
        o2_ptr,
        l2_ptr,
        out_ptr,
        stride_o1h,
        stride_o1t,
        stride_l1h,
        stride_l1t,
        stride_o2h,
        stride_o2t,
        stride_l2h,
        stride_l2t,
        stride_ot,
        stride_oh,
        DV,
        BLOCK_DV: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK_DV)
        mask = offs < DV
        l1 = tl.load(l1_ptr + h * stride_l1h + t * stride_l1t)
        l2 = tl.load(l2_ptr + h * stride_l2h + t * stride_l2t)
        m = tl.maximum(l1, l2)
        w1 = tl.exp(l1 - m)
        w2 = tl.exp(l2 - m)
        o1 = tl.load(o1_ptr + h * stride_o1h + t * stride_o1t + offs, mask=mask, other=0.0).to(tl.float32)
        o2 = tl.load(o2_ptr + h * stride_o2h + t * stride_o2t + offs, mask=mask, other=0.0).to(tl.float32)
        out = (o1 * w1 + o2 * w2) / (w1 + w2)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def merge_two_torch(o1, l1, o2, l2) -> torch.Tensor:
    """Reference: two attention partials over disjoint keys (``o [nh, T, Dv]``, natural-log ``lse [nh, T]``) merged
    -> ``[T, nh, Dv]`` in o1's dtype."""
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).transpose(0, 1).to(o1.dtype)


def merge_two(o1, l1, o2, l2) -> torch.Tensor:
    """``merge_two_triton`` on CUDA, the reference elsewhere."""
    if o1.is_cuda and triton is not None:
        return merge_two_triton(o1, l1, o2, l2)
    return merge_two_torch(o1, l1, o2, l2)


def merge_two_triton(o1, l1, o2, l2) -> torch.Tensor:
    """``merge_two_torch`` in one Triton launch (the last dim of o1 / o2 contiguous, any other strides)."""
    nh, T, DV = o1.shape
    assert o1.stride(-1) == 1 and o2.stride(-1) == 1
    out = torch.empty(T, nh, DV, dtype=o1.dtype, device=o1.device)
    _merge_two_kernel[(T, nh)](
        o1,
        l1,
        o2,
        l2,
        out,
        *o1.stride()[:2],
        *l1.stride(),
        *o2.stride()[:2],
        *l2.stride(),
        out.stride(0),
        out.stride(1),
        DV,
        BLOCK_DV=triton.next_power_of_2(DV),
        num_warps=4,
    )
    return out


def extend_attention_cudnn(q, k_cache, v_cache, slots: torch.Tensor, prefix_len: int, scale: float) -> torch.Tensor:
    """One sequence: ``q [n, nh, D]`` (its new tokens, whose K/V are already in the pool), ``slots [prefix_len + n]``
    (the pool slots of its whole context, device int) -> ``[n, nh, Dv]`` in q's dtype; the contract of
    ``extend_attention_torch`` for one sequence."""
    n = q.shape[0]
    k = k_cache.index_select(0, slots).transpose(0, 1)[None]  # [1, nkv, ctx, D]
    v = v_cache.index_select(0, slots).transpose(0, 1)[None]
    qh = q.transpose(0, 1)[None]  # [1, nh, n, D]
    o_new, l_new = _cudnn_attend(qh, k[:, :, prefix_len:], v[:, :, prefix_len:], True, scale)
    if prefix_len == 0:
        return o_new[0].transpose(0, 1)
    o_pre, l_pre = _cudnn_attend(qh, k[:, :, :prefix_len], v[:, :, :prefix_len], False, scale)
    assert o_new.shape[2] == n
    return merge_two(o_pre[0], l_pre[0], o_new[0], l_new[0])
