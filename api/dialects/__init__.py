"""One translator module per wire dialect: its Structs, its mapping to GenerationRequest, and its
renderers for results, streams and errors. None of them touches Redis or Litestar, and none
imports anything from api/ outside this package.

Each module (and LMI's two other shapes) is a :class:`Dialect`, found by its ``DialectName``; a
name with no dialect is a KeyError, never a silent fallback (``GenerationRequest.dialect`` is that
Literal, so no request can carry another). A dialect's stream is a
:class:`api.dialects.stream.StreamRenderer`, which :func:`api.dialects.stream.drive` feeds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from api.dialects import (
    anthropic_messages,
    happy_vllm,
    jobs,
    lmi,
    lmtp,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_responses,
    rerank,
    tei,
    tgi,
    triton,
    vllm_score,
)
from api.dialects.lmi_render import render_batch_result
from api.dialects.stream import StreamRenderer
from shared.errors import ServiceError
from shared.schemas import DialectName, GenerationRequest, JobResult

Body = msgspec.Struct | Sequence[msgspec.Struct]
"""A response body: a wire object, or a list of them (TGI's ``POST /``, LMTP's tokens)."""

__all__ = ["Dialect", "Body", "render_result", "render_group_result", "stream", "error_body"]


class Dialect(Protocol):
    """What the API needs from every dialect besides its routes: a job's result, its stream and
    any error, in its shape, from the stored request alone (a route whose wire request has
    options the stored one lacks builds its renderer itself)."""

    @property
    def NAME(self) -> str: ...  # read-only: a module's constant, or a frozen Shape's field

    def render_result(self, req: GenerationRequest, result: JobResult, job_id: str, created: int) -> Body: ...

    def stream(self, req: GenerationRequest, job_id: str, created: int) -> StreamRenderer[bytes]: ...

    def error_body(self, exc: ServiceError) -> tuple[int, msgspec.Struct]: ...


_ALL: tuple[Dialect, ...] = (jobs, lmi, lmi.TGI_COMPAT, lmi.DYNAMIC_BATCH, openai_completions, openai_chat, tgi, triton,
                             happy_vllm, lmtp, anthropic_messages, openai_responses,
                             openai_embeddings, rerank, vllm_score, tei)
_DIALECTS: dict[str, Dialect] = {d.NAME: d for d in _ALL}


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> Body:
    """A finished job's result in the shape of the dialect that submitted it."""
    return _DIALECTS[req.dialect].render_result(req, result, job_id, created)


def render_group_result(reqs: list[GenerationRequest], results: list[JobResult], group_id: str, created: int
                        ) -> Body:
    """The finished jobs of one request that fanned out (a list of prompts, LMI's dynamic batch),
    as that request would have been answered: only these two dialects queue several jobs."""
    if reqs[0].dialect == lmi.DYNAMIC_BATCH.NAME:
        return render_batch_result(results)
    return openai_completions.render_results(reqs, results, group_id, created)


def stream(req: GenerationRequest, job_id: str, created: int) -> StreamRenderer[bytes]:
    """A job's stream in the shape of the dialect that submitted it."""
    return _DIALECTS[req.dialect].stream(req, job_id, created)


def error_body(dialect: DialectName, exc: ServiceError) -> tuple[int, msgspec.Struct]:
    return _DIALECTS[dialect].error_body(exc)
