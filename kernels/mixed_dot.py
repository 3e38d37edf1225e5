"""The mixed BF16 / FP8 / NVFP4 projection of ``mixed_gemv.py`` on tensor cores, for a few rows of x (up to
``MAX_M``): the decode steps of 3..32 sequences.

    x [M, K] (bf16 or fp16), rows: ``MixedRows`` (dense, FP8 E4M3 with a scale per row, NVFP4)  ->  [M, out_features]

Why: past the GEMV's few rows (``mixed_gemv.MAX_M`` / ``FP8_MAX_M``) a projection ran part by part: the FP8 parts as
an activation-quantization kernel and one W8A8 ``_scaled_mm`` per part, the dense and NVFP4 parts as their own
GEMMs, then a concatenation. On the H200 the GDN input projection of Qwen3.6's NVFP4 checkpoint took 28-42 us at
8 rows of x (2026-12-04) where its 25 MB of weights take ~6 us to read, and a decode step runs 70 such projections. Here each program takes ``BLOCK_N`` rows of one format (no divergence) against all rows of x
padded to 16 or 32 (masked loads read zeros), decodes each K step's weight tile into x's dtype in registers and runs one
``tl.dot`` with fp32 sums; the per-row scale multiplies once at the end. Decoding is exact: an E4M3 byte converts to
bf16 and fp16 without rounding (Triton's FP8 conversion to fp16: one ``cvt`` for two bytes on sm_89/90), an NVFP4
code times its block scale is ``nvfp4_tiles.dequant_tile_words``' exact tile. So it differs from ``mixed_gemv_torch`` (the
reference, which rounds ``weight * scale`` to x's dtype before its matmul) by that rounding and the order of the
sums. One launch whose grid depends only on the shapes: CUDA-graph capturable.

Needs FP8 conversions on the device when there are FP8 rows (sm_89+; the interpreter has them too); elsewhere the
parts keep their own kernels (``use_mixed_dot``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .device_sms import scaled
from .mixed_gemv import (
    MixedRows,
    candidate_rows,
    flat_rows,
    format_flags,
    launch_args,
    mixed_gemv_triton,
    supports,
    use_mixed_gemv,
)

try:  # keep the module importable without triton
    import triton
    import triton.language as tl

    from .mixed_gemv import prefetch_program_rows, program_format
    from .nvfp4_tiles import TL_DTYPES, tile_dot_step
    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

# rows of x the kernel takes (one tile of x: 16 rows, or 32 above 16); decode batches above run the parts' GEMMs
MAX_M = 32
# rows a program from _MAX_BLOCK_N down to 16 until the grid has about _TARGET_PROGRAMS programs (two per SM of the
# H200), and a K step of _STEP_WEIGHTS weights over the program's rows at 16 rows of x, half as many at 32 (128..512
# a row; None in _BLOCK_K: that rule; the 32-row tiles spill registers on sm_90 with more): each program keeps a few
# steps of its rows' bytes in flight, and a projection with few rows (o_proj: 2,048, 16 a program) is otherwise
# latency-bound (H200, 4 warps and 128-weight steps: 20 us where its 8 MB take 2). That step is the FP8 rows'; BF16
# rows take half as many weights (the same bytes) and NVFP4 rows at most 256 (see the kernel). 2 warps: mma.sync on
# the tile in registers (4 warps take wgmma, which ran the NVFP4 fp16 tiles 1.5x slower on the H200,
# kernels/nvfp4_linear.py). bench/nvfp4_kernel_bench.py --groups mixed --mixed-dot-sweep times the choices.
_BLOCK_K = None
_STEP_WEIGHTS = 8192
_MAX_BLOCK_N = 64
_TARGET_PROGRAMS = 264
_NUM_STAGES = 3
_WARPS = 2

if triton is not None:
    # M not specialized: a step of 16 or 32 rows (divisible by 16) would compile another variant on the request path
    @triton.jit(do_not_specialize=["M"])
    def _mixed_dot_kernel(
        x_ptr,  # [M, K], 16-bit
        out_ptr,  # [M, >= every block's columns]
        d_ptr,  # dense [Nd, K] in x's dtype
        f_ptr,  # fp8 bytes [Nf, K] (uint8)
        fs_ptr,  # fp32 per-row scale [Nf] (stride_fs 0: one scale)
        n_ptr,  # nvfp4 int32 words [Nn, K/8]
        ns_ptr,  # nvfp4 block scale bytes [Nn, K/16]
        ng_ptr,  # fp32 per-row global scale [Nn] (stride_ng 0: one)
        M,
        Nd,
        Nf,
        Nn,
        d_progs,  # programs of the dense rows, then of the fp8 rows; the rest take the nvfp4 rows
        f_progs,
        d_col,
        f_col,
        n_col,
        stride_xm,
        stride_om,
        stride_d,
        stride_f,
        stride_fs,
        stride_n,
        stride_ns,
        stride_ng,
        K,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        DOT_DTYPE: tl.constexpr,  # x's dtype; fp32 under the CPU interpreter (its bf16 tl.dot multiplies raw bits)
        DOT_PREC: tl.constexpr,  # "ieee" for fp32 (never tf32), else unused
        PDL: tl.constexpr = False,  # kernels/pdl.py
        HAS_DENSE: tl.constexpr = True,  # which formats the projection has (``mixed_gemv.format_flags``)
        HAS_FP8: tl.constexpr = True,
        HAS_NVFP4: tl.constexpr = True,
    ):
        prefetch_program_rows(
            tl.program_id(0), d_progs, f_progs, d_ptr, f_ptr, n_ptr, ns_ptr, Nd, Nf, Nn, stride_d, stride_f, stride_n,
            stride_ns, K, BLOCK_N, PDL, HAS_DENSE, HAS_FP8, HAS_NVFP4,
        )  # fmt: skip
        pdl_wait_then_release(PDL)
        pid = tl.program_id(0)
        dt: tl.constexpr = DOT_DTYPE
        offs_b = tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        # xᵀ [BLOCK_K, BLOCK_M] at k = 0 (rows past M read as zeros)
        xt_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ
        dense, fp8 = program_format(pid, d_progs, f_progs, HAS_DENSE, HAS_FP8, HAS_NVFP4)  # absent: not compiled
        if dense:
            offs_n = pid * BLOCK_N + offs_b
            n_mask = offs_n < Nd
            # half the weights a K step: a 16-bit row's step holds an FP8 row's bytes, so the dense branch (in a
            # projection mostly FP8, GDN in_proj's 64 BF16 rows) does not set the kernel's shared memory: 49 KB a
            # program at 256-weight steps where the FP8 branch takes 32 (sm_90): room for 4 programs an SM, not 7
            DENSE_K: tl.constexpr = BLOCK_K // 2
            offs_dk = tl.arange(0, DENSE_K)
            d_ptrs = d_ptr + offs_n[:, None].to(tl.int64) * stride_d + offs_dk[None, :]
            xd_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_dk[:, None]
            for k0 in tl.range(0, K, DENSE_K, num_stages=NUM_STAGES):
                k_mask = (k0 + offs_dk) < K
                w = tl.load(d_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(dt)
                xt = tl.load(xd_ptrs + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0).to(dt)
                acc = tl.dot(w, xt, acc, input_precision=DOT_PREC)
            row_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
            col = d_col
        elif fp8:
            offs_n = (pid - d_progs) * BLOCK_N + offs_b
            n_mask = offs_n < Nf
            f_ptrs = f_ptr + offs_n[:, None].to(tl.int64) * stride_f + offs_k[None, :]
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                k_mask = (k0 + offs_k) < K
                b = tl.load(f_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0).to(tl.uint8)
                # exact; through fp16 and fp32 on purpose: Triton's direct E4M3 -> bf16 converts each fp16 to
                # fp32 with F2F (a quarter-rate unit: 256 a thread a K step at 16 x 512, sm_90 SASS), where the
                # explicit fp16 -> fp32 is a full-rate HADD2
                w = b.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32).to(dt)
                xt = tl.load(xt_ptrs + k0, mask=k_mask[:, None] & m_mask[None, :], other=0.0).to(dt)
                acc = tl.dot(w, xt, acc, input_precision=DOT_PREC)
            row_scale = tl.load(fs_ptr + offs_n * stride_fs, mask=n_mask, other=0.0).to(tl.float32)
            col = f_col
        else:
            offs_n = (pid - d_progs - f_progs) * BLOCK_N + offs_b
            n_mask = offs_n < Nn
            rows = offs_n[:, None].to(tl.int64)
            # at most 256 weights a step: decoding 512 a row spills registers (sm_90: ~450 bytes a thread at 16
            # rows, the MoE router|shared and the shared expert's down), and an NVFP4 row's 256 are 128 bytes
            NVFP4_K: tl.constexpr = min(BLOCK_K, 256)
            offs_nk = tl.arange(0, NVFP4_K)
            offs_w = tl.arange(0, NVFP4_K // 8)
            offs_s = tl.arange(0, NVFP4_K // 16)
            n_ptrs = n_ptr + rows * stride_n + offs_w[None, :]
            s_ptrs = ns_ptr + rows * stride_ns + offs_s[None, :]
            xn_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_nk[:, None]
            for k0 in tl.range(0, K, NVFP4_K, num_stages=NUM_STAGES):
                xt = tl.load(xn_ptrs + k0, mask=((k0 + offs_nk) < K)[:, None] & m_mask[None, :], other=0.0).to(dt)
                acc = tile_dot_step(
                    n_ptrs, s_ptrs, n_mask, k0, K, offs_w, offs_s, xt, acc, BLOCK_N, NVFP4_K // 8, dt, DOT_PREC
                )
            row_scale = tl.load(ng_ptr + offs_n * stride_ng, mask=n_mask, other=0.0).to(tl.float32)
            col = n_col
        y = acc * row_scale[:, None]
        o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + col + offs_n[:, None]
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


def _block_n(rows: tuple[int, int, int]) -> int:
    """Rows a program: ``_MAX_BLOCK_N`` down to 16 until the grid has about ``_TARGET_PROGRAMS`` programs."""
    bn, target = _MAX_BLOCK_N, scaled(_TARGET_PROGRAMS)
    while bn > 16 and sum(triton.cdiv(r, bn) for r in rows) < target:
        bn //= 2
    return bn


def _block_m(M: int) -> int:
    """Rows of x's tile: 16, or 32 above 16."""
    return 16 if M <= 16 else 32


def _block_k(block_n: int, block_m: int = 16) -> int:
    """Weights of a row per K step for programs of ``block_n`` rows against ``block_m`` rows of x (see
    ``_STEP_WEIGHTS``)."""
    return _BLOCK_K or min(512, max(128, _STEP_WEIGHTS * 16 // (block_m * block_n)))


@functools.lru_cache(maxsize=None)
def _cuda_has_fp8(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def launch_variant(M: int, rows: tuple[int, int, int]) -> tuple[int, int, int]:
    """What ``M`` rows of x compile over a projection of ``rows`` (dense, fp8, nvfp4 counts): ``(BLOCK_M, BLOCK_N,
    BLOCK_K)`` (the start-up warm-up reaches each one a step's token count can take; tests check it)."""
    bn, bm = _block_n(rows), _block_m(M)
    return bm, bn, _block_k(bn, bm)


def _device_has_fp8(x: torch.Tensor) -> bool:
    """FP8 conversions where ``x`` lives (the interpreter has them; on CUDA sm_89+); cached per device: the rule
    runs for every projection of an eager step."""
    return not x.is_cuda or _cuda_has_fp8(x.device.index if x.device.index is not None else torch.cuda.current_device())


def mixed_kernel(x: torch.Tensor, rows: Optional[MixedRows], mode: str = "auto"):
    """The one-launch kernel a projection over ``rows`` runs ``x`` through (``kernel(x, rows)``): the mixed GEMV
    up to its few rows, then this one; ``None`` where neither applies (the caller runs its parts). The fused
    projections' rule; a lone quantized Linear takes the GEMV only (``layers/quantized_linear.py`` says why)."""
    if use_mixed_gemv(x, rows, mode):
        return mixed_gemv_triton
    if use_mixed_dot(x, rows, mode):
        return mixed_dot_triton
    return None


def use_mixed_dot(x: torch.Tensor, rows: Optional[MixedRows], mode: str = "auto") -> bool:
    """Whether ``x`` takes the kernel over ``rows``: more rows than the mixed GEMV takes (``rows.max_m``), at most
    ``MAX_M``, 16-bit x, shapes the kernel takes, FP8 conversions on the device where there are FP8 rows, CUDA
    (``auto``) or anywhere (``on``, tests under the interpreter); ``mode`` as ``use_mixed_gemv``'s."""
    m = candidate_rows(x, rows, mode)
    if not (m and rows.max_m < m <= MAX_M) or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return not rows.rows[1] or _device_has_fp8(x)


def mixed_dot_triton(x: torch.Tensor, rows: MixedRows) -> torch.Tensor:
    """``mixed_gemv_torch``'s contract for 16-bit ``x [..., K]`` with at most ``MAX_M`` rows; CUDA, or CPU under
    TRITON_INTERPRET=1."""
    assert triton is not None, "triton is not installed"
    x2, out = flat_rows(x, rows)
    M = x2.shape[0]
    assert M <= MAX_M and supports(rows) and x.dtype in (torch.bfloat16, torch.float16), (M, rows.K, x.dtype)
    if M == 0 or sum(rows.rows) == 0:
        return out.view(*x.shape[:-1], rows.out_features)
    assert rows.rows[0] == 0 or rows.dense.dtype == x.dtype, "dense rows in another dtype than x"
    bm, bn, bk = launch_variant(M, rows.rows)
    programs, args = launch_args(rows, x2, out, bn, torch.uint8)  # FP8 as bytes
    _mixed_dot_kernel[(programs,)](
        *args, rows.K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=_NUM_STAGES,
        DOT_DTYPE=TL_DTYPES[x.dtype] if x.is_cuda else tl.float32, DOT_PREC="ieee", num_warps=_WARPS,
        **format_flags(rows), **pdl_launch(x2),
    )  # fmt: skip
    return out.view(*x.shape[:-1], rows.out_features)
