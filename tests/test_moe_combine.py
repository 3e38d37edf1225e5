"""The grouped MoE's last step (``kernels/moe_combine.py``): each token's k weighted expert rows summed and the gated
shared expert added in one launch, against the torch ops it replaces (the sum over k, the cast, and
``SharedExpertTerm.add_to``), rounded as they round; then the grouped kernels (BF16/FP16 and NVFP4) with the shared
term passed in against their reference plus ``add_to``. CPU under TRITON_INTERPRET=1 (fp32 and fp16: the
interpreter truncates where a cast to bf16 rounds), and bf16 on CUDA."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter

from freetoken.kernels.moe_combine import moe_combine_torch


def combine_case(T, k, H, dtype, device, shared=True, seed=0, weighted=False):
    """``moe_combine_triton`` against ``moe_combine_torch``, the shared term as the column views of one fused
    projection output (as the MoE block hands them over); ``weighted``: rows in ``dtype`` scaled by routing weights
    in the combine (the BF16 grouped kernel's form), else fp32 rows already scaled. Returns the largest
    difference."""
    from freetoken.kernels.moe_combine import moe_combine_triton

    g = torch.Generator().manual_seed(seed)
    partial = torch.randn(T * k, H, generator=g).to(device)
    weights = None
    if weighted:
        partial = partial.to(dtype)
        weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(device, dtype)
    fused = (2 * torch.randn(T, 1 + H + 3, generator=g)).to(device, dtype)
    gate, s = (fused[:, :1], fused[:, 1 : 1 + H]) if shared else (None, None)
    ref = moe_combine_torch(partial, k, dtype, s, gate, weights=weights)
    out = moe_combine_triton(partial, k, dtype, s, gate, weights=weights)
    assert out.dtype == dtype and out.shape == (T, H)
    # the same roundings in the same order, but Triton's exponential is not torch's (on CUDA it differs in the last
    # bits, which tips the sigmoid's rounding in ~20 % of rows): within a unit in the last place of the operands
    # (the result can be far smaller than they are: routed + gated shared cancel)
    ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    diff = (out.float() - ref.float()).abs()
    routed = moe_combine_torch(partial, k, dtype, weights=weights)
    bound = routed.float().abs() + (s.float().abs() if shared else 0)
    assert bool((diff <= ulp * bound + 1e-6).all()), diff.max()
    if not shared:  # no exponential involved: the same bits
        assert torch.equal(out, ref)
    if shared:  # the shared term is really in there
        assert (out.float() - routed.float()).abs().max() > 0.1
    if weighted:  # and so are the weights
        assert (out.float() - moe_combine_torch(partial.float(), k, dtype, s, gate).float()).abs().max() > 0.1
    # rows left in another order (expert order: moe_grouped_mm.py) and read through each pair's position
    order = torch.randperm(T * k, generator=g).to(device)
    position = torch.empty_like(order)
    position[order] = torch.arange(T * k, device=device)
    permuted = moe_combine_triton(partial[order], k, dtype, s, gate, weights=weights, rows_at=position.int())
    assert torch.equal(permuted, out)
    if T * k > 1:  # and the positions are really read
        shuffled = moe_combine_triton(partial[order], k, dtype, s, gate, weights=weights)
        assert not torch.equal(shuffled, out)
    if weighted and dtype != torch.float32:
        # fp32 weights are rounded to dtype where they are read (the router's softmax output, passed as it is):
        # fp32 values within a quarter unit of the dtype weights give the same bits
        w32 = weights.float() * (1 + torch.rand(weights.shape, generator=g).to(device) * 2**-12)
        assert not torch.equal(w32, weights.float())
        assert torch.equal(moe_combine_triton(partial, k, dtype, s, gate, weights=w32), out)
        assert torch.equal(moe_combine_torch(partial, k, dtype, s, gate, weights=w32), ref)
    return (out.float() - ref.float()).abs().max().item()


def grouped_case(T, E, k, H, I, dtype, device, nvfp4=False, seed=0):
    """A grouped kernel with the shared term passed in equals its torch reference plus ``add_to``."""
    from nvfp4_cases import random_bank

    from freetoken.kernels.fused_moe import fused_moe_torch, fused_moe_triton
    from freetoken.kernels.nvfp4_moe import nvfp4_fused_moe_triton, nvfp4_moe_torch
    from freetoken.layers.moe import SharedExpertTerm

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k, -1)
    w, ids = (w / w.sum(-1, keepdim=True)).to(device, dtype), ids.to(device)
    term = SharedExpertTerm(
        torch.randn(T, 1, generator=g).to(device, dtype), output=torch.randn(T, H).to(device, dtype)
    )
    if nvfp4:
        bank = random_bank(E, H, I, seed=seed, device=device)
        ref = term.add_to(nvfp4_moe_torch(x, *bank, ids, w))
        out = nvfp4_fused_moe_triton(x, *bank, ids, w, shared=term.output, shared_gate=term.gate_logit)
    else:
        w13, w2 = w13.to(device, dtype), w2.to(device, dtype)
        ref = term.add_to(fused_moe_torch(x, w13, w2, ids, w))
        out = fused_moe_triton(x, w13, w2, ids, w, shared=term.output, shared_gate=term.gate_logit)
    tol = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_torch_reference_is_the_ops_it_replaces():
    from freetoken.layers.moe import SharedExpertTerm

    partial, gate, s = torch.randn(12, 5), torch.randn(4, 1), torch.randn(4, 5)
    routed = partial.view(4, 3, 5).sum(dim=1)
    assert torch.equal(moe_combine_torch(partial, 3, torch.float32), routed)
    assert torch.equal(moe_combine_torch(partial, 3, torch.float32, s, gate), SharedExpertTerm(gate, s).add_to(routed))
    w = torch.rand(4, 3)
    weighted = (partial.view(4, 3, 5) * w[..., None]).sum(dim=1)
    assert torch.allclose(moe_combine_torch(partial, 3, torch.float32, weights=w), weighted, atol=1e-6)


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_moe_combine import combine_case, grouped_case
    for dt in (torch.float32, torch.float16):
        combine_case(3, 8, 100, dt, "cpu")  # H under one column block, masked
        combine_case(2, 3, 1500, dt, "cpu", seed=1)  # two column blocks
        combine_case(4, 1, 64, dt, "cpu", seed=2)  # top-1
        combine_case(3, 2, 40, dt, "cpu", shared=False, seed=3)
        combine_case(3, 8, 100, dt, "cpu", seed=4, weighted=True)
        combine_case(2, 3, 40, dt, "cpu", shared=False, seed=5, weighted=True)
    grouped_case(9, 6, 2, 32, 16, torch.float32, "cpu")
    grouped_case(9, 6, 2, 32, 16, torch.float16, "cpu", nvfp4=True, seed=1)
    print("OK")
    """
)


def test_moe_combine_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_moe_combine_cuda(dtype):
    for seed, (T, k, H, shared) in enumerate([(2184, 8, 2048, True), (7, 8, 2048, False), (33, 3, 1000, True)]):
        combine_case(T, k, H, dtype, "cuda", shared=shared, seed=seed)
        combine_case(T, k, H, dtype, "cuda", shared=shared, seed=seed, weighted=True)
    grouped_case(300, 16, 8, 256, 128, dtype, "cuda")
    grouped_case(300, 16, 8, 256, 128, dtype, "cuda", nvfp4=True)
