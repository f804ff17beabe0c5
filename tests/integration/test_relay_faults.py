"""Lossless relay: killing the API's pub/sub connection mid-stream loses and repeats nothing.

Several streams (OpenAI completions SSE and LMI JSON lines) run at once on the scripted stack;
``CLIENT KILL TYPE pubsub`` cuts every pub/sub connection (the API's listener, and the worker's
control channel with it) while tokens flow, or while the jobs still wait in the queue. Each
prompt is made of distinct characters, and the scripted engine emits the prompt's characters in
order, one token each, so every received token names its position: a lost or repeated token is
counted exactly, not just noticed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import pytest

from api.follow import follow
from api.listener import EventListener
from shared.codec import encode
from shared.errors import QueueUnavailable
from shared.events import Done, TokenDelta, Tokens
from shared.keys import Keys
from shared.queue import JobStore
from shared.redis import connect
from tests.support.faults import FIGURES, Figures
from tests.support.scripted_engine import ScriptedEngine, expected_text
from tests.support.scripted_stack import ScriptedStack, scripted_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.faults

TOKENS = 100
STREAM_TIMEOUT_S = 60  # a hang fails the test; a healthy run takes a few seconds


def distinct_prompt(k: int) -> str:
    """TOKENS distinct characters (CJK ideographs), different for every stream."""
    return "".join(chr(0x4E00 + k * TOKENS + i) for i in range(TOKENS))


@dataclass
class Received:
    kind: str
    prompt: str
    tokens: list[str] = field(default_factory=list)
    terminated: bool = False
    final_text: str | None = None
    first_token_at: float | None = None
    max_gap_s: float = 0.0
    _last_at: float | None = None

    def token(self, text: str) -> None:
        now = time.monotonic()
        if self._last_at is not None:
            self.max_gap_s = max(self.max_gap_s, now - self._last_at)
        self.first_token_at = self.first_token_at or now
        self._last_at = now
        # One character per scripted token; a chunk carries several when the worker's flusher
        # lagged its engine (during a fault, say): counted token by token.
        self.tokens.extend(text)

    def figures(self) -> tuple[int, int]:
        """(lost, duplicated) against the engine's known output."""
        expected = list(expected_text(self.prompt, TOKENS))
        seen: dict[str, int] = {}
        for t in self.tokens:
            seen[t] = seen.get(t, 0) + 1
        lost = sum(1 for t in expected if t not in seen)
        duplicated = sum(n - 1 for n in seen.values() if n > 1)
        return lost, duplicated


async def completions_stream(stack: ScriptedStack, out: Received) -> None:
    body = {"prompt": out.prompt, "max_tokens": TOKENS, "stream": True}
    async with stack.client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        buffer = b""
        async for chunk in resp.aiter_bytes():
            buffer += chunk
            *frames, buffer = buffer.split(b"\n\n")
            for frame in frames:
                if frame.startswith(b":"):
                    continue  # keep-alive comment
                data = frame.removeprefix(b"data: ")
                if data == b"[DONE]":
                    out.terminated = True
                    continue
                assert not out.terminated, "a frame after [DONE]"
                obj = json.loads(data)
                assert "error" not in obj, obj
                for choice in obj["choices"]:
                    if choice["text"]:
                        out.token(choice["text"])
        assert buffer == b""


async def lmi_stream(stack: ScriptedStack, out: Received) -> None:
    body = {"inputs": out.prompt, "parameters": {"max_new_tokens": TOKENS}, "stream": True}
    async with stack.client.stream("POST", "/invocations", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("application/jsonlines")
        async for line in resp.aiter_lines():
            if not line:
                continue
            assert out.final_text is None, "a line after the final one"
            obj = json.loads(line)
            assert "error" not in obj, obj
            out.token(obj["token"]["text"])
            if "generated_text" in obj:
                out.final_text = obj["generated_text"]
                out.terminated = True


async def kill_pubsub(stack: ScriptedStack) -> int:
    return await stack.redis.client_kill_filter(_type="pubsub")


async def run_streams(stack: ScriptedStack, n_each: int, kill_when) -> tuple[list[Received], list[int]]:
    streams = [Received("completions", distinct_prompt(k)) for k in range(n_each)]
    streams += [Received("lmi", distinct_prompt(n_each + k)) for k in range(n_each)]
    runners = {"completions": completions_stream, "lmi": lmi_stream}
    tasks = [asyncio.create_task(asyncio.wait_for(runners[s.kind](stack, s), STREAM_TIMEOUT_S)) for s in streams]
    kills = await kill_when(stack, streams)
    await asyncio.gather(*tasks)
    return streams, kills


def assert_complete(streams: list[Received]) -> dict[str, int]:
    totals = {"streams": len(streams), "tokens": 0, "lost": 0, "duplicated": 0}
    for s in streams:
        lost, duplicated = s.figures()
        totals["tokens"] += len(s.tokens)
        totals["lost"] += lost
        totals["duplicated"] += duplicated
        assert "".join(s.tokens) == expected_text(s.prompt, TOKENS), (s.kind, lost, duplicated)
        assert s.terminated, s.kind
        if s.kind == "lmi":
            assert s.final_text == expected_text(s.prompt, TOKENS)
    assert totals["lost"] == 0 and totals["duplicated"] == 0, totals
    return totals


def report(name: str, totals: dict[str, int], kills: list[int], streams: list[Received]) -> None:
    stall = max(s.max_gap_s for s in streams)
    FIGURES.append(Figures(
        scenario=f"pubsub_kill_{name}_x{len(kills)}", requests_sent=len(streams),
        completed=sum(1 for s in streams if s.terminated), tokens_lost=totals["lost"],
        tokens_duplicated=totals["duplicated"], seconds={"longest_stall_s": stall},
    ))
    print(f"\n[relay-faults] {name}: streams={totals['streams']} tokens={totals['tokens']} "
          f"kills={len(kills)} connections_killed={sum(kills)} lost={totals['lost']} "
          f"duplicated={totals['duplicated']} longest_stall_s={stall:.2f}")


async def _until(predicate, timeout_s: float = 30.0) -> None:
    await eventually(predicate, timeout_s=timeout_s, interval_s=0.01, what="the streams to progress")


@pytest.mark.parametrize("kill_count", [1, 2])
async def test_pubsub_kill_mid_stream_loses_and_repeats_nothing(redis_url, prefix, kill_count):
    async def kill_mid_stream(stack: ScriptedStack, streams: list[Received]) -> list[int]:
        kills = []
        for i in range(kill_count):
            # Every stream has tokens and none is done: the kill lands mid-stream for all of them.
            threshold = TOKENS * (i + 1) // (kill_count + 2)
            await _until(lambda t=threshold: all(len(s.tokens) >= t for s in streams))
            assert all(not s.terminated for s in streams)
            kills.append(await kill_pubsub(stack))
            assert kills[-1] >= 1
        return kills

    async with scripted_stack(redis_url, prefix, ScriptedEngine(delay_s=0.02)) as stack:
        streams, kills = await run_streams(stack, 3, kill_mid_stream)
    totals = assert_complete(streams)
    report("mid_stream", totals, kills, streams)


async def test_pubsub_kill_while_jobs_are_queued(redis_url, prefix):
    """Two engine slots, eight streams: six jobs wait in the queue (subscribed, no token yet)
    when the connection dies; their first token comes after the reconnect."""
    async def kill_while_queued(stack: ScriptedStack, streams: list[Received]) -> list[int]:
        await _until(lambda: sum(1 for s in streams if s.tokens) >= 2)
        waiting = [s for s in streams if not s.tokens]
        kills = [await kill_pubsub(stack)]
        assert len(waiting) >= 4, "expected jobs still queued at the kill"
        # And once more while the last ones still wait.
        await _until(lambda: sum(1 for s in streams if s.terminated) >= 2)
        if any(not s.tokens for s in streams):
            kills.append(await kill_pubsub(stack))
        return kills

    engine = ScriptedEngine(delay_s=0.01)
    async with scripted_stack(redis_url, prefix, engine, max_num_seqs=2) as stack:
        streams, kills = await run_streams(stack, 4, kill_while_queued)
    totals = assert_complete(streams)
    report("queued", totals, kills, streams)


# --- the kill window, made deterministic --------------------------------------------------------


async def test_event_published_during_the_kill_is_backfilled_at_once(redis_url, prefix):
    """One MULTI kills the pub/sub connections and logs + publishes the job's last events, so
    those live messages are lost for sure (nobody is subscribed at that instant). redis-py
    reconnects and re-subscribes by itself; the listener must then make its subscribers read
    the log, so the stream ends at once, not at the next periodic log check (30 s here)."""
    redis = connect(redis_url)
    keys = Keys(prefix)
    queue = JobStore(redis, keys)
    listener = EventListener(redis, keys.api_home("test"))
    runner = asyncio.create_task(listener.run())
    model, job_id = "tiny", "job1"
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[97], text="a")]),
              Tokens(seq=2, deltas=[TokenDelta(token_ids=[98], text="b")]),
              Done(seq=3, deltas=[TokenDelta(token_ids=[99], text="c", finish_reason="length")])]

    def log_and_publish(pipe, event) -> None:
        data = encode(event)
        pipe.xadd(keys.events(model, job_id), {"e": data}, id=f"{event.seq}-0")
        pipe.publish(keys.live(model, job_id), data)

    try:
        async with listener.subscribe(keys.live(model, job_id)) as live:
            got = []
            stream = follow(queue, live, model, job_id, check_log_s=30.0)
            pipe = redis.pipeline(transaction=True)
            log_and_publish(pipe, events[0])
            await pipe.execute()
            got.append(await asyncio.wait_for(anext(stream), 5))
            pipe = redis.pipeline(transaction=True)
            pipe.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            for event in events[1:]:
                log_and_publish(pipe, event)
            replies = await pipe.execute()
            assert replies[0] >= 1 and replies[2] == 0, replies  # killed; nobody heard seq 2
            started = time.monotonic()
            async for event in stream:
                got.append(event)
                assert time.monotonic() - started < 5, "the lost events waited for the periodic log check"
            print(f"\n[relay-faults] kill window: lost live messages backfilled in {time.monotonic() - started:.3f}s")
            assert [e.seq for e in got] == [1, 2, 3]
            assert isinstance(got[-1], Done)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await redis.aclose()


async def test_a_silent_pubsub_connection_is_replaced_and_backfilled(redis_url, prefix):
    """A half-open connection (the server's host vanished: no FIN, no RST) never fails a read.
    The listener PINGs a connection quiet for ``idle_s`` and replaces it when the PING goes
    unanswered too; its subscribers then read the log, so the stream ends within about two quiet
    windows, not at the next periodic log check (30 s here)."""
    host, port = redis_url.split("//")[1].split("/")[0].split(":")
    links: list[dict] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: dict) -> None:
        while data := await reader.read(65536):
            while link["dark"]:
                await asyncio.sleep(0.01)  # held for good: a link that went dark
            writer.write(data)
            await writer.drain()

    handlers: list[asyncio.Task] = []

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())
        server_r, server_w = await asyncio.open_connection(host, int(port))
        link = {"dark": False}
        links.append(link)
        try:
            await asyncio.gather(pipe(client_r, server_w, link), pipe(server_r, client_w, link),
                                 return_exceptions=True)
        finally:  # a dark link's pipes never end by themselves: the test's end cancels them
            for writer in (client_w, server_w):
                writer.close()

    proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
    proxy_port = proxy.sockets[0].getsockname()[1]
    redis = connect(redis_url)
    proxied = connect(redis_url.replace(f"{host}:{port}", f"127.0.0.1:{proxy_port}"))
    keys = Keys(prefix)
    queue = JobStore(redis, keys)
    listener = EventListener(proxied, keys.api_home("test"), idle_s=0.3)
    runner = asyncio.create_task(listener.run())
    model, job_id = "tiny", "silent"
    events = [Tokens(seq=1, deltas=[TokenDelta(token_ids=[97], text="a")]),
              Tokens(seq=2, deltas=[TokenDelta(token_ids=[98], text="b")]),
              Done(seq=3, deltas=[TokenDelta(token_ids=[99], text="c", finish_reason="length")])]

    async def log_and_publish(event) -> None:
        data = encode(event)
        pipe = redis.pipeline(transaction=True)
        pipe.xadd(keys.events(model, job_id), {"e": data}, id=f"{event.seq}-0")
        pipe.publish(keys.live(model, job_id), data)
        await pipe.execute()

    try:
        async with listener.subscribe(keys.live(model, job_id)) as live:
            stream = follow(queue, live, model, job_id, check_log_s=30.0)
            await log_and_publish(events[0])
            got = [await asyncio.wait_for(anext(stream), 5)]
            for link in links:
                link["dark"] = True
            for event in events[1:]:
                await log_and_publish(event)  # delivered to the dark link: never arrives
            started = time.monotonic()
            async for event in stream:
                got.append(event)
                assert time.monotonic() - started < 5, "a silent connection was not detected"
            print(f"\n[relay-faults] silent pub/sub connection replaced and backfilled in "
                  f"{time.monotonic() - started:.3f}s")
            assert [e.seq for e in got] == [1, 2, 3]
            assert len(links) >= 2  # a new connection replaced the dark one
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        proxy.close()
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await redis.aclose()
        await proxied.aclose()


async def test_a_channel_subscribed_before_the_listener_connects_is_confirmed_once_it_does(redis_url, prefix):
    """``subscribe(wait=False)`` only sends the SUBSCRIBE; with no connection yet, the listener's
    connect subscribes every channel it holds, and ``confirmed`` returns once Redis confirmed
    it (before that it is a 503, never a hang)."""
    redis = connect(redis_url)
    keys = Keys(prefix)
    listener = EventListener(redis, keys.api_home("early"))
    channel = keys.live("tiny", "early")
    runner = None
    try:
        async with listener.subscribe(channel, wait=False) as live:
            with pytest.raises(QueueUnavailable):
                await listener.confirmed(channel, timeout_s=0.2)
            runner = asyncio.create_task(listener.run())
            await listener.confirmed(channel, timeout_s=5)
            assert await redis.publish(channel, b"x") == 1
            assert await asyncio.wait_for(live.get(), 5) == b"x"
    finally:
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await redis.aclose()
