"""Bounded loopback load on ``ft serve`` (demo model, CPU): 64 concurrent clients send 128 short requests in
all shapes (streaming or not, chat or completions, shared prompt prefixes), some hanging up mid-stream or before
the answer. Every request is accounted for (completed + cancelled == sent, no errors), and afterwards the
engine is idle with every KV slot and page-table row free."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests
from bounded_clients import Outcome, chat_body, post_json, stream
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

CLIENTS = 64
REQUESTS = 128
ROWS = 16
SERVER_ARGS = [
    "--device",
    "cpu",
    "--max-running-requests",
    str(ROWS),
    "--num-tokens",
    "16384",
    "--max-seq-len-override",
    "1024",
    "--decode-log-interval",
    "20",
]
DEADLINE = 240.0  # per client call; the whole run takes well under this on 2 cores
TOPICS = ["the sea", "mountains", "a cat", "the moon", "bread", "rain", "a clock", "music"]


def one_request(url: str, i: int) -> tuple[str, Outcome]:
    """Request ``i``'s shape is fixed by ``i``: the run is the same every time (up to thread timing)."""
    topic = TOPICS[i % len(TOPICS)]
    shape = i % 8
    if shape in (0, 1):  # streams that hang up after 1 or 2 chunks of a long answer: must be aborted
        body = chat_body(f"Write a long essay about {topic}.", max_tokens=400, ignore_eos=True)
        return "hang-up", stream(url, body, deadline=DEADLINE, hang_up_after=1 + shape)
    if shape == 2:  # gives up waiting for a long non-streaming answer
        body = chat_body(f"Write a long essay about {topic}, request {i}.", max_tokens=400, ignore_eos=True)
        try:
            requests.post(url + "/v1/chat/completions", json=body, timeout=(5, 1.0))
        except requests.RequestException:
            return "hang-up", Outcome("cancelled")
        return "hang-up", Outcome("ok", finish_reason="stop")
    if shape == 3:
        return "stream", stream(url, chat_body(f"One sentence about {topic}.", max_tokens=8), deadline=DEADLINE)
    if shape == 4:
        body = {"prompt": f"Once upon a time, {topic}", "max_tokens": 8, "temperature": 0.7, "seed": i}
        return "stream", stream(url, body, deadline=DEADLINE, path="/v1/completions")
    if shape == 5:
        body = {"prompt": f"The story of {topic}:", "max_tokens": 6, "stop": ["\n"]}
        return "whole", post_json(url, body, deadline=DEADLINE, path="/v1/completions")
    return "whole", post_json(
        url, chat_body(f"Request {i}: say something about {topic}.", max_tokens=8), deadline=DEADLINE
    )


@pytest.mark.timeout(600)
def test_load_every_request_accounted_for_and_slots_freed(demo_gguf_path):
    srv = ServerProcess(SERVER_ARGS)
    try:
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(lambda i: one_request(srv.url, i), range(REQUESTS)))
        took = time.monotonic() - t0
        completed = [o for kind, o in results if o.kind == "ok"]
        cancelled = [o for kind, o in results if o.kind == "cancelled"]
        other = [(kind, o) for kind, o in results if o.kind not in ("ok", "cancelled")]
        assert not other, other[:5]
        assert len(completed) + len(cancelled) == REQUESTS
        assert len(cancelled) == REQUESTS // 8 * 3, (len(cancelled), "every hang-up client hung up")
        for kind, o in results:
            if kind in ("stream", "whole"):
                assert o.kind == "ok" and o.finish_reason in ("stop", "length"), o
            if kind == "stream":
                assert o.done, o
        # Every hang-up was aborted in the engine (each asked for 400 tokens): nothing keeps running.
        stats = srv.wait_idle(60)
        deadline = time.time() + 10
        while stats["kv_used_tokens"] and time.time() < deadline:
            time.sleep(0.1)
            stats = srv.get("/v1/stats").json()
        assert stats["running_requests"] == 0 and stats["queued_requests"] == 0, stats
        assert stats["kv_used_tokens"] == 0, stats
        assert stats["free_rows"] == ROWS, stats
        assert stats["requests_in_flight"] == 0, stats
        assert srv.get("/health").status_code == 200
        # ...and it still serves
        ok = post_json(srv.url, chat_body("What is the capital of France?", max_tokens=4), deadline=60)
        assert ok.kind == "ok", ok
        log = srv.log()
        assert "integrity check failed" not in log, log[-3000:]
        print(
            f"{REQUESTS} requests from {CLIENTS} clients in {took:.1f} s: {len(completed)} completed, "
            f"{len(cancelled)} cancelled; stats {stats}"
        )
    finally:
        code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.mark.timeout(300)
def test_overload_is_refused_with_429_and_leaves_nothing_behind(demo_gguf_path):
    """Past --max-running-requests + --max-queued-requests, requests get 429 at once; the rest are served, and
    every slot comes back."""
    srv = ServerProcess(
        [
            "--device",
            "cpu",
            "--max-running-requests",
            "2",
            "--max-queued-requests",
            "2",
            "--num-tokens",
            "4096",
            "--max-seq-len-override",
            "512",
        ]
    )
    try:
        n = 24
        with cf.ThreadPoolExecutor(n) as pool:
            results = list(
                pool.map(
                    lambda i: (
                        post_json(
                            srv.url, chat_body(f"Request {i}: hello.", max_tokens=6, ignore_eos=True), deadline=120
                        )
                        if i % 2
                        else stream(
                            srv.url, chat_body(f"Request {i}: hello.", max_tokens=6, ignore_eos=True), deadline=120
                        )
                    ),
                    range(n),
                )
            )
        served = [o for o in results if o.kind == "ok"]
        refused = [o for o in results if o.status == 429]
        assert len(served) + len(refused) == n, [o for o in results if o.kind != "ok" and o.status != 429]
        assert served and refused, (len(served), len(refused))
        assert all(o.error and o.error.get("code") == "server_overloaded" for o in refused), refused[:2]
        assert all(o.elapsed < 5 for o in refused), "429 comes at once"
        stats = srv.wait_idle(30)
        assert stats["kv_used_tokens"] == 0 and stats["free_rows"] == 2 and stats["requests_in_flight"] == 0, stats
        ok = post_json(srv.url, chat_body("Hi", max_tokens=4), deadline=60)
        assert ok.kind == "ok", ok
    finally:
        code = srv.stop()
    assert code == 0
