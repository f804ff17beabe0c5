"""What a worker writes again when a failover took events back from a job's log: the missing
events from its attempt's own bytes, then the batch's, in seq order; a job whose missing events
came before its attempt is let go (workers/outbox.py ``Outbox._refill``)."""

from __future__ import annotations

from redis.asyncio import Redis

from shared.errors import JobCancelled
from shared.events import Error, TokenDelta
from shared.keys import Keys
from shared.queue import Consumer, Outbound
from workers.attempt import Attempt
from workers.outbox import Outbox
from workers.protocol import Step


def _outbox(lost: list[str] | None = None) -> Outbox:
    """An outbox that never writes; the jobs it lets go are added to ``lost``."""
    return Outbox(Consumer(Redis(), Keys("t")), "m", "w", lose=(lost if lost is not None else []).extend)


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
    lost: list[str] = []
    again = _outbox(lost)._refill(outs[3:], {"j": 3})
    assert [o.seq for o in again] == [4, 5, 6, 7]
    assert [o.data for o in again] == a.encoded[1:]
    assert lost == []


def test_a_job_whose_log_lacks_events_from_before_its_attempt_is_let_go():
    lost: list[str] = []
    _, outs = _attempt(2, 3)
    assert _outbox(lost)._refill(outs[1:], {"j": 1}) == []  # seq 2 came from an earlier attempt
    assert lost == ["j"]


def test_an_event_made_without_an_attempts_history_is_let_go_after_a_gap():
    lost: list[str] = []
    dead = Outbound.of("j", Error.of(JobCancelled("x"), 4), attempt=1)  # a dead letter's: no history
    assert _outbox(lost)._refill([dead], {"j": 1}) == []
    assert lost == ["j"]


def test_the_attempts_first_event_is_written_again_with_the_prompts_ids_it_carried():
    a = Attempt(queued_at=1.0, started_at=2.0)
    outs = []
    for i in range(3):
        out = a.on_step(Step(deltas=[TokenDelta(token_ids=[i], text="x")], prompt_token_ids=[7, 8, 9]), lambda: 3.0)
        assert out is not None
        outs.append(Outbound("j", attempt=1, prompt_ids=out.prompt_ids, history=a.encoded, history_from=a.base,
                             history_prompt_ids=a.logged_prompt_ids, data=out.data, seq=out.seq))
    assert [o.prompt_ids for o in outs] == [[7, 8, 9], None, None]
    again = _outbox()._refill(outs[2:], {"j": 0})  # the log lost seqs 1 and 2
    assert [(o.seq, o.prompt_ids) for o in again] == [(1, [7, 8, 9]), (2, None), (3, None)]
