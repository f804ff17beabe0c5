"""What a worker writes again when a failover took events back from a job's log: the missing
events from its attempt's own bytes, then the batch's, in seq order; a job whose missing events
came before its attempt is let go (workers/runner.py ``Worker._refill``)."""

from __future__ import annotations

from redis.asyncio import Redis

from shared.config import load_settings
from shared.errors import JobCancelled
from shared.events import Error, TokenDelta
from shared.keys import Keys
from shared.queue import Consumer, Outbound
from tests.support.scripted_engine import ScriptedEngine
from workers.attempt import Attempt
from workers.protocol import Step
from workers.runner import Worker


def _worker() -> Worker:
    settings = load_settings({}, redis_url="redis://127.0.0.1:1/0", served_model_name="m")
    return Worker(settings, Consumer(Redis(), Keys("t")), ScriptedEngine(), worker_id="w")


def _attempt(seq: int, steps: int) -> tuple[Attempt, list[Outbound]]:
    a = Attempt(queued_at=1.0, started_at=2.0, seq=seq)
    outs = []
    for i in range(steps):
        out = a.on_step(Step(deltas=[TokenDelta(token_ids=[i], text="x")]), lambda: 3.0)
        assert out is not None
        outs.append(Outbound("j", attempt=1, history=a.encoded, history_from=a.base, data=out.data, seq=out.seq))
    return a, outs


def test_events_a_failover_took_back_are_written_again_from_the_attempts_own_bytes():
    a, outs = _attempt(2, 5)  # seqs 3..7, of which 3..5 were flushed and the log kept only 3
    again = _worker()._refill(outs[3:], {"j": 3})
    assert [o.seq for o in again] == [4, 5, 6, 7]
    assert [o.data for o in again] == a.encoded[1:]


def test_a_job_whose_log_lacks_events_from_before_its_attempt_is_let_go():
    worker = _worker()
    _, outs = _attempt(2, 3)
    assert worker._refill(outs[1:], {"j": 1}) == []  # seq 2 came from an earlier attempt


def test_an_event_made_without_an_attempts_history_is_let_go_after_a_gap():
    worker = _worker()
    dead = Outbound.of("j", Error.of(JobCancelled("x"), 4), attempt=1)  # a dead letter's: no history
    assert worker._refill([dead], {"j": 1}) == []


def test_the_attempts_first_event_is_written_again_with_the_prompts_ids_it_carried():
    a = Attempt(queued_at=1.0, started_at=2.0)
    outs = []
    for i in range(3):
        out = a.on_step(Step(deltas=[TokenDelta(token_ids=[i], text="x")], prompt_token_ids=[7, 8, 9]), lambda: 3.0)
        assert out is not None
        outs.append(Outbound("j", attempt=1, prompt_ids=out.prompt_ids, history=a.encoded, history_from=a.base,
                             history_prompt_ids=a.logged_prompt_ids, data=out.data, seq=out.seq))
    assert [o.prompt_ids for o in outs] == [[7, 8, 9], None, None]
    again = _worker()._refill(outs[2:], {"j": 0})  # the log lost seqs 1 and 2
    assert [(o.seq, o.prompt_ids) for o in again] == [(1, [7, 8, 9]), (2, None), (3, None)]
