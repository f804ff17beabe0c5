"""The engine a worker builds, and the same engine as ``vllm serve`` flags (the benchmark's peer)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from shared.config import load_settings
from tests.bench.serving import vllm_server_args
from workers.engine import engine_args

pytestmark = pytest.mark.engine


def _served(flags: list[str]) -> AsyncEngineArgs:
    """``vllm serve``'s engine flags read by vLLM's own parser (the server's front-end flags dropped)."""
    engine_flags = flags[flags.index("--model"):]
    front_end = (("--host", True), ("--port", True), ("--disable-uvicorn-access-log", False),
                 ("--enable-auto-tool-choice", False), ("--tool-call-parser", True), ("--tool-strict-level", True))
    for flag, takes_value in front_end:
        if flag in engine_flags:
            i = engine_flags.index(flag)
            del engine_flags[i:i + 1 + takes_value]
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(engine_flags))


def test_the_stream_interval_reaches_the_engine_and_vllm_serve_alike():
    for interval in (1, 4):
        settings = load_settings({"LLMQ_STREAM_INTERVAL": str(interval)})
        ours = engine_args(settings, settings.model_path)
        theirs = _served(vllm_server_args(settings, 8000))
        assert ours.stream_interval == theirs.stream_interval == interval
        for field in ("max_model_len", "max_num_seqs", "enforce_eager", "scheduling_policy", "kv_cache_memory_bytes"):
            assert getattr(ours, field) == getattr(theirs, field), field
