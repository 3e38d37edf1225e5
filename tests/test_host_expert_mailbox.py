"""The hybrid backend's mailbox: a polling host thread (``freetoken._core.CpuExpertMailbox``) answering the GPU's
requests (``kernels/host_expert_mailbox.py``). The thread against the executor's forward with requests written by
hand; the kernels and the thread together on the CPU under ``TRITON_INTERPRET=1`` (a subprocess) against the
direct CPU path, a layer without host pairs ringing nothing, and a host that never answers faulting the step; on
CUDA the same, pinned and through UVA."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch
from triton_interpreter import run_under_interpreter

from freetoken.moe.cpu_experts import CpuExperts

BF16 = torch.bfloat16


def _bank(E=6, H=64, I=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(BF16), (torch.randn(E, H, I, generator=g) * 0.1).to(BF16)


def _wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "the mailbox thread did not answer"
        time.sleep(0.001)


def test_the_thread_answers_requests_written_by_hand():
    """What the pack kernel does, done by hand: inputs first, then ``(seq << 16) | call`` in word 0; the thread runs
    the call (its output overwritten) and writes the request to word 1. A failed call answers too, with zeros and
    its error kept."""
    from freetoken import _core

    gate_up, down = _bank()
    experts = CpuExperts((gate_up, down), threads=2)
    control = torch.zeros(3, dtype=torch.int64)
    mailbox = _core.CpuExpertMailbox(control, control.data_ptr())
    assert mailbox.polling and mailbox.answered == 0 and mailbox.busy_seconds == 0.0
    T, k, H = 3, 2, 64
    bufs = []
    for _ in range(2):  # two calls over their own buffers: the request's low bits pick one
        x, ids, w = torch.randn(T, H).to(BF16), torch.zeros(T, k, dtype=torch.int64), torch.rand(T, k)
        out = torch.full((T, H), 7.0)
        bufs.append((x, ids, w, out, experts.mailbox_call(mailbox, x, ids, w, out)))
    assert [b[4] for b in bufs] == [0, 1]
    for seq, (ids, call) in enumerate([([[0, 5], [-1, 2], [3, 3]], 1), ([[4, -1], [-1, -1], [1, 0]], 0)], start=1):
        x, ids_buf, w, out, _ = bufs[call]
        ids_buf.copy_(torch.tensor(ids))
        request = (seq << 16) | call
        control[0] = request
        _wait_for(lambda: int(control[1]) == request)
        # what the executor's forward computes (against the torch references: test_cpu_experts.py), overwritten
        torch.testing.assert_close(out, experts.forward(x, ids_buf, w), atol=1e-6, rtol=1e-6)
    assert mailbox.answered == 2 and mailbox.take_errors() == []
    busy = mailbox.busy_seconds  # the time spent in the two calls (the worker reports it per step)
    assert 0.0 < busy < 10.0
    x, ids_buf, w, out, _ = bufs[0]
    ids_buf[1, 0] = 6  # outside the bank: zeros, the error kept, and still an answer
    control[0] = request = (3 << 16) | 0
    _wait_for(lambda: int(control[1]) == request)
    assert torch.equal(out, torch.zeros_like(out))
    assert [(i, "outside the bank" in m) for i, m in mailbox.take_errors()] == [(0, True)]
    assert mailbox.take_errors() == []
    with pytest.raises(ValueError, match="outside the bank's 6 experts"):
        mailbox.run(0)  # here and now, as the thread runs it
    mailbox.take_errors()
    control[0] = request = (4 << 16) | 5  # no call 5: answered all the same (the GPU must not wait), and reported
    _wait_for(lambda: int(control[1]) == request)
    assert mailbox.take_errors() == [(5, f"request {request:#x} names no call")]
    mailbox.close()
    assert not mailbox.polling
    with pytest.raises(ValueError, match="control"):
        _core.CpuExpertMailbox(control, control.data_ptr() + 4)


def check_mailbox_against_direct(device: str, seed: int = 0):
    """``HybridExperts`` through the mailbox (pack kernel, the thread, wait kernel) against its direct CPU path, over
    random cache outcomes: each layer's output is the GPU part plus the host's sums; a layer the cache fully served
    rings nothing and leaves the output as it was."""
    from freetoken.moe.hybrid_experts import HybridExperts

    E, H, I, T, k = 8, 64, 32, 3, 2
    banks = [_bank(E, H, I, seed=layer) for layer in range(2)]
    direct = HybridExperts(banks, torch.device("cpu"), max_fetch=1, threads=2)
    hybrid = HybridExperts(banks, torch.device(device), max_fetch=1, threads=2)
    if hybrid.mailbox is None:
        hybrid._open_mailbox(torch.device(device))
    gen = torch.Generator().manual_seed(seed)
    for step in range(6):
        for layer in range(2):
            x = torch.randn(T, H, generator=gen).to(BF16)
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
            w = torch.rand(T, k, generator=gen)
            # step 0: the cache left nothing for the host; else about half the pairs
            slots = torch.where(torch.rand(T, k, generator=gen) < (0.0 if step == 0 else 0.5), -1, 7).to(torch.int32)
            y = torch.randn(T, H, generator=gen).to(BF16)
            want = direct.finish(direct.start(layer, x, ids, slots, w), y.clone())
            answered = hybrid.mailbox.answered
            dev = [t.to(device) for t in (x, ids, slots, w, y)]
            got = hybrid.finish(hybrid.start(layer, *dev[:4]), dev[4]).cpu()
            rang = bool((slots < 0).any())
            assert hybrid.mailbox.answered == answered + rang
            if not rang:
                assert torch.equal(got, y)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    hybrid.check_errors()
    assert int(hybrid.state[0]) == hybrid.mailbox.answered > 0
    # a failed host call (an expert id outside the bank): zeros added, and the worker's check names the layer
    bad = torch.full((T, k), E, device=device)
    y = torch.ones(T, H, dtype=BF16, device=device)
    hybrid.finish(hybrid.start(1, x.to(device), bad, torch.full((T, k), -1, device=device), w.to(device)), y)
    assert torch.equal(y.cpu(), torch.ones(T, H, dtype=BF16))
    with pytest.raises(RuntimeError, match=f"MoE layer 1 \\({T} tokens\\): .*outside the bank's {E} experts"):
        hybrid.check_errors()
    hybrid.check_errors()  # reported once


def check_a_silent_host_faults_the_step(device: str):
    """A mailbox whose thread never runs: the wait gives up after ``max_spins`` polls, sets the fault word, leaves
    the output alone; the next layer neither rings nor waits, and the worker's check raises."""
    from freetoken.kernels.host_expert_mailbox import pack_for_host, wait_and_add
    from freetoken.moe.hybrid_experts import HybridExperts

    hybrid = HybridExperts([_bank()], torch.device("cpu"), max_fetch=0, threads=2)
    hybrid._open_mailbox(torch.device(device), start=False)
    T, k, H = 2, 2, 64
    buf = hybrid._buffers_for(T, k, H)
    call = hybrid.layers[0].mailbox_call(hybrid.mailbox, buf.x, buf.ids, buf.weights, buf.out)
    x, ids = torch.randn(T, H, device=device).to(BF16), torch.tensor([[0, 1], [2, 3]], device=device)
    slots, w = torch.full((T, k), -1, dtype=torch.int32, device=device), torch.rand(T, k, device=device)
    y = torch.ones(T, H, dtype=BF16, device=device)
    pack_for_host(x, ids, slots, w, buf.x, buf.ids, buf.weights, hybrid.control, hybrid.state, call)
    assert int(hybrid.control[0]) == (1 << 16) | call
    wait_and_add(y, buf.out, hybrid.control, hybrid.state, max_spins=50)
    assert torch.equal(y.cpu(), torch.ones(T, H, dtype=BF16)) and int(hybrid.control[2]) == 1
    with pytest.raises(RuntimeError, match="did not answer"):
        hybrid.check_errors()
    pack_for_host(x, ids, slots, w, buf.x, buf.ids, buf.weights, hybrid.control, hybrid.state, call)
    assert int(hybrid.control[0]) == (1 << 16) | call and int(hybrid.state[1]) == 0  # no second request


_CPU_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import test_host_expert_mailbox as t
    t.check_mailbox_against_direct("cpu")
    t.check_a_silent_host_faults_the_step("cpu")
    print("OK")
    """
)


def test_mailbox_kernels_and_thread_interpreter_cpu():
    run_under_interpreter(_CPU_SCRIPT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mailbox_cuda():
    check_mailbox_against_direct("cuda")
    check_a_silent_host_faults_the_step("cuda")
