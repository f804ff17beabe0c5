"""JSON from clients, decoded safely: the one decode for request bodies, LMTP frames, batch-file
lines and JSON held in string fields.

msgspec alone lets some byte sequences escape as exceptions that are not its own, which would
surface as a 500 (or close an LMTP socket): invalid UTF-8 raises ``UnicodeDecodeError``, and
nesting deeper than the interpreter's stack raises ``RecursionError``. Nesting just short of
that decodes, but the job record holding it is encoded and decoded again later, at whatever
stack depth the API or a worker happens to be, and may fail there instead. So here every
failure is a ``msgspec.DecodeError`` (``msgspec.ValidationError`` for a schema mismatch, as
before), which each caller already turns into its dialect's 4xx, and nothing nested deeper
than :data:`MAX_DEPTH` gets through.

The input must be UTF-8 JSON text (RFC 8259 §8.1): a byte order mark is refused with a message
that says so, as Python's ``json``, serde_json and Starlette refuse it. Duplicate keys are
accepted and the last one wins, as in Python's ``json`` and pydantic; ``NaN``/``Infinity`` are
not JSON and are refused; a number beyond a float's range is a validation error.
"""

from __future__ import annotations

import codecs
import re
from itertools import accumulate, count
from operator import sub
from typing import Any, TypeVar

import msgspec

__all__ = ["MAX_DEPTH", "decode", "decoder_for", "loads", "nesting_depth"]

T = TypeVar("T")

MAX_DEPTH = 128
"""Arrays and objects nest at most this deep: serde_json's limit, so TGI refuses the same bodies.
A JSON Schema or template kwargs that need more are not plausible; the job record adds only a
few levels on top, far from Python's recursion limit wherever it is decoded again."""

_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}

# A JSON string, escapes included (unrolled so a long string is one fast scan).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# Keep only brackets, one kind: in valid JSON they pair up, so the kind does not change depth.
_TO_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def decoder_for(kind: Any) -> msgspec.json.Decoder[Any]:
    """One cached decoder per target type."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    return decoder


def decode(data: bytes | str, decoder: msgspec.json.Decoder[T]) -> T:
    """``decoder.decode(data)`` for untrusted input. Raises ``msgspec.ValidationError`` when the
    JSON does not fit the type and ``msgspec.DecodeError`` for anything else: empty input, a byte
    order mark, invalid UTF-8, malformed JSON, nesting deeper than MAX_DEPTH."""
    if isinstance(data, str):
        try:
            data = data.encode()
        except UnicodeEncodeError:  # lone surrogates: no UTF-8 client could have sent them
            raise msgspec.DecodeError("invalid UTF-8 (the text holds unpaired surrogates)") from None
    if not data.strip():
        raise msgspec.DecodeError("empty input, expected a JSON document")
    if data.startswith(codecs.BOM_UTF8):
        raise msgspec.DecodeError("the input starts with a UTF-8 byte order mark (BOM); JSON must not (RFC 8259 "
                                  "section 8.1): send it without one")
    if not data.isascii():  # the ASCII check is one fast scan; most bodies stop here
        try:
            data.decode()
        except UnicodeDecodeError as exc:
            raise msgspec.DecodeError(
                f"invalid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}: {exc.reason})") from None
    try:
        value = decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    # A body cannot nest deeper than it opens: counting first keeps nearly every body off the
    # exact check.
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH and nesting_depth(data) > MAX_DEPTH:
        raise msgspec.DecodeError(f"JSON nested deeper than {MAX_DEPTH} levels")
    return value


def loads(data: bytes | str) -> Any:
    """Any JSON value, for ``json.loads``'s callers: also raises a ValueError (msgspec's), but
    refuses NaN, lone surrogates and deep nesting, which ``json.loads`` lets through."""
    return decode(data, decoder_for(Any))


def nesting_depth(data: bytes) -> int:
    """How deep the arrays and objects of valid JSON ``data`` nest (0 for a scalar).

    Linear and done in C (a regex, a translate, a split, and iterators; no Python loop per
    byte): the worst 10 MB bodies measured took 0.2-0.4 s here (msgspec's own decode of the same
    bodies: 0.01-2 s), and :func:`decode` skips it for any body with fewer brackets than the limit.
    Strings go first (they may hold brackets); then the depth before each closing bracket is
    the opens so far minus the closes before it."""
    brackets = _STRING.sub(b"", data).translate(_TO_SQUARE, _NOT_BRACKETS)
    if not brackets:
        return 0
    # Segment i (from 0) ends at closing bracket i: the depth there is the opens in segments
    # 0..i minus the i closes before it.
    return max(map(sub, accumulate(map(len, brackets.split(b"]"))), count()))
