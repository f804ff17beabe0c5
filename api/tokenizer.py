"""The model's tokenizer in the API process, for the few routes that need one (TGI ``/tokenize``,
``truncate``, Anthropic's ``count_tokens``) and the special-token ids some dialects flag.

Everything loads lazily, once per :class:`Tokenizer` (one in the API's services), in a thread:
the API starts without importing ``transformers`` and requests that never need a tokenizer never
pay for one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec

from shared.chat_template import chat_token_ids
from shared.errors import TokenizerUnavailable
from shared.schemas import ChatMessage, ChatOptions, ToolUse

__all__ = ["Encoding", "Tokenizer"]


class Encoding(msgspec.Struct, frozen=True):
    ids: list[int]
    offsets: list[tuple[int, int]]
    """Character offsets of each token in the text; ``(0, 0)`` for added special tokens."""


def _load(path: str) -> Any:
    from transformers import AutoTokenizer  # heavy: imported on first use only

    tok = AutoTokenizer.from_pretrained(path)
    if not tok.is_fast:
        raise TokenizerUnavailable("No fast tokenizer available")
    return tok


class Tokenizer:
    """The served model's tokenizer, owned by the API's services (one per process)."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self._tok: Any = None
        self._lock = asyncio.Lock()
        self._special: frozenset[int] | None = None

    async def _tokenizer(self) -> Any:
        if self._tok is None:
            async with self._lock:  # one load, however many callers wait
                if self._tok is None:
                    try:
                        self._tok = await asyncio.to_thread(_load, self.model_path)
                    except TokenizerUnavailable:
                        raise
                    except Exception as exc:  # no files, no network, an unknown tokenizer class, ...
                        raise TokenizerUnavailable(
                            f"No fast tokenizer available: {type(exc).__name__}: {exc}") from None
        return self._tok

    async def encode(self, text: str) -> Encoding:
        """Token ids (with the model's special tokens, as the engine adds them) and char offsets."""
        tok = await self._tokenizer()
        out = await asyncio.to_thread(tok, text, add_special_tokens=True, return_offsets_mapping=True)
        return Encoding(ids=list(out["input_ids"]), offsets=[(int(a), int(b)) for a, b in out["offset_mapping"]])

    async def chat_ids(self, messages: list[ChatMessage], options: ChatOptions,
                       tools: ToolUse | None = None) -> list[int]:
        """A chat's prompt ids, rendered exactly as the worker renders it for the engine."""
        tok = await self._tokenizer()
        return await asyncio.to_thread(chat_token_ids, tok, messages, options, tools)

    async def special_ids(self) -> frozenset[int]:
        """The ids the tokenizer marks special (from ``tokenizer.json``); empty when the API cannot
        see the model's files. Read once, without loading the tokenizer."""
        if self._special is None:
            self._special = await asyncio.to_thread(_read_special, self.model_path)
        return self._special


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
