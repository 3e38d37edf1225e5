"""A step's host arrays reach the device in one copy (``engine/host_upload.py``): values, shapes and dtypes, and
``ForwardBatch.from_plan`` built on it (page-table entries written, KV slots gathered) equal to the arrays computed
on the host; on CUDA the whole ``from_plan`` runs without stopping the host (sync debug mode set to error)."""

from __future__ import annotations

import pytest
import torch

from freetoken.cache.kv_pool import KVCachePool
from freetoken.engine.forward_batch import ForwardBatch
from freetoken.engine.host_upload import upload_int_arrays
from freetoken.engine.step_plan import StepPlan


def test_upload_keeps_values_and_shapes_as_int64():
    arrays = [
        torch.tensor([3, 1, 2]),
        torch.zeros(0, dtype=torch.int64),
        torch.tensor([[7, 8], [9, 10]], dtype=torch.int32),
    ]
    out = upload_int_arrays(arrays, torch.device("cpu"))
    assert [o.shape for o in out] == [a.shape for a in arrays]
    assert all(o.dtype == torch.int64 for o in out)
    for o, a in zip(out, arrays):
        assert torch.equal(o, a.long())
    out[0][0] = 99  # a copy: the plan's own arrays are left alone
    assert arrays[0][0] == 3
    assert upload_int_arrays([], torch.device("cpu")) == []


def test_every_array_starts_16_byte_aligned():
    """Triton specializes on each pointer's 16-byte divisibility: whatever the lengths before it (a step's token and
    sequence counts), each array must start aligned, or an unseen specialization compiles on the request path."""
    for lengths in ([1, 1, 3], [3, 33, 32, 32, 5], [2, 0, 7, 1], [4, 6]):
        arrays = [torch.arange(n) + 10 * i for i, n in enumerate(lengths)]
        out = upload_int_arrays(arrays, torch.device("cpu"))
        assert all(o.data_ptr() % 16 == 0 for o in out), lengths
        assert all(torch.equal(o, a) for o, a in zip(out, arrays))


_GREEDY = dict(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, seed=0)


def _plan_and_pool(device):
    kv = KVCachePool(1, 64, 1, 4, torch.float32, torch.device(device), max_rows=3, max_context=16)
    steps = [
        dict(tokens=[5, 6, 7], prefix_len=0, row=0, table_from=0, table_slots=[10, 11, 12], sample=_GREEDY),
        dict(tokens=[8], prefix_len=4, row=2, table_from=4, table_slots=[40], sample=_GREEDY),
    ]
    return StepPlan.build(steps), kv


def _expected():
    """What the batch must hold, worked out by hand from the plan."""
    return dict(
        positions=[0, 1, 2, 4],
        out_cache_loc=[10, 11, 12, 40],
        cu_seqlens=[0, 3, 4],
        prefix_lens=[0, 4],
        context_lens=[3, 5],
        rows=[0, 2],
        logits_indices=[2, 3],
    )


def check_from_plan(device):
    plan, kv = _plan_and_pool(device)
    kv.req_to_token[2, :4] = torch.tensor([30, 31, 32, 33], dtype=torch.int32)  # row 2's cached prefix
    batch = ForwardBatch.from_plan(plan, kv, attn=None)
    want = _expected()
    for name, values in want.items():
        t = getattr(batch, name)
        assert t.device.type == torch.device(device).type, name
        assert t.tolist() == values, (name, t.tolist())
    assert batch.cu_seqlens.dtype == batch.prefix_lens.dtype == batch.context_lens.dtype == torch.int32
    assert batch.out_cache_loc.dtype == batch.positions.dtype == batch.rows.dtype == torch.int64
    assert batch.input_ids.tolist() == [5, 6, 7, 8]
    assert kv.req_to_token[0, :3].tolist() == [10, 11, 12] and kv.req_to_token[2, :5].tolist() == [30, 31, 32, 33, 40]
    assert batch.extend_lens_cpu == [3, 1] and batch.prefix_lens_cpu == [0, 4] and not batch.is_decode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_array_starts_16_byte_aligned_on_cuda():
    arrays = [torch.arange(n) for n in (3, 33, 32, 5)]
    out = upload_int_arrays(arrays, torch.device("cuda"))
    assert all(o.data_ptr() % 16 == 0 for o in out)
    assert all(torch.equal(o.cpu(), a) for o, a in zip(out, arrays))


def test_from_plan_cpu():
    check_from_plan("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_from_plan_cuda_does_not_stop_the_host():
    check_from_plan("cuda")
    plan, kv = _plan_and_pool("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ForwardBatch.from_plan(plan, kv, attn=None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
