"""JSON for everything stored in Redis, so redis-cli shows it as text.

Encoders and decoders are built once here; a typed decode doubles as validation.
"""

from __future__ import annotations

from collections.abc import Mapping

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
_JSON_FIELDS = {"request": _request_decoder, "result": _result_decoder, "error": _error_decoder}


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)


def decode_event(data: bytes | str) -> Event:
    return _event_decoder.decode(data)


def decode_request(data: bytes | str) -> GenerationRequest:
    return _request_decoder.decode(data)


def job_to_hash(record: JobRecord) -> dict[str, bytes | str]:
    """Flatten a record into hash fields: scalars as text, documents as JSON; None is omitted."""
    fields: dict[str, bytes | str] = {}
    for name in record.__struct_fields__:
        value = getattr(record, name)
        if value is None:
            continue
        if name in _JSON_FIELDS:
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
        decoder = _JSON_FIELDS.get(name)
        fields[name] = decoder.decode(value) if decoder else value.decode()
    # strict=False converts the hash's text back to ints, floats and bools.
    return msgspec.convert(fields, JobRecord, strict=False)
