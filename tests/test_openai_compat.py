"""SGLang's and vLLM's OpenAI-compatibility cases, ported to ``ft serve`` on the demo model (SmolLM2-135M GGUF)
through the official ``openai`` client: one server (radix cache, cache reporting) for the module, short outputs.

What each test mirrors upstream (the cases, rewritten here; upstream-only features left out as noted):

* SGLang ``test/srt/openai_server/basic/test_openai_server.py``
  - ``test_completion`` / ``test_completion_stream``: every combination of echo, ``logprobs=5``, a list of two
    prompts, ``n=2`` and token-id input -> ``test_completion_matrix``, ``test_completion_stream_matrix``;
  - ``test_chat_completion`` / ``test_chat_completion_stream`` (``top_logprobs=5``, ``n=2``, role on the first
    delta of each choice, exactly one ``finish_reason`` per choice, usage in the last chunk) ->
    ``test_chat_matrix``, ``test_chat_stream_matrix``;
  - ``test_model_list`` -> ``test_model_list`` (``test_retrieve_model``: no ``GET /v1/models/{id}`` here;
    ``test_regex``, ``test_response_prefill``: no constrained decoding or ``continue_final_message``).
* vLLM ``tests/entrypoints/openai/completion/test_completion.py``
  - ``test_single_completion`` -> ``test_single_completion_length_and_usage``;
  - ``test_no_logprobs`` / ``test_zero_logprobs`` / ``test_some_logprobs`` -> ``test_completion_logprobs_counts``;
  - ``test_too_many_completion_logprobs`` -> ``test_too_many_logprobs_are_refused``;
  - ``test_completion_streaming`` -> ``test_completion_streaming_matches_whole`` (vLLM's last text chunk also
    carries the finish reason; here the finish chunk carries only text that came with the end, such as a held-back
    stop-string prefix);
  - ``test_parallel_no_streaming`` / ``test_parallel_streaming`` -> ``test_parallel_sampling``,
    ``test_parallel_streaming`` (plus: seeded choices are reproducible, greedy ones equal);
  - ``test_completion_stream_options`` -> ``test_stream_options_include_usage`` (``continuous_usage_stats`` is a
    vLLM extension, and ``stream_options`` without ``stream`` is not refused here);
  - ``test_batch_completions`` -> ``test_batch_completions`` (greedy ``n=2`` instead of beam search);
  - ``test_echo_logprob_completion`` -> ``test_echo_logprob_completion``.
* vLLM ``tests/entrypoints/openai/chat_completion/test_chat.py``
  - ``test_no_logprobs_chat`` / ``test_zero_logprobs_chat`` / ``test_some_logprobs_chat`` ->
    ``test_chat_logprobs_counts``; ``test_too_many_chat_logprobs`` -> ``test_too_many_logprobs_are_refused``;
  - ``test_single_chat_session`` -> ``test_single_chat_session``; ``test_chat_streaming`` ->
    ``test_chat_streaming_matches_whole``; ``test_chat_completion_stream_options`` ->
    ``test_stream_options_include_usage``.
* Not upstream: ``test_stop_strings`` (max_tokens / stop behaviour) and ``test_n_shares_the_prompt_through_the_cache``
  (the other choices of ``n`` resume from the prompt the first one computed).
"""

from __future__ import annotations

import re
import uuid

import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "demo"
PROMPT = "The capital of France is"
CHAT = [
    {"role": "system", "content": "You are a helpful AI assistant"},
    {"role": "user", "content": "What is the capital of France? Answer in a few words."},
]
MAX_TOKENS = 8
SERVER_ARGS = [
    "--cache-type",
    "radix",
    "--enable-cache-report",
    "--max-running-requests",
    "8",
    "--num-tokens",
    "16384",
    "--max-seq-len-override",
    "2048",
]


@pytest.fixture(scope="module")
def server(demo_gguf_path):
    srv = ServerProcess(SERVER_ARGS)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "integrity check failed" not in srv.log(), srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def tokenizer(demo_gguf_path):
    """The tokenizer the server uses, read from the same GGUF."""
    from tokenizers import Tokenizer

    from freetoken.loading.gguf import GGUFCheckpoint
    from freetoken.loading.gguf_tokenizer import tokenizer_from_gguf

    return Tokenizer.from_file(tokenizer_from_gguf(GGUFCheckpoint(demo_gguf_path)).tokenizer_path)


def prompt_ids(tokenizer, text: str = PROMPT) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def stream_chunks(stream) -> tuple[list, list]:
    """A stream's chunks with choices, and those with usage."""
    chunks, usage = [], []
    for chunk in stream:
        (usage if chunk.usage is not None else chunks).append(chunk)
    return chunks, usage


# ---- SGLang: completions --------------------------------------------------------------------------------------

COMBINATIONS = [
    (echo, logprobs, two_prompts, n, token_input)
    for echo in (False, True)
    for logprobs in (None, 5)
    for two_prompts in (False, True)
    for n in (1, 2)
    for token_input in (False, True)
]


def completion_args(tokenizer, echo, logprobs, two_prompts, n, token_input) -> tuple[dict, int, int]:
    """The request, its number of choices and its prompt tokens (each prompt counted once)."""
    one = prompt_ids(tokenizer) if token_input else PROMPT
    prompt = [one, one] if two_prompts else one
    prompts = 2 if two_prompts else 1
    args = dict(model=MODEL, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, echo=echo, logprobs=logprobs, n=n)
    return args, prompts * n, prompts * len(prompt_ids(tokenizer))


def test_completion_matrix(client, tokenizer):
    for echo, logprobs, two_prompts, n, token_input in COMBINATIONS:
        case = f"echo={echo} logprobs={logprobs} two_prompts={two_prompts} n={n} token_input={token_input}"
        args, choices, prompt_tokens = completion_args(tokenizer, echo, logprobs, two_prompts, n, token_input)
        r = client.completions.create(**args)
        assert [c.index for c in r.choices] == list(range(choices)), case
        assert all(c.finish_reason in ("stop", "length") for c in r.choices), case
        if echo:
            assert all(c.text.startswith(PROMPT) for c in r.choices), case
        if logprobs:
            lp = r.choices[0].logprobs
            assert isinstance(lp.tokens[0], str), case
            assert isinstance(lp.top_logprobs[1], dict) and 5 <= len(lp.top_logprobs[1]) <= 6, case
            if echo:
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, case
            else:
                assert lp.token_logprobs[0] is not None, case
        else:
            assert r.choices[0].logprobs is None, case
        assert r.id and r.created, case
        assert r.usage.prompt_tokens == prompt_tokens, case
        assert r.usage.completion_tokens > 0, case
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, case
        # greedy: every choice of every copy of the prompt says the same
        assert len({c.text for c in r.choices}) == 1, case


def test_completion_stream_matrix(client, tokenizer):
    for echo, logprobs, two_prompts, n, token_input in COMBINATIONS:
        case = f"echo={echo} logprobs={logprobs} two_prompts={two_prompts} n={n} token_input={token_input}"
        args, choices, prompt_tokens = completion_args(tokenizer, echo, logprobs, two_prompts, n, token_input)
        stream = client.completions.create(**args, stream=True, stream_options={"include_usage": True})
        chunks, usage = stream_chunks(stream)
        first: dict[int, str] = {}
        finishes: dict[int, int] = {}
        for chunk in chunks:
            assert chunk.id and chunk.created, case
            assert len(chunk.choices) == 1, case
            choice = chunk.choices[0]
            first.setdefault(choice.index, choice.text)
            if choice.finish_reason is not None:
                finishes[choice.index] = finishes.get(choice.index, 0) + 1
            if logprobs and choice.text:
                assert isinstance(choice.logprobs.tokens[0], str), case
                if not (echo and choice.text.startswith(PROMPT)):
                    assert isinstance(choice.logprobs.top_logprobs[0], dict), case
                    assert 5 <= len(choice.logprobs.top_logprobs[0]) <= 6, case
        assert sorted(first) == list(range(choices)), case
        assert finishes == {i: 1 for i in range(choices)}, case
        if echo:
            assert all(text.startswith(PROMPT) for text in first.values()), case
        assert len(usage) == 1 and chunks[-1] is not None, case
        u = usage[0].usage
        assert usage[0].choices == [], case
        assert u.prompt_tokens == prompt_tokens and u.completion_tokens > 0, case
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens, case


# ---- SGLang: chat ---------------------------------------------------------------------------------------------


def chat_args(logprobs, n) -> dict:
    """The chat request of the matrix: ``logprobs`` top logprobs per position (None: no logprobs), ``n`` choices."""
    return dict(
        model=MODEL,
        messages=CHAT,
        temperature=0,
        max_tokens=MAX_TOKENS,
        logprobs=logprobs is not None,
        top_logprobs=logprobs,
        n=n,
    )


def test_chat_matrix(client):
    for logprobs in (None, 5):
        for n in (1, 2):
            r = client.chat.completions.create(**chat_args(logprobs, n))
            assert [c.index for c in r.choices] == list(range(n))
            for c in r.choices:
                assert c.message.role == "assistant" and isinstance(c.message.content, str)
                if logprobs:
                    assert isinstance(c.logprobs.content[0].top_logprobs[0].token, str)
                    assert len(c.logprobs.content[0].top_logprobs) == logprobs
            assert r.id and r.created
            assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
            assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matrix(client):
    for logprobs in (None, 5):
        for n in (1, 2):
            stream = client.chat.completions.create(
                **chat_args(logprobs, n), stream=True, stream_options={"include_usage": True}
            )
            chunks, usage = stream_chunks(stream)
            seen: set[int] = set()
            finishes: dict[int, int] = {}
            for chunk in chunks:
                choice = chunk.choices[0]
                if choice.index not in seen:
                    assert choice.delta.role == "assistant", "the role comes first"
                    seen.add(choice.index)
                    continue
                assert choice.delta.role is None
                if choice.finish_reason is not None:
                    finishes[choice.index] = finishes.get(choice.index, 0) + 1
                elif logprobs:
                    top = choice.logprobs.content[0].top_logprobs
                    assert isinstance(top[0].token, str) and len(top) == logprobs
                assert isinstance(choice.delta.content, str) or choice.finish_reason
            assert seen == set(range(n))
            assert finishes == {i: 1 for i in range(n)}, "exactly one finish_reason per choice"
            assert len(usage) == 1 and usage[0].choices == []
            u = usage[0].usage
            assert u.prompt_tokens > 0 and u.completion_tokens > 0
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_model_list(client):
    models = list(client.models.list())
    assert len(models) == 1
    assert isinstance(getattr(models[0], "max_model_len", None), int)


# ---- vLLM: completions ----------------------------------------------------------------------------------------


def test_single_completion_length_and_usage(client, tokenizer):
    # a prompt no earlier test sent: nothing of it is cached
    prompt = f"Hello, my name is {uuid.uuid4().hex[:8]} and"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert r.id and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text) >= 1
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(prompt_ids(tokenizer, prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    r = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0)
    assert len(r.choices[0].text) >= 1


def test_completion_logprobs_counts(client):
    ids = [1, 504, 3458, 282]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=None)
    assert r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs is not None and len(lp.top_logprobs[0]) == 1
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=5)
    assert 5 <= len(r.choices[0].logprobs.top_logprobs[0]) <= 6


def test_too_many_logprobs_are_refused(client):
    ids = [1, 504, 3458, 282]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, logprobs=21)
    with pytest.raises(openai.BadRequestError):
        for _ in client.completions.create(model=MODEL, prompt=ids, max_tokens=5, logprobs=30, stream=True):
            pass
    messages = CHAT[:1] + [{"role": "user", "content": "what is 1+1?"}]
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=10, logprobs=True, top_logprobs=21, stream=True
        ):
            pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=10, logprobs=True, top_logprobs=30
        )
    # still serving
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text is not None
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10)
    assert r.choices[0].message.content is not None


def test_completion_streaming_matches_whole(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    chunks, _ = stream_chunks(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, stream=True)
    )
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_parallel_sampling(client):
    args = dict(model=MODEL, prompt="What is an LLM?", max_tokens=16, n=3, temperature=1.0, logprobs=0, seed=42)
    r = client.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.finish_reason is not None for c in r.choices)
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3, texts
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) <= 16 for c in r.choices)
    # seeded: choice i is seed + i, so the same request answers the same
    again = client.completions.create(**args)
    assert [c.text for c in again.choices] == texts
    # greedy choices are all equal
    greedy = client.completions.create(**{**args, "temperature": 0, "seed": None})
    assert len({c.text for c in greedy.choices}) == 1


def test_parallel_streaming(client):
    n, max_tokens = 3, 16
    stream = client.completions.create(
        model=MODEL, prompt="What is an LLM?", max_tokens=max_tokens, n=n, temperature=1.0, stream=True, seed=42
    )
    pieces: list[list[str]] = [[] for _ in range(n)]
    finishes = 0
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.text:
            pieces[choice.index].append(choice.text)
        finishes += choice.finish_reason is not None
    assert finishes == n
    assert all(len(p) <= max_tokens for p in pieces), "at most one text chunk per token"
    texts = ["".join(p) for p in pieces]
    assert len(set(texts)) == n, texts
    whole = client.completions.create(
        model=MODEL, prompt="What is an LLM?", max_tokens=max_tokens, n=n, temperature=1.0, seed=42
    )
    assert [c.text for c in whole.choices] == texts, "streamed or not, the seeded choices are the same"


def test_stream_options_include_usage(client):
    completion = dict(model=MODEL, prompt="What is the capital of France?", max_tokens=5, temperature=0, stream=True)
    chat = dict(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0, stream=True)
    for create, args in ((client.completions.create, completion), (client.chat.completions.create, chat)):
        for options in ({"include_usage": False}, {}):
            assert all(chunk.usage is None for chunk in create(**args, stream_options=options))
        stream = iter(create(**args, stream_options={"include_usage": True}))
        for chunk in stream:
            assert chunk.usage is None
            if chunk.choices[0].finish_reason is not None:
                final = next(stream)
                assert final.choices == [] and final.usage.prompt_tokens > 0 and final.usage.completion_tokens > 0
                assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
                assert next(stream, None) is None, "the usage chunk is the last"
                break
        else:
            pytest.fail("no finish chunk")


def test_batch_completions(client):
    for prompts in (["Hello, my name is"] * 2, [[1, 504, 3458, 282]] * 2):
        batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
        assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
        batch = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, temperature=0)
        assert len(batch.choices) == 4 and len({c.text for c in batch.choices}) == 1
        texts = ["", ""]
        for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, stream=True):
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
        assert texts[0] == texts[1] == batch.choices[0].text


def test_echo_logprob_completion(client, tokenizer):
    for logprobs in (1, 0):
        for prompt in ("Hello, my name is", [1, 504, 3458, 282, 314, 2208]):
            r = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=logprobs
            )
            text = tokenizer.decode(prompt, skip_special_tokens=False) if isinstance(prompt, list) else prompt
            assert r.choices[0].text.startswith(text)
            lp = r.choices[0].logprobs
            assert len(lp.text_offset) > 5 and len(lp.tokens) > 5
            assert len(lp.token_logprobs) > 5 and lp.token_logprobs[0] is None
            assert len(lp.top_logprobs) > 5 and lp.top_logprobs[0] is None
            assert all(max(logprobs, 1) <= len(top) <= logprobs + 1 for top in lp.top_logprobs[1:])


# ---- vLLM: chat -----------------------------------------------------------------------------------------------

MATH = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]


def test_chat_logprobs_counts(client):
    args = dict(model=MODEL, messages=MATH, max_completion_tokens=5, temperature=0)
    assert client.chat.completions.create(**args, logprobs=False).choices[0].logprobs is None
    r = client.chat.completions.create(**args, logprobs=True, top_logprobs=0)
    assert r.choices[0].logprobs.content is not None and len(r.choices[0].logprobs.content[0].top_logprobs) == 0
    r = client.chat.completions.create(**args, logprobs=True, top_logprobs=5)
    assert len(r.choices[0].logprobs.content[0].top_logprobs) == 5


def test_single_chat_session(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MATH, max_completion_tokens=5, logprobs=True, top_logprobs=5, temperature=0
    )
    assert r.id and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    message = r.choices[0].message
    assert message.role == "assistant" and message.content
    turn = MATH + [{"role": "assistant", "content": message.content}, {"role": "user", "content": "in json"}]
    r = client.chat.completions.create(model=MODEL, messages=turn, max_completion_tokens=5)
    assert r.choices[0].message.content is not None


def test_chat_streaming_matches_whole(client):
    args = dict(model=MODEL, messages=MATH, max_completion_tokens=10, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks, _ = stream_chunks(client.chat.completions.create(**args, stream=True))
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].delta.role in (None, "assistant") for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


# ---- FreeToken: max_tokens / stop, n through the prefix cache ----------------------------------------------------


def test_stop_strings(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**args).choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", full)
    assert len(words) >= 2, full
    stop = words[1]
    r = client.completions.create(**args, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    r = client.completions.create(**{**args, "max_tokens": 3})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_n_shares_the_prompt_through_the_cache(server, client):
    """The first choice computes the prompt; the others start after its first token and resume from the radix
    cache: the response's cached tokens, and the server's prefix-cache hit counter, say so."""

    def hits() -> float:
        text = server.get("/metrics").text
        return float(re.search(r"^freetoken_prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))

    passage = " ".join(f"Fact {i} ({uuid.uuid4().hex[:6]}): rivers flow to the sea." for i in range(30))
    messages = [{"role": "user", "content": passage + "\nWhere do rivers flow?"}]
    before = hits()
    r = client.chat.completions.create(model=MODEL, messages=messages, n=4, max_tokens=4, temperature=0.8, seed=1)
    prompt = r.usage.prompt_tokens
    assert prompt > 300 and len(r.choices) == 4
    assert r.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert hits() - before >= 3 * (prompt - 1)
