"""Tenants: whose fair share, quotas and usage a job counts toward.

A request's tenant is the ``LLMQ_TENANT_HEADER`` header when that setting names one (set by a
trusted gateway), else its API key (the key's hash, as a job's ``owner``), else ``default``.

An operator's settings for a tenant live in the hash ``llmq:tenant:<tenant>`` (``llmq:tenant:*``
holds the defaults for every tenant without its own), editable with redis-cli or ``llmq-tenants``:

- ``weight``: its share relative to others (default 1): a tenant of weight 2 gets twice the
  tokens of one of weight 1 while both have work waiting.
- ``max_running``: at most this many of its jobs run at once; the rest wait their turn.
- ``max_queued``: at most this many of its jobs wait (beyond ``max_running`` when set); one more
  is refused with 429.
- ``tokens_per_minute``: once its jobs that ended in the last 60 s used this many tokens (prompt +
  generated), its requests are refused with 429 until enough of them leave the window.
- ``slo_ttft_ms``, ``slo_tpot_ms``: the SLOs (milliseconds to the first token, per token after it)
  of its requests that set none, field by field (``x-slo-*`` headers and a body's ``slo`` win).

Limits apply per model: each model is its own pool of engines, with its own fair share (as a
provider's per-model rate limits). The scripts that act on them are in shared/lua (tenants.lua).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import re
import sys
import time
from typing import Annotated

import msgspec
from redis.asyncio import Redis

from shared.keys import LEVELS, Keys
from shared.redis import connect, reply

__all__ = ["DEFAULT_TENANT", "DEFAULTS", "SLO_MAX_MS", "key_hash", "TenantConfig", "TenantState", "UsageRow",
           "usage_row", "valid_tenant", "read_config", "ConfigCache", "read_state", "read_states",
           "read_usage", "top_tenants", "today", "main"]

DEFAULT_TENANT = "default"
"""The tenant of a request with no API key and no tenant header."""
DEFAULTS = "*"
"""The settings hash every tenant without its own falls back to, field by field."""
_TENANT = re.compile(r"[A-Za-z0-9._@-]{1,64}")
USAGE_FIELDS = ("requests", "prompt_tokens", "generated_tokens", "engine_ms", "preemptions", "preempted_ms")


def key_hash(key: str) -> str:
    """An API key's tenant (and a job's ``owner``): never the key itself, so a Redis dump leaks
    no credentials."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def valid_tenant(name: str) -> bool:
    """A tenant name a header may give: it becomes part of Redis key names."""
    return _TENANT.fullmatch(name) is not None


SLO_MAX_MS = 86_400_000
"""The longest SLO a tenant's default may set, as a request's (shared.schemas.Slo, which imports this module)."""
_SloMs = Annotated[int, msgspec.Meta(gt=0, le=SLO_MAX_MS)]


class TenantConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    weight: float = 1.0
    max_running: int | None = None
    max_queued: int | None = None
    tokens_per_minute: int | None = None
    slo_ttft_ms: _SloMs | None = None
    """The TTFT SLO of its requests that set none (api.submit.resolve_slo)."""
    slo_tpot_ms: _SloMs | None = None
    """The TPOT SLO of its requests that set none."""


def _config_of(raw: dict[bytes, bytes], defaults: dict[bytes, bytes]) -> TenantConfig:
    fields = {k.decode(): v.decode() for k, v in {**defaults, **raw}.items()}
    known = {k: v for k, v in fields.items() if k in TenantConfig.__struct_fields__ and v not in ("", "none")}
    try:
        config = msgspec.convert(known, TenantConfig, strict=False)
    except msgspec.ValidationError:
        return TenantConfig()  # a hand-edited value that is no number: no limits rather than no service
    return config if config.weight > 0 else msgspec.structs.replace(config, weight=1.0)


async def read_config(redis: Redis, keys: Keys, tenant: str) -> TenantConfig:
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(keys.tenant_config(tenant))
    pipe.hgetall(keys.tenant_config(DEFAULTS))
    own, defaults = await pipe.execute()
    return _config_of(own, defaults)


class ConfigCache:
    """The API's view of tenant settings, read at most once per ``ttl_s`` per tenant: an edit with
    redis-cli takes effect within that, and a request costs no extra round trip."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: float = 2.0) -> None:
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s
        self._seen: dict[str, tuple[float, TenantConfig]] = {}

    async def get(self, tenant: str) -> TenantConfig:
        now = time.monotonic()
        cached = self._seen.get(tenant)
        if cached is not None and now - cached[0] < self.ttl_s:
            return cached[1]
        config = await read_config(self.redis, self.keys, tenant)
        if len(self._seen) > 100_000:  # tenants come and go; never an unbounded map
            self._seen.clear()
        self._seen[tenant] = (now, config)
        return config


def today(now_s: float | None = None) -> str:
    """The UTC day usage is metered under."""
    return datetime.datetime.fromtimestamp(time.time() if now_s is None else now_s, datetime.UTC).date().isoformat()


class TenantState(msgspec.Struct, kw_only=True):
    """One tenant on one model, as the scheduler sees it now."""

    tenant: str
    model: str
    counter: float
    """Its virtual token counter: tokens served (and estimated for running jobs) / weight."""
    weight: float
    waiting: list[int]
    """Its jobs waiting, per priority level."""
    running: int
    tokens_last_minute: int
    share_last_minute: float | None
    """Its part of every tenant's tokens on the model in the last minute (None: none were used)."""
    config: TenantConfig


def _window(raw: dict[bytes, bytes], now_s: float) -> int:
    since = int(now_s) - 59
    return sum(int(v) for k, v in raw.items() if int(k) >= since)


async def read_state(redis: Redis, keys: Keys, model: str, tenant: str) -> TenantState:
    [state] = await read_states(redis, keys, model, [tenant])
    return state


async def read_states(redis: Redis, keys: Keys, model: str, tenants: list[str]) -> list[TenantState]:
    """Each tenant's state on ``model``, in one round trip however many there are (the console's
    tenants list reads up to 500): the model-wide tokens hash and the default settings, which
    every tenant's figures need, are read once."""
    if not tenants:
        return []
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(keys.tokens(model))
    pipe.hgetall(keys.tenant_config(DEFAULTS))
    for tenant in tenants:
        pipe.hmget(keys.tenant(model, tenant), ["vtc", "weight"])
        for level in range(LEVELS):
            pipe.zcard(keys.tenant_waiting(model, tenant, level))
        pipe.scard(keys.tenant_running(model, tenant))
        pipe.hgetall(keys.tenant_tokens(model, tenant))
        pipe.hgetall(keys.tenant_config(tenant))
    everyone, defaults, *replies = await pipe.execute()
    now = time.time()
    total = _window(everyone, now)
    each = LEVELS + 4  # the replies per tenant, in the order queued above
    states = []
    for i, tenant in enumerate(tenants):
        (counter, weight), *rest = replies[i * each:(i + 1) * each]
        waiting, (running, own, config) = rest[:LEVELS], rest[LEVELS:]
        mine = _window(own, now)
        states.append(TenantState(tenant=tenant, model=model, counter=float(counter or 0), weight=float(weight or 1),
                                  waiting=waiting, running=running, tokens_last_minute=mine,
                                  share_last_minute=mine / total if total else None,
                                  config=_config_of(config, defaults)))
    return states


class UsageRow(msgspec.Struct, kw_only=True):
    date: str
    model: str
    adapter: str | msgspec.UnsetType = msgspec.UNSET
    """A LoRA adapter's row: the part of the model's row (the row without one) its jobs used."""
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    engine_seconds: float = 0.0
    preemptions: int = 0
    """How often its jobs gave their engine slot to another tenant's (docs/tenants.md#preemption)."""
    preempted_seconds: float = 0.0
    """The time its preempted jobs waited again before they continued."""


def usage_row(day: str, model: str, counts: dict[str, int],
              adapter: str | msgspec.UnsetType = msgspec.UNSET) -> UsageRow:
    return UsageRow(date=day, model=model, adapter=adapter, requests=counts.get("requests", 0),
                    prompt_tokens=counts.get("prompt_tokens", 0), generated_tokens=counts.get("generated_tokens", 0),
                    engine_seconds=counts.get("engine_ms", 0) / 1000, preemptions=counts.get("preemptions", 0),
                    preempted_seconds=counts.get("preempted_ms", 0) / 1000)


async def read_usage(redis: Redis, keys: Keys, models: list[str], tenant: str, days: list[str]) -> list[UsageRow]:
    """The tenant's metered usage per day and model (only the pairs where it used anything), each
    model's row followed by one per LoRA adapter its jobs ran with, by name."""
    fields = [f"{tenant}:{f}" for f in USAGE_FIELDS]
    pipe = redis.pipeline(transaction=False)
    pairs = [(day, model) for day in days for model in models]
    for day, model in pairs:
        pipe.hmget(keys.usage(model, day), fields)
    rows = []
    for (day, model), values in zip(pairs, await pipe.execute(), strict=True):
        if not any(values):
            continue
        rows.append(usage_row(day, model, {f: int(v or 0) for f, v in zip(USAGE_FIELDS, values, strict=True)}))
        # Its adapters' fields, '<tenant>/<adapter>:<field>' (a tenant name has no glob character).
        per: dict[str, dict[str, int]] = {}
        async for field, value in redis.hscan_iter(keys.usage(model, day), match=f"{tenant}/*", count=1000):
            who, _, name = field.decode().rpartition(":")
            per.setdefault(who.removeprefix(f"{tenant}/"), {})[name] = int(value)
        rows += [usage_row(day, model, counts, adapter) for adapter, counts in sorted(per.items())]
    return rows


async def top_tenants(redis: Redis, keys: Keys, model: str, day: str, n: int = 5) -> list[tuple[str, dict[str, int]]]:
    """The ``n`` tenants that used the most tokens on ``model`` on ``day``, with their usage."""
    per: dict[str, dict[str, int]] = {}
    for field, value in (await reply(redis.hgetall(keys.usage(model, day)))).items():
        tenant, _, name = field.decode().rpartition(":")
        if "/" not in tenant:  # '<tenant>/<adapter>:' counts a part of the tenant's own usage again
            per.setdefault(tenant, {})[name] = int(value)
    ranked = sorted(per.items(), key=lambda kv: -(kv[1].get("prompt_tokens", 0) + kv[1].get("generated_tokens", 0)))
    return ranked[:n]


# --- llmq-tenants ----------------------------------------------------------------------------


def _limit(text: str) -> str:
    if text == "none" or text.isdigit():
        return text
    raise argparse.ArgumentTypeError("a whole number, or none")


def _slo_ms(text: str) -> str:
    # Refused here, not stored: a value the config cannot read would void every setting of the
    # tenant (_config_of), its limits too.
    if text == "none" or (text.isascii() and text.isdigit() and 0 < int(text) <= SLO_MAX_MS):
        return text
    raise argparse.ArgumentTypeError(f"a whole number of milliseconds, 1 to {SLO_MAX_MS}, or none")


async def _run(args: argparse.Namespace) -> str:
    redis = connect(args.url)
    keys = Keys(args.prefix)
    try:
        # `list` names no tenant (its parser has neither argument)
        tenant = key_hash(args.key) if getattr(args, "key", None) else getattr(args, "tenant", "")
        if args.command == "set":
            changes = {name: getattr(args, name) for name in TenantConfig.__struct_fields__
                       if getattr(args, name) is not None}
            unset = [name for name, value in changes.items() if value == "none"]
            if unset:
                await reply(redis.hdel(keys.tenant_config(tenant), *unset))
            if kept := {k: v for k, v in changes.items() if v != "none"}:
                await reply(redis.hset(keys.tenant_config(tenant), mapping=kept))
            return msgspec.json.encode(await read_config(redis, keys, tenant)).decode()
        if args.command == "show":
            models = [m.decode() for m in await redis.zrange(keys.models(), 0, -1)]
            states = [await read_state(redis, keys, model, tenant) for model in models]
            return msgspec.json.format(msgspec.json.encode(states), indent=2).decode()
        configured = []
        async for key in redis.scan_iter(match=keys.tenant_configs(), count=1000):
            name = key.decode().removeprefix(keys.tenant_config(""))
            configured.append((name, await read_config(redis, keys, name)))
        return "\n".join(f"{name}\t{msgspec.json.encode(config).decode()}" for name, config in sorted(configured))
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    """``llmq-tenants``: set, show and list tenants' weights, limits and default SLOs."""
    from shared.config import operator_cli

    _, p = operator_cli("llmq-tenants", __doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("set", "set a tenant's weight, limits and default SLOs ('none' removes one)"),
                       ("show", "a tenant's counter, jobs, last minute's tokens and share, per model")):
        cmd = sub.add_parser(name, help=text)
        who = cmd.add_mutually_exclusive_group(required=True)
        who.add_argument("tenant", nargs="?", help=f"tenant name, or {DEFAULTS!r} for every tenant's defaults")
        who.add_argument("--key", help="name the tenant by its API key (stored as its hash)")
        if name == "set":
            cmd.add_argument("--weight", type=lambda v: v if v == "none" else str(float(v)))
            cmd.add_argument("--max-running", dest="max_running", type=_limit)
            cmd.add_argument("--max-queued", dest="max_queued", type=_limit)
            cmd.add_argument("--tokens-per-minute", dest="tokens_per_minute", type=_limit)
            cmd.add_argument("--slo-ttft-ms", dest="slo_ttft_ms", type=_slo_ms,
                             help="milliseconds to the first token, for its requests that set none")
            cmd.add_argument("--slo-tpot-ms", dest="slo_tpot_ms", type=_slo_ms,
                             help="milliseconds per token after the first, for its requests that set none")
    sub.add_parser("list", help="every tenant with settings of its own")
    args = p.parse_args(argv)
    sys.stdout.write(asyncio.run(_run(args)) + "\n")


if __name__ == "__main__":
    main()
