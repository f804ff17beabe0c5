"""The three targets and the interleaved runs: llmq, vLLM's own OpenAI server, the engine in-process.

All of them run the same model with the engine settings an llmq worker uses (``Settings`` from the
environment, as ``python -m workers`` reads them, plus the engine environment it sets), are
started once and stay up for the whole benchmark, and are measured back to back in an order
rotated each round, so slow drifts of the shared machine fall on every target alike.

Around every run, each started target's processes are sampled for CPU time (tests/bench/cpu.py):
the measured target's by role, the others' (idle, but on the same cores) as one figure.
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
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Protocol, TypeVar

import httpx
import msgspec
from redis.asyncio import Redis

from shared.config import DEFAULT_MODEL, TINY_POOLING_DIRS, Settings, load_settings
from shared.keys import Keys
from shared.redis import redis_server_binary
from tests.bench.cpu import CpuMeter, ProcessCpu, by_role
from tests.bench.workload import RequestRecord, Summary, prompts_for, run_workload, summarize
from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from workers.environment import apply_engine_environment, eager

__all__ = ["Run", "Target", "HttpTarget", "TargetSet", "TARGET_SETS", "measure", "start_targets", "vllm_server_args",
           "engine_env", "engine_record",
           "owned_processes", "spawn_redis", "LLMQ_TARGETS", "Deployment", "start_deployment"]

READY_TIMEOUT_S = 600.0  # three engines loading and warming up at once on 2 shared cores


class TargetSet(msgspec.Struct, frozen=True):
    """A standard configuration of the benchmark: which targets, which engine, which workload."""

    name: str
    targets: tuple[str, ...]
    overlay: dict[str, str]
    """Environment over the caller's, read by the benchmark's Settings and given to every target
    (``LLMQ_*`` for the engine settings an llmq worker reads, plus torch's and vLLM's own)."""
    max_tokens: int
    rounds: int
    concurrency: str
    per_lane: int
    """Requests per run by default: max(per_lane * C, least)."""
    least: int


# The performance issue's engine (issue 15): fast per token, as a GPU is, so what the serving
# path costs per token is not hidden behind the engine. Every value is pinned, whatever this
# host's defaults are. VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM's CPU executor inside the
# engine-core process: AsyncLLM still runs that process apart from its front end (titled
# VLLM::EngineCore), which is the topology of one engine on one GPU; "1" would add a
# VLLM::Worker process polling shared memory beside it, a CPU-only extra (docs/benchmarks.md).
FAST = TargetSet(
    name="fast", targets=("llmq", "vllm-serve"),
    overlay={"LLMQ_MODEL": DEFAULT_MODEL, "LLMQ_MAX_NUM_SEQS": "64", "LLMQ_MAX_MODEL_LEN": "2048",
             "LLMQ_KV_CACHE_GIB": "1", "LLMQ_ENFORCE_EAGER": "true", "OMP_NUM_THREADS": "1",
             "TORCHDYNAMO_DISABLE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    max_tokens=64, rounds=5, concurrency="1,16,64", per_lane=8, least=32,
)
# Today's: whatever engine an llmq worker on this host builds from the environment, three targets.
DEFAULT = TargetSet(name="default", targets=("llmq", "vllm-serve", "in-process"), overlay={}, max_tokens=32,
                    rounds=3, concurrency="1,16,64", per_lane=4, least=16)
TARGET_SETS = {t.name: t for t in (DEFAULT, FAST)}


class Run(msgspec.Struct):
    round: int
    target: str
    summary: Summary
    cpu_s: dict[str, float] = msgspec.field(default_factory=dict)
    """CPU seconds each of the target's process roles used during the run (tests/bench/cpu.py);
    empty when the benchmark did not start the target (``--url``)."""
    idle_cpu_s: float = 0.0
    """CPU seconds the other started targets' processes used meanwhile: what an idle neighbour
    took from the two cores."""
    client_cpu_s: float = 0.0
    """CPU seconds of the benchmark's own process (the HTTP client) during the run."""


class Target(Protocol):
    name: str
    meter: CpuMeter | None

    async def run(self, prompts: Sequence[str], concurrency: int, max_tokens: int) -> Summary: ...


class Client(Protocol):
    """What sends a run's requests to an HTTP target: the project's client (:func:`project_client`)
    or vLLM's own (tests/bench/vllm_client.py)."""

    async def __call__(self, url: str, model: str, prompts: Sequence[str], concurrency: int,
                       max_tokens: int) -> Summary: ...


async def project_client(url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int) -> Summary:
    _, summary = await run_workload(url, model, prompts, concurrency=concurrency, max_tokens=max_tokens)
    return summary


class HttpTarget:
    """Any OpenAI-compatible server: llmq, ``vllm serve``, or a deployment given by URL."""

    def __init__(self, name: str, url: str, model: str, meter: CpuMeter | None = None,
                 client: Client = project_client) -> None:
        self.name, self.url, self.model, self.meter, self.client = name, url, model, meter, client

    async def run(self, prompts: Sequence[str], concurrency: int, max_tokens: int) -> Summary:
        return await self.client(self.url, self.model, prompts, concurrency, max_tokens)


class InProcessTarget:
    """Target (c): drives ``tests.bench.inprocess`` over its stdin/stdout."""

    name = "in-process"

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        # The driver holds AsyncLLM's front end and the client; the engine core is its child.
        self.meter: CpuMeter | None = CpuMeter({"driver": proc.pid})

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


def requests_for(concurrency: int, requests: int | None, per_lane: int = 4, least: int = 16) -> int:
    """N per run: a fixed number, or by default enough for each lane to run ``per_lane`` requests."""
    return requests if requests else max(per_lane * concurrency, least)


def _samples(targets: Sequence[Target]) -> dict[str, list[ProcessCpu]]:
    return {t.name: t.meter.sample() for t in targets if t.meter is not None}


async def measure(
    targets: Sequence[Target], *, rounds: int, concurrencies: Sequence[int], requests: int | None,
    max_tokens: int, progress: bool = True, per_lane: int = 4, least: int = 16,
) -> list[Run]:
    """For each round, for each concurrency, every target back to back, the order rotated per round.
    Every target gets the same prompts in a (round, concurrency) cell; prompts differ across cells,
    so a target's prefix cache never holds the next cell's prompts. Every run samples every
    started target's CPU time before and after (a few /proc reads, outside the timed window)."""
    runs = []
    for r in range(rounds):
        for c in concurrencies:
            prompts = prompts_for(requests_for(c, requests, per_lane, least), tag=f"r{r}c{c}-")
            k = r % len(targets)
            for target in [*targets[k:], *targets[:k]]:
                before, client_before = _samples(targets), time.process_time()
                summary = await target.run(prompts, c, max_tokens)
                client_s, after = time.process_time() - client_before, _samples(targets)
                own = by_role(before.get(target.name, ()), after.get(target.name, ()))
                idle = sum(s for name in after if name != target.name
                           for s in by_role(before[name], after[name]).values())
                runs.append(Run(round=r + 1, target=target.name, summary=summary, cpu_s=own,
                                idle_cpu_s=round(idle, 4), client_cpu_s=round(client_s, 4)))
                if progress:
                    print(f"round {r + 1} C={c:<3} {target.name:<11} {summary.output_tokens_per_s:9.1f} tok/s "
                          f"TTFT p50 {summary.ttft_p50_ms:8.2f} ms  ITL p50 {summary.itl_p50_ms:7.3f} ms"
                          f"{_cpu_line(own, summary)}"
                          f"{'' if summary.ok else '  FAILED: ' + '; '.join(summary.errors)}",
                          file=sys.stderr, flush=True)
    return runs


def _cpu_line(cpu_s: dict[str, float], summary: Summary) -> str:
    tokens = summary.completed * summary.max_tokens
    if not cpu_s or not tokens:
        return ""
    return "  CPU us/token " + " ".join(f"{role} {s * 1e6 / tokens:.0f}" for role, s in cpu_s.items())


# --- starting the targets -------------------------------------------------------------------------


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # A session of its own: stopping it stops its children too (vLLM's engine-core process).
    return spawn_logged(args, log, cwd=REPO, env=env, start_new_session=True)


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


def owned_processes(stack: AsyncExitStack) -> list[tuple[subprocess.Popen, Path]]:
    """A list of (process, log) that ``stack`` stops when it closes: each process's session is
    sent SIGTERM, then every one is waited for (SIGKILL after 30 s)."""
    procs: list[tuple[subprocess.Popen, Path]] = []

    def stop_all() -> None:
        for p, _ in procs:
            _stop(p)
        for p, _ in procs:
            _wait_stopped(p)

    stack.callback(stop_all)
    return procs


def spawn_redis(port: int, data_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    """A throwaway redis-server for a benchmark's llmq (no persistence), logging beside its data."""
    data_dir.mkdir(exist_ok=True)
    log = data_dir.parent / f"{data_dir.name}.log"
    return _spawn([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data_dir),
                   "--save", "", "--appendonly", "no"], env, log), log


class Deployment:
    """One llmq a benchmark started (:func:`start_deployment`): its own Redis, workers and web
    process, and a client of that Redis."""

    def __init__(self, name: str, url: str, redis_url: str, prefix: str, model: str) -> None:
        self.name, self.url, self.prefix, self.model = name, url, prefix, model
        self.redis = Redis.from_url(redis_url)
        self.keys = Keys(prefix)


D = TypeVar("D", bound=Deployment)


async def start_deployment(stack: AsyncExitStack, name: str, logs: Path, overlay: dict[str, str],
                           settings: Mapping[str, str], workers: int = 1, kind: type[D] = Deployment) -> D:
    """Start ``name``'s Redis, ``workers`` workers and one web process (each logging under
    ``logs``/<name>), on the engine ``overlay`` sets, with ``settings`` (``LLMQ_*``) over it; stopped
    when ``stack`` closes. Returns once every worker is warm."""
    engine = load_settings({**os.environ, **overlay})
    redis_port, api_port = free_port(), free_port()
    here = logs / name.replace(" ", "-").replace(",", "")
    here.mkdir()
    prefix = f"{here.name[:8]}-{uuid.uuid4().hex[:6]}"
    env = {**engine_env(engine, overlay), "LLMQ_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "LLMQ_PREFIX": prefix, "LLMQ_PORT": str(api_port), "LLMQ_HOST": "127.0.0.1", **settings}
    procs = owned_processes(stack)
    procs.append(spawn_redis(redis_port, here / "redis", env))
    for role, log in [*(("workers", here / f"worker{i}.log") for i in range(workers)), ("api", here / "api.log")]:
        procs.append((_spawn([sys.executable, "-m", role], env, log), log))
    url = f"http://127.0.0.1:{api_port}"
    await _until_200(f"{url}/ping", procs)
    deployment = kind(name, url, env["LLMQ_REDIS_URL"], prefix, engine.model_name)
    stack.push_async_callback(deployment.redis.aclose)
    async with httpx.AsyncClient() as client:
        while (await client.get(f"{url}/ping")).json().get("ready_workers", 0) < workers:
            await asyncio.sleep(1)
    return deployment


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
        # A pooling model (LLMQ_MODEL_KIND) on the pooling runner, as llmq's worker serves it.
        *(["--runner", "pooling"] if settings.kind != "generate" else []),
    ]
    if settings.kv_cache_bytes:
        args += ["--kv-cache-memory-bytes", str(settings.kv_cache_bytes)]
    if eager(settings):
        args.append("--enforce-eager")
    if settings.stream_interval != 1:
        args += ["--stream-interval", str(settings.stream_interval)]
    if settings.json_compact:
        args += ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']
    # The same output parsers as llmq's worker (workers/parsing.py).
    if settings.tool_parser_name:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", settings.tool_parser_name,
                 "--tool-strict-level", settings.tool_strictness]
    if settings.reasoning_parser_name:
        args += ["--reasoning-parser", settings.reasoning_parser_name]
    if settings.hf_overrides:
        args += ["--hf-overrides", json.dumps(settings.hf_overrides)]
    if settings.max_loras:  # LoRA adapters (docs/adapters.md)
        args += ["--enable-lora", "--max-loras", str(settings.max_loras),
                 "--max-lora-rank", str(settings.max_lora_rank)]
        if settings.max_cpu_loras:
            args += ["--max-cpu-loras", str(settings.max_cpu_loras)]
    if settings.world_size > 1:  # one engine over several devices (docs/operations.md#sizing)
        args += ["--tensor-parallel-size", str(settings.tensor_parallel_size),
                 "--pipeline-parallel-size", str(settings.pipeline_parallel_size)]
    if settings.executor_backend:
        args += ["--distributed-executor-backend", settings.executor_backend]
    return args


# The engine environment a report records: what moves the engine's speed on a CPU host.
ENGINE_VARIABLES = ("OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE", "VLLM_ENABLE_V1_MULTIPROCESSING",
                    "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")


def engine_record(settings: Settings, overlay: Mapping[str, str] | None = None) -> dict[str, object]:
    """The engine the started targets share, as a report's settings record it."""
    env = engine_env(settings, overlay)
    return {"model": settings.model_name, "model_path": settings.model_path, "max_num_seqs": settings.max_num_seqs,
            "max_model_len": settings.max_model_len, "kv_cache_bytes": settings.kv_cache_bytes,
            "enforce_eager": eager(settings), "stream_interval": settings.stream_interval,
            "scheduling_policy": "priority", "environment": {k: env.get(k) for k in ENGINE_VARIABLES}}


def engine_env(settings: Settings, overlay: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment every target's engine gets: this one, then ``overlay`` (a target set's),
    then what llmq's worker sets on CPU where neither set it."""
    env = {**os.environ, **(overlay or {})}
    apply_engine_environment(settings, env)
    return env


# llmq as the benchmark runs it, by target name: the settings each adds to the engine's environment.
# ``llmq-asyncllm`` is the worker on vLLM's AsyncLLM front end (LLMQ_ENGINE_FRONT, kept for one
# release beside the engine loop that is the default: docs/benchmarks.md#engine-front).
LLMQ_TARGETS: dict[str, dict[str, str]] = {"llmq": {}, "llmq-asyncllm": {"LLMQ_ENGINE_FRONT": "asyncllm"}}


def _spawn_llmq(name: str, env: dict[str, str], logs: Path,
                model: str) -> tuple[HttpTarget, list[tuple[subprocess.Popen, Path]]]:
    """The Procfile's three processes (web, worker and housekeeping: its sweeps cost CPU too) and a
    redis-server of their own, logging under ``logs`` as ``name``."""
    redis_port, api_port = free_port(), free_port()
    redis, redis_log = spawn_redis(redis_port, logs / f"{name}-redis", env)
    llmq_env = {**env, "LLMQ_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
                "LLMQ_PREFIX": f"bench-{uuid.uuid4().hex[:6]}", "LLMQ_PORT": str(api_port), "LLMQ_HOST": "127.0.0.1"}
    modules = {"worker": "workers", "api": "api", "housekeeping": "workers.housekeeping"}
    spawned = {role: (_spawn([sys.executable, "-m", module], llmq_env, logs / f"{name}-{role}.log"),
                      logs / f"{name}-{role}.log") for role, module in modules.items()}
    meter = CpuMeter({"api": spawned["api"][0].pid, "worker": spawned["worker"][0].pid, "redis": redis.pid,
                      "housekeeping": spawned["housekeeping"][0].pid})
    return (HttpTarget(name, f"http://127.0.0.1:{api_port}", model, meter),
            [(redis, redis_log), *spawned.values()])


async def start_targets(
    stack: AsyncExitStack, settings: Settings, logs: Path, names: Sequence[str] = ("llmq", "vllm-serve", "in-process"),
    overlay: Mapping[str, str] | None = None,
) -> list[Target]:
    """Start the named targets at once (engine loads overlap), wait until each is warm, and push
    their shutdown onto ``stack``. ``settings`` must be read from the same ``overlay``."""
    if unknown := set(names) - {*LLMQ_TARGETS, "vllm-serve", "in-process"}:
        raise SystemExit(f"no such target: {', '.join(sorted(unknown))}")
    if settings.model == DEFAULT_MODEL:
        from workers.tiny_model import ensure_tiny_model

        ensure_tiny_model(settings.model_path)
    elif settings.model in TINY_POOLING_DIRS:
        from workers.tiny_pooling import ensure_tiny_pooling

        ensure_tiny_pooling(settings.model, Path(settings.model_path))
    env = engine_env(settings, overlay)
    procs = owned_processes(stack)
    targets: dict[str, Target] = {}
    waits = []
    for name in (n for n in names if n in LLMQ_TARGETS):
        target, procs_of = _spawn_llmq(name, {**env, **LLMQ_TARGETS[name]}, logs, settings.model_name)
        procs += procs_of
        targets[name] = target
        waits.append(_until_200(f"{target.url}/ping", procs_of))
    if "vllm-serve" in names:
        port = free_port()
        log = logs / "vllm-serve.log"
        server = (_spawn(vllm_server_args(settings, port), env, log), log)
        procs.append(server)
        vllm = HttpTarget("vllm-serve", f"http://127.0.0.1:{port}", settings.model_name,
                          CpuMeter({"api-server": server[0].pid}))
        targets["vllm-serve"] = vllm

        async def vllm_ready() -> None:
            await _until_200(f"{vllm.url}/health", [server])
            # One request first: the engine's first request on CPU pays one-off compilation, which
            # llmq's worker also pays before it reports ready.
            if settings.kind == "generate":
                await vllm.run(["warm up"], 1, 8)
            else:
                async with httpx.AsyncClient(timeout=120) as client:
                    path, body = (("/v1/embeddings", {"input": "warm up"}) if settings.kind == "embed"
                                  else ("/score", {"text_1": "warm", "text_2": "up"}))
                    (await client.post(f"{vllm.url}{path}", json={"model": settings.model_name, **body})
                     ).raise_for_status()

        waits.append(vllm_ready())
    if "in-process" in names:
        log = logs / "in-process.log"
        with log.open("wb") as err:  # the child has its own copy
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.bench.inprocess", cwd=REPO, env=env, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=err, start_new_session=True,
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
