"""The mixed BF16 / FP8 / NVFP4 decode GEMV (``kernels/mixed_gemv.py``) vs its torch reference, and the fused
projections that take it (``layers/mixed_projection.py``, ``PartwiseLinear``): on CPU the layer wiring and the
kernel under TRITON_INTERPRET=1 (a subprocess), on CUDA (``gpu`` marker) Qwen3.6's NVFP4-checkpoint projections at
M = 1..4, the layers' dispatch and CUDA-graph capture.

Error measure: max |out - ref| / (1 + |ref|). The kernel multiplies exact decoded weights by x and scales the fp32
sums once per row; the reference rounds each weight to x's dtype first (about 2^-9 in bf16).
"""

import textwrap

import pytest
import torch
import torch.nn.functional as F
from nvfp4_cases import error, random_weight
from triton_interpreter import run_under_interpreter

from freetoken.quant import fp8

_TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _dense(n, k, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False, dtype=dtype, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    return lin


def _fp8(n, k, seed, dtype, device):
    from freetoken.layers.quantized_linear import Fp8Linear

    g = torch.Generator().manual_seed(seed)
    lin = Fp8Linear(k, n, dtype=dtype, device=device)
    w, s = fp8.quantize(torch.randn(n, k, generator=g) / k**0.5)
    with torch.no_grad():
        lin.weight.copy_(w), lin.weight_scale.copy_(s * (1 + seed))  # parts with different scales
        lin.input_scale.fill_(4.0 / fp8.E4M3_MAX)
    return lin


def _nvfp4(n, k, seed, dtype, device):
    from freetoken.layers.quantized_linear import Nvfp4Linear

    lin = Nvfp4Linear(k, n, dtype=dtype, device=device)
    w, s, s2 = random_weight(n, k, seed, plain_scales=True)
    with torch.no_grad():
        lin.weight.copy_(w), lin.weight_scale.copy_(s), lin.weight_scale_2.copy_(s2 * (1 + seed))
    return lin


_MAKERS = {"d": _dense, "f": _fp8, "n": _nvfp4}


def make_parts(spec, k, dtype=torch.float32, device="cpu"):
    """``spec``: ``[(format letter, rows), ...]`` in output order."""
    return [_MAKERS[f](n, k, i, dtype, device) for i, (f, n) in enumerate(spec)]


def check_projection(spec, k, M, dtype, device, mode="auto"):
    """``fuse_linears`` over ``spec``'s parts: the one-launch kernel's output (the GEMV, or ``mixed_dot``) vs the
    parts run one by one (each its own reference on CPU, its kernel on CUDA), and vs the kernel's torch reference."""
    from freetoken.kernels.mixed_dot import mixed_kernel
    from freetoken.kernels.mixed_gemv import mixed_gemv_torch
    from freetoken.layers.fused_linear import fuse_linears

    parts = make_parts(spec, k, dtype, device)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, k, generator=g).to(device, dtype)
    alone = torch.cat([p(x) for p in parts], dim=-1)  # before fusing: the parts' own storage
    fused = fuse_linears(*parts)
    assert fused.mixed is not None, spec
    fused.mixed_mode = mode
    out = fused(x)
    assert out.shape == alone.shape and out.dtype == x.dtype
    if mixed_kernel(x, fused.mixed, mode) is None:  # e.g. fp32 x with FP8 rows at three or four rows of x: the parts
        assert M > 2 and torch.equal(out, fused.forward_parts(x))
        return 0.0
    err = error(out, mixed_gemv_torch(x, fused.mixed))
    if device == "cpu":  # the parts' references (on CUDA an FP8 part alone may run W8A8)
        err = max(err, error(out, alone))
        # the parts now read views of the fused blocks and still give their own outputs
        assert torch.equal(torch.cat([p(x) for p in parts], dim=-1), fused.forward_parts(x))
    assert err <= _TOL[dtype], (spec, M, dtype, err)
    return err


# ----------------------------------------------------------------------------------------------------------------------
# CPU, no interpreter
# ----------------------------------------------------------------------------------------------------------------------


def test_parts_become_views_of_the_blocks():
    from freetoken.layers.fused_linear import fuse_linears

    parts = make_parts([("d", 8), ("d", 1), ("n", 32), ("n", 32)], 64)
    names = [sorted(n for n, _ in p.named_parameters()) for p in parts]
    before = [{n: t.clone() for n, t in p.state_dict().items()} for p in parts]
    fused = fuse_linears(*parts)
    rows = fused.mixed
    assert (rows.dense_col, rows.nvfp4_col, rows.out_features) == (0, 9, 73)
    assert rows.rows == (9, 0, 64)
    assert parts[3].weight.data_ptr() == rows.nvfp4_weight[32:].data_ptr()
    assert parts[1].weight.data_ptr() == rows.dense[8:].data_ptr()
    for p, n, b in zip(parts, names, before):
        assert sorted(x for x, _ in p.named_parameters()) == n
        assert all(torch.equal(p.state_dict()[k], v) for k, v in b.items())
    # each part's global scale, one per output row
    assert torch.equal(rows.nvfp4_global, torch.cat([p.weight_scale_2.reshape(1).expand(32) for p in parts[2:]]))
    assert "mixed_nvfp4_weight" in dict(fused.named_buffers())
    assert not any(n.startswith("mixed_") for n in fused.state_dict())


def test_where_the_kernel_does_not_apply():
    from freetoken.layers.fused_linear import fuse_linears
    from freetoken.layers.mixed_projection import mixed_rows, use_mixed_gemv

    assert mixed_rows(make_parts([("f", 8), ("d", 8), ("f", 8)], 64)) is None  # fp8 columns split by dense ones
    assert mixed_rows(make_parts([("d", 8), ("f", 8)], 40)) is None  # K off the 16 grid
    biased = make_parts([("d", 8), ("f", 8)], 64)
    biased[0] = torch.nn.Linear(64, 8, bias=True)
    assert mixed_rows(biased) is None
    pinned = make_parts([("d", 8), ("n", 8)], 64)
    pinned[1].impl = "torch"
    assert mixed_rows(pinned) is None
    rows = mixed_rows(make_parts([("d", 8), ("n", 16)], 64))
    x = torch.randn(4, 64)
    assert not use_mixed_gemv(x, rows)  # CPU: auto keeps the per-part references
    assert use_mixed_gemv(x, rows, "on") and not use_mixed_gemv(torch.randn(5, 64), rows, "on")
    for spec in ([("f", 8), ("f", 8)], [("f", 8), ("d", 8)]):  # with FP8 rows: W8A8 GEMMs from three rows
        fp8_rows = mixed_rows(make_parts(spec, 64))
        assert use_mixed_gemv(x[:2], fp8_rows, "on") and not use_mixed_gemv(x[:3], fp8_rows, "on")
    assert not use_mixed_gemv(x, None, "on") and not use_mixed_gemv(x, rows, "off")
    with pytest.raises(ValueError, match="unknown mixed GEMV mode"):
        use_mixed_gemv(x, rows, "bogus")
    # on CPU a fused projection gives exactly its parts' outputs (the references)
    parts = make_parts([("d", 8), ("n", 16), ("n", 16)], 64)
    fused = fuse_linears(*parts)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the kernel under the interpreter
# ----------------------------------------------------------------------------------------------------------------------


def every_e4m3_code_rows(device):
    """FP8 rows holding every finite E4M3 code at every column: row n holds code ``(n + k) % 256`` at column k (the
    two NaN codes zeroed), scale 1."""
    from freetoken.kernels.mixed_gemv import MixedRows

    K = N = 256
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # 0x7F / 0xFF are NaN in E4M3FN
    w = torch.stack([codes.roll(-n) for n in range(N)]).to(torch.uint8).view(torch.float8_e4m3fn)
    return MixedRows(K=K, fp8_weight=w.to(device), fp8_scale=torch.ones(N, device=device))


def check_every_e4m3_code(device):
    """The FP8 rows' word decoding (``e4m3_word``: four bytes a word, two weights per 32-bit operation) on every
    finite E4M3 code, signs and subnormals included, at each of the four byte positions of a word: row n of the
    weight holds code ``(n + k) % 256`` at column k (the two NaN codes zeroed), and x's rows pick single columns, so
    each output is one decoded weight, exact, equal to torch's E4M3 conversion bit for bit."""
    from freetoken.kernels.mixed_gemv import mixed_gemv_torch, mixed_gemv_triton

    rows = every_e4m3_code_rows(device)
    K = rows.K
    for cols in ((0, 1), (2, 3), (254, 255)):  # every byte position of a word, and the last word
        x = torch.zeros(2, K, device=device)
        x[0, cols[0]] = x[1, cols[1]] = 1.0
        out, ref = mixed_gemv_triton(x, rows), mixed_gemv_torch(x, rows)
        assert torch.equal(out, ref), (cols, (out - ref).abs().max())
    return 0.0


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_mixed_gemv as t
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    worst = {{}}
    cases = [
        ([("d", 40), ("n", 8)], 256, 1, f32),
        ([("n", 24), ("n", 8)], 160, 3, f32),  # one format alone
        ([("f", 24)], 96, 2, f32),  # K not a multiple of the step
        ([("f", 17), ("f", 9), ("d", 3), ("d", 1)], 512, 2, f32),  # GDN: qkv | z (fp8), b | a (dense)
        ([("d", 5), ("n", 16)], 96, 4, f32),  # four rows of x (no FP8 rows)
        ([("d", 9), ("d", 1), ("n", 32), ("n", 32)], 2048, 1, bf16),  # MoE: router | shared gate, gate | up
        ([("n", 7), ("f", 6), ("d", 5)], 64, 2, f16),  # any order of the blocks
    ]
    for spec, k, M, dt in cases:
        key = str(dt).split(".")[-1]
        worst[key] = max(worst.get(key, 0.0), t.check_projection(spec, k, M, dt, "cpu", mode="on"))
    worst["e4m3 codes exact"] = t.check_every_e4m3_code("cpu")
    for dt, err in sorted(worst.items()):
        print(f"mixed_gemv {{dt:9s}} max |out - ref| / (1 + |ref|) = {{err:.3g}}")
    print("OK")
    """
)


def test_mixed_gemv_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=900)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA: the projections of nvidia/Qwen3.6-35B-A3B-NVFP4 (hidden 2048)
# ----------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QWEN36 = {
    "moe_router_shared": ([("d", 256), ("d", 1), ("n", 512), ("n", 512)], 2048),
    "gdn_in_proj": ([("f", 8192), ("f", 4096), ("d", 32), ("d", 32)], 2048),
    "attn_qkv": ([("f", 8192), ("f", 512), ("f", 512)], 2048),
}


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(QWEN36))
def test_mixed_projection_cuda(name, M):
    spec, k = QWEN36[name]
    check_projection(spec, k, M, torch.bfloat16, "cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [1, 2, 3, 16])
def test_fp8_linear_decode_gemv_cuda(M):
    """A lone FP8 Linear (o_proj, GDN out_proj): up to 2 rows the W8A16 GEMV (near the dequantized reference), above
    the W8A8 GEMM (``mixed_dot`` is the fused projections', not a lone Linear's)."""
    from freetoken.kernels.fp8_linear import fp8_linear, fp8_linear_torch

    lin = _fp8(2048, 4096, 1, torch.bfloat16, "cuda")
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    if M <= 2:
        assert error(lin(x), fp8_linear_torch(x, lin.weight, lin.weight_scale)) <= 3e-2
    else:
        assert torch.equal(lin(x), fp8_linear(x, lin.weight, lin.weight_scale, lin.input_scale))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [1, 4, 5, 16])
def test_nvfp4_linear_few_rows_decode_gemv_cuda(M):
    """A lone NVFP4 Linear with few rows (the shared expert's down projection): up to 4 rows the mixed GEMV (one
    launch, near the reference), above the W4A16 kernels of ``nvfp4_linear``."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_torch, nvfp4_linear_triton

    lin = _nvfp4(2048, 512, 1, torch.bfloat16, "cuda")
    x = torch.randn(M, 512, device="cuda", dtype=torch.bfloat16)
    args = (lin.weight, lin.weight_scale, lin.weight_scale_2)
    if M <= 4:
        assert error(lin(x), nvfp4_linear_torch(x, *args)) <= 3e-2
    else:
        assert torch.equal(lin(x), nvfp4_linear_triton(x, *args))


@pytest.mark.gpu
@cuda
def test_mixed_projection_cuda_dispatch_and_graph():
    """M <= 32 runs one launch (no per-part kernel), M = 33 the parts; a captured graph replays new inputs."""
    from freetoken.kernels.mixed_gemv import mixed_gemv_torch
    from freetoken.layers.fused_linear import fuse_linears

    spec, k = QWEN36["moe_router_shared"]
    parts = make_parts(spec, k, torch.bfloat16, "cuda")
    fused = fuse_linears(*parts)
    ran = []
    for p in parts:
        p.register_forward_hook(lambda *a: ran.append(1))
    x = torch.randn(2, k, device="cuda", dtype=torch.bfloat16)
    fused(x)
    assert ran == []
    fused(torch.randn(32, k, device="cuda", dtype=torch.bfloat16))
    assert ran == []
    fused(torch.randn(33, k, device="cuda", dtype=torch.bfloat16))
    assert len(ran) == len(parts)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused(x)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = fused(x)
    for seed in (1, 2):
        x.copy_(torch.randn(2, k, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert error(out, mixed_gemv_torch(x, fused.mixed)) <= _TOL[torch.bfloat16]


def test_reference_is_the_parts_references():
    """``mixed_gemv_torch`` equals each part's own reference, block by block (CPU, fp32)."""
    from freetoken.kernels.mixed_gemv import mixed_gemv_torch
    from freetoken.layers.fused_linear import fuse_linears

    parts = make_parts([("f", 8), ("f", 4), ("d", 2), ("n", 16)], 64)
    x = torch.randn(3, 64)
    alone = [p(x) for p in parts]
    fused = fuse_linears(*parts)
    ref = mixed_gemv_torch(x, fused.mixed)
    got = torch.split(ref, [8, 4, 2, 16], dim=-1)
    for a, b in zip(alone, got):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], F.linear(x, parts[2].weight))


@pytest.mark.gpu
@cuda
def test_every_e4m3_code_cuda():
    check_every_e4m3_code("cuda")
