"""Who may call: API keys (``LLMQ_API_KEYS``), or with none, this machine's own user at its own browser.

With keys configured, every route except the health probes needs ``Authorization: Bearer <key>``
or ``x-api-key: <key>``. A job remembers a hash of the key that queued it (``JobRecord.owner``),
and only that key may read, follow or cancel it; another key gets the same 404 as a job that
does not exist, so job ids cannot be probed. Without keys owner is "".

Operator keys (``LLMQ_OPERATOR_KEYS``) are API keys too, whose holders see every job: the console
and its JSON routes show them everything (:class:`Viewer`), and only they may requeue or discard a
dead letter. With no keys of either kind, every caller is an operator, and the console's routes
answer loopback clients only (:func:`loopback`).

With no keys the loopback bind is the only check, and a browser on this machine is a loopback
caller whatever page it shows, so :class:`KeylessGuard` refuses what only another site's page
sends: a `Host` that is not this machine's (DNS rebinding), and a state-changing request or a
WebSocket upgrade from a foreign `Origin` (CSRF; a `text/plain` POST needs no CORS preflight).

The middleware (api/middleware.py) asks the app's guard, one or the other, about every request
and WebSocket upgrade. It runs after routing, so a refusal renders in the route's dialect, and an
upgrade is refused before it is accepted. (As a Litestar guard either would also cost a copy of
the route handler per request: 24 µs, measured.) The key's owner hash is part of the request's
context (:mod:`api.context`), which also checks the owner of a job named in the URL.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from shared.errors import Forbidden, ServiceError, Unauthorized
from shared.tenants import key_hash

if TYPE_CHECKING:  # annotations only: the web supervisor (api/__main__.py) imports this without Litestar
    from litestar.connection import ASGIConnection

    from shared.config import Settings

__all__ = ["OPEN_PATHS", "HEALTH_PATHS", "owner_of", "presented_key", "parse_keys", "configured_keys", "KeyGuard",
           "KeylessGuard",
           "Guard", "Viewer", "viewer", "loopback", "refuse_open_bind"]

log = structlog.get_logger()

# Health probes, called without credentials by load balancers and orchestrators. They carry no
# data, so they also answer any Host (a kubelet's probe names the pod's IP).
HEALTH_PATHS = frozenset({
    "/ping", "/health", "/liveness", "/readiness", "/v2/health/live", "/v2/health/ready", "/livez", "/readyz",
    "/v2/models/{model:str}/ready", "/v2/models/{model:str}/versions/{version:str}/ready",
})
# Open to every caller when keys are on. Metadata (/v1/models, /info, /v2, /v2/models/{m}) is not
# here: vLLM's --api-key protects /v1/models too.
OPEN_PATHS = HEALTH_PATHS | {
    "/openapi.json",  # API documentation, open as vLLM's is; it names no model or key
    "/metrics",  # Prometheus scrapes, open as vLLM's are: queue figures, no prompt or key
    # The console's page and files hold no data: the key typed into it goes with each JSON request.
    "/console", "/console/static/{file:path}",
}

# Methods a browser sends cross-site without asking (no CORS preflight) only to read; llmq's routes
# for them change nothing.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# A proxy's marks: a request carrying one was relayed, whatever its peer address says.
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")
LOOPBACK_PEERS = frozenset({"127.0.0.1", "::1"})


def owner_of(key: str) -> str:
    """What a job record stores: never the key itself, so a Redis dump leaks no credentials. The
    same hash names the key's tenant."""
    return key_hash(key)


def parse_keys(setting: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in setting.split(",") if k.strip())


def configured_keys(settings: Settings) -> tuple[str, ...]:
    """Every key that may call: LLMQ_API_KEYS and LLMQ_OPERATOR_KEYS (none: the keyless mode)."""
    return parse_keys(settings.api_keys) + parse_keys(settings.operator_keys)


def presented_key(headers) -> str | None:
    """The key a client sent: ``Authorization: Bearer <key>`` (OpenAI, TGI clients) or
    ``x-api-key`` (Anthropic-style clients)."""
    auth = headers.get("authorization") or ""
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


class KeyGuard:
    """The guard when keys are configured: every route but :data:`OPEN_PATHS` needs one."""

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

    def refusal(self, headers: Mapping[str, str], method: str | None, paths: set[str]) -> ServiceError | None:
        """The error refusing a request to a route of ``paths``, or None. ``method``: None for a
        WebSocket upgrade."""
        if method == "OPTIONS" or paths & OPEN_PATHS or self.valid(presented_key(headers)):
            return None
        return Unauthorized("Missing or invalid API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")


class KeylessGuard:
    """The guard when no keys are configured: what a page of another site makes the user's browser
    send is refused (403), since a browser on this machine is a loopback caller.

    - A `Host` other than ``allowed`` (the port ignored): after DNS rebinding, a hostile page is
      same-origin with llmq under its own name, and could read every job. Health probes answer any.
    - A method other than GET, HEAD and OPTIONS, or a WebSocket upgrade, whose `Origin` is foreign
      (``null`` included) or whose `Sec-Fetch-Site` is ``cross-site``: a form or a ``text/plain``
      fetch reaches llmq without a CORS preflight. A request without either header (curl, the
      SDKs) is not a browser's and passes."""

    def __init__(self, allowed: frozenset[str]) -> None:
        # As a request's Host is read: LLMQ_ALLOWED_HOSTS may name a port, which is ignored too.
        self.allowed = frozenset(_host_name(name) for name in allowed)

    def refusal(self, headers: Mapping[str, str], method: str | None, paths: set[str]) -> ServiceError | None:
        """As :meth:`KeyGuard.refusal`."""
        if HEALTH_PATHS.isdisjoint(paths) and _host_name(headers.get("host") or "") not in self.allowed:
            return Forbidden("With no API keys configured, llmq answers only the Host names localhost, 127.0.0.1, "
                             "[::1] and LLMQ_ALLOWED_HOSTS (docs/console.md#no-keys)")
        if method in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        if (origin is not None and not self._ours(origin)) or headers.get("sec-fetch-site") == "cross-site":
            return Forbidden("With no API keys configured, llmq refuses requests a web page of another site "
                             "sends (a foreign Origin, or Sec-Fetch-Site: cross-site) (docs/console.md#no-keys)")
        return None

    def _ours(self, origin: str) -> bool:
        """Whether an `Origin` is a page served under an allowed name (``null``, an opaque origin, is not)."""
        scheme, sep, authority = origin.strip().partition("://")
        return bool(sep) and scheme.lower() in ("http", "https") and _host_name(authority) in self.allowed


Guard = KeyGuard | KeylessGuard


def _host_name(authority: str) -> str:
    """The host of a `Host` header or an origin, lower-cased, without its port (``[::1]`` keeps
    its brackets, as LLMQ_ALLOWED_HOSTS names it)."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        end = authority.find("]") + 1
        return authority[:end] if end and authority[end:end + 1] in ("", ":") else ""  # "": no name allowed
    return authority.partition(":")[0]


def _loopback_address(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_open_bind(settings: Settings) -> None:
    """Exit (status 3, one log line) rather than serve with no keys on an address others can
    reach (LLMQ_HOST), unless LLMQ_ALLOW_OPEN says that network admits nobody else."""
    if configured_keys(settings) or settings.allow_open:
        return
    if _loopback_address(settings.host):
        return
    log.error("refusing_to_start", host=settings.host,
              reason="no API keys on an address that is not loopback: with no keys every caller may run, read and "
                     "cancel every job. Set LLMQ_API_KEYS or LLMQ_OPERATOR_KEYS, bind LLMQ_HOST=127.0.0.1, or set "
                     "LLMQ_ALLOW_OPEN=true if the network admits nobody else (docs/console.md#no-keys)")
    raise SystemExit(3)  # uvicorn's status for a server that never started: a supervisor does not retry it


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who reads the console's routes: an operator (every job), or a key's owner (its own)."""

    operator: bool
    owner: str
    """The caller's key hash ("" with no keys configured)."""

    @classmethod
    def of(cls, owner: str, operators: frozenset[str], keys_on: bool) -> Viewer:
        """The holder of the key whose hash is ``owner``: an operator when it is one of
        ``operators``; with no keys configured, every caller is one."""
        return cls(operator=not keys_on or owner in operators, owner=owner)

    @property
    def only(self) -> str | None:
        """Whose jobs a reader returns: the caller's, or None (everyone's) for an operator."""
        return None if self.operator else self.owner

    def sees(self, owner: str) -> bool:
        return self.operator or hmac.compare_digest(owner.encode(), self.owner.encode())


def loopback(connection: ASGIConnection) -> bool:
    """Whether the caller is on this machine, as far as the socket shows: its peer is 127.0.0.1 or
    ::1 (uvicorn's proxy_headers are off, so the peer is the socket's), and no proxy says it relays
    someone else's request. No peer (a Unix socket) and any other loopback address (an Istio
    sidecar connects from 127.0.0.6) count as remote. A same-host proxy that adds none of those
    headers cannot be told from a local client: any proxy in front of llmq needs keys."""
    client = connection.client
    if client is None or client.host not in LOOPBACK_PEERS:
        return False
    return not any(name in connection.headers for name in FORWARDING_HEADERS)


def viewer(connection: ASGIConnection, operators: frozenset[str], keys_on: bool) -> Viewer:
    """The caller of a console route. ``operators``: the operator keys' hashes. With no keys
    configured a loopback caller is an operator and any other is refused (403)."""
    if not keys_on:
        if not loopback(connection):
            raise Forbidden("With no API keys configured, the console and its routes answer loopback clients "
                            "only, and not through a proxy: set LLMQ_OPERATOR_KEYS (docs/console.md)")
        return Viewer.of("", operators, keys_on)
    key = presented_key(connection.headers) or ""  # the guard refused a missing or wrong one
    return Viewer.of(owner_of(key), operators, keys_on)
