"""``DeviceExpertCache`` (expert cache bookkeeping on the device) against the host ``ExpertSlotCache``: the same
decisions after every call of long random sequences, under both eviction policies (slot_of, owner, stamps,
routing counts with their ageing, hit and miss counts, slot contents), padding rows, the Triton admission and gather kernels (CPU under TRITON_INTERPRET=1 in a subprocess;
CUDA, the gather reading a pinned host bank), an audit that ``ensure`` neither syncs nor takes data-dependent
shapes, and a CUDA-graph capture of ``ensure`` + the grouped MoE kernel replayed with new routing."""

from __future__ import annotations

import os
import random
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_interpreter import run_under_interpreter

from freetoken.engine.sync_audit import no_host_sync
from freetoken.kernels.expert_gather import gather_experts_torch
from freetoken.moe.device_slot_cache import DeviceExpertCache
from freetoken.moe.fetch_cap import FetchCap
from freetoken.moe.slot_cache import ExpertSlotCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, E = 3, 16
GATE_UP, DOWN = (6, 4), (4, 3)


def make_banks(seed: int = 0, dtype=torch.float32, layers: int = L, experts: int = E, gate_up=GATE_UP, down=DOWN):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(experts, *gate_up, generator=g).to(dtype), torch.randn(experts, *down, generator=g).to(dtype))
        for _ in range(layers)
    ]


def routing_sequence(
    T: int, k: int, S: int, calls: int, seed: int, padded: bool = False, layers: int = L, experts: int = E
):
    """``(layer, ids [T, k], num_valid)`` with at most ``S`` distinct experts among the valid rows, drawn from a
    skewed per-layer popularity (so there are hits as well as misses); a third of the calls use exactly as many
    distinct experts as they may (``S`` when it fits). Padding rows (``padded``) route anywhere."""
    rng = random.Random(seed)
    weight = [[1.0 / (1 + r) for r in rng.sample(range(experts), experts)] for _ in range(layers)]
    for _ in range(calls):
        layer = rng.randrange(layers)
        m = rng.randint(k, min(S, experts))
        keys = sorted(range(experts), key=lambda e: -(rng.random() ** (1.0 / weight[layer][e])))
        chosen = keys[:m]
        if rng.random() < 0.3 and T * k >= m:  # cover every chosen expert
            rows = [[chosen[(t * k + j) % m] for j in range(k)] for t in range(T)]
        else:
            rows = [rng.sample(chosen, k) for _ in range(T)]
        n = rng.randint(0, T) if padded else T
        rows = rows[:n] + [rng.sample(range(experts), k) for _ in range(T - n)]
        yield layer, torch.tensor(rows), n


def assert_same_state(device_cache: DeviceExpertCache, host: ExpertSlotCache, banks) -> None:
    assert device_cache.slot_of[:-1].tolist() == host.slot_of.reshape(-1).tolist()
    assert device_cache.owner[:-1].tolist() == host.owner.tolist()
    assert device_cache.stamp[:-1].tolist() == host.last_used.tolist()
    assert device_cache.freq[:-1].tolist() == host.freq.tolist()
    assert (device_cache.hits, device_cache.misses, device_cache.spilled) == (host.hits, host.misses, host.spilled)
    for slot, flat in enumerate(device_cache.owner[:-1].tolist()):
        if flat >= 0:
            gate_up, down = banks[flat // host.num_experts]
            assert torch.equal(device_cache.gate_up[slot].cpu(), gate_up[flat % host.num_experts])
            assert torch.equal(device_cache.down[slot].cpu(), down[flat % host.num_experts])


def replay_against_host(
    T, k, S, calls, seed=0, padded=False, impl="auto", device="cpu", banks=None, policy="lfu", age_every=7,
    fetch_cap=None,
):  # fmt: skip
    """Runs one routing sequence through both caches, comparing after every call. Returns (hits, misses).
    ``age_every`` small by default: the counts are halved many times in a replay."""
    banks = banks or make_banks(seed)
    gate_up, down = tuple(banks[0][0].shape[1:]), tuple(banks[0][1].shape[1:])
    dtype = banks[0][0].dtype
    policy_args = dict(policy=policy, age_every=age_every, fetch_cap=fetch_cap)
    host = ExpertSlotCache(S, L, E, gate_up, down, dtype, torch.device("cpu"), **policy_args)
    cache = DeviceExpertCache(S, L, E, gate_up, down, dtype, torch.device(device), impl=impl, **policy_args)
    for layer, ids, n in routing_sequence(T, k, S, calls, seed, padded):
        valid = torch.tensor(n, device=device) if padded else None
        got = cache.ensure(layer, *banks[layer], ids.to(device), valid)
        want = host.lookup(layer, *banks[layer], ids[:n])
        assert got.shape == (T, k) and got.dtype == torch.int64
        assert torch.equal(got[:n].cpu(), want)
        assert torch.equal(got[n:].cpu(), torch.zeros(T - n, k, dtype=torch.int64))  # padding: slot 0
        assert_same_state(cache, host, banks)
    cache.check_integrity()
    return cache.hits, cache.misses


# T, k, S: slots from "exactly the experts one call may need" to a few calls' worth; always >= k
CASES = [
    (1, 2, 2),
    (1, 2, 5),
    (1, 4, 4),
    (1, 4, 9),
    (3, 2, 6),
    (3, 2, 4),
    (3, 4, 12),
    (3, 4, 7),
    (8, 2, 16),
    (8, 2, 5),
    (8, 4, 16),
    (8, 4, 10),
]


@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize("T,k,S", CASES)
def test_device_cache_makes_the_host_caches_decisions(T, k, S, policy):
    hits, misses = replay_against_host(T, k, S, calls=250, seed=T * 100 + k * 10 + S, policy=policy)
    assert misses > 0 and (hits > 0 or S == k)


@pytest.mark.parametrize("max_fetch", [0, 1, 3])
@pytest.mark.parametrize("T,k,S", [(1, 4, 9), (3, 2, 6), (8, 4, 16), (8, 2, 5)])
def test_capped_admission_spills_the_least_routed_misses_to_the_host(T, k, S, max_fetch):
    """The hybrid backend's cap: at most ``max_fetch`` misses a call are admitted, the most routed first; the
    others keep slot id -1 and are counted as spilled, exactly as the host reference decides."""
    for policy in ("lfu", "lru"):
        replay_against_host(T, k, S, calls=200, seed=S + max_fetch, padded=True, policy=policy,
                            fetch_cap=FetchCap(max_fetch))  # fmt: skip
    banks = make_banks(1)
    cache = DeviceExpertCache(S, L, E, GATE_UP, DOWN, torch.float32, torch.device("cpu"), fetch_cap=FetchCap(max_fetch))
    ids = torch.arange(T * k).remainder(E).view(T, k)  # a cold cache: every expert a miss
    slots = cache.ensure(0, *banks[0], ids)
    assert len(set(ids[slots >= 0].tolist())) == min(max_fetch, cache.misses)
    assert cache.spilled == cache.misses - min(max_fetch, cache.misses) and cache.spilled > 0


@pytest.mark.parametrize("max_fetch,share", [(0, 500), (1, 334), (2, 1000), (3, 250)])
@pytest.mark.parametrize("T,k,S", [(1, 4, 9), (3, 2, 6), (8, 4, 16), (8, 2, 5)])
def test_a_fetch_share_admits_its_part_of_each_calls_misses(T, k, S, max_fetch, share):
    """A share: a call admits ``max(floor, ceil(share * misses))`` of its misses (the hybrid backend's auto cap, so
    that both sides of a layer finish together at any batch), as the host reference decides."""
    cap = FetchCap(max_fetch, share)
    for policy in ("lfu", "lru"):
        replay_against_host(T, k, S, calls=150, seed=S + share, padded=True, policy=policy, fetch_cap=cap)
    cache = DeviceExpertCache(S, L, E, GATE_UP, DOWN, torch.float32, torch.device("cpu"), fetch_cap=cap)
    ids = torch.arange(T * k).remainder(E).view(T, k)  # a cold cache: every distinct expert a miss
    slots = cache.ensure(0, *make_banks(1)[0], ids)
    admitted = len(set(ids[slots >= 0].tolist()))
    assert admitted == min(cache.misses, cap.of(cache.misses, T))
    assert FetchCap(1, 334).of(7, 2) == 3 and FetchCap(3, 250).of(7, 2) == 3 and FetchCap(0, 1000).of(7, 2) == 7


@pytest.mark.parametrize("T,k,S", [(1, 4, 9), (1, 8, 12), (3, 2, 6), (8, 4, 16)])
def test_a_one_token_cap_replaces_the_share_at_one_token_steps(T, k, S):
    """A one-token cap (the auto cap's one-stream setting): a call with one valid token admits exactly that many of
    its misses (no share, no floor), larger calls keep ``max(floor, ceil(share * misses))``; padded calls count
    their valid rows, as the host reference decides."""
    cap = FetchCap(3, 500, one_token=2)
    for policy in ("lfu", "lru"):
        replay_against_host(T, k, S, calls=150, seed=S + T, padded=True, policy=policy, fetch_cap=cap)
    assert cap.of(8, tokens=1) == 2
    assert cap.of(8, tokens=2) == 4 and FetchCap(3, 500).of(8, tokens=1) == 4
    for tokens in (1, T):  # a cold cache: every distinct expert a miss
        cache = DeviceExpertCache(S, L, E, GATE_UP, DOWN, torch.float32, torch.device("cpu"), fetch_cap=cap)
        ids = torch.arange(T * k).remainder(E).view(T, k)
        slots = cache.ensure(0, *make_banks(1)[0], ids, torch.tensor(tokens))
        admitted = len(set(ids[:tokens][slots[:tokens] >= 0].tolist()))
        assert admitted == min(cache.misses, cap.of(cache.misses, tokens))
        if tokens == 1:
            assert admitted == min(2, cache.misses)


def test_a_negative_fetch_cap_or_a_share_past_1000_is_refused():
    with pytest.raises(ValueError, match="floor"):
        FetchCap(-1)
    with pytest.raises(ValueError, match="share"):
        FetchCap(1, 1001)
    with pytest.raises(ValueError, match="one-token"):
        FetchCap(1, one_token=-1)


@pytest.mark.parametrize("T,k,S", [(3, 2, 6), (8, 4, 10), (8, 2, 5)])
def test_padding_rows_count_nothing_and_fetch_nothing(T, k, S):
    replay_against_host(T, k, S, calls=250, seed=7 + S, padded=True)


def test_all_padding_only_ticks_the_clock():
    banks = make_banks()
    cache = DeviceExpertCache(4, L, E, GATE_UP, DOWN, torch.float32, torch.device("cpu"))
    cache.ensure(0, *banks[0], torch.tensor([[1, 2]]))
    state = lambda: (cache.slot_of[:-1], cache.owner[:-1], cache.stamp[:-1], cache.counts)  # noqa: E731 (no trash)
    before = [t.clone() for t in state()]
    slots = cache.ensure(1, *banks[1], torch.tensor([[5, 6], [7, 8]]), torch.tensor(0))
    assert torch.equal(slots, torch.zeros(2, 2, dtype=torch.int64))
    after = state()
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and int(cache.clock) == 2


def test_gather_reference_copies_exactly_the_live_jobs():
    banks = make_banks(1)
    pool_gate_up, pool_down = torch.randn(5, *GATE_UP), torch.randn(5, *DOWN)
    src, dst = torch.tensor([3, 1, 6, 0]), torch.tensor([4, 0, 2, 1])
    for n in range(5):
        gu, d = pool_gate_up.clone(), pool_down.clone()
        gather_experts_torch(*banks[0], gu, d, src, dst, torch.tensor(n))
        want_gu, want_d = pool_gate_up.clone(), pool_down.clone()
        want_gu[dst[:n]], want_d[dst[:n]] = banks[0][0][src[:n]], banks[0][1][src[:n]]
        assert torch.equal(gu, want_gu) and torch.equal(d, want_d)


# ------------------------------------------------------------------------------------------------------------
# ensure has no host sync and no data-dependent shape
# ------------------------------------------------------------------------------------------------------------


class ShapeTrace(TorchDispatchMode):
    """Records every operator with the shapes of its outputs."""

    def __init__(self):
        super().__init__()
        self.trace = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.trace.append((str(func), tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))))
        return out


@pytest.mark.parametrize("T,k,S", [(1, 4, 6), (8, 2, 12)])
def test_ensure_neither_syncs_nor_sizes_anything_by_the_data(T, k, S):
    banks = make_banks()
    cache = DeviceExpertCache(S, L, E, GATE_UP, DOWN, torch.float32, torch.device("cpu"))
    traces = []
    for layer, ids, n in routing_sequence(T, k, S, calls=12, seed=3, padded=True):
        valid = torch.tensor(n)
        with no_host_sync(), ShapeTrace() as shapes:
            cache.ensure(layer, *banks[layer], ids, valid)
        traces.append(shapes.trace)
    assert all(t == traces[0] for t in traces)  # the same ops with the same shapes whatever the routing
    assert cache.misses > 0


# ------------------------------------------------------------------------------------------------------------
# The Triton kernels (admission, gather) under the interpreter
# ------------------------------------------------------------------------------------------------------------

_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from freetoken.kernels.expert_gather import gather_experts_torch, gather_experts_triton
    from freetoken.moe.fetch_cap import FetchCap
    from test_device_slot_cache import make_banks, replay_against_host
    # several chunks per expert, partial last chunks, gate_up and down of different sizes
    shapes = [((6, 40), (40, 3), 64, 32), ((8, 16), (16, 4), 32, 16), ((2, 3), (3, 1), 16, 16)]
    for gate_up, down, chunk, block in shapes:
        banks = make_banks(2, gate_up=gate_up, down=down, layers=1, experts=7)
        src, dst = torch.tensor([3, 1, 6, 0, 2]), torch.tensor([4, 0, 2, 1, 3])
        for n in range(6):
            pools = [torch.randn(5, *gate_up), torch.randn(5, *down)]
            ref = [p.clone() for p in pools]
            gather_experts_triton(*banks[0], *pools, src, dst, torch.tensor(n), chunk=chunk, block=block)
            gather_experts_torch(*banks[0], *ref, src, dst, torch.tensor(n))
            assert all(torch.equal(a, b) for a, b in zip(pools, ref)), (gate_up, n)
    # the Triton admission and gather against the host cache, with the pool's stamps scanned in several blocks
    # and the pairs compared in several tiles
    from freetoken.kernels import expert_admission
    expert_admission.SLOT_BLOCK, expert_admission.PAIR_TILE = 4, 8
    banks = make_banks(5, dtype=torch.float16)
    for T, k, S, padded in [(1, 4, 4, False), (1, 2, 5, True), (3, 2, 6, True), (8, 2, 5, False), (8, 4, 10, True),
                            (8, 4, 30, True)]:
        for policy in ("lfu", "lru"):
            replay_against_host(T, k, S, calls=40, seed=S, padded=padded, impl="triton", banks=banks, policy=policy,
                                age_every=5)
            # the hybrid backend's cap, with a share, and with the auto cap's one-token setting
            for cap in (FetchCap(0), FetchCap(2), FetchCap(1, 500), FetchCap(3, 500, one_token=2)):
                replay_against_host(T, k, S, calls=25, seed=S, padded=padded, impl="triton", banks=banks,
                                    policy=policy, age_every=5, fetch_cap=cap)
    print("OK")
    """
)


def test_triton_admission_and_gather_interpreter_cpu():
    run_under_interpreter(_INTERPRETER_SCRIPT)


# ------------------------------------------------------------------------------------------------------------
# The offloaded experts pass num_valid_tokens through
# ------------------------------------------------------------------------------------------------------------


def test_offloaded_experts_hand_num_valid_tokens_to_the_cache():
    from freetoken.kernels.fused_moe import fused_moe_torch
    from freetoken.moe.offload import ExpertOffload

    H, I, T, k = 8, 4, 4, 2
    off = ExpertOffload(torch.device("cpu"), torch.float32, top_k=k)
    experts = off.make_experts(0, E, H, I)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g))
        experts.down_proj.copy_(torch.randn(E, H, I, generator=g))
    off.finish_loading()
    off.allocate_cache(8)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    ids = torch.tensor([[0, 1], [2, 0], [9, 10], [11, 12]])
    off.num_valid_tokens = torch.tensor(2)
    with torch.no_grad():
        out = experts(x, ids, w)
        ref = fused_moe_torch(x[:2], experts.gate_up_proj, experts.down_proj, ids[:2], w[:2])
    torch.testing.assert_close(out[:2], ref)
    assert off.counters() == (0, 3) and off.cache.resident(0) == [0, 1, 2]


# ------------------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pinned(banks):
    # torch's pinned allocator (cudaHostAlloc: mapped under UVA). The engine's banks, registered in place
    # (moe/host_pinning.py), go through the same kernel in
    # test_expert_offload.py::test_offload_matches_resident_experts_on_cuda; registering small test tensors here
    # could fail on pages they share with other allocations.
    return [(gate_up.pin_memory(), down.pin_memory()) for gate_up, down in banks]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("T,k,S", [(1, 4, 4), (3, 2, 6), (8, 4, 10), (8, 2, 16), (32, 8, 300)])
def test_device_cache_on_cuda_reads_the_pinned_bank(T, k, S, impl):
    """Both admissions on CUDA, the Triton gather reading host memory through its device address."""
    banks = _pinned(make_banks(T, dtype=torch.bfloat16, gate_up=(64, 96), down=(96, 32)))
    assert all(t.is_pinned() for bank in banks for t in bank)
    for policy in ("lfu", "lru"):
        replay_against_host(
            T, k, S, calls=150, seed=S, padded=True, impl=impl, device="cuda", banks=banks, policy=policy
        )


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_ensure_and_grouped_kernel_captured_in_a_cuda_graph(impl):
    """One graph holds every MoE layer (admission, gather of the misses from pinned host banks, grouped kernel
    over the slot pool); each replay gets new routing and a new count of valid tokens. The outputs equal the
    reference over all-resident experts, the cache state equals the host cache's after the same lookups."""
    from freetoken.kernels.fused_moe import fused_moe_torch, fused_moe_triton

    T, k, S, H, I = 4, 2, 8, 128, 64
    banks = _pinned(
        [(gu * 0.1, d * 0.1) for gu, d in make_banks(11, dtype=torch.bfloat16, gate_up=(2 * I, H), down=(H, I))]
    )
    host = ExpertSlotCache(S, L, E, (2 * I, H), (H, I), torch.bfloat16, torch.device("cpu"))
    cache = DeviceExpertCache(S, L, E, (2 * I, H), (H, I), torch.bfloat16, torch.device("cuda"), impl=impl)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(L, T, k, dtype=torch.int64, device="cuda")
    w = torch.full((T, k), 0.5, device="cuda", dtype=torch.bfloat16)
    valid = torch.tensor(T, device="cuda")
    seq = routing_sequence(T, k, S, calls=10**6, seed=5)
    rng = random.Random(0)

    def new_routing() -> int:
        for layer in range(L):
            ids[layer].copy_(next(seq)[1])
        n = rng.randint(0, T)
        valid.fill_(n)
        return n

    def moe_layers():
        return [
            fused_moe_triton(x, cache.gate_up, cache.down, cache.ensure(layer, *banks[layer], ids[layer], valid), w)
            for layer in range(L)
        ]

    def host_lookups(n):
        for layer in range(L):
            host.lookup(layer, *banks[layer], ids[layer][:n].cpu())

    n = new_routing()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels before capture
        moe_layers()
    torch.cuda.current_stream().wait_stream(side)
    host_lookups(n)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture records, it does not run: the cache state is unchanged
        outs = moe_layers()
    assert_same_state(cache, host, banks)
    for _ in range(8):
        n = new_routing()
        x.copy_(torch.randn_like(x))
        graph.replay()
        host_lookups(n)
        assert_same_state(cache, host, banks)
        for layer in range(L):
            ref = fused_moe_torch(x[:n], banks[layer][0].cuda(), banks[layer][1].cuda(), ids[layer][:n], w[:n])
            torch.testing.assert_close(outs[layer][:n].float(), ref.float(), atol=3e-2, rtol=3e-2)
