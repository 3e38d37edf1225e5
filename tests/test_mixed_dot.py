"""The mixed BF16 / FP8 / NVFP4 projection on tensor cores for 3..32 rows of x (``kernels/mixed_dot.py``) vs the
mixed GEMV's torch reference (``mixed_gemv_torch``), and the dispatch that gives it those rows: on CPU the rule and
the kernel under TRITON_INTERPRET=1 (a subprocess), on CUDA (``gpu`` marker) Qwen3.6's NVFP4-checkpoint
projections at M = 3..32, every E4M3 code exact, and CUDA-graph capture.

Error measure (``nvfp4_cases.error``): max |out - ref| / (1 + |ref|); the reference rounds each weight times its
scale to x's dtype before its matmul, the kernel multiplies exact decoded weights and scales the fp32 sums per row.
"""

import textwrap

import pytest
import torch
from nvfp4_cases import error
from test_mixed_gemv import QWEN36, _fp8, every_e4m3_code_rows, make_parts
from triton_interpreter import run_under_interpreter

_TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def check_dot_projection(spec, k, M, dtype, device, mode="auto"):
    """``fuse_linears`` over ``spec``'s parts at ``M`` rows: one launch of the kernel (no part runs), near the
    reference; the layer's output is the kernel's."""
    from freetoken.kernels.mixed_dot import mixed_dot_triton, mixed_kernel
    from freetoken.kernels.mixed_gemv import mixed_gemv_torch
    from freetoken.layers.fused_linear import fuse_linears

    parts = make_parts(spec, k, dtype, device)
    fused = fuse_linears(*parts)
    fused.mixed_mode = mode
    x = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(device, dtype)
    assert mixed_kernel(x, fused.mixed, mode) is mixed_dot_triton, (spec, M)
    ran = []
    hooks = [p.register_forward_hook(lambda *a: ran.append(1)) for p in parts]
    out = fused(x)
    for h in hooks:
        h.remove()
    assert ran == [] and out.shape == (M, sum(n for _, n in spec)) and out.dtype == dtype
    err = error(out, mixed_gemv_torch(x, fused.mixed))
    assert err <= _TOL[dtype], (spec, M, dtype, err)
    return err


def check_every_e4m3_code_dot(device):
    """Every finite E4M3 code, signs and subnormals included, through the kernel's FP8 tiles: row n of the weight
    holds code ``(n + k) % 256`` at column k (the NaN codes zeroed) and each row of x picks one column, so each
    output is one decoded weight, exact, equal to torch's conversion bit for bit."""
    from freetoken.kernels.mixed_dot import mixed_dot_triton
    from freetoken.kernels.mixed_gemv import mixed_gemv_torch

    rows = every_e4m3_code_rows(device)
    K = rows.K
    cols = (0, 1, 2, 3, 127, 128, 254, 255)  # every byte position, both halves of K, the last column
    x = torch.zeros(len(cols), K, device=device, dtype=torch.bfloat16)
    for i, c in enumerate(cols):
        x[i, c] = 1.0
    out, ref = mixed_dot_triton(x, rows), mixed_gemv_torch(x, rows)
    assert torch.equal(out, ref), (out - ref).abs().max()
    return 0.0


# ----------------------------------------------------------------------------------------------------------------------
# CPU, no interpreter: the dispatch rule
# ----------------------------------------------------------------------------------------------------------------------


def test_which_rows_take_the_kernel():
    from freetoken.kernels.mixed_dot import MAX_M, mixed_dot_triton, mixed_kernel, use_mixed_dot
    from freetoken.kernels.mixed_gemv import mixed_gemv_triton
    from freetoken.layers.mixed_projection import mixed_rows

    fp8_rows = mixed_rows(make_parts([("f", 16), ("d", 8)], 64, torch.bfloat16))
    no_fp8 = mixed_rows(make_parts([("d", 8), ("n", 16)], 64, torch.bfloat16))
    x = torch.randn(MAX_M + 1, 64, dtype=torch.bfloat16)
    # the GEMV up to its rows (2 with FP8 rows, else 4), then this kernel up to 32, then the parts (None)
    assert [mixed_kernel(x[:m], fp8_rows, "on") for m in (2, 3, 17, MAX_M, MAX_M + 1)] == [
        mixed_gemv_triton, mixed_dot_triton, mixed_dot_triton, mixed_dot_triton, None
    ]  # fmt: skip
    assert [mixed_kernel(x[:m], no_fp8, "on") for m in (4, 5, 16)] == [mixed_gemv_triton] + [mixed_dot_triton] * 2
    assert not use_mixed_dot(x[:8], fp8_rows)  # CPU: auto keeps the parts
    assert not use_mixed_dot(x[:8].float(), fp8_rows, "on")  # 16-bit x only
    assert not use_mixed_dot(x[:8], None, "on") and not use_mixed_dot(x[:8], fp8_rows, "off")
    with pytest.raises(ValueError, match="unknown mixed GEMV mode"):
        use_mixed_dot(x, fp8_rows, "bogus")


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the kernel under the interpreter
# ----------------------------------------------------------------------------------------------------------------------

_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_mixed_dot as t
    f16, bf16 = torch.float16, torch.bfloat16
    worst = {{}}
    cases = [
        ([("f", 40), ("f", 24), ("d", 3), ("d", 1)], 256, 3, bf16),  # GDN: qkv | z (fp8), b | a (dense)
        ([("f", 17)], 160, 16, f16),  # one format, K not a multiple of the step, 16 rows
        ([("d", 9), ("d", 1), ("n", 32), ("n", 32)], 512, 5, bf16),  # MoE: router | shared gate, gate | up
        ([("n", 7), ("f", 6), ("d", 5)], 64, 9, f16),  # any order of the blocks
        ([("n", 24)], 96, 12, bf16),  # NVFP4 alone
        ([("f", 40), ("d", 2), ("n", 16)], 128, 21, bf16),  # 32-row tiles of x
    ]
    for spec, k, M, dt in cases:
        key = str(dt).split(".")[-1]
        worst[key] = max(worst.get(key, 0.0), t.check_dot_projection(spec, k, M, dt, "cpu", mode="on"))
    worst["e4m3 codes exact"] = t.check_every_e4m3_code_dot("cpu")
    for dt, err in sorted(worst.items()):
        print(f"mixed_dot {{dt:9s}} max |out - ref| / (1 + |ref|) = {{err:.3g}}")
    print("OK")
    """
)


def test_mixed_dot_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT, timeout=900)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA: the projections of nvidia/Qwen3.6-35B-A3B-NVFP4 (hidden 2048)
# ----------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [3, 5, 8, 13, 16, 17, 24, 32])
@pytest.mark.parametrize("name", sorted(QWEN36))
def test_mixed_dot_projection_cuda(name, M):
    spec, k = QWEN36[name]
    if M <= 4 and not any(f == "f" for f, _ in spec):
        pytest.skip("the GEMV's rows")
    check_dot_projection(spec, k, M, torch.bfloat16, "cuda")


@pytest.mark.gpu
@cuda
def test_every_e4m3_code_dot_cuda():
    check_every_e4m3_code_dot("cuda")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("M", [3, 16, 32])
def test_kernel_alone_on_a_lone_fp8_weight_cuda(M):
    """The kernel over one FP8 block (o_proj's shape; the layer itself keeps W8A8 there, timed faster): near the
    dequantized reference."""
    from freetoken.kernels.fp8_linear import fp8_linear_torch
    from freetoken.kernels.mixed_dot import mixed_dot_triton
    from freetoken.kernels.mixed_gemv import MixedRows

    lin = _fp8(2048, 4096, 1, torch.bfloat16, "cuda")
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
    rows = MixedRows(4096, fp8_weight=lin.weight, fp8_scale=lin.weight_scale)
    assert error(mixed_dot_triton(x, rows), fp8_linear_torch(x, lin.weight, lin.weight_scale)) <= 3e-2


@pytest.mark.gpu
@cuda
def test_mixed_dot_cuda_graph():
    """A captured graph of the GDN input projection at 8 rows replays new inputs."""
    from freetoken.kernels.mixed_gemv import mixed_gemv_torch
    from freetoken.layers.fused_linear import fuse_linears

    spec, k = QWEN36["gdn_in_proj"]
    fused = fuse_linears(*make_parts(spec, k, torch.bfloat16, "cuda"))
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x)
    for seed in (1, 2):
        x.copy_(torch.randn(8, k, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert error(out, mixed_gemv_torch(x, fused.mixed)) <= _TOL[torch.bfloat16]
