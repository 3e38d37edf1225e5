"""The GPU half of the hybrid MoE backend's mailbox (``freetoken._core.CpuExpertMailbox``,
``crates/ft-py/src/cpu_expert_mailbox.rs``): a decode step hands a layer's host pairs to a polling CPU thread and
takes its sums back, with two kernels and no host node, copy or event in between.

``pack_for_host`` (one program, after the cache's admission): writes the host's pairs (``ids``: the expert where the
cache left slot id -1, else -1), their weights and ``x`` into the call's pinned buffers through UVA, then rings the
mailbox: ``request = (seq << 16) | call`` into the control block's word 0, after a system-scope fence, so the host
never reads a request before its inputs. A layer without host pairs writes nothing and rings nothing, which is what
makes the all-hit step cheap.

``wait_and_add`` (after the layer's GPU kernel): when the layer rang, spins on the control block's word 1 until the
host answered that request (an acquire load at system scope), then adds the host's fp32 sums to the layer's output.
A host that does not answer within ``max_spins`` polls (~1 us each across PCIe) sets the fault word (device and
host copies); from then on nothing rings or waits and the worker's per-step check fails the step.

``state`` (device int64 [3]): the request counter, the current layer's request (0: none) and the fault flag; the
control block (pinned int64 [3]): request, done, fault. Fixed addresses, so both kernels sit in decode CUDA graphs.
Under ``TRITON_INTERPRET=1`` (CPU tests) the system-scope instructions become plain loads and stores.
"""

from __future__ import annotations

import os

import torch

try:  # triton is a hard dependency on GPU machines; keep the module importable without it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

CALL_BITS = 16  # as crates/ft-py/src/cpu_expert_mailbox.rs
# ~1 us a poll across PCIe: a few seconds, far above any layer's host work, far below a client's patience
DEFAULT_MAX_SPINS = 1 << 22


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    @triton.jit
    def _release_store_sys(ptr, value, SYSTEM: tl.constexpr):
        """``*ptr = value`` after every earlier write of this thread is visible to the host."""
        if SYSTEM:
            tl.inline_asm_elementwise(
                "fence.acq_rel.sys; st.relaxed.sys.global.b64 [$1], $2; mov.u32 $0, 0;",
                "=r,l,l",
                [ptr, value],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            tl.store(ptr, value)

    @triton.jit
    def _acquire_load_sys(ptr, SYSTEM: tl.constexpr):
        """``*ptr``, fetched from memory each time; later reads see what the host wrote before it."""
        if SYSTEM:
            value = tl.inline_asm_elementwise(
                "ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=False, pack=1
            )
        else:
            value = tl.load(ptr, volatile=True)
        return value

    @triton.jit
    def _pack_kernel(
        x_ptr,  # [T, H] the layer's input (device)
        topk_ptr,  # [T, k] expert ids
        slot_ptr,  # [T, k] slot ids, -1: the host's pair
        weight_ptr,  # [T, k] routing weights
        host_x_ptr,  # [T, H] bf16, pinned
        host_ids_ptr,  # [T, k] int64, pinned
        host_weight_ptr,  # [T, k] fp32, pinned
        control_ptr,  # pinned int64 [3]
        state_ptr,  # device int64 [3]
        call,
        T,
        H,
        stride_x,
        PAIRS: tl.constexpr,  # T * k
        BLOCK_P: tl.constexpr,
        BLOCK_H: tl.constexpr,
        SYSTEM: tl.constexpr,
    ):
        offs = tl.arange(0, BLOCK_P)
        mask = offs < PAIRS
        slot = tl.load(slot_ptr + offs, mask=mask, other=0)
        host = mask & (slot < 0)
        n = tl.sum(host.to(tl.int32), axis=0)
        faulted = tl.load(state_ptr + 2)
        if (n > 0) & (faulted == 0):
            expert = tl.load(topk_ptr + offs, mask=mask, other=0).to(tl.int64)
            weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(host_ids_ptr + offs, tl.where(host, expert, -1), mask=mask, cache_modifier=".wt")
            tl.store(host_weight_ptr + offs, weight, mask=mask, cache_modifier=".wt")
            for t in range(0, T):
                for h0 in range(0, H, BLOCK_H):
                    cols = h0 + tl.arange(0, BLOCK_H)
                    keep = cols < H
                    row = tl.load(x_ptr + t * stride_x + cols, mask=keep)
                    tl.store(host_x_ptr + t * H + cols, row.to(tl.bfloat16), mask=keep, cache_modifier=".wt")
            seq = tl.load(state_ptr) + 1
            # warps run unsynchronised and each computes the scalars: all must read the counter before one of them
            # writes it back, or a late warp would count twice and ring a request nobody waits for
            tl.debug_barrier()
            request = seq * (1 << 16) + call
            tl.store(state_ptr, seq)
            tl.store(state_ptr + 1, request)
            tl.debug_barrier()  # every thread's writes, then the one request
            _release_store_sys(control_ptr, request, SYSTEM)
        else:
            tl.store(state_ptr + 1, 0)

    @triton.jit
    def _wait_add_kernel(
        y_ptr,  # [T, H] the layer's output, updated in place
        host_out_ptr,  # [T, H] fp32, pinned: the host's sums
        control_ptr,
        state_ptr,
        T,
        H,
        stride_y,
        max_spins,
        BLOCK_H: tl.constexpr,
        SYSTEM: tl.constexpr,
    ):
        request = tl.load(state_ptr + 1)
        if request != 0:
            done = _acquire_load_sys(control_ptr + 1, SYSTEM)
            spins = 0
            while (done != request) & (spins < max_spins):
                done = _acquire_load_sys(control_ptr + 1, SYSTEM)
                spins += 1
            if done == request:
                cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
                keep = cols < H
                for t in range(0, T):
                    y = tl.load(y_ptr + t * stride_y + cols, mask=keep)
                    # .cv: fetched again from host memory, never an earlier step's cached line
                    add = tl.load(host_out_ptr + t * H + cols, mask=keep, cache_modifier=".cv")
                    tl.store(y_ptr + t * stride_y + cols, (y.to(tl.float32) + add).to(y.dtype), mask=keep)
            else:
                tl.store(state_ptr + 2, 1)
                tl.store(control_ptr + 2, 1)


def new_state(device) -> torch.Tensor:
    """The device-side words: request counter, the current layer's request, fault."""
    return torch.zeros(3, dtype=torch.int64, device=device)


def pack_for_host(x, topk_ids, slot_ids, topk_weights, host_x, host_ids, host_weights, control, state, call: int):
    """Writes the pairs with slot id -1 (and x) to the pinned buffers and rings the mailbox for ``call``; nothing
    when there are none. ``x [T, H]`` with unit column stride; ``topk_ids``, ``slot_ids``, ``topk_weights`` [T, k]
    contiguous; ``host_*`` the call's buffers (bf16 [T, H], int64 [T, k], fp32 [T, k])."""
    assert triton is not None, "triton is not installed"
    T, H = x.shape
    pairs = topk_ids.numel()
    assert x.stride(1) == 1 and slot_ids.is_contiguous() and topk_ids.is_contiguous() and topk_weights.is_contiguous()
    assert 0 <= call < (1 << CALL_BITS)
    _pack_kernel[(1,)](
        x, topk_ids, slot_ids, topk_weights, host_x, host_ids, host_weights, control, state, call, T, H,
        x.stride(0), PAIRS=pairs, BLOCK_P=triton.next_power_of_2(max(pairs, 16)),
        BLOCK_H=min(1024, triton.next_power_of_2(H)), SYSTEM=not _interpreted(), num_warps=4,
    )  # fmt: skip


def wait_and_add(y, host_out, control, state, max_spins: int = DEFAULT_MAX_SPINS) -> torch.Tensor:
    """``y += host_out`` once the host answered the layer's request (nothing when it rang none); returns ``y``."""
    assert triton is not None, "triton is not installed"
    T, H = y.shape
    assert y.stride(1) == 1
    block = min(1024, triton.next_power_of_2(H))
    _wait_add_kernel[(triton.cdiv(H, block),)](
        y, host_out, control, state, T, H, y.stride(0), max_spins, BLOCK_H=block, SYSTEM=not _interpreted(),
        num_warps=4,
    )  # fmt: skip
    return y
