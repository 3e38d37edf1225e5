"""Grouped Triton MoE kernel vs the torch reference: on CUDA (``gpu`` marker) and on CPU under TRITON_INTERPRET=1.

The interpreter must be switched on before triton compiles anything, so CPU cases run in a subprocess with the
environment variable set (the parent may already have imported triton without it).
"""

import os
import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _case(T, E, k, H, I, dtype, device, seed=0, skew=False, tune=None):
    from freetoken.kernels.fused_moe import fused_moe_torch, fused_moe_triton

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    logits = torch.randn(T, E, generator=g)
    if skew:  # most tokens go to expert 0 and 1: exercises long runs and empty experts
        logits[:, :2] += 5
    p = torch.softmax(logits, -1)
    w, ids = torch.topk(p, k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(device, dtype)
    ids = ids.to(device)
    ref = fused_moe_torch(x, w13, w2, ids, w)
    out = fused_moe_triton(x, w13, w2, ids, w, tune=tune)
    tol = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}[dtype]
    assert out.dtype == dtype and out.shape == (T, H)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def check_align(ids, E, bm, device="cpu"):
    """Triton alignment vs the torch reference: same blocks, same experts, same pairs per expert run."""
    from freetoken.kernels.fused_moe import moe_align_block_size, moe_align_block_size_torch

    ref_ids, ref_be = moe_align_block_size_torch(ids, E, bm)
    got_ids, got_be = moe_align_block_size(ids.to(device), E, bm)
    assert got_ids.dtype == torch.int32 and got_be.dtype == torch.int32
    assert torch.equal(got_be.cpu(), ref_be)
    # each expert's run holds the same pairs (order inside a run is arbitrary: atomics)
    n = ids.numel()
    key = lambda si, be: (be.long().repeat_interleave(bm) * (n + 1) + si.long()).sort().values  # noqa: E731
    assert torch.equal(key(ref_ids, ref_be), key(got_ids.cpu(), got_be.cpu()))


def test_align_block_size_reference():
    from freetoken.kernels.fused_moe import moe_align_block_size_torch

    ids = torch.tensor([[2, 0], [2, 1], [2, 0]])
    sorted_ids, block_expert = moe_align_block_size_torch(ids, 4, 2)
    n = ids.numel()
    real = block_expert >= 0
    blocks = sorted_ids.view(-1, 2)
    seen = []
    for b in range(blocks.shape[0]):
        for pair in blocks[b].tolist():
            if pair < n:
                assert real[b] and ids.flatten()[pair] == block_expert[b]
                seen.append(pair)
    assert sorted(seen) == list(range(n))


def test_align_drops_ids_outside_the_experts():
    """Pairs routed outside ``[0, E)`` (a MoE prefill graph's padding rows: id ``E``) are in no block; the others are
    aligned as if those were absent."""
    from freetoken.kernels.fused_moe import moe_align_block_size_torch

    ids = torch.tensor([[2, 0], [4, 4], [2, 1], [4, -1]])  # E = 4: rows 1 and 3 (all or partly) dropped
    sorted_ids, block_expert = moe_align_block_size_torch(ids, 4, 2)
    n = ids.numel()
    blocks = sorted_ids.view(-1, 2)
    seen = sorted(p for b in range(blocks.shape[0]) for p in blocks[b].tolist() if p < n)
    assert seen == [0, 1, 4, 5]
    for b in range(blocks.shape[0]):
        for pair in blocks[b].tolist():
            if pair < n:
                assert ids.flatten()[pair] == block_expert[b]
    # the same real blocks as the valid pairs alone (more blocks past them: the bound counts every pair)
    alone = moe_align_block_size_torch(torch.tensor([[2, 0], [2, 1]]), 4, 2)[1]
    assert torch.equal(block_expert[block_expert >= 0], alone[alone >= 0])


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_triton_moe import _case, check_align
    g = torch.Generator().manual_seed(0)
    check_align(torch.tensor([[2, 0], [2, 1], [2, 0]]), 4, 2)
    check_align(torch.randint(0, 6, (37, 3), generator=g), 6, 16)
    check_align(torch.randint(0, 300, (700, 2), generator=g), 300, 4)  # > CHUNK pairs, E not a power of 2
    # > 1024 blocks (the running max carried across the kernel's block loop), experts 0-4 and 40-49 empty
    check_align(torch.randint(5, 40, (2000, 2), generator=g), 50, 2)
    dropped = torch.randint(0, 6, (300, 4), generator=g)
    dropped[200:] = 6  # padding rows, as a MoE prefill graph routes them
    dropped[5, 1] = -1
    check_align(dropped, 6, 16)
    # counted in parallel first (more than _SERIAL_COUNT_IDS ids), with padding rows dropped
    many = torch.randint(0, 37, (900, 4), generator=g)
    many[700:] = 37
    check_align(many, 37, 8)
    for args in {cases!r}:
        T, E, k, H, I, dt, skew, *tune = args
        _case(T, E, k, H, I, getattr(torch, dt), "cpu", seed=T, skew=skew, tune=tune[0] if tune else None)
    print("OK")
    """
)


def test_triton_moe_interpreter_cpu():
    cases = [
        (1, 4, 2, 16, 16, "float32", False),
        (5, 6, 2, 24, 20, "float32", False),
        (19, 8, 3, 32, 48, "float32", True),
        (7, 4, 2, 16, 32, "float16", False),
        # launch settings of grouped_bf16_config: rows per block, both kernels' tiles (I = 48: a partial N tile)
        (19, 8, 3, 32, 48, "float32", True, {"block_m": 32, "gu_block_n": 32, "down_block_k": 16, "warps": 2}),
        # the down kernel's own warps and stages
        (19, 8, 3, 32, 48, "float32", True, {"down_block_n": 32, "down_warps": 2, "down_stages": 2}),
        # tail row tiles: runs a little longer than block_m take the tail, shorter ones skip it, long ones (skew)
        # span blocks with and without a tail
        (40, 4, 2, 32, 48, "float32", False, {"block_m": 16, "tail": 16}),
        (61, 8, 3, 32, 48, "float32", True, {"block_m": 16, "tail": 16}),
        (45, 4, 3, 32, 48, "float16", True, {"block_m": 16, "tail": 32, "gu_block_n": 16}),
        # down programs walking N tiles: H = 48 in 16-column tiles walked two at a time (the second program's second
        # tile lies past H: masked), I = 40 in 16-wide K steps (a partial last step each tile); and a walk longer
        # than the tiles there are (clipped)
        (19, 8, 3, 48, 40, "float32", True, {"down_block_n": 16, "down_block_k": 16, "down_walk": 2}),
        (33, 6, 2, 32, 48, "float16", False, {"block_m": 16, "down_block_n": 16, "down_walk": 8}),
    ]
    run_under_interpreter(_CPU_SCRIPT, cases=cases)


def test_grouped_bf16_config_refuses_unknown_settings():
    from freetoken.kernels.fused_moe import grouped_bf16_config

    assert grouped_bf16_config(17472, 256)["block_m"] == 64  # Qwen3.6's 2,184-token chunk
    assert grouped_bf16_config(17472, 256, tune={"block_m": 128})["block_m"] == 128
    with pytest.raises(ValueError, match="block_mm"):
        grouped_bf16_config(8, 4, tune={"block_mm": 16})
    assert grouped_bf16_config(17472, 256)["tail"] == 0
    with pytest.raises(ValueError, match="tail 8"):
        grouped_bf16_config(8, 4, tune={"tail": 8})
    with pytest.raises(ValueError, match="down_walk"):
        grouped_bf16_config(8, 4, tune={"down_walk": 0})
    # a walk gets 4 down stages unless tuned; a tail tile takes precedence (the walking programs have none)
    walking = grouped_bf16_config(17472, 256, tune={"down_walk": 4})
    assert (walking["down_walk"], walking["down_stages"]) == (4, 4)
    assert grouped_bf16_config(17472, 256, tune={"down_walk": 4, "down_stages": None})["down_stages"] is None
    assert grouped_bf16_config(17472, 256, tune={"down_walk": 4, "down_stages": 2})["down_stages"] == 2
    tailed = grouped_bf16_config(17472, 256, tune={"down_walk": 4, "tail": 16})
    assert (tailed["down_walk"], tailed["down_stages"]) == (1, None)


def test_grouped_bf16_tail_from_the_environment(monkeypatch):
    from freetoken.kernels.fused_moe import grouped_bf16_config

    monkeypatch.setenv("FREETOKEN_BF16_MOE_TAIL", "16")
    assert grouped_bf16_config(17472, 256)["tail"] == 16
    monkeypatch.setenv("FREETOKEN_BF16_MOE_TAIL", "24")
    with pytest.raises(ValueError, match="tail 24"):
        grouped_bf16_config(17472, 256)


def test_down_walk_launch_grid(monkeypatch):
    """``down_walk`` launches the down kernel over ceil(N tiles / walk) programs a block, the walk clipped to the tiles
    there are (1: one tile a program); the interpreter test above checks the walking programs' values."""
    from freetoken.kernels import fused_moe as fm

    launches = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw["WALK"]))

    monkeypatch.setattr(fm, "_moe_down_kernel", Fake())
    inter, w2 = torch.zeros(6, 40), torch.zeros(2, 48, 40)  # H = 48: three 16-column tiles
    ids, blocks = torch.zeros(16, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    for walk in (1, 2, 8):
        cfg = fm.grouped_bf16_config(6, 2, tune={"block_m": 8, "down_block_n": 16, "down_walk": walk})
        fm._launch_down(inter, w2, ids, blocks, 48, cfg, "ieee")
    assert launches == [((2, 3), 1), ((2, 2), 2), ((2, 1), 3)]


def test_grouped_bf16_down_walk_from_the_environment(monkeypatch):
    from freetoken.kernels import fused_moe
    from freetoken.kernels.fused_moe import grouped_bf16_config

    assert grouped_bf16_config(17472, 256)["down_walk"] == fused_moe._DOWN_WALK_PREFILL
    assert grouped_bf16_config(2048, 256)["down_walk"] == 1  # 16-row blocks (8 pairs an expert): one tile
    monkeypatch.setenv("FREETOKEN_BF16_MOE_DOWN_WALK", "4")
    cfg = grouped_bf16_config(17472, 256)
    assert (cfg["down_walk"], cfg["down_stages"]) == (4, 4)  # walking: 4 pipeline stages
    monkeypatch.setenv("FREETOKEN_BF16_MOE_DOWN_WALK", "8")
    assert grouped_bf16_config(2048, 256)["down_walk"] == 8
    monkeypatch.setenv("FREETOKEN_BF16_MOE_DOWN_WALK", "four")
    with pytest.raises(ValueError, match="FREETOKEN_BF16_MOE_DOWN_WALK"):
        grouped_bf16_config(17472, 256)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "T,E,k,H,I,skew",
    [
        (1, 256, 8, 2048, 512, False),  # Qwen3.6 decode
        (4, 256, 8, 2048, 512, False),
        (64, 128, 8, 2048, 768, False),  # Qwen3-30B-A3B
        (300, 256, 8, 2048, 512, True),
        (1000, 16, 4, 256, 96, False),  # I not a multiple of the block
        (33, 8, 2, 200, 72, False),  # H not a multiple of the block
    ],
)
def test_triton_moe_cuda(T, E, k, H, I, skew, dtype):
    _case(T, E, k, H, I, dtype, "cuda", seed=T, skew=skew)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "tune",
    [
        {"block_m": 128, "warps": 8},
        {"block_m": 64, "gu_block_n": 128, "down_block_n": 128, "warps": 8, "stages": 3},
        {"block_m": 32, "gu_block_k": 128, "down_block_k": 128, "stages": 4},
        # tail row tiles (their dots transposed): ~68 pairs an expert, most blocks with a tail
        {"tail": 16},
        {"tail": 32, "warps": 8},
        # down programs walking 4 and all 16 of their N tiles
        {"down_walk": 4},
        {"down_walk": 16, "down_stages": 4},
    ],
)
def test_triton_moe_cuda_launch_settings(tune):
    """``tune`` at Qwen3.6's prefill shape (a 2,184-token chunk): every launch setting the sweep times matches torch."""
    _case(2184, 256, 8, 2048, 512, torch.bfloat16, "cuda", seed=1, tune=tune)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("T,E,k,bm", [(1, 256, 8, 16), (3000, 128, 8, 64), (77, 512, 10, 32), (5, 3, 2, 16)])
def test_align_cuda(T, E, k, bm):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    check_align(ids, E, bm, "cuda")


@pytest.mark.gpu
@cuda
def test_fused_moe_cuda_graph():
    from freetoken.kernels.fused_moe import fused_moe_torch, fused_moe_triton

    E, k, H, I = 64, 4, 256, 128
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(4, H, device="cuda", dtype=torch.bfloat16)
    w, ids = torch.topk(torch.softmax(torch.randn(4, E, device="cuda"), -1), k, -1)
    w = (w / w.sum(-1, keepdim=True)).bfloat16()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe_triton(x, w13, w2, ids, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, ids, w)
    for _ in range(2):  # new routing and inputs, same buffers
        x.copy_(torch.randn_like(x))
        w2_, ids_ = torch.topk(torch.softmax(torch.randn(4, E, device="cuda"), -1), k, -1)
        ids.copy_(ids_)
        w.copy_((w2_ / w2_.sum(-1, keepdim=True)).bfloat16())
        graph.replay()
        torch.testing.assert_close(out.float(), fused_moe_torch(x, w13, w2, ids, w).float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@cuda
def test_sparse_moe_block_auto_picks_triton_on_cuda():
    from freetoken.layers.moe import SparseMoeBlock
    from freetoken.models.base import ModelConfig

    cfg = ModelConfig.from_dict(
        dict(
            model_type="qwen3_5_moe_text",
            hidden_size=256,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=64,
        )
    )
    torch.manual_seed(0)
    blk = SparseMoeBlock(cfg)
    with torch.no_grad():
        for p in blk.parameters():
            p.normal_(0, 0.05)
    blk = blk.cuda().to(torch.bfloat16)
    x = torch.randn(50, 256, device="cuda", dtype=torch.bfloat16)
    from freetoken.layers.moe import resolve_moe_impl

    assert resolve_moe_impl(blk.experts.impl, x) == "triton"
    with torch.no_grad():
        out = blk(x)
        blk.experts.impl = "torch"
        ref = blk(x)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
