"""What a job may generate in a context of ``max_model_len`` tokens: its ``max_tokens``, cut to
what the context leaves after the prompt.

Agent clients ask for a fixed budget whatever the model (Claude Code sends ``max_tokens: 32000``),
so ``max_tokens`` alone is never refused: the worker clamps it to the room the prompt leaves, as
vLLM's own server does (``get_max_tokens``: ``min(max_tokens, max_model_len - prompt_len)``), and the
fair share's estimate charges no more than that room. A prompt that leaves no room at all is the
engine's to refuse, with its own message (the dialect's 400).
"""

from __future__ import annotations

__all__ = ["generation_budget"]


def generation_budget(max_tokens: int, prompt_tokens: int | None, max_model_len: int) -> int:
    """``max_tokens`` cut to what a context of ``max_model_len`` leaves after ``prompt_tokens``
    (None: not known here, counted as the one token every prompt has), and never below 1: a
    prompt that fills the context is left for the engine to refuse."""
    room = max_model_len - (1 if prompt_tokens is None else prompt_tokens)
    return max(1, min(max_tokens, room))
