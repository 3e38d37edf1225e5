"""``ft serve`` on a tiny random Qwen3.5-MoE checkpoint in the released layout (outer ``qwen3_5_moe`` config,
``model.language_model.*`` tensors, MTP and vision tensors to skip) with the real Qwen3.5/3.6 tokenizer: the
openai client gets chat answers, streamed and not (noise text, real plumbing), and greedy completions over
token ids equal HF transformers' greedy continuation of the same weights."""

from __future__ import annotations

import os

import hf_reference as R
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny-qwen3_5_moe"))
    return d, R.write_released_qwen3_5_moe(d, seed=5)


def serve_args(model_path: str) -> list[str]:
    return ["--model-path", model_path, "--served-model-name", "tiny", "--max-running-requests", "4",
            "--num-tokens", "4096", "--max-seq-len-override", "1024"]  # fmt: skip


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = ServerProcess(serve_args(checkpoint[0]))
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_chat_through_openai_client_streaming_and_not(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好, what is 2+2? 🙂"}]
    full = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 10 and 1 <= full.usage.completion_tokens <= 12
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=12, stream=True
        )
        if c.choices
    ]
    assert "".join(pieces) == full.choices[0].message.content
    assert "qwen3_5_moe" in server.log() or "Qwen3_5Moe" in server.log()


def test_greedy_completion_matches_hf(server, checkpoint):
    _, hf = checkpoint
    prompt = [9707, 11, 1879, 0, 3555, 374, 220, 17, 10, 17, 30]
    r = server.post(
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": None},
    )
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    expected, _ = R.hf_greedy(hf, prompt, 8)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(checkpoint[0], "tokenizer.json"))
    assert text == tok.decode(expected, skip_special_tokens=True)


def test_hybrid_radix_hit_through_the_server_equals_hf(server, checkpoint):
    """The server resolves radix to hybrid_radix on this hybrid model: a prompt sent twice resumes from a
    recurrent-state snapshot the second time (counted in /v1/stats) and both answers equal HF's."""
    _, hf = checkpoint
    prompt = R.prompt(150, seed=9, vocab=5000)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    hits0 = server.get("/v1/stats").json()["snapshot_hits"]
    texts = [server.post("/v1/completions", body).json()["choices"][0]["text"] for _ in range(2)]
    stats = server.get("/v1/stats").json()
    assert stats["snapshot_hits"] >= hits0 + 1 and stats["snapshot_slots_total"] == 16, stats
    assert "cache_type='hybrid_radix'" in server.log()
    expected, _ = R.hf_greedy(hf, prompt, 6)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(checkpoint[0], "tokenizer.json"))
    assert texts == [tok.decode(expected, skip_special_tokens=True)] * 2


def test_tool_call_round_trip_reuses_the_history_and_equals_naive(server, checkpoint):
    """A chat that goes user -> assistant tool call -> tool result -> assistant, rendered by the model's chat
    template: the second request reuses the first one's prefix (hybrid radix) and both answers equal a server
    with --cache-type naive."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    first = [
        {"role": "system", "content": "You are a weather agent. " * 20},
        {"role": "user", "content": "What is the weather in Paris today?"},
    ]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    }
    second = first + [call, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C, light wind."}]

    def ask(srv, messages):
        body = {"model": "tiny", "messages": messages, "tools": tools, "max_tokens": 8, "temperature": 0}
        r = srv.post("/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        return r.json()

    naive = ServerProcess(serve_args(checkpoint[0]) + ["--cache-type", "naive"])
    try:
        refs = [ask(naive, m)["choices"][0]["message"] for m in (first, second)]
    finally:
        assert naive.stop() == 0
    hits0 = server.get("/v1/stats").json()["snapshot_hit_tokens"]
    outs = [ask(server, m)["choices"][0]["message"] for m in (first, second)]
    assert outs == refs
    # the tool round trip resumed past the shared system prompt and question
    assert server.get("/v1/stats").json()["snapshot_hit_tokens"] >= hits0 + 64


def test_expert_offload_launch_line_serves_the_same_greedy_tokens(checkpoint):
    """The brief's launch line shape (--moe-backend offload --moe-cache-size N), with a cache far smaller than the
    model's 32 experts (and --moe-prefill-hit-d2d by default): greedy completions still equal HF's (the second
    prompt's prefill streamed while decode had filled the cache), and /v1/stats counts the cache's hits and misses
    and the streamed experts taken from the cache."""
    _, hf = checkpoint
    srv = ServerProcess(
        [
            "--model-path",
            checkpoint[0],
            "--served-model-name",
            "tiny",
            "--max-running-requests",
            "1",
            "--max-seq-len-override",
            "1024",
            "--moe-backend",
            "offload",
            "--moe-cache-size",
            "6",
            "--num-tokens",
            "4096",
        ]
    )
    try:
        log = srv.log()
        assert "moe_backend='offload'" in log and "Expert cache: 6 of 32 experts" in log, log[-3000:]
        assert "hit_d2d=True" in log, log[-3000:]
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(os.path.join(checkpoint[0], "tokenizer.json"))
        for prompt in ([9707, 11, 1879, 0, 3555, 374, 220, 17, 10, 17, 30], [785, 6722, 315, 9625, 374, 12095, 13]):
            r = srv.post(
                "/v1/completions",
                {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            expected, _ = R.hf_greedy(hf, prompt, 8)
            assert r.json()["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
        stats = srv.get("/v1/stats").json()
        assert stats["expert_misses"] > 0 and stats["expert_hits"] + stats["expert_misses"] >= 7 * 4, stats
        assert stats["prefill_experts_from_cache"] > 0 and stats["prefill_experts_from_host"] > 0, stats
        assert stats["expert_host_busy_ms"] == 0.0, stats  # (offload: the host computes no expert)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
