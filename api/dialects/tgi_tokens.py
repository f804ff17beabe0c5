"""TGI's tokens: each generated token with its own text, split from the engine's incremental text
the same way whether the tokens arrive in a stream or are recorded for a whole answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from shared.events import Done, TokenDelta, Tokens
from shared.schemas import TopLogprob

__all__ = ["Token", "PrefillToken", "TokenTexts", "TokenRecorder", "top_tokens_of", "fit"]


# TGI's own objects (router/src/lib.rs), in its key order.


class Token(msgspec.Struct):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(msgspec.Struct):
    id: int
    text: str
    logprob: float | None


def fit(values: list | None, n: int, fill: Any) -> list:
    """``values`` when there is one per token (``n``), else ``fill`` for each: the engine may
    send no per-token texts or logprobs."""
    return list(values) if values is not None and len(values) == n else [fill] * n


class TokenTexts:
    """Each generated token's text, for one sequence, fed its deltas in order.

    TGI prints each token's incremental text. The engine reports incremental text per delta, and
    a delta may hold several tokens (vLLM merges steps when the reader lags), so the text is
    split here using each token decoded alone, in a way that does not depend on how the tokens
    were grouped. A token whose text alone is clean and found in the text takes it (plus any
    invalid bytes held back before it, as the engine's detokeniser releases them); a token that
    is part of a character (its text alone has U+FFFD) or does not match takes what is left
    before the next match, or at the end of its delta. Special tokens keep their own text (the
    engine skips it); the last token is special when EOS ended the sequence. The non-special
    texts always add up to the generated text.
    """

    def __init__(self, special: frozenset[int] = frozenset()) -> None:
        self.special = special
        self.pending = ""  # text received but not yet given to a token

    def tokens(
        self,
        ids: list[int],
        alone: list[str] | None,
        text: str,
        logprobs: list[float] | None,
        reason: str | None = None,
        stop_reason: str | int | None = None,
    ) -> list[Token]:
        flags = [tid in self.special for tid in ids]
        if flags and reason == "stop" and not isinstance(stop_reason, str):
            flags[-1] = True
        alone = fit(alone, len(ids), "")
        texts = [a if f else "" for a, f in zip(alone, flags, strict=True)]
        self.pending += text
        partial = None
        for i, a in enumerate(alone):
            q = self.pending.find(a) if a and "\ufffd" not in a and not flags[i] else -1
            if q < 0:
                partial = i if not flags[i] else partial
                continue
            gap, self.pending = self.pending[:q], self.pending[q + len(a) :]
            if gap and partial is not None and "\ufffd" not in gap:
                texts[partial], gap = gap, ""  # the character the partial tokens before completed
            texts[i], partial = gap + a, None
        if partial is not None and not self.pending.endswith("\ufffd"):
            texts[partial], self.pending = texts[partial] + self.pending, ""
        plain = [i for i, f in enumerate(flags) if not f]
        if reason is not None and self.pending and plain:  # the end: nothing may be left over
            texts[plain[-1]], self.pending = texts[plain[-1]] + self.pending, ""
        lps = fit(logprobs, len(ids), None)
        return [Token(tid, texts[i], lps[i], flags[i]) for i, tid in enumerate(ids)]

    def delta(self, d: TokenDelta) -> list[Token]:
        return self.tokens(d.token_ids, d.token_texts, d.text, d.logprobs, d.finish_reason, d.stop_reason)


def top_tokens_of(
    tops: Iterable[list[TopLogprob]] | None, special: frozenset[int] = frozenset()
) -> list[list[Token]]:
    return [[Token(t.id, t.text, t.logprob, t.id in special) for t in top] for top in tops or ()]


class TokenRecorder:
    """A non-streamed answer's tokens, kept event by event as :class:`TgiStream` splits them, so
    the answer has exactly the tokens (and texts) a stream would have sent."""

    def __init__(self, special: frozenset[int] = frozenset()) -> None:
        self.special = special
        self.tokens: dict[int, list[Token]] = {}
        self._texts: dict[int, TokenTexts] = {}

    def seen(self, event: Tokens | Done) -> None:
        for delta in event.deltas:
            texts = self._texts.setdefault(delta.index, TokenTexts(self.special))
            self.tokens.setdefault(delta.index, []).extend(texts.delta(delta))
