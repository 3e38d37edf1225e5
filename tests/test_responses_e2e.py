"""The Responses API end to end with the official ``openai`` client (``client.responses``) against ``ft serve`` on
the tiny random Qwen3.5-MoE with the real tokenizer and scripted output (fixtures and helpers from
``test_tool_calls_e2e``: the model "says" a given text, everything else is the real path).

Plain text, a complete tool loop continued by ``previous_response_id`` and by resending the output items,
streamed through the client's ``responses.stream`` helper (which checks the event protocol: lifecycle ids,
output indexes, every item done before ``response.completed``) and not, retrieval and deletion."""

# ruff: noqa: F811  (the fixtures imported from test_tool_calls_e2e are taken by name as arguments)
from __future__ import annotations

import json

import openai
import pytest
from test_tool_calls_e2e import (  # noqa: F401  (fixtures)
    ANSWER,
    CALL,
    WEATHER_TOOL,
    checkpoint,
    openai_client,
    script,
    server,
)

pytestmark = pytest.mark.slow

RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
QUESTION = "What is the weather in Paris?"
THOUGHT = "The user wants the weather in Paris; I should call the tool."


def _stream(client, **kw):
    """A streamed response through the client's stream helper: (final response, event types in order)."""
    types, seqs = [], []
    with client.responses.stream(**kw) as s:
        for event in s:
            types.append(event.type)
            seqs.append(event.sequence_number)
        final = s.get_final_response()
    assert seqs == list(range(len(seqs)))
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    return final, types


def _create(client, stream: bool, **kw):
    return _stream(client, **kw)[0] if stream else client.responses.create(**kw)


def test_text_response(openai_client, script):
    n = script.next(ANSWER)
    r = openai_client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=n + 8)
    assert (r.status, r.output_text, r.instructions) == ("completed", ANSWER, "Be brief.")
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.output_tokens == n and r.usage.total_tokens == r.usage.input_tokens + n
    assert r.usage.output_tokens_details.reasoning_tokens == 0

    n = script.next(ANSWER, end_turn=False)
    r = openai_client.responses.create(model="tiny", input=QUESTION, max_output_tokens=n)
    assert (r.status, r.incomplete_details.reason, r.output_text) == ("incomplete", "max_output_tokens", ANSWER)
    assert r.output[0].status == "incomplete"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_loop_with_previous_response_id(openai_client, script, stream):
    n = script.next(CALL)
    kw = dict(model="tiny", tools=[RESPONSES_TOOL], max_output_tokens=n + 8)
    r = _create(openai_client, stream, input=QUESTION, **kw)
    assert r.status == "completed"
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == THOUGHT
    fc = r.output[1]
    assert fc.call_id.startswith("call_") and fc.name == "get_weather"
    assert json.loads(fc.arguments) == {"city": "Paris", "days": 1}
    assert r.usage.output_tokens == n and 0 < r.usage.output_tokens_details.reasoning_tokens < n

    # The client runs the tool and answers with its output; the server prepends the stored conversation.
    n = script.next(ANSWER)
    kw["max_output_tokens"] = n + 8
    output = [{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"}]
    r2 = _create(openai_client, stream, previous_response_id=r.id, input=output, **kw)
    assert (r2.status, r2.output_text, r2.previous_response_id) == ("completed", ANSWER, r.id)
    assert r2.usage.input_tokens > r.usage.input_tokens  # turn one is in the prompt
    assert openai_client.responses.retrieve(r2.id).output_text == ANSWER


def test_tool_loop_resending_the_output_items(openai_client, script):
    """Without ``store``: the client keeps the conversation and sends the output items back as input."""
    n = script.next(CALL)
    kw = dict(model="tiny", tools=[RESPONSES_TOOL], max_output_tokens=n + 8, store=False)
    question = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    r = openai_client.responses.create(input=question, **kw)
    fc = r.output[1]
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(r.id)

    n = script.next(ANSWER)
    kw["max_output_tokens"] = n + 8
    items = question + [i.model_dump(exclude_none=True) for i in r.output]
    items.append({"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21 C"})
    r2 = openai_client.responses.create(input=items, **kw)
    assert (r2.status, r2.output_text) == ("completed", ANSWER)


def test_stream_event_order_and_delete(openai_client, script):
    n = script.next(f"<think>\nSunny.\n</think>\n\n{ANSWER}")
    r, types = _stream(openai_client, model="tiny", input=QUESTION, max_output_tokens=n + 8)
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert (r.output[0].content[0].text, r.output_text) == ("Sunny.", ANSWER)
    body = [t for t in types[2:-1] if not t.endswith(".delta")]
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    expected = item + ["response.reasoning_text.done"] + done + item + ["response.output_text.done"] + done
    assert body == expected
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    openai_client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(r.id)
