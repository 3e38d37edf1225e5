"""``GET /metrics`` of a real ``ft serve`` on the demo model (issue 13), read with ``prometheus_client``'s own
parser: the text parses, the ``freetoken_`` families are there, and counters, histograms and the engine's gauges
move as requests are served, rejected and streamed; the route needs ``--api-key`` like the API."""

from __future__ import annotations

import time

import pytest
import requests
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

KEY = "metrics-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(demo_gguf_path):
    srv = ServerProcess(
        ["--max-running-requests", "4", "--num-tokens", "8192", "--max-seq-len-override", "2048", "--api-key", KEY]
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def scrape(srv) -> dict:
    """``{(sample name, frozenset(labels without model_name)): value}``, through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    r = srv.get("/metrics", headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    model = srv.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
    out = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("freetoken_"), family.name
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == model
            out[(s.name, frozenset(labels.items()))] = s.value
    return out


def v(m: dict, name: str, **labels) -> float:
    return m[(name, frozenset(labels.items()))]


def test_metrics_need_the_api_key(server):
    assert server.get("/metrics").status_code == 401
    assert server.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_counters_move_as_requests_are_served(server):
    before = scrape(server)
    assert v(before, "freetoken_engine_health", state="serving") == 1.0
    assert v(before, "freetoken_kv_cache_capacity_tokens") == 8192.0
    chat = {
        "model": "demo",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = server.post("/v1/chat/completions", json=chat, headers=AUTH)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    again = server.post("/v1/chat/completions", json=chat, headers=AUTH)  # the same prompt: a prefix-cache hit
    assert again.status_code == 200 and again.json()["usage"] == usage, again.text
    stream = requests.post(
        server.url + "/v1/completions",
        headers=AUTH,
        stream=True,
        timeout=120,
        json={
            "model": "demo",
            "prompt": "The capital of France is",
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert stream.status_code == 200
    body = stream.text
    assert "[DONE]" in body
    bad = server.post("/v1/chat/completions", json={**chat, "temperature": -1}, headers=AUTH)
    assert bad.status_code == 400
    for _ in range(300):  # the engine publishes its gauges after the step that ends the last request
        after = scrape(server)
        if v(after, "freetoken_num_requests_running") == 0 and v(after, "freetoken_num_requests_waiting") == 0:
            break
        time.sleep(0.1)

    def moved(name, **labels):
        return v(after, name, **labels) - v(before, name, **labels)

    assert moved("freetoken_requests_total", outcome="length") + moved("freetoken_requests_total", outcome="stop") == 3
    assert moved("freetoken_requests_total", outcome="length") >= 1  # the streamed one ignores EOS: 6 tokens
    assert moved("freetoken_requests_total", outcome="rejected") == 1
    assert moved("freetoken_requests_total", outcome="error") == 0
    assert moved("freetoken_generation_tokens_total") == 2 * usage["completion_tokens"] + 6
    assert moved("freetoken_prompt_tokens_total") >= 2 * usage["prompt_tokens"] + 1
    assert moved("freetoken_prefix_cache_queries_total") == moved("freetoken_prompt_tokens_total")
    assert moved("freetoken_prefix_cache_hits_total") >= usage["prompt_tokens"] // 2  # the repeated prompt
    assert moved("freetoken_time_to_first_token_seconds_count") == 3
    assert moved("freetoken_e2e_request_latency_seconds_count") == 3
    assert moved("freetoken_inter_token_latency_seconds_count") == 2 * (usage["completion_tokens"] - 1) + 5
    assert moved("freetoken_time_to_first_token_seconds_sum") > 0
    assert moved("freetoken_step_time_seconds_count", kind="decode") >= 5
    assert moved("freetoken_step_time_seconds_count", kind="prefill") >= 1
    assert v(after, "freetoken_num_requests_running") == 0 and v(after, "freetoken_num_requests_waiting") == 0
    assert v(after, "freetoken_engine_health", state="serving") == 1.0
