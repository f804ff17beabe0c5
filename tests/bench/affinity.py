"""Affinity in the pull, measured: conversations and LoRA adapters on two real workers, with it on
and off, and on one worker (issue 29's benchmark; docs/adapters.md#affinity).

``python -m tests.bench.affinity [--rounds 2]`` starts three deployments of llmq on the tiny
model (the fast set's engine, LoRA on: 4 adapters per engine), each with its own Redis, one web
process and its workers: ``one worker``, ``two, affinity on`` (LLMQ_AFFINITY_MS 50) and ``two,
affinity off`` (0). In each round, the deployments in turn (order rotated), two workloads:

- **conversations:** 8 at once, 6 turns each, one after another within a conversation as a chat
  client sends them (a long system prompt of its own, then each turn the last answer and a new
  user line): the prompt grows, and every turn's prefix is the last turn's prompt;
- **adapters:** 64 completions over 8 adapters of the tiny model, in a fixed random order, 8 at a
  time.

Each reports the engines' prefix-cache hit rate (vLLM's own count per request, ``num_cached_tokens``,
kept in each job's usage: the cached share of all prompt tokens), TTFT p50 and p99 (streamed, the
client's clock), output tokens/s, and the adapter loads of the workers' engines (their
``llmq_worker_adapter_loads_total``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import msgspec

from shared.config import DEFAULT_MODEL, load_settings
from shared.metrics import decode_samples
from tests.bench import serving
from tests.bench.procs import markdown_table, measured_report, percentile, save
from tests.bench.serving import TARGET_SETS

__all__ = ["main"]

DEPLOYMENTS = {"one worker": (1, "50"), "two, affinity on": (2, "50"), "two, affinity off": (2, "0")}
ADAPTERS = 8
BEAT_S = 1.5  # more than the workers' LLMQ_HEARTBEAT_S
_WORDS = ("river stone lantern orchard copper meadow harbor violet thunder ember glacier willow falcon "
          "saffron marble canyon juniper beacon cobalt prairie tide quartz hollow summit").split()


class Deployment(serving.Deployment):
    async def adapter_loads(self) -> int:
        total = 0
        async for key in self.redis.scan_iter(match=self.keys.worker_pattern(), _type="hash"):
            raw = await self.redis.hget(key, "metrics")
            total += sum(int(s.value) for s in decode_samples(raw or b"[]")
                         if s.name == "llmq_worker_adapter_loads_total")
        return total

    async def usage(self, job_ids: list[str]) -> tuple[int, int]:
        """(prompt tokens, of them cached) over the jobs' results."""
        pipe = self.redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(self.model, job_id), "result")
        prompt = cached = 0
        for raw in await pipe.execute():
            usage = msgspec.json.decode(raw or b"{}").get("usage", {})
            prompt += usage.get("prompt_tokens", 0)
            cached += usage.get("cached_tokens", 0)
        return prompt, cached


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, str, str, int]:
    """One streamed request: (TTFT s, job id, text, completion tokens)."""
    start = time.perf_counter()
    ttft, job_id, text, tokens = float("nan"), "", "", 0
    async with client.stream("POST", url, json={**body, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = msgspec.json.decode(line[6:])
            job_id = chunk["id"].split("-", 1)[1]
            for choice in chunk.get("choices") or ():
                piece = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    if ttft != ttft:
                        ttft = time.perf_counter() - start
                    text += piece
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft, job_id, text, tokens


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


async def conversations(d: Deployment, tag: str, n: int = 8, turns: int = 6) -> dict:
    results: list[tuple[float, str, int]] = []

    async def one(i: int) -> None:
        rng = random.Random(f"{tag}-{i}")
        messages = [{"role": "system", "content": f"Conversation {tag}-{i}. " + _words(rng, 150)}]
        async with httpx.AsyncClient(timeout=300) as client:
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Turn {turn}: " + _words(rng, 24)})
                ttft, job_id, text, tokens = await _stream(client, f"{d.url}/v1/chat/completions", {
                    "model": d.model, "messages": messages, "max_tokens": 32, "temperature": 0,
                    "ignore_eos": True})
                messages.append({"role": "assistant", "content": text})
                results.append((ttft, job_id, tokens))

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return await _summary(d, results, time.perf_counter() - start)


async def adapters(d: Deployment, tag: str, requests: int = 64, concurrency: int = 8) -> dict:
    rng = random.Random(tag)
    order = [f"lora-{rng.randrange(ADAPTERS)}" for _ in range(requests)]
    todo = iter(enumerate(order))
    results: list[tuple[float, str, int]] = []

    async def lane() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            for i, name in todo:
                results.append(await _one_completion(client, d, name, tag, i, rng))

    await asyncio.sleep(BEAT_S)  # the workers' counters reach Redis with their next heartbeat
    loads = await d.adapter_loads()
    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    summary = await _summary(d, results, time.perf_counter() - start)
    await asyncio.sleep(BEAT_S)
    return {**summary, "adapter_loads": await d.adapter_loads() - loads}


async def _one_completion(client: httpx.AsyncClient, d: Deployment, name: str, tag: str, i: int,
                          rng: random.Random) -> tuple[float, str, int]:
    ttft, job_id, _, tokens = await _stream(client, f"{d.url}/v1/completions", {
        "model": name, "prompt": f"Request {tag}-{i}: " + _words(rng, 16), "max_tokens": 16, "temperature": 0,
        "ignore_eos": True})
    return ttft, job_id, tokens


async def _summary(d: Deployment, results: list[tuple[float, str, int]], wall_s: float) -> dict:
    ttfts = [r[0] * 1000 for r in results]
    prompt, cached = await d.usage([r[1] for r in results])
    return {"requests": len(results), "prefix_cache_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "ttft_p50_ms": round(percentile(ttfts, 50), 2), "ttft_p99_ms": round(percentile(ttfts, 99), 2),
            "tokens_per_s": round(sum(r[2] for r in results) / wall_s, 1)}


async def measure(rounds: int) -> dict:
    # A longer context than the fast set's: a conversation's last turns run past 2,048 tokens.
    overlay = {**TARGET_SETS["fast"].overlay, "LLMQ_MAX_MODEL_LEN": "4096", "LLMQ_MAX_LORAS": "4",
               "LLMQ_MAX_LORA_RANK": "8", "LLMQ_HEARTBEAT_S": "1"}
    settings = load_settings({**os.environ, **overlay})
    if settings.model == DEFAULT_MODEL:
        from workers.tiny_model import build_tiny_adapter, ensure_tiny_model

        ensure_tiny_model(settings.model_path)
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-affinity-")))
        lora_dirs = {f"lora-{i}": build_tiny_adapter(logs / f"lora-{i}", seed=100 + i) for i in range(ADAPTERS)}
        overlay["LLMQ_ADAPTER_ROOTS"] = str(logs)  # the API and the workers load adapters from under it only
        deployments = list(await asyncio.gather(*(
            serving.start_deployment(stack, name, logs, overlay, {"LLMQ_AFFINITY_MS": ms}, workers, Deployment)
            for name, (workers, ms) in DEPLOYMENTS.items())))
        async with httpx.AsyncClient(timeout=30) as client:
            for d in deployments:
                for name, path in lora_dirs.items():
                    resp = await client.post(f"{d.url}/v1/load_lora_adapter",
                                             json={"lora_name": name, "lora_path": str(path)})
                    assert resp.status_code == 200, resp.text
        runs: list[dict] = []
        for r in range(rounds):
            for d in deployments[r % 3:] + deployments[:r % 3]:  # the order rotated each round
                for workload in (conversations, adapters):
                    result = await workload(d, f"r{r}")
                    runs.append({"round": r, "deployment": d.name, "workload": workload.__name__, **result})
                    print(f"round {r} {d.name:18} {workload.__name__:13} {result}", flush=True)
    medians: dict[tuple[str, str], dict] = {}
    for key in {(run["deployment"], run["workload"]) for run in runs}:
        mine = [run for run in runs if (run["deployment"], run["workload"]) == key]
        medians[key] = {field: round(statistics.median(run[field] for run in mine), 4)
                        for field in ("prefix_cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "tokens_per_s",
                                      "adapter_loads") if field in mine[0]}
    return {"runs": runs, "medians": [{"deployment": d, "workload": w, **m} for (d, w), m in sorted(medians.items())]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.affinity", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--out", default="bench-affinity.json")
    a = p.parse_args(argv)
    report = measured_report("affinity", "conversations and adapters on two workers, affinity on and off",
                             measure(a.rounds))
    rows = [[m["workload"], m["deployment"], m["prefix_cache_hit_rate"], m["ttft_p50_ms"], m["ttft_p99_ms"],
             m["tokens_per_s"], m.get("adapter_loads", "")] for m in report["medians"]]
    save(report, a.out, markdown_table(["workload", "deployment", "prefix-cache hit rate", "TTFT p50 ms",
                                        "TTFT p99 ms", "tok/s", "adapter loads"], rows))


if __name__ == "__main__":
    main()
