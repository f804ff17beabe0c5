"""The three targets and the interleaved runs: llmq, vLLM's own OpenAI server, the engine in-process.

All three run the same model with the engine settings an llmq worker uses (``Settings`` from the
environment, as ``python -m workers`` reads them), are started once and stay up for the whole
benchmark, and are measured back to back in an order rotated each round, so slow drifts of the
shared machine fall on every target alike.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Protocol

import msgspec

from shared.config import DEFAULT_MODEL, Settings, apply_engine_environment
from shared.redis import redis_server_binary
from tests.bench.workload import RequestRecord, Summary, prompts_for, run_workload, summarize
from tests.conftest import REPO, free_port

__all__ = ["Run", "Target", "HttpTarget", "measure", "start_targets", "vllm_server_args"]

READY_TIMEOUT_S = 600.0  # three engines loading and warming up at once on 2 shared cores


class Run(msgspec.Struct):
    round: int
    target: str
    summary: Summary


class Target(Protocol):
    name: str

    async def run(self, prompts: Sequence[str], concurrency: int, max_tokens: int) -> Summary: ...


class HttpTarget:
    """Any OpenAI-compatible server: llmq, ``vllm serve``, or a deployment given by URL."""

    def __init__(self, name: str, url: str, model: str) -> None:
        self.name, self.url, self.model = name, url, model

    async def run(self, prompts: Sequence[str], concurrency: int, max_tokens: int) -> Summary:
        _, summary = await run_workload(self.url, self.model, prompts, concurrency=concurrency, max_tokens=max_tokens)
        return summary


class InProcessTarget:
    """Target (c): drives ``tests.bench.inprocess`` over its stdin/stdout."""

    name = "in-process"

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def ready(self) -> None:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the in-process engine exited before it was ready (see its log)")

    async def run(self, prompts: Sequence[str], concurrency: int, max_tokens: int) -> Summary:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        cmd = {"prompts": list(prompts), "concurrency": concurrency, "max_tokens": max_tokens}
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the in-process engine exited mid-run (see its log)")
        answer = msgspec.json.decode(line, type=dict[str, msgspec.Raw])
        records = msgspec.json.decode(answer["records"], type=list[RequestRecord])
        duration = msgspec.json.decode(answer["duration_s"], type=float)
        return summarize(records, concurrency=concurrency, max_tokens=max_tokens, duration_s=duration)


def requests_for(concurrency: int, requests: int | None) -> int:
    """N per run: a fixed number, or by default enough for each lane to run four requests."""
    return requests if requests else max(4 * concurrency, 16)


async def measure(
    targets: Sequence[Target], *, rounds: int, concurrencies: Sequence[int], requests: int | None,
    max_tokens: int, progress: bool = True,
) -> list[Run]:
    """For each round, for each concurrency, every target back to back, the order rotated per round.
    Every target gets the same prompts in a (round, concurrency) cell; prompts differ across cells,
    so a target's prefix cache never holds the next cell's prompts."""
    runs = []
    for r in range(rounds):
        for c in concurrencies:
            prompts = prompts_for(requests_for(c, requests), tag=f"r{r}c{c}-")
            k = r % len(targets)
            for target in [*targets[k:], *targets[:k]]:
                summary = await target.run(prompts, c, max_tokens)
                runs.append(Run(round=r + 1, target=target.name, summary=summary))
                if progress:
                    print(f"round {r + 1} C={c:<3} {target.name:<11} {summary.output_tokens_per_s:9.1f} tok/s "
                          f"TTFT p50 {summary.ttft_p50_ms:8.2f} ms  ITL p50 {summary.itl_p50_ms:7.3f} ms"
                          f"{'' if summary.ok else '  FAILED: ' + '; '.join(summary.errors)}",
                          file=sys.stderr, flush=True)
    return runs


# --- starting the targets -------------------------------------------------------------------------


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # A session of its own: stopping it stops its children too (vLLM's engine-core process).
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return


def _wait_stopped(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except Exception:
        return 0


async def _until_200(url: str, procs: Sequence[tuple[subprocess.Popen, Path]]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while await asyncio.to_thread(_status, url) != 200:
        dead = [log for p, log in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-2000:]}" for _, log in procs)
            raise RuntimeError(f"{url} did not become ready (exited: {[str(d) for d in dead]})\n{tails}")
        await asyncio.sleep(1)


def vllm_server_args(settings: Settings, port: int) -> list[str]:
    """``vllm serve``'s flags for the engine llmq's worker builds (workers/engine.py VllmEngine.build)."""
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", settings.model_path, "--served-model-name", settings.model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(settings.max_model_len), "--max-num-seqs", str(settings.max_num_seqs),
        "--scheduling-policy", "priority", "--disable-log-stats",
        # llmq logs no access line per request; neither should its peer.
        "--disable-uvicorn-access-log",
    ]
    if settings.kv_cache_bytes:
        args += ["--kv-cache-memory-bytes", str(settings.kv_cache_bytes)]
    if settings.eager:
        args.append("--enforce-eager")
    if settings.json_compact:
        args += ["--structured-outputs-config", '{"backend": "guidance", "disable_any_whitespace": true}']
    return args


def engine_env(settings: Settings) -> dict[str, str]:
    """The environment every target's engine gets: this one plus what llmq's worker sets on CPU."""
    env = dict(os.environ)
    apply_engine_environment(settings, env)
    return env


async def start_targets(
    stack: AsyncExitStack, settings: Settings, logs: Path, names: Sequence[str] = ("llmq", "vllm-serve", "in-process")
) -> list[Target]:
    """Start the named targets at once (engine loads overlap), wait until each is warm, and push
    their shutdown onto ``stack``."""
    if settings.model == DEFAULT_MODEL:
        from workers.tiny_model import ensure_tiny_model

        ensure_tiny_model(settings.model_path)
    env = engine_env(settings)
    procs: list[tuple[subprocess.Popen, Path]] = []

    def stop_all() -> None:
        for p, _ in procs:
            _stop(p)
        for p, _ in procs:
            _wait_stopped(p)

    stack.callback(stop_all)
    targets: dict[str, Target] = {}
    waits = []
    if "llmq" in names:
        redis_port, api_port = free_port(), free_port()
        (logs / "redis").mkdir(exist_ok=True)
        procs.append((_spawn([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(redis_port), "--dir",
                              str(logs / "redis"), "--save", "", "--appendonly", "no"], env, logs / "redis.log"),
                      logs / "redis.log"))
        llmq_env = {**env, "LLMQ_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                    "LLMQ_PREFIX": f"bench-{uuid.uuid4().hex[:6]}", "LLMQ_PORT": str(api_port),
                    "LLMQ_HOST": "127.0.0.1"}
        llmq_procs = [(_spawn([sys.executable, "-m", name], llmq_env, logs / f"llmq-{name}.log"),
                       logs / f"llmq-{name}.log") for name in ("workers", "api")]
        procs += llmq_procs
        url = f"http://127.0.0.1:{api_port}"
        targets["llmq"] = HttpTarget("llmq", url, settings.model_name)
        waits.append(_until_200(f"{url}/ping", procs[-3:]))
    if "vllm-serve" in names:
        port = free_port()
        log = logs / "vllm-serve.log"
        server = (_spawn(vllm_server_args(settings, port), env, log), log)
        procs.append(server)
        vllm = HttpTarget("vllm-serve", f"http://127.0.0.1:{port}", settings.model_name)
        targets["vllm-serve"] = vllm

        async def vllm_ready() -> None:
            await _until_200(f"{vllm.url}/health", [server])
            # One request first: the engine's first request on CPU pays one-off compilation, which
            # llmq's worker also pays before it reports ready.
            await vllm.run(["warm up"], 1, 8)

        waits.append(vllm_ready())
    if "in-process" in names:
        log = logs / "in-process.log"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.bench.inprocess", cwd=REPO, env=env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=log.open("wb"), start_new_session=True,
            limit=2**26,  # one answer line holds every record of a run
        )

        async def stop_inprocess() -> None:
            if proc.stdin is not None:
                proc.stdin.close()  # EOF: it shuts its engine down and exits
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()

        stack.push_async_callback(stop_inprocess)
        inproc = InProcessTarget(proc)
        targets["in-process"] = inproc
        waits.append(asyncio.wait_for(inproc.ready(), READY_TIMEOUT_S))
    await asyncio.gather(*waits)
    return [targets[n] for n in names]
