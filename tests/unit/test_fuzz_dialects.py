"""Property-based fuzzing of every dialect's request path (decode + translate), no I/O.

Each test runs the same steps the dialect's route runs before queueing: msgspec decode of the
body bytes, then the dialect's translator, then the pure part of ``admit`` (the max_tokens
ceiling). The property: either valid ``GenerationRequest``s come out, which survive the trip
through Redis (``job_to_hash`` -> ``job_from_hash``, and ``encode`` -> ``decode_request``, the
worker's read) unchanged, or a typed 4xx ``ServiceError`` is raised. Anything else would be a
500 (or a job the worker cannot read).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.body import decode
from api.dialects import happy_vllm as hv
from api.dialects import lmi, lmtp, tgi
from api.dialects import openai_chat as chat
from api.dialects import openai_completions as oc
from api.dialects import triton as tr
from api.routes.lmi import _keys_decoder
from api.submit import check_queueable
from shared import json_input
from shared.codec import decode_request, encode, job_from_hash, job_to_hash
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import ChatOptions, GenerationRequest, JobRecord, OutputOptions, SamplingParams
from tests.support.dialect_bodies import (
    chat_bodies,
    completion_bodies,
    happy_bodies,
    job_bodies,
    lmi_bodies,
    lmtp_frames,
    tgi_bodies,
    triton_bodies,
)
from tests.support.fuzzing import single_field_bodies

MAX_MODEL_LEN = 2048
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def admit(req: GenerationRequest) -> None:
    """The pure part of ``api.submit.admit``."""
    check_queueable(req)


class Violation(AssertionError):
    """A translated request that the worker could not read back: a 500 or a dead worker later."""


def check(translate) -> list[GenerationRequest]:
    """Run one request path; assert the property. Returns the requests (empty when refused)."""
    try:
        out = translate()
        reqs = out if isinstance(out, list) else [out]
        for req in reqs:
            admit(req)
    except ServiceError as exc:
        assert 400 <= exc.status < 500, f"{type(exc).__name__} ({exc.status}): {exc.message}"
        return []
    for req in reqs:
        assert isinstance(req, GenerationRequest)
        # What the worker reads back (shared.queue.Consumer.pick -> decode_request) must be what was queued.
        data = encode(req)
        try:
            back = decode_request(data)
        except msgspec.ValidationError as exc:
            raise Violation(f"the worker cannot decode the queued request ({exc}): {data!r}") from None
        assert back == req, f"the request changed on its way through the queue: {data!r}"
        record = JobRecord(id="j", model=req.model or "tiny", request=req)
        raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in job_to_hash(record).items()}
        assert job_from_hash(raw).request == req
    return reqs


# --- OpenAI completions (also /invocations with `prompt`) -------------------------------------

@FUZZ
@given(completion_bodies)
def test_completions_path(body: bytes) -> None:
    check(lambda: oc.to_generation_requests(decode(oc.CompletionRequest, body)))


# --- OpenAI chat (also /invocations with `messages`) ------------------------------------------

@FUZZ
@given(chat_bodies)
def test_chat_path(body: bytes) -> None:
    check(lambda: chat.to_generation_request(decode(chat.ChatRequest, body), max_model_len=MAX_MODEL_LEN))


# --- LMI: /invocations dispatch, rolling batch, dynamic batch, TGI compat ---------------------

def lmi_path(body: bytes, tgi_compat: bool) -> list[GenerationRequest]:
    """``/invocations``: the key sniffing first, then the schema it picks."""
    try:
        keys = json_input.decode(body, _keys_decoder)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Malformed JSON body: {exc}") from None
    if not keys.inputs and keys.prompt:
        return oc.to_generation_requests(decode(oc.CompletionRequest, body))
    if not keys.inputs and keys.messages:
        return [chat.to_generation_request(decode(chat.ChatRequest, body), max_model_len=MAX_MODEL_LEN)]
    return lmi.to_generation_requests(decode(lmi.LmiRequest, body), model="", tgi_compat=tgi_compat)


@FUZZ
@given(lmi_bodies, st.booleans())
def test_lmi_path(body: bytes, tgi_compat: bool) -> None:
    check(lambda: lmi_path(body, tgi_compat))


# --- TGI: /generate, /generate_stream, / ------------------------------------------------------

@FUZZ
@given(tgi_bodies, st.booleans(), st.booleans())
def test_tgi_path(body: bytes, stream: bool, compat: bool) -> None:
    def path() -> GenerationRequest:
        parsed = decode(tgi.GenerateRequest, body)
        return tgi.to_generation_request(parsed, stream=stream, max_total_tokens=MAX_MODEL_LEN, compat=compat)

    for req in check(path):
        # The route's `truncate` swaps the prompt for (the tail of) its token ids.
        check(lambda req=req: tgi.with_prompt_ids(req, [1, 2, 3]))


# --- Triton: /v2/models/{model}/generate[_stream] ---------------------------------------------

def triton_path(body: bytes) -> GenerationRequest:
    return tr.to_generation_request(tr.read_body(decode(tr.RawBody, body)), "tiny")[0]


@FUZZ
@given(triton_bodies)
def test_triton_path(body: bytes) -> None:
    check(lambda: triton_path(body))


# --- happy_vllm: /v1/generate, /v1/generate_stream --------------------------------------------

@FUZZ
@given(happy_bodies, st.booleans())
def test_happy_vllm_path(body: bytes, stream: bool) -> None:
    check(lambda: hv.to_generation_request(hv.read_body(decode(hv.RawBody, body)), stream=stream))


# --- LMTP: WebSocket text frames --------------------------------------------------------------

def lmtp_path(text: str) -> list[GenerationRequest]:
    """``api.routes.lmtp.Session``: parse, check the stream id, decode the verb's payload."""
    try:
        frame = lmtp.parse_frame(text)
    except lmtp.FrameError:
        return []  # answered with a MSG error frame
    if frame.verb == "MODEL_INFO":
        lmtp.decode_model_info(frame)
        return []
    if frame.verb not in ("GENERATE", "SCORE"):
        return []
    if not isinstance(frame.stream_id, int) or isinstance(frame.stream_id, bool):
        return []  # answered with a MSG error frame
    if frame.verb == "GENERATE":
        return [lmtp.to_generation_request(lmtp.decode_generate(frame))]
    return [lmtp.to_score_request(lmtp.decode_score(frame))]


@FUZZ
@given(lmtp_frames)
def test_lmtp_frames(text: str) -> None:
    check(lambda: lmtp_path(text))


# --- llmq's own jobs: POST /v1/jobs -----------------------------------------------------------

@FUZZ
@given(job_bodies)
def test_jobs_path(body: bytes) -> None:
    check(lambda: decode(GenerationRequest, body))


# --- every field of every dialect, one at a time, with every edge value ----------------------

_sp = list(hv.VllmSampling.__struct_fields__)


def _fields(cls: type, prefix: str = "") -> list[str]:
    return [prefix + name for name in cls.__struct_fields__]


SWEEPS: dict[str, tuple[dict[str, Any], list[str], Any]] = {
    "openai_completions": (
        {"prompt": "ab", "max_tokens": 3},
        [*_fields(oc.CompletionRequest), "stream_options.include_usage", "structured_outputs.json",
         "structured_outputs.choice", "response_format.type", "response_format.json_schema"],
        lambda b: oc.to_generation_requests(decode(oc.CompletionRequest, b)),
    ),
    "openai_chat": (
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        [*_fields(chat.ChatRequest), "structured_outputs.json", "response_format.json_schema",
         "stream_options.include_usage"],
        lambda b: chat.to_generation_request(decode(chat.ChatRequest, b), max_model_len=MAX_MODEL_LEN),
    ),
    "lmi": (
        {"inputs": "ab", "parameters": {"max_new_tokens": 3}},
        ["inputs", "stream", *_fields(lmi.LmiParameters, "parameters."), "parameters.structured_outputs.json"],
        lambda b: lmi_path(b, False) + lmi_path(b, True),
    ),
    "tgi": (
        {"inputs": "ab", "parameters": {"max_new_tokens": 3}},
        ["inputs", "stream", *_fields(tgi.GenerateParameters, "parameters."), "parameters.grammar.value"],
        lambda b: [tgi.to_generation_request(decode(tgi.GenerateRequest, b), stream=s, max_total_tokens=MAX_MODEL_LEN)
                   for s in (False, True)],
    ),
    "triton": (
        {"text_input": "ab", "max_tokens": 3},
        [*_fields(tr._Inputs), "id", "parameters", "structured_outputs", *_sp, *("parameters." + f for f in _sp)],
        triton_path,
    ),
    "happy_vllm": (
        {"prompt": "ab", "max_tokens": 3},
        [*_fields(hv.HappyOptions), *_sp, "logits_processors"],
        lambda b: hv.to_generation_request(hv.read_body(decode(hv.RawBody, b)), stream=False),
    ),
    "lmtp_generate": (
        {"stream_id": 1, "prompt": [1, 2], "max_tokens": 3},
        _fields(lmtp.Generate),
        lambda b: lmtp_path("GENERATE " + b.decode("utf-8", "replace")),
    ),
    "lmtp_score": (
        {"stream_id": 1, "prompt": [1, 2], "scored": [3]},
        _fields(lmtp.Score),
        lambda b: lmtp_path("SCORE " + b.decode("utf-8", "replace")),
    ),
    "jobs": (
        {"prompt": "ab", "sampling": {"max_tokens": 3}},
        [*_fields(GenerationRequest), *_fields(SamplingParams, "sampling."), *_fields(OutputOptions, "output."),
         *_fields(ChatOptions, "chat.")],
        lambda b: decode(GenerationRequest, b),
    ),
}


@pytest.mark.parametrize("dialect", list(SWEEPS))
def test_single_field_sweep(dialect: str) -> None:
    """Each field of a valid body set to each edge value (FIELD_VALUES): deterministic, and it
    reaches every translator branch that one bad field can reach."""
    base, paths, path_fn = SWEEPS[dialect]
    failures = []
    for path, value, body in single_field_bodies(base, paths):
        try:
            check(lambda body=body: path_fn(body))
        except AssertionError as exc:
            failures.append(f"{path}={value!r:.40}: {exc}")
    if failures:
        raise Violation(f"{len(failures)} bodies broke the property, e.g.:\n" + "\n".join(failures[:10]))
