"""The goodput benchmark's reading of ``vllm bench serve``'s result (tests/bench/goodput.py): what
counts as refused, skipped and failed, the medians across rounds, and issue 44's targets."""

from __future__ import annotations

import json
from pathlib import Path

from shared.config import load_settings
from tests.bench.goodput import OVERLAY, GoodputRun, build_report, checks, medians, render, run_of

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-bench-goodput.json"


def test_a_result_splits_its_failures_into_refused_skipped_and_failed():
    run = run_of(json.loads(FIXTURE.read_text()), rnd=1, target="llmq", load=2.0, rate=364.123)
    assert (run.requests, run.completed, run.refused, run.skipped, run.failed) == (6, 3, 1, 1, 1)
    assert (run.goodput, run.throughput, run.rate, run.duration_s) == (0.8, 1.2, 364.12, 2.5)
    assert (run.ttft_p50_ms, run.ttft_p99_ms) == (750.0, 1485.0)
    # A traceback's last line names the failure.
    assert run.errors == ["aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected"]
    # A job skipped before its stream began is its response's 504.
    result = json.loads(FIXTURE.read_text())
    result["errors"] = ["Gateway Timeout" if e == "Too Many Requests" else e for e in result["errors"]]
    run = run_of(result, rnd=1, target="llmq", load=2.0, rate=1.0)
    assert (run.refused, run.skipped, run.failed) == (0, 2, 1)


def test_a_run_with_nothing_answered_has_no_ttft_figures():
    # vLLM's client reports percentiles of an empty list as 0 ms: no request was that fast.
    result = {**json.loads(FIXTURE.read_text()), "completed": 0, "request_goodput": 0.0, "request_throughput": 0.0}
    run = run_of(result, rnd=1, target="llmq", load=2.0, rate=364.0)
    assert (run.ttft_p50_ms, run.ttft_p99_ms) == (None, None)


def cell(target: str, load: float, rnd: int, goodput: float, *, refused: int = 0, p99: float = 500.0) -> GoodputRun:
    return GoodputRun(round=rnd, target=target, load=load, rate=100 * load, requests=int(3000 * load), completed=1,
                      refused=refused, skipped=0, failed=0, goodput=goodput, throughput=goodput, ttft_p50_ms=100.0,
                      ttft_p99_ms=p99, duration_s=30.0)


def test_issue_44s_targets_are_judged_on_medians_across_rounds_and_summed_refusals():
    runs = [cell("llmq", 0.5, 1, 49.0), cell("vllm-serve", 0.5, 1, 50.0), cell("llmq", 0.5, 2, 47.0, refused=1),
            cell("vllm-serve", 0.5, 2, 50.0),
            cell("llmq", 2.0, 1, 80.0, refused=2000, p99=900.0), cell("vllm-serve", 2.0, 1, 30.0),
            cell("llmq", 2.0, 2, 74.0, refused=2100, p99=1200.0), cell("vllm-serve", 2.0, 2, 40.0)]
    rows = medians(runs)
    assert [(r["target"], r["load"], r["goodput"], r["refused"], r["ttft_p99_ms"]) for r in rows] == [
        ("llmq", 0.5, 48.0, 1, 500.0), ("vllm-serve", 0.5, 50.0, 0, 500.0),
        ("llmq", 2.0, 77.0, 4100, 1050.0), ("vllm-serve", 2.0, 35.0, 0, 500.0)]
    got = {c["check"]: (c["value"], c["ok"]) for c in checks(rows, capacity=100.0)}
    assert got == {
        "0.5×: llmq goodput / vllm serve's": (0.96, True),
        "0.5×: requests llmq refused": (1, False),
        "2×: llmq goodput / vllm serve's": (2.2, True),
        "2×: llmq goodput / capacity": (0.77, True),
        "2×: TTFT p99 ms of the requests llmq admitted": (1050.0, False),
    }


def test_a_missing_target_is_no_figure_and_the_report_renders():
    runs = [cell("llmq", 0.5, 1, 49.0), cell("llmq", 2.0, 1, 70.0)]
    report = build_report(runs, capacity={"requests_per_s": 100.0, "concurrency": 64, "requests": 512,
                                          "runs": [100.0]},
                          settings={"input_tokens": 32, "max_tokens": 64, "slo_ttft_ms": 1000, "arrivals_s": 30.0,
                                    "rounds": 1})
    ratio = next(c for c in report["checks"] if c["check"] == "2×: llmq goodput / vllm serve's")
    assert (ratio["value"], ratio["ok"]) == (None, None)
    assert report["ok"] and not report["targets_met"]
    table = render(report)
    assert "| llmq | 2× | 200.0 | 6000 | 70.00 | 70.00 | 0 | 0 | 0 | 100.0 | 500.0 |" in table
    assert "| 2×: llmq goodput / vllm serve's | n/a | >= 2 | n/a |" in table


def test_the_benchmarks_llmq_sends_no_keepalive_within_a_run():
    # vLLM's client merges an SSE comment read alone into the data after it and then sees no token.
    assert load_settings(OVERLAY).sse_keepalive_s >= 600


def test_the_predictions_are_what_the_workers_metrics_added_over_the_run():
    from tests.bench.goodput import Predictions, predictions_between

    before = ('llmq_ttft_prediction_error_seconds_sum{model="m",worker="a"} 1.5\n'
              'llmq_ttft_prediction_error_seconds_count{model="m",worker="a"} 10\n'
              'llmq_ttft_prediction_error_seconds_bucket{model="m",worker="a",le="0.1"} 4\n'
              'llmq_ttft_predictions_total{direction="late",model="m",worker="a"} 3\n'
              'llmq_ttft_predictions_total{direction="early",model="m",worker="a"} 7\n')
    after = before.replace(" 1.5\n", " 3.5\n").replace(" 10\n", " 30\n").replace('"a"} 3\n', '"a"} 8\n')
    assert predictions_between(before, after) == Predictions(count=20, late=5, mean_error_ms=100.0)
    assert predictions_between(before, before) == Predictions(count=0, late=0, mean_error_ms=None)
