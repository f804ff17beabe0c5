"""``python -m tests.bench.scale``: the measured CPU per token by process, as a capacity table.

It reads the fast set's report (``bench-fast.json``, written by ``python -m tests.bench --config
fast``) and turns llmq's CPU per generated token at the highest concurrency into cores at a given
rate: Redis cores, API cores (and web processes, each kept under ``--api-busy`` of a core), and the
worker CPU each GPU needs outside its engine, for 1, 8 and 64 GPUs at ``--per-gpu`` tokens/s each.

The model is linear: cores = tokens/s x CPU seconds per token. That holds while the per-token cost
does not change with the rate, which ``tests.bench.relay`` checks on this box: its runs report CPU
per event at different rates (``--clients``). The per-token figures include what each request costs
spread over its tokens (64 per request in the fast set), so they overstate longer answers.

A Redis Cluster does not split one model: every key and channel of a model carries its hash tag
(``{model}``), so one model's traffic is one master's, and ``Redis cores`` above 1 means one model
needs more than one Redis core can give (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.bench.procs import markdown_table
from tests.conftest import REPO

__all__ = ["capacity", "costs_from_report", "main"]

GPUS = (1, 8, 64)


def costs_from_report(report: Mapping) -> tuple[int, dict[str, float], float | None]:
    """(concurrency, llmq's CPU µs per token by role, vllm serve's API-server µs per token) at the
    report's highest concurrency."""
    medians = report["medians"]
    top = max(m["concurrency"] for m in medians)
    llmq = next(m for m in medians if m["target"] == "llmq" and m["concurrency"] == top)
    serve = next((m for m in medians if m["target"] == "vllm-serve" and m["concurrency"] == top), None)
    api_server = serve["cpu_us_per_token"].get("api-server") if serve else None
    return top, dict(llmq["cpu_us_per_token"]), api_server


def capacity(costs_us: Mapping[str, float], per_gpu: float, gpus: Sequence[int] = GPUS, *,
             api_busy: float = 0.7, api_server_us: float | None = None) -> list[dict[str, float]]:
    """One row per GPU count: the rate and the cores each role needs at it."""
    rows = []
    for n in gpus:
        rate = n * per_gpu
        api = rate * costs_us["api"] / 1e6
        row = {"gpus": n, "tokens_per_s": rate, "redis_cores": rate * costs_us["redis"] / 1e6,
               "api_cores": api, "web_processes": max(1, math.ceil(api / api_busy)),
               "worker_cores_per_gpu": per_gpu * costs_us["worker"] / 1e6}
        if api_server_us is not None:
            row["vllm_serve_api_server_cores_per_gpu"] = per_gpu * api_server_us / 1e6
        rows.append(row)
    return rows


def table(rows: Sequence[Mapping[str, float]]) -> str:
    headers = ["GPUs", "tokens/s", "Redis cores", "API cores", "web processes", "worker cores per GPU"]
    with_serve = "vllm_serve_api_server_cores_per_gpu" in rows[0]
    if with_serve:
        headers.append("vllm serve API-server cores per GPU")
    out = []
    for r in rows:
        line = [r["gpus"], f"{r['tokens_per_s']:,.0f}", f"{r['redis_cores']:.2f}", f"{r['api_cores']:.2f}",
                r["web_processes"], f"{r['worker_cores_per_gpu']:.2f}"]
        if with_serve:
            line.append(f"{r['vllm_serve_api_server_cores_per_gpu']:.2f}")
        out.append(line)
    return markdown_table(headers, out)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--report", type=Path, default=REPO / "bench-fast.json", help="the fast set's report")
    p.add_argument("--per-gpu", type=float, default=12_500, help="generated tokens/s per GPU (default 12,500)")
    p.add_argument("--api-busy", type=float, default=0.7, help="how busy one web process may run (default 0.7)")
    a = p.parse_args(argv)
    report = json.loads(a.report.read_text())
    top, costs, api_server = costs_from_report(report)
    print(f"from {a.report.name} ({report['date']}, llmq {report['versions']['llmq_commit']}), C={top}: "
          + ", ".join(f"{role} {costs[role]:g} µs/token" for role in ("api", "worker", "redis")))
    print(table(capacity(costs, a.per_gpu, api_busy=a.api_busy, api_server_us=api_server)))


if __name__ == "__main__":
    main()
