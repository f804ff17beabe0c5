"""Target (c): the engine in-process, the limit neither server can beat.

A long-lived subprocess (``python -m tests.bench.inprocess``) that builds the engine exactly as an
llmq worker does (``VllmEngine.build`` from the same Settings, after the same
``apply_engine_environment``), then runs the workload straight on ``AsyncLLM.generate`` (DELTA
outputs), timing each request itself. The orchestrator drives it with JSON lines: one command on
stdin, one answer on stdout, so the engine loads once for the whole benchmark.

Protocol: it first writes ``{"ready": true}`` (after one warm-up request); then for each
``{"prompts": [...], "concurrency": C, "max_tokens": M}`` it writes
``{"records": [RequestRecord...], "duration_s": s}``; EOF on stdin ends it.

This is the only benchmark module that imports vLLM (inside ``main`` only, so importing the
module stays cheap). vLLM logs to stdout, so the protocol gets a private copy of fd 1 and fd 1
itself is pointed at stderr.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from typing import IO

import msgspec

from shared.config import DEFAULT_MODEL, load_settings
from tests.bench.workload import RequestRecord, run_all
from workers.environment import apply_engine_environment


class Command(msgspec.Struct):
    prompts: list[str]
    concurrency: int
    max_tokens: int


class Answer(msgspec.Struct):
    records: list[RequestRecord]
    duration_s: float


async def _serve(proto: IO[str]) -> None:
    settings = load_settings(engine_front="asyncllm")  # the workload runs on AsyncLLM itself
    if settings.model == DEFAULT_MODEL:
        from workers.tiny_model import ensure_tiny_model

        ensure_tiny_model(settings.model_path)
    apply_engine_environment(settings, os.environ)
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from workers.engine import VllmEngine

    engine = VllmEngine.build(settings, settings.model_path)
    llm = engine.engine.llm  # vLLM's AsyncLLM itself (the default front)

    async def one(prompt: str, max_tokens: int) -> RequestRecord:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        rec = RequestRecord()
        start = last = time.perf_counter()
        async for out in llm.generate(prompt, params, request_id=uuid.uuid4().hex, priority=0):
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if not n:
                continue
            rec.chunk(now, start, last)
            last = now
            rec.tokens += n
        rec.e2e_s = time.perf_counter() - start
        return rec

    try:
        await one("warm up", 8)  # the first request on CPU pays one-off compilation, as llmq's warm-up
        proto.write('{"ready": true}\n')
        loop = asyncio.get_running_loop()
        decoder = msgspec.json.Decoder(Command)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = decoder.decode(line)
            records, duration = await run_all(lambda p, m=cmd.max_tokens: one(p, m), cmd.prompts, cmd.concurrency)
            proto.write(msgspec.json.encode(Answer(records, duration)).decode() + "\n")
    finally:
        engine.shutdown()


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    asyncio.run(_serve(proto))


if __name__ == "__main__":
    main()
