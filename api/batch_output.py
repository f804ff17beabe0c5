"""A batch's output and error files, rendered from the outcomes housekeeping gathered.

Housekeeping (workers/batches.py) speaks no wire dialect: it leaves each produced file as its
lines' outcomes (shared/batches.py). The first time the API reads such a file (its object, a
listing, its content) it renders every line here, in the shape OpenAI's Batch API gives it,
with the response body the endpoint itself would have answered, then stores the bytes and their
size in place of the outcomes. Every later read serves the stored bytes. Rendering is
deterministic, so two API processes that render the same file at once store the same bytes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from api.dialects import openai_chat, openai_completions
from shared.batches import Answered, BatchStore, Failed, FileObject, LineOutcome, NotRun, Refused
from shared.codec import encode
from shared.errors import error_from_code

__all__ = ["rendered", "render_line"]

YIELD_EVERY = 256  # lines rendered between yields to the event loop (a file has up to 50,000)
_outcome = msgspec.json.Decoder(LineOutcome)


def _line(custom_id: str, request_id: str, *, status: int | None = None, body: Any = None,
          error: dict[str, str] | None = None) -> dict[str, Any]:
    response = None if status is None else {"status_code": status, "request_id": request_id, "body": body}
    return {"id": f"batch_req_{request_id}", "custom_id": custom_id, "response": response, "error": error}


def render_line(outcome: LineOutcome) -> dict[str, Any]:
    """One output- or error-file line."""
    match outcome:
        case Answered(requests=[first, *_]) if first.dialect == openai_chat.NAME:
            body = openai_chat.render_result(first, outcome.results[0], outcome.request_id, outcome.created)
            return _line(outcome.custom_id, outcome.request_id, status=200, body=body)
        case Answered(requests=requests) if requests[0].dialect == openai_completions.NAME:
            body = openai_completions.render_results(requests, outcome.results, outcome.request_id, outcome.created)
            return _line(outcome.custom_id, outcome.request_id, status=200, body=body)
        case Failed(error=error):
            status, body = openai_completions.error_body(error_from_code(error.code, error.message, error.status))
            return _line(outcome.custom_id, outcome.request_id, status=status, body=body)
        case Refused(error=error):
            return _line(outcome.custom_id, outcome.request_id, status=error.status, body=error.body)
        case NotRun(code=code, message=message):
            return _line(outcome.custom_id, outcome.request_id, error={"code": code, "message": message})
    # Only the two batch endpoints' lines are ever queued (api/batch_input.py).
    raise ValueError(f"no batch endpoint renders {outcome!r}")


async def _render(outcomes: bytes) -> bytes:
    out = []
    for number, raw in enumerate(outcomes.splitlines(), start=1):
        if number % YIELD_EVERY == 0:
            await asyncio.sleep(0)  # this process relays streams meanwhile
        out.append(encode(render_line(_outcome.decode(raw))) + b"\n")
    return b"".join(out)


async def rendered(store: BatchStore, meta: FileObject) -> FileObject:
    """The file's object once its content is rendered: as given for an uploaded or rendered file;
    for a produced file read for the first time, rendered now (its size known only then)."""
    outcomes = await store.outcomes(meta.id)
    if outcomes is None:
        return meta
    content = await _render(outcomes)
    meta = msgspec.structs.replace(meta, bytes=len(content))
    await store.put_rendered(meta, content)  # False: another reader stored the same bytes first, or it was deleted
    return meta
