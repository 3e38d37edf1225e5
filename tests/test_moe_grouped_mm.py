"""The BF16 grouped MoE through ``torch._grouped_mm`` (``kernels/moe_grouped_mm.py``): the pair sort it runs on
against a plain reading of it, then the whole MoE against ``fused_moe_torch`` (the HF loop) and against the Triton
grouped kernels, with and without the shared term, with pairs routed to no expert (a MoE prefill graph's padding),
an expert with no rows, and every pair on one expert. CPU (torch's own grouped GEMM, torch >= 2.9) and CUDA
(CUTLASS on sm_90)."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels.fused_moe import fused_moe_torch
from freetoken.kernels.moe_grouped_mm import fused_moe_grouped_mm, grouped_mm_supported, sort_pairs_by_expert


def test_pairs_sorted_by_expert():
    ids = torch.tensor([[3, 0], [5, 3], [1, 0], [6, 6]])  # 5 and 6: outside 5 experts (dropped)
    order, ends, position = sort_pairs_by_expert(ids, 5)
    flat = ids.reshape(-1)
    assert flat[order].tolist() == [0, 0, 1, 3, 3, 5, 6, 6]
    assert order.tolist()[:5] == [1, 5, 4, 0, 3]  # stable: a pair's rows keep token order within an expert
    assert ends.tolist() == [2, 3, 3, 5, 5] and ends.dtype == torch.int32  # expert 2 and 4 have no rows
    assert torch.equal(order[position.long()], torch.arange(8))  # position is order's inverse


def moe_case(T, E, k, H, I, device, seed=0, shared=False, drop=0, one_expert=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(device, torch.bfloat16)
    if one_expert:  # every token on experts 1..k: each of them gets all T rows, the others none
        ids = torch.arange(1, k + 1).repeat(T, 1)
    ids = ids.to(device)
    real = T - drop  # the last ``drop`` tokens are padding: routed to no expert, their outputs unused
    if drop:
        ids[real:] = E
    assert grouped_mm_supported(x, w13, w2)
    kw = {}
    if shared:
        kw = dict(shared=torch.randn(T, H, generator=g).to(device, torch.bfloat16),
                  shared_gate=torch.randn(T, 1, generator=g).to(device, torch.bfloat16))  # fmt: skip
    out = fused_moe_grouped_mm(x, w13, w2, ids, w, **kw)
    ref = fused_moe_torch(x[:real].float(), w13.float(), w2.float(), ids[:real], w[:real].float())
    if shared:
        ref = ref + torch.sigmoid(kw["shared_gate"][:real].float()) * kw["shared"][:real].float()
    assert out.shape == (T, H) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:real].float(), ref, atol=3e-2, rtol=3e-2)
    return x, w13, w2, ids, w, kw, out


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize(
    "case",
    [
        dict(T=37, E=8, k=2, H=64, I=32),
        dict(T=37, E=8, k=2, H=64, I=32, shared=True, seed=1),
        dict(T=40, E=16, k=4, H=64, I=48, drop=5, seed=2),
        dict(T=12, E=8, k=3, H=32, I=16, one_expert=True, seed=3),
    ],
)
def test_grouped_mm_moe_against_the_reference_cpu(case):
    moe_case(device="cpu", **case)


def test_grouped_mm_refuses_what_it_cannot_take():
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    assert grouped_mm_supported(x, w, w[:, :, :32]) == hasattr(torch, "_grouped_mm")
    assert not grouped_mm_supported(x.float(), w.float(), w.float())
    assert not grouped_mm_supported(torch.zeros(4, 60, dtype=torch.bfloat16), w, w)  # 120-byte rows: no TMA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(2184, 256, 8, 2048, 512), (300, 16, 8, 256, 128), (5, 64, 8, 256, 128)])
def test_grouped_mm_moe_cuda(shape):
    from freetoken.kernels.fused_moe import fused_moe_triton

    T, E, k, H, I = shape
    for seed, extra in enumerate([{}, dict(shared=True), dict(drop=min(3, T - 1))]):
        x, w13, w2, ids, w, kw, out = moe_case(T, E, k, H, I, "cuda", seed=seed, **extra)
        real = T - extra.get("drop", 0)
        triton_out = fused_moe_triton(x, w13, w2, ids, w, **kw)
        # both round each pair's down row to bf16 and combine alike: they differ only in the GEMMs' summation order
        torch.testing.assert_close(out[:real].float(), triton_out[:real].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_layer_takes_the_library_route_when_asked(monkeypatch):
    """``run_experts`` above the decode sizes runs ``fused_moe_grouped_mm`` when FREETOKEN_BF16_MOE_GROUPED asks
    for it (and the operands suit it), the Triton kernels otherwise; a bad value is refused in one line."""
    import freetoken.kernels.fused_moe as fused_moe
    import freetoken.kernels.moe_grouped_mm as moe_grouped_mm
    from freetoken.kernels.moe_decode import MAX_PAIRS
    from freetoken.layers.moe import run_experts

    calls = []
    real = moe_grouped_mm.fused_moe_grouped_mm
    monkeypatch.setattr(moe_grouped_mm, "fused_moe_grouped_mm", lambda *a, **kw: calls.append("lib") or real(*a, **kw))
    stand_in = lambda x, w13, w2, ids, w, **kw: calls.append("triton") or fused_moe_torch(x, w13, w2, ids, w)  # noqa: E731
    monkeypatch.setattr(fused_moe, "fused_moe_triton", stand_in)  # the interpreter would take minutes
    T, E, k, H, I = MAX_PAIRS // 2 + 1, 8, 2, 64, 32  # just past the decode GEMVs
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16()
    w13, w2 = torch.randn(E, 2 * I, H, generator=g).bfloat16() / 8, torch.randn(E, H, I, generator=g).bfloat16() / 6
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k, -1)
    ref = fused_moe_torch(x.float(), w13.float(), w2.float(), ids, w)
    monkeypatch.setenv("FREETOKEN_BF16_MOE_GROUPED", "grouped_mm")
    torch.testing.assert_close(run_experts("triton", x, w13, w2, ids, w).float(), ref, atol=3e-2, rtol=3e-2)
    run_experts("triton", x.float(), w13.float(), w2.float(), ids, w)  # fp32: the library takes no fp32
    monkeypatch.delenv("FREETOKEN_BF16_MOE_GROUPED")
    run_experts("triton", x, w13, w2, ids, w)
    assert calls == ["lib", "triton", "triton"]
    monkeypatch.setenv("FREETOKEN_BF16_MOE_GROUPED", "cutlass")
    with pytest.raises(ValueError, match="FREETOKEN_BF16_MOE_GROUPED='cutlass'"):
        run_experts("triton", x, w13, w2, ids, w)


def test_bad_grouped_gemm_variable_stops_start_up(monkeypatch, tmp_path):
    """``FREETOKEN_BF16_MOE_GROUPED`` with an unknown value is refused when a worker starts, in one line naming the
    variable, not at its first prefill."""
    from conftest import assert_start_up_refuses

    assert_start_up_refuses(monkeypatch, tmp_path, "FREETOKEN_BF16_MOE_GROUPED", "cutlass")
