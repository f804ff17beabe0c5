"""What a tool call costs: CPU per chat request with and without tools, by process.

``python -m tests.bench.tools`` starts the fast set's llmq and ``vllm serve`` (the same engine and
the same output parsers: ``--enable-auto-tool-choice --tool-call-parser hermes``), then sends,
in alternated rounds, non-streamed chat requests of two kinds at ``--concurrency``:

- ``tools``: a chat offering one strict function tool with ``tool_choice: required`` and one
  call allowed: the template renders the tool, the engine compiles and follows the tools'
  grammar, the worker parses the call with vLLM's parser, and the dialect renders it;
- ``plain``: the same chat without the tool, generating as many tokens as a tools request did
  (the warm-up's median, ``ignore_eos``), so the two differ by the tool alone.

Per target and role (api, worker, redis, engine; ``vllm serve``'s front end as its api) it
reports the median CPU µs per request of each kind, and per request the completion tokens, so a
difference in generated length is visible beside the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import httpx

from shared.config import load_settings
from tests.bench.cpu import by_role
from tests.bench.procs import markdown_table, measured_report, save
from tests.bench.serving import TARGET_SETS, HttpTarget, start_targets

__all__ = ["main"]

ROLES = ("api", "worker", "redis", "engine")
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}


def body(model: str, kind: str, i: int, max_tokens: int) -> dict:
    chat = {"model": model, "messages": [{"role": "user", "content": f"Weather in Paris? ({i})"}],
            "max_tokens": max_tokens, "temperature": 0}
    if kind == "tools":
        return chat | {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    return chat | {"ignore_eos": True}


async def _run(target: HttpTarget, kind: str, n: int, concurrency: int, max_tokens: int) -> tuple[dict, float, float]:
    """CPU µs per request of ``n`` requests of ``kind``, by role, their median completion tokens,
    and the share of them that ended with a complete tool call (``vllm serve`` lets the tiny
    model pad a call's JSON with whitespace until ``max_tokens``; llmq's worker holds it to one
    character, LLMQ_COMPACT_JSON)."""
    assert target.meter is not None
    todo = iter(range(n))
    tokens: list[int] = []
    errors: list[str] = []
    called = 0

    async def lane(client: httpx.AsyncClient) -> None:
        nonlocal called
        for i in todo:
            resp = await client.post(f"{target.url}/v1/chat/completions",
                                     json=body(target.model, kind, i + int(time.time()), max_tokens))
            if resp.status_code != 200:
                errors.append(f"{resp.status_code} {resp.text[:150]}")
                continue
            answer = resp.json()
            called += bool(answer["choices"][0]["message"].get("tool_calls"))
            tokens.append(answer["usage"]["completion_tokens"])

    before = target.meter.sample()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(lane(client) for _ in range(concurrency)))
    used = by_role(before, target.meter.sample())
    used["api"] = used.get("api", 0.0) + used.get("api-server", 0.0)  # vllm serve's front end
    if errors:
        raise SystemExit(f"FAILED ({target.name}, {kind}): {errors[:3]}")
    return {role: used.get(role, 0.0) / n * 1e6 for role in ROLES}, statistics.median(tokens), called / n


async def measure(rounds: int, concurrency: int, requests: int, max_tokens: int,
                  names: Sequence[str] = ("llmq", "vllm-serve")) -> dict:
    fast = TARGET_SETS["fast"]
    settings = load_settings({**os.environ, **fast.overlay})
    out: dict = {}
    async with AsyncExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-tools-")))
        targets = await start_targets(stack, settings, logs, names, fast.overlay)
        samples = {(t.name, kind): {r: [] for r in (*ROLES, "tokens", "called")} for t in targets
                   for kind in ("plain", "tools")}
        plain_tokens = max_tokens
        for t in targets:  # warm: the grammar compiler and the parser's first use
            assert isinstance(t, HttpTarget)
            _, tokens, _ = await _run(t, "tools", concurrency, concurrency, max_tokens)
            if t.name == names[0]:
                plain_tokens = max(1, round(tokens))
        for r in range(rounds):  # alternated, so a noisy spell falls on both kinds and targets
            order = [(t, kind) for t in targets for kind in ("plain", "tools")]
            for t, kind in order if r % 2 == 0 else reversed(order):
                budget = plain_tokens if kind == "plain" else max_tokens
                cpu, tokens, called = await _run(t, kind, requests, concurrency, budget)  # type: ignore[arg-type]
                into = samples[(t.name, kind)]
                for role, us in cpu.items():
                    into[role].append(us)
                into["tokens"].append(tokens)
                into["called"].append(called)
    for (name, kind), into in samples.items():
        out.setdefault(name, {})[kind] = {k: round(statistics.median(v), 1) for k, v in into.items()}
    return {"concurrency": concurrency, "requests_per_run": requests, "rounds": rounds, "max_tokens": max_tokens,
            "cpu_us_per_request": out}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.tools", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="runs of each kind, alternated (default 4)")
    p.add_argument("--concurrency", type=int, default=16, help="requests at once (default 16)")
    p.add_argument("--requests", type=int, default=128, help="requests per run (default 128)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    p.add_argument("--targets", default="llmq,vllm-serve",
                   help="comma-separated, the first setting the plain requests' length (default llmq,vllm-serve)")
    p.add_argument("--out", default="bench-tools.json")
    a = p.parse_args(argv)
    report = measured_report("tools", "CPU per chat request with and without a tool call, by process",
                             measure(a.rounds, a.concurrency, a.requests, a.max_tokens, a.targets.split(",")))
    rows = []
    for name, kinds in report["cpu_us_per_request"].items():
        for kind, figures in kinds.items():
            rows.append([name, kind, *(figures[r] for r in ROLES), figures["tokens"], figures["called"]])
    table = markdown_table(["target", "request", *(f"{r} µs" for r in ROLES), "tokens", "called"], rows)
    save(report, a.out, f"{table}\n\nC={a.concurrency}, non-streamed chat, max_tokens {a.max_tokens}")


if __name__ == "__main__":
    main()
