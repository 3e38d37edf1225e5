"""The last step of a grouped MoE: each token's k weighted expert rows summed, plus the gated shared expert.

The grouped kernels (``fused_moe.py``, ``nvfp4_moe.py``) write one row per (token, expert) pair: its down projection
rounded to the activation dtype (as the reference rounds it), which the combine scales by the routing weight ``w`` in
fp32 (half the bytes written and read of fp32 weighted rows, same result). The block's output is then

    out = cast(Σ_j w[t·k + j] · partial[t·k + j]) + cast(sigmoid(gate[t])) · shared[t]      (w = 1 when not given)

with every step rounded to the activation dtype as the torch ops round it (``moe_combine_torch``: the sum, the cast,
``SharedExpertTerm.add_to``'s sigmoid, product and sum). In torch that is five kernels a layer (sum, cast, sigmoid,
multiply, add) and two full passes more over ``[T, H]``; here it is one launch that reads the partials once. A
prefill step of Qwen3.6 runs it in each of its 40 MoE layers.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


def add_gated_shared(routed: torch.Tensor, shared_gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """``routed + sigmoid(shared_gate) * shared`` in the tensors' dtype: the MoE block's formula (Qwen's shared
    expert), whose roundings the kernel below reproduces."""
    return routed + torch.sigmoid(shared_gate) * shared


def moe_combine_torch(
    partial: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    shared: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``partial [T*k, H]`` (fp32, or any dtype with ``weights [T, k]``: each row times its weight, the weight
    rounded to ``dtype`` as the model's reference applies it, in fp32 first) → ``[T, H]`` in ``dtype``; plus ``sigmoid(shared_gate [T, 1]) * shared [T, H]`` in ``dtype`` ops when given.
    The k rows are added in pair order, as the kernel adds them (torch's CUDA ``sum`` reduces in another order,
    which tips ~3 % of bf16 outputs by a unit in the last place)."""
    T = partial.shape[0] // k
    if weights is not None:
        partial = partial.float() * weights.reshape(-1, 1).to(dtype).float()
    rows = partial.view(T, k, -1)
    acc = rows[:, 0].clone()
    for j in range(1, k):
        acc += rows[:, j]
    out = acc.to(dtype)
    return out if shared is None else add_gated_shared(out, shared_gate, shared)


if triton is not None:

    @triton.jit
    def _moe_combine_kernel(
        partial_ptr,
        rows_at_ptr,
        weights_ptr,
        shared_ptr,
        gate_ptr,
        out_ptr,
        H,
        stride_p,
        stride_s,
        stride_g,
        stride_o,
        K: tl.constexpr,
        HAS_WEIGHTS: tl.constexpr,
        HAS_SHARED: tl.constexpr,
        ROWS_AT: tl.constexpr,  # pair p's row is partial[rows_at[p]] (else partial[p])
        BLOCK_H: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < H
        dt = out_ptr.dtype.element_ty
        rows = partial_ptr + (t * K).to(tl.int64) * stride_p + cols
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(K):  # in pair order, as moe_combine_torch adds them
            if ROWS_AT:
                at = tl.load(rows_at_ptr + t.to(tl.int64) * K + j).to(tl.int64)
                row = tl.load(partial_ptr + at * stride_p + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                row = tl.load(rows + j * stride_p, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                row = row * tl.load(weights_ptr + t.to(tl.int64) * K + j).to(dt).to(tl.float32)
            acc = row if j == 0 else acc + row
        out = acc.to(dt)
        if HAS_SHARED:
            g = tl.load(gate_ptr + t.to(tl.int64) * stride_g).to(tl.float32)
            g = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            s = tl.load(shared_ptr + t.to(tl.int64) * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
            out = (out.to(tl.float32) + (g * s).to(dt).to(tl.float32)).to(dt)
        tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, out, mask=mask)


def moe_combine_triton(
    partial: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    shared: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    rows_at: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Same contract as ``moe_combine_torch`` (``shared`` and ``shared_gate`` may be strided views with unit last
    stride: the column views of a fused projection); ``out [T, H]`` (unit last stride): written and returned (a MoE
    prefill graph's output rows); ``rows_at [T*k]`` (int): pair p's row is ``partial[rows_at[p]]``, not
    ``partial[p]`` (rows left in expert order: ``moe_grouped_mm.py``). CUDA, or CPU under TRITON_INTERPRET=1."""
    n, H = partial.shape if rows_at is None else (rows_at.numel(), partial.shape[1])
    T = n // k
    if out is None:
        out = torch.empty(T, H, dtype=dtype, device=partial.device)
    assert out.shape == (T, H) and out.dtype == dtype and out.stride(-1) == 1
    if T == 0:
        return out
    assert partial.stride(-1) == 1
    has_shared = shared is not None
    if has_shared:
        assert shared.stride(-1) == 1 and shared_gate is not None
    block_h = min(1024, triton.next_power_of_2(H))
    if weights is not None:
        weights = weights.reshape(-1).contiguous()
        assert weights.numel() == n
    if rows_at is not None:
        rows_at = rows_at.reshape(-1).contiguous()
    _moe_combine_kernel[(T, triton.cdiv(H, block_h))](
        partial,
        rows_at if rows_at is not None else partial,
        weights if weights is not None else partial,
        shared if has_shared else partial,
        shared_gate if has_shared else partial,
        out,
        H,
        partial.stride(0),
        shared.stride(0) if has_shared else 0,
        shared_gate.stride(0) if has_shared else 0,
        out.stride(0),
        K=k,
        HAS_WEIGHTS=weights is not None,
        HAS_SHARED=has_shared,
        ROWS_AT=rows_at is not None,
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=False,  # weight times row, then the add, each rounded: no fused multiply-add
        **pdl_launch(partial),
    )
    return out
