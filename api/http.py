"""Small HTTP helpers every route uses: typed body decoding, fire-and-poll, stream responses."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import msgspec
from litestar import Request, Response
from litestar.response import Stream

from api.services import Services
from api.submit import enqueue_detached
from shared.codec import encode
from shared.errors import InvalidRequest
from shared.schemas import GenerationRequest

__all__ = ["decode_body", "wants_async", "accepted", "stream_response", "json_response", "idempotency_key"]

T = TypeVar("T")

_decoders: dict[type, msgspec.json.Decoder] = {}

# Streams must reach the client as they are produced: no proxy buffering, no caching.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def decode_body(request: Request, kind: type[T]) -> T:
    """Validate the body against the dialect's schema; failures become InvalidRequest, which each
    dialect renders in its own error shape."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    body = await request.body()
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Malformed JSON body: {exc}") from None


def idempotency_key(request: Request) -> str | None:
    return request.headers.get("idempotency-key") or None


def wants_async(request: Request) -> bool:
    """RFC 7240 ``Prefer: respond-async``: answer 202 with a job id instead of waiting."""
    prefer = request.headers.get("prefer", "")
    return any(token.strip().lower() == "respond-async" for token in prefer.split(","))


async def accepted(svc: Services, request: Request, req: GenerationRequest) -> Response:
    job_id = await enqueue_detached(svc, req, idempotency_key(request))
    location = f"/v1/jobs/{job_id}"
    return json_response({"id": job_id, "status": "queued", "url": location}, 202, headers={"Location": location})


def json_response(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(encode(body), status_code=status, media_type="application/json", headers=headers)


def stream_response(content: AsyncIterator[bytes], media_type: str, headers: dict[str, str] | None = None) -> Stream:
    return Stream(content, media_type=media_type, headers={**STREAM_HEADERS, **(headers or {})})
