"""Gated DeltaNet gates for a prefill chunk in one launch, beside the torch reference it is tested against:

    g = −exp(A_log) · softplus(a + dt_bias)      (log-decay)        β = sigmoid(b)      (write strength)

``a, b [T, Hv]`` are the raw projection columns (bf16 views of the fused input projection, any row stride),
``A_log, dt_bias [Hv]``; both outputs fp32 ``[T, Hv]`` contiguous (what fla's chunked kernels read). In torch these
are about eight launches per GDN layer (two casts, an add, softplus, exp, negate, multiply, sigmoid): host time in a
prefill step that the H200 profile of the agent turn showed host-bound (bench/profile_prefill.py --host-profile).

``gate_values`` is the per-element math, shared with the decode kernel (``gdn_decode.py``) so both paths compute
the gates the same way. softplus as torch's default (``x`` above 20, else ``log(1 + exp(x))``). ``out=(g, beta)``
writes into given ``[T, Hv]`` fp32 tensors (the GDN prefill graphs' static inputs: no copy into them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


def gdn_gates_torch(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Reference (the layer's eager formula): ``(g, beta)`` fp32 ``[T, Hv]``."""
    beta = torch.sigmoid(b.float())
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, beta


if triton is not None:

    @triton.jit
    def gate_values(a, b, a_log, dt_bias):
        """fp32 ``a, b`` (raw projections), ``a_log, dt_bias`` (the head's parameters, broadcastable) -> ``(g,
        beta)``."""
        x = a + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's default threshold: x itself above 20
        return -tl.exp(a_log) * softplus, tl.sigmoid(b)

    @triton.jit
    def _gdn_gates_kernel(
        a_ptr,
        b_ptr,
        A_log_ptr,
        dt_bias_ptr,
        g_ptr,
        beta_ptr,
        T,
        HV,
        stride_at,
        stride_bt,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < HV
        mask = (offs_t < T)[:, None] & h_mask[None, :]
        rows = offs_t[:, None].to(tl.int64)
        a = tl.load(a_ptr + rows * stride_at + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * stride_bt + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        a_log = tl.load(A_log_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        dt_bias = tl.load(dt_bias_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        g, beta = gate_values(a, b, a_log, dt_bias)
        out = rows * HV + offs_h[None, :]
        tl.store(g_ptr + out, g, mask=mask)
        tl.store(beta_ptr + out, beta, mask=mask)


def _outputs(a: torch.Tensor, out):
    """``(g, beta)`` to write: ``out``'s (checked: fp32 ``[T, Hv]`` contiguous) or new ones."""
    if out is None:
        return tuple(torch.empty(a.shape, dtype=torch.float32, device=a.device) for _ in range(2))
    for t in out:
        assert t.shape == a.shape and t.dtype == torch.float32 and t.is_contiguous() and t.device == a.device
    return tuple(out)


def gdn_gates_triton(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, out=None):
    """Same contract as ``gdn_gates_torch``; CUDA, or CPU under TRITON_INTERPRET=1. ``a, b`` need a unit stride
    over heads (column views of a projection are fine)."""
    T, HV = a.shape
    assert b.shape == (T, HV) and A_log.shape == (HV,) and dt_bias.shape == (HV,)
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    g, beta = _outputs(a, out)
    if T == 0:
        return g, beta
    block_h = triton.next_power_of_2(HV)
    block_t = max(1, min(64, 2048 // block_h))
    _gdn_gates_kernel[(triton.cdiv(T, block_t),)](
        a, b, A_log, dt_bias, g, beta, T, HV, a.stride(0), b.stride(0), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
        **pdl_launch(a),
    )  # fmt: skip
    return g, beta


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, impl: str = "auto", out=None
):
    """Triton on CUDA tensors, the torch reference elsewhere (``impl``: auto | triton | torch); ``out=(g, beta)``
    writes into those."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown GDN gates implementation {impl!r}")
    if impl == "triton" or (impl == "auto" and a.is_cuda and triton is not None):
        return gdn_gates_triton(a, b, A_log, dt_bias, out=out)
    g, beta = gdn_gates_torch(a, b, A_log, dt_bias)
    if out is None:
        return g, beta
    out = _outputs(a, out)
    for dst, src in zip(out, (g, beta)):
        dst.copy_(src)
    return tuple(out)
