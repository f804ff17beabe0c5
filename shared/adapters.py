"""LoRA adapters: the registry in Redis, what registration checks, and ``llmq-adapters``.

An adapter is a name requests send as their ``model``, on a base model whose workers serve it. The
registry is one hash (:meth:`shared.keys.Keys.adapters`: name -> the entry's JSON), so
``redis-cli HGETALL llmq:adapters`` shows it whole. Registering loads nothing: any worker of the base
model loads an adapter on its first job for it (workers/adapters.py), so a worker started later
needs no list, and an entry outlives every worker. Written by the API's ``/v1/load_lora_adapter``
(api/routes/adapters.py) and by ``llmq-adapters``; read by the API when it admits a request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import msgspec
from redis.asyncio import Redis

from shared.errors import InvalidRequest
from shared.keys import Keys
from shared.schemas import AdapterSpec

__all__ = ["Adapter", "AdapterStore", "check_source", "canonical_source", "new_adapter", "main"]


class Adapter(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One registry entry."""

    name: str
    """What requests send as ``model``; never a base model's name."""
    base: str
    """The base model's served name: its workers run the adapter, its queue holds the jobs."""
    source: str
    """A directory the base model's workers can read (PEFT's layout: ``adapter_config.json`` and
    the weights), or a hub name they can download."""
    rank: int | None = None
    """The adapter's rank, where registration could read its config."""
    tenant: str | None = None
    """The only tenant that sees and uses it (``/v1/models``, requests); None: every tenant."""
    created: int = 0
    """Epoch seconds of its registration."""

    def spec(self) -> AdapterSpec:
        return AdapterSpec(name=self.name, source=self.source)

    def visible_to(self, tenant: str) -> bool:
        return self.tenant is None or self.tenant == tenant


_decode = msgspec.json.Decoder(Adapter).decode


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name too long for the filesystem, a directory we may not search: not here
        return False


def _looks_local(source: str) -> bool:
    # A hub name is "org/name" (or "name"); a directory is absolute, relative to ".", or "~/...".
    return source.startswith(("/", ".", "~")) or _exists(Path(source))


def _not_a_config(source: str) -> InvalidRequest:
    return InvalidRequest(f"The adapter_config.json at '{source}' is not a LoRA config", param="lora_path")


def check_source(source: str, max_rank: int) -> int | None:
    """What registration can check of ``source`` on this host: a directory here must hold a LoRA
    adapter's config, of a rank the engine takes. Returns that rank; None for a hub name, or a
    directory this host cannot see (the workers' may be mounted elsewhere: they check it at its first
    job, which fails cleanly if it is wrong)."""
    if not source or "\x00" in source:
        raise InvalidRequest("`lora_path` must name a directory or a hub repository", param="lora_path")
    if not _looks_local(source):
        return None
    try:
        path = Path(source).expanduser()
    except RuntimeError:  # "~user" of no such user
        return None
    if not _exists(path):
        return None
    config = path / "adapter_config.json"
    try:
        fields = json.loads(config.read_bytes())
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise InvalidRequest(f"No LoRA adapter at '{source}': it has no adapter_config.json",
                             param="lora_path") from None
    except OSError as exc:
        raise InvalidRequest(f"The adapter at '{source}' cannot be read here: {exc.strerror}",
                             param="lora_path") from None
    except ValueError:
        raise _not_a_config(source) from None
    try:
        rank = int(fields.get("r", 0)) if isinstance(fields, dict) else 0
        kind = fields.get("peft_type", "LORA") if isinstance(fields, dict) else None
    except (ValueError, TypeError, OverflowError):  # r: a string, NaN, infinity
        raise _not_a_config(source) from None
    if kind != "LORA" or rank < 1:
        raise InvalidRequest(f"The adapter at '{source}' is not a LoRA adapter (peft_type {kind!r}, r {rank})",
                             param="lora_path")
    if rank > max_rank:
        raise InvalidRequest(f"The adapter at '{source}' has rank {rank}, above this deployment's limit of "
                             f"{max_rank} (LLMQ_MAX_LORA_RANK)", param="lora_path")
    return rank


def canonical_source(source: str, rank: int | None) -> str:
    """The source as the registry keeps it: a directory this host read (``rank`` known) as its
    absolute path (the workers' view of it is assumed the same); anything else as given."""
    return str(Path(source).expanduser().resolve()) if rank is not None else source


class AdapterStore:
    """The registry's reads and writes (one hash)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.key = keys.adapters()

    async def add(self, adapter: Adapter, *, replace: bool = False) -> bool:
        """Register ``adapter``; False when its name is taken and ``replace`` is not set."""
        value = msgspec.json.encode(adapter)
        if replace:
            await self.redis.hset(self.key, adapter.name, value)
            return True
        return bool(await self.redis.hsetnx(self.key, adapter.name, value))

    async def remove(self, name: str) -> bool:
        """Remove ``name``'s entry; False when there was none. Jobs already queued keep running with
        it (each job holds its adapter's source); new requests naming it get a 404."""
        return bool(await self.redis.hdel(self.key, name))

    async def get(self, name: str) -> Adapter | None:
        raw = await self.redis.hget(self.key, name)
        return None if raw is None else _decode(raw)

    async def all(self) -> dict[str, Adapter]:
        return {a.name: a for a in map(_decode, (await self.redis.hgetall(self.key)).values())}


def new_adapter(name: str, base: str, source: str, *, rank: int | None, tenant: str | None) -> Adapter:
    return Adapter(name=name, base=base, source=source, rank=rank, tenant=tenant, created=int(time.time()))


# --- llmq-adapters ---------------------------------------------------------------------------


async def _run(args: argparse.Namespace, max_rank: int, default_base: str) -> str:
    from shared.redis import connect

    redis = connect(args.url)
    store = AdapterStore(redis, Keys(args.prefix))
    try:
        if args.command == "add":
            rank = check_source(args.source, max_rank)
            adapter = new_adapter(args.name, args.base or default_base, canonical_source(args.source, rank),
                                  rank=rank, tenant=args.tenant)
            if not await store.add(adapter, replace=args.replace):
                raise SystemExit(f"llmq-adapters: '{args.name}' is registered already (--replace replaces it)")
            return msgspec.json.encode(adapter).decode()
        if args.command == "remove":
            if not await store.remove(args.name):
                raise SystemExit(f"llmq-adapters: no adapter '{args.name}'")
            return f"removed {args.name}"
        return "\n".join(msgspec.json.encode(a).decode() for _, a in sorted((await store.all()).items()))
    finally:
        await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    """``llmq-adapters``: register, remove and list LoRA adapters."""
    from shared.config import load_settings

    settings = load_settings()
    p = argparse.ArgumentParser(prog="llmq-adapters", description=__doc__.split("\n")[0])
    p.add_argument("--url", default=settings.redis_dsn, help="Redis URL (default: LLMQ_REDIS_URL)")
    p.add_argument("--prefix", default=settings.prefix, help="key prefix (default: LLMQ_PREFIX)")
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="register an adapter (nothing is loaded until its first request)")
    add.add_argument("name", help="the name requests send as `model`")
    add.add_argument("source", help="the adapter's directory (as the workers see it) or a hub name")
    add.add_argument("--base", help=f"its base model (default: {settings.model_name})")
    add.add_argument("--tenant", help="the only tenant that may see and use it (default: every tenant)")
    add.add_argument("--replace", action="store_true", help="replace an adapter of the same name")
    remove = sub.add_parser("remove", help="remove an adapter (its queued jobs still run)")
    remove.add_argument("name")
    sub.add_parser("list", help="every registered adapter, as JSON lines")
    args = p.parse_args(argv)
    try:
        out = asyncio.run(_run(args, settings.max_lora_rank, settings.model_name))
    except InvalidRequest as exc:
        raise SystemExit(f"llmq-adapters: {exc.message}") from None
    sys.stdout.write(out + "\n")


if __name__ == "__main__":
    main()
