"""The benchmark report's CPU figures (tests/bench/report.py): µs per generated token by role,
medians across rounds, and the CPU ratios against ``vllm serve``; and the target sets' pinned
engine (tests/bench/serving.py)."""

from __future__ import annotations

import os

from shared.config import load_settings
from tests.bench.__main__ import _args
from tests.bench.cpu import ENGINE
from tests.bench.report import build_report, render
from tests.bench.serving import FAST, TARGET_SETS, Run, engine_env
from tests.bench.workload import Summary
from workers.environment import eager


def summary(tok_s: float, completed: int = 100, max_tokens: int = 10) -> Summary:
    return Summary(requests=completed, completed=completed, ok=True, concurrency=16, max_tokens=max_tokens,
                   duration_s=completed * max_tokens / tok_s, output_tokens_per_s=tok_s, requests_per_s=1.0,
                   ttft_p50_ms=5.0, ttft_p99_ms=9.0, itl_p50_ms=1.0, itl_p99_ms=2.0, tpot_p50_ms=1.0,
                   tokens_per_chunk=1.0)


def llmq(rnd: int, worker_s: float) -> Run:
    # 1,000 tokens per run: CPU seconds x 1e3 = µs per token.
    return Run(round=rnd, target="llmq", summary=summary(1000.0),
               cpu_s={"api": 0.018, "worker": worker_s, "redis": 0.006, "housekeeping": 0.0, ENGINE: 0.2},
               idle_cpu_s=0.001, client_cpu_s=0.03)


def vllm(rnd: int) -> Run:
    return Run(round=rnd, target="vllm-serve", summary=summary(1250.0), cpu_s={"api-server": 0.04, ENGINE: 0.2},
               idle_cpu_s=0.002, client_cpu_s=0.03)


def test_cpu_per_token_by_role_is_the_median_across_rounds_and_compared_with_vllm_serve():
    runs = [llmq(1, 0.030), vllm(1), vllm(2), llmq(2, 0.034), llmq(3, 0.090), vllm(3)]
    report = build_report(runs, settings={"config": "fast", "model": "tiny"})
    by_target = {m["target"]: m["cpu_us_per_token"] for m in report["medians"]}
    assert list(by_target["llmq"].items()) == [
        ("api", 18.0), ("worker", 34.0), ("redis", 6.0), ("housekeeping", 0.0), (ENGINE, 200.0),
        ("outside engine", 58.0), ("total", 258.0), ("client", 30.0), ("idle neighbours", 1.0)]
    assert by_target["vllm-serve"] == {"api-server": 40.0, ENGINE: 200.0, "outside engine": 40.0, "total": 240.0,
                                       "client": 30.0, "idle neighbours": 2.0}
    (cmp,) = report["comparisons"]
    assert cmp["tokens_per_s_ratio"] == 0.8
    assert cmp["worker_over_api_server_cpu"] == 0.85  # 34 / 40
    assert cmp["total_cpu_ratio"] == 1.075  # 258 / 240

    table = render(report)
    assert "| target | C | api | worker | redis | housekeeping | api-server | engine | outside engine | total " \
           "| client | idle neighbours |" in table
    assert "| llmq | 16 | 18.0 | 34.0 | 6.0 | 0.0 |  | 200.0 | 58.0 | 258.0 | 30.0 | 1.0 |" in table
    assert "| vllm-serve | 16 |  |  |  |  | 40.0 | 200.0 | 40.0 | 240.0 | 30.0 | 2.0 |" in table
    assert "| 16 | vllm-serve | 0.800 | 0.00 | 0.00 | 1.075 | 0.850 |" in table


def test_a_run_without_processes_or_tokens_has_no_cpu_figures():
    unmeasured = Run(round=1, target="http://x", summary=summary(100.0))
    failed = Run(round=1, target="llmq", summary=summary(100.0, completed=0), cpu_s={"api": 1.0})
    report = build_report([unmeasured, failed], settings={})
    assert [m["cpu_us_per_token"] for m in report["medians"]] == [{}, {}]
    assert "CPU µs per generated token" not in render(report)


def test_the_fast_set_pins_its_engine_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("LLMQ_KV_CACHE_GIB", "4")
    a = _args(["--config", "fast"])
    assert (a.rounds, a.concurrency, a.max_tokens, a.targets) == (5, "1,16,64", 64, "llmq,vllm-serve")
    assert a.out.name == "bench-fast.json"
    settings = load_settings({**os.environ, **FAST.overlay})
    assert (settings.max_num_seqs, settings.max_model_len, settings.kv_cache_bytes, eager(settings)) == (
        64, 2048, 2**30, True)
    env = engine_env(settings, FAST.overlay)
    pinned = ("OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    assert [env[k] for k in pinned] == ["1", "1", "0"]
    # The default set keeps today's: three targets, the environment's engine, 32 tokens.
    d = _args([])
    assert (d.rounds, d.max_tokens, d.targets) == (3, 32, "llmq,vllm-serve,in-process")
    assert d.out.name == "bench-results.json"
    assert TARGET_SETS["default"].overlay == {}
    # The command line still wins over a set's defaults.
    assert _args(["--config", "fast", "--rounds", "2", "--targets", "llmq"]).rounds == 2
