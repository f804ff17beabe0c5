"""Claude Code and the Codex CLI, installed from npm at their pinned versions, each complete a
headless turn against a capture server (tests/support/capture_server.py), with no account and no
request anywhere but the base URL; their first model request has the shape recorded in
tests/fixtures/agents/. This proves the harness (tests/support/agent_clis.py) that later tests
point at llmq instead.

Where npm cannot reach the registry the tests skip, except in CI, where they fail. When a pin
moves, ``python -m tests.support.agent_clis`` rewrites the fixtures.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.agent_clis import (
    CLAUDE_CODE,
    CODEX,
    FIXTURES,
    claude_argv,
    claude_env,
    claude_shape,
    codex_argv,
    codex_env,
    codex_home,
    codex_shape,
    require,
    run,
    sanitize,
)
from tests.support.capture_server import Captured, CaptureServer

pytestmark = pytest.mark.e2e

REPLY = "hi from capture"


@pytest.fixture(scope="session")
def claude_exe() -> Path:
    return require(CLAUDE_CODE)


@pytest.fixture(scope="session")
def codex_exe() -> Path:
    return require(CODEX)


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}_request.json").read_text())


def explain(srv: CaptureServer, done) -> str:
    return f"exit {done.returncode}; hits {srv.hits()}\nstdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"


def the_one_request(srv: CaptureServer, done, hit: str) -> tuple[Captured, dict]:
    """The run's one model request, to ``hit`` (a path, and its query if any), answered 200: nothing
    else, no probe and no call home through the proxy. The request, and it as a dict."""
    assert srv.proxied() == [], explain(srv, done)
    assert srv.hits() == [f"POST {hit} -> 200"], explain(srv, done)
    first = srv.first("POST", hit.split("?", 1)[0])
    assert first is not None
    return first, first.as_dict()


def test_claude_code_completes_a_turn_and_sends_the_recorded_shape(claude_exe: Path, tmp_path: Path) -> None:
    with CaptureServer(reply=REPLY) as srv:
        done = run(claude_argv(claude_exe, "say hi"), claude_env(srv.url, tmp_path / "home", proxy=srv.url),
                   cwd=tmp_path)
        assert done.returncode == 0, explain(srv, done)
        result = json.loads(done.stdout)
        assert (result["type"], result["subtype"], result["is_error"]) == ("result", "success", False), result
        assert result["result"] == REPLY and result["num_turns"] == 1, result

        first, request = the_one_request(srv, done, "/v1/messages?beta=true")  # no count_tokens either

    headers, body = request["headers"], request["body"]
    assert first.auth == ["x-api-key"]
    assert headers["anthropic-version"] == "2023-06-01"
    assert "claude-code-20250219" in headers["anthropic-beta"].split(",")
    assert headers["user-agent"].startswith(f"claude-cli/{CLAUDE_CODE.version} ")
    assert body["model"] == "tiny-llama" and body["stream"] is True
    assert isinstance(body["max_tokens"], int) and body["max_tokens"] > 0
    assert body["thinking"]["type"] in ("adaptive", "enabled")
    assert all(b["type"] == "text" for b in body["system"])
    assert body["messages"][0]["role"] == "user"
    assert {m["role"] for m in body["messages"]} <= {"user", "assistant", "system"}
    assert len(body["tools"]) >= 8 and all("input_schema" in t for t in body["tools"])
    assert 20_000 < len(json.dumps(body)) < 300_000

    assert sanitize(claude_shape(request), {}) == fixture("claude_code")["shape"], (
        "Claude Code's request changed shape: rerun `python -m tests.support.agent_clis` and review the diff")


def test_codex_completes_a_turn_and_sends_the_recorded_shape(codex_exe: Path, tmp_path: Path) -> None:
    last = tmp_path / "last-message.txt"
    with CaptureServer(reply=REPLY) as srv:
        home = codex_home(tmp_path / "codex-home", f"{srv.url}/v1")
        done = run(codex_argv(codex_exe, "say hi", last_message=last),
                   codex_env(home, tmp_path / "home", proxy=srv.url), cwd=tmp_path)
        assert done.returncode == 0, explain(srv, done)
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        messages = [e["item"]["text"] for e in events
                    if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
        assert messages == [REPLY], events
        assert events[-1]["type"] == "turn.completed", events
        assert last.read_text().strip() == REPLY

        first, request = the_one_request(srv, done, "/v1/responses")

    headers, body = request["headers"], request["body"]
    assert first.auth == ["authorization"]
    assert headers["accept"] == "text/event-stream"
    assert headers["user-agent"].startswith(f"codex_exec/{CODEX.version} ")
    assert body["model"] == "tiny-llama" and body["stream"] is True and body["store"] is False
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True
    assert "reasoning.encrypted_content" in body["include"]
    tool_types = {t["type"] for t in body["tools"]}
    assert "function" in tool_types and tool_types <= {"function", "namespace", "web_search", "custom"}
    prompt = dict(body["input"][-1])
    assert prompt.pop("id").startswith("msg_")  # Codex names its input items itself
    assert prompt == {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]}
    assert 20_000 < len(json.dumps(body)) < 300_000

    assert sanitize(codex_shape(request), {}) == fixture("codex")["shape"], (
        "Codex's request changed shape: rerun `python -m tests.support.agent_clis` and review the diff")


def test_both_give_up_at_once_on_a_server_error(claude_exe: Path, codex_exe: Path, tmp_path: Path) -> None:
    """With the harness's no-retry settings a 500 ends the run after one request (without them
    Claude Code tries 11 times over ~3 minutes and Codex 30 times over ~25 s), so a later test
    against a failing llmq fails fast instead of hitting pytest's timeout."""
    with CaptureServer(fail_with=[500] * 40) as srv:
        started = time.monotonic()
        done = run(claude_argv(claude_exe, "say hi"), claude_env(srv.url, tmp_path / "claude"), cwd=tmp_path)
        took = time.monotonic() - started
        assert done.returncode != 0 and json.loads(done.stdout)["is_error"] is True, explain(srv, done)
        assert srv.hits() == ["POST /v1/messages?beta=true -> 500"] and took < 30, (took, explain(srv, done))

    with CaptureServer(fail_with=[500] * 40) as srv:
        home = codex_home(tmp_path / "codex-home", f"{srv.url}/v1")
        started = time.monotonic()
        done = run(codex_argv(codex_exe, "say hi"), codex_env(home, tmp_path / "codex"), cwd=tmp_path)
        took = time.monotonic() - started
        assert done.returncode != 0 and '"turn.failed"' in done.stdout, explain(srv, done)
        assert srv.hits() == ["POST /v1/responses -> 500"] and took < 30, (took, explain(srv, done))
