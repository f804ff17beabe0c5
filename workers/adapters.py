"""The worker's LoRA adapters: each job's adapter as vLLM's ``LoRARequest``, loaded before its first use.

vLLM loads an adapter inside the engine's step when a request names one it does not hold, and an
adapter that fails there (missing files, a rank above ``max_lora_rank``, another base model's
shapes) fails the step, and with it the engine. So the worker loads each adapter first, through
``add_lora``, which reports a failure to its caller and leaves the engine serving: a bad adapter
fails its own job with a 400 and nothing else. ``add_lora`` is asked again only for an adapter the
engine no longer lists, i.e. one it evicted (least recently used past ``max_cpu_loras``).

Before loading, the worker checks the job's source again as the API did at registration
(shared/adapters.py :class:`~shared.adapters.Sources`: under LLMQ_ADAPTER_ROOTS, or a hub repository
LLMQ_ADAPTER_HUB_ALLOW lists), against its own file system: a link swapped into an adapter's
directory since, or a job from before the roots, fails with the same words whatever is wrong.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Protocol

import structlog
from vllm.lora.request import LoRARequest
from vllm.v1.engine.exceptions import EngineDeadError

from shared.adapters import Sources
from shared.errors import InvalidRequest
from shared.schemas import AdapterSpec
from workers.protocol import AdapterState

__all__ = ["EngineAdapters"]

log = structlog.get_logger(__name__)


_NONE = AdapterState()


class LoraHost(Protocol):
    """Where adapters load: either engine front (workers/engine.py), which both forward to vLLM's
    engine-core client."""

    async def add_lora(self, lora: LoRARequest) -> bool: ...

    async def list_loras(self) -> set[int]: ...


class EngineAdapters:
    """One engine's adapters: a stable id per (name, source), and loads and evictions counted."""

    def __init__(self, engine: LoraHost, max_loras: int, sources: Sources, counted: AdapterState = _NONE) -> None:
        """``counted``: the loads and evictions of the engines before this one (a rebuild's)."""
        self.engine = engine
        self.max_loras = max_loras
        self.sources = sources
        self._ids: dict[tuple[str, str], int] = {}
        self._next_id = itertools.count(1)  # vLLM's ids start at 1
        self._held: set[int] = set()  # ids the engine listed after the last load
        self._state = AdapterState((), counted.loads, counted.evictions)  # names read by every pick: made once per load
        self._lock = asyncio.Lock()  # one load at a time: each reads the engine's list after it

    async def request(self, spec: AdapterSpec) -> LoRARequest:
        """``spec`` as the engine takes it, loaded; raises InvalidRequest when it cannot be."""
        if self.max_loras == 0:
            raise InvalidRequest(f"The LoRA adapter '{spec.name}' cannot run here: this model's workers serve no "
                                 "adapters (LLMQ_MAX_LORAS is 0)")
        # A new source under the same name is another adapter to the engine: a new id.
        key = (spec.name, spec.source)
        if key not in self._ids:
            self._ids[key] = next(self._next_id)
        lora_id = self._ids[key]
        lora = LoRARequest(lora_name=spec.name, lora_int_id=lora_id, lora_path=spec.source)
        if lora_id not in self._held:
            if not await asyncio.to_thread(self.sources.holds, spec.source):  # file system work: off the loop
                log.warning("adapter_source_refused", adapter=spec.name)
                raise InvalidRequest(f"The LoRA adapter '{spec.name}' could not be loaded: its source is not one "
                                     "this deployment allows (LLMQ_ADAPTER_ROOTS, LLMQ_ADAPTER_HUB_ALLOW)")
            async with self._lock:
                if lora_id not in self._held:
                    await self._load(lora)
        return lora

    def state(self) -> AdapterState:
        """The names of the adapters the engine listed after this worker's last load (what it
        holds, unless a job's step reloaded one it had evicted since), with the loads and evictions
        so far."""
        return self._state

    async def _load(self, lora: LoRARequest) -> None:
        try:
            await self.engine.add_lora(lora)
        except EngineDeadError:
            raise  # the engine, not the adapter: the job continues once the worker rebuilt it
        except Exception as exc:  # vLLM's loader raises anything from OSError to ValueError
            why = str(exc).removeprefix("Call to add_lora method failed: ")  # the engine core's wrapping
            log.warning("adapter_load_failed", adapter=lora.lora_name, error=why[:500])
            raise InvalidRequest(f"The LoRA adapter '{lora.lora_name}' could not be loaded: {why}"[:1000]) from None
        held = set(await self.engine.list_loras())
        evicted = len(self._held - held)
        self._held = held
        self._state = AdapterState(sorted(name for (name, _), i in self._ids.items() if i in held),
                                   self._state.loads + 1, self._state.evictions + evicted)
        log.info("adapter_loaded", adapter=lora.lora_name, held=len(held))
