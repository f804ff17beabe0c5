"""One translator module per wire dialect: its Structs, its mapping to GenerationRequest, and its
renderers for results, streams and errors. None of them touches Redis or Litestar."""

from __future__ import annotations

from typing import Any

from api.dialects import happy_vllm, jobs, lmi, lmtp, openai_chat, openai_completions, tgi, triton
from api.dialects.lmi_render import render_batch_result
from shared.errors import ServiceError
from shared.schemas import GenerationRequest, JobResult

__all__ = ["render_result", "render_group_result", "error_body"]

_MODULES = {
    m.NAME: m
    for m in (jobs, lmi, lmi.TGI_COMPAT, lmi.DYNAMIC_BATCH, openai_completions, openai_chat, tgi, triton, happy_vllm,
              lmtp)
}


def render_result(req: GenerationRequest, result: JobResult, job_id: str, created: int) -> Any:
    """A finished job's result in the shape of the dialect that submitted it."""
    return _MODULES.get(req.dialect, jobs).render_result(req, result, job_id, created)


def render_group_result(reqs: list[GenerationRequest], results: list[JobResult], group_id: str, created: int) -> Any:
    """The finished jobs of one request that fanned out (a list of prompts, LMI's dynamic batch),
    as that request would have been answered: only these two dialects queue several jobs."""
    if reqs[0].dialect == lmi.DYNAMIC_BATCH.NAME:
        return render_batch_result(results)
    return openai_completions.render_results(reqs, results, group_id, created)


def error_body(dialect: str, exc: ServiceError) -> tuple[int, Any]:
    return _MODULES.get(dialect, jobs).error_body(exc)
