"""Images (issue 45): vLLM's own client with random images, llmq against ``vllm serve``, both on
``tiny-vision``.

    python -m tests.bench.images            # 2 interleaved rounds at C=1,16 (make bench): bench-images.json
    python -m tests.bench.images --quick    # 1 round of 16 requests per run: the path end to end

Starts one llmq (its own Redis, one web process, one worker) with ``LLMQ_MODEL=tiny-vision``, and
``vllm serve`` on the same model directory (workers/tiny_vision.py builds it), both on the fast set's
pinned engine (tests/bench/serving.py: eager, 64 slots, 1 GiB of KV cache, one OpenMP thread).
vLLM's chat path takes the model's chat template from its tokenizer, and its default limit of 999
images per prompt needs no flag, as llmq's worker passes none.

Each run is one ``vllm bench serve`` (tests/bench/vllm_client.py) with ``--backend openai-chat``
on ``/v1/chat/completions`` and ``--dataset-name random-mm``: per request a user turn of 16
random text tokens and one image (a random-pixel JPEG as a base64 data URL, 64×48 or 100×30 with
equal odds: 19 and 12 of tiny-vision's tokens), 32 tokens out with ``ignore_eos``, greedy. Each
round, at C=1 and C=16, both targets in turn (the order rotated each round) get the same requests
(the same seed per cell; every cell's differ, so no cache holds the next cell's images).

Per target and concurrency: completed and failed requests (summed across rounds: issue 45's bar is
that llmq completes every one), request throughput, output tokens a second, TTFT p50/p99 (medians
across rounds), and llmq / ``vllm serve`` of each median. A request is completed when it returned
all 32 tokens. The prompt's tokens as each server counted them (its ``usage``) are recorded, so a
target that saw a different prompt shows.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import json
import os
import statistics
import sys
import tempfile
import zlib
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import httpx
import msgspec

from shared.config import VISION_MODEL, Settings, load_settings
from tests.bench.procs import markdown_table
from tests.bench.report import fmt, headline, machine, versions
from tests.bench.serving import FAST, HttpTarget, engine_record, requests_for, start_deployment, start_targets
from tests.bench.vllm_client import run_bench, summary_of
from tests.conftest import REPO

__all__ = ["ImagesRun", "bench_args", "run_of", "medians", "ratios", "prompt_mismatches", "build_report", "render",
           "main"]

# The fast set's engine on tiny-vision. vLLM's client merges an SSE comment read alone into the data
# after it (tests/bench/goodput.py): no keep-alive within a run.
OVERLAY = {**FAST.overlay, "LLMQ_MODEL": VISION_MODEL, "LLMQ_SSE_KEEPALIVE_S": "3600"}
TARGETS = ("llmq", "vllm-serve")
CONCURRENCY = (1, 16)
INPUT_TOKENS = 16
MAX_TOKENS = 32
IMAGES_PER_REQUEST = 1
BUCKETS = {(48, 64, 1): 0.5, (30, 100, 1): 0.5}
"""vLLM's random-mm buckets, (height, width, frames): probability. Two small image sizes, as
tiny-vision tiles every image to at most 2 × 2 tiles of 32 px whatever its size."""
PER_LANE, LEAST = 8, 64
"""Requests per run: max(8 × C, 64), so 64 at C=1 and 128 at C=16."""


def bench_args(url: str, model: str, tokenizer: str, *, requests: int, concurrency: int, seed: int,
               input_tokens: int = INPUT_TOKENS, max_tokens: int = MAX_TOKENS,
               images: int = IMAGES_PER_REQUEST, buckets: dict[tuple[int, int, int], float] | None = None) -> list[str]:
    """``vllm bench serve``'s flags for one run: ``requests`` chat requests of random text and
    ``images`` random images each (sizes from ``buckets``), chosen by ``seed``, ``concurrency`` in
    flight, sent at once."""
    buckets = BUCKETS if buckets is None else buckets
    return ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random-mm",
            "--random-input-len", str(input_tokens), "--random-output-len", str(max_tokens),
            "--random-range-ratio", "0", "--ignore-eos",
            "--random-mm-base-items-per-request", str(images), "--random-mm-num-mm-items-range-ratio", "0",
            "--random-mm-limit-mm-per-prompt", json.dumps({"image": images, "video": 0}),
            # A Python literal: the keys are tuples.
            "--random-mm-bucket-config", repr(buckets),
            "--num-prompts", str(requests), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--seed", str(seed), "--temperature", "0", "--disable-tqdm", "--ready-check-timeout-sec", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]


def cell_seed(rnd: int, concurrency: int) -> int:
    """The seed of a (round, concurrency) cell: the same for both targets, different across cells."""
    return zlib.crc32(f"images-r{rnd}-c{concurrency}".encode())


class ImagesRun(msgspec.Struct):
    """One target at one concurrency in one round."""

    round: int
    target: str
    concurrency: int
    requests: int
    completed: int
    """Requests that got a first token and all ``max_tokens`` tokens."""
    failed: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    prompt_tokens: float | None
    """The median prompt length the server reported (its ``usage``) over the completed requests:
    text, template and the image's tokens."""
    prompt_tokens_total: int
    """Their sum: equal across the targets of a cell when both saw the same prompts."""
    duration_s: float
    errors: list[str] = msgspec.field(default_factory=list)
    """Up to 3 distinct reasons among ``failed``."""


def _finite(x: float) -> float | None:
    return None if x != x else x  # a percentile of nothing is NaN


def run_of(result: dict, *, rnd: int, target: str, concurrency: int, max_tokens: int = MAX_TOKENS) -> ImagesRun:
    """One ``bench serve`` result (``--save-detailed``) as an :class:`ImagesRun`."""
    s = summary_of(result, concurrency=concurrency, max_tokens=max_tokens)
    done = [i for i, n in enumerate(result["output_lens"]) if n == max_tokens and result["ttfts"][i] > 0]
    reasons = [e for e in result.get("errors", []) if e]
    if s.requests - s.completed > len(reasons):
        reasons.append(f"returned fewer than {max_tokens} tokens")
    prompt = [result["input_lens"][i] for i in done if result["input_lens"][i]]
    return ImagesRun(
        round=rnd, target=target, concurrency=concurrency, requests=s.requests, completed=s.completed,
        failed=s.requests - s.completed, requests_per_s=s.requests_per_s, output_tokens_per_s=s.output_tokens_per_s,
        ttft_p50_ms=_finite(s.ttft_p50_ms), ttft_p99_ms=_finite(s.ttft_p99_ms),
        prompt_tokens=statistics.median(prompt) if prompt else None, prompt_tokens_total=sum(prompt),
        duration_s=s.duration_s,
        # A traceback's last line names the failure; vLLM's client keeps only a refusal's reason phrase.
        errors=sorted({e.strip().splitlines()[-1][:200] for e in reasons})[:3])


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


FIGURES = ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "prompt_tokens")


def medians(runs: Sequence[ImagesRun]) -> list[dict]:
    """Per (concurrency, target): the figures as medians across rounds, requests counted over all."""
    out = []
    for c in sorted({r.concurrency for r in runs}):
        for target in dict.fromkeys(r.target for r in runs):
            cell = [r for r in runs if r.concurrency == c and r.target == target]
            if cell:
                out.append({"target": target, "concurrency": c, "rounds": len(cell),
                            **{f: sum(getattr(r, f) for r in cell) for f in ("requests", "completed", "failed")},
                            **{f: _median([getattr(r, f) for r in cell]) for f in FIGURES}})
    return out


def ratios(rows: Sequence[dict], baseline: str = "vllm-serve") -> list[dict]:
    """Per concurrency: llmq's median over ``baseline``'s, for each figure (None: no figure)."""
    cell = {(r["target"], r["concurrency"]): r for r in rows}
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        ours, theirs = cell.get(("llmq", c)), cell.get((baseline, c))
        if ours is None or theirs is None:
            continue
        out.append({"concurrency": c, **{f: round(ours[f] / theirs[f], 3) if ours[f] is not None and theirs[f] else None
                                         for f in FIGURES[:4]}})
    return out


def prompt_mismatches(runs: Sequence[ImagesRun]) -> list[str]:
    """The cells (round, C) whose targets, all requests completed, counted different prompt tokens."""
    totals: dict[tuple[int, int], set[int]] = {}
    for r in runs:
        if not r.failed:
            totals.setdefault((r.round, r.concurrency), set()).add(r.prompt_tokens_total)
    return [f"round {rnd} C={c}: {sorted(t)}" for (rnd, c), t in totals.items() if len(t) > 1]


def build_report(runs: Sequence[ImagesRun], *, settings: dict) -> dict:
    rows = medians(runs)
    llmq = [r for r in runs if r.target == "llmq"]
    return {
        "benchmark": "images",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # Issue 45's bar: llmq completes every request. A failure of vllm serve is reported, not judged.
        "llmq_completed_all": bool(llmq) and all(r.failed == 0 for r in llmq),
        "ok": bool(runs) and all(r.failed == 0 for r in runs),
        "machine": machine(), "versions": versions(), "settings": settings,
        "medians": rows, "ratios": ratios(rows), "prompt_mismatches": prompt_mismatches(runs),
        "runs": [msgspec.to_builtins(r) for r in runs],
    }


def render(report: dict) -> str:
    s = report["settings"]
    sizes = ", ".join(f"{w}×{h}" for h, w in s["image_sizes"])
    lines = [
        headline(report),
        f"{s['model']} · chat, {s['input_tokens']} random text tokens + {s['images_per_request']} random image "
        f"({sizes}, base64 JPEG) · {s['max_tokens']} out, ignore_eos · {s['rounds']} round(s) · "
        "rates and TTFTs medians across rounds, requests summed",
        "",
        markdown_table(
            ["C", "target", "requests", "completed", "failed", "req/s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
             "prompt tokens"],
            [[m["concurrency"], m["target"], m["requests"], m["completed"], m["failed"], fmt(m["requests_per_s"], 2),
              fmt(m["output_tokens_per_s"], 1), fmt(m["ttft_p50_ms"], 1), fmt(m["ttft_p99_ms"], 1),
              fmt(m["prompt_tokens"], 0)] for m in report["medians"]]),
    ]
    if report["ratios"]:
        lines += ["", "llmq / vllm serve (medians):", "",
                  markdown_table(["C", "req/s", "output tok/s", "TTFT p50", "TTFT p99"],
                                 [[r["concurrency"], fmt(r["requests_per_s"], 3), fmt(r["output_tokens_per_s"], 3),
                                   fmt(r["ttft_p50_ms"], 3), fmt(r["ttft_p99_ms"], 3)] for r in report["ratios"]])]
    if report["prompt_mismatches"]:
        lines += ["", "The targets counted different prompt tokens: " + "; ".join(report["prompt_mismatches"])]
    broken = [r for r in report["runs"] if r["failed"]]
    if broken:
        lines += ["", "FAILED requests: " + "; ".join(
            f"{r['target']} C={r['concurrency']} round {r['round']}: {r['failed']} of {r['requests']} ({r['errors']})"
            for r in broken[:6])]
    return "\n".join(lines)


# --- running ----------------------------------------------------------------------------------------


def _image_url(width: int = 64, height: int = 48) -> str:
    from PIL import Image

    with io.BytesIO() as buf:
        Image.new("RGB", (width, height), (200, 40, 90)).save(buf, format="JPEG")
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def preflight(url: str, model: str) -> None:
    """One chat request with an image, answered whole: fails with the server's own answer (vLLM's
    client keeps only a refusal's reason phrase), and warms the image path up."""
    body = {"model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": _image_url()}}]}]}
    async with httpx.AsyncClient(timeout=300) as client:
        resp = await client.post(f"{url}/v1/chat/completions", json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"{url} answered an image with {resp.status_code}: {resp.text[:1000]}")


async def _start(stack: AsyncExitStack, settings: Settings, logs: Path, targets: Sequence[str]) -> dict[str, str]:
    """Start the named targets at once (their engines load together); their URLs by name."""

    async def start(name: str) -> str:
        if name == "llmq":
            return (await start_deployment(stack, "llmq", logs, OVERLAY, {})).url
        (vllm,) = await start_targets(stack, settings, logs, ("vllm-serve",), OVERLAY)
        assert isinstance(vllm, HttpTarget)
        return vllm.url

    return dict(zip(targets, await asyncio.gather(*map(start, targets)), strict=True))


async def measure(rounds: int, requests: int | None, concurrencies: Sequence[int], logs: Path | None,
                  targets: Sequence[str] = TARGETS) -> tuple[list[ImagesRun], dict]:
    from workers.tiny_vision import ensure_tiny_vision

    settings = load_settings({**os.environ, **OVERLAY})
    ensure_tiny_vision(Path(settings.model_path))
    tokenizer = settings.model_path
    async with AsyncExitStack() as stack:
        if logs is None:
            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmq-images-")))
        logs.mkdir(parents=True, exist_ok=True)
        print(f"starting {', '.join(targets)} on {settings.model_name} (logs in {logs})", file=sys.stderr, flush=True)
        urls = await _start(stack, settings, logs, targets)
        for name in targets:
            await preflight(urls[name], settings.model_name)
        runs: list[ImagesRun] = []
        for r in range(rounds):
            for c in concurrencies:
                n = requests_for(c, requests, PER_LANE, LEAST)
                k = r % len(targets)
                for name in [*targets[k:], *targets[:k]]:
                    result = await run_bench(bench_args(urls[name], settings.model_name, tokenizer, requests=n,
                                                        concurrency=c, seed=cell_seed(r, c)))
                    run = run_of(result, rnd=r + 1, target=name, concurrency=c)
                    runs.append(run)
                    print(f"round {r + 1} C={c:<3} {name:<10} {run.completed}/{run.requests} completed "
                          f"{run.requests_per_s:7.2f} req/s {run.output_tokens_per_s:8.1f} tok/s TTFT p50 "
                          f"{fmt(run.ttft_p50_ms)} p99 {fmt(run.ttft_p99_ms)} ms prompt {fmt(run.prompt_tokens, 0)}"
                          f"{'  FAILED: ' + '; '.join(run.errors) if run.failed else ''}", file=sys.stderr, flush=True)
    record = {"config": FAST.name, **engine_record(settings, OVERLAY), "client": "vllm bench serve",
              "backend": "openai-chat", "dataset": "random-mm", "input_tokens": INPUT_TOKENS, "max_tokens": MAX_TOKENS,
              "images_per_request": IMAGES_PER_REQUEST, "image_sizes": [list(k[:2]) for k in BUCKETS],
              "concurrency": list(concurrencies), "rounds": rounds,
              "requests": {c: requests_for(c, requests, PER_LANE, LEAST) for c in concurrencies}}
    return runs, record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.bench.images", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2; 1 with --quick)")
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="comma-separated (default 1,16)")
    p.add_argument("--requests", type=int, default=None,
                   help=f"requests per run (default max({PER_LANE} x C, {LEAST}); 16 with --quick)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated (default llmq,vllm-serve)")
    p.add_argument("--quick", action="store_true", help="1 round of 16 requests per run")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default at the repo root: bench-images.json, bench-images-quick.json)")
    p.add_argument("--logs", type=Path, default=None, help="where the targets' logs go (default a temp dir)")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.requests = 1, a.requests or 16
    out = a.out or REPO / ("bench-images-quick.json" if a.quick else "bench-images.json")
    concurrencies = [int(c) for c in a.concurrency.split(",")]
    targets = [t for t in a.targets.split(",") if t]
    if set(targets) - set(TARGETS):
        p.error(f"--targets: one of {', '.join(TARGETS)}")
    runs, settings = asyncio.run(measure(a.rounds, a.requests, concurrencies, a.logs, targets))
    report = build_report(runs, settings=settings)
    print(render(report))
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {out}", file=sys.stderr)
    raise SystemExit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
