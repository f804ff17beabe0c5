"""Every Redis key and channel name llmq uses. Nothing else formats a key.

Per-model keys carry the model in a Cluster hash tag (``{model}``), so the scripts that touch a
model's queue, fair-share state and job records stay in one slot. A job's per-token keys (its
event log, live and relay channels, ending, and its shard's fence) carry its token shard's tag
instead (:func:`shard_tag`, :func:`shard_of`): one model's token traffic spreads over a Cluster's
masters, and each script still touches one slot (docs/redis.md).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import zlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

__all__ = ["Keys", "GROUP", "LEVELS", "SHARDS", "new_job_id", "model_tag", "shard_of", "shard_tag", "TAG_CHARS"]

# The consumer group every worker of a model reads the queue through.
GROUP = "workers"
# Priority levels: one queue stream per level, read in order (0 first). A constant, not a setting,
# so an API and a worker can never disagree about which streams exist.
LEVELS = 3

# Token shards per model: a job's per-token traffic (its event log, its live and relay messages, the
# fence its worker's writes pass) lives under one of these hash tags, not the model's, so a model's
# token rate spreads over the masters of a Cluster. A constant, not a setting, like LEVELS: an API
# and a worker can never disagree about where a job's events are. 12 splits evenly over 1, 2, 3,
# 4 or 6 masters holding equal ranges of slots (shard_tag spreads the tags' slots evenly).
SHARDS = 12

# A job id is 32 hex digits whose first TAG_CHARS are its model's tag: every key of a job is under
# its model (the Cluster hash tag), so a bare id from a client (a poll, a cancel) must say which
# model holds it. The tag narrows the known models to (almost always) one without a lookup key,
# which could not live in the job's slot. Of the other 112 bits 104 are random (new_job_id).
TAG_CHARS = 4


@functools.cache  # asked for every known model on each poll: a handful of names per deployment
def model_tag(model: str) -> str:
    """The first hex digits of every job id queued for ``model``."""
    return hashlib.sha256(model.encode()).hexdigest()[:TAG_CHARS]


# The token shard of this process's next job id: its ids take the shards in turn, so its jobs split
# over them (and a Cluster's masters) evenly by count, not by chance (192 random ids over three
# masters differ by 20 % at the median, 40 % one time in twenty).
_next_shard = itertools.count()


# A job id's last two digits: the first of them that puts the id in its shard (below).
_ENDINGS = tuple(f"{n:02x}".encode() for n in range(256))


def new_job_id(model: str) -> str:
    """A new job id of ``model`` in this process's next token shard: its tag, 104 random bits,
    then the first of the 256 two-digit endings that puts it in the shard. One draw of random
    bytes (a system call each: drawing whole ids until one fell in the shard took a dozen per
    request), and the CRC of the random part once."""
    shard = next(_next_shard) % SHARDS
    while True:  # once, but about one time in 5e9 (no ending of the 256 fits: (11/12)^256)
        stem = (model_tag(model) + os.urandom(13).hex()).encode()
        stem_crc = zlib.crc32(stem)
        for ending in _ENDINGS:
            if zlib.crc32(ending, stem_crc) % SHARDS == shard:
                return (stem + ending).decode()


def shard_of(job_id: str) -> int:
    """The token shard of a job: a function of its id only, so every process finds it alone."""
    return zlib.crc32(job_id.encode()) % SHARDS


@functools.cache  # SHARDS tags per model, each found in a few dozen CRC16s
def shard_tag(model: str, shard: int) -> str:
    """The Cluster hash tag of one token shard of ``model``: ``<model>/<shard>.<n>``, with the
    smallest ``n`` that puts its slot in the shard's own 1/SHARDS of the slot space. The shards'
    slots are then evenly spaced, so a Cluster whose masters hold equal contiguous ranges of slots
    (``--cluster create``'s layout) holds equal numbers of shards on each; a model name alone
    would place them at random."""
    low = shard * REDIS_CLUSTER_HASH_SLOTS // SHARDS
    high = (shard + 1) * REDIS_CLUSTER_HASH_SLOTS // SHARDS
    n = 0
    while not low <= key_slot(f"{model}/{shard}.{n}".encode()) < high:
        n += 1
    return f"{model}/{shard}.{n}"


class Keys:
    """Key names under one prefix (default ``llmq``; tests use a fresh prefix per run)."""

    __slots__ = ("prefix",)

    def __init__(self, prefix: str = "llmq") -> None:
        self.prefix = prefix

    def _model(self, model: str) -> str:
        return f"{self.prefix}:{{{model}}}"

    def _shard(self, model: str, shard: int) -> str:
        return f"{self.prefix}:{{{shard_tag(model, shard)}}}"

    def queue(self, model: str, level: int = 0) -> str:
        """Stream: one entry per queued job, read through group ``workers``; level 0 (the default
        priority) is ``...:queue``, lower priorities ``...:queue:1`` and ``...:queue:2``."""
        return f"{self._model(model)}:queue" + (f":{level}" if level else "")

    def queues(self, model: str) -> list[str]:
        """Every level's queue, in reading order (most urgent first)."""
        return [self.queue(model, level) for level in range(LEVELS)]

    def waiting(self, model: str, level: int = 0) -> str:
        """Stream: one entry (``job``, ``tenant``) per job waiting its turn on a level, in arrival
        order; read by no group. Which waiting job runs next is the fair-share pick's choice
        (read.lua), which moves it to :meth:`queue`. XLEN is the level's backlog."""
        return f"{self._model(model)}:waiting" + (f":{level}" if level else "")

    def waitings(self, model: str) -> list[str]:
        return [self.waiting(model, level) for level in range(LEVELS)]

    def fair(self, model: str, level: int = 0) -> str:
        """Sorted set: tenant -> its virtual token counter, for each tenant with jobs waiting on a
        level and room to run one (under its ``max_running``); the pick takes the lowest."""
        return f"{self._model(model)}:fair" + (f":{level}" if level else "")

    def fairs(self, model: str) -> list[str]:
        return [self.fair(model, level) for level in range(LEVELS)]

    def fair_clock(self, model: str) -> str:
        """Hash: level -> the counter of the tenant picked last there; a tenant that starts
        waiting on an idle level is lifted to it, so idle time banks no credit."""
        return f"{self._model(model)}:fair:clock"

    def tenant(self, model: str, tenant: str) -> str:
        """Hash: one tenant's fair-share state on one model: ``vtc`` (tokens served / weight, plus
        the estimates of running jobs), ``weight`` and ``max_running`` (as its latest request was
        admitted with). The scripts append the suffixes of the keys below to it: a tenant id is
        only known inside them, from a waiting entry or a job record."""
        return f"{self._model(model)}:tenant:{tenant}"

    def tenant_waiting(self, model: str, tenant: str, level: int = 0) -> str:
        """Sorted set: the tenant's waiting jobs on a level (its line), ``<waiting entry id> <job id>``,
        the first to start lowest (Fair.order, :func:`shared.scripts.line_score`): preempted, then by
        first-token deadline, then by arrival."""
        return self.tenant(model, tenant) + ":line" + (f":{level}" if level else "")

    def tenant_running(self, model: str, tenant: str) -> str:
        """Set: the ids of the tenant's jobs picked and not yet ended (running, or about to)."""
        return self.tenant(model, tenant) + ":running"

    def tenant_tokens(self, model: str, tenant: str) -> str:
        """Hash with TTL: epoch second -> tokens of the tenant's jobs that ended in it; the last
        60 s are its tokens-per-minute window."""
        return self.tenant(model, tenant) + ":tokens"

    def tokens(self, model: str) -> str:
        """Hash with TTL: epoch second -> tokens of every tenant's jobs that ended in it (the
        denominator of a tenant's share of the last minute)."""
        return f"{self._model(model)}:tokens"

    def tenants(self, model: str) -> str:
        """Sorted set: tenant -> when it first queued a job on the model (epoch ms)."""
        return f"{self._model(model)}:tenants"

    def usage(self, model: str, day: str | None = None) -> str:
        """Hash: ``<tenant>:<requests|prompt_tokens|generated_tokens|engine_ms>`` -> count, for one
        UTC day (``YYYY-MM-DD``, kept LLMQ_USAGE_DAYS) or, with no day, since the start; a LoRA
        adapter's jobs count again under ``<tenant>/<adapter>:`` (no tenant name holds a ``/``)."""
        return f"{self._model(model)}:usage" + (f":{day}" if day else "")

    def job(self, model: str, job_id: str) -> str:
        """Hash: the job record (status, request, timestamps, worker, attempt, result, error; once
        ended, ``log``: its compact event log, bytes)."""
        return f"{self._model(model)}:job:{job_id}"

    def events(self, model: str, job_id: str) -> str:
        """The job's event log while it runs: a stream (entry ids ``<seq>-0``, so XRANGE resumes
        by sequence). Its end replaces it by the compact log (shared/eventlog.py), kept in the
        record's ``log`` field; a continued job's stream is kept instead, with the record's TTL.
        Under the job's token shard (:func:`shard_of`), not the model."""
        return self.events_in(model, shard_of(job_id), job_id)

    def events_in(self, model: str, shard: int, job_id: str = "") -> str:
        """:meth:`events` given the shard (with no job id: the shard's prefix)."""
        return f"{self._shard(model, shard)}:events:{job_id}"

    def fence(self, model: str, shard: int) -> str:
        """Hash, under a token shard: job id -> ``<attempt>@<worker>``, then `` <relay channels>``
        when it has followers, for each job of the shard a writer holds: the fence a flush
        (flush.lua) checks, with one HMGET for its batch, and the followers it publishes to (the
        only place a flush finds either). Installed by take.lua after the claim (the record's
        attempt, monotonic: a later attempt replaces an earlier one), by expire (an end the API
        writes, worker ''), widened by add_follower (follow.lua); removed by release.lua when its
        worker hands the job back and by settle.lua once the job's end is in its record."""
        return f"{self._shard(model, shard)}:fence"

    def ending(self, model: str, job_id: str) -> str:
        """Hash with a TTL, under the job's token shard: what the record must say of a job whose
        terminal event is logged (status, result or error, usage, its queue entry), written with
        that event; deleted once the record says it (settle.lua). Left behind by a writer that
        died between the two: the job's next claimer ends the record from it (take.lua)."""
        return self.ending_in(model, shard_of(job_id), job_id)

    def ending_in(self, model: str, shard: int, job_id: str = "") -> str:
        """:meth:`ending` given the shard (with no job id: the shard's prefix, for the scripts)."""
        return f"{self._shard(model, shard)}:ending:{job_id}"

    def live(self, model: str, job_id: str) -> str:
        """Pub/sub channel: the same events as the log, live (under the job's token shard)."""
        return self.live_in(model, shard_of(job_id), job_id)

    def live_in(self, model: str, shard: int, job_id: str = "") -> str:
        """:meth:`live` given the shard (with no job id: the shard's prefix, for the scripts)."""
        return f"{self._shard(model, shard)}:live:{job_id}"

    def relay(self, model: str, instance: str, job_id: str, *, sharded: bool = True) -> str:
        """Pub/sub channel: the live events of every job of ``model`` that one API process follows,
        many per message (``<job id> <event JSON>`` lines), so a worker publishes once per API
        process per flush rather than once per job. A job lists its followers' relay channels in
        its record's ``relay`` field; a job with none is published on its own :meth:`live` channel.
        On a Cluster (``sharded``) one per token shard: the channel of ``job_id``'s shard, published
        by its master. On a single Redis one per model (the first shard's name), since a flush
        writes every shard in one call there: one PUBLISH per API process per flush, not one per
        shard."""
        return self.relay_in(model, shard_of(job_id) if sharded else 0, instance)

    def relay_in(self, model: str, shard: int, instance: str) -> str:
        """:meth:`relay` given the shard."""
        return f"{self._shard(model, shard)}:relay:{instance}"

    def group(self, model: str, group_id: str) -> str:
        """String (JSON, with a TTL): the jobs of one request queued as one fire-and-poll job (a
        list of prompts, LMI's dynamic batch); polled and cancelled at ``/v1/jobs/<group id>``."""
        return f"{self._model(model)}:group:{group_id}"

    def idempotency(self, model: str, key: str) -> str:
        """String: Idempotency-Key -> job id."""
        return f"{self._model(model)}:idem:{key}"

    def dead(self, model: str) -> str:
        """Stream: jobs that failed too many deliveries (``job``, ``entry``, ``attempts``, ``at``), trimmed
        to about 10,000; the console's dead letters (shared/browse.py)."""
        return f"{self._model(model)}:dead"

    def recent(self, model: str) -> str:
        """Stream: one entry (``job``, ``tenant``, ``dialect``, ``owner``) per job queued, newest last, capped at
        LLMQ_RECENT_JOBS (approximately): the console's list of recent jobs (shared/browse.py)."""
        return f"{self._model(model)}:recent"

    def finished(self, model: str) -> str:
        """Hash: priority level -> jobs ended there after a delivery, since the start (finish.lua):
        the levels' throughput, sampled into :meth:`history`."""
        return f"{self._model(model)}:finished"

    def history(self, model: str) -> str:
        """Stream: a sample of the model's queue every few seconds, the last ten minutes
        (housekeeping): per level ``w<level>``, ``r<level>``, ``f<level>`` (waiting, running, the
        :meth:`finished` count); the console's chart."""
        return f"{self._model(model)}:history"

    def webhooks(self, model: str) -> str:
        """Stream: the outbox of finished jobs that carry a webhook, written in the same script
        that ends the job; housekeeping moves each entry into an arq delivery job."""
        return f"{self._model(model)}:webhooks"

    def holder(self, model: str, key: str) -> str:
        """String with TTL (LLMQ_AFFINITY_HOLD_S): the worker that last started a job of affinity
        ``key``, ``p:<prefix key>`` or ``a:<adapter>`` (shared/affinity.py); written by the pick."""
        return f"{self._model(model)}:holder:{key}"

    def affinity(self, model: str) -> str:
        """Hash: the pick's affinity counters since the start: ``hits`` (a job taken by the worker
        that held its key), ``misses`` (by another, its wait over), ``waits`` (a pick passed over a
        job held elsewhere)."""
        return f"{self._model(model)}:affinity"

    def workers(self, model: str) -> str:
        """Sorted set: ready worker id -> heartbeat expiry (ms); how the API knows it can serve."""
        return f"{self._model(model)}:workers"

    def media(self, sha256: str) -> str:
        """String with TTL (LLMQ_MEDIA_TTL_S, renewed whenever a job naming it is queued or
        claimed): an image's bytes as the client sent them, named by their SHA-256 (api/media.py
        stores, workers read; docs/images.md). Not JSON: ``redis-cli --raw GET`` writes the image
        file. No model tag: one image serves every model's jobs, and no script touches it."""
        return f"{self.prefix}:media:{sha256}"

    def model_info(self) -> str:
        """Hash: model name -> what its workers last said it takes (JSON ``ModelInfo``,
        shared/media.py): its input modalities and how its processor counts an image's tokens.
        Written by each worker as it comes up; nothing removes it, like :meth:`models`."""
        return f"{self.prefix}:model-info"

    def models(self) -> str:
        """Sorted set: model name -> latest heartbeat expiry (ms) of any worker serving it."""
        return f"{self.prefix}:models"

    def worker(self, worker_id: str) -> str:
        """Hash with TTL: one worker's heartbeat (model, slots, running, host, pid, started)."""
        return f"{self.prefix}:worker:{worker_id}"

    def worker_pattern(self) -> str:
        """SCAN pattern matching every worker's heartbeat key (the control channels are no keys)."""
        return f"{self.prefix}:worker:*"

    def heartbeats(self) -> str:
        """Sorted set: worker id -> heartbeat expiry (ms), for every worker, warming ones too: who
        has a :meth:`worker` hash, found without a SCAN of the keyspace (the console reads it
        every 2 s)."""
        return f"{self.prefix}:heartbeats"

    def worker_id(self, key: str) -> str:
        """The worker id in a heartbeat key (the inverse of :meth:`worker`)."""
        return key.removeprefix(f"{self.prefix}:worker:")

    def api_home(self, instance: object) -> str:
        """Pub/sub channel each API process stays subscribed to (keeps its listener in pub/sub mode)."""
        return f"{self.prefix}:api:{instance}"

    def api_metrics(self, instance: str) -> str:
        """String with TTL: one API process's own metrics series (its error answers, the streams
        it relays), as encoded samples, rewritten every heartbeat: any API process's ``/metrics``
        shows every live one's (api/metrics.py)."""
        return f"{self.prefix}:api:{instance}:metrics"

    def apis(self) -> str:
        """Sorted set: live API process id -> expiry (ms) of its :meth:`api_metrics` key."""
        return f"{self.prefix}:apis"

    def arq_queue(self) -> str:
        """arq's sorted set for the housekeeping process (background work, never the hot path)."""
        return f"{self.prefix}:arq:queue"

    def webhook_delivery(self, job_id: str) -> str:
        """arq job id of a job's webhook delivery: one per job, so a repeated enqueue is refused."""
        return f"{self.prefix}:webhook:{job_id}"

    def worker_control(self, worker_id: str) -> str:
        """Pub/sub channel: job ids the worker must abort (cancellation travels through Redis)."""
        return f"{self.prefix}:worker:{worker_id}:control"

    def adapters(self) -> str:
        """Hash: LoRA adapter name -> its registry entry's JSON (shared/adapters.py): base model,
        source, rank, its owner (a key's hash; none: the operators') and whether it is private. One
        key, read whole: ``redis-cli HGETALL llmq:adapters``."""
        return f"{self.prefix}:adapters"

    def tenant_config(self, tenant: str) -> str:
        """Hash: an operator's settings for one tenant (``weight``, ``max_running``, ``max_queued``,
        ``tokens_per_minute``), on every model; tenant ``*`` holds the defaults (shared/tenants.py)."""
        return f"{self.prefix}:tenant:{tenant}"

    def tenant_configs(self) -> str:
        """SCAN pattern matching every tenant's settings."""
        return f"{self.prefix}:tenant:*"

    # --- batch files (OpenAI Batch API shape); each batch's keys share its own hash tag ---------

    def file(self, file_id: str) -> str:
        """Hash: an uploaded or produced file (``meta`` JSON, ``owner``, and ``content`` bytes; a
        produced file holds its lines' ``outcomes`` instead until the API first renders it)."""
        return f"{self.prefix}:file:{file_id}"

    def files(self) -> str:
        """Sorted set: file id -> created_at (s), for listing."""
        return f"{self.prefix}:files"

    def batch(self, batch_id: str) -> str:
        """Hash: one batch's fields (status, timestamps, file ids, request counts, next line)."""
        return f"{self.prefix}:{{{batch_id}}}:batch"

    def batch_lines(self, batch_id: str) -> str:
        """List: the batch's input lines, validated and translated (or the line's error)."""
        return f"{self.prefix}:{{{batch_id}}}:lines"

    def batch_jobs(self, batch_id: str) -> str:
        """Hash: line index -> the queued jobs of that line, until their results are gathered."""
        return f"{self.prefix}:{{{batch_id}}}:jobs"

    def batch_output(self, batch_id: str) -> str:
        """Hash: line index -> the outcome of a line that was answered (its output-file line)."""
        return f"{self.prefix}:{{{batch_id}}}:out"

    def batch_errors(self, batch_id: str) -> str:
        """Hash: line index -> the outcome of a line that failed, was cancelled, expired or was
        invalid (its error-file line)."""
        return f"{self.prefix}:{{{batch_id}}}:err"

    def batches(self) -> str:
        """Sorted set: batch id -> created_at (s), for listing."""
        return f"{self.prefix}:batches"

    def batches_active(self) -> str:
        """Set: batches housekeeping still advances (in progress or cancelling)."""
        return f"{self.prefix}:batches:active"

    def batches_lock(self) -> str:
        """String with a TTL: held by the housekeeping tick advancing batches, so ticks never overlap."""
        return f"{self.prefix}:batches:lock"

    def batch_idempotency(self, batch_id: str, line: int, part: int) -> str:
        """The Idempotency-Key of a batch line's job: enqueueing it again finds the same job."""
        return f"batch:{batch_id}:{line}:{part}"
