"""vLLM's two ways to ask an OpenAI endpoint for constrained output, shared by chat and
completions: ``response_format`` (OpenAI's) and ``structured_outputs`` (vLLM's extra).
``response_format`` overrides ``structured_outputs`` field by field, as in vLLM's
``structured_outputs_from_response_format``."""

from __future__ import annotations

from typing import Any

import msgspec

from api.dialects.common import refuse, required
from shared import json_input
from shared.errors import InvalidRequest
from shared.schemas import StructuredOutput

__all__ = ["ResponseFormat", "StructuredOutputs", "structured_output", "JsonSchema"]

JsonSchema = dict[str, Any]
"""A JSON Schema document, passed through to the engine as the client wrote it."""


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    schema: JsonSchema | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs``; its options (whitespace, ...) are accepted and ignored: vLLM 0.32
    reads ``disable_any_whitespace`` from the engine's config only (``LLMQ_COMPACT_JSON``)."""

    json: str | JsonSchema | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def structured_output(so: StructuredOutputs | None, rf: ResponseFormat | None) -> StructuredOutput | None:
    json, json_object = None, False
    regex = choice = grammar = None
    if so is not None:
        refuse(
            sum(x is not None for x in (so.json, so.regex, so.choice)) > 1,
            "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",
            "structured_outputs",
        )
        json = _schema_from_string(so.json) if isinstance(so.json, str) else so.json
        json_object, regex, choice, grammar = bool(so.json_object), so.regex, so.choice, so.grammar
        refuse(so.grammar == "", "structured_outputs.grammar cannot be an empty string", "structured_outputs")
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            json_object = True
        else:
            json = _json_schema(rf)
    elif so is None:
        return None
    try:  # StructuredOutput refuses none or several kinds, and an empty choice
        return StructuredOutput(json=json, json_object=json_object, regex=regex, choice=choice, grammar=grammar)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="structured_outputs") from None


def _schema_from_string(text: str) -> JsonSchema:
    try:
        return json_input.decode(text, json_input.decoder_for(JsonSchema))
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise InvalidRequest("structured_outputs.json must be a JSON object", param="structured_outputs") from None


def _json_schema(rf: ResponseFormat) -> JsonSchema:
    """``response_format``'s schema, which overrides any ``structured_outputs`` json (as in vLLM)."""
    supported = "response_format type must be 'text', 'json_object' or 'json_schema', got '" + rf.type + "'"
    refuse(rf.type != "json_schema", supported, "response_format")
    schema = rf.json_schema.schema if rf.json_schema is not None else None
    message = "When response_format type is 'json_schema', the 'json_schema' field (with a 'schema') must be provided."
    return required(schema, message, "response_format")
