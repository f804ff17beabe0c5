"""The streaming workload: N requests at concurrency C against ``/v1/completions``.

Every request is greedy (temperature 0), ``ignore_eos`` with a fixed ``max_tokens``, streamed with
``stream_options.include_usage``. One ``httpx.AsyncClient`` (HTTP/1.1, a pool of at least C
connections) serves the whole run, so connection set-up is not measured per request.

Per request: TTFT (send -> first chunk carrying a choice), inter-chunk latencies (the gaps between
chunks carrying a choice), end-to-end time and the tokens received (the usage chunk's
``completion_tokens``; without one, the chunks counted). Servers may put several tokens in one
chunk, so ITL here is measured per chunk, as vLLM's own ``benchmark_serving`` does; TPOT
((e2e - TTFT) / (tokens - 1)) is the per-token figure. A request that does not end with exactly
``max_tokens`` tokens fails the run.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx
import msgspec

from tests.bench.procs import percentile

__all__ = ["RequestRecord", "Summary", "prompts_for", "run_workload", "summarize"]

_WORDS = ("river stone lantern orbit meadow copper violet harbor signal thunder quiet basket "
          "marble pepper window falcon garden silver ember canyon").split()


class RequestRecord(msgspec.Struct):
    """One request's timings (seconds) and what it returned."""

    ttft_s: float = 0.0
    itl_s: list[float] = msgspec.field(default_factory=list)
    e2e_s: float = 0.0
    tokens: int = 0
    chunks: int = 0
    error: str = ""

    def chunk(self, now: float, start: float, last: float) -> None:
        """A chunk carrying tokens arrived at ``now`` (``last``: the previous one's time)."""
        if self.chunks == 0:
            self.ttft_s = now - start
        else:
            self.itl_s.append(now - last)
        self.chunks += 1


class Summary(msgspec.Struct):
    """One run of the workload on one target: what the report tables show."""

    requests: int
    completed: int
    """Requests that ended with exactly max_tokens tokens."""
    ok: bool
    concurrency: int
    max_tokens: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_p50_ms: float
    tokens_per_chunk: float
    errors: list[str] = msgspec.field(default_factory=list)


def prompts_for(n: int, tag: str = "") -> list[str]:
    """``n`` distinct prompts of about 24 words: distinct so prefix caching flatters no target;
    ``tag`` (round, concurrency) keeps them distinct across runs on the same engine too."""
    out = []
    for i in range(n):
        words = [_WORDS[(i * 7 + j * (i % 5 + 1)) % len(_WORDS)] for j in range(20)]
        out.append(f"Request {tag}{i}: " + " ".join(words))
    return out


def summarize(records: Sequence[RequestRecord], *, concurrency: int, max_tokens: int, duration_s: float) -> Summary:
    good = [r for r in records if not r.error and r.tokens == max_tokens]
    bad = [r for r in records if r.error or r.tokens != max_tokens]
    itls = [x for r in good for x in r.itl_s]
    tpots = [(r.e2e_s - r.ttft_s) / (r.tokens - 1) for r in good if r.tokens > 1]
    chunks = sum(r.chunks for r in good)
    errors = sorted({r.error or f"{r.tokens} tokens, expected {max_tokens}" for r in bad})
    ms = 1000.0
    return Summary(
        requests=len(records),
        completed=len(good),
        ok=bool(records) and len(good) == len(records),
        concurrency=concurrency,
        max_tokens=max_tokens,
        duration_s=round(duration_s, 3),
        output_tokens_per_s=round(sum(r.tokens for r in good) / duration_s, 1) if duration_s else 0.0,
        requests_per_s=round(len(good) / duration_s, 3) if duration_s else 0.0,
        ttft_p50_ms=round(percentile([r.ttft_s for r in good], 50) * ms, 2),
        ttft_p99_ms=round(percentile([r.ttft_s for r in good], 99) * ms, 2),
        itl_p50_ms=round(percentile(itls, 50) * ms, 3),
        itl_p99_ms=round(percentile(itls, 99) * ms, 3),
        tpot_p50_ms=round(percentile(tpots, 50) * ms, 3),
        tokens_per_chunk=round(sum(r.tokens for r in good) / chunks, 3) if chunks else 0.0,
        errors=errors[:5],
    )


async def run_all(
    one: Callable[[str], Awaitable[RequestRecord]], prompts: Sequence[str], concurrency: int
) -> tuple[list[RequestRecord], float]:
    """``one`` over every prompt, at most ``concurrency`` at a time; the records and the wall time
    from the first send to the last answer. Shared by the HTTP client and the in-process target."""
    todo = iter(enumerate(prompts))
    records: list[RequestRecord | None] = [None] * len(prompts)

    async def lane() -> None:
        for i, prompt in todo:  # one shared iterator: a lane takes the next prompt when it is free
            try:
                records[i] = await one(prompt)
            except Exception as exc:  # one broken request fails the run, not the benchmark
                records[i] = RequestRecord(error=f"{type(exc).__name__}: {exc}"[:200])

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(min(concurrency, len(prompts)))))
    return [r for r in records if r is not None], time.perf_counter() - start


_chunk_decoder = msgspec.json.Decoder()


async def _one_http(client: httpx.AsyncClient, url: str, body: dict) -> RequestRecord:
    rec = RequestRecord()
    usage_tokens: int | None = None
    last = 0.0
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            rec.error = f"HTTP {resp.status_code}: {resp.text[:150]}"
            return rec
        # Read to the body's end, past [DONE]: a response closed before its end closes its
        # connection too (httpx), and every request would pay a new one, as vLLM's client does not.
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, keep-alive comments
            data = line[5:].strip()
            if data == "[DONE]":
                continue
            now = time.perf_counter()
            chunk = _chunk_decoder.decode(data)
            if "error" in chunk:
                rec.error = f"stream error: {str(chunk['error'])[:150]}"
                break
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            if chunk.get("choices"):
                rec.chunk(now, start, last)
                last = now
    rec.e2e_s = time.perf_counter() - start
    rec.tokens = usage_tokens if usage_tokens is not None else rec.chunks
    return rec


def request_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def run_workload(
    base_url: str, model: str, prompts: Sequence[str], *, concurrency: int, max_tokens: int,
    timeout_s: float = 600.0,
) -> tuple[list[RequestRecord], Summary]:
    """The workload against one OpenAI-compatible server at ``base_url`` (no ``/v1`` suffix)."""
    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        records, duration = await run_all(
            lambda p: _one_http(client, url, request_body(model, p, max_tokens)), prompts, concurrency
        )
    return records, summarize(records, concurrency=concurrency, max_tokens=max_tokens, duration_s=duration)


def median(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan
