"""LLMQ_DURABILITY=replicas:N on a real primary and replica: a 202 means the replica holds the job;
a replica that does not confirm in time is a 503 in the dialect's shape, and the retry with the
same Idempotency-Key runs the job once. Both servers: Redis 6.2 and Valkey 8.1, whose WAIT counts
a connection's last *write* only (so a repeated key writes again: shared/lua/enqueue.lua's touch)."""

from __future__ import annotations

import uuid

import pytest

from shared.durability import Durability
from shared.errors import NotDurable
from shared.keys import Keys
from shared.queue import Queue
from shared.redis import connect
from shared.schemas import GenerationRequest, JobRecord, SamplingParams
from tests.support.replicated_redis import server_binaries, start_replicated
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import scripted_stack
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
        queues = [Queue(client, Keys(prefix), durability=durable) for client in (first, second)]
        key = uuid.uuid4().hex
        req = GenerationRequest(model=MODEL, prompt="twice", sampling=SamplingParams(max_tokens=3))
        replicated.pause(1)
        try:
            for queue in queues:
                with pytest.raises(NotDurable):
                    await queue.enqueue(JobRecord.new(req, owner="", default_timeout_s=None), key)
        finally:
            replicated.resume(1)
        replicated.wait_linked()
        owners = {await queue.enqueue(JobRecord.new(req, owner="", default_timeout_s=None), key) for queue in queues}
        assert len(owners) == 1  # one job for the key, whichever process answered
    finally:
        await first.aclose()
        await second.aclose()
