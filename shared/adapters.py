"""LoRA adapters: the registry in Redis, who owns an entry, where a source may come from, and ``llmq-adapters``.

An adapter is a name requests send as their ``model``, on a base model whose workers serve it. The
registry is one hash (:meth:`shared.keys.Keys.adapters`: name -> the entry's JSON), so
``redis-cli HGETALL llmq:adapters`` shows it whole. Registering loads nothing: any worker of the base
model loads an adapter on its first job for it (workers/adapters.py), so a worker started later
needs no list, and an entry outlives every worker. Written by the API's ``/v1/load_lora_adapter``
(api/routes/adapters.py) and by ``llmq-adapters``; read by the API when it admits a request.

Each entry names its owner, the hash of the key that registered it (as a job record does); an entry
with none (``llmq-adapters``', a keyless deployment's, or one registered before owners) is the
operators'. A private entry is seen and used by its owner and operators alone.

A source is what a worker loads, so the API, ``llmq-adapters`` and the workers apply one rule to it
(:class:`Sources`): a directory that resolves, symlinks followed, under LLMQ_ADAPTER_ROOTS, or a hub
repository LLMQ_ADAPTER_HUB_ALLOW lists. Anything else gets one refusal, the same words whatever the
path, so registration tells a client nothing about the file system.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
from redis.asyncio import Redis

from shared.errors import InvalidRequest
from shared.keys import Keys
from shared.redis import reply
from shared.schemas import AdapterSpec
from shared.tenants import key_hash

if TYPE_CHECKING:
    from shared.config import Settings

__all__ = ["Adapter", "AdapterStore", "Caller", "Sources", "REFUSED", "check_name", "read_rank", "room_for",
           "new_adapter", "main"]

REFUSED = ("The lora_path is not a source this deployment allows: a directory holding adapter_config.json under "
           "LLMQ_ADAPTER_ROOTS (a tenant's key: under <root>/<its key's hash>), or a hub repository "
           "LLMQ_ADAPTER_HUB_ALLOW lists (docs/adapters.md#sources)")
"""The one answer to every source refused, whatever the reason: a path outside the roots, missing,
unreadable, not a directory, holding no config; a hub name not listed."""

_NAME = re.compile(r"[A-Za-z0-9._/-]{1,128}")
# A hub repository id as the hub takes it: org/name, each part starting and ending alphanumeric.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB = re.compile(f"{_HUB_PART}/{_HUB_PART}")
_OWNER = re.compile(r"[0-9a-f]{32}")  # a key's hash (shared/tenants.key_hash): one plain path component
MAX_ENTRIES = 256
"""The most files an adapter's directory may hold (PEFT's holds a handful): each is checked."""


class Caller(Protocol):
    """Who asks about an adapter (api/auth.py's Viewer): an operator, or the holder of one key."""

    @property
    def operator(self) -> bool: ...

    def sees(self, owner: str) -> bool:
        """Whether ``owner`` (a key's hash) is the caller's own, or the caller an operator."""
        ...


class Adapter(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One registry entry."""

    name: str
    """What requests send as ``model``; never a base model's name."""
    base: str
    """The base model's served name: its workers run the adapter, its queue holds the jobs."""
    source: str
    """What its workers load: a directory under LLMQ_ADAPTER_ROOTS, resolved (PEFT's layout:
    ``adapter_config.json`` and the weights), or a hub repository they download."""
    rank: int | None = None
    """The adapter's rank, where registration could read its config (a directory)."""
    owner: str | None = None
    """The hash of the key that registered it (api/auth.owner_of), or the key ``llmq-adapters --tenant``
    gave it to. None: the operators' (``llmq-adapters``', a keyless deployment's, or registered before
    owners). Only its owner and operators may replace or unload it."""
    private: bool = False
    """Only its owner and operators see and use it; to any other key it is a model that does not exist."""
    tenant: str | None = None
    """Before owners, the tenant it was private to: read, never written. The tenant header named it,
    so it proves nothing about a key: such an entry is private and the operators' alone."""
    created: int = 0
    """Epoch seconds of its registration."""

    def spec(self) -> AdapterSpec:
        return AdapterSpec(name=self.name, source=self.source)

    @property
    def hidden(self) -> bool:
        """Private: seen by its owner and operators only."""
        return self.private or self.tenant is not None

    def owned_by(self, who: Caller) -> bool:
        """Whether ``who`` may replace or unload it: its owner, or an operator."""
        return who.operator or (self.owner is not None and who.sees(self.owner))

    def visible_to(self, who: Caller) -> bool:
        """Whether ``who`` sees it (``/v1/models``, the console) and may use it in requests."""
        return not self.hidden or self.owned_by(who)


_decode = msgspec.json.Decoder(Adapter).decode


def check_name(name: str, models: tuple[str, ...] | list[str]) -> None:
    """A name requests may send for an adapter: 1-128 characters of ``A-Za-z0-9._/-``, no base model's."""
    if _NAME.fullmatch(name) is None:
        raise InvalidRequest("'lora_name' must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', '/' or '-'",
                             param="lora_name")
    if name in models:
        raise InvalidRequest(f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")


def refused() -> InvalidRequest:
    return InvalidRequest(REFUSED, param="lora_path")


@dataclass(frozen=True, slots=True)
class Sources:
    """Where adapters may come from: the same rule for the API, ``llmq-adapters`` and the workers."""

    roots: tuple[Path, ...]
    """LLMQ_ADAPTER_ROOTS, resolved."""
    hub: tuple[str, ...] = ()
    """LLMQ_ADAPTER_HUB_ALLOW: organisations and ``org/name`` repositories."""

    @classmethod
    def of(cls, settings: Settings) -> Sources:
        return cls(settings.adapter_root_paths, settings.adapter_hub_names)

    def place(self, source: str, *, owner: str | None = None) -> str:
        """``source`` as the registry keeps it and the workers load it, or the one refusal
        (:data:`REFUSED`) whatever is wrong:

        - a directory (absolute, or starting ``.`` or ``~``: relative to this process), resolved
          with symlinks followed, under a root, and under ``<root>/<owner>`` when ``owner`` is
          given (a tenant key's hash: a key names its own files only, not another's private
          adapter's); each file in it must resolve under a root too, so no link inside it reaches
          out. Kept as its resolved path, so a link swapped in later changes what it resolves to
          and the workers refuse it (:meth:`holds`).
        - ``org/name`` on the hub, whose organisation or repository is listed: as given."""
        local = source.startswith(("/", ".", "~"))
        placed = self._directory(source, owner) if local else source if self._listed(source) else None
        if placed is None:
            raise refused()
        return placed

    def checked(self, source: str, max_rank: int, *, owner: str | None = None) -> tuple[str, int | None]:
        """What registration keeps of ``source`` (:meth:`place`), and its rank (:func:`read_rank`)
        when it is a directory; None for a hub repository, which only its workers download."""
        placed = self.place(source, owner=owner)
        return placed, read_rank(placed, max_rank) if Path(placed).is_absolute() else None

    def holds(self, source: str) -> bool:
        """Whether a worker may load ``source`` as it is (a registry entry's, in a job): placed as
        itself, so neither a root's boundary nor a link has moved since it was registered."""
        try:
            return self.place(source) == source
        except InvalidRequest:
            return False

    def _directory(self, source: str, owner: str | None) -> str | None:
        if owner is not None and _OWNER.fullmatch(owner) is None:
            return None
        bases = self.roots if owner is None else tuple(root / owner for root in self.roots)
        try:
            path = Path(source).expanduser().resolve(strict=True)
            if not any(path.is_relative_to(base) for base in bases) or not path.is_dir():
                return None
            with os.scandir(path) as listing:  # read lazily: only as far as the limit
                entries = list(itertools.islice(listing, MAX_ENTRIES + 1))
            if len(entries) > MAX_ENTRIES or not all(self._inside(Path(e.path).resolve(strict=True)) for e in entries):
                return None
        except (OSError, RuntimeError, ValueError):  # missing, unreadable, a link loop, "~nobody", a NUL
            return None
        return str(path)

    def _inside(self, path: Path) -> bool:
        # Path.is_relative_to compares whole components: /roots/ab is not under /roots/a.
        return any(path.is_relative_to(root) for root in self.roots)

    def _listed(self, source: str) -> bool:
        if _HUB.fullmatch(source) is None or ".." in source or "--" in source:
            return False
        listed = {name.casefold() for name in self.hub}  # the hub's names ignore case
        if source.split("/")[0].casefold() not in listed and source.casefold() not in listed:
            return False
        # vLLM loads a relative path that exists where the worker runs instead of downloading it.
        return not os.path.lexists(source)


def _not_a_config() -> InvalidRequest:
    return InvalidRequest("The adapter's adapter_config.json is not a LoRA config", param="lora_path")


MAX_CONFIG_BYTES = 1 << 20
"""The most of an ``adapter_config.json`` registration reads (PEFT's is a few hundred bytes)."""


def _read_config(path: Path) -> bytes:
    """A regular file's first bytes, or OSError: opened without blocking and checked before it is
    read, so a named pipe put there cannot hang the process, nor a huge file fill its memory."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        with os.fdopen(os.dup(fd), "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError("too long for a config")
    return raw


def read_rank(directory: str, max_rank: int) -> int:
    """The rank of the LoRA adapter in ``directory`` (placed by :meth:`Sources.place`), checked
    against the engine's limit. Its errors name no path: the client knows which it sent."""
    try:
        fields = json.loads(_read_config(Path(directory) / "adapter_config.json"))
    except OSError:
        raise refused() from None
    except ValueError:
        raise _not_a_config() from None
    try:
        rank = int(fields.get("r", 0)) if isinstance(fields, dict) else 0
        kind = fields.get("peft_type", "LORA") if isinstance(fields, dict) else None
    except (ValueError, TypeError, OverflowError):  # r: a string, NaN, infinity
        raise _not_a_config() from None
    if kind != "LORA" or rank < 1:
        raise InvalidRequest(f"The adapter is not a LoRA adapter (peft_type {kind!r}, r {rank})", param="lora_path")
    if rank > max_rank:
        raise InvalidRequest(f"The adapter has rank {rank}, above this deployment's limit of {max_rank} "
                             "(LLMQ_MAX_LORA_RANK)", param="lora_path")
    return rank


def room_for(entries: Mapping[str, Adapter], owner: str | None, *, per_owner: int | None, total: int,
             adding: int = 1) -> None:
    """Raise when ``entries`` leave no room for ``adding`` more: LLMQ_ADAPTERS_MAX in all, and
    LLMQ_ADAPTERS_PER_OWNER entries owned by ``owner`` (``per_owner`` None: no such cap, an operator's)."""
    if len(entries) + adding > total:
        raise InvalidRequest("This deployment holds its most LoRA adapters (LLMQ_ADAPTERS_MAX): unload one first",
                             param="lora_name")
    if per_owner is not None and sum(e.owner == owner for e in entries.values()) + adding > per_owner:
        raise InvalidRequest("This key has registered its most LoRA adapters (LLMQ_ADAPTERS_PER_OWNER): unload "
                             "one first", param="lora_name")


class AdapterStore:
    """The registry's reads and writes (one hash)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.key = keys.adapters()

    async def add(self, adapter: Adapter, *, replace: bool, per_owner: int | None, total: int) -> bool:
        """Register ``adapter``: over an entry of its name only with ``replace`` (whose caller
        checked that entry is its to replace), else only where there is none; False when one is.
        A new name must leave room (:func:`room_for`), checked before the write and again after
        it, which is undone when it made too many: of registrations racing past a cap, each sees
        the others' writes after its own, so together they never stay over it (at worst one is
        refused that would have fitted). No WATCH: a Cluster client has no transactions."""
        if not replace:
            room_for(await self.all(), adapter.owner, per_owner=per_owner, total=total)
        value = msgspec.json.encode(adapter)
        # redis-py types a field's value as str; bytes are sent as they are (HSET takes a mapping of them).
        if replace:
            new = bool(await reply(self.redis.hset(self.key, mapping={adapter.name: value})))  # 0: it was there
        else:
            written = self.redis.hsetnx(self.key, adapter.name, value)  # type: ignore[arg-type]  # bytes, as above
            if not (new := bool(await reply(written))):
                return False
        if new:
            try:
                room_for(await self.all(), adapter.owner, per_owner=per_owner, total=total, adding=0)
            except InvalidRequest:
                if await reply(self.redis.hget(self.key, adapter.name)) == value:  # still ours: nobody replaced it
                    await reply(self.redis.hdel(self.key, adapter.name))
                raise
        return True

    async def remove(self, name: str) -> bool:
        """Remove ``name``'s entry; False when there was none. Jobs already queued keep running with
        it (each job holds its adapter's source); new requests naming it get a 404."""
        return bool(await reply(self.redis.hdel(self.key, name)))

    async def get(self, name: str) -> Adapter | None:
        raw = await reply(self.redis.hget(self.key, name))
        return None if raw is None else _decode(raw)

    async def all(self) -> dict[str, Adapter]:
        return {a.name: a for a in map(_decode, (await reply(self.redis.hgetall(self.key))).values())}


def new_adapter(name: str, base: str, source: str, *, rank: int | None, owner: str | None = None,
                private: bool = False) -> Adapter:
    return Adapter(name=name, base=base, source=source, rank=rank, owner=owner or None, private=private,
                   created=int(time.time()))


# --- llmq-adapters ---------------------------------------------------------------------------


def _owner(args: argparse.Namespace) -> str | None:
    """Whom ``--tenant`` or ``--key`` gives the adapter to: a key's hash, as llmq-tenants names a key."""
    if args.key:
        return key_hash(args.key)
    if args.tenant is not None and _OWNER.fullmatch(args.tenant) is None:
        raise SystemExit("llmq-adapters: --tenant names an API key's hash (32 hex characters, the tenant of a key "
                         "with no gateway header: GET /v1/access shows it); --key takes the key itself")
    return args.tenant


async def _run(args: argparse.Namespace, settings: Settings) -> str:
    from shared.redis import connect

    redis = connect(args.url)
    keys = Keys(args.prefix)
    store = AdapterStore(redis, keys)
    try:
        if args.command == "add":
            owner = _owner(args)
            advertised = [m.decode() for m in await redis.zrange(keys.models(), 0, -1)]
            check_name(args.name, [settings.model_name, *settings.extra_models, *advertised])
            # An operator's tool: any root, not a key's subdirectory.
            source, rank = Sources.of(settings).checked(args.source, settings.max_lora_rank)
            adapter = new_adapter(args.name, args.base or settings.model_name, source, rank=rank, owner=owner,
                                  private=owner is not None)
            if not await store.add(adapter, replace=args.replace, per_owner=None, total=settings.adapters_max):
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
    from shared.config import operator_cli

    settings, p = operator_cli("llmq-adapters", __doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="register an adapter (nothing is loaded until its first request)")
    add.add_argument("name", help="the name requests send as `model`")
    add.add_argument("source", help="the adapter's directory under LLMQ_ADAPTER_ROOTS (as the workers see it), or a "
                                    "hub repository LLMQ_ADAPTER_HUB_ALLOW lists")
    add.add_argument("--base", help=f"its base model (default: {settings.model_name})")
    to = add.add_mutually_exclusive_group()
    to.add_argument("--tenant", help="give it to one API key, by the key's hash (the key's tenant with no gateway "
                                     "header): private, seen and used by that key and operators, which may replace "
                                     "and unload it. Default: the operators' own, seen by every key")
    to.add_argument("--key", help="as --tenant, naming the key itself (only its hash is stored)")
    add.add_argument("--replace", action="store_true", help="replace an adapter of the same name")
    remove = sub.add_parser("remove", help="remove an adapter (its queued jobs still run)")
    remove.add_argument("name")
    sub.add_parser("list", help="every registered adapter, as JSON lines")
    args = p.parse_args(argv)
    try:
        out = asyncio.run(_run(args, settings))
    except InvalidRequest as exc:
        raise SystemExit(f"llmq-adapters: {exc.message}") from None
    sys.stdout.write(out + "\n")


if __name__ == "__main__":
    main()
