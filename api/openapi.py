"""The OpenAPI 3.1 document of llmq's HTTP API, served (open, like vLLM's) at ``GET /openapi.json``.

Routes read their own bodies (``api.http.decode_body``), so Litestar's generator would know no
request bodies. The document is built here instead from one table, :data:`OPERATIONS`: each
route's method and path, its request body and its JSON answers (the dialect's own msgspec Structs
rendered by ``msgspec.json.schema_components``, so a new field shows up without touching this
file), and the statuses and media types it answers with. Errors are described in the shape of
the route's dialect. A unit test checks the table against the routes the
app registers, so a new route cannot silently miss the document.

Not described: the LMTP WebSocket at ``/`` (OpenAPI has no WebSocket operations), and the
``OPTIONS`` answers Litestar adds to every path.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Any

import msgspec
from litestar import Response, get

from api.auth import HEALTH_PATHS, OPEN_PATHS
from api.dialects import anthropic_batches as message_batches
from api.dialects import anthropic_messages as anthropic
from api.dialects import happy_vllm, jobs, lmi, openai_chat, openai_completions, tgi, triton
from api.dialects import openai_responses as responses
from api.fanout import GroupView
from api.jobs import Accepted
from api.services import Svc
from api.views import (
    AccessView,
    DeadLetterDeleted,
    DeadLetterList,
    DeploymentView,
    JobList,
    Liveness,
    LoadAdapter,
    Ping,
    Readiness,
    RecordView,
    RequeueView,
    TenantList,
    UnloadAdapter,
    UsagePage,
)
from shared.batches import BatchCreate, BatchList, BatchObject, FileDeleted, FileList, FileObject
from shared.codec import encode
from shared.schemas import GenerationRequest, JobView

__all__ = ["OPERATIONS", "Operation", "document", "openapi_json", "openapi_path"]

REF = "#/components/schemas/{name}"
JSON = "application/json"
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
JSONLINES = "application/jsonlines"
TEXT = "text/plain"

# Errors each dialect can answer with, in its own shape (see api/dialects/*.error_body). 401 is
# added to every non-open operation when API keys are on, 403 to every one but the health probes
# when they are off; 413 wherever a body is read; 503 everywhere (Redis unreachable); 504 where a
# request waits for its answer (its deadline, or its cold wait with no warm worker, ran out); 424
# where it may be a job that killed its engine (engine_fault, docs/guarantees.md#dead-letter).
_OPENAI = (400, 404, 424, 429, 503, 504)
_TGI = (404, 422, 424, 429, 503, 504)
_LMI = (400, 404, 424, 429, 503, 504)
_TRITON = (400, 404, 503)  # Triton reports "overloaded" and an expired queue timeout as 503
_HAPPY = (404, 422, 424, 429, 503, 504)
_JOBS = (400, 404, 424, 429, 503)
_ANTHROPIC = (400, 404, 424, 503, 504, 529)  # a full queue is Anthropic's 529 overloaded_error


class Operation(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    path: str
    """OpenAPI style: ``{model}``, not Litestar's ``{model:str}``."""
    summary: str
    tag: str
    body: str | None = None
    """A key of the body schemas (:func:`_bodies`), or None for no body."""
    examples: tuple[dict[str, Any], ...] = ()
    """Request bodies that succeed (with the default model): documentation, and schemathesis's
    examples phase."""
    ok: dict[int, tuple[str, ...]] = msgspec.field(default_factory=lambda: {200: (JSON,)})
    """Success (and other non-error) statuses -> the media types each may carry."""
    errors: tuple[int, ...] = ()
    headers: tuple[str, ...] = ()
    """Request headers the route reads: ``Prefer``, ``Idempotency-Key``, ``Last-Event-ID``."""
    query: tuple[str, ...] = ()
    body_media: str = JSON
    answer: Any = None
    """The type of the 200 answer's JSON body (a Struct, a list or a union of them); None: not
    described (LMI's answers depend on the body and the deployment's settings)."""
    error: Any = None
    """The type of an error's JSON body: the route's dialect's error shape."""


_ASYNC = {202: (JSON,)}  # Prefer: respond-async, or /v1/jobs: the job id, poll /v1/jobs/{id}
_ASYNC_HEADERS = ("Prefer", "Idempotency-Key")
_OPENAI_ERR = openai_completions.ErrorResponse
_LMI_ERR = lmi.LmiError | lmi.GenerationError | lmi.FrontendError
_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
_TGI_EXAMPLE = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
_HAPPY_EXAMPLE = {"prompt": "Hello", "max_tokens": 4}
_TRITON_GEN: dict[str, Any] = {
    "tag": "triton", "body": "triton", "ok": {200: (JSON, SSE), **_ASYNC}, "errors": _TRITON, "headers": _ASYNC_HEADERS,
    "answer": triton.GenerateResponse, "error": triton.ErrorResponse,
    "examples": ({"text_input": "Hello", "parameters": {"max_tokens": 4}},
                 {"text_input": "Hi", "max_tokens": 2, "stream": True}),
}


def _op(method: str, path: str, summary: str, tag: str, **kw: Any) -> Operation:
    return Operation(method=method, path=path, summary=summary, tag=tag, **kw)


OPERATIONS: tuple[Operation, ...] = (
    # OpenAI
    _op("post", "/v1/completions", "OpenAI completions", "openai", body="completions",
        examples=({"prompt": "Hello", "max_tokens": 4}, {"prompt": ["a", "b"], "max_tokens": 2, "stream": True}),
        ok={200: (JSON, SSE), **_ASYNC}, errors=_OPENAI, headers=_ASYNC_HEADERS,
        answer=openai_completions.Completion, error=_OPENAI_ERR),
    _op("post", "/v1/chat/completions", "OpenAI chat completions", "openai", body="chat", examples=(_CHAT,),
        ok={200: (JSON, SSE), **_ASYNC}, errors=_OPENAI, headers=_ASYNC_HEADERS,
        answer=openai_chat.ChatCompletion, error=_OPENAI_ERR),
    # OpenAI Responses: a response is a job, read back from its record and event log
    _op("post", "/v1/responses", "OpenAI responses (background: queued at once)", "openai", body="responses",
        examples=({"input": "Hello", "max_output_tokens": 4}, {"input": "Hi", "max_output_tokens": 2, "stream": True},
                  {"input": "Hi", "max_output_tokens": 2, "background": True}),
        ok={200: (JSON, SSE), **_ASYNC}, errors=_OPENAI, headers=_ASYNC_HEADERS,
        answer=responses.Response, error=responses.ErrorResponse),
    _op("get", "/v1/responses/{response_id}", "A response; with stream=true its events after starting_after",
        "openai", ok={200: (JSON, SSE)}, errors=(400, 404, 503), query=("stream", "starting_after"),
        answer=responses.Response, error=responses.ErrorResponse),
    _op("post", "/v1/responses/{response_id}/cancel", "Cancel a response", "openai", errors=(404, 503),
        answer=responses.Response, error=responses.ErrorResponse),
    _op("delete", "/v1/responses/{response_id}", "Delete a response (cancels it if it runs)", "openai",
        errors=(404, 503), answer=responses.Deleted, error=responses.ErrorResponse),
    _op("get", "/v1/responses/{response_id}/input_items", "A response's input, as message items", "openai",
        errors=(404, 503), answer=responses.ItemList, error=responses.ErrorResponse),
    # Anthropic Messages
    _op("post", "/v1/messages", "Anthropic messages", "anthropic", body="messages",
        examples=({"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
                  {"model": "tiny-llama", "max_tokens": 2, "stream": True, "system": "Be brief.",
                   "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        ok={200: (JSON, SSE), **_ASYNC}, errors=_ANTHROPIC, headers=_ASYNC_HEADERS,
        answer=anthropic.Message, error=anthropic.ErrorResponse),
    _op("post", "/v1/messages/count_tokens", "Anthropic: the prompt's tokens, as a create would count them",
        "anthropic", body="count_tokens",
        examples=({"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}]},),
        errors=(400, 404, 503), answer=anthropic.TokenCount, error=anthropic.ErrorResponse),
    # Anthropic Message Batches: run by the housekeeping process, as OpenAI's batches are
    _op("post", "/v1/messages/batches", "Create a Message Batch", "anthropic", body="message_batch",
        examples=({"requests": [{"custom_id": "a", "params": {"model": "tiny-llama", "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "Hi"}]}}]},),
        errors=(400, 503), answer=message_batches.MessageBatch, error=anthropic.ErrorResponse),
    _op("get", "/v1/messages/batches", "Message Batches, newest first", "anthropic", errors=(400, 503),
        query=("message_batch_limit", "after_id", "before_id"), answer=message_batches.BatchPage,
        error=anthropic.ErrorResponse),
    _op("get", "/v1/messages/batches/{message_batch_id}", "A Message Batch", "anthropic", errors=(404, 503),
        answer=message_batches.MessageBatch, error=anthropic.ErrorResponse),
    _op("post", "/v1/messages/batches/{message_batch_id}/cancel", "Cancel a Message Batch", "anthropic",
        errors=(400, 404, 503), answer=message_batches.MessageBatch, error=anthropic.ErrorResponse),
    _op("delete", "/v1/messages/batches/{message_batch_id}", "Delete an ended Message Batch", "anthropic",
        errors=(400, 404, 503), answer=message_batches.DeletedBatch, error=anthropic.ErrorResponse),
    _op("get", "/v1/messages/batches/{message_batch_id}/results", "An ended Message Batch's results (JSONL)",
        "anthropic", ok={200: ("application/x-jsonl",)}, errors=(400, 404, 503), error=anthropic.ErrorResponse),
    _op("get", "/v1/models", "Models requests may name (served now, or queued for the next worker)", "openai",
        answer=openai_completions.ModelList, error=_OPENAI_ERR),
    # LoRA adapters, in vLLM's shape (docs/adapters.md)
    _op("post", "/v1/load_lora_adapter", "Register a LoRA adapter (a worker loads it at its first job)", "openai",
        body="load_adapter", examples=({"lora_name": "example-lora", "lora_path": "org/example-lora",
                                        "load_inplace": True},),
        ok={200: (TEXT,)}, errors=(400, 404, 503), error=_OPENAI_ERR),
    _op("post", "/v1/unload_lora_adapter", "Remove a LoRA adapter (its queued jobs still run)", "openai",
        body="unload_adapter", examples=({"lora_name": "example-lora"},), ok={200: (TEXT,)}, errors=(400, 404, 503),
        error=_OPENAI_ERR),
    # LMI / SageMaker
    _op("post", "/invocations", "LMI: dispatches on `inputs` / `prompt` / `messages`", "lmi", body="invocations",
        examples=(_TGI_EXAMPLE, {"prompt": "Hi", "max_tokens": 2}, _CHAT),
        ok={200: (JSON, JSONLINES, SSE), **_ASYNC}, errors=_LMI, headers=_ASYNC_HEADERS),
    _op("post", "/predictions/{model}", "LMI: a named model", "lmi", body="lmi",
        examples=({"inputs": ["a", "b"], "parameters": {"max_new_tokens": 2}, "stream": True},),
        ok={200: (JSON, JSONLINES, SSE), **_ASYNC}, errors=_LMI, headers=_ASYNC_HEADERS, error=_LMI_ERR),
    _op("get", "/ping", "LMI health", "health", ok={200: (JSON,), 503: (JSON,)}, answer=Ping),
    _op("get", "/livez", "Web process liveness", "health", ok={200: (JSON,)}, answer=Liveness),
    _op("get", "/readyz", "Web process readiness (Redis reachable)", "health", ok={200: (JSON,), 503: (JSON,)},
        answer=Readiness),
    _op("get", "/metrics", "Prometheus metrics: queues, workers, latencies", "health", ok={200: (TEXT,)}),
    # TGI
    _op("post", "/generate", "TGI generate", "tgi", body="tgi", examples=(_TGI_EXAMPLE,), errors=_TGI,
        ok={200: (JSON,), **_ASYNC}, headers=_ASYNC_HEADERS, answer=tgi.GenerateResponse, error=tgi.ErrorResponse),
    _op("post", "/generate_stream", "TGI stream (errors in-band)", "tgi", body="tgi", examples=(_TGI_EXAMPLE,),
        ok={200: (SSE,), **_ASYNC}, errors=_TGI, headers=_ASYNC_HEADERS, error=tgi.ErrorResponse),
    _op("post", "/", "TGI compat: a one-element array, or a stream", "tgi", body="tgi",
        examples=(_TGI_EXAMPLE, {**_TGI_EXAMPLE, "stream": True}), ok={200: (JSON, SSE), **_ASYNC}, errors=_TGI,
        headers=_ASYNC_HEADERS, answer=list[tgi.GenerateResponse], error=tgi.ErrorResponse),
    _op("post", "/tokenize", "TGI tokenize", "tgi", body="tgi", examples=({"inputs": "Hello"},), errors=_TGI,
        answer=list[tgi.SimpleToken], error=tgi.ErrorResponse),
    _op("get", "/info", "TGI info", "tgi", answer=tgi.Info),
    _op("get", "/health", "TGI health", "health", ok={200: (TEXT,), 503: (JSON,)}),
    # Triton (KServe v2)
    _op("post", "/v2/models/{model}/generate", "Triton generate", **_TRITON_GEN),
    _op("post", "/v2/models/{model}/versions/{version}/generate", "Triton generate", **_TRITON_GEN),
    _op("post", "/v2/models/{model}/generate_stream", "Triton generate_stream", **_TRITON_GEN),
    _op("post", "/v2/models/{model}/versions/{version}/generate_stream", "Triton generate_stream", **_TRITON_GEN),
    _op("get", "/v2", "KServe server metadata", "triton", answer=triton.ServerMetadataResponse),
    _op("get", "/v2/health/live", "KServe liveness", "health", ok={200: (TEXT,)}),
    _op("get", "/v2/health/ready", "KServe readiness", "health", ok={200: (TEXT,), 400: (TEXT,)}),
    _op("get", "/v2/models/{model}", "KServe model metadata", "triton", errors=(404, 503),
        answer=triton.ModelMetadataResponse, error=triton.ErrorResponse),
    _op("get", "/v2/models/{model}/versions/{version}", "KServe model metadata", "triton", errors=(404, 503),
        answer=triton.ModelMetadataResponse, error=triton.ErrorResponse),
    _op("get", "/v2/models/{model}/ready", "KServe model readiness", "health", ok={200: (TEXT,)},
        errors=(400, 404)),
    _op("get", "/v2/models/{model}/versions/{version}/ready", "KServe model readiness", "health",
        ok={200: (TEXT,)}, errors=(400, 404)),
    # happy_vllm
    _op("post", "/v1/generate", "happy_vllm generate", "happy_vllm", body="happy", examples=(_HAPPY_EXAMPLE,),
        ok={200: (JSON,), **_ASYNC}, errors=_HAPPY, headers=_ASYNC_HEADERS,
        answer=happy_vllm.ResponseGenerate, error=happy_vllm.ErrorDetail),
    _op("post", "/v1/generate_stream", "happy_vllm stream", "happy_vllm", body="happy", examples=(_HAPPY_EXAMPLE,),
        ok={200: (NDJSON,), **_ASYNC}, errors=_HAPPY, headers=_ASYNC_HEADERS, error=happy_vllm.ErrorDetail),
    _op("get", "/liveness", "happy_vllm liveness", "health", answer=happy_vllm.ResponseLiveness),
    _op("get", "/readiness", "happy_vllm readiness", "health", answer=happy_vllm.ResponseReadiness),
    _op("get", "/v1/info", "happy_vllm info", "happy_vllm", answer=happy_vllm.ResponseInformation),
    # Fire-and-poll jobs
    _op("post", "/v1/jobs", "Queue a job (llmq's internal request)", "jobs", body="job",
        examples=({"prompt": "Hello", "sampling": {"max_tokens": 4}},), ok=_ASYNC, errors=_JOBS,
        headers=("Idempotency-Key",), error=jobs.ErrorBody),
    _op("get", "/v1/jobs/{job_id}", "A job's status and result", "jobs", errors=(404, 503),
        answer=JobView | GroupView, error=jobs.ErrorBody),
    _op("delete", "/v1/jobs/{job_id}", "Cancel a job", "jobs", errors=(404, 503),
        answer=JobView | GroupView, error=jobs.ErrorBody),
    _op("get", "/v1/jobs/{job_id}/events", "A job's events as SSE, resumable", "jobs", ok={200: (SSE,)},
        errors=(400, 404, 503), headers=("Last-Event-ID",), query=("after",), error=jobs.ErrorBody),
    _op("get", "/v1/usage", "The caller's own usage by UTC day and model", "jobs", errors=(400, 503),
        query=("days",), answer=UsagePage, error=jobs.ErrorBody),
    # What the console reads (docs/console.md): a tenant's key sees its own jobs, operators every one
    _op("get", "/v1/jobs", "Recent jobs, newest first, filtered; no prompt or output", "jobs",
        errors=(400, 403, 503), query=("list_model", "list_tenant", "list_status", "list_dialect", "list_limit"),
        answer=JobList, error=jobs.ErrorBody),
    _op("get", "/v1/jobs/{job_id}/record", "A job's record: request, result, every attempt's worker", "jobs",
        errors=(400, 403, 404, 503), answer=RecordView, error=jobs.ErrorBody),
    _op("get", "/v1/access", "Who the caller is: an operator, or a tenant seeing its own", "console",
        errors=(403, 503), answer=AccessView, error=jobs.ErrorBody),
    _op("get", "/v1/deployment", "Models, workers, slots, adapters; each level's queue and history", "console",
        errors=(403, 503), answer=DeploymentView, error=jobs.ErrorBody),
    _op("get", "/v1/tenants", "Tenants: weight, share, running and waiting, limits, today's usage", "console",
        errors=(403, 503), answer=TenantList, error=jobs.ErrorBody),
    _op("get", "/v1/dead_letters", "Jobs that failed too many deliveries, newest first", "console",
        errors=(400, 403, 503), query=("list_model",), answer=DeadLetterList, error=jobs.ErrorBody),
    _op("post", "/v1/dead_letters/{job_id}/requeue", "Queue a dead letter again as a new job (operators)",
        "console", errors=(403, 404, 429, 503), answer=RequeueView, error=jobs.ErrorBody),
    _op("delete", "/v1/dead_letters/{job_id}", "Discard a dead letter (operators)", "console",
        errors=(403, 404, 503), answer=DeadLetterDeleted, error=jobs.ErrorBody),
    _op("get", "/console", "The web console", "console", ok={200: ("text/html",)}, errors=(403,),
        error=jobs.ErrorBody),
    _op("get", "/console/static/{file}", "The web console's files", "console",
        ok={200: ("text/html", "text/css", "text/javascript", "image/svg+xml", "image/png")}, errors=(403, 404),
        error=jobs.ErrorBody),
    # OpenAI Files and Batches: offline batch files, run by the housekeeping process
    _op("post", "/v1/files", "Upload a batch input file (JSONL; purpose=batch)", "batches", body="file_upload",
        body_media="multipart/form-data", errors=(400, 503), answer=FileObject, error=_OPENAI_ERR),
    _op("get", "/v1/files", "Files", "batches", errors=(503,), answer=FileList, error=_OPENAI_ERR),
    _op("get", "/v1/files/{file_id}", "A file", "batches", errors=(404, 503), answer=FileObject, error=_OPENAI_ERR),
    _op("delete", "/v1/files/{file_id}", "Delete a file", "batches", errors=(404, 503),
        answer=FileDeleted, error=_OPENAI_ERR),
    _op("get", "/v1/files/{file_id}/content", "A file's content (input, output or error JSONL)", "batches",
        ok={200: ("application/octet-stream",)}, errors=(404, 503), error=_OPENAI_ERR),
    _op("post", "/v1/batches", "Create a batch from an uploaded file", "batches", body="batch",
        examples=({"input_file_id": "file-abc", "endpoint": "/v1/chat/completions", "completion_window": "24h"},),
        errors=(400, 404, 503), answer=BatchObject, error=_OPENAI_ERR),
    _op("get", "/v1/batches", "Batches, newest first", "batches", errors=(400, 503), query=("limit", "batch_after"),
        answer=BatchList, error=_OPENAI_ERR),
    _op("get", "/v1/batches/{batch_id}", "A batch: status, request_counts, output and error files", "batches",
        errors=(404, 503), answer=BatchObject, error=_OPENAI_ERR),
    _op("post", "/v1/batches/{batch_id}/cancel", "Cancel a batch", "batches", errors=(400, 404, 503),
        answer=BatchObject, error=_OPENAI_ERR),
    # This document
    _op("get", "/openapi.json", "This OpenAPI document", "meta"),
)

_PARAMS: dict[str, dict[str, Any]] = {
    "model": {"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
              "description": "A served model name; any other is 404."},
    "version": {"name": "version", "in": "path", "required": True, "schema": {"type": "string"},
                "description": 'Triton model version: llmq serves every model as "1".'},
    "job_id": {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}},
    "response_id": {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},
    "stream": {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"},
               "description": "Replay the response's stream events (then follow them live)."},
    "starting_after": {"name": "starting_after", "in": "query", "required": False,
                       "schema": {"type": "integer", "minimum": -1},
                       "description": "With stream=true: only the events numbered above this."},
    "days": {"name": "days", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1},
             "description": "How many UTC days back, today included (7; at most LLMQ_USAGE_DAYS)."},
    "Prefer": {"name": "Prefer", "in": "header", "required": False,
               "schema": {"type": "string", "enum": ["respond-async"]},
               "description": "RFC 7240: answer 202 with a job id instead of waiting."},
    "Idempotency-Key": {"name": "Idempotency-Key", "in": "header", "required": False, "schema": {"type": "string"},
                        "description": "A repeated key (per API key) follows the earlier job."},
    "Last-Event-ID": {"name": "Last-Event-ID", "in": "header", "required": False, "schema": {"type": "string"},
                      "description": "Resume after this event sequence number."},
    "X-LLMQ-Timeout": {"name": "X-LLMQ-Timeout", "in": "header", "required": False,
                       "schema": {"type": "string", "pattern": r"^\s*[0-9]*\.?[0-9]+\s*$"},
                       "description": "Seconds from enqueue until the request must have finished (its deadline); "
                                      "past it: 504 deadline_exceeded. Default: LLMQ_DEADLINE_S."},
    "X-LLMQ-Priority": {"name": "X-LLMQ-Priority", "in": "header", "required": False,
                        "schema": {"type": "string", "pattern": r"^\s*-?[0-9]+\s*$"},
                        "description": "Lower runs earlier (default 0); a body `priority` field wins."},
    "file_id": {"name": "file_id", "in": "path", "required": True, "schema": {"type": "string"}},
    "batch_id": {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"}},
    "message_batch_id": {"name": "message_batch_id", "in": "path", "required": True, "schema": {"type": "string"}},
    "message_batch_limit": {"name": "limit", "in": "query", "required": False,
                            "schema": {"type": "integer", "minimum": 1, "maximum": 1000},
                            "description": "At most this many (1-1000, default 20)."},
    "after_id": {"name": "after_id", "in": "query", "required": False, "schema": {"type": "string"},
                 "description": "List the Message Batches after (older than) this one."},
    "before_id": {"name": "before_id", "in": "query", "required": False, "schema": {"type": "string"},
                  "description": "Not supported: a 400 (page with after_id)."},
    "limit": {"name": "limit", "in": "query", "required": False,
              "schema": {"type": "integer", "minimum": 1, "maximum": 100},
              "description": "At most this many (1-100, default 20)."},
    "batch_after": {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
                    "description": "List the batches after this batch id."},
    "after": {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
              "description": "Resume after this event sequence number (when no Last-Event-ID)."},
    "file": {"name": "file", "in": "path", "required": True, "schema": {"type": "string"}},
    "list_model": {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                   "description": "Only this model's (a served model name; any other is 400)."},
    "list_tenant": {"name": "tenant", "in": "query", "required": False, "schema": {"type": "string"},
                    "description": "Only this tenant's."},
    "list_status": {"name": "status", "in": "query", "required": False,
                    "schema": {"type": "string", "enum": ["queued", "running", "done", "failed", "cancelled"]}},
    "list_dialect": {"name": "dialect", "in": "query", "required": False, "schema": {"type": "string"},
                     "description": "Only jobs that came in this dialect (`openai_chat`, `tgi`, ...)."},
    "list_limit": {"name": "limit", "in": "query", "required": False,
                   "schema": {"type": "integer", "minimum": 1, "maximum": 500},
                   "description": "At most this many (1-500, default 50)."},
}


def openapi_path(litestar_path: str) -> str:
    """``/v2/models/{model:str}`` -> ``/v2/models/{model}``."""
    parts = litestar_path.split("/")
    return "/".join(p.split(":", 1)[0] + "}" if p.startswith("{") and ":" in p else p for p in parts)


def _any_json(t: type) -> dict[str, Any] | None:
    # ``dict[str, object]`` (chat template kwargs): any JSON value.
    return {"description": "any JSON value"} if t is object else None


def _components(*types: type) -> dict[str, Any]:
    return msgspec.json.schema_components(types, ref_template=REF, schema_hook=_any_json)[1]


def _scalar(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The scalar part of a property schema (Triton's request parameters are scalars only)."""
    branches = schema.get("anyOf", [schema])
    kept = [b for b in branches if b.get("type") in ("string", "integer", "number", "boolean")]
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else {"anyOf": kept}


def _happy_body() -> dict[str, Any]:
    """happy_vllm reads a plain object: its own keywords plus vLLM's SamplingParams keywords;
    any other key is refused by name."""
    parts = _components(happy_vllm.HappyOptions, happy_vllm.VllmSampling)
    props = {**parts["HappyOptions"]["properties"], **parts["VllmSampling"]["properties"]}
    return {"type": "object", "properties": props, "required": ["prompt"], "additionalProperties": False}


def _triton_body() -> dict[str, Any]:
    """Triton's ``{"id"?, "text_input", "parameters"?}``: model inputs and scalar vLLM sampling
    keywords, at the top level or inside ``parameters``."""
    parts = _components(triton._Inputs, happy_vllm.VllmSampling)
    sampling = {k: s for k, v in parts["VllmSampling"]["properties"].items() if (s := _scalar(v)) is not None}
    sampling["structured_outputs"] = {"type": "string", "description": "vLLM StructuredOutputsParams as JSON"}
    inputs = parts["_Inputs"]["properties"]
    inner = {"type": "object", "properties": {**inputs, **sampling}, "additionalProperties": False}
    props = {"id": {"type": "string"}, **inputs, **sampling, "parameters": inner}
    return {"type": "object", "properties": props, "required": ["text_input"], "additionalProperties": False}


def _invocations_body(schema: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """LMI's ``/invocations`` dispatch, written as exclusive branches: ``inputs`` -> LMI's schema;
    else ``prompt`` -> OpenAI completions; else ``messages`` -> chat."""
    no_inputs = {"not": {"required": ["inputs"]}}
    return {"oneOf": [
        schema[lmi.LmiRequest],
        {"allOf": [schema[openai_completions.CompletionRequest], no_inputs]},
        {"allOf": [schema[openai_chat.ChatRequest], no_inputs, {"not": {"required": ["prompt"]}}]},
    ]}


_REQUESTS = (openai_completions.CompletionRequest, openai_chat.ChatRequest, lmi.LmiRequest, tgi.GenerateRequest,
             GenerationRequest, BatchCreate, responses.ResponsesRequest, anthropic.MessagesRequest,
             anthropic.CountTokensRequest, message_batches.CreateBatch, LoadAdapter, UnloadAdapter)


def _schemas() -> tuple[dict[Any, dict[str, Any]], dict[str, Any]]:
    """Each described type's schema (a ``$ref``) and the components they need. One call, so
    msgspec names every component: two Structs of one name (TGI's and Triton's GenerateResponse)
    get their module paths."""
    described = [*_REQUESTS, Accepted, *(t for op in OPERATIONS for t in (op.answer, op.error) if t is not None)]
    # msgspec describes a union of untagged Structs only as its members: an ``anyOf`` of them.
    members = {t: typing.get_args(t) for t in described if isinstance(t, types.UnionType)}
    plain = list(dict.fromkeys(m for t in described for m in members.get(t, (t,))))
    refs, components = msgspec.json.schema_components(plain, ref_template=REF, schema_hook=_any_json)
    schema: dict[Any, dict[str, Any]] = dict(zip(plain, refs, strict=True))
    for union, parts in members.items():
        schema[union] = {"anyOf": [schema[p] for p in parts]}
    return schema, components


def _bodies(schema: dict[Any, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        "completions": schema[openai_completions.CompletionRequest],
        "chat": schema[openai_chat.ChatRequest],
        "lmi": schema[lmi.LmiRequest],
        "invocations": _invocations_body(schema),
        "tgi": schema[tgi.GenerateRequest],
        "triton": _triton_body(),
        "happy": _happy_body(),
        "job": schema[GenerationRequest],
        "responses": schema[responses.ResponsesRequest],
        "messages": schema[anthropic.MessagesRequest],
        "count_tokens": schema[anthropic.CountTokensRequest],
        "load_adapter": schema[LoadAdapter],
        "unload_adapter": schema[UnloadAdapter],
        "message_batch": schema[message_batches.CreateBatch],
        "batch": schema[BatchCreate],
        "file_upload": {"type": "object", "required": ["file", "purpose"], "properties": {
            "file": {"type": "string", "contentMediaType": "application/octet-stream"},
            "purpose": {"type": "string", "enum": ["batch"]}}},
    }


def _responses(op: Operation, keys_on: bool, schema: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status, media in op.ok.items():
        body = schema[Accepted] if status == 202 else schema[op.answer] if status == 200 and op.answer else {}
        out[str(status)] = {"description": "OK" if status < 300 else "Not ready",
                            "content": {m: {"schema": body if m == JSON else {}} for m in media}}
    errors = set(op.errors)
    if op.body is not None:
        errors.add(413)  # LLMQ_MAX_BODY_BYTES
    if keys_on and op.path not in _OPEN:
        errors.add(401)
    if not keys_on and op.path not in _HEALTH:
        errors.add(403)  # with no keys: a foreign Host, or a cross-site write (api/auth.py KeylessGuard)
    for status in sorted(errors - set(op.ok)):
        out[str(status)] = {"description": "An error, in the route's dialect's shape",
                            "content": {JSON: {"schema": schema[op.error] if op.error is not None else {}}}}
    return out


_OPEN = frozenset(openapi_path(p) for p in OPEN_PATHS)
_HEALTH = frozenset(openapi_path(p) for p in HEALTH_PATHS)


def _operation_id(op: Operation) -> str:
    words = re.findall(r"[A-Za-z0-9]+", op.path.replace("{", "by_"))
    return "_".join([op.method, *words]) if words else f"{op.method}_root"


_QUEUES_NOTHING = ("/tokenize", "/v1/files", "/v1/messages/count_tokens")


def _options(op: Operation) -> tuple[str, ...]:
    """Every route that queues work reads the deadline and priority headers (api.submit.admit)."""
    return ("X-LLMQ-Timeout", "X-LLMQ-Priority") if op.body is not None and op.path not in _QUEUES_NOTHING \
        else ()


def _operation(op: Operation, bodies: dict[str, Any], schema: dict[Any, dict[str, Any]], keys_on: bool
               ) -> dict[str, Any]:
    names = [seg[1:-1] for seg in op.path.split("/") if seg.startswith("{")]
    out: dict[str, Any] = {
        "summary": op.summary,
        "operationId": _operation_id(op),
        "tags": [op.tag],
        "parameters": [_PARAMS[n] for n in (*names, *op.headers, *_options(op), *op.query)],
        "responses": _responses(op, keys_on, schema),
    }
    if op.body is not None:
        media: dict[str, Any] = {"schema": bodies[op.body]}
        if op.examples:
            media["examples"] = {f"example{i}": {"value": ex} for i, ex in enumerate(op.examples, 1)}
        out["requestBody"] = {"required": True, "content": {op.body_media: media}}
    if keys_on and op.path not in _OPEN:
        out["security"] = [{"bearer": []}, {"apiKey": []}]
    return out


@functools.cache
def document(keys_on: bool = False) -> dict[str, Any]:
    """The whole document (cached: callers must not mutate it). ``keys_on``: API keys are
    configured, so non-open operations need one."""
    schema, schemas = _schemas()
    bodies = _bodies(schema)
    components: dict[str, Any] = {"schemas": schemas}
    if keys_on:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, bodies, schema, keys_on)
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmq", "version": "1",
                 "description": "A queue-backed LLM inference service speaking several wire dialects. "
                                "The LMTP WebSocket at `/` is not described (OpenAPI has no WebSockets)."},
        "paths": paths,
        "components": components,
    }


@functools.cache
def _encoded(keys_on: bool) -> bytes:
    return encode(document(keys_on))


@get("/openapi.json", opt={"dialect": "jobs"}, include_in_schema=False)
async def openapi_json(svc: Svc) -> Response:
    return Response(_encoded(svc.keys_on), media_type=JSON)
