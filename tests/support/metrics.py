"""``GET /metrics`` read as Prometheus reads it (prometheus_client's own parser), for the tests of
its figures."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Samples", "samples", "sample"]

Samples = dict[tuple[str, frozenset], float]
"""Every sample of an exposition: (name, its labels) -> value."""


def samples(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(values: Samples, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with exactly ``labels``."""
    return values[(name, frozenset(labels.items()))]
