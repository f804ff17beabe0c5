"""llmq's CPU split into a cost per request and a cost per further token, by process.

``python -m tests.bench.costs`` starts the fast set's llmq (api, worker, redis, housekeeping; the
engine core counted apart, as everywhere), then sends streaming requests of 1 token and of
``--tokens`` tokens at ``--concurrency``, in alternation, and reads each process's CPU time
(``/proc/<pid>/stat``) around every run. Per role:

- ``per request`` = the CPU of a 1-token request (HTTP, translation, enqueue, claim, the
  engine's prompt processing, the end, the answer);
- ``per token`` = (the CPU of an N-token request - that) / (N - 1): each further token's way
  from the engine to the client.

The fast set's per-token figures (``python -m tests.bench --config fast``) mix the two at 64
tokens per request; this split says which one a change moves. ``LLMQ_STREAM_INTERVAL`` in the
environment applies, so the two can be compared at several tokens per event.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

from shared.config import load_settings
from tests.bench.cpu import by_role
from tests.bench.procs import markdown_table, measured_report, save
from tests.bench.serving import TARGET_SETS, HttpTarget, start_targets
from tests.bench.workload import prompts_for

__all__ = ["main"]

ROLES = ("api", "worker", "redis", "engine")


async def _run(target: HttpTarget, n: int, tokens: int, concurrency: int, tag: str) -> dict[str, float]:
    """CPU µs per request of ``n`` requests of ``tokens`` tokens, by role."""
    assert target.meter is not None
    before = target.meter.sample()
    summary = await target.run(prompts_for(n, tag), concurrency, tokens)
    if summary.errors:
        raise SystemExit(f"FAILED: {summary.errors[:3]}")
    used = by_role(before, target.meter.sample())
    return {role: used.get(role, 0.0) / n * 1e6 for role in ROLES}


async def measure(rounds: int, concurrency: int, tokens: int, requests: int) -> dict:
    fast = TARGET_SETS["fast"]
    settings = load_settings({**os.environ, **fast.overlay})
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-costs-")))
        [llmq] = await start_targets(stack, settings, logs, ["llmq"], fast.overlay)
        assert isinstance(llmq, HttpTarget)
        await llmq.run(prompts_for(64, "warm"), concurrency, 16)
        short: dict[str, list[float]] = {r: [] for r in ROLES}
        long: dict[str, list[float]] = {r: [] for r in ROLES}
        for r in range(rounds):  # alternated, so a noisy spell falls on both
            for size, into in ((1, short), (tokens, long)) if r % 2 == 0 else ((tokens, long), (1, short)):
                for role, us in (await _run(llmq, requests, size, concurrency, f"c{r}-{size}-{time.time()}")).items():
                    into[role].append(us)
    per_request = {role: statistics.median(v) for role, v in short.items()}
    per_token = {role: (statistics.median(long[role]) - per_request[role]) / (tokens - 1) for role in ROLES}
    return {"concurrency": concurrency, "tokens": tokens, "requests_per_run": requests, "rounds": rounds,
            "stream_interval": settings.stream_interval,
            "per_request_us": {k: round(v, 1) for k, v in per_request.items()},
            "per_token_us": {k: round(v, 2) for k, v in per_token.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.costs", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="runs of each size, alternated (default 4)")
    p.add_argument("--concurrency", type=int, default=16, help="streams at once (default 16)")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the long requests (default 64)")
    p.add_argument("--requests", type=int, default=256, help="requests per run (default 256)")
    p.add_argument("--out", default="bench-costs.json")
    a = p.parse_args(argv)
    report = measured_report("costs", "llmq's CPU per request and per further token, by process",
                             measure(a.rounds, a.concurrency, a.tokens, a.requests))
    table = markdown_table(["CPU µs", *ROLES], [
        ["per request (1 token)", *(report["per_request_us"][r] for r in ROLES)],
        ["per further token", *(report["per_token_us"][r] for r in ROLES)],
    ])
    save(report, a.out, f"{table}\n\nC={a.concurrency}, {a.tokens}-token requests, stream interval "
                        f"{report['stream_interval']}")


if __name__ == "__main__":
    main()
