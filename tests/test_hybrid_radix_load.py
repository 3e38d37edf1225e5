"""Bounded load on the hybrid radix cache through ``ft serve`` (issue 12): a tiny random Qwen3.5-MoE on the CPU,
``--max-running-requests 4`` and a snapshot pool of 3 (so snapshots are evicted while others are being restored),
8 concurrent multi-turn sessions of 3 turns over token-id ``/v1/completions`` (streamed and not; the clients
arrive 50 ms apart, then every session sends its next turn as soon as it has its answer), half of them behind one
shared system prompt, some streaming clients hanging up mid-answer (the next turn carries on from what
the client saw). Every request is accounted for (completed or cancelled, no error status), every completed answer
equals the same prompt run on a ``--cache-type naive`` server one request at a time, a hung-up answer is a prefix
of it, snapshot hits happened, and afterwards the engine is idle with every KV slot, page-table row and live state
slot free and no more snapshots held than the pool has."""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading
import time

import hf_reference as R
import pytest
import requests
from bounded_clients import post_json, stream
from server_harness import ServerProcess

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from radix_stress import accounting  # noqa: E402

pytestmark = pytest.mark.slow

ROWS = 4
SNAPSHOT_SLOTS = 3
COMMON = [
    "--device",
    "cpu",
    "--served-model-name",
    "tiny",
    "--max-running-requests",
    str(ROWS),
    "--num-tokens",
    "4096",
    "--max-seq-len-override",
    "1024",
    "--decode-log-interval",
    "20",
]
# Small prefill chunks: long prompts are prefilled in several steps (chunk-end captures) beside other requests' decode.
CACHED_ARGS = COMMON + ["--num-snapshot-slots", str(SNAPSHOT_SLOTS), "--max-prefill-length", "96"]
NAIVE_ARGS = COMMON + ["--cache-type", "naive"]
SESSIONS = 8
TURNS = 3
HANG_UPS = {(1, 1): 2, (3, 0): 1, (5, 1): 2, (6, 2): 1}  # (session, turn) -> content chunks read before hanging up
DEADLINE = 120.0  # per client call
STAGGER = 0.05  # s between session starts
VOCAB = 5000
SHARED_SYSTEM = R.prompt(140, seed=1, vocab=VOCAB)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny-qwen3_5_moe-radix-load"))
    R.write_released_qwen3_5_moe(d, seed=7)
    return d


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


class StatsPoller:
    """Polls /v1/stats in a thread while the load runs."""

    def __init__(self, srv: ServerProcess, interval: float = 0.02):
        self.srv, self.interval, self.samples = srv, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self.srv.get("/v1/stats", timeout=5).json())
            except requests.RequestException:
                pass
            self._stop.wait(self.interval)

    def most(self, key: str) -> int:
        return max((s[key] for s in self.samples), default=0)


def run_session(url: str, tok, i: int) -> list[dict]:
    """Session ``i``'s turns, one after the other; the history is prompt + answer ids (as the client got them) +
    the next turn's new ids."""
    time.sleep(STAGGER * i)  # clients arrive one after another, not in the same millisecond
    system = SHARED_SYSTEM if i % 2 == 0 else R.prompt(90 + 10 * i, seed=100 + i, vocab=VOCAB)
    history = system + R.prompt(20 + 5 * i, seed=200 + i, vocab=VOCAB)
    turns = []
    for t in range(TURNS):
        prompt = history
        hang_up = HANG_UPS.get((i, t))
        max_tokens = 300 if hang_up else 16 + 8 * ((i + t) % 3)
        if hang_up or (i + t) % 2 == 0:
            out = stream(url, body(prompt, max_tokens), DEADLINE, path="/v1/completions", hang_up_after=hang_up)
            pieces = out.pieces
        else:
            out = post_json(url, body(prompt, max_tokens), deadline=DEADLINE, path="/v1/completions")
            pieces = [out.text]
        turns.append(
            {"session": i, "turn": t, "prompt": prompt, "max_tokens": max_tokens, "hang_up": hang_up, "outcome": out}
        )
        if out.kind not in ("ok", "cancelled"):
            break
        answer = [x for p in pieces for x in tok.encode(p, add_special_tokens=False).ids]
        history = prompt + answer + R.prompt(30 + 7 * t, seed=300 + 10 * i + t, vocab=VOCAB)
    return turns


@pytest.mark.timeout(420)
def test_concurrent_sessions_with_hang_ups_on_hybrid_radix(checkpoint):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    with cf.ThreadPoolExecutor(2) as pool:  # both servers start at once
        starting = [
            pool.submit(ServerProcess, args)
            for args in ([*CACHED_ARGS, "--model-path", checkpoint], [*NAIVE_ARGS, "--model-path", checkpoint])
        ]
        servers = [f.result() if not f.exception() else None for f in starting]
    srv, ref = servers
    try:
        assert srv is not None and ref is not None, [f.exception() for f in starting]
        assert "cache_type='hybrid_radix'" in srv.log() and "cache_type='naive'" in ref.log()
        stats0 = srv.get("/v1/stats").json()
        assert stats0["snapshot_slots_total"] == SNAPSHOT_SLOTS, stats0

        t0 = time.monotonic()
        with StatsPoller(srv) as poller, cf.ThreadPoolExecutor(SESSIONS) as pool:
            sessions = list(pool.map(lambda i: run_session(srv.url, tok, i), range(SESSIONS)))
        took = time.monotonic() - t0
        # It was a load: requests ran side by side and waited for a row.
        assert poller.most("running_requests") == ROWS and poller.most("queued_requests") >= 1, poller.samples[-3:]
        turns = [t for s in sessions for t in s]

        # Every request accounted for: each session ran all its turns, each one completed or (hang-ups) cancelled.
        bad = [(t["session"], t["turn"], t["outcome"]) for t in turns if t["outcome"].kind not in ("ok", "cancelled")]
        assert not bad, bad[:3]
        assert len(turns) == SESSIONS * TURNS
        for t in turns:
            o = t["outcome"]
            if t["hang_up"]:
                assert o.kind == "cancelled" and o.chunks == t["hang_up"], (t["session"], t["turn"], o)
            else:
                assert o.kind == "ok" and o.status == 200 and o.finish_reason == "length", (t["session"], t["turn"], o)

        # Nothing keeps running: the hang-ups (300 tokens each) were aborted, every slot comes back.
        stats = srv.wait_idle(60)
        deadline = time.time() + 10
        while (stats["kv_used_tokens"] or stats["state_slots_used"]) and time.time() < deadline:
            time.sleep(0.1)
            stats = srv.get("/v1/stats").json()
        # The stress run's end-of-load accounting (bench/radix_stress.py: nothing in flight, every KV slot, row and
        # live state slot free, every held snapshot and tree token evictable, snapshot hits, no integrity failure),
        # then this pool's size and the reuse's extent (second turns, the shared system prompt, repeated prefixes).
        assert accounting(stats, ROWS, srv.log()) == [], (accounting(stats, ROWS, srv.log()), stats)
        assert stats["snapshot_slots_total"] == SNAPSHOT_SLOTS and stats["snapshot_hit_tokens"] >= 64, stats

        # Greedy answers equal the naive server's, run one request at a time; a hung-up answer is a prefix of it.
        mismatches = []
        for t in turns:
            o = t["outcome"]
            want = post_json(
                ref.url,
                body(t["prompt"], 8 if t["hang_up"] else t["max_tokens"]),
                deadline=DEADLINE,
                path="/v1/completions",
            )
            assert want.kind == "ok", want
            same = want.text.startswith(o.text) if t["hang_up"] else want.text == o.text
            if not same:
                mismatches.append((t["session"], t["turn"], len(t["prompt"]), o.text, want.text))
        assert not mismatches, mismatches

        # ...and it still serves, and its integrity checks never failed.
        again = post_json(srv.url, body(SHARED_SYSTEM + [7, 8, 9], 4), deadline=60, path="/v1/completions")
        assert (
            again.kind == "ok"
            and again.text
            == post_json(ref.url, body(SHARED_SYSTEM + [7, 8, 9], 4), deadline=60, path="/v1/completions").text
        )
        assert srv.get("/health").status_code == 200
        log = srv.log()
        assert "integrity check failed" not in log and "panicked" not in log, log[-3000:]
        print(
            f"{len(turns)} requests in {took:.1f} s ({sum(t['hang_up'] is not None for t in turns)} hung up); "
            f"stats {stats}"
        )
    finally:
        codes = [s.stop() if s is not None else 0 for s in servers]
    assert codes == [0, 0], (codes, srv.log()[-3000:] if srv else "")
