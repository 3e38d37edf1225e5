"""NVFP4 MoE kernels (``kernels/nvfp4_moe.py``) vs their torch reference, over the bank layout of
``layers/nvfp4_experts.py``: the decode GEMVs (shared expert given or computed, its NVFP4 down projection in the
epilogue, ids outside the bank, CUDA-graph padding rows, strided x), the grouped prefill kernels (skewed routing, empty
experts, ids outside the bank), a slot pool in the same layout indexed by slot ids (the offload cache's use) equal to
the resident bank indexed by expert ids, ``Nvfp4Experts``' dispatch, and a ``SparseMoeBlock`` that folds its NVFP4
shared expert's SiLU-and-mul and down projection into the experts' decode kernel equal to one that does not. CPU
under TRITON_INTERPRET=1 (tiny shapes, in a subprocess), CUDA under the ``gpu`` marker (Qwen3.6-35B-A3B: 256
experts of 2 x 512 x 2048 and 2048 x 512, top-8, a shared expert of 512; a sweep of T and expert counts).

References: the decode kernels against ``moe_decode_torch`` over the dequantized bank (the same contract, shared
term included), the grouped kernels against ``nvfp4_moe_torch``. Error: max |out - ref| / (1 + |ref|); the
interpreter truncates fp32 to bf16 and its bf16 ``tl.dot`` is wrong, so the grouped path runs fp32 / fp16 there.
"""

import os
import textwrap

import pytest
import torch
from nvfp4_cases import dequantized_bank, error, random_bank, random_weight
from triton_interpreter import run_under_interpreter

from freetoken.quant import nvfp4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TOL = {  # (cpu interpreter, cuda)
    torch.float32: (1e-5, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (8e-2, 4e-2),
}


def _routing(T, S, k, g, invalid=False, padding_row=False, skew=False):
    """``[T, k]`` ids (distinct per token) and fp32 weights summing to 1. ``invalid``: ids < 0 and one past the bank;
    ``padding_row``: the last row all 0 (the expert cache's CUDA-graph padding); ``skew``: most pairs on 2 experts."""
    logits = torch.randn(T, S, generator=g)
    if skew:
        logits[:, :2] += 6
    ids = torch.topk(logits + torch.rand(T, S, generator=g), k, -1).indices
    if invalid:
        ids[0, -1] = -1
        ids[T // 2, 0] = -7
        ids[T - 1, k // 2] = S
    if padding_row:
        ids[-1] = 0
    w = torch.rand(T, k, generator=g) + 0.1
    return ids, w / w.sum(-1, keepdim=True)


def _shared_kw(shared, T, H, dtype, device, g, Is=None):
    """The shared-expert arguments: None, "output" (given), "expert" (gate|up and a plain down weight), "nvfp4"
    (gate|up and an NVFP4 down weight with one global scale, as ``Nvfp4Linear`` has it) or "nvfp4_rows" (a global
    scale per row)."""
    if shared is None:
        return {}
    Is = Is or (24 if shared == "expert" else 32)
    y = torch.randn(T, 1 + 2 * Is, generator=g).to(device, dtype)  # [gate logit | gate|up] of a fused projection
    if shared == "output":
        return dict(shared=torch.randn(T, H, generator=g).to(device, dtype), shared_gate=y[:, :1])
    if shared == "expert":
        down = (torch.randn(H, Is, generator=g) / Is**0.5).to(device, dtype)
        return dict(shared_gate=y[:, :1], shared_gate_up=y[:, 1:], shared_down=down)
    packed, scale, scale_2 = random_weight(H, Is, int(torch.randint(0, 1000, (), generator=g)), device=device)
    if shared == "nvfp4_rows":
        scale_2 = (scale_2 * (torch.rand(H, generator=g) + 0.5).to(device)).contiguous()
    return dict(
        shared_gate=y[:, :1], shared_gate_up=y[:, 1:], shared_down_nvfp4=nvfp4.Nvfp4Tensor(packed, scale, scale_2)
    )


def _reference_kw(kw, dtype):
    """``moe_decode_torch``'s arguments for ``kw``: an NVFP4 shared down weight dequantized to x's dtype
    (``Nvfp4Linear``'s reference)."""
    kw = dict(kw)
    d = kw.pop("shared_down_nvfp4", None)
    if d is not None:
        kw["shared_down"] = nvfp4.dequantize(d.packed, d.scale, d.scale_2, dtype)
    return kw


def check_decode(T, S, k, H, I, dtype, device, shared=None, seed=0, strided_x=False, Is=None, tune=None, **routing):
    from freetoken.kernels.moe_decode import moe_decode_torch
    from freetoken.kernels.nvfp4_moe import nvfp4_moe_decode_triton

    bank = random_bank(S, H, I, seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H + 8 if strided_x else H, generator=g)[:, :H].to(device, dtype)
    ids, w = _routing(T, S, k, g, **routing)
    ids, w = ids.to(device), w.to(device)
    kw = _shared_kw(shared, T, H, dtype, device, g, Is)
    out = nvfp4_moe_decode_triton(x, *bank, ids, w, tune=tune, **kw)
    ref = moe_decode_torch(x, *dequantized_bank(bank, dtype), ids, w, **_reference_kw(kw, dtype))
    err = error(out, ref)
    assert err <= _TOL[dtype][device == "cuda"], ("decode", T, S, k, H, I, dtype, shared, tune, err)
    return err


def check_grouped(T, E, k, H, I, dtype, device, seed=0, block_m=None, tune=None, half=None, **routing):
    """The grouped kernels (``half``: on fp16 weight tiles; None: the default for the dtype) against the
    reference."""
    from freetoken.kernels.nvfp4_moe import nvfp4_fused_moe_triton, nvfp4_moe_torch

    bank = random_bank(E, H, I, seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids, w = _routing(T, E, k, g, **routing)
    ids, w = ids.to(device), w.to(device, dtype)
    out = nvfp4_fused_moe_triton(x, *bank, ids, w, block_m=block_m, tune=tune, half=half)
    ref = nvfp4_moe_torch(x, *bank, ids, w)
    err = error(out, ref)
    assert err <= 2 * _TOL[dtype][device == "cuda"], ("grouped", T, E, k, H, I, dtype, tune, half, err)
    return err


def check_dequant(S, H, I, dtype, device, seed=0):
    """``nvfp4_dequantize_triton`` over a bank, contiguous and as the offload stream's strided row views
    (``moe/nvfp4_rows.py``), against the reference: equal up to the order of the two fp32 products (at most one
    ulp of the output dtype)."""
    from freetoken.kernels.nvfp4_dequant import nvfp4_dequantize_torch, nvfp4_dequantize_triton
    from freetoken.moe.nvfp4_rows import Nvfp4Rows

    bank = random_bank(S, H, I, seed, device=device)
    layout = Nvfp4Rows(H, I)
    views = layout.views(*layout.allocate(S, device=device))
    for v, t in zip(views, bank):
        v.copy_(t)
    ulp = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
    for packed, scale, glob in (bank[:3], bank[3:], views[:3], views[3:]):
        out = nvfp4_dequantize_triton(packed, scale, glob, dtype)
        ref = nvfp4_dequantize_torch(packed, scale, glob, dtype)
        torch.testing.assert_close(out, ref, rtol=ulp, atol=0.0)


def check_dequant_moe(T, E, k, H, I, dtype, device, seed=0, **routing):
    """The dequantize-then-BF16-grouped path against ``nvfp4_moe_torch`` (the same dequantization, then the same
    grouped math), ids outside the bank included."""
    from freetoken.kernels.nvfp4_dequant import nvfp4_dequant_moe
    from freetoken.kernels.nvfp4_moe import nvfp4_moe_torch

    bank = random_bank(E, H, I, seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids, w = _routing(T, E, k, g, **routing)
    ids, w = ids.to(device), w.to(device, dtype)
    err = error(nvfp4_dequant_moe(x, *bank, ids, w), nvfp4_moe_torch(x, *bank, ids, w))
    assert err <= 2 * _TOL[dtype][device == "cuda"], ("dequant grouped", T, E, k, H, I, dtype, err)
    return err


def check_slot_pool(T, k, dtype, device, E=12, S=7, H=64, I=32, seed=0):
    """Slots holding a subset of the experts in another order: the kernels over the pool with slot ids give exactly
    the resident bank's result with expert ids (decode and grouped); pairs whose expert is not in the pool (slot
    id -1) add nothing."""
    from freetoken.kernels.nvfp4_moe import nvfp4_fused_moe_triton, nvfp4_moe_decode_triton

    bank = random_bank(E, H, I, seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    resident = torch.randperm(E, generator=g)[:S]  # slot s holds expert resident[s]
    pool = tuple(t[resident.to(device)].contiguous() for t in bank)
    slot_of = torch.full((E,), -1, dtype=torch.int64)
    slot_of[resident] = torch.arange(S)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids, w = _routing(T, E, k, g)
    slots = slot_of[ids]
    ids = torch.where(slots >= 0, ids, -1)  # an expert out of the pool contributes nothing on both sides
    ids, slots, w = ids.to(device), slots.to(device), w.to(device, dtype)
    for fn in (nvfp4_moe_decode_triton, nvfp4_fused_moe_triton):
        assert torch.equal(fn(x, *pool, slots, w), fn(x, *bank, ids, w)), fn.__name__


def check_module(T, dtype, device, shared="output", seed=0):
    """``Nvfp4Experts`` with the kernels (``impl`` triton on CPU, auto on CUDA) vs the same module on the torch
    reference, the block's shared expert handed over as a ``SharedExpertTerm``."""
    from freetoken.layers.moe import SharedExpertTerm
    from freetoken.layers.nvfp4_experts import Nvfp4Experts

    E, H, I, k = 10, 64, 32, 4
    ex = Nvfp4Experts(E, H, I, device=device)
    with torch.no_grad():
        for p, t in zip(ex.bank(), random_bank(E, H, I, seed, device=device)):
            p.copy_(t)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    ids, w = _routing(T, E, k, g, invalid=True)
    ids, w = ids.to(device), w.to(device)
    kw = _shared_kw(shared, T, H, dtype, device, g)
    term = None
    if shared is not None:
        term = SharedExpertTerm(
            kw["shared_gate"], kw.get("shared"), kw.get("shared_gate_up"), kw.get("shared_down"),
            kw.get("shared_down_nvfp4"),
        )  # fmt: skip
    ex.impl = "triton" if device == "cpu" else "auto"
    out = ex(x, ids, w, term)
    ex.impl = "torch"
    ref = ex(x, ids, w, term)
    err = error(out, ref)
    assert err <= 2 * _TOL[dtype][device == "cuda"], ("module", T, dtype, shared, err)
    return err


def _nvfp4_block(H, E, k, I, Is, dtype, device, seed=0):
    """A Qwen3.5-MoE block as an NVFP4 checkpoint builds it: NVFP4 routed experts and shared expert projections
    (``Nvfp4Linear``), the router and the shared expert's gate in x's dtype; projections fused."""
    from freetoken.layers.moe import SparseMoeBlock
    from freetoken.layers.nvfp4_experts import Nvfp4Experts
    from freetoken.layers.quantized_linear import Nvfp4Linear
    from freetoken.models.base import ModelConfig

    cfg = dict(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I)
    blk = SparseMoeBlock(
        ModelConfig.from_dict(dict(cfg, model_type="qwen3_5_moe_text", shared_expert_intermediate_size=Is))
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (blk.gate.weight, blk.shared_expert_gate.weight):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    blk.to(device, dtype)  # before the quantized parts join: ``.to(dtype)`` would cast their E4M3 scales
    ex = Nvfp4Experts(E, H, I, device=device)
    with torch.no_grad():
        for p, t in zip(ex.bank(), random_bank(E, H, I, seed, device=device)):
            p.copy_(t)
    blk.experts = ex
    se = blk.shared_expert
    for i, (name, n, kk) in enumerate((("gate_proj", Is, H), ("up_proj", Is, H), ("down_proj", H, Is))):
        lin = Nvfp4Linear(kk, n, dtype=dtype, device=device)
        with torch.no_grad():
            for p, t in zip((lin.weight, lin.weight_scale, lin.weight_scale_2), random_weight(n, kk, seed + 1 + i)):
                p.copy_(t)
        setattr(se, name, lin)
    blk.fuse_projections()  # [router | shared gate | shared gate|up]: the fold needs the gate|up as one tensor
    return blk


def check_block(T, dtype, device, seed=0, H=64, E=10, k=4, I=32, Is=48):
    """``SparseMoeBlock`` with NVFP4 experts and shared expert: the shared expert's SiLU-and-mul and NVFP4 down
    projection folded into the experts' decode kernel (decode-sized steps) against the same block computing them
    itself (``takes_nvfp4_shared_down`` off). Experts on the kernels (``impl`` triton on CPU, auto on CUDA) or,
    with ``device == "torch"``, on the torch reference on the CPU, where the two must be equal bit for bit."""
    from freetoken.kernels.nvfp4_moe import DECODE_MAX_PAIRS

    on_torch = device == "torch"
    device = "cpu" if on_torch else device
    blk = _nvfp4_block(H, E, k, I, Is, dtype, device, seed)
    blk.experts.impl = "torch" if on_torch else "triton" if device == "cpu" else "auto"
    terms = []
    forward = blk.experts.forward
    blk.experts.forward = lambda x, ids, w, shared=None, out=None: (
        terms.append(shared) or forward(x, ids, w, shared, out)
    )
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    with torch.no_grad():
        out = blk(x)
        blk.experts.takes_nvfp4_shared_down = lambda pairs: False
        ref = blk(x)
    folded, unfolded = terms
    fold = T * k <= DECODE_MAX_PAIRS  # larger steps compute the shared expert as before
    assert (folded.down_nvfp4 is not None) == fold and (folded.output is None) == fold, T
    assert unfolded.down_nvfp4 is None and unfolded.output is not None
    if on_torch:
        assert torch.equal(out, ref), T
        return 0.0
    err = error(out, ref)
    assert err <= _TOL[dtype][device == "cuda"], ("block", T, dtype, err)
    return err


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the Triton kernels under the interpreter
# ----------------------------------------------------------------------------------------------------------------------

_CPU_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    # the decode cut these tiny steps were written around (80 pairs: grouped); the default is read at import
    os.environ["FREETOKEN_NVFP4_DECODE_MAX_PAIRS"] = "64"
    sys.path.insert(0, {tests!r})
    import test_nvfp4_moe as t
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    worst = {{}}
    def note(name, err):
        worst[name] = max(worst.get(name, 0.0), err)
    for dt in (f32, f16, bf16):
        key = str(dt).split(".")[-1]
        note("decode " + key, t.check_decode(1, 6, 2, 32, 16, dt, "cpu"))
        note("decode " + key, t.check_decode(3, 9, 4, 48, 32, dt, "cpu", "output", invalid=True, strided_x=True))
        note("decode " + key, t.check_decode(4, 8, 3, 64, 48, dt, "cpu", "expert", padding_row=True))
        note("decode " + key, t.check_decode(2, 5, 2, 512, 64, dt, "cpu"))  # several K steps, H even
        # the shared expert's NVFP4 down projection in the epilogue: one global scale, masked (Is = 48: no power of
        # two), several K steps (Is = 1024), a global per row with a strided x
        note("decode nvfp4 shared " + key, t.check_decode(3, 9, 4, 48, 32, dt, "cpu", "nvfp4", Is=48, invalid=True))
        note("decode nvfp4 shared " + key, t.check_decode(2, 6, 2, 64, 32, dt, "cpu", "nvfp4", Is=1024))
        note("decode nvfp4 shared " + key, t.check_decode(4, 8, 3, 48, 48, dt, "cpu", "nvfp4_rows", strided_x=True))
        # k not a power of two (10: a 16-wide pair axis, 6 of it masked), a K loop of several steps in the down kernel
        note("decode " + key, t.check_decode(2, 16, 10, 64, 48, dt, "cpu", "nvfp4", Is=48))
        note("decode " + key, t.check_decode(2, 6, 4, 32, 1024, dt, "cpu", tune=dict(down_block_w=32)))
        # the down kernel with the pairs one after another (tile_pairs=False)
        serial = dict(tile_pairs=False)
        note("decode serial " + key, t.check_decode(3, 9, 3, 48, 32, dt, "cpu", "output", tune=serial, invalid=True))
        note("decode serial " + key, t.check_decode(2, 6, 2, 64, 32, dt, "cpu", "nvfp4", Is=1024, tune=serial))
        # the gate|up GEMV in packed half precision (16-bit x; fp32 x keeps the fp32 kernel): masked, invalid pairs,
        # strided x; several K steps
        half = dict(gu_half=True)
        masked = t.check_decode(3, 9, 4, 48, 32, dt, "cpu", "output", invalid=True, strided_x=True, tune=half)
        note("decode half " + key, masked)
        note("decode half " + key, t.check_decode(2, 5, 2, 512, 64, dt, "cpu", tune=half))
        # the down GEMV in packed half precision (the intermediate packed per pair): masked, invalid pairs, several
        # K steps, k = 10 (a 16-wide pair axis) with masked blocks (I = 48)
        half_down = dict(down_half=True)
        masked = t.check_decode(3, 9, 4, 48, 32, dt, "cpu", "output", invalid=True, strided_x=True, tune=half_down)
        note("decode half down " + key, masked)
        note("decode half down " + key, t.check_decode(2, 6, 4, 32, 1024, dt, "cpu", tune=dict(half_down, down_block_w=32)))
        note("decode half down " + key, t.check_decode(2, 16, 10, 64, 48, dt, "cpu", "nvfp4", Is=48, tune=half_down))
    for dt in (f32, f16):  # the bf16-style tiles (fp16 x would take the fp16 tiles by default where not fused)
        key = str(dt).split(".")[-1]
        plain = dict(half=False)
        note("grouped " + key, t.check_grouped(9, 6, 2, 48, 32, dt, "cpu", invalid=True, **plain))
        note("grouped " + key, t.check_grouped(40, 8, 3, 32, 48, dt, "cpu", skew=True, **plain))  # long runs, empty experts
        note("grouped " + key, t.check_grouped(24, 5, 2, 160, 80, dt, "cpu", **plain))  # K tails, I not a power of two
        note("grouped " + key, t.check_grouped(60, 3, 2, 32, 48, dt, "cpu", block_m=128, invalid=True, **plain))
        # gate and up rows in one tile (I not a multiple of the tile: masked rows in both halves), other tiles
        fused = dict(fuse_gate_up=True, gu_block_n=32, gu_block_k=64, stages=2)
        note("grouped " + key, t.check_grouped(24, 5, 2, 160, 80, dt, "cpu", tune=fused, invalid=True))
        note("grouped " + key, t.check_grouped(40, 3, 2, 64, 48, dt, "cpu", block_m=32, tune=fused, **plain))
        # the default settings of large steps (100 pairs an expert: 64-row blocks, gate and up in one tile)
        note("grouped " + key, t.check_grouped(200, 2, 1, 64, 48, dt, "cpu"))
        # tail row tiles: runs a little longer than block_m (the tail taken), shorter (skipped), long (skew: blocks
        # with and without a tail), ids outside the bank (the dummy expert's tails write zeros), gate|up in one tile
        tail = dict(tail=16)
        note("grouped tail " + key, t.check_grouped(40, 4, 2, 32, 48, dt, "cpu", block_m=16, tune=tail, invalid=True, **plain))
        note("grouped tail " + key, t.check_grouped(40, 8, 3, 32, 48, dt, "cpu", block_m=16, tune=tail, skew=True, **plain))
        note("grouped tail " + key, t.check_grouped(40, 3, 2, 64, 48, dt, "cpu", block_m=16, tune=dict(fused, tail=32), **plain))
        # down programs walking N tiles: H = 160 in 32-column tiles two a program (the last one's second tile lies
        # past H), I = 80 in 32-wide K steps (a partial last step each tile), ids outside the bank (the dummy expert
        # writes zeros over its whole walk), and with tail row tiles
        walk = dict(down_block_n=32, down_block_k=32, down_walk=2)
        note("grouped walk " + key, t.check_grouped(24, 5, 2, 160, 80, dt, "cpu", tune=walk, invalid=True, **plain))
        walk_tail = dict(walk, tail=16)
        note("grouped walk " + key, t.check_grouped(40, 4, 2, 160, 80, dt, "cpu", block_m=16, tune=walk_tail, invalid=True, **plain))
        t.check_dequant(3, 48, 32, dt, "cpu")
        note("dequant grouped " + key, t.check_dequant_moe(24, 6, 2, 160, 80, dt, "cpu", invalid=True))
    for dt in (bf16, f16):  # on fp16 weight tiles: masked tails, invalid ids, prefill tiles, gate|up in one tile
        key = "half " + str(dt).split(".")[-1]
        note("grouped " + key, t.check_grouped(9, 6, 2, 48, 32, dt, "cpu", invalid=True, half=True))
        note("grouped " + key, t.check_grouped(24, 5, 2, 160, 80, dt, "cpu", half=True))
        note("grouped " + key, t.check_grouped(60, 3, 2, 32, 48, dt, "cpu", block_m=128, invalid=True, half=True))
        fused = dict(fuse_gate_up=True, gu_block_n=32, gu_block_k=64, stages=2)
        note("grouped " + key, t.check_grouped(24, 5, 2, 160, 80, dt, "cpu", tune=fused, invalid=True, half=True))
        tail = dict(tail=16)
        note("grouped tail " + key, t.check_grouped(40, 4, 2, 32, 48, dt, "cpu", block_m=16, tune=tail, invalid=True, half=True))
        walk = dict(down_block_n=32, down_block_k=32, down_walk=4, tail=16)  # 5 tiles: a walk of 4 and one of 1 + 3
        note("grouped walk " + key, t.check_grouped(40, 4, 2, 160, 80, dt, "cpu", block_m=16, tune=walk, invalid=True, half=True))
    t.check_dequant(2, 2064, 32, bf16, "cpu")  # a row longer than one step, with a tail
    t.check_slot_pool(3, 4, f32, "cpu")
    t.check_slot_pool(20, 4, f32, "cpu")
    note("module float32", t.check_module(2, f32, "cpu", "expert"))
    note("module float32", t.check_module(2, f32, "cpu", "nvfp4"))
    for dt in (f32, f16):  # the fold in a block: the decode kernel (T = 1, 3) and, past the cut, as before (T = 20)
        for T in (1, 3, 20):
            note("block " + str(dt).split(".")[-1], t.check_block(T, dt, "cpu"))
    note("module float32", t.check_module(20, f32, "cpu", "output"))  # 80 pairs: grouped, shared added after
    import freetoken.layers.nvfp4_experts as nx
    nx.DEQUANT_MIN_PAIRS = 80  # the same module step through the dequantized bank
    note("module dequant float32", t.check_module(20, f32, "cpu", "output"))
    for name, err in sorted(worst.items()):
        print(f"nvfp4_moe {{name:17s}} max |out - ref| / (1 + |ref|) = {{err:.3g}}")
    print("OK")
    """
)


def test_nvfp4_moe_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=1200)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 70])  # 70 x top-4 = 280 pairs: past the cut, no fold
def test_block_folds_the_nvfp4_shared_down_on_the_reference(T, dtype):
    """On the torch reference the folded block (``SharedExpertTerm.add_to`` with the NVFP4 down weight) equals the
    block running its shared expert itself, bit for bit."""
    check_block(T, dtype, "torch")


def test_module_runs_the_reference_on_cpu(monkeypatch):
    """``impl`` auto on CPU tensors: the torch reference, whatever the step size (no Triton launch)."""
    import freetoken.layers.nvfp4_experts as ne

    def boom(*a, **k):
        raise AssertionError("the Triton path ran on CPU")

    monkeypatch.setattr(ne, "run_nvfp4_experts", boom)
    ex = ne.Nvfp4Experts(6, 32, 16)
    with torch.no_grad():
        for p, t in zip(ex.bank(), random_bank(6, 32, 16)):
            p.copy_(t)
    for T in (1, 40):
        ids, w = _routing(T, 6, 2, torch.Generator().manual_seed(T))
        x = torch.randn(T, 32)
        assert torch.equal(ex(x, ids, w), ne.nvfp4_moe_torch(x, *ex.bank(), ids, w))


# ----------------------------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QWEN = dict(k=8, H=2048, I=512)
# the decode GEMVs' variants (``nvfp4_moe.decode_config``): the default, the down kernel's pairs one after another
_DECODE_VARIANTS = {
    "default": None,
    "serial down": dict(tile_pairs=False),
    "fp32 gate_up": dict(gu_half=False),  # the default from 8 tokens is the packed-half gate|up GEMV
    "half gate_up": dict(gu_half=True),
    "fp32 down": dict(down_half=False),  # ... and the packed-half down GEMV
    "half down": dict(down_half=True),
}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shared", [None, "output", "expert", "nvfp4"])
@pytest.mark.parametrize("T", [1, 2, 8, 32])  # 32 x top-8 = DECODE_MAX_PAIRS
@pytest.mark.parametrize("variant", list(_DECODE_VARIANTS))
def test_decode_cuda_qwen(T, shared, variant):
    tune = _DECODE_VARIANTS[variant]
    check_decode(T, 256, dtype=torch.bfloat16, device="cuda", shared=shared, seed=T, Is=512, tune=tune, **QWEN)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shared", ["nvfp4", "nvfp4_rows"])
def test_decode_cuda_nvfp4_shared_shapes(shared, dtype):
    """The shared expert's NVFP4 down GEMV in the epilogue off the Qwen shapes: masked rows and columns; each
    variant of the kernels (k = 10 not a power of two)."""
    for tune in _DECODE_VARIANTS.values():
        check_decode(5, 64, 4, 208, 80, dtype, "cuda", shared=shared, Is=48, strided_x=True, tune=tune)
        check_decode(3, 32, 8, 1024, 256, dtype, "cuda", shared=shared, Is=1024, invalid=True, tune=tune)
        check_decode(2, 64, 10, 512, 128, dtype, "cuda", shared=shared, Is=96, tune=tune)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T", [1, 4, 8, 32, 40])  # 40 x top-8: past the cut, the shared expert as before
def test_block_folds_the_nvfp4_shared_down_cuda(T):
    """At Qwen3.6's shapes the folded block equals the block running its shared expert as its own launches (the
    mixed GEMV / W4A16 kernel)."""
    check_block(T, torch.bfloat16, "cuda", seed=T, H=2048, E=256, k=8, I=512, Is=512)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "T,S,k,H,I,kw",
    [
        (3, 256, 8, 2048, 512, dict(invalid=True, padding_row=True)),
        (5, 64, 4, 208, 80, dict(strided_x=True)),  # H, I off every block size
        (16, 512, 4, 1024, 256, {}),
    ],
)
def test_decode_cuda_shapes(T, S, k, H, I, kw, dtype):
    check_decode(T, S, k, H, I, dtype, "cuda", shared="output", seed=T, **kw)


@pytest.mark.gpu
@cuda
# 2048: 64 pairs an expert (64-row blocks, 4 warps); 4096: gate and up in one tile; 8192: blocks of 128 rows
@pytest.mark.parametrize("T", [9, 64, 512, 2048, 4096, 8192])
def test_grouped_cuda_qwen(T):
    check_grouped(T, 256, dtype=torch.bfloat16, device="cuda", seed=T, **QWEN)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T", [9, 512, 2048, 4096, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_cuda_qwen_half(T, dtype):
    """The grouped kernels on fp16 weight tiles at Qwen3.6's shapes, every tile config the sizes pick."""
    check_grouped(T, 256, dtype=dtype, device="cuda", seed=T, half=True, **QWEN)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "T,E,k,H,I,kw",
    [
        (100, 8, 2, 2048, 512, dict(skew=True)),
        (77, 60, 4, 208, 80, dict(invalid=True)),
        (1024, 512, 8, 1024, 256, {}),
    ],
)
def test_grouped_cuda_shapes(T, E, k, H, I, kw, dtype):
    check_grouped(T, E, k, H, I, dtype, "cuda", seed=T, **kw)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "tune",
    [dict(fuse_gate_up=True), dict(fuse_gate_up=True, gu_block_n=32), dict(down_walk=4), dict(down_walk=16, tail=16)],
)
@pytest.mark.parametrize("T,E,k,H,I,kw", [(4096, 256, 8, 2048, 512, {}), (77, 60, 4, 208, 80, dict(invalid=True))])
def test_grouped_cuda_tunes(T, E, k, H, I, kw, tune):
    """Launch settings other than the default pick (the moesweep candidates): the same result."""
    check_grouped(T, E, k, H, I, torch.bfloat16, "cuda", seed=T, tune=tune, **kw)


def test_grouped_half_where_gate_and_up_are_separate_tiles(monkeypatch):
    """The fp16 weight tiles by default for 16-bit x where gate and up rows are separate tiles (up to ~2k tokens of
    Qwen3.6: faster there on the H200), not with gate|up in one tile (slower); pinned on or off by the setting."""
    from freetoken.kernels import nvfp4_moe as m

    small, large = m.grouped_config(2048 * 8, 256, 2048, 512), m.grouped_config(8192 * 8, 256, 2048, 512)
    assert not small["fuse_gate_up"] and large["fuse_gate_up"]
    bf16, f32 = torch.bfloat16, torch.float32
    assert m.grouped_half(small, bf16, None) and not m.grouped_half(large, bf16, None)
    assert not m.grouped_half(small, f32, None) and not m.grouped_half(small, f32, True)  # fp32 x: never
    assert m.grouped_half(large, bf16, True) and not m.grouped_half(small, bf16, False)
    monkeypatch.setattr(m, "GROUPED_HALF", "on")
    assert m.grouped_half(large, torch.float16, None)
    monkeypatch.setattr(m, "GROUPED_HALF", "off")
    assert not m.grouped_half(small, bf16, None)


def test_grouped_config_refuses_unknown_settings():
    pytest.importorskip("triton")
    from freetoken.kernels.nvfp4_moe import grouped_config

    big = grouped_config(65536, 256, 2048, 512)
    assert (big["block_m"], big["fuse_gate_up"], big["gu_block_k"], big["warps"]) == (128, True, 64, 8)
    mid = grouped_config(16384, 256, 2048, 512)  # 64 pairs an expert
    assert (mid["block_m"], mid["fuse_gate_up"], mid["warps"]) == (64, False, 4)
    # tail tiles where blocks are 64 rows with gate and up apart (timed on the H200), not on 128-row blocks or 16
    assert (mid["tail"], big["tail"], grouped_config(4096, 256, 2048, 512)["tail"]) == (16, 0, 0)
    # the down kernel's K steps: 64 weights on blocks of 64 rows and more (faster on the H100 and the H200, and 128
    # spilled beside a tail tile on sm_90), 128 on the small blocks just past the GEMVs
    small = grouped_config(4096, 256, 2048, 512)
    assert (mid["down_block_k"], big["down_block_k"], small["down_block_k"]) == (64, 64, 128)
    assert grouped_config(4096, 256, 2048, 512)["block_m"] == 16
    assert grouped_config(65536, 256, 2048, 512, tune={"stages": 2})["stages"] == 2
    with pytest.raises(ValueError, match="block_nn"):
        grouped_config(65536, 256, 2048, 512, tune={"block_nn": 64})
    assert big["down_walk"] == 1  # one N tile a down program until the walk is timed
    with pytest.raises(ValueError, match="down_walk 0"):
        grouped_config(65536, 256, 2048, 512, tune={"down_walk": 0})


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequant_cuda_qwen(dtype):
    check_dequant(8, 2048, 512, dtype, "cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T", [512, 4096])  # 4,096 and 32,768 pairs
def test_dequant_grouped_cuda_qwen(T):
    check_dequant_moe(T, 256, dtype=torch.bfloat16, device="cuda", seed=T, **QWEN)


@pytest.mark.gpu
@cuda
def test_slot_pool_and_module_cuda():
    check_slot_pool(3, 4, torch.bfloat16, "cuda")
    check_slot_pool(40, 4, torch.bfloat16, "cuda")
    check_module(2, torch.bfloat16, "cuda", "expert")
    check_module(40, torch.bfloat16, "cuda", "output")
    check_module(80, torch.bfloat16, "cuda", "output")  # 320 pairs: the grouped kernels, shared added after


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shared", ["output", "nvfp4"])  # given, or its NVFP4 down projection in the epilogue
@pytest.mark.parametrize("T", [2, 32, 40])  # decode GEMVs (shared fused; 256 pairs: the cut) and the grouped kernels
def test_nvfp4_moe_cuda_graph(T, shared):
    """Captured once, replayed with new inputs and routing (ids outside the bank included)."""
    from freetoken.layers.moe import SharedExpertTerm
    from freetoken.layers.nvfp4_experts import run_nvfp4_experts

    E, k, H, I = 256, 8, 2048, 512
    bank = random_bank(E, H, I, 1, plain_scales=True, device="cuda")
    x = torch.zeros(T, H, device="cuda", dtype=torch.bfloat16)
    s_out, s_gate = torch.zeros_like(x), torch.zeros(T, 1, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(T, k, dtype=torch.int64, device="cuda")
    w = torch.zeros(T, k, device="cuda")
    term = SharedExpertTerm(s_gate, output=s_out)
    if shared == "nvfp4":  # s_out's first 2 * 512 columns stand for the shared gate|up
        down = nvfp4.Nvfp4Tensor(*random_weight(H, 512, 3, plain_scales=True, device="cuda"))
        term = SharedExpertTerm(s_gate, gate_up=s_out[:, : 2 * 512], down_nvfp4=down)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_nvfp4_experts(x, bank, ids, w, term)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_nvfp4_experts(x, bank, ids, w, term)
    g = torch.Generator().manual_seed(2)
    for invalid in (False, True):
        new_ids, new_w = _routing(T, E, k, g, invalid=invalid)
        ids.copy_(new_ids), w.copy_(new_w)
        x.copy_(torch.randn(T, H, generator=g)), s_out.copy_(torch.randn(T, H, generator=g))
        s_gate.copy_(torch.randn(T, 1, generator=g))
        graph.replay()
        ref = run_nvfp4_experts(x, bank, ids, w, term)  # eager, same kernels
        assert error(out, ref) <= _TOL[torch.bfloat16][1]


def test_dequant_cut_from_the_environment(monkeypatch):
    """``FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS`` moves the dequantized-bank cut; a value that is not a number is refused
    in one line naming the variable (it is read when the NVFP4 layers load, at start-up)."""
    from freetoken.layers.nvfp4_experts import _dequant_min_pairs

    monkeypatch.delenv("FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS", raising=False)
    assert _dequant_min_pairs() == 8192 * 8 + 1  # an 8,192-token chunk at top-8 stays on the grouped kernel
    monkeypatch.setenv("FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS", "16384")
    assert _dequant_min_pairs() == 16384
    monkeypatch.setenv("FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS", "lots")
    with pytest.raises(ValueError, match="FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS='lots'"):
        _dequant_min_pairs()


def test_decode_cut_from_the_environment(monkeypatch):
    """``FREETOKEN_NVFP4_DECODE_MAX_PAIRS`` (read at import) moves the decode GEMVs' cut, 256 pairs by default."""
    from freetoken.kernels import nvfp4_moe
    from freetoken.tuning_env import int_from_env

    if "FREETOKEN_NVFP4_DECODE_MAX_PAIRS" not in os.environ:
        assert nvfp4_moe.DECODE_MAX_PAIRS == 256  # 32 decode streams at top-8
    monkeypatch.setenv("FREETOKEN_NVFP4_DECODE_MAX_PAIRS", "64")
    assert int_from_env("FREETOKEN_NVFP4_DECODE_MAX_PAIRS", 256) == 64
    monkeypatch.setenv("FREETOKEN_NVFP4_DECODE_MAX_PAIRS", "x")
    with pytest.raises(ValueError, match="FREETOKEN_NVFP4_DECODE_MAX_PAIRS='x'"):
        int_from_env("FREETOKEN_NVFP4_DECODE_MAX_PAIRS", 256)
