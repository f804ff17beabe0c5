"""Anthropic's Message Batches driven by the real ``anthropic`` SDK's ``messages.batches`` calls:
real Redis, the real API on a port, the worker loop with a scripted engine, and the real
housekeeping process (arq) running the batches, as for OpenAI's batches (test_batches.py)."""

from __future__ import annotations

import asyncio
import time

import anthropic
import openai
import pytest
from anthropic import AsyncAnthropic

from shared.keys import Keys
from tests.support.background import housekeeping
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually

MODEL = "tiny"


def _request(custom_id: str, content: str, max_tokens: int = 4, **extra) -> dict:
    return {"custom_id": custom_id, "params": {"model": MODEL, "max_tokens": max_tokens,
                                               "messages": [{"role": "user", "content": content}], **extra}}


def _client(url: str) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=url, api_key="none", max_retries=0)


async def _until_ended(client: AsyncAnthropic, batch_id: str, timeout_s: float = 60):
    """The batch once it ended, and every reading on the way."""
    seen = []

    async def ended():
        seen.append(await client.messages.batches.retrieve(batch_id))
        return seen[-1].processing_status == "ended"
    await eventually(ended, timeout_s=timeout_s, interval_s=0.1,
                     what=lambda: f"batch to end: {seen[-1] if seen else None}")
    return seen[-1], seen


async def _results(client: AsyncAnthropic, batch_id: str) -> dict:
    results = [line async for line in await client.messages.batches.results(batch_id)]
    assert len({r.custom_id for r in results}) == len(results)
    return {r.custom_id: r.result for r in results}


async def test_a_message_batch_runs_through_the_sdk_and_its_results_match_direct_calls(redis_url, prefix, tmp_path):
    async with scripted_stack(redis_url, prefix) as s:
        client = _client(s.url)
        with housekeeping(redis_url, prefix, tmp_path, batch_rate=2):
            batch = await client.messages.batches.create(requests=[
                _request("a", "hello", 5),
                _request("b", "xyz", 7, temperature=0, stop_sequences=["q"]),
                _request("bad", "x", 0),  # POST /v1/messages would refuse it: errored, the rest runs
                # Tools work as in a direct call (the scripted engine never calls them).
                _request("tools", "xy", 3, tools=[{"name": "f", "input_schema": {"type": "object"}}],
                         tool_choice={"type": "any", "disable_parallel_tool_use": True},
                         thinking={"type": "disabled"}),
                _request("c", "abc", 3),
            ])
            assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
            assert batch.processing_status == "in_progress" and batch.results_url is None
            assert batch.request_counts.processing == 5 and batch.ended_at is None
            assert batch.expires_at.timestamp() - batch.created_at.timestamp() == 24 * 3600
            done, seen = await _until_ended(client, batch.id)

            # Anthropic counts every request as processing until the batch ended, then by result.
            assert all(b.request_counts.processing == 5 for b in seen[:-1])
            counts = done.request_counts
            assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == \
                (0, 4, 1, 0, 0)
            assert done.ended_at >= done.created_at and done.cancel_initiated_at is None and done.archived_at is None
            assert done.results_url == f"/v1/messages/batches/{batch.id}/results"

            results = await _results(client, batch.id)
            assert sorted(results) == ["a", "b", "bad", "c", "tools"]
            for custom_id, prompt, n in (("a", "hello", 5), ("b", "xyz", 7), ("c", "abc", 3), ("tools", "xy", 3)):
                result = results[custom_id]
                assert result.type == "succeeded", result
                message = result.message
                assert isinstance(message, anthropic.types.Message) and message.model == MODEL
                assert message.content[0].text == expected_text(prompt, n)
                direct = await client.messages.create(model=MODEL, max_tokens=n,
                                                      messages=[{"role": "user", "content": prompt}])
                assert direct.content[0].text == message.content[0].text
                assert (direct.stop_reason, direct.usage.output_tokens, direct.usage.input_tokens) == \
                    (message.stop_reason, message.usage.output_tokens, message.usage.input_tokens)
            result = results["bad"]
            assert result.type == "errored" and result.error.type == "error"
            assert result.error.error.type == "invalid_request_error" and "max_tokens" in result.error.error.message
            tools_job = next(r for r in s.worker.engine.requests if r.tools is not None)
            assert (tools_job.tools.choice, tools_job.tools.parallel, tools_job.chat.template_kwargs) == (
                "required", False, {"enable_thinking": False})
            # Read again: the same bytes (rendered once, then served as stored).
            first = await s.client.get(f"/v1/messages/batches/{batch.id}/results")
            again = await s.client.get(f"/v1/messages/batches/{batch.id}/results")
            assert first.status_code == 200 and first.content == again.content
            assert first.headers["content-type"] == "application/x-jsonl"
            assert first.content.count(b"\n") == 5

            listed = [b.id async for b in client.messages.batches.list()]
            assert listed[0] == batch.id
            # OpenAI's Files and Batches routes see neither the Message Batch nor its results.
            oa = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.NotFoundError):
                await oa.batches.retrieve(batch.id)
            assert [f.id async for f in oa.files.list()] == []
            files = await s.redis.hmget(Keys(s.settings.prefix).batch(batch.id), "output_file_id", "error_file_id")
            assert all(files)  # its results are two stored files, answered only as Anthropic's results
            for file_id in files:
                with pytest.raises(openai.NotFoundError):
                    await oa.files.retrieve(file_id.decode())
            with pytest.raises(anthropic.BadRequestError):  # an ended batch cannot be canceled
                await client.messages.batches.cancel(batch.id)

            deleted = await client.messages.batches.delete(batch.id)
            assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
            with pytest.raises(anthropic.NotFoundError):
                await client.messages.batches.retrieve(batch.id)
            assert batch.id not in [b.id async for b in client.messages.batches.list()]


async def test_cancel_ends_a_batch_with_what_ran_and_the_rest_canceled(redis_url, prefix, tmp_path):
    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.02), max_num_seqs=1) as s:
        client = _client(s.url)
        with housekeeping(redis_url, prefix, tmp_path, batch_rate=1, batch_max_in_flight=1):
            requests = [_request(f"r{i}", "abc", 3) for i in range(2)] + [_request("long", "z", 1500)] + [
                _request(f"s{i}", "abc", 3) for i in range(5)]
            batch = await client.messages.batches.create(requests=requests)
            for _ in range(300):  # until the long request runs (the counts say nothing until the end)
                if any(r.sampling.max_tokens == 1500 for r in s.worker.engine.requests):
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            with pytest.raises(anthropic.BadRequestError):  # still processing: no results, no delete
                await client.messages.batches.delete(batch.id)
            canceling = await client.messages.batches.cancel(batch.id)
            assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at
            again = await client.messages.batches.cancel(batch.id)  # canceling twice is harmless
            assert again.cancel_initiated_at == canceling.cancel_initiated_at
            done, _ = await _until_ended(client, batch.id, timeout_s=30)

            counts = done.request_counts
            assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == \
                (0, 2, 0, 6, 0)
            assert done.cancel_initiated_at <= done.ended_at
            results = await _results(client, batch.id)
            assert [k for k, r in results.items() if r.type == "succeeded"] == ["r0", "r1"]
            assert sorted(k for k, r in results.items() if r.type == "canceled") == \
                ["long", "s0", "s1", "s2", "s3", "s4"]  # canceled while it ran, and never ran
            assert len(s.worker.engine.aborted) >= 1  # the running request was aborted in the engine


async def test_bad_batch_calls_get_anthropic_errors_and_list_pages(redis_url, prefix):
    async with scripted_stack(redis_url, prefix) as s:
        client = _client(s.url)
        for bad in ([], [_request("x", "a"), _request("x", "b")], [_request("no spaces", "a")],
                    [{"custom_id": "a"}]):
            with pytest.raises(anthropic.BadRequestError) as caught:
                await client.messages.batches.create(requests=bad)
            assert caught.value.body["error"]["type"] == "invalid_request_error"
        missing = await s.client.post("/v1/messages/batches", json={"request": []})
        assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
        for call in (client.messages.batches.retrieve, client.messages.batches.cancel, client.messages.batches.delete):
            with pytest.raises(anthropic.NotFoundError) as caught:
                await call("msgbatch_nope")
            assert caught.value.body["error"]["type"] == "not_found_error"
        unknown = await s.client.get("/v1/messages/batches/msgbatch_nope/results")
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"

        # No housekeeping here: the batches stay in progress, which is all a listing needs.
        ids = [(await client.messages.batches.create(requests=[_request("a", "hi")])).id for _ in range(3)]
        everything = [b.id async for b in client.messages.batches.list(limit=2)]  # the SDK pages on
        # Newest first by the second they were created (these three share one, mostly).
        assert sorted(everything) == sorted(ids)
        page = await client.messages.batches.list(limit=2)
        assert [b.id for b in page.data] == everything[:2] and page.has_more
        assert (page.first_id, page.last_id) == tuple(everything[:2])
        rest = await client.messages.batches.list(limit=2, after_id=page.last_id)
        assert [b.id for b in rest.data] == everything[2:] and not rest.has_more
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.batches.list(before_id=ids[0])
        with pytest.raises(anthropic.BadRequestError):
            await client.messages.batches.list(limit=0)
        # An OpenAI batch is not a Message Batch, and neither API lists the other's.
        upload = await s.client.post("/v1/files", files={"file": ("in.jsonl", b'{"custom_id": "a"}\n')},
                                     data={"purpose": "batch"})
        openai_batch = (await s.client.post("/v1/batches", json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"})).json()
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.batches.retrieve(openai_batch["id"])
        assert [b.id async for b in client.messages.batches.list()] == everything
        assert [b["id"] for b in (await s.client.get("/v1/batches")).json()["data"]] == [openai_batch["id"]]


async def test_a_message_batch_belongs_to_the_key_that_created_it(redis_url, prefix):
    async with scripted_stack(redis_url, prefix, api_keys="key-one, key-two") as s:
        one = AsyncAnthropic(base_url=s.url, api_key="key-one", max_retries=0)
        two = AsyncAnthropic(base_url=s.url, api_key="key-two", max_retries=0)
        batch = await one.messages.batches.create(requests=[_request("a", "hi")])
        assert (await one.messages.batches.retrieve(batch.id)).id == batch.id
        for call in (two.messages.batches.retrieve, two.messages.batches.cancel, two.messages.batches.delete):
            with pytest.raises(anthropic.NotFoundError):
                await call(batch.id)
        assert [b.id async for b in two.messages.batches.list()] == []
        assert [b.id async for b in one.messages.batches.list()] == [batch.id]
        with pytest.raises(anthropic.AuthenticationError):
            await AsyncAnthropic(base_url=s.url, api_key="nope", max_retries=0).messages.batches.list()


async def test_a_batch_past_its_24_hours_ends_with_its_requests_expired(redis_url, prefix, tmp_path):
    async with scripted_stack(redis_url, prefix) as s:
        client = _client(s.url)
        batch = await client.messages.batches.create(requests=[_request(f"r{i}", "abc", 3) for i in range(3)])
        # Its window ran out before housekeeping first saw it: none of its requests ever starts.
        await s.redis.hset(Keys(prefix).batch(batch.id), "expires_at", int(time.time()) - 1)
        with housekeeping(redis_url, prefix, tmp_path):
            done, _ = await _until_ended(client, batch.id)
        counts = done.request_counts
        assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == \
            (0, 0, 0, 0, 3)
        assert done.ended_at >= done.created_at and done.cancel_initiated_at is None
        results = await _results(client, batch.id)
        assert {k: r.type for k, r in results.items()} == {"r0": "expired", "r1": "expired", "r2": "expired"}


async def test_a_key_lists_its_own_message_batches_while_another_key_has_many_newer(redis_url, prefix):
    from shared.batches import MESSAGES, BatchObject, BatchStore
    from shared.tenants import key_hash

    def stored(batch_id: str, created_at: int, endpoint: str = MESSAGES) -> BatchObject:
        return BatchObject(id=batch_id, endpoint=endpoint, input_file_id="", completion_window="24h",
                           created_at=created_at, status="completed")

    async with scripted_stack(redis_url, prefix, api_keys="key-a,key-b") as s:
        store = BatchStore(s.redis, Keys(prefix))
        for n in range(3):
            await store.create(stored(f"msgbatch_a{n}", 1000 + n), [], key_hash("key-a"))
        await store.create(stored("batch_a_openai", 1500, "/v1/chat/completions"), [], key_hash("key-a"))
        for n in range(25):
            await store.create(stored(f"msgbatch_b{n}", 2000 + n), [], key_hash("key-b"))
        client = AsyncAnthropic(base_url=s.url, api_key="key-a", max_retries=0)
        page = await client.messages.batches.list(limit=2)
        assert [b.id for b in page.data] == ["msgbatch_a2", "msgbatch_a1"] and page.has_more
        assert (page.first_id, page.last_id) == ("msgbatch_a2", "msgbatch_a1")
        rest = await client.messages.batches.list(limit=2, after_id=page.last_id)
        assert [b.id for b in rest.data] == ["msgbatch_a0"] and not rest.has_more
        assert [b.id async for b in client.messages.batches.list()] == ["msgbatch_a2", "msgbatch_a1", "msgbatch_a0"]
        # The page size is 1-1000 in ASCII digits; anything else is Anthropic's 400.
        for raw in ("²", "١٢", "0", "1001", " 5", "9" * 5000):
            resp = await s.client.get("/v1/messages/batches", params={"limit": raw}, headers={"x-api-key": "key-a"})
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", (raw, resp.text)
