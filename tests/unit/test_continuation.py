"""Crash continuation's pure parts: what each choice published, how each unfinished choice
continues (prompt extension or forced replay), what a replay drops, how parts merge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from shared.errors import WorkerLost
from shared.events import TokenDelta, Tokens
from shared.schemas import (
    ChatMessage,
    GenerationRequest,
    Image,
    OutputOptions,
    SamplingParams,
    StructuredOutput,
    Text,
)
from workers.continuation import Replay, needs_replay, plan_continuation, published, run_parts
from workers.protocol import Part, Published, Step

PROMPT_IDS = [1, 2, 3]


def event(seq: int, *deltas: TokenDelta) -> Tokens:
    return Tokens(seq=seq, deltas=list(deltas))


def d(index: int, ids: list[int], text: str, finish: str | None = None, logprobs: bool = False) -> TokenDelta:
    delta = TokenDelta(index=index, token_ids=ids, text=text, finish_reason=finish)
    if logprobs:
        delta.logprobs = [-float(t) for t in ids]
        delta.token_texts = [f"<{t}>" for t in ids]
    return delta


def test_published_collects_each_choice_tokens_text_and_finish():
    prior = [event(1, d(0, [10, 11], "ab"), d(2, [30], "x")),
             event(2, d(1, [20], "p", finish="stop"), d(0, [12], "c")),
             event(3, d(2, [31], ""))]
    choices = published(prior)
    assert sorted(choices) == [0, 1, 2]
    assert (choices[0].token_ids, choices[0].text, choices[0].finished) == ([10, 11, 12], "abc", False)
    assert (choices[1].token_ids, choices[1].text, choices[1].finished) == ([20], "p", True)
    assert (choices[2].token_ids, choices[2].text, choices[2].finished) == ([30, 31], "x", False)


@pytest.mark.parametrize(("sampling", "replay"), [
    ({"temperature": 0.0}, False),
    ({"temperature": 1.0}, False),  # unseeded: any continuation is a sample of the same distribution
    ({"temperature": 0.0, "seed": 3}, False),  # greedy: the seed draws nothing that matters
    ({"repetition_penalty": 1.3}, False),  # counts prompt and output alike
    ({"temperature": 0.7, "seed": 3}, True),
    ({"stop": ["END"]}, True),
    ({"presence_penalty": 0.5}, True),
    ({"frequency_penalty": -0.5}, True),
    ({"structured": StructuredOutput(choice=["a", "b"])}, True),
])
def test_replay_is_needed_exactly_when_the_output_tokens_matter(sampling, replay):
    assert needs_replay(GenerationRequest(prompt="a", sampling=SamplingParams(**sampling))) is replay


def test_greedy_plain_single_choice_keeps_the_one_prefill_prompt_extension():
    req = GenerationRequest(prompt="abc", sampling=SamplingParams(max_tokens=10, temperature=0))
    plan = plan_continuation(req, [event(1, d(0, [5, 6], "xy"))], PROMPT_IDS)
    assert plan.parts is None
    assert plan.request.prompt_token_ids == [1, 2, 3, 5, 6] and plan.request.sampling.max_tokens == 8


def test_structured_output_continues_by_replaying_from_the_original_prompt():
    schema = {"type": "object"}
    req = GenerationRequest(
        prompt="abc", output=OutputOptions(prompt_tokens=True),
        sampling=SamplingParams(max_tokens=50, min_tokens=5, temperature=0, prompt_logprobs=1,
                                structured=StructuredOutput(json=schema)))
    plan = plan_continuation(req, [event(1, d(0, [5, 6], "{\"")), event(2, d(0, [7], "a"))], PROMPT_IDS)
    assert plan.request is req and plan.seq == 2 and plan.emitted == 3 and plan.prompt_tokens == 3
    (part,) = plan.parts
    assert (part.index, part.replay, part.held.text) == (0, (5, 6, 7), "{\"a")
    r = part.request
    # The original prompt and budget: the replayed tokens count as output, as in the first run.
    assert r.prompt is None and r.messages is None and r.prompt_token_ids == PROMPT_IDS
    assert r.sampling.max_tokens == 50 and r.sampling.min_tokens == 5 and r.sampling.structured.json == schema
    # Prompt tokens and their logprobs went out with the first event already.
    assert r.sampling.prompt_logprobs is None and not r.output.prompt_tokens


def test_several_choices_continue_each_from_its_own_tokens_and_finished_ones_are_not_rerun():
    req = GenerationRequest(prompt="abc", sampling=SamplingParams(n=4, max_tokens=10, min_tokens=2))
    prior = [event(1, d(0, [10, 11], "ab"), d(1, [20], "p"), d(3, [40], "z")),
             event(2, d(1, [21], "q", finish="stop"), d(0, [12], "c"))]
    plan = plan_continuation(req, prior, PROMPT_IDS)
    assert plan.emitted == 6
    assert [p.index for p in plan.parts] == [0, 2, 3], "choice 1 finished: not run again"
    by_index = {p.index: p.request for p in plan.parts}
    assert all(p.replay == () for p in plan.parts), "plain unseeded sampling: prompt extension"
    assert all(r.sampling.n == 1 for r in by_index.values())
    assert by_index[0].prompt_token_ids == [1, 2, 3, 10, 11, 12] and by_index[0].sampling.max_tokens == 7
    assert by_index[0].sampling.min_tokens == 0
    assert by_index[2].prompt_token_ids == PROMPT_IDS and by_index[2].sampling.max_tokens == 10
    assert by_index[2].sampling.min_tokens == 2, "a choice with nothing out yet starts afresh"
    assert by_index[3].prompt_token_ids == [1, 2, 3, 40] and by_index[3].sampling.max_tokens == 9
    # The result so far holds every published choice, the finished one included.
    assert [(c.index, c.text) for c in plan.builder.result().choices] == [(0, "abc"), (1, "pq"), (3, "z")]


def test_seeded_choices_replay_with_the_seed_vllm_gives_each_child():
    req = GenerationRequest(prompt="abc", sampling=SamplingParams(n=3, seed=10, temperature=0.8, max_tokens=10))
    prior = [event(1, d(0, [10], "a"), d(1, [20], "b"), d(2, [30], "c"))]
    plan = plan_continuation(req, prior, PROMPT_IDS)
    assert [(p.index, p.request.sampling.seed, p.replay) for p in plan.parts] == [
        (0, 10, (10,)), (1, 11, (20,)), (2, 12, (30,))]
    single = msgspec.structs.replace(req, sampling=msgspec.structs.replace(req.sampling, n=1))
    assert plan_continuation(single, [event(1, d(0, [10], "a"))], PROMPT_IDS).parts[0].request.sampling.seed == 10


def test_a_job_that_published_no_token_starts_afresh_and_one_without_prompt_ids_fails():
    req = GenerationRequest(prompt="abc", sampling=SamplingParams(n=2, structured=StructuredOutput(regex="a+")))
    assert plan_continuation(req, [], None).request is req and plan_continuation(req, [], None).parts is None
    with pytest.raises(WorkerLost):
        plan_continuation(req, [event(1, d(1, [5], "a"))], None)


# --- what a replay drops ----------------------------------------------------------------------

def test_replay_splits_a_delta_that_straddles_the_published_tokens():
    replay = Replay(Published(token_ids=[5, 6, 7], text="xyz"))
    assert replay.trim(d(0, [5, 6], "xy", logprobs=True)) is None
    kept = replay.trim(d(0, [7, 8, 9], "zuv", logprobs=True))
    assert (kept.token_ids, kept.text, kept.logprobs, kept.token_texts) == ([8, 9], "uv", [-8.0, -9.0], ["<8>", "<9>"])
    after = d(0, [10], "w")
    assert replay.trim(after) is after, "past the replay, deltas pass untouched"


def test_replay_counts_text_cumulatively_across_a_held_back_partial_character():
    """Token 3 is the first byte of 'é': the detokeniser held it back, so the client holds "ab"
    for three tokens. The replay's first new delta carries the whole character with token 4, as
    the uninterrupted run's did."""
    replay = Replay(Published(token_ids=[1, 2, 3], text="ab"))
    assert [replay.trim(d(0, [t], s)) for t, s in ((1, "a"), (2, "b"), (3, ""))] == [None, None, None]
    kept = replay.trim(d(0, [4], "é"))
    assert (kept.token_ids, kept.text) == ([4], "é")


def test_replay_releases_text_held_back_for_a_stop_string_with_the_next_token():
    """With stop strings vLLM holds back the tail of the text: five tokens out, "abc" sent. The
    sixth token's delta releases the held "de" plus its own "f"; all of it is new to the client."""
    replay = Replay(Published(token_ids=[1, 2, 3, 4, 5], text="abc"))
    assert replay.trim(d(0, [1, 2, 3, 4, 5], "abc")) is None
    kept = replay.trim(d(0, [6], "def"))
    assert (kept.token_ids, kept.text) == ([6], "def")


def test_replay_text_arriving_with_later_tokens_is_cut_at_the_published_length():
    replay = Replay(Published(token_ids=[1, 2], text="ab"))
    assert replay.trim(d(0, [1], "")) is None  # all text held back so far
    kept = replay.trim(d(0, [2, 3], "abc", finish="length"))
    assert (kept.token_ids, kept.text, kept.finish_reason) == ([3], "c", "length")


@pytest.mark.parametrize("delta", [
    d(0, [5, 9], "xy"),  # another token than the one published
    d(0, [5, 6], "xQ"),  # another text
    d(0, [5, 6], "xy", finish="stop"),  # ended inside the replay
])
def test_a_replay_that_diverges_from_what_was_sent_fails_instead_of_corrupting_the_stream(delta):
    with pytest.raises(WorkerLost):
        Replay(Published(token_ids=[5, 6, 7], text="xyz")).trim(delta)


# --- merging parts ----------------------------------------------------------------------------

def fake_run(outputs: dict[int, list[tuple[list[int], str]]], delays: dict[int, float], fail: int | None = None):
    """One engine request per part: its steps at index 0, the last one finished."""
    cancelled: list[int] = []

    async def run(part: Part) -> AsyncIterator[Step]:
        steps = outputs[part.index]
        try:
            for i, (ids, text) in enumerate(steps):
                await asyncio.sleep(delays[part.index])
                if part.index == fail and i == 1:
                    raise WorkerLost("scripted")
                last = i == len(steps) - 1
                yield Step([d(0, ids, text, finish="length" if last else None)], finished=last)
        except asyncio.CancelledError:
            cancelled.append(part.index)
            raise
    return run, cancelled


async def test_parts_merge_under_their_choice_indices_with_replays_dropped_and_one_final_step():
    req = GenerationRequest(prompt="p")
    parts = [Part(0, req, replay=(1, 2), held=Published(token_ids=[1, 2], text="ab")), Part(2, req)]
    outputs = {0: [([1], "a"), ([2, 3], "bc"), ([4], "d")], 2: [([7], "x"), ([8], "y")]}
    run, _ = fake_run(outputs, {0: 0.001, 2: 0.003})
    steps = [s async for s in run_parts(parts, run)]
    by_index: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    for s in steps:
        assert s.deltas, "steps left empty by the replay are not yielded"
        for delta in s.deltas:
            by_index.setdefault(delta.index, []).extend(delta.token_ids)
            texts[delta.index] = texts.get(delta.index, "") + delta.text
    assert by_index == {0: [3, 4], 2: [7, 8]} and texts == {0: "cd", 2: "xy"}
    assert [s.finished for s in steps] == [False] * (len(steps) - 1) + [True]
    finishes = [(x.index, x.finish_reason) for s in steps for x in s.deltas if x.finish_reason]
    assert sorted(finishes) == [(0, "length"), (2, "length")], "each choice's finish reaches the client"


async def test_a_failing_part_fails_the_job_and_stops_the_others():
    req = GenerationRequest(prompt="p")
    outputs = {0: [([1], "a")] * 50, 1: [([2], "b")] * 3}
    run, cancelled = fake_run(outputs, {0: 0.01, 1: 0.001}, fail=1)
    with pytest.raises(WorkerLost):
        async for _ in run_parts([Part(0, req), Part(1, req)], run):
            pass
    assert cancelled == [0]


def test_a_chat_with_images_continues_by_replay_from_its_messages_not_its_expanded_ids():
    """The engine's processor expands each image from its placeholder: a continuation renders the
    chat (and reads the images) again, never the recorded ids, where every image is expanded."""
    image = Image(sha256="ab" * 32, format="png", width=64, height=48, tokens=23)
    messages = [ChatMessage(role="user", parts=[Text(text="what is this?"), image])]
    req = GenerationRequest(messages=messages, sampling=SamplingParams(max_tokens=10, temperature=0))
    assert needs_replay(req) and not needs_replay(msgspec.structs.replace(req, messages=[ChatMessage(
        role="user", content="what is this?")]))
    plan = plan_continuation(req, [event(1, d(0, [5, 6], "xy"))], PROMPT_IDS)
    (part,) = plan.parts
    assert part.replay == (5, 6) and part.request.messages == messages and part.request.prompt_token_ids is None
    assert part.request.images == [image] and part.request.sampling.max_tokens == 10
