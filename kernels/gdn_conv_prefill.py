"""Gated DeltaNet causal depthwise conv1d + SiLU over a varlen prefill batch (``GatedDeltaNet._extend``).

Sequence b holds the tokens ``cu_seqlens[b] .. cu_seqlens[b+1]-1`` of ``qkv [T, C]`` and continues from the slot
``s = slots[b]`` of the conv state pool. For the token at position p of that sequence and channel c:

    y[t, c] = silu(Σ_{j<Kc} weight[c, j] · x(p − (Kc−1) + j, c))

where ``x(i, c) = qkv[cu_seqlens[b] + i, c]`` for i ≥ 0 and ``x(i, c) = conv_pool[s, c, Kc−1+i]`` (the last Kc−1
inputs before this step) for i < 0, or 0 when ``has_init[b]`` is false. The cached inputs and the weight are
rounded to qkv's dtype first (as the layer's eager path does).

- ``gdn_conv_prefill_torch``: the reference, the layer's former per-sequence ``cat`` + ``F.conv1d(groups=C)`` +
  ``F.silu`` (math in qkv's dtype); it reads the batch's offsets on the host.
- ``gdn_conv_prefill_triton``: one launch for the whole batch, grid ``(N, cdiv(max_len, BLOCK_T), cdiv(C,
  BLOCK_C))``; a program computes a ``[BLOCK_T, BLOCK_C]`` tile of one sequence (fp32 sums and SiLU, one rounding)
  and returns when the tile starts past its sequence's end. No host sync: only ``max_len`` comes from the host.

Both only read the pool: the caller writes the new states (the last Kc−1 inputs) afterwards, so every sequence
reads its previous state before any slot changes.

``parts`` (column widths summing to C, e.g. the GDN's q | k | v) writes y as one contiguous ``[rows, width]``
block per part, one block after another (``parts_layout``): each part's first T rows are then a contiguous tensor,
which fla's kernels take without the copy a column view of ``[T, C]`` costs (~3 strided copies a GDN layer), and
``out`` lets the caller give the buffer (the GDN prefill graphs' static inputs: no copy into them either). ``gdn_conv_prefill`` dispatches: Triton on CUDA tensors, torch
elsewhere (``impl`` forces one; Triton on CPU needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # triton is a hard dependency on GPU machines; keep the reference importable without it
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

BLOCK_T = 32
BLOCK_C = 128
NUM_WARPS = 4


# ----------------------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------------------


def gdn_conv_prefill_torch(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_init: torch.Tensor,
    max_len: int = 0,
) -> torch.Tensor:
    """Reference for ``gdn_conv_prefill_triton``: exactly the layer's former eager conv, one sequence at a time.
    Reads ``cu_seqlens``, ``slots`` and ``has_init`` on the host (a sync on CUDA); ``max_len`` is unused."""
    T, C = qkv.shape
    Kc = weight.shape[-1]
    w = weight[:, None, :].to(qkv.dtype)  # [C, 1, Kc]: conv1d's depthwise layout
    y = torch.empty(T, C, dtype=qkv.dtype, device=qkv.device)
    cu, sl, init = cu_seqlens.tolist(), slots.tolist(), has_init.tolist()
    for b in range(len(sl)):
        a, z = cu[b], cu[b + 1]
        prev = conv_pool[sl[b]].to(qkv.dtype) if init[b] else qkv.new_zeros(C, Kc - 1)
        xx = torch.cat([prev, qkv[a:z].t()], dim=-1)  # [C, Kc-1+n]; column j = position j-(Kc-1)
        y[a:z] = F.silu(F.conv1d(xx[None], w, groups=C)[0].t())
    return y


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _gdn_conv_prefill_kernel(
        x_ptr,  # [T, C], unit column stride
        w_ptr,  # [C, KC]
        pool_ptr,  # [S, C, KC-1]
        cu_ptr,  # [N+1]
        slots_ptr,  # [N]
        init_ptr,  # [N], nonzero = continue from the slot
        y_ptr,  # parts of [rows, width] one after another (a single part: [T, C])
        C,
        split1,  # first column of part 1 (C: no part 1)
        split2,  # first column of part 2 (C: no part 2)
        base1,  # element offset of part 1 in y
        base2,
        stride_y0,  # row stride of part 0 (its width)
        stride_y1,
        stride_y2,
        stride_xt,
        stride_wc,
        stride_wk,
        stride_ps,
        stride_pc,
        stride_pk,
        KC: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_C: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        i_n = tl.program_id(0)
        start = tl.load(cu_ptr + i_n)
        n = tl.load(cu_ptr + i_n + 1) - start
        t0 = tl.program_id(1) * BLOCK_T
        if t0 >= n:  # the grid covers the longest sequence
            return
        offs_t = t0 + tl.arange(0, BLOCK_T)  # positions within the sequence
        offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = offs_c < C
        mask = (offs_t < n)[:, None] & c_mask[None, :]
        xdt = x_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + i_n).to(tl.int64)
        # positions before the sequence that come from the slot: KC-1 of them, or none (zeros) for a fresh one
        n_prev = tl.where(tl.load(init_ptr + i_n).to(tl.int32) != 0, KC - 1, 0)
        x_base = x_ptr + start.to(tl.int64) * stride_xt + offs_c[None, :]
        p_base = pool_ptr + slot * stride_ps + offs_c[None, :].to(tl.int64) * stride_pc
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if t0 >= KC - 1:
            # every tap of the tile reads x (all tiles but a sequence's first): one pointer add, a load and an FMA an
            # element a tap; the general path below costs ~5x the instructions, which bound the kernel (2026-12-04)
            row_ptrs = x_base + offs_t[:, None].to(tl.int64) * stride_xt
            for j in tl.static_range(KC):
                xv = tl.load(row_ptrs + (j - (KC - 1)) * stride_xt, mask=mask, other=0.0)
                # the reference rounds the weight to qkv's dtype too
                w = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_mask, other=0.0)
                acc += xv.to(tl.float32) * w.to(xdt).to(tl.float32)[None, :]
        else:
            # tap j reads the tile shifted by j-(KC-1) rows: reloaded per tap (L1/L2 hits), registers cannot shift
            for j in tl.static_range(KC):
                pos = offs_t[:, None] + (j - (KC - 1))
                in_x = pos >= 0
                # addresses clamped into range: the masked-off lanes still form them
                xv = tl.load(x_base + tl.maximum(pos, 0).to(tl.int64) * stride_xt, mask=mask & in_x, other=0.0)
                # positions before the sequence, from the slot
                pcol = tl.minimum(pos + (KC - 1), KC - 2)
                pv = tl.load(p_base + pcol * stride_pk, mask=mask & (pos < 0) & (pos >= -n_prev), other=0.0)
                v = tl.where(in_x, xv, pv.to(xdt)).to(tl.float32)
                w = tl.load(w_ptr + offs_c * stride_wc + j * stride_wk, mask=c_mask, other=0.0)
                acc += v * w.to(xdt).to(tl.float32)[None, :]
        y = acc * tl.sigmoid(acc)
        # the tile's part (tiles never straddle parts: the launcher's BLOCK_C divides the split columns)
        c0 = tl.program_id(2) * BLOCK_C
        in1 = c0 >= split1
        in2 = c0 >= split2
        base = tl.where(in2, base2, tl.where(in1, base1, 0)).to(tl.int64)
        col0 = tl.where(in2, split2, tl.where(in1, split1, 0))
        stride_y = tl.where(in2, stride_y2, tl.where(in1, stride_y1, stride_y0)).to(tl.int64)
        rows = (start + offs_t).to(tl.int64)
        y_ptrs = y_ptr + base + rows[:, None] * stride_y + (offs_c - col0)[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


def parts_views(y: torch.Tensor, rows: int, T: int, parts) -> tuple[torch.Tensor, ...]:
    """The ``[T, width]`` views of a flat buffer holding ``[rows, width]`` blocks part after part: each contiguous."""
    views, at = [], 0
    for width in parts:
        views.append(y[at : at + T * width].view(T, width))
        at += rows * width
    return tuple(views)


def _parts_buffer(qkv: torch.Tensor, parts, out) -> tuple[torch.Tensor, int]:
    """``(flat buffer, rows)`` for ``parts``: ``out`` (contiguous, qkv's dtype, a whole number of ``[rows, C]``) or a
    new ``[T * C]`` one."""
    T, C = qkv.shape
    assert sum(parts) == C and 1 <= len(parts) <= 3 and min(parts) > 0, (parts, C)
    if out is None:
        return torch.empty(T * C, dtype=qkv.dtype, device=qkv.device), T
    assert out.is_contiguous() and out.dtype == qkv.dtype and out.device == qkv.device, "bad conv output buffer"
    assert out.numel() % C == 0 and out.numel() // C >= T, (out.numel(), T, C)
    return out.view(-1), out.numel() // C


def gdn_conv_prefill_triton(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_init: torch.Tensor,
    max_len: int,
    block_t: int = BLOCK_T,
    block_c: int = BLOCK_C,
    parts=None,
    out: torch.Tensor | None = None,
    num_warps: int = NUM_WARPS,
):
    """Triton form of ``gdn_conv_prefill``; grid ``(N, cdiv(max_len, block_t), cdiv(C, block_c))``."""
    assert triton is not None, "triton is not installed"
    T, C = qkv.shape
    Kc = weight.shape[-1]
    N = slots.shape[0]
    assert weight.shape == (C, Kc) and Kc >= 2 and conv_pool.shape[1:] == (C, Kc - 1), (
        qkv.shape,
        weight.shape,
        conv_pool.shape,
    )
    assert qkv.stride(1) == 1, "qkv needs a unit column stride"
    assert cu_seqlens.shape == (N + 1,) and has_init.shape == (N,)
    assert qkv.device == weight.device == conv_pool.device == cu_seqlens.device == slots.device == has_init.device
    widths = tuple(parts) if parts is not None else (C,)
    y, rows = _parts_buffer(qkv, widths, out)
    result = parts_views(y, rows, T, widths) if parts is not None else y[: T * C].view(T, C)
    if N == 0 or T == 0 or max_len <= 0:
        return result
    splits = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
    block_c = min(block_c, triton.next_power_of_2(C))
    while any(sp % block_c for sp in splits):  # a tile never straddles two parts
        block_c //= 2
    split1, split2 = (splits + [C, C])[:2]
    strides = (list(widths) + [C, C])[:3]
    _gdn_conv_prefill_kernel[(N, triton.cdiv(max_len, block_t), triton.cdiv(C, block_c))](
        qkv,
        weight,
        conv_pool,
        cu_seqlens,
        slots,
        has_init,
        y,
        C,
        split1,
        split2,
        rows * split1 if split1 < C else 0,
        rows * split2 if split2 < C else 0,
        *strides,
        qkv.stride(0),
        weight.stride(0),
        weight.stride(1),
        conv_pool.stride(0),
        conv_pool.stride(1),
        conv_pool.stride(2),
        KC=Kc,
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=num_warps,
        **pdl_launch(qkv),
    )
    return result


# ----------------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------------


def gdn_conv_prefill(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    conv_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_init: torch.Tensor,
    max_len: int,
    impl: str = "auto",
    parts=None,
    out: torch.Tensor | None = None,
):
    """Causal depthwise conv + SiLU over a varlen batch, continuing from the pool's slots (read only).

    ``qkv [T, C]`` (unit column stride, row stride free: may be columns of a fused projection output),
    ``weight [C, Kc]``, ``conv_pool [S, C, Kc-1]`` (any dtype: its values are rounded to qkv's), ``cu_seqlens [N+1]``
    int32, ``slots [N]`` int, ``has_init [N]`` bool or int (nonzero: continue from the slot, else from zeros), all
    on qkv's device; ``max_len`` the longest sequence (host int, sizes the Triton grid). Returns ``y [T, C]``
    contiguous in qkv's dtype, or with ``parts`` (column widths summing to C, at most 3) a tuple of contiguous
    ``[T, width]`` tensors, the blocks of ``out`` (flat, ``rows * C`` elements, ``rows >= T``: ``parts_views``) when
    given. ``impl``: ``auto`` (Triton on CUDA, torch elsewhere) | ``triton`` | ``torch``."""
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown GDN conv prefill implementation {impl!r}")
    if impl == "triton" or (impl == "auto" and qkv.is_cuda and triton is not None):
        return gdn_conv_prefill_triton(
            qkv, weight, conv_pool, cu_seqlens, slots, has_init, max_len, parts=parts, out=out
        )
    y = gdn_conv_prefill_torch(qkv, weight, conv_pool, cu_seqlens, slots, has_init, max_len)
    if parts is None:
        return y
    buf, rows = _parts_buffer(qkv, tuple(parts), out)
    views = parts_views(buf, rows, y.shape[0], tuple(parts))
    for view, part in zip(views, torch.split(y, list(parts), dim=-1)):
        view.copy_(part)
    return views
