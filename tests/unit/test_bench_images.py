"""The images benchmark's pure parts (tests/bench/images.py): the flags it gives ``vllm bench
serve``, its reading of a result, the medians across rounds and llmq / ``vllm serve`` ratios."""

from __future__ import annotations

import ast
import json

import msgspec

from shared.config import VISION_MODEL, load_settings
from tests.bench.images import (
    OVERLAY,
    ImagesRun,
    bench_args,
    build_report,
    cell_seed,
    medians,
    prompt_mismatches,
    ratios,
    render,
    run_of,
)


def flags(args: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs (a flag with no value: None)."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_the_runs_are_vllm_clients_random_images_over_chat():
    f = flags(bench_args("http://127.0.0.1:1", "tiny-vision", "/models/tiny-vision", requests=64, concurrency=16,
                         seed=7))
    assert (f["--backend"], f["--endpoint"], f["--dataset-name"]) == ("openai-chat", "/v1/chat/completions",
                                                                       "random-mm")
    assert (f["--num-prompts"], f["--max-concurrency"], f["--seed"], f["--random-output-len"]) == ("64", "16", "7",
                                                                                                   "32")
    assert "--ignore-eos" in f and f["--ignore-eos"] is None
    assert (f["--model"], f["--tokenizer"], f["--base-url"]) == ("tiny-vision", "/models/tiny-vision",
                                                                 "http://127.0.0.1:1")
    # Images only, one a request, both sizes parsed back as vLLM's flag parses them.
    assert json.loads(f["--random-mm-limit-mm-per-prompt"] or "") == {"image": 1, "video": 0}
    assert f["--random-mm-base-items-per-request"] == "1"
    buckets = ast.literal_eval(f["--random-mm-bucket-config"] or "")
    assert set(buckets) == {(48, 64, 1), (30, 100, 1)} and all(k[2] == 1 for k in buckets)
    # Where the result goes is vllm_client.run_bench's to add.
    assert "--result-dir" not in f


def test_vllms_flag_parser_takes_the_arguments():
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(bench_args("http://127.0.0.1:1", "m", "t", requests=8, concurrency=1, seed=3,
                                      buckets={(64, 64, 1): 1.0}))
    assert ns.random_mm_bucket_config == {(64, 64, 1): 1.0}
    assert ns.random_mm_limit_mm_per_prompt == {"image": 1, "video": 0}
    assert (ns.dataset_name, ns.backend, ns.num_prompts, ns.ignore_eos) == ("random-mm", "openai-chat", 8, True)


def test_both_targets_of_a_cell_get_the_same_seed_and_cells_differ():
    assert cell_seed(0, 1) == cell_seed(0, 1)
    assert len({cell_seed(r, c) for r in range(3) for c in (1, 16)}) == 6


def test_the_benchmark_serves_tiny_vision_without_keepalives():
    s = load_settings(OVERLAY)
    assert s.model == VISION_MODEL and s.sse_keepalive_s >= 600


def result(lens: list[int], *, errors: list[str] | None = None, prompt: int = 54) -> dict:
    n = len(lens)
    return {"duration": 2.0, "output_lens": lens, "input_lens": [prompt if x else 0 for x in lens],
            "ttfts": [0.01 * (i + 1) if x else 0.0 for i, x in enumerate(lens)],
            "itls": [[0.005] * (x - 1) if x else [] for x in lens], "errors": errors or [""] * n}


def test_a_result_counts_a_request_short_of_its_tokens_or_refused_as_failed():
    errors = ["", "", "Bad Request", "Traceback ...\naiohttp.ClientPayloadError: Response payload is not completed"]
    run = run_of(result([32, 32, 0, 0], errors=errors), rnd=1, target="llmq", concurrency=1)
    assert (run.requests, run.completed, run.failed) == (4, 2, 2)
    assert run.errors == ["Bad Request", "aiohttp.ClientPayloadError: Response payload is not completed"]
    assert (run.requests_per_s, run.output_tokens_per_s, run.prompt_tokens, run.prompt_tokens_total) == (1.0, 32.0,
                                                                                                           54, 108)
    assert (run.ttft_p50_ms, run.ttft_p99_ms) == (15.0, 19.9)
    short = run_of(result([32, 31]), rnd=1, target="llmq", concurrency=1)
    assert (short.completed, short.failed, short.errors) == (1, 1, ["returned fewer than 32 tokens"])


def test_a_run_with_nothing_completed_has_no_ttft_figures():
    run = run_of(result([0, 0], errors=["Bad Request"] * 2), rnd=1, target="llmq", concurrency=1)
    assert (run.completed, run.ttft_p50_ms, run.ttft_p99_ms, run.prompt_tokens) == (0, None, None, None)


def cell(target: str, c: int, rnd: int, rps: float, *, failed: int = 0, p50: float | None = 20.0) -> ImagesRun:
    return ImagesRun(round=rnd, target=target, concurrency=c, requests=64, completed=64 - failed, failed=failed,
                     requests_per_s=rps, output_tokens_per_s=rps * 32, ttft_p50_ms=p50, ttft_p99_ms=40.0,
                     prompt_tokens=54.0, prompt_tokens_total=3456, duration_s=10.0,
                     errors=["Bad Request"] if failed else [])


def test_medians_across_rounds_counts_summed_and_ratios_of_medians():
    runs = [cell("llmq", 1, 1, 8.0), cell("vllm-serve", 1, 1, 10.0), cell("vllm-serve", 1, 2, 12.0),
            cell("llmq", 1, 2, 10.0, failed=1, p50=30.0),
            cell("llmq", 16, 1, 40.0), cell("vllm-serve", 16, 1, 50.0)]
    rows = medians(runs)
    assert [(r["concurrency"], r["target"], r["requests"], r["failed"], r["requests_per_s"], r["ttft_p50_ms"])
            for r in rows] == [(1, "llmq", 128, 1, 9.0, 25.0), (1, "vllm-serve", 128, 0, 11.0, 20.0),
                               (16, "llmq", 64, 0, 40.0, 20.0), (16, "vllm-serve", 64, 0, 50.0, 20.0)]
    got = ratios(rows)
    assert got == [{"concurrency": 1, "requests_per_s": 0.818, "output_tokens_per_s": 0.818, "ttft_p50_ms": 1.25,
                    "ttft_p99_ms": 1.0},
                   {"concurrency": 16, "requests_per_s": 0.8, "output_tokens_per_s": 0.8, "ttft_p50_ms": 1.0,
                    "ttft_p99_ms": 1.0}]
    # A figure missing on either side is no ratio; a target alone, no row.
    rows[0]["ttft_p50_ms"] = None
    assert ratios(rows)[0]["ttft_p50_ms"] is None
    assert ratios(medians([cell("llmq", 1, 1, 8.0)])) == []


SETTINGS = {"model": "tiny-vision", "input_tokens": 16, "images_per_request": 1, "image_sizes": [[48, 64], [30, 100]],
            "max_tokens": 32, "rounds": 2}


def test_the_report_holds_llmq_to_every_request_and_renders():
    runs = [cell("llmq", 1, 1, 8.0), cell("vllm-serve", 1, 1, 10.0, failed=2)]
    report = build_report(runs, settings=SETTINGS)
    assert report["llmq_completed_all"] and not report["ok"]
    table = render(report)
    assert "| 1 | llmq | 64 | 64 | 0 | 8.00 | 256.0 | 20.0 | 40.0 | 54 |" in table
    assert "| 1 | 0.800 | 0.800 | 1.000 | 1.000 |" in table
    assert "64×48, 100×30" in table
    assert "FAILED requests: vllm-serve C=1 round 1: 2 of 64 (['Bad Request'])" in table
    report = build_report([cell("llmq", 1, 1, 8.0, failed=1)], settings=SETTINGS)
    assert not report["llmq_completed_all"] and report["ratios"] == []


def test_a_cell_whose_targets_counted_different_prompts_is_named():
    same = [cell("llmq", 1, 1, 8.0), cell("vllm-serve", 1, 1, 10.0)]
    assert prompt_mismatches(same) == []
    other = msgspec.structs.replace(cell("vllm-serve", 16, 2, 10.0), prompt_tokens_total=3400)
    # A run with failures counts fewer prompts: not compared.
    partial = msgspec.structs.replace(cell("vllm-serve", 1, 1, 10.0, failed=1), prompt_tokens_total=3400)
    assert prompt_mismatches([*same, cell("llmq", 16, 2, 8.0), other, partial]) == ["round 2 C=16: [3400, 3456]"]
    report = build_report([cell("llmq", 16, 2, 8.0), other], settings=SETTINGS)
    assert "The targets counted different prompt tokens: round 2 C=16: [3400, 3456]" in render(report)
