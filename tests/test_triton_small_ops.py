"""Fused small-op kernels of the decode hot path (``rms_norm``, ``activation``, ``rope``, ``moe_routing``) vs their
torch references: on CUDA (``gpu`` marker, real Qwen3.6 shapes, CUDA-graph capture) and on CPU under TRITON_INTERPRET=1.

The interpreter must be switched on before triton compiles anything, so CPU cases run in one subprocess with the
environment variable set. The references themselves are checked bit for bit against the layers they stand for.

Tolerances: fp32 1e-5; fp16 and bf16 on CUDA 1e-2 (a one-ulp rounding flip where fp32 math differs in the last bit).
The interpreter converts fp32 to bf16 by truncating, not rounding to nearest as the GPU and torch do, so bf16 under
the interpreter gets 3e-2; fp16 there rounds like torch and keeps 1e-2.
"""

import os
import textwrap

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import run_under_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
_TOL_INTERPRETER_BF16 = 3e-2


def _close(out, ref, dtype, device):
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    tol = _TOL_INTERPRETER_BF16 if (device == "cpu" and dtype == torch.bfloat16) else _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    return ((out.float() - ref.float()).abs() / (1 + ref.float().abs())).max().item()


def _rows(T, N, dtype, device, g, strided=False):
    """Fresh ``[T, N]`` activations; ``strided``: a row-strided view into a wider buffer."""
    if strided:
        return torch.randn(T, N + 7, generator=g).to(device, dtype)[:, 3 : 3 + N]
    return torch.randn(T, N, generator=g).to(device, dtype)


def _weight(N, dtype, device, g, one_plus):
    """Near the layer's init (0 for one_plus, 1 for plain), never exactly it."""
    return (torch.randn(N, generator=g) * 0.2 + (0.0 if one_plus else 1.0)).to(device, dtype)


# ----------------------------------------------------------------------------------------------------------------------
# cases, shared by the interpreter subprocess and the CUDA tests; each returns its max |out - ref| / (1 + |ref|)
# ----------------------------------------------------------------------------------------------------------------------


def check_rms_norm(T, N, dtype, device, one_plus, strided=False, seed=0):
    from freetoken.kernels.rms_norm import add_rms_norm_torch, add_rms_norm_triton, rms_norm_torch, rms_norm_triton

    g = torch.Generator().manual_seed(seed)
    x = _rows(T, N, dtype, device, g, strided)
    res = _rows(T, N, dtype, device, g, strided)
    w = _weight(N, dtype, device, g, one_plus)
    err = _close(rms_norm_triton(x, w, 1e-6, one_plus), rms_norm_torch(x, w, 1e-6, one_plus), dtype, device)
    ref_n, ref_s = add_rms_norm_torch(x, res.clone(), w, 1e-6, one_plus)
    n, s = add_rms_norm_triton(x, res, w, 1e-6, one_plus)
    err = max(err, _close(n, ref_n, dtype, device), _close(s, ref_s, dtype, device))
    before = res.clone()
    n, s = add_rms_norm_triton(x, res, w, 1e-6, one_plus, inplace=True)
    assert s is res and not torch.equal(res, before), "inplace must write the sum into residual's storage"
    err = max(err, _close(n, ref_n, dtype, device), _close(s, ref_s, dtype, device))
    # ``out``: the norm written into given rows (a MoE prefill graph's input buffer), both paths
    buf = torch.zeros(T + 3, N, dtype=dtype, device=device)
    n, _ = add_rms_norm_triton(x, before, w, 1e-6, one_plus, out=buf[:T])
    assert n.data_ptr() == buf.data_ptr() and not buf[T:].any()
    ref_buf = torch.zeros_like(buf)
    assert add_rms_norm_torch(x, before, w, 1e-6, one_plus, out=ref_buf[:T])[0].data_ptr() == ref_buf.data_ptr()
    return max(err, _close(buf[:T], ref_n, dtype, device), _close(ref_buf[:T], ref_n, dtype, device))


def check_gated_rms_norm(R, D, dtype, device, strided=False, seed=0, heads=0):
    """``heads``: x and the gate as ``[R, heads, D]``, the gate a column slice of a wider projection output (the
    Gated DeltaNet's z), which no ``[R * heads, D]`` view covers."""
    from freetoken.kernels.rms_norm import gated_rms_norm_torch, gated_rms_norm_triton

    g = torch.Generator().manual_seed(seed)
    if heads:
        x = _rows(R * heads, D, dtype, device, g, False).view(R, heads, D)
        wide = _rows(R, (heads + 3) * D, dtype, device, g, False)
        z = wide[:, 2 * D : (heads + 2) * D].view(R, heads, D)
        assert R < 2 or z.stride(0) != heads * z.stride(1)
    else:
        x = _rows(R, D, dtype, device, g, strided)
        z = _rows(R, D, dtype, device, g, strided)
    w = _weight(D, dtype, device, g, one_plus=False)
    return _close(gated_rms_norm_triton(x, z, w, 1e-6), gated_rms_norm_torch(x, z, w, 1e-6), dtype, device)


def check_silu_and_mul(T, I, dtype, device, strided=False, seed=0):
    from freetoken.kernels.activation import silu_and_mul_torch, silu_and_mul_triton

    g = torch.Generator().manual_seed(seed)
    x = _rows(T, 2 * I, dtype, device, g, strided) * 3  # reach SiLU's curved part and its tails
    return _close(silu_and_mul_triton(x), silu_and_mul_torch(x), dtype, device)


def _inv_freq(rotary_dim, theta=10_000_000.0):
    return (1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))).float()


def check_qk_norm_rope(T, nh, nkv, D, R, dtype, device, norm="one_plus", max_pos=40_000, seed=0):
    """``norm``: one_plus (Qwen3.5/3.6), plain (Qwen3), none (Llama). q is the ``[..., :D]`` view of ``[T, nh, 2D]``."""
    from freetoken.kernels.rope import qk_norm_rope_torch, qk_norm_rope_triton

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, nh, 2 * D, generator=g).to(device, dtype)[..., :D]
    k = torch.randn(T, nkv, D, generator=g).to(device, dtype)
    positions = torch.randint(0, max_pos, (T,), generator=g).to(device)
    inv_freq = _inv_freq(R).to(device)
    one_plus = norm == "one_plus"
    qw = kw = None
    if norm != "none":
        qw, kw = _weight(D, dtype, device, g, one_plus), _weight(D, dtype, device, g, one_plus)
    args = (q, k, positions, inv_freq, R, qw, kw, 1e-6, one_plus)
    (q_out, k_out), (q_ref, k_ref) = qk_norm_rope_triton(*args), qk_norm_rope_torch(*args)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    return max(_close(q_out, q_ref, dtype, device), _close(k_out, k_ref, dtype, device))


def check_topk_softmax(T, E, k, dtype, device, renormalize=True, strided=False, seed=0):
    from freetoken.kernels.moe_routing import topk_softmax_torch, topk_softmax_triton

    g = torch.Generator().manual_seed(seed)
    logits = _rows(T, E, dtype, device, g, strided) * 2
    ids, w = topk_softmax_triton(logits, k, renormalize)
    ref_ids, ref_w = topk_softmax_torch(logits, k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    else:  # low-precision logits tie often; any order among equal probabilities is right
        probs = torch.softmax(logits, -1, dtype=torch.float32)
        assert all(len(set(row)) == k for row in ids.tolist()), "an expert chosen twice"
        unnorm = probs.gather(-1, ids)
        torch.testing.assert_close(unnorm / unnorm.sum(-1, keepdim=True) if renormalize else unnorm, ref_w)
    return ((w - ref_w).abs() / (1 + ref_w.abs())).max().item()


def check_topk_ties(device):
    """Equal probabilities go to the lowest expert id, largest weight first."""
    from freetoken.kernels.moe_routing import topk_softmax_triton

    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, 2.0]], device=device)
    ids, _ = topk_softmax_triton(logits, 4, True)
    assert ids.tolist() == [[1, 3, 5, 2]], ids.tolist()


def check_empty(device):
    from freetoken.kernels.activation import silu_and_mul_triton
    from freetoken.kernels.moe_routing import topk_softmax_triton
    from freetoken.kernels.rms_norm import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton
    from freetoken.kernels.rope import qk_norm_rope_triton

    x, w = torch.empty(0, 16, device=device), torch.ones(16, device=device)
    assert rms_norm_triton(x, w, 1e-6, True).shape == (0, 16)
    assert add_rms_norm_triton(x, x.clone(), w, 1e-6, False, inplace=True)[0].shape == (0, 16)
    assert gated_rms_norm_triton(x, x, w, 1e-6).shape == (0, 16)
    assert silu_and_mul_triton(x).shape == (0, 8)
    assert topk_softmax_triton(x, 2, True)[0].shape == (0, 2)
    q, k = torch.empty(0, 2, 16, device=device), torch.empty(0, 1, 16, device=device)
    pos = torch.empty(0, dtype=torch.int64, device=device)
    assert qk_norm_rope_triton(q, k, pos, _inv_freq(8).to(device), 8)[0].shape == (0, 2, 16)


# ----------------------------------------------------------------------------------------------------------------------
# the references are the layers' numerics, bit for bit
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_references_equal_the_layers(dtype):
    from freetoken.kernels.activation import silu_and_mul_torch
    from freetoken.kernels.moe_routing import topk_softmax_torch
    from freetoken.kernels.rms_norm import add_rms_norm_torch, gated_rms_norm_torch, rms_norm_torch
    from freetoken.kernels.rope import qk_norm_rope_torch
    from freetoken.layers.gated_deltanet import GatedRMSNorm
    from freetoken.layers.moe import GatedMLP, SparseMoeBlock
    from freetoken.layers.norm import RMSNorm
    from freetoken.layers.rotary import RotaryEmbedding
    from freetoken.models.base import ModelConfig

    torch.manual_seed(0)
    T, H = 9, 96
    with torch.no_grad():
        x, h = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)
        for one_plus in (True, False):
            norm = RMSNorm(H, eps=1e-6, one_plus=one_plus)
            norm.weight.normal_(0.0 if one_plus else 1.0, 0.2)
            norm = norm.to(dtype)
            assert torch.equal(rms_norm_torch(x, norm.weight, 1e-6, one_plus), norm(x))
            summed = h + x  # the decoder's residual add
            n, s = add_rms_norm_torch(x, h.clone(), norm.weight, 1e-6, one_plus, inplace=True)
            assert torch.equal(s, summed) and torch.equal(n, norm(summed))

        gated = GatedRMSNorm(32, eps=1e-6)
        gated.weight.normal_(1.0, 0.2)
        gated = gated.to(dtype)
        o, z = torch.randn(T * 4, 32).to(dtype), torch.randn(T * 4, 32).to(dtype)
        assert torch.equal(gated_rms_norm_torch(o, z, gated.weight, 1e-6), gated(o, z))

        mlp = GatedMLP(H, 40).to(dtype)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        # GatedMLP.forward; not bit for bit on CPU only: torch's vectorised SiLU (contiguous gate) and its scalar
        # loop (the strided half of a fused buffer) differ in the last fp32 bit
        torch.testing.assert_close(silu_and_mul_torch(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)

        positions = torch.randint(0, 40_000, (T,))
        for D, R, norm_kind in [(64, 16, "one_plus"), (32, 32, "plain"), (32, 32, "none")]:
            q, k = torch.randn(T, 4, D).to(dtype), torch.randn(T, 2, D).to(dtype)
            rot = RotaryEmbedding(D, R, 10_000_000.0, 4096)
            if norm_kind == "none":  # Llama
                ref = rot(positions, q, k)
                got = qk_norm_rope_torch(q, k, positions, rot.inv_freq, R)
            else:  # gated attention (one_plus) / Qwen3 (plain): q_norm, k_norm, then the rotary
                one_plus = norm_kind == "one_plus"
                qn, kn = RMSNorm(D, 1e-6, one_plus), RMSNorm(D, 1e-6, one_plus)
                for m in (qn, kn):
                    m.weight.normal_(0.0 if one_plus else 1.0, 0.2)
                qn, kn = qn.to(dtype), kn.to(dtype)
                ref = rot(positions, qn(q), kn(k))
                got = qk_norm_rope_torch(q, k, positions, rot.inv_freq, R, qn.weight, kn.weight, 1e-6, one_plus)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (D, R, norm_kind)

        cfg = ModelConfig.from_dict(
            dict(
                model_type="qwen3_5_moe_text",
                hidden_size=H,
                num_experts=24,
                num_experts_per_tok=4,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=0,
            )
        )
        blk = SparseMoeBlock(cfg)
        blk.gate.weight.normal_(0, 1.0)
        blk = blk.to(dtype)
        ids, w = topk_softmax_torch(F.linear(x, blk.gate.weight), 4, blk.norm_topk_prob)
        ref_ids, ref_w = blk.route(x)
        assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)  # route leaves the cast to the experts


def test_dispatch_uses_the_reference_off_cuda():
    from freetoken.kernels.activation import silu_and_mul, silu_and_mul_torch
    from freetoken.kernels.moe_routing import topk_softmax, topk_softmax_torch
    from freetoken.kernels.rms_norm import rms_norm, rms_norm_torch

    x = torch.randn(3, 64)
    w = torch.randn(64)
    assert torch.equal(rms_norm(x, w, 1e-6, True), rms_norm_torch(x, w, 1e-6, True))
    assert torch.equal(silu_and_mul(x), silu_and_mul_torch(x))
    assert all(torch.equal(a, b) for a, b in zip(topk_softmax(x, 3, True), topk_softmax_torch(x, 3, True)))


# ----------------------------------------------------------------------------------------------------------------------
# CPU: the Triton kernels under the interpreter
# ----------------------------------------------------------------------------------------------------------------------

_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_triton_small_ops as t
    worst, n = {{}}, 0
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        cases = [
            ("rms_norm", lambda: t.check_rms_norm(1, 100, dt, "cpu", one_plus=True)),
            ("rms_norm", lambda: t.check_rms_norm(37, 100, dt, "cpu", one_plus=False, strided=True, seed=1)),
            ("rms_norm", lambda: t.check_rms_norm(37, 64, dt, "cpu", one_plus=True, strided=True, seed=2)),
            ("gated_rms_norm", lambda: t.check_gated_rms_norm(37 * 3, 40, dt, "cpu", strided=True)),
            ("gated_rms_norm", lambda: t.check_gated_rms_norm(1, 24, dt, "cpu", seed=1)),
            ("gated_rms_norm", lambda: t.check_gated_rms_norm(9, 32, dt, "cpu", seed=2, heads=3)),
            ("silu_and_mul", lambda: t.check_silu_and_mul(37, 50, dt, "cpu", strided=True)),
            ("silu_and_mul", lambda: t.check_silu_and_mul(1, 1100, dt, "cpu", seed=1)),  # two column blocks
            ("qk_norm_rope", lambda: t.check_qk_norm_rope(37, 4, 2, 40, 16, dt, "cpu", "one_plus")),
            ("qk_norm_rope", lambda: t.check_qk_norm_rope(1, 3, 1, 32, 32, dt, "cpu", "plain", seed=1)),
            ("qk_norm_rope", lambda: t.check_qk_norm_rope(5, 2, 2, 24, 24, dt, "cpu", "none", seed=2)),
            ("topk_softmax", lambda: t.check_topk_softmax(37, 60, 4, dt, "cpu", strided=True)),
            ("topk_softmax", lambda: t.check_topk_softmax(1, 512, 16, dt, "cpu", renormalize=False, seed=1)),
            ("topk_softmax", lambda: t.check_topk_softmax(5, 7, 1, dt, "cpu", seed=2)),
        ]
        for name, case in cases:
            key = (name, str(dt).split(".")[-1])
            worst[key] = max(worst.get(key, 0.0), case())
            n += 1
    t.check_topk_ties("cpu")
    t.check_empty("cpu")
    for (name, dt), err in sorted(worst.items()):
        print(f"{{name:16s}} {{dt:9s}} max |out - ref| / (1 + |ref|) = {{err:.3g}}")
    print(f"OK {{n + 2}} cases")
    """
)


def test_small_ops_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA: real shapes (Qwen3.6-35B-A3B: H 2048, head_dim 256 with 64 rotary dims, GDN dv 128 over 32 heads, E 256 k 8)
# ----------------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 37, 1000])
@pytest.mark.parametrize("one_plus", [True, False])
def test_rms_norm_cuda(T, one_plus, dtype):
    check_rms_norm(T, 2048, dtype, "cuda", one_plus, strided=T == 37, seed=T)
    check_rms_norm(T, 4096 + 96, dtype, "cuda", one_plus, seed=T)  # N not a power of two


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 37, 1000])
def test_gated_rms_norm_cuda(T, dtype):
    check_gated_rms_norm(T * 32, 128, dtype, "cuda", strided=T == 37, seed=T)
    check_gated_rms_norm(T, 128, dtype, "cuda", seed=T, heads=32)  # the GDN's z, read in place


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 512), (37, 512), (1000, 768), (3, 6144), (5, 200)])
def test_silu_and_mul_cuda(T, I, dtype):
    check_silu_and_mul(T, I, dtype, "cuda", strided=T == 37, seed=T)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T,nh,nkv,D,R,norm",
    [
        (1, 16, 2, 256, 64, "one_plus"),  # Qwen3.6 gated attention, decode
        (37, 16, 2, 256, 64, "one_plus"),
        (1000, 16, 2, 256, 64, "one_plus"),
        (37, 32, 4, 128, 128, "plain"),  # Qwen3 / Qwen3-MoE
        (37, 32, 8, 64, 64, "none"),  # Llama (SmolLM2)
        (7, 5, 1, 80, 40, "plain"),  # head_dim not a power of two
    ],
)
def test_qk_norm_rope_cuda(T, nh, nkv, D, R, norm, dtype):
    check_qk_norm_rope(T, nh, nkv, D, R, dtype, "cuda", norm, max_pos=262_144, seed=T)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T,E,k,renorm",
    [(1, 256, 8, True), (37, 256, 8, True), (1000, 256, 8, True), (9, 128, 8, False), (5, 512, 10, True)],
)
def test_topk_softmax_cuda(T, E, k, renorm, dtype):
    check_topk_softmax(T, E, k, dtype, "cuda", renormalize=renorm, strided=T == 37, seed=T)


@pytest.mark.gpu
@cuda
def test_ties_and_empty_cuda():
    check_topk_ties("cuda")
    check_empty("cuda")


@pytest.mark.gpu
@cuda
def test_small_ops_cuda_graph():
    """Each op captured in a CUDA graph, then replayed on new inputs copied into the captured buffers."""
    from freetoken.kernels.activation import silu_and_mul, silu_and_mul_torch
    from freetoken.kernels.moe_routing import topk_softmax, topk_softmax_torch
    from freetoken.kernels.rms_norm import (
        add_rms_norm,
        add_rms_norm_torch,
        gated_rms_norm,
        gated_rms_norm_torch,
        rms_norm,
        rms_norm_torch,
    )
    from freetoken.kernels.rope import qk_norm_rope, qk_norm_rope_torch

    dev, dt, T = "cuda", torch.bfloat16, 4
    H, D, R = 2048, 256, 64
    w = torch.randn(H, device=dev, dtype=dt) * 0.2
    wv = 1 + torch.randn(128, device=dev, dtype=dt) * 0.2
    qw, kw = torch.randn(D, device=dev, dtype=dt) * 0.2, torch.randn(D, device=dev, dtype=dt) * 0.2
    inv_freq = _inv_freq(R).to(dev)
    inputs = dict(
        x=torch.empty(T, H, device=dev, dtype=dt),
        res=torch.empty(T, H, device=dev, dtype=dt),
        o=torch.empty(T * 32, 128, device=dev, dtype=dt),
        z=torch.empty(T * 32, 128, device=dev, dtype=dt),
        gu=torch.empty(T, 1024, device=dev, dtype=dt),
        qg=torch.empty(T, 16, 2 * D, device=dev, dtype=dt),
        k=torch.empty(T, 2, D, device=dev, dtype=dt),
        pos=torch.empty(T, dtype=torch.int64, device=dev),
        logits=torch.empty(T, 256, device=dev, dtype=dt),
    )

    def refill():
        for name, t in inputs.items():
            t.copy_(torch.randint(0, 262_144, t.shape, device=dev) if name == "pos" else torch.randn_like(t))

    ops = {
        "rms_norm": (lambda i: rms_norm(i["x"], w, 1e-6, True), lambda i: rms_norm_torch(i["x"], w, 1e-6, True)),
        "add_rms_norm": (
            lambda i: add_rms_norm(i["x"], i["res"], w, 1e-6, True, inplace=True),
            lambda i: add_rms_norm_torch(i["x"], i["res"].clone(), w, 1e-6, True),
        ),
        "gated_rms_norm": (
            lambda i: gated_rms_norm(i["o"], i["z"], wv, 1e-6),
            lambda i: gated_rms_norm_torch(i["o"], i["z"], wv, 1e-6),
        ),
        "silu_and_mul": (lambda i: silu_and_mul(i["gu"]), lambda i: silu_and_mul_torch(i["gu"])),
        "qk_norm_rope": (
            lambda i: qk_norm_rope(i["qg"][..., :D], i["k"], i["pos"], inv_freq, R, qw, kw, 1e-6, True),
            lambda i: qk_norm_rope_torch(i["qg"][..., :D], i["k"], i["pos"], inv_freq, R, qw, kw, 1e-6, True),
        ),
        "topk_softmax": (
            lambda i: topk_softmax(i["logits"], 8, True),
            lambda i: topk_softmax_torch(i["logits"], 8, True),
        ),
    }
    for name, (fused, reference) in ops.items():
        refill()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up (compile) outside the capture
            fused(inputs)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(inputs)
        out = out if isinstance(out, tuple) else (out,)
        for _ in range(2):
            refill()
            ref = reference(inputs)  # before replay: the in-place add overwrites the residual
            ref = ref if isinstance(ref, tuple) else (ref,)
            graph.replay()
            torch.cuda.synchronize()
            for got, want in zip(out, ref):
                if got.dtype == torch.int64:  # expert ids: bf16 logits can tie, compare the chosen probabilities
                    probs = torch.softmax(inputs["logits"], -1, dtype=torch.float32)
                    torch.testing.assert_close(probs.gather(-1, got).sum(-1), probs.gather(-1, want).sum(-1))
                else:
                    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2, msg=name)
