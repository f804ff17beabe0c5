"""The queue microbenchmarks (``tests.bench.pickup``, ``tests.bench.relay``) at tiny size, as
``make bench`` runs them (separate processes, their own redis-server): the report has its shape,
every job was picked up exactly once, every SSE client got exactly its tokens in order."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench.procs import REPO
from tests.bench.relay import check_stream, expected_text


def _run(module: str, *args: str, out) -> dict:
    proc = subprocess.run([sys.executable, "-m", module, *args, "--out", str(out)], cwd=REPO, capture_output=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"| target" in proc.stdout or b"| tokens/event" in proc.stdout  # the markdown table
    return json.loads(out.read_text())


def test_pickup_measures_every_target_and_loses_no_job(tmp_path):
    result = _run("tests.bench.pickup", "--rounds", "2", "--jobs", "20", "--arq-jobs", "3", "--arq-default-jobs", "0",
                  "--held", "300", out=tmp_path / "pickup.json")
    targets = result["targets"]
    assert set(targets) == {"floor: bare XADD -> XREADGROUP", "llmq", "llmq, 300 held", "arq poll_delay=0.01"}
    for name, row in targets.items():
        assert row["lost"] == 0, name
        assert row["n"] == (3 if name.startswith("arq") else 20), name
        assert 0 < row["p50_ms"] <= row["p99_ms"], name
        assert len(row["round_p50s_ms"]) == 2
    assert result["every_job_started_once"]  # each llmq job's record: attempt 1, status done
    assert set(result["ratios"]) == {"held_over_empty_p50", "held_over_empty_p50_median_of_rounds"}
    assert set(result["reclaim_call_ms"]) == {"llmq", "llmq, 300 held"}  # no live lease was taken
    assert {"llmq_p50_le_1ms", "held_changes_p50_lt_10pct"} == set(result["targets_met"])


def test_relay_delivers_every_token_to_every_client_in_order(tmp_path):
    result = _run("tests.bench.relay", "--rounds", "1", "--clients", "2", "--tokens", "50", "--per-event", "1", "5",
                  "--client-procs", "1", "--log-dir", str(tmp_path), out=tmp_path / "relay.json")
    assert set(result["summary"]) == {"1", "5"}
    runs = {r["per_event"]: r for r in result["runs"]}
    for per_event, run in runs.items():
        assert run["errors"] == [] and run["complete"]
        assert run["tokens"] == 2 * 50
        # One SSE data frame per worker event: per_event tokens a step, or every step a job made
        # while the emitter's flusher was busy (merged into one event).
        assert 2 <= run["events"] <= 2 * 50 // per_event
        assert run["events_per_s"] > 0
        # Who the bottleneck was: every process's CPU share over the run is reported.
        assert set(run["cpu_pct"]) == {"redis", "api", "emitter", "clients"}
    assert all(s["complete"] for s in result["summary"].values())


def test_stream_check_rejects_a_lost_or_reordered_token():
    def response(texts: list[str]) -> bytes:
        frames = b"".join(b"data: " + json.dumps({"choices": [{"text": t}]}).encode() + b"\n\n" for t in texts)
        frames += b"data: [DONE]\n\n"
        return b"HTTP/1.1 200 OK\r\n\r\n" + b"%x\r\n" % len(frames) + frames + b"\r\n0\r\n\r\n"

    text = expected_text(6)
    assert check_stream(response(list(text)), 6) == (6, 6, "")
    assert check_stream(response(list(text[:3] + text[4:])), 6)[2]  # one token lost
    assert check_stream(response([text[1], text[0], *text[2:]]), 6)[2]  # two swapped
