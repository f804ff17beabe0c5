"""No keys configured, and a browser on the same machine (issue 41; docs/console.md#no-keys).

A real ``python -m api`` with neither LLMQ_API_KEYS nor LLMQ_OPERATOR_KEYS, on a free loopback
port and real Redis, no worker (a 403 needs none; an allowed submission is seen queued: 202).
Every request is what a hostile page makes the user's browser send: a rebound `Host`, a
cross-site `text/plain` POST (no CORS preflight), a WebSocket upgrade from another `Origin`;
and what a proxy in front changes: forwarding headers, another loopback peer. Then the start-up
refusal on an address that is not loopback.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from api import dialects
from shared.errors import Forbidden
from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from tests.support.web_process import MODEL, Api, api_env, api_process, stop

JOB = "0123456789abcdef0123456789abcdef"  # any job id: a refusal comes before the job is looked up
EXTRA_HOST = "llmq.test"  # LLMQ_ALLOWED_HOSTS of the module's API
HOSTILE = "http://evil.example"


@pytest.fixture(scope="module")
def api(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    with api_process(redis_url, tmp_path_factory.mktemp("keyless") / "api.log", LLMQ_ALLOWED_HOSTS=EXTRA_HOST) as a:
        yield a


@pytest.fixture(scope="module")
def client(api: Api) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api.url, timeout=10) as c:
        yield c


def browser(api: Api, origin: str | None = HOSTILE, site: str | None = "cross-site", host: str | None = None,
            ) -> dict[str, str]:
    """The headers a browser sends with a page's `fetch(url, {method: "POST", body})`: no preflight
    for `text/plain`."""
    headers = {"Host": host or f"127.0.0.1:{api.port}", "Content-Type": "text/plain;charset=UTF-8"}
    if origin is not None:
        headers["Origin"] = origin
    if site is not None:
        headers["Sec-Fetch-Site"] = site
    return headers


# --- the error each dialect answers a refusal with ----------------------------------------

def jobs_forbidden(b: dict) -> bool:
    return set(b) == {"error"} and b["error"]["code"] == "forbidden" and b["error"]["status"] == 403


def openai_forbidden(b: dict) -> bool:
    # The type is the dialect's (api/dialects/openai_completions.py); the code is vLLM's: the status.
    return set(b) == {"error"} and set(b["error"]) == {"message", "type", "param", "code"} and b["error"]["code"] == 403


def anthropic_forbidden(b: dict) -> bool:
    return b["type"] == "error" and b["error"]["type"] == "permission_error"


def responses_forbidden(b: dict) -> bool:
    return set(b) == {"error"} and b["error"]["code"] == "forbidden"


def lmi_forbidden(b: dict) -> bool:
    return b == {"code": 403, "type": "forbidden", "message": b["message"]}


def tgi_forbidden(b: dict) -> bool:
    return b["error_type"] == "forbidden"


def happy_vllm_forbidden(b: dict) -> bool:
    return set(b) == {"detail"}


# Routes that change something, one or more per dialect: (method, path, body, check of the 403's body).
CHANGES: list[tuple[str, str, dict[str, Any] | None, Callable[[dict], bool]]] = [
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, openai_forbidden),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
     openai_forbidden),
    ("POST", "/v1/responses", {"model": MODEL, "input": "x"}, responses_forbidden),
    ("POST", "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
     anthropic_forbidden),
    ("POST", "/invocations", {"inputs": "x"}, lmi_forbidden),
    ("POST", f"/predictions/{MODEL}", {"inputs": "x"}, lmi_forbidden),
    ("POST", "/generate", {"inputs": "x"}, tgi_forbidden),
    ("POST", "/", {"inputs": "x"}, tgi_forbidden),
    ("POST", "/v1/generate", {"prompt": "x"}, happy_vllm_forbidden),
    ("POST", "/v1/jobs", {"prompt": "x"}, jobs_forbidden),
    ("DELETE", f"/v1/jobs/{JOB}", None, jobs_forbidden),
    ("POST", f"/v1/dead_letters/{JOB}/requeue", None, jobs_forbidden),
    ("DELETE", f"/v1/dead_letters/{JOB}", None, jobs_forbidden),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "/tmp"}, openai_forbidden),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "evil"}, openai_forbidden),
    ("POST", "/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                             "completion_window": "24h"}, openai_forbidden),
    ("POST", "/v1/batches/batch_x/cancel", None, openai_forbidden),
    ("POST", "/v1/files", {"purpose": "batch"}, openai_forbidden),
    ("DELETE", "/v1/files/file-x", None, openai_forbidden),
    ("POST", "/v1/messages/batches", {"requests": []}, anthropic_forbidden),
    ("DELETE", "/v1/messages/batches/msgbatch_x", None, anthropic_forbidden),
    ("POST", "/v1/responses/resp_x/cancel", None, responses_forbidden),
    ("DELETE", "/v1/responses/resp_x", None, responses_forbidden),
]


def _message(body: dict) -> str:
    return json.dumps(body)


def _listed(client: httpx.Client) -> set[str]:
    listed = client.get("/v1/jobs", params={"limit": 500})
    assert listed.status_code == 200, listed.text
    return {job["id"] for job in listed.json()["data"]}


@contextmanager
def nothing_queued(client: httpx.Client) -> Iterator[None]:
    """The block queues no job (the recent-jobs list the console shows stays as it was)."""
    before = _listed(client)
    yield
    assert _listed(client) == before


# --- Host ---------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io",
                                  "[::1].evil.example", "10.0.0.7:{port}", "", "localhost."])
def test_a_host_that_is_not_this_machines_is_refused(api: Api, client: httpx.Client, host: str):
    host = host.format(port=api.port)
    for path, check in (("/v1/jobs", jobs_forbidden), ("/v1/models", openai_forbidden), ("/console", jobs_forbidden),
                        ("/console/static/app.js", jobs_forbidden), ("/metrics", None), ("/openapi.json", None),
                        ("/v1/deployment", jobs_forbidden), (f"/v1/jobs/{JOB}/record", jobs_forbidden)):
        resp = client.get(path, headers={"Host": host})
        assert resp.status_code == 403, (host, path, resp.text)
        assert check is None or check(resp.json()), (path, resp.text)
        assert "LLMQ_ALLOWED_HOSTS" in resp.text
    # What it says names no client input: the Host it refused is not echoed.
    if host:
        assert host not in client.get("/v1/jobs", headers={"Host": host}).text


@pytest.mark.parametrize("host", ["localhost:{port}", "LOCALHOST", "127.0.0.1", "127.0.0.1:{port}", "[::1]:{port}",
                                  "[::1]", f"{EXTRA_HOST}:443", EXTRA_HOST.upper()])
def test_this_machines_names_and_the_allowed_hosts_are_served(api: Api, client: httpx.Client, host: str):
    resp = client.get("/v1/jobs", headers={"Host": host.format(port=api.port)})
    assert resp.status_code == 200, resp.text
    assert client.get("/console", headers={"Host": host.format(port=api.port)}).status_code == 200


def test_the_health_probes_answer_any_host(client: httpx.Client):
    # A kubelet's probe names the pod's address; the probes carry no data.
    kubelet = {"Host": "10.244.1.7:8080"}
    assert client.get("/livez", headers=kubelet).status_code == 200
    assert client.get("/readyz", headers=kubelet).json() == {"status": "ready", "redis": "ok"}
    # No warm worker: each dialect's "not ready" (Triton's is a 400), never a 403.
    for path, status in (("/ping", 503), ("/health", 503), ("/readiness", 200), ("/v2/health/ready", 400),
                         (f"/v2/models/{MODEL}/ready", 400), (f"/v2/models/{MODEL}/versions/1/ready", 400),
                         ("/v2/health/live", 200), ("/liveness", 200)):
        assert client.get(path, headers=kubelet).status_code == status, path


def test_a_rebound_host_cannot_submit_either(api: Api, client: httpx.Client):
    # After DNS rebinding the page is same-origin under its own name: Origin and Host agree.
    with nothing_queued(client):
        resp = client.post("/v1/completions", content=_message({"prompt": "x"}),
                           headers=browser(api, origin="http://evil.example:8080", site="same-origin",
                                           host="evil.example:8080"))
    assert resp.status_code == 403 and openai_forbidden(resp.json()), resp.text


# --- Origin and Sec-Fetch-Site --------------------------------------------------------------

@pytest.mark.parametrize(("method", "path", "body", "check"), CHANGES, ids=[f"{c[0]} {c[1]}" for c in CHANGES])
def test_a_cross_site_text_plain_request_is_refused_in_the_routes_dialect(api, client, method, path, body, check):
    with nothing_queued(client):
        resp = client.request(method, path, content=_message(body) if body is not None else None,
                              headers=browser(api))
    assert resp.status_code == 403, resp.text
    assert check(resp.json()), resp.text
    assert "another site" in resp.text


def test_a_cross_site_triton_request_is_refused_in_its_dialect(api, client):
    with nothing_queued(client):
        resp = client.post(f"/v2/models/{MODEL}/generate", content=_message({"text_input": "x"}), headers=browser(api))
    # Triton's statuses are few (api/dialects/triton.py): the one it gives a 403 is the dialect's.
    status, body = dialects.error_body("triton", Forbidden("x"))
    assert resp.status_code == status and set(resp.json()) == set(msgspec.to_builtins(body)) == {"error"}
    assert "another site" in resp.json()["error"]


@pytest.mark.parametrize(("origin", "site"), [
    (HOSTILE, None),  # an older browser: Origin only
    ("null", None),  # a sandboxed iframe, a data: URL, a redirect's opaque origin
    (None, "cross-site"),
    ("http://localhost.evil.example", "cross-site"),
    ("http://127.0.0.1.evil.example:{port}", None),
    ("file://", None),
    ("chrome-extension://abcdefghijklmnop", None),
    ("ws://127.0.0.1:{port}", None),  # not a page's scheme
    ("http://[::1].evil.example", None),
    ("http://localhost:{port}", "cross-site"),  # the browser says cross-site: believed
])
def test_a_foreign_origin_or_a_cross_site_fetch_is_refused(api, client, origin, site):
    origin = origin.format(port=api.port) if origin else origin
    with nothing_queued(client):
        resp = client.post("/v1/jobs", content=_message({"prompt": "x"}), headers=browser(api, origin, site))
    assert resp.status_code == 403 and jobs_forbidden(resp.json()), resp.text


def test_a_cross_site_read_is_answered(api, client):
    # GET, HEAD and OPTIONS change nothing; without CORS headers the page cannot read the answer.
    resp = client.get("/v1/jobs", headers=browser(api))
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
    preflight = client.options("/v1/jobs", headers={**browser(api), "Access-Control-Request-Method": "DELETE"})
    assert preflight.status_code == 204 and "access-control-allow-origin" not in preflight.headers


@pytest.mark.parametrize(("origin", "site"), [
    (None, None),  # curl, the SDKs: no browser's headers
    ("http://localhost:{port}", "same-origin"),  # the console itself
    ("http://127.0.0.1:{port}", "same-origin"),
    ("http://[::1]:{port}", "same-origin"),
    ("https://LOCALHOST", "same-site"),  # another local port: the issue ignores the port
    (f"http://{EXTRA_HOST}", None),
])
def test_this_machines_pages_and_clients_without_an_origin_submit(api, client, origin, site):
    origin = origin.format(port=api.port) if origin else origin
    headers = {**browser(api, origin, site), "Content-Type": "application/json", "Prefer": "respond-async"}
    resp = client.post("/v1/completions", content=_message({"model": MODEL, "prompt": "x", "max_tokens": 2}),
                       headers=headers)
    assert resp.status_code == 202, resp.text
    job = resp.headers["location"].rsplit("/", 1)[1]
    cancel = client.delete(f"/v1/jobs/{job}", headers=browser(api, origin, site))
    assert cancel.status_code == 200, cancel.text


# --- WebSocket (LMTP at /) ------------------------------------------------------------------

def _upgrade(api: Api, origin: str | None, host: str | None = None) -> None:
    """An LMTP upgrade, over a socket to the API's loopback port whatever ``host`` names."""
    sock = socket.create_connection(("127.0.0.1", api.port), timeout=10)
    with ws_connect(f"ws://{host or f'127.0.0.1:{api.port}'}/", sock=sock, origin=origin, open_timeout=10) as ws:
        ws.send(json.dumps({"type": "MODEL_INFO"}))  # any frame: the session is live


@pytest.mark.parametrize(("origin", "host"), [
    (HOSTILE, None), ("null", None), ("http://localhost.evil.example", None), (None, "evil.example:{port}"),
    ("http://evil.example:{port}", "evil.example:{port}"),  # rebound: same-origin under the attacker's name
])
def test_a_websocket_upgrade_from_another_site_is_refused_before_it_is_accepted(api, origin, host):
    with pytest.raises(InvalidStatus) as refused:
        _upgrade(api, origin.format(port=api.port) if origin else None, host.format(port=api.port) if host else None)
    response = refused.value.response
    assert response.status_code == 403  # an HTTP answer to the upgrade: never accepted
    body = json.loads(response.body)
    assert set(body) == {"error"} and "With no API keys configured" in body["error"]  # LMTP's error object


@pytest.mark.parametrize("origin", [None, "http://localhost:{port}", "http://127.0.0.1:{port}"])
def test_a_websocket_upgrade_from_this_machines_page_or_a_client_is_accepted(api, origin):
    _upgrade(api, origin.format(port=api.port) if origin else None)


# --- loopback: the peer, not what a proxy says --------------------------------------------

@pytest.mark.parametrize("header", [{"X-Forwarded-For": "127.0.0.1"}, {"X-Forwarded-For": "203.0.113.7"},
                                    {"Forwarded": "for=127.0.0.1"}, {"X-Real-IP": "127.0.0.1"}])
def test_a_request_a_proxy_relayed_is_remote_for_the_console(client: httpx.Client, header: dict[str, str]):
    for path in ("/v1/jobs", "/v1/access", "/console", f"/v1/jobs/{JOB}/record"):
        resp = client.get(path, headers=header)
        assert resp.status_code == 403 and jobs_forbidden(resp.json()), (path, resp.text)
        assert "loopback" in resp.text and "proxy" in resp.text
    assert client.get("/v1/jobs").status_code == 200  # the same caller without the header


def test_a_caller_from_another_loopback_address_is_remote_for_the_console(api: Api):
    # An Istio sidecar relays from 127.0.0.6: 127/8 is not the caller's own machine, only 127.0.0.1 and ::1 are.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=api.url, transport=transport, timeout=10) as other:
        for path in ("/v1/jobs", "/console", "/v1/dead_letters"):
            resp = other.get(path)
            assert resp.status_code == 403 and jobs_forbidden(resp.json()), (path, resp.text)
        # The console's rule only: submitting stays open, as it is to any caller with no keys.
        queued = other.post("/v1/jobs", json={"prompt": "x"})
        assert queued.status_code == 202, queued.text
        assert other.delete(f"/v1/jobs/{queued.json()['id']}").status_code == 200


def test_an_ipv6_loopback_caller_is_local(redis_url, tmp_path):
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
    with api_process(redis_url, tmp_path / "api.log", LLMQ_HOST="::1") as api:
        assert httpx.get(f"{api.url}/v1/jobs", timeout=10).status_code == 200  # Host: [::1]:port, peer ::1
        assert httpx.get(f"{api.url}/console", timeout=10).status_code == 200


# --- start-up ---------------------------------------------------------------------------------

def _refused_to_start(redis_url: str, log: Path, command: tuple[str, ...], **settings: str) -> str:
    proc = spawn_logged([sys.executable, *command], log, cwd=REPO, start_new_session=True,
                        env=api_env(redis_url, free_port(), **settings))
    try:
        code = proc.wait(60)
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    assert code != 0, text
    return text


@pytest.mark.parametrize("processes", ["1", "2"])
def test_with_no_keys_the_web_refuses_to_start_on_an_address_that_is_not_loopback(redis_url, tmp_path, processes):
    text = _refused_to_start(redis_url, tmp_path / "api.log", ("-m", "api"), LLMQ_HOST="0.0.0.0",
                             LLMQ_WEB_PROCESSES=processes)
    [line] = [json.loads(line) for line in text.splitlines() if "refusing_to_start" in line]
    assert line["level"] == "error" and line["host"] == "0.0.0.0"
    assert "LLMQ_ALLOW_OPEN" in line["reason"] and "LLMQ_API_KEYS" in line["reason"]
    assert "web_processes_started" not in text  # refused before binding anything


def test_the_uvicorn_factory_refuses_too(redis_url, tmp_path):
    text = _refused_to_start(redis_url, tmp_path / "api.log",
                             ("-m", "uvicorn", "--factory", "api.app:create_app", "--port", "0"),
                             LLMQ_HOST="0.0.0.0")
    assert "refusing_to_start" in text and "LLMQ_ALLOW_OPEN" in text


@pytest.mark.parametrize("opened", [{"LLMQ_ALLOW_OPEN": "true"}, {"LLMQ_API_KEYS": "key-one"},
                                    {"LLMQ_OPERATOR_KEYS": "op-key"}], ids=["allow-open", "api-keys", "operator-keys"])
def test_keys_or_allow_open_let_it_start_on_any_address(redis_url, tmp_path, opened):
    # Bound to every address; reached on loopback only.
    with api_process(redis_url, tmp_path / "api.log", LLMQ_HOST="0.0.0.0", **opened) as api:
        resp = httpx.get(f"{api.url}/v1/jobs", headers={"Host": "evil.example"}, timeout=10)
        # Open on purpose still keeps a browser's rules; keys replace them.
        assert resp.status_code == (403 if "LLMQ_ALLOW_OPEN" in opened else 401), resp.text


def test_supervised_web_processes_keep_the_rules(redis_url, tmp_path):
    # LLMQ_WEB_PROCESSES=2: each child builds its own uvicorn server and app; the same options and guard.
    with api_process(redis_url, tmp_path / "api.log", LLMQ_WEB_PROCESSES="2") as api, \
            httpx.Client(base_url=api.url, timeout=10) as client, nothing_queued(client):
        for _ in range(4):  # new connections: spread over both children
            with httpx.Client(base_url=api.url, timeout=10) as fresh:
                assert fresh.get("/v1/jobs").status_code == 200
                assert fresh.get("/v1/jobs", headers={"X-Forwarded-For": "127.0.0.1"}).status_code == 403
                assert fresh.get("/v1/jobs", headers={"Host": "evil.example"}).status_code == 403
                refused = fresh.post("/v1/jobs", content=_message({"prompt": "x"}), headers=browser(api))
                assert refused.status_code == 403 and jobs_forbidden(refused.json())
