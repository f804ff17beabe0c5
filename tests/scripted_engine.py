"""A scripted engine for queue-layer tests: deterministic tokens, no model.

It produces ``max_tokens`` tokens whose text is the prompt's characters cycled, so a test
knows exactly what every stream must contain. The prompt ``fail`` is refused before any token;
``break`` fails after its first token. Never the only test of a user path: the e2e
suite runs the same paths on real vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from shared.errors import GenerationFailed, InvalidRequest
from shared.events import TokenDelta
from shared.schemas import GenerationRequest, PromptInfo
from workers.continuation import Part


@dataclass(slots=True)
class Step:
    deltas: list[TokenDelta]
    finished: bool = False
    prompt_tokens: int = 0
    prompt: PromptInfo | None = None


def expected_text(prompt: str, max_tokens: int) -> str:
    return "".join(prompt[i % len(prompt)] for i in range(max_tokens))


class ScriptedEngine:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.aborted: list[str] = []
        self.started: list[str] = []  # job ids in the order they reached the engine
        self.active = 0
        self.peak_active = 0  # most jobs generating at once: what the engine's slots bound

    async def stream(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
                     ) -> AsyncIterator[Step]:
        if parts is not None:  # only a crash continuation of n > 1 or replayed jobs has parts
            raise NotImplementedError("the scripted engine does not run continuation parts")
        self.started.append(job_id)
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            async for step in self._steps(req):
                yield step
        finally:
            self.active -= 1

    async def _steps(self, req: GenerationRequest) -> AsyncIterator[Step]:
        prompt = req.prompt or "".join(chr(97 + t % 26) for t in req.prompt_token_ids or [0])
        if req.messages:
            prompt = req.messages[-1].content or "a"
        if prompt == "fail":
            raise InvalidRequest("scripted failure")
        if prompt == "break":  # fails after its first token
            yield Step(deltas=[TokenDelta(token_ids=[98], text="b")], prompt_tokens=5)
            raise GenerationFailed("scripted failure mid-stream")
        n = req.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(self.delay_s)
            char = prompt[i % len(prompt)]
            last = i == n - 1
            delta = TokenDelta(token_ids=[ord(char)], text=char, finish_reason="length" if last else None)
            if req.sampling.logprobs is not None:
                delta.logprobs, delta.token_texts = [-0.5], [char]
            # The prompt's tokens on the first step when asked, as the real engine reports them.
            info = PromptInfo(token_ids=[ord(c) for c in prompt]) if i == 0 and req.output.prompt_tokens else None
            yield Step(deltas=[delta], finished=last, prompt_tokens=len(prompt), prompt=info)

    async def abort(self, job_id: str) -> None:
        self.aborted.append(job_id)
