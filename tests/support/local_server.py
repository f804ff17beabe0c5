"""The base of a test's HTTP receiver: a free loopback port, served from a thread of its own while
``with Receiver() as rx:`` lasts (the capture server agent CLIs talk to, the OTLP receiver
exporters send to). What it answers is its handler's business."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

from tests.conftest import free_port

__all__ = ["LocalServer"]


class LocalServer:
    url: str

    def _serve(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        """Bind the port (so ``url`` is known before the block starts) and make the thread."""
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
