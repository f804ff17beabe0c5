"""The real housekeeping process (``python -m workers.housekeeping``, arq) for tests of the
background work it does: webhook deliveries and batch files."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.bench.procs import stop
from tests.conftest import REPO

__all__ = ["housekeeping"]


@contextmanager
def housekeeping(redis_url: str, prefix: str, log_dir: Path, **settings: str) -> Iterator[subprocess.Popen]:
    """Run it on ``prefix`` with extra ``LLMQ_*`` settings; its log tail is printed afterwards."""
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_SERVED_MODEL_NAME": "tiny",
           "LLMQ_LOG_JSON": "true", **{f"LLMQ_{k.upper()}": str(v) for k, v in settings.items()}}
    log = log_dir / f"housekeeping-{prefix}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workers.housekeeping"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop(proc)
        print(log.read_text()[-3000:])
