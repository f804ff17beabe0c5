"""OpenAI Responses through the real openai SDK, on a real port, real Redis and a scripted engine.

The scripted engine answers with the last input message's characters cycled (``"abc"`` with
``max_output_tokens: 4`` gives ``"abca"``) and stops on the length, so the status is
``incomplete``; an input starting ``eos`` ends with a stop instead (``completed``), and one
starting ``slow`` waits before its first token (time to cancel it, or to see it queued/running).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import msgspec
import openai
import pytest
from hypothesis import strategies as st

from api.dialects import openai_responses as r
from shared.events import TokenDelta, ToolCallDelta
from shared.schemas import ChatMessage, GenerationRequest, ToolCall
from tests.support.dialect_bodies import responses_bodies
from tests.support.fuzzing import draw, malformed_bodies, odd_bodies, struct_body
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import scripted_settings, serve_api
from tests.support.waiting import eventually, job_status
from workers.protocol import Step

SLOW_S = 1.5


def agent_steps(job_id: str, prompt_tokens: int) -> list[Step]:
    """A model that reasons, then calls two tools (the second a namespace's function), as the
    worker publishes a parsed chat: reasoning and call pieces apart, ids derived from the job."""
    return [
        Step(deltas=[TokenDelta(token_ids=[1], reasoning="plan")], prompt_tokens=prompt_tokens),
        Step(deltas=[TokenDelta(token_ids=[2], tool_calls=[
            ToolCallDelta(index=0, id=f"call_{job_id}_0", name="get_weather", arguments='{"city":')])]),
        Step(deltas=[TokenDelta(token_ids=[3], tool_calls=[ToolCallDelta(index=0, arguments='"Paris"}')])]),
        Step(deltas=[TokenDelta(token_ids=[4], tool_calls=[
            ToolCallDelta(index=1, id=f"call_{job_id}_1", name="crm__lookup", arguments="{}")],
            finish_reason="tool_calls")], finished=True),
    ]


class ResponsesEngine(ScriptedEngine):
    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        prompt = req.messages[-1].content if req.messages else ""
        if prompt.startswith("call"):  # the agent's turn: reasoning and tool calls, no text
            for step in agent_steps(job_id, len(prompt)):
                await asyncio.sleep(self.delay_s)
                yield step
            return
        # Fuzzed bodies ask for up to the whole context: a few dozen tokens tell the same story.
        req = msgspec.structs.replace(req, sampling=msgspec.structs.replace(
            req.sampling, max_tokens=min(req.sampling.max_tokens, 64)))
        if prompt.startswith("slow"):
            await asyncio.sleep(SLOW_S)
        async for step in super().steps(job_id, req, replay):
            if prompt.startswith("eos") and step.finished:
                for delta in step.deltas:
                    delta.finish_reason = "stop"
            yield step


# One stack for the module: tests/integration/conftest.py
pytestmark = pytest.mark.stack(ResponsesEngine(delay_s=0.001), prefix="scripted-responses")


@pytest.fixture
async def client(stack):
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


async def until(client: openai.AsyncOpenAI, resp_id: str, statuses: set[str], timeout_s: float = 10.0):
    async def response():
        resp = await client.responses.retrieve(resp_id)
        return resp if resp.status in statuses else None
    return await eventually(response, timeout_s=timeout_s, what=f"response {resp_id} in {statuses}")


async def test_create_plain_output_text_usage_and_echo(client):
    resp = await client.responses.create(model="tiny", input="abc", instructions="be brief", max_output_tokens=5,
                                         metadata={"k": "v"}, temperature=0.5, service_tier="flex", user="u1")
    assert resp.output_text == expected_text("abc", 5) == "abcab"
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5 and resp.usage.total_tokens == resp.usage.input_tokens + 5
    assert resp.output[0].id == "msg_" + resp.id.removeprefix("resp_") and resp.output[0].status == "incomplete"
    assert (resp.metadata, resp.instructions, resp.temperature, resp.service_tier, resp.user) == (
        {"k": "v"}, "be brief", 0.5, "flex", "u1")
    assert resp.model == "tiny" and resp.tools == [] and resp.store is True and resp.background is False


async def test_message_items_and_a_stop_complete(client):
    items = [{"role": "user", "content": "first"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "eosx"}]}]
    resp = await client.responses.create(model="tiny", input=items, max_output_tokens=3)
    assert resp.status == "completed" and resp.incomplete_details is None and resp.output_text == "eos"
    assert resp.output[0].status == "completed"


async def test_stream_deltas_join_to_the_plain_text_with_consecutive_numbers(client):
    plain = await client.responses.create(model="tiny", input="eosxyz", max_output_tokens=8)
    stream = await client.responses.create(model="tiny", input="eosxyz", max_output_tokens=8, stream=True)
    events = [e async for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text == events[-4].text == "eosxyzeo"
    assert events[-1].response.usage.output_tokens == 8 and events[0].response.status == "in_progress"


async def test_sdk_stream_helper_accumulates_the_same_text(client):
    async with client.responses.stream(model="tiny", input="eosab", max_output_tokens=6) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.output_text == "eosabe" and final.status == "completed"


async def test_json_schema_format_is_accepted_and_echoed(client, stack):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    resp = await client.responses.create(model="tiny", input="eosjs", max_output_tokens=4, text={"format": fmt})
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "thing"
    assert stack.worker.engine.requests[-1].sampling.structured.json == schema  # the constraint reached the engine


async def test_background_then_retrieve_until_completed_and_input_items(client):
    resp = await client.responses.create(model="tiny", input="slow eos", instructions="sys", max_output_tokens=4,
                                         background=True)
    assert resp.status == "queued" and resp.background is True and resp.output == []
    done = await until(client, resp.id, {"completed", "incomplete"})
    assert done.output_text == "slow" and done.id == resp.id and done.created_at == resp.created_at
    items = await client.responses.input_items.list(resp.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "slow eos"), ("system", "sys")]


async def test_retrieve_stream_starting_after_gives_exactly_the_later_events(client):
    resp = await client.responses.create(model="tiny", input="eosq", max_output_tokens=6, background=True)
    await until(client, resp.id, {"completed"})
    whole = [e async for e in await client.responses.retrieve(resp.id, stream=True)]
    assert [e.sequence_number for e in whole] == list(range(len(whole))) and whole[-1].type == "response.completed"
    for n in (0, 3, 5, len(whole) - 2):
        later = [e async for e in await client.responses.retrieve(resp.id, stream=True, starting_after=n)]
        assert [e.model_dump() for e in later] == [e.model_dump() for e in whole[n + 1:]]


async def test_resume_a_running_background_stream_follows_it_live(client):
    resp = await client.responses.create(model="tiny", input="slow live", max_output_tokens=5, background=True)
    events = [e async for e in await client.responses.retrieve(resp.id, stream=True, starting_after=1)]
    assert events[0].sequence_number == 2 and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "slow "


async def test_background_stream_outlives_its_request(client):
    stream = await client.responses.create(model="tiny", input="slow gone", max_output_tokens=3, background=True,
                                           stream=True)
    first = await anext(aiter(stream))
    assert first.type == "response.created" and first.response.status == "queued"
    await stream.close()  # the client leaves: a background job keeps running
    done = await until(client, first.response.id, {"incomplete"})
    assert done.output_text == "slo"


async def test_cancel_a_background_response(client, stack):
    resp = await client.responses.create(model="tiny", input="slow cancel", max_output_tokens=50, background=True)
    cancelled = await client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled" and cancelled.id == resp.id
    assert (await until(client, resp.id, {"cancelled"})).status == "cancelled"


async def test_delete_answers_the_deletion_object_and_forgets_the_response(stack, client):
    resp = await client.responses.create(model="tiny", input="eosd", max_output_tokens=2)
    raw = await stack.client.delete(f"/v1/responses/{resp.id}")
    assert raw.status_code == 200 and raw.json() == {"id": resp.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(resp.id)
    assert await stack.redis.keys(f"*{resp.id.removeprefix('resp_')}*") == []


async def test_deleting_a_running_response_ends_its_live_stream(client):
    resp = await client.responses.create(model="tiny", input="slow delete", max_output_tokens=200, background=True)
    stream = await client.responses.retrieve(resp.id, stream=True)
    events = []

    async def read() -> None:
        async for event in stream:
            events.append(event)

    reader = asyncio.create_task(read())
    while not any(e.type == "response.output_text.delta" for e in events):
        await asyncio.sleep(0.01)
    await client.responses.delete(resp.id)
    await asyncio.wait_for(reader, 10)  # the follower gets the end, never waits on a forgotten job
    assert events[-1].type == "response.failed" and events[-1].response.status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(resp.id)


async def test_error_classes(client, stack):
    with pytest.raises(openai.BadRequestError) as info:  # a hosted tool cannot be forced: llmq cannot run it
        await client.responses.create(model="tiny", input="x", tools=[{"type": "web_search_preview"}],
                                      tool_choice={"type": "web_search_preview"})
    assert info.value.body["param"] == "tool_choice" and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as gone:
        await client.responses.create(model="tiny", input="x", previous_response_id="resp_x")
    assert gone.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as by_file:  # an image by file_id: llmq has no files API
        await client.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "file_id": "file_1", "detail": "auto"}]}])
    assert by_file.value.body["param"] == "input[0].content[0].file_id"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_0000deadbeef")
    with pytest.raises(openai.NotFoundError):
        await client.responses.cancel("nope")
    # A chat job's id is not a response: 404, not someone else's object in the wrong shape.
    chat = await stack.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}],
                                                                  "max_tokens": 2})
    job_id = chat.json()["id"].removeprefix("chatcmpl-")
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_" + job_id)


async def test_stream_frames_are_named_events_without_done(stack):
    async with stack.client.stream("POST", "/v1/responses", json={"input": "eosf", "max_output_tokens": 2,
                                                                   "stream": True}) as resp:
        raw = await resp.aread()
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"" and b"[DONE]" not in raw
    for f in frames[:-1]:
        event, data = f.split(b"\n")
        assert event.startswith(b"event: response.") and data.startswith(b'data: {"type":"' + event[7:] + b'"')


async def test_malformed_bodies_are_openai_400s(stack):
    for body in (b"", b"\xff", b"{", b'{"input": 1}', b'{"input": "x", "temperature": 9}'):
        resp = await stack.client.post("/v1/responses", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 400, body
        assert resp.json()["error"]["type"] == "invalid_request_error"



async def test_fuzzed_and_malformed_bodies_never_500_or_hang(stack):
    valid = st.one_of(st.sampled_from([{"input": "hi", "max_output_tokens": 2},
                                       {"input": [{"role": "user", "content": "x"}], "stream": True}]),
                      struct_body(r.ResponsesRequest, wild=False))
    bodies = [(b, False) for b in draw(responses_bodies, 60) + draw(odd_bodies(valid), 30)]
    bodies += [(b, True) for b in draw(malformed_bodies(valid), 30)]  # these must be a 4xx
    limit, failures = asyncio.Semaphore(8), []

    async def one(body: bytes, malformed: bool) -> None:
        async with limit:
            try:
                async with asyncio.timeout(10):
                    async with stack.client.stream("POST", "/v1/responses", content=body,
                                                   headers={"content-type": "application/json"}) as resp:
                        content = await resp.aread()
            except TimeoutError:
                failures.append(f"HANG body={body[:200]!r}")
                return
        if resp.status_code >= 500 or (malformed and resp.status_code < 400) or b"internal" in content:
            failures.append(f"{resp.status_code} body={body[:200]!r} response={content[:200]!r}")

    await asyncio.gather(*(one(b, m) for b, m in bodies))
    assert not failures, "\n".join(failures[:10])
    ok = await stack.client.post("/v1/responses", json={"input": "ok", "max_output_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_respond_async_polls_at_v1_jobs_with_the_response_object(stack):
    resp = await stack.client.post("/v1/responses", json={"input": "eosj", "max_output_tokens": 3},
                                   headers={"Prefer": "respond-async"})
    assert resp.status_code == 202
    job_id = resp.json()["id"]
    view = await job_status(stack.client, job_id, "done")
    assert view["dialect"] == "openai_responses"
    assert view["result"]["id"] == "resp_" + job_id and view["result"]["output"][0]["content"][0]["text"] == "eos"


async def test_a_repeated_idempotency_key_answers_the_same_background_response(client):
    first = await client.responses.create(model="tiny", input="eosk", max_output_tokens=2, background=True,
                                          extra_headers={"Idempotency-Key": "resp-key-1"})
    again = await client.responses.create(model="tiny", input="eosk", max_output_tokens=2, background=True,
                                          extra_headers={"Idempotency-Key": "resp-key-1"})
    assert again.id == first.id and again.created_at == first.created_at


async def test_a_background_response_resumes_on_another_web_process_after_the_first_is_gone(stack, redis_url,
                                                                                              client):
    """Started on API process A, which then shuts down; B (the stack's own API) replays and follows
    it from the job's event log: every event exactly once, the text whole."""
    settings_a = scripted_settings(redis_url, "scripted-responses")
    async with serve_api(settings_a) as url_a:
        async with openai.AsyncOpenAI(base_url=f"{url_a}/v1", api_key="unused", max_retries=0) as on_a:
            stream = await on_a.responses.create(model="tiny", input="slow resume", max_output_tokens=6,
                                                 background=True, stream=True)
            seen = [await anext(aiter(stream)), await anext(aiter(stream))]
            await stream.close()
    assert [e.sequence_number for e in seen] == [0, 1]
    rest = [e async for e in await client.responses.retrieve(seen[0].response.id, stream=True, starting_after=1)]
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "slow r"
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "slow r"


async def test_an_error_before_the_first_token_keeps_its_status_and_a_later_one_fails_in_band(client):
    with pytest.raises(openai.BadRequestError) as info:  # the engine refuses "fail" before any token
        await client.responses.create(model="tiny", input="fail", max_output_tokens=3, stream=True)
    assert info.value.body["message"] == "scripted failure"
    events = [e async for e in await client.responses.create(model="tiny", input="break", max_output_tokens=3,
                                                             stream=True)]
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    assert events[-1].sequence_number == len(events) - 1
    assert events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    failed = await client.responses.retrieve(events[-1].response.id)
    assert failed.status == "failed" and failed.error.message == "scripted failure mid-stream"


async def test_a_repeated_key_of_a_finished_background_response_answers_how_it_ended(client):
    first = await client.responses.create(model="tiny", input="eosr", max_output_tokens=2, background=True,
                                          metadata={"m": "1"}, extra_headers={"Idempotency-Key": "resp-key-2"})
    await until(client, first.id, {"completed"})
    again = await client.responses.create(model="tiny", input="eosr", max_output_tokens=2, background=True,
                                          metadata={"m": "1"}, extra_headers={"Idempotency-Key": "resp-key-2"})
    assert (again.id, again.status, again.output_text, again.metadata) == (first.id, "completed", "eo", {"m": "1"})


async def test_a_response_read_back_later_says_what_its_first_answer_said(client):
    fmt = {"type": "json_schema", "name": "ans", "schema": {"type": "object"}, "strict": True}
    first = await client.responses.create(model="tiny", input="slow kept", instructions="be brief",
                                          metadata={"team": "a"}, user="u1", max_output_tokens=3,
                                          background=True, text={"format": fmt})
    later = await until(client, first.id, {"completed", "incomplete"})
    for field in ("instructions", "metadata", "user", "background", "store", "max_output_tokens", "service_tier"):
        assert getattr(later, field) == getattr(first, field), field
    assert later.text.format.name == first.text.format.name == "ans"
    resumed = [e async for e in await client.responses.retrieve(first.id, stream=True)]
    assert resumed[0].response.metadata == {"team": "a"} and resumed[0].response.instructions == "be brief"


async def test_previous_response_id_continues_the_conversation(client, stack):
    first = await client.responses.create(model="tiny", input="abc", instructions="old rules", max_output_tokens=4)
    second = await client.responses.create(model="tiny", input="next", previous_response_id=first.id,
                                           max_output_tokens=3)
    assert second.previous_response_id == first.id and second.output_text == expected_text("next", 3)
    # The second turn's prompt holds the first turn's input and output, not its instructions.
    items = await client.responses.input_items.list(second.id)
    assert [(i.role, i.content[0].text) for i in reversed(items.data)] == [
        ("user", "abc"), ("assistant", first.output_text), ("user", "next")]
    third = await client.responses.create(model="tiny", input="more", previous_response_id=second.id,
                                          max_output_tokens=2)
    items = await client.responses.input_items.list(third.id)
    assert [i.content[0].text for i in reversed(items.data)] == [
        "abc", first.output_text, "next", second.output_text, "more"]
    assert (await client.responses.retrieve(third.id)).previous_response_id == second.id


async def test_a_chain_onto_an_unstored_or_unfinished_response_is_refused(client):
    unstored = await client.responses.create(model="tiny", input="abc", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as info:
        await client.responses.create(model="tiny", input="x", previous_response_id=unstored.id)
    assert "store: false" in info.value.message
    running = await client.responses.create(model="tiny", input="slow chain", max_output_tokens=50, background=True)
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="tiny", input="x", previous_response_id=running.id)
    assert info.value.body["param"] == "previous_response_id"
    await client.responses.cancel(running.id)


# --- tools: the agent's turn, and the next one chained onto it -------------------------------

TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
         {"type": "namespace", "name": "crm", "description": "CRM", "tools": [
             {"type": "function", "name": "lookup", "parameters": {"type": "object"}}]},
         {"type": "web_search"}]


def agent_output(resp, job_id: str) -> None:
    reasoning, weather, lookup = resp.output
    assert (reasoning.type, reasoning.id, reasoning.content[0].text) == ("reasoning", f"rs_{job_id}", "plan")
    assert (weather.type, weather.id, weather.call_id, weather.name, weather.arguments) == (
        "function_call", f"fc_{job_id}_0", f"call_{job_id}_0", "get_weather", '{"city":"Paris"}')
    assert (lookup.call_id, lookup.name, lookup.namespace, lookup.arguments) == (f"call_{job_id}_1", "lookup", "crm",
                                                                                 "{}")


async def test_tool_calls_come_back_as_items_and_the_chain_answers_them(client, stack):
    first = await client.responses.create(model="tiny", input="call the tools", tools=TOOLS,
                                          reasoning={"effort": "low"}, include=["reasoning.encrypted_content"])
    job_id = first.id.removeprefix("resp_")
    agent_output(first, job_id)
    assert first.status == "completed" and first.output_text == "" and first.tool_choice == "auto"
    assert [t.type for t in first.tools] == ["function", "namespace", "web_search"]  # echoed as sent
    offered = stack.worker.engine.requests[-1]
    assert [t.name for t in offered.tools.tools] == ["get_weather", "crm__lookup"]  # the hosted one left out
    assert offered.chat.template_kwargs["reasoning_effort"] == "low"

    outputs = [{"type": "function_call_output", "call_id": f"call_{job_id}_0", "output": "sunny"},
               {"type": "function_call_output", "call_id": f"call_{job_id}_1", "output": "found"}]
    second = await client.responses.create(model="tiny", input=outputs, previous_response_id=first.id, tools=TOOLS,
                                           max_output_tokens=3)
    assert second.output_text == "fou"  # the scripted model repeats the last turn: the last tool's output
    calls = [ToolCall(id=f"call_{job_id}_0", name="get_weather", arguments='{"city":"Paris"}'),
             ToolCall(id=f"call_{job_id}_1", name="crm__lookup", arguments="{}")]
    assert stack.worker.engine.requests[-1].messages == [
        ChatMessage(role="user", content="call the tools"),
        ChatMessage(role="assistant", reasoning="plan", tool_calls=calls),
        ChatMessage(role="tool", content="sunny", tool_call_id=f"call_{job_id}_0"),
        ChatMessage(role="tool", content="found", tool_call_id=f"call_{job_id}_1")]
    items = (await client.responses.input_items.list(second.id)).data[::-1]
    assert [i.type for i in items] == ["message", "reasoning", "function_call", "function_call",
                                       "function_call_output", "function_call_output"]
    assert (items[3].name, items[3].namespace, items[5].call_id, items[5].output) == (
        "lookup", "crm", f"call_{job_id}_1", "found")


def shape(events) -> list[str]:
    types = [e.type for e in events]
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


async def test_a_streamed_agent_turn_resumes_exactly_from_any_event(client, stack):
    async with client.responses.stream(model="tiny", input="call live", tools=TOOLS) as stream:
        live = [event async for event in stream]
        final = await stream.get_final_response()
    agent_output(final, final.id.removeprefix("resp_"))
    assert [e.sequence_number for e in live] == list(range(len(live)))
    done = [e.item for e in live if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["reasoning", "function_call", "function_call"]  # what Codex builds calls from
    # The background replay of the same kind of turn, cut anywhere, is the exact rest.
    resp = await client.responses.create(model="tiny", input="call later", tools=TOOLS, background=True)
    await until(client, resp.id, {"completed"})
    whole = [e async for e in await client.responses.retrieve(resp.id, stream=True)]
    # How many delta events a piece arrives in is how the worker's flushes fell, so runs of deltas count once.
    assert shape(whole) == shape(live)
    for n in range(len(whole)):
        later = [e async for e in await client.responses.retrieve(resp.id, stream=True, starting_after=n)]
        assert [e.model_dump() for e in later] == [e.model_dump() for e in whole[n + 1:]]
    # The job's own event log (/v1/jobs/{id}/events) holds the pieces, and resumes as exactly.
    job_events = f"/v1/jobs/{resp.id.removeprefix('resp_')}/events"
    logged = [f for f in (await stack.client.get(job_events)).content.split(b"\n\n") if f.startswith(b"id: ")]
    assert b'"reasoning":"plan"' in logged[0] and b'"name":"crm__lookup"' in logged[-1]
    resumed = (await stack.client.get(job_events, headers={"Last-Event-ID": "2"})).content.split(b"\n\n")
    assert [f for f in resumed if f.startswith(b"id: ")] == logged[2:]
