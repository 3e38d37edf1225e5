"""A step's new keys and values written into the paged KV pool as one Triton kernel, beside the torch reference it is
tested against.

    k_cache[loc[t]] = k[t];  v_cache[loc[t]] = v[t]      k [T, nkv, D], v [T, nkv, Dv], in the pool's dtype

The reference is ``AttentionBackend.store_kv``'s two index assignments (two kernels per attention layer); the kernel
writes both in one launch, one program per token. ``k`` and ``v`` may be strided views (e.g. column slices of a
fused q|k|v projection), with a contiguous last dim. Equal slots in ``loc`` (CUDA-graph padding rows share a scratch
slot) leave one of the writers' rows there, as the reference does. No host reads, launch sizes from the shapes:
CUDA-graph capturable. ``store_kv`` runs Triton on CUDA tensors whose dtype is the pool's (a cast stays a torch op)
and the reference elsewhere.
"""

from __future__ import annotations

import torch

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


def store_kv_torch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """``k_cache [slots, nkv, D]``, ``v_cache [slots, nkv, Dv]``, ``loc [T]`` int slots; writes in place."""
    k_cache[loc] = k.to(k_cache.dtype)
    v_cache[loc] = v.to(v_cache.dtype)


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        loc_ptr,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_kct,
        stride_kch,
        stride_vct,
        stride_vch,
        NKV: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(loc_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        h_mask = offs_h < NKV
        offs_d = tl.arange(0, BLOCK_D)
        mask = h_mask[:, None] & (offs_d < D)[None, :]
        key = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        tl.store(kc_ptr + slot * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :], key, mask=mask)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_v = h_mask[:, None] & (offs_dv < DV)[None, :]
        val = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=mask_v)
        tl.store(vc_ptr + slot * stride_vct + offs_h[:, None] * stride_vch + offs_dv[None, :], val, mask=mask_v)


def store_kv_triton(k_cache, v_cache, loc, k, v) -> None:
    """Same contract as ``store_kv_torch`` for ``k``/``v`` already in the pool's dtype; CUDA, or CPU under
    TRITON_INTERPRET=1."""
    T, nkv, D = k.shape
    DV = v.shape[2]
    assert k.dtype == k_cache.dtype and v.dtype == v_cache.dtype, "cast to the pool's dtype first"
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        NKV=nkv,
        D=D,
        DV=DV,
        BLOCK_H=triton.next_power_of_2(nkv),
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(DV),
        num_warps=1 if nkv * max(D, DV) <= 512 else 4,
        **pdl_launch(k),
    )


def store_kv(k_cache, v_cache, loc, k, v) -> None:
    """Triton on CUDA tensors already in the pool's dtype (rows with a contiguous last dim), the reference
    elsewhere."""
    fast = (
        triton is not None
        and k.is_cuda
        and k.dtype == k_cache.dtype
        and v.dtype == v_cache.dtype
        and k.stride(-1) == 1
        and v.stride(-1) == 1
    )
    (store_kv_triton if fast else store_kv_torch)(k_cache, v_cache, loc, k, v)
