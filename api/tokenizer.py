"""The model's tokenizer in the API process, for the few routes that need one (TGI ``/tokenize``,
``truncate``) and the special-token ids some dialects flag.

Everything loads lazily, once per process, in a thread: the API starts without importing
``transformers`` and requests that never need a tokenizer never pay for one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec

from shared.config import Settings
from shared.errors import ServiceError

__all__ = ["Encoding", "TokenizerUnavailable", "encode", "special_ids"]


class TokenizerUnavailable(ServiceError):
    status = 404
    code = "tokenizer_unavailable"


class Encoding(msgspec.Struct, frozen=True):
    ids: list[int]
    offsets: list[tuple[int, int]]
    """Character offsets of each token in the text; ``(0, 0)`` for added special tokens."""


_tokenizers: dict[str, Any] = {}
_locks: dict[str, asyncio.Lock] = {}
_special: dict[str, frozenset[int]] = {}


def _load(path: str) -> Any:
    from transformers import AutoTokenizer  # heavy: imported on first use only

    tok = AutoTokenizer.from_pretrained(path)
    if not tok.is_fast:
        raise TokenizerUnavailable("No fast tokenizer available")
    return tok


async def _tokenizer(settings: Settings) -> Any:
    path = settings.model_path
    tok = _tokenizers.get(path)
    if tok is not None:
        return tok
    async with _locks.setdefault(path, asyncio.Lock()):  # one load, however many callers wait
        if path not in _tokenizers:
            try:
                _tokenizers[path] = await asyncio.to_thread(_load, path)
            except TokenizerUnavailable:
                raise
            except Exception as exc:  # no files, no network, an unknown tokenizer class, ...
                raise TokenizerUnavailable(f"No fast tokenizer available: {type(exc).__name__}: {exc}") from None
        return _tokenizers[path]


async def encode(settings: Settings, text: str) -> Encoding:
    """Token ids (with the model's special tokens, as the engine adds them) and char offsets."""
    tok = await _tokenizer(settings)
    out = await asyncio.to_thread(tok, text, add_special_tokens=True, return_offsets_mapping=True)
    return Encoding(ids=list(out["input_ids"]), offsets=[(int(a), int(b)) for a, b in out["offset_mapping"]])


# --- special token ids, without loading the tokenizer --------------------------------------------


class _AddedToken(msgspec.Struct):
    id: int
    special: bool = False


class _TokenizerFile(msgspec.Struct):
    """Only the part of ``tokenizer.json`` we read; msgspec skips the (large) rest."""

    added_tokens: list[_AddedToken] = []


def _tokenizer_file(model_path: str) -> Path | None:
    local = Path(model_path) / "tokenizer.json"
    if local.is_file():
        return local
    try:  # a hub name: use a cached copy if there is one, never the network
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, "tokenizer.json")
    except Exception:
        return None
    return Path(cached) if isinstance(cached, str) else None


def _read_special(model_path: str) -> frozenset[int]:
    path = _tokenizer_file(model_path)
    if path is None:
        return frozenset()
    try:
        parsed = msgspec.json.decode(path.read_bytes(), type=_TokenizerFile)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return frozenset()
    return frozenset(t.id for t in parsed.added_tokens if t.special)


async def special_ids(settings: Settings) -> frozenset[int]:
    """The ids the tokenizer marks special (from ``tokenizer.json``); empty when the API cannot
    see the model's files. Read once per process."""
    path = settings.model_path
    found = _special.get(path)
    if found is None:
        found = _special[path] = await asyncio.to_thread(_read_special, path)
    return found
