"""Triton paged attention (extend + split-K decode) vs the torch references, on CUDA (``gpu`` marker) and on CPU under
TRITON_INTERPRET=1 (tiny shapes, run in a subprocess so the interpreter is on before triton compiles anything)."""

import os
import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pool(nkv, D, DV, dtype, device, max_rows, max_ctx, seed):
    g = torch.Generator().manual_seed(seed)
    slots = max_rows * max_ctx + 5
    kc = torch.randn(slots, nkv, D, generator=g).to(device, dtype)
    vc = torch.randn(slots, nkv, DV, generator=g).to(device, dtype)
    perm = torch.randperm(slots, generator=g)[: max_rows * max_ctx].view(max_rows, max_ctx)
    r2t = torch.zeros(max_rows + 1, max_ctx, dtype=torch.int32)
    r2t[:max_rows] = perm.to(torch.int32)
    return kc, vc, r2t.to(device)


def _tol(dtype):
    return {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]


def extend_case(
    nh, nkv, D, DV, ext, pre, dtype, device, seed=0, config=None, num_splits=0, key_ramp=0.0, gated=False
):  # fmt: skip
    """``key_ramp``: keys scaled by ``1 + key_ramp * position / context`` (each row's own positions), so the scores'
    running max keeps growing along the keys: the lazy rescale of ``_extend_tiles`` then fires mid-row.
    ``gated``: also with an output gate (the strided gate half of a ``[T, nh, 2*DV]`` projection), which the key
    splits' merge applies: the same as the ungated output times ``sigmoid(gate)``."""
    from freetoken.kernels.attention import extend_attention_torch, extend_attention_triton

    B = len(ext)
    max_ctx = max(e + p for e, p in zip(ext, pre)) + 3
    kc, vc, r2t = _pool(nkv, D, DV, dtype, device, B + 1, max_ctx, seed)
    if key_ramp:
        ramp = 1.0 + key_ramp * torch.arange(max_ctx, dtype=torch.float32) / max_ctx
        for r in range(B + 1):
            slots = r2t[r].long().cpu()
            kc[slots] = (kc[slots].float().cpu() * ramp[:, None, None]).to(device, dtype)
    rows = torch.randperm(B + 1, generator=torch.Generator().manual_seed(seed))[:B]
    cu = torch.tensor([0] + list(torch.tensor(ext).cumsum(0).tolist()), dtype=torch.int32)
    T = int(cu[-1])
    q = torch.randn(T, nh, D, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    scale = D**-0.5
    ref = extend_attention_torch(q, kc, vc, r2t, rows, cu, torch.tensor(pre), scale)
    out = extend_attention_triton(
        q,
        kc,
        vc,
        r2t,
        rows.to(device),
        cu.to(device),
        torch.tensor(pre, dtype=torch.int32, device=device),
        scale,
        max_extend_len=max(ext),
        config=config,
        num_splits=num_splits,
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=_tol(dtype), rtol=_tol(dtype))
    if gated:
        gate = (3 * torch.randn(T, nh, 2 * DV, generator=torch.Generator().manual_seed(seed + 2)))[..., DV:]
        gate = gate.to(device, dtype)
        gated_out = extend_attention_triton(
            q, kc, vc, r2t, rows.to(device), cu.to(device), torch.tensor(pre, dtype=torch.int32, device=device),
            scale, max_extend_len=max(ext), config=config, num_splits=num_splits, gate=gate,
        )  # fmt: skip
        expected = out * torch.sigmoid(gate)  # the gated layer's own op on the ungated output
        torch.testing.assert_close(gated_out.float(), expected.float(), atol=_tol(dtype), rtol=_tol(dtype))
        torch.testing.assert_close(gated_out.float(), (ref * torch.sigmoid(gate)).float(), atol=2 * _tol(dtype),
                                   rtol=2 * _tol(dtype))  # fmt: skip


def decode_case(nh, nkv, D, DV, ctx, dtype, device, splits, seed=0, gated=False, config=None):
    """``gated``: the output gate of gated attention, given as the strided gate half of a ``[B, nh, 2*DV]``
    projection and applied by the merge kernel; ``config``: stage 1's launch overrides (the benchmark's sweep)."""
    from freetoken.kernels.attention import decode_attention_torch, decode_attention_triton

    B = len(ctx)
    kc, vc, r2t = _pool(nkv, D, DV, dtype, device, B + 1, max(ctx) + 2, seed)
    rows = torch.randperm(B + 1, generator=torch.Generator().manual_seed(seed))[:B]
    q = torch.randn(B, nh, D, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    gate = None
    if gated:
        gate = (3 * torch.randn(B, nh, 2 * DV, generator=torch.Generator().manual_seed(seed + 2)))[..., DV:]
        gate = gate.to(device, dtype)
    scale = D**-0.5
    ref = decode_attention_torch(q, kc, vc, r2t, rows, torch.tensor(ctx), scale, gate=gate)
    out = decode_attention_triton(
        q,
        kc,
        vc,
        r2t,
        rows.to(device),
        torch.tensor(ctx, dtype=torch.int32, device=device),
        scale,
        num_kv_splits=splits,
        gate=gate,
        config=config,
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=_tol(dtype), rtol=_tol(dtype))
    if gated:  # the reference is the gated layer's own two ops
        plain = decode_attention_torch(q, kc, vc, r2t, rows, torch.tensor(ctx), scale)
        assert torch.equal(ref, plain * torch.sigmoid(gate))


def backend_case(device, dtype):
    """TritonAttention vs TorchAttention inside a tiny Qwen3 model: prefill, chunked prefill, mixed batch, decode."""
    from freetoken.cache.kv_pool import KVCachePool
    from freetoken.engine.forward_batch import ForwardBatch
    from freetoken.engine.step_plan import StepPlan
    from freetoken.kernels.attention import TritonAttention
    from freetoken.layers.attention import TorchAttention
    from freetoken.models.base import ModelConfig
    from freetoken.models.qwen3 import Qwen3ForCausalLM

    cfg = ModelConfig.from_dict(
        dict(
            model_type="qwen3",
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=48,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
        )
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model = model.to(device, dtype).eval()
    lay = model.kv_layout
    outs = {}
    for name, attn in (("torch", TorchAttention()), ("triton", TritonAttention())):
        kv = KVCachePool(lay.num_layers, 200, lay.num_kv_heads, lay.head_dim, dtype, torch.device(device), 3, 40)
        perm = torch.randperm(200, generator=torch.Generator().manual_seed(3)).tolist()
        sl = [perm[r * 40 : (r + 1) * 40] for r in range(3)]
        steps = [
            [(0, 0, list(range(1, 10))), (1, 0, [5, 6, 7])],
            [(0, 9, [11, 12, 13]), (1, 3, [8]), (2, 0, list(range(20, 37)))],
            [(0, 12, [2]), (1, 4, [3]), (2, 17, [4])],  # pure decode
            [(0, 13, [9]), (1, 5, [10]), (2, 18, [11])],
        ]
        res = []
        for seqs in steps:
            plan = StepPlan.build(
                [
                    dict(tokens=t, prefix_len=p, row=r, table_from=p, table_slots=sl[r][p : p + len(t)])
                    for r, p, t in seqs
                ]
            )
            batch = ForwardBatch.from_plan(plan, kv, attn, all_logits=True)
            assert batch.is_decode == (seqs is steps[2] or seqs is steps[3])
            with torch.no_grad():
                res.append(model(batch).float())
        outs[name] = res
    for a, b in zip(outs["torch"], outs["triton"]):
        torch.testing.assert_close(b, a, atol=_tol(dtype) * 10, rtol=_tol(dtype) * 10)


def gated_backend_case(device, dtype):
    """Both backends' ``forward`` with an output gate (the strided gate half of gated attention's projection) over
    prefill, a mixed step and decode: the same gated output (Triton decode applies the gate in its merge kernel)."""
    from freetoken.cache.kv_pool import KVCachePool
    from freetoken.engine.forward_batch import ForwardBatch
    from freetoken.engine.step_plan import StepPlan
    from freetoken.kernels.attention import TritonAttention
    from freetoken.layers.attention import TorchAttention

    nh, nkv, D = 4, 2, 16
    steps = [
        [(0, 0, list(range(1, 10))), (1, 0, [5, 6, 7])],
        [(0, 9, [11, 12]), (1, 3, [8])],
        [(0, 11, [2]), (1, 4, [3])],  # pure decode
    ]
    outs = {}
    for name, attn in (("torch", TorchAttention()), ("triton", TritonAttention())):
        kv = KVCachePool(1, 64, nkv, D, dtype, torch.device(device), 2, 32)
        g = torch.Generator().manual_seed(0)
        res = []
        for seqs in steps:
            plan = StepPlan.build(
                [
                    dict(
                        tokens=t, prefix_len=p, row=r, table_from=p, table_slots=[32 * r + p + i for i in range(len(t))]
                    )
                    for r, p, t in seqs
                ]
            )
            batch = ForwardBatch.from_plan(plan, kv, attn, all_logits=True)
            T = sum(len(t) for _, _, t in seqs)
            q, k, v = (torch.randn(T, h, D, generator=g).to(device, dtype) for h in (nh, nkv, nkv))
            gate = (3 * torch.randn(T, nh, 2 * D, generator=g)).to(device, dtype)[..., D:]
            with torch.no_grad():
                res.append(attn.forward(q, k, v, 0, batch, D**-0.5, gate=gate).float())
        assert batch.is_decode
        outs[name] = res
    for a, b in zip(outs["torch"], outs["triton"]):
        torch.testing.assert_close(b, a, atol=_tol(dtype) * 10, rtol=_tol(dtype) * 10)


_CPU_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    sys.path.insert(0, {tests!r})
    import test_triton_attention as t
    for dt in ("float32", "float16"):
        dt = getattr(torch, dt)
        t.extend_case(4, 2, 16, 16, [3, 1, 20], [0, 5, 7], dt, "cpu")
        t.extend_case(2, 2, 24, 8, [17], [33], dt, "cpu", seed=1)  # non-power-of-2 D, DV != D, no GQA
        t.decode_case(4, 1, 16, 16, [1, 9, 40], dt, "cpu", splits=1)
        t.decode_case(6, 2, 16, 32, [1, 9, 40, 3], dt, "cpu", splits=3)  # GQA group 3, empty splits
        t.decode_case(4, 2, 16, 24, [1, 9, 40], dt, "cpu", splits=2, gated=True)  # output gate in the merge
        t.decode_case(4, 2, 16, 16, [1, 9, 40], dt, "cpu", splits=2, config=dict(block_n=16, warps=2, stages=1))
    # the 128 x 64 tiles sm_90 takes for head dims above 128, over chunks shorter and longer than a tile
    t.extend_case(4, 2, 16, 16, [150, 5], [100, 0], torch.float16, "cpu", seed=2, config=(128, 64, 8, 2))
    # the keys split over programs (a short chunk after a long prefix), merged after: splits of whole key tiles,
    # some empty for a short sequence, more splits than tiles, and the small tiles
    t.extend_case(4, 2, 16, 16, [150, 5], [300, 0], torch.float16, "cpu", seed=3, config=(128, 64, 8, 2), num_splits=3)
    t.extend_case(4, 2, 16, 16, [3, 1, 20], [0, 5, 70], torch.float32, "cpu", seed=4, num_splits=5)
    t.extend_case(2, 2, 24, 8, [17], [33], torch.float32, "cpu", seed=5, config=(16, 32, 4, 2), num_splits=2)
    # the output gate: in the split merge, and after the kernel when unsplit
    for splits in (2, 1):
        t.extend_case(4, 2, 16, 16, [17, 3], [40, 0], torch.float16, "cpu", seed=7, config=(16, 32, 4, 2),
                      num_splits=splits, gated=True)
    # the running max grows by more than 2^8 between unmasked tiles (lazy rescale fires mid-row), decided for the
    # block (FREETOKEN_EXTEND_LAZY_RESCALE=1), per row (row, and auto on this split launch), at every growth (0)
    for lazy in ("1", "row", "auto", "0"):
        os.environ["FREETOKEN_EXTEND_LAZY_RESCALE"] = lazy
        t.extend_case(4, 2, 16, 16, [40, 5], [300, 90], torch.float32, "cpu", seed=6, config=(16, 32, 4, 2),
                      num_splits=2, key_ramp=12.0)
    # unsplit key offsets in int64, as for pools past 2^31 elements (split launches always take int64)
    os.environ["FREETOKEN_EXTEND_SLOT_INT32"] = "0"
    t.extend_case(4, 2, 16, 16, [40, 5], [300, 90], torch.float32, "cpu", seed=8, config=(16, 32, 4, 2), num_splits=1)
    del os.environ["FREETOKEN_EXTEND_SLOT_INT32"]
    # unsplit, keys on a ramp that changes sign (the scores shrink along the keys, then grow with the other sign), lazily
    # (for the block, per row, auto: for the block unsplit) and with every growth rescaled
    for lazy in ("1", "row", "auto", "0"):
        os.environ["FREETOKEN_EXTEND_LAZY_RESCALE"] = lazy
        t.extend_case(4, 2, 16, 16, [40, 5], [300, 90], torch.float32, "cpu", seed=13, config=(16, 32, 4, 2),
                      num_splits=1, key_ramp=-12.0)
    t.backend_case("cpu", torch.float32)
    t.gated_backend_case("cpu", torch.float32)
    print("OK")
    """
)


def test_triton_attention_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=800)


def test_int32_key_offsets_only_where_every_offset_fits(monkeypatch):
    from freetoken.kernels.attention import int32_key_offsets

    small = torch.empty(1000, 2, 256, device="meta")
    big = torch.empty(2**22, 2, 256, device="meta")  # 2^31 elements: the last offset does not fit
    assert int32_key_offsets(small, small)
    assert not int32_key_offsets(small, big) and not int32_key_offsets(big, small)
    monkeypatch.setenv("FREETOKEN_EXTEND_SLOT_INT32", "0")
    assert not int32_key_offsets(small, small)


def test_pick_extend_splits():
    """Splits fill the waves of a short chunk after a long prefix and leave full grids (long fresh prefills) alone."""
    from freetoken.kernels.attention import pick_extend_splits

    assert pick_extend_splits(288, 30000, 132) == 3  # Qwen3.6's agent turn: 18 blocks x 16 heads, 30k keys
    assert pick_extend_splits(1024, 8192, 132) == 1  # a fresh 8k chunk: 64 x 16, 97 % full already
    assert pick_extend_splits(16, 3000, 132) == 1  # short context: splits under 2,048 keys do not pay
    assert pick_extend_splits(16, 100000, 132) == 8  # few programs, long context: up to 8 splits


def test_registered_as_triton_backend():
    import freetoken.kernels.attention  # noqa: F401
    from freetoken.layers import attention as A

    assert A._BACKENDS["triton"].__name__ == "TritonAttention"
    assert A.make_attention_backend("auto", torch.device("cpu")).name == "torch"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "nh,nkv,D,DV,ext,pre",
    [
        (16, 2, 256, 256, [1, 37, 300], [0, 100, 513]),  # Qwen3.6 attention shape
        (32, 4, 128, 128, [512, 3, 1], [0, 1000, 64]),  # Qwen3-30B-A3B
        (8, 8, 64, 64, [129, 64], [0, 0]),  # MHA, plain prefill
        (12, 4, 96, 80, [33, 70], [17, 0]),  # odd head dims, DV != D
    ],
)
def test_extend_cuda(nh, nkv, D, DV, ext, pre, dtype):
    extend_case(nh, nkv, D, DV, ext, pre, dtype, "cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [0, 2, 3, 8])
def test_extend_split_cuda(num_splits, dtype):
    """Qwen3.6's shape, a chunk after a long prefix, with the keys split over programs (0: the launcher's pick)."""
    extend_case(16, 2, 256, 256, [300, 1, 129], [5000, 64, 2100], dtype, "cuda", num_splits=num_splits, gated=True)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", ["1", "row", "0"])
def test_extend_rescale_modes_cuda(mode, monkeypatch):
    """Qwen3.6's shape on its 128 x 64 tiles with the running max rescaled lazily for the block, per row without a
    branch, and at every growth (``FREETOKEN_EXTEND_LAZY_RESCALE``; the default ``auto`` is per row on split launches,
    for the block unsplit), keys on a ramp so that rows' maxima grow mid-row."""
    monkeypatch.setenv("FREETOKEN_EXTEND_LAZY_RESCALE", mode)
    for splits in (1, 3):
        extend_case(16, 2, 256, 256, [300, 129], [2100, 0], torch.bfloat16, "cuda", num_splits=splits, key_ramp=12.0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 16, 64])
@pytest.mark.parametrize(
    "nh,nkv,D,DV,ctx",
    [
        (16, 2, 256, 256, [1, 17, 2049, 300]),
        (32, 4, 128, 128, [5000, 1, 64]),
        (8, 8, 64, 64, [100, 7]),
        (12, 4, 96, 80, [33, 70, 2]),
    ],
)
def test_decode_cuda(nh, nkv, D, DV, ctx, splits, dtype):
    decode_case(nh, nkv, D, DV, ctx, dtype, "cuda", splits)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 16])
@pytest.mark.parametrize("nh,nkv,D,DV,ctx", [(16, 2, 256, 256, [1, 17, 2049, 300]), (12, 4, 96, 80, [33, 70, 2])])
def test_decode_gated_cuda(nh, nkv, D, DV, ctx, splits, dtype):
    decode_case(nh, nkv, D, DV, ctx, dtype, "cuda", splits, gated=True)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_in_model_cuda(dtype):
    backend_case("cuda", dtype)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_backends_cuda(dtype):
    gated_backend_case("cuda", dtype)


@pytest.mark.gpu
@cuda
def test_make_attention_backend_auto_cuda():
    from freetoken.layers.attention import make_attention_backend

    assert make_attention_backend("auto", torch.device("cuda")).name == "triton"


def test_row_rescale_follows_the_mode_and_the_splits():
    """``auto`` decides per row exactly where a launch splits its keys; the explicit modes ignore the splits."""
    from freetoken.kernels.attention import row_rescale

    assert [row_rescale("auto", s) for s in (1, 2, 3)] == [False, True, True]
    assert all(row_rescale("row", s) for s in (1, 3)) and not any(row_rescale(m, 3) for m in ("1", "0"))
