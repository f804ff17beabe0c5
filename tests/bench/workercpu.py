"""The worker process's own CPU per request and per further token, with a scripted engine.

``python -m tests.bench.workercpu [--jobs 256 --tokens 64 --concurrency 64 --rounds 4]`` starts
its own redis-server and one worker process (this module with ``--child``: a real
:class:`workers.runner.Worker` whose engine is :class:`LockstepEngine`, every running job one
token per engine step, all of them in the same step, as vLLM's output handler hands a step's
outputs to every request at once). The parent queues jobs as the API does (``JobStore.enqueue``, one
relay channel following them) and reads the worker process's CPU (``/proc/<pid>/stat``) around
each run; runs of 1-token and of ``--tokens``-token jobs alternate, so a noisy spell falls on
both. As in ``tests.bench.costs``:

- ``per request`` = the worker's CPU for a 1-token job (pick and claim, the engine's one step, the
  terminal event and the job's end);
- ``per token`` = (the CPU of an N-token job - that) / (N - 1).

The queue layer only: the engine is a few lines of Python here, where vLLM's ``AsyncLLM`` front end
(detokenising, its output handler) is most of a real worker's CPU per token
(docs/benchmarks.md, "Worker CPU outside the engine"). ``--concurrency`` bounds the jobs running at
once (the worker's ``max_num_seqs``); every job is queued before the run starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from redis.asyncio import Redis

from shared.config import load_settings
from shared.events import TokenDelta
from shared.keys import Keys
from shared.logging import configure_logging
from shared.queue import Consumer, JobStore
from shared.redis import connect
from shared.schemas import GenerationRequest
from tests.bench.commandstats import run_jobs
from tests.bench.procs import load_average, markdown_table, report_head, save, start_redis, stop
from workers.protocol import AdapterState, Step

__all__ = ["LockstepEngine", "main"]

MODEL = "cpu"


class LockstepEngine:
    """Every running job advances one token per engine step, in the same step (``step_s`` apart),
    made by one ticker: workers/engine_loop.py in miniature. The worker runs jobs through
    :meth:`run`, each step handed to the job's callback from the ticker; :meth:`stream` (the
    warm-up's) waits on a queue per job, as vLLM's RequestOutputCollector does."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self._sinks: dict[str, Callable[[Step], None]] = {}
        self._left: dict[str, tuple[str, int, int]] = {}  # job -> (prompt, made, max_tokens)
        self._ticker: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for job_id, (prompt, made, n) in list(self._left.items()):
                char = prompt[made % len(prompt)]
                last = made + 1 == n
                delta = TokenDelta(token_ids=[ord(char)], text=char, finish_reason="length" if last else None)
                step = Step(deltas=[delta], finished=last, prompt_tokens=len(prompt))
                if made == 0:
                    step.prompt_token_ids = [ord(c) for c in prompt]
                self._sinks[job_id](step)
                if last:
                    del self._left[job_id]
                else:
                    self._left[job_id] = (prompt, made + 1, n)

    def _start(self, job_id: str, req: GenerationRequest, sink: Callable[[Step], None]) -> None:
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        self._sinks[job_id] = sink
        self._left[job_id] = (req.prompt or "a", 0, req.sampling.max_tokens)

    def _forget(self, job_id: str) -> None:
        self._sinks.pop(job_id, None)
        self._left.pop(job_id, None)

    async def stream(self, job_id: str, req: GenerationRequest, parts: Sequence[object] | None = None,
                     trace_headers: Mapping[str, str] | None = None, images: Mapping[str, object] | None = None
                     ) -> AsyncIterator[Step]:
        queue: asyncio.Queue[Step] = asyncio.Queue()
        self._start(job_id, req, queue.put_nowait)
        try:
            while True:
                step = await queue.get()
                yield step
                if step.finished:
                    return
        finally:
            self._forget(job_id)

    async def run(self, job_id: str, req: GenerationRequest, parts: Sequence[object] | None = None,
                  trace_headers: Mapping[str, str] | None = None, images: Mapping[str, object] | None = None, *,
                  on_step: Callable[[Step], None]) -> None:
        """The batch form, as the real engine's loop runs it: each tick hands every job its step,
        and a job's task wakes only at its end."""
        done = asyncio.get_running_loop().create_future()

        def sink(step: Step) -> None:
            on_step(step)
            if step.finished and not done.done():
                done.set_result(None)

        self._start(job_id, req, sink)
        try:
            await done
        finally:
            self._forget(job_id)

    def parses(self, req: GenerationRequest) -> bool:
        return False

    def adapter_state(self) -> AdapterState:
        return AdapterState()

    async def abort(self, job_id: str) -> None:
        self._left.pop(job_id, None)


async def _child(url: str, prefix: str, slots: int, step_s: float) -> None:
    from workers.runner import Worker

    settings = load_settings({}, redis_url=url, prefix=prefix, served_model_name=MODEL, block_ms=100,
                             max_num_seqs=slots, log_level="warning")
    redis = connect(url)
    worker = Worker(settings, Consumer(redis, Keys(prefix)), LockstepEngine(step_s), worker_id=f"cpu-{prefix}")
    task = asyncio.create_task(worker.run())
    while not worker.ready:
        await asyncio.sleep(0.01)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # EOF: stop
    worker.stop()
    await task
    await redis.aclose()


def cpu_seconds(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` in nanoseconds' resolution (``schedstat``'s run
    time, not ``stat``'s 10 ms ticks: a run of 1-token jobs costs only a few ticks)."""
    return sum(int((task / "schedstat").read_text().split()[0]) for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9


async def _measure(redis: Redis, prefix: str, pid: int, rounds: int, jobs: int, tokens: int) -> dict:
    queue = JobStore(redis, Keys(prefix))
    short: list[float] = []
    long: list[float] = []

    async def run(size: int) -> float:
        # The jobs wait queued until the worker is woken, so its CPU from here is theirs alone.
        before = cpu_seconds(pid)
        await run_jobs(queue, MODEL, jobs, size, relay="bench-api", poll_s=0.05)
        after = cpu_seconds(pid)
        return (after - before) / jobs * 1e6

    await run(tokens)  # warm: the worker's first jobs pay imports and caches
    for r in range(rounds):
        for size in ((1, tokens) if r % 2 == 0 else (tokens, 1)):
            (short if size == 1 else long).append(await run(size))
    per_request = statistics.median(short)
    per_token = (statistics.median(long) - per_request) / (tokens - 1)
    return {"per_request_us": round(per_request, 1), "per_token_us": round(per_token, 2),
            "short_runs_us": [round(x, 1) for x in short], "long_runs_us": [round(x, 1) for x in long]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.workercpu", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=256, help="jobs per run (default 256)")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the long jobs (default 64)")
    p.add_argument("--concurrency", type=int, default=64, help="the worker's slots (default 64)")
    p.add_argument("--rounds", type=int, default=4, help="runs of each size, alternated (default 4)")
    p.add_argument("--step-ms", type=float, default=2.0, help="the scripted engine's step (default 2)")
    p.add_argument("--out", default="bench-workercpu.json")
    p.add_argument("--child", nargs=2, metavar=("URL", "PREFIX"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    configure_logging("warning", True)
    if a.child:
        asyncio.run(_child(a.child[0], a.child[1], a.concurrency, a.step_ms / 1000))
        return
    loads = [load_average()]
    proc, url = start_redis()
    prefix = f"cpu-{uuid.uuid4().hex[:6]}"
    child = subprocess.Popen([sys.executable, "-m", "tests.bench.workercpu", "--concurrency", str(a.concurrency),
                              "--step-ms", str(a.step_ms), "--child", url, prefix],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert child.stdout is not None and child.stdin is not None
        if child.stdout.readline().strip() != "ready":
            raise SystemExit("the worker did not start")

        async def go() -> dict:
            redis = connect(url)
            try:
                return await _measure(redis, prefix, child.pid, a.rounds, a.jobs, a.tokens)
            finally:
                await redis.aclose()

        result = asyncio.run(go())
        child.stdin.close()
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        stop(proc)
    loads.append(load_average())
    report = {**report_head("workercpu", "the worker process's CPU per request and per further token", loads),
              "jobs": a.jobs, "tokens": a.tokens, "concurrency": a.concurrency, "step_ms": a.step_ms, **result}
    save(report, a.out, markdown_table(["worker CPU µs", "value"], [
        ["per request (1 token)", result["per_request_us"]], ["per further token", result["per_token_us"]]]))


if __name__ == "__main__":
    main()
