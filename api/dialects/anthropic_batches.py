"""Anthropic's Message Batches (``/v1/messages/batches``), as the anthropic SDK (2.x) parses them,
on llmq's one batch machinery (shared/batches.py, workers/housekeeping/batches.py).

A Message Batch is stored as a batch of endpoint :data:`~shared.batches.MESSAGES` whose lines are
the create body's ``requests``, each translated by the Messages dialect (anthropic_messages.py)
when the batch is created: a request whose ``params`` the endpoint would refuse becomes an
``errored`` line, and the rest run. Housekeeping runs it as it runs any batch; its produced
files hold Anthropic's result lines (:func:`result_line`, rendered on their first read by
api/batch_output.py), which ``results`` serves. This module holds the wire shapes and the pure
translations both ways; api/routes/anthropic_batches.py wires them to HTTP and Redis.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Annotated

import msgspec
from msgspec import Meta

from api.dialects import anthropic_messages as am
from shared.batches import Answered, BatchObject, Failed, LineError, LineOutcome, NotRun, Refused
from shared.codec import encode
from shared.errors import InvalidRequest, ServiceError
from shared.schemas import GenerationRequest

__all__ = ["CreateBatch", "BatchRequest", "check", "translate", "refusal", "MessageBatch", "RequestCounts",
           "render_batch", "result_line", "IndividualResponse", "tally", "DeletedBatch", "BatchPage",
           "MAX_REQUESTS", "WINDOW_S", "ID_PREFIX"]

MAX_REQUESTS = 100_000  # Anthropic's limit per batch
WINDOW_S = 24 * 3600  # a Message Batch expires 24 hours after its creation
ID_PREFIX = "msgbatch_"

# --- the create body ----------------------------------------------------------------------------


class BatchRequest(msgspec.Struct, kw_only=True):
    custom_id: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    params: msgspec.Raw
    """A Messages create body, decoded per request (:func:`translate`): one bad request is an
    errored line, not a refused batch."""


class CreateBatch(msgspec.Struct, kw_only=True):
    requests: Annotated[list[BatchRequest], Meta(min_length=1, max_length=MAX_REQUESTS)]


def check(body: CreateBatch) -> None:
    """What refuses the whole batch beyond its schema: a ``custom_id`` used twice (results are
    matched to requests by it)."""
    seen: set[str] = set()
    for number, request in enumerate(body.requests):
        if request.custom_id in seen:
            raise InvalidRequest(f"requests.{number}.custom_id: {request.custom_id!r} is used more than once; "
                                 "each custom_id must be unique within the batch", param=f"requests.{number}")
        seen.add(request.custom_id)


_params = msgspec.json.Decoder(am.MessagesRequest)


def translate(request: BatchRequest) -> GenerationRequest:
    """One request's params into the job it queues; InvalidRequest (or the dialect's own refusal)
    when ``POST /v1/messages`` would refuse it. The body passed ``json_input`` whole, so the
    params are well-formed JSON: only their fields remain to check."""
    try:
        params = _params.decode(request.params)
    except msgspec.DecodeError as exc:  # (ValidationError is one)
        raise InvalidRequest(f"params: {exc}") from None
    if params.stream:
        raise InvalidRequest("params.stream: streaming is not supported in a batch; results come from "
                             "the batch's results", param="stream")
    return am.to_generation_request(params)


def refusal(exc: ServiceError) -> LineError:
    """The errored line of a request refused at creation: Anthropic's status and error body."""
    status, body = am.error_body(exc)
    return LineError(status=status, body=msgspec.Raw(encode(body)))


# --- the message_batch object -------------------------------------------------------------------


class RequestCounts(msgspec.Struct, kw_only=True):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatch(msgspec.Struct, kw_only=True):
    """Field order is Anthropic's. Times are RFC 3339 strings (the SDK parses them as datetimes)."""

    id: str
    type: str = "message_batch"
    processing_status: str
    request_counts: RequestCounts
    ended_at: str | None
    created_at: str
    expires_at: str
    archived_at: str | None = None  # llmq never archives: results stay until the batch is deleted
    cancel_initiated_at: str | None
    results_url: str | None


class BatchPage(msgspec.Struct, kw_only=True):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedBatch(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message_batch_deleted"


def _time(epoch_s: int | None) -> str | None:
    return None if epoch_s is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))


# The stored batch's statuses (OpenAI's, which housekeeping moves through) as Anthropic's three.
# ``finalizing`` is the moment housekeeping writes the results: not ended until they are there.
_PROCESSING = {"validating": "in_progress", "in_progress": "in_progress", "finalizing": "in_progress",
               "cancelling": "canceling"}


def ended(batch: BatchObject) -> bool:
    return batch.status not in _PROCESSING


def render_batch(batch: BatchObject, errors: Counter[str] | None = None) -> MessageBatch:
    """The message_batch object. Anthropic counts every request as ``processing`` until the whole
    batch ended, and only then splits them by result: ``succeeded`` are the output file's lines,
    ``errors`` counts the error file's result types (:func:`tally`)."""
    total = batch.request_counts.total
    if ended(batch):
        errors = errors or Counter()
        counts = RequestCounts(processing=0, succeeded=batch.request_counts.completed,
                               errored=errors["errored"], canceled=errors["canceled"], expired=errors["expired"])
        ended_at = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
        results_url: str | None = f"/v1/messages/batches/{batch.id}/results"
    else:
        counts = RequestCounts(processing=total, succeeded=0, errored=0, canceled=0, expired=0)
        ended_at, results_url = None, None
    # Housekeeping ends an expired batch through ``cancelling`` too; no client asked for that.
    cancelled = None if batch.status == "expired" else batch.cancelling_at
    return MessageBatch(id=batch.id, processing_status=_PROCESSING.get(batch.status, "ended"),
                        request_counts=counts, ended_at=_time(ended_at), created_at=_time(batch.created_at) or "",
                        expires_at=_time(batch.expires_at) or "", cancel_initiated_at=_time(cancelled),
                        results_url=results_url)


# --- result lines -------------------------------------------------------------------------------


class Succeeded(msgspec.Struct, kw_only=True, tag="succeeded"):
    message: am.Message


class Errored(msgspec.Struct, kw_only=True, tag="errored"):
    error: am.ErrorResponse | msgspec.Raw
    """Raw for a request refused at creation, whose body was rendered then."""


class Canceled(msgspec.Struct, kw_only=True, tag="canceled"):
    pass


class Expired(msgspec.Struct, kw_only=True, tag="expired"):
    pass


class IndividualResponse(msgspec.Struct, kw_only=True):
    """One line of the results JSONL."""

    custom_id: str
    result: Succeeded | Errored | Canceled | Expired


def result_line(outcome: LineOutcome) -> IndividualResponse:
    """A line's outcome (as housekeeping gathered it) as its result line."""
    result: Succeeded | Errored | Canceled | Expired
    match outcome:
        case Answered(requests=[first, *_], results=[answer, *_]):
            result = Succeeded(message=am.render_result(first, answer, outcome.request_id, outcome.created))
        case Failed(error=error):
            result = Errored(error=am.error_body(error.exception())[1])
        case Refused(error=error):
            result = Errored(error=error.body)
        case NotRun(code="batch_cancelled"):  # cancelled before it ran, or while it ran
            result = Canceled()
        case NotRun(code="batch_expired"):
            result = Expired()
        case NotRun(message=message):  # its job's record expired before it was gathered
            result = Errored(error=am.ErrorResponse(error=am.ErrorObject(type="api_error", message=message)))
        case _:
            raise ValueError(f"no result line for {outcome!r}")
    return IndividualResponse(custom_id=outcome.custom_id, result=result)


class _Kind(msgspec.Struct):
    type: str


class _Line(msgspec.Struct):
    result: _Kind


_line = msgspec.json.Decoder(_Line)


def tally(content: bytes) -> Counter[str]:
    """Result lines by type (``errored``, ``canceled``, ...), from rendered results JSONL."""
    return Counter(_line.decode(raw).result.type for raw in content.splitlines() if raw.strip())
