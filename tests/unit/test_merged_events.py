"""An engine step joining its job's still-unsent event (Attempt.on_step's ``into``): the merged
events read back as the separate ones would (the result, each choice's tokens, texts, logprobs,
reasoning and tool-call arguments), with seqs 1..n and a compact log that expands to them; and a
step that would read back otherwise (reasoning after text, a finished choice, a prompt, logprobs on
one side only) makes an event of its own. Each merge has its control: the same steps unmerged."""

from __future__ import annotations

import dataclasses

import msgspec

from shared import eventlog
from shared.codec import encode
from shared.events import Done, Event, TokenDelta, Tokens, ToolCallDelta
from shared.result import ResultBuilder
from shared.schemas import PromptInfo, TopLogprob
from workers.attempt import Attempt, merge_tokens
from workers.protocol import Step


def clock() -> float:
    return 1000.0


def run(steps: list[Step], *, merge_every: int) -> list[Event]:
    """The attempt's events for ``steps``, the flusher taking the outbox after every
    ``merge_every`` steps (1: never merged, as when the flusher keeps up)."""
    a = Attempt(queued_at=1.0, started_at=2.0, whole_log=True)
    unsent: Tokens | None = None
    for i, s in enumerate(steps):
        if i % merge_every == 0:
            unsent = None  # the flusher took it
        fresh = dataclasses.replace(s, deltas=[msgspec.structs.replace(d) for d in s.deltas])  # as the engine's
        out = a.on_step(fresh, clock, unsent)
        if out is not None and isinstance(out.event, Tokens):
            unsent = out.event
    return a.events


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
        deltas = [TokenDelta(index=c, token_ids=[i * 10 + c], text=f"{c}{i}", token_texts=[f"{c}{i}"],
                             logprobs=[-0.5 * i], top_logprobs=[[TopLogprob(i, f"{i}", -0.5 * i)]],
                             finish_reason="length" if last else None) for c in (0, 1)]
        steps.append(Step(deltas=deltas, finished=last, prompt_tokens=3,
                          prompt=PromptInfo(token_ids=[1, 2, 3]) if i == 0 else None))
    return steps


def test_merged_events_of_n_choices_with_logprobs_read_back_as_the_separate_ones():
    steps = two_choices(9)
    separate, merged = run(steps, merge_every=1), run(steps, merge_every=4)
    assert len(merged) < len(separate)
    assert [e.seq for e in merged] == list(range(1, len(merged) + 1))
    assert choice_view(merged) == choice_view(separate)
    assert merged[0].prompt == separate[0].prompt  # the prompt's info rides the first event still

    def result(events):
        builder = ResultBuilder()
        for e in events:
            builder.add(e)
        return builder.result()

    assert result(merged) == result(separate)
    # The compact log a whole attempt leaves expands to its merged events, byte for byte.
    raw = encode(merged)
    assert eventlog.expand(eventlog.compact(raw, None), None) == raw


def test_reasoning_text_and_one_tool_calls_pieces_merge_in_order():
    steps = [Step(deltas=[TokenDelta(token_ids=[1], reasoning="think ")]),
             Step(deltas=[TokenDelta(token_ids=[2], reasoning="more")]),
             Step(deltas=[TokenDelta(token_ids=[3], text="Hi")]),
             Step(deltas=[TokenDelta(token_ids=[4], tool_calls=[ToolCallDelta(index=0, id="c1", name="f")])]),
             Step(deltas=[TokenDelta(token_ids=[5], tool_calls=[ToolCallDelta(index=0, arguments='{"a"')])]),
             Step(deltas=[TokenDelta(token_ids=[6], tool_calls=[ToolCallDelta(index=0, arguments=": 1}")])]),
             Step(deltas=[TokenDelta(token_ids=[7], finish_reason="tool_calls")], finished=True)]
    separate, merged = run(steps, merge_every=1), run(steps, merge_every=len(steps))
    assert choice_view(merged) == choice_view(separate)
    [tokens, done] = merged
    # One piece per call: its arguments as the separate pieces join.
    assert tokens.deltas[0].tool_calls == [ToolCallDelta(index=0, id="c1", name="f", arguments='{"a": 1}')]
    assert isinstance(done, Done) and done.seq == 2


def test_reasoning_after_text_is_an_event_of_its_own():
    """Every dialect renders a delta's reasoning before its text: merged, the later reasoning would
    come out before the earlier text."""
    into = Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="answer")])
    assert not merge_tokens(into, [TokenDelta(token_ids=[2], reasoning="afterthought")])
    assert into == Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], text="answer")])  # unchanged
    assert merge_tokens(into, [TokenDelta(token_ids=[2], text=" more")])  # the control


def test_a_finished_choice_or_logprobs_on_one_side_only_do_not_merge():
    ended = Tokens(seq=1, deltas=[TokenDelta(index=0, token_ids=[1], finish_reason="stop")])
    assert not merge_tokens(ended, [TokenDelta(index=0, token_ids=[2])])
    assert merge_tokens(ended, [TokenDelta(index=1, token_ids=[2])])  # another choice goes on
    with_logprobs = Tokens(seq=1, deltas=[TokenDelta(token_ids=[1], logprobs=[-1.0])])
    assert not merge_tokens(with_logprobs, [TokenDelta(token_ids=[2])])
    # A delta with no token of its own (a finish reason only) joins whatever the other carries.
    assert merge_tokens(with_logprobs, [TokenDelta(finish_reason="length")])
    assert with_logprobs.deltas == [TokenDelta(token_ids=[1], logprobs=[-1.0], finish_reason="length")]


def test_a_step_carrying_the_prompt_makes_its_own_event():
    a = Attempt(queued_at=1.0, started_at=2.0)
    first = a.on_step(Step(deltas=[TokenDelta(token_ids=[1], text="a")]), clock)
    second = a.on_step(Step(deltas=[], prompt=PromptInfo(token_ids=[9])), clock, first.event)
    assert not second.merged and second.event.seq == 2


def test_a_merge_reports_the_first_token_time_and_the_steps_tokens():
    a = Attempt(queued_at=1.0, started_at=2.0)
    prompt_only = a.on_step(Step(deltas=[], prompt=PromptInfo(token_ids=[9])), clock)
    assert prompt_only.first_token_at is None
    joined = a.on_step(Step(deltas=[TokenDelta(token_ids=[1, 2], text="ab")]), clock, prompt_only.event)
    assert joined.merged and joined.event is prompt_only.event and joined.tokens == 2
    assert joined.first_token_at == 1000.0  # the worker sets it on the unsent event's write
    assert a.seq == 1 and a.usage.completion_tokens == 2
