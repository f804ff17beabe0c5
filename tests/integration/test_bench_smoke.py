"""The benchmark's workload client and report at tiny size, against the scripted stack (real API,
real Redis, a scripted engine that streams exactly max_tokens tokens). No vLLM here: the smoke run
on the real engines is ``make bench-smoke``; this proves the measuring and reporting code."""

from __future__ import annotations

import json

import pytest

from tests.bench.__main__ import _args, _main
from tests.bench.report import build_report, render
from tests.bench.serving import HttpTarget, measure
from tests.bench.workload import RequestRecord, prompts_for, run_workload, summarize
from tests.support.scripted_stack import scripted_stack

MAX_TOKENS = 8


@pytest.fixture(scope="module")
async def url(redis_url):
    async with scripted_stack(redis_url, "bench-smoke") as s:
        yield s.url


async def test_every_request_streams_exactly_max_tokens_and_is_timed(url):
    prompts = prompts_for(12, tag="t-")
    records, summary = await run_workload(url, "tiny", prompts, concurrency=4, max_tokens=MAX_TOKENS)
    assert len(records) == 12
    for r in records:
        assert not r.error
        assert r.tokens == MAX_TOKENS  # from the usage chunk
        # One token per scripted step; a chunk carries several when the worker's flusher lagged.
        assert 1 <= r.chunks <= MAX_TOKENS
        assert len(r.itl_s) == r.chunks - 1
        assert 0 < r.ttft_s <= r.e2e_s
    assert summary.ok and summary.completed == summary.requests == 12
    assert summary.concurrency == 4 and summary.max_tokens == MAX_TOKENS
    assert summary.output_tokens_per_s == pytest.approx(12 * MAX_TOKENS / summary.duration_s, rel=0.01)
    assert summary.requests_per_s > 0
    assert 0 < summary.ttft_p50_ms <= summary.ttft_p99_ms
    assert 0 < summary.itl_p50_ms <= summary.itl_p99_ms
    assert summary.tokens_per_chunk == pytest.approx(12 * MAX_TOKENS / sum(r.chunks for r in records), abs=0.001)


async def test_interleaved_runs_give_medians_ratios_and_added_ttft(url):
    # Three names on one server: the shape of a full run without starting any engine.
    targets = [HttpTarget(n, url, "tiny") for n in ("llmq", "vllm-serve", "in-process")]
    runs = await measure(targets, rounds=2, concurrencies=[1, 4], requests=5, max_tokens=MAX_TOKENS, progress=False)
    assert len(runs) == 2 * 2 * 3
    # The order rotates per round, so no target always runs first.
    assert [r.target for r in runs[:3]] == ["llmq", "vllm-serve", "in-process"]
    assert [r.target for r in runs[6:9]] == ["vllm-serve", "in-process", "llmq"]
    assert all(r.summary.ok and r.summary.completed == 5 for r in runs)

    report = build_report(runs, settings={"model": "tiny", "max_tokens": MAX_TOKENS, "rounds": 2, "requests": 5})
    assert report["ok"] is True
    assert {"date", "machine", "versions", "settings", "medians", "comparisons", "runs"} <= report.keys()
    assert report["machine"]["cores"] >= 1 and len(report["machine"]["load_average"]) == 3
    assert {"vllm", "torch", "llmq_commit"} <= report["versions"].keys()
    assert [(m["target"], m["concurrency"]) for m in report["medians"]] == [
        (t, c) for c in (1, 4) for t in ("llmq", "vllm-serve", "in-process")]
    for m in report["medians"]:
        assert m["rounds"] == 2 and m["ok"] and m["output_tokens_per_s"] > 0 and m["ttft_p99_ms"] > 0
    assert [(c["concurrency"], c["against"]) for c in report["comparisons"]] == [
        (1, "vllm-serve"), (1, "in-process"), (4, "vllm-serve"), (4, "in-process")]
    for c in report["comparisons"]:
        assert c["tokens_per_s_ratio"] > 0
        assert isinstance(c["added_ttft_p50_ms"], float) and isinstance(c["added_ttft_p99_ms"], float)
    json.dumps(report)  # JSON-ready as is
    table = render(report)
    assert "| llmq | 4 |" in table and "| 4 | vllm-serve |" in table and "FAILED" not in table


async def test_a_request_short_of_max_tokens_fails_the_run(url):
    # "break" makes the scripted engine fail after its first token: the stream ends early.
    records, summary = await run_workload(url, "tiny", ["fine prompt", "break"], concurrency=2, max_tokens=MAX_TOKENS)
    assert not summary.ok and summary.completed == 1 and summary.requests == 2
    assert summary.errors
    short = summarize([RequestRecord(ttft_s=0.1, e2e_s=0.2, tokens=MAX_TOKENS - 1, chunks=7)],
                      concurrency=1, max_tokens=MAX_TOKENS, duration_s=0.2)
    assert not short.ok and short.errors == [f"{MAX_TOKENS - 1} tokens, expected {MAX_TOKENS}"]


async def test_cli_against_a_url_writes_the_json_report(url, tmp_path):
    out = tmp_path / "bench.json"
    code = await _main(_args(["--url", url, "--model", "tiny", "--rounds", "1", "--concurrency", "2",
                              "--requests", "4", "--max-tokens", "5", "--out", str(out)]))
    assert code == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["settings"]["url"] == url and report["comparisons"] == []
    (row,) = report["medians"]
    assert row["target"] == url and row["concurrency"] == 2 and row["ok"]


def test_prompts_are_distinct_and_the_same_for_every_target():
    assert len(set(prompts_for(200))) == 200
    assert prompts_for(5, tag="x") == prompts_for(5, tag="x") != prompts_for(5, tag="y")
