"""LMQL's LMTP (Language Model Transport Protocol) over WebSocket (``specs/lmtp-protocol.md``).

Every WebSocket text message is ``<VERB> <json>``. Clients send ``GENERATE``, ``SCORE`` and
``MODEL_INFO``; the server answers ``TOKEN [ {...} ]`` (one token per frame) and ``MSG [ {...} ]``
(replies and command errors). Many streams share one socket, told apart by ``stream_id``.
Work is in token ids end to end. This module is pure translation: the socket lives in
``api/routes/lmtp.py``.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Final

import msgspec
from msgspec import UNSET, Meta, UnsetType

from api.dialects import jobs
from api.dialects.stream import StreamRenderer
from shared import json_input
from shared.errors import GenerationFailed, InvalidRequest, ServiceError
from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.schemas import GenerationRequest, JobResult, OutputOptions, PromptInfo, SamplingParams, TopLogprob

__all__ = [
    "NAME",
    "Generate",
    "Score",
    "ModelInfo",
    "ModelInfoData",
    "Frame",
    "FrameError",
    "parse_frame",
    "decode_generate",
    "decode_score",
    "decode_model_info",
    "to_generation_request",
    "to_score_request",
    "TokenStream",
    "ScoreStream",
    "TokenFrames",
    "stream",
    "score_payloads",
    "TokenPayload",
    "ErrorPayload",
    "ModelInfoPayload",
    "ModelDescription",
    "Payload",
    "JobToken",
    "ErrorBody",
    "frame",
    "error_payload",
    "model_info_payload",
    "render_result",
    "error_body",
]

NAME: Final = "lmtp"

MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
MASK_BIAS = 100.0
"""LMQL masks with logit biases of +-100: an alternative whose bias is this much below the
sampled token's was ruled out by the mask."""


class Generate(msgspec.Struct, kw_only=True):
    """``GENERATE``: defaults are LMQL's server's (temperature 0, 32 tokens, top-1 logprobs).
    Unknown keys are ignored, as LMQL's server passes them on to the model unchecked."""

    stream_id: int
    prompt: Annotated[list[int], Meta(min_length=1)]
    model: str = ""
    max_tokens: Annotated[int, Meta(ge=1)] = 32
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 0.0
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 1
    logit_bias: dict[int, float] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: int | None = None


class Score(msgspec.Struct, kw_only=True):
    """``SCORE``: the logprob of each ``scored`` token given ``prompt`` and the scored tokens before it."""

    stream_id: int
    prompt: list[int]
    scored: Annotated[list[int], Meta(min_length=1)]
    model: str = ""


class ModelInfoData(msgspec.Struct, kw_only=True):
    """``MODEL_INFO``'s ``data``: only its model is read (any JSON value, taken as text)."""

    model: Any = None


class ModelInfo(msgspec.Struct, kw_only=True):
    """``MODEL_INFO``: the model is named at the top level and again in ``data``."""

    stream_id: Any = None
    model: str = ""
    data: ModelInfoData = msgspec.field(default_factory=ModelInfoData)

    def model_name(self) -> str:
        """The model asked for, or "" for the default."""
        return self.model or str(self.data.model or "")


class _Head(msgspec.Struct):
    """Only the stream id, read before the full payload so errors can name their stream."""

    stream_id: Any = None


class Frame(msgspec.Struct, frozen=True):
    verb: str
    stream_id: Any
    payload: str


class FrameError(Exception):
    """A message that cannot be dispatched at all: answered with a ``MSG`` error."""

    def __init__(self, message: str, stream_id: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.stream_id = stream_id


_head_decoder = msgspec.json.Decoder(_Head)
_generate_decoder = msgspec.json.Decoder(Generate)
_score_decoder = msgspec.json.Decoder(Score)
_info_decoder = msgspec.json.Decoder(ModelInfo)


def parse_frame(text: str) -> Frame:
    """Split ``<VERB> <json>`` on the first space; the JSON must be an object."""
    verb, _, payload = text.partition(" ")
    if not payload.strip():
        raise FrameError(f"malformed LMTP message: expected '<VERB> <json>', got {text[:80]!r}")
    try:
        head = json_input.decode(payload, _head_decoder)
    except msgspec.ValidationError as exc:  # (a subclass of DecodeError: first)
        if str(exc).startswith("Expected `object`"):
            raise FrameError(f"the payload of {verb} must be a JSON object") from None
        raise FrameError(f"invalid {verb} payload: {exc}") from None  # a number out of range
    except msgspec.DecodeError as exc:
        raise FrameError(f"malformed JSON in {verb} message: {exc}") from None
    return Frame(verb=verb, stream_id=head.stream_id, payload=payload)


def _decode(decoder: msgspec.json.Decoder, frame: Frame) -> Any:
    try:
        # parse_frame checked the text already (UTF-8, depth): only the fields remain to check.
        return decoder.decode(frame.payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"invalid {frame.verb} payload: {exc}") from None


def decode_generate(frame: Frame) -> Generate:
    return _decode(_generate_decoder, frame)


def decode_score(frame: Frame) -> Score:
    return _decode(_score_decoder, frame)


def decode_model_info(frame: Frame) -> ModelInfo:
    return _decode(_info_decoder, frame)


def has_mask(bias: dict[int, float]) -> bool:
    return any(abs(v) >= MASK_BIAS for v in bias.values())


def _logprobs_to_ask(cmd: Generate) -> int:
    """Top-k to ask the engine for. vLLM reports logprobs from before the logit bias, so masked
    tokens can rank high; with a mask and k > 1 ask for twice as many, to still have k after
    dropping the masked ones."""
    k = cmd.top_logprobs
    if k > 1 and has_mask(cmd.logit_bias or {}):
        return min(MAX_TOP_LOGPROBS, 2 * k)
    return k


def to_generation_request(cmd: Generate) -> GenerationRequest:
    sampling = SamplingParams(
        temperature=cmd.temperature,
        max_tokens=cmd.max_tokens,
        logprobs=_logprobs_to_ask(cmd),
        logit_bias=dict(cmd.logit_bias or {}),
        top_p=cmd.top_p,
        top_k=cmd.top_k,
        repetition_penalty=cmd.repetition_penalty,
        presence_penalty=cmd.presence_penalty,
        frequency_penalty=cmd.frequency_penalty,
        seed=cmd.seed,
    )
    return GenerationRequest(model=cmd.model, prompt_token_ids=list(cmd.prompt), sampling=sampling, dialect=NAME)


def to_score_request(cmd: Score) -> GenerationRequest:
    """Scoring is prompt logprobs: one forward pass over prompt + scored, one throwaway token."""
    return GenerationRequest(
        model=cmd.model,
        prompt_token_ids=[*cmd.prompt, *cmd.scored],
        sampling=SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
        output=OutputOptions(prompt_tokens=True),
        dialect=NAME,
    )


# --- server payloads: field order is the key order on the wire ------------------------------

class TokenPayload(msgspec.Struct, kw_only=True):
    """A TOKEN frame's payload: one token of a stream. SCORE payloads have no ``top_logprobs``."""

    token: int
    stream_id: int
    logprob: float
    finish_reason: str | None = None
    top_logprobs: dict[str, float] | UnsetType = UNSET
    """Token id (as text) to logprob, the sampled token first."""


class ErrorPayload(msgspec.Struct, kw_only=True):
    """As a TOKEN frame this fails the client's stream (LMTPStreamError); as MSG, a request."""

    stream_id: Any
    """Whatever the client sent (None when it could not be read)."""
    error: str


class ModelDescription(msgspec.Struct, kw_only=True):
    model: str
    model_type: str
    ready_workers: int
    max_model_len: int


class ModelInfoPayload(msgspec.Struct, kw_only=True):
    stream_id: Any
    model_info: ModelDescription


Payload = TokenPayload | ErrorPayload | ModelInfoPayload


class JobToken(msgspec.Struct, kw_only=True):
    """One token of an LMTP job seen through ``GET /v1/jobs/{id}`` (no stream, no alternatives);
    a scored token has no ``finish_reason``."""

    token: int
    logprob: float
    finish_reason: str | None | UnsetType = UNSET


class ErrorBody(msgspec.Struct):
    error: str


def _finish_reason(reason: str | None) -> str:
    """LMTP knows ``stop`` (EOS) and ``length``; vLLM's ``stop`` / ``abort`` end the stream too."""
    return "length" if reason == "length" else "stop"


class TokenStream:
    """A GENERATE stream's events -> TOKEN payloads, one per token, in order.

    The newest token is held back until the next event shows whether it is the last one:
    the final ``finish_reason`` must ride on the last token, and a job's final event may carry
    no new token.
    """

    def __init__(self, cmd: Generate) -> None:
        self.stream_id = cmd.stream_id
        self.k = cmd.top_logprobs
        self.bias = cmd.logit_bias or {}
        self.held: TokenPayload | None = None
        self.reason: str | None = None

    def feed(self, event: Event) -> list[TokenPayload]:
        """Payloads ready to send after ``event`` (``Error`` events are the caller's)."""
        match event:
            case Tokens():
                return self._take(event.deltas)
            case Done():
                out = self._take(event.deltas)
                if self.held is None:
                    raise GenerationFailed("the engine finished without generating a token")
                self.held.finish_reason = _finish_reason(self.reason)
                out.append(self.held)
                self.held = None
                return out
            case Error():
                return []

    def _take(self, deltas: list[TokenDelta]) -> list[TokenPayload]:
        """The payloads these deltas release: every new token but the newest, which is held."""
        out: list[TokenPayload] = []
        for delta in deltas:
            if delta.index != 0:
                continue
            self.reason = delta.finish_reason or self.reason
            for payload in self._tokens(delta):
                if self.held is not None:
                    out.append(self.held)
                self.held = payload
        return out

    def _tokens(self, delta: TokenDelta) -> list[TokenPayload]:
        payloads = []
        for i, token in enumerate(delta.token_ids):
            logprob = _number(delta.logprobs[i]) if delta.logprobs and i < len(delta.logprobs) else 0.0
            tops = delta.top_logprobs[i] if delta.top_logprobs and i < len(delta.top_logprobs) else []
            payloads.append(TokenPayload(token=token, stream_id=self.stream_id, logprob=logprob,
                                         top_logprobs=self._top(token, logprob, tops)))
        return payloads

    def _top(self, token: int, logprob: float, tops: list[TopLogprob]) -> dict[str, float]:
        """The sampled token first (as LMQL's server does), then the best k alternatives the mask
        allowed. LMQL files the best-scored entry as the top-1 edge and draws beam candidates from
        these, so a token the mask ruled out must not appear (vLLM's logprobs are pre-bias)."""
        floor = self.bias.get(token, 0.0) - MASK_BIAS
        allowed = [t for t in tops if self.bias.get(t.id, 0.0) > floor][: self.k]
        top = {str(token): logprob}
        for t in allowed:
            top.setdefault(str(t.id), _number(t.logprob))
        return top


class ScoreStream:
    """A SCORE stream's events -> one TOKEN payload per scored token, sent once the job is done."""

    def __init__(self, cmd: Score) -> None:
        self.stream_id = cmd.stream_id
        self.offset = len(cmd.prompt)
        self.scored = list(cmd.scored)
        self.prompt: PromptInfo | None = None

    def feed(self, event: Event) -> list[TokenPayload]:
        match event:
            case Tokens():
                self.prompt = event.prompt or self.prompt
                return []
            case Done():
                prompt = event.prompt or self.prompt
                return score_payloads(self.stream_id, self.offset, self.scored, prompt)
            case Error():
                return []


class TokenFrames(StreamRenderer[Payload]):
    """One GENERATE or SCORE stream as TOKEN payloads. Its errors are TOKEN error payloads too:
    LMQL's client only delivers TOKEN frames to a stream, so a MSG error would leave it waiting."""

    def __init__(self, stream_id: int, tokens: TokenStream | ScoreStream) -> None:
        self.stream_id, self.tokens = stream_id, tokens

    def step(self, event: Tokens | Done) -> list[Payload]:
        return list(self.tokens.feed(event))

    def fail(self, exc: ServiceError) -> list[Payload]:
        return [error_payload(self.stream_id, exc.message)]


def stream(req: GenerationRequest, job_id: str, created: int) -> StreamRenderer[bytes]:
    """LMTP streams only on its socket (:class:`TokenFrames`); a job of it followed over HTTP is
    read in llmq's own event shape."""
    return jobs.stream(req, job_id, created)


def score_payloads(stream_id: int, offset: int, scored: list[int], prompt: PromptInfo | None) -> list[TokenPayload]:
    """The scored slice of the prompt's logprobs. The very first prompt token has no logprob:
    0.0, as LMQL's server reports it."""
    if prompt is None or prompt.logprobs is None or prompt.token_ids[offset:] != scored:
        raise GenerationFailed("the engine did not report logprobs for the scored tokens")
    logprobs = prompt.logprobs[offset:]
    last = len(scored) - 1
    return [
        TokenPayload(token=token, stream_id=stream_id, logprob=_number(lp if lp is not None else 0.0),
                     finish_reason="stop" if i == last else None)
        for i, (token, lp) in enumerate(zip(scored, logprobs, strict=True))
    ]


def _number(value: float) -> float:
    """JSON has no infinities; LMQL's server would print ``-Infinity``. A very low finite
    logprob keeps every JSON parser happy and sorts the same."""
    return value if math.isfinite(value) else (-1e30 if value < 0 else 1e30)


def frame(verb: str, payload: Payload) -> str:
    """One server message, byte-compatible with LMQL's server: ``json.dumps([payload])``, whose
    spacing (``", "``, ``": "``) and float text differ from msgspec's compact encoding."""
    return f"{verb} {json.dumps([msgspec.to_builtins(payload)])}"


def error_payload(stream_id: Any, message: str) -> ErrorPayload:
    return ErrorPayload(stream_id=stream_id, error=message)


def model_info_payload(stream_id: Any, model: str, ready_workers: int, max_model_len: int) -> ModelInfoPayload:
    return ModelInfoPayload(
        stream_id=stream_id,
        model_info=ModelDescription(model=model, model_type="llmq", ready_workers=ready_workers,
                                    max_model_len=max_model_len),
    )


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> list[JobToken]:
    """An LMTP job seen through ``GET /v1/jobs/{id}``: its TOKEN payloads, without a stream id."""
    if req.output.prompt_tokens and result.prompt is not None and result.prompt.logprobs is not None:
        ids, lps = result.prompt.token_ids, result.prompt.logprobs
        return [JobToken(token=t, logprob=_number(lp if lp is not None else 0.0))
                for t, lp in zip(ids, lps, strict=True)]
    choice = result.choices[0] if result.choices else None
    if choice is None:
        return []
    logprobs = choice.logprobs or [0.0] * len(choice.token_ids)
    last = len(choice.token_ids) - 1
    return [
        JobToken(token=t, logprob=_number(lp),
                 finish_reason=_finish_reason(choice.finish_reason) if i == last else None)
        for i, (t, lp) in enumerate(zip(choice.token_ids, logprobs, strict=False))
    ]


def error_body(exc: ServiceError) -> tuple[int, ErrorBody]:
    """Only reached over HTTP (the upgrade itself, or a job view): LMTP's own error object."""
    return exc.status, ErrorBody(exc.message)
