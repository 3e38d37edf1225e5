"""Programmatic dependent launch (``kernels/pdl.py``): the switch, and on the GPU a chain of decode-path kernels in
one CUDA graph, each reading the one before it, giving bit for bit what the chain gives without PDL (and with the
GEMVs' L2 prefetch), replay after replay with new inputs (a kernel that read its input before ``griddepcontrol.wait``
would read the previous replay's values now and then). The tiny models' greedy tokens with PDL:
tests/test_decode_graphs.py."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.pdl import pdl_launch, pdl_mode, pdl_requested


def test_pdl_switch(monkeypatch):
    monkeypatch.delenv("FREETOKEN_PDL", raising=False)
    assert pdl_mode() == "prefetch" and pdl_requested()  # on by default (sm_90+ only: pdl_launch decides per device)
    monkeypatch.setenv("FREETOKEN_PDL", "")
    assert pdl_mode() == "prefetch"
    monkeypatch.setenv("FREETOKEN_PDL", "0")
    assert not pdl_requested()
    assert pdl_launch(torch.zeros(1)) == {}
    monkeypatch.setenv("FREETOKEN_PDL", "1")
    assert pdl_requested()
    assert pdl_launch(torch.zeros(1)) == {}  # the CPU (the interpreter) never takes it
    monkeypatch.setenv("FREETOKEN_PDL", "prefetch")
    assert pdl_requested()
    monkeypatch.setenv("FREETOKEN_PDL", "yes")
    with pytest.raises(ValueError, match="FREETOKEN_PDL"):
        pdl_requested()


def _chain(x, residual, norm_w, weights, fused):
    """``add_rms_norm`` (in place on the residual) -> NVFP4 linear on fp16 tiles (its x packing launch, then the
    dot) -> SiLU-and-mul -> NVFP4 linear on the packed-half GEMV at one row, and the same at four rows through the
    fp32 GEMV's split K and its reduce; the norm's rows also through a mixed BF16 / FP8 / NVFP4 projection at four
    rows (``mixed_dot``) and at one (``mixed_gemv``): every launch reads what the one before it wrote."""
    from freetoken.kernels.activation import silu_and_mul_triton
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton
    from freetoken.kernels.rms_norm import add_rms_norm

    h, _ = add_rms_norm(x, residual, norm_w, 1e-6, True, inplace=True)
    up = nvfp4_linear_triton(h, *weights[0], path="half_dot")
    act = silu_and_mul_triton(up)
    one = nvfp4_linear_triton(act[:1], *weights[1], path="half")
    four = nvfp4_linear_triton(act, *weights[1], path="gemv")
    return one, four, fused(h), fused(h[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_chain_in_a_graph_equals_the_chain_without(monkeypatch):
    from nvfp4_cases import random_weight
    from test_mixed_gemv import make_parts

    from freetoken.layers.fused_linear import fuse_linears

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    dev, M, H, I = "cuda", 4, 2048, 1024
    weights = [random_weight(2 * I, H, 1, device=dev), random_weight(H, I, 2, device=dev)]
    norm_w = torch.randn(H, device=dev, dtype=torch.bfloat16) * 0.1
    fused = fuse_linears(*make_parts([("f", 512), ("d", 32), ("n", 256)], H, torch.bfloat16, dev))
    gen = torch.Generator(device=dev).manual_seed(3)
    inputs = [torch.randn(M, H, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(64)]
    outs = {}
    for pdl in ("0", "1", "prefetch"):
        monkeypatch.setenv("FREETOKEN_PDL", pdl)
        x = torch.zeros(M, H, device=dev, dtype=torch.bfloat16)
        residual = torch.zeros_like(x)
        _chain(x, residual, norm_w, weights, fused)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results = _chain(x, residual, norm_w, weights, fused)
        got = []
        for v in inputs:
            x.copy_(v)
            residual.copy_(v * 0.5)
            graph.replay()
            got.append([r.clone() for r in results])
        torch.cuda.synchronize()
        outs[pdl] = got
    for mode in ("1", "prefetch"):
        for want, have in zip(outs["0"], outs[mode]):
            assert all(torch.equal(a, b) for a, b in zip(want, have)), mode
