"""An HTTP server for a test to point a client at: a free loopback port, served from a thread of
its own until stopped (the capture server agent CLIs talk to, the OTLP receiver exporters send
to). What it answers is its handler's business."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.conftest import free_port

__all__ = ["LocalServer"]


class LocalServer:
    def __init__(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
