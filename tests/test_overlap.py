"""Overlap scheduling (issue 9): a decode step is planned and launched before the one ahead of it is committed,
its input token taken on the device from that step's sampled tokens. The requests must see exactly what the
synchronous loop (``--disable-overlap-schedule``) gives them: greedy and seeded sampling with penalties, logprobs,
stop tokens ending requests mid-batch (the step already launched past their end is discarded), requests admitted
while others decode, a hybrid model's radix cache over a multi-turn conversation, expert offload, the decode graph
path (emulated on CPU), and the server end to end with stop strings. On CPU a "launch" runs the step to the end,
but the code path (placeholder inputs, deferred commits, discarded tokens) is the one the GPU runs."""

from __future__ import annotations

import concurrent.futures as cf

import hf_reference as R
import pytest

pytestmark = pytest.mark.slow

ARGS = dict(
    device="cpu",
    num_tokens=4096,
    max_seq_len_override=512,
    load_progress=False,
    max_prefill_length=64,
    max_running_requests=4,
)
SAMPLINGS = [
    dict(temperature=0.0, max_tokens=12),
    dict(temperature=0.9, top_p=0.9, top_k=20, seed=5, max_tokens=12, presence_penalty=0.5, frequency_penalty=0.3),
    dict(temperature=1.2, min_p=0.05, seed=7, max_tokens=9),
    dict(temperature=0.0, max_tokens=10, frequency_penalty=1.0),
    dict(temperature=0.7, seed=11, max_tokens=14),
    dict(temperature=0.0, max_tokens=1),
]


def _qwen3_dir(path) -> str:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(4)
    Qwen3ForCausalLM(cfg).float().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tiny_llama_dir, tmp_path_factory):
    hybrid = str(tmp_path_factory.mktemp("tiny-qwen3_5_moe-overlap"))
    R.write_released_qwen3_5_moe(hybrid, seed=11, max_position_embeddings=4096)
    return {"llama": tiny_llama_dir, "qwen3": _qwen3_dir(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3_5_moe": hybrid}


def _llm(path: str, overlap: bool, **extra):
    from freetoken import LLM

    return LLM(path, disable_overlap_schedule=not overlap, **{**ARGS, **extra})


def _run(llm, prompts: list[list[int]], stops: list[list[int]], late: int = 3) -> list[tuple]:
    """Every prompt with its ``SAMPLINGS`` entry and stop tokens; the last ``late`` arrive while the first decode.
    Returns ``(tokens, logprobs, finish reason, cached tokens)`` per request."""
    eng, out = llm.engine, {}

    def add(i):
        rid = next(llm._ids)
        out[rid] = [i, [], [], None, 0]
        eng.add_request(rid, prompts[i], {**SAMPLINGS[i % len(SAMPLINGS)], "stop_token_ids": stops[i]})

    def drain(steps: int):
        for _ in range(steps):
            if eng.is_idle():
                return
            for kind, rid, a, b in eng.step():
                o = out[rid]
                if kind == "token":
                    o[1].append(int(a))
                    o[2].append(float(b))
                elif kind == "finished":
                    o[3] = a
                elif kind == "started":
                    o[4] = int(b)
                elif kind == "failed":
                    raise AssertionError(a)

    for i in range(len(prompts) - late):
        add(i)
    drain(4)
    for i in range(len(prompts) - late, len(prompts)):
        add(i)
    drain(10_000)
    assert eng.is_idle()
    eng.check_integrity()
    return [tuple(o[1:]) for o in sorted(out.values(), key=lambda o: o[0])]


def _assert_same(got: list[tuple], ref: list[tuple]):
    for (tok, lp, fin, _), (rtok, rlp, rfin, _) in zip(got, ref):
        assert (tok, fin) == (rtok, rfin)
        assert max((abs(a - b) for a, b in zip(lp, rlp)), default=0.0) < 1e-4  # batch composition may differ


def _stops_mid_batch(ref: list[tuple]) -> list[list[int]]:
    """Every other request stops on a token it generates a few positions in (so it ends while others decode)."""
    return [[r[0][min(3, len(r[0]) - 1)]] if i % 2 == 0 and len(r[0]) > 4 else [] for i, r in enumerate(ref)]


CASES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "llama-graphs": ("llama", {"emulate_cuda_graphs": True}),
    "qwen3_5_moe-radix": ("qwen3_5_moe", {}),
    "qwen3_5_moe-offload-graphs": ("qwen3_5_moe", {"moe_backend": "offload", "emulate_cuda_graphs": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_gives_the_outputs_of_the_synchronous_loop(model_dirs, case):
    family, extra = CASES[case]
    prompts = [R.prompt(5 + 13 * i, seed=40 + i) for i in range(7)]
    off, on = _llm(model_dirs[family], False, **extra), _llm(model_dirs[family], True, **extra)
    stops = _stops_mid_batch(_run(off, prompts, [[]] * len(prompts)))
    ref = _run(off, prompts, stops)
    got = _run(on, prompts, stops)
    _assert_same(got, ref)
    assert sum(r[2] == "stop" for r in ref) >= 2, "no request ended mid-batch on a stop token"
    assert on.engine.stats()["overlapped_steps"] > 5
    assert off.engine.stats()["overlapped_steps"] == 0


def test_hybrid_radix_multi_turn_with_answers_ending_on_a_stop_token(model_dirs):
    """Each answer ends on a stop token while the next decode is already launched: the request's live state,
    advanced by that step, is donated covering the whole answer, and the next turn resumes there."""
    off, on = _llm(model_dirs["qwen3_5_moe"], False), _llm(model_dirs["qwen3_5_moe"], True)
    history, previous = R.prompt(150, seed=1), 0
    for turn in range(3):
        probe = _run(off, [history], [[]], late=0)[0][0]
        (ref,) = _run(off, [history], [[probe[3]]], late=0)
        (got,) = _run(on, [history], [[probe[3]]], late=0)
        _assert_same([got], [ref])
        assert got[2] == "stop"
        if turn:
            assert got[3] == previous, "the next turn resumes after the whole previous answer"
        previous = len(history) + len(got[0])
        history = history + got[0] + R.prompt(40, seed=100 + turn)
    assert on.engine.stats()["snapshot_hits"] >= 2


@pytest.fixture(scope="module")
def servers(demo_gguf_path):
    from server_harness import ServerProcess

    args = ["--max-running-requests", "4", "--num-tokens", "8192", "--max-seq-len-override", "2048"]
    on = ServerProcess(args)
    off = ServerProcess(args, env={"DISABLE_OVERLAP_SCHEDULING": "1"})
    yield on, off
    for srv in (on, off):
        assert srv.stop() == 0, srv.log()[-3000:]
        assert "integrity check failed" not in srv.log()


def _chat(srv, i: int) -> dict:
    questions = ["What is the capital of France?", "Name three colours.", "Count to ten.", "Say hello in French."]
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": questions[i % 4]}],
        "max_tokens": 8 + 7 * i,
        "temperature": 0 if i % 2 == 0 else 0.8,
        "seed": 100 + i,
        "presence_penalty": 0.4 if i % 3 == 0 else 0.0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    if i in (1, 5):
        body["stop"] = [" and", "."]
    r = srv.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_server_outputs_equal_with_overlap_on_and_off(servers):
    on, off = servers
    assert "overlap_schedule=True" in on.log() and "overlap_schedule=False" in off.log()
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _chat(on, i), range(8)))
        ref = list(pool.map(lambda i: _chat(off, i), range(8)))
    for g, r in zip(got, ref):
        assert (g["message"]["content"], g["finish_reason"]) == (r["message"]["content"], r["finish_reason"])
        lg = [t["logprob"] for t in g["logprobs"]["content"]]
        lr = [t["logprob"] for t in r["logprobs"]["content"]]
        assert len(lg) == len(lr) and max((abs(a - b) for a, b in zip(lg, lr)), default=0.0) < 1e-3
    assert "stop" in {r["finish_reason"] for r in ref}
    assert on.wait_idle()["overlapped_steps"] > 0
    assert off.wait_idle()["overlapped_steps"] == 0


def _worker(path: str, graphs: bool, **extra):
    from freetoken.worker import Worker

    return Worker({**ARGS, "model_path": path, "dtype": "float32", "emulate_cuda_graphs": graphs, **extra})


def _decode(rows_pos: list[tuple[int, int]], tokens: list[int], prev: list[int], step_id: int, seed: int) -> dict:
    """A decode plan: row r at position p feeds ``tokens[i]`` (or, where ``prev[i] >= 0``, the previous step's
    sampled row ``prev[i]``), its KV slot ``100 * r + p``; seeded sampling with penalties."""
    from freetoken.engine.step_plan import StepPlan

    sample = {"temperature": 0.9, "top_k": 30, "presence_penalty": 0.5, "num_top_logprobs": 2}
    seqs = [
        {"tokens": [t], "prefix_len": p, "row": r, "table_from": p, "table_slots": [100 * r + p], "input_from_prev": q}
        | {"sample": {**sample, "seed": seed + r}}
        for (r, p), t, q in zip(rows_pos, tokens, prev)
    ]
    return StepPlan.build(seqs, step_id=step_id).to_flat()


CUDA = {"device": "cuda", "emulate_cuda_graphs": False, "disable_cuda_graph": False}
LAUNCH_CASES = [
    pytest.param(False, {}, id="eager"),
    pytest.param(True, {}, id="emulated-graphs"),
    pytest.param(False, CUDA, id="cuda-graphs", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("graphs,extra", LAUNCH_CASES)
def test_worker_launch_collect_reads_the_previous_steps_tokens(model_dirs, graphs, extra):
    """Two decode steps launched before either is collected, the second's inputs taken from the first's sampled
    rows (in another order), equal the same steps run one by one with the tokens fed back from the host (on CUDA:
    real graphs, the second launched while the first may still run)."""
    from freetoken.engine.step_plan import StepPlan
    from freetoken.errors import InvalidPlan

    def prefill(w):
        seqs = [
            {"tokens": R.prompt(6, seed=r), "prefix_len": 0, "row": r, "table_from": 0}
            | {"table_slots": [100 * r + i for i in range(6)], "sample": {"temperature": 0.0}}
            for r in (0, 1)
        ]
        return w.execute(StepPlan.build(seqs).to_flat())[0]

    ref, over = _worker(model_dirs["llama"], graphs, **extra), _worker(model_dirs["llama"], graphs, **extra)
    first = prefill(ref)
    assert prefill(over) == first
    a = ref.execute(_decode([(0, 6), (1, 6)], first, [-1, -1], 1, 10))
    b = ref.execute(_decode([(1, 7), (0, 7)], a[0][::-1], [-1, -1], 2, 20))
    over.launch(_decode([(0, 6), (1, 6)], first, [-1, -1], 1, 10))
    over.launch(_decode([(1, 7), (0, 7)], [0, 0], [1, 0], 2, 20))
    for want in (a, b):
        tokens, logprobs, _, tops = over.collect()  # (the statistics differ)
        assert (tokens, tops) == (want[0], want[3])
        assert max(abs(x - y) for x, y in zip(logprobs, want[1])) < 1e-5
    with pytest.raises(InvalidPlan, match="input_from_prev"):
        over.launch(_decode([(0, 8)], [0], [2], 3, 30))  # the previous step sampled two rows
