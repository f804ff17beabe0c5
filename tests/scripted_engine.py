"""A scripted engine for queue-layer tests: deterministic tokens, no model.

It produces ``max_tokens`` tokens whose text is the prompt's characters cycled, so a test
knows exactly what every stream must contain. Never the only test of a user path: the e2e
suite runs the same paths on real vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared.errors import InvalidRequest
from shared.events import TokenDelta
from shared.schemas import GenerationRequest, PromptInfo


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

    async def stream(self, job_id: str, req: GenerationRequest) -> AsyncIterator[Step]:
        prompt = req.prompt or "".join(chr(97 + t % 26) for t in req.prompt_token_ids or [0])
        if req.messages:
            prompt = req.messages[-1].content or "a"
        if prompt == "fail":
            raise InvalidRequest("scripted failure")
        n = req.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(self.delay_s)
            char = prompt[i % len(prompt)]
            last = i == n - 1
            delta = TokenDelta(token_ids=[ord(char)], text=char, finish_reason="length" if last else None)
            if req.sampling.logprobs is not None:
                delta.logprobs, delta.token_texts = [-0.5], [char]
            yield Step(deltas=[delta], finished=last, prompt_tokens=len(prompt))

    async def abort(self, job_id: str) -> None:
        self.aborted.append(job_id)
