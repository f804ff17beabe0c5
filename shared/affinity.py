"""Affinity keys: what a job shares with the jobs before it, so the worker that ran those can take it.

A job's *prefix key* names the conversation or agent loop it belongs to: turns of one conversation
share their first messages, so the worker that served the last turn holds their KV blocks in its
prefix cache. It is the client's own key where it gives one (Responses' and chat's
``prompt_cache_key``, which Codex sends, or the ``X-LLMQ-Affinity`` header), else a hash of what
stays the same from turn to turn: the system prompt, the tools and the first user message of a
chat, or the first :data:`PREFIX_CHARS` characters of a long text prompt. A short prompt gets none:
there is little to reuse. The key includes the model and adapter (a prefix cache is per adapter).

The pick (shared/lua/read.lua) leaves a job for the worker that holds its prefix key, or else its
adapter, for at most ``LLMQ_AFFINITY_MS`` (docs/adapters.md#affinity).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # shared/admission.py calls this when it makes a record
    from shared.schemas import GenerationRequest

__all__ = ["prefix_key", "PREFIX_CHARS"]

PREFIX_CHARS = 1024
"""The characters of a text prompt its key is made of; a shorter prompt gets none."""
_IDS = 256
"""The same for a prompt of token ids."""

_encode = msgspec.json.Encoder().encode


def prefix_key(req: GenerationRequest, hint: str | None = None) -> str | None:
    """``req``'s prefix key: 16 hex digits, or None when it has nothing worth keeping together."""
    if hint:
        material = b"hint\0" + hint.encode()
    elif req.messages:
        head = []
        for message in req.messages:  # the system turns, then the first user turn
            head.append(message)
            if message.role == "user":
                break
        tools = req.tools.tools if req.tools is not None else None
        material = b"chat\0" + _encode([head, tools])
    elif req.prompt is not None and len(req.prompt) >= PREFIX_CHARS:
        material = b"text\0" + req.prompt[:PREFIX_CHARS].encode()
    elif req.prompt_token_ids is not None and len(req.prompt_token_ids) >= _IDS:
        material = b"ids\0" + _encode(req.prompt_token_ids[:_IDS])
    else:
        return None
    adapter = req.adapter.name if req.adapter is not None else ""
    return hashlib.blake2b(b"\0".join((req.model.encode(), adapter.encode(), material)), digest_size=8).hexdigest()
