"""LoRA adapters through the API, on real Redis and a scripted engine: registering and removing
them in vLLM's shape, listing them, naming one as the model in each dialect, who may register,
replace and unload (two tenants' keys, an operator's, and a tenant header that grants nothing),
private adapters invisible everywhere to other keys, the sources registration refuses (one answer
for all), names and caps, the negative cache, a keyless deployment (make run's adapters),
``llmq-adapters``, and usage per adapter. Loading and generating with real vLLM:
tests/e2e/test_adapters.py."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path

import aiohttp
import httpx
import msgspec
import pytest

from api.announce import _register_tiny_adapters
from api.auth import Viewer
from api.models import ModelRegistry
from shared.adapters import REFUSED, AdapterStore, main, new_adapter
from shared.errors import ModelNotFound
from shared.keys import Keys
from shared.schemas import AdapterSpec
from shared.tenants import key_hash
from tests.support.scripted_engine import ScriptedEngine
from tests.support.scripted_stack import ScriptedStack, scripted_stack
from tests.support.waiting import eventually
from workers.protocol import AdapterState
from workers.tiny_model import build_tiny_adapter

A, B, OP = "key-of-tenant-a", "key-of-tenant-b", "key-of-the-operator"
HA, HB, HOP = key_hash(A), key_hash(B), key_hash(OP)


class HoldingEngine(ScriptedEngine):
    """A scripted engine whose heartbeat names the adapters a test says it holds."""

    held: tuple[str, ...] = ()

    def adapter_state(self) -> AdapterState:
        return AdapterState(held=self.held)


ENGINE = HoldingEngine(delay_s=0.0)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapter-roots").resolve()


@pytest.fixture(scope="module")
def dirs(roots: Path) -> dict[str, Path]:
    """The operators' adapter, one in each tenant key's subdirectory, and one outside the roots."""
    return {"op": build_tiny_adapter(roots / "ops" / "sql", seed=1),
            "a": build_tiny_adapter(roots / HA / "mine", seed=2),
            "b": build_tiny_adapter(roots / HB / "theirs", seed=3),
            "outside": build_tiny_adapter(roots.parent / f"{roots.name}-outside" / "x", seed=4)}


@pytest.fixture(scope="module")
async def stack(redis_url: str, roots: Path):
    async with scripted_stack(redis_url, f"adapters-{uuid.uuid4().hex[:6]}", ENGINE, api_keys=f"{A},{B}",
                              operator_keys=OP, tenant_header="x-tenant", tenant_adapters="private",
                              adapter_roots=str(roots), adapter_hub_allow="hub-org", adapters_per_owner=3,
                              max_lora_rank=8, heartbeat_s=0.5) as s:
        yield s


def auth(key: str, tenant: str | None = None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **({"x-tenant": tenant} if tenant else {})}


async def load(client: httpx.AsyncClient, key: str, name: str, path: Path | str, tenant: str | None = None,
               **more: object) -> httpx.Response:
    return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **more},
                             headers=auth(key, tenant))


async def unload(client: httpx.AsyncClient, key: str, name: str, tenant: str | None = None) -> httpx.Response:
    return await client.post("/v1/unload_lora_adapter", json={"lora_name": name}, headers=auth(key, tenant))


def error(resp: httpx.Response) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["message"]


async def model_ids(client: httpx.AsyncClient, key: str, tenant: str | None = None) -> dict[str, dict]:
    resp = await client.get("/v1/models", headers=auth(key, tenant))
    return {m["id"]: m for m in resp.json()["data"]}


async def entry(stack: ScriptedStack, name: str) -> dict | None:
    raw = await stack.redis.hget(Keys(stack.settings.prefix).adapters(), name)
    return None if raw is None else json.loads(raw)


async def model_info(stack: ScriptedStack, key: str, name: str, tenant: str | None = None) -> dict:
    """LMTP's MODEL_INFO for ``name``: its MSG payload."""
    url = stack.url.replace("http://", "ws://") + "/"
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers=auth(key, tenant)) as ws:
        await ws.send_str("MODEL_INFO " + json.dumps({"stream_id": 1, "model": name}))
        head, _, body = (await asyncio.wait_for(ws.receive_str(), 10)).partition(" ")
    assert head == "MSG"
    [payload] = json.loads(body)
    return payload


async def count_tokens(stack: ScriptedStack, key: str, name: str, tenant: str | None = None) -> httpx.Response:
    return await stack.client.post("/v1/messages/count_tokens", headers=auth(key, tenant),
                                   json={"model": name, "messages": [{"role": "user", "content": "hi"}]})


async def complete(stack: ScriptedStack, key: str, name: str, tenant: str | None = None) -> httpx.Response:
    return await stack.client.post("/v1/completions", json={"model": name, "prompt": "hey", "max_tokens": 2},
                                   headers=auth(key, tenant))


async def test_an_operator_registers_lists_uses_and_removes_an_adapter(stack, dirs):
    client, redis, settings = stack.client, stack.redis, stack.settings
    resp = await load(client, OP, "sql", dirs["op"])
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert resp.headers["content-type"].startswith("text/plain")
    assert error(await load(client, OP, "sql", dirs["op"])) == (400, (
        "The lora adapter 'sql' has already been loaded. If you want to load the adapter in place, set "
        "'load_inplace' to True."))
    assert (await load(client, OP, "sql", dirs["op"], load_inplace=True)).status_code == 200
    # The registry is one hash, readable with redis-cli; the entry names the key that registered it.
    found = await entry(stack, "sql")
    assert {k: found[k] for k in ("name", "base", "source", "rank", "owner")} == {
        "name": "sql", "base": "tiny", "source": str(dirs["op"]), "rank": 8, "owner": HOP}
    assert "private" not in found and "tenant" not in found
    # Listed as vLLM lists an adapter, its base model as parent; its source as root to operators only.
    card = {"id": "sql", "object": "model", "created": 0, "owned_by": "llmq", "root": str(dirs["op"]),
            "parent": "tiny", "max_model_len": settings.max_model_len, "input_modalities": ["text"],
            "kind": "generate"}
    assert (await model_ids(client, OP))["sql"] == card
    assert (await model_ids(client, A))["sql"] == {**card, "root": "sql"}

    resp = await complete(stack, A, "sql")
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["model"] == "sql"  # echoed as asked, as vLLM does
    job_id = answer["id"].removeprefix("cmpl-")
    # The job is the base model's, and runs with the adapter's source.
    req = ENGINE.requests[-1]
    assert (req.model, req.adapter) == ("tiny", AdapterSpec(name="sql", source=str(dirs["op"])))
    assert await redis.hget(Keys(settings.prefix).job("tiny", job_id), "adapter") == b"sql"
    # Usage: the model's row, then the adapter's part of it. The meter is written by the flush's
    # second half (finish.lua), a moment after the log's terminal event that answered the client.
    async def usage():
        rows = (await client.get("/v1/usage?days=1", headers=auth(A))).json()["data"]
        return [(r["model"], r.get("adapter"), r["requests"], r["generated_tokens"]) for r in rows]
    assert await eventually(usage, what="the job's usage") == [("tiny", None, 1, 2), ("tiny", "sql", 1, 2)]

    resp = await unload(client, OP, "sql")
    assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'sql' removed successfully.")
    assert error(await unload(client, OP, "sql")) == (404, "The lora adapter 'sql' cannot be found.")
    assert "sql" not in await model_ids(client, OP)
    assert error(await complete(stack, A, "sql")) == (404, "The model `sql` does not exist.")


async def test_every_dialect_names_an_adapter(stack, dirs):
    client = stack.client
    assert (await load(client, OP, "every", dirs["op"])).status_code == 200
    spec = AdapterSpec(name="every", source=str(dirs["op"]))
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
        resp = await client.post(path, json=body, headers=auth(A))
        assert resp.status_code == 200, (path, resp.text)
        assert echoed is None or echoed(resp.json()) == "every", (path, resp.json())
        assert [r.adapter for r in ENGINE.requests[before:]] == [spec] * (2 if path == "/v1/completions" else 1), path
    assert (await unload(client, OP, "every")).status_code == 200


async def test_a_tenants_key_registers_private_adapters_from_its_own_directory_only(stack, dirs):
    client = stack.client
    assert error(await load(client, A, "a-pub", dirs["a"])) == (403, (
        "A tenant's key may register private LoRA adapters only (LLMQ_TENANT_ADAPTERS=private): set 'private': true"))
    for other in (dirs["b"], dirs["op"]):  # another key's files, or the operators'
        assert error(await load(client, A, "a-own", other, private=True)) == (400, REFUSED)
    # The tenant header names nobody's files and no owner: the entry is the key's.
    assert (await load(client, A, "a-own", dirs["a"], tenant=HB, private=True)).status_code == 200
    found = await entry(stack, "a-own")
    assert (found["owner"], found["private"], found["source"]) == (HA, True, str(dirs["a"]))
    assert "tenant" not in found
    assert (await unload(client, A, "a-own")).status_code == 200


async def test_a_private_adapter_is_invisible_to_every_other_key_everywhere(stack, dirs):
    client = stack.client
    assert (await load(client, A, "mine", dirs["a"], private=True)).status_code == 200
    assert (await load(client, OP, "pub-x", dirs["op"])).status_code == 200
    ENGINE.held = ("gone", "mine", "pub-x")  # "gone": held by an engine, registered no more

    async def deployment(key: str) -> tuple[list[str], list[list[str]]]:
        body = (await client.get("/v1/deployment", headers=auth(key))).json()
        [model] = [m for m in body["models"] if m["name"] == "tiny"]
        return model["adapters"], [w["adapters"] for w in body["workers"] if w["model"] == "tiny"]

    async def beaten() -> bool:
        return (await deployment(OP))[0] == ["gone", "mine", "pub-x"]

    await eventually(beaten, timeout_s=10, what="the worker's heartbeat to name its adapters")
    try:
        # Another key, and another key that names the owner's tenant in the header: nothing anywhere.
        for key, tenant in ((B, None), (B, HA)):
            ids = await model_ids(client, key, tenant)
            assert "mine" not in ids and "pub-x" in ids
            for ask in (complete, count_tokens):
                mine, ghost = await ask(stack, key, "mine", tenant), await ask(stack, key, "ghost", tenant)
                assert (mine.status_code, mine.content) == (404, ghost.content.replace(b"ghost", b"mine"))
            resp = await client.post("/v1/messages", headers=auth(key, tenant), json={
                "model": "mine", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
            assert await model_info(stack, key, "mine", tenant) == {"stream_id": 1,
                                                                    "error": "The model `mine` does not exist."}
            assert await deployment(key) == (["pub-x"], [["pub-x"]])
            mine, ghost = await unload(client, key, "mine", tenant), await unload(client, key, "ghost", tenant)
            assert (mine.status_code, mine.content) == (404, ghost.content.replace(b"ghost", b"mine"))
            # Its name is taken, in the same words as a name any key can see.
            mine = await load(client, key, "mine", dirs["b"], tenant, private=True, load_inplace=True)
            public = await load(client, key, "pub-x", dirs["b"], tenant, private=True, load_inplace=True)
            assert (mine.status_code, mine.content) == (400, public.content.replace(b"pub-x", b"mine"))
            assert error(mine) == (400, "The lora adapter name 'mine' is taken: choose another.")
        # Its owner sees and uses it, its source still not shown (a path is the deployment's).
        assert (await model_ids(client, A))["mine"]["root"] == "mine"
        assert (await complete(stack, A, "mine")).status_code == 200
        assert (await count_tokens(stack, A, "mine")).json() == (await count_tokens(stack, A, "tiny")).json()
        info = await model_info(stack, A, "mine")
        assert (info["model_info"]["model"], info["model_info"]["ready_workers"]) == ("mine", 1)
        assert await deployment(A) == (["mine", "pub-x"], [["mine", "pub-x"]])
        # An operator sees and uses every adapter, and removes any over HTTP.
        assert (await model_ids(client, OP))["mine"]["root"] == str(dirs["a"])
        assert (await complete(stack, OP, "mine")).status_code == 200
        assert (await unload(client, OP, "mine")).status_code == 200
        assert "mine" not in await model_ids(client, A)
        assert (await unload(client, OP, "pub-x")).status_code == 200
    finally:
        ENGINE.held = ()


async def test_only_its_owner_or_an_operator_replaces_or_unloads_an_entry(stack, dirs):
    client = stack.client
    assert (await load(client, OP, "op-x", dirs["op"])).status_code == 200
    for tenant in (None, HOP):
        assert error(await unload(client, A, "op-x", tenant)) == (
            403, "Only its owner's key or an operator's may unload the lora adapter 'op-x'.")
        assert error(await load(client, A, "op-x", dirs["a"], tenant, private=True, load_inplace=True)) == (
            400, "The lora adapter name 'op-x' is taken: choose another.")
    assert (await entry(stack, "op-x"))["source"] == str(dirs["op"])  # untouched
    # A key replaces its own; another key cannot even see it.
    assert (await load(client, A, "a-x", dirs["a"], private=True)).status_code == 200
    assert (await load(client, A, "a-x", dirs["a"], private=True, load_inplace=True)).status_code == 200
    assert error(await unload(client, B, "a-x")) == (404, "The lora adapter 'a-x' cannot be found.")
    # An operator replacing it takes it over (here as a public one): its owner may no longer unload it.
    assert (await load(client, OP, "a-x", dirs["op"], load_inplace=True)).status_code == 200
    assert ((await entry(stack, "a-x"))["owner"], (await model_ids(client, A))["a-x"]["root"]) == (HOP, "a-x")
    assert (await unload(client, A, "a-x")).status_code == 403
    for name in ("a-x", "op-x"):
        assert (await unload(client, OP, name)).status_code == 200


async def test_an_entry_from_before_owners_is_the_operators(stack, dirs):
    """Private to a tenant a header named: that proves nothing about a key, so only operators keep it."""
    key = Keys(stack.settings.prefix).adapters()
    old = {"name": "legacy", "base": "tiny", "source": str(dirs["a"]), "rank": 8, "tenant": HA, "created": 1}
    await stack.redis.hset(key, "legacy", json.dumps(old))
    public = {**{k: v for k, v in old.items() if k != "tenant"}, "name": "legacy-pub"}
    await stack.redis.hset(key, "legacy-pub", json.dumps(public))

    async def listed() -> bool:  # the API reads the registry whole at most once a second
        return {"legacy", "legacy-pub"} <= set(await model_ids(stack.client, OP))

    await eventually(listed, what="the written entries to be read")
    ids = await model_ids(stack.client, A, HA)
    assert "legacy" not in ids and "legacy-pub" in ids
    assert error(await complete(stack, A, "legacy", HA)) == (404, "The model `legacy` does not exist.")
    assert error(await unload(stack.client, A, "legacy")) == (404, "The lora adapter 'legacy' cannot be found.")
    assert (await unload(stack.client, A, "legacy-pub")).status_code == 403
    assert (await complete(stack, OP, "legacy")).status_code == 200
    for name in ("legacy", "legacy-pub"):
        assert (await unload(stack.client, OP, name)).status_code == 200


async def test_every_refused_source_gets_the_same_400_naming_nothing(stack, dirs, roots):
    client = stack.client
    os.symlink(dirs["outside"], roots / "ops" / "link-out")
    (roots / "ops" / "empty").mkdir()
    sources = ["/etc", "/root", "/etc/passwd", "/no/such/path", str(roots / "ops" / "missing"), str(dirs["outside"]),
               f"{roots}/ops/../../{dirs['outside'].parent.name}/x", str(roots / "ops" / "link-out"),
               str(roots / "ops" / "empty"), "~root", "./x", "evil-org/backdoored-lora",
               "http://169.254.169.254/latest/meta-data", "hub-org/../etc"]
    bodies = set()
    for key, private, more in ((OP, False, []), (A, True, [str(dirs["b"]), str(dirs["op"])])):
        for source in sources + more:
            resp = await load(client, key, "probe", source, private=private)
            assert resp.status_code == 400, (key, source, resp.text)
            bodies.add(resp.content)
    [body] = bodies
    assert json.loads(body)["error"]["message"] == REFUSED
    assert b"/etc" not in body and str(roots).encode() not in body and b"No such" not in body
    assert await entry(stack, "probe") is None
    # A hub repository of a listed organisation is taken as given: its workers download it.
    assert (await load(client, OP, "hub", "hub-org/some-lora")).status_code == 200
    assert (await load(client, A, "hub-a", "hub-org/other-lora", private=True)).status_code == 200
    assert (await model_ids(client, OP))["hub"]["root"] == "hub-org/some-lora"
    assert (await entry(stack, "hub"))["source"] == "hub-org/some-lora" and "rank" not in await entry(stack, "hub")
    for name in ("hub", "hub-a"):
        assert (await unload(client, OP, name)).status_code == 200


async def test_names_and_caps(stack, dirs, roots):
    client = stack.client
    charset = "'lora_name' must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', '/' or '-'"
    for name in ("has space", "a" * 129, "é", "x:y"):
        assert error(await load(client, OP, name, dirs["op"])) == (400, charset), name
    assert (await load(client, OP, "org/sql-v1.2_b", dirs["op"])).status_code == 200
    assert error(await load(client, OP, "tiny", dirs["op"])) == (
        400, "The lora adapter 'tiny' conflicts with a served base model.")
    # LLMQ_ADAPTERS_PER_OWNER (3 here) counts a tenant key's own entries; a replacement takes no room.
    for i in range(3):
        assert (await load(client, A, f"a-{i}", dirs["a"], private=True)).status_code == 200
    full = (400, "This key has registered its most LoRA adapters (LLMQ_ADAPTERS_PER_OWNER): unload one first")
    assert error(await load(client, A, "a-3", dirs["a"], private=True)) == full
    assert (await load(client, A, "a-0", dirs["a"], private=True, load_inplace=True)).status_code == 200
    assert (await load(client, B, "b-0", dirs["b"], private=True)).status_code == 200  # its own count
    for i in range(4):  # an operator's: LLMQ_ADAPTERS_MAX alone
        assert (await load(client, OP, f"op-{i}", dirs["op"])).status_code == 200
    # Registrations racing past the cap never leave more than it allows.
    assert (await unload(client, A, "a-2")).status_code == 200
    racing = await asyncio.gather(*(load(client, A, f"race-{i}", dirs["a"], private=True) for i in range(8)))
    assert {r.status_code for r in racing} <= {200, 400}
    registry = await AdapterStore(stack.redis, Keys(stack.settings.prefix)).all()
    owned = sorted(n for n, a in registry.items() if a.owner == HA)
    assert len(owned) <= 3 and sum(r.status_code == 200 for r in racing) == len(owned) - 2
    for name in registry:
        assert (await unload(client, OP, name)).status_code == 200


async def test_registration_refuses_what_it_can_tell_is_wrong(stack, roots):
    client = stack.client
    too_big = build_tiny_adapter(roots / "ops" / "big", seed=3, rank=16)
    assert error(await load(client, OP, "big", too_big)) == (
        400, "The adapter has rank 16, above this deployment's limit of 8 (LLMQ_MAX_LORA_RANK)")
    small = build_tiny_adapter(roots / "ops" / "small", seed=5)
    assert error(await load(client, OP, "x", small, base_model_name="nope")) == (
        404, "The model `nope` does not exist.")
    assert error(await load(client, OP, "", small)) == (400, "Both 'lora_name' and 'lora_path' must be provided.")
    resp = await client.post("/v1/load_lora_adapter", content=b"\xff\xfe{",
                             headers={"content-type": "application/json", **auth(OP)})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "BadRequestError"


async def test_a_client_cannot_name_an_adapters_source(stack):
    """The jobs dialect takes the internal request as its body: an ``adapter`` in it is replaced by
    what the registry says (nothing, for a base model), so no client picks what a worker loads."""
    client = stack.client
    body = {"model": "tiny", "prompt": "no adapter", "sampling": {"max_tokens": 2},
            "adapter": {"name": "evil", "source": "/etc"}}
    resp = await client.post("/v1/jobs", json=body, headers=auth(A))
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]

    async def ended() -> bool:
        return (await client.get(f"/v1/jobs/{job_id}", headers=auth(A))).json()["status"] == "done"

    await eventually(ended, what="the job to end")
    [req] = [r for r in ENGINE.requests if r.prompt == "no adapter"]
    assert req.adapter is None
    raw = await stack.redis.hget(Keys(stack.settings.prefix).job("tiny", job_id), "request")
    assert b"/etc" not in raw and b"evil" not in raw


async def test_tenant_keys_change_nothing_by_default(redis_url, prefix, tmp_path):
    """LLMQ_TENANT_ADAPTERS=none (the default): registering and unloading are operators' alone."""
    adapter = build_tiny_adapter(tmp_path / "a", seed=1)
    async with scripted_stack(redis_url, prefix, api_keys=A, operator_keys=OP, tenant_header="x-tenant",
                              adapter_roots=str(tmp_path)) as s:
        for tenant in (None, "ops"):
            assert error(await load(s.client, A, "x", adapter, tenant, private=True)) == (
                403, "Only an operator key may register LoRA adapters (LLMQ_OPERATOR_KEYS)")
        assert (await load(s.client, OP, "x", adapter)).status_code == 200
        assert error(await unload(s.client, A, "x", "ops")) == (
            403, "Only an operator key may unload LoRA adapters (LLMQ_OPERATOR_KEYS)")
        assert (await unload(s.client, OP, "x")).status_code == 200


async def test_with_no_keys_make_runs_adapters_register_under_the_default_root(redis_url, prefix, tmp_path):
    """Every (loopback) caller is an operator; the roots default to the model cache, where
    ``make run`` builds the tiny model's adapters and api/announce.py registers them."""
    async with scripted_stack(redis_url, prefix, cache_dir=str(tmp_path), adapters_max=2) as s:
        dirs = {name: build_tiny_adapter(path, seed=i) for i, (name, path) in
                enumerate(s.settings.tiny_adapter_dirs.items(), 1)}
        assert await asyncio.to_thread(_register_tiny_adapters, s.settings, s.url) == list(dirs)
        ids = {m["id"]: m for m in (await s.client.get("/v1/models")).json()["data"]}
        assert {n: ids[n]["root"] for n in dirs} == {n: str(p.resolve()) for n, p in dirs.items()}
        assert "owner" not in await entry(s, "tiny-lora-1")  # nobody's key: the operators'
        third = build_tiny_adapter(tmp_path / "models" / "third", seed=3)
        assert error(await s.client.post("/v1/load_lora_adapter", json={"lora_name": "third",
                                                                        "lora_path": str(third)})) == (
            400, "This deployment holds its most LoRA adapters (LLMQ_ADAPTERS_MAX): unload one first")
        assert error(await s.client.post("/v1/load_lora_adapter", json={"lora_name": "out",
                                                                        "lora_path": str(tmp_path)})) == (400, REFUSED)


async def test_junk_model_names_cost_no_reads_after_the_first(redis, keys):
    registry = ModelRegistry(redis, keys, "tiny", cache_s=1.0)
    reads = 0
    store_get = registry.adapter_store.get

    async def counted(name: str):
        nonlocal reads
        reads += 1
        return await store_get(name)

    registry.adapter_store.get = counted  # type: ignore[method-assign]
    for _ in range(50):
        with pytest.raises(ModelNotFound):
            await registry.target("junk")
    assert reads == 1
    # Registered by another process: usable here once the miss is older than cache_s.
    await AdapterStore(redis, keys).add(new_adapter("junk", "tiny", "/x", rank=None), replace=False, per_owner=None,
                                        total=10)
    with pytest.raises(ModelNotFound):
        await registry.target("junk")
    await asyncio.sleep(1.1)
    assert await registry.target("junk") == ("tiny", AdapterSpec(name="junk", source="/x"))
    # Private: another key's request finds no such model; its owner's and an operator's do.
    await AdapterStore(redis, keys).add(new_adapter("own", "tiny", "/y", rank=None, owner=HA, private=True),
                                        replace=False, per_owner=None, total=10)
    await registry.adapters(fresh=True)
    with pytest.raises(ModelNotFound):
        await registry.target("own", Viewer(operator=False, owner=HB))
    for who in (Viewer(operator=False, owner=HA), Viewer(operator=True, owner=HOP)):
        assert (await registry.target("own", who))[0] == "tiny"


def test_llmq_adapters_applies_the_roots_and_gives_an_adapter_to_a_key(redis_url, prefix, tmp_path, monkeypatch,
                                                                       capsys):
    adapter = build_tiny_adapter(tmp_path / "roots" / "sql", seed=1)
    for name, value in {"LLMQ_REDIS_URL": redis_url, "LLMQ_PREFIX": prefix, "LLMQ_SERVED_MODEL_NAME": "tiny",
                        "LLMQ_ADAPTER_ROOTS": str(tmp_path / "roots")}.items():
        monkeypatch.setenv(name, value)
    main(["add", "sql", str(adapter), "--tenant", HA])
    given = msgspec.json.decode(capsys.readouterr().out)
    assert {k: given[k] for k in ("name", "source", "rank", "owner", "private")} == {
        "name": "sql", "source": str(adapter.resolve()), "rank": 8, "owner": HA, "private": True}
    main(["add", "sql-b", str(adapter), "--key", B])
    assert msgspec.json.decode(capsys.readouterr().out)["owner"] == HB
    main(["add", "ops-sql", str(adapter)])
    assert "owner" not in msgspec.json.decode(capsys.readouterr().out)  # the operators'
    with pytest.raises(SystemExit, match="--tenant names an API key's hash"):
        main(["add", "old-style", str(adapter), "--tenant", "team-a"])
    with pytest.raises(SystemExit) as info:
        main(["add", "out", str(tmp_path)])
    assert str(info.value) == f"llmq-adapters: {REFUSED}"
    with pytest.raises(SystemExit, match="conflicts with a served base model"):
        main(["add", "tiny", str(adapter)])
    main(["list"])
    assert [json.loads(line)["name"] for line in capsys.readouterr().out.splitlines()] == ["ops-sql", "sql", "sql-b"]
