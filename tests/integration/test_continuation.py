"""A dead worker's job with several choices continues on a peer, each choice from its own tokens
(real Redis, real runner and relay, a scripted engine; tests/e2e/test_crash_continuation.py runs
the same on vLLM).

The engine is deterministic in each choice's whole output, like vLLM's samplers: a seeded choice
draws from its own seed (the parent's + its index, as vLLM seeds children) at every output
position, so only a forced replay of its published tokens continues it, never a prompt extension;
an unseeded choice differs from its siblings by its first token only, so a prompt extension
continues it exactly. Steps carry several tokens (vLLM coalesces too), a different number on
each worker, so a replay's steps straddle the published tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from shared.events import Done, Error, TokenDelta, Tokens
from shared.keys import GROUP
from shared.schemas import GenerationRequest
from tests.support import inprocess_workers
from tests.support.inprocess_workers import MODEL, Client, kill, running_on
from tests.support.scripted_engine import ScriptedEngine
from workers.protocol import Step

make_worker = inprocess_workers.make_worker  # in-process workers on real Redis


def child_seed(seed: int | None, n: int, child: int) -> int | None:
    return None if seed is None else seed + child if n > 1 else seed


def choice_token(context: list[int], seed: int | None, child: int, position: int) -> int:
    salt = seed + position if seed is not None else (child if position == 0 else 0)
    return 97 + (sum(context[-3:]) * 7 + len(context) + salt) % 26


def expected(prompt: str, n: int, max_tokens: int, seed: int | None) -> list[list[int]]:
    choices = []
    for child in range(n):
        context, out = [ord(c) for c in prompt], []
        for position in range(max_tokens):
            out.append(choice_token(context, child_seed(seed, n, child), child, position))
            context.append(out[-1])
        choices.append(out)
    return choices


class ChoiceEngine(ScriptedEngine):
    """``per_step`` tokens of every choice per step; a part's replay is forced, as
    workers/forcing.py forces it inside vLLM. The parts of each continued job it ran are in
    ``parts`` (ScriptedEngine runs them through the real ``run_parts``)."""

    forces_replay = True

    def __init__(self, per_step: int, delay_s: float) -> None:
        super().__init__(delay_s)
        self.per_step = per_step

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        s = req.sampling
        prompt = list(req.prompt_token_ids) if req.prompt_token_ids is not None else [ord(c) for c in req.prompt or ""]
        contexts = [list(prompt) for _ in range(s.n)]
        seeds = [child_seed(s.seed, s.n, child) for child in range(s.n)]
        for start in range(0, s.max_tokens, self.per_step):
            await asyncio.sleep(self.delay_s)
            end = min(start + self.per_step, s.max_tokens)
            deltas = []
            for child, context in enumerate(contexts):
                ids = []
                for position in range(start, end):
                    ids.append(replay[position] if position < len(replay)
                               else choice_token(context, seeds[child], child, position))
                    context.append(ids[-1])
                deltas.append(TokenDelta(index=child, token_ids=ids, text="".join(map(chr, ids)),
                                         finish_reason="length" if end == s.max_tokens else None))
            yield Step(deltas=deltas, finished=end == s.max_tokens, prompt_tokens=len(prompt),
                       prompt_token_ids=prompt if start == 0 else None)


@pytest.mark.parametrize("seed", [None, 5], ids=["unseeded-extension", "seeded-replay"])
async def test_a_dead_workers_choices_each_continue_on_a_peer_as_one_run(make_worker, redis, keys, seed):
    n, max_tokens = 3, 60
    a = await make_worker(engine=ChoiceEngine(per_step=3, delay_s=0.03))
    client = Client(redis, a.queue)
    job_id = await client.start("crash me", max_tokens, n=n, **({} if seed is None else {"seed": seed}))
    await running_on(a.queue, job_id, a.worker, min_tokens=4)
    b = await make_worker(engine=ChoiceEngine(per_step=2, delay_s=0.005))
    await kill(a)
    events = await client.finish()

    want = expected("crash me", n, max_tokens, seed)
    assert [e.seq for e in events] == list(range(1, len(events) + 1)) and isinstance(events[-1], Done)
    assert not any(isinstance(e, Error) for e in events)
    got: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for e in events:
        for delta in e.deltas if isinstance(e, (Tokens, Done)) else []:
            got.setdefault(delta.index, []).extend(delta.token_ids)
            text[delta.index] = text.get(delta.index, "") + delta.text
            if delta.finish_reason:
                finishes.setdefault(delta.index, []).append(delta.finish_reason)
    assert [got[i] for i in range(n)] == want, "each choice: nothing lost, repeated or changed"
    assert [text[i] for i in range(n)] == ["".join(map(chr, w)) for w in want]
    assert finishes == {i: ["length"] for i in range(n)}, "each choice finishes exactly once"
    assert events[-1].usage.completion_tokens == n * max_tokens and events[-1].usage.prompt_tokens == len("crash me")

    (parts,) = b.worker.engine.parts  # the peer ran one request per choice, not the job afresh
    assert [p.index for p in parts] == list(range(n)) and all(p.request.sampling.n == 1 for p in parts)
    if seed is None:
        assert all(not p.replay for p in parts), "unseeded: each choice continues by prompt extension"
        out = [p.request.prompt_token_ids[len("crash me"):] for p in parts]
    else:
        assert [p.request.sampling.seed for p in parts] == [seed, seed + 1, seed + 2]
        assert all(p.request.prompt_token_ids == [ord(c) for c in "crash me"] for p in parts)
        out = [list(p.replay) for p in parts]
    assert all(0 < len(o) < max_tokens and o == want[i][:len(o)] for i, o in enumerate(out)), "killed mid-stream"
    job = await b.queue.get_job(MODEL, job_id)
    assert job.status == "done" and job.attempt == 2 and job.worker == b.worker.worker_id
    assert [c.token_ids for c in job.result.choices] == want
    assert (await redis.xpending(keys.queue(MODEL), GROUP))["pending"] == 0
