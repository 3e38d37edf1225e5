"""Hostile input against a real ``ft serve`` (demo model, CPU): schemathesis cases generated from the server's
own ``/openapi.json`` (valid and invalid bodies), then hand-written garbage. Bad input gets a 4xx in OpenAI's
error shape; never a 5xx, never a hang; and a control request keeps answering the same throughout."""

from __future__ import annotations

import json
import os
import time

import pytest
import requests
from bounded_clients import post_json
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402  (hypothesis comes with schemathesis)
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENAPI = os.path.join(ROOT, "crates", "ft-server", "openapi.json")
# Small budgets keep every generated request short: 4 tokens unless the request says less (see `tame`).
MAX_OUT = 4
SERVER_ARGS = [
    "--device",
    "cpu",
    "--max-running-requests",
    "4",
    "--num-tokens",
    "8192",
    "--max-seq-len-override",
    "512",
    "--max-output-tokens",
    str(MAX_OUT),
]
CALL_TIMEOUT = (5, 60)  # connect, read: a hang fails the test instead of stalling it
CONTROL = {
    "model": "demo",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 2,
    "temperature": 0,
}

schema = schemathesis.openapi.from_path(OPENAPI)
schema.config.phases.coverage.enabled = False  # its boundary sweep is hundreds of cases per operation


@pytest.fixture(scope="module")
def server(demo_gguf_path):
    srv = ServerProcess(SERVER_ARGS)
    yield srv
    code = srv.stop()
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def control(server):
    """The control request's answer on a fresh server; later answers must match it."""
    r = requests.post(server.url + "/v1/chat/completions", json=CONTROL, timeout=CALL_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def check_control(server, expected: str, after: str) -> None:
    r = requests.post(server.url + "/v1/chat/completions", json=CONTROL, timeout=CALL_TIMEOUT)
    assert r.status_code == 200, f"control request failed after {after}: {r.status_code} {r.text[:300]}"
    assert r.json()["choices"][0]["message"]["content"] == expected, f"control answer changed after {after}"
    assert requests.get(server.url + "/health", timeout=CALL_TIMEOUT).status_code == 200, after


def check_schema_is_honest(case, response) -> None:
    """The schema says what the server takes: a schema-valid body is served (or refused only for what a schema
    cannot express: the prompt's length in tokens, token ids past the vocabulary), a schema-invalid one refused."""
    if case.meta is None or not case.operation.label.startswith("POST"):
        return
    status = response.status_code
    if case.meta.generation.mode.is_negative:
        assert 400 <= status < 500, f"schema-invalid body served ({status}): {case.body!r:.500}"
        return
    if status == 200:
        return
    error = response.json().get("error", {})  # OpenAI's and Anthropic's shapes both nest it under "error"
    message = error.get("message", "")
    # what a static schema cannot say: the context and vocabulary limits, and which model names are served (the
    # schema documents the 404)
    inexpressible = (
        error.get("code")
        in ("context_length_exceeded", "model_not_found", "previous_response_not_found", "response_not_found")
        or "maximum context length" in message
        or "out of the vocabulary" in message
        or error.get("type") == "not_found_error"
        or unsatisfiable_tool_choice(error)
        or cross_field_logprobs(error)
    )
    assert inexpressible, f"schema-valid body refused ({status} {error}): {case.body!r:.500}"


def unsatisfiable_tool_choice(error: dict) -> bool:
    """A tool_choice that names a tool the request lacks, forces a call without tools, or needs a tool-call parser
    the server has none of for its model (the demo model's): cross-field and server facts, not the schema's."""
    message = error.get("message", "")
    return error.get("code") == "invalid_tool_choice" or (
        message.startswith("tool_choice ")
        and any(s in message for s in ("needs tools", "not one of the tools", "cannot be served"))
    )


def cross_field_logprobs(error: dict) -> bool:
    """``top_logprobs`` without ``logprobs: true`` (chat), ``max_tokens: 0`` without ``echo`` (completions), more
    than 128 choices over a batch of prompts, ``best_of`` other than ``n``: one field's range depends on another's
    value, which OpenAPI 3.0 cannot say."""
    message = error.get("message", "")
    return any(
        s in message
        for s in ("needs logprobs set to true", "0 only with echo", "choices in one request", "best_of must equal n")
    )


def tame(body):
    """Caps explicit output budgets so generated requests stay short (the schema itself stays honest)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and MAX_OUT < v < 2**63:
                body[key] = MAX_OUT
    return body


_calls = {"n": 0}
_statuses: dict[str, list[int]] = {}  # operation label -> statuses seen


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_no_server_errors(case, server, control):
    tame(case.body)
    t0 = time.monotonic()
    response = case.call(base_url=server.url, timeout=CALL_TIMEOUT)
    assert time.monotonic() - t0 < CALL_TIMEOUT[1]
    case.validate_response(
        response,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
    )
    check_schema_is_honest(case, response)
    _calls["n"] += 1
    _statuses.setdefault(case.operation.label, []).append(response.status_code)
    if _calls["n"] % 25 == 0:
        check_control(server, control, f"schemathesis case {_calls['n']}: {case.body!r:.300}")


def test_schemathesis_cases_were_meaningful():
    """The generated cases reached the engine (200s), and bad ones were refused (4xx), on every generating endpoint.
    How many of the 40 cases are servable varies from run to run with what the generator explores (POST
    /v1/completions: 22 in one run, 4 in a full-suite CI run, 2026-12-01), so the bar is a few, not a share."""
    if not _statuses:
        pytest.skip("the schemathesis test did not run in this session")
    print({op: sorted(set(v)) for op, v in _statuses.items()}, {op: len(v) for op, v in _statuses.items()})
    for op in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses"):
        seen = _statuses.get(op, [])
        assert seen.count(200) >= 2, (op, seen)
        assert any(400 <= s < 500 for s in seen), (op, seen)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def chat(**over) -> dict:
    return {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **over}


def raw_chat(fragment: str) -> bytes:
    """A chat body with ``fragment`` spliced in as raw JSON text (for values `json.dumps` will not write)."""
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + fragment + "}").encode()


BIG = 10 * 1024 * 1024
FOUR = "4xx"  # a refusal is required
ANY = "2xx or 4xx"  # valid enough to serve, or refused: either is fine, a 5xx is not

CASES: list[tuple[str, str, object, str]] = [
    # (name, path, body: dict or raw bytes, expectation)
    ("truncated JSON", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"', FOUR),
    ("empty body", "/v1/chat/completions", b"", FOUR),
    ("not JSON", "/v1/chat/completions", b"hello there", FOUR),
    ("JSON array body", "/v1/chat/completions", b"[1, 2, 3]", FOUR),
    ("JSON string body", "/v1/completions", b'"prompt"', FOUR),
    ("missing messages", "/v1/chat/completions", {"model": "demo"}, FOUR),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, FOUR),
    ("messages null", "/v1/chat/completions", {"messages": None}, FOUR),
    ("messages an object", "/v1/chat/completions", {"messages": {"role": "user", "content": "hi"}}, FOUR),
    ("empty messages", "/v1/chat/completions", {"messages": []}, FOUR),
    ("message not an object", "/v1/chat/completions", {"messages": ["hi"]}, FOUR),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, FOUR),
    ("role a number", "/v1/chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, FOUR),
    ("missing role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, FOUR),
    ("missing content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, FOUR),
    ("content a number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, FOUR),
    ("content a bool", "/v1/chat/completions", {"messages": [{"role": "user", "content": True}]}, FOUR),
    ("content an object", "/v1/chat/completions", {"messages": [{"role": "user", "content": {"text": "hi"}}]}, FOUR),
    ("content numbers", "/v1/chat/completions", {"messages": [{"role": "user", "content": [1, 2]}]}, FOUR),
    ("content nested lists", "/v1/chat/completions", {"messages": [{"role": "user", "content": [[["x"]]]}]}, FOUR),
    (
        "content image part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        FOUR,
    ),
    (
        "content text part not a string",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        FOUR,
    ),
    (
        "max_tokens 1e30",
        "/v1/chat/completions",
        raw_chat('"max_completion_tokens": 1e30').replace(b'"max_tokens": 2, ', b""),
        FOUR,
    ),
    ("max_tokens 2^70", "/v1/chat/completions", chat(max_tokens=2**70), FOUR),
    ("max_tokens 0", "/v1/chat/completions", chat(max_tokens=0), FOUR),
    ("max_tokens -1", "/v1/chat/completions", chat(max_tokens=-1), FOUR),
    ("max_tokens 2.5", "/v1/chat/completions", chat(max_tokens=2.5), FOUR),
    ("max_tokens a string", "/v1/chat/completions", chat(max_tokens="2"), FOUR),
    ("seed 2^70", "/v1/chat/completions", chat(seed=2**70), FOUR),
    ("seed -2^70", "/v1/chat/completions", chat(seed=-(2**70)), FOUR),
    ("seed -1", "/v1/chat/completions", chat(seed=-1, temperature=1.0), ANY),
    ("top_k 2^70", "/v1/chat/completions", chat(top_k=2**70), FOUR),
    ("top_k -5", "/v1/chat/completions", chat(top_k=-5), FOUR),
    ("temperature NaN", "/v1/chat/completions", raw_chat('"temperature": NaN'), FOUR),
    ("temperature Infinity", "/v1/chat/completions", raw_chat('"temperature": Infinity'), FOUR),
    ("temperature -Infinity", "/v1/chat/completions", raw_chat('"temperature": -Infinity'), FOUR),
    ("temperature 1e309", "/v1/chat/completions", raw_chat('"temperature": 1e309'), FOUR),
    ("temperature -1", "/v1/chat/completions", chat(temperature=-1), FOUR),
    ("temperature 1e308", "/v1/chat/completions", chat(temperature=1e308), FOUR),
    ("temperature tiny", "/v1/chat/completions", chat(temperature=1e-300), ANY),
    ("top_p NaN", "/v1/chat/completions", raw_chat('"top_p": NaN'), FOUR),
    ("top_p 0", "/v1/chat/completions", chat(top_p=0), FOUR),
    ("top_p -0.5", "/v1/chat/completions", chat(top_p=-0.5), FOUR),
    ("top_p denormal", "/v1/chat/completions", chat(top_p=1e-300, temperature=1.0), ANY),
    ("min_p -1", "/v1/chat/completions", chat(min_p=-1), FOUR),
    ("min_p 2", "/v1/chat/completions", chat(min_p=2), FOUR),
    ("min_p 1 sampled", "/v1/chat/completions", chat(min_p=1.0, temperature=2.0), ANY),
    ("presence_penalty NaN", "/v1/chat/completions", raw_chat('"presence_penalty": NaN'), FOUR),
    ("frequency_penalty huge", "/v1/chat/completions", chat(frequency_penalty=1e308), ANY),
    ("n 0", "/v1/chat/completions", chat(n=0), FOUR),
    ("n 129", "/v1/chat/completions", chat(n=129), FOUR),
    ("n 1e9", "/v1/chat/completions", chat(n=10**9), FOUR),
    ("logit_bias", "/v1/chat/completions", chat(logit_bias={"1": 100}), FOUR),
    ("response_format json", "/v1/chat/completions", chat(response_format={"type": "json_object"}), FOUR),
    ("legacy functions", "/v1/chat/completions", chat(functions=[{"name": "f"}]), FOUR),
    ("stream a string", "/v1/chat/completions", chat(stream="yes"), FOUR),
    ("stream_options a number", "/v1/chat/completions", chat(stream=True, stream_options=5), FOUR),
    ("stop a number", "/v1/chat/completions", chat(stop=5), FOUR),
    ("stop numbers", "/v1/chat/completions", chat(stop=[1, 2]), FOUR),
    ("stop empty string", "/v1/chat/completions", chat(stop=[""]), FOUR),
    ("stop many strings", "/v1/chat/completions", chat(stop=[f"s{i}" for i in range(5000)]), ANY),
    ("stop_token_ids negative", "/v1/chat/completions", chat(stop_token_ids=[-1]), FOUR),
    ("stop_token_ids huge", "/v1/chat/completions", chat(stop_token_ids=[2**40]), FOUR),
    (
        "invalid UTF-8 in a string",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3("}], "max_tokens": 2}',
        FOUR,
    ),
    ("invalid UTF-8 outside strings", "/v1/chat/completions", b'{"messages": \xff\xfe}', FOUR),
    ("lone surrogate escape", "/v1/chat/completions", raw_chat('"user": "\\ud800"'), FOUR),
    (
        "NUL and controls in content",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "a\u0000b\u0007c\u202ed\U0001f600"}]),
        ANY,
    ),
    (
        "10 MB body",
        "/v1/chat/completions",
        ('{"messages": [{"role": "user", "content": "' + "a" * BIG + '"}]}').encode(),
        FOUR,
    ),
    ("deep nesting body", "/v1/chat/completions", nested(100_000).encode(), FOUR),
    ("deep nesting in tools", "/v1/chat/completions", raw_chat('"tools": ' + nested(5000)), FOUR),
    (
        "nested garbage in kwargs",
        "/v1/chat/completions",
        chat(chat_template_kwargs={"x": [[[[{"y": [None, 1.5, {"z": []}]}]]]], "messages": 5, "tools": "no"}),
        ANY,
    ),
    ("kwargs not an object", "/v1/chat/completions", chat(chat_template_kwargs=[1, 2]), FOUR),
    ("tools not a list", "/v1/chat/completions", chat(tools={"a": 1}), FOUR),
    ("tools of numbers", "/v1/chat/completions", chat(tools=[5, "x", None]), FOUR),
    ("tool_choice nonsense", "/v1/chat/completions", chat(tool_choice={"type": "wat"}), FOUR),
    (
        "valid tool",
        "/v1/chat/completions",
        chat(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather",
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    },
                }
            ],
            tool_choice="auto",
        ),
        ANY,
    ),
    ("tool without function", "/v1/chat/completions", chat(tools=[{"type": "function"}]), FOUR),
    (
        "tool parameters not a schema",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]),
        FOUR,
    ),
    (
        "tool parameters nonsense schema",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": 5, "parameters": {"type": "wat", "properties": 7}}}]),
        FOUR,
    ),
    (
        "tool parameters an invalid JSON Schema object",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "wat", "properties": 7}}}]),
        ANY,
    ),
    (
        "tool_calls garbage",
        "/v1/chat/completions",
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{bad json"}}, 5]},
                {"role": "tool", "content": "x"},
            ]
        ),
        FOUR,
    ),
    ("many messages", "/v1/chat/completions", chat(messages=[{"role": "user", "content": "hi"}] * 5000), FOUR),
    (
        "prompt past the context",
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "word " * 60_000}]),
        FOUR,
    ),
    ("duplicate keys", "/v1/chat/completions", raw_chat('"max_tokens": "x"'), FOUR),
    ("model a number", "/v1/chat/completions", chat(model=5), FOUR),
    # /v1/completions
    ("prompt missing", "/v1/completions", {"max_tokens": 2}, FOUR),
    ("prompt empty list", "/v1/completions", {"prompt": [], "max_tokens": 2}, FOUR),
    ("prompt empty string", "/v1/completions", {"prompt": "", "max_tokens": 2}, ANY),
    ("prompt negative id", "/v1/completions", {"prompt": [-1], "max_tokens": 2}, FOUR),
    ("prompt id 2^40", "/v1/completions", {"prompt": [2**40], "max_tokens": 2}, FOUR),
    ("prompt id past the vocab", "/v1/completions", {"prompt": [10_000_000], "max_tokens": 2}, FOUR),
    ("prompt float ids", "/v1/completions", {"prompt": [1.5, 2], "max_tokens": 2}, FOUR),
    ("prompt two prompts", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, ANY),
    ("prompt nested ids", "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 2}, ANY),
    ("prompt empty inner list", "/v1/completions", {"prompt": [[1, 2], []], "max_tokens": 2}, FOUR),
    ("prompts x n over 128", "/v1/completions", {"prompt": ["a"] * 65, "n": 2, "max_tokens": 2}, FOUR),
    ("prompt 129 prompts", "/v1/completions", {"prompt": ["a"] * 129, "max_tokens": 2}, FOUR),
    ("prompt an object", "/v1/completions", {"prompt": {"text": "hi"}, "max_tokens": 2}, FOUR),
    ("prompt null", "/v1/completions", {"prompt": None, "max_tokens": 2}, FOUR),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "x", "max_tokens": 2}, FOUR),
    ("best_of 3", "/v1/completions", {"prompt": "hi", "best_of": 3, "max_tokens": 2}, FOUR),
    ("best_of 2 with n 1", "/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "max_tokens": 2}, FOUR),
    ("responses input an object", "/v1/responses", {"input": {"text": "hi"}, "max_output_tokens": 2}, FOUR),
    ("responses input item garbage", "/v1/responses", {"input": [5, None, "x"], "max_output_tokens": 2}, FOUR),
    ("responses nested parts", "/v1/responses", {"input": [{"role": "user", "content": [[[]]]}]}, FOUR),
    ("responses unknown previous id", "/v1/responses", {"input": "hi", "previous_response_id": "../x"}, FOUR),
    ("responses call without id", "/v1/responses", {"input": [{"type": "function_call", "name": "f"}]}, FOUR),
    ("responses cancel garbage id", "/v1/responses/%00%ff/cancel", {}, FOUR),
    ("echo byte tokens", "/v1/completions", {"prompt": [[200, 201, 202]], "echo": True, "max_tokens": 2}, ANY),
    (
        "echo special tokens streamed",
        "/v1/completions",
        {"prompt": [0, 1, 2], "echo": True, "max_tokens": 2, "stream": True},
        ANY,
    ),
]


@pytest.mark.parametrize("name,path,body,expect", CASES, ids=[c[0] for c in CASES])
def test_hand_written_hostile_input(server, control, name, path, body, expect):
    out = post_json(server.url, body, deadline=CALL_TIMEOUT[1], path=path)
    assert out.kind != "connection", f"{name}: no HTTP answer ({out.detail})"
    assert out.elapsed < CALL_TIMEOUT[1], name
    assert out.status is not None and out.status < 500, f"{name}: {out.status} {out.error or out.detail}"
    if expect == FOUR:
        assert 400 <= out.status < 500, f"{name}: expected a 4xx, got {out.status} {out.text[:200]!r}"
    if out.status >= 400:
        assert out.error and out.error.get("message") and out.error.get("type"), f"{name}: not OpenAI-shaped: {out}"
    check_control(server, control, name)


def test_wrong_methods_and_paths(server, control):
    for method, path, status in [
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
        ("PUT", "/v1/completions", 405),
        ("GET", "/v1/nope", 404),
        ("DELETE", "/health", 405),
    ]:
        r = requests.request(method, server.url + path, timeout=CALL_TIMEOUT)
        assert r.status_code == status, (method, path, r.status_code, r.text[:200])
    check_control(server, control, "wrong methods")


def test_slow_and_abandoned_bodies_do_not_block(server, control):
    """A client that announces a body and never sends it, and one that sends half and leaves, hold nothing."""
    import socket

    held = []
    for announced, sent in [(1000, b""), (1000, b'{"messages": [')]:
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {announced}\r\n\r\n".encode()
            + sent
        )
        held.append(s)
    check_control(server, control, "a stalled upload")
    for s in held:
        s.close()
    check_control(server, control, "abandoned uploads")


def test_openapi_served_matches_the_file(server):
    r = requests.get(server.url + "/openapi.json", timeout=CALL_TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    with open(OPENAPI) as f:
        assert r.json() == json.load(f)
    loaded = schemathesis.openapi.from_dict(r.json())
    labels = {op.ok().label for op in loaded.get_all_operations()}
    assert {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
        "GET /v1/stats",
        "GET /health",
    } <= labels, labels


def test_huge_prompts_do_not_block_health(server, control):
    """Templating and tokenizing megabytes of prompt takes seconds of CPU: it must not hold the threads that
    answer /health and stream everyone else's tokens."""
    import concurrent.futures as cf

    body = {"messages": [{"role": "user", "content": "word " * 1_500_000}], "max_tokens": 2}  # 7.5 MB, 1.5 M tokens
    latencies = []
    with cf.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(post_json, server.url, body, 120.0) for _ in range(3)]
        while not all(f.done() for f in futures):
            t = time.monotonic()
            assert requests.get(server.url + "/health", timeout=CALL_TIMEOUT).status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.05)
        outs = [f.result() for f in futures]
    for o in outs:
        assert o.status == 400 and o.error["code"] == "context_length_exceeded", o
    assert latencies and max(latencies) < 3.0, (max(latencies), len(latencies))
    check_control(server, control, "huge prompts")
