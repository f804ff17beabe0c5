"""schemathesis against the live app's own OpenAPI document (issue 4, fuzzing).

The real app serves ``GET /openapi.json`` on a real local port, with a scripted worker on real
Redis, so generation requests really run to completion. schemathesis loads that document and,
for every operation in it, sends generated requests (valid and invalid bodies, boundary values,
the ``Prefer`` / ``Idempotency-Key`` headers) and checks each answer:

- never a 5xx (``not_a_server_error``);
- never a hang: each request (a stream read to its end included) finishes within
  REQUEST_TIMEOUT_S; schemathesis's own timeout also bounds an SSE stream's total time;
- the status is one the document lists, and the media type one it lists for that status
  (``status_code_conformance``, ``content_type_conformance``): the document stays honest.
- below JSON (a test of its own, on the same live app): every operation the document lists with a
  JSON body gets malformed bytes (a BOM before the JSON, the JSON cut short, invalid UTF-8 in it,
  nesting past the depth limit) and must answer a 4xx the document lists for it, as JSON.

The app runs in a thread with its own event loop, because schemathesis's calls are blocking.
Generation is deterministic (hypothesis ``derandomize``) and bounded (MAX_EXAMPLES per operation).
"""

from __future__ import annotations

import asyncio
import codecs
import threading
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import checks as st_checks

from api.openapi import document
from shared.json_input import MAX_DEPTH
from tests.support.scripted_engine import CappedEngine
from tests.support.scripted_stack import scripted_stack

MODEL = "tiny"
MAX_EXAMPLES = 25
REQUEST_TIMEOUT_S = 10.0
TOKENIZER_LOAD_S = 60.0
STATUSES: dict[str, dict[int, int]] = {}  # per operation: status -> responses, printed at the end
SLOWEST: dict[str, float] = {}
KNOWN_JOBS: list[str] = []
# response_schema_conformance: every JSON answer, success or error, matches the Struct the
# document derives its schema from (api/openapi.py), so the document is what the wire carries.
CHECKS = [st_checks.not_a_server_error, st_checks.status_code_conformance, st_checks.content_type_conformance,
          st_checks.response_schema_conformance]
# A valid JSON body made malformed: a BOM before it, cut short, invalid UTF-8 in it, nested too deep.
BREAKERS = {
    "bom": lambda body: codecs.BOM_UTF8 + body,
    "truncated": lambda body: body[:-1],
    "invalid_utf8": lambda body: body.replace(b'"', b'"\xff', 1),
    "too_deep": lambda body: b"[" * (MAX_DEPTH + 1) + body + b"]" * (MAX_DEPTH + 1),
}


class LiveApp:
    """The scripted stack, served from a thread of its own until ``stop``."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.redis_url, self.prefix = redis_url, prefix
        self.url = ""
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="schemathesis-app", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the test thread
            self.error = exc
            self.ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with scripted_stack(self.redis_url, self.prefix, CappedEngine(delay_s=0.0)) as stack:
            self.url = stack.url
            self.ready.set()
            await self._stop.wait()

    def start(self) -> str:
        self._thread.start()
        if not self.ready.wait(30) or self.error is not None:
            raise RuntimeError(f"the app did not start: {self.error!r}")
        return self.url

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the app did not stop"
        if self.error is not None:
            raise self.error


@pytest.fixture(scope="module")
def live_url(redis_url: str) -> Iterator[str]:
    app = LiveApp(redis_url, "schemathesis")
    url = app.start()
    try:
        # The first /tokenize loads the tokenizer (imports transformers: ~8 s on a busy 2-core
        # box), once per process. Load it before timing requests, and bound that load too.
        start = time.monotonic()
        warm = httpx.post(f"{url}/tokenize", json={"inputs": "warm"}, timeout=TOKENIZER_LOAD_S)
        assert warm.status_code == 200, warm.text
        print(f"\n[schemathesis] tokenizer cold load {time.monotonic() - start:.1f}s")
        # A real job, so the job routes are fuzzed on an id that exists, not only on a 404.
        job = httpx.post(f"{url}/v1/jobs", json={"prompt": "job", "sampling": {"max_tokens": 3}}, timeout=10)
        assert job.status_code == 202, job.text
        KNOWN_JOBS.append(job.json()["id"])
        yield url
        for label, seen in sorted(STATUSES.items()):
            print(f"[schemathesis] {label}: {dict(sorted(seen.items()))} slowest {SLOWEST[label]:.2f}s")
    finally:
        app.stop()


# The document the app serves (test_the_live_app_serves_this_document checks the two are equal).
# Loaded eagerly: schemathesis's fixture-based loader does not run under pytest 9.
schema = schemathesis.openapi.from_dict(document())
# The documented examples, then generated cases (valid and invalid). The coverage phase (every
# boundary value, every undeclared method) is left out: it sends thousands of requests, too
# slow for `make test`; it found nothing when last run by hand (see the report).
schema.config.phases.update(phases=["examples", "fuzzing"])


@schema.hook
def flatmap_path_parameters(ctx, path_parameters):  # noqa: ARG001
    # Half the cases name the served model (and its one version) or a job that exists, so the
    # paths behind /predictions/{model}, /v2/models/{model}/... and /v1/jobs/{id} are reached,
    # not just their 404.
    if not isinstance(path_parameters, dict):
        return st.just(path_parameters)
    if "job_id" in path_parameters:
        return st.sampled_from([*({**path_parameters, "job_id": j} for j in KNOWN_JOBS), path_parameters])
    if "model" not in path_parameters:
        return st.just(path_parameters)
    served = {**path_parameters, "model": MODEL}
    options = [served, path_parameters]
    if "version" in served:
        options.insert(0, {**served, "version": "1"})
    return st.sampled_from(options)


def test_the_live_app_serves_this_document(live_url):
    resp = httpx.get(f"{live_url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    assert resp.json() == document()


def test_every_json_operation_answers_malformed_bytes_with_a_documented_4xx(live_url):
    """Not generated by schemathesis (it sends only what a schema describes): the document's own
    list of operations, so a route added later is covered without touching this test."""
    doc = document()
    body = msgspec.json.encode({"prompt": "hi", "inputs": "hi", "text_input": "hi", "max_tokens": 2})
    sent = 0
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if "application/json" not in op.get("requestBody", {}).get("content", {}):
                continue
            url = live_url + path.replace("{model}", MODEL).replace("{version}", "1")
            for name, breaker in BREAKERS.items():
                resp = httpx.request(method, url, content=breaker(body), headers={"content-type": "application/json"},
                                     timeout=REQUEST_TIMEOUT_S)
                sent += 1
                where = f"{method.upper()} {path} ({name}): {resp.status_code} {resp.text[:300]}"
                assert 400 <= resp.status_code < 500 and str(resp.status_code) in op["responses"], where
                assert resp.headers["content-type"].startswith("application/json") and resp.json(), where
    assert sent >= 4 * 16, sent  # every generation route, jobs and batches


@schema.parametrize()
@pytest.mark.timeout(120)  # a backstop per operation: a JSON-lines stream that never ends has no read timeout
@settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_live_app_conforms_to_its_openapi_document(case, live_url):
    start = time.monotonic()
    label = f"{case.method} {case.operation.path}"
    response = case.call(base_url=live_url, timeout=REQUEST_TIMEOUT_S)
    elapsed = time.monotonic() - start
    seen = STATUSES.setdefault(label, {})
    seen[response.status_code] = seen.get(response.status_code, 0) + 1
    SLOWEST[label] = max(SLOWEST.get(label, 0.0), elapsed)
    case.validate_response(response, checks=CHECKS)
    assert elapsed < REQUEST_TIMEOUT_S, f"{case.method} {case.formatted_path} took {elapsed:.1f}s"


async def test_the_document_is_open_when_api_keys_are_on(redis_url, prefix):
    """Like vLLM's, the document needs no key; it then marks which operations do."""
    async with scripted_stack(redis_url, prefix, api_keys="key-one") as s:
        resp = await s.client.get("/openapi.json")
        assert resp.status_code == 200
        assert resp.json() == document(keys_on=True)
        assert (await s.client.get("/v1/models")).status_code == 401  # metadata stays closed
