"""The FP8 prefill path for NVFP4 experts (``kernels/nvfp4_fp8_moe.py``): the bank's conversion to E4M3 and the
rows' quantization against their definitions, the Triton kernels against the torch references (bit for bit: the
kernels round to the E4M3 grid themselves, ``kernels/e4m3.py``), and the whole
step against the W4A16 reference (``nvfp4_moe_torch``) within FP8's error: ids outside the bank, an expert with no
rows, every pair on one expert, the shared term, the offload stream's strided bank views."""

from __future__ import annotations

import textwrap

import pytest
import torch
from nvfp4_cases import random_bank
from triton_interpreter import run_under_interpreter

from freetoken.kernels.nvfp4_fp8_moe import (
    FP8,
    FP8_MAX,
    fp8_row_factors,
    nvfp4_fp8_moe,
    nvfp4_to_fp8,
    quantize_rows_fp8_torch,
    scaled_grouped_mm_torch,
)
from freetoken.quant import nvfp4

# The step's error against the W4A16 reference, relative to the reference's norm. One E4M3 rounding of Gaussian-like
# values costs ~2.5 % of their norm (4 significant bits); a GEMM of rounded rows and weights ~3.5 %; the step rounds
# four times (x, gate|up, the intermediate rows, down): ~5-6 % on these random banks.
_STEP_TOL = 0.08


def test_row_factors_are_powers_of_two_that_fill_e4m3():
    _, scale, glob, *_ = random_bank(6, 64, 32, seed=1)
    scale[2, 5] = 0  # an all-zero row (a dummy expert's)
    f, w_scale = fp8_row_factors(scale, glob)
    mantissa, _ = torch.frexp(f)
    assert torch.all(mantissa == 0.5)  # multiplying by f rounds nothing
    rowmax = scale.float().amax(-1)
    top = 6 * rowmax * f
    live = rowmax > 0
    assert torch.all(top[live] <= FP8_MAX) and torch.all(top[live] > FP8_MAX / 2)
    assert f[2, 5] == 1 and torch.equal(w_scale, glob / f)


def test_conversion_against_the_dequantized_bank():
    packed, scale, glob, *_ = random_bank(4, 128, 64, seed=2)
    wq, w_scale = nvfp4_to_fp8(packed, scale, glob, impl="torch")
    assert wq.dtype == FP8 and wq.shape == (4, 128, 128) and w_scale.shape == (4, 128)
    exact = nvfp4.dequantize(packed, scale, glob)  # fp32: code * scale * global
    got = wq.float() * w_scale[..., None]
    # one E4M3 rounding of code * scale * f: half a step of 4 significant bits, or of the subnormal grid 2^-9
    bound = exact.abs() * 2.0**-4 + 2.0**-10 * w_scale[..., None]
    assert torch.all((got - exact).abs() <= bound)
    assert (got == exact).float().mean() > 0.5  # most products have at most four significant bits


def test_rows_quantized_per_row():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 96, generator=g).to(torch.bfloat16)
    x[4] = 0
    q, s = quantize_rows_fp8_torch(x)
    assert q.dtype == FP8 and s.shape == (9,)
    assert torch.all(q[4].float() == 0)
    assert torch.equal(q.float().abs().amax(-1)[[0, 1, 2, 3, 5, 6, 7, 8]], torch.full((8,), FP8_MAX))
    back = q.float() * s[:, None]
    assert torch.all((back - x.float()).abs() <= x.float().abs() * 2.0**-4 + s[:, None] * 2.0**-10)
    gu = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    q2, s2 = quantize_rows_fp8_torch(gu, silu_mul=True)
    act = torch.nn.functional.silu(gu[:, :32].float()) * gu[:, 32:].float()
    assert q2.shape == (5, 32)
    assert torch.all((q2.float() * s2[:, None] - act).abs() <= act.abs() * 2.0**-4 + s2[:, None] * 2.0**-10)


def test_scaled_grouped_mm_reference_reads_groups_and_scales():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(7, 32, generator=g).to(FP8)
    b = torch.randn(3, 16, 32, generator=g).to(FP8)
    sa, sb = torch.rand(7, generator=g) + 0.5, torch.rand(3, 16, generator=g) + 0.5
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)  # group 1 empty, row 6 past the last end
    out = scaled_grouped_mm_torch(a, b.transpose(1, 2), sa, sb, offs, torch.float32)
    assert torch.allclose(out[1], (a[1].float() @ b[0].float().T) * sa[1] * sb[0])
    assert torch.allclose(out[4], (a[4].float() @ b[2].float().T) * sa[4] * sb[2])
    assert torch.all(out[6] == 0)


def check_step(T, E, k, H, I, device, seed=0, invalid=False, one_expert=False, shared=False, strided=False,
               dtype=torch.bfloat16, chunk_tokens=None):  # fmt: skip
    """``nvfp4_fp8_moe`` against ``nvfp4_moe_torch`` (the W4A16 reference) within ``_STEP_TOL`` of the reference's
    norm; returns the relative error."""
    from freetoken.kernels.nvfp4_moe import nvfp4_moe_torch

    bank = random_bank(E, H, I, seed, plain_scales=True, device=device)
    if strided:  # the offload prefill stream's row views (moe/nvfp4_rows.py)
        from freetoken.moe.nvfp4_rows import Nvfp4Rows

        layout = Nvfp4Rows(H, I)
        views = layout.views(*layout.allocate(E, device=device))
        for v, t in zip(views, bank):
            v.copy_(t)
        bank = tuple(views)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=g), -1), k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(device, dtype)
    if one_expert:
        ids = torch.arange(1, k + 1).repeat(T, 1)
    if invalid:  # ids outside the bank weigh nothing
        ids[0, -1], ids[T // 2, 0], ids[T - 1, 0] = -1, E, E + 3
    ids = ids.to(device)
    kw = {}
    if shared:
        kw = dict(shared=torch.randn(T, H, generator=g).to(device, dtype),
                  shared_gate=torch.randn(T, 1, generator=g).to(device, dtype))  # fmt: skip
    out = nvfp4_fp8_moe(x, *bank, ids, w, **kw)
    if chunk_tokens:  # the tokens in pieces over the bank converted once: each row as in one piece
        pieces = nvfp4_fp8_moe(x, *bank, ids, w, **kw, chunk_tokens=chunk_tokens)
        torch.testing.assert_close(pieces, out, rtol=1e-2, atol=1e-3)
    valid = (ids >= 0) & (ids < E)
    ref = nvfp4_moe_torch(x, *bank, torch.where(valid, ids, 0), torch.where(valid, w, 0)).float()
    if shared:
        ref = ref + torch.sigmoid(kw["shared_gate"].float()) * kw["shared"].float()
    assert out.shape == (T, H) and out.dtype == dtype and torch.isfinite(out).all()
    err = float((out.float() - ref).norm() / ref.norm())
    assert err < _STEP_TOL, (T, E, k, H, I, invalid, one_expert, shared, strided, err)
    return err


@pytest.mark.parametrize(
    "case",
    [
        dict(T=40, E=8, k=2, H=64, I=32),
        dict(T=33, E=16, k=4, H=64, I=48, invalid=True, seed=1),
        dict(T=12, E=8, k=3, H=32, I=32, one_expert=True, seed=2),
        dict(T=20, E=8, k=2, H=64, I=32, shared=True, strided=True, seed=3, chunk_tokens=7),
    ],
)
def test_step_against_the_w4a16_reference_cpu(case):
    err = check_step(device="cpu", **case)
    assert err > 1e-3  # rounded to E4M3: the path cannot be the reference itself


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from nvfp4_cases import random_bank
    from freetoken.kernels import nvfp4_fp8_moe as m
    from freetoken.moe.nvfp4_rows import Nvfp4Rows
    bank = random_bank(3, 64, 48, seed=5)
    bank[1][1, 7] = 0  # an all-zero row of block scales
    layout = Nvfp4Rows(64, 48)
    views = layout.views(*layout.allocate(3))
    for v, t in zip(views, bank):
        v.copy_(t)
    for part in (bank[:3], bank[3:], views[:3], views[3:]):  # contiguous, and the offload stream's strided rows
        q, s = m.nvfp4_to_fp8(*part, impl="triton")
        rq, rs = m.nvfp4_to_fp8(*part, impl="torch")
        assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "conversion"
    g = torch.Generator().manual_seed(6)
    x = torch.randn(11, 80, generator=g).to(torch.bfloat16)
    for silu in (False, True):
        q, s = m.quantize_rows_fp8_triton(x, silu_mul=silu)
        rq, rs = m.quantize_rows_fp8_torch(x, silu_mul=silu)
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
        if not silu:  # the same fp32 products, rounded the same way
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "rows"
        step = (q.float() - rq.float()).abs()  # SiLU's exp may differ in its last bit: a value one E4M3 step away
        assert torch.all(step <= rq.float().abs() * 2.0**-3 + 2.0**-9), ("rows", silu)
        assert (step > 0).float().mean() < 0.01, ("rows", silu)
    print("OK")
    """
)


def test_fp8_kernels_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=600)


@pytest.mark.gpu
def test_fp8_kernels_match_references_cuda():
    bank = random_bank(5, 2048, 512, seed=7, device="cuda")  # Qwen3.6's expert widths: 128 and 32 scales a row
    for part in (bank[:3], bank[3:]):
        q, s = nvfp4_to_fp8(*part, impl="triton")
        rq, rs = nvfp4_to_fp8(*part, impl="torch")
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    from freetoken.kernels.nvfp4_fp8_moe import quantize_rows_fp8_triton

    x = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16)
    for silu in (False, True):
        q, s = quantize_rows_fp8_triton(x, silu_mul=silu)
        rq, rs = quantize_rows_fp8_torch(x, silu_mul=silu)
        torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
        if not silu:
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        step = (q.float() - rq.float()).abs()
        assert torch.all(step <= rq.float().abs() * 2.0**-3 + 2.0**-9) and (step > 0).float().mean() < 1e-3


@pytest.mark.gpu
def test_scaled_grouped_mm_matches_reference_cuda():
    g = torch.Generator().manual_seed(8)
    a = torch.randn(300, 256, generator=g).to("cuda", FP8)
    b = torch.randn(6, 128, 256, generator=g).to("cuda", FP8)
    sa, sb = (torch.rand(300, generator=g) + 0.5).cuda(), (torch.rand(6, 128, generator=g) + 0.5).cuda()
    offs = torch.tensor([50, 50, 51, 180, 299, 300], dtype=torch.int32, device="cuda")  # an empty group, a lone row
    out = torch._scaled_grouped_mm(a, b.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16)
    ref = scaled_grouped_mm_torch(a, b.transpose(1, 2), sa, sb, offs, torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [
        dict(T=300, E=16, k=4, H=256, I=128),
        dict(T=257, E=32, k=8, H=512, I=256, invalid=True, seed=1),
        dict(T=64, E=8, k=2, H=256, I=128, one_expert=True, seed=2),
        dict(T=200, E=16, k=4, H=256, I=128, shared=True, strided=True, seed=3, chunk_tokens=64),
        dict(T=2048, E=64, k=8, H=2048, I=512, seed=4),  # Qwen3.6's expert shapes
    ],
)
def test_step_against_the_w4a16_reference_cuda(case):
    check_step(device="cuda", **case)
