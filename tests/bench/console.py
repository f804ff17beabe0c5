"""What an open console costs the per-token path: the streaming workload with no console open, and
with one open in Chromium and following the busy queue (issue 31's check; docs/console.md).

``python -m tests.bench.console [--rounds 5]`` starts one llmq on the fast set's engine (one web
process, one worker, housekeeping), then runs the fast set's workload (streamed completions of 64
tokens, C=16 and 64) back to back as two targets, the order rotated each round:

- **console closed:** nothing else;
- **console open:** before the run, headless Debian Chromium (tests/support/browser.py) opens the
  console as an operator on three pages that poll and stream through the whole run: the overview
  (``/v1/deployment`` every 2 s), the recent jobs (``/v1/jobs`` every 2 s) and one long job's view
  (its record every 2 s and its event stream, live: a stream more on the relay).

In both, that long job (2,000 tokens: about as long as a run) runs beside the workload, queued
before the run and cancelled after it; only the console open follows it.

- **console's requests:** the same polls and the same event stream from this process, with no
  browser: what the console asks of llmq, apart from what rendering costs the machine.

Reported per concurrency: the medians of each target's throughput, TTFT p50 and ITL p50, and the
web process's and the worker's CPU per token (the console's polls are the web process's work, so
they are in its figure), with the ratio to the console closed. The browser runs on the same two
cores here, niced (an operator's runs on another machine): its own CPU during the run is
reported too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx

from shared.config import load_settings
from tests.bench.cpu import by_role, children_map, cpu_seconds
from tests.bench.procs import load_average, markdown_table, report_head, save
from tests.bench.serving import TARGET_SETS, HttpTarget, requests_for, start_targets
from tests.bench.workload import prompts_for, run_workload

__all__ = ["main"]

TARGETS = ("console closed", "console's requests", "console open")
POLL_S = 2.0
PER_LANE = 32  # requests per lane and run: runs of several seconds, so a 2 s poll falls in each many times


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it (the browser's renderers, GPU and network processes)."""
    kids, out, stack = children_map(), [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(kids.get(p, ()))
    return out


def _tree_cpu(pid: int) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in _tree(pid))


def _lowest_priority(pid: int | None) -> None:
    """The browser stands for an operator's, which runs on another machine: on these two shared
    cores it takes only what the deployment leaves (nice 19), so what is measured is what its
    requests cost the deployment, not what rendering takes from the engine."""
    for p in _tree(pid) if pid else ():
        try:
            os.setpriority(os.PRIO_PROCESS, p, 19)
        except OSError:
            pass


@asynccontextmanager
async def console_open(d: HttpTarget, job_id: str) -> AsyncIterator[Callable[[], float]]:
    """The console open on three pages, every one loaded and polled once before this yields (so
    nothing of its start falls in the measured run): the overview, the recent jobs and the view of
    ``job_id``, a long job it follows live. Yields a function giving the browser's CPU seconds
    since it yielded."""
    from tests.support.browser import browser

    async with browser() as chromium:
        context = await chromium.new_context()  # no keys: a loopback browser is an operator
        for where in ("#/overview", "#/jobs", f"#/jobs/{job_id}"):
            await (await context.new_page()).goto(f"{d.url}/console{where}")
        await asyncio.sleep(POLL_S)  # every page has polled once
        pid = chromium_pid()
        _lowest_priority(pid)
        before = _tree_cpu(pid) if pid else 0.0
        yield lambda: (_tree_cpu(pid) - before) if pid else 0.0
        await context.close()


@asynccontextmanager
async def console_requests(d: HttpTarget, job_id: str) -> AsyncIterator[Callable[[], float]]:
    """What the console open on those three pages asks of llmq, without a browser: the same polls
    every 2 s and the same event stream, from this process (a few ms of its CPU per second)."""
    async with httpx.AsyncClient(base_url=d.url, timeout=30) as client:
        async def poll(path: str) -> None:
            while True:
                (await client.get(path)).raise_for_status()
                await asyncio.sleep(POLL_S)

        async def follow() -> None:
            async with client.stream("GET", f"/v1/jobs/{job_id}/events") as resp:
                async for _ in resp.aiter_bytes():
                    pass

        paths = ("/v1/access", "/v1/deployment", "/v1/jobs?limit=50", f"/v1/jobs/{job_id}/record")
        tasks = [asyncio.create_task(poll(p)) for p in paths] + [asyncio.create_task(follow())]
        await asyncio.sleep(POLL_S)
        try:
            yield lambda: 0.0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@asynccontextmanager
async def long_job(d: HttpTarget) -> AsyncIterator[str]:
    """A job about as long as a run, queued before it and cancelled after if still running: the one
    the console's job view follows. Queued for both targets, so each run shares the engine with it
    alike (a longer one would make every step's attention, and so the engine, slower)."""
    async with httpx.AsyncClient(base_url=d.url, timeout=30) as client:
        body = {"model": d.model, "prompt": "A long story", "sampling": {"max_tokens": 2000, "ignore_eos": True}}
        job_id = (await client.post("/v1/jobs", json=body)).json()["id"]
        while (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "queued":
            await asyncio.sleep(0.05)
        try:
            yield job_id
        finally:
            await client.delete(f"/v1/jobs/{job_id}")


def chromium_pid() -> int | None:
    """The newest Chromium browser process (the one this benchmark launched)."""
    best = None
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"chromium") and not any(a.startswith(b"--type=") for a in cmd):
                best = max(best or 0, int(entry))
    return best


IDLE_S = 20.0


async def idle_cost(d: HttpTarget) -> dict[str, float]:
    """Each role's CPU per second over IDLE_S with the console open and the queue idle, less the
    same with it closed: what its polls cost the deployment, apart from any load."""
    from tests.support.browser import browser

    assert d.meter is not None
    before = d.meter.sample()
    await asyncio.sleep(IDLE_S)
    closed = by_role(before, d.meter.sample())
    async with browser() as chromium:
        context = await chromium.new_context()
        for where in ("#/overview", "#/jobs", "#/tenants"):
            await (await context.new_page()).goto(f"{d.url}/console{where}")
        _lowest_priority(chromium_pid())
        before = d.meter.sample()
        await asyncio.sleep(IDLE_S)
        opened = by_role(before, d.meter.sample())
        await context.close()
    return {role: round((opened.get(role, 0.0) - closed.get(role, 0.0)) * 1000 / IDLE_S, 2)
            for role in sorted(set(opened) | set(closed))}


async def measure(rounds: int, concurrencies: Sequence[int], requests: int | None) -> tuple[list[dict], dict]:
    fast = TARGET_SETS["fast"]
    overlay = {**fast.overlay, "LLMQ_HEARTBEAT_S": "1"}
    settings = load_settings({**os.environ, **overlay})
    runs: list[dict] = []
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-console-")))
        # The Procfile's processes (web, worker, housekeeping) and Redis, metered per role.
        [d] = await start_targets(stack, settings, logs, ("llmq",), overlay)
        assert isinstance(d, HttpTarget) and d.meter is not None
        meter = d.meter
        idle = await idle_cost(d)
        print(f"the console's idle cost, CPU ms per second by role: {idle}", flush=True)
        for r in range(rounds):
            for c in concurrencies:
                prompts = prompts_for(requests_for(c, requests, PER_LANE, fast.least), tag=f"r{r}c{c}-")
                for target in TARGETS[r % 3:] + TARGETS[:r % 3]:
                    async with AsyncExitStack() as run_stack:
                        job_id = await run_stack.enter_async_context(long_job(d))
                        opened = {"console open": console_open, "console's requests": console_requests}
                        browser_s = (await run_stack.enter_async_context(opened[target](d, job_id))
                                     if target in opened else lambda: 0.0)
                        before = meter.sample()
                        _, summary = await run_workload(d.url, d.model, prompts, concurrency=c,
                                                        max_tokens=fast.max_tokens)
                        cpu = by_role(before, meter.sample())
                        browser_cpu = browser_s()
                    tokens = summary.completed * summary.max_tokens
                    row = {"round": r + 1, "concurrency": c, "target": target, "ok": summary.ok,
                           "tokens_per_s": summary.output_tokens_per_s, "ttft_p50_ms": summary.ttft_p50_ms,
                           "itl_p50_ms": summary.itl_p50_ms, "browser_cpu_s": round(browser_cpu, 3),
                           **{f"{role}_us_per_token": round(s * 1e6 / tokens, 1) for role, s in cpu.items()}}
                    runs.append(row)
                    print(f"round {r + 1} C={c:<3} {target:15} {row}", flush=True)
    return runs, idle


FIGURES = ("tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "api_us_per_token", "worker_us_per_token", "browser_cpu_s")


def medians(runs: list[dict], concurrencies: Sequence[int]) -> list[dict]:
    """Per concurrency and figure: each target's median, and its ratio to the console closed's."""
    out = []
    for c in concurrencies:
        by = {t: [r for r in runs if r["concurrency"] == c and r["target"] == t] for t in TARGETS}
        row: dict = {"concurrency": c}
        for figure in FIGURES:
            median = {t: statistics.median(r.get(figure, 0.0) for r in by[t]) for t in TARGETS}
            closed = median[TARGETS[0]]
            row[figure] = {t: {"median": round(m, 2), "ratio": round(m / closed, 3) if closed else None}
                           for t, m in median.items()}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.console", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--requests", type=int, default=None, help="per run (default: the fast set's)")
    p.add_argument("--out", default="bench-console.json")
    a = p.parse_args(argv)
    concurrencies = [int(c) for c in a.concurrency.split(",")]
    loads = [load_average()]
    runs, idle = asyncio.run(measure(a.rounds, concurrencies, a.requests))
    loads.append(load_average())
    table = medians(runs, concurrencies)
    report = {**report_head("console", "the streaming workload with the console closed and open", loads),
              "idle_cpu_ms_per_s": idle, "runs": runs, "medians": table}
    print(f"the console open on an idle queue, CPU ms per second by role: {idle}")
    rows = [[m["concurrency"], t, *(f"{m[f][t]['median']} ({m[f][t]['ratio']})" for f in FIGURES[:5]),
             m["browser_cpu_s"][t]["median"]] for m in table for t in TARGETS]
    save(report, a.out, markdown_table(["C", "target", "tok/s (ratio)", "TTFT p50 ms", "ITL p50 ms",
                                        "web CPU µs/token", "worker CPU µs/token", "browser CPU s"], rows))


if __name__ == "__main__":
    main()
