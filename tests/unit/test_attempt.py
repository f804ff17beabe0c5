"""One attempt's engine steps turned into events, without Redis or a loop: the events and their
seqs, the Done with the last step's tokens, the usage, the first token's time (a fresh job only),
the prompt's ids on the first event, a continuation's starting seq, and an error's seq."""

from __future__ import annotations

import msgspec

from shared import eventlog
from shared.codec import encode
from shared.errors import DeadlineExceeded, GenerationFailed, JobCancelled
from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.result import ResultBuilder
from shared.schemas import PromptInfo, Usage
from workers.attempt import Attempt
from workers.protocol import Step


def step(*ids: int, text: str = "", finished: bool = False, finish_reason: str | None = None, **extra) -> Step:
    return Step(deltas=[TokenDelta(token_ids=list(ids), text=text, finish_reason=finish_reason)], finished=finished,
                **extra)


def at(ms: float):
    """A clock that reads ``ms`` (epoch ms)."""
    return lambda: ms


def fresh(**kwargs) -> Attempt:
    return Attempt(queued_at=100.0, started_at=110.0, whole_log=True, **kwargs)


def test_each_step_with_tokens_is_one_tokens_event_in_seq_order():
    a = fresh()
    first, second = a.on_step(step(5, text="a"), at(120.0)), a.on_step(step(6, 7, text="bc"), at(130.0))
    assert first.event == Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")])
    assert second.event == Tokens(seq=2, deltas=[TokenDelta(token_ids=[6, 7], text="bc")])
    assert (first.tokens, second.tokens) == (1, 2)
    assert first.result is None and first.log is None  # only an end carries those


def test_a_step_with_nothing_new_makes_no_event():
    a = fresh()
    assert a.on_step(Step(deltas=[TokenDelta()]), at(120.0)) is None
    assert a.on_step(Step(deltas=[]), at(121.0)) is None
    assert a.on_step(step(5, text="a"), at(122.0)).event.seq == 1  # no seq was spent


def test_a_step_that_only_carries_the_prompt_is_an_event():
    prompt = PromptInfo(token_ids=[1, 2], token_texts=["x", "y"])
    out = fresh().on_step(Step(deltas=[], prompt=prompt), at(120.0))
    assert out.event == Tokens(seq=1, deltas=[], prompt=prompt) and out.tokens == 0


def test_the_done_carries_the_last_steps_tokens_the_usage_and_the_result():
    a = fresh()
    a.on_step(step(5, text="a", prompt_tokens=3), at(120.0))
    out = a.on_step(step(6, text="b", finished=True, finish_reason="stop"), at(130.0))
    assert isinstance(out.event, Done) and out.event.seq == 2
    assert out.event.deltas == [TokenDelta(token_ids=[6], text="b", finish_reason="stop")]
    assert out.event.usage == Usage(prompt_tokens=3, completion_tokens=2) and out.tokens == 1
    assert (out.event.timings.queued_at, out.event.timings.started_at, out.event.timings.finished_at) == (
        100.0, 110.0, 130.0)
    [choice] = out.result.choices
    assert (choice.token_ids, choice.text, choice.finish_reason) == ([5, 6], "ab", "stop")
    assert out.result == a.result


def test_usage_counts_every_token_and_the_prompt_as_the_engine_reports_it():
    a = fresh()
    a.on_step(step(1, 2, 3, prompt_tokens=7), at(120.0))
    a.on_step(step(4), at(121.0))  # prompt_tokens 0 on later steps: the count stays
    assert a.usage == Usage(prompt_tokens=7, completion_tokens=4)


def test_the_first_token_time_is_set_once_and_only_on_a_fresh_job():
    a = fresh()
    assert a.on_step(Step(deltas=[], prompt=PromptInfo(token_ids=[1])), at(115.0)).first_token_at is None
    assert a.on_step(step(5, text="a"), at(120.0)).first_token_at == 120.0
    assert a.on_step(step(6, text="b"), at(130.0)).first_token_at is None
    assert a.timings.first_token_at == 120.0
    continued = fresh()
    continued.continues(4, ResultBuilder(), prompt_tokens=3, emitted=4)
    out = continued.on_step(step(9, text="z"), at(140.0))
    assert out.first_token_at is None and continued.timings.first_token_at is None  # the first attempt's


def test_the_prompts_ids_ride_the_first_event_only():
    a = fresh()
    out = a.on_step(step(5, text="a", prompt_token_ids=[1, 2, 3]), at(120.0))
    assert out.prompt_ids == [1, 2, 3]
    assert a.on_step(step(6, text="b", prompt_token_ids=[1, 2, 3]), at(121.0)).prompt_ids is None
    # Known from a step with no event yet: they wait for the first event.
    b = fresh()
    assert b.on_step(Step(deltas=[], prompt_token_ids=[4]), at(120.0)) is None
    assert b.on_step(step(5), at(121.0)).prompt_ids == [4]
    # Or from the prompt info, when the engine gave no separate ids.
    c = fresh()
    assert c.on_step(step(5, prompt=PromptInfo(token_ids=[8, 9])), at(120.0)).prompt_ids == [8, 9]


def test_a_continued_attempt_stores_no_prompt_ids_and_keeps_the_plans_prompt_count():
    a = fresh()
    a.continues(2, ResultBuilder(), prompt_tokens=5, emitted=2)
    out = a.on_step(step(7, text="c", prompt_token_ids=[1, 2, 3, 4, 5, 6, 7], prompt_tokens=7), at(120.0))
    assert out.prompt_ids is None
    assert a.usage == Usage(prompt_tokens=5, completion_tokens=3)


def test_a_continuation_goes_on_from_the_seq_the_earlier_attempts_reached():
    builder = ResultBuilder()
    earlier = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")]),
               Tokens(seq=2, deltas=[TokenDelta(token_ids=[6], text="b")])]
    for event in earlier:
        builder.add(event)
    a = Attempt(queued_at=100.0, started_at=110.0, seq=2)  # a continued job: not its whole log
    a.continues(2, builder, prompt_tokens=3, emitted=2)
    assert a.on_step(step(7, text="c"), at(120.0)).event.seq == 3
    done = a.on_step(step(8, text="d", finished=True, finish_reason="length"), at(130.0))
    assert done.event.seq == 4 and done.log is None  # the stream is kept: earlier events are not its own
    assert done.result.choices[0].token_ids == [5, 6, 7, 8]  # the whole job's, not this attempt's
    assert done.event.usage == Usage(prompt_tokens=3, completion_tokens=4)


def test_an_error_takes_the_next_seq_after_the_attempts_events():
    a = fresh()
    a.on_step(step(5, text="a"), at(120.0))
    a.on_step(step(6, text="b"), at(121.0))
    out = a.end(GenerationFailed("boom"))
    assert out.event == Error(seq=3, code=GenerationFailed.code, message="boom", status=GenerationFailed.status)
    assert isinstance(out.event.exception(), GenerationFailed)
    assert out.tokens == 0 and out.first_token_at is None and out.prompt_ids is None


def test_a_job_ended_before_it_ran_ends_after_what_was_logged():
    never_ran = Attempt(queued_at=100.0, started_at=110.0, seq=4)
    out = never_ran.end(JobCancelled("job was cancelled before it started"))
    assert out.event.seq == 5 and out.log is None and never_ran.usage == Usage()
    fresh_out = fresh().end(DeadlineExceeded("the request's deadline passed while it was queued"))
    assert fresh_out.event.seq == 1
    assert _expanded(fresh_out.log) == [fresh_out.event]


def test_an_ending_of_a_whole_log_is_the_compact_form_of_every_event_of_the_attempt():
    a = fresh()
    events: list[Event] = [a.on_step(step(5, text="a", prompt_token_ids=[1]), at(120.0)).event]
    done = a.on_step(step(6, text="b", finished=True, finish_reason="stop"), at(130.0))
    events.append(done.event)
    assert _expanded(done.log, encode(done.result)) == events
    assert [msgspec.json.decode(e, type=Event) for e in a.encoded] == events
    assert b"[" + b",".join(a.encoded) + b"]" == encode(events)  # each event encoded once, the same bytes


def _expanded(blob: bytes, result: bytes | None = None) -> list[Event]:
    return msgspec.json.decode(eventlog.expand(blob, result), type=list[Event])


def test_a_token_event_is_encoded_from_its_deltas_to_the_same_bytes_as_the_event():
    """The worker writes a token event without building it (workers/attempt.tokens_json); the API
    decodes those bytes as the event, so they must be exactly what encoding the event gives."""
    from shared.schemas import TopLogprob
    from workers.attempt import tokens_json

    cases = [
        [],
        [TokenDelta(token_ids=[5], text="a")],
        [TokenDelta(token_ids=[5, 6], text='"\\\n\u00e9\U0001F600', finish_reason="stop", stop_reason=7)],
        [TokenDelta(index=1, token_ids=[9], text="", token_texts=["x"], logprobs=[-0.5],
                    top_logprobs=[[TopLogprob(9, "x", -0.5)]]), TokenDelta(index=0, reasoning="r")],
    ]
    for seq, deltas in enumerate(cases, start=1):
        assert tokens_json(seq, deltas) == encode(Tokens(seq=seq, deltas=deltas))
        assert msgspec.json.decode(tokens_json(seq, deltas), type=Event) == Tokens(seq=seq, deltas=deltas)


def test_an_attempt_makes_no_event_object_for_a_token_but_its_emission_reads_as_one():
    a = fresh()
    out = a.on_step(step(5, text="a"), at(120.0))
    assert out.terminal is None and out.seq == 1
    assert out.data == encode(Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")]))
    assert out.event == Tokens(seq=1, deltas=[TokenDelta(token_ids=[5], text="a")])
