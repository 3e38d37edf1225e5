"""The KV store kernel (``kernels/kv_store.py``) vs its torch reference: on CPU under TRITON_INTERPRET=1 (in a
subprocess, so the interpreter is on before triton compiles anything) and on CUDA (``gpu`` marker). A store only
moves bits, so results must be equal."""

import os
import textwrap

import pytest
import torch
from triton_interpreter import run_under_interpreter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_store_kv(T, nkv, D, DV, dtype, device, strided=False, duplicate=False, seed=0):
    """``strided``: k and v are column slices of one fused projection output; ``duplicate``: the last two tokens
    share a slot (CUDA-graph padding rows), checked for holding one of their rows."""
    from freetoken.kernels.kv_store import store_kv_torch, store_kv_triton

    g = torch.Generator().manual_seed(seed)
    slots = 3 * T + 4
    caches = [
        (
            torch.randn(slots, nkv, D, generator=g).to(device, dtype),
            torch.randn(slots, nkv, DV, generator=g).to(device, dtype),
        )
        for _ in range(2)
    ]
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    if strided:
        qkv = torch.randn(T, 8 + nkv * (D + DV), generator=g).to(device, dtype)
        k = qkv[:, 8 : 8 + nkv * D].view(T, nkv, D)
        v = qkv[:, 8 + nkv * D :].view(T, nkv, DV)
    else:
        k = torch.randn(T, nkv, D, generator=g).to(device, dtype)
        v = torch.randn(T, nkv, DV, generator=g).to(device, dtype)
    loc = torch.randperm(slots, generator=g)[:T].to(device)
    if duplicate:
        loc[-1] = loc[-2]
    store_kv_triton(*caches[0], loc, k, v)
    store_kv_torch(*caches[1], loc, k, v)
    n = T - 2 if duplicate else T  # the rows whose slot no other row writes
    assert torch.equal(caches[0][0][loc[:n]], k[:n]) and torch.equal(caches[0][1][loc[:n]], v[:n])
    if duplicate:  # one of the two writers' rows
        assert any(torch.equal(caches[0][0][loc[-1]], k[i]) for i in (-1, -2))
        keep = torch.ones(slots, dtype=torch.bool, device=device)
        keep[loc[-1]] = False
        caches = [(kc[keep], vc[keep]) for kc, vc in caches]
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_dispatch_uses_the_reference_off_cuda():
    from freetoken.kernels.kv_store import store_kv

    kc, vc = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    k, v = torch.ones(2, 2, 8, dtype=torch.bfloat16), torch.full((2, 2, 8), 2.0)
    store_kv(kc, vc, torch.tensor([3, 1]), k, v)  # a cast to the pool's dtype
    assert kc[[3, 1]].eq(1).all() and vc[[3, 1]].eq(2).all() and kc[[0, 2]].eq(0).all()


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    import test_kv_store as t
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        t.check_store_kv(1, 2, 16, 16, dt, "cpu")
        t.check_store_kv(5, 3, 24, 8, dt, "cpu", strided=True, duplicate=True)
    print("OK")
    """
)


def test_store_kv_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "T,nkv,D,DV,strided",
    [(1, 2, 256, 256, True), (37, 2, 256, 256, True), (300, 8, 128, 128, False), (7, 3, 80, 96, True)],
)
def test_store_kv_cuda(T, nkv, D, DV, strided, dtype):
    check_store_kv(T, nkv, D, DV, dtype, "cuda", strided=strided, duplicate=T > 1, seed=T)
