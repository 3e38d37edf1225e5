"""The start-up memory plan: every pool in the table, the KV budget arithmetic, and on CUDA the measured
prefill workspace against ``torch.cuda.max_memory_allocated`` after a real max-length prefill."""

from __future__ import annotations

import pytest
import torch

from freetoken.memory_plan import GiB, MemoryPlan


def _one_prompt(tokens):
    from freetoken.engine.step_plan import StepPlan

    tokens = list(tokens)
    return StepPlan.build(
        [
            {
                "tokens": tokens,
                "prefix_len": 0,
                "row": 0,
                "table_from": 0,
                "table_slots": list(range(len(tokens))),
                "sample": {"temperature": 0.0},
            }
        ]
    )


def plan(**over) -> MemoryPlan:
    kw = dict(
        device="cuda:0",
        free_before=100 * GiB,
        memory_ratio=0.9,
        weights=40 * GiB,
        state_bytes=1 * GiB,
        scratch_kv_bytes=GiB // 2,
        workspace=3 * GiB,
        workspace_tokens=8192,
        reserve=GiB,
    )
    kw.update(over)
    return MemoryPlan(**kw)


def test_kv_budget_subtracts_every_planned_pool():
    p = plan()
    # 0.9 x 100 - 40 (loading) - 1 (state) - 0.5 (scratch) - 3 (workspace) - 1 (reserve) = 44.5 GiB
    assert p.kv_budget(used_by_loading=40 * GiB) == int(44.5 * GiB)
    assert plan(workspace=None).kv_budget(40 * GiB) == int(47.5 * GiB)
    assert plan(token_count_bytes=GiB // 2).kv_budget(40 * GiB) == int(44.0 * GiB)
    assert plan(sampling_workspace=GiB // 4, sampling_rows=32).kv_budget(40 * GiB) == int(44.25 * GiB)


def test_step_workspace_adds_the_sampling_of_many_rows():
    """What a step is checked against: the chunk's workspace plus the sampling workspace (None when unmeasured)."""
    assert plan().step_workspace == 3 * GiB
    assert plan(sampling_workspace=GiB // 4, sampling_rows=32).step_workspace == int(3.25 * GiB)
    assert plan(workspace=None, sampling_workspace=GiB).step_workspace is None


def test_table_lists_every_pool():
    p = plan(kv_tokens=1000, kv_bytes=2 * GiB, free_after=5 * GiB, live_state_slots=4, snapshot_slots=8)
    text = p.table()
    for label in (
        "weights",
        "KV cache (1000 tokens)",
        "recurrent state (4 live + 8 snapshot slots)",
        "output token counts",
        "prefill workspace (8192-token chunk)",
        "reserve (--vram-reserve-mb)",
        "headroom",
        "free after initialization",
    ):
        assert label in text, text
    assert "3.00 GiB" in text and "40.00 GiB" in text
    assert "not measured" in plan(workspace=None).table()
    assert "sampling workspace" not in text  # no rows planned (CPU)
    assert "sampling workspace (32 rows)" in plan(sampling_workspace=GiB // 4, sampling_rows=32).table()


def test_worker_logs_the_plan_on_cpu(tiny_llama_dir):
    import logging

    from freetoken.worker import Worker

    class Lines(logging.Handler):  # the freetoken logger does not propagate; listen on it directly
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    logging.getLogger("freetoken").addHandler(lines)
    try:
        w = Worker(
            {
                "model_path": tiny_llama_dir,
                "device": "cpu",
                "num_tokens": 512,
                "max_seq_len_override": 256,
                "load_progress": False,
            }
        )
    finally:
        logging.getLogger("freetoken").removeHandler(lines)
    assert w.memory_plan.kv_tokens == 512 and w.memory_plan.workspace is None
    assert any(line.startswith("Memory plan (cpu):") for line in lines.lines), lines.lines
    w.dry_run(128)  # the CUDA start-up's dry run path, on the scratch row and slots
    assert w.execute_plan(_one_prompt(range(1, 9)), _allow_scratch=False).tokens


def _chunk(tokens, prefix_len):
    """A prompt's next chunk on row 0, its KV in slots 0..prefix_len+len(tokens)."""
    from freetoken.engine.step_plan import StepPlan

    tokens = list(tokens)
    return StepPlan.build(
        [
            {
                "tokens": tokens,
                "prefix_len": prefix_len,
                "row": 0,
                "table_from": prefix_len,
                "table_slots": list(range(prefix_len, prefix_len + len(tokens))),
                "sample": {"temperature": 0.0},
            }
        ]
    )


@pytest.mark.gpu
def test_cuda_workspace_covers_a_max_length_prefill(tmp_path):
    """The dry run's measured workspace must cover every chunk of a max-length prompt (the last ones attend
    over the longest prefixes), and each step's own ``workspace_bytes`` must be the allocator's peak."""
    from conftest import make_tiny_llama_dir

    from freetoken.worker import Worker

    chunk, context = 512, 2048
    w = Worker(
        {
            "model_path": make_tiny_llama_dir(tmp_path, max_position_embeddings=context),
            "device": "cuda",
            "max_prefill_length": chunk,
            "max_seq_len_override": context,
            "load_progress": False,
            "memory_ratio": 0.5,
        }
    )
    p = w.memory_plan
    assert p.workspace is not None and p.workspace > 0 and p.workspace_tokens == chunk
    assert w.info()["planned_workspace_bytes"] == p.step_workspace
    for start in range(0, context, chunk):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = w.execute_plan(_chunk([1 + i % 250 for i in range(start, start + chunk)], start))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        print(
            f"\nchunk at {start}: planned workspace {p.workspace / 2**20:.1f} MiB, measured peak "
            f"{peak / 2**20:.1f} MiB, step stat {r.stats['workspace_bytes'] / 2**20:.1f} MiB"
        )
        assert r.stats["workspace_bytes"] == peak
        assert peak <= p.workspace * 1.1 + 2**20


@pytest.mark.gpu
def test_cuda_plan_covers_many_prompts_sampled_together(tmp_path):
    """A step that ends --max-running-requests prompts at once, every row on the filtered draw with penalties, stays
    within the planned step workspace (the chunk's plus the sampling of that many rows); the decode graphs' pool
    within its plan (planned from the allocator's segments, which the pool holds)."""
    from conftest import make_tiny_llama_dir

    from freetoken.engine.step_plan import StepPlan
    from freetoken.worker import Worker

    rows = 8
    w = Worker(
        {
            "model_path": make_tiny_llama_dir(tmp_path),
            "device": "cuda",
            "max_running_requests": rows,
            "max_seq_len_override": 256,
            "load_progress": False,
            "memory_ratio": 0.5,
        }
    )
    p = w.memory_plan
    assert p.sampling_rows == rows and p.sampling_workspace is not None and p.sampling_workspace > 0
    assert w.graphs is not None and w.graphs.pool_bytes <= p.graph_bytes, (w.graphs.pool_bytes, p.graph_bytes)
    sample = {"temperature": 1.0, "top_p": 0.9, "top_k": 5, "min_p": 0.01, "seed": 1, "presence_penalty": 0.5}
    step = StepPlan.build(
        [
            {
                "tokens": [1 + r, 2, 3, 4],
                "prefix_len": 0,
                "row": r,
                "table_from": 0,
                "table_slots": list(range(4 * r, 4 * r + 4)),
                "sample": sample,
            }
            for r in range(rows)
        ]
    )
    r = w.execute_plan(step)
    assert len(r.tokens) == rows
    assert r.stats["workspace_bytes"] <= p.step_workspace, (r.stats["workspace_bytes"], p.step_workspace)


@pytest.mark.parametrize(
    "running, ratio, count, want",
    [(1, 2.0, None, 16), (4, 2.0, None, 16), (12, 2.0, None, 24), (4, 0.0, None, 0), (1, 2.0, 3, 3)],
)
def test_snapshot_pool_default_has_a_floor(running, ratio, count, want):
    """ceil(--linear-state-cache-ratio x --max-running-requests), raised to MIN_SNAPSHOT_SLOTS (FreeToken's 2.0 alone
    gave a one-request server 2 snapshots, fewer than two alternating prompts need); ratio 0 means none, and
    --num-snapshot-slots is taken as given."""
    from types import SimpleNamespace

    from freetoken.models.base import StateLayout
    from freetoken.startup import MIN_SNAPSHOT_SLOTS, _allocate_state_pool

    assert MIN_SNAPSHOT_SLOTS == 16
    w = SimpleNamespace(
        model=SimpleNamespace(state_layout=StateLayout(2, (8, 3), (2, 4, 4))),
        args={"cache_type": "radix", "num_snapshot_slots": count, "linear_state_cache_ratio": ratio},
        max_running_requests=running,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    _allocate_state_pool(w)
    assert w.num_snapshot_slots == want and w.num_state_slots == running + want
    assert w.state.num_slots == running + want + 1  # the scratch slot past Rust's


def test_cublas_workspace_follows_the_config_variable(monkeypatch):
    """The decode graph plan counts cuBLAS's per-stream workspace as torch sizes it from CUBLAS_WORKSPACE_CONFIG."""
    from freetoken.startup import cublas_workspace_bytes

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_workspace_bytes(torch.device("cpu")) == 32 * 2**20
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes(torch.device("cpu")) == 8 * 2**20 + 128 * 2**10
