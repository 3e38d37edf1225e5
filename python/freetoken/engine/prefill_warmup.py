"""Prefill warm-up at start-up: a few prompt chunks of the shapes requests bring run on the scratch row before the
server answers, so the first requests do not wait for Triton to compile their kernels.

The memory plan's dry run compiles the kernels of one shape (the largest chunk) and the graph capture those of
decode; a request of another shape compiles its own specializations (Triton specializes on integer arguments equal
to 1 or divisible by 16, and the launchers pick other tiles for short chunks, small MoE steps, a chunk after a long
prefix). On the H200 the first short chat after start-up waited 3.3 s (resident) and 14.4 s (NVFP4 experts
offloaded) for that (``bench/results/2026-12-02-h200-qwen3.6-35b-a3b-radix-offload-scenario-nvfp4.txt``);
FreeToken 0.1.2 warmed two lengths and its first TTFT was 15.1 s on an H100, 0.6 s once it warmed them all
(REFERENCES §4.5, FT#169). ``--skip-prefill-warmup`` skips it, and so does ``FREETOKEN_PREFILL_WARMUP=0`` (the
test suite sets it: its many small workers would each compile their own warm-up shapes on a GPU).

The chunks: short and medium odd lengths from an empty prefix (a short prompt, a chat turn, a document), then a
chunk after a long prefix with recurrent-state snapshots at the grid point inside it and at its end (a cached
agent turn: key-split attention, the snapshot rounds of the Gated DeltaNet prefill). Each runs through the real
step path on the scratch row, KV slots and state slot (the region of the memory plan's dry run), sampled greedily;
nothing of a live request is touched, and the prompt ids are 0 (finite activations; their outputs are discarded). CUDA only:
on the CPU nothing is compiled.

Then, where more than one request may run, one step of several sequences (``batch_step_plan``): prompts that arrive
together, with a decode token riding along. One sequence and several take different kernels (fla's varlen
chunk kernels, autotuned on their first call: on the H200 the first step of 32 concurrent prompts waited 38.6 s
for them, 2026-12-04 ``bench/results/2026-12-04-h200-qwen3.6-35b-a3b-nvfp4-decode-stall.txt``). Where the GDN
batch graphs hold it, the step runs twice: from its graph, as served, and eagerly (``eager_batch_steps``), as the
steps no batch graph holds run (their token counts specialize fla's kernels differently from the graphs' padded
ones). Its extra sequences use live rows and state slots: before the server answers no request holds them, and a
request starting on them writes its page-table entries from position 0 and starts from a zero state
(``prefix_len`` 0), so nothing they leave is read.

Last, cuBLAS's first call at each GEMM shape (``gemm_warmup.py``): the dense GEMMs the chunks made, each called once
at every multiple of ``FREETOKEN_GEMM_WARMUP_ROWS`` (64) rows up to the chunk length, so that a served turn's new
token count does not stop the device for a few milliseconds before its first GEMM of each shape.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import torch

from ..layers.gated_deltanet import eager_batch_steps
from ..log import get_logger
from ..startup_progress import phase
from ..tuning_env import switch_from_env
from .gemm_warmup import GemmRecorder, warm_gemms, warmup_rows, warmup_rows_step
from .step_plan import StepPlan

if TYPE_CHECKING:
    from ..worker import Worker

logger = get_logger(__name__)

# odd: Triton's "other integer" specialization, and each a different tile pick (tests/test_prefill_warmup.py checks
# that they reach every launch of the NVFP4 linear a step's token count can make); 17 tokens are 136 (token, expert)
# pairs at top-8, where an eager step (a short chunk, or one with decode tokens mixed in) takes the NVFP4 MoE decode
# GEMVs in packed half precision (64..256 pairs), which no other length reaches (5: 40 pairs; 37: 296, grouped)
FRESH_LENGTHS = (5, 17, 37, 301, 1999)
# (prefix, new tokens of each turn after it): few query blocks over a long prefix (key splits), snapshots; a short
# turn and an agent-sized one (its attention partials and MoE rows are larger: the allocator grows to them here, not
# inside a served turn; on the H200 the first ~1,100-token turn of a session took 113 ms where the next took 77)
CACHED_TURN = (6007, (303, 2047))
GRID = 64  # the recurrent-state snapshot grid
# the fresh prompts of the batched step (odd, different: each sequence its own tail in the chunk kernels)
BATCH_FRESH_LENGTHS = (9, 27)


def warmup_enabled(args: dict, device: torch.device, env: Optional[dict] = None) -> bool:
    """CUDA, without ``--skip-prefill-warmup`` and without ``FREETOKEN_PREFILL_WARMUP=0`` (any other value than 0
    or 1 is refused)."""
    on = switch_from_env("FREETOKEN_PREFILL_WARMUP", env)
    return device.type == "cuda" and not args["skip_prefill_warmup"] and on


def warmup_chunks(max_prefill_length: int, scratch_tokens: int, max_context: int) -> list[tuple[int, int]]:
    """``[(prefix, new tokens)]`` the warm-up runs, clipped to what the scratch region and the model allow (a
    prefix longer than a chunk is built by the chunks before it: ``(0, c), (c, c), ...``)."""
    room = min(scratch_tokens, max_context)
    chunks = [(0, min(n, max_prefill_length)) for n in FRESH_LENGTHS if n < room]
    prefix, turns = CACHED_TURN
    prefix = min(prefix, room - turns[0] - 1)
    if prefix >= 2 * GRID:
        for start in range(0, prefix, max_prefill_length):
            chunks.append((start, min(max_prefill_length, prefix - start)))
        # (each turn after the same prefix: the scratch KV of the prefix is what a turn reads, not what it wrote)
        chunks += [(prefix, min(new, max_prefill_length)) for new in turns if prefix + new < room]
    return list(dict.fromkeys(chunks))  # in order, once each


def _zero_prompt(w: "Worker", row: int, state_slot: int, prefix: int, new: int, first_slot: int) -> dict:
    """A sequence of ``new`` zero ids after ``prefix`` on ``row`` (``state_slot`` where the model has recurrent
    state), its KV in the slots from ``first_slot`` on, sampled greedily: a ``StepPlan.build`` entry."""
    return {
        "tokens": [0] * new,
        "prefix_len": prefix,
        "row": row,
        "table_from": prefix,
        "table_slots": list(range(first_slot, first_slot + new)),
        "state_slot": state_slot if w.state is not None else -1,
        "sample": {"temperature": 0.0},
    }


def scratch_chunk_plan(w: "Worker", prefix: int, new: int) -> StepPlan:
    """``new`` zero ids after ``prefix`` on the scratch row, sampled greedily (also the memory plan's dry run,
    ``Worker.dry_run``, with no prefix); a chunk after a prefix (the cached turn, and the chunks
    that build a prefix longer than one chunk) also captures its state at the grid point inside it and at its end,
    into the scratch state slot."""
    plan = StepPlan.build(
        [_zero_prompt(w, w.scratch_row, w.num_state_slots, prefix, new, w.kv_capacity_tokens + prefix)]
    )
    end = prefix + new
    grid = (end - 1) // GRID * GRID
    if w.state is not None and prefix > 0:
        points = [p for p in (grid, end) if p > prefix]
        plan.snap_seq = torch.zeros(len(points), dtype=torch.int64)
        plan.snap_upto = torch.tensor(points, dtype=torch.int64)
        plan.snap_slot = torch.full((len(points),), w.num_state_slots, dtype=torch.int64)
    return plan


def batch_step_plan(w: "Worker", scratch_prefix: int) -> Optional[StepPlan]:
    """One step of several sequences: the scratch row's next token after its ``scratch_prefix`` tokens (a decode
    token in a mixed step; a fresh 5-token prompt when there is no prefix) and ``BATCH_FRESH_LENGTHS`` prompts on
    live rows 0, 1, .. (state slots 0, 1, ..), their KV in the scratch region after the scratch row's. None where
    at most one request runs (no step ever holds two sequences) or the scratch region has no room."""
    fresh = BATCH_FRESH_LENGTHS[: max(0, w.max_running_requests - 1)]
    base, first = w.kv_capacity_tokens, 1 if scratch_prefix > 0 else 5
    if w.max_running_requests < 2 or scratch_prefix + first + sum(fresh) > min(w.scratch_tokens, w.max_context):
        return None
    seqs = [(w.scratch_row, w.num_state_slots, scratch_prefix, first)]
    seqs += [(row, row, 0, n) for row, n in enumerate(fresh)]
    slot, specs = base + scratch_prefix, []
    for row, state_slot, prefix, new in seqs:
        specs.append(_zero_prompt(w, row, state_slot, prefix, new, slot))
        slot += new
    return StepPlan.build(specs)


def _has_batch_graphs(w: "Worker") -> bool:
    return any(getattr(getattr(m, "prefill_graphs", None), "batch", None) is not None for m in w.model.modules())


def run_prefill_warmup(w: "Worker") -> float:
    """Runs the warm-up chunks on ``w`` (see the module doc); returns the seconds it took."""
    chunks = warmup_chunks(w.max_prefill_length, w.scratch_tokens, w.max_context)
    # the scratch row's prefix after the chunks: the cached turn's (each turn after it rewrites only its own tokens)
    scratch_prefix = max((p for p, _ in chunks), default=0)
    batch = batch_step_plan(w, scratch_prefix)
    shapes = ", ".join(f"{n}" if p == 0 else f"{n} after {p}" for p, n in chunks)
    batched = "" if batch is None else f", then one step of {batch.num_seqs} sequences"
    phase(f"Prefill warm-up: {len(chunks)} chunks ({shapes} tokens){batched}")
    t0 = time.perf_counter()
    with GemmRecorder() as gemms:  # the dense GEMMs the chunks make, for cuBLAS's first call at each shape below
        for prefix, new in chunks:
            w.execute_plan(scratch_chunk_plan(w, prefix, new), _allow_scratch=True)
    if batch is not None:
        w.execute_plan(batch, _allow_scratch=True)  # as served: a GDN batch graph where one holds the step
        if _has_batch_graphs(w):
            with eager_batch_steps():  # and eagerly, as steps that no batch graph holds run
                w.execute_plan(batch, _allow_scratch=True)
    took = time.perf_counter() - t0
    logger.info(f"Prefill warm-up done in {took:.1f} s")
    step = warmup_rows_step()
    rows = warmup_rows(w.max_prefill_length, step)
    if gemms.calls and rows:
        t1 = time.perf_counter()
        try:
            warm_gemms(gemms.calls.values(), rows)
            logger.info(
                f"GEMM warm-up: {len(gemms.calls)} GEMM shapes at {len(rows)} token counts ({rows[0]}..{rows[-1]} "
                f"in steps of {step}, FREETOKEN_GEMM_WARMUP_ROWS) in {time.perf_counter() - t1:.1f} s"
            )
        except Exception as e:  # an optimization: the server serves without it (first calls then pay in a step)
            logger.warning(f"GEMM warm-up skipped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        took += time.perf_counter() - t1
    return took
