"""Agents through llmq: tool calls with the real clients against real vLLM workers on the tiny
model (its template renders tools in Qwen's hermes format, the worker parses with vLLM's
``hermes`` parser, and forced choices are held to the tools' schemas by structured outputs).

The tiny model's words are gibberish, so these tests force the first tool call (as agent
frameworks let a caller do) and check what a client depends on: the call parses, its arguments
validate against the tool's schema, the finish reason is vLLM's, the tool's result goes back, and
the run ends with an answer.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": CITY, "strict": True}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_required_tool_call_parses_and_validates_streamed_or_not(client, stack):
    kwargs = dict(model=stack.model, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
                  max_tokens=200, parallel_tool_calls=False)
    plain = client.chat.completions.create(**kwargs)
    [choice] = plain.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id == f"call_{plain.id.removeprefix('chatcmpl-')}_0", "the call's id is derived from the job"
    jsonschema.validate(json.loads(call.function.arguments), CITY)

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    pieces = [t for c in chunks for ch in c.choices for t in ch.delta.tool_calls or ()]
    assert pieces[0].id is not None and pieces[0].function.name == "get_weather"
    assert all(p.id is None and p.function.name is None for p in pieces[1:]), "later pieces carry arguments only"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments, "greedy: as unstreamed"
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_a_named_tool_finishes_with_stop_and_history_with_calls_renders(client, stack):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=stack.model, messages=ASK, tools=[WEATHER], tool_choice=named,
                                           temperature=0, max_tokens=200)
    assert first.choices[0].finish_reason == "stop", "a named tool's turn stops, as OpenAI and vLLM report it"
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=stack.model, messages=history, tools=[WEATHER],
                                            tool_choice="none", temperature=0, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.usage.prompt_tokens > first.usage.prompt_tokens
    no_tools = client.chat.completions.create(model=stack.model, messages=ASK, tools=[], tool_choice="none",
                                              max_tokens=4)
    assert no_tools.choices[0].message.role == "assistant"


def test_auto_tool_choice_without_a_parser_is_the_dialects_400(stack):
    """The same request on an API whose deployment names no tool parser (vLLM without
    ``--enable-auto-tool-choice``)."""
    url = stack.api(LLMQ_TOOL_PARSER="none")
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as other:
        with pytest.raises(openai.BadRequestError) as info:
            other.chat.completions.create(model=stack.model, messages=ASK, tools=[WEATHER], max_tokens=4)
        assert "LLMQ_TOOL_PARSER" in info.value.message
        forced = other.chat.completions.create(model=stack.model, messages=ASK, tools=[WEATHER],
                                               tool_choice="required", max_tokens=200, temperature=0)
        assert forced.choices[0].message.tool_calls, "a forced choice needs no parser"


def weather_agent_run(stack, model_class: str, output_type: type | None = None) -> tuple[object, list[str]]:
    """An openai-agents run of an agent with one function tool, required on the first turn (the
    SDK resets the choice to auto once a tool ran), on ``model_class`` (its chat or its Responses
    model): the run's result and the cities the tool was called with."""
    import agents
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no export to OpenAI's tracing service
    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    async def run() -> object:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
        model = getattr(agents, model_class)(model=stack.model, openai_client=client)
        agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                      output_type=output_type,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=200, temperature=0,
                                                   parallel_tool_calls=False))
        try:
            return await Runner.run(agent, "Weather in Paris?", max_turns=6)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert seen and seen[0] in ("Paris", "Rome", "Oslo"), "the tool ran with arguments that fit its schema"
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]  # type: ignore[attr-defined]
    assert outputs and outputs[0].output == f"sunny in {seen[0]}", "its result went back"
    return result, seen


def test_openai_agents_runs_its_tool_loop_on_chat_completions(stack):
    result, _ = weather_agent_run(stack, "OpenAIChatCompletionsModel")
    assert isinstance(result.final_output, str), "the run ended with an answer"


def test_langchain_bind_tools_and_structured_output_by_function_calling(stack):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Weather(BaseModel):
        """The weather in a city."""

        city: Literal["Paris", "Rome", "Oslo"]

    llm = ChatOpenAI(base_url=f"{stack.url}/v1", api_key="x", model=stack.model, temperature=0, max_tokens=200,
                     max_retries=0)
    message = llm.bind_tools([Weather], tool_choice="required", parallel_tool_calls=False).invoke("Weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "Weather" and call["args"]["city"] in ("Paris", "Rome", "Oslo")
    assert call["id"].startswith("call_")
    answer = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Rome?")
    assert isinstance(answer, Weather)


def test_openai_agents_runs_its_tool_loop_on_the_responses_api(stack):
    """The Responses model, whose SDK treats a turn cut at its token budget as a failure: the
    final answer is a typed output (a JSON schema the grammar brings to its end), which a random
    model's free text would not reach."""
    from pydantic import BaseModel

    class Report(BaseModel):
        city: Literal["Paris", "Rome", "Oslo"]
        sky: Literal["sunny", "cloudy"]

    result, _ = weather_agent_run(stack, "OpenAIResponsesModel", output_type=Report)
    assert isinstance(result.final_output, Report), "the run ended with an answer"


def test_anthropic_sdk_tool_use_then_tool_result_then_a_final_message(stack):
    import anthropic

    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY, "strict": True}
    with anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0) as client:
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        first = client.messages.create(model=stack.model, max_tokens=200, messages=ask, tools=[tool],
                                       tool_choice={"type": "any", "disable_parallel_tool_use": True})
        assert first.stop_reason == "tool_use"
        [use] = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, CITY)
        history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "sunny, 21 C"}]}]
        with client.messages.stream(model=stack.model, max_tokens=16, messages=history, tools=[tool],
                                    tool_choice={"type": "none"}) as stream:
            final = stream.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens")
        assert [b.type for b in final.content] == ["text"] and final.usage.input_tokens > first.usage.input_tokens
