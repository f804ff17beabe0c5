"""A batch's output and error files, rendered from the outcomes housekeeping gathered.

Housekeeping (workers/housekeeping/batches.py) speaks no wire dialect: it leaves each produced file as its
lines' outcomes (shared/batches.py). The first time the API reads such a file (its object, a
listing, its content) it renders every line here, in the shape OpenAI's Batch API gives it,
with the response body the endpoint itself would have answered, then stores the bytes and their
size in place of the outcomes. Every later read serves the stored bytes. Rendering is
deterministic, so two API processes that render the same file at once store the same bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from api.dialects import anthropic_batches, openai_chat, openai_completions, openai_embeddings
from api.dialects.openai_chat import ChatCompletion
from api.dialects.openai_completions import Completion, ErrorResponse
from api.dialects.openai_embeddings import EmbeddingResponse
from shared.batches import RESULTS, Answered, BatchStore, Failed, FileObject, LineOutcome, NotRun, Refused
from shared.codec import encode

__all__ = ["rendered", "render_line", "BatchRequestOutput"]

YIELD_EVERY = 256  # lines rendered between yields to the event loop (a file has up to 50,000)
_outcome = msgspec.json.Decoder(LineOutcome)


Body = Completion | ChatCompletion | EmbeddingResponse | ErrorResponse | msgspec.Raw


class BatchResponse(msgspec.Struct, kw_only=True):
    status_code: int
    request_id: str
    body: Body
    """The endpoint's own answer; Raw for a refusal, whose body was stored already as JSON."""


class BatchRequestError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class BatchRequestOutput(msgspec.Struct, kw_only=True):
    """One line of an output or error file (OpenAI's "request output object"): the endpoint's
    response, or, when the line never ran, the batch's own error."""

    id: str
    custom_id: str
    response: BatchResponse | None = None
    error: BatchRequestError | None = None


def _answered(outcome: LineOutcome, status: int, body: Body) -> BatchRequestOutput:
    response = BatchResponse(status_code=status, request_id=outcome.request_id, body=body)
    return BatchRequestOutput(id=f"batch_req_{outcome.request_id}", custom_id=outcome.custom_id, response=response)


def render_line(outcome: LineOutcome) -> BatchRequestOutput:
    """One output- or error-file line."""
    match outcome:
        case Answered(requests=[first, *_]) if first.dialect == openai_chat.NAME:
            chat = openai_chat.render_result(first, outcome.results[0], outcome.request_id, outcome.created)
            return _answered(outcome, 200, chat)
        case Answered(requests=[first]) if first.dialect == openai_embeddings.NAME:
            embeddings = openai_embeddings.render_result(first, outcome.results[0], outcome.request_id, outcome.created)
            return _answered(outcome, 200, embeddings)
        case Answered(requests=requests) if requests[0].dialect == openai_completions.NAME:
            completion = openai_completions.render_results(requests, outcome.results, outcome.request_id,
                                                           outcome.created)
            return _answered(outcome, 200, completion)
        case Failed(error=failure):
            status, body = openai_completions.error_body(failure.exception())
            return _answered(outcome, status, body)
        case Refused(error=refusal):
            return _answered(outcome, refusal.status, refusal.body)
        case NotRun(code=code, message=message):
            error = BatchRequestError(code=code, message=message)
            return BatchRequestOutput(id=f"batch_req_{outcome.request_id}", custom_id=outcome.custom_id, error=error)
    # Only the batch endpoints' lines are ever queued (api/batch_input.py).
    raise ValueError(f"no batch endpoint renders {outcome!r}")


async def _render(outcomes: bytes, render: Callable[[LineOutcome], msgspec.Struct] = render_line) -> bytes:
    out = []
    for number, raw in enumerate(outcomes.splitlines(), start=1):
        if number % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # this process relays streams meanwhile
        out.append(encode(render(_outcome.decode(raw))) + b"\n")
    return b"".join(out)


async def rendered(store: BatchStore, meta: FileObject) -> FileObject:
    """The file's object once its content is rendered: as given for an uploaded or rendered file;
    for a produced file read for the first time, rendered now (its size known only then)."""
    outcomes = await store.outcomes(meta.id)
    if outcomes is None:
        return meta
    # A Message Batch's files hold Anthropic's result lines, which its results route serves.
    content = await _render(outcomes, anthropic_batches.result_line if meta.purpose == RESULTS else render_line)
    meta = msgspec.structs.replace(meta, bytes=len(content))
    await store.put_rendered(meta, content)  # False: another reader stored the same bytes first, or it was deleted
    return meta
