"""Health: ``GET /ping`` (LMI / SageMaker) answers 200 once a warm worker serves the model."""

from __future__ import annotations

from litestar import Response, get

from api.http import json_response
from api.services import Svc
from shared.queue import now_ms

__all__ = ["ping"]


@get("/ping", opt={"dialect": "lmi"})
async def ping(svc: Svc) -> Response:
    ready = await svc.queue.redis.zcount(svc.keys.workers(svc.model), now_ms(), "+inf")
    status = "Healthy" if ready else "Unhealthy"
    return json_response({"status": status, "model": svc.model, "ready_workers": ready}, 200 if ready else 503)
