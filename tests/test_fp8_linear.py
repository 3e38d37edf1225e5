"""FP8 per-tensor linears (``kernels/fp8_linear.py``): W8A8 through tensor-wise ``torch._scaled_mm``, and the dispatch
that picks it. CPU: ``Fp8Linear`` and fused FP8 projections run the torch reference (``_scaled_mm`` is never called),
input-scale groups, the ``fp8_dynamic`` scheme. CUDA (``gpu`` marker): the Triton input quantization equals torch's
bit for bit; the GEMM equals the W8A8 product computed in fp32 over a sweep of M 1..8192 at the Qwen3.6-35B-A3B FP8
projection shapes; fused projections run one tensor-wise GEMM per part (never a scale vector), also from a side
stream; CUDA-graph capture.
"""

import pytest
import torch
import torch.nn.functional as F

from freetoken.kernels.mixed_gemv import FP8_MAX_M
from freetoken.quant import fp8


def _fp8_linear(n, k, seed=0, dynamic=False, bias=False, device="cpu", dtype=torch.bfloat16, input_scale=None):
    from freetoken.layers.quantized_linear import Fp8Linear

    g = torch.Generator().manual_seed(seed)
    lin = Fp8Linear(k, n, bias=bias, dtype=dtype, device=device, dynamic_input=dynamic)
    w, s = fp8.quantize(torch.randn(n, k, generator=g) / k**0.5)
    with torch.no_grad():
        lin.weight.copy_(w), lin.weight_scale.copy_(s)
        if not dynamic:
            lin.input_scale.fill_(input_scale if input_scale is not None else 4.0 / fp8.E4M3_MAX)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def _no_scaled_mm(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("torch._scaled_mm ran")

    monkeypatch.setattr(torch, "_scaled_mm", boom)


# ----------------------------------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dynamic", [False, True])
def test_cpu_dispatch_picks_the_reference(monkeypatch, dynamic):
    _no_scaled_mm(monkeypatch)
    lin = _fp8_linear(48, 64, dynamic=dynamic, bias=True, dtype=torch.float32)
    x = torch.randn(5, 64)
    assert torch.equal(lin(x), F.linear(x, lin.dequantized_weight(torch.float32), lin.bias))


def test_fused_fp8_projection_on_cpu_runs_part_by_part(monkeypatch):
    from freetoken.layers.fused_linear import Fp8PartwiseLinear, PartwiseLinear, fuse_linears

    _no_scaled_mm(monkeypatch)
    parts = [_fp8_linear(32, 64, 0, dtype=torch.float32), _fp8_linear(16, 64, 1, dtype=torch.float32)]
    fused = fuse_linears(*parts)
    assert isinstance(fused, Fp8PartwiseLinear) and isinstance(fused, PartwiseLinear)
    x = torch.randn(3, 64)
    a, b = fused.split(fused(x))
    assert torch.equal(a, parts[0](x)) and torch.equal(b, parts[1](x))


def test_input_scale_groups():
    """Parts quantize x once per distinct input scale; dynamic parts share one quantization."""
    from freetoken.layers.fused_linear import _input_scale_groups

    q, k, v = (_fp8_linear(16, 32, i, input_scale=1.0) for i in range(3))
    assert _input_scale_groups([q, k, v]) == [0, 0, 0]
    k.input_scale.fill_(2.0)
    assert _input_scale_groups([q, k, v]) == [0, 1, 0]
    d1, d2 = _fp8_linear(16, 32, dynamic=True), _fp8_linear(16, 32, 1, dynamic=True)
    assert _input_scale_groups([d1, q, d2]) == [0, 1, 0]


def test_fp8_dynamic_scheme():
    """A compressed-tensors FP8 group with dynamic (or no) activation quantization: ``fp8_dynamic``, an
    ``Fp8Linear`` without ``input_scale``."""
    from freetoken.layers.quantized_linear import make_quantized_linear
    from freetoken.quant.config import FP8, FP8_DYNAMIC, _group_scheme

    w8 = {"num_bits": 8, "type": "float", "strategy": "tensor"}
    assert _group_scheme({"weights": w8, "input_activations": {"num_bits": 8, "dynamic": False}}, "g") == FP8
    assert _group_scheme({"weights": w8, "input_activations": {"num_bits": 8, "dynamic": True}}, "g") == FP8_DYNAMIC
    assert _group_scheme({"weights": w8}, "g") == FP8_DYNAMIC
    lin = make_quantized_linear(FP8_DYNAMIC, 32, 16, False, torch.float32, "cpu")
    assert lin.dynamic_input and lin.input_scale is None and "input_scale" not in dict(lin.named_parameters())


def test_quantize_reference_saturates():
    from freetoken.kernels.fp8_linear import dynamic_scale, fp8_quantize_torch

    x = torch.tensor([[0.0, 1.0, -3000.0, 5.0]])
    q, s = fp8_quantize_torch(x, torch.tensor(1.0))
    assert q.float().tolist() == [[0.0, 1.0, -448.0, 5.0]] and float(s) == 1.0
    q, s = fp8_quantize_torch(x)
    assert float(s) == float(dynamic_scale(x)) == float(torch.tensor(3000.0) / fp8.E4M3_MAX)
    assert float(q.float().abs().max()) == 448.0
    assert float(dynamic_scale(torch.zeros(2, 3))) == float(torch.tensor(1e-12))


# ----------------------------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------------------------

fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
)
# Qwen3.6-35B-A3B's FP8 projections: GDN in_proj_qkv (8192 x 2048), in_proj_z (4096 x 2048), out_proj (2048 x 4096),
# attention q (gated: 8192 x 2048), k / v (512 x 2048), o (2048 x 4096)
SHAPES = [(8192, 2048), (512, 2048), (2048, 4096)]


def _w8a8_reference(x, lin):
    """The W8A8 product in fp32: x quantized exactly as the kernel does (torch), both dequantized, one matmul."""
    from freetoken.kernels.fp8_linear import fp8_quantize_torch

    xq, s = fp8_quantize_torch(x.reshape(-1, x.shape[-1]), lin.input_scale)
    y = (xq.float() * s) @ (lin.weight.float() * lin.weight_scale).t()
    if lin.bias is not None:
        y = y + lin.bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def _err(out, ref):
    return float(((out.float() - ref.float()).abs() / (1 + ref.float().abs())).max())


@pytest.mark.gpu
@fp8_gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_quantize_equals_torch_cuda(dynamic):
    from freetoken.kernels.fp8_linear import fp8_quantize, fp8_quantize_torch

    x = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16) * 3
    x[0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-30])  # saturation, zero, underflow
    scale = None if dynamic else torch.tensor(0.01, device="cuda")
    (q, s), (rq, rs) = fp8_quantize(x, scale), fp8_quantize_torch(x, scale)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.gpu
@fp8_gpu
@pytest.mark.parametrize("M", [1, 2, 16, 17, 256, 8192])
@pytest.mark.parametrize("N,K", SHAPES)
def test_fp8_linear_cuda_sweep(M, N, K):
    lin = _fp8_linear(N, K, seed=M, dynamic=M % 2 == 1, bias=N == 512, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    out = lin(x)
    w8a16 = lin.bias is None and M <= FP8_MAX_M  # decode sizes: the mixed GEMV (W8A16, kernels/mixed_gemv.py)
    if not w8a16:
        assert _err(out, _w8a8_reference(x, lin)) <= 2e-2
    # against W8A16 the W8A8 GEMM differs by the activation quantization error
    assert _err(out, F.linear(x, lin.dequantized_weight(x.dtype), lin.bias)) <= (3e-2 if w8a16 else 0.25)


@pytest.mark.gpu
@fp8_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_linear_cuda_dtypes(dtype):
    lin = _fp8_linear(512, 2048, bias=True, device="cuda", dtype=dtype)
    x = torch.randn(2, 7, 2048, device="cuda", dtype=dtype)  # 3-D input
    assert _err(lin(x), _w8a8_reference(x, lin)) <= 2e-2


@pytest.mark.gpu
@fp8_gpu
def test_fused_projection_one_tensorwise_gemm_per_part_cuda(monkeypatch):
    """q|k|v with two distinct input scales and a dynamic part: three ``_scaled_mm`` calls, every scale a scalar,
    the result equal to each part on its own; from a side stream too (the sm_89 row-wise bug's setting)."""
    from freetoken.layers.fused_linear import fuse_linears

    parts = [_fp8_linear(8192, 2048, 0, device="cuda"), _fp8_linear(512, 2048, 1, device="cuda", input_scale=0.02)]
    parts.append(_fp8_linear(512, 2048, 2, device="cuda", dynamic=True))
    fused = fuse_linears(*parts)
    calls = []
    real = torch._scaled_mm

    def spy(a, b, scale_a, scale_b, **kw):
        calls.append((scale_a.numel(), scale_b.numel()))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    y = fused(x)
    assert calls == [(1, 1)] * 3
    assert all(torch.equal(a, p(x)) for a, p in zip(fused.split(y), parts))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y2 = fused(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(y, y2)


@pytest.mark.gpu
@fp8_gpu
@pytest.mark.parametrize("dynamic", [False, True])
def test_fp8_linear_cuda_graph(dynamic):
    lin = _fp8_linear(2048, 4096, dynamic=dynamic, device="cuda")
    x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        lin(x)  # compile and warm cuBLASLt outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lin(x)
    for seed in (1, 2):
        x.copy_(torch.randn(4, 4096, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert torch.equal(out, lin(x))
