"""The expert-sorted NVFP4 decode gate|up GEMV (``kernels/nvfp4_moe_sorted.py``) inside the decode MoE
(``nvfp4_moe_decode_triton(..., gate_up_block_m=m)``) against ``moe_decode_torch`` over the dequantized bank, and
against the per-pair kernel: experts with more tokens than a program's rows (several blocks of one expert), ids
outside the bank (offload misses, CUDA-graph padding rows), strided x. CPU under TRITON_INTERPRET=1 (tiny shapes,
in a subprocess; fp32 / fp16: the interpreter truncates bf16), CUDA under the ``gpu`` marker at Qwen3.6-35B-A3B's
shapes for the step sizes the dispatch sends here."""

import textwrap

import pytest
import torch
from nvfp4_cases import dequantized_bank, error, random_bank
from triton_interpreter import run_under_interpreter

_TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (8e-2, 4e-2)}


def _routing(T, S, k, g, invalid=False, skew=False):
    logits = torch.randn(T, S, generator=g)
    if skew:  # most tokens on experts 0 and 1: runs longer than a program's rows
        logits[:, :2] += 6
    ids = torch.topk(logits + torch.rand(T, S, generator=g), k, -1).indices
    if invalid:
        ids[0, -1] = -1
        ids[T // 2, 0] = S
        ids[-1] = -3  # a CUDA-graph padding row of the expert cache: nothing in the bank
    w = torch.rand(T, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def check_sorted(T, S, k, H, I, dtype, device, block_m, seed=0, strided_x=False, **routing):
    """The decode MoE with the sorted gate|up at ``block_m`` rows a program vs the reference and vs the per-pair
    kernel; returns the error against the reference."""
    from freetoken.kernels.moe_decode import moe_decode_torch
    from freetoken.kernels.nvfp4_moe import nvfp4_moe_decode_triton

    bank = random_bank(S, H, I, seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H + 8 if strided_x else H, generator=g)[:, :H].to(device, dtype)
    ids, w = _routing(T, S, k, g, **routing)
    ids, w = ids.to(device), w.to(device)
    out = nvfp4_moe_decode_triton(x, *bank, ids, w, gate_up_block_m=block_m)
    ref = moe_decode_torch(x, *dequantized_bank(bank, dtype), ids, w)
    per_pair = nvfp4_moe_decode_triton(x, *bank, ids, w)
    err = error(out, ref)
    tol = _TOL[dtype][device == "cuda"]
    assert err <= tol, ("sorted", T, S, k, H, I, dtype, block_m, err)
    # the same arithmetic in the same order per pair: equal to the per-pair kernel up to fp32 summation order
    assert error(out, per_pair) <= tol, ("sorted vs per pair", T, block_m, error(out, per_pair))
    return err


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import torch
    import test_nvfp4_moe_sorted as t
    for dt in (torch.float32, torch.float16):
        for m in (1, 2, 4):
            t.check_sorted(6, 5, 2, 64, 48, dt, "cpu", m, skew=True)  # runs of up to 6 tokens: several blocks
            t.check_sorted(5, 7, 3, 80, 48, dt, "cpu", m, invalid=True, strided_x=True)  # tails, misses
    print("OK")
    """
)


def test_sorted_gate_up_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=900)


def test_sorted_gate_up_refuses_other_block_sizes():
    pytest.importorskip("triton")
    from freetoken.kernels.nvfp4_moe_sorted import nvfp4_sorted_gate_up

    bank = random_bank(4, 32, 16)
    with pytest.raises(ValueError, match="block_m"):
        nvfp4_sorted_gate_up(torch.randn(2, 32), *bank[:3], torch.zeros(2, 2, dtype=torch.int64), 3)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("block_m", [1, 2, 4])
@pytest.mark.parametrize("T", [8, 16, 32, 64])
def test_sorted_gate_up_cuda_qwen(T, block_m):
    check_sorted(T, 256, 8, 2048, 512, torch.bfloat16, "cuda", block_m, seed=T, invalid=True)


@pytest.mark.gpu
@cuda
def test_sorted_gate_up_cuda_skewed():
    check_sorted(32, 256, 8, 2048, 512, torch.bfloat16, "cuda", 4, skew=True)
