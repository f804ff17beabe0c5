"""shared.metrics' text exposition, read back with Prometheus' own parser (prometheus_client)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import BUCKETS, CATALOGUE, Recorder, Sample, decode_samples, encode_samples, exposition


def test_a_recorders_counters_and_histograms_parse_as_prometheus_families():
    r = Recorder("m")
    r.inc("llmq_worker_tokens_total", 5)
    r.inc("llmq_worker_tokens_total", 2)
    r.inc("llmq_worker_jobs_ended_total", outcome="done")
    for seconds in (0.004, 0.2, 0.2, 1000.0):
        r.observe("llmq_ttft_seconds", seconds)
    samples = decode_samples(encode_samples(r.samples()))  # as pushed through the heartbeat
    families = {f.name: f for f in text_string_to_metric_families(exposition(samples))}

    assert families["llmq_worker_tokens"].type == "counter"
    [tokens] = families["llmq_worker_tokens"].samples
    assert (tokens.labels, tokens.value) == ({"model": "m"}, 7)
    [ended] = families["llmq_worker_jobs_ended"].samples
    assert ended.labels == {"model": "m", "outcome": "done"} and ended.value == 1

    ttft = families["llmq_ttft_seconds"]
    assert ttft.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert len(buckets) == len(BUCKETS) + 1
    assert (buckets["0.005"], buckets["0.1"], buckets["0.25"], buckets["300"], buckets["+Inf"]) == (1, 1, 3, 3, 4)
    totals = {s.name: s.value for s in ttft.samples if not s.name.endswith("_bucket")}
    assert totals == {"llmq_ttft_seconds_count": 4, "llmq_ttft_seconds_sum": 1000.404}


def test_label_values_are_escaped():
    text = exposition([Sample("llmq_workers_ready", {"model": 'we"ird\\name\n'}, 1)])
    [family] = [f for f in text_string_to_metric_families(text) if f.samples]
    assert family.samples[0].labels == {"model": 'we"ird\\name\n'}
    assert "\n# HELP llmq_workers_ready " in text


def test_every_family_is_declared_before_any_sample_and_a_new_recorder_starts_at_zero():
    families = {f.name: f for f in text_string_to_metric_families(exposition([]))}
    assert {(f.name, f.type, len(f.samples)) for f in families.values()} == {
        (name.removesuffix("_total"), metric.kind, 0) for name, metric in CATALOGUE.items()}
    fresh = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in Recorder("m").samples()}
    assert fresh[("llmq_worker_jobs_ended_total", (("model", "m"), ("outcome", "done")))] == 0
    assert fresh[("llmq_worker_tokens_total", (("model", "m"),))] == 0
    assert fresh[("llmq_ttft_seconds_bucket", (("le", "+Inf"), ("model", "m")))] == 0
    assert fresh[("llmq_ttft_seconds_count", (("model", "m"),))] == 0
