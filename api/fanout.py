"""One client request, several jobs: OpenAI's list of prompts, LMI's dynamic batch.

Each prompt is its own job (so workers batch them like any other), and their events are merged
back into one stream whose choice indexes run across the jobs: job ``j``'s choice ``i`` becomes
``j * n + i``, as vLLM numbers them. The merged stream ends with one ``Done`` carrying the summed
usage, or with the first ``Error``. A job's prompt info rides on its first event, whose deltas
tell which job it belongs to.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from api.relay import Keepalive, collect
from api.services import Services
from api.submit import Submission, submit
from shared.events import Done, Error, Event, TokenDelta, Tokens
from shared.schemas import GenerationRequest, JobResult, Usage

__all__ = ["submit_all", "merge", "collect_all"]


async def submit_all(svc: Services, reqs: list[GenerationRequest], *, keepalive: bool = False) -> list[Submission]:
    subs: list[Submission] = []
    try:
        for req in reqs:
            subs.append(await submit(svc, req, keepalive=keepalive and not subs))
    except BaseException:
        for sub in subs:
            await sub.events.aclose()  # type: ignore[attr-defined]
        raise
    return subs


def _shift(deltas: list[TokenDelta], offset: int) -> list[TokenDelta]:
    if not offset:
        return deltas
    return [msgspec.structs.replace(d, index=d.index + offset) for d in deltas]


async def merge(subs: list[Submission], n: int) -> AsyncIterator[Event | Keepalive]:
    """The jobs' events as one job's: interleaved as they arrive, indexes shifted, one terminal."""
    if len(subs) == 1:
        async for item in subs[0].events:
            yield item
        return
    inbox: asyncio.Queue[tuple[int, Event | Keepalive]] = asyncio.Queue()

    async def pump(j: int, events: AsyncIterator[Event | Keepalive]) -> None:
        async for item in events:
            await inbox.put((j, item))

    tasks = [asyncio.create_task(pump(j, sub.events)) for j, sub in enumerate(subs)]
    usage, open_jobs, seq = Usage(), len(subs), 0
    try:
        while open_jobs:
            j, item = await inbox.get()
            if isinstance(item, Keepalive):
                if j == 0:  # one keep-alive source is enough
                    yield item
                continue
            if isinstance(item, Error):
                yield item
                return
            seq += 1
            deltas = _shift(item.deltas, j * n)
            if item.prompt is not None and not deltas:
                deltas = [TokenDelta(index=j * n)]  # so the reader can tell whose prompt this is
            if isinstance(item, Done):
                open_jobs -= 1
                usage.prompt_tokens += item.usage.prompt_tokens
                usage.completion_tokens += item.usage.completion_tokens
                if not open_jobs:
                    yield Done(seq=seq, deltas=deltas, prompt=item.prompt, usage=usage, timings=item.timings)
                    return
            yield Tokens(seq=seq, deltas=deltas, prompt=item.prompt)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in subs:
            await sub.events.aclose()  # type: ignore[attr-defined]


async def collect_all(subs: list[Submission]) -> list[JobResult]:
    """Every job's result, in order; the first failure is raised and the rest are let go."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(collect(sub.events)) for sub in subs]
    except* Exception as group:
        raise group.exceptions[0] from None
    finally:
        for sub in subs:
            await sub.events.aclose()  # type: ignore[attr-defined]
    return [task.result() for task in tasks]
