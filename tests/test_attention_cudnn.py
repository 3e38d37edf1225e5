"""The cuDNN route of a long chunk's extend attention (``kernels/attention_cudnn.py``): the choice rule and the
log-sum-exp merge on the CPU (the merge kernel under ``TRITON_INTERPRET=1``), and on CUDA the whole route against
our Triton extend kernel over a scattered paged pool."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter


def partials(nh, T, m1, m2, DV, dtype=torch.float32, seed=0):
    """Attention of T queries over two disjoint key sets, each as (o [nh, T, DV], natural lse [nh, T]), and the
    attention over both sets at once [T, nh, DV] (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    s1, s2 = torch.randn(nh, T, m1, generator=gen) * 3, torch.randn(nh, T, m2, generator=gen) * 3
    v1, v2 = torch.randn(nh, m1, DV, generator=gen), torch.randn(nh, m2, DV, generator=gen)
    o1, o2 = torch.softmax(s1, -1) @ v1, torch.softmax(s2, -1) @ v2
    want = torch.softmax(torch.cat([s1, s2], -1), -1) @ torch.cat([v1, v2], 1)
    return (o1.to(dtype), torch.logsumexp(s1, -1), o2.to(dtype), torch.logsumexp(s2, -1)), want.transpose(0, 1)


def test_merge_reference_is_attention_over_both_key_sets():
    from freetoken.kernels.attention_cudnn import merge_two_torch

    (o1, l1, o2, l2), want = partials(3, 5, 7, 2, 8)
    assert (merge_two_torch(o1, l1, o2, l2) - want).abs().max() < 1e-5


def test_choice_rule(monkeypatch):
    import freetoken.kernels.attention_cudnn as m

    q, kc = torch.zeros(2048, 4, 256, dtype=torch.bfloat16), torch.zeros(10, 2, 256, dtype=torch.bfloat16)
    monkeypatch.delenv("FREETOKEN_EXTEND_ATTENTION", raising=False)
    assert m.extend_attention_choice() == "triton"  # the default
    monkeypatch.setenv("FREETOKEN_EXTEND_ATTENTION", "cudnn")
    assert not m.use_cudnn_extend(q, kc, 1, 2048)  # chosen, but CPU tensors: never
    monkeypatch.setenv("FREETOKEN_EXTEND_ATTENTION", "fast")
    with pytest.raises(ValueError, match="FREETOKEN_EXTEND_ATTENTION"):
        m.extend_attention_choice()
    for choice in m.CHOICES:
        monkeypatch.setenv("FREETOKEN_EXTEND_ATTENTION", choice.upper())
        assert m.extend_attention_choice() == choice


def test_a_failing_cudnn_op_keeps_the_triton_kernel(monkeypatch):
    """The probe: an op that raises (missing in this torch, refusing the shape) or answers wrong says no, so the
    extend step stays on the Triton kernel instead of failing."""
    import freetoken.kernels.attention_cudnn as m

    def boom(*a, **k):
        raise RuntimeError("no cuDNN attention here")

    def wrong(q, k, v, causal, scale):
        return torch.zeros_like(q), torch.zeros(q.shape[:3])

    def right(q, k, v, causal, scale):  # plain attention with its log-sum-exp, as the op answers
        kf, vf = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        s = q @ kf.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(s, -1) @ vf, torch.logsumexp(s, -1)

    for fake, works in ((boom, False), (wrong, False), (right, True)):
        monkeypatch.setattr(m, "_cudnn_attend", fake)
        m.cudnn_attention_works.cache_clear()
        assert m.cudnn_attention_works(torch.device("cpu"), 4, 2, 16, torch.float32) is works, fake.__name__
    m.cudnn_attention_works.cache_clear()


def test_bad_choice_stops_start_up(monkeypatch, tmp_path):
    """``FREETOKEN_EXTEND_ATTENTION`` with an unknown value is refused when the worker starts, in one line naming the
    variable, not at its first prefill."""
    from conftest import assert_start_up_refuses

    assert_start_up_refuses(monkeypatch, tmp_path, "FREETOKEN_EXTEND_ATTENTION", "auto")


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests!r})
    from test_attention_cudnn import partials
    from freetoken.kernels.attention_cudnn import merge_two_torch, merge_two_triton
    for i, (nh, T, DV, dtype) in enumerate([(3, 5, 8, torch.float32), (2, 4, 24, torch.bfloat16)]):
        (o1, l1, o2, l2), _ = partials(nh, T, 6, 3, DV, dtype, seed=i)
        o1 = o1.transpose(0, 1).contiguous().transpose(0, 1)  # token-major storage: strides as cuDNN may give them
        l2 = l2.t().contiguous().t()
        got, want = merge_two_triton(o1, l1, o2, l2), merge_two_torch(o1, l1, o2, l2)
        assert got.shape == (T, nh, DV) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (got.float() - want.float()).abs().max() < tol, (got - want).abs().max()
    print("OK")
    """
)


def test_merge_kernel_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nh, nkv, D", [(16, 2, 256), (8, 8, 128)])
@pytest.mark.parametrize("new, prefix", [(1100, 0), (1100, 3000), (2184, 27816)])
def test_cudnn_extend_matches_triton(nh, nkv, D, new, prefix):
    """The cuDNN route (two calls and the merge) against our Triton extend kernel over a scattered page table, and
    the probe passing on this GPU (a probe that fails where cuDNN should work would silently lose the speed)."""
    from freetoken.kernels.attention import extend_attention_triton
    from freetoken.kernels.attention_cudnn import cudnn_attention_works, extend_attention_cudnn

    dev, dt = torch.device("cuda"), torch.bfloat16
    assert cudnn_attention_works(dev, nh, nkv, D, dt)
    ctx = new + prefix
    gen = torch.Generator(device=dev).manual_seed(new + prefix + D)
    kc = torch.randn(ctx + 64, nkv, D, device=dev, dtype=dt, generator=gen)
    vc = torch.randn(ctx + 64, nkv, D, device=dev, dtype=dt, generator=gen)
    r2t = torch.randperm(ctx + 64, device=dev, generator=gen)[:ctx].to(torch.int32).view(1, ctx)
    q = torch.randn(new, nh, D, device=dev, dtype=dt, generator=gen)
    cu = torch.tensor([0, new], dtype=torch.int32, device=dev)
    pre = torch.tensor([prefix], dtype=torch.int32, device=dev)
    rows = torch.zeros(1, dtype=torch.int32, device=dev)
    want = extend_attention_triton(q, kc, vc, r2t, rows, cu, pre, D**-0.5, new, max_context=ctx)
    got = extend_attention_cudnn(q, kc, vc, r2t[0], prefix, D**-0.5)
    assert got.shape == want.shape and got.dtype == dt
    assert (got.float() - want.float()).abs().max() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_prefill_through_cudnn_matches_triton(tmp_path, monkeypatch):
    """A tiny bf16 hybrid model on CUDA: a 2,600-token prompt in 1,024-token chunks (the later ones after a cached
    prefix) through the attention layers' cuDNN route and through the Triton kernel, same engine: the same first
    token at about the same logprob, and the route really taken (or not) in each."""
    import hf_reference as R

    import freetoken.kernels.attention as attention
    from freetoken import LLM, SamplingParams

    calls = []
    real = attention.extend_attention_cudnn

    def counted(*a, **k):
        calls.append(a[4])  # the chunk's cached prefix
        return real(*a, **k)

    monkeypatch.setattr(attention, "extend_attention_cudnn", counted)
    d = str(tmp_path / "tiny-qwen3_5_moe")
    os.makedirs(d)
    R.write_released_qwen3_5_moe(d, seed=13, max_position_embeddings=8192)
    llm = LLM(
        d, device="cuda", dtype="bfloat16", max_seq_len_override=8192, max_prefill_length=1024, cache_type="naive",
        load_progress=False,
    )  # fmt: skip
    prompt = [(i * 37) % 5000 + 3 for i in range(2600)]
    outs, taken = {}, {}
    for choice in ("cudnn", "triton"):
        monkeypatch.setenv("FREETOKEN_EXTEND_ATTENTION", choice)
        calls.clear()
        outs[choice] = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        taken[choice] = sorted(set(calls))
    assert taken == {"cudnn": [0, 1024], "triton": []}  # the last chunk (552 tokens) is under MIN_TOKENS
    assert outs["cudnn"].token_ids == outs["triton"].token_ids
    assert abs(outs["cudnn"].logprobs[0] - outs["triton"].logprobs[0]) < 0.05
