"""The dead-worker takeover on a Redis Cluster (a local 3-master Redis 6.2 cluster).

PUBSUB NUMSUB counts the subscribers of the node it is sent to. A worker subscribes its control
channel on the master serving its model's slot and its peers count there; a channel with no
subscriber there is counted on the other masters too, so a worker that subscribed elsewhere (one
from before this rule: it picked a random master) is still alive to its peers.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis

from shared.config import load_settings
from shared.keys import GROUP, Keys
from shared.queue import Consumer, JobStore
from shared.redis import connect
from tests.support.inprocess_workers import MODEL, TAKEOVER_S, judging, seconds_until_taken, submit, subscribe_confirmed
from tests.support.redis_cluster import LocalCluster, start_cluster
from tests.support.scripted_engine import ContextEngine
from workers.runner import Worker


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = start_cluster(tmp_path_factory.mktemp("takeover-cluster"))
    yield local
    local.stop()


def plain_subscribers(cluster: LocalCluster, channel: str) -> list[int]:
    """The channel's subscribers on each node, in port order."""
    counts = []
    for i in range(len(cluster.ports)):
        with SyncRedis.from_url(cluster.node_url(i)) as node:
            counts.append(dict(node.pubsub_numsub(channel)).get(channel.encode(), 0))
    return counts


async def subscribed_on(url: str, channel: str):
    """A client of one node and its confirmed subscription to ``channel`` (close both)."""
    client = Redis.from_url(url)
    return client, await subscribe_confirmed(client, channel)


async def test_a_worker_subscribes_on_its_models_master_and_judges_peers_on_every_master(cluster):
    prefix = f"tc-{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    redis = connect(cluster.url)
    store, consumer = JobStore(redis, keys), Consumer(redis, keys)
    await consumer.ensure_group(MODEL)
    home = cluster.ports.index(cluster.owner_port(keys.queue(MODEL)))
    elsewhere = (home + 1) % len(cluster.ports)
    old_job, dead_job = await submit(store, "old", 5), await submit(store, "dead", 5)
    # "old" subscribed on another master, as workers did before; "dead" where workers do now.
    old = await subscribed_on(cluster.node_url(elsewhere), keys.worker_control("old"))
    dead = await subscribed_on(cluster.node_url(home), keys.worker_control("dead"))
    [got_old] = (await consumer.pick(MODEL, "old", 1)).deliveries
    [got_dead] = (await consumer.pick(MODEL, "dead", 1)).deliveries
    assert (got_old.job_id, got_dead.job_id) == (old_job, dead_job)
    settings = load_settings({}, redis_url=cluster.url, prefix=prefix, served_model_name=MODEL, block_ms=100,
                             heartbeat_s=0.2, lease_s=30.0)
    worker = Worker(settings, Consumer(redis, keys), ContextEngine(0.005))
    task = asyncio.create_task(worker.run())
    try:
        await judging(worker)
        expected = [0] * len(cluster.ports)
        expected[home] = 1
        assert plain_subscribers(cluster, keys.worker_control(worker.worker_id)) == expected

        await dead[1].aclose()
        await dead[0].aclose()
        taken_s = await seconds_until_taken(store, dead_job, worker, since=time.monotonic())
        assert TAKEOVER_S <= taken_s < 1.0, taken_s
        await asyncio.sleep(2 * TAKEOVER_S)
        job = await store.get_job(MODEL, old_job)
        assert job.worker == "old" and job.attempt == 1, "a subscriber on another master counts"
        pending = await redis.xpending_range(keys.queue(MODEL), GROUP, "-", "+", 10)
        assert [p["consumer"] for p in pending] == [b"old"]
    finally:
        worker.stop()
        await asyncio.wait([task], timeout=20)
        await old[1].aclose()
        await old[0].aclose()
        await redis.aclose()
