"""Anthropic Messages end to end with the real ``anthropic`` SDK against real vLLM workers.

The tiny model's output is gibberish, but its chat template is real: these tests compare
outputs with each other (stream vs not, greedy) and the API's token count with the engine's,
never particular words. Greedy is ``temperature: 0``, which the 2.x SDK sends via ``extra_body``.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

pytestmark = pytest.mark.e2e

SYSTEM = "You are terse."
USER = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(stack):
    with anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0, timeout=120) as client:
        yield client


def test_greedy_stream_equals_create_and_count_tokens_equals_input_tokens(client, stack):
    kwargs = dict(model=stack.model, system=SYSTEM, messages=USER, max_tokens=16, extra_body=GREEDY)
    plain = client.messages.create(**kwargs)
    assert plain.id.startswith("msg_") and plain.model == stack.model and plain.role == "assistant"
    assert plain.stop_reason in ("end_turn", "max_tokens") and 0 < plain.usage.output_tokens <= 16
    with client.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == plain.content[0].text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        plain.stop_reason, plain.usage.input_tokens, plain.usage.output_tokens)
    counted = client.messages.count_tokens(model=stack.model, system=SYSTEM, messages=USER)
    assert counted.input_tokens == plain.usage.input_tokens > 0


def test_prefill_is_continued_and_counted_alike(client, stack):
    story = [*USER, {"role": "assistant", "content": "Once upon"}]
    msg = client.messages.create(model=stack.model, messages=story, max_tokens=4, extra_body=GREEDY)
    assert client.messages.count_tokens(model=stack.model, messages=story).input_tokens == msg.usage.input_tokens


def test_stop_sequences_end_with_stop_sequence(client, stack):
    kwargs = dict(model=stack.model, system=SYSTEM, messages=USER, max_tokens=16, extra_body=GREEDY)
    text = client.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text  # a stop string the greedy text certainly contains
    stopped = client.messages.create(**kwargs, stop_sequences=[stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[: text.index(stop)]


def test_output_config_json_schema_is_followed(client, stack):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    msg = client.messages.create(model=stack.model, messages=USER, max_tokens=24, extra_body=GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert msg.stop_reason == "end_turn", msg
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_errors_are_sdk_classes(client, stack):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", messages=USER, max_tokens=2)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=stack.model, messages=USER, max_tokens=2,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
