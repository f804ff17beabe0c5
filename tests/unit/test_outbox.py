"""The worker's outbox without Redis (workers/outbox.py): a queued token event stays open to its
job's next steps until a flush takes it or a later event of the job is queued; a batch Redis
refuses is kept and written again; a job the flush found lost is reported; ends are counted until
written; the flusher returns once closed and empty."""

from __future__ import annotations

import asyncio
from typing import cast

from redis.exceptions import ConnectionError as RedisConnectionError

from shared.codec import decode_event
from shared.errors import JobCancelled
from shared.events import Error, TokenDelta
from shared.queue import Consumer, Delivery, Flushed, Outbound
from workers.attempt import Attempt
from workers.outbox import Outbox
from workers.protocol import Step


class FakeQueue:
    """Records each batch a flush sends; fails the first ``down`` flushes as Redis away would."""

    def __init__(self, down: int = 0, lost: list[str] | None = None) -> None:
        self.batches: list[list[Outbound]] = []
        self.down = down
        self.lost = lost or []

    async def flush(self, model: str, batch: list[Outbound], worker_id: str) -> Flushed:
        if self.down:
            self.down -= 1
            raise RedisConnectionError("down")
        self.batches.append(list(batch))
        return Flushed(lost=self.lost, gaps={})


def outbox(queue: FakeQueue, lost: list[str] | None = None) -> Outbox:
    return Outbox(cast("Consumer", queue), "m", "w", lose=(lost if lost is not None else []).extend)


D = Delivery(entry_id=b"1-0", job_id="j", state="run", request=None, queued_at=1.0, attempt=1)


def step(token: int, text: str) -> Step:
    return Step(deltas=[TokenDelta(token_ids=[token], text=text)])


def feed(box: Outbox, attempt: Attempt, token: int, text: str) -> bool:
    """One engine step of job ``D`` (its dialect merges steps), as the runner hands it on; True
    when the step joined the job's open event."""
    out = attempt.on_step(step(token, text), lambda: 5.0, join=True)
    assert out is not None
    if not out.merged:
        box.add(D, attempt, out, joinable=True)
    return out.merged


def texts(batch: list[Outbound]) -> list[str]:
    return [decode_event(out.data).deltas[0].text for out in batch]


async def test_a_queued_event_takes_the_jobs_next_steps_until_a_flush_takes_it():
    queue, attempt = FakeQueue(), Attempt(queued_at=1.0, started_at=2.0)
    box = outbox(queue)
    assert [feed(box, attempt, i, t) for i, t in enumerate("abc")] == [False, False, True]  # the first stands alone
    await box.flush()
    assert texts(queue.batches[0]) == ["a", "bc"]  # sealed as taken: the joined step's bytes
    assert feed(box, attempt, 3, "d") is False  # taken: the next step makes an event of its own
    assert feed(box, attempt, 4, "e") is True
    await box.flush()
    assert texts(queue.batches[1]) == ["de"]


async def test_without_a_flush_every_step_joins_the_open_event():
    """The control: the same steps, never taken, keep joining."""
    queue, attempt = FakeQueue(), Attempt(queued_at=1.0, started_at=2.0)
    box = outbox(queue)
    assert [feed(box, attempt, i, t) for i, t in enumerate("abcde")] == [False, False, True, True, True]
    await box.flush()
    assert texts(queue.batches[0]) == ["a", "bcde"]


async def test_a_jobs_end_seals_its_open_event_and_is_counted_until_written():
    queue, attempt = FakeQueue(), Attempt(queued_at=1.0, started_at=2.0)
    box = outbox(queue)
    for i, t in enumerate("abc"):
        feed(box, attempt, i, t)
    await box.write_ends()
    assert queue.batches == []  # no end queued: nothing to write first
    end = attempt.end(JobCancelled("x"))
    assert end.terminal is not None
    box.end(D, end.terminal, data=end.data, entry_id=D.entry_id)
    await box.write_ends()
    [batch] = queue.batches
    assert texts(batch[:2]) == ["a", "bc"] and batch[2].ending is not None and isinstance(batch[2].ending.event, Error)
    assert (batch[2].attempt, batch[2].level) == (D.attempt, D.level)  # the delivery's, unless given


async def test_a_batch_redis_refuses_is_written_again_and_a_lost_job_reported():
    queue, lost = FakeQueue(down=1, lost=["j"]), []
    box = outbox(queue, lost)
    box.end(D, Error.of(JobCancelled("x"), 1))
    await box.flush()
    assert len(queue.batches) == 1 and queue.batches[0][0].seq == 1  # kept through the outage
    assert lost == ["j"]


async def test_the_flusher_writes_everything_queued_then_returns_once_closed():
    queue, attempt = FakeQueue(), Attempt(queued_at=1.0, started_at=2.0)
    box = outbox(queue)
    flusher = asyncio.create_task(box.run())
    feed(box, attempt, 0, "a")
    await asyncio.sleep(0.01)
    feed(box, attempt, 1, "b")
    box.close()
    await asyncio.wait_for(flusher, 1)
    assert [texts(b) for b in queue.batches] == [["a"], ["b"]]
