"""Goodput under overload (issue 44): requests that meet a TTFT SLO, per second, llmq against
``vllm serve``, below and past the engine's capacity.

    python -m tests.bench.goodput            # 2 interleaved rounds (make bench): bench-goodput.json
    python -m tests.bench.goodput --quick    # 1 round of 8 s arrivals: the path end to end

Starts the fast set's targets once (llmq and ``vllm serve`` on the same pinned engine,
tests/bench/serving.py). **Capacity** is ``vllm serve``'s request throughput at C=64 with vLLM's own
client (tests/bench/vllm_client.py) and the fast set's fixed lengths (32 random prompt tokens, 64
tokens out, ``ignore_eos``): the median of 3 runs of 512 requests. Then each round, at 0.5× and 2×
that rate, both targets in turn (the order rotated each round) get ``rate × 30 s`` requests as a
Poisson process (``bench serve --request-rate``, no concurrency limit: overload comes as an open
loop, whether the server keeps up or not), every one with ``x-slo-ttft-ms: 1000``, and
``--goodput ttft:1000`` counts those whose first token came within it.

Per run, from vLLM's result JSON: **goodput** and **throughput** (vLLM's: good and completed
requests over the run's duration, the first send to the last answer); **refused** (HTTP 429: the
admission judged the SLO out of reach); **skipped** (a job not started because its first-token
deadline had passed, or would before its first token: HTTP 504, or a 200 stream that ended with no
token, whose in-band error vLLM's client does not read);
**failed** (anything else); TTFT p50/p99 over the requests that got a first token: vLLM's client
computes them over successful requests only, so refused and skipped ones are not in them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import sys
import tempfile
import zlib
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import msgspec

from shared.config import load_settings
from tests.bench.procs import markdown_table
from tests.bench.report import fmt, headline, machine, versions
from tests.bench.serving import FAST, HttpTarget, engine_record, requests_for, start_targets
from tests.bench.vllm_client import INPUT_TOKENS, bench_serve, run_vllm_client
from tests.conftest import REPO

__all__ = ["GoodputRun", "run_of", "medians", "checks", "build_report", "render", "main"]

SLO_TTFT_MS = 1000
SLO_HEADER = "x-slo-ttft-ms"
LOADS = (0.5, 2.0)
"""Arrival rates as multiples of capacity: one the engine keeps up with, one it cannot."""
CAPACITY_CONCURRENCY = 64
# vLLM's client strips every read of a stream before it splits messages, so an SSE comment read
# alone (llmq's keep-alive while a request waits) runs into the data after it and the client sees
# no token at all: a request that waited 15 s would count as skipped. Past any run's length, no
# keep-alive is sent; the targets are judged on first tokens well inside it anyway.
OVERLAY = {**FAST.overlay, "LLMQ_SSE_KEEPALIVE_S": "3600"}
# vLLM's client keeps only a failed response's reason phrase (endpoint_request_func.py), so a
# refusal is told from other failures by 429's phrase, and a job skipped past its first-token
# deadline by 504's (the stream had sent nothing yet, so it is the response's status), or, once a
# stream had begun (a keep-alive), by the message the client gives a stream that carried no token.
REFUSED = "Too Many Requests"
SKIPPED = ("Gateway Timeout", "Never received a valid chunk")


class GoodputRun(msgspec.Struct):
    """One target at one arrival rate in one round."""

    round: int
    target: str
    load: float
    """The arrival rate as a multiple of capacity."""
    rate: float
    requests: int
    completed: int
    """Requests that got a first token and ended well (vLLM's ``completed``)."""
    refused: int
    skipped: int
    failed: int
    goodput: float
    """Completed requests whose first token came within the SLO, per second of the run."""
    throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    duration_s: float
    errors: list[str] = msgspec.field(default_factory=list)
    """Up to 3 distinct reasons among ``failed``."""
    predictions: Predictions | None = None
    """llmq's: how its admission's TTFT predictions of the run's jobs turned out (its /metrics)."""


class Predictions(msgspec.Struct):
    """llmq's TTFT predictions over a run, from its /metrics: the jobs predicted at admission whose
    first token came, and how far off the prediction was (docs/guarantees.md#slos)."""

    count: int
    late: int
    """First tokens later than predicted."""
    mean_error_ms: float | None
    """The mean of |first token - predicted|, queueing to first token as the worker measures it."""


PREDICTION_SERIES = ("llmq_ttft_prediction_error_seconds_sum", "llmq_ttft_prediction_error_seconds_count",
                     'llmq_ttft_predictions_total{direction="late"')


def prediction_totals(exposition: str) -> tuple[float, float, float]:
    """The error histogram's sum and count and the late predictions, summed over every worker."""
    totals = [0.0, 0.0, 0.0]
    for line in exposition.splitlines():
        for i, name in enumerate(PREDICTION_SERIES):
            if line.startswith(name) and (i == 2 or line[len(name)] in " {"):
                totals[i] += float(line.rsplit(" ", 1)[1])
    return totals[0], totals[1], totals[2]


def predictions_between(before: str, after: str) -> Predictions:
    (s0, n0, l0), (s1, n1, l1) = prediction_totals(before), prediction_totals(after)
    count = round(n1 - n0)
    return Predictions(count=count, late=round(l1 - l0),
                       mean_error_ms=round((s1 - s0) / count * 1000, 1) if count else None)


def run_of(result: dict, *, rnd: int, target: str, load: float, rate: float) -> GoodputRun:
    """One ``bench serve`` result (``--save-detailed``, ``--goodput``) as a :class:`GoodputRun`."""
    errors = [e for e in result["errors"] if e]
    refused = sum(e == REFUSED for e in errors)
    skipped = sum(e.startswith(SKIPPED) for e in errors)
    others = [e for e in errors if e != REFUSED and not e.startswith(SKIPPED)]
    # With no request answered, vLLM's percentiles are of an empty list (0): no figure, not 0 ms.
    answered = result["completed"] > 0
    return GoodputRun(
        round=rnd, target=target, load=load, rate=round(rate, 2), requests=len(result["errors"]),
        completed=result["completed"], refused=refused, skipped=skipped, failed=len(others),
        goodput=round(result["request_goodput"], 3), throughput=round(result["request_throughput"], 3),
        ttft_p50_ms=round(result["p50_ttft_ms"], 2) if answered else None,
        ttft_p99_ms=round(result["p99_ttft_ms"], 2) if answered else None,
        duration_s=round(result["duration"], 2), errors=sorted({e.strip().splitlines()[-1][:200] for e in others})[:3])


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def medians(runs: Sequence[GoodputRun]) -> list[dict]:
    """Per (load, target): rates and TTFTs as medians across rounds, refusals, skips and failures
    summed (the target "refuses none" is about every request of the run)."""
    out = []
    for load in sorted({r.load for r in runs}):
        for target in dict.fromkeys(r.target for r in runs):
            cell = [r for r in runs if r.load == load and r.target == target]
            out.append({"target": target, "load": load, "rounds": len(cell), "rate": _median([r.rate for r in cell]),
                        "requests": sum(r.requests for r in cell),
                        **{f: _median([getattr(r, f) for r in cell])
                           for f in ("goodput", "throughput", "ttft_p50_ms", "ttft_p99_ms")},
                        **{f: sum(getattr(r, f) for r in cell) for f in ("refused", "skipped", "failed")}})
    return out


def checks(rows: Sequence[dict], capacity: float, slo_ms: float = SLO_TTFT_MS) -> list[dict]:
    """Issue 44's targets, each with the measured figure and whether it passed (None: no figure)."""
    cell = {(r["target"], r["load"]): r for r in rows}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    def check(name: str, value: float | None, op: str, bound: float) -> dict:
        ok = None if value is None else value >= bound if op == ">=" else value <= bound
        return {"check": name, "value": value, "target": f"{op} {bound:g}", "ok": ok}

    low, high = (cell.get(("llmq", load), {}) for load in LOADS)
    low_vllm, high_vllm = (cell.get(("vllm-serve", load), {}) for load in LOADS)
    return [
        check("0.5×: llmq goodput / vllm serve's", ratio(low.get("goodput"), low_vllm.get("goodput")), ">=", 0.95),
        check("0.5×: requests llmq refused", low.get("refused"), "<=", 0),
        check("2×: llmq goodput / vllm serve's", ratio(high.get("goodput"), high_vllm.get("goodput")), ">=", 2),
        check("2×: llmq goodput / capacity", ratio(high.get("goodput"), capacity), ">=", 0.7),
        check("2×: TTFT p99 ms of the requests llmq admitted", high.get("ttft_p99_ms"), "<=", slo_ms),
    ]


def build_report(runs: Sequence[GoodputRun], *, capacity: dict, settings: dict) -> dict:
    rows = medians(runs)
    targets = checks(rows, capacity["requests_per_s"], settings.get("slo_ttft_ms", SLO_TTFT_MS))
    return {
        "benchmark": "goodput",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # Refusals and skips are the outcome measured; anything else failing means a broken run.
        "ok": bool(runs) and not any(r.failed for r in runs),
        "targets_met": all(c["ok"] for c in targets),
        "machine": machine(), "versions": versions(), "settings": settings, "capacity": capacity,
        "medians": rows, "checks": targets, "runs": [msgspec.to_builtins(r) for r in runs],
    }


def render(report: dict) -> str:
    s, cap = report["settings"], report["capacity"]
    lines = [
        headline(report),
        f"fast set · {s['input_tokens']} random prompt tokens, {s['max_tokens']} out "
        f"· SLO TTFT {s['slo_ttft_ms']} ms · {s['arrivals_s']} s of Poisson arrivals per run "
        f"· {s['rounds']} round(s) · capacity {cap['requests_per_s']:.2f} req/s "
        f"(vllm serve at C={cap['concurrency']}, median of {len(cap['runs'])}) "
        "· rates and TTFTs medians across rounds, counts summed",
        "",
        markdown_table(
            ["target", "load", "rate req/s", "requests", "goodput req/s", "throughput req/s", "refused", "skipped",
             "failed", "TTFT p50 ms", "TTFT p99 ms"],
            [[m["target"], f"{m['load']:g}×", fmt(m["rate"], 1), m["requests"], fmt(m["goodput"], 2),
              fmt(m["throughput"], 2), m["refused"], m["skipped"], m["failed"], fmt(m["ttft_p50_ms"], 1),
              fmt(m["ttft_p99_ms"], 1)] for m in report["medians"]]),
        "",
        markdown_table(["check", "measured", "needs", "met"],
                       [[c["check"], fmt(c["value"], 3), c["target"],
                         "n/a" if c["ok"] is None else "yes" if c["ok"] else "NO"] for c in report["checks"]]),
        "",
        "TTFT percentiles are vLLM's client's, over the requests that got a first token: refused and skipped "
        "ones are not in them.",
    ]
    predicted = [r for r in report["runs"] if r.get("predictions")]
    if predicted:
        lines += ["", "llmq's TTFT predictions (its /metrics; queueing to first token as its worker measures it):", "",
                  markdown_table(["round", "load", "jobs predicted", "late", "mean |error| ms"],
                                 [[r["round"], f"{r['load']:g}×", r["predictions"]["count"], r["predictions"]["late"],
                                   fmt(r["predictions"]["mean_error_ms"], 1)] for r in predicted])]
    if not report["ok"]:
        broken = [r for r in report["runs"] if r["failed"]]
        lines += ["", "FAILED: requests failed other than by refusal or skip: "
                  + "; ".join(f"{r['target']} {r['load']:g}× round {r['round']}: {r['failed']} ({r['errors']})"
                              for r in broken[:5])]
    return "\n".join(lines)


async def _metrics(target: HttpTarget) -> str:
    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(target.url.rstrip("/").removesuffix("/v1") + "/metrics")).text


async def measure(rounds: int, arrivals_s: float, capacity_runs: int, logs: Path | None) -> tuple[list, dict, dict]:
    settings = load_settings({**os.environ, **OVERLAY})
    tokenizer = settings.model_path
    async with AsyncExitStack() as stack:
        if logs is None:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-goodput-")))
        logs.mkdir(parents=True, exist_ok=True)
        print(f"starting llmq and vllm serve (logs in {logs})", file=sys.stderr, flush=True)
        targets = await start_targets(stack, settings, logs, FAST.targets, OVERLAY)
        vllm = next(t for t in targets if t.name == "vllm-serve")
        assert isinstance(vllm, HttpTarget)
        n = requests_for(CAPACITY_CONCURRENCY, None, FAST.per_lane, FAST.least)
        measured = []
        for i in range(capacity_runs):
            summary = await run_vllm_client(vllm.url, vllm.model, tokenizer, concurrency=CAPACITY_CONCURRENCY,
                                            requests=n, max_tokens=FAST.max_tokens, seed=zlib.crc32(b"capacity%d" % i))
            if not summary.ok:
                raise RuntimeError(f"capacity run failed: {summary.errors}")
            measured.append(summary.requests_per_s)
            print(f"capacity run {i + 1}: {summary.requests_per_s:.2f} req/s", file=sys.stderr, flush=True)
        capacity = {"requests_per_s": round(statistics.median(measured), 3), "concurrency": CAPACITY_CONCURRENCY,
                    "requests": n, "runs": measured}
        runs: list[GoodputRun] = []
        for r in range(rounds):
            for load in LOADS:
                rate = capacity["requests_per_s"] * load
                seed = zlib.crc32(f"goodput-r{r}-x{load}".encode())  # the same prompts for both targets
                for target in targets[r % 2:] + targets[:r % 2]:
                    assert isinstance(target, HttpTarget)
                    before = await _metrics(target) if target.name == "llmq" else ""
                    result = await bench_serve(
                        target.url, target.model, tokenizer, requests=max(1, round(rate * arrivals_s)),
                        max_tokens=FAST.max_tokens, seed=seed, request_rate=rate,
                        extra=["--goodput", f"ttft:{SLO_TTFT_MS}", "--header", f"{SLO_HEADER}={SLO_TTFT_MS}"])
                    run = run_of(result, rnd=r + 1, target=target.name, load=load, rate=rate)
                    if target.name == "llmq":
                        await asyncio.sleep(settings.heartbeat_s + 1)  # the workers' metrics come with heartbeats
                        run.predictions = predictions_between(before, await _metrics(target))
                    runs.append(run)
                    print(f"round {r + 1} {load:g}x {target.name:<10} rate {run.rate:7.1f} goodput {run.goodput:7.2f} "
                          f"throughput {run.throughput:7.2f} refused {run.refused} skipped {run.skipped} failed "
                          f"{run.failed} TTFT p50 {fmt(run.ttft_p50_ms)} p99 {fmt(run.ttft_p99_ms)} ms",
                          file=sys.stderr, flush=True)
    record = {"config": FAST.name, **engine_record(settings, OVERLAY), "sse_keepalive_s": settings.sse_keepalive_s,
              "client": "vllm bench serve", "input_tokens": INPUT_TOKENS, "max_tokens": FAST.max_tokens,
              "slo_ttft_ms": SLO_TTFT_MS, "loads": list(LOADS), "arrivals_s": arrivals_s, "rounds": rounds}
    return runs, capacity, record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.goodput", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2; 1 with --quick)")
    p.add_argument("--arrivals-s", type=float, default=30.0,
                   help="seconds of arrivals per run: requests = rate x this (default 30; 8 with --quick)")
    p.add_argument("--quick", action="store_true", help="1 round, 8 s of arrivals, one capacity run")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default at the repo root: bench-goodput.json, bench-goodput-quick.json)")
    p.add_argument("--logs", type=Path, default=None, help="where the targets' logs go (default a temp dir)")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.arrivals_s = 1, 8.0
    out = a.out or REPO / ("bench-goodput-quick.json" if a.quick else "bench-goodput.json")
    runs, capacity, settings = asyncio.run(measure(a.rounds, a.arrivals_s, 1 if a.quick else 3, a.logs))
    report = build_report(runs, capacity=capacity, settings=settings)
    print(render(report))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {out}", file=sys.stderr)
    # Missed targets are the measurement (before admission landed, llmq admits everything);
    # only a broken run fails the command, so `make bench` goes on to the next benchmark.
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
