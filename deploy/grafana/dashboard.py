"""llmq's Grafana dashboard, built in code with grafana-foundation-sdk: the JSON beside it
(llmq.json) is this module's output, and a test checks it is. Every query names only series that
llmq's /metrics serves (shared/metrics.py's catalogue), which a test checks against a live scrape.

    .venv/bin/python deploy/grafana/dashboard.py    # rewrites deploy/grafana/llmq.json

Import llmq.json in Grafana (Dashboards > New > Import) with a Prometheus data source that scrapes
any web process's /metrics: one scrape shows the whole deployment (docs/operations.md#metrics).
"""

from __future__ import annotations

from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder

OUT = Path(__file__).with_name("llmq.json")
RATE = "[$__rate_interval]"


def _query(expr: str, legend: str) -> Dataquery:
    return Dataquery().expr(expr).legend_format(legend)


def _series(title: str, unit: str, *queries: tuple[str, str], width: int = 12) -> Timeseries:
    panel = Timeseries().title(title).unit(unit).min(0).height(8).span(width)
    for expr, legend in queries:
        panel = panel.with_target(_query(expr, legend))
    return panel


def _quantiles(title: str, histogram: str) -> Timeseries:
    expr = "histogram_quantile({q}, sum by (le, model) (rate({h}_bucket{rate})))"
    return _series(title, "s", *((expr.format(q=q, h=histogram, rate=RATE), f"p{int(q * 100)} {{{{model}}}}")
                                 for q in (0.5, 0.99)))


def build() -> Dashboard:
    return (
        Dashboard("llmq").uid("llmq").tags(["llmq"]).refresh("30s").time("now-1h", "now")
        .with_row(Row("Queue"))
        .with_panel(_series("Unfinished jobs by level", "short",
                            ("sum by (model, level) (llmq_queue_depth)", "depth {{model}} L{{level}}"),
                            ("sum by (model, level) (llmq_queue_lag)", "not yet delivered {{model}} L{{level}}")))
        .with_panel(_series("Oldest unfinished job", "s",
                            ("max by (model, level) (llmq_queue_oldest_age_seconds)", "{{model}} L{{level}}")))
        .with_panel(Stat().title("Ready workers").height(4).span(6)
                    .with_target(_query("sum by (model) (llmq_workers_ready)", "{{model}}")))
        .with_panel(Stat().title("Dead letters").height(4).span(6)
                    .with_target(_query("sum by (model) (llmq_dead_letters)", "{{model}}")))
        .with_row(Row("Work"))
        .with_panel(_series("Jobs per second", "reqps",
                            (f"sum by (model) (rate(llmq_worker_jobs_started_total{RATE}))", "started {{model}}"),
                            (f"sum by (model) (rate(llmq_worker_jobs_reclaimed_total{RATE}))", "reclaimed {{model}}"),
                            (f"sum by (model, outcome) (rate(llmq_worker_jobs_ended_total{RATE}))",
                             "ended {{outcome}} {{model}}")))
        .with_panel(_series("Tokens per second", "short",
                            (f"sum by (model) (rate(llmq_worker_tokens_total{RATE}))", "{{model}}")))
        .with_panel(_series("Pooled inputs per second (embeddings, scored pairs)", "short",
                            (f"sum by (model) (rate(llmq_worker_pooled_inputs_total{RATE}))", "{{model}}")))
        .with_row(Row("Latency"))
        .with_panel(_quantiles("Queue wait", "llmq_queue_wait_seconds").span(8))
        .with_panel(_quantiles("Time to first token", "llmq_ttft_seconds").span(8))
        .with_panel(_quantiles("End to end", "llmq_e2e_seconds").span(8))
        .with_row(Row("API"))
        .with_panel(_series("Error answers per second", "reqps",
                            (f"sum by (status, code) (rate(llmq_api_errors_total{RATE}))", "{{status}} {{code}}")))
        .with_panel(_series("Streams in flight", "short",
                            ("sum by (api) (llmq_api_streams_in_flight)", "{{api}}")))
        .with_row(Row("Tenants"))
        .with_panel(_series("Tokens per second by tenant", "short",
                            (f"sum by (tenant) (rate(llmq_tenant_prompt_tokens_total{RATE})"
                             f" + rate(llmq_tenant_generated_tokens_total{RATE}))", "{{tenant}}")))
        .with_panel(_series("Waiting and running jobs by tenant", "short",
                            ("sum by (tenant) (llmq_tenant_waiting_jobs)", "waiting {{tenant}}"),
                            ("sum by (tenant) (llmq_tenant_running_jobs)", "running {{tenant}}")))
    )


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
