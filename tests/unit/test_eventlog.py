"""The compact event log (shared/eventlog.py): rebuilt byte for byte, whatever the events."""

from __future__ import annotations

import random
import zlib

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import eventlog
from shared.codec import encode
from shared.events import Done, Error, Event, Timings, TokenDelta, Tokens
from shared.result import ResultBuilder
from shared.schemas import JobResult, Pooled, PromptInfo, TopLogprob, Usage

WORDS = "the quick brown fox jumps over a lazy dog , . ! é 日本 \n \" \\ \t".split(" ")
PROMPT = PromptInfo(token_ids=[1, 2, 3], token_texts=["a", "b", "c"], logprobs=[None, -0.5, -1.25])


def job(n: int, *, logprobs: bool = False, prompt: bool = False, seed: int = 0) -> list[Event]:
    """A job of ``n`` one-token events as the worker writes them: Tokens..., then Done."""
    rnd = random.Random(seed)
    events: list[Event] = []
    for i in range(1, n + 1):
        delta = TokenDelta(token_ids=[rnd.randrange(32000)], text=rnd.choice(WORDS) + rnd.choice(WORDS))
        if logprobs:
            delta.logprobs, delta.token_texts = [-rnd.random() * 5], [delta.text]
            delta.top_logprobs = [[TopLogprob(rnd.randrange(32000), rnd.choice(WORDS), -rnd.random())]]
        info = PROMPT if prompt and i == 1 else None
        if i < n:
            events.append(Tokens(seq=i, deltas=[delta], prompt=info))
        else:
            delta.finish_reason = "length"
            events.append(Done(seq=i, deltas=[delta], prompt=info, usage=Usage(prompt_tokens=24, completion_tokens=n),
                               timings=Timings(queued_at=1764000000000.125, started_at=1764000000001.5,
                                               first_token_at=1764000000003.0, finished_at=1764000000090.75)))
    return events


def result_of(events: list[Event]) -> bytes:
    """The result the worker stores for ``events`` (workers/runner.py: the same ResultBuilder)."""
    builder = ResultBuilder()
    for event in events:
        builder.add(event)
    return encode(builder.result())


@pytest.mark.parametrize("n", [64, 500])
@pytest.mark.parametrize("logprobs", [False, True])
def test_a_finished_job_compacts_to_its_shape_in_a_few_hundred_bytes(n, logprobs):
    events = job(n, logprobs=logprobs, prompt=True)
    raw, result = encode(events), result_of(events)
    blob = eventlog.compact(raw, result)
    assert blob[:1] == eventlog.SHAPE and eventlog.needs_result(blob)
    assert eventlog.expand(blob, result) == raw
    # The target: the result plus at most 1 KB (here far less; the stream took ~150 bytes a token).
    assert len(blob) <= (400 if n == 64 else 1024), len(blob)
    assert len(blob) < len(raw) / 10


def test_a_pooling_jobs_log_refers_to_its_results_vectors_rather_than_repeat_them():
    vectors = Pooled(data=bytes(range(256)) * 32, width=64)  # 32 rows of 64 float32s
    events: list[Event] = [Done(seq=1, usage=Usage(prompt_tokens=40), pooled=vectors,
                                timings=Timings(queued_at=1764000000000.125, finished_at=1764000000090.75))]
    raw, result = encode(events), result_of(events)
    blob = eventlog.compact(raw, result)
    assert blob[:1] == eventlog.SHAPE and eventlog.expand(blob, result) == raw
    assert len(blob) < 200 < len(raw) // 50  # the vectors' base64 (about 11 KB) is the result's alone


def test_a_one_character_token_stream_compacts_to_under_a_hundred_bytes():
    """The usual job (one token an event, each a character or so) is what the preset dictionary
    holds: its log is the few bytes that differ from it, not its templates spelled out again."""
    prompt = "Request 7: basket falcon canyon orbit harbor"
    events: list[Event] = [Tokens(seq=i + 1, deltas=[TokenDelta(token_ids=[ord(c)], text=c)])
                           for i, c in enumerate(prompt * 2)][:63]
    events.append(Done(seq=64, deltas=[TokenDelta(token_ids=[ord("x")], text="x", finish_reason="length")],
                       usage=Usage(prompt_tokens=12, completion_tokens=64),
                       timings=Timings(queued_at=1795783430403.579, started_at=1795783430408.313)))
    raw, result = encode(events), result_of(events)
    blob = eventlog.compact(raw, result)
    assert blob[:1] == eventlog.SHAPE and eventlog.expand(blob, result) == raw
    assert len(blob) < 100, len(blob)


def test_a_log_compacted_before_the_dictionary_still_reads_back():
    """A log lives LLMQ_RESULT_TTL_S: one an older worker wrote (no preset dictionary) is read
    by a newer API."""
    events = job(64)
    raw, result = encode(events), result_of(events)
    new = zlib.decompressobj(-15, zdict=eventlog._DICTIONARY)
    shape = msgspec.json.decode(new.decompress(eventlog.compact(raw, result)[1:]) + new.flush())
    old = zlib.compressobj(9, zlib.DEFLATED, -15)
    blob = eventlog.SHAPE_V0 + old.compress(msgspec.json.encode(shape)) + old.flush()
    assert eventlog.needs_result(blob) and eventlog.expand(blob, result) == raw


def test_a_job_ended_by_an_error_carries_its_own_bulk():
    events: list[Event] = [*job(40)[:-1], Error(seq=40, code="cancelled", message="job was cancelled", status=499)]
    raw = encode(events)
    blob = eventlog.compact(raw)
    assert blob[:1] == eventlog.SHAPE_WITH_BASE and not eventlog.needs_result(blob)
    assert eventlog.expand(blob) == raw
    assert len(blob) < len(raw) / 2


def test_a_lone_error_is_kept_as_it_is():
    raw = encode([Error(seq=1, code="cancelled", message="job was cancelled before it started", status=499)])
    blob = eventlog.compact(raw)
    assert blob == eventlog.PLAIN + raw
    assert eventlog.expand(blob) == raw


def test_events_the_result_does_not_describe_fall_back_to_their_own_bytes():
    events = job(64)
    raw = encode(events)
    unrelated = encode(JobResult(choices=[], usage=Usage(prompt_tokens=1, completion_tokens=1)))
    blob = eventlog.compact(raw, unrelated)
    assert blob[:1] == eventlog.PACKED
    assert eventlog.expand(blob, unrelated) == raw
    assert eventlog.expand(blob) == raw  # the packed form needs no result


def test_an_unknown_form_or_a_missing_result_is_refused():
    events = job(8)
    blob = eventlog.compact(encode(events), result_of(events))
    with pytest.raises(ValueError, match="result"):
        eventlog.expand(blob)
    with pytest.raises(ValueError, match="not a compact event log"):
        eventlog.expand(b"X" + blob[1:])


# --- any events at all: rebuilt == original --------------------------------------------------

texts = st.text(max_size=6)
floats = st.floats(allow_nan=False, width=64)
top = st.builds(TopLogprob, st.integers(0, 2**31), texts, floats)
deltas = st.builds(
    TokenDelta,
    index=st.integers(0, 2),
    token_ids=st.lists(st.integers(0, 2**40), max_size=3),
    text=texts,
    token_texts=st.none() | st.lists(texts, max_size=3),
    logprobs=st.none() | st.lists(floats, max_size=3),
    top_logprobs=st.none() | st.lists(st.lists(top, max_size=2), max_size=3),
    finish_reason=st.none() | st.sampled_from(["stop", "length", "abort"]),
    stop_reason=st.none() | st.integers(0, 9) | texts,
)
prompts = st.none() | st.just(PROMPT) | st.builds(PromptInfo, token_ids=st.lists(st.integers(0, 99), max_size=3))
usages = st.builds(Usage, prompt_tokens=st.integers(0, 99), completion_tokens=st.integers(0, 999))


@st.composite
def jobs(draw: st.DrawFn) -> list[Event]:
    """Any event sequence: seqs usually 1..n but not always, any deltas, any ending."""
    n = draw(st.integers(0, 12))
    start = draw(st.sampled_from([1, 1, 1, 5]))
    events: list[Event] = []
    for i in range(n):
        seq = start + i if draw(st.integers(0, 9)) else draw(st.integers(0, 99))
        events.append(Tokens(seq=seq, deltas=draw(st.lists(deltas, max_size=3)), prompt=draw(prompts)))
    end = draw(st.sampled_from(["done", "error", "none"]))
    if end == "done":
        events.append(Done(seq=start + n, deltas=draw(st.lists(deltas, max_size=2)), prompt=draw(prompts),
                           usage=draw(usages), timings=Timings(queued_at=draw(floats))))
    elif end == "error":
        events.append(Error(seq=start + n, code=draw(texts), message=draw(texts), status=draw(st.integers(400, 599))))
    return events


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs(), st.sampled_from(["builder", "none", "other"]))
def test_any_events_are_rebuilt_byte_for_byte(events, which):
    raw = encode(events)
    result = {"builder": result_of(events), "none": None,
              "other": encode(JobResult(choices=[], usage=Usage()))}[which]
    blob = eventlog.compact(raw, result)
    assert eventlog.expand(blob, result) == raw
    assert len(blob) <= len(raw) + 1  # never larger than the events themselves (+ the form's byte)
