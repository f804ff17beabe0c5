"""Which models this deployment serves: the ones it knows, and the ones a warm worker serves now.

A model is *known* when it is configured (``LLMQ_MODEL``, ``LLMQ_MODELS``) or when any worker has
ever advertised it: workers add their model to ``llmq:models`` with each heartbeat and nothing
removes it, so a model stays known while all its workers are down. A request for a known model is
queued whether or not a worker is warm (cold starts, rolling restarts, scale from zero); the
request's cold wait (:class:`api.follow.ColdWait`) bounds how long a waiting client is kept. An
unknown model gets the dialect's 404.

A model is *live* while a warm worker serves it (the model's ``workers`` set, scored by heartbeat
expiry). The health probes that load balancers use report that, and the cold wait watches it.

A model's *context length* (``/v1/models``' ``max_model_len``, TGI's and happy_vllm's ``/info``,
LMTP's model info) is what its warm workers report in their heartbeats: the least of them, as a
request may go to any. With none warm it is this process's ``LLMQ_MAX_MODEL_LEN``, the length the
next worker started with the same settings serves (a worker whose model cannot serve it stops at
start), so no length is advertised that no worker serves.

A LoRA adapter (shared/adapters.py) is a name a request may send too: :meth:`ModelRegistry.target`
resolves it to its base model, whose queue holds the job, and the adapter the job runs with. The
registry is read whole at most once per ``cache_s`` per process; a name this copy does not hold
costs one read of that name (and of the models, which a worker may have advertised since), and a
name found to be neither is remembered as nothing for ``cache_s``, so a flood of junk names costs
no reads. An adapter is usable at once on the API process that registered it and within
``cache_s`` on the others, and unusable within ``cache_s`` of its removal. A private adapter is,
to any key but its owner's and operators', a model that does not exist (:func:`caller`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from redis.asyncio import Redis

from api.auth import Viewer
from shared.adapters import Adapter, AdapterStore, Caller
from shared.errors import ModelNotFound
from shared.keys import Keys
from shared.queue import now_ms
from shared.schemas import AdapterSpec
from shared.slo import UNKNOWN, Capacity, Rates, capacity_of

if TYPE_CHECKING:
    from api.context import RequestContext
    from api.services import Services

__all__ = ["ModelRegistry", "caller"]

_rates = msgspec.json.Decoder(Rates)

_MISSING_MAX = 10_000
"""The most names the negative cache remembers (past it, it starts again)."""


def caller(svc: Services, ctx: RequestContext) -> Viewer:
    """Who a request is to the adapters: its key (``ctx.owner``), an operator's when it is one of
    LLMQ_OPERATOR_KEYS, and every caller with no keys configured (as on the console). Never the
    tenant header: a client may send any."""
    return Viewer.of(ctx.owner, svc.operators, svc.keys_on)


class ModelRegistry:
    def __init__(self, redis: Redis, keys: Keys, default: str, configured: tuple[str, ...] = (), *,
                 cache_s: float = 1.0, max_model_len: int = 2048) -> None:
        self.redis = redis
        self.max_model_len = max_model_len
        """LLMQ_MAX_MODEL_LEN: the context length of a model no warm worker reports one for."""
        self.keys = keys
        self.default = default
        self.configured = (default, *(m for m in configured if m != default))
        self.cache_s = cache_s
        self._live: dict[str, int] = {}
        self._live_at = float("-inf")
        self._known: tuple[str, ...] = self.configured
        self._known_at = float("-inf")
        self._context: dict[str, tuple[float, int]] = {}  # model -> (when read, its context length)
        self._capacity: dict[str, tuple[float, Capacity]] = {}  # model -> (when read, its capacity)
        self.adapter_store = AdapterStore(redis, keys)
        self._adapters: dict[str, Adapter] = {}
        self._adapters_at = float("-inf")
        self._missing: dict[str, float] = {}  # name -> when it was found to be no model and no adapter

    async def live(self, *, fresh: bool = False) -> dict[str, int]:
        """Live model name -> number of warm workers; cached for ``cache_s`` (one read per second
        per API process, whatever the request rate)."""
        if not fresh and time.monotonic() - self._live_at < self.cache_s:
            return self._live
        now = now_ms()
        names = set(await self._advertised(now))
        names.update(self.configured)
        pipe = self.redis.pipeline(transaction=False)
        ordered = sorted(names)
        for name in ordered:
            pipe.zcount(self.keys.workers(name), now, "+inf")
        counts = await pipe.execute()
        self._live = {name: count for name, count in zip(ordered, counts, strict=True) if count}
        self._live_at = time.monotonic()
        return self._live

    async def warm(self, model: str) -> bool:
        """Whether a warm worker serves ``model`` (cached like :meth:`live`)."""
        return model in await self.live()

    async def known(self, *, fresh: bool = False) -> tuple[str, ...]:
        """Every model requests may name: the configured ones first, then every model a worker has
        ever advertised (also where a job id may be found: results outlive their workers)."""
        if fresh or time.monotonic() - self._known_at >= self.cache_s:
            advertised = await self._advertised()
            self._known = (*self.configured, *sorted(set(advertised) - set(self.configured)))
            self._known_at = time.monotonic()
        return self._known

    async def _advertised(self, since_ms: float | None = None) -> list[str]:
        key = self.keys.models()
        raw = (await self.redis.zrange(key, 0, -1) if since_ms is None
               else await self.redis.zrangebyscore(key, since_ms, "+inf"))
        return [n.decode() if isinstance(n, bytes) else n for n in raw]

    async def _warm_fields(self, models: list[str], fields: list[str]) -> list[list[list[bytes | None]]]:
        """Per model, per warm worker, ``fields`` of its heartbeat. Two round trips, whatever the
        count. A worker's hash may have expired since the read of the set (left out), or predate a
        field (None)."""
        now = now_ms()
        pipe = self.redis.pipeline(transaction=False)
        for model in models:
            pipe.zrangebyscore(self.keys.workers(model), now, "+inf")
        warm = await pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        for workers in warm:
            for worker in workers:
                pipe.hmget(self.keys.worker(worker.decode() if isinstance(worker, bytes) else worker), fields)
        reported = iter(await pipe.execute() if any(warm) else ())
        return [[values for values in (next(reported) for _ in workers) if any(v is not None for v in values)]
                for workers in warm]

    async def context_lengths(self, models: list[str]) -> dict[str, int]:
        """Each model's context length: the least its warm workers report (the ``max_model_len``
        of their heartbeats), else :attr:`max_model_len`."""
        warm = await self._warm_fields(models, ["max_model_len"])
        return {model: min((int(v) for [v] in workers if v is not None), default=self.max_model_len)
                for model, workers in zip(models, warm, strict=True)}

    async def capacity(self, model: str) -> Capacity:
        """What ``model``'s warm workers can do (shared/slo.py): their slots and measured rates, from
        their heartbeats; cached for ``cache_s`` (admission reads it for every request)."""
        at, capacity = self._capacity.get(model, (float("-inf"), UNKNOWN))
        if time.monotonic() - at >= self.cache_s:
            [workers] = await self._warm_fields([model], ["slots", "rates"])
            capacity = capacity_of((int(slots or 0), _rates.decode(rates) if rates else Rates())
                                   for slots, rates in workers)
            self._capacity[model] = (time.monotonic(), capacity)
        return capacity

    async def context_length(self, model: str, *, cached: bool = False) -> int:
        """One model's :meth:`context_lengths`; ``cached``: as read within ``cache_s`` (TGI checks
        each request against it: one read per second per API process, whatever the rate)."""
        at, length = self._context.get(model, (float("-inf"), 0))
        if not cached or time.monotonic() - at >= self.cache_s:
            length = (await self.context_lengths([model]))[model]
            self._context[model] = (time.monotonic(), length)
        return length

    async def adapters(self, *, fresh: bool = False) -> dict[str, Adapter]:
        """Every registered adapter by name (cached like :meth:`live`); ``fresh`` also forgets the
        names found to be nothing (this process just registered one)."""
        if fresh or time.monotonic() - self._adapters_at >= self.cache_s:
            self._adapters = await self.adapter_store.all()
            self._adapters_at = time.monotonic()
            if fresh:
                self._missing.clear()
        return self._adapters

    async def visible_adapters(self, who: Caller) -> list[Adapter]:
        """The adapters ``who`` may see and use, by name."""
        return sorted((a for a in (await self.adapters()).values() if a.visible_to(who)), key=lambda a: a.name)

    async def target(self, name: str | None, who: Caller | None = None) -> tuple[str, AdapterSpec | None]:
        """What a request naming ``name`` runs on: its model (the default when it names none), or an
        adapter's base model and the adapter; raises ModelNotFound for a name this deployment does
        not know, or an adapter ``who`` may not use (:func:`caller`; None: the name was checked
        already, as a job's). Whether a worker is warm does not matter here."""
        model = name or self.default
        if model in await self.known():
            return model, None
        adapter = (await self.adapters()).get(model)
        if adapter is None and not self._missing_now(model):
            adapter = await self.adapter_store.get(model)  # registered since this copy was read
            if adapter is None:
                if model in await self.known(fresh=True):  # a worker advertised it since
                    return model, None
                self._note_missing(model)
        if adapter is not None and (who is None or adapter.visible_to(who)):
            return adapter.base, adapter.spec()
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model")

    async def resolve(self, name: str | None, who: Caller | None = None) -> str:
        """The model whose queue holds what a request naming ``name`` runs (:meth:`target`)."""
        return (await self.target(name, who))[0]

    def _missing_now(self, name: str) -> bool:
        at = self._missing.get(name)
        return at is not None and time.monotonic() - at < self.cache_s

    def _note_missing(self, name: str) -> None:
        now = time.monotonic()
        if len(self._missing) >= _MISSING_MAX:
            self._missing = {n: at for n, at in self._missing.items() if now - at < self.cache_s}
            if len(self._missing) >= _MISSING_MAX:  # that many junk names within cache_s: start again
                self._missing.clear()
        self._missing[name] = now
