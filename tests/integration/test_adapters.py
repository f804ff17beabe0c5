"""LoRA adapters through the API, on real Redis and a scripted engine: registering and removing
them in vLLM's shape, listing them, naming one as the model in each dialect, tenants' private
adapters, and usage per adapter. Loading and generating with real vLLM: tests/e2e/test_adapters.py."""

from __future__ import annotations

import json

import pytest

from shared.keys import Keys
from shared.schemas import AdapterSpec
from tests.support.scripted_engine import ScriptedEngine
from tests.support.waiting import eventually
from workers.tiny_model import build_tiny_adapter

ENGINE = ScriptedEngine(delay_s=0.0)
pytestmark = pytest.mark.stack(ENGINE, prefix="adapters", tenant_header="x-tenant", max_lora_rank=8)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return build_tiny_adapter(tmp_path_factory.mktemp("lora") / "a", seed=1)


async def load(client, name, path, tenant="t1", **more):
    return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **more},
                             headers={"x-tenant": tenant})


async def unload(client, name, tenant="t1"):
    return await client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers={"x-tenant": tenant})


def error(resp) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["message"]


async def model_ids(client, tenant="t1") -> dict[str, dict]:
    return {m["id"]: m for m in (await client.get("/v1/models", headers={"x-tenant": tenant})).json()["data"]}


async def test_register_list_use_and_remove_an_adapter(stack, adapter_dir):
    client, redis, settings = stack.client, stack.redis, stack.settings
    resp = await load(client, "sql", adapter_dir)
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert resp.headers["content-type"].startswith("text/plain")
    assert error(await load(client, "sql", adapter_dir)) == (400, (
        "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, set "
        "'load_inplace' to True."))
    assert (await load(client, "sql", adapter_dir, load_inplace=True)).status_code == 200
    # The registry is one hash, readable with redis-cli.
    entry = json.loads(await redis.hget(Keys(settings.prefix).adapters(), "sql"))
    assert {k: entry[k] for k in ("name", "base", "source", "rank")} == {
        "name": "sql", "base": "tiny", "source": str(adapter_dir), "rank": 8}
    # Listed as vLLM lists an adapter: its base model as parent, its source as root.
    assert (await model_ids(client))["sql"] == {
        "id": "sql", "object": "model", "created": 0, "owned_by": "llmq", "root": str(adapter_dir), "parent": "tiny",
        "max_model_len": settings.max_model_len}

    resp = await client.post("/v1/completions", json={"model": "sql", "prompt": "hey", "max_tokens": 3},
                             headers={"x-tenant": "t1"})
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["model"] == "sql"  # echoed as asked, as vLLM does
    job_id = answer["id"].removeprefix("cmpl-")
    # The job is the base model's, and runs with the adapter's source.
    req = ENGINE.requests[-1]
    assert (req.model, req.adapter) == ("tiny", AdapterSpec(name="sql", source=str(adapter_dir)))
    assert await redis.hget(Keys(settings.prefix).job("tiny", job_id), "adapter") == b"sql"
    # Usage: the model's row, then the adapter's part of it.
    rows = (await client.get("/v1/usage?days=1", headers={"x-tenant": "t1"})).json()["data"]
    assert [(r["model"], r.get("adapter"), r["requests"], r["generated_tokens"]) for r in rows] == [
        ("tiny", None, 1, 3), ("tiny", "sql", 1, 3)]

    resp = await unload(client, "sql")
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert error(await unload(client, "sql")) == (404, "The lora adapter 'sql' cannot be found.")
    assert "sql" not in await model_ids(client)
    resp = await client.post("/v1/completions", json={"model": "sql", "prompt": "hey", "max_tokens": 3})
    assert error(resp) == (404, "The model `sql` does not exist.")


async def test_every_dialect_names_an_adapter(stack, adapter_dir):
    client = stack.client
    assert (await load(client, "every", adapter_dir)).status_code == 200
    spec = AdapterSpec(name="every", source=str(adapter_dir))
    calls = [
        ("/v1/chat/completions", {"model": "every", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         lambda r: r["model"]),
        ("/v1/responses", {"model": "every", "input": "hi", "max_output_tokens": 2}, lambda r: r["model"]),
        ("/v1/messages", {"model": "every", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         lambda r: r["model"]),
        ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "adapter_id": "every"}}, None),
        ("/v2/models/tiny/generate", {"text_input": "hi", "parameters": {"max_tokens": 2, "lora_name": "every"}},
         None),  # its model_name is the path's, as Triton's is
        ("/invocations", {"inputs": "hi", "parameters": {"max_new_tokens": 2}, "adapters": "every"}, None),
        ("/v1/completions", {"model": "every", "prompt": ["a", "b"], "max_tokens": 2}, lambda r: r["model"]),
    ]
    for path, body, echoed in calls:
        before = len(ENGINE.requests)
        resp = await client.post(path, json=body, headers={"x-tenant": "t1"})
        assert resp.status_code == 200, (path, resp.text)
        assert echoed is None or echoed(resp.json()) == "every", (path, resp.json())
        assert [r.adapter for r in ENGINE.requests[before:]] == [spec] * (2 if path == "/v1/completions" else 1), path
    assert (await unload(client, "every")).status_code == 200


async def test_a_private_adapter_is_its_tenants_alone(stack, adapter_dir):
    client = stack.client
    assert (await load(client, "mine", adapter_dir, tenant="t1", private=True)).status_code == 200
    assert "mine" in await model_ids(client, "t1") and "mine" not in await model_ids(client, "t2")
    body = {"model": "mine", "prompt": "hey", "max_tokens": 2}
    assert (await client.post("/v1/completions", json=body, headers={"x-tenant": "t1"})).status_code == 200
    resp = await client.post("/v1/completions", json=body, headers={"x-tenant": "t2"})
    assert error(resp) == (404, "The model `mine` does not exist.")  # as if it did not exist
    resp = await client.post("/v1/messages", headers={"x-tenant": "t2"},
                             json={"model": "mine", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    assert error(await unload(client, "mine", tenant="t2")) == (404, "The lora adapter 'mine' cannot be found.")
    assert error(await load(client, "mine", adapter_dir, tenant="t2", load_inplace=True)) == (
        400, "The lora adapter 'mine' conflicts with another tenant's.")
    assert (await unload(client, "mine", tenant="t1")).status_code == 200


async def test_registration_refuses_what_it_can_tell_is_wrong(stack, adapter_dir, tmp_path):
    client = stack.client
    too_big = build_tiny_adapter(tmp_path / "big", seed=3, rank=16)
    assert error(await load(client, "big", too_big)) == (
        400, f"The adapter at '{too_big}' has rank 16, above this deployment's limit of 8 (LLMQ_MAX_LORA_RANK)")
    assert error(await load(client, "empty", tmp_path)) == (
        400, f"No LoRA adapter at '{tmp_path}': it has no adapter_config.json")
    assert error(await load(client, "tiny", adapter_dir)) == (
        400, "The lora adapter 'tiny' conflicts with a served base model.")
    assert error(await load(client, "x", adapter_dir, base_model_name="nope")) == (
        404, "The model `nope` does not exist.")
    assert error(await load(client, "", adapter_dir)) == (400, "Both 'lora_name' and 'lora_path' must be provided.")
    resp = await client.post("/v1/load_lora_adapter", content=b"\xff\xfe{",
                             headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"
    # A hub name, or a directory only the workers see, is left to them: its job fails if it is wrong.
    assert (await load(client, "hub", "org/some-lora")).status_code == 200
    assert (await model_ids(client))["hub"]["root"] == "org/some-lora"
    assert (await unload(client, "hub")).status_code == 200


async def test_a_client_cannot_name_an_adapters_source(stack):
    """The jobs dialect takes the internal request as its body: an ``adapter`` in it is replaced by
    what the registry says (nothing, for a base model), so no client picks what a worker loads."""
    client = stack.client
    body = {"model": "tiny", "prompt": "no adapter", "sampling": {"max_tokens": 2},
            "adapter": {"name": "evil", "source": "/etc"}}
    resp = await client.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]

    async def ended() -> bool:
        return (await client.get(f"/v1/jobs/{job_id}")).json()["status"] == "done"

    await eventually(ended, what="the job to end")
    [req] = [r for r in ENGINE.requests if r.prompt == "no adapter"]
    assert req.adapter is None
    raw = await stack.redis.hget(Keys(stack.settings.prefix).job("tiny", job_id), "request")
    assert b"/etc" not in raw and b"evil" not in raw
