"""Whether a job's engine steps may share one token event: decided here, in shared/, because the
worker merges (workers/attempt.py) and only the API's dialects (api/dialects) know how a stream
reads, and a worker never imports api/.

A worker whose flusher lags behind the engine finds a job's previous event still in its outbox
when the next step comes; the step may then join that event (one log entry, one live line, one
render for several tokens) rather than make one of its own. The merged event's delta carries every
token's id, per-token text and logprobs, but one joined ``text``: a dialect that renders text
deltas reads it as the two steps would have read (in fewer chunks); a dialect that renders one
line per token from a delta (its ids, texts and logprobs side by side, with the delta's ``text``
as the last token's) or one response per engine step would not. Merged events also make a
stream's chunking depend on the flusher's lag, so a test comparing a delta dialect's stream
compares what a client reads (tests/support/streams.py), not its chunk boundaries.
"""

from __future__ import annotations

from typing import get_args

from shared.schemas import DialectName, GenerationRequest

__all__ = ["MERGES_STEPS", "merges_steps"]

MERGES_STEPS: dict[DialectName, bool] = {
    # The events as they are stored: a merged delta keeps each token's id, text and logprobs.
    "jobs": True,
    # One chunk per delta, its text (and, with logprobs, a per-token list): a client joins them.
    # With logprobs, ``text_offset`` is counted from the per-token texts within a chunk but from
    # the chunk's text across chunks: where they differ (a character split over tokens) a merged
    # chunk would move the offsets, so such a request does not merge (merges_steps).
    "openai_completions": True,
    # One chunk per delta: content, reasoning and tool-call pieces, and with logprobs a per-token
    # ``content`` list, all of which a client joins.
    "openai_chat": True,
    # A content_block_delta per piece of a delta, blocks by kind: joined text reads the same.
    "anthropic_messages": True,
    # One delta event per piece, and the final response built from every event.
    "openai_responses": True,
    # One line per step, each the whole answer so far: fewer lines, the same last one.
    "happy_vllm": True,
    # One ``token`` per token (id, text, logprob), the delta's ``text`` its last token's.
    "tgi": False,
    # LMI's jsonlines and its TGI-compatible SSE: one line per token, as TGI's.
    "lmi": False,
    "lmi_tgi": False,
    # A dynamic batch's stream: a line per engine step with each input's new text, as DJL streams
    # one token iteration a line (a client may count lines as tokens).
    "lmi_batch": False,
    # One response per engine step with that step's output count, logprobs and cumulative
    # logprob; which of those a request asked for is not in the stored request.
    "triton": False,
    # One TOKEN frame per token with its own logprob and alternatives.
    "lmtp": False,
    # Never streamed: a pooling job's one event is its end.
    "openai_embeddings": False,
    "rerank": False,
    "vllm_score": False,
    "tei": False,
}
assert set(MERGES_STEPS) == set(get_args(DialectName)), "every dialect says whether it merges"


def merges_steps(req: GenerationRequest) -> bool:
    """Whether ``req``'s stream reads the same when a job's steps share an event."""
    if req.dialect == "openai_completions" and req.sampling.logprobs is not None:
        return False
    return MERGES_STEPS[req.dialect]
