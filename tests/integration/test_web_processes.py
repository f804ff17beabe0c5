"""``LLMQ_WEB_PROCESSES=2``: two web processes on one port, sharing one model, relay exactly.

The real ``python -m api`` (api/__main__.py: a supervisor and two children on SO_REUSEPORT
sockets) on real Redis, and an in-process worker with the scripted engine, whose every token is
known in advance. Which child served a connection is read from the kernel: the child whose file
descriptors hold the server side of that TCP connection (``/proc/<pid>/fd`` and ``/proc/net/tcp``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shared.config import load_settings
from shared.keys import Keys
from shared.queue import Consumer
from shared.redis import connect
from shared.schemas import GenerationRequest
from tests.bench.cpu import children as child_pids
from tests.conftest import REPO, free_port
from tests.support.processes import spawn_logged
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.waiting import eventually
from tests.support.web_process import stop
from workers.protocol import Step
from workers.runner import Worker

MODEL = "tiny"
START_TIMEOUT_S = 60
GRACEFUL_S = 10  # api/__main__.py's: how long a stopping web process lets its streams run


# --- which process holds a connection -----------------------------------------------------

def _server_socket_inode(api_port: int, client_port: int) -> str | None:
    """The inode of the accepted socket whose local port is the API's and remote the client's."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            local, remote = int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)
            if local == api_port and remote == client_port:
                return cols[9]
    return None


def serving_pid(parent: int, api_port: int, client_port: int) -> int | None:
    inode = _server_socket_inode(api_port, client_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in child_pids(parent):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return pid
            except OSError:
                continue
    return None


def client_port(resp: httpx.Response) -> int:
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


# --- the deployment: python -m api with two processes + a scripted worker ------------------

@dataclass
class Web:
    proc: subprocess.Popen
    port: int
    url: str
    log: Path
    engine: ScriptedEngine
    children: list[int] = field(default_factory=list)

    def served_by(self, resp: httpx.Response) -> int | None:
        return serving_pid(self.proc.pid, self.port, client_port(resp))


@asynccontextmanager
async def web_processes(redis_url: str, prefix: str, log: Path, engine: ScriptedEngine,
                        **env_extra: str) -> AsyncIterator[Web]:
    port = free_port()
    env = {**os.environ, "LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_HOST": "127.0.0.1",
           "LLMQ_PORT": str(port), "LLMQ_SERVED_MODEL_NAME": MODEL, "LLMQ_LOG_JSON": "true",
           "LLMQ_WEB_PROCESSES": "2", "LLMQ_SSE_KEEPALIVE_S": "0.5", **env_extra}
    proc = spawn_logged([sys.executable, "-m", "api"], log, cwd=REPO, env=env, start_new_session=True)
    keys = Keys(prefix)
    redis = connect(redis_url)
    settings = load_settings({}, redis_url=redis_url, prefix=prefix, served_model_name=MODEL, block_ms=200)
    worker = Worker(settings, Consumer(redis, keys), engine, worker_id=f"w-{prefix}")
    worker_task = asyncio.create_task(worker.run())
    try:
        # Up: both children's listeners hold their home channel, and the worker is routable.
        async def up() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"the web processes exited:\n{log.read_text(errors='replace')[-3000:]}")
            return (len(await redis.pubsub_channels(keys.api_home("*"))) >= 2
                    and await redis.zscore(keys.workers(MODEL), worker.worker_id) is not None)
        await eventually(up, timeout_s=START_TIMEOUT_S, interval_s=0.1,
                         what=lambda: f"the web processes to start:\n{log.read_text(errors='replace')[-3000:]}")
        web = Web(proc, port, f"http://127.0.0.1:{port}", log, engine, child_pids(proc.pid))
        assert len(web.children) == 2, web.children
        yield web
    finally:
        worker.stop()
        await asyncio.wait_for(worker_task, 10)
        stop(proc)
        await redis.aclose()


@dataclass
class Streamed:
    pid: int | None
    texts: list[str]
    finish_reasons: list[str | None]
    frames_after_done: int
    done: bool


async def stream_completion(web: Web, client: httpx.AsyncClient, prompt: str, max_tokens: int,
                            started: asyncio.Event | None = None) -> Streamed:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    out = Streamed(None, [], [], 0, False)
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        out.pid = web.served_by(resp)
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if out.done:
                out.frames_after_done += 1
            elif line == "data: [DONE]":
                out.done = True
            else:
                choice = json.loads(line[6:])["choices"][0]
                out.texts.append(choice["text"])
                out.finish_reasons.append(choice["finish_reason"])
                if started is not None:
                    started.set()
    return out


def assert_exact(s: Streamed, prompt: str, max_tokens: int) -> None:
    """Every token once, in order (a chunk carries one step, or every step its job made while the
    worker's flusher was busy), the finish reason on the last, then [DONE]."""
    assert "".join(s.texts) == expected_text(prompt, max_tokens)
    assert all(s.texts)
    assert s.finish_reasons == [None] * (len(s.texts) - 1) + ["length"]
    assert s.done and s.frames_after_done == 0


class GatedEngine(ScriptedEngine):
    """The scripted tokens; a prompt starting with "gated" holds after its first ``hold_after``
    tokens until :attr:`gate` is set."""

    def __init__(self, delay_s: float, hold_after: int) -> None:
        super().__init__(delay_s)
        self.hold_after = hold_after
        self.gate = asyncio.Event()

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        n = 0
        async for step in super().steps(job_id, req, replay):
            if n == self.hold_after and (req.prompt or "").startswith("gated"):
                await self.gate.wait()
            n += 1
            yield step


# --- the tests ------------------------------------------------------------------------------

async def test_many_streams_through_two_processes_each_exact(redis_url, prefix, tmp_path):
    streams, max_tokens = 48, 30
    async with web_processes(redis_url, prefix, tmp_path / "web.log", ScriptedEngine(delay_s=0.005)) as web:
        limits = httpx.Limits(max_connections=streams)
        async with httpx.AsyncClient(base_url=web.url, timeout=30, limits=limits) as client:
            prompts = [f"p{i:02d}{chr(97 + i % 26)}-" for i in range(streams)]
            results = await asyncio.gather(*(stream_completion(web, client, p, max_tokens) for p in prompts))
        for prompt, result in zip(prompts, results, strict=True):
            assert_exact(result, prompt, max_tokens)
        served = [r.pid for r in results]
        # Every connection was held by one of the children, and the kernel hashed them over both
        # sockets: fewer than 8 of 48 on one side has probability ~1e-6 (binomial). One listening
        # socket shared by both (uvicorn's workers) let the first child to wake take most of them.
        assert set(served) <= set(web.children), (served, web.children)
        assert min(served.count(pid) for pid in web.children) >= streams // 6, served
        assert web.proc.poll() is None and child_pids(web.proc.pid) == web.children  # none restarted


async def test_a_killed_process_is_replaced_on_its_socket(redis_url, prefix, tmp_path):
    streams, max_tokens = 24, 20
    async with web_processes(redis_url, prefix, tmp_path / "web.log", ScriptedEngine(delay_s=0.005)) as web:
        killed, kept = web.children
        os.kill(killed, signal.SIGKILL)
        keys = Keys(prefix)
        redis = connect(redis_url)
        try:
            deadline = time.monotonic() + 20
            while True:  # a new child, and its listener up: two home channels again
                children = child_pids(web.proc.pid)
                if len(children) == 2 and killed not in children and \
                        len(await redis.pubsub_channels(keys.api_home("*"))) == 2:
                    break
                assert time.monotonic() < deadline, children
                await asyncio.sleep(0.1)
        finally:
            await redis.aclose()
        assert kept in children
        web.children = children
        async with httpx.AsyncClient(base_url=web.url, timeout=30,
                                     limits=httpx.Limits(max_connections=streams)) as client:
            prompts = [f"again{i}-" for i in range(streams)]
            results = await asyncio.gather(*(stream_completion(web, client, p, max_tokens) for p in prompts))
        for prompt, result in zip(prompts, results, strict=True):
            assert_exact(result, prompt, max_tokens)
        assert {r.pid for r in results} == set(children)  # the replacement serves its socket's share


async def test_resume_through_the_other_process(redis_url, prefix, tmp_path):
    max_tokens, prompt = 40, "gated-"
    engine = GatedEngine(delay_s=0.01, hold_after=5)
    async with web_processes(redis_url, prefix, tmp_path / "web.log", engine) as web:
        async with httpx.AsyncClient(base_url=web.url, timeout=30) as client:
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens":
                                                              max_tokens}, headers={"Prefer": "respond-async"})
            assert resp.status_code == 202
            job_id = resp.json()["id"]

        async def events(headers: dict[str, str], avoid: int | None, stop_after: int | None
                         ) -> tuple[int, list[tuple[int, dict]]]:
            """The job's SSE events on a fresh connection, opened again until a process other than
            ``avoid`` holds it; stops once its events carry ``stop_after`` tokens (None: the whole
            stream; steps made while the worker's flusher was behind share an event). Once a
            connection is kept, the engine's gate opens."""
            for _ in range(50):
                async with httpx.AsyncClient(base_url=web.url, timeout=30) as fresh, \
                        fresh.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r:
                    assert r.status_code == 200
                    pid = web.served_by(r)
                    assert pid in web.children
                    if pid == avoid:
                        continue
                    if stop_after is None:
                        engine.gate.set()  # subscribed (the route subscribes before it answers)
                    out: list[tuple[int, dict]] = []
                    buf = ""
                    async for chunk in r.aiter_text():
                        buf += chunk
                        while "\n\n" in buf:
                            frame, buf = buf.split("\n\n", 1)
                            if frame.startswith("id: "):
                                id_line, data_line = frame.split("\n")
                                out.append((int(id_line[4:]), json.loads(data_line.removeprefix("data: "))))
                        tokens = sum(len(d["token_ids"]) for _, e in out for d in e.get("deltas", []))
                        if stop_after is not None and tokens >= stop_after:
                            return pid, out
                    return pid, out
            pytest.fail(f"50 connections in a row went to process {avoid}")

        # Five tokens live from one process; the engine then holds the job until the resume below
        # is connected, so the other process relays the rest live, not from a finished log.
        first_pid, first = await events({}, None, stop_after=5)
        assert [seq for seq, _ in first] == list(range(1, len(first) + 1))
        async with httpx.AsyncClient(base_url=web.url, timeout=30) as client:
            assert (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "running"
        second_pid, rest = await events({"Last-Event-ID": str(len(first))}, first_pid, stop_after=None)
        assert second_pid != first_pid

        _, whole = await events({}, None, stop_after=None)  # the log, read once the job is done
        assert first + rest == whole
        assert [seq for seq, _ in whole] == list(range(1, len(whole) + 1))
        assert whole[-1][1]["type"] == "done"
        text = "".join(d["text"] for _, e in whole for d in e.get("deltas", []))  # done carries the last step
        assert text == expected_text(prompt, max_tokens)


async def test_sigterm_drains_every_process_then_the_parent_exits_0(redis_url, prefix, tmp_path):
    streams, max_tokens = 24, 60  # all 24 hashed to one process: probability 2**-23
    log = tmp_path / "web.log"
    async with web_processes(redis_url, prefix, log, ScriptedEngine(delay_s=0.03)) as web:  # ~1.8 s per stream
        children = web.children
        async with httpx.AsyncClient(base_url=web.url, timeout=30,
                                     limits=httpx.Limits(max_connections=streams)) as client:
            prompts = [f"drain{i}-" for i in range(streams)]
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(stream_completion(web, client, p, max_tokens, e))
                     for p, e in zip(prompts, started, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 10)
            signalled = time.monotonic()
            web.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            drained_s = time.monotonic() - signalled
        for prompt, result in zip(prompts, results, strict=True):
            assert_exact(result, prompt, max_tokens)
        assert {r.pid for r in results} == set(children)  # both processes had streams to drain
        assert 0.5 < drained_s < GRACEFUL_S  # the streams ran on after the signal, and ended by themselves
        code = await asyncio.get_running_loop().run_in_executor(None, web.proc.wait, GRACEFUL_S)
        assert code == 0, log.read_text(errors="replace")[-3000:]
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)  # exited, and reaped by the parent
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        stopped = [e for e in lines if e["event"] == "web_processes_stopped"]
        assert len(stopped) == 1 and not any(e["event"] == "web_process_restarted" for e in lines)
        # Nothing listens on the port any more (a server may bind it again: SO_REUSEADDR, as uvicorn
        # binds, passes over the TIME_WAIT connections the drained streams left).
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", web.port), timeout=2):
            pass
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", web.port))


async def test_one_scrape_shows_every_web_process_series(redis_url, prefix, tmp_path):
    """A scrape lands on one of the N processes; each process's own series (its error answers)
    reach it through Redis, labelled with that process's id."""
    from prometheus_client.parser import text_string_to_metric_families

    async with web_processes(redis_url, prefix, tmp_path / "web.log", ScriptedEngine(delay_s=0.001),
                             LLMQ_HEARTBEAT_S="0.2") as web:
        refused: dict[int | None, int] = {}
        for _ in range(200):  # a new connection each: the kernel spreads them over both processes
            async with httpx.AsyncClient(base_url=web.url, timeout=10) as client:
                resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
                assert resp.status_code == 400
                pid = web.served_by(resp)
            refused[pid] = refused.get(pid, 0) + 1
            if len(refused) == 2 and min(refused.values()) >= 3:
                break
        assert sorted(refused) == sorted(web.children), refused
        redis = connect(redis_url)
        try:
            ids = {a.decode() for a in await redis.zrange(Keys(prefix).apis(), 0, -1)}
        finally:
            await redis.aclose()
        assert len(ids) == 2
        expected = sorted(refused.values())
        for _ in range(50):  # until both processes pushed what they counted
            async with httpx.AsyncClient(base_url=web.url, timeout=10) as client:
                text = (await client.get("/metrics")).text
            counts = {s.labels["api"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name == "llmq_api_errors_total" and s.labels.get("status") == "400"}
            if sorted(counts.values()) == expected:
                break
            await asyncio.sleep(0.1)
        assert set(counts) == ids and sorted(counts.values()) == expected
