"""OpenTelemetry tracing across real processes (issue 18): one API and two vLLM workers on the
tiny model export OTLP/HTTP to a receiver in this test (tests/support/otlp_receiver.py), and one client
request becomes one trace: the API's request span, the worker's ``llmq.queue``, ``llmq.attempt``
and ``llmq.engine`` spans, and vLLM's own ``llm_request``, linked parent to child across the
processes by the client's ``traceparent``. A worker SIGKILLed mid-stream never exports its
attempt: the peer that continues the job exports it for it (reconstructed), beside its own.

One small stack (a fresh prefix, a short lease so a dead worker's job is taken over in seconds)
serves both tests; generations stay short.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.crash_stack import Small, json_lines, small_stack, stream_and_kill
from tests.support.event_log import ended_record
from tests.support.otlp_receiver import Receiver, Span
from tests.support.waiting import eventually_sync

pytestmark = pytest.mark.e2e

# Distinctive prompts: not one of their bytes may leave a process in an exported span.
CHAT_PROMPT = "Quixotic zebras juggle 4711 marmalade jars"
LONG_PROMPT = "Seventeen zeppelins hum sonatas over Vladivostok"
SECRET_WORDS = [p.encode() for p in (CHAT_PROMPT, LONG_PROMPT, "marmalade", "zeppelins", "Vladivostok")]
MAX_TOKENS = 16
LONG_TOKENS = 200  # long enough for the kill to land mid-stream (test_crash_continuation.py)
SPANS_TIMEOUT_S = 60  # the exporters batch every 100 ms; 2 shared cores can stall them


@pytest.fixture(scope="module")
def traced(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Small, Receiver]]:
    logs = tmp_path_factory.mktemp("tracing-logs")
    # Only this test's OTel settings: an inherited OTEL_SERVICE_NAME would replace the per-process
    # default names checked below.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with Receiver() as rx, small_stack(redis_url, logs, f"trace-{uuid.uuid4().hex[:6]}", env,
                                       OTEL_EXPORTER_OTLP_ENDPOINT=rx.url, OTEL_BSP_SCHEDULE_DELAY="100") as small:
        yield small, rx


# --- helpers ------------------------------------------------------------------------------------

def new_traceparent() -> tuple[str, str, str]:
    """(header, trace id, span id): the client's own span, as a caller with a tracer sends it."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def named(spans: list[Span], trace_id: str, name: str) -> list[Span]:
    return [s for s in spans if s.trace_id == trace_id and s.name == name]


def api_span(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s.trace_id == trace_id and s.service == "llmq-api"]


def no_prompt_exported(rx: Receiver) -> None:
    bodies = rx.bodies()
    assert bodies, "nothing was exported"
    leaked = sorted({w.decode() for body in bodies for w in SECRET_WORDS if w in body})
    assert not leaked, f"prompt text in exported spans: {leaked}"
    assert not rx.errors(), rx.errors()


def json_log_lines(small: Small) -> list[tuple[str, dict]]:
    """(log file, line) for every JSON line any process of the stack wrote."""
    out = []
    for log in sorted(small.logs.glob("*.log")):
        for raw in log.read_bytes().splitlines():
            if raw.startswith(b"{"):
                try:
                    out.append((log.name, json.loads(raw)))
                except ValueError:
                    continue  # a line another writer (vLLM's engine child) interleaved into
    return out


def job_log_lines(small: Small, job_id: str, until_event: str) -> list[tuple[str, dict]]:
    """The lines naming ``job_id``, once ``until_event`` about it has been logged (the worker logs
    ``job_finished`` after it published the end the client already read)."""
    def logged() -> list[tuple[str, dict]] | None:
        lines = [(name, x) for name, x in json_log_lines(small) if x.get("job_id") == job_id]
        return lines if any(x.get("event") == until_event for _, x in lines) else None
    return eventually_sync(logged, timeout_s=SPANS_TIMEOUT_S, interval_s=0.1,
                           what=lambda: f"a {until_event} line for {job_id}\n{small.tails()}")


def check_log_trace_ids(lines: list[tuple[str, dict]], trace_id: str) -> None:
    untraced = [(name, x.get("event"), x.get("trace_id")) for name, x in lines if x.get("trace_id") != trace_id]
    assert not untraced, f"job log lines without trace_id {trace_id}: {untraced}"


def dump(rx: Receiver, trace_id: str) -> str:
    return rx.dump([s for s in rx.spans() if s.trace_id == trace_id])


# --- the scenarios --------------------------------------------------------------------------

def test_one_streamed_request_is_one_trace_across_the_api_the_worker_and_vllm(traced):
    small, rx = traced
    small.two_workers()
    header, trace_id, client_span = new_traceparent()
    client = openai.OpenAI(base_url=f"{small.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(
        model=small.model, prompt=CHAT_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={"traceparent": header})
    job_id, usage, text = "", None, ""
    for chunk in stream:
        job_id = chunk.id.removeprefix("cmpl-")
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert job_id and usage is not None and usage.completion_tokens == MAX_TOKENS and text

    names = ("llmq.queue", "llmq.attempt", "llmq.engine")
    spans = rx.wait_for(lambda got: api_span(got, trace_id) and all(named(got, trace_id, n) for n in names),
                        SPANS_TIMEOUT_S)
    trace = [s for s in spans if s.trace_id == trace_id]
    detail = dump(rx, trace_id)

    print(detail)
    [api] = api_span(spans, trace_id)
    assert api.name == "POST /v1/completions" and api.kind == "SERVER", detail
    assert api.parent_span_id == client_span, "the API span continues the client's traceparent"
    assert api.resource["llmq.process"] == "api" and api.status != "ERROR", detail
    assert {k: api.attributes.get(k) for k in (
        "http.request.method", "http.route", "url.path", "http.response.status_code", "llmq.job_id",
        "gen_ai.request.model", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens",
        "gen_ai.response.finish_reasons")} == {
        "http.request.method": "POST", "http.route": "/v1/completions", "url.path": "/v1/completions",
        "http.response.status_code": 200, "llmq.job_id": job_id, "gen_ai.request.model": small.model,
        "gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens,
        "gen_ai.response.finish_reasons": ["length"]}, detail
    assert "llmq.dialect" in api.attributes and "llmq.job_ids" not in api.attributes, detail
    # The job record carries the API span as the workers' parent.
    stored = small.redis.hget(small.keys.job(small.model, job_id), "traceparent")
    assert stored == f"00-{trace_id}-{api.span_id}-01".encode(), stored

    [queue] = named(trace, trace_id, "llmq.queue")
    [attempt] = named(trace, trace_id, "llmq.attempt")
    [engine] = named(trace, trace_id, "llmq.engine")
    worker = small.redis.hget(small.keys.job(small.model, job_id), "worker").decode()
    for span in (queue, attempt, engine):
        assert span.service == "llmq-worker" and span.resource["llmq.process"] == "worker", detail
    assert (queue.kind, queue.parent_span_id) == ("CONSUMER", api.span_id), detail
    assert {k: queue.attributes.get(k) for k in ("llmq.job_id", "llmq.outcome", "llmq.worker")} == {
        "llmq.job_id": job_id, "llmq.outcome": "run", "llmq.worker": worker}, detail
    assert (attempt.kind, attempt.parent_span_id) == ("CONSUMER", api.span_id) and attempt.status != "ERROR", detail
    assert {k: attempt.attributes.get(k) for k in (
        "llmq.job_id", "llmq.attempt", "llmq.worker", "llmq.resumed_after_seq", "llmq.outcome",
        "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons")} == {
        "llmq.job_id": job_id, "llmq.attempt": 1, "llmq.worker": worker, "llmq.resumed_after_seq": 0,
        "llmq.outcome": "done", "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens, "gen_ai.response.finish_reasons": ["length"]}, detail
    assert (engine.kind, engine.parent_span_id) == ("INTERNAL", attempt.span_id), detail
    assert (engine.attributes.get("gen_ai.usage.input_tokens"),
            engine.attributes.get("gen_ai.usage.output_tokens")) == (usage.prompt_tokens, usage.completion_tokens)
    # Nesting in time: the queue wait ends where the attempt begins (the claim), the engine runs
    # inside the attempt, and the API span ends with the last byte, after the attempt's end.
    assert api.start_ns <= attempt.start_ns <= engine.start_ns <= engine.end_ns <= attempt.end_ns <= api.end_ns, detail
    assert queue.start_ns <= queue.end_ns <= attempt.end_ns, detail

    no_prompt_exported(rx)
    lines = job_log_lines(small, job_id, "job_finished")
    assert any(name.startswith("worker") for name, _ in lines), lines
    check_log_trace_ids(lines, trace_id)

    # Last, as it depends on vLLM: its own span, parented under the engine span by trace_headers.
    spans = rx.wait_for(lambda got: named(got, trace_id, "llm_request"), SPANS_TIMEOUT_S)
    [vllm] = named(spans, trace_id, "llm_request")
    assert (vllm.kind, vllm.parent_span_id, vllm.service) == ("SERVER", engine.span_id, "llmq-worker"), dump(
        rx, trace_id)
    assert vllm.attributes.get("gen_ai.usage.completion_tokens") == MAX_TOKENS, vllm
    print(vllm.brief())
    no_prompt_exported(rx)


@pytest.mark.faults
def test_a_sigkilled_attempt_is_reconstructed_beside_the_peers_continuation_in_the_same_trace(traced):
    small, rx = traced
    small.two_workers()
    header, trace_id, client_span = new_traceparent()
    body = {"inputs": LONG_PROMPT, "stream": True, "parameters": {
        "do_sample": False, "max_new_tokens": LONG_TOKENS, "ignore_eos_token": True, "details": True}}
    with httpx.Client(timeout=120, headers={"traceparent": header}) as client:
        killed = stream_and_kill(small, lambda items: json_lines(client, f"{small.url}/invocations", body, items))
    record = ended_record(small.redis, small.keys, small.model, killed.job_id)
    assert record[b"status"] == b"done" and record[b"attempt"] == b"2", record
    peer = record[b"worker"].decode()
    assert peer != killed.worker
    assert sum(1 for _, line in killed.items if "token" in line) == LONG_TOKENS

    def complete(got: list[Span]) -> bool:
        attempts = named(got, trace_id, "llmq.attempt")
        return bool(api_span(got, trace_id)) and len(attempts) >= 2 and bool(named(got, trace_id, "llmq.engine"))

    spans = rx.wait_for(complete, SPANS_TIMEOUT_S)
    detail = dump(rx, trace_id)
    print(detail)
    [api] = api_span(spans, trace_id)
    assert (api.name, api.kind, api.parent_span_id) == ("POST /invocations", "SERVER", client_span), detail
    assert {k: api.attributes.get(k) for k in ("llmq.job_id", "http.response.status_code",
                                                "gen_ai.usage.output_tokens")} == {
        "llmq.job_id": killed.job_id, "http.response.status_code": 200,
        "gen_ai.usage.output_tokens": LONG_TOKENS}, detail

    attempts = sorted(named(spans, trace_id, "llmq.attempt"), key=lambda s: s.attributes.get("llmq.attempt", 0))
    assert [s.attributes.get("llmq.attempt") for s in attempts] == [1, 2], detail
    lost, continued = attempts
    assert all(s.parent_span_id == api.span_id and s.kind == "CONSUMER" and s.service == "llmq-worker"
               for s in attempts), detail
    assert {k: lost.attributes.get(k) for k in (
        "llmq.job_id", "llmq.worker", "llmq.outcome", "llmq.reconstructed")} == {
        "llmq.job_id": killed.job_id, "llmq.worker": killed.worker, "llmq.outcome": "worker_lost",
        "llmq.reconstructed": True}, detail
    assert lost.status == "ERROR", detail
    assert {k: continued.attributes.get(k) for k in ("llmq.job_id", "llmq.worker", "llmq.outcome")} == {
        "llmq.job_id": killed.job_id, "llmq.worker": peer, "llmq.outcome": "done"}, detail
    assert "llmq.reconstructed" not in continued.attributes and continued.status != "ERROR", detail
    # It resumed after what the killed worker had logged when it died (at least that many events).
    assert continued.attributes["llmq.resumed_after_seq"] >= killed.logged > 0, detail
    # The lost attempt ran from its start to the reclaim; the peer's from the reclaim to the end.
    assert api.start_ns <= lost.start_ns < continued.start_ns, detail
    assert lost.end_ns <= continued.end_ns <= api.end_ns, detail
    # The killed process never ended its engine span; the peer's hangs under its own attempt.
    [engine] = named(spans, trace_id, "llmq.engine")
    assert engine.parent_span_id == continued.span_id, detail
    # A queue span only for the first delivery (the killed worker's, if it exported it in time).
    queues = named(spans, trace_id, "llmq.queue")
    assert [q.attributes.get("llmq.worker") for q in queues] in ([], [killed.worker]), detail

    no_prompt_exported(rx)
    lines = job_log_lines(small, killed.job_id, "job_finished")
    assert any(x.get("event") == "job_finished" and x.get("worker") == peer for _, x in lines), lines
    check_log_trace_ids(lines, trace_id)


def test_a_client_that_leaves_ends_the_trace_with_a_cancelled_attempt_and_traced_api_logs(traced):
    """The API logs about a job only when something goes wrong: a client that disconnects
    mid-stream makes it log the cancel, in the request's trace like the worker's lines."""
    small, rx = traced
    small.two_workers()
    header, trace_id, client_span = new_traceparent()
    body = {"model": small.model, "prompt": CHAT_PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    job_id = ""
    with httpx.Client(timeout=120, headers={"traceparent": header}) as client, client.stream(
            "POST", f"{small.url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for raw in resp.iter_lines():
            if raw.startswith("data: {"):
                job_id = json.loads(raw.removeprefix("data: "))["id"].removeprefix("cmpl-")
                break  # leaving the block closes the connection mid-stream
    assert job_id, "no chunk arrived"

    lines = job_log_lines(small, job_id, "job_cancelled_on_disconnect")
    assert any(name == "api.log" for name, _ in lines), lines
    spans = rx.wait_for(lambda got: api_span(got, trace_id) and named(got, trace_id, "llmq.attempt"), SPANS_TIMEOUT_S)
    detail = dump(rx, trace_id)
    print(detail)
    [api] = api_span(spans, trace_id)
    assert (api.name, api.parent_span_id, api.attributes.get("llmq.job_id")) == (
        "POST /v1/completions", client_span, job_id), detail
    [attempt] = named(spans, trace_id, "llmq.attempt")
    assert (attempt.parent_span_id, attempt.status) == (api.span_id, "ERROR"), detail
    assert {k: attempt.attributes.get(k) for k in ("llmq.job_id", "llmq.outcome", "error.type")} == {
        "llmq.job_id": job_id, "llmq.outcome": "cancelled", "error.type": "cancelled"}, detail
    assert attempt.attributes["gen_ai.usage.output_tokens"] < 400, detail
    no_prompt_exported(rx)
    check_log_trace_ids([(name, x) for name, x in json_log_lines(small) if x.get("job_id") == job_id], trace_id)
