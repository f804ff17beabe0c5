"""``/console``: the web console's page and its files (docs/console.md), served as they are.

The console is a small static app (api/console/static/: HTML, CSS and JavaScript modules, no
build step and nothing fetched from elsewhere) that reads the JSON routes of
api/routes/overview.py and the job routes, with the key typed into it. The page and its files hold
no data, so they need no key; with no keys configured they answer loopback clients only, as the
console's routes do. Off with ``LLMQ_CONSOLE=false``.
"""

from __future__ import annotations

import functools
from importlib import resources

from litestar import Request, Response, get
from litestar.params import FromPath

from api.auth import viewer
from api.dialects.jobs import ErrorBody
from api.operations import documented
from api.services import Svc
from shared.errors import HttpError

__all__ = ["ROUTES"]

_OPT = {"dialect": "jobs"}
_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}
# Everything from this origin only: a page that loads nothing from elsewhere works offline, and
# a value from the server shown in it cannot pull in a script.
_HEADERS = {"content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            "x-content-type-options": "nosniff", "cache-control": "no-cache", "referrer-policy": "no-referrer"}


@functools.cache
def _files() -> dict[str, tuple[bytes, str]]:
    """Every file of the app by its path under static/ (read once): the only names served, so a
    path never reaches the file system."""
    root = resources.files("api").joinpath("console", "static")
    found: dict[str, tuple[bytes, str]] = {}

    def walk(folder, prefix: str) -> None:
        for item in folder.iterdir():
            name = prefix + item.name
            if item.is_dir():
                walk(item, name + "/")
            elif (suffix := "." + item.name.rpartition(".")[2]) in _TYPES:
                found[name] = (item.read_bytes(), _TYPES[suffix])
    walk(root, "")
    return found


def _serve(request: Request, svc: Svc, name: str) -> Response:
    viewer(request, svc.operators, svc.keys_on)  # no keys: loopback only
    if (found := _files().get(name)) is None:
        raise HttpError(f"no console file {name}", status=404)
    body, media_type = found
    return Response(body, media_type=media_type, headers=_HEADERS)


@documented("The web console", "console", ok={200: ("text/html",)}, errors=(403,), error=ErrorBody)
@get("/console", opt=_OPT)
async def page(request: Request, svc: Svc) -> Response:
    return _serve(request, svc, "index.html")


@documented("The web console's files", "console",
            ok={200: ("text/html", "text/css", "text/javascript", "image/svg+xml", "image/png")}, errors=(403, 404),
            error=ErrorBody)
@get("/console/static/{file:path}", opt=_OPT)
async def static(request: Request, svc: Svc, file: FromPath[str]) -> Response:
    return _serve(request, svc, file.lstrip("/"))


ROUTES = [page, static]
