"""Crash continuation: turn a reclaimed job's logged events into the requests that continue it.

When a worker dies mid-generation its successor does not start over: the client already holds
the first tokens, and a fresh run would contradict them. The successor reads, per choice, what
was published (token ids, text, whether the choice finished) and asks the engine only for the
rest of each unfinished choice. Its events continue the same sequence, so the client's stream
reads as one run. There are two ways to continue a choice that already has k tokens out:

- **Prompt extension** (one prefill): the prompt's token ids plus the choice's k tokens become
  the new prompt, with what is left of the token budget. The engine then sees those k tokens as
  prompt, not as output, which is harmless only while nothing depends on which tokens were
  *output*: greedy decoding then continues token for token as the uninterrupted run would, and
  unseeded sampling draws from the same distribution (no such run is reproducible anyway). It
  is wrong for structured output (the grammar would start over at the beginning of the
  document), stop strings (vLLM holds back the last ``len(stop) - 1`` characters of text until
  they cannot start a stop string, and looks for stops in output text only: the held text would
  be lost and a stop across the seam missed), presence and frequency penalties (they count
  output tokens only) and seeded sampling (the seeded generator would restart, not be k draws in).
- **Forced replay** (k decode steps, for all of those): the original prompt with the original
  parameters, and the first k output tokens forced to the published ones (``Part.replay``;
  workers/forcing.py does it inside vLLM's sampler, after the grammar's mask). The grammar,
  penalties, stop-string buffer, ``min_tokens`` and the seeded generator all advance through
  the same k outputs as the dead worker's run did. :class:`Replay` then drops what the client
  already holds: the k tokens, and as much text as was published (compared as cumulative text,
  since incremental detokenisation can hold back part of a UTF-8 character or a would-be stop
  string, so one token is not one piece of text). What the replay produces is checked against
  what was published; a mismatch fails the job with ``worker_lost`` rather than corrupt a stream.

A job with several choices (``n`` > 1) continues each unfinished choice as its own engine
request (n = 1, seeded as vLLM seeds its children: seed + index), and :func:`run_parts` merges
their outputs back under the original choice indices; a choice whose finish was published is not
run again. A single-choice job that needs no replay (greedy, plain) keeps the one-prefill
extension path (``Continuation.request``).
Beam search publishes everything at its end, so it never has partial output and restarts from
scratch. A job whose prompt token ids were never recorded cannot continue and fails with
``worker_lost``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from shared.errors import WorkerLost
from shared.events import Event, TokenDelta, Tokens
from shared.queue import Consumer, Delivery
from shared.redis import REDIS_DOWN
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, SamplingParams
from workers.protocol import Part, Published, Step

__all__ = ["Continuation", "Replay", "needs_replay", "plan_continuation", "plan_for", "published", "run_parts"]

log = structlog.get_logger()


@dataclass(slots=True)
class Continuation:
    request: GenerationRequest
    """What to give the engine when ``parts`` is None: the original request, or (greedy n = 1
    plain jobs) its prompt extension."""
    parts: list[Part] | None = None
    """Otherwise one engine request per unfinished choice."""
    seq: int = 0
    """The last published sequence number; new events continue from here."""
    builder: ResultBuilder = field(default_factory=ResultBuilder)
    """Already holds the published events, so the final result covers the whole job."""
    emitted: int = 0
    """Completion tokens published by earlier attempts, all choices together."""
    prompt_tokens: int = 0
    """The original prompt's length (an extended prompt is longer)."""


def published(prior: Sequence[Event]) -> dict[int, Published]:
    """Per choice index, the tokens and text of the events ``prior``, and whether it finished."""
    choices: dict[int, Published] = {}
    texts: dict[int, list[str]] = {}
    for event in prior:
        if not isinstance(event, Tokens):
            continue
        for delta in event.deltas:
            choice = choices.setdefault(delta.index, Published())
            choice.token_ids.extend(delta.token_ids)
            texts.setdefault(delta.index, []).append(delta.text)
            choice.reasoning += delta.reasoning
            for call in delta.tool_calls:
                choice.calls[call.index] = choice.calls.get(call.index, "") + call.arguments
            choice.finished = choice.finished or delta.finish_reason is not None
    for index, parts in texts.items():
        choices[index].text = "".join(parts)
    return choices


def needs_replay(req: GenerationRequest, parsed: bool = False) -> bool:
    """Whether continuing after published output needs the output replayed (see the module
    docstring): prompt extension would change what comes next. A parsed chat (``parsed``: tools or
    a reasoning parser, workers/parsing.py) is replayed too: its parser must see every token."""
    s = req.sampling
    # A chat with images is run again from its messages (the engine's processor expands each
    # image from the original placeholders, never from already expanded ids): forced, so exact.
    return (parsed or bool(req.images) or s.structured is not None or bool(s.stop) or s.presence_penalty != 0
            or s.frequency_penalty != 0 or (s.seed is not None and s.temperature > 0))


def plan_continuation(req: GenerationRequest, prior: list[Event], prompt_ids: list[int] | None,
                      parsed: bool = False) -> Continuation:
    """The continuation of ``req`` after the token events ``prior`` (all non-terminal, in order);
    ``parsed``: the engine parses its output (:func:`needs_replay`).

    Raises :class:`WorkerLost` when the job published tokens but cannot continue seamlessly.
    """
    plan = Continuation(request=req, seq=prior[-1].seq if prior else 0)
    for event in prior:
        plan.builder.add(event)
    choices = published(prior)
    plan.emitted = sum(len(c.token_ids) for c in choices.values())
    if not plan.emitted:
        return plan  # nothing but (maybe) the prompt was published: a fresh start is seamless
    s = req.sampling
    if s.beam_width > 1:  # never reached: beam search publishes nothing before its end
        raise WorkerLost("the worker running this job stopped after streaming part of a beam search")
    if prompt_ids is None:
        raise WorkerLost("the worker running this job stopped and its prompt tokens were not recorded")
    plan.prompt_tokens = len(prompt_ids)
    replay = needs_replay(req, parsed)
    if s.n == 1 and not replay:
        plan.request = _extended(req, prompt_ids, choices[0].token_ids)
        return plan
    plan.parts = []
    for index in range(s.n):
        choice = choices.get(index, Published())
        if choice.finished:
            continue
        # Seeded like vLLM's own children of an n > 1 request, so each choice keeps its stream.
        one = msgspec.structs.replace(req, sampling=msgspec.structs.replace(
            s, n=1, seed=s.seed + index if s.seed is not None and s.n > 1 else s.seed))
        if replay:
            plan.parts.append(Part(index, _from_ids(one, prompt_ids, one.sampling), tuple(choice.token_ids),
                                   choice))
        else:
            plan.parts.append(Part(index, _extended(one, prompt_ids, choice.token_ids)))
    return plan


def _from_ids(req: GenerationRequest, ids: list[int], sampling: SamplingParams) -> GenerationRequest:
    """``req`` run again from the prompt ``ids`` (a chat with images: from its messages, which
    render to the same ids; the engine needs the placeholders to place the images)."""
    prompt: dict[str, object] = {} if req.images else {"prompt": None, "messages": None, "prompt_token_ids": ids}
    return msgspec.structs.replace(
        req, **prompt,
        sampling=msgspec.structs.replace(sampling, prompt_logprobs=None),  # published with the first event
        output=msgspec.structs.replace(req.output, prompt_tokens=False),
    )


def _extended(req: GenerationRequest, prompt_ids: list[int], emitted: list[int]) -> GenerationRequest:
    """The prompt extension of one choice: its published tokens become prompt."""
    s, k = req.sampling, len(emitted)
    return _from_ids(req, prompt_ids + emitted, msgspec.structs.replace(
        s, max_tokens=max(s.max_tokens - k, 1), min_tokens=max(s.min_tokens - k, 0)))


class Replay:
    """Drops from a forced replay's output what the client already holds (``held``: its tokens,
    and its text per channel), checking that the replay reproduced it. Text is compared as
    cumulative text per channel, since incremental detokenisation (and a parser) can hold back
    text, so one token is not one piece of text."""

    def __init__(self, held: Published) -> None:
        self.held = held
        self.tokens = held.token_ids
        self.position = 0  # output tokens seen
        self.seen: dict[object, int] = {}  # characters of each channel's held text seen so far

    def trim(self, delta: TokenDelta) -> TokenDelta | None:
        """``delta`` without the replayed part (None: nothing new in it)."""
        n = len(delta.token_ids)
        skip = min(n, max(len(self.tokens) - self.position, 0))
        if list(delta.token_ids[:skip]) != list(self.tokens[self.position:self.position + skip]):
            raise WorkerLost("the continued job did not reproduce the tokens already sent")
        self.position += n
        if delta.finish_reason is not None and self.position <= len(self.tokens):
            raise WorkerLost("the continued job ended before reproducing the tokens already sent")
        text = self._cut("text", self.held.text, delta.text)
        reasoning = self._cut("reasoning", self.held.reasoning, delta.reasoning)
        calls = []
        for call in delta.tool_calls:
            if call.index not in self.held.calls:
                calls.append(call)
                continue
            call.id = call.name = None  # the client has the call's opening piece
            call.arguments = self._cut(call.index, self.held.calls[call.index], call.arguments)
            if call.arguments:
                calls.append(call)
        if not skip and text == delta.text and reasoning == delta.reasoning and calls == delta.tool_calls:
            return delta
        if not (n - skip or text or reasoning or calls or delta.finish_reason):
            return None
        delta.token_ids, delta.text, delta.reasoning, delta.tool_calls = delta.token_ids[skip:], text, reasoning, calls
        if delta.logprobs is not None:
            delta.logprobs = delta.logprobs[skip:]
        if delta.token_texts is not None:
            delta.token_texts = delta.token_texts[skip:]
        if delta.top_logprobs is not None:
            delta.top_logprobs = delta.top_logprobs[skip:]
        return delta

    def _cut(self, channel: object, held: str, piece: str) -> str:
        """``piece`` of ``channel`` without what the client holds of it (``held``)."""
        seen = self.seen.get(channel, 0)
        if seen >= len(held) or not piece:
            return piece
        cut = min(len(piece), len(held) - seen)
        if piece[:cut] != held[seen:seen + cut]:
            raise WorkerLost("the continued job did not reproduce the text already sent")
        self.seen[channel] = seen + cut
        return piece[cut:]


async def run_parts(parts: Sequence[Part], run: Callable[[Part], AsyncIterator[Step]]) -> AsyncIterator[Step]:
    """Run every part at once (``run`` streams one part's engine request, its deltas at index 0)
    and yield their steps as they come: each delta under its choice's index, replayed output
    dropped; only the step that ends the last part is ``finished``."""
    queue: asyncio.Queue[Step | Exception | None] = asyncio.Queue()  # None: a part ended

    async def pump(part: Part) -> None:
        replay = Replay(part.held) if part.replay and part.held is not None else None
        try:
            async for step in run(part):
                kept = []
                for delta in step.deltas:
                    delta.index = part.index
                    if (shown := replay.trim(delta) if replay is not None else delta) is not None:
                        kept.append(shown)
                step.deltas = kept
                queue.put_nowait(step)
        except Exception as exc:  # re-raised by the reader, in the job's task
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(part), name=f"part-{part.index}") for part in parts]
    running = unfinished = len(tasks)
    try:
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                step = item
                if step.finished:
                    unfinished -= 1
                    step.finished = unfinished == 0
                if step.deltas or step.finished:
                    yield step
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def plan_for(queue: Consumer, model: str, d: Delivery, req: GenerationRequest, parsed: bool = False
                   ) -> Continuation:
    """A fresh start, or the continuation of what earlier attempts already published (the log
    is read until Redis answers: the job cannot start without it); ``parsed``: the engine parses
    the job's output (:func:`needs_replay`)."""
    if not d.last_seq:
        return Continuation(request=req)
    delay = 0.1
    while True:
        try:
            prior = await queue.read_log(model, d.job_id)
            break
        except REDIS_DOWN as exc:
            log.warning("redis_read_failed", retry_in_s=delay, error=str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
    plan = plan_continuation(req, [e for e in prior.events if isinstance(e, Tokens)], prior.prompt_ids, parsed)
    log.info("job_continued", after_seq=plan.seq, emitted=plan.emitted,
             parts=None if plan.parts is None else [(p.index, len(p.replay)) for p in plan.parts])
    return plan
