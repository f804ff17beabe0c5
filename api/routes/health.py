"""Health probes.

Two kinds, for two audiences:

- **Is this model served right now?** ``GET /ping`` (LMI / SageMaker) here, and the dialects' own
  (TGI ``/health``, happy_vllm ``/readiness``, Triton ``/v2/health/ready``): healthy while a warm
  worker serves the default model. Load balancers use them to pick a deployment that can answer.
- **Is this web process up?** ``GET /livez`` (the process serves HTTP) and ``GET /readyz`` (it
  reaches Redis): what Kubernetes should probe on the web pods. Requests are queued while no worker
  is warm, so the web tier must stay in the Service while the workers are at zero or restarting.
"""

from __future__ import annotations

from typing import Literal

from litestar import Response, get

from api.http import json_response
from api.operations import JSON, documented
from api.services import Svc
from api.views import Liveness, Ping, Readiness
from shared.redis import REDIS_DOWN

__all__ = ["ping", "livez", "readyz"]


@documented("LMI health", "health", ok={200: (JSON,), 503: (JSON,)}, answer=Ping)
@get("/ping", opt={"dialect": "lmi"})
async def ping(svc: Svc) -> Response:
    ready = (await svc.models.live(fresh=True)).get(svc.model, 0)
    status: Literal["Healthy", "Unhealthy"] = "Healthy" if ready else "Unhealthy"
    return json_response(Ping(status=status, model=svc.model, ready_workers=ready), 200 if ready else 503)


@documented("Web process liveness", "health", ok={200: (JSON,)}, answer=Liveness)
@get("/livez", opt={"dialect": "jobs"})
async def livez() -> Response:
    return json_response(Liveness())


@documented("Web process readiness (Redis reachable)", "health", ok={200: (JSON,), 503: (JSON,)},
            answer=Readiness)
@get("/readyz", opt={"dialect": "jobs"})
async def readyz(svc: Svc) -> Response:
    """Ready while Redis answers: this process can queue work, warm worker or not."""
    try:
        await svc.queue.redis.ping()
    except REDIS_DOWN:
        return json_response(Readiness("unready", "unreachable"), 503)
    return json_response(Readiness("ready", "ok"))
