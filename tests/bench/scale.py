"""``python -m tests.bench.scale``: the measured CPU per token by process, as a capacity table.

It reads the fast set's report (``bench-fast.json``, written by ``python -m tests.bench --config
fast``) and turns llmq's CPU per generated token at the highest concurrency into cores at a given
rate: Redis cores, API cores (and web processes, each kept under ``--api-busy`` of a core), and the
worker CPU each GPU needs outside its engine, for 1, 8 and 64 GPUs at ``--per-gpu`` tokens/s each.

The model is linear: cores = tokens/s x CPU seconds per token. That holds while the per-token cost
does not change with the rate, which ``tests.bench.relay`` checks on this box: its runs report CPU
per event at different rates (``--clients``). The per-token figures include what each request costs
spread over its tokens (64 per request in the fast set), so they overstate longer answers.

``Redis cores`` is what one Redis would spend. On a Cluster one model's token traffic splits over
its SHARDS token shards (shared/keys.py), which ``--cluster-report`` (``python -m
tests.bench.relay_shards``'s report) says how well: three masters relayed a measured multiple of one
master's tokens (less than 3x: a flush is one script call per shard, and the model's own master
also does every job's queue work). ``Cluster masters`` is then how many masters one model needs,
each kept under ``--redis-busy`` of its core, at that measured efficiency per master (an
extrapolation past three masters). One model spreads over at most SHARDS + 1 slots (its shards and
its own), so past that it cannot use more masters: the table says so.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from shared.keys import SHARDS
from tests.bench.procs import markdown_table
from tests.conftest import REPO

__all__ = ["capacity", "cluster_efficiency", "costs_from_report", "main"]

GPUS = (1, 8, 64)


def costs_from_report(report: Mapping, target: str = "llmq") -> tuple[int, dict[str, float], float | None]:
    """(concurrency, ``target``'s CPU µs per token by role, vllm serve's API-server µs per token) at
    the report's highest concurrency."""
    medians = report["medians"]
    top = max(m["concurrency"] for m in medians)
    llmq = next(m for m in medians if m["target"] == target and m["concurrency"] == top)
    serve = next((m for m in medians if m["target"] == "vllm-serve" and m["concurrency"] == top), None)
    api_server = serve["cpu_us_per_token"].get("api-server") if serve else None
    return top, dict(llmq["cpu_us_per_token"]), api_server


def cluster_efficiency(report: Mapping) -> tuple[int, float]:
    """(masters, one-master capacity per master) at the most masters of a relay-shards report:
    e.g. (3, 0.77) when three masters relayed 2.31x one master's tokens."""
    capacity = report["capacity_vs_fewest_masters"]
    most = max(capacity, key=int)
    return int(most), capacity[most] / int(most)


def capacity(costs_us: Mapping[str, float], per_gpu: float, gpus: Sequence[int] = GPUS, *,
             api_busy: float = 0.7, api_server_us: float | None = None, per_master: float | None = None,
             redis_busy: float = 0.7) -> list[dict[str, float]]:
    """One row per GPU count: the rate and the cores each role needs at it. ``per_master``: a
    Cluster master's share of one model's tokens in one-master cores (:func:`cluster_efficiency`):
    the row then says how many masters one model needs (0: more than its slots can spread over)."""
    rows = []
    for n in gpus:
        rate = n * per_gpu
        api = rate * costs_us["api"] / 1e6
        redis = rate * costs_us["redis"] / 1e6
        row = {"gpus": n, "tokens_per_s": rate, "redis_cores": redis,
               "api_cores": api, "web_processes": max(1, math.ceil(api / api_busy)),
               "worker_cores_per_gpu": per_gpu * costs_us["worker"] / 1e6}
        if per_master is not None:
            # One master needs no split; more pay the split's cost (per_master < 1).
            masters = 1 if redis <= redis_busy else math.ceil(redis / (per_master * redis_busy))
            row["cluster_masters"] = masters if masters <= SHARDS + 1 else 0
        if api_server_us is not None:
            row["vllm_serve_api_server_cores_per_gpu"] = per_gpu * api_server_us / 1e6
        rows.append(row)
    return rows


def table(rows: Sequence[Mapping[str, float]]) -> str:
    headers = ["GPUs", "tokens/s", "Redis cores", "API cores", "web processes", "worker cores per GPU"]
    with_cluster = "cluster_masters" in rows[0]
    if with_cluster:
        headers.insert(3, "Cluster masters for one model")
    with_serve = "vllm_serve_api_server_cores_per_gpu" in rows[0]
    if with_serve:
        headers.append("vllm serve API-server cores per GPU")
    out = []
    for r in rows:
        line = [r["gpus"], f"{r['tokens_per_s']:,.0f}", f"{r['redis_cores']:.2f}", f"{r['api_cores']:.2f}",
                r["web_processes"], f"{r['worker_cores_per_gpu']:.2f}"]
        if with_cluster:
            line.insert(3, r["cluster_masters"] or f"more than {SHARDS + 1}")
        if with_serve:
            line.append(f"{r['vllm_serve_api_server_cores_per_gpu']:.2f}")
        out.append(line)
    return markdown_table(headers, out)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--report", type=Path, default=REPO / "bench-fast.json", help="the fast set's report")
    p.add_argument("--per-gpu", type=float, default=12_500, help="generated tokens/s per GPU (default 12,500)")
    p.add_argument("--api-busy", type=float, default=0.7, help="how busy one web process may run (default 0.7)")
    p.add_argument("--cluster-report", type=Path, default=REPO / "bench-relay-shards.json",
                   help="python -m tests.bench.relay_shards's report (no Cluster column without it)")
    p.add_argument("--redis-busy", type=float, default=0.7, help="how busy one Redis master may run (default 0.7)")
    p.add_argument("--target", default="llmq", help="which llmq of the report (default llmq; llmq-asyncllm)")
    a = p.parse_args(argv)
    report = json.loads(a.report.read_text())
    top, costs, api_server = costs_from_report(report, a.target)
    print(f"from {a.report.name} ({report['date']}, llmq {report['versions']['llmq_commit']}), C={top}: "
          + ", ".join(f"{role} {costs[role]:g} µs/token" for role in ("api", "worker", "redis")))
    per_master = None
    if a.cluster_report.exists():
        cluster = json.loads(a.cluster_report.read_text())
        masters, per_master = cluster_efficiency(cluster)
        print(f"from {a.cluster_report.name} ({cluster['date']}): {masters} masters relayed "
              f"{masters * per_master:.2f}x one master's tokens ({per_master:.2f} per master)")
    print(table(capacity(costs, a.per_gpu, api_busy=a.api_busy, api_server_us=api_server, per_master=per_master,
                         redis_busy=a.redis_busy)))


if __name__ == "__main__":
    main()
