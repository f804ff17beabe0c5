"""``tests.bench.fairness`` at tiny size against the test Redis: the report has its shape, every
call got the jobs it asked for, every pick was a job of one of the waiting tenants, and the fair
share rotated: with equal weights and equal jobs, each aligned window of N picks over N tenants
names every tenant exactly once (the backlog is queued tenant after tenant, so a queue picking in
arrival order would fail this)."""

from __future__ import annotations

import json
import math

from tests.bench.fairness import main

TENANTS = (1, 50)
COUNTS = (1, 8)
PICKS, ROUNDS, WARM = 100, 2, 2


def test_fairness_bench_reports_every_pick_and_each_tenant_gets_its_turn(redis_url, tmp_path, capsys):
    out = tmp_path / "fairness.json"
    main(["--tenants", *map(str, TENANTS), "--counts", *map(str, COUNTS), "--picks", str(PICKS), "--rounds",
          str(ROUNDS), "--warm", str(WARM), "--jobs-per-tenant", "2", "--redis-url", redis_url, "--out", str(out)])
    assert "| tenants | count | picks | p50 µs |" in capsys.readouterr().out
    result = json.loads(out.read_text())

    assert result["benchmark"] == "fairness" and result["llmq_commit"]
    assert result["settings"]["jobs_per_tenant"] == {"1": 9, "50": 2}  # one more than a read of 8 asks, or 2 each
    assert result["settings"]["server_cpu"] == "schedstat"  # the test Redis runs on this host
    assert [(r["tenants"], r["count"]) for r in result["rows"]] == [(n, c) for n in TENANTS for c in COUNTS]
    for row in result["rows"]:
        calls = math.ceil(PICKS / row["count"]) * ROUNDS
        assert (row["calls"], row["picks"], len(row["rounds"])) == (calls, calls * row["count"], ROUNDS), row
        assert 0 < row["p50_us"] <= row["p99_us"], row
        assert row["cpu_us_per_pick"] > 0 and row["script_us_per_pick"] > 0 and row["enqueue_us_per_job"] > 0, row
    assert set(result["ratios"]) == {
        *(f"{k} 50/1 tenants, count {c}" for c in COUNTS
          for k in ("p50_us", "p99_us", "cpu_us_per_pick", "script_us_per_pick")),
        "enqueue_us_per_job 50/1 tenants", "enqueue_cpu_us_per_job 50/1 tenants"}

    # Every call, warm-up included, picked as many jobs as it asked for.
    picks = ROUNDS * sum((WARM + math.ceil(PICKS / c)) * c for c in COUNTS)
    for n in TENANTS:
        fair = result["fairness"][str(n)]
        assert fair["picks"] == picks, (n, fair)
        flaws = (fair["short_calls"], fair["foreign_picks"], fair["not_run"], fair["unknown_tenants"])
        assert flaws == (0, 0, 0, []), fair
        assert fair["held"] and fair["broken_at"] is None, fair  # each window of n picks: every tenant once
        assert fair["full_windows"] == picks // n
        assert (fair["picks_per_tenant_min"], fair["picks_per_tenant_max"]) == (picks // n, math.ceil(picks / n)), fair
        # Each pick was replaced by a job of its tenant: the backlog is as it began.
        assert (fair["tenants_in_fair_set"], fair["jobs_waiting"]) == (n, fair["jobs_waiting_at_start"]), fair
    assert result["fair"]
