"""``python -m workers``: one worker process owning one vLLM engine.

Settings (and the tracer, with tracing on) are loaded here and passed down; an AsyncExitStack owns
the Redis client, the engine and the tracer.
SIGTERM/SIGINT start a graceful drain; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING

import structlog
import uvloop

from shared.config import Settings, SettingsError, load_tracing, settings_or_exit
from shared.durability import check_server
from shared.keys import Keys
from shared.logging import configure_logging
from shared.queue import Consumer
from shared.redis import connect, wait_for_redis
from shared.redis_memory import EvictingRedis, check_policy
from workers import lora_fixes  # no vLLM import
from workers.claim import prepare_host
from workers.environment import apply_tracing_environment
from workers.lifeline import bind_children

if TYPE_CHECKING:
    from shared.tracing import Tracing


async def serve(settings: Settings, tracing: Tracing | None = None) -> None:
    log = structlog.get_logger()
    claim = prepare_host(settings, os.environ)
    model_path = settings.model_path

    async with AsyncExitStack() as stack:
        stack.callback(claim.release)  # last out: the device stays claimed until the engine is gone
        traces_endpoint = None
        if tracing is not None:
            stack.callback(tracing.shutdown)  # after the drain: the last attempts' spans go out
            # Before vLLM starts: its spans go out through our provider, in our protocol.
            tracing.make_global()
            if settings.engine_tracing:
                traces_endpoint = apply_tracing_environment(os.environ)
        redis = connect(settings.redis_dsn, block_ms=settings.block_ms)
        stack.push_async_callback(redis.aclose)
        await wait_for_redis(redis, what="worker")
        durability = settings.acknowledgement
        try:
            await check_policy(redis, allow_eviction=settings.redis_allow_eviction, process="worker")
            await check_server(redis, durability)
        except EvictingRedis:  # logged, naming the nodes
            raise SystemExit(1) from None
        except ValueError as exc:
            log.error("redis_unfit", error=str(exc))
            raise SystemExit(1) from None

        from workers.engine import VllmEngine  # heavy import: only once Redis is known good
        from workers.media import model_info
        from workers.runner import Worker
        from workers.vision import image_cost

        bind_children()  # a SIGKILLed worker takes its engine process with it
        log.info("engine_loading", model=model_path)
        # VLLM_PLUGINS is vLLM's own variable, read as vLLM will read it in the engine's processes.
        if settings.max_loras and (missing := lora_fixes.not_loaded(os.environ)):
            # vLLM runs without them: prompt logprobs beside other requests would kill its engine
            # (docs/adapters.md#prompt-logprobs-with-lora).
            log.warning("lora_fixes_not_loaded", missing=missing)
        try:
            engine = VllmEngine.build(settings, model_path, traces_endpoint)
        except SettingsError as exc:  # the model refused them (a context longer than its own): one line, no traceback
            log.error("engine_settings_invalid", error=str(exc))
            raise SystemExit(1) from None
        stack.callback(engine.shutdown)

        queue = Consumer(redis, Keys(settings.prefix), result_ttl_s=settings.result_ttl_s,
                         usage_days=settings.usage_days, durability=durability)
        info = model_info(engine.multimodal, image_cost(model_path), settings.kind)
        worker = Worker(settings, queue, engine, device=claim.label, devices=claim.devices, tracing=tracing,
                        info=info, freeze_heap=settings.gc_freeze)
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            if worker.stopping:
                raise SystemExit(1)
            log.info("worker_stopping", worker=worker.worker_id)
            worker.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await worker.run()
        log.info("worker_stopped", worker=worker.worker_id, failed=worker.failed)
    if worker.failed:
        raise SystemExit(1)


def main() -> None:
    settings = settings_or_exit()
    configure_logging(settings.log_level, settings.log_json, log_requests=settings.log_requests)
    tracing = load_tracing("llmq-worker", "worker")
    # uvloop, as uvicorn runs the API and vLLM runs its own server: the worker's loop carries the
    # engine's output handler and every token's flush.
    uvloop.run(serve(settings, tracing))


if __name__ == "__main__":
    main()

