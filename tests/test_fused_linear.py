"""``fuse_linears`` over plain ``nn.Linear`` parts: one GEMM whose split output equals each part run on its own, the
parts' parameters views into the fused weight, and an odd total width padded to an aligned row count (the
MoE router | shared gate | shared gate_up is 1281 wide in Qwen3.5/3.6) with the padding never reaching the
output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from freetoken.layers.fused_linear import _ROW_ALIGN, FusedLinear, fuse_linears


@pytest.mark.parametrize("sizes", [(5, 1, 6), (8, 16), (3,)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_output_equals_the_parts(sizes, bias):
    g = torch.Generator().manual_seed(0)
    parts = [nn.Linear(16, n, bias=bias) for n in sizes]
    with torch.no_grad():
        for p in parts:
            p.weight.copy_(torch.randn(p.weight.shape, generator=g))
            if bias:
                p.bias.copy_(torch.randn(p.bias.shape, generator=g))
    x = torch.randn(4, 16, generator=g)
    expected = [p(x) for p in parts]

    fused = fuse_linears(*parts)
    assert isinstance(fused, FusedLinear)
    rows = fused.weight.shape[0]
    assert rows % _ROW_ALIGN == 0 and sum(sizes) <= rows < sum(sizes) + _ROW_ALIGN
    assert torch.count_nonzero(fused.weight[sum(sizes) :]) == 0
    y = fused(x)
    assert y.shape == (4, sum(sizes))
    for got, want, p in zip(fused.split(y), expected, parts):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert p(x).shape == want.shape  # the part still runs on its own, on its view of the fused weight
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for p, s in zip(parts, starts):
        assert p.weight.data_ptr() == fused.weight[s].data_ptr()
