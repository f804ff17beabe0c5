"""structlog set-up, called first by each entrypoint (never at import).

JSON lines when stderr is not a TTY (production, CI), a readable console otherwise. Context such
as ``job_id``, ``model`` and ``worker`` is bound through contextvars.

Tracebacks, ours and those of stdlib loggers (uvicorn, arq, redis), are rendered here and only
here, in both modes, as exception types, messages and frames (file, line, function), never with
the frames' local variables: those held the Settings (API keys, webhook secret, Redis password)
and the request body, ~30 KB per line. An exception that may quote a request (a log call with
``may_quote_request=True``, uvicorn's "Exception in ASGI application") is shown with its messages
replaced, unless LLMQ_LOG_REQUESTS is on: the prompt a failed job quoted stays out of the logs.
"""

from __future__ import annotations

import functools
import linecache
import logging
import sys
from typing import Any

import msgspec
import structlog
from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import EventDict, Processor

from shared.config import Settings

__all__ = ["configure_logging", "HIDDEN_MESSAGE"]

HIDDEN_MESSAGE = "<hidden: it may quote the request; LLMQ_LOG_REQUESTS=true shows it>"
MAX_FRAMES = 20  # the outermost and innermost 10 of a deeper stack
MAX_MESSAGE = 1000  # characters of one exception message

# Stdlib records whose exception is one a request raised (logger name, message start).
_REQUEST_ERRORS = (("uvicorn.error", "Exception in ASGI application"),)

_frames = ExceptionDictTransformer(show_locals=False, max_frames=MAX_FRAMES)


def _json(obj: dict[str, Any], **_: object) -> str:
    # msgspec would encode a Settings field by field, secrets included; its repr masks them.
    obj = {k: repr(v) if isinstance(v, Settings) else v for k, v in obj.items()}
    return msgspec.json.encode(obj, enc_hook=repr).decode()


def _trim(stacks: list[dict[str, Any]], hide: bool) -> list[dict[str, Any]]:
    for stack in stacks:
        value = stack["exc_value"]
        if hide:
            stack["exc_value"], stack["exc_notes"], stack["syntax_error"] = HIDDEN_MESSAGE if value else "", [], None
        elif len(value) > MAX_MESSAGE:
            stack["exc_value"] = f"{value[:MAX_MESSAGE]}... ({len(value)} characters)"
        for group in stack.get("exceptions") or ():
            _trim(group, hide)
    return stacks


def _text(stacks: list[dict[str, Any]], indent: str = "") -> str:
    """The console's traceback, in Python's order (the first cause first), from the same dicts."""
    lines: list[str] = []
    for i, stack in enumerate(reversed(stacks)):
        if i:
            lines.append("\nThe above exception was the direct cause of the following exception:\n"
                         if stacks[len(stacks) - i]["is_cause"] else
                         "\nDuring handling of the above exception, another exception occurred:\n")
        lines.append("Traceback (most recent call last):")
        for f in stack["frames"]:
            if f["lineno"] < 0:  # "Skipped frames: n"
                lines.append(f"  ... {f['name']}")
                continue
            lines.append(f'  File "{f["filename"]}", line {f["lineno"]}, in {f["name"]}')
            source = linecache.getline(f["filename"], f["lineno"]).strip()
            if source:
                lines.append(f"    {source}")
        lines.append(f"{stack['exc_type']}: {stack['exc_value']}" if stack["exc_value"] else stack["exc_type"])
        lines.extend(stack["exc_notes"])
        for n, group in enumerate(stack.get("exceptions") or (), 1):
            lines.append(f"+---- {n} ----")
            lines.append(_text(group, "| "))
    return "\n".join(indent + line for line in "\n".join(lines).split("\n"))


def _format(exc_info: Any, *, hide: bool, as_text: bool) -> Any:
    stacks = _trim(_frames(exc_info), hide)
    return _text(stacks) if as_text else stacks


class _Tracebacks:
    """Turns ``exc_info`` into ``exception``: dicts (JSON) or text (console), without locals."""

    def __init__(self, *, as_text: bool, show_request_text: bool) -> None:
        self.show_request_text = show_request_text
        self.shown = structlog.processors.ExceptionRenderer(functools.partial(_format, hide=False, as_text=as_text))
        self.hidden = structlog.processors.ExceptionRenderer(functools.partial(_format, hide=True, as_text=as_text))

    def __call__(self, logger: Any, name: str, event_dict: EventDict) -> EventDict:
        quotes = event_dict.pop("may_quote_request", False)
        record = event_dict.get("_record")
        if record is not None:
            quotes = any(record.name == logger_name and record.getMessage().startswith(start)
                         for logger_name, start in _REQUEST_ERRORS)
        render = self.hidden if quotes and not self.show_request_text else self.shown
        return render(logger, name, event_dict)


def configure_logging(level: str = "info", json: bool | None = None, *, log_requests: bool = False) -> None:
    """``log_requests`` (LLMQ_LOG_REQUESTS) also shows the messages of exceptions that may quote
    a request."""
    use_json = not sys.stderr.isatty() if json is None else json
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _Tracebacks(as_text=not use_json, show_request_text=log_requests),
    ]
    renderer: Processor
    if use_json:
        renderer = structlog.processors.JSONRenderer(serializer=_json)
    else:
        # exc_info never reaches it (rendered above); plain_traceback in case: rich's shows locals.
        renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
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
    # Loggers set up before us (uvicorn's own config when it is started as `uvicorn --factory`,
    # or a library's) would print through handlers of their own, past the traceback rules above:
    # every record goes through the root handler instead.
    for logger in list(logging.root.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            logger.handlers[:] = [h for h in logger.handlers if isinstance(h, logging.NullHandler)]
            logger.propagate = True
    # httpx logs every request's full URL at info: a webhook receiver's URL may carry its token.
    logging.getLogger("httpx").setLevel(max(numeric, logging.WARNING))
