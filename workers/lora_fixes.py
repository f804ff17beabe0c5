"""Two fixes to vLLM 0.32's LoRA, loaded by vLLM itself as general plugins (pyproject.toml's
``vllm.general_plugins`` entry points; vLLM calls them in every process it starts, the engine
core included, where the model runner lives). Each is its own entry point, so VLLM_PLUGINS can
leave either out.

**Prompt logprobs beside other requests** (``llmq_lora_prompt_logprobs``: :func:`register_prompt_logprobs`).
With LoRA enabled, a request asking for prompt logprobs that shares an engine step with other
requests crashes the engine (``einsum(): subscript b has size N ...`` in the punica wrapper's
``add_lora_logits``; vllm#16668, #17766, #29955). The step's LoRA mapping for the logits holds one
index per request (one per sampled row), while ``GPUModelRunner._get_prompt_logprobs_dict``
computes the logits of one request's prompt positions, one row per prompt token. With one request
in the step the single index broadcasts; with several the shapes disagree, or, when the counts
happen to match, rows silently take other requests' adapters. The fix wraps that method without
copying it: with LoRA on and prompt logprobs pending, it runs vLLM's own method once per pending
request, with a one-request dict, and meanwhile gives the model's ``compute_logits`` a hook that
first sets the active mapping to that request's LoRA id (no adapter: id 0, index -1) repeated for
exactly the rows passed, the mapping vllm#16694 proposed; on the CPU backend, whose ops broadcast
one index over all rows, the id once, as vLLM maps a request alone in its step (see
:func:`_broadcasts`). Otherwise vLLM's method runs untouched.

**Rows without an adapter on the CPU backend** (``llmq_lora_no_adapter_rows``: :func:`register_no_adapter_rows`).
vLLM marks a row of no adapter with index -1, which its GPU kernels skip; its PyTorch ops (the CPU
backend) index the stacked weights with it, and -1 is the last slot. So once an adapter sits in
the last slot (with LLMQ_MAX_LORAS=2: the second one loaded), a base-model request batched with an
adapter's request is computed with that adapter in every LoRA layer, and even alone its logits get
that adapter's ``lm_head`` delta, if it has one (vllm PR #48421, open). The fix wraps the expand
ops, through which every LoRA delta reaches the output: rows of index -1 get a zero input, so
their delta is exactly 0, as with an empty slot. The CPU punica wrapper's ``update_metadata``
notes once per step whether the mapping has such rows at all; without them the ops skip the check.

Neither imports vLLM here: each patches vLLM's module when that is imported (the worker's own
process, whose engine core is a child, never imports the model runner: ~0.6 s saved). If vLLM's
internals are not the ones these were written against, each logs one warning and leaves vLLM alone.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

__all__ = ["register_prompt_logprobs", "register_no_adapter_rows", "not_loaded", "FIXES", "PATCHED"]

logger = logging.getLogger(__name__)

# Set on each wrapper, so a second registration (vLLM loads plugins once per process, but a test
# or a reload may call again) sees vLLM's function is already ours and wraps nothing twice.
PATCHED = "__llmq_lora_fix__"

_RUNNER = "vllm.v1.worker.gpu_model_runner"
_TORCH_OPS = "vllm.lora.ops.torch_ops.lora_ops"
_PUNICA_CPU = "vllm.lora.punica_wrapper.punica_cpu"


def register_prompt_logprobs() -> None:
    """Entry point: wrap ``GPUModelRunner._get_prompt_logprobs_dict`` (vLLM's CPU runner inherits it)."""
    _when_imported(_RUNNER, _patch_runner)


def register_no_adapter_rows() -> None:
    """Entry point: wrap the CPU backend's expand ops. The CPU punica wrapper imports them by name,
    so its copies are patched too (it imports the ops' module first)."""
    _when_imported(_PUNICA_CPU, _patch_cpu_ops)


FIXES = ("llmq_lora_prompt_logprobs", "llmq_lora_no_adapter_rows")
"""The entry points' names (pyproject.toml), as VLLM_PLUGINS names them."""


def not_loaded(environ: Mapping[str, str]) -> list[str]:
    """The fixes vLLM will not load here: an entry point missing from the package metadata this
    process sees (llmq not installed, or a stale ``llmq.egg-info`` in the directory it runs from,
    which comes first on ``sys.path``), or VLLM_PLUGINS set without naming it (vLLM splits it on
    commas, as here). For a worker to say so at start."""
    from importlib.metadata import entry_points

    found = {e.name for e in entry_points(group="vllm.general_plugins") if e.value.startswith(f"{__name__}:")}
    allowed = environ.get("VLLM_PLUGINS")
    names = None if allowed is None else allowed.split(",")
    return [n for n in FIXES if n not in found or (names is not None and n not in names)]


# -- patching a module when it is imported ---------------------------------------------------------

_pending: dict[str, Callable[[Any], None]] = {}
_seen: set[str] = set()


def _when_imported(name: str, patch: Callable[[Any], None]) -> None:
    """``patch(module)`` now if ``name`` is imported, else right after its import; once per process."""
    if name in _seen:
        return
    _seen.add(name)
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return
    _pending[name] = patch
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds a pending module through the other finders and hands it a loader that patches it."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        patch = _pending.pop(name, None)
        if patch is None:
            return None
        if not _pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the other finders' (this one no longer answers for it)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, which patches the module after executing it."""

    def __init__(self, inner: Any, patch: Callable[[Any], None]) -> None:
        self._inner, self._patch = inner, patch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module keeps its own loader, as if this one had never been there.
        module.__loader__ = module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        self._patch(module)


def _not_applied(fix: str, problem: str) -> None:
    logger.warning("llmq's LoRA fix (%s) not applied: %s; vLLM is left as it is", fix, problem)


def _parameters(function: Any) -> list[str]:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []


# -- prompt logprobs: each request's rows with its own LoRA mapping --------------------------------

# What the wrapper relies on in vLLM's method: it reads the pending requests from
# ``self.num_prompt_logprobs`` (narrowed here to one request per call), computes their logits
# through ``self.model.compute_logits`` (hooked here) and finds a request's batch row with
# ``input_batch.req_id_to_index``.
_RUNNER_READS = ("num_prompt_logprobs", "compute_logits", "req_id_to_index")
_RUNNER_PARAMETERS = ["self", "hidden_states", "num_scheduled_tokens"]


def _patch_runner(module: Any) -> None:
    fix = "prompt logprobs beside other requests"
    runner: Any = getattr(module, "GPUModelRunner", None)  # vLLM's class, or None
    original = None if runner is None else runner.__dict__.get("_get_prompt_logprobs_dict")
    if getattr(original, PATCHED, False):
        return
    if not inspect.isfunction(original):
        return _not_applied(fix, "GPUModelRunner has no _get_prompt_logprobs_dict")
    if not callable(getattr(runner, "_set_active_loras", None)):
        return _not_applied(fix, "GPUModelRunner has no _set_active_loras")
    if (params := _parameters(original)) != _RUNNER_PARAMETERS:
        return _not_applied(fix, f"_get_prompt_logprobs_dict takes {params}, not {_RUNNER_PARAMETERS}")
    if missing := [name for name in _RUNNER_READS if name not in original.__code__.co_names]:
        return _not_applied(fix, f"_get_prompt_logprobs_dict no longer uses {', '.join(missing)}")
    runner._get_prompt_logprobs_dict = _wrap_runner(original)


def _wrap_runner(original: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(original)
    def _get_prompt_logprobs_dict(self: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int]) -> dict:
        # The common case costs two attribute reads: no request wants prompt logprobs, or no LoRA.
        if not self.num_prompt_logprobs or not getattr(self, "lora_config", None):
            return original(self, hidden_states, num_scheduled_tokens)
        return _per_request(self, original, hidden_states, num_scheduled_tokens)

    setattr(_get_prompt_logprobs_dict, PATCHED, True)
    return _get_prompt_logprobs_dict


def _per_request(runner: Any, original: Callable[..., dict], hidden_states: Any,
                 num_scheduled_tokens: dict[str, int]) -> dict:
    """vLLM's method once per pending request, each with that request's own LoRA mapping; the
    results merged, and the requests vLLM's method finished removed from the real dict."""
    pending: dict[str, int] = runner.num_prompt_logprobs
    batch = runner.input_batch
    per_row = not _broadcasts()
    # The adapters this step's batch holds, as the step's own set_active_loras passed them: the
    # same set, so activating a mapping loads, evicts or touches nothing.
    active = set(batch.lora_id_to_lora_request.values())
    step_mapping = _current_mapping(runner)
    merged: dict = {}
    try:
        for req_id, k in list(pending.items()):
            index = batch.req_id_to_index.get(req_id)
            lora_id = 0 if index is None else int(batch.request_lora_mapping[index])
            one = {req_id: k}
            runner.num_prompt_logprobs = one
            try:
                with _mapped_logits(runner, lora_id, active, per_row):
                    merged.update(original(runner, hidden_states, num_scheduled_tokens))
            finally:
                runner.num_prompt_logprobs = pending
            if req_id not in one:  # vLLM's method finished this request's prompt and dropped it
                del pending[req_id]
    finally:
        if step_mapping is not None:
            # Anything later in this step (a drafter) sees the step's mapping again; the next
            # step sets its own in any case.
            runner._set_active_loras(step_mapping.prompt_mapping, step_mapping.index_mapping, active,
                                     step_mapping.type)
    return merged


@functools.cache
def _broadcasts() -> bool:
    """Whether this platform's LoRA ops take one index for all the rows (vLLM's PyTorch ops, the
    CPU backend's, broadcast it, as they do for a request alone in its step). Given one index per
    row they gather a copy of the adapter's ``lm_head`` weights per row first: measured here, 100
    rows of a 32,000-token vocabulary took 44 ms instead of 1.3 ms, and a long prompt on a large
    vocabulary would need gigabytes. Elsewhere (the GPU kernels) each row reads its own index."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@contextmanager
def _mapped_logits(runner: Any, lora_id: int, active: set, per_row: bool) -> Iterator[None]:
    """While vLLM's method runs for one request, the model's ``compute_logits`` first maps the
    rows it is given to the request's LoRA id (0: no adapter): one entry per row, or (``per_row``
    false) one entry for them all. An instance attribute shadows the model's method and is
    removed afterwards."""
    model = runner.model
    inner = model.compute_logits
    shadowed = "compute_logits" in vars(model)

    def compute_logits(hidden: Any, *args: Any, **kwargs: Any) -> Any:
        rows = (lora_id,) * (hidden.shape[0] if per_row else 1)
        runner._set_active_loras(rows, rows, active)
        return inner(hidden, *args, **kwargs)

    model.compute_logits = compute_logits
    try:
        yield
    finally:
        if shadowed:
            model.compute_logits = inner
        else:
            del model.compute_logits


def _current_mapping(runner: Any) -> Any:
    """The LoRA mapping this step set (vLLM's manager keeps its last one), to restore after; None
    where this vLLM keeps it elsewhere: the next step sets its own anyway."""
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    mapping = getattr(manager, "_last_mapping", None)
    return mapping if all(hasattr(mapping, name) for name in ("prompt_mapping", "index_mapping", "type")) else None


# -- the CPU backend: a row without an adapter gets no delta ----------------------------------------

_EXPANDS = ("bgmv_expand", "bgmv_expand_slice")
_EXPAND_PARAMETERS = ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor"]
_METADATA_PARAMETERS = ["self", "mapping"]

# Per punica wrapper (by id; an entry leaves with its wrapper, as an engine rebuilt in place makes
# new ones), whether the mapping it holds now has a row of no adapter. Set once per mapping (once
# per step), so that the expand ops, called a dozen times per step, skip their tensor check in a
# batch where every row has an adapter (a plain dict: ~0.1 us to ask, a WeakKeyDictionary ~1 us);
# vLLM's own no_lora already skips the LoRA layers of a batch without any adapter.
_no_adapter_rows: dict[int, bool] = {}


def _patch_cpu_ops(punica_cpu: Any) -> None:
    fix = "rows without an adapter on the CPU backend"
    ops = sys.modules.get(_TORCH_OPS)
    if ops is None:
        return _not_applied(fix, f"{_TORCH_OPS} is not where {_PUNICA_CPU} takes its ops from")
    for name in _EXPANDS:
        original = getattr(ops, name, None)
        if getattr(original, PATCHED, False):
            continue
        if not inspect.isfunction(original):
            return _not_applied(fix, f"{_TORCH_OPS} has no {name}")
        if _parameters(original)[:4] != _EXPAND_PARAMETERS:
            return _not_applied(fix, f"{name} takes {_parameters(original)}")
    wrapper: Any = getattr(punica_cpu, "PunicaWrapperCPU", None)  # vLLM's class, or None
    update = getattr(wrapper, "update_metadata", None)
    if not inspect.isfunction(update) or _parameters(update)[:2] != _METADATA_PARAMETERS:
        return _not_applied(fix, "PunicaWrapperCPU has no update_metadata(self, mapping, ...)")
    if not getattr(update, PATCHED, False):
        wrapper.update_metadata = _wrap_update_metadata(update)
    for name in _EXPANDS:
        wrapped = _wrap_expand(getattr(ops, name))
        unwrapped = wrapped.__wrapped__  # type: ignore[attr-defined]  # functools.wraps set it
        # The sgmv ops call these through the ops module; the punica wrapper through its own names.
        for module in (ops, sys.modules.get("vllm.lora.ops.torch_ops"), punica_cpu):
            if module is not None and getattr(module, name, None) in (unwrapped, wrapped):
                setattr(module, name, wrapped)


def _wrap_update_metadata(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update_metadata(self: Any, mapping: Any, *args: Any, **kwargs: Any) -> Any:
        try:  # LoRA ids, 0 for a row of no adapter (index -1 once converted)
            none = 0 in mapping.index_mapping or 0 in mapping.prompt_mapping
        except (AttributeError, TypeError):
            none = True  # not a mapping as known: check every op's indices
        if id(self) not in _no_adapter_rows:
            weakref.finalize(self, _no_adapter_rows.pop, id(self), None)
        _no_adapter_rows[id(self)] = none
        return original(self, mapping, *args, **kwargs)

    setattr(update_metadata, PATCHED, True)
    return update_metadata


def _wrap_expand(original: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(original, PATCHED, False):
        return original

    @functools.wraps(original)
    def expand(inputs: Any, lora_b_weights: Any, output_tensor: Any, lora_indices_tensor: Any,
               *args: Any, **kwargs: Any) -> Any:
        if any(_no_adapter_rows.values()):
            none = lora_indices_tensor < 0
            if bool(none.any()):
                # Index -1 (no adapter) would pick the last slot's weights: zero the row's input,
                # so its delta is exactly 0. One index for all rows broadcasts, as vLLM's op does.
                inputs = inputs * (~none).unsqueeze(-1).to(inputs.dtype)
        return original(inputs, lora_b_weights, output_tensor, lora_indices_tensor, *args, **kwargs)

    setattr(expand, PATCHED, True)
    return expand
