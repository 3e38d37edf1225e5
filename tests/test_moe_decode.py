"""Decode MoE GEMVs (``kernels/moe_decode.py``) vs their torch reference, and their wiring into ``run_experts`` /
``SparseMoeBlock`` (shared expert fused) and the expert cache's slot ids: on CPU under TRITON_INTERPRET=1 (tiny
shapes, in a subprocess so the interpreter is on before triton compiles anything) and on CUDA (``gpu`` marker,
Qwen3.6-35B-A3B shapes, one CUDA-graph capture).

The interpreter converts fp32 to bf16 by truncating, not rounding to nearest as the GPU and torch do, so bf16 under
the interpreter only gets a loose bound; fp16 rounds like torch there and the kernels round where the reference does,
so fp16 must match to the last bit but for the order of fp32 sums.
"""

import os
import textwrap

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_under_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TOL = {  # (cpu interpreter, cuda): max |out - ref| / (1 + |ref|)
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (6e-2, 2e-2),
}


def _err(out, ref) -> float:
    return float(((out.float() - ref.float()).abs() / (1 + ref.float().abs())).max()) if ref.numel() else 0.0


def _routing(T, S, k, g, invalid=False, padding_row=False):
    """``[T, k]`` ids (distinct within a token, repeated across tokens once T*k > S), fp32 weights summing to 1.
    ``invalid``: some ids < 0 and one past the last slot; ``padding_row``: the last row all slot 0 (how the expert
    cache maps CUDA-graph padding rows)."""
    ids = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    if invalid:
        ids[0, -1] = -1
        ids[T // 2, 0] = -7
        ids[T - 1, k // 2] = S
    if padding_row:
        ids[-1] = 0
    w = torch.rand(T, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def check_moe_decode(
    T, S, k, H, I, dtype, device, shared=None, Is=None, invalid=False, padding_row=False, strided_x=False, seed=0
):
    """``moe_decode_triton`` vs ``moe_decode_torch``; ``shared``: None, "output" (the shared expert's output is
    given) or "expert" (computed in the kernel from its gate|up, given as column views of a fused projection)."""
    from freetoken.kernels.moe_decode import moe_decode_torch, moe_decode_triton

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H + 8 if strided_x else H, generator=g)[:, :H].to(device, dtype)
    w13 = (torch.randn(S, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(S, H, I, generator=g) / I**0.5).to(device, dtype)
    ids, w = _routing(T, S, k, g, invalid, padding_row)
    ids, w = ids.to(device), w.to(device)
    kw = {}
    if shared is not None:
        Is = Is or I
        y = torch.randn(T, 3 + 1 + 2 * Is, generator=g).to(device, dtype)  # [router logits | gate logit | gate|up]
        kw["shared_gate"] = y[:, 3:4]
        if shared == "output":
            kw["shared"] = torch.randn(T, H, generator=g).to(device, dtype)
        else:
            kw["shared_gate_up"] = y[:, 4:]
            kw["shared_down"] = (torch.randn(H, Is, generator=g) / Is**0.5).to(device, dtype)
    out = moe_decode_triton(x, w13, w2, ids, w, **kw)
    ref = moe_decode_torch(x, w13, w2, ids, w, **kw)
    assert out.dtype == dtype and out.shape == (T, H)
    err = _err(out, ref)
    assert err <= _TOL[dtype][device == "cuda"], (T, S, k, H, I, dtype, shared, err)
    return err


def _block(H, E, k, I, Is, dtype, device, seed=0):
    from freetoken.layers.moe import SparseMoeBlock
    from freetoken.models.base import ModelConfig

    cfg = ModelConfig.from_dict(
        dict(
            model_type="qwen3_5_moe_text",
            hidden_size=H,
            num_experts=E,
            num_experts_per_tok=k,
            moe_intermediate_size=I,
            shared_expert_intermediate_size=Is,
        )
    )
    blk = SparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in blk.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return blk.to(device, dtype)


def check_block(T, H, E, k, I, Is, dtype, device, seed=0):
    """The block with its projections fused and Triton experts (decode kernels, shared expert in their epilogue)
    vs the same block unfused on the torch reference (``out + sigmoid(g) * shared_expert(x)``)."""
    from freetoken.layers.fused_linear import fuse_projections

    ref_blk = _block(H, E, k, I, Is, dtype, device, seed)
    ref_blk.experts.impl = "torch"
    blk = _block(H, E, k, I, Is, dtype, device, seed)
    fuse_projections(blk)
    blk.experts.impl = "triton"
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    with torch.no_grad():
        out, ref = blk(x), ref_blk(x)
    err = _err(out, ref)
    assert err <= _TOL[dtype][device == "cuda"], (T, dtype, err)
    return err


def check_expert_cache_slots(dtype, device, seed=0):
    """Slot ids from ``DeviceExpertCache.ensure`` with CUDA-graph padding rows (slot 0): the decode kernels over
    the slot pool equal the torch reference over the same slots, and the real rows equal resident experts."""
    from freetoken.layers.moe import SharedExpertTerm, run_experts
    from freetoken.moe.device_slot_cache import DeviceExpertCache

    T, E, k, H, I, S = 4, 12, 3, 32, 24, 9
    g = torch.Generator().manual_seed(seed)
    bank_gu = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    bank_dn = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    cache = DeviceExpertCache(S, 1, E, (2 * I, H), (H, I), dtype, torch.device(device), impl="torch")
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids, w = _routing(T, E, k, g)
    ids, w = ids.to(device), w.to(device)
    valid = torch.tensor([T - 1], device=device)  # the last row is padding
    slots = cache.ensure(0, bank_gu, bank_dn, ids, valid)
    assert bool((slots[-1] == 0).all())
    y = torch.randn(T, 2 + 2 * I, generator=g).to(device, dtype)
    down = (torch.randn(H, I, generator=g) / I**0.5).to(device, dtype)
    shared = SharedExpertTerm(y[:, 1:2], gate_up=y[:, 2:], down_weight=down)
    out = run_experts("triton", x, cache.gate_up, cache.down, slots, w, shared)
    ref = run_experts("torch", x, cache.gate_up, cache.down, slots, w, shared)
    resident = run_experts("torch", x, bank_gu.to(device), bank_dn.to(device), ids, w, shared)
    assert _err(out, ref) <= _TOL[dtype][device == "cuda"]
    torch.testing.assert_close(ref[: T - 1], resident[: T - 1], atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------------------------------
# CPU, no interpreter
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_block_formula(dtype):
    """``moe_decode_torch`` = the routed sum ``SparseMoeBlock`` computed before (weights cast to x's dtype first,
    ``fused_moe_torch``) plus ``sigmoid(g) * down(silu_and_mul(gate_up))``, bit for bit."""
    from freetoken.kernels.activation import silu_and_mul_torch
    from freetoken.kernels.fused_moe import fused_moe_torch
    from freetoken.kernels.moe_decode import moe_decode, moe_decode_torch

    T, S, k, H, I, Is = 5, 7, 3, 16, 12, 10
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = torch.randn(S, 2 * I, H, generator=g).to(dtype)
    w2 = torch.randn(S, H, I, generator=g).to(dtype)
    ids, w = _routing(T, S, k, g, invalid=True)
    gate, gu = torch.randn(T, 1, generator=g).to(dtype), torch.randn(T, 2 * Is, generator=g).to(dtype)
    down = torch.randn(H, Is, generator=g).to(dtype)
    routed = fused_moe_torch(x, w13, w2, ids, w.to(dtype))
    assert torch.equal(moe_decode_torch(x, w13, w2, ids, w), routed)
    ref = routed + torch.sigmoid(gate) * F.linear(silu_and_mul_torch(gu), down)
    got = moe_decode_torch(x, w13, w2, ids, w, shared_gate=gate, shared_gate_up=gu, shared_down=down)
    assert torch.equal(got, ref)
    assert torch.equal(moe_decode(x, w13, w2, ids, w, shared_gate=gate, shared_gate_up=gu, shared_down=down), ref)
    assert moe_decode_torch(x[:0], w13, w2, ids[:0], w[:0]).shape == (0, H)


def test_shared_arguments_are_checked():
    from freetoken.kernels.moe_decode import moe_decode_torch

    x, w13, w2 = torch.zeros(1, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 4)
    ids, w = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    with pytest.raises(ValueError, match="shared_gate"):
        moe_decode_torch(x, w13, w2, ids, w, shared=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="not both"):
        moe_decode_torch(x, w13, w2, ids, w, shared=x, shared_gate=x[:, :1], shared_gate_up=x, shared_down=w13[0])
    with pytest.raises(ValueError, match="both shared_gate_up and shared_down"):
        moe_decode_torch(x, w13, w2, ids, w, shared_gate=x[:, :1], shared_gate_up=x)


def test_unfused_and_fused_blocks_agree_on_the_torch_path():
    """The shared expert now travels through the experts backend on both block paths: same output as before."""
    from freetoken.layers.fused_linear import fuse_projections

    blk = _block(32, 8, 3, 24, 20, torch.float32, "cpu")
    x = torch.randn(6, 32)
    with torch.no_grad():
        se = blk.shared_expert
        ids, w = blk.route(x)
        old = blk.experts(x, ids, w) + torch.sigmoid(blk.shared_expert_gate(x)) * se(x)
        unfused = blk(x)
        fuse_projections(blk)
        fused = blk(x)
    assert w.dtype == torch.float32
    torch.testing.assert_close(unfused, old, atol=0, rtol=0)
    torch.testing.assert_close(fused, old, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the Triton kernels under the interpreter
# ----------------------------------------------------------------------------------------------------------------------

_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_moe_decode as t
    import freetoken.kernels.moe_decode as md
    worst = {{}}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        cases = [
            (1, 6, 2, 32, 24, None, {{}}),
            (1, 9, 8, 40, 24, "expert", dict(Is=20)),
            (5, 6, 4, 32, 24, "output", dict(invalid=True, strided_x=True)),  # repeats across tokens, ids < 0
            (5, 16, 8, 24, 20, "expert", dict(Is=12, padding_row=True)),
            (5, 12, 3, 48, 40, None, dict(invalid=True)),
        ]
        for T, S, k, H, I, shared, kw in cases:
            key = str(dt).split(".")[-1]
            worst[key] = max(worst.get(key, 0.0), t.check_moe_decode(T, S, k, H, I, dt, "cpu", shared, **kw))
        md._TILE = 64  # narrow tiles: several steps of the K loops, masked tails
        worst[key] = max(worst[key], t.check_moe_decode(5, 8, 3, 48, 40, dt, "cpu", "expert", Is=40, invalid=True))
        md._TILE = 4096
    t.check_block(1, 32, 8, 3, 24, 20, torch.float32, "cpu")
    t.check_block(5, 32, 8, 3, 24, 20, torch.float16, "cpu")
    t.check_block(30, 32, 8, 3, 24, 20, torch.float32, "cpu")  # 90 pairs: the grouped kernel, shared term in torch
    t.check_expert_cache_slots(torch.float32, "cpu")
    t.check_expert_cache_slots(torch.float16, "cpu")
    for dt, err in sorted(worst.items()):
        print(f"moe_decode {{dt:9s}} max |out - ref| / (1 + |ref|) = {{err:.3g}}")
    print("OK")
    """
)


def test_moe_decode_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA: Qwen3.6-35B-A3B (H 2048, 256 experts of I 512, top-8, shared expert Is 512) and odd shapes
# ----------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [None, "output", "expert"])
@pytest.mark.parametrize(
    "T,S,k,H,I,kw",
    [
        (1, 256, 8, 2048, 512, {}),  # Qwen3.6 decode, batch 1
        (8, 256, 8, 2048, 512, {}),  # MAX_PAIRS
        (3, 256, 8, 2048, 512, dict(invalid=True, padding_row=True)),
        (5, 128, 2, 2048, 768, {}),  # I not a power of two
        (4, 300, 8, 200, 72, dict(strided_x=True, Is=40)),  # H, I, Is not multiples of the blocks
        (32, 64, 2, 1024, 256, {}),  # many tokens, duplicate experts
    ],
)
def test_moe_decode_cuda(T, S, k, H, I, kw, shared, dtype):
    check_moe_decode(T, S, k, H, I, dtype, "cuda", shared, seed=T, **kw)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8, 40])  # decode kernels (8, 64 pairs) and the grouped kernel above MAX_PAIRS
def test_block_cuda(T, dtype):
    check_block(T, 2048, 256, 8, 512, 512, dtype, "cuda", seed=T)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_cache_slots_cuda(dtype):
    check_expert_cache_slots(dtype, "cuda")


@pytest.mark.gpu
@cuda
def test_moe_decode_cuda_graph():
    """Captured once with the shared expert fused, replayed with new inputs and routing (ids < 0 included)."""
    from freetoken.kernels.moe_decode import moe_decode_torch, moe_decode_triton

    T, S, k, H, I, Is = 2, 256, 8, 2048, 512, 512
    dev, dt = "cuda", torch.bfloat16
    w13 = torch.randn(S, 2 * I, H, device=dev, dtype=dt) / H**0.5
    w2 = torch.randn(S, H, I, device=dev, dtype=dt) / I**0.5
    down = torch.randn(H, Is, device=dev, dtype=dt) / Is**0.5
    x = torch.randn(T, H, device=dev, dtype=dt)
    y = torch.randn(T, 1 + 2 * Is, device=dev, dtype=dt)
    ids = torch.zeros(T, k, dtype=torch.int64, device=dev)
    w = torch.zeros(T, k, device=dev)
    args = lambda: (x, w13, w2, ids, w)  # noqa: E731
    kw = dict(shared_gate=y[:, :1], shared_gate_up=y[:, 1:], shared_down=down)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_decode_triton(*args(), **kw)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_decode_triton(*args(), **kw)
    g = torch.Generator().manual_seed(1)
    for invalid in (False, True):
        new_ids, new_w = _routing(T, S, k, g, invalid=invalid)
        ids.copy_(new_ids)
        w.copy_(new_w)
        x.copy_(torch.randn(T, H, generator=g).to(dev, dt))
        y.copy_(torch.randn(T, 1 + 2 * Is, generator=g).to(dev, dt))
        graph.replay()
        assert _err(out, moe_decode_torch(*args(), **kw)) <= _TOL[dt][1]
