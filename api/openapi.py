"""The OpenAPI 3.1 document of llmq's HTTP API, served (open, like vLLM's) at ``GET /openapi.json``.

Routes read their own bodies (``api.http.decode_body``), so Litestar's generator would know no
request bodies. Each route declares its operation beside it instead (``api.operations.documented``):
its request body and its JSON answers (the dialect's own msgspec Structs, rendered here by
``msgspec.json.schema_components``, so a new field shows up without touching this file), and the
statuses and media types it answers with. Errors are described in the shape of the route's
dialect. This module only assembles: the body schemas, the parameters, what every operation
shares (auth, 413, the deadline headers) and the order of the whole, :data:`HTTP_ROUTES`, which
is also the list of HTTP routes the app registers: a route cannot be served and miss the document.

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
from api.dialects import openai_responses as responses
from api.dialects import rerank, tei, vllm_score
from api.dialects.happy_vllm import HappyOptions, VllmSampling
from api.dialects.lmi import LmiRequest
from api.dialects.openai_chat import ChatRequest
from api.dialects.openai_completions import CompletionRequest
from api.dialects.openai_embeddings import EmbeddingRequest
from api.dialects.tgi import GenerateRequest as TgiRequest
from api.dialects.triton import _Inputs as TritonInputs
from api.jobs import Accepted
from api.metrics import metrics
from api.operations import JSON, Operation, documented, openapi_path, operation_of
from api.routes import (
    adapters,
    anthropic_batches,
    anthropic_messages,
    console,
    happy_vllm,
    health,
    jobs,
    lmi,
    openai_batches,
    openai_chat,
    openai_completions,
    openai_responses,
    overview,
    pooling,
    tgi,
    triton,
    usage,
)
from api.services import Svc
from api.views import LoadAdapter, UnloadAdapter
from shared.batches import BatchCreate
from shared.codec import encode
from shared.schemas import GenerationRequest

__all__ = ["HTTP_ROUTES", "OPERATIONS", "Operation", "document", "openapi_json", "openapi_path"]

REF = "#/components/schemas/{name}"


def _param(name: str, where: str, *, schema: dict[str, Any] | None = None, description: str | None = None
           ) -> dict[str, Any]:
    """One OpenAPI parameter object: a path's parameter is required, a query's or a header's is not; a
    string unless ``schema`` says otherwise. Its keys in the order the published document has them."""
    out: dict[str, Any] = {"name": name, "in": where, "required": where == "path",
                           "schema": schema or {"type": "string"}}
    if description is not None:
        out["description"] = description
    return out


# Whole milliseconds, 1 to SLO_MAX_MS (api/context.py reads them; anything else is a 400).
_SLO_MS = {"type": "string", "pattern": r"^\s*[0-9]+\s*$"}
_PARAMS: dict[str, dict[str, Any]] = {
    "model": _param("model", "path", description="A served model name; any other is 404."),
    "version": _param("version", "path", description='Triton model version: llmq serves every model as "1".'),
    "job_id": _param("job_id", "path"),
    "response_id": _param("response_id", "path"),
    "stream": _param("stream", "query", schema={"type": "boolean"},
                     description="Replay the response's stream events (then follow them live)."),
    "starting_after": _param("starting_after", "query", schema={"type": "integer", "minimum": -1},
                             description="With stream=true: only the events numbered above this."),
    "days": _param("days", "query", schema={"type": "integer", "minimum": 1},
                   description="How many UTC days back, today included (7; at most LLMQ_USAGE_DAYS)."),
    "Prefer": _param("Prefer", "header", schema={"type": "string", "enum": ["respond-async"]},
                     description="RFC 7240: answer 202 with a job id instead of waiting."),
    "Idempotency-Key": _param("Idempotency-Key", "header",
                              description="A repeated key (per API key) follows the earlier job."),
    "Last-Event-ID": _param("Last-Event-ID", "header", description="Resume after this event sequence number."),
    "X-LLMQ-Timeout": _param("X-LLMQ-Timeout", "header",
                             schema={"type": "string", "pattern": r"^\s*[0-9]*\.?[0-9]+\s*$"},
                             description="Seconds from enqueue until the request must have finished (its deadline); "
                                         "past it: 504 deadline_exceeded. Default: LLMQ_DEADLINE_S."),
    "X-LLMQ-Priority": _param("X-LLMQ-Priority", "header", schema={"type": "string", "pattern": r"^\s*-?[0-9]+\s*$"},
                              description="Lower runs earlier (default 0); a body `priority` field wins."),
    "x-slo-ttft-ms": _param("x-slo-ttft-ms", "header", schema=_SLO_MS,
                            description="SLO: milliseconds from enqueue to the first token (llm-d's header). A request "
                                        "predicted to miss it is refused, and a job not started by then never starts. "
                                        "/v1/jobs: a body `slo` wins; default: the tenant's `slo_ttft_ms`."),
    "x-slo-tpot-ms": _param("x-slo-tpot-ms", "header", schema=_SLO_MS,
                            description="SLO: milliseconds per output token after the first (llm-d's header); "
                                        "recorded and reported (GET /v1/jobs/{job_id}), never enforced. /v1/jobs: a "
                                        "body `slo` wins; default: the tenant's `slo_tpot_ms`."),
    "file_id": _param("file_id", "path"),
    "batch_id": _param("batch_id", "path"),
    "message_batch_id": _param("message_batch_id", "path"),
    "message_batch_limit": _param("limit", "query", schema={"type": "integer", "minimum": 1, "maximum": 1000},
                                  description="At most this many (1-1000, default 20)."),
    "after_id": _param("after_id", "query", description="List the Message Batches after (older than) this one."),
    "before_id": _param("before_id", "query", description="Not supported: a 400 (page with after_id)."),
    "limit": _param("limit", "query", schema={"type": "integer", "minimum": 1, "maximum": 100},
                    description="At most this many (1-100, default 20)."),
    "batch_after": _param("after", "query", description="List the batches after this batch id."),
    "after": _param("after", "query", description="Resume after this event sequence number (when no Last-Event-ID)."),
    "file": _param("file", "path"),
    "list_model": _param("model", "query", description="Only this model's (a served model name; any other is 400)."),
    "list_tenant": _param("tenant", "query", description="Only this tenant's."),
    "list_status": _param("status", "query",
                          schema={"type": "string", "enum": ["queued", "running", "done", "failed", "cancelled"]}),
    "list_dialect": _param("dialect", "query",
                           description="Only jobs that came in this dialect (`openai_chat`, `tgi`, ...)."),
    "list_limit": _param("limit", "query", schema={"type": "integer", "minimum": 1, "maximum": 500},
                         description="At most this many (1-500, default 50)."),
}


def _any_json(t: type) -> dict[str, Any]:
    # ``dict[str, object]`` (chat template kwargs): any JSON value. msgspec asks only of a type it
    # cannot describe itself, and takes NotImplementedError as no schema from the hook.
    if t is object:
        return {"description": "any JSON value"}
    raise NotImplementedError


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
    parts = _components(HappyOptions, VllmSampling)
    props = {**parts["HappyOptions"]["properties"], **parts["VllmSampling"]["properties"]}
    return {"type": "object", "properties": props, "required": ["prompt"], "additionalProperties": False}


def _triton_body() -> dict[str, Any]:
    """Triton's ``{"id"?, "text_input", "parameters"?}``: model inputs and scalar vLLM sampling
    keywords, at the top level or inside ``parameters``."""
    parts = _components(TritonInputs, VllmSampling)
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
        schema[LmiRequest],
        {"allOf": [schema[CompletionRequest], no_inputs]},
        {"allOf": [schema[ChatRequest], no_inputs, {"not": {"required": ["prompt"]}}]},
    ]}


_REQUESTS = (CompletionRequest, EmbeddingRequest, rerank.RerankRequest, vllm_score.ScoreRequest,
             tei.EmbedRequest, tei.RerankRequest, ChatRequest, LmiRequest, TgiRequest,
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
        "completions": schema[CompletionRequest],
        "embeddings": schema[EmbeddingRequest],
        "rerank": schema[rerank.RerankRequest],
        "rerank_any": {"anyOf": [schema[rerank.RerankRequest], schema[tei.RerankRequest]]},
        "score": schema[vllm_score.ScoreRequest],
        "tei_embed": schema[tei.EmbedRequest],
        "chat": schema[ChatRequest],
        "lmi": schema[LmiRequest],
        "invocations": _invocations_body(schema),
        "tgi": schema[TgiRequest],
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


def _options(op: Operation) -> tuple[str, ...]:
    """Every route that queues work reads the deadline, priority and SLO headers (api.submit.admit)."""
    if op.body is None or not op.queues:
        return ()
    return ("X-LLMQ-Timeout", "X-LLMQ-Priority", "x-slo-ttft-ms", "x-slo-tpot-ms")


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


@documented("This OpenAPI document", "meta")
@get("/openapi.json", opt={"dialect": "jobs"}, include_in_schema=False)
async def openapi_json(svc: Svc) -> Response:
    return Response(_encoded(svc.keys_on), media_type=JSON)


HTTP_ROUTES = (
    openai_completions.completions,
    *openai_chat.ROUTES,
    *openai_responses.ROUTES,
    *anthropic_messages.ROUTES,
    *anthropic_batches.ROUTES,
    *pooling.ROUTES,
    openai_completions.models,
    *adapters.ROUTES,
    *lmi.ROUTES,
    health.ping,
    health.livez,
    health.readyz,
    metrics,
    *tgi.ROUTES,
    *triton.ROUTES,
    *happy_vllm.ROUTES,
    *jobs.ROUTES,
    usage.usage,
    *overview.ROUTES,
    *console.ROUTES,
    *openai_batches.ROUTES,
    openapi_json,
)
"""Every HTTP route the app serves (api/app.py registers these), in the order the document lists
them: each module's routes in its ROUTES order. Clients read the document as a map, so the order
is for people and for the golden file (tests/fixtures/openapi.json), which pins the published
bytes."""
OPERATIONS: tuple[Operation, ...] = tuple(operation_of(route) for route in HTTP_ROUTES)
