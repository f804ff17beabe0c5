"""vLLM's per-position logprobs as llmq's: one conversion for both engine front ends
(workers/engine.py's ``AsyncLLM`` and workers/engine_loop.py's loop), so the two cannot write
different events for the same output."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shared.events import TokenDelta
from shared.schemas import PromptInfo, TopLogprob

__all__ = ["top", "add_logprobs", "prompt_info"]

Position = Mapping[int, Any]  # token id -> vLLM's Logprob (logprob, rank, decoded_token)


def top(position: Position, k: int) -> list[TopLogprob]:
    """The k best alternatives of one position; vLLM's dict also holds the sampled token when it
    ranked lower, which the caller reports separately."""
    ranked = sorted((lp.rank or 0, tid, lp) for tid, lp in position.items() if (lp.rank or 0) <= k)
    return [TopLogprob(tid, lp.decoded_token or "", lp.logprob) for _, tid, lp in ranked]


def add_logprobs(delta: TokenDelta, positions: Sequence[Position], want_top: int) -> None:
    """``delta``'s sampled logprobs and token texts, and with ``want_top`` its alternatives, from
    vLLM's positions for its tokens."""
    logprobs, texts, tops = [], [], []
    for token_id, position in zip(delta.token_ids, positions, strict=False):
        sampled = position[token_id]
        logprobs.append(sampled.logprob)
        texts.append(sampled.decoded_token or "")
        if want_top:
            tops.append(top(position, want_top))
    delta.logprobs, delta.token_texts = logprobs, texts
    delta.top_logprobs = tops if want_top else None


def prompt_info(decode: Any, ids: list[int], positions: Sequence[Position | None] | None, k: int | None
                ) -> PromptInfo:
    """The prompt's tokens as a request that asked for them reads them: each token's text, and
    with prompt logprobs (``positions``, vLLM's, the first None) each one's logprob and its ``k``
    best alternatives. ``decode``: the tokenizer's, for the texts vLLM gives no position for."""
    info = PromptInfo(token_ids=ids)
    if positions is None:
        info.token_texts = [decode([tid]) for tid in ids]
        return info
    texts: list[str] = []
    logprobs: list[float | None] = []
    tops: list[list[TopLogprob]] = []
    for tid, position in zip(ids, positions, strict=False):
        if position is None:  # the first token: nothing before it to predict it from
            texts.append(decode([tid]))
            logprobs.append(None)
            tops.append([])
            continue
        texts.append(position[tid].decoded_token or "")
        logprobs.append(position[tid].logprob)
        tops.append(top(position, k or 0) if k else [])
    info.token_texts, info.logprobs = texts, logprobs
    info.top_logprobs = tops if k else None
    return info
