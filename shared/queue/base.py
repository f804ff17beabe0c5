"""What both faces of the queue hold (the API's job store, a worker's consumer): the connection,
the keys, the scripts, the fenced event writer, and the one read both make, a job's event log."""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
from redis.asyncio import Redis

from shared import eventlog, scripts
from shared.codec import decode_event
from shared.durability import NOT_DURABLE, Durability
from shared.events import Event
from shared.keys import Keys
from shared.queue.writer import EventWriter
from shared.redis import reply

__all__ = ["Side", "Logged"]

_ids = msgspec.json.Decoder(list[int])
_event_list = msgspec.json.Decoder(list[Event])


class Logged(NamedTuple):
    """A job's logged events (:meth:`Side.read_log`)."""

    events: list[Event]
    prompt_ids: list[int] | None = None
    """The prompt's token ids, logged with an attempt's first event (None: not among those read)."""


class Side:
    """One face of the queue on ``redis``; its fenced writes go through :attr:`writer`, on the
    same scripts."""

    def __init__(self, redis: Redis, keys: Keys, *, result_ttl_s: int = 3600, usage_days: int = 400,
                 durability: Durability = NOT_DURABLE) -> None:
        self.redis = redis
        self.keys = keys
        self.durability = durability
        """What an admission, and a claim, wait for before they count (LLMQ_DURABILITY)."""
        self.scripts = scripts.Scripts(redis)
        self.writer = EventWriter(self.scripts, keys, result_ttl_s=result_ttl_s, usage_ttl_s=usage_days * 86400)

    @property
    def sharded(self) -> bool | None:
        """Whether live events go out with SPUBLISH; decided on first use (shared/scripts.py)."""
        return self.scripts.sharded

    async def _run(self, call: scripts.Call) -> tuple[Any, int]:
        """Run a script; under LLMQ_DURABILITY with the WAIT after it: its reply, and the
        confirmations of its writes (0 when nothing is waited for)."""
        if self.durability.wanted:
            return await self.scripts.run_and_wait(call, self.durability)
        return await self.scripts.run(call), 0

    async def read_log(self, model: str, job_id: str, after_seq: int = 0) -> Logged:
        """The job's logged events with sequence number > ``after_seq``, in order: from the
        stream while it runs, rebuilt from the compact log once it has ended (one script, so
        never half of each; the same events and bytes either way). With the prompt's token ids
        when the events read include the one that carried them (a running job's log: what a
        continuation needs)."""
        kind, *found = await self.scripts.run(scripts.read_log(self.keys.events(model, job_id), after_seq + 1))
        if kind == b"s":
            events, prompt_ids = [], None
            for _, fields in found[0]:
                events.append(decode_event(fields[1]))
                if len(fields) > 2 and fields[2] == b"p":  # the attempt's first event: 'e', event, 'p', ids
                    prompt_ids = _ids.decode(fields[3])
            return Logged(events, prompt_ids)
        # No stream in the shard: ended and settled (the compact log is in the record; settle.lua
        # drops the stream only after finish.lua put it there), or an older worker's string.
        compact, result = (found[0], None) if kind == b"c" else (None, None)
        if compact is None or eventlog.needs_result(compact):
            held, result = await reply(self.redis.hmget(self.keys.job(model, job_id), ["log", "result"]))
            compact = compact if compact is not None else held
        if compact is None:
            return Logged([])
        if eventlog.needs_result(compact) and not result:
            return Logged([])  # the record expired a moment before its log (same TTL): the job is gone
        return Logged([e for e in _event_list.decode(eventlog.expand(compact, result or None)) if e.seq > after_seq])
