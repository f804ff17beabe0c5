"""py-spy over the process that feeds the engine: llmq's worker, or ``vllm serve``'s API server.

``python -m tests.bench.frontprofile --target llmq|vllm-serve [--seconds 30]`` starts the fast
set's target (tests/bench/serving.py), warms it, then records that one process (or llmq's
``--role api``, with ``--tokens 1`` its cost per request) with py-spy
(``--nonblocking``, raw stacks) while streamed requests of ``--tokens`` tokens run at
``--concurrency``, and prints its CPU µs per generated token over the recording and the top
frames by own time. ``vllm serve`` reads its engine through vLLM's ``AsyncLLM``; llmq's worker
through its own engine loop (``workers/engine_loop.py``), or through ``AsyncLLM`` as
``--target llmq-asyncllm`` (LLMQ_ENGINE_FRONT). Both detokenise with vLLM's detokenizer, so what
llmq's worker does beyond that is the queue's part.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

from shared.config import load_settings
from tests.bench.cpu import cpu_seconds
from tests.bench.serving import TARGET_SETS, HttpTarget, start_targets
from tests.bench.workload import prompts_for

ROOT_ROLE = {"llmq": "worker", "llmq-asyncllm": "worker", "vllm-serve": "api-server"}


def _own_samples(raw: Path) -> collections.Counter[str]:
    """py-spy's raw stacks: the samples of each innermost frame (its own time)."""
    own: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        own[stack.split(";")[-1]] += int(n)
    return own


def _shares(counts: collections.Counter[str], top: int | None = None) -> list[tuple[float, str]]:
    total = sum(counts.values()) or 1
    return [(100 * n / total, name) for name, n in counts.most_common(top)]


def summarise(raw: Path, top: int) -> list[tuple[float, str]]:
    return _shares(_own_samples(raw), top)


def by_package(raw: Path) -> list[tuple[float, str]]:
    """Own time by the package of each sample's innermost Python frame (py-spy names files from
    their package: ``litestar/routes/http.py``, ``api/jobs.py``, ``asyncio/events.py``): what a
    layer costs by itself, e.g. what a raw ASGI route would save of Litestar's routing."""
    packages: collections.Counter[str] = collections.Counter()
    for frame, n in _own_samples(raw).items():
        where = frame.rpartition(" (")[2]
        packages[where.split("/")[0] if "/" in where else "(other)"] += n
    return _shares(packages)


async def profile(target_name: str, seconds: float, tokens: int, concurrency: int, out: Path,
                  role: str | None = None) -> dict:
    fast = TARGET_SETS["fast"]
    settings = load_settings({**os.environ, **fast.overlay})
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-prof-")))
        [target] = await start_targets(stack, settings, logs, [target_name], fast.overlay)
        assert isinstance(target, HttpTarget) and target.meter is not None
        pid = target.meter.roots[role or ROOT_ROLE[target_name]]
        await target.run(prompts_for(64, "warm"), concurrency, 16)
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "-d",
                                str(int(seconds)), "-r", "100", "-f", "raw", "-o", str(out), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = cpu_seconds(pid)
        generated = 0
        while spy.poll() is None:
            summary = await target.run(prompts_for(concurrency * 2, f"p{generated}"), concurrency, tokens)
            generated += round(summary.output_tokens_per_s * summary.duration_s)
        after = cpu_seconds(pid)
        assert before is not None and after is not None
        return {"target": target_name, "role": role or ROOT_ROLE[target_name], "tokens": generated,
                "us_per_token": (after - before) * 1e6 / generated}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.frontprofile")
    p.add_argument("--target", choices=sorted(ROOT_ROLE), required=True)
    p.add_argument("--role", help="llmq's process to record: worker (default) or api")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default="profile.raw")
    a = p.parse_args()
    result = asyncio.run(profile(a.target, a.seconds, a.tokens, a.concurrency, Path(a.out), a.role))
    print(result)
    for share, frame in summarise(Path(a.out), a.top):
        print(f"{share:5.1f}% {frame}")
    print("own time by package:")
    for share, package in by_package(Path(a.out)):
        print(f"{share:5.1f}% {package}")


if __name__ == "__main__":
    main()
