"""Gated DeltaNet prefill conv kernel (``kernels/gdn_conv_prefill.py``) vs its torch reference and vs the formula
in fp64, and the layer's extend path with the kernel forced vs the torch path (outputs, written conv/ssm states,
snapshots): on CPU under TRITON_INTERPRET=1 (in a subprocess: the interpreter must be on before triton compiles
anything) and on CUDA (``gpu`` marker) at Qwen3.6-35B-A3B's shape.

Batches mix sequences of 1 and 2 tokens (fewer than Kc-1: their windows reach into the previous state), longer
than a token block, fresh ones (their slots hold garbage that must not be read) and continuing ones; qkv is a
column slice of a wider projection output."""

from __future__ import annotations

import contextlib
import copy
import os
import textwrap

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_under_interpreter

IMPL_VAR = "FREETOKEN_GDN_CONV_IMPL"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# one unit in the last place, relative: a bound for rounding to nearest (GPU) and for truncation (the interpreter
# casts fp32 -> bf16 by truncating, triton/runtime/interpreter.py ``_convert_float``)
ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-7}


def _inputs(lens, init, C, Kc, S, x_dtype, pool_dtype, device, seed, w_dtype=None, init_dtype=torch.bool):
    """A varlen batch on random distinct slots of a pool filled with random values everywhere (fresh sequences'
    slots included), qkv a column slice of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    qkv = torch.randn(T, C + 9, generator=gen).to(device, x_dtype)[:, 5 : 5 + C]
    weight = (torch.randn(C, 1, Kc, generator=gen) * 0.5).to(device, w_dtype or x_dtype)[:, 0, :]  # conv1d view
    pool = torch.randn(S, C, Kc - 1, generator=gen).to(device, pool_dtype)
    slots = torch.randperm(S, generator=gen)[:N].to(device)
    cu = torch.tensor([0, *lens]).cumsum(0).to(device, torch.int32)
    has_init = torch.tensor(init).to(device, init_dtype)
    return qkv, weight, pool, cu, slots, has_init


def conv_exact(qkv, weight, pool, cu, slots, has_init):
    """The formula in fp64 from the inputs as the kernel sees them (cached inputs and weight rounded to qkv's
    dtype). Returns ``(y, Σ_j |term_j|)`` per token and channel."""
    C, Kc = weight.shape
    w = weight.to(qkv.dtype).double()
    y = torch.empty(qkv.shape, dtype=torch.float64)
    mag = torch.empty(qkv.shape, dtype=torch.float64)
    cu, slots, has_init = cu.tolist(), slots.tolist(), has_init.tolist()
    for b, slot in enumerate(slots):
        a, z = cu[b], cu[b + 1]
        prev = pool[slot].to(qkv.dtype).double().cpu() if has_init[b] else torch.zeros(C, Kc - 1, dtype=torch.float64)
        xs = torch.cat([prev, qkv[a:z].double().cpu().t()], dim=-1)  # [C, Kc-1+n]
        terms = xs.unfold(1, Kc, 1) * w.cpu()[:, None, :]  # [C, n, Kc]: token i's window is xs[:, i : i+Kc]
        y[a:z] = F.silu(terms.sum(-1)).t()
        mag[a:z] = terms.abs().sum(-1).t()
    return y, mag


def check_conv_prefill(
    lens, init, C, Kc, S, x_dtype, pool_dtype, device, seed=0, w_dtype=None, init_dtype=torch.bool, block_t=None,
    parts=False,
):  # fmt: skip
    """Triton vs the reference and vs the formula; the pool is left untouched; ``parts``: also ``check_parts``.
    Returns the max |Δy| vs the reference."""
    from freetoken.kernels.gdn_conv_prefill import gdn_conv_prefill_torch, gdn_conv_prefill_triton

    qkv, weight, pool, cu, slots, has_init = _inputs(
        lens, init, C, Kc, S, x_dtype, pool_dtype, device, seed, w_dtype, init_dtype
    )
    before = pool.clone()
    kw = {"block_t": block_t} if block_t else {}
    y = gdn_conv_prefill_triton(qkv, weight, pool, cu, slots, has_init, max(lens), **kw)
    y_ref = gdn_conv_prefill_torch(qkv, weight, pool, cu, slots, has_init, max(lens))
    assert y.dtype == x_dtype and y.shape == (sum(lens), C) and y.is_contiguous()
    assert torch.equal(pool, before)
    exact, mag = conv_exact(qkv, weight, pool, cu, slots, has_init)
    # the kernel sums in fp32 and rounds once (within 1 ulp of exact). The interpreter truncates its casts of wider
    # cached inputs / weights to qkv's dtype, where torch rounds: each term moves by up to 2 ulp.
    truncates = device == "cpu" and x_dtype == torch.bfloat16 and torch.float32 in (pool_dtype, w_dtype)
    input_err = 2.2 * ULP[x_dtype] * mag if truncates else 0.0
    err = (y.double().cpu() - exact).abs()
    assert (err <= 1e-6 * (1 + mag) + ULP[x_dtype] * exact.abs() + input_err).all(), err.max()
    # the reference does the conv in qkv's dtype and rounds twice (conv output, then SiLU)
    tol = TOL[x_dtype]
    torch.testing.assert_close(y.float(), y_ref.float(), atol=4 * tol, rtol=2 * tol)
    if parts:
        check_parts(gdn_conv_prefill_triton, (qkv, weight, pool, cu, slots, has_init, max(lens)), y, kw)
    return (y.float() - y_ref.float()).abs().max().item()


def split_widths(C: int, odd: bool = False) -> list[tuple[int, ...]]:
    """Column splits as the GDN's q | k | v (key, key, value widths; multiples of 8 where C allows, as real widths
    are) and two parts; ``odd``: also one-column parts (the Triton launcher then narrows its tiles to one column)."""
    key = (C // 4) // 8 * 8 or max(1, C // 4)
    half = (C // 2) // 8 * 8 or C // 2
    splits = [(key, key, C - 2 * key), (half, C - half)]
    return splits + [(C - 3, 1, 2)] if odd else splits


def check_parts(conv, args, y, kw=None, odd=False):
    """``parts`` (q | k | v as contiguous blocks) and ``out`` (a caller's buffer with more rows than tokens, its
    other rows untouched) give exactly ``y``'s columns."""
    from freetoken.kernels.gdn_conv_prefill import parts_views

    T, C = y.shape
    for parts in split_widths(C, odd):
        got = conv(*args, parts=parts, **(kw or {}))
        rows = T + 5
        buf = torch.full((rows * C,), 7.0, dtype=y.dtype, device=y.device)
        into = conv(*args, parts=parts, out=buf, **(kw or {}))
        want = torch.split(y, list(parts), dim=-1)
        for a, b, view, w in zip(got, into, parts_views(buf, rows, T, parts), want):
            assert a.is_contiguous() and b.is_contiguous() and torch.equal(a, w) and torch.equal(b, w)
            assert b.data_ptr() == view.data_ptr()
        written = torch.zeros(rows * C, dtype=torch.bool, device=y.device)
        for view in parts_views(written, rows, T, parts):
            view.fill_(True)
        assert (buf[~written] == 7.0).all()


# ---------------------------------------------------------------------------------------------------------------
# the layer's extend path
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def conv_impl(impl):
    old = os.environ.get(IMPL_VAR)
    os.environ[IMPL_VAR] = impl
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(IMPL_VAR)
        else:
            os.environ[IMPL_VAR] = old


def check_layer(device, x_dtype, conv_dtype, impl="triton", seed=0):
    """Two extend steps (mixed lengths and prefixes, snapshots in the second, some reaching into the previous
    conv state) through ``GatedDeltaNet`` with the conv forced to ``impl`` vs forced to torch, on copies of one
    pool: outputs, every slot's conv state (bit-exact: data movement only) and ssm state. Returns the max |Δout|."""
    from test_gdn_decode import _DecodeBatch, _tiny_layer

    from freetoken.cache.state_pool import RecurrentStatePool

    layer = _tiny_layer(False, device, seed).to(x_dtype)
    pool = RecurrentStatePool(1, 16, layer.conv_state_shape, layer.ssm_state_shape, conv_dtype, torch.float32, device)
    gen = torch.Generator().manual_seed(seed + 1)
    pool.conv[0].copy_(torch.randn(pool.conv[0].shape, generator=gen))  # garbage in fresh sequences' slots too
    pool.ssm[0].copy_(0.3 * torch.randn(pool.ssm[0].shape, generator=gen))
    pools = {"torch": pool, impl: copy.deepcopy(pool)}
    slots = [5, 1, 7, 3, 9]
    steps = [
        # (prefix lens, extend lens, snapshots (seq, upto, slot))
        ([3, 0, 10, 0, 2], [1, 2, 70, 5, 2], None),
        ([4, 2, 80, 5, 4], [2, 1, 40, 1, 36], [(0, 5, 10), (1, 3, 11), (2, 84, 0), (2, 120, 2), (4, 5, 4)]),
    ]
    tol = 1e-4 if device == "cuda" else 1e-5
    worst = 0.0
    for prefix, lens, snaps in steps:
        x = torch.randn(sum(lens), 32, generator=gen).to(device, x_dtype)
        out = {}
        for name, p in pools.items():
            batch = _DecodeBatch(p, slots, prefix, lens, is_decode=False, snapshots=snaps)
            with conv_impl(name):
                out[name] = layer(x, batch)
        got, ref = out[impl].float(), out["torch"].float()
        if x_dtype == torch.float32:
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        else:
            # bf16: the conv outputs differ by an ulp (one rounding vs two), which the per-head RMSNorm amplifies
            # where a head's output is small: bound the error over the whole output and its worst element
            assert (got - ref).norm() <= 2e-2 * ref.norm() and (got - ref).abs().max() <= 5e-2 * ref.abs().max()
        worst = max(worst, (got - ref).abs().max().item())
        assert torch.equal(pools[impl].conv[0], pools["torch"].conv[0])
        s_tol = tol if x_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(pools[impl].ssm[0], pools["torch"].ssm[0], atol=s_tol, rtol=s_tol)
    return worst


# ---------------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype,pool_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_reference_matches_formula(x_dtype, pool_dtype):
    from freetoken.kernels.gdn_conv_prefill import gdn_conv_prefill_torch

    lens, init = [1, 2, 40, 5], [True, False, True, True]
    qkv, weight, pool, cu, slots, has_init = _inputs(lens, init, 24, 4, 8, x_dtype, pool_dtype, "cpu", seed=1)
    y = gdn_conv_prefill_torch(qkv, weight, pool, cu, slots, has_init, max(lens))
    exact, mag = conv_exact(qkv, weight, pool, cu, slots, has_init)
    assert ((y.double() - exact).abs() <= 1e-6 * (1 + mag)).all()


def test_reference_parts_and_out_buffer():
    """The torch path's ``parts`` / ``out`` (what the CPU layer runs) against its own ``[T, C]`` output."""
    from freetoken.kernels.gdn_conv_prefill import gdn_conv_prefill, gdn_conv_prefill_torch

    lens = [1, 2, 70, 5]
    args = _inputs(lens, [1, 0, 1, 0], 40, 4, 9, torch.bfloat16, torch.float32, "cpu", 3, None, torch.bool)
    y = gdn_conv_prefill_torch(*args, max(lens))
    check_parts(lambda *a, **kw: gdn_conv_prefill(*a, impl="torch", **kw), (*args, max(lens)), y, odd=True)


def test_dispatch_picks_torch_on_cpu(monkeypatch):
    import freetoken.kernels.gdn_conv_prefill as m

    def boom(*a, **k):
        raise AssertionError("Triton path taken on CPU")

    monkeypatch.setattr(m, "gdn_conv_prefill_triton", boom)
    args = _inputs([3, 1], [True, False], 8, 4, 4, torch.float32, torch.float32, "cpu", seed=2)
    ref = m.gdn_conv_prefill_torch(*args, 3)
    assert torch.equal(m.gdn_conv_prefill(*args, 3), ref)
    with pytest.raises(ValueError):
        m.gdn_conv_prefill(*args, 3, impl="cuda")
    check_layer("cpu", torch.float32, torch.float32, impl="auto")


def test_bad_impl_variable_stops_start_up(monkeypatch, tmp_path):
    """``FREETOKEN_GDN_CONV_IMPL`` with an unknown value is refused when a hybrid model's worker starts, in one line
    naming the variable, not at its first prefill."""
    from conftest import assert_start_up_refuses

    assert IMPL_VAR == "FREETOKEN_GDN_CONV_IMPL"
    assert_start_up_refuses(monkeypatch, tmp_path, IMPL_VAR, "cuda")


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_gdn_conv_prefill import check_conv_prefill, check_layer
    f32, bf16, i32 = torch.float32, torch.bfloat16, torch.int32
    mixed = [1, 2, 70, 5, 33, 2]  # 70 and 33 are over the default 32-token block
    # lens, has_init, C, Kc, pool slots, x dtype, pool dtype, weight dtype, has_init dtype, token block
    configs = [
        (mixed, [1, 0, 1, 0, 1, 1], 40, 4, 9, f32, f32, None, torch.bool, None),
        (mixed, [1, 0, 1, 0, 1, 1], 300, 4, 9, bf16, f32, None, i32, None),   # C over two channel blocks
        (mixed, [0, 1, 1, 1, 0, 0], 40, 4, 9, bf16, bf16, f32, torch.bool, None),  # fp32 weight, bf16 activations
        ([1, 2, 19, 8, 9], [1, 1, 0, 1, 1], 24, 4, 7, bf16, bf16, None, i32, 8),  # several 8-token blocks
        ([70], [1], 40, 4, 3, f32, bf16, None, torch.bool, None),
        ([3, 1, 20], [1, 1, 0], 16, 2, 5, f32, f32, None, torch.bool, 8),    # Kc = 2: a one-column state
        ([1, 4, 20], [1, 0, 1], 16, 3, 5, bf16, f32, None, torch.bool, 8),
    ]
    for i, (lens, init, C, Kc, S, xd, pd, wd, hd, bt) in enumerate(configs):
        # parts (q | k | v blocks) on two configs: the interpreter runs each split twice more
        err = check_conv_prefill(
            lens, init, C, Kc, S, xd, pd, "cpu", seed=i, w_dtype=wd, init_dtype=hd, block_t=bt, parts=i in (1, 3)
        )
        print("conv", lens, C, Kc, xd, pd, "max|dy|=%.3g" % err)
    for xd, cd in ((f32, f32), (f32, bf16), (bf16, f32)):
        print("layer", xd, cd, "max|dout|=%.3g" % check_layer("cpu", xd, cd))
    print("OK")
    """
)


def test_gdn_conv_prefill_interpreter_cpu():
    pytest.importorskip("triton")
    run_under_interpreter(_CPU_SCRIPT)


# ---------------------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "lens,init",
    [([2184], [True]), ([1, 2, 1500, 600, 81], [True, False, True, False, True])],
    ids=["one_chunk", "mixed"],
)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_conv_prefill_cuda_real_shape(lens, init, pool_dtype):
    """Qwen3.6-35B-A3B: conv_dim 8192, Kc = 4, the profiled 2,184-token chunk."""
    check_conv_prefill(lens, init, 8192, 4, 64, torch.bfloat16, pool_dtype, "cuda", seed=len(lens), parts=True)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_layer_extend_cuda(x_dtype):
    check_layer("cuda", x_dtype, torch.bfloat16, impl="auto")
