"""Worker -> API events: a tagged union, one JSON object per event.

Each event carries the job's sequence number (1, 2, 3, ...). The same bytes go to the live
pub/sub channel and to the job's event log, so a reader that missed live messages reads the log
from its last sequence number and discards duplicates by number. Exactly one terminal event
(``done`` or ``error``) ends every job.
"""

from __future__ import annotations

import msgspec

from shared.errors import ServiceError, error_from_code
from shared.schemas import Pooled, PromptInfo, TopLogprob, Usage

__all__ = ["LOGPROB_FLOOR", "ToolCallDelta", "TokenDelta", "Tokens", "Timings", "Done", "Error", "Event", "is_terminal"]

LOGPROB_FLOOR = -9999.0
"""The lowest logprob an event carries: the worker publishes NaN and infinities as this
(workers/attempt.py: JSON has no NaN or infinity, msgspec writes them as ``null``, which the API's
typed decode of the event refuses), and dialects floor -inf to it, as vLLM's server does (its
value for "no logprob" too)."""


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of one tool call: its first piece names it (``id`` and ``name``), later pieces add
    to its ``arguments`` (JSON text, in fragments)."""

    index: int
    """The call's position among the choice's calls."""
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class TokenDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens of one choice since the previous event. With a chat's output parsed (tools, or a
    reasoning parser: workers/parsing.py), ``text`` is the content only, and the reasoning and tool
    calls these tokens completed come apart."""

    index: int = 0
    token_ids: list[int] = []
    text: str = ""
    """Text newly completed by these tokens (incremental detokenisation: may be empty)."""
    token_texts: list[str] | None = None
    """Per-token text, present when logprobs were asked for (dialects that print one token a line)."""
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: str | None = None
    """Set on the delta that ends this choice: vLLM's ``stop``, ``length`` or ``abort``, or
    ``tool_calls`` (the model called tools, and the choice was not a named tool's: vLLM's rule)."""
    stop_reason: str | int | None = None
    """The stop string or token id that matched; None when EOS (or the length) ended it."""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = []


class Tokens(msgspec.Struct, tag="tokens", kw_only=True, omit_defaults=True):
    seq: int
    deltas: list[TokenDelta]
    prompt: PromptInfo | None = None
    """On the first event only, when the request asked for the prompt's tokens."""


class Timings(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Epoch milliseconds, as in the job record."""

    queued_at: float = 0.0
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class Done(msgspec.Struct, tag="done", kw_only=True, omit_defaults=True):
    """Ends the job. It carries the final engine step's tokens, so a dialect whose last line
    holds both the last token and the summary (LMI, TGI) never has to hold a token back."""

    seq: int
    deltas: list[TokenDelta] = []
    prompt: PromptInfo | None = None
    usage: Usage = msgspec.field(default_factory=Usage)
    timings: Timings = msgspec.field(default_factory=Timings)
    pooled: Pooled | None = None
    """A pooling job's outputs: its one event, as nothing of it streams."""


class Error(msgspec.Struct, tag="error", kw_only=True):
    seq: int
    code: str
    message: str
    status: int = 500
    """The HTTP status a dialect should use if nothing has been sent yet."""

    @classmethod
    def of(cls, exc: ServiceError, seq: int) -> Error:
        """The terminal event that reports ``exc`` as event ``seq`` of a job."""
        return cls(seq=seq, code=exc.code, message=exc.message, status=exc.status)

    def exception(self) -> ServiceError:
        """The typed error this event carries (it crossed a process boundary as code + message)."""
        return error_from_code(self.code, self.message, self.status)


Event = Tokens | Done | Error


def is_terminal(event: Event) -> bool:
    return not isinstance(event, Tokens)
