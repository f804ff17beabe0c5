"""Where llmq's time to first token goes: one streaming request at a time, split at each hop.

``python -m tests.bench.ttft [--requests 60]`` starts the fast set's targets (llmq and
``vllm serve``, the same engine), sends the same sequential streaming requests to each, and for
llmq reads every job's record to split its TTFT at the three times the record keeps:

- ``send -> queued``: the client's send to the API's ``queued_at`` (HTTP, routing, validation,
  translation; the enqueue script runs right after it);
- ``queued -> started``: ``queued_at`` to the worker's ``started_at`` (the stream entry reaching
  the worker, its claim script);
- ``started -> first token``: the worker's ``started_at`` to its ``first_token_at`` (the engine:
  tokenizing, prefill, the first step, output processing; the same work ``vllm serve`` does);
- ``first token -> client``: ``first_token_at`` to the client's first token-bearing chunk (the
  flush script, the relay channel, the listener, the response's start and first write).

The API and the worker run on this host, so their clocks are the client's. ``vllm serve``'s TTFT
beside it is the same engine with no queue: the difference is what the queue's hops add.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
from redis.asyncio import Redis

from shared.config import load_settings
from tests.bench.procs import markdown_table, measured_report, save, stats_ms
from tests.bench.serving import TARGET_SETS, HttpTarget, start_targets
from tests.bench.workload import prompts_for, request_body

__all__ = ["main"]

HOPS = ("send -> queued", "queued -> started", "started -> first token", "first token -> client")
WARM_UP = 5
MAX_TOKENS = 8


def _redis_port(pid: int) -> int:
    # redis-server retitles itself "redis-server 127.0.0.1:<port>"
    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    return int(title.split()[1].rsplit(":", 1)[1])


async def _first_chunks(target: HttpTarget, prompts: list[str], max_tokens: int) -> list[tuple[float, float, str]]:
    """Per request, in turn: (send, first token-bearing chunk) as epoch seconds, and its id."""
    out = []
    async with httpx.AsyncClient(timeout=60) as client:
        for prompt in prompts:
            body = request_body(target.model, prompt, max_tokens)
            sent = time.time()
            first, chunk_id = 0.0, ""
            async with client.stream("POST", target.url + "/v1/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if not first and line.startswith("data: {") and '"choices":[{' in line:
                        first, chunk_id = time.time(), line.split('"id":"', 1)[1].split('"', 1)[0]
            out.append((sent, first, chunk_id))
    return out[WARM_UP:]


async def _hops(redis: Redis, rows: list[tuple[float, float, str]]) -> dict[str, list[float]]:
    hops: dict[str, list[float]] = {h: [] for h in HOPS}
    for sent, first, chunk_id in rows:
        job_id = chunk_id.removeprefix("cmpl-")
        [key] = [k async for k in redis.scan_iter(match=f"*:job:{job_id}", count=10_000)]
        queued, started, first_token = (float(v) for v in await redis.hmget(key, "queued_at", "started_at",
                                                                               "first_token_at"))
        for hop, ms in zip(HOPS, (queued - sent * 1000, started - queued, first_token - started,
                                   first * 1000 - first_token), strict=True):
            hops[hop].append(ms)
    return hops


async def measure(requests: int, rounds: int, max_tokens: int = MAX_TOKENS) -> dict:
    fast = TARGET_SETS["fast"]
    settings = load_settings({**os.environ, **fast.overlay})
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-ttft-")))
        targets = await start_targets(stack, settings, logs, fast.targets, fast.overlay)
        llmq = next(t for t in targets if t.name == "llmq")
        assert isinstance(llmq, HttpTarget) and llmq.meter is not None
        redis = Redis(port=_redis_port(llmq.meter.roots["redis"]))
        stack.push_async_callback(redis.aclose)
        ttft: dict[str, list[float]] = {t.name: [] for t in targets}
        hops: dict[str, list[float]] = {h: [] for h in HOPS}
        for r in range(rounds):  # interleaved, order alternated
            for target in targets if r % 2 == 0 else targets[::-1]:
                assert isinstance(target, HttpTarget)
                rows = await _first_chunks(target, prompts_for(requests + WARM_UP, f"ttft{r}"), max_tokens)
                ttft[target.name] += [(first - sent) * 1000 for sent, first, _ in rows]
                if target is llmq:
                    for hop, values in (await _hops(redis, rows)).items():
                        hops[hop] += values
    return {"ttft": {name: stats_ms(v) for name, v in ttft.items()},
            "hops": {hop: stats_ms(v) for hop, v in hops.items()},
            "added_p50_ms": round(statistics.median(ttft["llmq"]) - statistics.median(ttft["vllm-serve"]), 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.ttft", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=60, help="sequential requests per target and round (default 60)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"tokens per request (default {MAX_TOKENS}); the next request is sent when one ends, so a "
                        "longer one's end overlaps the next one's start as in the workload at C=1")
    p.add_argument("--out", default="bench-ttft.json")
    a = p.parse_args(argv)
    report = measured_report("ttft", "time to first token at C=1, llmq's split at each hop",
                             measure(a.requests, a.rounds, a.max_tokens))
    rows = [[f"TTFT, {name}", s["p50_ms"], s["p90_ms"], s["p99_ms"]] for name, s in report["ttft"].items()]
    rows += [[f"llmq: {hop}", s["p50_ms"], s["p90_ms"], s["p99_ms"]] for hop, s in report["hops"].items()]
    table = markdown_table(["", "p50 ms", "p90 ms", "p99 ms"], rows)
    save(report, a.out, f"{table}\n\nadded TTFT p50: {report['added_p50_ms']} ms")


if __name__ == "__main__":
    main()
