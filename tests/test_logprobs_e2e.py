"""Logprobs end to end (issue 13) on the demo model: ``ft serve`` against the reference, ``log_softmax`` of
``freetoken.LLM(...).logits(ids)`` at the same positions. Chat ``logprobs`` / ``top_logprobs``, completions'
legacy ``logprobs`` with ``echo`` (prompt logprobs, ``max_tokens: 0`` as loglikelihood evaluations send it),
streamed equal to whole, the official ``openai`` client, and 400s for values out of range.

The server runs with ``--max-prefill-length 32`` so the prompts here are computed in several chunks (each chunk
reports its own positions), and with the radix cache: a prompt asking for its logprobs is computed whole even
when the cache holds it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import requests
import torch
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ARGS = ["--max-running-requests", "8", "--num-tokens", "8192", "--max-seq-len-override", "2048"]
TOL = 1e-4
# ~70 tokens of text: three prefill chunks on the server (32, 32, the rest), one on the reference
PASSAGE = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of France, "
    "on the Seine river, in the north of the country. Its museums, among them the Louvre, draw millions of "
    "visitors every year; its cafés and bakeries fill the mornings with the smell of fresh bread."
)


@pytest.fixture(scope="module")
def server(demo_gguf_path):
    srv = ServerProcess(ARGS + ["--max-prefill-length", "32", "--enable-cache-report"])
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "integrity check failed" not in srv.log(), srv.log()[-3000:]


@pytest.fixture(scope="module")
def llm(demo_gguf_path):
    from freetoken import LLM

    return LLM(demo_gguf_path, device="cpu", num_tokens=4096, max_running_requests=2, load_progress=False)


def ref_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """``[T, V]`` log-probabilities: row ``q`` is the distribution of the token at position ``q + 1``."""
    return torch.log_softmax(llm.logits(ids).double(), -1)


def chat(server, stream: bool = False, **kw) -> requests.Response:
    body = {"model": "demo", "messages": QUESTION, "temperature": 0, "max_tokens": 12, "stream": stream, **kw}
    return server.post("/v1/chat/completions", body, stream=stream)


def sse_chunks(r: requests.Response) -> list[dict]:
    lines = [line.decode()[6:] for line in r.iter_lines() if line.startswith(b"data: ")]  # SSE is UTF-8
    return [json.loads(d) for d in lines if d != "[DONE]"]


def assert_same_logprobs(a, b) -> None:
    """Equal JSON up to float noise (a repeated prompt may hit the prefix cache: the same values to ~1e-6)."""
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=TOL)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_logprobs(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_logprobs(x, y)
    else:
        assert a == b


def chat_prompt_ids(llm) -> list[int]:
    import jinja2

    rendered = jinja2.Template(llm.info["chat_template"]).render(messages=QUESTION, add_generation_prompt=True)
    return llm.tokenizer.encode(rendered, add_special_tokens=False).ids


def test_chat_top_logprobs_equal_the_reference(server, llm):
    r = chat(server, logprobs=True, top_logprobs=5)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    prompt = chat_prompt_ids(llm)
    from freetoken import SamplingParams

    gen = llm.generate([prompt], SamplingParams(max_tokens=12))[0].token_ids  # greedy, as the server sampled
    ref = ref_logprobs(llm, prompt + gen)
    assert 0 < len(content) <= len(gen)
    for i, e in enumerate(content):
        top = e["top_logprobs"]
        lps = [t["logprob"] for t in top]
        assert len(top) == 5 and lps == sorted(lps, reverse=True) and max(lps) <= 0
        assert sum(math.exp(v) for v in lps) <= 1 + 1e-6
        assert (top[0]["token"], top[0]["bytes"]) == (e["token"], e["bytes"])  # greedy: the sampled token is top-1
        assert abs(top[0]["logprob"] - e["logprob"]) < 1e-6
        row = ref[len(prompt) - 1 + i]
        want = torch.topk(row, 5)
        np.testing.assert_allclose(lps, want.values.numpy(), atol=TOL)
        assert e["logprob"] == pytest.approx(float(row[gen[i]]), abs=TOL)
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        for t, tid in zip(top, want.indices.tolist()):
            assert t["token"] == llm.tokenizer.decode([tid]) or "\ufffd" in t["token"] or t["token"].strip() == ""
    # streamed: the chunks' entries are the whole answer's
    streamed = []
    for c in sse_chunks(chat(server, stream=True, logprobs=True, top_logprobs=5)):
        if c["choices"] and c["choices"][0]["logprobs"]:
            streamed += c["choices"][0]["logprobs"]["content"]
    assert_same_logprobs(streamed, content)


def test_echo_prompt_logprobs_equal_the_reference_and_skip_the_cache(server, llm):
    ids = llm.encode(PASSAGE)
    assert len(ids) > 64
    warm = server.post("/v1/completions", {"model": "demo", "prompt": [ids], "max_tokens": 1})
    assert warm.status_code == 200
    body = {"model": "demo", "prompt": [ids], "echo": True, "logprobs": 5, "max_tokens": 0}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed whole despite the cache
    assert choice["text"] == llm.tokenizer.decode(ids, skip_special_tokens=False)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = ref_logprobs(llm, ids)
    want = [float(ref[q - 1, ids[q]]) for q in range(1, len(ids))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=TOL)
    for q in range(1, len(ids)):
        top = lp["top_logprobs"][q]
        assert 5 <= len(top) <= 6  # five alternatives and the prompt's own token
        best = torch.topk(ref[q - 1], 5).values.numpy()
        np.testing.assert_allclose(sorted(top.values(), reverse=True)[:5], best, atol=TOL)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # streamed: the echo chunk carries the same logprobs
    chunks = sse_chunks(server.post("/v1/completions", {**body, "stream": True}, stream=True))
    merged = {k: [] for k in lp}
    for c in chunks:
        for k in merged:
            merged[k] += ((c["choices"][0]["logprobs"] or {}).get(k) or []) if c["choices"] else []
    assert_same_logprobs(merged, lp)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]


def test_completion_logprobs_of_generated_tokens(server, llm):
    prompt = "The capital of France is"
    body = {"model": "demo", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    out = server.post("/v1/completions", body).json()["choices"][0]
    lp = out["logprobs"]
    ids = llm.encode(prompt)
    from freetoken import SamplingParams

    gen = llm.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids[: len(lp["tokens"])]
    ref = ref_logprobs(llm, ids + gen)
    for i, (v, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"])):
        assert v == pytest.approx(float(ref[len(ids) - 1 + i, gen[i]]), abs=TOL)
        assert len(top) == 3 and max(top.values()) == pytest.approx(v, abs=1e-6)  # greedy: chosen is the best
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == out["text"]
    streamed = sse_chunks(server.post("/v1/completions", {**body, "stream": True}, stream=True))
    assert [t for c in streamed if c["choices"] for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])] == lp[
        "tokens"
    ]


def test_loglikelihood_through_the_openai_client(server, llm):
    """What lm-eval-harness's local-completions does: token-id prompts (context + continuation), ``echo``,
    ``logprobs: 1``, ``max_tokens`` 0 or 1; the continuation's logprob sum and greediness from the answer."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    context, continuation = llm.encode("The capital of France is"), llm.encode(" Paris")[-1:]
    ids = context + continuation
    ref = ref_logprobs(llm, ids)
    want = float(ref[len(context) - 1, continuation[0]])
    greedy = int(ref[len(context) - 1].argmax()) == continuation[0]
    for max_tokens in (0, 1):
        r = client.completions.create(
            model="demo", prompt=[ids], echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
        )
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens
        got = sum(lp.token_logprobs[len(context) : len(ids)])
        assert got == pytest.approx(want, abs=TOL)
        top = lp.top_logprobs[len(context)]
        assert (max(top.values()) == pytest.approx(lp.token_logprobs[len(context)], abs=1e-6)) == greedy


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 1000000}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": QUESTION, "top_logprobs": 5}, "top_logprobs"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ],
)
def test_out_of_range_values_are_400(server, path, body, param):
    r = server.post(path, {"model": "demo", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
