"""The capacity table: per-token CPU turned into cores, from the fast set's report shape."""

from __future__ import annotations

import pytest

from tests.bench.scale import capacity, cluster_efficiency, costs_from_report, table

REPORT = {"medians": [
    {"target": "llmq", "concurrency": 1, "cpu_us_per_token": {"api": 200.0, "worker": 500.0, "redis": 100.0}},
    {"target": "llmq", "concurrency": 64, "cpu_us_per_token": {"api": 40.0, "worker": 80.0, "redis": 8.0}},
    {"target": "llmq-asyncllm", "concurrency": 64, "cpu_us_per_token": {"api": 41.0, "worker": 95.0, "redis": 8.5}},
    {"target": "vllm-serve", "concurrency": 64, "cpu_us_per_token": {"api-server": 70.0}},
]}


def test_the_highest_concurrency_is_read():
    assert costs_from_report(REPORT) == (64, {"api": 40.0, "worker": 80.0, "redis": 8.0}, 70.0)


def test_another_llmq_of_the_report_is_read_by_name():
    assert costs_from_report(REPORT, "llmq-asyncllm") == (64, {"api": 41.0, "worker": 95.0, "redis": 8.5}, 70.0)


def test_cores_are_rate_times_cpu_per_token():
    _, costs, serve = costs_from_report(REPORT)
    rows = capacity(costs, 12_500, (1, 8), api_busy=0.7, api_server_us=serve)
    assert rows[1]["tokens_per_s"] == 100_000
    assert rows[1]["redis_cores"] == pytest.approx(0.8)  # 100k tok/s x 8 µs
    assert rows[1]["api_cores"] == pytest.approx(4.0)
    assert rows[1]["web_processes"] == 6  # 4 cores at 0.7 each
    assert rows[0]["web_processes"] == 1
    assert rows[0]["worker_cores_per_gpu"] == pytest.approx(1.0)
    assert rows[0]["vllm_serve_api_server_cores_per_gpu"] == pytest.approx(0.875)
    text = table(rows)
    assert text.splitlines()[2] == "| 1 | 12,500 | 0.10 | 0.50 | 1 | 1.00 | 0.88 |"


def test_the_cluster_column_is_masters_at_the_measured_efficiency_and_says_when_one_model_cannot_spread():
    masters, per_master = cluster_efficiency({"capacity_vs_fewest_masters": {"1": 1.0, "3": 2.31}})
    assert (masters, per_master) == (3, pytest.approx(0.77))
    costs = {"api": 40.0, "worker": 80.0, "redis": 8.0}
    rows = capacity(costs, 12_500, (1, 8, 64, 1000), per_master=per_master, redis_busy=0.7)
    # 0.1 core: one master; 0.8: ceil(0.8 / (0.77 x 0.7)) = 2; 6.4: 12; 100: beyond the 13 slots.
    assert [r["cluster_masters"] for r in rows] == [1, 2, 12, 0]
    lines = table(rows).splitlines()
    assert lines[0].startswith("| GPUs | tokens/s | Redis cores | Cluster masters for one model |")
    assert lines[-1].split(" | ")[3] == "more than 13"
