"""Redis's refusals (shared/redis.py ``refusal``), LLMQ_DURABILITY's grammar (``replicas_of``), and
the memory guard's sampling (shared/redis_memory.py) against the session's real redis-server."""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlparse

import pytest
from redis._parsers.base import BaseParser
from redis.asyncio.connection import Connection
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
)

from shared.durability import Durability, replicas_of
from shared.redis import REDIS_DOWN, NoReplicasError, RedisRefused, _handshake, refusal
from shared.redis_memory import SAMPLE_EVERY_S, MemoryGuard

# The texts Redis sends (redis-py strips the leading '-' and, for a known error code, the class
# keeps the whole text). Inside a script, 6.2 wraps the refusal in its own ResponseError.
OOM = "OOM command not allowed when used memory > 'maxmemory'."
SCRIPT_OOM = ("Error running script (call to f_0123456789abcdef0123456789abcdef01234567): @user_script:64: "
              "@user_script: 64: -OOM command not allowed when used memory > 'maxmemory'. ")
READONLY = "You can't write against a read only replica."
NOREPLICAS = "NOREPLICAS Not enough good replicas to write."


@pytest.mark.parametrize("exc", [
    OutOfMemoryError(OOM),
    ReadOnlyError(READONLY),
    ResponseError(SCRIPT_OOM),
    ResponseError(NOREPLICAS),
    ResponseError("Error running script (call to f_0): @user_script:1: -NOREPLICAS Not enough good replicas"),
    ResponseError("READONLY You can't write against a read only replica."),
], ids=["oom", "readonly", "script-oom-6.2", "noreplicas", "script-noreplicas", "readonly-text"])
def test_refusals_are_redis_refused(exc):
    refused = refusal(exc)
    assert isinstance(refused, RedisRefused)
    assert str(refused) == str(exc)
    # A ConnectionError: every `except REDIS_DOWN` retries it as an outage.
    assert isinstance(refused, RedisConnectionError) and isinstance(refused, REDIS_DOWN)
    assert refusal(refused) is refused


@pytest.mark.parametrize(("reply", "kind"), [
    ("OOM command not allowed when used memory > 'maxmemory'.", OutOfMemoryError),
    ("READONLY You can't write against a read only replica.", ReadOnlyError),
    ("NOREPLICAS Not enough good replicas to write.", NoReplicasError),
])
def test_a_plain_commands_refusal_is_parsed_into_redis_down(reply, kind):
    """redis-py's parser strips the code (so the text no longer says NOREPLICAS): the class says
    it, and a plain command's refusal is one of REDIS_DOWN, as a loop's outage handling expects."""
    exc = BaseParser.parse_error(reply)
    assert type(exc) is kind and isinstance(exc, REDIS_DOWN)
    assert isinstance(refusal(exc), RedisRefused)


@pytest.mark.parametrize("exc", [
    ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    ResponseError("Error running script (call to f_0): @user_script:3: user_script:3: bad argument"),
    NoScriptError("No matching script. Please use EVAL."),
    ResponseError("ERR unknown command 'FOO'"),
    RedisConnectionError("Connection refused"),
    ValueError(OOM),  # the words, but not from Redis
], ids=["wrongtype", "script-bug", "noscript", "unknown-command", "connection", "not-redis"])
def test_other_errors_are_no_refusal(exc):
    assert refusal(exc) is None


@pytest.mark.parametrize(("mode", "replicas"), [
    ("none", 0), ("NONE", 0), (" none ", 0), ("fsync", 0), ("replicas:1", 1), ("replicas:2", 2), ("Replicas:12", 12),
])
def test_replicas_of_good_modes(mode, replicas):
    assert replicas_of(mode) == replicas


@pytest.mark.parametrize(("mode", "command"), [
    ("none", ("WAIT", 0, 500)), ("replicas:2", ("WAIT", 2, 500)), ("fsync", ("WAITAOF", 1, 0, 500)),
])
def test_each_mode_waits_with_its_own_command(mode, command):
    durability = Durability.of(mode, 500)
    assert durability.command() == command
    assert durability.wanted == (0 if mode == "none" else command[1])


@pytest.mark.parametrize("mode", [
    "", "fsync:1", "replicas", "replicas:", "replicas:0", "replicas:-1", "replicas:01", "replicas:1.5",
    "replicas: 1", "replicas:x", "replica:1", "none,replicas:1",
])
def test_replicas_of_bad_modes(mode):
    with pytest.raises(ValueError, match="LLMQ_DURABILITY"):
        replicas_of(mode)


async def _fill(redis, key: str, size: int) -> None:
    chunk = b"x" * 65536
    async with redis.pipeline(transaction=False) as pipe:
        for _ in range(size // len(chunk) + 1):
            pipe.append(key, chunk)
        await pipe.execute()


async def test_memory_guard_samples_at_most_every_half_second(redis, prefix):
    """With no maxmemory the share is 0 and everything is admitted; with a limit, the share is
    read from INFO and cached for SAMPLE_EVERY_S, and concurrent callers share one sample."""
    before = (await redis.config_get("maxmemory"))["maxmemory"]
    filler = f"{prefix}:filler"
    try:
        await redis.config_set("maxmemory", 0)
        guard = MemoryGuard(redis, 0.5)
        assert await guard.used(filler) == 0.0 and await guard.admits(filler)

        used = int((await redis.info("memory"))["used_memory"])
        await redis.config_set("maxmemory", used * 4)  # about a quarter used
        guard = MemoryGuard(redis, 0.5)
        first = await guard.used(filler)
        assert 0.1 < first < 0.5 and await guard.admits(filler)
        sampled_at = time.monotonic()
        # Fill past the watermark: the cached sample still says a quarter until it is stale.
        await _fill(redis, filler, used * 2)
        shares = await asyncio.gather(*(guard.used(filler) for _ in range(20)))
        if time.monotonic() - sampled_at < SAMPLE_EVERY_S:
            assert set(shares) == {first}
        await asyncio.sleep(SAMPLE_EVERY_S + 0.05)
        calls = await asyncio.gather(*(guard.used(filler) for _ in range(20)))
        assert len(set(calls)) == 1 and calls[0] > 0.5  # one fresh sample, shared
        assert not await guard.admits(filler)
        assert MemoryGuard(redis, 1.0).watermark >= 1 and await MemoryGuard(redis, 1.0).admits(filler)
        await redis.delete(filler)
        assert not await guard.admits(filler)  # still the cached sample
        await asyncio.sleep(SAMPLE_EVERY_S + 0.05)
        assert await guard.admits(filler)
    finally:
        await redis.delete(filler)
        await redis.config_set("maxmemory", before)


async def test_a_connection_closed_during_its_handshake_is_a_lost_connection(redis_url):
    """A Cluster client closing every connection to re-read its slots can close one between its
    open and its handshake's first write: redis-py then fails with an AttributeError (a 500 in a
    Cluster failover); llmq's handshake raises it as the lost connection it is."""

    class ClosedUnderfoot(Connection):
        closed = False

        async def _send_packed_command(self, command):  # the first write of the handshake
            if not self.closed:
                self.closed = True
                await self.disconnect()
            await super()._send_packed_command(command)

    url = urlparse(redis_url)
    conn = ClosedUnderfoot(host=url.hostname, port=url.port, redis_connect_func=_handshake, socket_timeout=5)
    with pytest.raises(RedisConnectionError, match="closed while it was being opened"):
        await conn.connect()
    await conn.disconnect()
