"""NaN and infinite logprobs (a context past the model's positions makes NaN) never reach the wire:
the worker's attempt publishes them as -9999.0, vLLM's floor, so the event decodes on the API side
and every dialect renders a number. Before, msgspec wrote NaN as ``null``, the API's typed decode
of the event failed, and the client got a bare 500."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from api import dialects
from shared import eventlog
from shared.codec import decode_event, encode
from shared.events import LOGPROB_FLOOR, Done, Event, TokenDelta, Tokens
from shared.result import ResultBuilder
from shared.schemas import (
    ChatMessage,
    GenerationRequest,
    JobResult,
    OutputOptions,
    PromptInfo,
    SamplingParams,
    TopLogprob,
)
from tests.support.streams import frames
from workers.attempt import Attempt
from workers.protocol import Step

NAN, INF = float("nan"), float("inf")


def nonfinite_steps() -> list[Step]:
    """Two engine steps whose every kind of logprob holds NaN, +inf and -inf among finite ones."""
    prompt = PromptInfo(token_ids=[97, 98, 99], token_texts=["a", "b", "c"], logprobs=[None, NAN, -INF],
                        top_logprobs=[[], [TopLogprob(98, "b", NAN)],
                                      [TopLogprob(99, "c", -INF), TopLogprob(5, "x", -2.0)]])
    first = TokenDelta(token_ids=[100, 101], text="de", token_texts=["d", "e"], logprobs=[NAN, -0.5],
                       top_logprobs=[[TopLogprob(100, "d", NAN), TopLogprob(7, "y", INF)],
                                     [TopLogprob(101, "e", -0.5), TopLogprob(8, "z", -INF)]])
    last = TokenDelta(token_ids=[102], text="f", token_texts=["f"], logprobs=[INF],
                      top_logprobs=[[TopLogprob(102, "f", INF), TopLogprob(9, "w", -1.0)]], finish_reason="length")
    return [Step(deltas=[first], prompt_tokens=3, prompt=prompt, prompt_token_ids=[97, 98, 99]),
            Step(deltas=[last], finished=True, prompt_tokens=3)]


def published(steps: list[Step]) -> list:
    """The events an attempt publishes for ``steps``, as the API decodes them off the wire."""
    attempt = Attempt(queued_at=1.0, started_at=2.0, whole_log=True)
    return [decode_event(encode(attempt.on_step(s, lambda: 3.0).event)) for s in steps]


def test_without_the_floor_a_nan_logprob_cannot_cross_the_wire():
    # What the worker published before: msgspec writes NaN and infinities as null, and the API's
    # typed decode refuses null where a float belongs (the bare 500).
    raw = encode(Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], logprobs=[NAN])]))
    assert raw == b'{"type":"tokens","seq":1,"deltas":[{"token_ids":[1],"logprobs":[null]}]}'
    with pytest.raises(msgspec.ValidationError, match="Expected `float`, got `null`"):
        decode_event(raw)


def test_the_attempt_publishes_every_nonfinite_logprob_as_the_floor_and_keeps_the_rest():
    tokens, done = published(nonfinite_steps())
    assert isinstance(tokens, Tokens) and isinstance(done, Done)
    (first,), (last,) = tokens.deltas, done.deltas
    assert first.logprobs == [LOGPROB_FLOOR, -0.5] and last.logprobs == [LOGPROB_FLOOR] and LOGPROB_FLOOR == -9999.0
    assert first.top_logprobs == [[TopLogprob(100, "d", -9999.0), TopLogprob(7, "y", -9999.0)],
                                  [TopLogprob(101, "e", -0.5), TopLogprob(8, "z", -9999.0)]]
    assert last.top_logprobs == [[TopLogprob(102, "f", -9999.0), TopLogprob(9, "w", -1.0)]]
    assert tokens.prompt.logprobs == [None, -9999.0, -9999.0]  # the first prompt token has none: still None
    assert tokens.prompt.top_logprobs == [[], [TopLogprob(98, "b", -9999.0)],
                                          [TopLogprob(99, "c", -9999.0), TopLogprob(5, "x", -2.0)]]


def test_the_result_and_the_compact_log_hold_the_floor_too():
    attempt = Attempt(queued_at=1.0, started_at=2.0, whole_log=True)
    for s in nonfinite_steps():
        out = attempt.on_step(s, lambda: 3.0)
    assert out.result.choices[0].logprobs == [-9999.0, -0.5, -9999.0]
    # Both decode with their types: the only null is the prompt's first token, which has no logprob.
    assert msgspec.json.decode(encode(out.result), type=JobResult) == out.result
    logged = msgspec.json.decode(eventlog.expand(out.log, encode(out.result)), type=list[Event])
    assert logged == published(nonfinite_steps())


def strict_json(raw: bytes) -> object:
    """JSON that has no NaN or Infinity (Python's json reads them; JSON, and clients, do not)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in the wire body")
    return json.loads(raw, parse_constant=refuse)


def numbers(value: object) -> list[float]:
    """Every float in a decoded JSON document."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in numbers(v)]
    return []


ASKS_LOGPROBS = GenerationRequest(
    model="tiny", prompt="abc",
    sampling=SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1),
    output=OutputOptions(details=True, echo=True, prompt_tokens=True))
CHAT = msgspec.structs.replace(ASKS_LOGPROBS, prompt=None, messages=[ChatMessage(role="user", content="abc")],
                               sampling=msgspec.structs.replace(ASKS_LOGPROBS.sampling, prompt_logprobs=None))
# Every dialect a job can be rendered in, asking for every logprob it can show; True: it shows
# the generated tokens' logprobs, so the floor must be in its answer.
DIALECTS = {
    "jobs": (ASKS_LOGPROBS, True), "openai_completions": (ASKS_LOGPROBS, True), "openai_chat": (CHAT, True),
    "tgi": (ASKS_LOGPROBS, True), "lmi": (ASKS_LOGPROBS, True), "lmi_tgi": (ASKS_LOGPROBS, True),
    "lmi_batch": (ASKS_LOGPROBS, False), "triton": (ASKS_LOGPROBS, False), "happy_vllm": (ASKS_LOGPROBS, False),
    "lmtp": (ASKS_LOGPROBS, True), "anthropic_messages": (CHAT, False), "openai_responses": (CHAT, False),
}


@pytest.mark.parametrize("name", sorted(DIALECTS))
async def test_every_dialect_renders_them_as_numbers_in_its_answer_and_its_stream(name):
    base, shows = DIALECTS[name]
    req = msgspec.structs.replace(base, dialect=name)
    events = published(nonfinite_steps())
    builder = ResultBuilder()
    for event in events:
        builder.add(event)
    answer = strict_json(encode(dialects.render_result(req, builder.result(), "job1", 7)))
    streamed = [strict_json(part) for frame in await frames(dialects.stream(req, "job1", 7), events)
                for part in _json_parts(frame)]
    for body in (answer, streamed):
        assert all(math.isfinite(n) for n in numbers(body)), name
        if shows:
            assert LOGPROB_FLOOR in numbers(body), (name, body)


def _json_parts(frame: bytes) -> list[bytes]:
    """The JSON documents in one frame of any framing (SSE ``data:`` lines, JSON lines, LMTP's
    ``VERB [...]``), skipping ``[DONE]``, comments and event names."""
    parts = []
    for line in frame.splitlines():
        line = line.strip()
        if line.startswith(b"data:"):
            line = line[5:].strip()
        elif line[:1] not in (b"{", b"["):
            line = line.partition(b" ")[2] if line[:1].isalpha() and b" [" in line else b""
        if line and line != b"[DONE]":
            parts.append(line)
    return parts
