"""No keys, and a real browser on the same machine (docs/console.md#no-keys).

Chromium (tests/support/browser.py) against a real ``python -m api`` with no keys and no worker.
A hostile page served from 127.0.0.2 (another site) posts to llmq with `text/plain` and opens its
WebSocket; then a name that resolves to 127.0.0.1 (the end of a DNS rebinding, here by Chromium's
``--host-resolver-rules``) loads the console. Nothing gets in; llmq's own page still works.
tests/integration/test_keyless.py pins every rule header by header; this shows a browser sends
what those tests send.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.support.browser import FLAGS, chromium_or_skip
from tests.support.web_process import Api, api_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REBOUND = "rebound.example"  # resolves to 127.0.0.1 in this browser only

# What a hostile page does once loaded: queue a job with a body that needs no CORS preflight, and
# open LMTP's socket. It cannot read the POST's answer (no-cors); llmq's job list tells.
ATTACK = """
async (llmq) => {
  const posted = await fetch(llmq + "/v1/jobs", {method: "POST", mode: "no-cors", body: '{"prompt": "pwned"}'})
    .then(r => r.type, e => "network error: " + e);
  const socket = await new Promise(done => {
    const ws = new WebSocket(llmq.replace("http", "ws") + "/");
    ws.onopen = () => { ws.close(); done("open"); };
    ws.onerror = () => done("refused");
  });
  return {posted, socket};
}
"""


@contextmanager
def hostile_site() -> Iterator[str]:
    """An HTTP server on 127.0.0.2 (another site than 127.0.0.1) serving an empty page."""
    class Page(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = b"<!doctype html><title>not llmq</title>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.2", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.2:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@asynccontextmanager
async def chromium() -> AsyncIterator:
    """A page in a Chromium where ``REBOUND`` names 127.0.0.1."""
    from playwright.async_api import async_playwright

    executable = chromium_or_skip()
    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=str(executable),
                                            args=[*FLAGS, f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"])
        try:
            yield await launched.new_page()
        finally:
            await launched.close()


@pytest.fixture(scope="module")
def api(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with api_process(redis_url, tmp_path_factory.mktemp("keyless-browser") / "api.log") as a:
        yield a


def jobs(api: Api) -> list[dict]:
    return httpx.get(f"{api.url}/v1/jobs", timeout=10).json()["data"]


async def test_another_sites_page_queues_nothing_and_gets_no_socket(api: Api):
    before = jobs(api)
    with hostile_site() as site:
        async with chromium() as page:
            await page.goto(site)
            outcome = await page.evaluate(ATTACK, api.url)
    # The POST went out (an opaque answer: the browser sent it, without a preflight) and was refused.
    assert outcome == {"posted": "opaque", "socket": "refused"}
    assert jobs(api) == before


async def test_a_rebound_name_gets_403_even_same_origin(api: Api):
    before = jobs(api)
    async with chromium() as page:
        rebound = f"http://{REBOUND}:{api.port}"
        response = await page.goto(f"{rebound}/console")
        assert response is not None and response.status == 403
        # Now same-origin with llmq under its own name: it may read answers, but every one is a 403.
        statuses = await page.evaluate("""async () => [
            (await fetch("/v1/jobs")).status,
            (await fetch("/v1/jobs", {method: "POST", body: '{"prompt": "pwned"}',
                                      headers: {"Content-Type": "application/json"}})).status]""")
        assert statuses == [403, 403]
        outcome = await page.evaluate(ATTACK, rebound)
        assert outcome == {"posted": "basic", "socket": "refused"}  # same-origin: answered, with a 403
    assert jobs(api) == before


async def test_llmqs_own_page_queues_and_opens_its_socket(api: Api):
    async with chromium() as page:
        response = await page.goto(f"{api.url}/console")
        assert response is not None and response.status == 200
        outcome = await page.evaluate(ATTACK, api.url)
    assert outcome == {"posted": "basic", "socket": "open"}  # same-origin: even no-cors answers are readable
    queued = [j for j in jobs(api) if j["status"] == "queued"]
    assert queued, "the console's own page queued nothing"
    for job in queued:
        assert httpx.delete(f"{api.url}/v1/jobs/{job['id']}", timeout=10).status_code == 200
