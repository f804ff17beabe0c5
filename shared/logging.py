"""structlog set-up, called first by each entrypoint (never at import).

JSON lines when stderr is not a TTY (production, CI), a readable console otherwise. Context such
as ``job_id``, ``model`` and ``worker`` is bound through contextvars.
"""

from __future__ import annotations

import logging
import sys

import msgspec
import structlog

__all__ = ["configure_logging"]


def _json(obj: object, **_: object) -> str:
    return msgspec.json.encode(obj, enc_hook=repr).decode()


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    use_json = not sys.stderr.isatty() if json is None else json
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if use_json:
        shared.append(structlog.processors.dict_tracebacks)
        renderer = structlog.processors.JSONRenderer(serializer=_json)
    else:
        renderer = structlog.dev.ConsoleRenderer()
    numeric = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Route stdlib loggers (uvicorn, vllm, redis, arq) through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
