"""``CpuExperts`` (``crates/ft-cpu-experts``): routed experts on the host CPU against the torch references
(``fused_moe_torch`` for BF16 banks, ``nvfp4_moe_torch`` for NVFP4 banks, both on fp32 copies), on the AVX-512 kernels
(where this CPU has them) and the portable ones; banks as the loaders hold them (``Nvfp4Experts`` filled from
``nvfp4.quantize``, the offload rows' strided views); input checks."""

from __future__ import annotations

import pytest
import torch
from nvfp4_cases import random_bank

from freetoken.kernels.fused_moe import fused_moe_torch
from freetoken.kernels.nvfp4_moe import dequantize_experts, nvfp4_moe_torch
from freetoken.layers.nvfp4_experts import Nvfp4Experts
from freetoken.moe.cpu_experts import CpuExperts, executor
from freetoken.moe.nvfp4_rows import Nvfp4Rows
from freetoken.quant import nvfp4

THREADS = 2


def bf16_bank(E, H, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    down = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    return gate_up, down


def nvfp4_bank(E, H, I, seed=0):
    """The six tensors of an ``Nvfp4Experts`` loaded from ModelOpt-quantized random weights (gate and up with
    different global scales), exactly as the checkpoint loader fills them."""
    g = torch.Generator().manual_seed(seed)
    layer = Nvfp4Experts(E, H, I, device="cpu")
    for e in range(E):
        for kind, shape, std in (("gate_proj", (I, H), 1.0), ("up_proj", (I, H), 2.5), ("down_proj", (H, I), 1.0)):
            q = nvfp4.quantize(torch.randn(*shape, generator=g) * std / shape[1] ** 0.5)
            layer.load_expert_weight(f"{e}.{kind}.weight", q.packed)
            layer.load_expert_weight(f"{e}.{kind}.weight_scale", q.scale)
            layer.load_expert_weight(f"{e}.{kind}.weight_scale_2", q.scale_2)
    return layer.bank()


def routing(T, k, E, seed=0):
    """``(ids int64 [T, k], weights fp32 [T, k])``: experts repeated across tokens, about one id in six -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[torch.rand(T, k, generator=g) < 0.17] = -1
    return ids, torch.rand(T, k, generator=g) + 0.1


def form(kernels: str, bank) -> str:
    """What the executor's kernels hand the rows of ``bank`` (``executor.rs``'s ``Form``): int16 blocks for NVFP4
    rows on VNNI, BF16 for BF16 rows on AVX512-BF16, else f32."""
    nvfp4 = len(bank) == 6
    if nvfp4 and kernels in ("avx512_vnni", "avx512_bf16"):
        return "int16"
    return "bf16" if not nvfp4 and kernels == "avx512_bf16" else "f32"


def through_int16_blocks(v: torch.Tensor) -> torch.Tensor:
    """``v`` (fp64, last dimension a multiple of 16) as the VNNI kernels take it (``nvfp4_int16_dot::quantize``):
    each block of 16 as int16 times a power of two that puts its largest in [2^14, 2^15), ties to even."""
    b = v.reshape(*v.shape[:-1], -1, 16)
    largest = b.abs().amax(-1, keepdim=True)
    e = (torch.frexp(largest).exponent - 1).clamp(min=-100).double()
    up = torch.exp2(14 - e)
    q = torch.round(b * up).clamp(-32767, 32767) / up
    return torch.where(largest > 0, q, torch.zeros_like(q)).reshape(v.shape)


def reference(bank, x, ids, weights, form="f32"):
    """fp32 over the (dequantized) bank for the f32 form. Otherwise (``form``) the activations are rounded to bf16
    before the down projection, as the kernels (and the GPU's) round them, and for "int16" x and the activations go
    through int16 blocks first, as the kernels take them; computed in fp64 up to those roundings: an fp32 reference
    rounds an element the other way wherever its own summation order lands near a tie, and one large element's flip
    moved a whole output by 6e-4 (a Sapphire Rapids host, 2026-12-07: torch's fp32 products differ by CPU)."""
    if form == "f32":
        if len(bank) == 2:
            return fused_moe_torch(x.float(), bank[0].float(), bank[1].float(), ids, weights.float())
        return nvfp4_moe_torch(x.float(), *bank, ids, weights.float())
    if len(bank) == 2:
        gate_up, down = bank[0].float(), bank[1].float()
    else:
        every = torch.arange(bank[0].shape[0])
        gate_up, down = (dequantize_experts(*bank[i : i + 3], every, torch.float32) for i in (0, 3))
    out, I = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64), down.shape[2]
    blocks = through_int16_blocks if form == "int16" else (lambda v: v)
    for t, j in (ids >= 0).nonzero().tolist():
        e = int(ids[t, j])
        h = gate_up[e].double() @ blocks(x[t].double())
        act = blocks((torch.nn.functional.silu(h[:I]) * h[I:]).float().bfloat16().double())
        out[t] += float(weights[t, j]) * (down[e].double() @ act)
    return out.float()


def check(bank, T, k, portable, seed=0, tol=1e-4):
    experts = CpuExperts(bank, threads=THREADS, portable=portable)
    E, H = experts.num_experts, experts.hidden_size
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, weights = routing(T, k, E, seed)
    start = torch.randn(T, H, generator=g)
    want = start + reference(bank, x, ids, weights, form(experts.executor.kernels, bank))
    out = start.clone()
    got = experts.forward(x, ids, weights, out)
    assert got is out
    err = float((out - want).norm() / want.norm())
    assert err < tol, (T, k, portable, err)
    return out


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("T,k", [(1, 8), (3, 4), (8, 8)])
def test_bf16_bank(T, k, portable):
    check(bf16_bank(8, 256, 128), T, k, portable)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("T,k", [(1, 8), (3, 4), (8, 8)])
def test_nvfp4_bank(T, k, portable):
    check(nvfp4_bank(8, 256, 128), T, k, portable)


@pytest.mark.parametrize("portable", [False, True])
def test_qwen_shape(portable):
    """Qwen3.6-35B-A3B's expert shape (H 2048, I 512), a bank of 4."""
    check(bf16_bank(4, 2048, 512, seed=1), 2, 4, portable, seed=1)
    check(nvfp4_bank(4, 2048, 512, seed=1), 2, 4, portable, seed=1)


@pytest.mark.parametrize("H,I", [(48, 16), (272, 80), (160, 528)])
def test_sizes_off_the_kernel_chunks(H, I):
    """H and I multiples of 16 but not of the kernels' 32 (BF16) or 256 (NVFP4) elements; BF16 takes any size."""
    for portable in (False, True):
        check(nvfp4_bank(3, H, I, seed=H), 4, 2, portable, seed=H)
        check(bf16_bank(3, H + 3, I + 5, seed=H), 4, 2, portable, seed=H)


def test_every_code_and_scale():
    """Random bytes: every E2M1 code of both nibbles and E4M3 scales over their whole finite range (subnormals
    included), per-row globals that differ between gate and up."""
    bank = random_bank(6, 512, 256, seed=3)
    simd = check(bank, 5, 6, portable=False, seed=3)
    portable = check(bank, 5, 6, portable=True, seed=3)
    # each is checked against its reference above; between them, the bf16 activations of the int16 form
    bf16_act = form(executor(THREADS).kernels, bank) != "f32"
    assert float((simd - portable).norm() / portable.norm()) < (4e-3 if bf16_act else 1e-5)


def test_offload_rows_and_scale_bits():
    """The offload host bank's strided views (``Nvfp4Rows``), and block scales given as their uint8 bits."""
    E, H, I = 5, 256, 64
    bank = nvfp4_bank(E, H, I, seed=4)
    rows = Nvfp4Rows(H, I)
    gate_up, down = rows.allocate(E, "cpu")
    views = rows.views(gate_up, down)
    for view, part in zip(views, bank):
        view.copy_(part)
    assert views[0].stride(0) != views[0][0].numel()  # the experts sit at the row's stride
    x = torch.randn(4, H).bfloat16()
    ids, weights = routing(4, 3, E, seed=4)
    want = CpuExperts(bank, threads=THREADS).forward(x, ids, weights)
    assert torch.equal(CpuExperts(views, threads=THREADS).forward(x, ids, weights), want)
    bits = list(bank)
    bits[1], bits[4] = bank[1].view(torch.uint8), bank[4].view(torch.uint8)
    assert torch.equal(CpuExperts(bits, threads=THREADS).forward(x, ids, weights), want)


def test_id_dtypes_weight_dtypes_and_empty_steps():
    E, H, I = 4, 64, 32
    bank = bf16_bank(E, H, I)
    experts = CpuExperts(bank, threads=THREADS)
    x = torch.randn(3, H).bfloat16()
    ids, weights = routing(3, 2, E)
    want = experts.forward(x, ids, weights.bfloat16().float())
    assert torch.equal(experts.forward(x, ids.int(), weights.bfloat16()), want)
    none = torch.full((3, 2), -1)
    assert torch.equal(experts.forward(x, none, weights), torch.zeros(3, H))
    empty = experts.forward(x[:0], ids[:0], weights[:0])
    assert empty.shape == (0, H)


def test_the_executor_is_shared_and_says_its_path():
    assert executor(THREADS) is executor(THREADS)
    assert executor(THREADS, True).simd is False and executor(THREADS, True).kernels == "portable"
    assert executor(THREADS).kernels in ("portable", "avx512", "avx512_vnni", "avx512_bf16")
    assert executor(THREADS).threads == THREADS
    assert executor().threads >= 1


def test_call_times_are_summed_by_phase_and_taken():
    """``take_call_times`` (for ``bench/cpu_expert_bench.py``): one count a call, nanoseconds in each phase, the
    pool's broadcasts, and zero again once taken. A fresh executor of its own, so no other test's calls count."""
    from freetoken import _core

    E, H, I = 4, 64, 32
    experts = CpuExperts(bf16_bank(E, H, I), threads=THREADS)
    experts.executor = _core.CpuExpertExecutor(3)
    ids, weights = routing(3, 2, E)
    for _ in range(4):
        experts.forward(torch.randn(3, H).bfloat16(), ids, weights)
    t = experts.executor.take_call_times()
    assert _core.CPU_EXPERT_PHASES == ["group", "x", "gate_up", "acts", "down"]  # bench/cpu_expert_bench.py's columns
    counts = {"calls", "broadcasts", "joined", "wakeups", "wait_ns"}
    assert set(t) == {f"{p}_ns" for p in _core.CPU_EXPERT_PHASES} | counts
    assert t["calls"] == 4 and t["gate_up_ns"] > 0 and t["down_ns"] > 0
    assert t["broadcasts"] >= 4 and 0 <= t["joined"] <= 2 * t["broadcasts"] and t["wakeups"] <= t["broadcasts"]
    assert all(v == 0 for v in experts.executor.take_call_times().values())


def test_bad_input_raises_value_error():
    E, H, I = 4, 64, 32
    gate_up, down = bf16_bank(E, H, I)
    experts = CpuExperts((gate_up, down), threads=THREADS)
    x = torch.randn(2, H).bfloat16()
    ids, weights = routing(2, 2, E)
    ids[1, 1] = E
    with pytest.raises(ValueError, match=r"topk_ids\[1, 1\] = 4 is outside the bank's 4 experts"):
        experts.forward(x, ids, weights)
    ids[1, 1] = 0
    out = torch.zeros(2, H)
    cases = [
        (dict(x=x.float()), "x must be a contiguous bfloat16"),
        (dict(x=torch.randn(H, 2).bfloat16().t()), "x must be a contiguous bfloat16"),
        (dict(x=torch.randn(2, H + 1).bfloat16()), "x must be"),
        (dict(topk_ids=ids.float()), "topk_ids must be int32 or int64"),
        (dict(topk_ids=ids[:1]), "topk_ids must be"),
        (dict(topk_weights=weights.double()), "topk_weights must be float32 or bfloat16"),
        (dict(topk_weights=weights[:, :1]), "topk_weights must be"),
        (dict(out=out.bfloat16()), "out must be a contiguous float32"),
        (dict(out=torch.zeros(H, 2).t()), "out must be a contiguous float32"),
        (dict(x=None), "x must be a CPU tensor"),
    ]
    for change, message in cases:
        args = dict(x=x, topk_ids=ids, topk_weights=weights, out=out) | change
        with pytest.raises(ValueError, match=message):
            experts.forward(**args)
    with pytest.raises(ValueError, match="gate_up must be"):
        CpuExperts((gate_up.float(), down))
    with pytest.raises(ValueError, match=r"down must have shape \[4, 64, 32\]"):
        CpuExperts((gate_up, down[:, :, :16]))
    with pytest.raises(ValueError, match="row-major inside each expert"):
        CpuExperts((gate_up, down.transpose(1, 2).contiguous().transpose(1, 2)))
    with pytest.raises(ValueError, match="a bank is"):
        CpuExperts((gate_up,))
    w13, s13, g13, w2, s2, g2 = nvfp4_bank(2, 64, 32)
    with pytest.raises(ValueError, match="w13_global must be torch.float32"):
        CpuExperts((w13, s13, g13.double(), w2, s2, g2))
    with pytest.raises(ValueError, match="w2_scale must have shape"):
        CpuExperts((w13, s13, g13, w2, s2[:, :, :1], g2))
    with pytest.raises(ValueError, match="divisible by 16"):
        CpuExperts((w13[:, :, :12], s13, g13, w2, s2, g2))
