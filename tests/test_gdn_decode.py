"""Gated DeltaNet decode kernels (``kernels/gdn_decode.py``) vs their torch references and vs the layer's eager
decode path: on CPU under TRITON_INTERPRET=1 (in a subprocess: the interpreter must be on before triton compiles
anything) and on CUDA (``gpu`` marker), including a CUDA-graph capture of both kernels.

Every check runs several consecutive steps on slots that are a random subset of a larger pool (rows reordered each
step, state carried), and asserts that the slots no row names are left bit-identical."""

import os
import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# one unit in the last place, relative: a bound for rounding to nearest (GPU) and for truncation (the interpreter
# casts fp32 -> bf16 by truncating, triton/runtime/interpreter.py ``_convert_float``)
ULP = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _errs(got, ref):
    return (got.float() - ref.float()).abs().max().item() if got.numel() else 0.0


def _batch_slots(real, pad, scratch, gen, device):
    """The real slots in a fresh row order, then ``pad`` CUDA-graph padding rows on the scratch slot."""
    rows = real[torch.randperm(len(real), generator=gen)]
    return torch.cat([rows, torch.full((pad,), scratch, dtype=torch.int64)]).to(device), rows.to(device)


def _untouched(S, real, scratch):
    keep = torch.ones(S, dtype=torch.bool)
    keep[real] = False
    keep[scratch] = False
    return keep


def check_conv(B, C, Kc, S, x_dtype, state_dtype, device, seed=0, steps=3, pad=0, w_dtype=None):
    """Triton conv update vs the reference on the same pool; returns the max |Δy|."""
    from freetoken.kernels.gdn_decode import gdn_conv_decode_torch, gdn_conv_decode_triton

    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(S, C, Kc - 1, generator=gen).to(device, state_dtype)
    ref_pool, before = pool.clone(), pool.clone()
    weight = (torch.randn(C, 1, Kc, generator=gen) * 0.5).to(device, w_dtype or x_dtype)[:, 0, :]  # conv1d view
    perm = torch.randperm(S, generator=gen)
    real, scratch = perm[:B], perm[B]
    truncates = device == "cpu" and torch.bfloat16 in (x_dtype, state_dtype)
    worst = 0.0
    for _ in range(steps):
        slots, real_rows = _batch_slots(real, pad, scratch, gen, device)
        qkv = torch.randn(B + pad, C + 5, generator=gen).to(device, x_dtype)[:, :C]  # row-strided view
        window = torch.cat([pool[real_rows].to(x_dtype), qkv[:B, :, None]], -1).double()
        terms = window * weight.to(x_dtype).double()
        y_exact = torch.nn.functional.silu(terms.sum(-1))
        y = gdn_conv_decode_triton(qkv, pool, weight, slots)
        y_ref = gdn_conv_decode_torch(qkv[:B], ref_pool, weight, real_rows)
        assert y.dtype == x_dtype and y.shape == (B + pad, C)
        # the kernel sums in fp32 and rounds once (within 1 ulp of exact); the reference, like the eager layer,
        # rounds every product to qkv's dtype first (a few ulp in bf16/fp16). The interpreter truncates its own
        # fp32 -> bf16 casts of the cached inputs and the weight too, moving each term by up to 2 ulp.
        input_err = 2 * ULP[x_dtype] * terms.abs().sum(-1) if truncates and state_dtype != x_dtype else 0.0
        assert ((y[:B].double() - y_exact).abs() <= 1e-5 + ULP[x_dtype] * y_exact.abs() + input_err).all()
        tol = max(TOL[x_dtype], TOL[state_dtype] if truncates else 0.0)  # truncated states drift from the ref's
        torch.testing.assert_close(y[:B].float(), y_ref.float(), atol=4 * tol, rtol=2 * tol)
        worst = max(worst, _errs(y[:B], y_ref))
        # the state update is data movement plus the reference's roundings: bit-exact (within 1 ulp when the
        # interpreter truncates a cast between the two dtypes)
        if truncates and state_dtype != x_dtype:
            torch.testing.assert_close(pool[real].float(), ref_pool[real].float(), atol=0, rtol=2**-7)
        else:
            assert torch.equal(pool[real], ref_pool[real])
        keep = _untouched(S, real, scratch)
        assert torch.equal(pool[keep], before[keep])
    return worst


def _recurrent_inputs(B, Hk, Hv, dk, dv, dtype, device, gen, gate_spread=1.0):
    """q, k, v as split views of a conv output and a, b as columns of a projection output (as in the layer)."""
    C = 2 * Hk * dk + Hv * dv
    y = torch.randn(B, C + 3, generator=gen).to(device, dtype)[:, :C]
    q, k, v = torch.split(y, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    ba = (torch.randn(B, 2 * Hv + 1, generator=gen) * gate_spread).to(device, dtype)
    return q.reshape(B, Hk, dk), k.reshape(B, Hk, dk), v.reshape(B, Hv, dv), ba[:, Hv : 2 * Hv], ba[:, :Hv]


def check_recurrent(
    B, Hk, Hv, dk, dv, S, dtype, state_dtype, device, seed=0, steps=3, pad=0, scale=None, gate_spread=1.0
):
    """Triton recurrence vs the reference on the same pool; returns (max |Δo|, max |ΔS|)."""
    from freetoken.kernels.gdn_decode import gdn_recurrent_decode_torch, gdn_recurrent_decode_triton

    gen = torch.Generator().manual_seed(seed)
    pool = (0.3 * torch.randn(S, Hv, dk, dv, generator=gen)).to(device, state_dtype)
    ref_pool, before = pool.clone(), pool.clone()
    A_log = (torch.randn(Hv, generator=gen) * 0.5).to(device)
    dt_bias = torch.randn(Hv, generator=gen).to(device)
    perm = torch.randperm(S, generator=gen)
    real, scratch = perm[:B], perm[B]
    # fp32 on CUDA: dk = 128 terms summed in another order, approximate exp/rsqrt
    o_tol = 1e-4 if device == "cuda" and dtype == torch.float32 else TOL[dtype]
    s_tol = 1e-4 if device == "cuda" and state_dtype == torch.float32 else TOL[state_dtype]
    worst_o = worst_s = 0.0
    for _ in range(steps):
        slots, real_rows = _batch_slots(real, pad, scratch, gen, device)
        q, k, v, a, b = _recurrent_inputs(B + pad, Hk, Hv, dk, dv, dtype, device, gen, gate_spread)
        o = gdn_recurrent_decode_triton(q, k, v, a, b, A_log, dt_bias, pool, slots, scale=scale)
        o_ref = gdn_recurrent_decode_torch(
            q[:B], k[:B], v[:B], a[:B], b[:B], A_log, dt_bias, ref_pool, real_rows, scale=scale
        )
        assert o.dtype == dtype and o.shape == (B + pad, Hv, dv)
        torch.testing.assert_close(o[:B].float(), o_ref.float(), atol=o_tol, rtol=o_tol)
        torch.testing.assert_close(pool[real].float(), ref_pool[real].float(), atol=s_tol, rtol=s_tol)
        worst_o, worst_s = max(worst_o, _errs(o[:B], o_ref)), max(worst_s, _errs(pool[real], ref_pool[real]))
        keep = _untouched(S, real, scratch)
        assert torch.equal(pool[keep], before[keep])
    return worst_o, worst_s


# ---------------------------------------------------------------------------------------------------------------
# the layer's eager decode path
# ---------------------------------------------------------------------------------------------------------------


class _DecodeBatch:
    """The fields of ForwardBatch the GDN layer reads, for one token per sequence (or a prefill when
    ``prefill_lens`` is given). ``is_decode=False`` with one token each sends the layer down its general path."""

    def __init__(self, pool, slots, prefix_lens, extend_lens, is_decode, snapshots=None):
        self.state = pool
        self.state_slots_cpu = list(slots)
        self.state_slots = torch.tensor(slots, device=pool.device)
        self.prefix_lens_cpu = list(prefix_lens)
        self.extend_lens_cpu = list(extend_lens)
        self.has_initial_state_cpu = [p > 0 for p in prefix_lens]
        dev = pool.device
        self.prefix_lens = torch.tensor(prefix_lens, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.tensor([0, *extend_lens], dtype=torch.int32).cumsum(0).to(dev, torch.int32)
        self.is_decode = is_decode
        self.snapshots = snapshots
        self.gdn_windows = None  # several sequences: gathered conv windows, as ForwardBatch.from_plan has them
        if not is_decode and len(slots) > 1:
            from freetoken.layers.gdn_state_windows import window_host_arrays, window_index

            cu, kc1 = self.cu_seqlens.tolist(), pool.conv_shape[-1]
            arrays = window_host_arrays(cu, self.prefix_lens_cpu, self.state_slots_cpu, snapshots or [], kc1)
            self.gdn_windows = window_index([a.to(dev) for a in arrays], len(slots))


def _tiny_layer(interleaved, device, seed=0):
    from freetoken.layers.gated_deltanet import GatedDeltaNet
    from freetoken.models.base import ModelConfig

    cfg = ModelConfig.from_dict(
        dict(
            hidden_size=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            hidden_act="silu",
        )
    )
    layer = GatedDeltaNet(cfg, layer_id=0, state_layer=0, interleaved_proj=interleaved)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name in ("dt_bias", "norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    return layer.to(device).eval().requires_grad_(False)


def decode_with_kernels(layer, x, pool, slots, impl):
    """The layer's decode step rebuilt from the two kernels (what the layer's wiring is expected to do)."""
    from freetoken.kernels.gdn_decode import gdn_conv_decode, gdn_recurrent_decode

    B = x.shape[0]
    Hk, Hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    qkv, z, b, a = layer.project(x)
    y = gdn_conv_decode(qkv, pool.conv[layer.state_layer], layer.conv1d.weight[:, 0, :], slots, impl=impl)
    q, k, v = torch.split(y, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    o = gdn_recurrent_decode(
        q.reshape(B, Hk, dk),
        k.reshape(B, Hk, dk),
        v.reshape(B, Hv, dv),
        a,
        b,
        layer.A_log,
        layer.dt_bias,
        pool.ssm[layer.state_layer],
        slots,
        impl=impl,
    )
    o = layer.norm(o.reshape(B * Hv, dv), z.reshape(-1, dv))
    return layer.out_proj(o.reshape(B, layer.value_dim))


def check_layer_chain(device, impl, interleaved=False, steps=3, seed=0):
    """Prefill three sequences through the layer, then decode: the kernel chain vs the layer's decode branch and
    vs its general (per-sequence) path. Returns the max |Δout| against each."""
    from freetoken.cache.state_pool import RecurrentStatePool

    layer = _tiny_layer(interleaved, device, seed)
    pool = RecurrentStatePool(1, 9, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, torch.float32, device)
    gen = torch.Generator().manual_seed(seed + 1)
    slots, lens = [5, 1, 7], [5, 2, 9]
    x = torch.randn(sum(lens), 32, generator=gen).to(device)
    layer(x, _DecodeBatch(pool, slots, [0, 0, 0], lens, is_decode=False))
    pools = {
        name: RecurrentStatePool(
            1, 9, layer.conv_state_shape, layer.ssm_state_shape, torch.float32, torch.float32, device
        )
        for name in ("decode", "general", "kernels")
    }
    for p in pools.values():
        p.conv[0].copy_(pool.conv[0])
        p.ssm[0].copy_(pool.ssm[0])
    worst = {"decode": 0.0, "general": 0.0}
    tol = 1e-5 if device == "cpu" else 1e-3
    for _ in range(steps):
        order = torch.randperm(3, generator=gen).tolist()
        rows = [slots[i] for i in order]
        x = torch.randn(3, 32, generator=gen).to(device)
        prefix = [lens[i] for i in order]
        got = decode_with_kernels(layer, x, pools["kernels"], torch.tensor(rows, device=device), impl)
        for name, is_decode in (("decode", True), ("general", False)):
            ref = layer(x, _DecodeBatch(pools[name], rows, prefix, [1, 1, 1], is_decode))
            torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
            worst[name] = max(worst[name], _errs(got, ref))
            torch.testing.assert_close(pools["kernels"].ssm[0], pools[name].ssm[0], atol=tol, rtol=tol)
            assert torch.equal(pools["kernels"].conv[0], pools[name].conv[0])
        lens = [n + 1 for n in lens]
    return worst


# ---------------------------------------------------------------------------------------------------------------
# CPU
# ---------------------------------------------------------------------------------------------------------------


def test_recurrent_reference_matches_layer_math():
    """``gdn_recurrent_decode_torch`` = the layer's gating + ``_prepare_torch`` + one recurrent step."""
    import torch.nn.functional as F

    from freetoken.kernels.gdn_decode import gdn_recurrent_decode_torch
    from freetoken.layers.gated_deltanet import _prepare_torch, torch_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(3)
    B, Hk, Hv, dk, dv, S = 3, 2, 4, 16, 8, 6
    q, k, v, a, b = _recurrent_inputs(B, Hk, Hv, dk, dv, torch.float32, "cpu", gen, gate_spread=15.0)
    A_log, dt_bias = torch.randn(Hv, generator=gen), torch.randn(Hv, generator=gen)
    pool = torch.randn(S, Hv, dk, dv, generator=gen)
    slots = torch.tensor([4, 0, 2])
    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    qf, kf, vf, gf, bf = _prepare_torch(q, k, v, g, torch.sigmoid(b), Hv)
    o_ref, s_ref = torch_recurrent_gated_delta_rule(
        qf[:, :, None], kf[:, :, None], vf[:, :, None], gf[:, :, None], bf[:, :, None], pool[slots].clone()
    )
    o = gdn_recurrent_decode_torch(q, k, v, a, b, A_log, dt_bias, pool, slots)
    torch.testing.assert_close(o, o_ref[:, :, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool[slots], s_ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_torch_chain_matches_layer_decode(interleaved):
    check_layer_chain("cpu", "torch", interleaved)


def test_dispatch_picks_torch_on_cpu(monkeypatch):
    import freetoken.kernels.gdn_decode as m

    def boom(*a, **k):
        raise AssertionError("Triton path taken on CPU")

    monkeypatch.setattr(m, "gdn_conv_decode_triton", boom)
    monkeypatch.setattr(m, "gdn_recurrent_decode_triton", boom)
    check_layer_chain("cpu", "auto", steps=1)
    with pytest.raises(ValueError):
        m.gdn_conv_decode(
            torch.zeros(1, 4), torch.zeros(2, 4, 3), torch.zeros(4, 4), torch.zeros(1, dtype=torch.int64), impl="cuda"
        )


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_gdn_decode import check_conv, check_recurrent, check_layer_chain
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    # B, C, Kc, S, x dtype, state dtype, padding rows, weight dtype
    for i, (B, C, Kc, S, xd, sd, pad, wd) in enumerate([
        (3, 24, 4, 9, f32, f32, 0, None),
        (3, 40, 4, 9, bf16, bf16, 2, None),      # padding rows on a scratch slot
        (2, 300, 4, 7, bf16, f32, 0, f32),       # C over one block, fp32 state and weight under bf16 activations
        (4, 16, 2, 6, f16, bf16, 1, None),       # Kc = 2: a one-column state
        (1, 20, 3, 3, f32, bf16, 0, None),
    ]):
        print("conv", B, C, Kc, xd, sd, pad, "max|dy|=%.3g" % check_conv(B, C, Kc, S, xd, sd, "cpu", seed=i, pad=pad,
                                                                       w_dtype=wd))
    # B, Hk, Hv, dk, dv, S, activation dtype, state dtype, padding rows, scale, gate spread
    for i, (B, Hk, Hv, dk, dv, S, xd, sd, pad, scale, spread) in enumerate([
        (3, 2, 4, 16, 8, 9, f32, f32, 0, None, 1.0),     # r = 2, dk != dv
        (3, 4, 4, 8, 16, 9, f32, f32, 0, 0.3, 15.0),     # r = 1, explicit scale, softplus past its threshold both ways
        (3, 2, 4, 16, 8, 9, bf16, bf16, 2, None, 1.0),   # bf16 state, padding rows
        (2, 1, 3, 12, 20, 5, bf16, f32, 1, None, 1.0),   # r = 3, dk / dv not powers of 2
        (1, 2, 2, 64, 64, 3, f32, f32, 0, None, 1.0),    # several value blocks
    ]):
        eo, es = check_recurrent(B, Hk, Hv, dk, dv, S, xd, sd, "cpu", seed=i, pad=pad, scale=scale, gate_spread=spread)
        print("recurrent", B, Hk, Hv, dk, dv, xd, sd, pad, "max|do|=%.3g max|dS|=%.3g" % (eo, es))
    for interleaved in (False, True):
        print("layer chain", interleaved, check_layer_chain("cpu", "triton", interleaved))
    print("OK")
    """
)


def test_gdn_decode_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


# ---------------------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Qwen3.6-35B-A3B: Hk=16, Hv=32, dk=dv=128, Kc=4, conv_dim 8192
REAL = dict(Hk=16, Hv=32, dk=128, dv=128)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("B", [1, 7, 64])
@pytest.mark.parametrize(
    "x_dtype,state_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)],
)
def test_conv_cuda(B, x_dtype, state_dtype):
    check_conv(B, 8192, 4, 200, x_dtype, state_dtype, "cuda", seed=B, pad=3)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("B", [1, 3, 7, 64])
@pytest.mark.parametrize(
    "dtype,state_dtype",
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
)
def test_recurrent_cuda(B, dtype, state_dtype):
    check_recurrent(B, REAL["Hk"], REAL["Hv"], REAL["dk"], REAL["dv"], 200, dtype, state_dtype, "cuda", seed=B, pad=3)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("interleaved", [False, True])
def test_chain_matches_layer_cuda(interleaved):
    check_layer_chain("cuda", "auto", interleaved)


@pytest.mark.gpu
@cuda
def test_decode_kernels_cuda_graph():
    """Both kernels captured once at batch 8 and replayed with new inputs and slots (3 padding rows on a scratch
    slot): real rows equal the eager reference, slots no row names are untouched."""
    from freetoken.kernels.gdn_decode import (
        gdn_conv_decode,
        gdn_conv_decode_torch,
        gdn_recurrent_decode,
        gdn_recurrent_decode_torch,
    )

    Hk, Hv, dk, dv = REAL["Hk"], REAL["Hv"], REAL["dk"], REAL["dv"]
    Bg, B, S, Kc, dt = 8, 5, 64, 4, torch.bfloat16
    C = 2 * Hk * dk + Hv * dv
    gen = torch.Generator().manual_seed(0)
    conv_pool = torch.randn(S, C, Kc - 1, generator=gen).to("cuda", dt)
    ssm_pool = (0.3 * torch.randn(S, Hv, dk, dv, generator=gen)).cuda()
    weight = (torch.randn(C, 1, Kc, generator=gen) * 0.5).to("cuda", dt)[:, 0, :]
    A_log = (torch.randn(Hv, generator=gen) * 0.5).cuda()
    dt_bias = torch.randn(Hv, generator=gen).cuda()
    # static inputs: one projection output holding qkv and b, a (as a fused projection would)
    proj = torch.zeros(Bg, C + 2 * Hv, device="cuda", dtype=dt)
    slots = torch.zeros(Bg, dtype=torch.int64, device="cuda")

    def step():
        y = gdn_conv_decode(proj[:, :C], conv_pool, weight, slots)
        q, k, v = torch.split(y, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        b, a = proj[:, C : C + Hv], proj[:, C + Hv :]
        return gdn_recurrent_decode(
            q.reshape(Bg, Hk, dk), k.reshape(Bg, Hk, dk), v.reshape(Bg, Hv, dv), a, b, A_log, dt_bias, ssm_pool, slots
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        perm = torch.randperm(S, generator=gen)
        real, scratch = perm[:B], perm[B]
        slots.copy_(torch.cat([real, torch.full((Bg - B,), int(scratch))]))
        proj.copy_(torch.randn(Bg, C + 2 * Hv, generator=gen).to(dt))
        conv_ref, ssm_ref = conv_pool.clone(), ssm_pool.clone()
        conv_before, ssm_before = conv_pool.clone(), ssm_pool.clone()
        graph.replay()
        # the reference continues from the same conv output: the torch conv rounds differently in bf16 (checked
        # against it loosely through o below), and the state comparison is about the recurrence
        y_torch = gdn_conv_decode_torch(proj[:B, :C], conv_ref.clone(), weight, real.cuda())
        y = gdn_conv_decode(proj[:B, :C], conv_ref, weight, real.cuda())
        torch.testing.assert_close(y.float(), y_torch.float(), atol=3e-2, rtol=3e-2)
        q, k, v = torch.split(y, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        o_ref = gdn_recurrent_decode_torch(
            q.reshape(B, Hk, dk),
            k.reshape(B, Hk, dk),
            v.reshape(B, Hv, dv),
            proj[:B, C + Hv :],
            proj[:B, C : C + Hv],
            A_log,
            dt_bias,
            ssm_ref,
            real.cuda(),
        )
        torch.testing.assert_close(out[:B].float(), o_ref.float(), atol=3e-2, rtol=3e-2)
        assert torch.equal(conv_pool[real], conv_ref[real])
        torch.testing.assert_close(ssm_pool[real], ssm_ref[real], atol=1e-3, rtol=1e-3)
        keep = _untouched(S, real, scratch)
        assert torch.equal(conv_pool[keep], conv_before[keep]) and torch.equal(ssm_pool[keep], ssm_before[keep])
