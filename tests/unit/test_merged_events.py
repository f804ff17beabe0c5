"""An engine step joining its job's still-unsent event (Attempt.on_step's ``join``): the merged
events read back as the separate ones would (the result, each choice's tokens, texts, logprobs,
reasoning and tool-call arguments), with seqs 1..n and a compact log that expands to them; a step
that would read back otherwise (reasoning after text, a finished choice, a prompt, the first token,
logprobs on one side only) makes an event of its own. Each merge has its control: the same steps
unmerged. Per dialect (shared/chunking.py): a stream that merges renders what a client reads the
same both ways; one that does not would render merged deltas otherwise, and a worker never merges
its steps."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import msgspec
import pytest
from redis.asyncio import Redis

from api.dialects import stream
from shared import eventlog
from shared.chunking import MERGES_STEPS, merges_steps
from shared.codec import decode_event, encode
from shared.config import load_settings
from shared.events import Done, Event, TokenDelta, ToolCallDelta
from shared.keys import Keys
from shared.queue import Consumer, Delivery
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, OutputOptions, PromptInfo, SamplingParams, TopLogprob
from tests.support.scripted_engine import ScriptedEngine
from tests.support.streams import frames
from workers.attempt import Attempt, merge_deltas
from workers.protocol import Step
from workers.runner import Worker, _Running


def clock() -> float:
    return 1000.0


def run(steps: list[Step], *, take_every: int) -> tuple[list[Event], Attempt]:
    """The attempt's events for ``steps``, the flusher taking the outbox after every
    ``take_every`` steps (1: never merged, as when the flusher keeps up); the attempt's ``log`` is
    the compact log its end wrote."""
    a = Attempt(queued_at=1.0, started_at=2.0, whole_log=True)
    for i, s in enumerate(steps):
        fresh = dataclasses.replace(s, deltas=[msgspec.structs.replace(d) for d in s.deltas])  # as the engine's
        out = a.on_step(fresh, clock, join=i % take_every != 0)
        if out is not None and out.log is not None:
            a.log = out.log
    return [decode_event(a.sealed(seq)) for seq in range(1, a.seq + 1)], a


def choice_view(events: list[Event]) -> dict:
    """Per choice, what a reader assembles from the events."""
    view: dict[int, dict] = {}
    for e in events:
        for d in getattr(e, "deltas", []):
            c = view.setdefault(d.index, {"ids": [], "text": "", "reasoning": "", "texts": [], "logprobs": [],
                                          "tops": [], "args": {}, "names": {}, "finish": None})
            c["ids"] += d.token_ids
            c["text"] += d.text
            c["reasoning"] += d.reasoning
            c["texts"] += d.token_texts or []
            c["logprobs"] += d.logprobs or []
            c["tops"] += d.top_logprobs or []
            for call in d.tool_calls:
                c["args"][call.index] = c["args"].get(call.index, "") + call.arguments
                if call.name:
                    c["names"][call.index] = call.name
            c["finish"] = d.finish_reason or c["finish"]
    return view


def two_choices(n: int) -> list[Step]:
    steps = []
    for i in range(n):
        last = i == n - 1
        deltas = [TokenDelta(index=c, token_ids=[i * 10 + c], text=f"{c}{i} ", token_texts=[f"{c}{i} "],
                             logprobs=[-0.5 * i], top_logprobs=[[TopLogprob(i, f"{i}", -0.5 * i)]],
                             finish_reason="length" if last else None) for c in (0, 1)]
        steps.append(Step(deltas=deltas, finished=last, prompt_tokens=3,
                          prompt=PromptInfo(token_ids=[1, 2, 3]) if i == 0 else None))
    return steps


def result(events: list[Event]):
    builder = ResultBuilder()
    for e in events:
        builder.add(e)
    return builder.result()


def test_steps_join_the_unsent_event_and_read_back_as_the_separate_events():
    steps = two_choices(9)
    separate, plain = run(steps, take_every=1)
    merged, joined = run(steps, take_every=4)
    assert [e.seq for e in separate] == list(range(1, 10))
    # Takes before steps 0, 4 and 8. The first event stands alone (the prompt, the first token), the
    # next takes steps 1-3, the next steps 4-7; the last step is the Done.
    assert [len(e.deltas[0].token_ids) for e in merged] == [1, 3, 4, 1]
    assert [e.seq for e in merged] == list(range(1, len(merged) + 1))
    assert choice_view(merged) == choice_view(separate)
    assert merged[0].prompt == separate[0].prompt
    assert result(merged) == result(separate) == joined.result == plain.result
    assert joined.usage == plain.usage
    # The compact log the Done carries expands to the merged events, byte for byte.
    raw = b"[" + b",".join(joined.encoded) + b"]"
    assert [decode_event(e) for e in msgspec.json.decode(raw, type=list[msgspec.Raw])] == merged
    assert eventlog.expand(joined.log, encode(joined.result)) == raw


def test_a_joined_event_is_encoded_when_taken_and_takes_no_step_after():
    a = Attempt(queued_at=1.0, started_at=2.0)
    a.on_step(Step(deltas=[TokenDelta(token_ids=[1], text="a")]), clock)
    second = a.on_step(Step(deltas=[TokenDelta(token_ids=[2], text="b")]), clock, join=True)
    assert second.seq == 2 and not second.merged  # the attempt's first event takes no other step
    before = a.encoded[-1]
    third = a.on_step(Step(deltas=[TokenDelta(token_ids=[3], text="c")]), clock, join=True)
    assert third.merged and third.seq == 2 and third.tokens == 1 and a.encoded[-1] == before  # not yet encoded
    assert decode_event(a.sealed(2)).deltas == [TokenDelta(token_ids=[2, 3], text="bc")]
    fourth = a.on_step(Step(deltas=[TokenDelta(token_ids=[4], text="d")]), clock, join=True)
    assert not fourth.merged and fourth.seq == 3  # sealed: taken by the flusher
    assert a.usage.completion_tokens == 4


def test_reasoning_text_and_one_tool_calls_pieces_merge_in_order():
    steps = [Step(deltas=[TokenDelta(token_ids=[0], text="")]),
             Step(deltas=[TokenDelta(token_ids=[1], reasoning="think ")]),
             Step(deltas=[TokenDelta(token_ids=[2], reasoning="more")]),
             Step(deltas=[TokenDelta(token_ids=[3], text="Hi")]),
             Step(deltas=[TokenDelta(token_ids=[4], tool_calls=[ToolCallDelta(index=0, id="c1", name="f")])]),
             Step(deltas=[TokenDelta(token_ids=[5], tool_calls=[ToolCallDelta(index=0, arguments='{"a"')])]),
             Step(deltas=[TokenDelta(token_ids=[6], tool_calls=[ToolCallDelta(index=0, arguments=": 1}")])]),
             Step(deltas=[TokenDelta(token_ids=[7], finish_reason="tool_calls")], finished=True)]
    separate, _ = run(steps, take_every=1)
    merged, _ = run(steps, take_every=len(steps))
    assert choice_view(merged) == choice_view(separate)
    [_, tokens, done] = merged
    # One piece per call: its arguments as the separate pieces join.
    assert tokens.deltas[0].tool_calls == [ToolCallDelta(index=0, id="c1", name="f", arguments='{"a": 1}')]
    assert isinstance(done, Done) and done.seq == 3


def test_what_would_read_back_otherwise_does_not_merge():
    answer = [TokenDelta(token_ids=[1], text="answer")]
    # Every dialect renders a delta's reasoning before its text: merged, the later reasoning
    # would come out before the earlier text.
    assert merge_deltas(answer, [TokenDelta(token_ids=[2], reasoning="afterthought")]) is None
    assert merge_deltas(answer, [TokenDelta(token_ids=[2], text=" more")]) is not None  # the control
    assert answer == [TokenDelta(token_ids=[1], text="answer")]  # never changed in place
    ended = [TokenDelta(index=0, token_ids=[1], finish_reason="stop")]
    assert merge_deltas(ended, [TokenDelta(index=0, token_ids=[2])]) is None
    assert merge_deltas(ended, [TokenDelta(index=1, token_ids=[2])]) is not None  # another choice goes on
    with_logprobs = [TokenDelta(token_ids=[1], logprobs=[-1.0])]
    assert merge_deltas(with_logprobs, [TokenDelta(token_ids=[2])]) is None
    # A delta with no token of its own (a finish reason only) joins whatever the other carries.
    assert merge_deltas(with_logprobs, [TokenDelta(finish_reason="length")]) == [
        TokenDelta(token_ids=[1], logprobs=[-1.0], finish_reason="length")]


def test_the_first_token_and_a_prompt_make_events_of_their_own():
    a = Attempt(queued_at=1.0, started_at=2.0)
    a.on_step(Step(deltas=[], prompt=PromptInfo(token_ids=[9])), clock)
    a.on_step(Step(deltas=[TokenDelta(text="x")]), clock)  # text with no token (an event after the first)
    first_token = a.on_step(Step(deltas=[TokenDelta(token_ids=[1], text="a")]), clock, join=True)
    assert not first_token.merged and first_token.first_token_at == 1000.0 and first_token.seq == 3
    prompt = a.on_step(Step(deltas=[], prompt=PromptInfo(token_ids=[9])), clock, join=True)
    assert not prompt.merged and prompt.seq == 4


# --- per dialect: what a client reads of merged and of separate steps --------------------------------


def _sse_data(stream_frames: list[bytes]) -> list:
    return [json.loads(line[6:]) for f in stream_frames for line in f.split(b"\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


def _openai_view(stream_frames: list[bytes]) -> dict:
    """Per choice, OpenAI's pieces joined (text or content, reasoning, tool-call arguments,
    logprobs), its finish reason, and the usage chunk."""
    view: dict = {"usage": None}
    for chunk in _sse_data(stream_frames):
        view["usage"] = chunk.get("usage") or view["usage"]
        for c in chunk["choices"]:
            v = view.setdefault(c["index"], {"text": "", "reasoning": "", "args": {}, "logprobs": [], "finish": None})
            delta = c.get("delta", c)
            v["text"] += delta.get("content") or delta.get("text") or ""
            v["reasoning"] += delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                v["args"][call["index"]] = v["args"].get(call["index"], "") + call["function"]["arguments"]
            lps = c.get("logprobs") or {}
            legacy = zip(*(lps.get(k, []) for k in ("tokens", "token_logprobs", "text_offset")), strict=True)
            v["logprobs"] += lps.get("content") or list(legacy)
            v["finish"] = c.get("finish_reason") or v["finish"]
    return view


def _anthropic_view(stream_frames: list[bytes]) -> tuple:
    blocks: dict[int, dict] = {}
    kinds, last = [], None
    for e in _sse_data(stream_frames):
        if e["type"] == "content_block_start":
            kinds.append(e["content_block"]["type"])
            blocks[e["index"]] = {}
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            for k, v in d.items():
                if k != "type":
                    blocks[e["index"]][k] = blocks[e["index"]].get(k, "") + v
        elif e["type"] == "message_delta":
            last = e
    return kinds, blocks, last


def _responses_view(stream_frames: list[bytes]) -> dict:
    return [e for e in _sse_data(stream_frames) if e["type"] == "response.completed"][0]["response"]


def _happy_vllm_view(stream_frames: list[bytes]) -> bytes:
    return stream_frames[-1]  # each line is the whole answer so far


def _jobs_view(stream_frames: list[bytes]) -> dict:
    return choice_view([decode_event(e) for e in (json.dumps(x).encode() for x in _sse_data(stream_frames))])


def _chat_steps() -> list[Step]:
    reasoning = [Step(deltas=[TokenDelta(token_ids=[i], reasoning=f"r{i} ", token_texts=[f"r{i}"],
                                         logprobs=[-0.1], top_logprobs=[[TopLogprob(i, f"r{i}", -0.1)]])])
                 for i in range(3)]
    text = [Step(deltas=[TokenDelta(token_ids=[10 + i], text=f"t{i} ", token_texts=[f"t{i} "], logprobs=[-0.2],
                                    top_logprobs=[[TopLogprob(10 + i, f"t{i} ", -0.2)]])]) for i in range(6)]
    end = [Step(deltas=[TokenDelta(token_ids=[99], text="!", token_texts=["!"], logprobs=[-0.3],
                                   top_logprobs=[[TopLogprob(99, "!", -0.3)]], finish_reason="stop")],
                finished=True, prompt_tokens=4)]
    return reasoning + text + end


VIEWS = {"openai_chat": _openai_view, "openai_completions": _openai_view, "anthropic_messages": _anthropic_view,
         "openai_responses": _responses_view, "happy_vllm": _happy_vllm_view, "jobs": _jobs_view}


def _rendered(req: GenerationRequest, events: list[Event]) -> list[bytes]:
    return asyncio.run(frames(stream(req, "job", 1), events))


# Anthropic Messages and the Responses API have one choice only.
@pytest.mark.parametrize(("dialect", "n"), [(d, n) for d, merges in sorted(MERGES_STEPS.items()) if merges
                                            for n in ((1,) if d in ("anthropic_messages", "openai_responses")
                                                      else (1, 2))])
def test_a_merging_dialect_reads_the_same_from_merged_steps(dialect, n):
    assert set(VIEWS) == {d for d, merges in MERGES_STEPS.items() if merges}
    logprobs = None if dialect == "openai_completions" else 1  # completions with logprobs does not merge
    req = GenerationRequest(prompt="p", dialect=dialect, sampling=SamplingParams(n=n, logprobs=logprobs),
                            output=OutputOptions(include_usage=True))
    assert merges_steps(req)
    steps = _chat_steps() if n == 1 else two_choices(9)
    if dialect in ("openai_completions", "happy_vllm"):  # no reasoning there
        steps = [s for s in steps if not s.deltas[0].reasoning]
    separate, _ = run(steps, take_every=1)
    merged, _ = run(steps, take_every=4)
    assert len(merged) < len(separate)
    plain, joined = _rendered(req, separate), _rendered(req, merged)
    assert len(joined) < len(plain)
    assert VIEWS[dialect](joined) == VIEWS[dialect](plain)


# The pooling dialects stream nothing: their one event is the job's end (docs/pooling.md).
UNSTREAMED = ("openai_embeddings", "rerank", "vllm_score", "tei")


@pytest.mark.parametrize("dialect", sorted(d for d, merges in MERGES_STEPS.items()
                                           if not merges and d not in UNSTREAMED))
def test_a_per_token_dialect_would_render_merged_steps_otherwise(dialect):
    """Why these never merge: their stream has a line per token (or per step) with its own text or
    count, which a merged delta (several tokens, one joined text: no per-token texts without
    logprobs) renders otherwise."""
    req = GenerationRequest(prompt="p", dialect=dialect, output=OutputOptions(details=True))
    assert not merges_steps(req)
    steps = [Step(deltas=[TokenDelta(token_ids=[i], text=t)]) for i, t in enumerate(["a", "b", "", "c", "d"])]
    steps.append(Step(deltas=[TokenDelta(token_ids=[9], text=".", finish_reason="stop")], finished=True))
    separate, _ = run(steps, take_every=1)
    merged, _ = run(steps, take_every=len(steps))
    assert _rendered(req, merged) != _rendered(req, separate)


def test_completions_with_logprobs_do_not_merge():
    """``text_offset``: within a chunk from the per-token texts, across chunks from the text; a
    character split over tokens makes them differ, and a merged chunk moves the offsets."""
    req = GenerationRequest(prompt="p", dialect="openai_completions", sampling=SamplingParams(logprobs=0))
    assert not merges_steps(req)
    steps = [Step(deltas=[TokenDelta(token_ids=[i], text=t, token_texts=[tt], logprobs=[-0.5])])
             for i, (t, tt) in enumerate([("a", "a"), ("", "\ufffd"), ("\u00e9", "\ufffd"), ("b", "b")])]
    steps.append(Step(deltas=[TokenDelta(token_ids=[9], finish_reason="stop")], finished=True))
    separate, _ = run(steps, take_every=1)
    merged, _ = run(steps, take_every=len(steps))
    assert _openai_view(_rendered(req, merged)) != _openai_view(_rendered(req, separate))


# --- the worker: its outbox while the flusher has not taken it ------------------------------------


async def outbox_of(dialect: str, tokens: int) -> tuple[list, Attempt]:
    """A job run through a worker whose flusher never took its outbox (every step came while it
    was busy): the outbox as a flush would take it, and the attempt."""
    settings = load_settings({}, redis_url="redis://127.0.0.1:1/0", served_model_name="m")
    worker = Worker(settings, Consumer(Redis(), Keys("t")), ScriptedEngine(), worker_id="w")
    req = GenerationRequest(prompt="abc", dialect=dialect, sampling=SamplingParams(max_tokens=tokens))
    d = Delivery(entry_id=b"1-0", job_id="j", state="run", request=req, queued_at=1.0, attempt=1)
    worker._running["j"] = _Running(task=None, held=None)  # type: ignore[arg-type]  # what _generate reads
    attempt = Attempt(queued_at=1.0, started_at=2.0, whole_log=True)
    await worker._generate(d, req, attempt, None)
    return worker.outbox._take(), attempt  # as a flush takes it


@pytest.mark.parametrize("dialect", sorted(MERGES_STEPS))
async def test_a_worker_merges_only_where_the_dialect_renders_text_deltas(dialect):
    batch, attempt = await outbox_of(dialect, 9)
    # The bytes the outbox writes are the attempt's (its compact log's, its refills').
    assert [out.data for out in batch] == attempt.encoded
    assert [out.seq for out in batch] == list(range(1, len(batch) + 1))
    events = [decode_event(out.data) for out in batch]
    assert [t for e in events for d in e.deltas for t in d.token_ids] == [ord(c) for c in "abcabcabc"]
    # Merging: the first step alone, the next seven in one event, the last the Done; else one each.
    assert len(batch) == (3 if MERGES_STEPS[dialect] else 9), dialect
