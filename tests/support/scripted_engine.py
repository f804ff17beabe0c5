"""Scripted engines for queue-layer tests: deterministic tokens, no model. Every fake engine in
the tests is a :class:`ScriptedEngine`.

:class:`ScriptedEngine` keeps the books (which jobs and requests reached it, how many ran at
once, what was aborted) and runs a continued job's parts through the real
:func:`workers.continuation.run_parts`, as ``workers.engine.VllmEngine`` does; a subclass scripts
one engine request's tokens by overriding :meth:`ScriptedEngine.steps`. Its own script produces
``max_tokens`` tokens whose text is the prompt's characters cycled, so a test knows exactly what
every stream must contain. The prompt ``fail`` is refused before any token; ``break`` fails after
its first token. A job marked ``kill-engine`` (``test_fault``) fails the engine's step after its
first token, as workers/faults.py makes real vLLM's do; :meth:`ScriptedEngine.die` kills it from
outside, and :meth:`ScriptedEngine.restart` brings it back. Never the only test of a user path:
the e2e suite runs the same paths on real vLLM.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import msgspec

from shared.errors import EngineDead, GenerationFailed, InvalidRequest
from shared.events import TokenDelta
from shared.schemas import GenerationRequest, Pooled, PromptInfo
from workers.continuation import run_parts
from workers.protocol import AdapterState, Death, Part, Step, drain

__all__ = ["ScriptedEngine", "CappedEngine", "ContextEngine", "expected_text", "expected_ids", "next_token"]


def expected_text(prompt: str, max_tokens: int) -> str:
    return "".join(prompt[i % len(prompt)] for i in range(max_tokens))


class ScriptedEngine:
    forces_replay = False
    """Whether :meth:`steps` forces ``replay`` (a continued job's published tokens); an engine
    that cannot refuses such a job rather than ignore its replay."""

    def __init__(self, delay_s: float = 0.0, *, hands_from_loop: bool = False) -> None:
        self.delay_s = delay_s
        self.hands_from_loop = hands_from_loop
        """:meth:`run` hands each step over from a task of its own, as the real engine's loop does,
        not from the job's task."""
        self.aborted: list[str] = []
        self.started: list[str] = []  # job ids in the order they reached the engine
        self.requests: list[GenerationRequest] = []  # their requests, the warm-up's first
        self.parts: list[list[Part]] = []  # the parts of each continued job that came in parts
        self.trace_headers: list[Mapping[str, str] | None] = []  # what each job's engine request was given
        self.images: list[Mapping[str, Any] | None] = []  # the decoded images each was given
        self.active = 0
        self.peak_active = 0  # most jobs generating at once: what the engine's slots bound
        self.log: list[tuple[str, str]] = []
        """What the engine did, in order: ("start", job id) when a job's stream begins, ("end", job
        id) when it ends however it ends, ("abort", job id), ("death", cause), ("restart", ""). Tests
        that pin an order of events read it instead of clocks, which a loaded machine stretches."""
        self.deaths: list[Death] = []  # each death's cause, in order
        self._yielded: set[str] = set()  # jobs that had a step out of the engine
        self.restarts = 0
        self.restart_s = 0.0  # how long a rebuild takes
        self._dead: Death | None = None

    def die(self, cause: Death = "killed") -> None:
        """The engine dies now: every stream raises EngineDead at its next step."""
        if self._dead is None:
            self._dead = cause
            self.deaths.append(cause)
            self.log.append(("death", cause))

    def dead(self) -> bool:
        return self._dead is not None

    async def death(self) -> Death:
        return self._dead or "killed"

    async def restart(self) -> None:
        assert self._dead is not None, "only a dead engine is rebuilt"
        await asyncio.sleep(self.restart_s)
        self._dead = None
        self.restarts += 1
        self.log.append(("restart", ""))

    async def stream(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
                     trace_headers: Mapping[str, str] | None = None, images: Mapping[str, Any] | None = None
                     ) -> AsyncIterator[Step]:
        self.started.append(job_id)
        self.log.append(("start", job_id))
        self.trace_headers.append(trace_headers)
        self.images.append(images)
        self.requests.append(req)
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            if parts is None:
                steps = self.steps(job_id, req)
            else:
                if not self.forces_replay and any(part.replay for part in parts):
                    raise NotImplementedError(f"{type(self).__name__} cannot force a replay")
                self.parts.append(list(parts))
                steps = run_parts(parts, lambda part: self.steps(job_id, part.request, part.replay))
            killer = req.test_fault == "kill-engine"
            async with contextlib.aclosing(steps):
                async for step in steps:
                    if killer and any(d.token_ids for d in step.deltas) and job_id in self._yielded:
                        self.die("failed")  # its step raised: the whole engine with it
                    if self._dead is not None:
                        raise EngineDead(f"scripted engine death ({self._dead})")
                    self._yielded.add(job_id)
                    yield step
        finally:
            self.active -= 1
            self._yielded.discard(job_id)
            self.log.append(("end", job_id))

    async def run(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
                  trace_headers: Mapping[str, str] | None = None, images: Mapping[str, Any] | None = None, *,
                  on_step: Callable[[Step], None]) -> None:
        if not self.hands_from_loop:
            await drain(self.stream(job_id, req, parts, trace_headers, images), on_step)
            return
        # As workers/engine_loop.py does: from a task of the engine's own, in a context of its own,
        # each step handed over in the caller's.
        caller = contextvars.copy_context()
        steps = drain(self.stream(job_id, req, parts, trace_headers, images),
                      lambda step: caller.run(on_step, step))
        loop = asyncio.get_running_loop().create_task(steps, context=contextvars.Context())
        try:
            await asyncio.shield(loop)
        except asyncio.CancelledError:
            loop.cancel()
            raise

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        """One engine request's steps: the hook a subclass overrides. ``replay``: output tokens to
        force first (only when :attr:`forces_replay`)."""
        if req.pooling is not None:  # one step: per input a scripted vector (its length, then 1s)
            await asyncio.sleep(self.delay_s)  # or score (its length over 8)
            inputs = req.pooling.texts or req.pooling.token_ids
            width = 1 if req.pooling.task == "score" else req.pooling.dimensions or 4
            rows = [[len(x) / 8] if width == 1 else [float(len(x)), *[1.0] * (width - 1)] for x in inputs]
            yield Step(deltas=[], finished=True, prompt_tokens=sum(len(x) for x in inputs),
                       pooled=Pooled(data=array.array("f", [v for row in rows for v in row]).tobytes(), width=width))
            return
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

    def parses(self, req: GenerationRequest) -> bool:
        return False  # scripted output is never parsed

    def adapter_state(self) -> AdapterState:
        return AdapterState()  # a scripted engine loads no adapter: its adapter jobs are nobody's

    async def abort(self, job_id: str) -> None:
        self.aborted.append(job_id)
        self.log.append(("abort", job_id))


class CappedEngine(ScriptedEngine):
    """At most a few tokens per job, whatever max_tokens says: fuzzed bodies ask for thousands."""

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        sampling = msgspec.structs.replace(req.sampling, max_tokens=min(req.sampling.max_tokens, 4))
        async for step in super().steps(job_id, msgspec.structs.replace(req, sampling=sampling), replay):
            yield step


def next_token(context: list[int]) -> int:
    return 97 + (sum(context[-3:]) * 7 + len(context)) % 26


def expected_ids(prompt: str, n: int) -> list[int]:
    """What :class:`ContextEngine` generates for ``prompt``, ``n`` tokens, in one run."""
    ids = [ord(c) for c in prompt]
    for _ in range(n):
        ids.append(next_token(ids))
    return ids[len(prompt):]


class ContextEngine(ScriptedEngine):
    """Deterministic in its whole context: each next token is a function of every token before
    it (like greedy decoding), so a job continued from "prompt + published tokens" must produce
    exactly what an uninterrupted run produces. Reports the prompt's token ids on the first step,
    as the real engine does, so a peer can continue the job."""

    def __init__(self, delay_s: float, die_after: int | None = None) -> None:
        super().__init__(delay_s)
        self.die_after = die_after  # tokens of a job after which the engine dies, once (killed)

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        ids = list(req.prompt_token_ids) if req.prompt_token_ids is not None else [ord(c) for c in req.prompt or ""]
        prompt_len, n = len(ids), req.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(self.delay_s)
            if self.die_after is not None and i == self.die_after and not job_id.startswith("warmup-"):
                self.die_after = None
                self.die("killed")
            ids.append(next_token(ids))
            last = i == n - 1
            delta = TokenDelta(token_ids=[ids[-1]], text=chr(ids[-1]), finish_reason="length" if last else None)
            yield Step(deltas=[delta], finished=last, prompt_tokens=prompt_len,
                       prompt_token_ids=ids[:prompt_len] if i == 0 else None)
