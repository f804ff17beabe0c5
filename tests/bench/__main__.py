"""``python -m tests.bench``: llmq against vLLM's own OpenAI server and the engine in-process.

    python -m tests.bench                        # the full comparison (make bench)
    python -m tests.bench --smoke                # one short round at C=1,4 (make bench-smoke)
    python -m tests.bench --url http://host:8080 --model NAME   # only the workload, against any
                                                 # OpenAI-compatible deployment (llmq or not)

Defaults: 3 rounds; concurrency 1, 16, 64; max(4*C, 16) requests per run; 32 tokens per request.
On the 2-core development box that is about 2 minutes of engine loads plus 3-4 minutes per round
(13-15 minutes at a load average of ~5; twice that when the box is busy). The engine
settings come from the same ``LLMQ_*`` variables an llmq worker reads (model, max_num_seqs,
max_model_len, KV cache), so all three targets run the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

from shared.config import load_settings
from tests.bench.report import build_report, render
from tests.bench.serving import HttpTarget, Target, measure, start_targets
from tests.conftest import REPO

SMOKE = {"rounds": 1, "concurrency": "1,4", "requests": 8, "max_tokens": 16}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated levels (default 1,16,64)")
    p.add_argument("--requests", type=int, default=0, help="requests per run (default max(4*C, 16))")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request, ignore_eos (default 32)")
    p.add_argument("--targets", default="llmq,vllm-serve,in-process",
                   help="which of llmq, vllm-serve, in-process to run (default all three)")
    p.add_argument("--url", help="measure only this OpenAI-compatible server (no targets started)")
    p.add_argument("--model", help="with --url: the model name to send (default: the server's first /v1/models)")
    p.add_argument("--smoke", action="store_true", help="one round, C=1,4, 8 requests of 16 tokens")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default bench-results.json at the repo root; bench-smoke.json with --smoke)")
    p.add_argument("--logs", type=Path, default=None, help="where the targets' logs go (default a temp dir)")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
    if a.out is None:
        a.out = REPO / ("bench-smoke.json" if a.smoke else "bench-results.json")
    return a


def _first_model(url: str) -> str:
    import httpx

    resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _main(a: argparse.Namespace) -> int:
    concurrencies = [int(c) for c in a.concurrency.split(",") if c.strip()]
    settings = load_settings()
    async with AsyncExitStack() as stack:
        targets: list[Target]
        if a.url:
            model = a.model or _first_model(a.url)
            targets = [HttpTarget(a.url, a.url, model)]
            engine = {"url": a.url, "model": model}
        else:
            logs = a.logs or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-bench-")))
            logs.mkdir(parents=True, exist_ok=True)
            names = [n.strip() for n in a.targets.split(",") if n.strip()]
            print(f"starting {', '.join(names)} (engine loads take a minute or two; logs in {logs})",
                  file=sys.stderr, flush=True)
            targets = await start_targets(stack, settings, logs, names)
            engine = {"model": settings.model_name, "model_path": settings.model_path,
                      "max_num_seqs": settings.max_num_seqs, "max_model_len": settings.max_model_len,
                      "kv_cache_bytes": settings.kv_cache_bytes, "enforce_eager": settings.eager,
                      "scheduling_policy": "priority"}
        runs = await measure(targets, rounds=a.rounds, concurrencies=concurrencies, requests=a.requests or None,
                             max_tokens=a.max_tokens)
    report = build_report(runs, settings={
        **engine, "rounds": a.rounds, "concurrency": concurrencies, "max_tokens": a.max_tokens,
        "requests": a.requests or "max(4*C, 16)", "itl": "per chunk (as vLLM's benchmark_serving); TPOT per token",
    })
    print(render(report))
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {a.out}", file=sys.stderr)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> None:
    raise SystemExit(asyncio.run(_main(_args(argv))))


if __name__ == "__main__":
    main()
