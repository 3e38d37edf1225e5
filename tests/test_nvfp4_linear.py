"""W4A16 NVFP4 linear (``kernels/nvfp4_linear.py``) vs its torch reference, and ``Nvfp4Linear``'s dispatch: on CPU
(the reference dispatch; the Triton paths under TRITON_INTERPRET=1, in a subprocess so the interpreter is on before
triton compiles anything) and on CUDA (``gpu`` marker: a sweep of M 1..8192 over the Qwen3.6-35B-A3B shapes and odd
ones, both paths at small M, CUDA-graph capture).

Error measure: max |out - ref| / (1 + |ref|). The kernels compute ``e2m1 * scale`` exactly and apply the global
scale to the fp32 sum; the reference rounds every weight to x's dtype after the global scale, so bf16 differs by
about 2^-9 per weight; fp32 only by the order of the sums. The interpreter converts fp32 to bf16 by truncating
(the GPU rounds to nearest) and its ``tl.dot`` is wrong in bf16, so the tensor-core path runs fp32 / fp16 there.
"""

import os
import textwrap

import pytest
import torch
import torch.nn.functional as F
from nvfp4_cases import error, random_weight
from triton_interpreter import run_under_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TOL = {  # (cpu interpreter, cuda)
    torch.float32: (1e-5, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (6e-2, 3e-2),
}


def check_linear(M, N, K, dtype, device, bias=False, strided=False, path="auto", seed=0, lead=(), tune=None):
    """``nvfp4_linear_triton`` (``path``: auto | gemv | dot) vs ``nvfp4_linear_torch`` for ``x [*lead, M, K]``."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_torch, nvfp4_linear_triton

    w, s, s2 = random_weight(N, K, seed, device=device)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, M, K + 8 if strided else K, generator=g)[..., :K].to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    out = nvfp4_linear_triton(x, w, s, s2, b, path=path, tune=tune)
    ref = nvfp4_linear_torch(x, w, s, s2, b)
    err = error(out, ref)
    assert err <= _TOL[dtype][device == "cuda"], (M, N, K, dtype, path, err)
    return err


# ----------------------------------------------------------------------------------------------------------------------
# CPU, no interpreter
# ----------------------------------------------------------------------------------------------------------------------


def test_layer_runs_the_reference_on_cpu(monkeypatch):
    """``impl`` auto on a CPU tensor: the reference, bit for bit (no Triton launch)."""
    import freetoken.layers.quantized_linear as ql

    def boom(*a, **k):
        raise AssertionError("the Triton path ran on CPU")

    monkeypatch.setattr(ql, "nvfp4_linear_triton", boom)
    lin = ql.Nvfp4Linear(64, 40, bias=True, dtype=torch.float32)
    w, s, s2 = random_weight(40, 64)
    with torch.no_grad():
        lin.weight.copy_(w), lin.weight_scale.copy_(s), lin.weight_scale_2.copy_(s2), lin.bias.normal_()
    x = torch.randn(3, 64)
    assert torch.equal(lin(x), F.linear(x, lin.dequantized_weight(torch.float32), lin.bias))
    lin.impl = "bogus"
    with pytest.raises(ValueError, match="unknown implementation"):
        lin(x)


def test_configs():
    """Block sizes from the shapes: K split when there are too few rows; every tile sized as documented."""
    from freetoken.kernels import nvfp4_linear as nl

    bm, bn, bw, split = nl._gemv_config(1, 512, 2048)  # the shared expert's gate: 512 rows
    assert bm == 1 and split > 1 and 512 // bn * split >= nl._TARGET_PROGRAMS // 4
    assert nl._gemv_config(1, 248320, 2048)[3] == 1  # lm_head: rows enough
    assert nl._dot_config(16, 2048, 512)[0] == 16 and nl._dot_config(8192, 2048, 512)[:2] == (128, 128)
    # the fp16 tiles at decode sizes: 64 weight rows, K steps of 256 (of K when it is shorter), 2 warps
    assert nl._dot_config(16, 248320, 2048, half=True) == (16, 64, 256, 2)
    assert nl._dot_config(4, 64, 96, half=True)[2] == 128
    # the path: the GEMV for one or two rows; up to 8 only where tensor-core programs would not fill the SMs
    assert [nl.pick_path(m, 248320) for m in (1, 2, 3, 8)] == ["gemv", "gemv", "dot", "dot"]
    assert [nl.pick_path(m, 512) for m in (1, 4, 8, 9, 16)] == ["gemv", "gemv", "gemv", "dot", "dot"]
    # for 16-bit x and weights large enough to pay for x's extra launch (lm_head): the packed-half GEMV, then the
    # fp16 tensor-core tiles, then the plain paths
    top = nl.HALF_DOT_AUTO_MAX_M
    half = [nl.pick_path(m, 248320, 2048, torch.bfloat16) for m in range(1, top + 2)]
    assert half == ["half"] * nl.HALF_AUTO_MAX_M + ["half_dot"] * (top - nl.HALF_AUTO_MAX_M) + ["dot"]
    assert nl.pick_path(1, 248320, 2048, torch.float32) == "gemv"  # fp32 x: the fp32 GEMV's exact sums
    assert nl.pick_path(1, 512, 2048, torch.float16) == "gemv"  # a small weight: not worth the packing launch


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the Triton paths under the interpreter
# ----------------------------------------------------------------------------------------------------------------------

_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_nvfp4_linear as t
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    worst = {{}}
    cases = [
        # GEMV: one and two rows, bias, K not a multiple of the step (masked), odd N, strided and 3-D x
        (1, 24, 96, f32, dict(bias=True)),
        (2, 40, 4096, f32, {{}}),  # 40 rows: K split (two partial sums, the fixed-order reduce)
        (1, 8, 64, f16, {{}}),
        (2, 13, 48, bf16, dict(strided=True)),
        (1, 16, 256, bf16, dict(bias=True, lead=(2,))),  # x [2, 1, K]: M = 2 rows
        # the GEMV up to 8 rows for a weight with few rows (auto)
        (6, 24, 96, f32, dict(bias=True)),
        # tensor cores: small-M tiles, the large-M tiles, odd N, masked M and K tails
        (3, 24, 96, f32, dict(bias=True, path="dot")),
        (16, 40, 160, f16, dict(strided=True)),
        (33, 24, 64, f32, {{}}),
        (70, 130, 96, f32, dict(bias=True)),
        (70, 24, 48, f16, {{}}),
        # both paths at small M
        (2, 24, 64, f32, dict(path="dot")),
        (4, 24, 64, f16, dict(path="gemv")),
        # launch settings a benchmark sweep overrides (bench/nvfp4_kernel_bench.py --groups sweep)
        (2, 40, 1024, f32, dict(path="gemv", tune=dict(tile=8192, warps=8, stages=4))),
        (5, 40, 256, f16, dict(path="dot", tune=dict(block_n=64, block_k=64, warps=8, stages=2))),
        # the packed-half GEMV: bias, K split, odd N and masked tails with strided x, 3-D x of 4 rows, its settings
        (1, 24, 96, bf16, dict(path="half", bias=True)),
        (2, 40, 4096, f16, dict(path="half")),
        (3, 13, 48, bf16, dict(path="half", strided=True)),
        (2, 16, 256, f16, dict(path="half", lead=(2,))),
        (1, 40, 1024, bf16, dict(path="half", tune=dict(tile=4096, words=16, warps=8, stages=2))),
        # tensor cores on fp16 tiles: unmasked (N, K multiples of the tile), masked N / K tails with bias and strided
        # x, 3-D x, the wide-M tiles, its settings
        (3, 64, 256, bf16, dict(path="half_dot")),
        (6, 64, 768, bf16, dict(path="half_dot")),  # three K steps of the 256-wide default
        (5, 40, 160, f16, dict(path="half_dot", bias=True, strided=True)),
        (4, 32, 128, bf16, dict(path="half_dot", lead=(2,))),
        (70, 24, 64, bf16, dict(path="half_dot")),
        (2, 64, 256, f16, dict(path="half_dot", tune=dict(block_n=64, block_k=64, warps=4, stages=2))),
        # programs walking several N tiles: unmasked (2 programs of 2 tiles, 2 K steps each), masked tails
        (3, 256, 512, bf16, dict(path="half_dot", tune=dict(walk=2))),
        (5, 200, 160, f16, dict(path="half_dot", bias=True, tune=dict(walk=3))),
        (4, 72, 96, f32, dict(path="dot", bias=True, tune=dict(walk=2))),
    ]
    for M, N, K, dt, kw in cases:
        key = str(dt).split(".")[-1]
        worst[key] = max(worst.get(key, 0.0), t.check_linear(M, N, K, dt, "cpu", seed=M + N, **kw))
    t.check_layer_dispatch("cpu", f32)
    t.check_half_pairs("cpu")
    t.check_half_rows("cpu")
    t.check_half_dot_exact("cpu")
    t.check_walk_equals_one_tile("cpu", 3, 256, 512, bf16, "half_dot", 2)
    t.check_walk_equals_one_tile("cpu", 5, 200, 160, f16, "half_dot", 3)
    t.check_walk_equals_one_tile("cpu", 4, 72, 96, f32, "dot", 2)
    for dt in (bf16, f16):
        worst["half rows"] = max(worst.get("half rows", 0.0), t.check_half_magnitudes("cpu", dt))
    for dt, err in sorted(worst.items()):
        print(f"nvfp4_linear {{dt:9s}} max |out - ref| / (1 + |ref|) = {{err:.3g}}")
    print("OK")
    """
)


def check_layer_dispatch(device, dtype):
    """``Nvfp4Linear`` with ``impl`` triton (CUDA: auto) runs the kernel: its output is the kernel's, bit for bit."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton
    from freetoken.layers.quantized_linear import Nvfp4Linear

    lin = Nvfp4Linear(64, 24, bias=True, dtype=dtype, device=device)
    w, s, s2 = random_weight(24, 64, 5, device=device)
    with torch.no_grad():
        lin.weight.copy_(w), lin.weight_scale.copy_(s), lin.weight_scale_2.copy_(s2), lin.bias.normal_()
    lin.impl = "triton" if device == "cpu" else "auto"
    for M in (1, 5):
        x = torch.randn(M, 64, device=device).to(dtype)
        assert torch.equal(lin(x), nvfp4_linear_triton(x, lin.weight, lin.weight_scale, lin.weight_scale_2, lin.bias))


def check_half_pairs(device):
    """``half_pairs``: each row scaled by a power of two that puts its largest |x| in [2^12, 2^13), packed as fp16
    pairs in the GEMV's order, exactly (bf16 -> fp16 is exact in range); ``2^-s`` undoes the scale; a zero row gives
    zeros and a finite factor."""
    from freetoken.kernels.nvfp4_half_gemv import half_pairs

    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 96, generator=g) * torch.tensor([[3e4], [1e-6], [1.0], [0.0]])
    x = x.to(device, torch.bfloat16)
    xp, xf = half_pairs(x)
    xp, xf = xp.cpu(), xf.cpu()
    assert xp.shape == (4, 8, 6) and xf.shape == (4,)
    xp = xp.transpose(1, 2)  # [m, block, pair]
    lo = (xp & 0xFFFF).to(torch.int16).view(torch.float16).float()
    hi = (xp >> 16).to(torch.int16).view(torch.float16).float()
    blocks = x.cpu().float().reshape(4, 6, 2, 2, 4)  # [m, block, word, half, p]
    scale = (1.0 / xf)[:, None, None]
    assert torch.equal(lo, blocks[:, :, :, 0, :].reshape(4, 6, 8) * scale)
    assert torch.equal(hi, blocks[:, :, :, 1, :].reshape(4, 6, 8) * scale)
    top = (x.cpu().float().abs().amax(1) / xf)[:3]
    assert bool(((top >= 2**12) & (top < 2**13)).all()), top
    assert bool(torch.isfinite(xf).all()) and bool((lo[3] == 0).all())


def check_half_rows(device):
    """``half_rows``: each row scaled by ``half_pairs``' power of two, exactly, in fp16, each 8 columns in the fp16
    tile's order (column ``8j + 2p + lane`` holds x's ``8j + p + 4 lane``); a zero row gives zeros and a finite
    factor."""
    from freetoken.kernels.nvfp4_half_gemv import half_pairs, half_rows

    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 96, generator=g) * torch.tensor([[3e4], [1e-6], [1.0], [0.0]])
    x = x.to(device, torch.bfloat16)
    xh, xf = half_rows(x)
    assert xh.shape == (4, 96) and xh.dtype == torch.float16 and xf.shape == (4,)
    assert torch.equal(xf, half_pairs(x)[1])
    c = torch.arange(96)
    cols = c - c % 8 + (c % 8) // 2 + 4 * (c % 2)
    assert sorted(cols.tolist()) == list(range(96)) and cols[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    xh, xf, x = xh.cpu(), xf.cpu(), x.cpu()
    assert torch.equal(xh.float(), x.float()[:, cols] / xf[:, None]) and bool((xh[3] == 0).all())


def check_half_dot_exact(device):
    """The fp16 tiles (``dequant_tile_half``: its pair column order, its scale pairs) decode every E2M1 code under
    every E4M3 scale exactly: x = one-hot rows picks single weights, so ``y[m, n] = W[n, m]`` with nothing rounded
    (the weight has at most 6 significant bits, bf16 keeps 8)."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton
    from freetoken.quant import nvfp4

    K, N = 64, 128  # 16 codes across each block, one scale a row (every E4M3 byte from 0 to 127)
    codes = torch.arange(16, dtype=torch.uint8).repeat(N, K // 16)
    codes = codes.roll(3, dims=1)  # codes move across words and blocks
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scale = torch.arange(N, dtype=torch.uint8)[:, None].expand(N, K // 16).contiguous().view(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    ref = nvfp4.dequantize(packed, scale, one).float()  # [N, K]
    x = torch.eye(K, dtype=torch.bfloat16)
    dev = lambda t: t.to(device)  # noqa: E731
    out = nvfp4_linear_triton(dev(x), dev(packed), dev(scale), dev(one), path="half_dot").float().cpu()
    finite = torch.isfinite(ref).all(1)  # (byte 127 is E4M3's NaN)
    assert torch.equal(out[:, finite], ref[finite].T)


def check_walk_equals_one_tile(device, M, N, K, dtype, path, walk):
    """Programs walking ``walk`` N tiles in one pipelined loop (``tune`` ``walk``) give the one-tile programs' output
    bit for bit: the same tiles, K steps and sums, only the loop around them differs (N past the last full round of
    tiles and K off the K step: masked tiles, and tiles wholly past N, in the last programs)."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton

    w, s, s2 = random_weight(N, K, M + N, device=device)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=g).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype)
    one = nvfp4_linear_triton(x, w, s, s2, b, path=path)
    walked = nvfp4_linear_triton(x, w, s, s2, b, path=path, tune={"walk": walk})
    assert torch.equal(walked, one), (M, N, K, dtype, path, walk)


def check_half_magnitudes(device, dtype):
    """The packed-half GEMV on rows of very different sizes (one near bf16's top for fp16's range, one tiny, one
    zero): each row as exact, relative to its own size, as a row of O(1) (its scale travels with it)."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_torch, nvfp4_linear_triton

    w, s, s2 = random_weight(24, 256, 11, device=device)
    g = torch.Generator().manual_seed(12)
    sizes = torch.tensor([[1.0], [2e4 if dtype == torch.bfloat16 else 100.0], [1e-5], [0.0]])
    x = (torch.randn(4, 256, generator=g) * sizes).to(device, dtype)
    out = nvfp4_linear_triton(x, w, s, s2, path="half").float()
    ref = nvfp4_linear_torch(x.float(), w, s, s2)
    err = ((out - ref).abs().amax(1) / ref.abs().amax(1).clamp(min=1e-30))[:3]
    assert bool((err <= _TOL[dtype][device == "cuda"]).all()), err
    assert bool((out[3] == 0).all())
    return float(err.max())


def test_nvfp4_linear_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=900)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA: Qwen3.6-35B-A3B's NVFP4 Linears (shared expert 512 x 2048 and 2048 x 512, lm_head 248320 x 2048) and odd shapes
# ----------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SWEEP_M = [1, 2, 3, 4, 8, 16, 17, 64, 65, 256, 1024, 8192]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", SWEEP_M)
@pytest.mark.parametrize("N,K", [(512, 2048), (2048, 512), (1000, 208)])
def test_nvfp4_linear_cuda_sweep(M, N, K):
    check_linear(M, N, K, torch.bfloat16, "cuda", bias=N == 1000, seed=M)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [1, 2, 16, 256])
def test_nvfp4_linear_cuda_lm_head(M):
    check_linear(M, 248320, 2048, torch.bfloat16, "cuda", seed=M)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 2, 16, 300])
def test_nvfp4_linear_cuda_dtypes(M, dtype):
    check_linear(M, 2048, 512, dtype, "cuda", bias=True, strided=True, seed=M)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "M, path",
    [(m, "gemv") for m in (1, 2, 4, 8)]
    + [(m, "half") for m in (1, 2, 3, 4)]
    + [(m, "dot") for m in (1, 2, 4, 8, 16)]
    + [(m, "half_dot") for m in (1, 2, 3, 4, 8, 16, 33, 64)],
)
def test_nvfp4_linear_cuda_both_paths(M, path):
    """Each path over the M it takes (the GEMV up to 8 rows, its packed-half form up to 4: ``nvfp4_linear_triton``
    refuses more)."""
    check_linear(M, 512, 2048, torch.bfloat16, "cuda", path=path, seed=M)
    if path in ("half", "half_dot"):
        check_linear(M, 2048, 512, torch.float16, "cuda", path=path, bias=True, strided=True, seed=M)


@pytest.mark.gpu
@cuda
def test_nvfp4_half_gemv_cuda_magnitudes():
    check_half_pairs("cuda")
    check_half_rows("cuda")
    check_half_dot_exact("cuda")
    for dtype in (torch.bfloat16, torch.float16):
        check_half_magnitudes("cuda", dtype)


def _asm_and_emulation(launch, M: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A half-precision launcher (``_launch_gemv`` / ``_launch_dot`` with ``half``) on M rows against lm_head-sized
    rows (4096 x 2048), once with its inline PTX and once with the interpreter's emulation, both on the GPU."""
    w, s, s2 = random_weight(4096, 2048, M, device="cuda")
    x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
    outs = []
    for asm in (True, False):
        out = torch.empty(M, 4096, device="cuda", dtype=torch.bfloat16)
        launch(x, w, s.view(torch.uint8), s2.reshape(()), None, out, half=True, asm=asm)
        outs.append(out)
    return outs[0], outs[1]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [1, 4])
def test_nvfp4_half_gemv_asm_matches_its_emulation(M):
    """The inline-PTX ``fma.rn.f16x2`` chain against the lane-by-lane emulation the interpreter runs, both compiled
    for the GPU, on lm_head's rows: the same fp16 roundings (the emulation rounds the add in fp32 first; a tie can
    differ in the last bit of a block's fp16 sum, nowhere near bf16's output rounding)."""
    from freetoken.kernels import nvfp4_linear as nl

    ptx, emulated = (out.float() for out in _asm_and_emulation(nl._launch_gemv, M))
    assert (ptx - emulated).abs().max().item() <= 1e-2 * (1 + emulated.abs().max().item()), M
    assert (ptx != emulated).float().mean().item() < 0.01


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [1, 16])
def test_nvfp4_half_dot_asm_matches_its_emulation(M):
    """The fp16 tiles' inline ``mul.rn.f16x2`` against the interpreter's emulation, both compiled for the GPU: every
    product is exact, so the outputs are equal bit for bit (lm_head's rows, unmasked tiles)."""
    from freetoken.kernels import nvfp4_linear as nl

    ptx, emulated = _asm_and_emulation(nl._launch_dot, M)
    assert torch.equal(ptx, emulated)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("walk", [2, 4])
@pytest.mark.parametrize("M", [2, 16])
def test_nvfp4_linear_cuda_walk(M, walk):
    """Walking programs on the GPU: the fp16 tiles on lm_head's K (unmasked, and with N past the last full walk), the
    bf16 tiles masked."""
    check_walk_equals_one_tile("cuda", M, 64 * 4 * 8, 2048, torch.bfloat16, "half_dot", walk)
    check_walk_equals_one_tile("cuda", M, 1000, 2048, torch.bfloat16, "half_dot", walk)
    check_walk_equals_one_tile("cuda", M, 1000, 208, torch.bfloat16, "dot", walk)


@pytest.mark.gpu
@cuda
def test_nvfp4_layer_dispatch_cuda():
    check_layer_dispatch("cuda", torch.bfloat16)


@pytest.mark.gpu
@cuda
# the GEMV with split-K (two launches), the tensor-core path, the packed-half GEMV (x packed, split-K: three)
@pytest.mark.parametrize("M,path", [(1, "auto"), (16, "auto"), (2, "half")])
def test_nvfp4_linear_cuda_graph(M, path):
    """Captured once, replayed with new activations: no host reads, nothing sized from data."""
    from functools import partial

    from freetoken.kernels.nvfp4_linear import nvfp4_linear_torch
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton as linear

    nvfp4_linear_triton = partial(linear, path=path)

    w, s, s2 = random_weight(512, 2048, 3, device="cuda")
    x = torch.zeros(M, 2048, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        nvfp4_linear_triton(x, w, s, s2)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_linear_triton(x, w, s, s2)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        x.copy_(torch.randn(M, 2048, generator=g).to("cuda", torch.bfloat16))
        graph.replay()
        assert error(out, nvfp4_linear_torch(x, w, s, s2)) <= _TOL[torch.bfloat16][1]


def test_unknown_launch_settings_are_refused():
    """A benchmark's ``tune`` names only its path's settings: a typo must not silently time the default."""
    from freetoken.kernels.nvfp4_linear import nvfp4_linear_triton

    w, s, s2 = random_weight(16, 64, 0)
    with pytest.raises(ValueError, match="block_n"):
        nvfp4_linear_triton(torch.randn(1, 64), w, s, s2, path="gemv", tune={"block_n": 64})
