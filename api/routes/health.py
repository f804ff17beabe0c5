"""Health: ``GET /ping`` (LMI / SageMaker) answers 200 once a warm worker serves the default model."""

from __future__ import annotations

from litestar import Response, get

from api.http import json_response
from api.services import Svc

__all__ = ["ping"]


@get("/ping", opt={"dialect": "lmi"})
async def ping(svc: Svc) -> Response:
    ready = (await svc.models.live(fresh=True)).get(svc.model, 0)
    status = "Healthy" if ready else "Unhealthy"
    return json_response({"status": status, "model": svc.model, "ready_workers": ready}, 200 if ready else 503)
