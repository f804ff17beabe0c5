"""A webhook receiver on loopback for tests (tests/integration/test_webhooks.py and
test_webhook_egress.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from litestar import Litestar, Request, Response, post
from litestar.params import FromPath

from tests.conftest import free_port
from tests.support.waiting import eventually

__all__ = ["SECRET", "Receiver", "receiver"]

SECRET = "test-secret"


class Receiver:
    """Answers each hook's requests from its plan of statuses (200 once the plan runs out), or
    redirects it to the URL in ``redirects``."""

    def __init__(self) -> None:
        self.plans: dict[str, list[int]] = {}
        self.redirects: dict[str, str] = {}
        self.hits: dict[str, list[tuple[float, dict[str, str], bytes]]] = defaultdict(list)
        self.url = ""

    async def hits_of(self, name: str, count: int, timeout_s: float = 30) -> list[tuple[float, dict[str, str], bytes]]:
        """The hook's hits once there are ``count`` (or, after ``timeout_s``, as many as came)."""
        with contextlib.suppress(AssertionError):  # the caller asserts on what came
            await eventually(lambda: len(self.hits[name]) >= count, timeout_s=timeout_s)
        return self.hits[name]


@asynccontextmanager
async def receiver(certfile: Path | None = None, name: str = "127.0.0.1") -> AsyncIterator[Receiver]:
    """A receiver on loopback; with ``certfile`` (key and chain, PEM) it speaks https, and its
    ``url`` names it ``name``."""
    rx = Receiver()

    @post("/hook/{name:str}", status_code=200)
    async def hook(request: Request, name: FromPath[str]) -> Response:
        rx.hits[name].append((time.monotonic(), dict(request.headers), await request.body()))
        if name in rx.redirects:
            return Response(b"", status_code=307, headers={"Location": rx.redirects[name]})
        plan = rx.plans.get(name) or []
        return Response(b"", status_code=plan.pop(0) if plan else 200)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Litestar([hook]), host="127.0.0.1", port=port, log_level="warning",
                                           ssl_certfile=certfile))
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started, interval_s=0.02, what="the receiver to serve")
    rx.url = f"{'https' if certfile else 'http'}://{name}:{port}"
    try:
        yield rx
    finally:
        server.should_exit = True
        await task

