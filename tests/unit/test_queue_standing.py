"""A waiting job's standing on its stream (issue 44, part 4): the exact comment every SSE dialect
sends for it, nothing in JSON lines or on LMTP's socket, and when the relay reads it."""

from __future__ import annotations

from typing import get_args

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from api import dialects
from api.dialects import lmtp
from api.dialects.openai_chat_stream import ChatStream
from api.dialects.stream import render
from api.follow import STANDING_EVERY_S, _Awaiting
from api.follow_state import FollowState
from shared.framing import KEEPALIVE, KEEPALIVE_TICK, Keepalive, comment
from shared.schemas import DialectName, GenerationRequest
from shared.slo import Capacity, Standing

WAITING = Keepalive(standing=Standing(position=7, eta_s=12.34))
FRAME = b": queue position=7 eta_s=12.3\n\n"

# Each dialect's stream as its HTTP route renders it: SSE, or not (LMI's JSON lines, its SSE
# formatter's lines, its dynamic batch, Triton's SSE without comments, happy_vllm's NDJSON).
SSE_DIALECTS = ["jobs", "openai_completions", "openai_chat", "openai_responses", "anthropic_messages", "tgi", "lmtp"]
SILENT_DIALECTS = ["lmi", "lmi_tgi", "lmi_batch", "triton", "happy_vllm", "openai_embeddings", "rerank",
                   "vllm_score", "tei"]


def test_every_dialect_is_one_or_the_other():
    assert sorted(SSE_DIALECTS + SILENT_DIALECTS) == sorted(get_args(DialectName))


@pytest.mark.parametrize("name", SSE_DIALECTS)
def test_sse_dialects_send_the_standing_as_one_comment(name):
    renderer = dialects.stream(GenerationRequest(prompt="x", dialect=name), "job-1", 0)
    assert render(renderer, WAITING) == [FRAME]
    assert render(renderer, KEEPALIVE_TICK) == [b": keep-alive\n\n"]
    # No ETA yet (no warm worker measured its speed): the plain comment, never a half-filled one.
    assert render(renderer, Keepalive(standing=Standing(position=3, eta_s=None))) == [KEEPALIVE]


@pytest.mark.parametrize("name", SILENT_DIALECTS)
def test_other_framings_send_nothing_for_it(name):
    renderer = dialects.stream(GenerationRequest(prompt="x", dialect=name), "job-1", 0)
    assert render(renderer, WAITING) == [] and render(renderer, KEEPALIVE_TICK) == []


def test_chat_as_json_lines_and_lmtp_tokens_send_nothing():
    req = GenerationRequest(messages=[{"role": "user", "content": "x"}], dialect="openai_chat")
    assert render(ChatStream(req, "job-1", 0, sse_format=False), WAITING) == []
    # LMTP's socket: TOKEN payloads only (a quiet stretch sends nothing, whatever it carries).
    assert render(lmtp.TokenFrames(1, None), WAITING) == []  # type: ignore[arg-type]


@pytest.mark.parametrize(("standing", "frame"), [
    (Standing(position=0, eta_s=0.0), b": queue position=0 eta_s=0.0\n\n"),
    (Standing(position=12, eta_s=3.45), b": queue position=12 eta_s=3.5\n\n"),  # one decimal
    (Standing(position=2, eta_s=-0.2), b": queue position=2 eta_s=0.0\n\n"),  # overdue: now, not a negative wait
    (Standing(position=1000, eta_s=7200.0), b": queue position=1000 eta_s=7200.0\n\n"),
])
def test_the_comment_has_one_fixed_shape(standing, frame):
    assert comment(Keepalive(standing=standing)) == frame


# --- when the relay reads it ----------------------------------------------------------------------


class Queue:
    """A JobStore's ``position``, scripted: each call takes the next answer (an exception is raised)."""

    def __init__(self, *answers: Standing | None | Exception) -> None:
        self.answers, self.calls = list(answers), 0

    async def position(self, model: str, job_id: str, capacity: Capacity) -> Standing | None:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def awaiting(queue: Queue, after_seq: int = 0) -> _Awaiting:
    return _Awaiting(queue, None, "tiny", "job-1", FollowState(after_seq), None,  # type: ignore[arg-type]
                     check_log_s=5.0, keepalive_s=0.5, deadline=None, cold=None, capacity=_capacity)


async def _capacity() -> Capacity:
    return Capacity(slots=1, prefill_tps=100.0, decode_tps=100.0, generated_per_job=10.0)


def due(a: _Awaiting) -> None:
    """As if the last read was long enough ago."""
    assert a.standing_at is not None
    a.standing_at -= STANDING_EVERY_S


async def test_a_waiting_job_reads_its_standing_at_most_every_two_seconds():
    standing = Standing(position=4, eta_s=9.0)
    queue = Queue(standing, Standing(position=3, eta_s=6.0))
    a = awaiting(queue)
    assert await a.tick() == Keepalive(standing=standing)  # the first quiet tick reads it
    assert await a.tick() is KEEPALIVE_TICK and queue.calls == 1  # too soon for another read
    due(a)
    assert (await a.tick()).standing == Standing(position=3, eta_s=6.0) and queue.calls == 2


async def test_a_failed_read_is_a_plain_keepalive_and_the_next_one_tries_again():
    queue = Queue(RedisConnectionError("gone"), ResponseError("NOSCRIPT"), Standing(position=1, eta_s=1.0))
    a = awaiting(queue)
    assert await a.tick() is KEEPALIVE_TICK
    due(a)
    assert await a.tick() is KEEPALIVE_TICK
    due(a)
    assert (await a.tick()).standing == Standing(position=1, eta_s=1.0)


async def test_once_the_job_is_not_waiting_the_keepalives_are_plain_without_reads():
    queue = Queue(None)
    a = awaiting(queue)
    assert await a.tick() is KEEPALIVE_TICK  # started, or ended: not queued
    assert a.standing_at is None
    assert await a.tick() is KEEPALIVE_TICK and queue.calls == 1


async def test_a_started_or_resumed_stream_never_reads_it():
    started = awaiting(Queue())
    started.state.last = 3  # an event went out (by the lane, or follow)
    assert await started.tick() is KEEPALIVE_TICK
    resumed = awaiting(Queue(), after_seq=5)  # Last-Event-ID: the job had events
    assert await resumed.tick() is KEEPALIVE_TICK
