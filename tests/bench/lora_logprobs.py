"""What llmq's LoRA fixes (workers/lora_fixes.py) cost, on three engines in interleaved rounds.

Prompt logprobs and plain generations, timed in the engine's own process.

``python -m tests.bench.lora_logprobs [--rounds 5]``. Three long-lived engine processes, each
built as a worker builds its engine (``VllmEngine.build`` after ``apply_engine_environment``):

- **fixed**: LLMQ_MAX_LORAS=2 (rank 8) with every installed vLLM plugin, llmq's fixes included;
- **unfixed**: the same engine with no plugins (``VLLM_PLUGINS=""``): vLLM 0.32 as it comes;
- **no-lora**: LLMQ_MAX_LORAS=0, where neither fix does anything.

Workloads, all of the base model, each prompt distinct (~100 tokens: no prefix-cache hits):

- ``plp C=16``: 48 requests asking for 5 prompt logprobs and 1 token, 16 at a time: many prompts'
  logprobs per engine step, each now computed per request. Not on **unfixed**, whose engine dies
  of it (the bug).
- ``plp C=1``: 12 such requests one at a time, which vLLM survives alone (its one LoRA index
  broadcasts): the fix's own cost per request (one more mapping update per prompt, and back).
- ``plain C=16`` / ``plain C=1``: 48 (or 8) requests of 32 tokens without prompt logprobs: what
  the fixes cost everything else (the CPU ops' check for rows without an adapter; the runner's two
  attribute reads per step).

Each round runs every workload on every engine, the engines' order rotating; the report is each
metric's median over rounds (requests per second, median latency, and the engine processes' CPU
milliseconds per request, which the neighbours' load on a shared box moves much less than the
wall clock) and the ratios of medians (fixed/unfixed: the fixes; fixed/no-lora: LoRA's whole
price for those requests). Figures go to stdout as JSON, and to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

from tests.bench.procs import REPO

ENGINES = {
    "fixed": {"LLMQ_MAX_LORAS": "2", "LLMQ_MAX_LORA_RANK": "8"},
    "unfixed": {"LLMQ_MAX_LORAS": "2", "LLMQ_MAX_LORA_RANK": "8", "VLLM_PLUGINS": ""},
    "no-lora": {"LLMQ_MAX_LORAS": "0"},
}
# name -> (requests, concurrency, prompt_logprobs, max_tokens)
WORKLOADS = {
    "plp C=16": (48, 16, 5, 1),
    "plp C=1": (12, 1, 5, 1),
    "plain C=16": (48, 16, None, 32),
    "plain C=1": (8, 1, None, 32),
}
SKIP = {("unfixed", "plp C=16")}  # the bug itself: the engine dies
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()


def prompts(count: int, tag: str) -> list[str]:
    """``count`` distinct prompts of ~100 tokens (a tag first, so no two share a cached prefix)."""
    return [f"{tag}-{i} " + " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(48)) for i in range(count)]


# --- the engine process ----------------------------------------------------------------------------


async def _serve(proto) -> None:
    from shared.config import load_settings
    from workers.environment import apply_engine_environment
    from workers.tiny_model import ensure_tiny_model

    settings = load_settings(engine_front="asyncllm")  # the workload runs on AsyncLLM itself
    ensure_tiny_model(Path(settings.model_path))
    apply_engine_environment(settings, os.environ)
    from vllm import SamplingParams

    from workers.engine import VllmEngine

    engine = VllmEngine.build(settings, settings.model_path)
    llm = engine.engine.llm  # vLLM's AsyncLLM itself (the default front)

    async def one(prompt: str, plp: int | None, max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=plp)
        start = time.perf_counter()
        async for _ in llm.generate(prompt, params, request_id=uuid.uuid4().hex):
            pass
        return time.perf_counter() - start

    async def run(texts: list[str], concurrency: int, plp: int | None, max_tokens: int) -> dict:
        gate = asyncio.Semaphore(concurrency)

        async def gated(text: str) -> float:
            async with gate:
                return await one(text, plp, max_tokens)

        cpu, start = cpu_s(), time.perf_counter()
        latencies = await asyncio.gather(*(gated(t) for t in texts))
        return {"duration_s": time.perf_counter() - start, "cpu_s": cpu_s() - cpu, "latencies": latencies}

    try:
        await one("warm up", 2, 4)
        proto.write('{"ready": true}\n')
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            proto.write(json.dumps(await run(cmd["prompts"], cmd["concurrency"], cmd["prompt_logprobs"],
                                             cmd["max_tokens"])) + "\n")
    finally:
        engine.shutdown()


def cpu_s() -> float:
    """CPU seconds of this process and its children (the engine core) so far. On a shared box the
    wall clock moves with the neighbours' load; the engine's own CPU much less so."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def serve() -> None:
    # vLLM logs to stdout: the protocol gets a private copy of fd 1, and fd 1 goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    asyncio.run(_serve(proto))


# --- the orchestrator ------------------------------------------------------------------------------


class EngineProcess:
    def __init__(self, name: str, log: Path) -> None:
        self.name, self.log = name, log
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"} | ENGINES[self.name]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.bench.lora_logprobs", "--serve", cwd=REPO, env=env,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=self.log.open("w"))
        ready = await asyncio.wait_for(self.proc.stdout.readline(), 600)
        if not ready:
            raise RuntimeError(f"engine {self.name} did not start: see {self.log}")

    async def run(self, workload: str, tag: str) -> dict:
        count, concurrency, plp, max_tokens = WORKLOADS[workload]
        cmd = {"prompts": prompts(count, tag), "concurrency": concurrency, "prompt_logprobs": plp,
               "max_tokens": max_tokens}
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await self.proc.stdin.drain()
        answer = await asyncio.wait_for(self.proc.stdout.readline(), 600)
        if not answer:
            raise RuntimeError(f"engine {self.name} died in {workload}: see {self.log}")
        result = json.loads(answer)
        return {"req_per_s": count / result["duration_s"], "median_latency_s": statistics.median(result["latencies"]),
                "cpu_ms_per_req": 1000 * result["cpu_s"] / count}

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 60)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def measure(rounds: int, logs: Path, workloads: list[str]) -> dict:
    engines = [EngineProcess(name, logs / f"{name}.log") for name in ENGINES]
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for engine in engines:  # one at a time: three loads at once only slow each other down
            await engine.start()
        for r in range(rounds):
            order = engines[r % len(engines):] + engines[:r % len(engines)]
            for workload in workloads:
                for engine in order:
                    if (engine.name, workload) not in SKIP:
                        runs.setdefault((engine.name, workload), []).append(
                            await engine.run(workload, f"r{r}-{engine.name}"))
    finally:
        for engine in engines:
            await engine.stop()
    medians = {f"{e} | {w}": {k: statistics.median(run[k] for run in rs) for k in rs[0]}
               for (e, w), rs in runs.items()}
    ratios = {}
    for workload in workloads:
        fixed = medians[f"fixed | {workload}"]
        for other in ("unfixed", "no-lora"):
            if f"{other} | {workload}" in medians:
                theirs = medians[f"{other} | {workload}"]
                ratios[f"{workload}: fixed/{other}"] = {k: round(fixed[k] / theirs[k], 3) for k in fixed}
    return {"rounds": rounds, "medians": medians, "ratios": ratios,
            "runs": {f"{e} | {w}": rs for (e, w), rs in runs.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.lora_logprobs", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    p.add_argument("--out", type=Path, default=REPO / "bench-lora-logprobs.json")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # one engine process
    args = p.parse_args(argv)
    if args.serve:
        serve()
        return
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-lora-logprobs-{uuid.uuid4().hex[:6]}"
    logs.mkdir(parents=True)
    workloads = [w.strip() for w in args.workloads.split(",")]
    if unknown := [w for w in workloads if w not in WORKLOADS]:
        p.error(f"unknown workloads: {unknown}")
    report = asyncio.run(measure(args.rounds, logs, workloads))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"medians": report["medians"], "ratios": report["ratios"]}, indent=2))


if __name__ == "__main__":
    main()
