"""vLLM's two ways to ask an OpenAI endpoint for constrained output, shared by chat and
completions: ``response_format`` (OpenAI's) and ``structured_outputs`` (vLLM's extra).
``response_format`` overrides ``structured_outputs`` field by field, as in vLLM's
``structured_outputs_from_response_format``."""

from __future__ import annotations

from typing import Any

import msgspec

from shared import json_input
from shared.errors import InvalidRequest
from shared.schemas import StructuredOutput

__all__ = ["ResponseFormat", "StructuredOutputs", "structured_output"]


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's ``structured_outputs``; its options (whitespace, ...) are accepted and ignored: vLLM 0.32
    reads ``disable_any_whitespace`` from the engine's config only (``LLMQ_COMPACT_JSON``)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _refuse(bad: bool, message: str, param: str) -> None:
    if bad:
        raise InvalidRequest(message, param=param)


def structured_output(so: StructuredOutputs | None, rf: ResponseFormat | None) -> StructuredOutput | None:
    fields: dict[str, Any] = {}
    if so is not None:
        _refuse(
            sum(x is not None for x in (so.json, so.regex, so.choice)) > 1,
            "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice').",
            "structured_outputs",
        )
        fields = {k: v for k, v in msgspec.structs.asdict(so).items() if v is not None and v is not False}
        if isinstance(so.json, str):
            fields["json"] = _schema_from_string(so.json)
        _refuse(so.grammar == "", "structured_outputs.grammar cannot be an empty string", "structured_outputs")
    if rf is not None and rf.type != "text":
        fields.update(_from_response_format(rf))
    if so is None and not fields:
        return None
    try:
        return StructuredOutput(**fields)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="structured_outputs") from None


def _schema_from_string(text: str) -> dict[str, Any]:
    try:
        return json_input.decode(text, json_input.decoder_for(dict[str, Any]))
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise InvalidRequest("structured_outputs.json must be a JSON object", param="structured_outputs") from None


def _from_response_format(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    supported = "response_format type must be 'text', 'json_object' or 'json_schema', got '" + rf.type + "'"
    _refuse(rf.type != "json_schema", supported, "response_format")
    schema = rf.json_schema.schema if rf.json_schema is not None else None
    message = "When response_format type is 'json_schema', the 'json_schema' field (with a 'schema') must be provided."
    _refuse(schema is None, message, "response_format")
    return {"json": schema}
