"""Route handlers called directly, past Litestar's per-request handler machinery.

Litestar routes every request and runs the middleware (errors, request lifecycle, tracing) as
before. For each request, its handler layer then builds a kwargs model, resolves the dependencies
(``svc``, ``ctx``), validates them in a signature model, and calls the handler: about 12 % of the
API's CPU per streaming request, measured (docs/benchmarks.md, the raw ASGI path). Most
handlers take nothing but ``request``, ``svc`` and ``ctx``, whose values need no validation, so
:class:`DirectCalls`, the innermost middleware, calls those itself, doing what Litestar's
``HTTPRoute.handle`` does for them: the guards, the call, the same response conversion, closing
an upload's files. Errors are answered by Litestar's exception middleware where Litestar puts it
for a route (inside every other middleware), so they render in the route's dialect.
A handler with any other parameter (a path parameter, ``job``) goes through Litestar.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar._asgi.utils import wrap_in_exception_handler
from litestar.datastructures.multi_dicts import FormMultiDict
from litestar.handlers import HTTPRouteHandler
from litestar.types import ASGIApp, Receive, Scope, Send
from litestar.types.empty import Empty
from litestar.utils.scope.state import ScopeState

__all__ = ["DirectCalls", "DIRECT_PARAMETERS", "callable_directly"]

DIRECT_PARAMETERS = frozenset({"request", "svc", "ctx"})
"""The parameters a handler called directly may take (the app's dependencies ``svc`` and ``ctx``,
and Litestar's ``request``)."""


def callable_directly(handler: HTTPRouteHandler) -> bool:
    """Whether ``handler`` needs nothing of Litestar's handler layer but what :class:`DirectCalls`
    does: an async function of :data:`DIRECT_PARAMETERS` only, no cache, no request hooks."""
    return (set(handler.parsed_fn_signature.parameters) <= DIRECT_PARAMETERS and not handler.has_sync_callable
            and not handler.cache and handler.resolve_before_request() is None
            and handler.resolve_after_response() is None)


class DirectCalls:
    """ASGI middleware (the innermost): call a handler that :func:`callable_directly` allows.

    ``services(state)`` and ``context(scope, svc)`` are the app's ``svc`` and ``ctx`` providers,
    the same functions Litestar's dependency injection calls for every other handler."""

    def __init__(self, app: ASGIApp, services: Callable[[Any], Any], context: Callable[[Scope, Any], Any]) -> None:
        self.app, self.services, self.context = app, services, context
        self._direct: dict[HTTPRouteHandler, bool] = {}  # each route handler's answer, found once
        # As Litestar wraps each route's own handling: an error is answered right here, inside
        # every middleware, which then sees the response (its status) and not the exception.
        self._call_answering_errors = wrap_in_exception_handler(self._call)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = scope.get("route_handler")
        if scope["type"] != "http" or not isinstance(handler, HTTPRouteHandler) or not self._callable(handler):
            await self.app(scope, receive, send)
        else:
            await self._call_answering_errors(scope, receive, send)

    async def _call(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = scope["route_handler"]
        assert isinstance(handler, HTTPRouteHandler)  # __call__ sends only those here
        request = handler.resolve_request_class()(scope=scope, receive=receive, send=send)
        if handler.resolve_guards():
            await handler.authorize_connection(connection=request)
        app = scope["litestar_app"]
        takes = handler.parsed_fn_signature.parameters
        svc = self.services(app.state)
        kwargs: dict[str, Any] = {"svc": svc} if "svc" in takes else {}
        if "request" in takes:
            kwargs["request"] = request
        if "ctx" in takes:  # read from the headers only for a handler that takes it, as Litestar does
            kwargs["ctx"] = self.context(scope, svc)
        try:
            data = await handler.fn(**kwargs)
            response = await handler.to_response(app=app, data=data, request=request)
            await response(scope, receive, send)
        finally:
            if (form := ScopeState.from_scope(scope).form) is not Empty:  # an upload's spooled files
                await FormMultiDict.from_form_data(form).close()

    def _callable(self, handler: HTTPRouteHandler) -> bool:
        found = self._direct.get(handler)
        if found is None:
            found = self._direct[handler] = callable_directly(handler)
        return found
