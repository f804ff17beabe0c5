"""Following a job: its events to the client in order, with gaps filled.

:func:`follow` yields a job's events in sequence order, exactly once, ending with the terminal
event. Live pub/sub messages (the relay channel) are the fast path; the event log fills any gap
(a message lost in a reconnect, or a resume from ``Last-Event-ID``). Every dialect builds on it,
so no dialect has its own relay: :func:`api.dialects.stream.drive` renders what it yields, and
:func:`collect` folds it for a whole answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from redis.exceptions import RedisError

from api.dialects.stream import StreamRenderer, drive
from api.follow_state import FollowState
from api.listener import Inbox
from shared.codec import decode_event
from shared.errors import DeadlineExceeded, QueueUnavailable, ServiceError
from shared.events import Done, Error, Event, Tokens, is_terminal
from shared.framing import KEEPALIVE_TICK, Keepalive
from shared.queue import JobStore, now_ms
from shared.redis import REDIS_DOWN
from shared.result import ResultBuilder
from shared.schemas import JobResult
from shared.slo import Capacity

__all__ = ["follow", "collect", "prefetch", "ColdWait", "Watcher", "Lane", "Relay", "Events", "DEADLINE_GRACE_MS"]

T = TypeVar("T")

# How long past its deadline a running job's own worker has to end it before the API does.
DEADLINE_GRACE_MS = 2000


@dataclass(frozen=True, slots=True)
class ColdWait:
    """How long a waiting client is kept while no warm worker serves its job's model.

    Requests for a known model are queued even with no worker up (a cold start, a rolling restart,
    scale from zero), so a synchronous or streaming client needs a bound: after ``wait_s`` without
    a warm worker its job is ended with ``deadline_exceeded``. ``warm`` answers from the API's
    cached view of the workers (at most one Redis read a second per process), and is asked only
    while the job is quiet: tokens flowing mean a worker is running it.
    """

    warm: Callable[[], Awaitable[bool]]
    wait_s: float

    def error(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"no worker became ready to serve this request within {self.wait_s:g} s "
                                "(LLMQ_COLD_WAIT_S)")


class Watcher(Protocol):
    """Who else hears how a followed job's relay ends (:class:`api.submit.Following`: the
    request's watch, its span and the subscription)."""

    def ended(self, event: Event) -> None:
        """The terminal event is going out (before it is yielded: the reader may stop right after)."""

    async def closed(self) -> None:
        """The relay ended, or its reader let it go."""


class Lane:
    """The way a followed job's events reach its client without waking the request's task.

    While :func:`follow` waits for the next live message, the job's :class:`api.listener.Inbox`
    hands each one to :meth:`take`, in the listener's step: the next event in sequence (never the
    terminal one) goes to ``deliver``, the stream's consumer (:class:`api.http.EventStream`), which
    renders it through the stream's renderer and writes its frames, or declines (say, its client
    is not keeping up). Whatever is not taken here reaches :func:`follow` as before: the order,
    the gap fill from the log, the terminal event, keep-alives, deadlines and the end all stay
    there. Both drive the relay's one :class:`api.follow_state.FollowState`, which :func:`follow`
    gives the lane as it starts, so neither copies the other's position.
    """

    __slots__ = ("state", "deliver", "at", "failure")

    def __init__(self) -> None:
        self.state: FollowState | None = None  # the relay's position, once follow has started
        self.deliver: Callable[[Event], bool] | None = None
        self.at = 0.0  # when an event last went out here (loop time)
        self.failure: Exception | None = None  # rendering an event taken here failed

    def take(self, data: bytes) -> bool:
        """Called by the listener: whether ``data`` went out here. Raises nothing: this runs in the
        listener's step, and one stream's failure is that stream's alone."""
        deliver, state = self.deliver, self.state
        if deliver is None or state is None or not data:  # no consumer, or RESYNC: follow reads the log
            return False
        try:
            event = decode_event(data)
        except Exception:  # follow decodes it again, and fails in the request's task
            return False
        match state.place(event):
            case "duplicate":
                return True  # dropped here
            case "gap" | "end":
                return False  # follow's: it fills the gap from the log, or ends the relay
        try:
            if not deliver(event):
                return False
        except Exception as exc:  # raised by follow in the request's task (drive renders a ServiceError)
            self.failure = exc
            state.sent(event)
            return False
        state.sent(event)
        self.at = asyncio.get_running_loop().time()
        return True


class Events(Protocol):
    """A job's events as the API passes them around: a :class:`Relay`, a :func:`prefetch`'s
    replay, or a generator of api/fanout.py or api/jobs.py. An async iterator that also closes:
    whoever stops reading before the end closes it, which releases the job's subscription.
    (Spelled out: on Python 3.11 a Protocol cannot extend AsyncIterator.)"""

    def __aiter__(self) -> AsyncIterator[Event | Keepalive]: ...

    def __anext__(self) -> Awaitable[Event | Keepalive]: ...

    async def aclose(self) -> None: ...


class Relay:
    """A followed job's events (what :func:`follow` yields), with the :class:`Lane` its consumer
    may take them through instead."""

    __slots__ = ("_events", "lane")

    def __init__(self, events: AsyncGenerator[Event | Keepalive, None], lane: Lane) -> None:
        self._events, self.lane = events, lane

    def __aiter__(self) -> Relay:
        return self

    def __anext__(self) -> Awaitable[Event | Keepalive]:
        return self._events.__anext__()

    async def aclose(self) -> None:
        self.lane.deliver = None
        await self._events.aclose()


async def follow(
    queue: JobStore,
    live: Inbox,
    model: str,
    job_id: str,
    *,
    after_seq: int = 0,
    backfill: bool = False,
    check_log_s: float = 5.0,
    keepalive_s: float | None = None,
    deadline: float | None = None,
    cold: ColdWait | None = None,
    watcher: Watcher | None = None,
    lane: Lane | None = None,
    capacity: Callable[[], Awaitable[Capacity]] | None = None,
) -> AsyncGenerator[Event | Keepalive, None]:
    """Yield the job's events with seq > ``after_seq``, in order, ending with the terminal one.

    ``backfill`` reads the log first (resume, or re-attaching to an existing job). While nothing
    arrives the log is re-checked every ``check_log_s``, so a lost live message costs latency,
    never an event. Past the job's ``deadline`` (epoch ms) the job is ended here if nobody else
    ended it (queued: at once; running: after a grace for its worker), so a client never waits
    beyond its deadline for a job no worker reads. With ``cold``, the job is also ended once no
    warm worker has served its model for ``cold.wait_s`` while it was quiet. ``watcher`` hears
    of the terminal event and of the end (a hook here rather than a wrapping generator: no extra
    layer per event). With a ``lane``, events may go out through it while this waits (see :class:`Lane`).
    With ``capacity`` (the model's, shared/slo.py), a keep-alive while the job waits carries its
    standing: its queue position and ETA.

    This generator only yields; :class:`_Awaiting` does the waiting and reading, and the order is
    :class:`api.follow_state.FollowState`'s, which the lane drives too.
    """
    state = FollowState(after_seq)
    if lane is not None:
        lane.state = state
    awaiting = _Awaiting(queue, live, model, job_id, state, lane, check_log_s=check_log_s, keepalive_s=keepalive_s,
                         deadline=deadline, cold=cold, capacity=capacity)
    try:
        if backfill:
            await awaiting.read_log()
        while True:
            while (event := state.pop()) is not None:
                if state.done:
                    if watcher is not None:
                        watcher.ended(event)  # before the yield: the reader may stop right after it
                    yield event
                    return
                yield event
            if await awaiting.wait():  # quiet for a while
                if keepalive_s:
                    yield await awaiting.tick()
                await awaiting.read_log_if_due()
    finally:
        if watcher is not None:
            await watcher.closed()


# The least time between two reads of a waiting job's standing (one script call each): the
# keep-alive ticks that come sooner are plain.
STANDING_EVERY_S = 2.0

# How long a relay rides out Redis being away (a restart, a Sentinel or Cluster failover: seconds)
# before it ends the client's stream with a 503; and how soon it reads the log again meanwhile.
RELAY_OUTAGE_S = 30.0
RETRY_LOG_S = 0.25


class _Awaiting:
    """The waiting half of :func:`follow`, and all of its I/O: the next live message (while the
    lane may send events meanwhile), the log read after a gap, a reconnect or a quiet stretch, the
    job ended past its deadline or its cold wait, Redis ridden out while it is away, and the
    waiting job's standing for the keep-alive (:meth:`tick`). What it receives goes into the
    relay's :class:`FollowState` for :func:`follow` to yield."""

    def __init__(self, queue: JobStore, live: Inbox, model: str, job_id: str, state: FollowState, lane: Lane | None,
                 *, check_log_s: float, keepalive_s: float | None, deadline: float | None,
                 cold: ColdWait | None, capacity: Callable[[], Awaitable[Capacity]] | None = None) -> None:
        self.queue, self.live, self.model, self.job_id = queue, live, model, job_id
        self.state, self.lane = state, lane
        self.check_log_s = check_log_s
        self.base_wait_s = min(check_log_s, keepalive_s) if keepalive_s else check_log_s
        self.check_at = deadline  # when to look at the deadline next (epoch ms)
        self.cold = cold
        # When the cold wait runs out (epoch ms), unless a warm worker is seen by then; None while one is.
        self.cold_at = now_ms() + cold.wait_s * 1000 if cold is not None else None
        self.idle_s = 0.0  # quiet since the log was last read
        self.quiet_at: float | None = None  # when the lane last sent an event, if it did while this waited
        self.log_due = False  # Redis was away at the last read: the log is read again soon, not in check_log_s
        self.outage = _Outage()
        self.loop = asyncio.get_running_loop()
        # When the standing was last read (loop time); None once the job has started (or a resume
        # came after its first events): from then on the keep-alives are plain.
        self.standing_at: float | None = -STANDING_EVERY_S if state.last == 0 and capacity is not None else None
        self.capacity = capacity

    async def read_log(self) -> None:
        """Hold the log's events after the last one delivered (or, while Redis is away, read it again soon)."""
        events = await self.outage.ride(self.queue.read_events(self.model, self.job_id, self.state.last))
        self.log_due = events is None
        if events:
            self.state.fill(events)

    async def read_log_if_due(self) -> None:
        """After a quiet wait: the log, once ``check_log_s`` has passed quietly or Redis was away."""
        if self.idle_s >= self.check_log_s or self.log_due:
            self.idle_s = 0.0
            await self.read_log()

    async def wait(self) -> bool:
        """Wait for the next live message and hold it (or, after a gap, the log's events). True when
        the wait was quiet: :func:`follow`'s keep-alive, then :meth:`read_log_if_due`."""
        wait_s = await self._wait_s()
        parked_at = self.loop.time()
        try:
            data = await self._message(wait_s)
        except TimeoutError:
            return await self._timed_out(wait_s, parked_at)
        self.idle_s = 0.0
        event = decode_event(data) if data else None  # empty bytes = RESYNC from the listener
        if event is not None and self.state.place(event) != "gap":
            self.state.hold(event)  # a duplicate is dropped as it is popped
            self.log_due = False
        else:  # a gap, or a reconnect: the log has everything after the last event delivered
            await self.read_log()
        return False

    async def tick(self) -> Keepalive:
        """The keep-alive after a quiet wait: while the job waits, where it stands in its model's
        queue (read at most every :data:`STANDING_EVERY_S`: one script call, never per token).
        The standing is a courtesy: a failed read is a plain keep-alive, never the stream's end."""
        if self.standing_at is None:
            return KEEPALIVE_TICK
        if self.state.last:  # an event went out: the job has started
            self.standing_at = None
            return KEEPALIVE_TICK
        now = self.loop.time()
        if now - self.standing_at < STANDING_EVERY_S:
            return KEEPALIVE_TICK
        self.standing_at = now
        try:
            assert self.capacity is not None  # without it, standing_at is None from the start
            standing = await self.queue.position(self.model, self.job_id, await self.capacity())
        except (RedisError, *REDIS_DOWN):  # the log read rides out an outage; this one just skips a beat
            return KEEPALIVE_TICK
        if standing is None:  # no longer queued: started, or ended (its events follow)
            self.standing_at = None
            return KEEPALIVE_TICK
        return Keepalive(standing=standing)

    async def _wait_s(self) -> float:
        """How long the next wait may last: until the log, the deadline or the cold wait is due,
        less the activity the lane's events counted since (ending the job if it is overdue now)."""
        wait_s = min(self.base_wait_s, RETRY_LOG_S) if self.log_due else self.base_wait_s
        if self.check_at is not None:
            if time.time() * 1000 >= self.check_at:  # once per event: the bare clock, not now_ms's rounding
                self.check_at = await self._expire()
            wait_s = min(wait_s, max(0.001, (self.check_at - time.time() * 1000) / 1000))
        if self.cold_at is not None:
            wait_s = min(wait_s, max(0.001, (self.cold_at - time.time() * 1000) / 1000))
        if self.quiet_at is not None:  # events went out through the lane: quiet only since the last of them
            wait_s = max(0.001, wait_s - (self.loop.time() - self.quiet_at))
            self.quiet_at = None
        return wait_s

    async def _message(self, wait_s: float) -> bytes:
        """The next live message; TimeoutError after ``wait_s``. Messages already queued are taken
        without waiting, so a burst of events flows through the whole chain in one task step and the
        response's writes coalesce (api.middleware.CoalescingSend). A wait arms a timer, not
        wait_for's extra task per event (and keeps an item that arrives as the timer fires: it
        stays queued); meanwhile the lane may take the messages."""
        live, lane = self.live, self.lane
        if not live.empty():
            return live.get_nowait()
        if lane is not None:
            live.sink = lane.take
        try:
            async with asyncio.timeout(wait_s):
                data = await live.get()
        finally:
            live.sink = None
        if lane is not None and lane.failure is not None:
            raise lane.failure
        return data

    async def _timed_out(self, wait_s: float, parked_at: float) -> bool:
        """The wait ran out: whether it was quiet, or the deadline is due, or the lane's events flowed."""
        if self.check_at is not None and now_ms() >= self.check_at:
            self.log_due = False
            return False  # the next wait's first look is at the deadline
        lane = self.lane
        if lane is not None and lane.at > parked_at:
            # Not quiet: events went out through the lane (so a worker runs the job: a quiet
            # stretch from now on starts a fresh cold wait, as after any event).
            self.idle_s, self.quiet_at, self.log_due, self.cold_at = 0.0, lane.at, False, None
            return False
        if self.cold is not None:  # quiet: is a worker there to run it?
            await self._watch_cold()
        self.idle_s += wait_s
        return True

    async def _expire(self) -> float:
        """End the job if it is overdue; returns when to check again (epoch ms)."""
        if await self.outage.ride(self.queue.expire(self.model, self.job_id, grace_ms=DEADLINE_GRACE_MS)) is None:
            return now_ms() + RETRY_LOG_S * 1000
        return now_ms() + DEADLINE_GRACE_MS

    async def _watch_cold(self) -> None:
        cold = self.cold
        assert cold is not None
        try:
            warm = await cold.warm()
        except REDIS_DOWN:
            return  # Redis is away: it says nothing about the workers; the relay recovers from the log
        if warm:
            self.cold_at = None
            return
        if self.cold_at is None:  # the warm workers went away: a fresh wait starts now
            self.cold_at = now_ms() + cold.wait_s * 1000
        if now_ms() >= self.cold_at:
            # Still no worker: end the job (fenced, as a deadline does); its error event follows.
            ended = await self.outage.ride(self.queue.expire(self.model, self.job_id, grace_ms=0, now=cold.error()))
            if ended is not None:
                self.cold = self.cold_at = None


class _Outage:
    """Redis going away while a job is relayed: a pause for the client (the worker keeps its events,
    the log has them once Redis is back), and past :data:`RELAY_OUTAGE_S` the client's 503."""

    def __init__(self) -> None:
        self.since: float | None = None

    async def ride(self, call: Awaitable[T]) -> T | None:
        """``call``'s result, or None while Redis is away (for at most RELAY_OUTAGE_S)."""
        try:
            result = await call
        except REDIS_DOWN:
            now = time.monotonic()
            self.since = self.since if self.since is not None else now
            if now - self.since > RELAY_OUTAGE_S:
                raise QueueUnavailable("lost the connection to the queue while relaying the job") from None
            return None
        self.since = None
        return result


async def prefetch(events: Events, wait_s: float) -> Events:
    """Wait up to ``wait_s`` for the first event before the response starts, so an error that
    comes first (say, a prompt too long for the model) still gets a real HTTP status. Raises that
    error; otherwise returns an iterator that replays what was read, then continues.

    The wait runs ``anext`` in a task rather than under a timeout: cancelling an async generator
    mid-await would close it for good.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    head: Event | Keepalive | None = None
    waiting: asyncio.Future[Event | Keepalive] | None = None
    while head is None:
        step = asyncio.ensure_future(anext(events))
        try:
            done, _ = await asyncio.wait({step}, timeout=max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:
            step.cancel()  # the handler was cancelled (client gone): leave no task reading on
            raise
        if not done:
            waiting = step
            break
        match step.result():
            case Error() as error:
                raise error.exception()
            case Keepalive():
                # The tick that ends the wait only starts the response: its first frame stays an
                # event, as it always was (a client that reads a lone comment badly, as vLLM's
                # benchmark client does, meets one only on a longer wait).
                if loop.time() >= deadline:
                    break
            case event:
                head = event

    return _Replay(head, waiting, events)


class _Replay:
    """What :func:`prefetch` read, then the rest of ``events`` handed straight through: each later
    event costs one method call here, not a generator layer of its own."""

    __slots__ = ("_first", "_events", "_ended", "lane")

    def __init__(self, head: Event | Keepalive | None, waiting: asyncio.Future[Event | Keepalive] | None,
                 events: Events) -> None:
        self._first = waiting if waiting is not None else head
        self._events = events
        self._ended = False
        self.lane: Lane | None = events.lane if isinstance(events, Relay) else None

    def __aiter__(self) -> _Replay:
        return self

    def __anext__(self) -> Awaitable[Event | Keepalive]:
        if self._first is not None:
            first, self._first = self._first, None
            return self._head(first)
        if self._ended:
            return self._stop()
        return self._events.__anext__()

    async def _head(self, first: Event | Keepalive | asyncio.Future[Event | Keepalive]) -> Event | Keepalive:
        item = await first if isinstance(first, asyncio.Future) else first
        if not isinstance(item, Keepalive) and is_terminal(item):
            self._ended = True
        return item

    @staticmethod
    async def _stop() -> Event | Keepalive:
        raise StopAsyncIteration

    def _let_go(self) -> None:
        first, self._first = self._first, None
        if isinstance(first, asyncio.Future) and not first.done():
            first.cancel()  # the read still running from prefetch: nobody will take its event

    async def aclose(self) -> None:
        self._let_go()
        await self._events.aclose()

    def __del__(self) -> None:  # dropped unread (the response ended early): as aclose, minus the await
        self._let_go()


class _Whole(StreamRenderer[None]):
    """A whole answer: the events folded into the job's result; an error is raised."""

    def __init__(self, on_event: Callable[[Tokens | Done], None] | None) -> None:
        self.builder = ResultBuilder()
        self.on_event = on_event

    def step(self, event: Tokens | Done) -> list[None]:
        self.builder.add(event)
        if self.on_event is not None:
            self.on_event(event)
        return []

    def fail(self, exc: ServiceError) -> list[None]:
        raise exc


async def collect(
    events: AsyncIterator[Event | Keepalive], on_event: Callable[[Tokens | Done], None] | None = None
) -> JobResult:
    """Fold a whole job into its result (non-streaming responses), through the one stream loop
    (:func:`api.dialects.stream.drive`); a terminal error is raised. ``on_event`` sees each token
    event too (a dialect that keeps per-event detail)."""
    whole = _Whole(on_event)
    async for _ in drive(whole, events):
        pass  # nothing is rendered: the answer is the fold
    return whole.builder.result()
