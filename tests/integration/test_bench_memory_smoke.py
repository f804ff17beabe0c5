"""``tests.bench.memory`` at tiny size, as ``make bench`` would run it: its own redis-server, a real
API and worker, both modes; the compact log is what the report says it is."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench.procs import REPO


def test_memory_bench_reports_both_modes_and_the_compact_log_is_small(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "-m", "tests.bench.memory", "--jobs", "40", "--tokens", "64",
                           "--out", str(out)], cwd=REPO, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"| tokens/job |" in proc.stdout
    stream, compact = json.loads(out.read_text())["rows"]
    assert (stream["mode"], stream["log_type"]) == ("stream", "stream")
    assert (compact["mode"], compact["log_type"]) == ("compact", "record field")
    assert compact["keys_per_job"] == 1  # the record; its log is a field of it
    assert stream["logs_read_back"] == compact["logs_read_back"] == 40
    assert compact["log_bytes_max"] <= 1024 < stream["log_bytes_per_job"]
    assert compact["record_bytes_per_job"] - stream["record_bytes_per_job"] < 200  # the record gained its log only
    assert compact["memory_usage_bytes_per_job"] < stream["memory_usage_bytes_per_job"] / 3
