"""``ft serve`` on the demo model, end to end through the official ``openai`` client (issue 2) and the prefix
cache's visible behaviour (issue 3). Two servers: radix cache with cache reporting, and the naive cache as the
reference for "a cache hit gives the same greedy output"."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SERVER_ARGS = ["--max-running-requests", "8", "--num-tokens", "16384", "--max-seq-len-override", "4096"]


@pytest.fixture(scope="module")
def server(demo_gguf_path):
    srv = ServerProcess(SERVER_ARGS + ["--enable-cache-report", "--decode-log-interval", "5"])
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "integrity check failed" not in srv.log(), srv.log()[-3000:]


@pytest.fixture(scope="module")
def naive_server(demo_gguf_path):
    srv = ServerProcess(SERVER_ARGS + ["--cache-type", "naive"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_gguf_path):
    """The tokenizer and chat template the server uses, read from the same GGUF."""
    from tokenizers import Tokenizer

    from freetoken.loading.gguf import GGUFCheckpoint
    from freetoken.loading.gguf_tokenizer import tokenizer_from_gguf

    info = tokenizer_from_gguf(GGUFCheckpoint(demo_gguf_path))
    return Tokenizer.from_file(info.tokenizer_path), info.chat_template


def test_greedy_factual_answer_and_usage(client, demo_tokenizer):
    import jinja2

    r = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=24)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].finish_reason == "stop"
    tok, template = demo_tokenizer
    rendered = jinja2.Template(template).render(messages=QUESTION, add_generation_prompt=True)
    prompt_ids = tok.encode(rendered, add_special_tokens=False).ids
    assert r.usage.prompt_tokens == len(prompt_ids)
    # the answer re-encodes to the generated tokens, plus the end-of-turn token that stopped it
    assert r.usage.completion_tokens == len(tok.encode(text, add_special_tokens=False).ids) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(
        model="demo",
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage, roles = [], [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert "".join(pieces) == full.choices[0].message.content
    assert len(pieces) > 3, "tokens must arrive one by one, not in one piece"
    assert roles == ["assistant"] and finish == ["stop"]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_anthropic_client_messages_streaming_and_count_tokens(server, client):
    """The official ``anthropic`` client against ``/v1/messages``: the same greedy answer as chat completions,
    the stream's text equal to the whole message's, and ``count_tokens`` equal to the prompt's usage."""
    from anthropic import Anthropic

    ac = Anthropic(base_url=server.url, api_key="unused", timeout=120)
    GREEDY = {"temperature": 0}  # current clients no longer send sampling fields; the server still takes them
    msg = ac.messages.create(model="demo", max_tokens=24, messages=QUESTION, extra_body=GREEDY)
    text = msg.content[0].text
    assert "Paris" in text, text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens <= 24
    same = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=24)
    assert same.choices[0].message.content == text
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == same.usage.prompt_tokens
    with ac.messages.stream(model="demo", max_tokens=24, messages=QUESTION, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == msg.stop_reason
    count = ac.messages.count_tokens(model="demo", messages=QUESTION)
    assert count.input_tokens == same.usage.prompt_tokens
    stopped = ac.messages.create(
        model="demo", max_tokens=24, messages=QUESTION, extra_body=GREEDY, stop_sequences=["zzz", "Paris"]
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert stopped.content[0].text == text[: text.index("Paris")]


def test_completions_token_ids_and_exact_counts(server):
    r = server.post(
        "/v1/completions",
        {"model": "demo", "prompt": [1, 504, 3458, 282], "max_tokens": 7, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == "length"


def test_models_and_health(server):
    models = server.get("/v1/models").json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert server.get("/health").status_code == 200


def test_sixteen_concurrent_streams_and_malformed_request(server, client):
    def one(i: int) -> str:
        stream = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            temperature=0.7,
            seed=i,
            max_tokens=12,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        bad = requests.post(
            server.url + "/v1/chat/completions",
            data=b'{"messages": [',
            timeout=30,
            headers={"Content-Type": "application/json"},
        )
        texts = [f.result(timeout=300) for f in futures]
    assert all(texts), texts
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    # still serving
    r = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=8)
    assert r.choices[0].message.content
    server.wait_idle()


def test_prefix_cache_hit_reports_cached_tokens_and_matches_naive(server, naive_server):
    passage = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(40))
    messages = [{"role": "user", "content": passage + "\nWhat animal jumps?"}]
    body = {"model": "demo", "messages": messages, "temperature": 0, "max_tokens": 16}
    first = server.post("/v1/chat/completions", body).json()
    second = server.post("/v1/chat/completions", body).json()
    reference = naive_server.post("/v1/chat/completions", body).json()
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert prompt_tokens > 400
    # only the chat template's default system prompt, shared with earlier requests, can be cached the first time
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < 40
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens - 1 >= cached >= prompt_tokens - 16, (cached, prompt_tokens)
    text = first["choices"][0]["message"]["content"]
    assert second["choices"][0]["message"]["content"] == text
    assert reference["choices"][0]["message"]["content"] == text
    assert "Prefill batch" in server.log() and f"#cached-token: {cached}" in server.log()


def test_n_choices_with_and_without_the_prefix_cache(server, naive_server):
    """``n`` works with the cache off too (each choice computes the prompt); greedy choices are equal, and the same
    as the radix server's, where the other choices found the prompt cached."""
    body = {"model": "demo", "messages": QUESTION, "temperature": 0, "max_tokens": 12, "n": 3}
    cached = server.post("/v1/chat/completions", body).json()
    naive = naive_server.post("/v1/chat/completions", body).json()
    for r in (cached, naive):
        assert [c["index"] for c in r["choices"]] == [0, 1, 2], r
        assert len({c["message"]["content"] for c in r["choices"]}) == 1, r
    assert naive["choices"][0]["message"] == cached["choices"][0]["message"]
    prompt = cached["usage"]["prompt_tokens"]
    assert naive["usage"]["prompt_tokens"] == prompt, "the prompt counts once"
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1


def test_thirty_two_clients_with_shared_prefixes_then_idle(server):
    system = "You are a terse assistant. " * 20

    def one(i: int) -> dict:
        body = {
            "model": "demo",
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Say {i}."}],
        }
        r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert len(results) == 32 and all(r["choices"][0]["message"]["content"] is not None for r in results)
    assert sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results) > 0
    stats = server.wait_idle()
    assert stats["kv_used_tokens"] == 0, stats  # only the prefix cache holds KV now


def test_client_disconnect_aborts_within_a_step(server):
    body = {"model": "demo", "messages": QUESTION, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith(b"data: {"):
                got += 1
            if got >= 3:
                break
    # the connection is closed: the request must leave within a step or two, not after 2000 tokens
    t0 = time.time()
    server.wait_idle(timeout=20)
    assert time.time() - t0 < 20


def test_idle_integrity_check_runs_once_the_server_is_quiet(server, client):
    """The bookkeeping check waits for a quiet moment after the last answer (not on the next request's path), and
    then runs: `/v1/stats` counts it, and the fixture's teardown finds no failure in the log."""
    before = server.wait_idle()["integrity_checks"]
    client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=4)
    deadline = time.time() + 20
    while server.get("/v1/stats").json()["integrity_checks"] <= before:
        assert time.time() < deadline, "no integrity check ran within 20 s of going idle"
        time.sleep(0.1)


def test_stats_split_the_last_prefill_step(server, client):
    """`/v1/stats` `last_prefill_*`: the last prompt-computing step's new tokens, the engine's time for it (at least
    the worker's), its span on the device (0 on the CPU: not measured) and the host's time to enqueue its forward
    (on the CPU the forward itself, within the worker's time)."""
    content = "Tell me a story about a lighthouse keeper, " + "and then another one " * 20
    client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=2
    )
    stats = server.wait_idle()
    assert stats["last_prefill_tokens"] > 40
    assert stats["last_prefill_engine_ms"] >= stats["last_prefill_forward_ms"] > 0
    assert stats["last_prefill_device_ms"] == 0
    assert 0 < stats["last_prefill_launch_ms"] <= stats["last_prefill_forward_ms"]
