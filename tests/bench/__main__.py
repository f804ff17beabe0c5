"""``python -m tests.bench``: llmq against vLLM's own OpenAI server and the engine in-process.

    python -m tests.bench                        # the default target set (make bench)
    python -m tests.bench --config fast          # the fast-engine set (make bench)
    python -m tests.bench --smoke                # one short round at C=1,4 (make bench-smoke)
    python -m tests.bench --url http://host:8080 --model NAME   # only the workload, against any
                                                 # OpenAI-compatible deployment (llmq or not)

Two standard target sets (tests/bench/serving.py TARGET_SETS):

- ``default``: llmq, ``vllm serve`` and the engine in-process, on the engine an llmq worker on this
  host builds from the ``LLMQ_*`` variables; 3 rounds, C = 1, 16, 64, max(4*C, 16) requests of 32
  tokens. About 2 minutes of engine loads plus 1-4 minutes per round on the 2-core box.
- ``fast``: llmq and ``vllm serve`` on the performance issue's engine, pinned whatever the
  environment says (the tiny Llama, eager, 64 seqs, 2048 context, 1 GiB KV, one OpenMP thread, no
  torch.compile); 5 rounds, C = 1, 16, 64, max(8*C, 32) requests of 64 tokens. About 3 minutes.

Every run also reports CPU per generated token by process role (tests/bench/cpu.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

from shared.config import load_settings
from tests.bench.report import build_report, render
from tests.bench.serving import TARGET_SETS, HttpTarget, Target, engine_record, measure, start_targets
from tests.bench.vllm_client import INPUT_TOKENS, vllm_client
from tests.conftest import REPO

SMOKE = {"rounds": 1, "concurrency": "1,4", "requests": 8, "max_tokens": 16}
# The workload arguments a target set gives a value to when the command line does not.
SET_ARGS = ("rounds", "concurrency", "max_tokens", "targets")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(TARGET_SETS), default="default",
                   help="the target set: engine, targets and workload defaults (default: default)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default: the set's, 3 or 5)")
    p.add_argument("--concurrency", help="comma-separated levels (default: the set's, 1,16,64)")
    p.add_argument("--requests", type=int, default=0,
                   help="requests per run (default: the set's, max(4*C, 16) or max(8*C, 32))")
    p.add_argument("--max-tokens", type=int, help="tokens per request, ignore_eos (default: the set's, 32 or 64)")
    p.add_argument("--targets", help="which of llmq, llmq-asyncllm (the worker on vLLM's AsyncLLM), vllm-serve, "
                                     "in-process to run (default: the set's)")
    p.add_argument("--url", help="measure only this OpenAI-compatible server (no targets started)")
    p.add_argument("--model", help="with --url: the model name to send (default: the server's first /v1/models)")
    p.add_argument("--smoke", action="store_true", help="one round, C=1,4, 8 requests of 16 tokens")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default at the repo root: bench-results.json, bench-fast.json with "
                        "--config fast, bench-smoke.json or bench-smoke-fast.json with --smoke)")
    p.add_argument("--client", choices=("llmq", "vllm"), default="llmq",
                   help="who sends the HTTP targets' requests: the project's client (httpx, tests/bench/workload.py) "
                        "or vLLM's own `vllm bench serve` (random dataset, tests/bench/vllm_client.py)")
    p.add_argument("--input-tokens", type=int, default=INPUT_TOKENS,
                   help=f"with --client vllm: the random prompts' length in tokens (default {INPUT_TOKENS})")
    p.add_argument("--tokenizer", help="with --client vllm and --url: the model's tokenizer (a path or name)")
    p.add_argument("--logs", type=Path, default=None, help="where the targets' logs go (default a temp dir)")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
    target_set = TARGET_SETS[a.config]
    for k in SET_ARGS:
        if getattr(a, k) is None:
            value = getattr(target_set, k)
            setattr(a, k, ",".join(value) if k == "targets" else value)
    if a.out is None:
        a.out = REPO / (f"bench-smoke{'-fast' if a.config == 'fast' else ''}.json" if a.smoke
                        else "bench-fast.json" if a.config == "fast" else "bench-results.json")
    return a


def _first_model(url: str) -> str:
    import httpx

    resp = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _main(a: argparse.Namespace) -> int:
    concurrencies = [int(c) for c in a.concurrency.split(",") if c.strip()]
    target_set = TARGET_SETS[a.config]
    overlay = target_set.overlay
    settings = load_settings({**os.environ, **overlay})
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
            targets = await start_targets(stack, settings, logs, names, overlay)
            engine = engine_record(settings, overlay)
        if a.client == "vllm":
            client = vllm_client(a.tokenizer or settings.model_path, a.input_tokens)
            for target in targets:
                if isinstance(target, HttpTarget):
                    target.client = client
        runs = await measure(targets, rounds=a.rounds, concurrencies=concurrencies, requests=a.requests or None,
                             max_tokens=a.max_tokens, per_lane=target_set.per_lane, least=target_set.least)
    report = build_report(runs, settings={
        "config": a.config, **engine, "client": a.client,
        **({"input_tokens": a.input_tokens} if a.client == "vllm" else {}),
        "rounds": a.rounds, "concurrency": concurrencies, "max_tokens": a.max_tokens,
        "requests": a.requests or f"max({target_set.per_lane}*C, {target_set.least})",
        "itl": "per chunk (as vLLM's benchmark_serving); TPOT per token",
    })
    print(render(report))
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {a.out}", file=sys.stderr)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> None:
    raise SystemExit(asyncio.run(_main(_args(argv))))


if __name__ == "__main__":
    main()
