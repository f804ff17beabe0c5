"""What tracing costs in CPU per request, in the API's and the worker's code, on and off.

``python -m tests.bench.tracing [--rounds 5 --requests 2000]``. Whole-deployment runs (``tests.bench``
with the ``OTEL_*`` variables set) show the cost too, but on a shared 2-core box their run-to-run
spread is wider than it; this isolates it. Rounds interleave the modes; in each, ``--requests``
requests go through, in this process:

- **api**: ``api.tracing.Traced`` (on) or nothing (off) around an ASGI app that does what a
  streamed request's route does with its span (``queued``, then ``ended`` with the job's ``Done``)
  and sends a response of 17 body chunks (16 tokens and the end), as the relay would.
- **worker**: a delivery's ``workers.tracing.JobSpans`` (queue and attempt spans), its engine span
  (``engine_started``) and its end (``ended``) with a 16-token result (on), or nothing (off).

Spans leave as in production, through the SDK's batch processor and OTLP/HTTP exporter, to a
receiver in another process (``tests/support/otlp_receiver.py``); each round ends with a flush, so the
exporter thread's encoding and sending is counted. CPU is this process's (``time.process_time``).
vLLM's own span is not here: its cost is vLLM's per-request statistics, per token, in the engine
(``LLMQ_ENGINE_TRACING``; the whole-deployment runs show it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from api.context import SPAN
from api.tracing import Traced
from shared.events import Done, TokenDelta
from shared.queue import Delivery
from shared.schemas import Choice, GenerationRequest, JobResult, Usage
from shared.tracing import Tracing
from tests.bench.procs import REPO
from workers.tracing import JobSpans

TOKENS = 16
# The receiver: its URL first; once its stdin closes, how many spans it received.
RECEIVER = ("import sys\nfrom tests.support.otlp_receiver import Receiver\nrx = Receiver().__enter__()\n"
            "print(rx.url, flush=True)\nsys.stdin.read()\nprint(len(rx.spans()), flush=True)\n")
SPANS_PER_REQUEST = 4  # the API's, and the worker's queue, attempt and engine spans


async def _app(scope, receive, send) -> None:
    span = scope.get(SPAN)
    if span is not None:
        span.queued("0123456789abcdef0123456789abcdef", "tiny", "default", "openai_completions")
        span.ended(Done(seq=TOKENS + 1, deltas=[TokenDelta(finish_reason="length")],
                        usage=Usage(prompt_tokens=5, completion_tokens=TOKENS)))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for _ in range(TOKENS):
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _api(app, n: int) -> None:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message) -> None:
        pass

    headers = [(b"content-type", b"application/json"),
               (b"traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]
    for _ in range(n):
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
                 "path_template": "/v1/completions"}
        await app(scope, receive, send)


def _worker(tracing: Tracing | None, n: int) -> None:
    req = GenerationRequest(prompt="x", dialect="openai_completions")
    result = JobResult(choices=[Choice(finish_reason="length")], usage=Usage(prompt_tokens=5, completion_tokens=TOKENS))
    for _ in range(n):
        d = Delivery(entry_id=b"1-0", job_id="0123456789abcdef0123456789abcdef", state="run", request=req,
                     queued_at=time.time() * 1000 - 5, attempt=1, tenant="default",
                     traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01")
        if tracing is None:
            continue
        spans = JobSpans(tracing, d, "tiny", "host:1:abc")
        spans.engine_started()
        spans.ended("done", result.usage, result)


def _measure(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def run(rounds: int, n: int, url: str) -> dict:
    provider = TracerProvider()
    # A queue that holds a whole round: a tight loop makes spans faster than any service would,
    # and a dropped span would not be counted.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{url}/v1/traces"),
                                                   max_queue_size=16 * n))
    tracing = Tracing(provider)
    apps = {"off": _app, "on": Traced(_app, tracing)}
    loop = asyncio.new_event_loop()
    cpu: dict[str, list[float]] = {f"{where} {mode}": [] for where in ("api", "worker") for mode in ("off", "on")}
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            on = mode == "on"

            def api(app=apps[mode], on=on) -> None:
                loop.run_until_complete(_api(app, n))
                if on:
                    provider.force_flush()

            def worker(on=on) -> None:
                _worker(tracing if on else None, n)
                if on:
                    provider.force_flush()

            cpu[f"api {mode}"].append(_measure(api) / n * 1e6)
            cpu[f"worker {mode}"].append(_measure(worker) / n * 1e6)
    provider.shutdown()
    loop.close()
    medians = {k: round(statistics.median(v), 1) for k, v in cpu.items()}
    return {"rounds": rounds, "requests": n, "cpu_us_per_request": medians,
            "added_us_per_request": {w: round(medians[f"{w} on"] - medians[f"{w} off"], 1) for w in ("api", "worker")},
            "runs": {k: [round(x, 1) for x in v] for k, v in cpu.items()}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.tracing", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", default=str(REPO / "bench-tracing.json"))
    args = parser.parse_args(argv)
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        url = receiver.stdout.readline().strip()
        report = run(args.rounds, args.requests, url)
    finally:
        receiver.stdin.close()
        received = receiver.stdout.readline().strip()
        receiver.wait(10)
    # Every span arrived: the figures count all the work, none was dropped on the way.
    report["spans_received"] = int(received)
    report["spans_made"] = args.rounds * args.requests * SPANS_PER_REQUEST
    print(f"CPU µs per request, medians of {args.rounds} rounds of {args.requests} requests:")
    for where in ("api", "worker"):
        m = report["cpu_us_per_request"]
        print(f"  {where:6s} off {m[f'{where} off']:7.1f}   on {m[f'{where} on']:7.1f}   "
              f"added {report['added_us_per_request'][where]:7.1f}")
    print(f"spans made {report['spans_made']}, received {report['spans_received']}")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
