"""JSON for everything stored in Redis, so redis-cli shows it as text.

Encoders and decoders are built once here; a typed decode doubles as validation.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import msgspec

from shared.events import Event
from shared.schemas import GenerationRequest, JobError, JobRecord, JobResult

__all__ = [
    "encode",
    "decode_event",
    "decode_request",
    "job_to_hash",
    "job_from_hash",
]

_encoder = msgspec.json.Encoder()
_event_decoder = msgspec.json.Decoder(Event)
_request_decoder = msgspec.json.Decoder(GenerationRequest)
_result_decoder = msgspec.json.Decoder(JobResult)
_error_decoder = msgspec.json.Decoder(JobError)

# Job-hash fields that hold a JSON document rather than a scalar.
_JSON_FIELDS: dict[str, msgspec.json.Decoder[Any]] = {
    "request": _request_decoder, "result": _result_decoder, "error": _error_decoder}
# Job-hash fields left out while they hold their default: every reader takes a missing one for it
# (the scripts' ``or`` fallbacks, the record's own defaults), and a finished job keeps its record
# for LLMQ_RESULT_TTL_S. ``status`` and ``queued_at`` stay: operators read them with redis-cli.
_OMITTED_WHEN_DEFAULT = frozenset({"worker", "attempt", "cancel", "owner", "webhook_attempts", "preemptions",
                                   "preempted_ms", "runs", "tokens"})
_RECORD_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(JobRecord)}


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def decode_event(data: bytes | str) -> Event:
    return _event_decoder.decode(data)


def decode_request(data: bytes | str) -> GenerationRequest:
    return _request_decoder.decode(data)


@functools.cache
def _fields(cls: type[msgspec.Struct]) -> tuple[tuple[tuple[int, str, Any], ...], tuple[tuple[int, str], ...]]:
    """Where a Struct type's values may differ from their defaults only by identity (a number or
    a string default: position, name, default), and where they may hold a Struct (position, name)."""
    fields = msgspec.structs.fields(cls)
    plain = tuple((i, f.name, f.default) for i, f in enumerate(fields)
                  if type(f.default) in (int, float, str))
    nested = tuple((i, f.name) for i, f in enumerate(fields) if f.default is None or f.default is msgspec.NODEFAULT)
    return plain, nested


def canonical(obj: msgspec.Struct) -> msgspec.Struct:
    """``obj`` with each field (nested Structs' too) that equals its default holding the default
    object itself. msgspec's ``omit_defaults`` compares floats by identity, so a dialect that
    spells out every sampling value (``temperature`` 1.0, ``top_p`` 1.0, ...) would otherwise
    store them all with the job, for as long as its record lives."""
    plain, nested = _fields(type(obj))
    values = msgspec.structs.astuple(obj)
    changes: dict[str, Any] = {}
    for i, name, default in plain:
        value = values[i]
        if value is not default and type(value) is type(default) and value == default:
            changes[name] = default
    for i, name in nested:
        value = values[i]
        if isinstance(value, msgspec.Struct):
            new = canonical(value)
            if new is not value:
                changes[name] = new
    return msgspec.structs.replace(obj, **changes) if changes else obj


def job_to_hash(record: JobRecord) -> dict[str, bytes | str]:
    """Flatten a record into hash fields: scalars as text, documents as JSON (the request with
    its defaults left out, :func:`canonical`); None, and a few defaults, are omitted."""
    fields: dict[str, bytes | str] = {}
    defaults = _RECORD_DEFAULTS
    for name in record.__struct_fields__:
        value = getattr(record, name)
        if value is None or (name in _OMITTED_WHEN_DEFAULT and value == defaults[name]):
            continue
        if name == "request":
            fields[name] = encode(canonical(value))
        elif name in _JSON_FIELDS:
            fields[name] = encode(value)
        elif isinstance(value, bool):
            fields[name] = "1" if value else "0"
        else:
            fields[name] = str(value)
    return fields


def job_from_hash(raw: Mapping[bytes, bytes]) -> JobRecord:
    """Inverse of :func:`job_to_hash` for an ``HGETALL`` reply."""
    fields: dict[str, object] = {}
    for key, value in raw.items():
        name = key.decode()
        if name not in _RECORD_DEFAULTS:
            continue  # the scripts' own fields: the compact log (bytes, not text), relay, charged, ...
        decoder = _JSON_FIELDS.get(name)
        fields[name] = decoder.decode(value) if decoder else value.decode()
    # strict=False converts the hash's text back to ints, floats and bools.
    return msgspec.convert(fields, JobRecord, strict=False)
