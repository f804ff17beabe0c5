"""Claude Code and the Codex CLI, at their pinned npm versions, complete turns against llmq: real
processes, the real vLLM worker on the tiny model with a context long enough for their prompts
(~50k characters, 12 and 9 tools), their default settings (tools, thinking, effort, reasoning
summaries). Each run is then checked against what llmq queued and answered: the job's record
holds the tools the CLI offered (hosted ones left out), the reasoning options, and a finished
result.

Where npm cannot reach the registry the tests skip, except in CI, where they fail
(tests/support/agent_clis.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from shared.config import load_settings
from shared.keys import Keys
from tests.support.agent_clis import (
    CLAUDE_CODE,
    CODEX,
    claude_argv,
    claude_env,
    codex_argv,
    codex_env,
    codex_home,
    require,
    run,
)
from tests.support.event_log import record_text
from tests.support.real_processes import one_worker

pytestmark = pytest.mark.e2e

CONTEXT = 65536
"""Tokens of context: Claude Code's and Codex's prompts, in the tiny model's tokens, with room to answer."""


class Served:
    def __init__(self, url: str, redis: Redis, keys: Keys, model: str) -> None:
        self.url, self.redis, self.keys, self.model = url, redis, keys, model

    def jobs(self) -> list[dict]:
        """Every job record on this stack's prefix, its request and result decoded."""
        out = []
        for key in self.redis.scan_iter(match=self.keys.job(self.model, "*")):
            fields = record_text(self.redis.hgetall(key))
            if "request" not in fields:
                continue
            for name in ("request", "result", "error"):
                if name in fields:
                    fields[name] = json.loads(fields[name])
            out.append(fields)
        return out


@pytest.fixture(scope="module")
def served(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One worker and one API with a 64k context (the tiny model's positions extended to it)."""
    logs = tmp_path_factory.mktemp("agent-cli-logs")
    prefix = f"clis-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_LOG_JSON": "true",
           "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_MAX_MODEL_LEN": str(CONTEXT), "LLMQ_HEARTBEAT_S": "1"}
    redis = Redis.from_url(redis_url)
    try:
        with one_worker(env, logs) as url:
            yield Served(url, redis, Keys(prefix), load_settings({}).model_name)
    finally:
        redis.close()


def explain(done: subprocess.CompletedProcess) -> str:
    return f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"


def only_job(served: Served, dialect: str) -> dict:
    jobs = [j for j in served.jobs() if j["request"].get("dialect") == dialect]
    assert len(jobs) == 1, [j["request"].get("dialect") for j in served.jobs()]
    return jobs[0]


def test_claude_code_completes_a_turn_with_its_default_tools_and_thinking(served: Served, tmp_path: Path) -> None:
    exe = require(CLAUDE_CODE)
    # Claude Code asks for 32,000 tokens, which llmq clamps to the context; a random model writes
    # until it samples its end. Claude Code's own cap bounds the run (a turn cut at the cap is an
    # error to it, so the cap is generous).
    env = claude_env(served.url, tmp_path / "home", CLAUDE_CODE_MAX_OUTPUT_TOKENS="4096")
    done = run(claude_argv(exe, "say hi"), env, cwd=tmp_path, timeout_s=600)
    assert done.returncode == 0, explain(done)
    result = json.loads(done.stdout)
    assert (result["type"], result["is_error"]) == ("result", False), result

    job = only_job(served, "anthropic_messages")
    request = job["request"]
    assert job["status"] == "done", job
    tools = request["tools"]["tools"]
    assert len(tools) >= 8 and all("name" in t for t in tools), "Claude Code's tools reached the model"
    assert request["tools"].get("choice", "auto") == "auto"
    kwargs = request["chat"]["template_kwargs"]
    assert kwargs.get("enable_thinking") is True and kwargs.get("reasoning_effort"), kwargs
    roles = [m["role"] for m in request["messages"]]
    assert "system" in roles, "its system turn inside messages was kept"
    usage = job["result"]["usage"]
    assert usage["prompt_tokens"] > 4000 and 0 < usage["completion_tokens"] < 4096, usage


def test_codex_completes_a_turn_on_the_responses_api(served: Served, tmp_path: Path) -> None:
    exe = require(CODEX)
    home = codex_home(tmp_path / "codex-home", f"{served.url}/v1", extra_toml="")
    done = run(codex_argv(exe, "say hi"), codex_env(home, tmp_path / "home"), cwd=tmp_path, timeout_s=900)
    assert done.returncode == 0, explain(done)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert events and events[-1]["type"] == "turn.completed", explain(done)

    job = only_job(served, "openai_responses")
    request = job["request"]
    assert job["status"] == "done", job
    names = {t["name"] for t in request["tools"]["tools"]}
    assert len(names) >= 7, "its function tools, and the namespace's, reached the model"
    assert "web_search" not in names, "a hosted tool llmq cannot run is left out"
    assert request["tools"].get("choice", "auto") == "auto"
    assert job["result"]["usage"]["prompt_tokens"] > 4000
