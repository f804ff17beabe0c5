"""A batch's input file, validated and translated when the batch is created.

Two kinds of problem, as OpenAI's Batch API has them:

- the file itself is wrong (a line that is not JSON, lacks ``custom_id``/``method``/``url``/
  ``body``, targets another endpoint, repeats a ``custom_id``; too many lines): the batch fails at
  once, with every problem in ``errors`` and its line number;
- a well-formed line whose request the endpoint would refuse (a bad parameter, an unknown
  model): that line alone fails, in the error file, with the status and body the endpoint itself
  would have answered. The rest of the batch runs.

Each good line is translated here by the endpoint's own dialect module into the requests a
worker runs, so housekeeping queues them as they are.
"""

from __future__ import annotations

import asyncio

import msgspec

from api.context import RequestContext
from api.dialects import openai_chat, openai_completions, openai_embeddings
from api.services import Services
from api.submit import admit
from shared import json_input
from shared.batches import BatchError, InputLine, LineError, StoredLine
from shared.codec import encode
from shared.errors import InvalidRequest, ServiceError

__all__ = ["read_lines", "MAX_LINES", "MAX_EMBEDDING_INPUTS"]

MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_EMBEDDING_INPUTS = 50_000  # OpenAI's limit on the inputs of all the lines of an embeddings batch
YIELD_EVERY = 256
_line = msgspec.json.Decoder(InputLine)
_chat = msgspec.json.Decoder(openai_chat.ChatRequest)
_completion = msgspec.json.Decoder(openai_completions.CompletionRequest)
_embeddings = msgspec.json.Decoder(openai_embeddings.EmbeddingRequest)


async def read_lines(svc: Services, ctx: RequestContext, content: bytes, endpoint: str
                     ) -> tuple[list[StoredLine], list[BatchError]]:
    raw_lines = [raw for raw in content.splitlines() if raw.strip()]
    if not raw_lines:
        return [], [BatchError(code="empty_file", message="The input file has no requests.")]
    if len(raw_lines) > MAX_LINES:
        return [], [BatchError(code="too_many_requests",
                               message=f"A batch holds at most {MAX_LINES} requests; the file has {len(raw_lines)}.")]
    lines: list[StoredLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for number, raw in enumerate(raw_lines, start=1):
        if number % YIELD_EVERY == 0:
            # ~0.1 ms of CPU per line: a 50,000-line file would otherwise hold this process's
            # event loop (every stream it relays) for seconds.
            await asyncio.sleep(0)
        try:
            line = json_input.decode(raw, _line)
        except msgspec.DecodeError as exc:  # (ValidationError is one)
            errors.append(BatchError(code="invalid_request", line=number, message=f"Invalid request line: {exc}"))
            continue
        if line.method.upper() != "POST":
            errors.append(BatchError(code="invalid_method", line=number, param="method",
                                     message=f"Only POST is supported, not {line.method!r}."))
        elif line.url != endpoint:
            errors.append(BatchError(code="mismatched_endpoint", line=number, param="url",
                                     message=f"The line's url {line.url!r} is not the batch's endpoint {endpoint!r}."))
        elif line.custom_id in seen:
            errors.append(BatchError(code="duplicate_custom_id", line=number, param="custom_id",
                                     message=f"The custom_id {line.custom_id!r} is used more than once."))
        else:
            seen.add(line.custom_id)
            lines.append(await _translate(svc, ctx, line, endpoint))
    inputs = sum(req.pooling.size for line in lines for req in line.requests if req.pooling is not None)
    if inputs > MAX_EMBEDDING_INPUTS:
        errors.append(BatchError(code="too_many_inputs", message=f"An embeddings batch holds at most "
                                 f"{MAX_EMBEDDING_INPUTS} inputs across its requests; the file has {inputs}."))
    return lines, errors


async def _translate(svc: Services, ctx: RequestContext, line: InputLine, endpoint: str) -> StoredLine:
    try:
        if endpoint == "/v1/chat/completions":
            chat = _decode(_chat, line.body)
            _refuse_stream(chat.stream)
            reqs = [openai_chat.to_generation_request(chat, max_model_len=svc.settings.max_model_len)]
        elif endpoint == "/v1/embeddings":
            reqs = [openai_embeddings.to_generation_request(_decode(_embeddings, line.body))]
        else:
            completion = _decode(_completion, line.body)
            _refuse_stream(completion.stream)
            reqs = openai_completions.to_generation_requests(completion)
        reqs = [await admit(svc, ctx, req) for req in reqs]
    except ServiceError as exc:
        status, body = openai_completions.error_body(exc)
        return StoredLine(custom_id=line.custom_id, error=LineError(status=status, body=msgspec.Raw(encode(body))))
    return StoredLine(custom_id=line.custom_id, requests=reqs)


def _decode(decoder: msgspec.json.Decoder, body: msgspec.Raw):
    try:
        # The whole line passed json_input.decode, so its body is UTF-8 JSON nested no deeper
        # than the line: only its fields remain to check.
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request body: {exc}") from None


def _refuse_stream(stream: bool) -> None:
    if stream:
        raise InvalidRequest("stream is not supported in a batch: results go to the output file", param="stream")
