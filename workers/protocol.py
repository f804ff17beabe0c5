"""What the worker's loop needs from an engine: the :class:`Engine` Protocol and the :class:`Step`
it yields.

Kept apart from workers/engine.py, the one module that imports vLLM (and so torch): the runner,
crash continuation and every test's fake engine use these two names without loading vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.events import TokenDelta
from shared.schemas import GenerationRequest, PromptInfo

if TYPE_CHECKING:  # workers.continuation imports Step from here
    from workers.continuation import Part

__all__ = ["Engine", "Step"]


@dataclass(slots=True)
class Step:
    """What one engine step produced for one job."""

    deltas: list[TokenDelta]
    finished: bool = False
    prompt_tokens: int = 0
    prompt: PromptInfo | None = None
    """The prompt's tokens, on the first step, when the request asked for them."""
    prompt_token_ids: list[int] | None = None
    """The prompt's token ids as the engine saw them, on the first step: kept with the job so
    another worker can continue it if this one dies (workers/continuation.py)."""


class Engine(Protocol):
    """What the loop needs from an engine (``workers.engine.VllmEngine`` is the real one;
    ``tests/support/scripted_engine.py`` holds the fakes)."""

    def stream(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
               trace_headers: Mapping[str, str] | None = None) -> AsyncIterator[Step]:
        """``req``'s steps; with ``parts`` (a continued job, workers/continuation.py), those of each
        part, merged under their choice indices, the last one ``finished``. ``trace_headers``: the
        W3C context the engine's own spans continue (tracing on)."""

    def parses(self, req: GenerationRequest) -> bool:
        """Whether ``req``'s output goes through the engine's output parsers (a chat with tools,
        or a reasoning parser: workers/parsing.py), so a continuation must replay it."""

    async def abort(self, job_id: str) -> None: ...
