"""Beam search over any engine that can score one next token (LMI ``num_beams``).

vLLM's V1 engine has no beam search of its own: its servers run it as repeated one-token
generations that return the top ``2 * width`` logprobs, and so does this module. It knows
nothing about vLLM; the engine adapter hands it a ``next_tokens`` function.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["Beam", "NextTokens", "beam_search"]

# token ids so far -> {candidate id: (logprob, decoded text)}
NextTokens = Callable[[list[int], int], Awaitable[dict[int, tuple[float, str]]]]


@dataclass(slots=True)
class Beam:
    token_ids: list[int] = field(default_factory=list)
    """Generated tokens only (the prompt is not repeated here)."""
    texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cumulative: float = 0.0
    finish_reason: str = "length"

    def score(self, length_penalty: float) -> float:
        # vLLM's and Hugging Face's beam score: mean-ish logprob, tunable towards longer beams.
        return self.cumulative / max(1, len(self.token_ids)) ** length_penalty


async def beam_search(
    prompt_ids: list[int],
    next_tokens: NextTokens,
    *,
    width: int,
    max_tokens: int,
    eos_token_id: int | None,
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
) -> list[Beam]:
    """The ``width`` best finished beams, best first."""
    live = [Beam()]
    done: list[Beam] = []
    for _ in range(max_tokens):
        expansions = await asyncio.gather(*(next_tokens(prompt_ids + b.token_ids, 2 * width) for b in live))
        candidates: list[Beam] = []
        for beam, options in zip(live, expansions, strict=True):
            for token_id, (logprob, text) in options.items():
                grown = Beam(
                    token_ids=[*beam.token_ids, token_id],
                    texts=[*beam.texts, text],
                    logprobs=[*beam.logprobs, logprob],
                    cumulative=beam.cumulative + logprob,
                )
                if token_id == eos_token_id and not ignore_eos:
                    grown.finish_reason = "stop"
                    done.append(grown)
                else:
                    candidates.append(grown)
        candidates.sort(key=lambda b: b.score(length_penalty), reverse=True)
        live = candidates[:width]
        if not live:
            break
    done.extend(live)  # beams still open at max_tokens end with "length"
    done.sort(key=lambda b: b.score(length_penalty), reverse=True)
    return done[:width]
