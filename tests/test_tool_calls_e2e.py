"""Tool calls and reasoning end to end, with the official ``openai`` and ``anthropic`` clients against ``ft serve``
on a tiny random Qwen3.5-MoE checkpoint with the real Qwen3.5/3.6 tokenizer and our Qwen chat template (hermes
``<tool_call>`` JSON, ``<think>`` blocks). A random model never writes a call, so its output is scripted
(``FREETOKEN_TEST_SCRIPT``, ``freetoken/scripted_output.py``): the worker's sampled tokens are replaced by the token
ids of a given text, and everything else is the real path: the template renders the tools and the conversation
(tool calls and tool results included), the tokenizer encodes it, the worker runs its steps, the detokenizer keeps
``<tool_call>`` / ``<think>`` (added, non-special tokens), the parsers split the output.

Each test plays a complete tool loop: the model calls a tool, the client answers with the result, the model
answers; streamed and not, in both APIs; and a reasoning split in both APIs."""

from __future__ import annotations

import json
import os

import hf_reference as R
import pytest
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

IM_END_ID = 248046
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
CALL = (
    "<think>\nThe user wants the weather in Paris; I should call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
)
ANSWER = "It is sunny in Paris, 21 degrees."


class Script:
    """The turns the worker will say, appended one per request (see ``freetoken/scripted_output.py``)."""

    def __init__(self, path: str, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.path = path
        self.tok = Tokenizer.from_file(tokenizer_json)
        self.turns: list[list[int]] = []
        self._write()

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.turns, f)
        os.replace(tmp, self.path)

    def next(self, text: str, end_turn: bool = True) -> int:
        """The next request's output is ``text`` then ``<|im_end|>`` (``end_turn=False``: without, for a request cut
        off by an output budget of exactly the returned count); returns its token count."""
        ids = self.tok.encode(text, add_special_tokens=False).ids + ([IM_END_ID] if end_turn else [])
        self.turns.append(ids)
        self._write()
        return len(ids)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny-qwen3_5_moe-tools"))
    R.write_released_qwen3_5_moe(d, seed=7)
    return d


@pytest.fixture(scope="module")
def script(checkpoint, tmp_path_factory):
    s = Script(str(tmp_path_factory.mktemp("script") / "turns.json"), os.path.join(checkpoint, "tokenizer.json"))
    # the tags are single tokens of the real tokenizer: the parsers see them as the model would write them
    assert len(s.tok.encode("<tool_call></tool_call><think></think>", add_special_tokens=False).ids) == 4
    return s


@pytest.fixture(scope="module")
def server(checkpoint, script):
    srv = ServerProcess(
        [
            "--model-path",
            checkpoint,
            "--served-model-name",
            "tiny",
            "--max-running-requests",
            "2",
            "--num-tokens",
            "4096",
            "--max-seq-len-override",
            "1024",
            "--disable-cuda-graph",
        ],
        env={"FREETOKEN_TEST_SCRIPT": script.path},
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def anthropic_client(server):
    from anthropic import Anthropic

    return Anthropic(base_url=server.url, api_key="unused", timeout=120)


def test_parsers_resolved_from_the_template(server):
    assert "Output parsers: tool calls hermes, reasoning qwen3" in server.log()


def _openai_stream(stream):
    """Folds a streamed chat completion: (reasoning, content, [(id, name, arguments)], finish reasons)."""
    reasoning, content, calls, reasons = "", "", [], []
    for i, chunk in enumerate(stream):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if i == 0:
            assert choice.delta.role == "assistant"
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.type == "function" and tc.function.arguments == ""
                calls.append([tc.id, tc.function.name, ""])
            else:
                calls[tc.index][2] += tc.function.arguments
        if choice.finish_reason is not None:
            reasons.append(choice.finish_reason)
    return reasoning, content, calls, reasons


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_tool_loop(openai_client, script, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    n = script.next(CALL)
    kw = dict(model="tiny", tools=[WEATHER_TOOL], max_tokens=n + 8)
    if stream:
        reasoning, content, calls, reasons = _openai_stream(
            openai_client.chat.completions.create(messages=messages, stream=True, **kw)
        )
        assert reasons == ["tool_calls"]
        assert content == ""
        call_id, name, arguments = calls[0]
    else:
        r = openai_client.chat.completions.create(messages=messages, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        reasoning = choice.message.reasoning_content
        assert len(choice.message.tool_calls) == 1
        tc = choice.message.tool_calls[0]
        assert tc.type == "function"
        call_id, name, arguments = tc.id, tc.function.name, tc.function.arguments
    assert reasoning == "The user wants the weather in Paris; I should call the tool."
    assert call_id.startswith("call_") and name == "get_weather"
    assert json.loads(arguments) == {"city": "Paris", "days": 1}

    # The client runs the tool and sends the result; the model answers.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]
    n = script.next(ANSWER)
    kw["max_tokens"] = n + 8
    if stream:
        reasoning, content, calls, reasons = _openai_stream(
            openai_client.chat.completions.create(messages=messages, stream=True, **kw)
        )
        assert (content, calls, reasons, reasoning) == (ANSWER, [], ["stop"], "")
    else:
        r = openai_client.chat.completions.create(messages=messages, **kw)
        assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (ANSWER, None)
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == n


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_tool_loop(anthropic_client, script, stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    n = script.next(CALL)
    kw = dict(model="tiny", tools=[ANTHROPIC_TOOL], max_tokens=n + 8)
    if stream:
        kinds = []
        with anthropic_client.messages.stream(messages=messages, **kw) as s:
            for event in s:
                if event.type == "content_block_delta":
                    kinds.append(event.delta.type)
            msg = s.get_final_message()
        assert "thinking_delta" in kinds and "input_json_delta" in kinds
    else:
        msg = anthropic_client.messages.create(messages=messages, **kw)
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "The user wants the weather in Paris; I should call the tool."
    use = msg.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert use.input == {"city": "Paris", "days": 1}

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]
    n = script.next(ANSWER)
    kw["max_tokens"] = n + 8
    if stream:
        with anthropic_client.messages.stream(messages=messages, **kw) as s:
            msg = s.get_final_message()
    else:
        msg = anthropic_client.messages.create(messages=messages, **kw)
    assert msg.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in msg.content] == [("text", ANSWER)]
    assert msg.usage.output_tokens == n


def test_reasoning_split_in_both_apis(openai_client, anthropic_client, script):
    thought, answer = "Two and two make four.", "4"
    text = f"<think>\n{thought}\n</think>\n\n{answer}"
    question = [{"role": "user", "content": "What is 2+2?"}]

    n = script.next(text)
    r = openai_client.chat.completions.create(model="tiny", messages=question, max_tokens=n + 8)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == (thought, answer)
    assert r.choices[0].finish_reason == "stop"
    n = script.next(text)
    reasoning, content, calls, reasons = _openai_stream(
        openai_client.chat.completions.create(model="tiny", messages=question, max_tokens=n + 8, stream=True)
    )
    assert (reasoning, content, calls, reasons) == (thought, answer, [], ["stop"])

    for stream in (False, True):
        n = script.next(text)
        kw = dict(model="tiny", messages=question, max_tokens=n + 8, thinking={"type": "enabled", "budget_tokens": 64})
        if stream:
            with anthropic_client.messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = anthropic_client.messages.create(**kw)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert (msg.content[0].thinking, msg.content[1].text) == (thought, answer)
        assert msg.stop_reason == "end_turn"
