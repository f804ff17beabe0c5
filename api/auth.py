"""API keys (``LLMQ_API_KEYS``): who may submit, read and cancel jobs.

With keys configured, every route except the health probes needs ``Authorization: Bearer <key>``
or ``x-api-key: <key>``. A job remembers a hash of the key that queued it (``JobRecord.owner``),
and only that key may read, follow or cancel it; another key gets the same 404 as a job that
does not exist, so job ids cannot be probed. Without keys nothing is checked and owner is "".

Operator keys (``LLMQ_OPERATOR_KEYS``) are API keys too, whose holders see every job: the console
and its JSON routes show them everything (:class:`Viewer`), and only they may requeue or discard a
dead letter. With no keys of either kind, every caller is an operator, and the console's routes
answer loopback clients only (the API binds loopback by default; the container images do not).

The check is a Litestar guard: it runs after routing, so a 401 renders in the route's dialect.
The key's owner hash is part of the request's context (:mod:`api.context`), which also checks the
owner of a job named in the URL.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from shared.errors import Forbidden, Unauthorized
from shared.tenants import key_hash

__all__ = ["OPEN_PATHS", "owner_of", "presented_key", "parse_keys", "KeyGuard", "Viewer", "viewer", "loopback"]

# Probes a load balancer or orchestrator calls without credentials. Metadata (/v1/models, /info,
# /v2, /v2/models/{m}) is not here: vLLM's --api-key protects /v1/models too.
OPEN_PATHS = frozenset({
    "/ping", "/health", "/liveness", "/readiness", "/v2/health/live", "/v2/health/ready", "/livez", "/readyz",
    "/v2/models/{model:str}/ready", "/v2/models/{model:str}/versions/{version:str}/ready",
    "/openapi.json",  # API documentation, open as vLLM's is; it names no model or key
    "/metrics",  # Prometheus scrapes, open as vLLM's are: queue figures, no prompt or key
    # The console's page and files hold no data: the key typed into it goes with each JSON request.
    "/console", "/console/static/{file:path}",
})

def owner_of(key: str) -> str:
    """What a job record stores: never the key itself, so a Redis dump leaks no credentials. The
    same hash names the key's tenant."""
    return key_hash(key)


def parse_keys(setting: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in setting.split(",") if k.strip())


def presented_key(headers) -> str | None:
    """The key a client sent: ``Authorization: Bearer <key>`` (OpenAI, TGI clients) or
    ``x-api-key`` (Anthropic-style clients)."""
    auth = headers.get("authorization") or ""
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


class KeyGuard:
    """The app-wide guard; registered only when keys are configured."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = tuple(k.encode() for k in keys)

    def __repr__(self) -> str:
        return f"KeyGuard({len(self.keys)} keys)"  # never the keys themselves

    def valid(self, key: str | None) -> bool:
        if not key:
            return False
        given = key.encode()
        # compare_digest over every key: the time taken does not say how close a guess was.
        return any([hmac.compare_digest(given, k) for k in self.keys])

    async def __call__(self, connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        if handler.paths & OPEN_PATHS or "OPTIONS" in (getattr(handler, "http_methods", None) or ()):
            return
        if not self.valid(presented_key(connection.headers)):
            raise Unauthorized("Missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who reads the console's routes: an operator (every job), or a key's owner (its own)."""

    operator: bool
    owner: str
    """The caller's key hash ("" with no keys configured)."""

    @property
    def only(self) -> str | None:
        """Whose jobs a reader returns: the caller's, or None (everyone's) for an operator."""
        return None if self.operator else self.owner

    def sees(self, owner: str) -> bool:
        return self.operator or hmac.compare_digest(owner.encode(), self.owner.encode())


def loopback(connection: ASGIConnection) -> bool:
    client = connection.client
    if client is None:  # no peer address (a test transport): nothing to check it against
        return True
    try:
        return ipaddress.ip_address(client.host).is_loopback
    except ValueError:
        return client.host == "localhost"


def viewer(connection: ASGIConnection, operators: frozenset[str], keys_on: bool) -> Viewer:
    """The caller of a console route. ``operators``: the operator keys' hashes. With no keys
    configured a loopback caller is an operator and any other is refused (403)."""
    if not keys_on:
        if not loopback(connection):
            raise Forbidden("With no API keys configured, the console and its routes answer loopback clients "
                            "only: set LLMQ_OPERATOR_KEYS (docs/console.md)")
        return Viewer(operator=True, owner="")
    key = presented_key(connection.headers) or ""  # the guard refused a missing or wrong one
    owner = owner_of(key)
    return Viewer(operator=owner in operators, owner=owner)
