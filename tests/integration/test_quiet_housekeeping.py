"""An idle housekeeping process (the real one, arq, on a real redis-server) prints its start-up
lines and then nothing per tick at info; its per-second cron lines are still there at debug."""

from __future__ import annotations

import json
import time

from tests.support.background import housekeeping
from tests.support.waiting import eventually_sync

IDLE_S = 4.0  # four ticks of the per-second crons (each one used to print four lines)


def _run_idle(redis_url: str, prefix: str, tmp_path, **settings: str) -> list[dict]:
    with housekeeping(redis_url, prefix, tmp_path, **settings) as proc:
        log = tmp_path / f"housekeeping-{prefix}.log"
        def swept() -> bool:  # started: its first sweep ran
            assert proc.poll() is None, log.read_text()
            return b"housekeeping_sweep" in log.read_bytes()
        eventually_sync(swept, timeout_s=30, interval_s=0.1, what=lambda: f"a first sweep:\n{log.read_text()}")
        time.sleep(IDLE_S)
        text = log.read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_an_idle_housekeeper_prints_nothing_per_tick_at_info(redis_url, prefix, tmp_path):
    lines = _run_idle(redis_url, prefix, tmp_path)
    events = [x["event"] for x in lines if x["level"] != "debug"]
    # arq's two start-up lines and the first sweep; then only the shutdown (stopped by the helper).
    assert events[0].startswith("Starting worker for 5 functions") and events[1].startswith("redis_version=")
    assert events[2] == "housekeeping_sweep"
    assert all(e.startswith("shutdown on SIGTERM") for e in events[3:]), events
    assert not [x for x in lines if x["level"] == "debug"]


def test_the_cron_lines_are_debug_lines(redis_url, prefix, tmp_path):
    lines = _run_idle(redis_url, prefix, tmp_path, log_level="debug")
    ticks = [x for x in lines if "cron:drain_outbox(" in x["event"] or "cron:drain_outbox ●" in x["event"]]
    # a start and a finish line per second, all at debug
    assert len(ticks) >= 2 * int(IDLE_S) and {x["level"] for x in ticks} == {"debug"}, ticks
