"""Every route that reads a body answers any byte sequence with its dialect's own 4xx: a table.

The real app on a real port (scripted worker, real Redis). Each named bad body goes to every
HTTP route that reads a JSON body, and the answer must be exactly that dialect's status and
error shape (OpenAI 400 ``{"error": {...}}``, LMI 424, TGI 422 ``{"error", "error_type"}``,
Triton 400 ``{"error"}``, happy_vllm 422 ``{"detail"}``, llmq jobs 400), with a message that
names the problem. Odd but valid bodies (a duplicate key, a huge number, nesting at the limit,
a 9 MB string, another content type) get the route's normal answer or its 4xx, as listed.
The LMTP socket gets the same bytes as frames: each is answered with an LMTP error frame and
the socket keeps streaming. Batch input files carry bad lines: the batch fails with one error
per line. Random bodies of the same kinds are in test_fuzz_http.py.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest

from shared.json_input import MAX_DEPTH
from tests.support.fuzzing import deep
from tests.support.scripted_engine import CappedEngine

MODEL = "tiny"
TIMEOUT_S = 30.0


# --- dialect error shapes: each checks the exact keys and returns the message ------------------

def openai_shape(body: Any, status: int) -> str:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert err["code"] == status and err["type"] == "BadRequestError", body
    return err["message"]


def lmi_shape(body: Any, status: int) -> str:
    if status == 424:
        assert set(body) == {"error", "code"} and body["code"] == 424, body
        return body["error"]
    assert set(body) == {"code", "type", "message"} and body["code"] == status, body
    return body["message"]


def tgi_shape(body: Any, status: int) -> str:
    assert set(body) == {"error", "error_type"}, body
    if status == 422:
        assert body["error_type"] == "validation" and body["error"].startswith("Input validation error: "), body
    return body["error"]


def triton_shape(body: Any, status: int) -> str:
    assert set(body) == {"error"} and isinstance(body["error"], str), body
    return body["error"]


def happy_shape(body: Any, status: int) -> str:
    assert set(body) == {"detail"} and isinstance(body["detail"], str), body
    return body["detail"]


def jobs_shape(body: Any, status: int) -> str:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"code", "message", "param", "status"} and err["status"] == status, body
    return err["message"]


@dataclass(frozen=True)
class Dialect:
    name: str
    bad_status: int  # the status of a body it cannot decode
    shape: Callable[[Any, int], str]


OPENAI = Dialect("openai", 400, openai_shape)
LMI = Dialect("lmi", 424, lmi_shape)
TGI = Dialect("tgi", 422, tgi_shape)
TRITON = Dialect("triton", 400, triton_shape)
HAPPY = Dialect("happy_vllm", 422, happy_shape)
JOBS = Dialect("jobs", 400, jobs_shape)


@dataclass(frozen=True)
class Route:
    path: str
    dialect: Dialect
    base: dict[str, Any]  # a body the route accepts; it holds the string "hi" and the number 2
    ok: int = 200
    number: tuple[str, ...] = ()  # where the route's number (2) is, for the number cases
    seed: tuple[str, ...] = ()  # where a seed goes, when the route takes one
    schema_dialect: Dialect | None = None  # the shape of errors after dispatch, when it differs
    in_band: bool = False  # errors found after decoding arrive in the stream (200), as TGI's do

    @property
    def label(self) -> str:
        return f"{self.path}[{self.base_kind}]" if self.path == "/invocations" else self.path

    @property
    def base_kind(self) -> str:
        return next(iter(self.base))


# do_sample: TGI uses (and checks) a seed only when sampling.
_TGI_BASE = {"inputs": "hi", "parameters": {"max_new_tokens": 2, "do_sample": True}}
_TRITON_BASE = {"text_input": "hi", "parameters": {"max_tokens": 2}}
ROUTES = [
    Route("/v1/completions", OPENAI, {"prompt": "hi", "max_tokens": 2}, number=("max_tokens",), seed=("seed",)),
    Route("/v1/chat/completions", OPENAI, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
          number=("max_tokens",), seed=("seed",)),
    Route("/invocations", LMI, _TGI_BASE, number=("parameters", "max_new_tokens"), seed=("parameters", "seed")),
    Route("/invocations", LMI, {"prompt": "hi", "max_tokens": 2}, number=("max_tokens",), seed=("seed",),
          schema_dialect=OPENAI),
    Route("/predictions/tiny", LMI, _TGI_BASE, number=("parameters", "max_new_tokens"), seed=("parameters", "seed")),
    Route("/generate", TGI, _TGI_BASE, number=("parameters", "max_new_tokens"), seed=("parameters", "seed")),
    Route("/generate_stream", TGI, _TGI_BASE, number=("parameters", "max_new_tokens"), seed=("parameters", "seed"),
          in_band=True),
    Route("/", TGI, _TGI_BASE, number=("parameters", "max_new_tokens"), seed=("parameters", "seed")),
    Route("/tokenize", TGI, _TGI_BASE, number=("parameters", "max_new_tokens")),
    Route("/v2/models/tiny/generate", TRITON, _TRITON_BASE, number=("parameters", "max_tokens"),
          seed=("parameters", "seed")),
    Route("/v2/models/tiny/generate_stream", TRITON, _TRITON_BASE, number=("parameters", "max_tokens"),
          seed=("parameters", "seed")),
    Route("/v1/generate", HAPPY, {"prompt": "hi", "max_tokens": 2}, number=("max_tokens",), seed=("seed",)),
    Route("/v1/generate_stream", HAPPY, {"prompt": "hi", "max_tokens": 2}, number=("max_tokens",), seed=("seed",)),
    Route("/v1/jobs", JOBS, {"prompt": "hi", "sampling": {"max_tokens": 2}}, ok=202,
          number=("sampling", "max_tokens"), seed=("sampling", "seed")),
    # input_file_id is filled in with a real uploaded file by the fixture.
    Route("/v1/batches", OPENAI, {"metadata": {"k": "hi"}, "endpoint": "/v1/completions", "completion_window": "24h",
                                  "input_file_id": ""}),
]


def encoded(route: Route, file_id: str, **replace: Any) -> bytes:
    """The route's base body (with the uploaded file's id), fields replaced by path ("a.b")."""
    body = msgspec.json.decode(msgspec.json.encode(route.base))
    if "input_file_id" in body:
        body["input_file_id"] = file_id
    for path, value in replace.items():
        *parents, last = path.split(".")
        node = body
        for key in parents:
            node = node[key]
        node[last] = value
    return msgspec.json.encode(body)


def with_raw(route: Route, file_id: str, path: tuple[str, ...], raw: bytes) -> bytes:
    """The base body with the value at ``path`` replaced by raw JSON text (or a new key ``x``)."""
    return encoded(route, file_id, **{".".join(path or ("x",)): msgspec.Raw(raw)})


# --- the bodies ---------------------------------------------------------------------------------

BOM = "byte order mark"
UTF8 = "invalid UTF-8"
DEEP = f"nested deeper than {MAX_DEPTH} levels"
EMPTY = "empty input"


@dataclass(frozen=True)
class Bad:
    name: str
    build: Callable[[Route, str], bytes]
    says: str | None = None  # what the message must contain
    content_type: str = "application/json"


def _splice(body: bytes, bad: bytes) -> bytes:
    assert b'"hi"' in body
    return body.replace(b'"hi"', b'"h' + bad + b'i"', 1)


MALFORMED = [
    Bad("empty", lambda r, f: b"", EMPTY),
    Bad("whitespace", lambda r, f: b" \r\n\t ", EMPTY),
    Bad("empty_no_content_type", lambda r, f: b"", EMPTY, content_type=""),
    Bad("truncated", lambda r, f: encoded(r, f)[:-3], "truncated"),
    Bad("truncated_in_string", lambda r, f: encoded(r, f).split(b'"hi"')[0] + b'"h', "truncated"),
    Bad("bom", lambda r, f: codecs.BOM_UTF8 + encoded(r, f), BOM),
    Bad("utf16_with_bom", lambda r, f: codecs.BOM_UTF16_LE + encoded(r, f).decode().encode("utf-16-le"), UTF8),
    Bad("invalid_utf8_in_string", lambda r, f: _splice(encoded(r, f), b"\xff\xfe"), UTF8),
    Bad("overlong_utf8", lambda r, f: _splice(encoded(r, f), b"\xc0\xaf"), UTF8),
    Bad("encoded_surrogate", lambda r, f: _splice(encoded(r, f), b"\xed\xa0\x80"), UTF8),
    Bad("truncated_utf8_sequence", lambda r, f: _splice(encoded(r, f), b"\xe2\x82"), UTF8),
    Bad("invalid_utf8_in_key", lambda r, f: encoded(r, f)[:-1] + b', "\xc3\x28": 1}', UTF8),
    Bad("invalid_utf8_in_ignored_key", lambda r, f: encoded(r, f)[:-1] + b', "x": "\xff"}', UTF8),
    Bad("lone_surrogate_escape", lambda r, f: encoded(r, f).replace(b'"hi"', b'"\\ud800"', 1)),
    Bad("nan", lambda r, f: with_raw(r, f, r.number, b"NaN"), "malformed"),
    Bad("infinity", lambda r, f: with_raw(r, f, r.number, b"Infinity"), "malformed"),
    Bad("minus_infinity", lambda r, f: with_raw(r, f, r.number, b"-Infinity"), "malformed"),
    Bad("leading_zero", lambda r, f: with_raw(r, f, r.number, b"02"), "malformed"),
    Bad("nul_byte", lambda r, f: b"\x00" + encoded(r, f), "malformed"),
    Bad("deep_arrays_100k", lambda r, f: b"[" * 100_000),
    Bad("deep_objects_100k", lambda r, f: b'{"a":' * 100_000, DEEP),
    Bad("deep_closed_objects_100k", lambda r, f: deep(b"1", 100_000, objects=True), DEEP),
    # Nested values inside the body: past the limit by one, and far past it (near the stack's).
    Bad("deep_value_limit_plus_one", lambda r, f: with_raw(r, f, ("x",), deep(b"1", MAX_DEPTH)), DEEP),
    Bad("deep_object_value_900", lambda r, f: with_raw(r, f, ("x",), deep(b"1", 900, objects=True)), DEEP),
    # (a typed field may refuse the array before its depth is measured: either message is right)
    Bad("deep_number_value_900", lambda r, f: with_raw(r, f, r.number, deep(b"2", 900))),
    Bad("binary_junk", lambda r, f: bytes(range(256)), UTF8),
    Bad("form_urlencoded", lambda r, f: b"prompt=hi&max_tokens=2", "malformed",
        content_type="application/x-www-form-urlencoded"),
    Bad("multipart", lambda r, f: b'--xx\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--xx--\r\n',
        "malformed", content_type="multipart/form-data; boundary=xx"),
    Bad("top_level_array", lambda r, f: b"[]"),
    Bad("top_level_string", lambda r, f: b'"hi"'),
    Bad("top_level_null", lambda r, f: b"null"),
    Bad("top_level_number", lambda r, f: b"2"),
]


pytestmark = pytest.mark.stack(CappedEngine(delay_s=0.0), prefix="malformed")  # tests/integration/conftest.py


@pytest.fixture(scope="module")
async def stack(stack):
    """The module's stack, with one batch input file uploaded (``stack.file_id``): the batch
    routes' bodies name it."""
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}
    resp = await stack.client.post("/v1/files", files={"file": ("in.jsonl", json.dumps(line).encode())},
                                   data={"purpose": "batch"})
    assert resp.status_code == 200, resp.text
    stack.file_id = resp.json()["id"]  # type: ignore[attr-defined]
    return stack


async def send(stack, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, bytes]:
    headers = {"content-type": content_type} if content_type else {}
    async with asyncio.timeout(TIMEOUT_S):
        async with stack.client.stream("POST", path, content=body, headers=headers) as resp:
            return resp.status_code, await resp.aread()


async def expect_bad(stack, route: Route, body: bytes, says: str | None = None, *, schema: bool = False,
                     content_type: str = "application/json") -> str:
    """The route's 4xx; ``schema``: an error found after the body was dispatched to its schema."""
    got, content = await send(stack, route.path, body, content_type)
    dialect = (route.schema_dialect or route.dialect) if schema else route.dialect
    want = dialect.bad_status
    if schema and route.in_band and got == 200:  # one SSE event carrying the error, as TGI's generate_stream
        assert content.startswith(b"data:") and content.count(b"data:") == 1, (route.label, content)
        content = content.removeprefix(b"data:")
    else:
        assert got == want, f"{route.label}: {got} (want {want}): {content[:300]!r}"
    message = dialect.shape(json.loads(content), want)
    if says is not None:
        assert says.lower() in message.lower(), f"{route.label}: {message!r} does not say {says!r}"
    return message


async def expect_ok(stack, route: Route, body: bytes, content_type: str = "application/json") -> bytes:
    got, content = await send(stack, route.path, body, content_type)
    assert got == route.ok, f"{route.label}: {got} (want {route.ok}): {content[:300]!r}"
    assert b"internal server error" not in content
    return content


# --- the tables -----------------------------------------------------------------------------------

async def test_every_route_accepts_its_base_body(stack):
    """The table's premise: without the damage, each base body is answered normally."""
    for route in ROUTES:
        await expect_ok(stack, route, encoded(route, stack.file_id))


@pytest.mark.parametrize("bad", MALFORMED, ids=[b.name for b in MALFORMED])
async def test_malformed_bodies_get_each_dialects_4xx(stack, bad):
    failures = []
    for route in ROUTES:
        try:
            await expect_bad(stack, route, bad.build(route, stack.file_id), bad.says, content_type=bad.content_type)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)
    await expect_ok(stack, ROUTES[0], encoded(ROUTES[0], stack.file_id))  # still serving


async def test_odd_but_valid_bodies_get_a_defined_answer(stack):
    """Valid JSON at its edges: the normal answer, or the dialect's 4xx where a value is out of
    range. Never a 5xx (a seed past int64 used to fail inside the worker's engine)."""
    f = stack.file_id
    for route in ROUTES:
        base = encoded(route, f)
        # A duplicate key is accepted, the last one wins (Python's json, pydantic, msgspec).
        first = route.base_kind.encode()
        again = msgspec.json.encode(msgspec.json.decode(base)[route.base_kind])
        await expect_ok(stack, route, base[:-1] + b', "' + first + b'": ' + again + b"}")
        # Another content type, or none: the body is JSON all the same (clients that forget the
        # header, curl -d, keep working).
        await expect_ok(stack, route, base, content_type="text/plain")
        await expect_ok(stack, route, base, content_type="")
        await expect_ok(stack, route, b" \n\t" + base + b"\r\n")  # whitespace around JSON is JSON
        if route.dialect not in (TRITON, HAPPY):  # (they refuse an unknown key, whatever it holds)
            # Nesting exactly at the limit is accepted: the body object is one level.
            await expect_ok(stack, route, with_raw(route, f, ("x",), deep(b"1", MAX_DEPTH - 1)))
        if route.number:
            for number in (b"1e999", b"-1e999", b"1" + b"0" * 30, b"-" + b"9" * 30, b"2.5", b"1e-999", b"9" * 5000):
                await expect_bad(stack, route, with_raw(route, f, route.number, number), schema=True)
        if route.seed:
            seed_at = ".".join(route.seed)
            for seed in (2**63, -(2**63) - 1, 10**30):
                await expect_bad(stack, route, encoded(route, f, **{seed_at: seed}), "seed", schema=True)
            await expect_ok(stack, route, encoded(route, f, **{seed_at: 2**63 - 1}))


async def test_a_duplicate_key_takes_the_last_value(stack):
    body = b'{"prompt": "hi", "max_tokens": 1, "max_tokens": 3}'
    status, content = await send(stack, "/v1/completions", body)
    assert status == 200, content
    assert json.loads(content)["usage"]["completion_tokens"] == 3


async def test_a_9mb_string_is_served_and_a_body_past_the_limit_is_413(stack):
    """LLMQ_MAX_BODY_BYTES is 10 MB: a 9 MB prompt is an ordinary request (the scripted engine
    counts a character a token); one byte past the limit is 413, in the dialect's shape."""
    big = "a" * 9_000_000
    for path, body in (("/v1/completions", {"prompt": big, "max_tokens": 2}),
                       ("/generate", {"inputs": big, "parameters": {"max_new_tokens": 2}}),
                       ("/v2/models/tiny/generate", {"text_input": big, "parameters": {"max_tokens": 2}})):
        status, content = await send(stack, path, msgspec.json.encode(body))
        assert status == 200, (path, content[:300])
    over = b'{"prompt": "' + b"a" * stack.settings.max_body_bytes + b'"}'
    for route in ROUTES:
        got, content = await send(stack, route.path, over)
        assert got == 413, (route.label, got, content[:300])
        assert set(json.loads(content)), (route.label, content[:300])


# JSON held in a string field is decoded by the translator: the same rules apply there.
EMBEDDED = [
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 2, "grammar": {"type": "json", "value": "<J>"}}}),
    ("/v2/models/tiny/generate", {"text_input": "hi", "sampling_parameters": "<J>"}),
    ("/v2/models/tiny/generate", {"text_input": "hi", "parameters": {"structured_outputs": "<J>"}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": "<J>"}}),
]
EMBEDDED_JSON = {
    # A schema TGI and vLLM would take, but for its depth (past the limit, and near the stack's).
    "deep_schema": '{"properties": ' + deep(b"{}", MAX_DEPTH, objects=True).decode() + "}",
    "deep_schema_900": '{"properties": ' + deep(b"{}", 900, objects=True).decode() + "}",
    "deep_objects_100k": '{"a":' * 100_000,
    "nan": '{"properties": {"a": NaN}}',
    "lone_surrogate": '{"properties": {"\\ud800": {}}}',
    "bom": "\ufeff{}",
    "empty": "",
}


@pytest.mark.parametrize("name", list(EMBEDDED_JSON))
async def test_json_inside_string_fields_is_decoded_as_safely(stack, name):
    by_path = {r.path: r for r in ROUTES}
    for path, template in EMBEDDED:
        body = msgspec.json.encode(template).replace(b'"<J>"', msgspec.json.encode(EMBEDDED_JSON[name]))
        await expect_bad(stack, by_path[path], body)


async def test_a_batch_file_of_bad_lines_fails_with_one_error_per_line(stack):
    """The file's lines are client bytes too: each bad line is reported, none is a 500."""
    good = b'{"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}'
    bad_lines = [
        codecs.BOM_UTF8 + good.replace(b'"ok"', b'"bom"'),
        good.replace(b'"hi"', b'"h\xffi"').replace(b'"ok"', b'"utf8"'),
        good.replace(b'"ok"', b'"\xc0\xaf"'),
        good.replace(b"2}}", b"NaN}}").replace(b'"ok"', b'"nan"'),
        good.replace(b"2}}", deep(b"2", 1000) + b"}}").replace(b'"ok"', b'"deep"'),
        b'{"a":' * 100_000,
        good[:40],
    ]
    content = b"\n".join([good, *bad_lines]) + b"\n"
    resp = await stack.client.post("/v1/files", files={"file": ("bad.jsonl", content)}, data={"purpose": "batch"})
    assert resp.status_code == 200, resp.text
    created = await stack.client.post("/v1/batches", json={"input_file_id": resp.json()["id"],
                                                           "endpoint": "/v1/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["status"] == "failed"
    errors = batch["errors"]["data"]
    assert [e["line"] for e in errors] == list(range(2, 2 + len(bad_lines))), errors
    assert {e["code"] for e in errors} == {"invalid_request"}
    says = [BOM, UTF8, UTF8, "malformed", DEEP, DEEP, "truncated"]
    for error, fragment in zip(errors, says, strict=True):
        assert fragment.lower() in error["message"].lower(), error


async def test_odd_multipart_uploads_get_4xx(stack):
    """``POST /v1/files`` parses multipart: broken forms are the client's error, never a 500."""
    cases = [
        (b"", "multipart/form-data; boundary=xx"),
        (b"--xx\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch", "multipart/form-data; boundary=xx"),
        (b"junk", "multipart/form-data"),  # no boundary
        (b"\xff\xfe" * 100, "multipart/form-data; boundary=xx"),
        (b'--xx\r\nContent-Disposition: form-data; name="\xff"\r\n\r\nbatch\r\n--xx--\r\n',
         "multipart/form-data; boundary=xx"),
        (b'{"purpose": "batch"}', "application/json"),
        (b"purpose=batch&file=x", "application/x-www-form-urlencoded"),
    ]
    for body, content_type in cases:
        status, content = await send(stack, "/v1/files", body, content_type)
        assert 400 <= status < 500, (body[:60], content_type, status, content[:300])
        openai_shape(json.loads(content), status)


# --- LMTP: the same bytes as WebSocket frames ---------------------------------------------------

GOOD_FRAME = 'GENERATE {"stream_id": %d, "prompt": [97, 98], "max_tokens": 2}'
LMTP_BAD: list[tuple[str, str | bytes, str, str]] = [
    # (name, frame (bytes: a binary frame), reply verb, what the error says)
    ("binary_invalid_utf8", b'GENERATE {"stream_id": 1, "prompt": [1]}\xff', "MSG", "not UTF-8"),
    ("binary_junk", bytes(range(256)), "MSG", "not UTF-8"),
    ("no_payload", "GENERATE", "MSG", "malformed LMTP message"),
    ("not_json", "GENERATE {not json", "MSG", "malformed JSON"),
    ("truncated", 'GENERATE {"stream_id": 3, "prompt": [1', "MSG", "malformed"),
    ("bom", 'GENERATE \ufeff{"stream_id": 4, "prompt": [1]}', "MSG", BOM),
    ("nan", 'GENERATE {"stream_id": 5, "prompt": [1], "temperature": NaN}', "MSG", "malformed JSON"),
    ("deep_arrays_100k", "GENERATE " + "[" * 100_000, "MSG", "must be a JSON object"),
    ("deep_objects_100k", "GENERATE " + '{"a":' * 100_000, "MSG", DEEP),
    ("deep_stream_id", 'GENERATE {"stream_id": ' + deep(b"1", 900).decode() + "}", "MSG", DEEP),
    ("deep_value", 'GENERATE {"stream_id": 6, "prompt": [1], "x": ' + deep(b"1", MAX_DEPTH).decode() + "}", "MSG",
     DEEP),
    ("top_level_array", "GENERATE [1, 2]", "MSG", "must be a JSON object"),
    ("stream_id_out_of_range", 'GENERATE {"stream_id": 1e999}', "MSG", "out of range"),
    ("float_stream_id", 'GENERATE {"stream_id": 7.5, "prompt": [1]}', "MSG", "integer `stream_id`"),
    ("unknown_verb", 'FOO {"stream_id": 8}', "MSG", "Unknown command"),
    ("wrong_shape", 'GENERATE {"stream_id": 9, "prompt": "text"}', "TOKEN", "invalid GENERATE payload"),
    ("huge_seed", 'GENERATE {"stream_id": 11, "prompt": [1], "seed": 1' + "0" * 30 + "}", "TOKEN", "seed"),
    ("huge_max_tokens", 'GENERATE {"stream_id": 10, "prompt": [1], "max_tokens": 1' + "0" * 30 + "}", "TOKEN",
     "max_tokens"),  # past any int64 (one within is clamped to the context: below)
    ("float_seed", 'GENERATE {"stream_id": 12, "prompt": [1], "seed": 1e30}', "TOKEN", "seed"),
    ("score_empty", 'SCORE {"stream_id": 13, "prompt": [1], "scored": []}', "TOKEN", "invalid SCORE payload"),
]


async def test_lmtp_bad_frames_get_error_frames_and_the_socket_keeps_streaming(stack):
    url = stack.url.replace("http", "ws") + "/"
    async with aiohttp.ClientSession() as session, session.ws_connect(url, max_msg_size=0) as ws:
        for name, frame, verb, says in LMTP_BAD:
            if isinstance(frame, bytes):
                await ws.send_bytes(frame)
            else:
                await ws.send_str(frame)
            async with asyncio.timeout(TIMEOUT_S):
                msg = await ws.receive()
            assert msg.type == aiohttp.WSMsgType.TEXT, (name, msg)
            got_verb, _, payload = msg.data.partition(" ")
            (item,) = json.loads(payload)
            assert got_verb == verb and "error" in item, (name, msg.data[:300])
            assert says.lower() in item["error"].lower(), (name, item["error"][:300])
            assert "internal server error" not in item["error"], name
        # A binary frame with a valid command is still served (LMTP is text; llmq is lenient).
        await ws.send_bytes((GOOD_FRAME % 100).encode())
        await ws.send_str(GOOD_FRAME % 101)
        # max_tokens far past the context is no error: the worker clamps it to the context.
        await ws.send_str('GENERATE {"stream_id": 102, "prompt": [1], "max_tokens": 1' + "0" * 18 + "}")
        finished: set[int] = set()
        async with asyncio.timeout(TIMEOUT_S):
            while finished != {100, 101, 102}:
                msg = await ws.receive()
                assert msg.type == aiohttp.WSMsgType.TEXT, msg
                got_verb, _, payload = msg.data.partition(" ")
                for item in json.loads(payload):
                    assert "error" not in item, item
                    if got_verb == "TOKEN" and item.get("finish_reason"):
                        finished.add(item["stream_id"])
        assert not ws.closed


async def test_lmtp_text_frame_with_invalid_utf8_closes_with_1007_and_the_server_serves_on(stack):
    """RFC 6455 makes invalid UTF-8 in a text frame a protocol error: the WebSocket layer closes
    the connection (1007) before any handler sees it. The server keeps serving new sockets."""
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.settings.port)
    key = "dGhlIHNhbXBsZSBub25jZQ=="
    writer.write(f"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    async with asyncio.timeout(TIMEOUT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101"), head
        payload = b"GENERATE \xff"
        mask = b"\x01\x02\x03\x04"
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        writer.write(bytes([0x81, 0x80 | len(payload)]) + mask + masked)  # FIN + text, masked
        await writer.drain()
        frame = await reader.read(64)
    assert frame[0] == 0x88, frame  # a close frame
    assert int.from_bytes(frame[2:4], "big") == 1007, frame
    writer.close()
    async with aiohttp.ClientSession() as session, session.ws_connect(stack.url.replace("http", "ws") + "/") as ws:
        await ws.send_str(GOOD_FRAME % 1)
        async with asyncio.timeout(TIMEOUT_S):
            msg = await ws.receive()
        assert msg.type == aiohttp.WSMsgType.TEXT and '"stream_id": 1' in msg.data, msg


async def test_tokenize_answers_odd_text_with_offsets_that_slice_it(stack):
    """TGI's /tokenize runs the tokenizer on whatever text it is given: empty, control
    characters, U+FFFD, a joined emoji, combining marks, a long run. Each token's text is the
    slice its offsets name, and the offsets reach the end of the text."""
    for text in ["", "\x00", "\ufffd", "\U0001f469\u200d\U0001f469\u200d\U0001f467", "e\u0301\u0301", "\t\r\n",
                 "a" * 100_000]:
        status, content = await send(stack, "/tokenize", msgspec.json.encode({"inputs": text}))
        assert status == 200, (text[:20], content[:300])
        tokens = json.loads(content)
        assert tokens and tokens[0]["start"] == tokens[0]["stop"] == 0  # the BOS special token
        for token in tokens:
            assert token["text"] == text[token["start"]:token["stop"]], (text[:20], token)
        assert max(t["stop"] for t in tokens) == len(text)
