"""Worker.execute driven by flat plans encoded the way crates/ft-py does (little-endian i32/i64/f32 bytes),
on a tiny random Llama checkpoint (fast) and the demo model's info()."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.engine.step_plan import STEP_CONTRACT_VERSION
from freetoken.errors import InvalidPlan, WorkerOutOfMemory


def encode_plan(
    seqs: list[dict],
    step_id: int = 0,
    kind: str | None = None,
    version: int = STEP_CONTRACT_VERSION,
    copies=(),
    snapshots=(),
) -> dict:
    """The Rust side's flattening (crates/ft-py/src/py_worker.rs). Each seq: tokens, prefix_len, row, table_from,
    table_slots, optional request_id / state_slot / sample (temperature, top_p, top_k, min_p, seed,
    num_top_logprobs) / prompt_logprobs (next: the token after the chunk or -1, top)."""
    i32 = lambda xs: np.asarray(list(xs), dtype="<i4").tobytes()  # noqa: E731
    i64 = lambda xs: np.asarray(list(xs), dtype="<i8").tobytes()  # noqa: E731
    f32 = lambda xs: np.asarray(list(xs), dtype="<f4").tobytes()  # noqa: E731
    lens = [len(s["tokens"]) for s in seqs]
    sent = [len(s["table_slots"]) for s in seqs]
    sampled = [(i, s["sample"]) for i, s in enumerate(seqs) if s.get("sample") is not None]
    if kind is None:
        dec = [n == 1 and s["prefix_len"] > 0 for n, s in zip(lens, seqs)]
        kind = "decode" if all(dec) else "prefill" if not any(dec) else "mixed"
    u64 = lambda x: x - (1 << 64) if x >= 1 << 63 else x  # noqa: E731
    plp = [(i, s["prompt_logprobs"]) for i, s in enumerate(seqs) if s.get("prompt_logprobs") is not None]
    return {
        "version": version,
        "step_id": step_id,
        "kind": kind,
        "request_ids": i64(s.get("request_id", i) for i, s in enumerate(seqs)),
        "input_ids": i32(t for s in seqs for t in s["tokens"]),
        "cu_seqlens": i32(np.concatenate([[0], np.cumsum(lens)])),
        "table_indptr": i32(np.concatenate([[0], np.cumsum(sent)])),
        "prefix_lens": i32(s["prefix_len"] for s in seqs),
        "rows": i32(s["row"] for s in seqs),
        "table_from": i32(s["table_from"] for s in seqs),
        "table_slots": i32(x for s in seqs for x in s["table_slots"]),
        "state_slots": i32(s.get("state_slot", -1) for s in seqs),
        "sample_index": i32(i for i, _ in sampled),
        "temperature": f32(p.get("temperature", 0.0) for _, p in sampled),
        "top_p": f32(p.get("top_p", 1.0) for _, p in sampled),
        "top_k": i32(p.get("top_k", 0) for _, p in sampled),
        "min_p": f32(p.get("min_p", 0.0) for _, p in sampled),
        "presence_penalty": f32(p.get("presence_penalty", 0.0) for _, p in sampled),
        "frequency_penalty": f32(p.get("frequency_penalty", 0.0) for _, p in sampled),
        "seeds": i64(u64(p.get("seed", 0)) for _, p in sampled),
        "num_top_logprobs": i32(p.get("num_top_logprobs", 0) for _, p in sampled),
        "plp_seq": i32(i for i, _ in plp),
        "plp_next": i32(p.get("next", -1) for _, p in plp),
        "plp_top": i32(p.get("top", 0) for _, p in plp),
        "copy_src": i32(c[0] for c in copies),
        "copy_dst": i32(c[1] for c in copies),
        "snap_seq": i32(c[0] for c in snapshots),
        "snap_upto": i32(c[1] for c in snapshots),
        "snap_slot": i32(c[2] for c in snapshots),
    }


class Seq:
    """One request as the scheduler sees it: its row, its KV slots (scattered on purpose), its tokens."""

    def __init__(self, row: int, prompt: list[int], slot_base: int, stride: int = 3):
        self.row, self.tokens, self.cached = row, list(prompt), 0
        self.slot_base, self.stride = slot_base, stride

    def slot(self, pos: int) -> int:
        return self.slot_base + self.stride * pos

    def item(self, n: int | None = None, sample=None) -> dict:
        """The next ``n`` uncomputed tokens (all by default) as a plan entry."""
        n = len(self.tokens) - self.cached if n is None else n
        p = self.cached
        return {
            "tokens": self.tokens[p : p + n],
            "prefix_len": p,
            "row": self.row,
            "table_from": p,
            "table_slots": [self.slot(q) for q in range(p, p + n)],
            "sample": sample,
        }

    def advance(self, n: int, new_token: int | None = None):
        self.cached += n
        if new_token is not None:
            self.tokens.append(new_token)


GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def worker(tiny_llama_dir):
    from freetoken.worker import Worker

    return Worker(
        {
            "model_path": tiny_llama_dir,
            "device": "cpu",
            "dtype": "float32",
            "num_tokens": 1024,
            "max_running_requests": 4,
            "load_progress": False,
        }
    )


def _ref_next(worker, tokens: list[int]) -> tuple[int, float]:
    logits = worker.forward_logits(tokens)[-1]
    t = int(logits.argmax())
    return t, float(torch.log_softmax(logits, -1)[t])


INFO_KEYS = {
    "served_model_name",
    "architecture",
    "max_context",
    "vocab_size",
    "tokenizer_path",
    "chat_template",
    "bos_token",
    "eos_token",
    "eos_token_ids",
    "add_bos_token",
    "bos_token_id",
    "kv_capacity_tokens",
    "num_state_slots",
    "step_contract_version",
}


def test_info(worker, tiny_llama_dir):
    info = worker.info()
    assert INFO_KEYS <= set(info)
    assert info["step_contract_version"] == STEP_CONTRACT_VERSION
    assert info["kv_capacity_tokens"] == 1024 and info["num_state_slots"] == 0
    assert info["vocab_size"] == 256 and info["max_context"] == 512
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["eos_token_ids"] == [2]


def test_demo_info(demo_worker):
    info = demo_worker.info()
    assert INFO_KEYS <= set(info)
    assert info["served_model_name"] == "SmolLM2-135M-Instruct.Q4_1"
    assert (info["bos_token"], info["bos_token_id"], info["eos_token"]) == ("<|im_start|>", 1, "<|im_end|>")
    assert 2 in info["eos_token_ids"] and info["add_bos_token"] is False
    assert info["max_context"] == 2048 and info["vocab_size"] == 49152
    assert "<|im_start|>" in info["chat_template"]
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(info["tokenizer_path"]).get_vocab_size() == 49152


def test_prefill_then_decode_steps(worker):
    a = Seq(0, [5, 9, 13, 200, 7, 7, 1], slot_base=0)
    b = Seq(3, [100, 101, 102], slot_base=500, stride=2)
    step = 0
    toks, lps, stats, _ = worker.execute(encode_plan([a.item(sample=GREEDY), b.item(sample=GREEDY)], step))
    assert len(toks) == len(lps) == 2 and stats["forward_ms"] > 0
    for s, t in zip((a, b), toks):
        assert t == _ref_next(worker, s.tokens)[0]
        s.advance(len(s.tokens), t)
    for step in range(1, 7):
        plan = encode_plan([a.item(sample=GREEDY), b.item(sample=GREEDY)], step)
        assert plan["kind"] == "decode"
        refs = [_ref_next(worker, s.tokens) for s in (a, b)]
        toks, lps, _, _ = worker.execute(plan)
        assert toks == [r[0] for r in refs]
        assert lps == pytest.approx([r[1] for r in refs], abs=1e-4)
        for s, t in zip((a, b), toks):
            s.advance(1, t)


def test_mixed_step_chunked_prefill_beside_decode(worker):
    a = Seq(1, [40, 41, 42, 43], slot_base=200)
    toks, _, _, _ = worker.execute(encode_plan([a.item(sample=GREEDY)]))
    a.advance(4, toks[0])
    b = Seq(2, list(range(60, 90)), slot_base=300, stride=1)
    # b's prompt in chunks of 12: the first two chunks do not sample; a decodes in every step
    for step, n in enumerate((12, 12, 6)):
        last = b.cached + n == len(b.tokens)
        plan = encode_plan([a.item(sample=GREEDY), b.item(n, sample=GREEDY if last else None)], step)
        assert plan["kind"] == "mixed"
        want = [_ref_next(worker, a.tokens)[0]] + ([_ref_next(worker, b.tokens)[0]] if last else [])
        toks, _, _, _ = worker.execute(plan)
        assert toks == want
        a.advance(1, toks[0])
        b.advance(n, toks[1] if last else None)


def test_seeded_sampling_independent_of_batch(worker):
    s = {"temperature": 1.0, "top_p": 0.9, "seed": (1 << 63) + 12345}
    alone = worker.execute(encode_plan([Seq(0, [3, 4, 5], 0).item(sample=s)]))[0]
    other = Seq(1, [9, 8, 7, 6, 5], 100).item(sample={"temperature": 0.7, "seed": 1})
    batched = worker.execute(encode_plan([other, Seq(0, [3, 4, 5], 0).item(sample=s)]))[0]
    assert batched[1] == alone[0]


def _bad_plans(worker):
    cap, rows = worker.kv_capacity_tokens, worker.max_running_requests
    ok = lambda **kw: {
        "tokens": [1, 2],
        "prefix_len": 0,
        "row": 0,
        "table_from": 0,
        "table_slots": [0, 1],  # noqa: E731
        "sample": GREEDY,
        **kw,
    }
    return {
        "row past the last request row": [ok(row=rows)],
        "negative row": [ok(row=-1)],
        "slot past capacity": [ok(table_slots=[0, cap])],
        "negative slot": [ok(table_slots=[-5, 1])],
        "token past vocab": [ok(tokens=[1, 256])],
        "context past max_context": [ok(tokens=[1], prefix_len=600, table_from=600, table_slots=[3])],
        "same row twice": [ok(), ok(table_slots=[5, 6])],
        "negative temperature": [ok(sample={"temperature": -1.0})],
        "top_p zero": [ok(sample={"temperature": 1.0, "top_p": 0.0})],
        "21 top logprobs": [ok(sample={"temperature": 0.0, "num_top_logprobs": 21})],
        "prompt logprobs target past vocab": [ok(prompt_logprobs={"next": 256, "top": 1}, sample=None)],
    }


BAD_CASES = [
    "row past the last request row",
    "negative row",
    "slot past capacity",
    "negative slot",
    "token past vocab",
    "context past max_context",
    "same row twice",
    "negative temperature",
    "top_p zero",
    "21 top logprobs",
    "prompt logprobs target past vocab",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_invalid_plan_touches_nothing(worker, case):
    table = worker.kv.req_to_token.clone()
    k0 = worker.kv.k[0].clone()
    with pytest.raises(InvalidPlan):
        worker.execute(encode_plan(_bad_plans(worker)[case]))
    assert torch.equal(worker.kv.req_to_token, table) and torch.equal(worker.kv.k[0], k0)


def test_invalid_plan_shapes_and_version(worker):
    good = encode_plan([Seq(0, [1, 2, 3], 0).item(sample=GREEDY)])
    with pytest.raises(InvalidPlan, match="version"):
        worker.execute({**good, "version": STEP_CONTRACT_VERSION + 1})
    with pytest.raises(InvalidPlan):
        worker.execute({**good, "cu_seqlens": np.asarray([0, 2], dtype="<i4").tobytes()})
    with pytest.raises(InvalidPlan, match="recurrent state"):
        worker.execute(encode_plan([Seq(0, [1, 2, 3], 0).item(sample=GREEDY)], copies=[(0, 1)]))


def _unpack_top(extra: dict, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    k = extra[f"{prefix}_k"]
    ids = np.frombuffer(extra[f"{prefix}_ids"], dtype="<i4").reshape(-1, k)
    return ids, np.frombuffer(extra[f"{prefix}_logprobs"], dtype="<f4").reshape(-1, k)


def test_top_and_prompt_logprobs_are_log_softmax_of_the_logits(worker):
    """The step contract's logprob fields: a prompt in two chunks asking for prompt logprobs (the first chunk's
    last position predicts ``plp_next``, the final chunk's last the sampled token), a sampled row asking for 5
    alternatives beside one asking for none, all equal to ``log_softmax`` of ``forward_logits`` at the same
    positions; a step asking for nothing returns nothing more."""
    a = Seq(0, [5, 9, 13, 200, 7, 7, 1, 99, 42, 3], slot_base=0)
    b = Seq(1, [100, 101, 102], slot_base=500)
    ref = torch.log_softmax(worker.forward_logits(a.tokens), -1)
    _, _, _, extra = worker.execute(encode_plan([dict(a.item(6), prompt_logprobs={"next": a.tokens[6], "top": 3})]))
    assert set(extra) == {"prompt_logprobs", "prompt_top_k", "prompt_top_ids", "prompt_top_logprobs"}
    got = np.frombuffer(extra["prompt_logprobs"], dtype="<f4")
    want = [float(ref[q - 1, a.tokens[q]]) for q in range(1, 7)]  # positions 1..6: t6 is plp_next
    np.testing.assert_allclose(got, want, atol=1e-5)
    ids, lps = _unpack_top(extra, "prompt_top")
    assert ids.shape == (6, 3)
    for q in range(6):
        top = torch.topk(ref[q], 3)
        assert ids[q].tolist() == top.indices.tolist()
        np.testing.assert_allclose(lps[q], top.values.numpy(), atol=1e-5)
    a.advance(6)
    final = dict(a.item(sample={"temperature": 0.0, "num_top_logprobs": 5}), prompt_logprobs={"next": -1, "top": 3})
    toks, lps1, _, extra = worker.execute(encode_plan([final, b.item(sample=GREEDY)], step_id=1))
    got = np.frombuffer(extra["prompt_logprobs"], dtype="<f4")
    np.testing.assert_allclose(got, [float(ref[q - 1, a.tokens[q]]) for q in range(7, 10)], atol=1e-5)
    ids, lps = _unpack_top(extra, "top")
    assert ids.shape[0] == 2 and ids.shape[1] >= 5  # one row per sampled sequence; b's is unused
    top = torch.topk(ref[9], 5)
    assert toks[0] == ids[0, 0] == int(top.indices[0])
    assert ids[0, :5].tolist() == top.indices.tolist()
    np.testing.assert_allclose(lps[0, :5], top.values.numpy(), atol=1e-5)
    assert lps1[0] == pytest.approx(float(lps[0, 0]), abs=1e-6)
    assert np.all(np.diff(lps[0]) <= 0) and np.all(lps[0] <= 0) and np.exp(lps[0]).sum() <= 1 + 1e-6
    a.advance(4, toks[0])
    assert worker.execute(encode_plan([a.item(sample=GREEDY)], step_id=2))[3] == {}


def test_injected_oom_then_next_step_works(worker, monkeypatch):
    seq = Seq(1, [11, 12, 13, 14, 15], slot_base=700)
    plan = encode_plan([seq.item(sample=GREEDY)])
    want = worker.execute(plan)[0]

    def boom(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(worker.model, "forward", boom)
    with pytest.raises(WorkerOutOfMemory, match="out of memory"):
        worker.execute(plan)
    monkeypatch.undo()
    assert worker.execute(plan)[0] == want


def test_bad_attention_backend_is_a_clear_error():
    from freetoken.worker import Worker

    for name in ("fi", "fa", "trtllm"):
        with pytest.raises(ValueError, match="FlashInfer/FlashAttention"):
            Worker({"attention_backend": name, "device": "cpu"})


@pytest.mark.gpu
def test_cuda_worker_matches_cpu(worker, tiny_llama_dir):
    """On CUDA: KV pool sized from free memory (memory_ratio), fp32 logits close to the CPU worker's, and bf16
    (auto dtype for a bf16 request) close enough that greedy decoding agrees on a short run."""
    from freetoken.worker import Worker

    ids = [5, 17, 200, 3, 99, 42, 42, 7, 128, 255, 0, 1, 2, 64, 33, 91] * 4
    ref = worker.forward_logits(ids)
    w32 = Worker(
        {
            "model_path": tiny_llama_dir,
            "device": "cuda",
            "dtype": "float32",
            "memory_ratio": 0.05,
            "load_progress": False,
        }
    )
    free = torch.cuda.mem_get_info()[0]
    assert w32.kv_capacity_tokens > 4096
    assert w32.kv.nbytes() < 0.06 * (free + w32.kv.nbytes())
    got = w32.forward_logits(ids).cpu()
    assert (got - ref).abs().max().item() < 1e-4
    seq = Seq(0, ids[:20], slot_base=0)
    toks, lps, stats, _ = w32.execute(encode_plan([seq.item(sample=GREEDY)]))
    assert toks == [int(ref[19].argmax())]
    del w32
    torch.cuda.empty_cache()
    wbf = Worker(
        {
            "model_path": tiny_llama_dir,
            "device": "cuda",
            "dtype": "bfloat16",
            "num_tokens": 4096,
            "load_progress": False,
        }
    )
    got = wbf.forward_logits(ids).cpu()
    assert got.dtype == torch.float32 and (got - ref).abs().max().item() < 0.05


def test_frequency_penalty_forbids_repeats_and_counts_start_fresh_with_each_request(worker):
    """A large frequency penalty makes greedy decoding avoid every token it generated; the counts belong to the
    request, so a new request in the same row starts from none (its first token is the unpenalized argmax)."""
    strong = {"temperature": 0.0, "frequency_penalty": 50.0}
    seq = Seq(2, [7, 7, 7, 7], slot_base=0)
    got = []
    for step in range(12):
        toks, _, _, _ = worker.execute(encode_plan([seq.item(sample=strong)], step_id=step))
        seq.advance(len(seq.tokens) - seq.cached, toks[0])
        got.append(toks[0])
    assert len(set(got)) == len(got), got
    fresh = Seq(2, [7, 7, 7, 7], slot_base=600)  # a new request in the same row
    toks, lps, _, _ = worker.execute(encode_plan([fresh.item(sample=strong)], step_id=99))
    want, want_lp = _ref_next(worker, fresh.tokens)
    assert toks == [want] and abs(lps[0] - want_lp) < 1e-4  # logprobs stay the model's own


def _profiled_step(worker, out, step_id: int, then_short: int | None = None):
    """(tokens of a 7-token step unprofiled, the same step as ``step_id`` under ``FREETOKEN_PROFILE_STEPS=5`` writing
    to ``out``); ``then_short``: also a 3-token step with that id, below the threshold."""
    from freetoken.engine.step_profiler import StepProfiler

    tokens = [5, 9, 13, 200, 7, 7, 1]
    plain, _, _, _ = worker.execute(encode_plan([Seq(0, tokens, slot_base=0).item(sample=GREEDY)], 0))
    saved = worker.step_profiler
    try:
        worker.step_profiler = StepProfiler(
            worker.device, {"FREETOKEN_PROFILE_STEPS": "5", "FREETOKEN_PROFILE_OUT": str(out)}
        )
        profiled, _, _, _ = worker.execute(encode_plan([Seq(0, tokens, slot_base=0).item(sample=GREEDY)], step_id))
        if then_short is not None:
            worker.execute(encode_plan([Seq(0, tokens[:3], slot_base=0).item(sample=GREEDY)], then_short))
    finally:
        worker.step_profiler = saved
    return plain, profiled


def test_step_profiler_profiles_only_steps_over_its_threshold(worker, tmp_path):
    """``FREETOKEN_PROFILE_STEPS``: an eager step of at least that many new tokens is run under the profiler and
    written out (same tokens as unprofiled); a smaller step, or no variable, profiles nothing."""
    from freetoken.engine.step_profiler import StepProfiler

    out = tmp_path / "steps.txt"
    plain, profiled = _profiled_step(worker, out, 41, then_short=42)  # 3 < 5 tokens
    assert profiled == plain
    text = out.read_text()
    assert text.startswith("step 41: 7 new tokens, wall ") and "top by self CPU time" in text, text[:300]
    assert "step 42" not in text
    assert StepProfiler(worker.device, {}).wrap(0, 10**6, len) is len  # unset: the step itself, untouched
    ranged = StepProfiler(worker.device, {"FREETOKEN_PROFILE_STEPS": "5-8"})
    assert ranged.wrap(0, 9, len) is len and ranged.wrap(0, 4, len) is len and ranged.wrap(0, 8, len) is not len
    with pytest.raises(ValueError, match="FREETOKEN_PROFILE_STEPS='5-x'"):
        StepProfiler(worker.device, {"FREETOKEN_PROFILE_STEPS": "5-x"})


def test_step_profiler_a_failing_device_timeline_does_not_fail_the_step(worker, tmp_path, monkeypatch):
    """The device timeline is a diagnostic: if reading it fails, the block says so and the step's tokens stand."""
    from freetoken.engine import step_profiler

    def broken(events):
        raise KeyError("no time_range")

    monkeypatch.setattr(step_profiler, "device_intervals", broken)
    out = tmp_path / "steps.txt"
    plain, profiled = _profiled_step(worker, out, 43)
    assert profiled == plain
    assert "device timeline unavailable: KeyError" in out.read_text()


def test_step_profiler_host_mode_lists_the_steps_python_functions(worker, tmp_path):
    """``FREETOKEN_PROFILE_MODE=host``: the step runs under cProfile (same tokens) and its block names the model's
    step and the model's forward among the functions by own time; an unknown mode is refused naming the variable."""
    from freetoken.engine.step_profiler import StepProfiler

    out = tmp_path / "steps.txt"
    tokens = [5, 9, 13, 200, 7, 7, 1]
    plain, _, _, _ = worker.execute(encode_plan([Seq(0, tokens, slot_base=0).item(sample=GREEDY)], 0))
    saved = worker.step_profiler
    env = {"FREETOKEN_PROFILE_STEPS": "5", "FREETOKEN_PROFILE_OUT": str(out), "FREETOKEN_PROFILE_MODE": "host"}
    try:
        worker.step_profiler = StepProfiler(worker.device, env)
        profiled, _, _, _ = worker.execute(encode_plan([Seq(0, tokens, slot_base=0).item(sample=GREEDY)], 43))
    finally:
        worker.step_profiler = saved
    assert profiled == plain
    text = out.read_text()
    assert text.startswith("step 43: 7 new tokens, wall ") and "top by own host time" in text, text[:300]
    assert len(text.splitlines()) > 10 and "worker.py" in text and "forward" in text, text
    with pytest.raises(ValueError, match="FREETOKEN_PROFILE_MODE='cuda'"):
        StepProfiler(worker.device, {"FREETOKEN_PROFILE_MODE": "cuda"})
