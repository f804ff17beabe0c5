"""Handlers of ``request``, ``svc`` and ``ctx`` only are called by api/direct.py, past Litestar's
kwargs model and dependency injection; the rest go through Litestar. Both answer the same: the
real app on a real port, a scripted worker, real Redis. (Guards, body limits and every dialect's
errors through the direct path: tests/integration/test_security.py, test_malformed_input.py.)"""

from __future__ import annotations

import pytest
from litestar.routes.http import HTTPRoute

from api.app import create_app
from api.direct import callable_directly
from tests.support.scripted_stack import scripted_settings, scripted_stack


@pytest.fixture
def through_litestar(monkeypatch) -> list[str]:
    """The paths whose handler Litestar's own handler layer called."""
    called: list[str] = []
    original = HTTPRoute._call_handler_function

    async def counted(self, scope, request, parameter_model, route_handler):
        called.append(scope["path"])
        return await original(self, scope, request, parameter_model, route_handler)

    monkeypatch.setattr(HTTPRoute, "_call_handler_function", counted)
    return called


async def test_generation_routes_are_called_directly_and_job_routes_through_litestar(
        redis_url, prefix, through_litestar):
    async with scripted_stack(redis_url, prefix) as s:
        resp = await s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
        assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        job_id = resp.text.split('"id":"cmpl-', 1)[1].split('"', 1)[0]
        resp = await s.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hey"}],
                                                                    "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hey"
        resp = await s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": "two"})
        assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
        assert through_litestar == []
        assert (await s.client.get(f"/v1/jobs/{job_id}")).json()["status"] == "done"
        assert through_litestar == [f"/v1/jobs/{job_id}"]


def test_which_handlers_are_called_directly(redis_url, prefix):
    app = create_app(scripted_settings(redis_url, prefix))
    direct = {(method, path) for route in app.routes for handler in getattr(route, "route_handlers", ())
              for method in handler.http_methods for path in handler.paths if callable_directly(handler)}
    for generation in ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses", "/generate",
                       "/generate_stream", "/invocations", "/v1/generate", "/v1/generate_stream", "/v1/jobs"):
        assert ("POST", generation) in direct
    # A path parameter, the ``job`` dependency, Litestar's ``scope``: Litestar's own layer.
    for other in (("POST", "/predictions/{model:str}"), ("GET", "/v1/jobs/{job_id:str}"),
                  ("POST", "/v2/models/{model:str}/generate"), ("OPTIONS", "/v1/completions")):
        assert other not in direct
