"""LoRA adapters over HTTP, in vLLM's shape: ``POST /v1/load_lora_adapter`` registers one and
``POST /v1/unload_lora_adapter`` removes it (the registry: shared/adapters.py).

vLLM's bodies and answers, with two fields of llmq's: ``base_model_name`` (the base model, by
default ``LLMQ_MODEL``'s) and ``private`` (only the caller's tenant sees and uses it). Registering
loads nothing: a worker of the base model loads the adapter at its first job. ``load_inplace``
replaces an entry of the same name, as in vLLM, for the jobs queued from then on.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from litestar import Request, Response, post

from api.context import Ctx
from api.dialects import openai_completions as oc
from api.http import decode_body
from api.services import Svc
from shared.adapters import canonical_source, check_source, new_adapter
from shared.errors import InvalidRequest, ModelNotFound

__all__ = ["ROUTES", "LoadAdapter", "UnloadAdapter"]

_Name = Annotated[str, msgspec.Meta(max_length=256)]


class LoadAdapter(msgspec.Struct, kw_only=True):
    lora_name: _Name
    lora_path: Annotated[str, msgspec.Meta(max_length=4096)]
    load_inplace: bool = False
    base_model_name: _Name | None = None
    """llmq's: the base model the adapter was trained on; default: LLMQ_MODEL's."""
    private: bool = False
    """llmq's: only the caller's tenant may see and use it; others get a 404 for its name."""


class UnloadAdapter(msgspec.Struct, kw_only=True):
    lora_name: _Name
    lora_int_id: int | None = None  # vLLM's; names are unique here, so it is not needed


def _text(message: str) -> Response:
    # vLLM answers a plain string; as text/plain here, so a client that reads the type reads it right.
    return Response(message, media_type="text/plain; charset=utf-8", status_code=200)


@post("/v1/load_lora_adapter", opt={"dialect": oc.NAME}, status_code=200)
async def load_lora_adapter(request: Request, svc: Svc, ctx: Ctx) -> Response:
    body = await decode_body(request, LoadAdapter)
    name, source = body.lora_name, body.lora_path
    if not name or not source:
        raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.")
    if not name.isprintable() or name != name.strip():
        raise InvalidRequest("'lora_name' must be printable, with no leading or trailing space", param="lora_name")
    known = await svc.models.known(fresh=True)
    if name in known:
        raise InvalidRequest(f"The lora adapter '{name}' conflicts with a served base model.", param="lora_name")
    base = body.base_model_name or svc.model
    if base not in known:
        raise ModelNotFound(f"The model `{base}` does not exist.", param="base_model_name")
    rank = check_source(source, svc.settings.max_lora_rank)
    adapter = new_adapter(name, base, canonical_source(source, rank), rank=rank,
                          tenant=ctx.tenant if body.private else None)
    store = svc.models.adapter_store
    existing = await store.get(name)
    if existing is not None and not existing.visible_to(ctx.tenant):
        raise InvalidRequest(f"The lora adapter '{name}' conflicts with another tenant's.", param="lora_name")
    if not await store.add(adapter, replace=body.load_inplace and existing is not None):
        raise InvalidRequest(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                             "in place, set 'load_inplace' to True.", param="lora_name")
    await svc.models.adapters(fresh=True)
    return _text(f"Success: LoRA adapter '{name}' added successfully.")


@post("/v1/unload_lora_adapter", opt={"dialect": oc.NAME}, status_code=200)
async def unload_lora_adapter(request: Request, svc: Svc, ctx: Ctx) -> Response:
    body = await decode_body(request, UnloadAdapter)
    if not body.lora_name:
        raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
    store = svc.models.adapter_store
    existing = await store.get(body.lora_name)
    if existing is None or not existing.visible_to(ctx.tenant) or not await store.remove(body.lora_name):
        raise ModelNotFound(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
    await svc.models.adapters(fresh=True)
    return _text(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


ROUTES = [load_lora_adapter, unload_lora_adapter]
