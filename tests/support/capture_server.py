"""A loopback HTTP server that records what an agent CLI sends and answers just enough for its
turn to complete (tests/e2e/test_agent_clis_capture.py; tests/support/agent_clis.py).

Every request is kept as a ``Captured``: method, path, query, headers (the secrets named in
``SECRET_HEADERS`` dropped, their names kept in ``auth``), the JSON body (or the raw text where
it is not JSON) and when it came.
The answers are the smallest valid ones in each dialect:

- ``POST /v1/messages`` (Anthropic Messages, Claude Code): one text block saying ``reply``; as the
  full SSE sequence (message_start, content_block_start, ping, content_block_delta,
  content_block_stop, message_delta, message_stop) when the body asks ``stream: true``, else JSON.
  A request ending in an assistant prefill ``{`` gets a JSON object's rest, so the small "topic
  title" calls Claude Code makes in interactive sessions would parse (``claude -p`` makes none).
- ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}`` (N from the body's size).
- ``POST /v1/responses`` (OpenAI Responses, Codex): an SSE stream of response.created,
  response.output_item.added, response.content_part.added, response.output_text.delta,
  response.output_text.done, response.content_part.done, response.output_item.done and
  response.completed (with ``response.id`` and ``usage``); JSON when ``stream`` is not true.
- ``GET /v1/models`` (and ``/models``): one model, in both the OpenAI and Anthropic list shapes.
- anything else: 404 with a JSON error, recorded like the rest.
- proxy requests (``CONNECT host:port`` or an absolute URI, when a CLI's ``HTTPS_PROXY`` points
  here): recorded with the target as the path, and refused with 403. This is how a test sees
  a CLI trying to reach anything but the base URL (telemetry, updates, feature flags).

SSE bodies are written whole with a Content-Length: a canned reply needs no real streaming, and
keep-alive then works as it does with any HTTP/1.1 server.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.local_server import LocalServer

__all__ = ["SECRET_HEADERS", "CaptureServer", "Captured"]

# Dropped from every record: credentials, and what identifies this machine's user.
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie", "chatgpt-account-id"})


@dataclass
class Captured:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names, SECRET_HEADERS dropped
    body: Any  # the parsed JSON, else the text (None when empty)
    at: float  # time.monotonic() on arrival
    status: int = 0  # what the server answered
    auth: list[str] = field(default_factory=list)  # which SECRET_HEADERS came (names only, values dropped)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CaptureServer(LocalServer):
    """``with CaptureServer() as srv:`` serves on ``srv.url`` until the block ends;
    ``srv.requests`` is every request so far, in arrival order."""

    reply: str = "hi"
    model: str = "tiny-llama"
    # Statuses to answer the next model requests (messages, responses) with, one each, before the
    # real reply: to see how a CLI retries. 429/529 carry the dialect's overloaded error.
    fail_with: list[int] = field(default_factory=list)
    requests: list[Captured] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._counter = 0
        self._serve(self._handler(), "capture-server")

    def captured(self) -> list[Captured]:
        with self._lock:
            return list(self.requests)

    def first(self, method: str, path: str) -> Captured | None:
        """The first request to ``path`` with ``method``, or None."""
        return next((r for r in self.captured() if r.method == method and r.path == path), None)

    def proxied(self) -> list[str]:
        """The targets of every proxy request: what the CLI tried to reach beyond loopback."""
        return [r.path for r in self.captured() if r.method == "CONNECT" or not r.path.startswith("/")]

    def hits(self) -> list[str]:
        """``"METHOD path[?query] -> status"`` for every request, in order."""
        out = []
        for r in self.captured():
            query = "&".join(f"{k}={v}" for k, vs in sorted(r.query.items()) for v in vs)
            out.append(f"{r.method} {r.path}{'?' + query if query else ''} -> {r.status}")
        return out

    def _next_id(self, prefix: str) -> str:
        with self._lock:
            self._counter += 1
            return f"{prefix}_capture{self._counter:04d}"

    # --- the answers ---------------------------------------------------------------------------

    def _answer(self, method: str, path: str, body: Any) -> tuple[int, str, bytes]:
        body = body if isinstance(body, dict) else {}
        route = path.rstrip("/")
        if method == "POST" and route in ("/v1/messages", "/messages", "/v1/responses", "/responses"):
            with self._lock:
                status = self.fail_with.pop(0) if self.fail_with else 0
            if status:
                kind = "overloaded_error" if status in (429, 529) else "api_error"
                return _json(status, {"type": "error", "error": {"type": kind, "message": f"planned {status}",
                                                                 "code": kind}})
        if method == "POST" and route in ("/v1/messages", "/messages"):
            return self._messages(body)
        if method == "POST" and route in ("/v1/messages/count_tokens", "/messages/count_tokens"):
            return _json(200, {"input_tokens": _approx_tokens(body)})
        if method == "POST" and route in ("/v1/responses", "/responses"):
            return self._responses(body)
        if method in ("GET", "HEAD") and route in ("/v1/models", "/models"):
            return _json(200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "type": "model", "created": 0, "owned_by": "llmq",
                 "display_name": self.model, "created_at": "1970-01-01T00:00:00Z"}],
                "has_more": False, "first_id": self.model, "last_id": self.model})
        if method == "HEAD" and route == "":
            return 200, "text/plain", b""
        return _json(404, {"type": "error", "error": {"type": "not_found_error", "message": f"{method} {path}"}})

    def _messages(self, body: dict) -> tuple[int, str, bytes]:
        text = self.reply
        messages = body.get("messages") or []
        last = messages[-1] if messages else {}
        if last.get("role") == "assistant":  # a prefill: continue it so the whole parses
            prefill = _text_of(last.get("content"))
            if prefill.strip().startswith("{"):
                text = json.dumps({"title": self.reply, "isNewTopic": False, "topic": self.reply})[1:]
        model = body.get("model") or self.model
        msg_id = self._next_id("msg")
        usage_in = _approx_tokens(body)
        if not body.get("stream"):
            return _json(200, {
                "id": msg_id, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": usage_in, "output_tokens": 1}})
        events = [
            ("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": usage_in, "output_tokens": 1, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 0}}}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("ping", {"type": "ping"}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": text}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                               "usage": {"output_tokens": 1}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        return 200, "text/event-stream", _sse(events)

    def _responses(self, body: dict) -> tuple[int, str, bytes]:
        model = body.get("model") or self.model
        resp_id, item_id = self._next_id("resp"), self._next_id("msg")
        usage_in = _approx_tokens(body)
        usage = {"input_tokens": usage_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage_in + 1}
        part = {"type": "output_text", "text": self.reply, "annotations": []}
        item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
        response = {"id": resp_id, "object": "response", "created_at": int(time.time()), "model": model,
                    "status": "in_progress", "output": [], "usage": None}
        done = {**response, "status": "completed", "output": [item], "usage": usage}
        if not body.get("stream"):
            return _json(200, done)
        events = [
            {"type": "response.created", "response": response},
            {"type": "response.in_progress", "response": response},
            {"type": "response.output_item.added", "output_index": 0,
             "item": {**item, "status": "in_progress", "content": []}},
            {"type": "response.content_part.added", "item_id": item_id, "output_index": 0, "content_index": 0,
             "part": {**part, "text": ""}},
            {"type": "response.output_text.delta", "item_id": item_id, "output_index": 0, "content_index": 0,
             "delta": self.reply},
            {"type": "response.output_text.done", "item_id": item_id, "output_index": 0, "content_index": 0,
             "text": self.reply},
            {"type": "response.content_part.done", "item_id": item_id, "output_index": 0, "content_index": 0,
             "part": part},
            {"type": "response.output_item.done", "output_index": 0, "item": item},
            {"type": "response.completed", "response": done},
        ]
        return 200, "text/event-stream", _sse([(e["type"], {**e, "sequence_number": i}) for i, e in enumerate(events)])

    # --- the HTTP side -------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self) -> None:
                if self.command == "CONNECT" or not self.path.startswith("/"):
                    return self._refuse_proxying()
                raw = self._read_body()
                split = urlsplit(self.path)
                record = Captured(
                    method=self.command, path=split.path, query=parse_qs(split.query, keep_blank_values=True),
                    headers={k.lower(): v for k, v in self.headers.items() if k.lower() not in SECRET_HEADERS},
                    body=_decode(raw, self.headers.get("Content-Encoding", "")), at=time.monotonic(),
                    auth=sorted({k.lower() for k in self.headers if k.lower() in SECRET_HEADERS}))
                with srv._lock:
                    srv.requests.append(record)
                status, content_type, payload = srv._answer(self.command, split.path, record.body)
                record.status = status
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                if content_type == "text/event-stream":
                    self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _refuse_proxying(self) -> None:
                """With ``HTTPS_PROXY``/``HTTP_PROXY`` pointing here, whatever a CLI tries to reach
                beyond loopback arrives as ``CONNECT host:443`` (or an absolute URI): recorded with
                that target as its path, and refused."""
                self._read_body()
                with srv._lock:
                    srv.requests.append(Captured(
                        method=self.command, path=self.path, query={},
                        headers={k.lower(): v for k, v in self.headers.items() if k.lower() not in SECRET_HEADERS},
                        body=None, at=time.monotonic(), status=403))
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

            def _read_body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = do_CONNECT = _handle  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet under pytest
                pass

        return Handler


def _decode(raw: bytes, encoding: str) -> Any:
    if not raw:
        return None
    try:
        if encoding == "gzip":
            raw = gzip.decompress(raw)
        elif encoding == "deflate":
            raw = zlib.decompress(raw)
        elif encoding:
            return {"undecoded_content_encoding": encoding, "size": len(raw)}
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _json(status: int, obj: Any) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(obj).encode()


def _sse(events: list[tuple[str, dict]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def _approx_tokens(body: Any) -> int:
    return max(1, len(json.dumps(body)) // 4)


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return ""
