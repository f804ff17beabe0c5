"""``GET /v1/usage``: the caller's own metered usage, by UTC day and model.

The caller is its tenant (shared/tenants.py): its API key, or the tenant header a trusted gateway
sets. Usage is what its jobs used when they ended: requests, prompt and generated tokens, and
engine time (start to end). Each day is kept LLMQ_USAGE_DAYS.
"""

from __future__ import annotations

import datetime

from litestar import Request, Response, get

from api.context import Ctx
from api.dialects.jobs import ErrorBody
from api.http import json_response
from api.operations import documented
from api.query import query_int
from api.services import Svc
from api.views import UsagePage
from shared.tenants import read_usage, today

__all__ = ["usage"]


@documented("The caller's own usage by UTC day and model", "jobs", errors=(400, 503), query=("days",),
            answer=UsagePage, error=ErrorBody)
@get("/v1/usage", opt={"dialect": "jobs"})
async def usage(request: Request, svc: Svc, ctx: Ctx) -> Response:
    """The last ``days`` UTC days (query; 7 unless given; today included), up to LLMQ_USAGE_DAYS."""
    kept = svc.settings.usage_days
    days = query_int(request, "days", min(7, kept), 1, kept)
    last = datetime.date.fromisoformat(today())
    dates = [(last - datetime.timedelta(days=back)).isoformat() for back in range(days - 1, -1, -1)]
    models = sorted(await svc.models.known())
    rows = await read_usage(svc.queue.redis, svc.keys, models, ctx.tenant, dates)
    return json_response(UsagePage(tenant=ctx.tenant, start_date=dates[0], end_date=dates[-1], data=rows))
