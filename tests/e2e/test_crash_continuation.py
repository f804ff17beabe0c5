"""SIGKILL the worker that is streaming a job: a peer continues it, and the client's stream is
one uninterrupted run (real processes, real vLLM on the tiny model).

Four kinds of job: greedy (continued by prompt extension), a JSON schema and a ``choice`` job
(structured output: continued by replaying the published tokens under the same grammar) and an
``n`` = 3 job (each choice continued from its own tokens). vLLM refuses ``n`` > 1 with greedy
sampling, so that job samples with a seed: each choice is replayed with its own seed, as vLLM
seeds its children, and must still equal the uninterrupted run token for token.

This module starts its own small stack (two workers, one API) on a fresh prefix with a short
lease, so a dead worker's job is taken over within seconds; each test starts a replacement for
the worker it killed. Greedy output on CPU depends on the batch (tests/e2e/test_procfile_drain.py):
each reference runs alone, as the continued job then runs alone on the surviving worker, and
generations stay short.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import jsonschema
import pytest

from tests.support.crash_stack import (
    LEASE_S,
    Items,
    Small,
    check_taken_over,
    compare_completions,
    json_lines,
    result_ids,
    small_stack,
    sse_events,
    stream_and_kill,
)
from tests.support.faults import Figures, lost_and_duplicated

pytestmark = [pytest.mark.e2e, pytest.mark.faults]

MAX_TOKENS = 200
BODY = {"inputs": "Once upon a time", "parameters": {"do_sample": False, "max_new_tokens": MAX_TOKENS,
                                                     "ignore_eos_token": True, "details": True}}
# An array of exactly 22 enum strings: ~160 tokens of JSON, whatever the random weights prefer.
SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"enum": ["alpha", "beta", "gamma", "delta"]}, "minItems": 22, "maxItems": 22}},
    "required": ["items"], "additionalProperties": False}
# Three options of 150 characters (~100 tokens each), distinct from their first character.
OPTIONS = ["".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(150)) for i in range(3)]


@pytest.fixture(scope="module")
def small(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Small]:
    with small_stack(redis_url, tmp_path_factory.mktemp("crash-logs"), f"crash-{uuid.uuid4().hex[:6]}") as stack:
        yield stack


# --- the scenarios --------------------------------------------------------------------------

def test_sigkill_mid_stream_continues_on_a_peer_identical_to_an_uninterrupted_run(small, figures):
    small.two_workers()
    with httpx.Client(timeout=120) as client:
        reference = client.post(f"{small.url}/invocations", json=BODY)
        assert reference.status_code == 200, reference.text
        want = [t["id"] for t in reference.json()["details"]["tokens"]]
        assert len(want) == MAX_TOKENS
        killed = stream_and_kill(
            small, lambda items: json_lines(client, f"{small.url}/invocations", {**BODY, "stream": True}, items))

    ids = [line["token"]["id"] for _, line in killed.items if "token" in line]
    figures.requests_sent, figures.completed = 1, int(ids == want)
    figures.tokens_lost, figures.tokens_duplicated = lost_and_duplicated(want, ids)
    figures.seconds["recovery_s"] = killed.recovery_s
    print(f"killed after {killed.logged} events; next token {killed.recovery_s:.2f} s later (lease {LEASE_S} s)")

    assert ids == want, "the continued stream equals an uninterrupted greedy run: nothing lost or repeated"
    assert killed.items[-1][1]["generated_text"] == reference.json()["generated_text"]
    check_taken_over(small, killed)


def test_sigkill_mid_json_schema_stream_replays_the_grammar_on_a_peer(small, figures):
    body = {"prompt": "The inventory as JSON:", "max_tokens": 400, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA}}}
    _, got = compare_completions(small, body, figures)
    document = json.loads(got.text[0])
    jsonschema.validate(document, SCHEMA)
    assert len(document["items"]) == 22 and got.finish == {0: ["stop"]}


def test_sigkill_mid_choice_stream_replays_the_grammar_on_a_peer(small, figures):
    body = {"prompt": "Pick one:", "max_tokens": 400, "temperature": 0, "structured_outputs": {"choice": OPTIONS}}
    _, got = compare_completions(small, body, figures)
    assert got.text[0] in OPTIONS and got.finish == {0: ["stop"]}


def test_sigkill_mid_stream_of_three_choices_continues_each_on_a_peer(small, figures):
    body = {"prompt": "Once upon a time", "n": 3, "max_tokens": 120, "temperature": 1.0, "seed": 1234,
            "ignore_eos": True}
    want, got = compare_completions(small, body, figures)
    assert sorted(got.tokens) == [0, 1, 2] and all(len(t) == 120 for t in got.tokens.values())
    assert len(set(want.text.values())) == 3, "three different samples, each continued from its own tokens"


# --- agent turns: a tool call's arguments -------------------------------------------------------

LONG = {"type": "object", "properties": {"items": {
    "type": "array", "items": {"enum": ["alpha", "beta", "gamma", "delta"]}, "minItems": 48, "maxItems": 48}},
    "required": ["items"], "additionalProperties": False}
"""~300 tokens of arguments: the kill lands inside them."""
RECORD = {"type": "function", "function": {"name": "record_inventory", "description": "Store the inventory.",
                                           "parameters": LONG, "strict": True}}


@dataclass
class Turn:
    """An agent turn's stream as its client assembles it, in any of the three dialects: content,
    reasoning, each call's id (with the job's id made equal between two jobs), name and
    arguments (and how often it was opened), the finish reasons, and the in-band errors."""

    content: str = ""
    reasoning: str = ""
    calls: dict[int, dict] = field(default_factory=dict)
    finish: list[str] = field(default_factory=list)
    errors: int = 0

    def _call(self, index: int) -> dict:
        return self.calls.setdefault(index, {"ids": [], "name": None, "arguments": ""})

    def _opened(self, index: int, call_id: str, name: str, job_id: str) -> None:
        call = self._call(index)
        call["ids"].append(call_id.replace(job_id, "JOB"))
        call["name"] = name

    @classmethod
    def of(cls, dialect: str, items: Items) -> Turn:
        out = cls()
        job_id = JOB_OF[dialect](items)
        for _, event in items:
            if "error" in event or event.get("type") in ("error", "response.failed"):
                out.errors += 1
            elif dialect == "chat":
                out._chat(event, job_id)
            elif dialect == "responses":
                out._responses(event, job_id)
            else:
                out._messages(event, job_id)
        return out

    def _chat(self, chunk: dict, job_id: str) -> None:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            self.content += delta.get("content") or ""
            self.reasoning += delta.get("reasoning") or ""
            for piece in delta.get("tool_calls", []):
                if "id" in piece:
                    self._opened(piece["index"], piece["id"], piece["function"]["name"], job_id)
                self._call(piece["index"])["arguments"] += piece["function"].get("arguments", "")
            if choice["finish_reason"]:
                self.finish.append(choice["finish_reason"])

    def _responses(self, event: dict, job_id: str) -> None:
        kind = event["type"]
        if kind == "response.output_text.delta":
            self.content += event["delta"]
        elif kind == "response.reasoning_text.delta":
            self.reasoning += event["delta"]
        elif kind == "response.output_item.added" and event["item"]["type"] == "function_call":
            self._opened(event["output_index"], event["item"]["call_id"], event["item"]["name"], job_id)
        elif kind == "response.function_call_arguments.delta":
            self._call(event["output_index"])["arguments"] += event["delta"]
        elif kind == "response.completed":
            self.finish.append(event["response"]["status"])

    def _messages(self, event: dict, job_id: str) -> None:
        kind = event["type"]
        if kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
            block = event["content_block"]
            self._opened(event["index"], block["id"], block["name"], job_id)
        elif kind == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                self.content += delta["text"]
            elif delta["type"] == "thinking_delta":
                self.reasoning += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                self._call(event["index"])["arguments"] += delta["partial_json"]
        elif kind == "message_delta":
            self.finish.append(event["delta"]["stop_reason"])


JOB_OF = {
    "chat": lambda items: items[0][1]["id"].removeprefix("chatcmpl-"),
    "responses": lambda items: items[0][1]["response"]["id"].removeprefix("resp_"),
    "messages": lambda items: items[0][1]["message"]["id"].removeprefix("msg_"),
}
ROUTES = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def agent_body(dialect: str, model: str, choice: str, tool: dict | None, *, thinking: bool = False) -> dict:
    """One agent turn in ``dialect``: greedy, with ``tool`` offered under ``choice`` (``required``
    or ``named``) and one call allowed; ``thinking``: the model reasons first."""
    user = [{"role": "user", "content": "Take stock."}]
    fn = tool["function"] if tool else None
    if dialect == "chat":
        body = {"messages": user, "max_tokens": 600}
        if fn:
            body |= {"tools": [tool], "parallel_tool_calls": False, "tool_choice": choice if choice == "required"
                     else {"type": "function", "function": {"name": fn["name"]}}}
        if thinking:
            body["chat_template_kwargs"] = {"enable_thinking": True}
    elif dialect == "responses":
        body = {"input": user, "max_output_tokens": 600}
        if fn:
            body |= {"tools": [{"type": "function", **fn}], "parallel_tool_calls": False,
                     "tool_choice": choice if choice == "required" else {"type": "function", "name": fn["name"]}}
        if thinking:
            body["reasoning"] = {"effort": "high"}
    else:
        body = {"messages": user, "max_tokens": 600}
        if fn:
            body |= {"tools": [{"name": fn["name"], "description": fn["description"],
                                "input_schema": fn["parameters"], "strict": True}],
                     "tool_choice": {"type": "any", "disable_parallel_tool_use": True} if choice == "required"
                     else {"type": "tool", "name": fn["name"], "disable_parallel_tool_use": True}}
        if thinking:
            body["thinking"] = {"type": "adaptive"}  # Claude Code's; "enabled" needs a budget of 1024 or more
    return {"model": model, "stream": True, "temperature": 0, **body}


def compare_turns(small: Small, dialect: str, body: dict, figures: Figures, after: int) -> Turn:
    """The same agent turn alone, uninterrupted, then with its worker killed after ``after``
    events: what the client assembles must be equal, token for token, with no error."""
    small.two_workers()
    url = small.url + ROUTES[dialect]
    with httpx.Client(timeout=120) as client:
        reference: Items = []
        sse_events(client, url, body, reference)
        killed = stream_and_kill(small, lambda items: sse_events(client, url, body, items), after=after)
    want, got = Turn.of(dialect, reference), Turn.of(dialect, killed.items)
    figures.requests_sent, figures.completed = 1, int(got == want and not got.errors)
    figures.ended_with_error = got.errors
    figures.seconds["recovery_s"] = killed.recovery_s
    print(f"{dialect}: killed after {killed.logged} events; next event {killed.recovery_s:.2f} s later")

    assert not got.errors and not want.errors, "no error event: the job continued"
    assert got == want, "what the client assembles equals an uninterrupted run's"
    got_job, want_job = JOB_OF[dialect](killed.items), JOB_OF[dialect](reference)
    assert result_ids(small, got_job) == result_ids(small, want_job), "token for token"
    check_taken_over(small, killed)
    return got


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_sigkill_mid_tool_call_arguments_continues_the_call_on_a_peer(small, figures, dialect, choice):
    """An agent's turn: the worker dies while the model is writing a tool call's arguments (under
    the tools' grammar); the peer replays through a fresh parser, and the client assembles what an
    uninterrupted run gives: the same call, opened once with the same id, the same arguments, and
    no error."""
    got = compare_turns(small, dialect, agent_body(dialect, small.model, choice, RECORD), figures, after=40)
    [call] = got.calls.values()
    assert len(call["ids"]) == 1 and call["ids"][0].endswith("_JOB_0") and call["name"] == "record_inventory"
    jsonschema.validate(json.loads(call["arguments"]), LONG)
    finish = {"chat": "tool_calls" if choice == "required" else "stop", "responses": "completed",
              "messages": "tool_use"}
    assert got.finish == [finish[dialect]]


@pytest.fixture(scope="module")
def thinking_small(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Small]:
    """The small stack with the tiny model's reasoning parser (qwen3) on its workers."""
    with small_stack(redis_url, tmp_path_factory.mktemp("thinking-logs"), f"think-{uuid.uuid4().hex[:6]}",
                     LLMQ_REASONING_PARSER="qwen3") as stack:
        yield stack


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_sigkill_mid_reasoning_continues_the_reasoning_on_a_peer(thinking_small, figures, dialect):
    """The worker dies while the model reasons (the prompt opens <think>; vLLM's qwen3 parser
    sends what follows as reasoning): the peer replays through a fresh parser and the client's
    reasoning and content are an uninterrupted run's."""
    body = agent_body(dialect, thinking_small.model, "required", None, thinking=True)
    got = compare_turns(thinking_small, dialect, body, figures, after=40)
    assert got.reasoning, "the turn reasoned"
