"""Copy missed experts from a layer's host bank into slots of the device expert pool (the fetch half of
``DeviceExpertCache``).

A job list of fixed length ``P`` says what to copy: ``job_src [P]`` (expert rows of the bank ``gate_up [E, 2I, H]``,
``down [E, H, I]``), ``job_dst [P]`` (slots of the pool ``gate_up [S, 2I, H]``, ``down [S, H, I]``), of which only
the first ``num_jobs`` (a device scalar) are real. Nothing here reads ``num_jobs`` on the host, so both versions
can sit inside a CUDA graph whose routing changes from replay to replay.

``gather_experts_torch`` is the reference (and the CPU path): every one of the ``P`` rows is copied, the rows past
``num_jobs`` repeating job 0, so the shapes never depend on the data. ``gather_experts_triton`` launches a grid of
``(P, chunks of one expert)`` programs; programs past ``num_jobs`` exit at once, the others copy one chunk with
wide loads. On CUDA the bank is host memory pinned in place (``cudaHostRegister``: mapped into the device's
address space under UVA), so the kernel reads it across PCIe directly (zero-copy: no cudaMemcpy, nothing for the
host to decide). Many programs in flight keep enough reads outstanding to fill the link.
"""

from __future__ import annotations

import torch

try:  # triton is a hard dependency on GPU machines; keep the reference importable without it
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


def gather_experts_torch(bank_gate_up, bank_down, pool_gate_up, pool_down, job_src, job_dst, num_jobs) -> None:
    """Reference: ``pool[job_dst[j]] = bank[job_src[j]]`` for ``j < num_jobs``, in fixed shapes. Bank, pool and
    jobs on one device (the CPU in practice)."""
    P = job_src.numel()
    if P == 0:
        return
    live = torch.arange(P, device=job_src.device) < num_jobs
    src = torch.where(live, job_src, job_src[0])  # rows past num_jobs repeat job 0: same slot, same bytes
    dst = torch.where(live, job_dst, job_dst[0])
    any_job = (num_jobs > 0).reshape(())  # broadcasts over banks of any rank (BF16 [E, N, K], NVFP4 rows [E, W])
    for bank, pool in ((bank_gate_up, pool_gate_up), (bank_down, pool_down)):
        # with no job at all, write slot job_dst[0] back onto itself
        rows = torch.where(any_job, bank[src], pool[dst])
        pool.index_copy_(0, dst, rows)


if triton is not None:

    @triton.jit
    def _copy_chunk(src, dst, start, numel, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        for off in tl.static_range(0, CHUNK, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            mask = offs < numel
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    @triton.jit
    def _gather_experts_kernel(
        bank_gu_ptr,
        bank_d_ptr,  # [E, 2I, H], [E, H, I]: host memory on CUDA (read through UVA)
        pool_gu_ptr,
        pool_d_ptr,  # [S, 2I, H], [S, H, I]
        job_src_ptr,
        job_dst_ptr,
        num_jobs_ptr,
        gu_numel,
        d_numel,  # elements of one expert's gate_up / down
        stride_bank_gu,
        stride_bank_d,
        stride_pool_gu,
        stride_pool_d,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        job = tl.program_id(0)
        chunk = tl.program_id(1)
        if job < tl.load(num_jobs_ptr):
            e = tl.load(job_src_ptr + job).to(tl.int64)
            s = tl.load(job_dst_ptr + job).to(tl.int64)
            gu_chunks = tl.cdiv(gu_numel, CHUNK)
            if chunk < gu_chunks:
                _copy_chunk(
                    bank_gu_ptr + e * stride_bank_gu,
                    pool_gu_ptr + s * stride_pool_gu,
                    chunk * CHUNK,
                    gu_numel,
                    CHUNK,
                    BLOCK,
                )
            else:
                _copy_chunk(
                    bank_d_ptr + e * stride_bank_d,
                    pool_d_ptr + s * stride_pool_d,
                    (chunk - gu_chunks) * CHUNK,
                    d_numel,
                    CHUNK,
                    BLOCK,
                )


def gather_experts_triton(
    bank_gate_up,
    bank_down,
    pool_gate_up,
    pool_down,
    job_src,
    job_dst,
    num_jobs,
    chunk: int = 16384,
    block: int = 2048,
    num_warps: int = 4,
) -> None:
    """Same contract as ``gather_experts_torch``; rows past ``num_jobs`` are left untouched. On CUDA the banks may be
    pinned host tensors (Triton passes their device address). Works on CPU under TRITON_INTERPRET=1. ``chunk``,
    ``block`` (elements one load covers) and ``num_warps``: launch settings (bench/expert_gather_bench.py sweeps
    them)."""
    assert triton is not None, "triton is not installed"
    P = job_src.numel()
    if P == 0:
        return
    for t in (bank_gate_up, bank_down, pool_gate_up, pool_down):
        assert t[0].is_contiguous(), "each expert must be one contiguous block"
    gu_numel, d_numel = pool_gate_up[0].numel(), pool_down[0].numel()
    largest = triton.next_power_of_2(max(gu_numel, d_numel))
    block = min(block, largest)
    chunk = max(block, min(chunk, largest))
    grid = (P, triton.cdiv(gu_numel, chunk) + triton.cdiv(d_numel, chunk))
    _gather_experts_kernel[grid](
        bank_gate_up,
        bank_down,
        pool_gate_up,
        pool_down,
        job_src,
        job_dst,
        num_jobs,
        gu_numel,
        d_numel,
        bank_gate_up.stride(0),
        bank_down.stride(0),
        pool_gate_up.stride(0),
        pool_down.stride(0),
        CHUNK=chunk,
        BLOCK=block,
        num_warps=num_warps,
        **pdl_launch(pool_gate_up),
    )
