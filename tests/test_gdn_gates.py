"""Gated DeltaNet gates kernel (``kernels/gdn_gates.py``) vs its torch reference: on CPU under TRITON_INTERPRET=1 (in
a subprocess: the interpreter must be on before triton compiles anything) and on CUDA (``gpu`` marker); ``a`` and
``b`` are column views of a wider projection output, as the layer hands them over."""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter


def check_gates(T, HV, dtype, device, seed=0):
    """Triton vs torch on column views of one projection; ``a`` spans both sides of softplus's threshold."""
    from freetoken.kernels.gdn_gates import gdn_gates_torch, gdn_gates_triton

    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(T, 2 * HV + 7, generator=gen) * 4
    proj[:, 3 + HV] += 40  # a's first head above softplus's threshold (x returned as is), the others below
    proj = proj.to(device, dtype)
    b, a = proj[:, 3 : 3 + HV], proj[:, 3 + HV : 3 + 2 * HV]
    A_log = torch.randn(HV, generator=gen).to(device)
    dt_bias = torch.randn(HV, generator=gen).to(device)
    g, beta = gdn_gates_triton(a, b, A_log, dt_bias)
    g_ref, beta_ref = gdn_gates_torch(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and g.is_contiguous() and g.shape == (T, HV)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, beta_ref, rtol=1e-5, atol=1e-6)
    assert (a.float() + dt_bias > 20).any() and (a.float() + dt_bias < 20).any()  # both sides of the threshold
    # out=: into the rows of a wider buffer (the prefill graphs' static gates), bit-for-bit the same values
    buf = torch.full((2, T + 3, HV), 5.0, device=device)
    got = gdn_gates_triton(a, b, A_log, dt_bias, out=(buf[0, :T], buf[1, :T]))
    assert got[0].data_ptr() == buf.data_ptr() and torch.equal(got[0], g) and torch.equal(got[1], beta)
    assert (buf[:, T:] == 5.0).all()


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_gdn_gates as t
    for T, HV, dt in [(1, 4, torch.float32), (130, 6, torch.bfloat16), (70, 32, torch.float32), (3, 48, torch.float16)]:
        t.check_gates(T, HV, dt, "cpu", seed=T + HV)
    print("OK")
    """
)


def test_gdn_gates_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


def test_dispatch():
    """CPU tensors take the reference; an unknown implementation is refused; zero rows give empty outputs."""
    from freetoken.kernels.gdn_gates import gdn_gates, gdn_gates_torch

    a, b = torch.randn(5, 4), torch.randn(5, 4)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    for x, y in zip(gdn_gates(a, b, A_log, dt_bias), gdn_gates_torch(a, b, A_log, dt_bias)):
        assert torch.equal(x, y)
    out = torch.zeros(2, 5, 4)
    for x, y in zip(gdn_gates(a, b, A_log, dt_bias, out=tuple(out)), gdn_gates_torch(a, b, A_log, dt_bias)):
        assert torch.equal(x, y)
    assert torch.equal(out[0], gdn_gates_torch(a, b, A_log, dt_bias)[0])
    with pytest.raises(ValueError, match="unknown GDN gates implementation"):
        gdn_gates(a, b, A_log, dt_bias, impl="bogus")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 2184, 8192])
def test_gdn_gates_cuda(T):
    check_gates(T, 32, torch.bfloat16, "cuda", seed=T)  # Qwen3.6's 32 value heads
