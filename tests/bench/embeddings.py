"""``python -m tests.bench.embeddings``: embeddings through llmq against ``vllm serve``, by vLLM's client.

Both targets serve ``tiny-embed`` on the fast set's engine settings (tests/bench/serving.py: one
OpenMP thread, eager, 64 sequences), ``vllm serve`` with ``--runner pooling`` as llmq's worker runs
it. vLLM's own benchmark client (``vllm bench serve --backend openai-embeddings``, its random
dataset of ``--input-tokens`` tokens a prompt, one input per request) sends the same requests to
each, at each ``--concurrency``, the targets' order alternated round by round. Per target and
concurrency it reports the medians over rounds of requests per second and latency, and the CPU
per request of each process role (llmq's api, worker and redis; ``vllm serve``'s API server; the
engine), and llmq's ratio to ``vllm serve``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

from shared.config import EMBED_MODEL, load_settings
from tests.bench.cpu import by_role
from tests.bench.procs import markdown_table, measured_report, percentile, save
from tests.bench.serving import FAST, HttpTarget, engine_record, start_targets
from tests.bench.vllm_client import run_bench

__all__ = ["main"]

OVERLAY = {**FAST.overlay, "LLMQ_MODEL": EMBED_MODEL, "LLMQ_MAX_MODEL_LEN": "512"}
ROLES = ("api", "worker", "redis", "api-server", "engine")


async def _run(target: HttpTarget, tokenizer: str, concurrency: int, requests: int, input_tokens: int,
               seed: int) -> dict[str, float]:
    assert target.meter is not None
    before = target.meter.sample()
    result = await run_bench([
        "--backend", "openai-embeddings", "--base-url", target.url, "--endpoint", "/v1/embeddings",
        "--model", target.model, "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(input_tokens), "--random-output-len", "1", "--random-range-ratio", "0",
        "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--seed", str(seed),
        "--disable-tqdm", "--ready-check-timeout-sec", "0", "--percentile-metrics", "e2el",
        "--metric-percentiles", "50,99"])
    used = by_role(before, target.meter.sample())
    failed = [e for e in result.get("errors", []) if e]
    if failed or result["completed"] != requests:
        raise SystemExit(f"FAILED ({target.name}): {result['completed']} of {requests} answered: {failed[:3]}")
    latencies = [s * 1000 for s in result.get("e2els") or []]
    return {"requests_per_s": result["request_throughput"],
            "e2e_p50_ms": percentile(latencies, 50) if latencies else result["median_e2el_ms"],
            "e2e_p99_ms": percentile(latencies, 99) if latencies else result["p99_e2el_ms"],
            **{f"{role}_us_per_request": used.get(role, 0.0) / requests * 1e6 for role in ROLES}}


async def measure(rounds: int, concurrencies: list[int], requests: int, input_tokens: int) -> dict:
    settings = load_settings({**os.environ, **OVERLAY})
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-embeddings-")))
        targets = await start_targets(stack, settings, logs, ["llmq", "vllm-serve"], OVERLAY)
        for r in range(rounds):
            for c in concurrencies:
                for t in targets if r % 2 == 0 else reversed(targets):
                    assert isinstance(t, HttpTarget)
                    run = await _run(t, settings.model_path, c, requests, input_tokens, seed=r * 1000 + c)
                    samples.setdefault((t.name, c), []).append(run)
    medians = [{"target": name, "concurrency": c,
                **{k: round(statistics.median(run[k] for run in runs), 2) for k in runs[0]}}
               for (name, c), runs in samples.items()]
    ratios = []
    for c in concurrencies:
        llmq = next(m for m in medians if m["target"] == "llmq" and m["concurrency"] == c)
        serve = next(m for m in medians if m["target"] == "vllm-serve" and m["concurrency"] == c)
        ratios.append({"concurrency": c,
                       "requests_per_s_ratio": round(llmq["requests_per_s"] / serve["requests_per_s"], 3),
                       "added_e2e_p50_ms": round(llmq["e2e_p50_ms"] - serve["e2e_p50_ms"], 2)})
    return {"settings": {"rounds": rounds, "requests": requests, "input_tokens": input_tokens,
                         "engine": engine_record(settings, OVERLAY)}, "medians": medians, "comparisons": ratios}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.embeddings", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated levels (default 1,16,64)")
    p.add_argument("--requests", type=int, default=512, help="requests per run (default 512)")
    p.add_argument("--input-tokens", type=int, default=32, help="tokens per input (default 32)")
    p.add_argument("--out", default="bench-embeddings.json")
    a = p.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    report = measured_report("embeddings", "embeddings through llmq and vllm serve, by vLLM's client",
                             measure(a.rounds, levels, a.requests, a.input_tokens))
    rows = [[m["target"], m["concurrency"], m["requests_per_s"], m["e2e_p50_ms"], m["e2e_p99_ms"],
             *(m[f"{role}_us_per_request"] for role in ROLES)] for m in report["medians"]]
    table = markdown_table(["target", "C", "req/s", "e2e p50 ms", "e2e p99 ms",
                            *(f"{role} µs/req" for role in ROLES)], rows)
    table += "\n\n" + markdown_table(["C", "llmq ÷ vllm serve, req/s", "added e2e p50 ms"],
                                     [[r["concurrency"], r["requests_per_s_ratio"], r["added_e2e_p50_ms"]]
                                      for r in report["comparisons"]])
    save(report, a.out, table)


if __name__ == "__main__":
    main()
