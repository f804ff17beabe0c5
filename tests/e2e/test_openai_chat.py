"""Chat completions end to end with the real ``openai`` SDK against real vLLM workers.

The tiny model's output is gibberish, but its chat template (Zephyr style) is real, so these
tests compare outputs with each other (stream vs not, same seed) and check shapes and
constraints, never particular words.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import ANSWER

pytestmark = pytest.mark.e2e

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


def collect_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """Texts and finish reasons per choice; checks that every choice opens with its role."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        for choice in chunk.choices:
            if choice.index not in texts:
                assert choice.delta.role == "assistant" and choice.delta.content == ""
                texts[choice.index] = ""
                continue
            assert choice.delta.role is None
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert len({c.id for c in chunks}) == 1
    return texts, finish, chunks


def test_greedy_stream_equals_non_stream(client, stack):
    kwargs = dict(model=stack.model, messages=CHAT, temperature=0, max_completion_tokens=24)
    plain = client.chat.completions.create(**kwargs)
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-") and plain.model == stack.model
    [choice] = plain.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert plain.usage.completion_tokens <= 24
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + plain.usage.completion_tokens

    texts, finish, _ = collect_stream(client.chat.completions.create(**kwargs, stream=True))
    assert texts == {0: choice.message.content} and finish == {0: choice.finish_reason}


def test_null_max_tokens_generates_up_to_the_context(client, stack):
    # A long prompt (~930 of the stack's 1024 tokens) keeps the rest of the context short.
    long = [{"role": "user", "content": "x" * 900}]
    resp = client.chat.completions.create(
        model=stack.model, messages=long, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.prompt_tokens > 900
    assert resp.usage.total_tokens == 1024  # the e2e stack's LLMQ_MAX_MODEL_LEN


def test_chat_template_options_reach_the_worker(client, stack):
    story = [{"role": "assistant", "content": "Once upon"}]
    kwargs = dict(model=stack.model, messages=story, temperature=0, max_tokens=4)
    answer = client.chat.completions.create(**kwargs)
    resumed = client.chat.completions.create(
        **kwargs, extra_body={"add_generation_prompt": False, "continue_final_message": True}
    )
    # Continuing drops the message's end-of-turn and the new assistant header from the prompt.
    assert resumed.usage.prompt_tokens < answer.usage.prompt_tokens
    assert resumed.choices[0].message.role == "assistant"


def test_logprobs_and_top_logprobs_shapes(client, stack):
    kwargs = dict(model=stack.model, messages=CHAT, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    plain = client.chat.completions.create(**kwargs)
    [choice] = plain.choices
    entries = choice.logprobs.content
    assert len(entries) == plain.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best token
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs)

    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed.extend(c.logprobs.content)
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]

    bare = client.chat.completions.create(**{**kwargs, "top_logprobs": None})
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)


def test_n_choices_when_sampling(client, stack):
    kwargs = dict(model=stack.model, messages=CHAT, temperature=1.0, max_tokens=12, n=2, seed=5)
    plain = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in plain.choices) == [0, 1]
    assert all(c.message.role == "assistant" for c in plain.choices)
    texts, finish, _ = collect_stream(client.chat.completions.create(**kwargs, stream=True))
    assert sorted(texts) == sorted(finish) == [0, 1]


def test_same_seed_same_output_and_stop_strings(client, stack):
    kwargs = dict(model=stack.model, messages=CHAT, temperature=1.0, max_tokens=24, seed=1234)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first

    # ignore_eos: the full 24 tokens, so the text is long enough to hold a stop string
    greedy = dict(model=stack.model, messages=CHAT, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    text = client.chat.completions.create(**greedy).choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text  # a stop string the greedy text certainly contains
    stopped = client.chat.completions.create(**greedy, stop=[stop])
    [choice] = stopped.choices
    assert choice.finish_reason == "stop" and choice.message.content == text[: text.index(stop)]
    assert choice.model_extra["stop_reason"] == stop


def test_response_format_json_schema_validates(client, stack):
    finished = 0
    for seed in range(6):
        resp = client.chat.completions.create(
            model=stack.model,
            messages=CHAT,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        )
        [choice] = resp.choices
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), ANSWER)
            finished += 1
    assert finished >= 1, "no json_schema output finished within max_tokens"


def test_structured_outputs_choice_and_json_object(client, stack):
    resp = client.chat.completions.create(
        model=stack.model, messages=CHAT, max_tokens=10, extra_body={"structured_outputs": {"choice": ["red", "green"]}}
    )
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.content in ("red", "green")
    for seed in range(3):
        resp = client.chat.completions.create(
            model=stack.model, messages=CHAT, max_tokens=40, seed=seed, response_format={"type": "json_object"}
        )
        [choice] = resp.choices
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.lstrip().startswith("{")


def test_stream_options_include_usage(client, stack):
    stream = client.chat.completions.create(
        model=stack.model,
        messages=CHAT,
        temperature=0,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, _, chunks = collect_stream(stream)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens <= 10 and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


def test_bad_requests_raise_bad_request_error(client, stack):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=stack.model, messages=CHAT, n=2, temperature=0)
    assert info.value.status_code == 400
    assert info.value.body["message"] == "n must be 1 when using greedy sampling, got 2."
    with pytest.raises(openai.BadRequestError, match="`logprobs` must be set to true"):
        client.chat.completions.create(model=stack.model, messages=CHAT, top_logprobs=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)


def test_lmi_chat_on_invocations(stack):
    """LMI's chat: ``/invocations`` with ``messages``; streams are JSON lines, or SSE when set."""
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 12}
    with httpx.Client(timeout=120) as http:
        plain = http.post(f"{stack.url}/invocations", json=body)
        assert plain.status_code == 200 and plain.json()["object"] == "chat.completion"
        text = plain.json()["choices"][0]["message"]["content"]
        with http.stream("POST", f"{stack.url}/invocations", json={**body, "stream": True}) as resp:
            assert resp.headers["content-type"].startswith("application/jsonlines")
            lines = [json.loads(line) for line in resp.read().splitlines()]
        with http.stream("POST", f"{stack.sse_url}/invocations", json={**body, "stream": True}) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            frames = [f for f in resp.read().split(b"\n\n") if f and not f.startswith(b":")]
    assert frames[-1] == b"data: [DONE]"
    sse_chunks = [json.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    for chunks in (lines, sse_chunks):
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text
