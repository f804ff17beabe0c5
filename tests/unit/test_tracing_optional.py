"""OpenTelemetry is an optional extra (``llmq[tracing]``): the web process and the worker start
without it, and only asking for tracing (the ``OTEL_*`` variables) makes it required, which the
entrypoint then says in one line. Each test runs a fresh interpreter in which ``import
opentelemetry`` fails, as it does where the extra is not installed."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

# Put first on sys.meta_path, ahead of the finders that would find the installed package.
NO_OPENTELEMETRY = """
import importlib.abc, sys

class NoOpenTelemetry(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
"""


def run_without_opentelemetry(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", NO_OPENTELEMETRY + code], capture_output=True, text=True,
                          env=environ, cwd=REPO, timeout=120)


def test_the_blocker_hides_opentelemetry(tmp_path):
    """The control: without it, the tests below would pass whatever the imports did."""
    out = run_without_opentelemetry("import opentelemetry.trace\n", tmp_path)
    assert out.returncode != 0 and "No module named 'opentelemetry'" in out.stderr


def test_the_api_and_the_worker_start_without_opentelemetry(tmp_path):
    code = """
import api.app, api.__main__, workers.__main__, workers.runner
from shared.config import load_settings, load_tracing

settings = load_settings({})
api.app.create_app(settings)
assert load_tracing("llmq-api", "api") is None and load_tracing("llmq-worker", "worker") is None
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry", "shared.tracing", "api.tracing",
                                                     "workers.tracing"))))
"""
    out = run_without_opentelemetry(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tracing_asked_for_without_opentelemetry_is_a_settings_error(tmp_path):
    code = """
from shared.config import SettingsError, load_tracing

try:
    load_tracing("llmq-worker", "worker")
except SettingsError as exc:
    print(exc)
"""
    out = run_without_opentelemetry(code, tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT="http://collector:4318")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("tracing is on (OTEL_* variables) but opentelemetry is not installed: "
                                  "pip install 'llmq[tracing]'")
