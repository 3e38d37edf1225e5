"""The quantized layers' torch references: ``Nvfp4Linear`` / ``Fp8Linear`` equal a matmul with the dequantized
weight; ``Nvfp4Experts`` (``kernels/nvfp4_moe.py``) equals ``fused_moe_torch`` over the whole bank dequantized, on
the decode (gather) and prefill (loop) paths; ``fuse_linears`` over quantized parts runs them part by part."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernels.fused_moe import fused_moe_torch
from freetoken.layers.fused_linear import PartwiseLinear, fuse_linears
from freetoken.layers.nvfp4_experts import Nvfp4Experts
from freetoken.layers.quantized_linear import Fp8Linear, Nvfp4Linear
from freetoken.quant import fp8, nvfp4


def _nvfp4_linear(n, k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    lin = Nvfp4Linear(k, n, dtype=torch.float32, device=device)
    q = nvfp4.quantize(w)
    with torch.no_grad():
        lin.weight.copy_(q.packed), lin.weight_scale.copy_(q.scale), lin.weight_scale_2.copy_(q.scale_2)
    return lin


def test_linears_equal_dequantized_matmul():
    x = torch.randn(5, 64)
    lin = _nvfp4_linear(48, 64, 0)
    assert torch.equal(lin(x), F.linear(x, nvfp4.dequantize(lin.weight, lin.weight_scale, lin.weight_scale_2)))
    f = Fp8Linear(64, 32, dtype=torch.float32)
    w, s = fp8.quantize(torch.randn(32, 64))
    with torch.no_grad():
        f.weight.copy_(w), f.weight_scale.copy_(s)
    assert torch.equal(f(x), F.linear(x, fp8.dequantize(w, s)))
    plain = torch.nn.Linear(64, 8, bias=False)
    fused = fuse_linears(plain, lin, f)
    assert isinstance(fused, PartwiseLinear)
    a, b, c = fused.split(fused(x))
    assert torch.equal(a, plain(x)) and torch.equal(b, lin(x)) and torch.equal(c, f(x))


def _bank(E=6, H=32, I=16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    ex = Nvfp4Experts(E, H, I, device=device)
    for e in range(E):
        for name, w in (("gate_proj", w13[e, :I]), ("up_proj", w13[e, I:]), ("down_proj", w2[e])):
            q = nvfp4.quantize(w)
            ex.load_expert_weight(f"{e}.{name}.weight", q.packed)
            ex.load_expert_weight(f"{e}.{name}.weight_scale", q.scale)
            ex.load_expert_weight(f"{e}.{name}.weight_scale_2", q.scale_2.reshape(1))
    assert ex.missing_weights() == []
    return ex


@pytest.mark.parametrize("T", [1, 5, 40])  # 5*2 pairs gather, 40*2 loop
def test_nvfp4_experts_equal_fused_moe_over_the_dequantized_bank(T):
    ex = _bank()
    x = torch.randn(T, 32)
    ids = torch.randint(0, 6, (T, 2))
    ids[0, 1] = -1  # an id outside the bank adds nothing
    w = torch.rand(T, 2)
    d13 = nvfp4.dequantize(ex.gate_up_proj, ex.gate_up_proj_scale, ex.gate_up_proj_global)
    d2 = nvfp4.dequantize(ex.down_proj, ex.down_proj_scale, ex.down_proj_global)
    assert torch.equal(ex(x, ids, w), fused_moe_torch(x, d13, d2, ids, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvfp4_experts_cuda_and_graph_capture():
    ex_cpu, ex = _bank(), _bank(device="cuda")
    x, ids, w = torch.randn(16, 32), torch.randint(0, 6, (16, 8)), torch.rand(16, 8)
    ref = ex_cpu(x, ids, w)
    got = ex(x.cuda(), ids.cuda(), w.cuda())
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-5, atol=1e-5)
    xs, ids_s, w_s = x.cuda(), ids.cuda(), w.cuda()
    ex(xs, ids_s, w_s)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ex(xs, ids_s, w_s)  # 128 pairs: the gather path, no host sync
    graph.replay()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
