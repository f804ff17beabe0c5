"""The Lua scripts in shared/lua and how Python calls them: loading (with the libraries each
uses), registering, the sharded variant, and per script its layout and its packer.

Redis 6.2 has no Functions, so a library is text put before the script that uses it; which
libraries a script uses is declared here (:class:`Script` ``uses``), not guessed from its text.

**The layout is the contract.** Each :class:`Script` names its KEYS and ARGV slots in order; its
script names the same slots as locals first, before any code, in a few statements
(``local group, worker, now = unpack(ARGV, 1, 3)``; a slot alone, ``local job = KEYS[1]``), makes
numbers of those it uses as numbers right after (``at, width = tonumber(at), tonumber(width)``),
and reads no other slot. A group of slots repeated per item (a level, a job, an event) is read by
offset from the item's start (``local job, log = KEYS[k], KEYS[k + 1]``); where it starts and how
wide it is travel in the script's own fixed ARGV (``<group>_at``, ``<group>_width``), computed
here from the group's names, so no count is written on both sides. A script whose ARGV ends in
values of a variable number (field/value pairs) has a ``tail``. tests/unit/test_scripts.py holds
each script's locals against its layout (names, order, offsets), every key suffix a script
appends against :class:`shared.keys.Keys`, and every packer's output against its layout.

**Packers.** Each script has one function here that builds its KEYS and ARGV (a :class:`Call`)
from typed arguments: the only place that knows its positions. Callers (shared/queue/,
shared/batches.py) run it with :meth:`Scripts.run`. The consumer group's name travels in ARGV,
never as a literal in Lua.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple, cast

from redis.asyncio import Redis, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from shared.cluster import sharded_pubsub
from shared.durability import Durability, run_and_wait
from shared.keys import GROUP, LEVELS, Keys, shard_of
from shared.redis import refusal
from shared.slo import UNKNOWN, Capacity

__all__ = ["Library", "Group", "Script", "Call", "Scripts", "SCRIPTS", "LIBRARIES", "source", "sharded",
           "Extra", "Candidate"]

Value = str | bytes | int | float


# --- libraries, scripts and their layouts ------------------------------------------------------

@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity: module constants
class Library:
    """Lua functions several scripts share, in one table (``Fair.ended``, ``Job.finish``)."""

    file: str
    table: str
    uses: tuple[Library, ...] = ()


ITEMS = Library("items.lua", "Items")
FAIR = Library("tenants.lua", "Fair")
JOB = Library("job.lua", "Job", uses=(FAIR,))
CLAIM = Library("claim.lua", "Claim")
PICK = Library("pick.lua", "Pick", uses=(FAIR, CLAIM))
SLO = Library("slo.lua", "Slo", uses=(FAIR,))
LIBRARIES = (ITEMS, FAIR, JOB, CLAIM, PICK, SLO)


@dataclass(frozen=True, slots=True)
class Group:
    """Slots repeated per item, read by offset from the item's start. Its start and width are
    the fixed ARGV slots ``<name>_at`` and ``<name>_width`` (a group of one item or none, an
    optional key, needs no width)."""

    name: str
    slots: tuple[str, ...]

    @property
    def width(self) -> int:
        return len(self.slots)


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity: module constants
class Script:
    """One script: its file, the libraries it calls, and its slots by name."""

    file: str
    keys: tuple[str, ...] = ()
    """KEYS[1 ..]: the fixed keys."""
    argv: tuple[str, ...] = ()
    """ARGV[1 ..]: the fixed values (a group's ``_at`` and ``_width`` among them)."""
    key_groups: tuple[Group, ...] = ()
    """Then, in order, each group's keys per item."""
    argv_groups: tuple[Group, ...] = ()
    """Then, in order, each group's values per item."""
    tail: bool = False
    """ARGV goes on after the fixed values with values of a variable number."""
    uses: tuple[Library, ...] = ()
    publishes: bool = False
    """It publishes live events: on a Cluster with sharded pub/sub it runs as :func:`sharded`."""

    def slot(self, name: str) -> int:
        """The 1-based ARGV index of a fixed value."""
        return self.argv.index(name) + 1


class Call(NamedTuple):
    """A script and the KEYS and ARGV for one call of it."""

    script: Script
    keys: list[str]
    args: list[Value]


def _places(first: int, groups: Sequence[Group], counts: Sequence[int]) -> list[int]:
    """``<group>_at, <group>_width`` for groups laid out one after another from index ``first``,
    ``counts[i]`` items of group i."""
    out: list[int] = []
    for group, count in zip(groups, counts, strict=True):
        out += [first, group.width]
        first += group.width * count
    return out


# --- queue and job scripts --------------------------------------------------------------------

ENQUEUE = Script(
    "enqueue.lua",
    keys=("job", "tenant_key", "tenants", "clock", "recent"),
    key_groups=(Group("levels", ("queue", "waiting_stream", "fair")), Group("idempotency", ("idempotency",))),
    argv=("job_id", "idempotency_ttl", "max_depth", "levels", "level", "tenant", "weight", "max_running",
          "max_queued", "tokens_per_minute", "now", "levels_at", "levels_width", "idempotency_at", "touch",
          "recent_max", "dialect", "owner", "queued_at", "first_token_deadline", "slo_ttft_ms", "prefill_ms",
          "slots", "decode_tps", "generated_per_job"),
    tail=True,  # the job record's field, value pairs
    uses=(FAIR, SLO),
)


def enqueue(keys: Keys, model: str, job_id: str, tenant: str, *, idempotency: str | None, idempotency_ttl: int,
            max_depth: int, level: int, weight: float, max_running: int, max_queued: int, tokens_per_minute: int,
            now: float, record: Iterable[Value], touch: bool = False, recent: int = 0, dialect: str = "",
            owner: str = "", queued_at: float | None = None, first_token_deadline: float | None = None,
            slo_ttft_ms: int | None = None, prefill_ms: float = 0.0, capacity: Capacity = UNKNOWN) -> Call:
    """``max_running``, ``max_queued``, ``tokens_per_minute``: -1 for no limit. ``record``: the
    job hash's field, value pairs. ``touch``: a repeated idempotency key is written again (its
    TTL), so a WAIT after the script covers the earlier job too. ``recent``: how many entries the
    model's recent stream keeps (0: the job is not added), each its id, tenant, ``dialect`` and
    ``owner`` (a tenant's list reads only its own entries' records). ``queued_at`` (default
    ``now``) and ``first_token_deadline``: where it stands in its tenant's line (Fair.order);
    ``capacity``, ``prefill_ms`` and ``slo_ttft_ms``: its predicted TTFT, and its SLO."""
    k = [keys.job(model, job_id), keys.tenant(model, tenant), keys.tenants(model), keys.fair_clock(model),
         keys.recent(model)]
    for lvl in range(LEVELS):
        k += [keys.queue(model, lvl), keys.waiting(model, lvl), keys.fair(model, lvl)]
    if idempotency:
        k.append(keys.idempotency(model, idempotency))
    levels_at, levels_width, idempotency_at, _ = _places(len(ENQUEUE.keys) + 1, ENQUEUE.key_groups,
                                                        [LEVELS, 1 if idempotency else 0])
    return Call(ENQUEUE, k, [job_id, idempotency_ttl, max_depth, LEVELS, level, tenant, repr(weight), max_running,
                             max_queued, tokens_per_minute, now, levels_at, levels_width, idempotency_at,
                             int(touch), recent, dialect, owner, now if queued_at is None else queued_at,
                             "" if first_token_deadline is None else first_token_deadline,
                             "" if slo_ttft_ms is None else slo_ttft_ms, round(prefill_ms, 3),
                             *_capacity(capacity), *record])


def _capacity(capacity: Capacity) -> list[Value]:
    """A model's capacity as the scripts take it (Slo.wait_ms): slots, decode_tps, generated_per_job."""
    return [capacity.slots, repr(capacity.decode_tps), repr(capacity.generated_per_job)]


POSITION = Script(
    "position.lua",
    key_groups=(Group("levels", ("queue", "waiting", "fair")),),
    argv=("tenant_prefix", "tenant", "level", "score", "slots", "decode_tps", "generated_per_job", "levels",
          "levels_at", "levels_width"),
    uses=(PICK, SLO),
)


def position(keys: Keys, model: str, tenant: str, level: int, score: float, capacity: Capacity) -> Call:
    """A waiting job's standing: ``tenant``'s job on ``level`` whose score in its line is
    ``score`` (:func:`line_score`)."""
    k: list[str] = []
    for lvl in range(LEVELS):
        k += [keys.queue(model, lvl), keys.waiting(model, lvl), keys.fair(model, lvl)]
    return Call(POSITION, k, [keys.tenant(model, ""), tenant, level, repr(score), *_capacity(capacity), LEVELS,
                              *_places(1, POSITION.key_groups, [LEVELS])])


LATER = 1e13
"""Fair.order's band of jobs without a first-token deadline (shared/lua/tenants.lua)."""


def line_score(queued_at: float, first_token_deadline: float | None, preempted_at: float | None) -> float:
    """A waiting job's score in its tenant's line, as Fair.order gives it (tests/unit/test_scripts.py
    holds the two together)."""
    if preempted_at is not None:
        return -preempted_at
    if first_token_deadline is not None:
        return first_token_deadline
    return LATER + queued_at


READ = Script(
    "read.lua",
    keys=("clock", "workers", "affinity"),
    key_groups=(Group("levels", ("queue", "waiting", "fair")),),
    argv=("group", "consumer", "count", "tenant_prefix", "job_prefix", "now", "max_failed", "levels", "levels_at",
          "levels_width", "holder_prefix", "affinity_ms", "hold_ms", "own", "lead_ms"),
    uses=(FAIR, PICK),
)


class Affinity(NamedTuple):
    """What a worker's pick knows of affinity (docs/adapters.md#affinity)."""

    wait_ms: int
    """How long a job may be left for the worker that holds its keys (LLMQ_AFFINITY_MS); 0: off."""
    hold_ms: int
    """How long a worker holds a key after its last job of it (LLMQ_AFFINITY_HOLD_S)."""
    adapters: Sequence[str] = ()
    """The adapters this worker's engine holds now: their jobs are this worker's too."""


NO_AFFINITY = Affinity(0, 1)


def read(keys: Keys, model: str, consumer: str, count: int, *, now: float, max_failed: int,
         affinity: Affinity = NO_AFFINITY, lead_ms: float = 0) -> Call:
    """``lead_ms``: as :func:`preempt`'s."""
    k = [keys.fair_clock(model), keys.workers(model), keys.affinity(model)]
    for lvl in range(LEVELS):
        k += [keys.queue(model, lvl), keys.waiting(model, lvl), keys.fair(model, lvl)]
    return Call(READ, k, [GROUP, consumer, count, keys.tenant(model, ""), keys.job(model, ""), now, max_failed, LEVELS,
                          *_places(len(READ.keys) + 1, READ.key_groups, [LEVELS]), keys.holder(model, ""),
                          affinity.wait_ms, affinity.hold_ms, "\n".join(affinity.adapters), round(lead_ms)])


PREEMPT = Script(
    "preempt.lua",
    keys=("clock",),
    key_groups=(Group("levels", ("queue", "waiting", "fair")), Group("job_keys", ("job",))),
    argv=("group", "consumer", "tenant_prefix", "job_prefix", "now", "max_failed", "max_preemptions", "levels",
          "levels_at", "levels_width", "job_keys_at", "job_keys_width", "jobs_at", "jobs_width", "lead_ms"),
    argv_groups=(Group("jobs", ("job_id", "entry", "attempt", "level", "used")),),
    uses=(ITEMS, FAIR, PICK),
)


class Candidate(NamedTuple):
    """A running job a worker offers to give way (preempt.lua)."""

    job_id: str
    entry: bytes
    attempt: int
    level: int
    prompt_tokens: int
    """What it has used so far: counted for its tenant should it end before it runs again."""
    generated_tokens: int


def preempt(keys: Keys, model: str, consumer: str, candidates: Sequence[Candidate], *, now: float, max_failed: int,
            max_preemptions: int, lead_ms: float = 0) -> Call:
    """``lead_ms``: the worker's mean time from a start to the first token: a waiting job whose
    first-token deadline passes within it is not started (claim.lua, ``late``)."""
    k = [keys.fair_clock(model)]
    for lvl in range(LEVELS):
        k += [keys.queue(model, lvl), keys.waiting(model, lvl), keys.fair(model, lvl)]
    k += [keys.job(model, c.job_id) for c in candidates]
    args: list[Value] = [GROUP, consumer, keys.tenant(model, ""), keys.job(model, ""), now, max_failed,
                         max_preemptions, LEVELS,
                         *_places(len(PREEMPT.keys) + 1, PREEMPT.key_groups, [LEVELS, len(candidates)]),
                         *_places(len(PREEMPT.argv) + 1, PREEMPT.argv_groups, [len(candidates)]), round(lead_ms)]
    for c in candidates:
        args += [c.job_id, c.entry, c.attempt, c.level, f"{c.prompt_tokens} {c.generated_tokens}"]
    return Call(PREEMPT, k, args)


CLAIM_TAKEN = Script(
    "claim_taken.lua",
    key_groups=(Group("jobs", ("job",)),),
    argv=("worker", "now", "max_failed", "jobs_at", "jobs_width"),
    uses=(CLAIM,),
)


def claim_taken(keys: Keys, model: str, worker: str, job_ids: Sequence[str], *, now: float, max_failed: int) -> Call:
    k = [keys.job(model, job_id) for job_id in job_ids]
    return Call(CLAIM_TAKEN, k, [worker, now, max_failed,
                                 *_places(len(CLAIM_TAKEN.keys) + 1, CLAIM_TAKEN.key_groups, [len(job_ids)])])


TAKEOVER = Script("takeover.lua", keys=("queue",), argv=("group", "dead", "taker", "count"))


def takeover(queue: str, dead: str, taker: str, count: int) -> Call:
    return Call(TAKEOVER, [queue], [GROUP, dead, taker, count])


RENEW = Script(
    "renew.lua",
    key_groups=(Group("job_keys", ("job", "queue")),),
    argv=("group", "worker", "idle", "hand_back", "job_keys_at", "job_keys_width", "jobs_at", "jobs_width"),
    argv_groups=(Group("jobs", ("entry", "attempt")),),
    uses=(ITEMS,),
)


def renew(keys: Keys, model: str, worker: str, held: Sequence[tuple[str, bytes, int, int]], *, idle_ms: int,
          hand_back: bool) -> Call:
    """``held``: (job id, queue entry id, attempt, level) per job."""
    k: list[str] = []
    args: list[Value] = [GROUP, worker, idle_ms, 1 if hand_back else 0,
                         *_places(len(RENEW.keys) + 1, RENEW.key_groups, [len(held)]),
                         *_places(len(RENEW.argv) + 1, RENEW.argv_groups, [len(held)])]
    for job_id, entry, attempt, level in held:
        k += [keys.job(model, job_id), keys.queue(model, level)]
        args += [entry, attempt]
    return Call(RENEW, k, args)


ACK = Script("ack.lua", keys=("queue",), argv=("group", "entry"))


def ack(queue: str, entry: bytes) -> Call:
    return Call(ACK, [queue], [GROUP, entry])


CANCEL = Script("cancel.lua", keys=("job",))


def cancel(job: str) -> Call:
    return Call(CANCEL, [job], [])


ADD_FOLLOWER = Script("add_follower.lua", keys=("job",), argv=("channel",))


def add_follower(keys: Keys, model: str, job_id: str, channel: str) -> Call:
    return Call(ADD_FOLLOWER, [keys.job(model, job_id)], [channel])


SET_IF_EXISTS = Script("set_if_exists.lua", keys=("hash",), tail=True)


def set_if_exists(key: str, fields: dict[str, Value]) -> Call:
    return Call(SET_IF_EXISTS, [key], [v for pair in fields.items() for v in pair])


READ_LOG = Script("read_log.lua", keys=("log",), argv=("from_seq",))


def read_log(log: str, from_seq: int) -> Call:
    return Call(READ_LOG, [log], [from_seq])


FOLLOW = Script("follow.lua", keys=("fence",), argv=("job_id", "channel"))


def follow(keys: Keys, model: str, job_id: str, channel: str) -> Call:
    return Call(FOLLOW, [keys.fence(model, shard_of(job_id))], [job_id, channel])


# The keys a job's end meters its tenant in (Fair.ended): fixed ones, then per level the fair set.
_METER_KEYS = ("clock", "usage_day", "usage_total", "tokens")


def _meter_keys(keys: Keys, model: str, day: str) -> list[str]:
    return [keys.fair_clock(model), keys.usage(model, day), keys.usage(model), keys.tokens(model)]


EXPIRE = Script("expire.lua", keys=("job",), argv=("now", "grace", "at_once"))


def expire(keys: Keys, model: str, job_id: str, *, now: float, grace_ms: int, at_once: bool) -> Call:
    return Call(EXPIRE, [keys.job(model, job_id)], [now, grace_ms, "1" if at_once else "0"])


def _shards(keys: Keys, model: str, shards: Sequence[int]) -> list[str]:
    return [keys.fence(model, shard) for shard in shards]


FLUSH = Script(
    "flush.lua",
    key_groups=(Group("shards", ("fence",)), Group("event_keys", ("log",))),
    argv=("writer", "result_ttl", "shards_at", "shards_width", "event_keys_at", "event_keys_width", "shard_args_at",
          "shard_args_width", "events_at", "events_width", "endings_at", "endings_width", "prompts_at",
          "prompts_width"),
    argv_groups=(
        Group("shard_args", ("live_prefix", "ending_prefix")),
        Group("events", ("attempt", "seq", "event", "job_id", "shard")),
        # Per terminal event, after all events: what its record must say once it has ended
        # (Keys.ending, until finish.lua has written it).
        Group("endings", ("index", "status", "field", "payload", "entry", "entry_level", "dead", "prompt_tokens",
                          "generated_tokens", "finished_at")),
        # Per event that carries the prompt's token ids (an attempt's first): logged with it.
        Group("prompts", ("index", "ids")),
    ),
    uses=(ITEMS, JOB),
    publishes=True,
)


_SHARD_ARGS, _EVENTS, _ENDINGS, _PROMPTS = FLUSH.argv_groups


class Extra(NamedTuple):
    """What one event writes beyond the log and the live path: to its record (finish.lua), and
    for a terminal one its ending (flush.lua's ``endings`` group)."""

    first_token_at: Value = ""
    status: str = ""
    """Terminal: the job's final status; with ``field`` ('result' or 'error') and its JSON."""
    field: str = ""
    payload: Value = ""
    entry: Value = ""
    """Terminal: the queue entry to ack and delete, and its level."""
    entry_level: int = 0
    dead: str = ""
    """'1': also record the job in the dead-letter stream."""
    compact: Value = ""
    """The job's whole log in compact form, to keep in its record once it has ended."""
    prompt_tokens: int = -1
    """The tokens its tenant is charged (-1: not known)."""
    generated_tokens: int = -1
    finished_at: Value = ""
    """Terminal: when its writer ended it (ms), so that a read between its logged end and its
    record's (JobStore._ended) has the same time the record will ('': finish.lua's now)."""

    def ending(self) -> list[Value]:
        """Its values in flush.lua's ``endings`` group (less the index) and in Keys.ending."""
        return [self.status, self.field, self.payload, self.entry, self.entry_level, self.dead,
                self.prompt_tokens, self.generated_tokens, self.finished_at]

    @classmethod
    def from_ending(cls, fields: dict[bytes, bytes]) -> Extra:
        """The terminal extra kept in a job's ending (Keys.ending's fields, as take.lua returns them)."""
        def get(name: str) -> bytes:
            return fields.get(name.encode(), b"")

        return cls(status=get("status").decode(), field=get("field").decode(), payload=get("payload"),
                   entry=get("entry"), entry_level=int(get("entry_level") or 0), dead=get("dead").decode(),
                   prompt_tokens=int(get("prompt_tokens") or -1), generated_tokens=int(get("generated_tokens") or -1),
                   finished_at=get("finished_at"))


def flush(keys: Keys, model: str, *, writer: str, result_ttl: int, shards: Sequence[int],
          events: Sequence[Value], endings: Sequence[tuple[int, Extra]], prompts: Sequence[tuple[int, Value]] = ()
          ) -> Call:
    """``shards``: the token shards of this call (one on a Cluster); ``events``: flat, five values
    per event: attempt, seq, event JSON (encoded once by its writer), job id, index into
    ``shards``; ``endings``: (0-based index into the events, its terminal extra); ``prompts``:
    (index into the events, the prompt's token ids as JSON) for the events that carry them. Each event's
    log is a declared key (its shard's slot, the script's). Few values per event on purpose:
    packing and sending them was most of a worker's own cost per token. ``writer``: the worker
    writing (its fence entries name it; '' for an API)."""
    width = _EVENTS.width
    count = len(events) // width
    shard_args_at, shard_args_width, events_at, events_width, endings_at, endings_width, prompts_at, prompts_width = (
        _places(len(FLUSH.argv) + 1, FLUSH.argv_groups, [len(shards), count, len(endings), len(prompts)]))
    k = _shards(keys, model, shards)
    shards_at, shards_width, event_keys_at, event_keys_width = _places(1, FLUSH.key_groups, [len(shards), count])
    log_key = keys.events
    # Every fifth value from the fourth is a job id: a flat list's type cannot say so per place.
    job_ids = cast(Sequence[str], events[3::width])
    k += [log_key(model, job_id) for job_id in job_ids]
    args: list[Value] = [writer, result_ttl, shards_at, shards_width, event_keys_at, event_keys_width,
                         shard_args_at, shard_args_width, events_at, events_width, endings_at, endings_width,
                         prompts_at, prompts_width]
    for shard in shards:
        args += [keys.live_in(model, shard), keys.ending_in(model, shard)]
    args += events
    for index, extra in endings:
        args += [index, *extra.ending()]
    for index, ids in prompts:
        args += [index, ids]
    return Call(FLUSH, k, args)


def _shard_jobs(script: Script, keys: Keys, model: str, shards: Sequence[int], jobs: Sequence[tuple[str, int]],
                values: Sequence[Sequence[Value]], shard_args: Sequence[Value], fixed: Sequence[Value] = ()) -> Call:
    """take.lua's and settle.lua's layout: per shard its fence and one value; per job its log and
    (job id, shard index, ``values``)."""
    k = _shards(keys, model, shards) + [keys.events(model, job_id) for job_id, _ in jobs]
    args: list[Value] = [*_places(1, script.key_groups, [len(shards), len(jobs)]),
                         *_places(len(script.argv) + 1, script.argv_groups, [len(shards), len(jobs)]), *fixed,
                         *shard_args]
    for (job_id, index), more in zip(jobs, values, strict=True):
        args += [job_id, *more, index] if script is TAKE else [job_id, index, *more]
    return Call(script, k, args)


TAKE = Script(
    "take.lua",
    key_groups=(Group("shards", ("fence",)), Group("logs", ("log",))),
    argv=("shards_at", "shards_width", "logs_at", "logs_width", "shard_args_at", "shard_args_width", "jobs_at",
          "jobs_width", "worker"),
    argv_groups=(Group("shard_args", ("ending_prefix",)), Group("jobs", ("job_id", "attempt", "followers", "shard"))),
    uses=(ITEMS, JOB),
)


def take(keys: Keys, model: str, worker: str, shards: Sequence[int], jobs: Sequence[tuple[str, int, str, int]]
         ) -> Call:
    """``jobs``: (job id, attempt, followers (the record's ``relay``), index into ``shards``) each;
    ``worker``: the claimer ('' for an API ending a job)."""
    return _shard_jobs(TAKE, keys, model, shards, [(j, i) for j, _, _, i in jobs], [(a, f) for _, a, f, _ in jobs],
                       [keys.ending_in(model, shard) for shard in shards], [worker])


RELEASE = Script("release.lua", keys=("fence",), argv=("job_id", "writer"))


def release(keys: Keys, model: str, job_id: str, worker: str, attempt: int) -> Call:
    return Call(RELEASE, [keys.fence(model, shard_of(job_id))], [job_id, f"{attempt}@{worker}"])


SETTLE = Script(
    "settle.lua",
    key_groups=(Group("shards", ("fence",)), Group("logs", ("log",))),
    argv=("shards_at", "shards_width", "logs_at", "logs_width", "shard_args_at", "shard_args_width", "jobs_at",
          "jobs_width"),
    argv_groups=(Group("shard_args", ("ending_prefix",)), Group("jobs", ("job_id", "shard", "drop"))),
    uses=(ITEMS,),
)


def settle(keys: Keys, model: str, shards: Sequence[int], jobs: Sequence[tuple[str, int, bool]]) -> Call:
    """``jobs``: (job id, index into ``shards``, whether its record holds its compact log now) each."""
    return _shard_jobs(SETTLE, keys, model, shards, [(j, i) for j, i, _ in jobs], [("1" if d else "0",)
                                                                                  for _, _, d in jobs],
                       [keys.ending_in(model, shard) for shard in shards])


FINISH = Script(
    "finish.lua",
    key_groups=(
        # What only a terminal event writes besides its record (its tenant's meter, the webhook
        # outbox, the dead letters, its queue entry): sent only with items that end a job.
        Group("ending", ("dead_letters", "webhooks", *_METER_KEYS, "finished")),
        Group("levels", ("queue", "fair")),
        Group("jobs", ("job",)),
    ),
    argv=("group", "result_ttl", "now", "tenant_prefix", "day_ttl", "levels", "ending_at", "levels_at",
          "levels_width", "jobs_at", "jobs_width", "items_at", "items_width"),
    argv_groups=(Group("items", ("job_id", "attempt", "first_token_at", "status", "field", "payload",
                                 "entry", "entry_level", "dead", "compact", "prompt_tokens", "generated_tokens",
                                 "finished_at")),),
    uses=(ITEMS, JOB),
)


def finish(keys: Keys, model: str, *, result_ttl: int, now: float, day: str, day_ttl: int,
           items: Sequence[tuple[str, int, Extra]]) -> Call:
    """``items``: (job id, attempt, what its event writes to its record) each. The keys a job's
    end writes (its tenant's meter, today's usage among them) go only when an item ends one."""
    ending = any(extra.status for _, _, extra in items)
    k: list[str] = []
    if ending:
        k += [keys.dead(model), keys.webhooks(model), *_meter_keys(keys, model, day), keys.finished(model)]
    levels = LEVELS if ending else 0
    for level in range(levels):
        k += [keys.queue(model, level), keys.fair(model, level)]
    ending_at, _, levels_at, levels_width, jobs_at, jobs_width = _places(1, FINISH.key_groups,
                                                                         [int(ending), levels, len(items)])
    args: list[Value] = [GROUP, result_ttl, now, keys.tenant(model, ""), day_ttl, levels, ending_at, levels_at,
                         levels_width, jobs_at, jobs_width,
                         *_places(len(FINISH.argv) + 1, FINISH.argv_groups, [len(items)])]
    for job_id, attempt, extra in items:
        k.append(keys.job(model, job_id))
        args += [job_id, attempt, *extra]
    return Call(FINISH, k, args)


# --- batches ----------------------------------------------------------------------------------

BATCH_CREATE = Script("batch_create.lua", keys=("batch", "lines"), argv=("lines_at",), tail=True)


def batch_create(batch: str, lines_key: str, fields: dict[str, Value], lines: Iterable[Value]) -> Call:
    """The batch hash's ``fields``, and its lines (the tail: the field, value pairs, then the lines)."""
    pairs = [v for pair in fields.items() for v in pair]
    return Call(BATCH_CREATE, [batch, lines_key], [len(BATCH_CREATE.argv) + 1 + len(pairs), *pairs, *lines])


BATCH_STATUS = Script("batch_status.lua", keys=("batch",), argv=("status", "stamp_field", "now", "allowed"),
                      tail=True)


def batch_status(batch: str, status: str, now: int, allowed: Iterable[str], fields: dict[str, Value]) -> Call:
    """Move to ``status`` (stamping ``<status>_at``) from one of ``allowed``, setting ``fields`` too."""
    return Call(BATCH_STATUS, [batch], [status, f"{status}_at", now, ",".join(allowed),
                                        *(v for pair in fields.items() for v in pair)])


FILE_RENDERED = Script("file_rendered.lua", keys=("file",), argv=("meta", "content"))


def file_rendered(file: str, meta: bytes, content: bytes) -> Call:
    return Call(FILE_RENDERED, [file], [meta, content])


SCRIPTS = (ENQUEUE, READ, PREEMPT, POSITION, CLAIM_TAKEN, TAKEOVER, RENEW, ACK, CANCEL, ADD_FOLLOWER, FOLLOW,
           SET_IF_EXISTS, READ_LOG, EXPIRE, FLUSH, TAKE, RELEASE, SETTLE, FINISH, BATCH_CREATE, BATCH_STATUS,
           FILE_RENDERED)


# --- loading and running ----------------------------------------------------------------------

@functools.cache
def _read(file: str) -> str:
    """One file of shared/lua as it is (read once per process)."""
    return resources.files("shared").joinpath("lua", file).read_text()


def _libraries(uses: Iterable[Library]) -> list[Library]:
    """``uses`` and what they use, each once, every library after those it calls."""
    ordered: list[Library] = []

    def add(library: Library) -> None:
        if library not in ordered:
            for dependency in library.uses:
                add(dependency)
            ordered.append(library)

    for library in uses:
        add(library)
    return ordered


@functools.cache
def source(script: Script) -> str:
    """The text Redis runs: the libraries the script uses, then the script itself."""
    return "\n".join([*(_read(library.file) for library in _libraries(script.uses)), _read(script.file)])


def sharded(source_text: str) -> str:
    """A script's text with its live-channel PUBLISH made SPUBLISH (sharded pub/sub, Redis >= 7
    Cluster). Legal inside the script: the channel carries its token shard's hash tag, the
    script's slot (flush.lua runs per shard on a Cluster)."""
    out = source_text.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
    assert out != source_text, "the script no longer publishes with redis.call('PUBLISH', ...)"
    return out


class Scripts:
    """The scripts registered on one client. Those that publish are registered on first use, in
    the variant the deployment needs (plain pub/sub, or sharded on a Redis >= 7 Cluster), which
    is decided once then (shared/cluster.py; a standalone Redis decides without a round trip)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.sharded: bool | None = None
        """Whether live events go out with SPUBLISH; None until a publishing script first ran."""
        self._registered: dict[Script, AsyncScript] = {}

    async def run(self, call: Call):
        script = self._registered.get(call.script) or await self._register(call.script)
        try:
            return await script(keys=call.keys, args=call.args)
        except ResponseError as exc:
            raise await self._refused(exc) from None

    async def run_and_wait(self, call: Call, durability: Durability) -> tuple[Any, int]:
        """Run ``call``, then WAIT for ``durability.replicas`` on the same connection
        (shared/durability.py): the script's reply, and how many replicas hold its writes."""
        script = self._registered.get(call.script) or await self._register(call.script)
        text_ = script.script if isinstance(script.script, str) else str(script.script, "utf-8")
        try:
            return await run_and_wait(self.redis, script.sha, text_, call.keys, call.args, durability)
        except ResponseError as exc:
            raise await self._refused(exc) from None

    async def _refused(self, exc: ResponseError) -> Exception:
        """What a script's error reply is to its caller: a :class:`RedisRefused` when Redis refused
        the write, else the error itself."""
        refused = refusal(exc)
        if refused is None:
            return exc
        if "READONLY" in str(exc) and not isinstance(self.redis, RedisCluster):
            # A primary demoted by a failover. redis-py drops the connection and asks Sentinel again
            # only for a bare READONLY reply; Redis 6.2 wraps a script's ("Error running script ...
            # -READONLY"), so the idle connections are dropped here: the next command reconnects.
            await self.redis.connection_pool.disconnect(inuse_connections=False)
        return refused

    async def _register(self, script: Script) -> AsyncScript:
        text_ = source(script)
        if script.publishes:
            if self.sharded is None:
                self.sharded = await sharded_pubsub(self.redis)
            if self.sharded:
                text_ = sharded(text_)
        registered = self._registered[script] = self.redis.register_script(text_)
        return registered
