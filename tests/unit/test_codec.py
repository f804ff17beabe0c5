from __future__ import annotations

from shared.codec import decode_event, encode, job_from_hash, job_to_hash
from shared.events import Done, Error, Timings, TokenDelta, Tokens
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, JobError, JobRecord, JobResult, SamplingParams, TopLogprob, Usage


def test_events_round_trip_as_tagged_json():
    events = [
        Tokens(seq=1, deltas=[TokenDelta(token_ids=[5, 6], text="ab", logprobs=[-0.1, -0.2],
                                         top_logprobs=[[TopLogprob(5, "a", -0.1)], [TopLogprob(6, "b", -0.2)]])]),
        Done(seq=2, deltas=[TokenDelta(token_ids=[7], text="c", finish_reason="stop", stop_reason="c")],
             usage=Usage(prompt_tokens=3, completion_tokens=3), timings=Timings(queued_at=1.5)),
        Error(seq=3, code="boom", message="it broke", status=503),
    ]
    for event in events:
        assert decode_event(encode(event)) == event
    assert encode(events[2]) == b'{"type":"error","seq":3,"code":"boom","message":"it broke","status":503}'


def test_job_record_round_trips_through_a_redis_hash():
    record = JobRecord(
        id="j1", model="m", status="done", request=GenerationRequest(prompt="hi", sampling=SamplingParams(n=2)),
        queued_at=1000.5, started_at=1001.0, worker="w", attempt=2, cancel=True,
        result=JobResult(usage=Usage(prompt_tokens=1)), error=JobError(code="x", message="y"),
    )
    fields = job_to_hash(record)
    assert fields["status"] == "done" and fields["cancel"] == "1" and fields["attempt"] == "2"
    assert "first_token_at" not in fields  # None is omitted
    raw = {k.encode(): (v if isinstance(v, bytes) else v.encode()) for k, v in fields.items()}
    assert job_from_hash(raw) == record


def test_a_queued_record_stores_no_default_a_reader_would_assume():
    """A finished job keeps its record for LLMQ_RESULT_TTL_S: a dialect that spells out every
    sampling default (as the OpenAI ones do) stores no more than one that leaves them unset."""
    spelled = SamplingParams(temperature=float("1.0"), top_p=float("1.0"), min_p=float("0"), max_tokens=64,
                             presence_penalty=float("0"), repetition_penalty=float("1"), ignore_eos=True)
    record = JobRecord(id="j1", model="m", request=GenerationRequest(prompt="hi", sampling=spelled), queued_at=1.5)
    fields = job_to_hash(record)
    assert fields["request"] == b'{"prompt":"hi","chat":{},"sampling":{"max_tokens":64,"ignore_eos":true},"output":{}}'
    assert set(fields) == {"id", "model", "status", "request", "queued_at", "tenant", "estimate"}
    raw = {k.encode(): (v if isinstance(v, bytes) else v.encode()) for k, v in fields.items()}
    assert job_from_hash(raw) == record  # what was left out reads back as its default


def test_result_builder_joins_deltas_per_choice_and_takes_finish_from_the_last():
    builder = ResultBuilder()
    builder.add(Tokens(seq=1, deltas=[TokenDelta(index=0, token_ids=[1], text="a"),
                                      TokenDelta(index=1, token_ids=[2], text="x")]))
    builder.add(Tokens(seq=2, deltas=[TokenDelta(index=1, token_ids=[3], text="y", finish_reason="length")]))
    builder.add(Done(seq=3, deltas=[TokenDelta(index=0, token_ids=[4], text="b", finish_reason="stop")],
                     usage=Usage(prompt_tokens=2, completion_tokens=4)))
    result = builder.result()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in result.choices] == [
        (0, "ab", [1, 4], "stop"), (1, "xy", [2, 3], "length")]
    assert result.usage.completion_tokens == 4
