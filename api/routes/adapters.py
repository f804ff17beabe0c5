"""LoRA adapters over HTTP, in vLLM's shape: ``POST /v1/load_lora_adapter`` registers one and
``POST /v1/unload_lora_adapter`` removes it (the registry: shared/adapters.py).

vLLM's bodies and answers, with two fields of llmq's: ``base_model_name`` (the base model, by
default ``LLMQ_MODEL``'s) and ``private`` (only the caller's key and operators see and use it).
Registering loads nothing: a worker of the base model loads the adapter at its first job.
``load_inplace`` replaces an entry of the same name, as in vLLM, for the jobs queued from then on.

Who may (docs/adapters.md#who-may-register-replace-and-unload): an operator's key, any entry; with
LLMQ_TENANT_ADAPTERS=private a tenant's key too, private entries of its own only, from files under
``<root>/<its key's hash>``. The tenant header grants nothing here: an entry's owner is the key's hash.
"""

from __future__ import annotations

import asyncio

from litestar import Request, Response, post

from api.auth import Viewer, viewer
from api.dialects import openai_completions as oc
from api.http import decode_body
from api.operations import OPENAI_ERROR, TEXT, documented
from api.services import Svc
from api.views import LoadAdapter, UnloadAdapter
from shared.adapters import Sources, check_name, new_adapter
from shared.errors import Forbidden, InvalidRequest, ModelNotFound

__all__ = ["ROUTES"]


def _text(message: str) -> Response:
    # vLLM answers a plain string; as text/plain here, so a client that reads the type reads it right.
    return Response(message, media_type="text/plain; charset=utf-8", status_code=200)


def _changer(request: Request, svc: Svc, action: str) -> Viewer:
    """The caller, when it may register or unload adapters at all: an operator, or with
    LLMQ_TENANT_ADAPTERS=private any key (its own private ones). Else 403, before the body is read."""
    who = viewer(request, svc.operators, svc.keys_on)
    if not who.operator and svc.settings.tenant_adapters == "none":
        raise Forbidden(f"Only an operator key may {action} LoRA adapters (LLMQ_OPERATOR_KEYS)")
    return who


@documented("Register a LoRA adapter (a worker loads it at its first job)", "openai", body="load_adapter",
            examples=({"lora_name": "example-lora", "lora_path": "org/example-lora", "load_inplace": True},),
            ok={200: (TEXT,)}, errors=(400, 404, 503), error=OPENAI_ERROR)
@post("/v1/load_lora_adapter", opt={"dialect": oc.NAME}, status_code=200)
async def load_lora_adapter(request: Request, svc: Svc) -> Response:
    who = _changer(request, svc, "register")
    body = await decode_body(request, LoadAdapter)
    name, source = body.lora_name, body.lora_path
    if not name or not source:
        raise InvalidRequest("Both 'lora_name' and 'lora_path' must be provided.")
    if not who.operator and not body.private:
        raise Forbidden("A tenant's key may register private LoRA adapters only (LLMQ_TENANT_ADAPTERS=private): "
                        "set 'private': true")
    known = await svc.models.known(fresh=True)
    check_name(name, known)
    base = body.base_model_name or svc.model
    if base not in known:
        raise ModelNotFound(f"The model `{base}` does not exist.", param="base_model_name")
    settings = svc.settings
    # In a thread: a slow file system (a network mount) must not hold up the event loop.
    placed, rank = await asyncio.to_thread(Sources.of(settings).checked, source, settings.max_lora_rank,
                                           owner=None if who.operator else who.owner)
    adapter = new_adapter(name, base, placed, rank=rank, owner=who.owner, private=body.private)
    store = svc.models.adapter_store
    existing = await store.get(name)
    if existing is not None and not existing.owned_by(who):
        raise _taken(name)  # the same words for a public entry and for a private one this key cannot see
    replace = body.load_inplace and existing is not None
    if not await store.add(adapter, replace=replace, per_owner=None if who.operator else settings.adapters_per_owner,
                           total=settings.adapters_max):
        raise _loaded(name) if existing is not None else _taken(name)  # None: another registered it meanwhile
    await svc.models.adapters(fresh=True)
    return _text(f"Success: LoRA adapter '{name}' added successfully.")


def _taken(name: str) -> InvalidRequest:
    return InvalidRequest(f"The lora adapter name '{name}' is taken: choose another.", param="lora_name")


def _loaded(name: str) -> InvalidRequest:
    return InvalidRequest(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                          "in place, set 'load_inplace' to True.", param="lora_name")


@documented("Remove a LoRA adapter (its queued jobs still run)", "openai", body="unload_adapter",
            examples=({"lora_name": "example-lora"},), ok={200: (TEXT,)}, errors=(400, 404, 503), error=OPENAI_ERROR)
@post("/v1/unload_lora_adapter", opt={"dialect": oc.NAME}, status_code=200)
async def unload_lora_adapter(request: Request, svc: Svc) -> Response:
    who = _changer(request, svc, "unload")
    body = await decode_body(request, UnloadAdapter)
    if not body.lora_name:
        raise InvalidRequest("'lora_name' needs to be provided to unload a LoRA adapter.")
    store = svc.models.adapter_store
    existing = await store.get(body.lora_name)
    if existing is None or not existing.visible_to(who):
        raise _not_found(body.lora_name)
    if not existing.owned_by(who):
        raise Forbidden(f"Only its owner's key or an operator's may unload the lora adapter '{body.lora_name}'.")
    if not await store.remove(body.lora_name):
        raise _not_found(body.lora_name)
    await svc.models.adapters(fresh=True)
    return _text(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _not_found(name: str) -> ModelNotFound:
    return ModelNotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name")


ROUTES = [load_lora_adapter, unload_lora_adapter]
