"""The start-up prefill warm-up (``engine/prefill_warmup.py``): which chunks it runs, that they run through the step
path on a hybrid model (snapshots and the chunk after a prefix included) and leave nothing behind that a live
request sees, and the ``--skip-prefill-warmup`` flag. (Its point, Triton compiling before the server answers,
is a CUDA matter: ``Worker`` runs it on CUDA only; here it is called directly, on CPU workers and under the gpu
marker on CUDA ones.)"""

from __future__ import annotations

import hf_reference as R
import pytest
import torch

from freetoken.engine.prefill_warmup import (
    BATCH_FRESH_LENGTHS,
    CACHED_TURN,
    FRESH_LENGTHS,
    batch_step_plan,
    run_prefill_warmup,
    warmup_chunks,
    warmup_enabled,
)


def test_chunks_fit_the_scratch_region_and_the_chunk_length():
    prefix, turns = CACHED_TURN
    full = warmup_chunks(8192, 8192, 32768)
    assert full == [(0, n) for n in FRESH_LENGTHS] + [(0, prefix)] + [(prefix, n) for n in turns]
    # a prefix longer than a chunk is built chunk by chunk; no chunk exceeds the chunk length
    small = warmup_chunks(1024, 8192, 32768)
    assert all(n <= 1024 for _, n in small) and small[-2:] == [(prefix, turns[0]), (prefix, 1024)]
    assert [p for p, _ in small[len(FRESH_LENGTHS) - 1 : -2]] == list(range(0, prefix, 1024))
    # a short context: the fresh lengths that fit, a prefix clipped to leave room for the short turn after it, and
    # no turn that would not fit
    short = warmup_chunks(8192, 8192, 1024)
    assert (0, 1999) not in short and max(p + n for p, n in short) < 1024 and short[-1][0] > 0
    assert warmup_chunks(8192, 8192, 40) == [(0, 5), (0, 17), (0, 37)]  # too short for a cached turn


def test_warmup_lengths_reach_every_nvfp4_linear_launch_a_step_makes():
    """Every launch variant a step of 33..4,096 tokens makes of the NVFP4 linear on the shared expert's weights
    (Qwen3.6: gate|up 1024 x 2048, down 2048 x 512; up to 32 rows the mixed GEMV / ``mixed_dot`` run instead: the
    next test) is one a warm-up chunk or the batched step makes first; else a request compiles it (on the H200 a
    14-token step did, 181 ms, before ``mixed_dot`` took those rows)."""
    pytest.importorskip("triton")
    from freetoken.kernels.mixed_dot import MAX_M
    from freetoken.kernels.nvfp4_linear import launch_variant

    warm = set(FRESH_LENGTHS) | {1 + sum(BATCH_FRESH_LENGTHS)}
    for n, k in ((1024, 2048), (2048, 512)):
        made = {launch_variant(m, n, k, torch.bfloat16) for m in range(MAX_M + 1, 4097)}
        warmed = {launch_variant(m, n, k, torch.bfloat16) for m in warm}
        assert made - warmed == set(), f"{n}x{k}: no warm-up length reaches {sorted(made - warmed)}"


def test_warmup_lengths_reach_every_mixed_dot_launch_a_step_makes():
    """The same for the fused projections' tensor-core kernel (``mixed_dot``) at Qwen3.6's NVFP4-checkpoint shapes:
    every launch variant a step of 3..32 tokens makes (FP8 rows from 3, others from 5) is one a warm-up chunk makes.
    (Decode steps compile theirs at graph capture; a mixed decode + prefill step runs eagerly at any count.)"""
    pytest.importorskip("triton")
    from freetoken.kernels.mixed_dot import MAX_M, launch_variant

    warm = set(FRESH_LENGTHS) | {1 + sum(BATCH_FRESH_LENGTHS)}
    shapes = {"router|shared": (257, 0, 1024), "gdn in_proj": (64, 12288, 0), "q|k|v": (0, 9216, 0)}
    for name, rows in shapes.items():
        first = 3 if rows[1] else 5
        made = {launch_variant(m, rows) for m in range(first, MAX_M + 1)}
        warmed = {launch_variant(m, rows) for m in warm if first <= m <= MAX_M}
        assert made - warmed == set(), f"{name}: no warm-up length reaches {sorted(made - warmed)}"


def _worker(path: str, **kw):
    from freetoken.worker import Worker

    args = dict(model_path=path, device="cpu", dtype="float32", num_tokens=4096, max_running_requests=2)
    return Worker({**args, "load_progress": False, **kw})


def _chunk(w, ids: list[int], prefix: int, row: int = 0) -> torch.Tensor:
    """A live request's chunk on ``row`` (KV slots 0.., state slot ``row``) after ``prefix`` of its tokens: the
    logits of its last position."""
    from freetoken.engine.step_plan import StepPlan

    plan = StepPlan.build(
        [
            {
                "tokens": ids,
                "prefix_len": prefix,
                "row": row,
                "table_from": prefix,
                "table_slots": list(range(prefix, prefix + len(ids))),
                "state_slot": row if w.state is not None else -1,
                "sample": {"temperature": 0.0},
            }
        ]
    )
    return w.execute_plan(plan).logits


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny-qwen3_5_moe-warmup"))
    R.write_released_qwen3_5_moe(d, seed=5, max_position_embeddings=2048)
    return d


@pytest.mark.parametrize("moe", [{}, {"moe_backend": "offload", "moe_cache_size": 4}])
def test_warmup_runs_on_the_scratch_region_only(hybrid_checkpoint, moe):
    """A hybrid model (snapshots in the chunk after the prefix), its experts resident or offloaded behind a small
    expert cache (which the warm-up's chunks fill with experts of their own): the warm-up runs between two chunks of
    a live request, and the second chunk (reading the first one's KV and recurrent state) gives the logits it gives
    on a worker that never warmed up. The live request sits on row 1: the batched step borrows row 0 and state slot
    0, which at start-up no request holds (a request on them starts over; ``test_batch_step_rows_start_over``)."""
    ids = R.prompt(90, seed=3, vocab=1000)
    warmed, plain = (_worker(hybrid_checkpoint, max_prefill_length=1024, **moe) for _ in range(2))
    assert warmed.state is not None and (warmed.offload is not None) == bool(moe)
    for w in (warmed, plain):
        _chunk(w, ids[:50], 0, row=1)
    steps = warmed.steps_executed
    took = run_prefill_warmup(warmed)
    assert took >= 0 and warmed.steps_executed == steps  # scratch steps are not served steps
    assert len(warmup_chunks(warmed.max_prefill_length, warmed.scratch_tokens, warmed.max_context)) >= 6
    assert torch.equal(_chunk(warmed, ids[50:], 50, row=1), _chunk(plain, ids[50:], 50, row=1))


def test_batch_step_plan(hybrid_checkpoint):
    """The batched step: the scratch row's decode token after its prefix (or a fresh prompt without one), then
    fresh prompts on live rows 0.. with their state slots, KV in the scratch region; none where one request runs at
    most or the scratch region is too small."""
    w = _worker(hybrid_checkpoint, max_running_requests=4, max_prefill_length=1024)
    plan = batch_step_plan(w, 300)
    assert plan.rows.tolist() == [w.scratch_row, 0, 1]
    assert plan.extend_lens.tolist() == [1, *BATCH_FRESH_LENGTHS] and plan.prefix_lens.tolist() == [300, 0, 0]
    assert plan.state_slots.tolist() == [w.num_state_slots, 0, 1]
    slots = plan.table_slots
    assert int(slots.min()) == w.kv_capacity_tokens + 300 and slots.unique().numel() == slots.numel()
    assert int(slots.max()) < w.kv_capacity_tokens + w.scratch_tokens
    assert batch_step_plan(w, 0).extend_lens.tolist() == [5, *BATCH_FRESH_LENGTHS]
    assert batch_step_plan(w, w.scratch_tokens - 10) is None
    two = _worker(hybrid_checkpoint, max_running_requests=2, max_prefill_length=1024)
    assert batch_step_plan(two, 0).rows.tolist() == [two.scratch_row, 0]
    assert batch_step_plan(_worker(hybrid_checkpoint, max_running_requests=1), 0) is None


def test_batch_step_rows_start_over(hybrid_checkpoint):
    """What the batched step leaves on the live rows it borrows is never read: a request that then starts on row 0
    (its page-table entries from position 0, a zero state) gives the logits of a worker that never warmed up."""
    ids = R.prompt(70, seed=8, vocab=1000)
    warmed, plain = (_worker(hybrid_checkpoint, max_prefill_length=1024) for _ in range(2))
    run_prefill_warmup(warmed)
    for w in (warmed, plain):
        _chunk(w, ids[:40], 0)
    assert torch.equal(_chunk(warmed, ids[40:], 40), _chunk(plain, ids[40:], 40))


def test_batch_step_also_runs_eagerly_where_batch_graphs_hold_it(hybrid_checkpoint, monkeypatch):
    """With GDN batch graphs the batched step runs as served (from its graph) and then eagerly, as the steps no batch
    graph holds (their kernels specialize on other token counts); without them once. The switch is restored."""
    from freetoken.engine import prefill_warmup
    from freetoken.layers import gated_deltanet as gdn

    w = _worker(hybrid_checkpoint, max_prefill_length=512)
    seen, real = [], w.execute_plan

    def spy(plan, **kw):
        if plan.num_seqs > 1:
            seen.append(gdn.batch_graphs_on())
        return real(plan, **kw)

    monkeypatch.setattr(w, "execute_plan", spy)
    for has, want in ((True, [True, False]), (False, [True])):
        monkeypatch.setattr(prefill_warmup, "_has_batch_graphs", lambda _w, has=has: has)
        seen.clear()
        run_prefill_warmup(w)
        assert seen == want and gdn.batch_graphs_on()


def test_gemm_warmup_runs_last_and_a_failure_in_it_is_only_a_warning(hybrid_checkpoint, monkeypatch, caplog):
    """After the chunks, each dense GEMM they made is called at every multiple of 64 rows (``engine/gemm_warmup.py``;
    logged); a GEMM warm-up that fails is logged as a warning and the start-up goes on (it is an optimization)."""
    import logging

    from freetoken.engine import prefill_warmup

    w = _worker(hybrid_checkpoint, max_prefill_length=512)
    with caplog.at_level(logging.INFO):
        run_prefill_warmup(w)
    assert "GEMM warm-up:" in caplog.text and "token counts (64..512 in steps of 64" in caplog.text
    caplog.clear()

    def broken(calls, rows):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore lines")

    monkeypatch.setattr(prefill_warmup, "warm_gemms", broken)
    with caplog.at_level(logging.INFO):
        assert run_prefill_warmup(w) >= 0
    assert "GEMM warm-up skipped: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED" in caplog.text
    assert "more lines" not in caplog.text
    monkeypatch.setenv("FREETOKEN_GEMM_WARMUP_ROWS", "0")  # off: neither line
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run_prefill_warmup(w)
    assert "GEMM warm-up" not in caplog.text


def test_the_flag_defaults_to_warming_up():
    from freetoken.serve_defaults import serve_defaults

    assert serve_defaults()["skip_prefill_warmup"] is False


def test_when_it_runs():
    """CUDA only, unless the flag or FREETOKEN_PREFILL_WARMUP=0 skips it; another value of the variable is refused."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on, off = {"skip_prefill_warmup": False}, {"skip_prefill_warmup": True}
    assert warmup_enabled(on, cuda, env={}) and warmup_enabled(on, cuda, env={"FREETOKEN_PREFILL_WARMUP": "1"})
    assert not warmup_enabled(on, cpu, env={}) and not warmup_enabled(off, cuda, env={})
    assert not warmup_enabled(on, cuda, env={"FREETOKEN_PREFILL_WARMUP": "0"})
    with pytest.raises(ValueError, match="FREETOKEN_PREFILL_WARMUP"):
        warmup_enabled(on, cpu, env={"FREETOKEN_PREFILL_WARMUP": "yes"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmup_on_cuda(hybrid_checkpoint):
    """The warm-up's chunks on a CUDA hybrid worker (Triton attention with key splits, fla with snapshot rounds,
    the gates kernel): they run, and leave a live request's second chunk as it is without them."""
    ids = R.prompt(90, seed=4, vocab=1000)
    warmed, plain = (_worker(hybrid_checkpoint, device="cuda", max_prefill_length=1024) for _ in range(2))
    for w in (warmed, plain):
        _chunk(w, ids[:50], 0, row=1)  # (row 0 is the batched step's)
    run_prefill_warmup(warmed)
    assert torch.equal(_chunk(warmed, ids[50:], 50, row=1), _chunk(plain, ids[50:], 50, row=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunk_counts_divisible_by_16_compile_nothing_new(hybrid_checkpoint):
    """Chunks that differ from chunks already run only in how their counts divide (an even token count, a multiple
    of 16, a tail of 16 or 48 tokens after the snapshot grid point) compile no Triton kernel: Triton specializes
    integer arguments divisible by 16, and each such compile is paid on a request's path (on the H200 a 2,048-token
    chunk after the warm-up's odd lengths waited 0.9 s for the MoE's kernels, an agent turn ~170 ms for the
    attention merge's, 2026-12-03). Each pair keeps the tiles the launchers pick (the same rows per block, blocks
    per expert with the warm-up's zero ids, rows per norm program)."""
    from freetoken.engine.kernel_compiles import process_compile_watch
    from freetoken.engine.prefill_warmup import scratch_chunk_plan

    w = _worker(hybrid_checkpoint, device="cuda", dtype="bfloat16", max_prefill_length=4096, num_tokens=16384)
    assert w.scratch_tokens == w.max_context == 2048
    run_prefill_warmup(w)
    # (prefix, new): odd counts first; then the same sizes with even counts (tails after the grid point 47 -> 48,
    # 19 -> 16 tokens)
    odd = [(0, 5), (0, 37), (0, 301), (0, 1999), (1090, 301), (1392, 163)]
    even = [(0, 6), (0, 48), (0, 304), (0, 2000), (1090, 302), (1392, 160)]
    for prefix, new in odd:
        w.execute_plan(scratch_chunk_plan(w, prefix, new), _allow_scratch=True)
    watch = process_compile_watch()
    assert watch.installed
    mark = watch.mark()
    for prefix, new in even:
        stats = w.execute_plan(scratch_chunk_plan(w, prefix, new), _allow_scratch=True).stats
        assert 0 < stats["device_ms"] <= stats["forward_ms"], stats  # the step's span on the device's timeline
        assert 0 < stats["launch_ms"] <= stats["forward_ms"], stats  # the host's enqueueing of the forward
    assert watch.since(mark) == [], f"compiled for the even counts: {watch.since(mark)}"


def _batch(w, seqs: list[tuple[int, int, int]]) -> dict:
    """One step of live sequences ``(row, prefix, new)`` (state slot = row, KV slots ``row * 256 + position``,
    zero ids); its stats."""
    from freetoken.engine.step_plan import StepPlan

    specs = [
        {
            "tokens": [0] * new,
            "prefix_len": prefix,
            "row": row,
            "table_from": prefix,
            "table_slots": [row * 256 + p for p in range(prefix, prefix + new)],
            "state_slot": row,
            "sample": {"temperature": 0.0},
        }
        for row, prefix, new in seqs
    ]
    return w.execute_plan(StepPlan.build(specs)).stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_steps_compile_nothing_new(hybrid_checkpoint):
    """After the warm-up, steps of many sequences (concurrent prompts, then decode tokens mixed with new prompts)
    compile no Triton kernel: on the H200 the first step of 32 concurrent prompts waited 38.6 s for fla's varlen
    kernels and their autotuning, inside a served request (2026-12-04)."""
    from freetoken.engine.kernel_compiles import process_compile_watch

    w = _worker(hybrid_checkpoint, device="cuda", dtype="bfloat16", max_running_requests=40, num_tokens=16384)
    run_prefill_warmup(w)
    watch = process_compile_watch()
    assert watch.installed
    mark = watch.mark()
    _batch(w, [(r, 0, 2 + r % 3) for r in range(2)])
    _batch(w, [(r, 0, 15) for r in range(16)])  # 240 tokens, as the bench's 16..32 short prompts
    _batch(w, [(r, 0, 7 + r % 2) for r in range(16, 40)])
    # decode tokens of the first rows beside fresh prompts on others (continuous batching's mixed step)
    _batch(w, [(r, 15, 1) for r in range(16)] + [(r, 0, 30 + r) for r in range(16, 20)])
    assert watch.since(mark) == [], f"compiled for batched steps: {watch.since(mark)}"
