"""Batch files in the OpenAI Batch API shape, driven by the ``openai`` SDK's ``files`` and
``batches`` calls: real Redis, the real API on a port, the worker loop with a scripted engine,
and the real housekeeping process (arq) running the batches."""

from __future__ import annotations

import asyncio
import json

import msgspec
import openai
import pytest
from openai import AsyncOpenAI

from api.batch_output import rendered
from shared import batches
from shared.batches import MESSAGES, Answered, BatchObject, BatchStore, Failed, FileObject, LineError, NotRun, Refused
from shared.codec import encode
from shared.keys import Keys
from shared.media import ModelInfo
from shared.queue import JobStore
from shared.schemas import ChatMessage, Choice, GenerationRequest, JobError, JobResult, SamplingParams, Usage
from shared.tenants import key_hash
from tests.support.background import housekeeping
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually

MODEL = "tiny"


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _chat_line(custom_id: str, content: str, max_tokens: int = 4, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     **extra}}


async def _until(client: AsyncOpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 60):
    """The batch once its status is one of ``statuses``, and every reading on the way."""
    seen = []

    async def reached():
        seen.append(await client.batches.retrieve(batch_id))
        return seen[-1].status in statuses
    await eventually(reached, timeout_s=timeout_s, interval_s=0.1,
                     what=lambda: f"batch in {statuses}: {seen[-1] if seen else None}")
    return seen[-1], seen


def _by_custom_id(text: str) -> dict[str, dict]:
    lines = [json.loads(line) for line in text.splitlines()]
    assert len({line["custom_id"] for line in lines}) == len(lines)
    return {line["custom_id"]: line for line in lines}


async def test_a_batch_runs_through_the_sdk_and_its_output_matches_direct_calls(redis_url, prefix, tmp_path):
    async with scripted_stack(redis_url, prefix) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none")
        with housekeeping(redis_url, prefix, tmp_path, batch_rate=2):
            upload = await client.files.create(file=("in.jsonl", _jsonl([
                _chat_line("a", "hello", 5),
                _chat_line("b", "xyz", 7, temperature=0),
                _chat_line("bad", "x", -1),  # the endpoint would refuse it: a 400 in the error file
                _chat_line("c", "abc", 3),
                # An agent's line: tools reach the worker as in a direct request.
                _chat_line("t", "tool", 3, tools=[{"type": "function", "function": {"name": "f"}}],
                           tool_choice="required", parallel_tool_calls=False),
            ])), purpose="batch")
            assert upload.purpose == "batch" and upload.bytes > 0
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                completion_window="24h", metadata={"run": "1"})
            assert batch.status == "in_progress" and batch.request_counts.total == 5
            done, seen = await _until(client, batch.id, ("completed", "failed"))

            assert done.status == "completed", done
            assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 4, 1)
            assert done.metadata == {"run": "1"} and done.completed_at >= done.created_at
            progress = [b.request_counts.completed + b.request_counts.failed for b in seen]
            assert progress == sorted(progress)  # progress only moves forward
            assert any(0 < p < 5 for p in progress)  # at 2 lines per second it was seen mid-way

            output = _by_custom_id((await client.files.content(done.output_file_id)).text)
            assert sorted(output) == ["a", "b", "c", "t"]
            [tools] = [r.tools for r in s.worker.engine.requests if r.tools is not None]
            assert ([t.name for t in tools.tools], tools.choice, tools.parallel) == (["f"], "required", False)
            for custom_id, prompt, n in (("a", "hello", 5), ("b", "xyz", 7), ("c", "abc", 3)):
                line = output[custom_id]
                assert line["error"] is None and line["response"]["status_code"] == 200
                body = line["response"]["body"]
                assert body["object"] == "chat.completion" and body["model"] == MODEL
                assert body["choices"][0]["message"]["content"] == expected_text(prompt, n)
                direct = await client.chat.completions.create(model=MODEL, max_tokens=n,
                                                              messages=[{"role": "user", "content": prompt}])
                assert direct.choices[0].message.content == body["choices"][0]["message"]["content"]
                assert direct.usage.completion_tokens == body["usage"]["completion_tokens"]

            # Rendered on the first read, whichever it is: the object's size is the content's.
            listed_files = {f.id: f for f in (await client.files.list()).data}
            content = (await client.files.content(done.error_file_id)).content
            assert listed_files[done.error_file_id].bytes == len(content)
            assert (await client.files.retrieve(done.error_file_id)).bytes == len(content)
            errors = _by_custom_id(content.decode())
            assert list(errors) == ["bad"]
            assert errors["bad"]["response"]["status_code"] == 400
            assert "max_tokens" in errors["bad"]["response"]["body"]["error"]["message"]

            listed = await client.batches.list()
            assert batch.id in [b.id for b in listed.data]
            assert (await client.files.retrieve(done.output_file_id)).purpose == "batch_output"


async def test_completions_batches_fan_a_list_of_prompts_into_jobs_and_join_them(redis_url, prefix, tmp_path):
    async with scripted_stack(redis_url, prefix) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none")
        with housekeeping(redis_url, prefix, tmp_path):
            upload = await client.files.create(file=("c.jsonl", _jsonl([
                {"custom_id": "one", "method": "POST", "url": "/v1/completions",
                 "body": {"model": MODEL, "prompt": "abc", "max_tokens": 4}},
                {"custom_id": "two", "method": "POST", "url": "/v1/completions",
                 "body": {"model": MODEL, "prompt": ["xy", "pq"], "max_tokens": 3}},
            ])), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                completion_window="24h")
            done, _ = await _until(client, batch.id, ("completed", "failed"))
            assert done.status == "completed" and done.request_counts.completed == 2 and not done.error_file_id
            size = (await client.files.retrieve(done.output_file_id)).bytes
            content = (await client.files.content(done.output_file_id)).content
            assert size == len(content)
            output = _by_custom_id(content.decode())
            assert [c["text"] for c in output["one"]["response"]["body"]["choices"]] == [expected_text("abc", 4)]
            two = output["two"]["response"]["body"]["choices"]
            assert [(c["index"], c["text"]) for c in two] == [(0, expected_text("xy", 3)), (1, expected_text("pq", 3))]


async def test_a_malformed_input_file_fails_the_batch_with_line_numbers(redis_url, prefix):
    async with scripted_stack(redis_url, prefix) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none")
        good = _chat_line("a", "hi")
        wrong_url = {**_chat_line("b", "hi"), "url": "/v1/completions"}
        upload = await client.files.create(file=("in.jsonl", _jsonl([good, wrong_url, good]) + b"not json\n"),
                                           purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                            completion_window="24h")
        assert batch.status == "failed" and batch.failed_at
        assert [(e.line, e.code) for e in batch.errors.data] == [
            (2, "mismatched_endpoint"), (3, "duplicate_custom_id"), (4, "invalid_request")]
        assert (await client.batches.retrieve(batch.id)).status == "failed"
        assert await s.redis.scard(Keys(prefix).batches_active()) == 0  # nothing left to run


def _embeddings_line(custom_id: str, given: object, **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": given, **extra}}


async def test_an_embeddings_batch_answers_each_line_as_the_endpoint_would(redis_url, prefix, tmp_path):
    # The scripted worker pools: a vector per input (its length, then 1s; tests/support/scripted_engine.py).
    async with scripted_stack(redis_url, prefix, model_kind="embed", info=ModelInfo(kind="embed")) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none")
        with housekeeping(redis_url, prefix, tmp_path):
            lines = [_embeddings_line(f"e{i}", ["x" * (i + 1), "yy"], dimensions=2) for i in range(40)]
            lines.append(_embeddings_line("bad", []))
            upload = await client.files.create(file=("e.jsonl", _jsonl(lines)), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                                completion_window="24h")
            done, _ = await _until(client, batch.id, ("completed", "failed"))
            assert done.status == "completed", done
            assert (done.request_counts.completed, done.request_counts.failed) == (40, 1)
            output = _by_custom_id((await client.files.content(done.output_file_id)).text)
            assert sorted(output) == sorted(f"e{i}" for i in range(40))
            for i in range(40):
                body = output[f"e{i}"]["response"]["body"]
                assert body["object"] == "list" and body["model"] == MODEL
                assert [d["embedding"] for d in body["data"]] == [[float(i + 1), 1.0], [2.0, 1.0]]
                assert body["usage"]["prompt_tokens"] == i + 3
            errors = _by_custom_id((await client.files.content(done.error_file_id)).text)
            assert errors["bad"]["response"]["status_code"] == 400
            assert errors["bad"]["response"]["body"]["error"]["param"] == "input"


async def test_an_embeddings_batch_of_more_than_openais_inputs_fails_whole(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, model_kind="embed", info=ModelInfo(kind="embed")) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        lines = [_embeddings_line(f"e{i}", ["a"] * 2048) for i in range(25)]  # 51,200 inputs
        upload = await client.files.create(file=("big.jsonl", _jsonl(lines)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings",
                                            completion_window="24h")
        assert batch.status == "failed"
        assert [(e.code, e.message) for e in batch.errors.data] == [
            ("too_many_inputs", "An embeddings batch holds at most 50000 inputs across its requests; "
                                "the file has 51200.")]


async def test_bad_batch_requests_get_openai_errors(redis_url, prefix):
    async with scripted_stack(redis_url, prefix) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_missing")
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions",
                                        completion_window="24h")
        with pytest.raises(openai.BadRequestError):
            await client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
        upload = await client.files.create(file=("x.jsonl", _jsonl([_chat_line("a", "hi")])), purpose="batch")
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(input_file_id=upload.id, endpoint="/v1/audio/transcriptions",
                                        completion_window="24h")
        deleted = await client.files.delete(upload.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(upload.id)


async def test_cancel_ends_a_batch_with_what_ran_and_the_rest_in_the_error_file(redis_url, prefix, tmp_path):
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.02), max_num_seqs=1) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none")
        with housekeeping(redis_url, prefix, tmp_path, batch_rate=1, batch_max_in_flight=1):
            lines = [_chat_line(f"r{i}", "abc", 3) for i in range(2)] + [_chat_line("long", "z", 1500)] + [
                _chat_line(f"s{i}", "abc", 3) for i in range(5)]
            upload = await client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            for _ in range(300):  # until the long line runs
                if (await client.batches.retrieve(batch.id)).request_counts.completed == 2:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.5)
            cancelling = await client.batches.cancel(batch.id)
            assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
            done, _ = await _until(client, batch.id, ("cancelled",), timeout_s=30)
            assert done.cancelled_at and done.request_counts.total == 8
            assert (done.request_counts.completed, done.request_counts.failed) == (2, 6)
            assert sorted(_by_custom_id((await client.files.content(done.output_file_id)).text)) == ["r0", "r1"]
            errors = _by_custom_id((await client.files.content(done.error_file_id)).text)
            assert errors["long"]["error"]["code"] == "batch_cancelled"  # cancelled while it ran
            assert all(errors[f"s{i}"]["error"]["code"] == "batch_cancelled" for i in range(5))  # never ran
            assert len(s.worker.engine.aborted) >= 1  # the running line was aborted in the engine
            with pytest.raises(openai.BadRequestError):
                await client.batches.cancel((await client.batches.create(
                    input_file_id=(await client.files.create(file=("b.jsonl", b"x\n"), purpose="batch")).id,
                    endpoint="/v1/chat/completions", completion_window="24h")).id)  # a failed batch


async def test_batch_lines_wait_behind_interactive_requests_within_the_in_flight_bound(redis_url, prefix, tmp_path):
    engine = ScriptedEngine(delay_s=0.01)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=1) as s:
        client = AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none")
        with housekeeping(redis_url, prefix, tmp_path, batch_rate=10, batch_max_in_flight=3):
            upload = await client.files.create(file=("in.jsonl", _jsonl(
                [_chat_line(f"l{i}", "abc", 60) for i in range(9)])), purpose="batch")
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                completion_window="24h")
            keys = Keys(prefix)
            peak = 0
            interactive = None
            line_job = None
            while (await client.batches.retrieve(batch.id)).status != "completed":
                peak = max(peak, await s.redis.hlen(keys.batch_jobs(batch.id)))
                if line_job is None and (running := await s.redis.hvals(keys.batch_jobs(batch.id))):
                    model, [job_id] = json.loads(running[0])
                    line_job = await JobStore(s.redis, keys).get_job(model, job_id)
                if interactive is None and await s.redis.xlen(keys.waiting(MODEL, 2)) >= 2:
                    # Batch lines are waiting: an interactive request goes ahead of all of them.
                    waiting = await s.redis.xlen(keys.waiting(MODEL, 2))
                    started = len(engine.started)
                    reply = await client.completions.create(model=MODEL, prompt="now", max_tokens=2)
                    interactive = (reply.id.removeprefix("cmpl-"), started, waiting)
                await asyncio.sleep(0.05)
            assert interactive is not None, "the batch never had lines waiting"
            job_id, started_before, waiting = interactive
            # It started next (or after one more line, had the running one just ended as it was
            # sent), ahead of the two or more batch lines already waiting.
            assert waiting >= 2 and engine.started.index(job_id) in (started_before, started_before + 1)
            assert peak <= 3  # never more batch lines queued or running than the bound
            # A line's job is due when its batch expires (LLMQ_DEADLINE_S is for interactive requests).
            assert line_job.request.priority == 2 and line_job.deadline == pytest.approx(batch.expires_at * 1000, abs=1)


_CHAT = GenerationRequest(model="tiny", messages=[ChatMessage(role="user", content="hi")], dialect="openai_chat",
                          sampling=SamplingParams(max_tokens=2))


def _prompt(text: str) -> GenerationRequest:
    return GenerationRequest(model="tiny", prompt=text, dialect="openai_completions",
                             sampling=SamplingParams(max_tokens=1))


def _result(text: str) -> JobResult:
    return JobResult(choices=[Choice(text=text, token_ids=[1], finish_reason="length")],
                     usage=Usage(prompt_tokens=2, completion_tokens=1))


OUTCOMES = [
    Answered(custom_id="a", request_id="j1", created=1700000000, requests=[_CHAT], results=[_result("hé")]),
    Answered(custom_id="b", request_id="j2", created=1700000001, requests=[_prompt("ab"), _prompt("cd")],
             results=[_result("x"), _result("y")]),
    Failed(custom_id="c", request_id="j4", error=JobError(code="deadline_exceeded", message="too late", status=504)),
    Refused(custom_id="d", request_id="batch_1_3",
            error=LineError(status=400, body=msgspec.Raw(b'{"error":{"message":"m"}}'))),
    NotRun(custom_id="e", request_id="batch_1_4", code="batch_cancelled",
           message="The batch was cancelled before this request ran."),
]
# What OpenAI's Batch API gives for each, the body as the endpoint itself answers (as before the
# outcomes were rendered by the API rather than by housekeeping: byte for byte the same).
RENDERED = (
    '{"id":"batch_req_j1","custom_id":"a","response":{"status_code":200,"request_id":"j1","body":{"id":"chatcmpl-j1",'
    '"object":"chat.completion","created":1700000000,"model":"tiny","choices":[{"index":0,"message":{"role":"assistant",'
    '"content":"hé"},"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":2,'
    '"completion_tokens":1,"total_tokens":3}}},"error":null}\n'
    '{"id":"batch_req_j2","custom_id":"b","response":{"status_code":200,"request_id":"j2","body":{"id":"cmpl-j2",'
    '"object":"text_completion","created":1700000001,"model":"tiny","choices":[{"index":0,"text":"x","logprobs":null,'
    '"finish_reason":"length","stop_reason":null},{"index":1,"text":"y","logprobs":null,"finish_reason":"length",'
    '"stop_reason":null}],"usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}},"error":null}\n'
    '{"id":"batch_req_j4","custom_id":"c","response":{"status_code":504,"request_id":"j4","body":{"error":'
    '{"message":"too late","type":"InternalServerError","param":null,"code":504}}},"error":null}\n'
    '{"id":"batch_req_batch_1_3","custom_id":"d","response":{"status_code":400,"request_id":"batch_1_3","body":'
    '{"error":{"message":"m"}}},"error":null}\n'
    '{"id":"batch_req_batch_1_4","custom_id":"e","response":null,"error":{"code":"batch_cancelled",'
    '"message":"The batch was cancelled before this request ran."}}\n'
).encode()


async def test_a_produced_file_is_rendered_once_on_its_first_read(redis, keys):
    store = BatchStore(redis, keys)
    meta = FileObject(id="file-out", bytes=0, created_at=1700000002, filename="batch_1_output.jsonl",
                      purpose="batch_output")
    await store.put_outcomes(meta, b"".join(encode(o) + b"\n" for o in OUTCOMES), "owner")
    first = await rendered(store, meta)
    assert first == msgspec.structs.replace(meta, bytes=len(RENDERED))
    assert await store.file_content(meta.id) == RENDERED
    assert await store.get_file(meta.id) == (first, "owner") and await store.outcomes(meta.id) is None
    assert await rendered(store, first) == first  # later reads serve what is stored

    # A file deleted while a reader was rendering it is not brought back by that reader.
    gone = msgspec.structs.replace(meta, id="file-gone")
    await store.put_outcomes(gone, encode(OUTCOMES[-1]) + b"\n", "owner")
    await store.delete_file(gone.id)
    assert not await store.put_rendered(gone, RENDERED) and not await redis.exists(keys.file(gone.id))


def _stored(batch_id: str, created_at: int, endpoint: str = "/v1/chat/completions") -> BatchObject:
    return BatchObject(id=batch_id, endpoint=endpoint, input_file_id="file-x", completion_window="24h",
                       created_at=created_at, status="completed")


async def test_the_batch_index_is_filtered_by_owner_before_a_page_is_cut(redis, keys, monkeypatch):
    monkeypatch.setattr(batches, "_LIST_CHUNK", 4)  # pages that take several reads of the index
    store = BatchStore(redis, keys)
    for n in range(5):
        await store.create(_stored(f"batch_a{n}", 1000 + 10 * n), [], "a")
        for m in range(4):  # each newer than a's
            await store.create(_stored(f"batch_b{n}{m}", 1001 + 10 * n + m), [], "b")
    await store.create(_stored("msgbatch_a", 2000, MESSAGES), [], "a")  # Anthropic's: not OpenAI's list

    async def listed(owner: str, after: str | None, limit: int,
                     endpoints: tuple[str, ...] = batches.ENDPOINTS) -> tuple[list[str], bool]:
        found, more = await store.list(owner, after, limit, endpoints)
        return [b.id for b in found], more

    assert await listed("a", None, 2) == (["batch_a4", "batch_a3"], True)
    assert await listed("a", "batch_a3", 2) == (["batch_a2", "batch_a1"], True)
    assert await listed("a", "batch_a1", 2) == (["batch_a0"], False)
    assert await listed("a", "batch_a2", 2) == (["batch_a1", "batch_a0"], False)  # exactly a page left
    assert await listed("b", None, 20) == ([f"batch_b{n}{m}" for n in range(4, -1, -1) for m in range(3, -1, -1)],
                                           False)
    assert (await listed("b", None, 19))[1]
    # Another owner's batch is no place to start from: the list starts at the caller's newest.
    assert await listed("a", "batch_b30", 5) == ([f"batch_a{n}" for n in range(4, -1, -1)], False)
    assert await listed("c", None, 2) == ([], False)
    assert await listed("a", None, 5, (MESSAGES,)) == (["msgbatch_a"], False)


async def test_a_key_lists_its_own_batches_while_another_key_has_many_newer(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, api_keys="key-a,key-b") as s:
        store = BatchStore(s.redis, Keys(prefix))
        for n in range(3):
            await store.create(_stored(f"batch_a{n}", 1000 + n), [], key_hash("key-a"))
        for n in range(25):
            await store.create(_stored(f"batch_b{n}", 2000 + n), [], key_hash("key-b"))

        async def page(key: str, **params) -> dict:
            resp = await s.client.get("/v1/batches", params=params, headers={"authorization": f"Bearer {key}"})
            assert resp.status_code == 200, resp.text
            return resp.json()

        first = await page("key-a", limit=2)
        assert [b["id"] for b in first["data"]] == ["batch_a2", "batch_a1"] and first["has_more"]
        assert (first["first_id"], first["last_id"]) == ("batch_a2", "batch_a1")
        rest = await page("key-a", limit=2, after="batch_a1")
        assert [b["id"] for b in rest["data"]] == ["batch_a0"] and not rest["has_more"]
        assert (rest["first_id"], rest["last_id"]) == ("batch_a0", "batch_a0")
        everything = await page("key-a")  # 20 unless given: all three, and no more
        assert [b["id"] for b in everything["data"]] == ["batch_a2", "batch_a1", "batch_a0"]
        assert not everything["has_more"]
        assert [b["id"] for b in (await page("key-a", after="batch_b3"))["data"]] == ["batch_a2", "batch_a1",
                                                                                     "batch_a0"]
        theirs = await page("key-b", limit=25)
        assert len(theirs["data"]) == 25 and not theirs["has_more"]
        # The page size is 1-100 in ASCII digits; anything else is the dialect's 400 (vLLM's shape).
        for raw in ("²", "١٢", "0", "101", " 5", "9" * 5000):
            resp = await s.client.get("/v1/batches", params={"limit": raw}, headers={"authorization": "Bearer key-a"})
            assert resp.status_code == 400, (raw, resp.text)
            assert resp.json()["error"] == {"message": "limit must be a whole number from 1 to 100",
                                            "type": "BadRequestError", "param": "limit", "code": 400}
