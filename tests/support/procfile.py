"""The Procfile's processes under honcho, and a streaming client on its own thread: the helpers of
the e2e tests that start ``web`` and ``worker`` as deployed (tests/e2e/test_procfile_drain.py,
tests/e2e/test_fast_failover.py, tests/e2e/test_procfile_scaling.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.conftest import REPO
from tests.support.processes import spawn_logged

__all__ = ["BIN", "Stream", "completion_body", "kill_leftovers", "start_honcho", "log_events"]

BIN = Path(sys.executable).parent  # the venv's bin: the Procfile says `python`, honcho lives here


def completion_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    """A greedy completion of exactly ``max_tokens`` tokens, with their logprobs (the tokens)."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": stream, "stream_options": {"include_usage": True} if stream else None}


class Stream:
    """One client's streamed completion, read on its own thread."""

    def __init__(self, url: str, prompt: str, max_tokens: int) -> None:
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.job_id = ""
        self.tokens: list[str] = []
        self.text = ""
        self.finish_reasons: list[str] = []
        self.usage: dict | None = None
        self.errors: list[object] = []
        self.arrivals: list[float] = []
        self.done = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = completion_body(self.prompt, self.max_tokens, True)
        try:
            with httpx.Client(timeout=httpx.Timeout(30, read=300)) as client, client.stream(
                    "POST", f"{self.url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    self.errors.append((resp.status_code, resp.read().decode()))
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        break
                    self._chunk(json.loads(line.removeprefix("data: ")))
        except Exception as exc:  # noqa: BLE001 - reported by the test's assertions
            self.errors.append(repr(exc))

    def _chunk(self, chunk: dict) -> None:
        if "error" in chunk:
            self.errors.append(chunk["error"])
            return
        self.job_id = chunk["id"].removeprefix("cmpl-")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk["choices"]:
            self.text += choice["text"]
            if choice["logprobs"]:
                self.tokens += choice["logprobs"]["tokens"]
                self.arrivals += [time.monotonic()] * len(choice["logprobs"]["tokens"])
            if choice["finish_reason"]:
                self.finish_reasons.append(choice["finish_reason"])


def start_honcho(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    # Its own session, so nothing here signals the test's process group; honcho puts each of its
    # children in a session of their own too (cleaned up in kill_leftovers).
    return spawn_logged([str(BIN / "honcho"), "-f", "Procfile", "--no-colour", "start", *args], log, cwd=REPO,
                        env=env, start_new_session=True)


def kill_leftovers(logs: list[Path]) -> None:
    """Honcho SIGKILLs its children 5 s after it is stopped; if honcho itself died first, kill the
    shells it started (each leads a session holding its python) by their pids from its log."""
    for log in logs:
        for pid in map(int, re.findall(rb"started \(pid=(\d+)\)", log.read_bytes() if log.exists() else b"")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"-m workers" in cmdline or b"-m api" in cmdline:  # not a recycled pid
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def log_events(log: str, event: str) -> list[dict]:
    """The JSON log records named ``event`` in a process's log, or a honcho log (lines ``time name | {json}``)."""
    return [json.loads(line[line.index("{"):]) for line in log.splitlines() if f'"event":"{event}"' in line]
