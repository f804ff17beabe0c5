"""A stream's body chunks of one loop turn go out in one write, every stream's in one callback; a
client that is not reading holds up only its own stream."""

from __future__ import annotations

import asyncio

from api.middleware import CoalescingSend, Flusher


class Transport:
    """An ASGI ``send`` that records each message; while ``paused`` a body write waits (as a
    server's send does while its transport is paused) and records where it ran."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bool]] = []
        self.paused: asyncio.Event | None = None
        self.tasks: set[asyncio.Task | None] = set()

    async def __call__(self, message: dict) -> None:
        if self.paused is not None:
            await self.paused.wait()
        self.tasks.add(asyncio.current_task())
        self.messages.append((message.get("body", b""), message.get("more_body", False)))


def body(message: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": message, "more_body": more}


async def test_chunks_of_one_turn_are_one_write_for_every_stream_without_a_task_each():
    flusher = Flusher()
    a, b = Transport(), Transport()
    out_a, out_b = CoalescingSend(a, flusher), CoalescingSend(b, flusher)
    await out_a(body(b"1"))
    out_a.write(b"2")
    out_b.write(b"x")
    await out_b(body(b"y"))
    assert a.messages == b.messages == []  # held until the end of the turn
    await asyncio.sleep(0)
    assert a.messages == [(b"12", True)] and b.messages == [(b"xy", True)]
    assert a.tasks == b.tasks == {None}  # written in the flusher's callback, no task per stream
    await out_a(body(b"3"))
    await out_a(body(b"", more=False))  # the end waits for what is held, in order
    assert a.messages == [(b"12", True), (b"3", True), (b"", False)]


async def test_a_client_not_reading_holds_up_only_its_own_stream_in_order():
    flusher = Flusher()
    slow, fast = Transport(), Transport()
    slow.paused = asyncio.Event()
    out_slow, out_fast = CoalescingSend(slow, flusher, flush_bytes=4), CoalescingSend(fast, flusher)
    out_slow.write(b"a")
    out_fast.write(b"1")
    await asyncio.sleep(0)
    assert fast.messages == [(b"1", True)] and slow.messages == []  # its write waits in a task
    out_slow.write(b"bc")
    out_fast.write(b"2")
    await asyncio.sleep(0)
    assert fast.messages == [(b"1", True), (b"2", True)]
    assert out_slow.ready()
    out_slow.write(b"de")
    assert not out_slow.ready()  # flush_bytes wait: the producer must send and wait
    sent = asyncio.ensure_future(out_slow(body(b"f")))
    await asyncio.sleep(0.01)
    assert not sent.done()  # back-pressure reaches the producer
    slow.paused.set()
    await asyncio.wait_for(sent, 1)
    await out_slow(body(b"", more=False))
    assert b"".join(m for m, _ in slow.messages) == b"abcdef" and slow.messages[-1] == (b"", False)
