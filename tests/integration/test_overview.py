"""The console's JSON routes (api/routes/overview.py) on a real Redis and the real app: who sees
what, the recent jobs and their filters, one job's record and attempts, tenants, the deployment,
and dead letters requeued and discarded (operators only).

Keys on: two tenants' keys and an operator's. A dead letter is made as finish.lua makes one (the
record failed with ``dead_letter``, an entry in the model's dead stream); the browser tests make a
real one with a SIGKILLed vLLM worker (tests/e2e/test_console.py).
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import msgspec
import pytest

from shared.keys import Keys
from shared.tenants import key_hash
from tests.support.heartbeats import beating
from tests.support.scripted_stack import ScriptedStack
from tests.support.waiting import eventually

A, B, OP = "key-of-tenant-a", "key-of-tenant-b", "key-of-the-operator"
pytestmark = pytest.mark.stack(api_keys=f"{A},{B}", operator_keys=OP)


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def submit(stack: ScriptedStack, key: str, prompt: str = "abc", tokens: int = 4) -> str:
    resp = await stack.client.post("/v1/jobs", json={"prompt": prompt, "sampling": {"max_tokens": tokens}},
                                   headers=auth(key))
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


async def done(stack: ScriptedStack, key: str, job_id: str) -> dict:
    async def finished():
        body = (await stack.client.get(f"/v1/jobs/{job_id}", headers=auth(key))).json()
        return body if body["status"] in ("done", "failed", "cancelled") else None
    return await eventually(finished, timeout_s=20, what=f"job {job_id} to end")


async def get(stack: ScriptedStack, path: str, key: str, **params) -> httpx.Response:
    return await stack.client.get(path, headers=auth(key), params=params)


async def test_access_says_who_the_caller_is(stack: ScriptedStack):
    assert (await get(stack, "/v1/access", A)).json() == {"object": "access", "role": "tenant",
                                                         "tenant": key_hash(A), "keys": True}
    assert (await get(stack, "/v1/access", OP)).json()["role"] == "operator"
    assert (await stack.client.get("/v1/access")).status_code == 401


async def test_a_tenant_lists_only_its_own_jobs_and_an_operator_every_one(stack: ScriptedStack):
    a1, a2, b1 = await submit(stack, A), await submit(stack, A, tokens=6), await submit(stack, B)
    for key, job_id in ((A, a1), (A, a2), (B, b1)):
        await done(stack, key, job_id)
    mine = [j["id"] for j in (await get(stack, "/v1/jobs", A)).json()["data"]]
    assert a1 in mine and a2 in mine and b1 not in mine
    assert mine.index(a2) < mine.index(a1)  # newest first
    everyone = [j["id"] for j in (await get(stack, "/v1/jobs", OP)).json()["data"]]
    assert {a1, a2, b1} <= set(everyone)
    # The recent stream names each job's owner, so a tenant's list reads only its own records.
    entries = {f[b"job"].decode(): f for _, f in await stack.redis.xrange(Keys(stack.settings.prefix).recent("tiny"))}
    assert entries[a1][b"owner"].decode() == key_hash(A) and entries[b1][b"owner"].decode() == key_hash(B)
    assert entries[a1][b"dialect"] == b"jobs" and entries[a1][b"tenant"].decode() == key_hash(A)
    # The filters: tenant, status, dialect, and a limit.
    by_b = (await get(stack, "/v1/jobs", OP, tenant=key_hash(B))).json()["data"]
    assert [j["id"] for j in by_b] == [b1]
    assert (await get(stack, "/v1/jobs", OP, status="queued")).json()["data"] == []
    assert (await get(stack, "/v1/jobs", OP, dialect="openai_chat")).json()["data"] == []
    assert len((await get(stack, "/v1/jobs", OP, limit="1")).json()["data"]) == 1
    row = next(j for j in everyone_rows(await get(stack, "/v1/jobs", A)) if j["id"] == a2)
    assert row["status"] == "done" and row["dialect"] == "jobs" and row["tenant"] == key_hash(A)
    assert row["generated_tokens"] == 6 and row["prompt_tokens"] > 0
    assert row["attempts"] == 1 and row["preemptions"] == 0 and row["workers"] == [stack.worker.worker_id]
    assert 0 <= row["queue_ms"] <= row["ttft_ms"]
    assert "prompt" not in row and "request" not in row and "result" not in row  # a list shows no text
    # Bad filters are the jobs dialect's 400.
    for params in ({"status": "sleeping"}, {"limit": "0"}, {"model": "nope"}):
        resp = await get(stack, "/v1/jobs", OP, **params)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_request"


def everyone_rows(resp: httpx.Response) -> list[dict]:
    return resp.json()["data"]


def test_a_records_view_names_its_trace_and_every_run():
    from api.views import RecordView
    from shared.schemas import GenerationRequest, JobRecord

    record = JobRecord(id="j", model="m", request=GenerationRequest(prompt="p"), status="done", attempt=2,
                       worker="w2", started_at=2000.5, owner="o", runs="1@host:1:a@1000 2@w2@2000",
                       traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", tokens="3 7")
    view = RecordView.of(record)
    assert view.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and view.tenant == "o"
    assert [(r.attempt, r.worker, r.started_at) for r in view.runs] == [(1, "host:1:a", 1000), (2, "w2", 2000)]
    assert (view.prompt_tokens, view.generated_tokens) == (3, 7)
    # One attempt: its run is the record's worker and start (the end dropped the field).
    one = RecordView.of(JobRecord(id="j", model="m", request=GenerationRequest(prompt="p"), attempt=1, worker="w",
                                  started_at=5.0))
    assert [(r.attempt, r.worker) for r in one.runs] == [(1, "w")] and one.trace_id is None
    assert one.tenant == "default"


async def test_a_record_shows_its_attempts_to_its_owner_and_operators_only(stack: ScriptedStack):
    job_id = await submit(stack, A, prompt="record me")
    await done(stack, A, job_id)
    for key in (A, OP):
        rec = (await get(stack, f"/v1/jobs/{job_id}/record", key)).json()
        assert rec["status"] == "done" and rec["request"]["prompt"] == "record me"
        assert [r["attempt"] for r in rec["runs"]] == [1] and rec["runs"][0]["worker"] == stack.worker.worker_id
        assert rec["queued_at"] <= rec["runs"][0]["started_at"] <= rec["finished_at"]
        assert rec["attempts"] == 1 and rec["tenant"] == key_hash(A)
    other = await get(stack, f"/v1/jobs/{job_id}/record", B)
    assert other.status_code == 404 and other.json()["error"]["code"] == "job_not_found"


async def test_an_operator_cancels_another_keys_job(stack: ScriptedStack):
    job_id = await submit(stack, A, tokens=4000)
    assert (await stack.client.delete(f"/v1/jobs/{job_id}", headers=auth(B))).status_code == 404
    assert (await stack.client.delete(f"/v1/jobs/{job_id}", headers=auth(OP))).status_code == 200
    assert (await done(stack, A, job_id))["status"] == "cancelled"


async def test_tenants_show_share_weight_and_todays_usage(stack: ScriptedStack):
    await done(stack, B, await submit(stack, B, tokens=5))
    mine = (await get(stack, "/v1/tenants", B)).json()["data"]
    assert [r["tenant"] for r in mine] == [key_hash(B)]
    assert mine[0]["today"]["requests"] >= 1 and mine[0]["today"]["generated_tokens"] >= 5
    assert mine[0]["weight"] == 1.0 and mine[0]["tokens_last_minute"] > 0
    everyone = {r["tenant"] for r in (await get(stack, "/v1/tenants", OP)).json()["data"]}
    assert {key_hash(A), key_hash(B)} <= everyone


async def test_the_deployment_names_the_model_its_worker_and_levels(stack: ScriptedStack):
    body = (await get(stack, "/v1/deployment", A)).json()
    [model] = [m for m in body["models"] if m["name"] == "tiny"]
    assert model["ready_workers"] == 1 and model["slots"] == stack.settings.max_num_seqs
    assert [w["id"] for w in body["workers"]] == [stack.worker.worker_id]
    assert body["workers"][0]["metrics"] == []  # /metrics shows them


async def test_the_deployment_shows_each_workers_devices_and_engine_layout(stack: ScriptedStack):
    """A worker of two tensor-parallel ranks on two GPUs, as its heartbeat says, beside the
    scripted one's single device."""
    async with beating(stack.redis, stack.settings.prefix, "w-big", "big", device="gpu:0,1",
                       devices=["gpu:0", "gpu:1"], tensor_parallel_size=2) as big:
        body = (await get(stack, "/v1/deployment", A)).json()  # a tenant's key: the workers are no one's data
    [shown] = [w for w in body["workers"] if w["id"] == "w-big"]
    assert 0 <= shown.pop("last_heartbeat_age_s") < 5
    assert shown == {"id": "w-big", "model": "big", "kind": "generate", "status": "warming",
                     "slots": big.settings.max_num_seqs, "running": 0, "host": socket.gethostname(),
                     "pid": os.getpid(), "device": "gpu:0,1",
                     "devices": ["gpu:0", "gpu:1"], "parallel": {"tensor": 2, "pipeline": 1, "nodes": 1},
                     "adapters": [], "metrics": [], "rates": {}}
    [tiny] = [w for w in body["workers"] if w["id"] == stack.worker.worker_id]
    assert (tiny["devices"], tiny["parallel"]) == ([], {"tensor": 1, "pipeline": 1, "nodes": 1})


async def test_history_samples_give_each_level_its_throughput(stack: ScriptedStack):
    from shared import browse

    keys = Keys(stack.settings.prefix)
    await browse.sample(stack.redis, keys, "tiny")
    # A sample a minute old, as housekeeping leaves every 5 s: the throughput is measured against it.
    before = {"w0": 0, "r0": 0, "f0": 0, "w1": 0, "r1": 0, "f1": 0, "w2": 0, "r2": 0, "f2": 0}
    old = int(time.time() * 1000) - 55_000
    await stack.redis.delete(keys.history("tiny"))
    await stack.redis.xadd(keys.history("tiny"), before, id=f"{old}-0")
    await browse.sample(stack.redis, keys, "tiny")
    finished = int(await stack.redis.hget(keys.finished("tiny"), "0"))
    assert finished > 0
    [model] = [m for m in (await get(stack, "/v1/deployment", OP)).json()["models"] if m["name"] == "tiny"]
    rate = model["levels"][0]["finished_per_min"]
    assert rate == pytest.approx(finished * 60 / 55, rel=0.1)
    assert [p["waiting"] for p in model["history"]] == [0, 0] and model["history"][1]["finished_per_min"] > 0


async def _dead_letter(stack: ScriptedStack, key: str) -> str:
    """A finished job turned into a dead letter as finish.lua leaves one."""
    job_id = await submit(stack, key, prompt="poison")
    await done(stack, key, job_id)
    keys = Keys(stack.settings.prefix)
    error = msgspec.json.encode({"code": "dead_letter", "message": "failed 3 deliveries", "status": 500})
    await stack.redis.hset(keys.job("tiny", job_id), mapping={"status": "failed", "error": error})
    await stack.redis.xadd(keys.dead("tiny"), {"job": job_id, "entry": "1-0", "attempts": 3,
                                               "at": int(time.time() * 1000)})
    return job_id


async def test_dead_letters_are_requeued_by_an_operator_and_refused_to_a_tenant(stack: ScriptedStack):
    dead = await _dead_letter(stack, A)
    rows = (await get(stack, "/v1/dead_letters", A)).json()["data"]
    assert [(r["job_id"], r["attempts"], r["error"]["code"]) for r in rows] == [(dead, 3, "dead_letter")]
    assert (await get(stack, "/v1/dead_letters", B)).json()["data"] == []
    refused = await stack.client.post(f"/v1/dead_letters/{dead}/requeue", headers=auth(A))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert (await stack.client.delete(f"/v1/dead_letters/{dead}", headers=auth(A))).status_code == 403
    resp = await stack.client.post(f"/v1/dead_letters/{dead}/requeue", headers=auth(OP))
    assert resp.status_code == 200, resp.text
    new_id = resp.json()["requeued_as"]
    assert new_id != dead
    # The new job is the tenant's own (its key reads it) and runs the same request.
    assert (await done(stack, A, new_id))["status"] == "done"
    rec = (await get(stack, f"/v1/jobs/{new_id}/record", A)).json()
    assert rec["request"]["prompt"] == "poison" and rec["tenant"] == key_hash(A)
    assert (await get(stack, "/v1/dead_letters", OP)).json()["data"] == []
    again = await stack.client.post(f"/v1/dead_letters/{dead}/requeue", headers=auth(OP))
    assert again.status_code == 404


async def test_an_operator_discards_a_dead_letter(stack: ScriptedStack):
    dead = await _dead_letter(stack, B)
    resp = await stack.client.delete(f"/v1/dead_letters/{dead}", headers=auth(OP))
    assert resp.status_code == 200 and resp.json() == {"object": "dead_letter.deleted", "job_id": dead}
    assert dead not in [r["job_id"] for r in (await get(stack, "/v1/dead_letters", OP)).json()["data"]]


async def test_the_console_page_and_files_are_served_with_no_key_and_nothing_from_elsewhere(stack: ScriptedStack):
    page = await stack.client.get("/console")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert "http://" not in page.text and "https://" not in page.text
    assert (await stack.client.get("/console/static/app.js")).status_code == 200
    # Nothing any file of the app loads comes from elsewhere (llmq runs offline): no URL in them
    # but the SVG namespace's name.
    from api.routes.console import _files

    for name, (body, _) in _files().items():
        text = body.decode().replace("http://www.w3.org/2000/svg", "")
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name
    assert (await stack.client.get("/console/static/../routes/console.py")).status_code == 404
    assert (await stack.client.get("/console/static/nope.js")).status_code == 404


async def test_query_integers_are_ascii_digits_or_the_jobs_400(stack: ScriptedStack):
    # str.isdigit() is true of '²' (int() refuses it: a 500 once) and of '١٢' (int() reads 12).
    for path, name in (("/v1/jobs", "limit"), ("/v1/usage", "days")):
        for raw in ("²", "١٢", "１２", " 5", "+5", "9" * 5000, ""):
            resp = await get(stack, path, OP, **{name: raw})
            assert resp.status_code == 400, (path, raw, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "invalid_request" and name in error["message"], (path, raw, error)
        assert (await get(stack, path, OP, **{name: "3"})).status_code == 200


def count_round_trips(redis) -> list[list[tuple]]:
    """Each round trip ``redis`` makes from now on, as the (command, key) pairs it sent: one for a
    command sent alone, all of a pipeline's for the pipeline."""
    trips: list[list[tuple]] = []
    send, make = redis.execute_command, redis.pipeline

    async def alone(*args, **options):
        trips.append([args[:2]])
        return await send(*args, **options)

    def pipeline(*args, **kwargs):
        pipe = make(*args, **kwargs)
        execute = pipe.execute

        async def together(*a, **k):
            trips.append([command[:2] for command, _ in pipe.command_stack])
            return await execute(*a, **k)
        pipe.execute = together
        return pipe

    redis.execute_command, redis.pipeline = alone, pipeline
    return trips


async def test_tenants_are_read_in_one_round_trip_per_model_however_many_there_are(redis, keys):
    from shared import browse
    from shared.tenants import read_state

    now = int(time.time())
    for n in range(60):
        await redis.zadd(keys.tenants("m"), {f"t{n}": n})
        await redis.hset(keys.tenant("m", f"t{n}"), mapping={"vtc": n, "weight": 1 + n % 2})
    await redis.sadd(keys.tenant_running("m", "t1"), "job-1")
    await redis.zadd(keys.tenant_waiting("m", "t2", 1), {"1-0 job-2": 1.0})
    await redis.hset(keys.tenant_tokens("m", "t1"), str(now), 30)
    await redis.hset(keys.tokens("m"), str(now), 120)
    await redis.hset(keys.tenant_config("t2"), "max_running", 3)
    await redis.hset(keys.usage("m", browse.today()), mapping={"t1:requests": 4, "t1:generated_tokens": 9})

    trips = count_round_trips(redis)
    rows = {r.tenant: r for r in await browse.tenant_rows(redis, keys, ["m"])}
    # The tenants and the day's usage, then every tenant's state (and settings) at once; the
    # model-wide tokens hash read once, not once per tenant.
    assert len(trips) == 2 and len(rows) == 60
    assert sum(sent == ("HGETALL", keys.tokens("m")) for trip in trips for sent in trip) == 1
    t1, t2 = rows["t1"], rows["t2"]
    assert (t1.running, t1.waiting, t1.weight, t1.tokens_last_minute, t1.share_last_minute) == (1, 0, 2.0, 30, 0.25)
    assert (t2.running, t2.waiting, t2.limits.max_running) == (0, 1, 3)
    assert t1.fair_share == round(2 / 3, 4) and t2.fair_share == round(1 / 3, 4) and rows["t3"].fair_share is None
    assert (t1.today.requests, t1.today.generated_tokens, t2.today.requests) == (4, 9, 0)
    # One tenant's state, as the scheduler's CLI reads it, is the same reading.
    one = await read_state(redis, keys, "m", "t1")
    assert (one.running, one.weight, one.share_last_minute, one.config) == (1, 2.0, 0.25, t1.limits)


async def test_tenants_are_read_once_a_second_and_each_key_sees_only_its_own_rows(stack: ScriptedStack, monkeypatch):
    import asyncio

    from shared import browse

    await submit(stack, A), await submit(stack, B)
    reads = []
    real = browse.tenant_rows

    async def counted(*args, **kwargs):
        reads.append(time.monotonic())
        return await real(*args, **kwargs)
    monkeypatch.setattr(browse, "tenant_rows", counted)
    await asyncio.sleep(1.1)  # what an earlier test left in the process's cache is stale now

    mine = (await get(stack, "/v1/tenants", A)).json()["data"]
    theirs = (await get(stack, "/v1/tenants", B)).json()["data"]
    everyone = (await get(stack, "/v1/tenants", OP)).json()["data"]
    # One read served all three (they came within its second), each cut to what its key may see.
    assert len(reads) == 1
    assert {r["tenant"] for r in mine} == {key_hash(A)} and {r["tenant"] for r in theirs} == {key_hash(B)}
    assert {key_hash(A), key_hash(B)} <= {r["tenant"] for r in everyone}
    # Callers that find it stale together share one read.
    await asyncio.sleep(1.1)
    answers = await asyncio.gather(*(get(stack, "/v1/tenants", key) for key in (A, B, OP, A, B)))
    assert len(reads) == 2 and [r.status_code for r in answers] == [200] * 5
    assert {r["tenant"] for r in answers[3].json()["data"]} == {key_hash(A)}
