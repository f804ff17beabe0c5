"""A request body as a typed value: the decoding half of :func:`api.http.decode_body`, with no
HTTP in it, so a test (or any caller holding bytes) decodes exactly as a route does."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from shared import json_input
from shared.errors import InvalidRequest

__all__ = ["decode"]

T = TypeVar("T")


def decode(kind: type[T], body: bytes) -> T:
    """Validate ``body`` against the dialect's schema; failures become InvalidRequest, which each
    dialect renders in its own error shape. Any byte sequence is a 4xx here, never a 500
    (``shared.json_input``: invalid UTF-8, a BOM, an empty body, nesting too deep, ...)."""
    try:
        return json_input.decode(body, json_input.decoder_for(kind))
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Malformed JSON body: {exc}") from None
