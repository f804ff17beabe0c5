"""Tracing in process: the API's request span, the worker's spans and the engine's trace headers
form one trace, with the right parents and attributes and no prompt text; with tracing off no
record carries trace context and the API never imports OpenTelemetry.

Spans go to the SDK's in-memory exporter (the processes' OTLP export is tests/e2e/test_tracing.py,
on real vLLM). The scripted engine records the ``trace_headers`` each job's engine request got.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, format_span_id, format_trace_id

from shared.otel_env import tracing_enabled
from shared.tracing import Tracing, parent_context
from tests.support import inprocess_workers
from tests.support.inprocess_workers import MODEL, Client, kill, running_on
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually
from workers.environment import apply_tracing_environment

make_worker = inprocess_workers.make_worker

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = "zebra-quartz-prompt"  # distinctive: must appear in no span


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exported: InMemorySpanExporter) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    return Tracing(provider)


async def spans_when(exported: InMemorySpanExporter, done, timeout_s: float = 10) -> list[ReadableSpan]:
    """The finished spans once ``done(spans)`` holds (the API's span ends a moment after the
    client has read the last byte)."""
    def finished() -> list[ReadableSpan] | None:
        spans = list(exported.get_finished_spans())
        return spans if done(spans) else None
    return await eventually(finished, timeout_s=timeout_s, interval_s=0.02, what=lambda: str(
        [(s.name, dict(s.attributes or {})) for s in exported.get_finished_spans()]))


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def sid(span: ReadableSpan) -> str:
    return format_span_id(span.context.span_id)


def no_prompt_anywhere(spans: list[ReadableSpan], text: str) -> None:
    for span in spans:
        assert text not in span.to_json(), f"{span.name} holds prompt text"


async def test_one_request_is_one_trace_from_its_traceparent_to_the_engine(redis_url, prefix, tracing, exported):
    engine = ScriptedEngine(delay_s=0.001)
    async with scripted_stack(redis_url, prefix, engine, tracing=tracing) as stack:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "stream": True}
        async with stack.client.stream("POST", "/v1/completions", json=body,
                                       headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}) as response:
            assert response.status_code == 200
            text = "".join([chunk async for chunk in response.aiter_text()])
        assert text.endswith("data: [DONE]\n\n")
        spans = await spans_when(exported, lambda s: named(s, "POST /v1/completions"))
        api = named(spans, "POST /v1/completions")[0]
        job_id = api.attributes["llmq.job_id"]
        record = await stack.redis.hgetall(f"{prefix}:{{tiny}}:job:{job_id}")

    assert {format_trace_id(s.context.trace_id) for s in spans} == {TRACE}
    assert sorted(s.name for s in spans) == ["POST /v1/completions", "llmq.attempt", "llmq.engine", "llmq.queue"]
    queue, attempt, engine_span = (named(spans, n)[0] for n in ("llmq.queue", "llmq.attempt", "llmq.engine"))

    # The API's span continues the client's, and is the parent of the worker's.
    assert api.kind == SpanKind.SERVER and api.parent.is_remote and format_span_id(api.parent.span_id) == CLIENT_SPAN
    assert dict(api.attributes) == {
        "http.request.method": "POST", "url.path": "/v1/completions", "http.route": "/v1/completions",
        "http.response.status_code": 200, "llmq.job_id": job_id, "gen_ai.request.model": "tiny",
        "llmq.tenant": "default", "llmq.dialect": "openai_completions", "gen_ai.usage.input_tokens": len(PROMPT),
        "gen_ai.usage.output_tokens": 12, "gen_ai.response.finish_reasons": ("length",)}
    assert record[b"traceparent"].decode() == f"00-{TRACE}-{sid(api)}-01"
    assert queue.parent.span_id == api.context.span_id and attempt.parent.span_id == api.context.span_id
    assert engine_span.parent.span_id == attempt.context.span_id
    # The engine request carried the engine span's context, for vLLM's own span.
    assert engine.trace_headers[-1] == {"traceparent": f"00-{TRACE}-{sid(engine_span)}-01"}

    assert queue.kind == attempt.kind == SpanKind.CONSUMER
    assert queue.start_time == int(float(record[b"queued_at"]) * 1_000_000)
    assert queue.end_time <= attempt.start_time <= engine_span.start_time
    assert engine_span.end_time <= attempt.end_time <= api.end_time  # the API's ends at the last byte
    assert dict(queue.attributes) == {"llmq.job_id": job_id, "gen_ai.request.model": "tiny", "llmq.level": 0,
                                      "llmq.tenant": "default", "llmq.dialect": "openai_completions",
                                      "llmq.worker": f"w-{prefix}", "llmq.outcome": "run"}
    assert dict(attempt.attributes) == {
        "llmq.job_id": job_id, "gen_ai.request.model": "tiny", "llmq.level": 0, "llmq.tenant": "default",
        "llmq.dialect": "openai_completions", "llmq.attempt": 1, "llmq.worker": f"w-{prefix}",
        "llmq.resumed_after_seq": 0,
        "gen_ai.usage.input_tokens": len(PROMPT), "gen_ai.usage.output_tokens": 12, "llmq.outcome": "done",
        "gen_ai.response.finish_reasons": ("length",), "llmq.tool_calls": 0}
    assert attempt.status.status_code == StatusCode.UNSET
    assert dict(engine_span.attributes) == {"gen_ai.request.model": "tiny", "gen_ai.usage.input_tokens": len(PROMPT),
                                            "gen_ai.usage.output_tokens": 12}
    no_prompt_anywhere(spans, PROMPT)
    no_prompt_anywhere(spans, PROMPT[:6])  # nor any generated text (the script cycles the prompt)


async def test_a_request_without_traceparent_starts_a_trace_and_an_error_is_marked(redis_url, prefix, tracing,
                                                                                   exported):
    async with scripted_stack(redis_url, prefix, tracing=tracing) as stack:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "break"}], "max_tokens": 5}
        response = await stack.client.post("/v1/chat/completions", json=body,
                                           headers={"traceparent": "00-not-a-valid-header-01"})
        assert response.status_code == 500  # "break" fails after its first token
        spans = await spans_when(exported, lambda s: named(s, "POST /v1/chat/completions"))

    api, attempt = named(spans, "POST /v1/chat/completions")[0], named(spans, "llmq.attempt")[0]
    assert api.parent is None  # a malformed traceparent is ignored, as W3C says: a new trace
    assert attempt.context.trace_id == api.context.trace_id and attempt.parent.span_id == api.context.span_id
    assert api.attributes["error.type"] == attempt.attributes["error.type"] == "generation_failed"
    assert api.status.status_code == attempt.status.status_code == StatusCode.ERROR
    assert api.attributes["http.response.status_code"] == 500
    assert attempt.attributes["llmq.outcome"] == "generation_failed"
    assert "gen_ai.response.finish_reasons" not in attempt.attributes


async def test_probes_and_scrapes_make_no_spans_and_a_span_is_named_by_its_route(redis_url, prefix, tracing, exported):
    async with scripted_stack(redis_url, prefix, tracing=tracing) as stack:
        for path in ("/metrics", "/ping", "/livez", "/readyz"):
            assert (await stack.client.get(path)).status_code == 200
        assert (await stack.client.get("/v1/models")).status_code == 200
        assert (await stack.client.get("/v1/jobs/0123456789abcdef0123456789abcdef")).status_code == 404
        assert (await stack.client.get("/v1/no/such/route")).status_code == 404  # no route: no middleware
        spans = await spans_when(exported, lambda s: len(s) == 2)
    # Named by the route's template, not the path: ids would make every span name unique.
    assert [(s.name, s.attributes["http.route"], s.attributes["http.response.status_code"]) for s in spans] == [
        ("GET /v1/models", "/v1/models", 200), ("GET /v1/jobs/{job_id}", "/v1/jobs/{job_id}", 404)]


async def test_a_lost_attempt_is_reconstructed_by_the_worker_that_continues_the_job(make_worker, redis, tracing,
                                                                                    exported):
    # The first worker traces nothing, as a SIGKILLed process exports nothing of its attempt.
    a = await make_worker(delay_s=0.02)
    client = Client(redis, a.queue)
    # 200 tokens at 20 ms: a keeps it for 4 s, past b's start on a loaded machine.
    job_id = await client.start("crash me", 200, traceparent=f"00-{TRACE}-{CLIENT_SPAN}-01")
    await running_on(a.queue, job_id, a.worker, min_tokens=10)
    started = (await a.queue.get_job(MODEL, job_id)).started_at
    b = await make_worker(delay_s=0.005, tracing=tracing)
    await kill(a)
    await client.finish()
    spans = await spans_when(exported, lambda s: len(named(s, "llmq.attempt")) == 2)

    lost, second = sorted(named(spans, "llmq.attempt"), key=lambda s: s.attributes["llmq.attempt"])
    assert not named(spans, "llmq.queue")  # the first delivery took it off the queue
    assert {format_trace_id(s.context.trace_id) for s in spans} == {TRACE}
    assert {format_span_id(s.parent.span_id) for s in (lost, second)} == {CLIENT_SPAN}
    assert dict(lost.attributes) == {
        "llmq.job_id": job_id, "gen_ai.request.model": MODEL, "llmq.level": 0, "llmq.dialect": "jobs",
        "llmq.tenant": "default", "llmq.attempt": 1, "llmq.worker": a.worker.worker_id, "llmq.outcome": "worker_lost",
        "llmq.reconstructed": True, "error.type": "worker_lost"}
    assert lost.status.status_code == StatusCode.ERROR
    assert lost.start_time == int(started * 1_000_000) and lost.end_time <= second.start_time
    assert second.attributes["llmq.attempt"] == 2 and second.attributes["llmq.worker"] == b.worker.worker_id
    assert second.attributes["llmq.resumed_after_seq"] >= 10
    assert second.attributes["llmq.outcome"] == "done"
    assert second.attributes["gen_ai.usage.output_tokens"] == 200


async def test_a_preempted_attempt_ends_preempted_and_the_next_one_continues_the_trace(make_worker, redis, tracing,
                                                                                     exported):
    """docs/tenants.md#preemption: the attempt that gave its slot away ends ``preempted``, not an
    error, and the job's next attempt is the next span of the same trace."""
    # A lease longer than the in-process default (1 s): on a loaded CI box a lapsed lease ended an
    # attempt "released" (a takeover), which is not what this test is about.
    w = await make_worker(delay_s=0.01, max_num_seqs=2, tracing=tracing, preempt_min_run_ms=50, preempt_min_tokens=1,
                          lease_s=10.0)
    heavy = [Client(redis, w.queue) for _ in range(2)]
    for i, client in enumerate(heavy):
        await client.start(f"long {i}", 150, traceparent=f"00-{TRACE}-{CLIENT_SPAN}-01" if i else None,
                           tenant="heavy")
        await running_on(w.queue, client.job_id, w.worker, min_tokens=5)
    light = Client(redis, w.queue)
    await light.start("short", 4, tenant="light")
    for client in (*heavy, light):
        await client.finish(timeout=30)
    spans = await spans_when(exported, lambda s: len(named(s, "llmq.attempt")) >= 4)
    attempts = [s for s in named(spans, "llmq.attempt") if s.attributes["llmq.job_id"] == heavy[1].job_id]
    if len(attempts) == 1:  # the other heavy job gave way (the cheaper to resume): look at that one
        attempts = [s for s in named(spans, "llmq.attempt") if s.attributes["llmq.job_id"] == heavy[0].job_id]
    first, second = sorted(attempts, key=lambda s: s.attributes["llmq.attempt"])
    assert first.attributes["llmq.outcome"] == "preempted" and "error.type" not in first.attributes
    assert first.status.status_code != StatusCode.ERROR
    assert second.attributes["llmq.outcome"] == "done" and second.attributes["llmq.resumed_after_seq"] >= 5
    assert first.context.trace_id == second.context.trace_id and first.end_time <= second.start_time


async def test_with_tracing_off_no_record_carries_trace_context(redis_url, prefix):
    engine = ScriptedEngine(delay_s=0.001)
    async with scripted_stack(redis_url, prefix, engine) as stack:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
        response = await stack.client.post("/v1/completions", json=body,
                                           headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"})
        assert response.status_code == 200
        job_id = response.json()["id"].removeprefix("cmpl-")
        record = await stack.redis.hgetall(f"{prefix}:{{tiny}}:job:{job_id}")
    assert record and b"traceparent" not in record
    assert engine.trace_headers[-1] is None


def test_the_api_and_worker_never_import_opentelemetry_with_tracing_off(tmp_path):
    code = ("import sys\n"
            "from api.app import create_app\n"
            "from shared.config import load_settings\n"
            "import workers.runner, shared.queue\n"
            "create_app(load_settings({}))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.trace',\n"
            "    'opentelemetry.exporter', 'shared.tracing', 'api.tracing', 'workers.tracing'))))\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no OTEL_* variable
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    # (Litestar itself probes for the opentelemetry package and its HTTP conventions when an app is
    # made; the tracing API, the SDK and llmq's tracing modules are what must stay out.)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"OTEL_SERVICE_NAME": "llmq"}, False),  # a name alone exports nowhere
])
def test_tracing_is_on_only_when_the_otel_variables_say_where(env, on):
    assert tracing_enabled(env) is on


def test_the_engine_gets_the_traces_url_and_protocol_llmq_uses():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}
    assert apply_tracing_environment(env) == "http://c:4318/v1/traces"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM's exporters would say grpc
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    assert apply_tracing_environment(env) == "http://c:4317" and env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "grpc"
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert apply_tracing_environment(env) == "http://t/x"


def test_a_malformed_traceparent_is_no_parent():
    assert parent_context("00-zz-yy-01") is None and parent_context("") is None and parent_context(None) is None
    assert parent_context(f"00-{TRACE}-{CLIENT_SPAN}-01") is not None


async def test_a_job_queued_without_trace_context_gets_one_trace_of_its_own(make_worker, redis, tracing, exported):
    w = await make_worker(delay_s=0.001, tracing=tracing)
    client = Client(redis, w.queue)
    await client.start("a batch line", 4)  # as a batch line or an LMTP frame is queued: no traceparent
    await client.finish()
    spans = await spans_when(exported, lambda s: len(s) == 3)
    queue, attempt, engine_span = (named(spans, n)[0] for n in ("llmq.queue", "llmq.attempt", "llmq.engine"))
    assert queue.parent is None  # the root
    assert attempt.parent.span_id == queue.context.span_id and engine_span.parent.span_id == attempt.context.span_id
    assert len({s.context.trace_id for s in spans}) == 1


def test_the_service_name_is_the_processs_unless_otel_service_name_says(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    api = Tracing.from_env("llmq-api", "api", os.environ)
    assert (api.provider.resource.attributes["service.name"], api.provider.resource.attributes["llmq.process"]) == (
        "llmq-api", "api")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llmq")
    worker = Tracing.from_env("llmq-worker", "worker", os.environ)
    assert worker.provider.resource.attributes["service.name"] == "llmq"
    api.shutdown()
    worker.shutdown()


def test_an_exporter_llmq_cannot_use_is_a_settings_error_at_start(monkeypatch):
    from shared.config import SettingsError, load_tracing

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(SettingsError, match="OTEL_TRACES_EXPORTER='zipkin'"):
        load_tracing("llmq-api", "api")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(SettingsError, match="http/json"):
        load_tracing("llmq-api", "api")
