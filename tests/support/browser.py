"""A real browser for the console's tests: Debian's Chromium, driven by Playwright.

Chromium comes from Debian's packages (``apt-get install chromium``), installed on first use when
it is missing and this runs as root, as CI does; Playwright (a test dependency, pyproject.toml)
drives that executable, so no browser is downloaded from elsewhere. Where it cannot be installed,
the test is skipped, and fails under CI (``CI=true``), where a skipped browser test would hide a
broken console.

Chromium starts headless in a new empty profile, with the flags that keep it off the network
(this machine has none: without them it retries Google's hosts at every start).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

__all__ = ["CHROMIUM", "chromium_or_skip", "browser"]

CHROMIUM = Path(os.environ.get("LLMQ_CHROMIUM", "/usr/bin/chromium"))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]
_tried: list[str] = []  # the reason it could not be installed, once per session


def _install() -> str | None:
    """Install Debian's chromium; None when done, else why not."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root, or no apt-get: install Debian's chromium package"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "chromium"]
    for step in ([install], [["apt-get", "update", "-q"], install]):  # the package lists may be missing
        for cmd in step:
            done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=900)
            if done.returncode:
                break
        else:
            return None
    return f"apt-get failed: {done.stderr.strip()[-500:]}"


def chromium_or_skip() -> Path:
    if not CHROMIUM.exists() and not _tried:
        _tried.append(_install() or "")
    if CHROMIUM.exists():
        return CHROMIUM
    why = _tried[0] if _tried else "not installed"
    if os.environ.get("CI"):
        pytest.fail(f"CI: Chromium is needed for the console's browser tests: {why}")
    pytest.skip(f"no Chromium at {CHROMIUM}: {why}")


@asynccontextmanager
async def browser() -> AsyncIterator:
    """A Playwright Chromium browser (``playwright.async_api.Browser``)."""
    executable = chromium_or_skip()
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        launched = await pw.chromium.launch(executable_path=str(executable), args=FLAGS)
        try:
            yield launched
        finally:
            await launched.close()
