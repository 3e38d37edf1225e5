"""The token-by-token delta-rule kernel for a sequence's short tail (``kernels/gdn_recurrent_piece.py``) against its
torch reference (the layer's recurrence) and, for the reference itself, against the chunked torch form the CPU path
runs; on the CPU under ``TRITON_INTERPRET=1``, on CUDA at Qwen3.6's shape and against fla's chunked kernels."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter


def piece_inputs(T, Hk, Hv, dk, dv, dtype, device="cpu", seed=0):
    """q, k, v as strided views of one conv output (as the layer splits it), fp32 gates, an fp32 state."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    y = torch.randn(T, C + 5, generator=gen).to(device, dtype)[:, :C]
    q, k, v = torch.split(y, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    g = (-torch.rand(T, Hv, generator=gen) * 0.7).to(device)
    beta = torch.rand(T, Hv, generator=gen).to(device)
    state = (0.2 * torch.randn(1, Hv, dk, dv, generator=gen)).to(device)
    return q.reshape(T, Hk, dk), k.reshape(T, Hk, dk), v.reshape(T, Hv, dv), g, beta, state


def check_piece(T, Hk, Hv, dk, dv, dtype, device="cpu", seed=0, scale=None, into_rows=False, **launch):
    """Triton (``launch``: its warps / block_v) vs the torch reference; returns (max |do|, max |dS|).
    ``into_rows``: o goes into rows of a larger output (``out=``), whose other rows must stay as they were."""
    from freetoken.kernels.gdn_recurrent_piece import gdn_recurrent_piece_torch, gdn_recurrent_piece_triton

    q, k, v, g, beta, state = piece_inputs(T, Hk, Hv, dk, dv, dtype, device, seed)
    before = state.clone()
    whole = torch.full((T + 3, Hv, dv), 7.0, dtype=v.dtype, device=device) if into_rows else None
    if into_rows:
        launch["out"] = whole[2 : 2 + T]
    o, final = gdn_recurrent_piece_triton(q, k, v, g, beta, state, scale, **launch)
    if into_rows:
        assert o.data_ptr() == whole[2].data_ptr()
        assert (whole[:2] == 7.0).all() and (whole[2 + T :] == 7.0).all()
    o_ref, final_ref = gdn_recurrent_piece_torch(q, k, v, g, beta, state, scale)
    assert torch.equal(state, before)  # the state before the piece is only read (it may be a pool slot)
    assert o.dtype == v.dtype and o.shape == (T, Hv, dv) and final.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.float(), o_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(final, final_ref, atol=1e-4, rtol=1e-4)
    return (o.float() - o_ref.float()).abs().max().item(), (final - final_ref).abs().max().item()


def test_reference_matches_the_chunked_form():
    """The reference is the layer's math: the same tokens through the CPU path's chunked form."""
    from freetoken.kernels.gdn_recurrent_piece import gdn_recurrent_piece_torch
    from freetoken.layers.gated_deltanet import gated_delta_rule

    for T in (1, 5, 63):
        q, k, v, g, beta, state = piece_inputs(T, 2, 4, 16, 24, torch.float32, seed=T)
        o, final = gdn_recurrent_piece_torch(q, k, v, g, beta, state)
        o_c, final_c, _ = gated_delta_rule(q, k, v, g, beta, state, [0, T], False, backend="torch")
        assert (o - o_c).abs().max() < 2e-5 and (final - final_c).abs().max() < 2e-5


def test_dispatch_runs_the_reference_on_cpu(monkeypatch):
    import freetoken.kernels.gdn_recurrent_piece as m

    def boom(*a, **k):
        raise AssertionError("Triton on CPU tensors")

    monkeypatch.setattr(m, "gdn_recurrent_piece_triton", boom)
    q, k, v, g, beta, state = piece_inputs(3, 1, 2, 8, 8, torch.float32)
    o, final = m.gdn_recurrent_piece(q, k, v, g, beta, state)
    whole = torch.zeros(5, 2, 8)
    o2, final2 = m.gdn_recurrent_piece(q, k, v, g, beta, state, out=whole[1:4])
    assert o2.data_ptr() == whole[1].data_ptr() and torch.equal(whole[1:4], o) and torch.equal(final2, final)
    assert o.shape == (3, 2, 8) and final.shape == (1, 2, 8, 8)


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_gdn_recurrent_piece import check_piece
    f32, bf16 = torch.float32, torch.bfloat16
    # T, Hk, Hv, dk, dv, dtype, scale
    for i, (T, Hk, Hv, dk, dv, dt, scale, rows) in enumerate([
        (1, 2, 4, 16, 8, f32, None, False),     # one token, GVA r = 2, dk != dv
        (7, 3, 3, 8, 16, f32, 0.3, False),      # r = 1, explicit scale
        (5, 1, 3, 12, 20, bf16, None, True),    # r = 3, dims not powers of 2, bf16, o into a larger output's rows
        (9, 2, 2, 32, 40, f32, None, False),    # several value blocks, the last one partial
    ]):
        diffs = check_piece(T, Hk, Hv, dk, dv, dt, seed=i, scale=scale, into_rows=rows)
        print("piece", T, Hk, Hv, dk, dv, dt, "max|do|=%.3g max|dS|=%.3g" % diffs)
    print("OK")
    """
)


def test_piece_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 8, 63])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("warps", [1, 4])
def test_piece_cuda_at_qwen_shape(T, dtype, warps):
    """Qwen3.6-35B-A3B's GDN shape (16 key heads, 32 value heads, 128 x 128 state) against the reference, and against
    fla's chunked kernels over the same tokens (the path a piece of >= 64 tokens takes)."""
    from freetoken.kernels.gdn_recurrent_piece import gdn_recurrent_piece_triton
    from freetoken.layers import gated_deltanet as gdn

    check_piece(T, 16, 32, 128, 128, dtype, "cuda", seed=T, warps=warps, into_rows=T == 8)
    if gdn._fla_ops() is None:
        pytest.skip("fla not importable")
    q, k, v, g, beta, state = piece_inputs(T, 16, 32, 128, 128, dtype, "cuda", seed=T + 1)
    o, final = gdn_recurrent_piece_triton(q, k, v, g, beta, state)
    o_f, final_f = gdn._fla_gated_delta_rule(q, k, v, g, beta, state.clone(), [0, T], False)
    # fla rounds its normalised q / k and intermediates to the input dtype: bf16 inputs give bf16-sized differences
    o_tol, s_tol = (2e-3, 2e-3) if dtype == torch.float32 else (5e-2, 2e-2)
    assert (o.float() - o_f.float()).abs().max() < o_tol and (final - final_f.float()).abs().max() < s_tol
