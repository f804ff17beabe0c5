"""``tests.bench.tracing`` at tiny size, as ``make bench`` runs it: both modes, every span it made
received by the OTLP receiver it starts, and tracing costing something on (so the figures measure
the work, not an exporter that dropped it)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench.procs import REPO


def test_tracing_bench_measures_both_modes_and_every_span_arrives(tmp_path):
    out = tmp_path / "tracing.json"
    proc = subprocess.run([sys.executable, "-m", "tests.bench.tracing", "--rounds", "2", "--requests", "100",
                           "--out", str(out)], cwd=REPO, capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["spans_received"] == report["spans_made"] == 2 * 100 * 4
    cpu = report["cpu_us_per_request"]
    assert set(cpu) == {"api off", "api on", "worker off", "worker on"}
    assert cpu["api on"] > cpu["api off"] and cpu["worker on"] > cpu["worker off"]
