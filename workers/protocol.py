"""What the worker's loop needs from an engine: the :class:`Engine` Protocol, the :class:`Step`
it yields, and the :class:`Part` a continued job is run in (workers/continuation.py).

Kept apart from workers/engine.py, the one module that imports vLLM (and so torch): the runner,
crash continuation and every test's fake engine use these names without loading vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from shared.events import TokenDelta
from shared.schemas import GenerationRequest, Pooled, PromptInfo

__all__ = ["Engine", "Step", "AdapterState", "Death", "Part", "Published", "drain"]


@dataclass(slots=True)
class Step:
    """What one engine step produced for one job."""

    deltas: list[TokenDelta]
    finished: bool = False
    prompt_tokens: int = 0
    prompt: PromptInfo | None = None
    """The prompt's tokens, on the first step, when the request asked for them."""
    cached_tokens: int = 0
    """On the first step: the prompt's tokens the engine found in its prefix cache."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids as the engine saw them, on the first step: kept with the job so
    another worker can continue it if this one dies (workers/continuation.py)."""
    pooled: Pooled | None = None
    """A pooling job's outputs, on its one step (finished, no deltas)."""


@dataclass(slots=True)
class Published:
    """What the client already holds of one choice: its tokens, and its text per channel (the
    content; with a parsed chat also the reasoning and each tool call's arguments)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    reasoning: str = ""
    calls: dict[int, str] = field(default_factory=dict)
    """Per tool call index, its arguments so far (a call in here has had its id and name sent)."""


@dataclass(frozen=True, slots=True)
class Part:
    """One unfinished choice of a continued job, run as its own engine request (n = 1)."""

    index: int
    """The choice's index in the job's events."""
    request: GenerationRequest
    """With ``replay``: the original prompt's token ids and parameters. Without: the prompt
    extended by the choice's published tokens, with the rest of its budget."""
    replay: tuple[int, ...] = ()
    """Output tokens the engine must force first: the choice's published tokens."""
    held: Published | None = None
    """What the client already holds for ``replay``: its text per channel."""


Death = Literal["failed", "killed"]
"""How an engine died (:meth:`Engine.death`)."""


class AdapterState(NamedTuple):
    """An engine's LoRA adapters (workers/adapters.py)."""

    held: Sequence[str] = ()
    loads: int = 0
    evictions: int = 0


class Engine(Protocol):
    """What the loop needs from an engine (``workers.engine.VllmEngine`` is the real one;
    ``tests/support/scripted_engine.py`` holds the fakes)."""

    def stream(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
               trace_headers: Mapping[str, str] | None = None, images: Mapping[str, Any] | None = None
               ) -> AsyncIterator[Step]:
        """``req``'s steps; with ``parts`` (a continued job, workers/continuation.py), those of each
        part, merged under their choice indices, the last one ``finished``. ``trace_headers``: the
        W3C context the engine's own spans continue (tracing on); ``images``: the job's images,
        decoded, by SHA-256 (workers/media.py)."""

    async def run(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
                  trace_headers: Mapping[str, str] | None = None, images: Mapping[str, Any] | None = None, *,
                  on_step: Callable[[Step], None]) -> None:
        """:meth:`stream`'s batch form, which the worker runs its jobs with: each step handed to
        ``on_step`` as the engine makes it (from the engine's own loop, where it has one:
        workers/engine_loop.py, so a job's task is not woken per step), in the caller's context
        (the job's, bound for its log lines); returns after the last.
        What ``on_step`` raises ends the job, raised here. An engine without a loop of its own
        drains its stream (:func:`drain`)."""

    def parses(self, req: GenerationRequest) -> bool:
        """Whether ``req``'s output goes through the engine's output parsers (a chat with tools,
        or a reasoning parser: workers/parsing.py), so a continuation must replay it."""

    def adapter_state(self) -> AdapterState:
        """The LoRA adapters the engine holds now (their jobs are this worker's first: the pick's
        affinity, shared/lua/read.lua), and its loads and evictions so far."""

    async def abort(self, job_id: str) -> None: ...

    def dead(self) -> bool:
        """Whether the engine has died (its process gone, or failed): checked as a job starts, so
        no job is blamed for a death that came before it."""

    async def restart(self) -> None:
        """Replace a dead engine with a new one of the same configuration, in place. The worker's
        loop goes on meanwhile (its heartbeat, its leases); raises if the new engine cannot start."""

    async def death(self) -> Death:
        """How the engine died (once :meth:`dead`): ``failed`` when a step of its own raised, so
        the requests in that step caused it; ``killed`` by a signal from outside (an OOM kill, an
        operator) or of no known cause."""


async def drain(steps: AsyncIterator[Step], on_step: Callable[[Step], None]) -> None:
    """An engine's stream handed step by step to ``on_step`` (:meth:`Engine.run` for an engine
    without a loop of its own), closed however it ends."""
    async with contextlib.aclosing(steps):  # type: ignore[type-var]  # an async generator in practice
        async for step in steps:
            on_step(step)
