"""The fenced event writer: every write to a job's token shard (Keys.fence), the second slot of
every job, beside its model's.

A job's events go to its log and its followers only while their writer's attempt holds the job's
shard fence (take.lua installs it at a claim; a later claim, or the API ending the job, takes it
over). The worker writes its jobs' events here (:meth:`EventWriter.flush`), and the API ends a job
its worker can no longer end (:meth:`EventWriter.end_fenced`, for an expired or deleted job): both
through this one class, so the fence is kept in one place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import structlog

from shared import scripts
from shared.cluster import is_cluster
from shared.codec import encode
from shared.errors import JobCancelled
from shared.events import Done, Error, Event, Tokens
from shared.keys import Keys, shard_of
from shared.schemas import JobError, JobResult, Usage
from shared.tenants import today

__all__ = ["EventWriter", "Outbound", "Ending", "Flushed", "Fence", "now_ms"]

log = structlog.get_logger()


def now_ms() -> float:
    """The time every record, entry and script is given: epoch ms, to the microsecond."""
    return round(time.time() * 1000, 3)


class Ending(NamedTuple):
    """What a terminal event writes beyond the log and the live path: the job's outcome to its
    record, its queue entry acked and deleted, its tenant charged (finish.lua)."""

    event: Done | Error
    entry_id: bytes | None = None
    """The queue entry to ack and delete (None: no entry to clear)."""
    result: JobResult | None = None
    usage: Usage | None = None
    """What the job used, when no ``result`` says so (it failed or never ran); None: not known.
    Its tenant's fair share and usage are charged it."""
    log: bytes | None = None
    """The job's whole event log, this event included, in compact form (shared/eventlog.py), to
    replace the per-event stream once the job has ended; None keeps the stream (its writer does
    not hold every event of the job)."""
    dead: bool = False
    """Also record the job in the dead-letter stream."""


@dataclass(slots=True)
class Outbound:
    """One event on its way out: its bytes, the fence it is written under, what a failover needs
    to write it again and, for a terminal event, its :class:`Ending`.

    The worker's usual token event is built from its bytes alone; an event object goes through
    :meth:`of`, and an earlier event written again through :meth:`replay`."""

    job_id: str
    seq: int
    data: bytes
    """The event's JSON, encoded once by its writer (which may encode it again while it waits:
    workers/runner.py joins later steps to it until it is sealed)."""
    attempt: int = 0
    """The writer's attempt: the write happens only while (worker, attempt) still own the job.
    0 = unfenced (a delivery whose record is missing)."""
    level: int = 0
    """The level stream that holds the job's queue entry (written with a first token's time too)."""
    first_token_at: float | None = None
    prompt_ids: list[int] | None = None
    """The prompt's token ids, logged with the event (an attempt's first) so a successor can continue."""
    history: Sequence[bytes] = ()
    """The writer's attempt's events so far as JSON (this one among them), seqs ``history_from``
    + 1 on: what it writes again when a failover took some back from the log (:attr:`Flushed.gaps`)."""
    history_from: int = 0
    history_prompt_ids: list[int] | None = None
    """The prompt's token ids event ``history_from`` + 1 carried (``prompt_ids`` of the attempt's
    first event), written again with it when a failover took it back."""
    ending: Ending | None = None
    """A terminal event's: what it also writes; None for a token event."""

    @classmethod
    def of(cls, job_id: str, event: Event, *, data: bytes = b"", entry_id: bytes | None = None,
           result: JobResult | None = None, usage: Usage | None = None, log: bytes | None = None,
           dead: bool = False, **fields: Any) -> Outbound:
        """``event`` on its way out, as ``data`` (its JSON, encoded here when empty); ``fields``
        are Outbound's own (``attempt``, ``first_token_at``, ``history`` ...). A terminal event's
        :class:`Ending` is made of the keywords named as its fields; a token event has none."""
        ending = None if isinstance(event, Tokens) else Ending(event, entry_id, result, usage, log, dead)
        return cls(job_id, event.seq, data or encode(event), ending=ending, **fields)

    def replay(self, seq: int) -> Outbound:
        """Event ``seq`` of this one's attempt (one before it) written again from its history. The
        attempt's first event carries the prompt's ids again, or a successor after a later crash
        could not continue the job."""
        return Outbound(self.job_id, seq, self.history[seq - self.history_from - 1], attempt=self.attempt,
                        level=self.level, history=self.history, history_from=self.history_from,
                        history_prompt_ids=self.history_prompt_ids,
                        prompt_ids=self.history_prompt_ids if seq == self.history_from + 1 else None)

    @property
    def terminal(self) -> bool:
        return self.ending is not None


class Flushed(NamedTuple):
    """What a flush (:meth:`EventWriter.flush`) could not write."""

    lost: list[str]
    """Jobs whose events were refused: the worker lost them (a peer owns them now)."""
    gaps: dict[str, int]
    """Jobs whose log holds fewer events than came before their first one in the batch (a
    failover took the last ones back), with how many it holds: none of their events in the batch
    was written."""


class Fence(NamedTuple):
    """What taking a job's shard fence (:meth:`EventWriter.take`) found."""

    state: bytes
    """``ok`` (taken), ``lost`` (a later attempt holds it) or ``ended`` (its end is logged)."""
    last_seq: int
    """Where its log ends."""
    ending: scripts.Extra | None
    """``ended``: the ending logged with its terminal event, which its record does not say yet."""


class EventWriter:
    """The fenced writes to jobs' token shards, for the worker (its events) and the API (an end
    in place of a worker). ``scripts``: the caller's, on its Redis."""

    def __init__(self, scripts_: scripts.Scripts, keys: Keys, *, result_ttl_s: int, usage_ttl_s: int) -> None:
        self.scripts = scripts_
        self.keys = keys
        self.result_ttl_s = result_ttl_s
        self.usage_ttl_s = usage_ttl_s

    def _groups(self, job_ids: Sequence[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """How to split a call over jobs by token shard: per call (shards, [(item index, index into
        shards)]). On a Cluster one call per shard (one slot each); a single Redis takes them all
        in one call."""
        calls: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}
        one = not is_cluster(self.scripts.redis)
        for i, job_id in enumerate(job_ids):
            shard = shard_of(job_id)
            shards, items = calls.setdefault(0 if one else shard, ([], []))
            if shard not in shards:
                shards.append(shard)
            items.append((i, shards.index(shard)))
        return list(calls.values())

    async def _each(self, calls: list[scripts.Call]) -> list[Any]:
        """Run calls on different shards side by side (on a Cluster, different masters)."""
        if not calls:
            return []
        if len(calls) == 1:
            return [await self.scripts.run(calls[0])]
        # Every call answered before any error is raised: a retry of the batch never races a call
        # of the try before it.
        replies = await asyncio.gather(*(self.scripts.run(call) for call in calls), return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return list(replies)

    async def take(self, model: str, worker: str, jobs: Sequence[tuple[str, int, str]]) -> list[Fence]:
        """Take the shard fences of ``jobs`` (job id, attempt, its record's relay channels) for
        ``worker`` ('' for the API) at those attempts (take.lua), in order."""
        groups = self._groups([job_id for job_id, _, _ in jobs])
        replies = await self._each([
            scripts.take(self.keys, model, worker, shards, [(*jobs[i], at) for i, at in items])
            for shards, items in groups])
        fences: dict[int, Fence] = {}
        for (_, items), reply in zip(groups, replies, strict=True):
            for (i, _), (state, last_seq, ending) in zip(items, reply, strict=True):
                extra = (scripts.Extra.from_ending(dict(zip(ending[::2], ending[1::2], strict=True)))
                         if state == b"ended" else None)
                fences[i] = Fence(state, int(last_seq), extra)
        return [fences[i] for i in range(len(jobs))]

    async def release(self, model: str, worker: str, jobs: Sequence[tuple[str, int]]) -> None:
        """Leave the shard fences of ``jobs`` (job id, attempt) that ``worker`` holds: nothing more
        from it (a job handed back)."""
        await self._each([scripts.release(self.keys, model, job_id, worker, attempt) for job_id, attempt in jobs])

    async def finish(self, model: str, items: list[tuple[str, int, scripts.Extra]],
                     settle: list[tuple[str, bool]]) -> list[int]:
        """Write what events say to their records (finish.lua), then settle the shards of the jobs
        that ended (``settle``: job id, whether its record now holds its compact log). Returns the
        indexes of the items refused."""
        ending = any(extra.status for _, _, extra in items)  # today's date only for items that end a job
        refused = await self.scripts.run(scripts.finish(
            self.keys, model, result_ttl=self.result_ttl_s, now=now_ms(), day=today() if ending else "",
            day_ttl=self.usage_ttl_s, items=items))
        gone = {items[int(i)][0] for i in refused}
        settle = [(job_id, drop) for job_id, drop in settle if job_id not in gone]
        if settle:
            groups = self._groups([job_id for job_id, _ in settle])
            await self._each([scripts.settle(self.keys, model, shards, [(settle[i][0], at, settle[i][1])
                                                                        for i, at in items])
                              for shards, items in groups])
        return [int(i) for i in refused]

    async def flush(self, model: str, batch: list[Outbound], worker: str = "") -> Flushed:
        """Publish a batch of events: per token shard, per event XADD to the event log and one
        PUBLISH per following API process's relay channel (or per event to the job's own live
        channel when none is recorded), in one script per shard (flush.lua; a single Redis runs one
        for every shard). An attempt's first event carries the prompt's token ids into its log
        entry, so whoever reads a token there can continue after it. A first token's time goes to
        its record (finish.lua, in the model's slot) beside those calls, and a job's end after them
        (the record's outcome, its compact log, XACK + XDEL), then the shards of the jobs that ended
        are settled (settle.lua). Each event is written only while its attempt holds its job's shard fence
        (take.lua), and only right after the event before it: a job whose log lacks events before
        its first one here (a failover took them back) writes none of them (:attr:`Flushed.gaps`).

        A terminal event is logged (with its ending, Keys.ending) before its record says so: a
        writer that dies between leaves the record to the job's next claimer (its :meth:`take`),
        and every follower has the end from the log. ``worker``: the writer, whose fence entries
        (take.lua) its events must find.
        """
        groups = self._groups([out.job_id for out in batch])
        extras: dict[int, scripts.Extra] = {}
        for i, out in enumerate(batch):
            if out.first_token_at is not None or out.terminal:
                extras[i] = self._extra(out)  # the usual token event needs none
        calls = [self._flush_call(model, worker, batch, extras, shards, items) for shards, items in groups]
        # A first token's time goes to its record side by side with the logs (off the path to the
        # client's first token); nothing depends on the order of the two.
        notes = [i for i, extra in extras.items() if not extra.status]
        if notes:
            calls.append(scripts.finish(self.keys, model, result_ttl=self.result_ttl_s, now=now_ms(), day="",
                                        day_ttl=self.usage_ttl_s,
                                        items=[(batch[i].job_id, batch[i].attempt, extras[i]) for i in notes]))
        replies = await self._each(calls)
        lost_jobs = {batch[notes[int(n)]].job_id for n in replies.pop()} if notes else set()
        lost_at: set[int] = set()
        gaps: dict[str, int] = {}
        whole: set[int] = set()
        for (_, items), (lost, gap, complete) in zip(groups, replies, strict=True):
            lost_at.update(items[int(n)][0] for n in lost)
            gaps.update({batch[items[int(n)][0]].job_id: int(logged) for n, logged in zip(gap[::2], gap[1::2],
                                                                                          strict=True)})
            whole.update(items[int(n)][0] for n in complete)
        lost_jobs.update(batch[i].job_id for i in lost_at)
        ends = [i for i, extra in extras.items() if extra.status and i not in lost_at and batch[i].job_id not in gaps]
        if ends:
            ended: list[tuple[str, int, scripts.Extra]] = []
            for i in ends:
                extra = extras[i]
                if i not in whole:
                    extra = extra._replace(compact="")  # the log holds more than this writer knows of
                ended.append((batch[i].job_id, batch[i].attempt, extra))
            # A refusal here is a peer's claim between the two steps: that claimer ends the record
            # from the logged ending (its take), so the job is not lost to anyone.
            refused = await self.finish(model, ended, [(job_id, bool(extra.compact)) for job_id, _, extra in ended])
            if refused:
                log.info("flush_end_left_to_claimer", worker=worker, jobs=[ended[n][0] for n in refused])
        return Flushed(sorted(lost_jobs), gaps)

    def _flush_call(self, model: str, worker: str, batch: list[Outbound], extras: dict[int, scripts.Extra],
                    shards: list[int], items: list[tuple[int, int]]) -> scripts.Call:
        """flush.lua for the events of ``batch`` at ``items`` (index into the batch, into ``shards``)."""
        events: list[Any] = []  # flat: the packer's five values per event, built in this one pass
        endings: list[tuple[int, scripts.Extra]] = []
        prompts: list[tuple[int, bytes]] = []
        for n, (i, at) in enumerate(items):
            out = batch[i]
            events += (out.attempt, out.seq, out.data, out.job_id, at)  # the bytes its writer encoded
            if i in extras and extras[i].status:
                endings.append((n, extras[i]))
            if out.prompt_ids is not None:
                prompts.append((n, encode(out.prompt_ids)))
        return scripts.flush(self.keys, model, writer=worker, result_ttl=self.result_ttl_s, shards=shards,
                             events=events, endings=endings, prompts=prompts)

    async def end_fenced(self, model: str, job_id: str, attempt: int, followers: str,
                         event: Callable[[int], bytes], extra: scripts.Extra) -> bool:
        """End a job in place of its worker (the API, for a job expire.lua just took at ``attempt``):
        fence its token shard at that attempt, so its worker writes nothing more, then log
        ``event(seq)`` after its last event, with ``extra`` as its ending, and write that to its
        record. False when its worker logged its end first (the record then says that one) or the
        fence or the write was refused."""
        [fence] = await self.take(model, "", [(job_id, attempt, followers)])
        if fence.state == b"ended":  # its worker logged its end first: the record says that one
            assert fence.ending is not None
            await self.finish(model, [(job_id, attempt, fence.ending._replace(entry=""))], [(job_id, False)])
            return False
        if fence.state != b"ok":
            return False
        seq = fence.last_seq + 1
        flushed = await self.scripts.run(scripts.flush(self.keys, model, writer="", result_ttl=self.result_ttl_s,
                                                       shards=[shard_of(job_id)],
                                                       events=[attempt, seq, event(seq), job_id, 0],
                                                       endings=[(0, extra)]))
        if flushed[0] or flushed[1]:
            return False
        await self.finish(model, [(job_id, attempt, extra)], [(job_id, False)])
        return True

    @classmethod
    def _extra(cls, out: Outbound) -> scripts.Extra:
        """What an event writes beyond the log and the live path."""
        extra = scripts.Extra(first_token_at="" if out.first_token_at is None else out.first_token_at,
                              entry_level=out.level)
        if out.ending is None:
            return extra  # a first token's time: no entry, nothing charged (-1: unknown)
        end = out.ending
        status, field, payload = cls._terminal(end)
        # The tokens its tenant is charged: the result's usage, else what the worker counted (-1: unknown).
        usage = end.result.usage if end.result is not None else end.usage
        return extra._replace(
            status=status, field=field, payload=payload, entry=end.entry_id or "", dead="1" if end.dead else "",
            compact=end.log or "", prompt_tokens=usage.prompt_tokens if usage else -1,
            generated_tokens=usage.completion_tokens if usage else -1, finished_at=now_ms() if status else "")

    @staticmethod
    def _terminal(end: Ending) -> tuple[str, str, bytes | str]:
        match end.event:
            case Done():
                return "done", "result", encode(end.result or JobResult())
            case Error(code=code, message=message, status=status) as error:
                outcome = "cancelled" if isinstance(error.exception(), JobCancelled) else "failed"
                return outcome, "error", encode(JobError(code=code, message=message, status=status))
