"""LLMQ_DURABILITY=replicas:N on a real primary and replica: a 202 means the replica holds the job;
a replica that does not confirm in time is a 503 in the dialect's shape, and the retry with the
same Idempotency-Key runs the job once. Both servers: Redis 6.2 and Valkey 8.1, whose WAIT counts
a connection's last *write* only (so a repeated key writes again: shared/lua/enqueue.lua's touch)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from shared.admission import new_job
from shared.durability import Durability, check_server
from shared.errors import NotDurable
from shared.keys import Keys
from shared.queue import JobStore
from shared.redis import connect
from shared.schemas import GenerationRequest, SamplingParams
from tests.support.replicated_redis import server_binaries, start_replicated
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import ScriptedStack, scripted_stack
from tests.support.waiting import eventually

MODEL = "tiny"
SERVERS = sorted(server_binaries())


@pytest.fixture(params=SERVERS)
def replicated(request, tmp_path):
    node = start_replicated(tmp_path, request.param)
    yield node
    node.stop()


def _job(prompt: str) -> dict:
    return {"prompt": prompt, "sampling": {"max_tokens": 3}}


async def test_a_202_means_the_replica_holds_the_job(replicated, prefix):
    keys = Keys(prefix)
    async with scripted_stack(replicated.url, prefix, durability="replicas:1", durability_timeout_ms=2000) as s:
        for i in range(20):
            resp = await s.client.post("/v1/jobs", json=_job(f"held {i}"), headers={"Prefer": "respond-async"})
            assert resp.status_code == 202, resp.text
            with replicated.client(1) as replica:  # read the moment the client is answered
                assert replica.hexists(keys.job(MODEL, resp.json()["id"]), "request")


async def test_a_replica_that_does_not_confirm_is_a_503_and_the_retry_runs_the_job_once(replicated, prefix):
    engine = ScriptedEngine()
    key = {"Idempotency-Key": uuid.uuid4().hex, "Prefer": "respond-async"}
    async with scripted_stack(replicated.url, prefix, engine, durability="replicas:1",
                              durability_timeout_ms=300) as s:
        replicated.pause(1)
        try:
            refused = await s.client.post("/v1/jobs", json=_job("unconfirmed"), headers=key)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "not_durable"
            # The job was written and may run, but is not acknowledged: a retry while the replica
            # still lags is refused too (on Valkey that needs the touch: WAIT counts the last write).
            again = await s.client.post("/v1/jobs", json=_job("unconfirmed"), headers=key)
            assert again.status_code == 503, again.text
        finally:
            replicated.resume(1)
        replicated.wait_linked()
        accepted = await s.client.post("/v1/jobs", json=_job("unconfirmed"), headers=key)
        assert accepted.status_code == 202, accepted.text
        job_id = accepted.json()["id"]

        async def done() -> bool:
            return (await s.client.get(f"/v1/jobs/{job_id}")).json()["status"] == "done"
        await eventually(done, what="the retried job to finish")
    runs = [r for r in engine.requests if r.prompt == "unconfirmed"]
    assert engine.started.count(job_id) == 1 and len(runs) == 1


async def test_durability_none_acknowledges_without_a_replica(replicated, prefix):
    async with scripted_stack(replicated.url, prefix) as s:
        replicated.pause(1)
        try:
            resp = await s.client.post("/v1/jobs", json=_job("fast"), headers={"Prefer": "respond-async"})
        finally:
            replicated.resume(1)
        assert resp.status_code == 202, resp.text


async def test_a_retry_from_another_connection_waits_for_the_first_write(replicated, prefix):
    """Two API processes: the first wrote the job and got too few confirmations; the retry reaches
    the second, whose connection wrote nothing. Its WAIT must still cover the job (Valkey and Redis
    7.2+ count a connection's own last write: without the touch it would return at once)."""
    durable = Durability(replicas=1, timeout_ms=300)
    first, second = connect(replicated.url), connect(replicated.url)
    try:
        queues = [JobStore(client, Keys(prefix), durability=durable) for client in (first, second)]
        key = uuid.uuid4().hex
        req = GenerationRequest(model=MODEL, prompt="twice", sampling=SamplingParams(max_tokens=3))
        replicated.pause(1)
        try:
            for queue in queues:
                with pytest.raises(NotDurable):
                    await queue.enqueue(new_job(req, owner="", default_timeout_s=None), key)
        finally:
            replicated.resume(1)
        replicated.wait_linked()
        # The retries may wait longer: a replica just resumed acknowledges once it has caught up
        # (more than 300 ms on a loaded box). The phase above is what tells a touch from none.
        patient = Durability(replicas=1, timeout_ms=5000)
        owners = {await JobStore(client, Keys(prefix), durability=patient).enqueue(
            new_job(req, owner="", default_timeout_s=None), key) for client in (first, second)}
        assert len(owners) == 1  # one job for the key, whichever process answered
    finally:
        await first.aclose()
        await second.aclose()


@asynccontextmanager
async def _picked_while_the_replica_is_paused(replicated, s: ScriptedStack, engine: ScriptedEngine, prompt: str
                                              ) -> AsyncIterator[tuple[JobStore, str]]:
    """With the replica paused, a job queued without waiting (LLMQ_DURABILITY=none elsewhere) that
    the stack's worker has claimed and started in its engine, but holds: its claim is only on the
    primary, which could still lose it. Yields the plain store and the job's id; the replica
    resumes on the way out."""
    plain = JobStore(s.redis, Keys(s.settings.prefix))
    req = GenerationRequest(model=MODEL, prompt=prompt, sampling=SamplingParams(max_tokens=3))
    replicated.pause(1)
    try:
        job_id = await plain.enqueue(new_job(req, owner="", default_timeout_s=None))
        await eventually(lambda: job_id in engine.started, what="the engine to start on the pick", timeout_s=5)
        yield plain, job_id
    finally:
        replicated.resume(1)


async def test_a_worker_writes_nothing_about_a_job_until_the_replica_holds_its_claim(replicated, prefix):
    """The engine starts on the pick (its prompt is processed while the replica catches up), but
    no event, no first token and no end is written before the claim is confirmed; then the job
    runs to its end once, every token once."""
    engine = ScriptedEngine()
    keys = Keys(prefix)
    async with scripted_stack(replicated.url, prefix, engine, durability="replicas:1", durability_timeout_ms=200) as s:
        async with _picked_while_the_replica_is_paused(replicated, s, engine, "gated") as (plain, job_id):
            await asyncio.sleep(1.0)
            assert await s.redis.exists(keys.events(MODEL, job_id)) == 0
            assert await s.redis.hmget(keys.job(MODEL, job_id), ["first_token_at", "log", "result"]) == [None] * 3
            assert await s.redis.hget(keys.job(MODEL, job_id), "status") == b"running"

        async def done() -> bool:
            record = await plain.get_job(MODEL, job_id)
            return record is not None and record.status == "done"

        await eventually(done, what="the job to finish once the replica confirms")
        record = await plain.get_job(MODEL, job_id)
        assert record is not None and record.result is not None
        assert record.result.choices[0].text == "gat"
        assert [e.seq for e in await plain.read_events(MODEL, job_id)] == [1, 2, 3]
    assert engine.started.count(job_id) == 1


async def test_a_claim_lost_before_the_replica_confirms_it_aborts_the_engine_request_and_writes_nothing(
        replicated, prefix):
    engine = ScriptedEngine()
    keys = Keys(prefix)
    async with scripted_stack(replicated.url, prefix, engine, durability="replicas:1", durability_timeout_ms=200) as s:
        async with _picked_while_the_replica_is_paused(replicated, s, engine, "lost") as (_, job_id):
            await s.redis.hset(keys.job(MODEL, job_id), "worker", "a-peer")  # a peer took it meanwhile
            await eventually(lambda: job_id in engine.aborted, what="the engine request to be aborted", timeout_s=5)
            await asyncio.sleep(0.3)
            assert await s.redis.exists(keys.events(MODEL, job_id)) == 0
            assert await s.redis.hget(keys.job(MODEL, job_id), "status") == b"running"  # untouched: the peer's


@pytest.mark.parametrize("appendonly", ["yes", "no"])
async def test_fsync_waits_for_the_primarys_own_aof_where_the_server_has_waitaof(tmp_path, prefix, appendonly):
    if "valkey-8.1" not in server_binaries():
        pytest.skip("no server with WAITAOF here")
    node = start_replicated(tmp_path, "valkey-8.1", replicas=0)
    try:
        client = connect(node.url)
        await client.config_set("appendonly", appendonly)
        durable = Durability.of("fsync", 1000)
        if appendonly == "no":
            with pytest.raises(ValueError, match="AOF on"):
                await check_server(client, durable)
        else:
            await check_server(client, durable)
            await client.config_set("appendfsync", "always")
            queue = JobStore(client, Keys(prefix), durability=durable)
            req = GenerationRequest(model=MODEL, prompt="on disk", sampling=SamplingParams(max_tokens=3))
            assert await queue.enqueue(new_job(req, owner="", default_timeout_s=None))
            await client.config_set("appendfsync", "no")  # the kernel's flush, ~30 s: WAITAOF times out
            with pytest.raises(NotDurable, match="on disk"):
                await JobStore(client, Keys(prefix), durability=Durability.of("fsync", 200)).enqueue(
                    new_job(req, owner="", default_timeout_s=None))
        await client.aclose()
    finally:
        node.stop()


async def test_fsync_refuses_to_start_on_a_server_without_waitaof(tmp_path):
    node = start_replicated(tmp_path, "redis-6.2", replicas=0)
    try:
        client = connect(node.url)
        with pytest.raises(ValueError, match="needs WAITAOF"):
            await check_server(client, Durability.of("fsync", 1000))
        await check_server(client, Durability.of("replicas:1", 1000))  # WAIT is everywhere
        await client.aclose()
    finally:
        node.stop()
