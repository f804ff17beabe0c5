"""Images at admission on real Redis (api/media.py, shared/media.py): stored once by hash and kept
while used, a conversation's re-sent screenshot stored once, URLs fetched through the egress guard
from a real loopback server (allowed, refused, redirected, too large, too slow, missing), and the
API refusing what it must before anything is queued.

Every connection goes to loopback; the private and metadata addresses named here are refused
before any connection (the fetcher's transport then fails the test if called).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Self

import httpx
import msgspec
import pytest
from PIL import Image as PILImage

from api.media import MediaFetcher, ModelInfos, fallback_tokens, store_images
from shared.codec import decode_request
from shared.config import Settings, load_settings
from shared.errors import InvalidRequest
from shared.keys import Keys
from shared.media import HOLD_MARGIN_S, ImageCost, MediaStore, ModelInfo
from shared.schemas import ChatMessage, GenerationRequest, Image, Text
from tests.conftest import free_port
from tests.support.scripted_stack import scripted_stack
from tests.support.waiting import eventually
from workers.media import load_images

LIMIT = 100_000  # max_image_bytes of the fetcher tests
VISION = ModelInfo(input_modalities=["text", "image"],
                   image=ImageCost(longest_edge=2048, tile=512, per_tile=64, per_global=64))


def png(size: tuple[int, int] = (30, 20), color: int = 0) -> bytes:
    out = io.BytesIO()
    PILImage.new("L", size, color).save(out, "PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def settings(**overrides: object) -> Settings:
    return load_settings({}, **{"max_image_bytes": LIMIT, "media_fetch_timeout_s": 2.0, **overrides})


def chat(*turns: list | str) -> GenerationRequest:
    """A conversation alternating user and assistant turns; a list is a turn's parts."""
    messages = [ChatMessage(role="user" if n % 2 == 0 else "assistant", **(
        {"parts": turn} if isinstance(turn, list) else {"content": turn})) for n, turn in enumerate(turns)]
    return GenerationRequest(model="tiny", messages=messages)


async def media_keys(redis, keys: Keys) -> list[bytes]:
    return await redis.keys(keys.media("*"))


# --- a loopback HTTP origin ----------------------------------------------------------------------

Route = Callable[[asyncio.StreamWriter], Awaitable[None]]


class Origin:
    """A loopback HTTP/1.1 server answering each path with the test's ``routes``: it records each
    request's path and headers, and how many connections it was given."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.routes: dict[str, Route] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.connections = 0
        self.sent = 0  # body bytes written by the streaming routes
        self._handlers: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.connections += 1
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            line, *fields = head.strip().split("\r\n")
            path = line.split(" ")[1]
            headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
            self.requests.append((path, headers))
            route = self.routes.get(path, answer(404, b"no such image"))
            await route(writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._handlers.discard(task)

    def streaming(self) -> Route:
        """A chunked body that never ends (64 KiB a chunk), until the client hangs up."""
        async def route(writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"\x89PNG" + b"\0" * (65536 - 4)
            while True:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.sent += len(chunk)
                await writer.drain()
        return route


def answer(status: int, body: bytes = b"", **headers: str) -> Route:
    async def route(writer: asyncio.StreamWriter) -> None:
        fields = {"Content-Length": str(len(body)), "Connection": "close", **headers}
        writer.write(f"HTTP/1.1 {status} X\r\n".encode() + b"".join(
            f"{k.replace('_', '-')}: {v}\r\n".encode() for k, v in fields.items()) + b"\r\n" + body)
    return route


def stalled(**headers: str) -> Route:
    """Headers, then nothing: a server that never finishes its answer."""
    async def route(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n" + b"".join(f"{k.replace('_', '-')}: {v}\r\n".encode()
                                                       for k, v in headers.items()) + b"\r\n")
        await writer.drain()
        await asyncio.sleep(60)
    return route


@pytest.fixture
async def origin():
    async with Origin() as o:
        yield o


def no_connection() -> httpx.AsyncClient:
    """A client whose every request fails the test: what is refused must be refused before."""
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"a connection was attempted to {request.url}")
    return httpx.AsyncClient(transport=httpx.MockTransport(refuse))


def offline() -> MediaFetcher:
    """A fetcher for requests that must fetch nothing."""
    return MediaFetcher(max_bytes=LIMIT, timeout_s=1, client=no_connection())


async def fetch_refused(fetcher: MediaFetcher, url: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        await fetcher.fetch(url, where="messages[0].parts[0]")
    assert refused.value.param == "messages[0].parts[0]"
    return refused.value


# --- the store -----------------------------------------------------------------------------------


async def test_a_second_put_of_the_same_bytes_only_renews_and_a_get_renews(redis, keys):
    store = MediaStore(redis, keys, ttl_s=100)
    data = png()
    assert await store.put("a" * 64, data) is True
    key = keys.media("a" * 64)
    await redis.expire(key, 10)
    assert await store.put("a" * 64, data) is False  # held: renewed, not written again
    assert 90 < await redis.ttl(key) <= 100 and await media_keys(redis, keys) == [key.encode()]
    await redis.expire(key, 10)
    assert await store.get("a" * 64) == data
    assert 90 < await redis.ttl(key) <= 100
    assert await store.put("a" * 64, data, hold_s=500.5) is False
    assert 495 < await redis.ttl(key) <= 501  # a job's deadline past the store's TTL wins
    assert await store.get("b" * 64) is None
    assert await store.renew(["a" * 64, "b" * 64]) == [True, False]


# --- store_images --------------------------------------------------------------------------------


async def test_a_conversation_resending_its_screenshot_stores_it_once(redis, keys, monkeypatch):
    store = MediaStore(redis, keys, ttl_s=100)
    shot = png((1024, 512))
    puts: list[str] = []
    real_put = store.put

    async def counted(sha, data, *, hold_s=None):
        puts.append(sha)
        return await real_put(sha, data, hold_s=hold_s)

    monkeypatch.setattr(store, "put", counted)
    req = chat([Text(text="what is this?"), Image(data=b64(shot), media_type="image/png")], "a screenshot",
               [Text(text="and now?"), Image(url=f"data:image/png;base64,{b64(shot)}", detail="high")], "the same",
               [Image(data=b64(shot), media_type="image/png"), Text(text="still?")])
    out = await store_images(req, store=store, fetcher=offline(), info=VISION, settings=settings(), hold_s=None)
    [key] = await media_keys(redis, keys)
    assert await redis.get(key) == shot
    assert len(puts) == 2  # two distinct sources (base64, the data URL), each read once: one key
    images = out.images
    assert len(images) == 3 and {i.sha256 for i in images} == {key.decode().rpartition(":")[2]}
    for image in images:
        assert (image.format, image.width, image.height) == ("png", 1024, 512)
        assert image.tokens == VISION.image.tokens(1024, 512) == 8 * 64 + 64
        assert image.url is None and image.data is None and image.media_type is None and image.stored
    assert images[1].detail == "high" and images[0].detail is None
    # The text parts and the other turns as they were; the queued form decodes back to itself.
    assert out.messages[0].parts[0] == Text(text="what is this?") and out.messages[1] == req.messages[1]
    assert out.messages[4].parts[1] == Text(text="still?")
    assert decode_request(msgspec.json.encode(out)) == out
    # Sent again (a continued conversation holds references): renewed, refused once gone.
    await redis.expire(key, 5)
    again = await store_images(out, store=store, fetcher=offline(), info=VISION,
                               settings=settings(), hold_s=200)
    assert again.images == out.images and await redis.ttl(key) > 100
    await redis.delete(key)
    with pytest.raises(InvalidRequest, match="no longer stored") as gone:
        await store_images(out, store=store, fetcher=offline(), info=VISION,
                           settings=settings(), hold_s=None)
    assert gone.value.param == "messages[0].parts[1]"


async def test_a_request_without_images_is_returned_as_it_is_with_no_redis_call(keys):
    class NoRedis:
        def __getattr__(self, name):
            raise AssertionError(f"Redis was called: {name}")

    req = chat("hello", "hi", [Text(text="only text")])
    fetcher = offline()
    assert await store_images(req, store=MediaStore(NoRedis(), keys, 10), fetcher=fetcher, info=None,  # type: ignore[arg-type]
                              settings=settings(), hold_s=None) is req
    prompt = GenerationRequest(prompt="x")
    assert await store_images(prompt, store=MediaStore(NoRedis(), keys, 10), fetcher=fetcher, info=None,  # type: ignore[arg-type]
                              settings=settings(), hold_s=None) is prompt


async def test_what_store_images_refuses(redis, keys):
    store = MediaStore(redis, keys, ttl_s=100)
    fetcher = offline()

    async def refused(req: GenerationRequest, info: ModelInfo | None = VISION, **limits) -> InvalidRequest:
        with pytest.raises(InvalidRequest) as exc:
            await store_images(req, store=store, fetcher=fetcher, info=info, settings=settings(**limits), hold_s=None)
        return exc.value

    image = Image(data=b64(png()), media_type="image/png")
    text_only = await refused(chat("hi", "hello", [Text(text="look"), image]), info=ModelInfo())
    assert text_only.message == "model `tiny` does not take images" and text_only.param == "messages[2].parts[1]"
    # Anthropic's check: a base64 source's media_type must be what its bytes are
    wrong = await refused(chat([Image(data=b64(png()), media_type="image/jpeg")]))
    assert "Image does not match the provided media type image/jpeg" in wrong.message
    assert wrong.param == "messages[0].parts[0]"
    big = await refused(chat([Text(text="x"), image]), max_image_bytes=len(png()) - 1)
    assert f"exceeds {len(png()) - 1} bytes" in big.message and big.param == "messages[0].parts[1]"
    wide = await refused(chat([image]), max_image_px=29)
    assert "max allowed size: 29 pixels (30x20)" in wide.message
    assert "not a valid image" in (await refused(chat([Image(data=b64(b"GIF89a-nope"))]))).message
    assert "not valid base64" in (await refused(chat([Image(data="###")]))).message
    assert "data URL" in (await refused(chat([Image(url="data:image/png,raw")]))).message
    assert "needs a `url` or `data`" in (await refused(chat([Image()]))).message
    forged = Image(sha256="f" * 64, format="png", width=3, height=2, tokens=1)
    assert "no longer stored" in (await refused(chat([forged]))).message
    assert "is refused" in (await refused(chat([Image(url="file:///etc/passwd")]))).message
    assert await media_keys(redis, keys) == []  # nothing refused was stored


async def test_a_model_nobody_has_described_gets_the_fallback_estimate(redis, keys):
    out = await store_images(chat([Image(data=b64(png((1000, 1000))))]), store=MediaStore(redis, keys, ttl_s=100),
                             fetcher=offline(), info=None, settings=settings(),
                             hold_s=None)
    assert out.images[0].tokens == fallback_tokens(1000, 1000) == 1334


async def test_model_infos_are_read_from_redis_and_cached(redis, keys):
    infos = ModelInfos(redis, keys, cache_s=0.3)
    assert await infos.get("tiny") is None
    await redis.hset(keys.model_info(), mapping={"tiny": msgspec.json.encode(VISION), "junk": b"{not json"})
    assert await infos.get("tiny") is None  # read within cache_s: the copy it holds
    await asyncio.sleep(0.35)
    assert await infos.get("tiny") == VISION and await infos.get("junk") is None


# --- fetching ------------------------------------------------------------------------------------


async def test_an_allowed_url_is_fetched_and_stored(redis, keys, origin):
    image = png((600, 400))
    origin.routes["/a.png"] = answer(200, image, Content_Type="image/png", Set_Cookie="session=s3cret; Path=/")
    origin.routes["/r"] = answer(302, Location="/a.png")  # relative: resolved against the URL
    fetcher = MediaFetcher.of(settings(media_allow="127.0.0.1"))
    try:
        host = origin.url.removeprefix("http://")
        req = chat([Text(text="what?"), Image(url=f"{origin.url}/a.png")], "a picture",
                   [Image(url=f"http://user:pw@{host}/r")])
        out = await store_images(req, store=MediaStore(redis, keys, ttl_s=100), fetcher=fetcher, info=VISION,
                                 settings=settings(), hold_s=None)
    finally:
        await fetcher.aclose()
    [key] = await media_keys(redis, keys)
    assert await redis.get(key) == image
    assert [(i.format, i.width, i.height) for i in out.images] == [("png", 600, 400)] * 2
    assert [path for path, _ in origin.requests] == ["/a.png", "/r", "/a.png"]
    for _, headers in origin.requests:
        assert headers["user-agent"] == "llmq" and headers["host"] == host
        assert "cookie" not in headers and "authorization" not in headers  # no cookie kept, no credentials sent


async def test_the_default_policy_refuses_loopback_before_connecting(origin):
    origin.routes["/a.png"] = answer(200, png())
    fetcher = MediaFetcher.of(settings())
    try:
        refused = await fetch_refused(fetcher, f"{origin.url}/a.png")
    finally:
        await fetcher.aclose()
    assert refused.message == "messages[0].parts[0]: the image URL is refused: 127.0.0.1 is a loopback address"
    assert origin.connections == 0


@pytest.mark.parametrize(("allow", "url", "why"), [
    ("", "http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a cloud metadata address"),
    ("127.0.0.1", "http://169.254.169.254/latest/meta-data/", "outside LLMQ_MEDIA_ALLOW"),
    ("", "http://[::ffff:169.254.169.254]/", "cloud metadata address"),
    ("", "http://10.1.2.3/x.png", "private address"),
    ("", "http://localhost/x.png", "localhost is a local or cloud-metadata name"),
    ("", "http://metadata.google.internal/x.png", "local or cloud-metadata name"),
    # a name not listed: its addresses decide (localhost's, from /etc/hosts: 127.0.0.1, maybe ::1)
    ("127.0.0.2/32", "http://localhost/x.png", "localhost resolves to an address outside LLMQ_MEDIA_ALLOW"),
    ("", "ftp://example.com/x.png", "not an http(s) URL"),
])
async def test_internal_destinations_are_refused_before_any_connection(allow, url, why):
    fetcher = MediaFetcher.of(settings(media_allow=allow), client=no_connection())
    started = time.monotonic()
    try:
        refused = await fetch_refused(fetcher, url)
    finally:
        await fetcher.aclose()
    assert why in refused.message and "the image URL is refused" in refused.message
    assert time.monotonic() - started < 0.5
    assert "WEBHOOK" not in refused.message and "::1" not in refused.message
    assert "127.0.0.1" not in refused.message  # never an address the name resolved to


async def test_a_redirect_is_checked_again_as_a_new_hop(origin):
    async with Origin("127.0.0.2") as other:
        other.routes["/a.png"] = answer(200, png())
        origin.routes["/r"] = answer(302, Location=f"{other.url}/a.png")
        origin.routes["/loop"] = answer(307, Location="/loop")
        fetcher = MediaFetcher.of(settings(media_allow="127.0.0.1"))
        try:
            refused = await fetch_refused(fetcher, f"{origin.url}/r")
            assert refused.message == ("messages[0].parts[0]: the image URL's redirect is refused: 127.0.0.2 is an "
                                       "address outside LLMQ_MEDIA_ALLOW")
            assert other.connections == 0
            looped = await fetch_refused(fetcher, f"{origin.url}/loop")
            assert "redirected more than 5 times" in looped.message
            assert [p for p, _ in origin.requests].count("/loop") == 6  # the first hop and five redirects
        finally:
            await fetcher.aclose()


async def test_a_body_past_the_limit_is_refused_without_reading_it(origin):
    origin.routes["/declared"] = stalled(Content_Length=str(100 * 2**20), Content_Type="image/png")
    origin.routes["/endless"] = origin.streaming()
    fetcher = MediaFetcher.of(settings(media_allow="127.0.0.1", media_fetch_timeout_s=5.0))
    try:
        started = time.monotonic()
        declared = await fetch_refused(fetcher, f"{origin.url}/declared")
        assert time.monotonic() - started < 2  # from the header alone: the body never comes
        assert declared.message == (f"messages[0].parts[0]: the image at 127.0.0.1 exceeds {LIMIT} bytes "
                                    "(LLMQ_MAX_IMAGE_BYTES)")
        # A body that never ends: refused for its size (not its time), so the read stopped.
        started = time.monotonic()
        endless = await fetch_refused(fetcher, f"{origin.url}/endless")
        assert f"exceeds {LIMIT} bytes" in endless.message and time.monotonic() - started < 2
    finally:
        await fetcher.aclose()
    # What the server got written before the hang-up: the limit plus what loopback's socket buffers
    # (autotuned to megabytes) took in.
    assert origin.sent < 32 * 2**20


async def test_a_slow_server_missing_image_and_closed_port_are_400s(origin):
    origin.routes["/slow"] = stalled(Content_Length="1000")
    fetcher = MediaFetcher.of(settings(media_allow="127.0.0.1,localhost", media_fetch_timeout_s=0.5))
    try:
        started = time.monotonic()
        slow = await fetch_refused(fetcher, f"{origin.url}/slow")
        assert 0.4 < time.monotonic() - started < 2
        assert slow.message == ("messages[0].parts[0]: fetching the image from 127.0.0.1 took longer than 0.5 s "
                                "(LLMQ_MEDIA_FETCH_TIMEOUT_S)")
        missing = await fetch_refused(fetcher, f"{origin.url}/nothing.png")
        assert missing.message == "messages[0].parts[0]: fetching the image from 127.0.0.1 answered 404"
        closed = await fetch_refused(fetcher, f"http://localhost:{free_port()}/a.png")
        assert closed.message == "messages[0].parts[0]: could not fetch the image from localhost (ConnectError)"
        origin.routes["/gz"] = answer(200, b"\x1f\x8b", Content_Encoding="gzip")
        assert "Content-Encoding gzip" in (await fetch_refused(fetcher, f"{origin.url}/gz")).message
    finally:
        await fetcher.aclose()


async def test_images_of_one_request_are_fetched_concurrently_and_the_first_error_wins(redis, keys, origin):
    origin.routes["/slow.png"] = stalled(Content_Length="1000")
    for n in range(3):
        origin.routes[f"/{n}.png"] = answer(200, png((n + 1, 1)))
    fetcher = MediaFetcher.of(settings(media_allow="127.0.0.1", media_fetch_timeout_s=0.6))
    try:
        started = time.monotonic()
        with pytest.raises(InvalidRequest) as refused:
            await store_images(chat([Image(url=f"{origin.url}/{n}.png") for n in range(3)] + [
                Image(url=f"{origin.url}/slow.png"), Image(url=f"{origin.url}/slow.png")]),
                store=MediaStore(redis, keys, ttl_s=100), fetcher=fetcher, info=VISION, settings=settings(),
                hold_s=None)
        assert time.monotonic() - started < 1.5  # one timeout, not one per image
    finally:
        await fetcher.aclose()
    assert refused.value.param == "messages[0].parts[3]" and "took longer" in refused.value.message
    assert [p for p, _ in origin.requests].count("/slow.png") == 1  # one read per distinct source


# --- through the API -----------------------------------------------------------------------------

pytestmark = pytest.mark.stack(models="text-only,vision")


@pytest.fixture(scope="module")
async def described(stack):
    """The two extra models' infos, written before any request reads them."""
    keys = Keys(stack.settings.prefix)
    await stack.redis.hset(keys.model_info(), mapping={"text-only": msgspec.json.encode(ModelInfo()),
                                                       "vision": msgspec.json.encode(VISION)})
    return stack


def job(model: str, url: str) -> dict:
    return {"model": model, "sampling": {"max_tokens": 1},
            "messages": [{"role": "user", "parts": [{"type": "text", "text": "what is it?"},
                                                    {"type": "image", "url": url}]}]}


async def test_the_api_stores_an_image_and_queues_its_reference(described):
    s = described
    image = png((64, 48))
    resp = await s.client.post("/v1/jobs", json=job("vision", f"data:image/png;base64,{b64(image)}"))
    assert resp.status_code == 202, resp.text
    keys = Keys(s.settings.prefix)
    queued = decode_request(await s.redis.hget(keys.job("vision", resp.json()["id"]), "request"))
    [ref] = queued.images
    assert ref.url is None and (ref.format, ref.width, ref.height, ref.tokens) == ("png", 64, 48, 4 * 3 * 64 + 64)
    assert await s.redis.get(keys.media(ref.sha256)) == image
    # With no deadline of its own, the job gets LLMQ_MEDIA_TTL_S as its deadline, and its image is
    # kept past it: no job outlives its images.
    ttl, ttl_s = await s.redis.ttl(keys.media(ref.sha256)), s.settings.media_ttl_s
    assert ttl_s < ttl <= ttl_s + HOLD_MARGIN_S
    record = await s.redis.hmget(keys.job("vision", resp.json()["id"]), ["queued_at", "deadline", "estimate"])
    assert float(record[1]) - float(record[0]) == ttl_s * 1000
    # What the fair share and the quotas charge: its text, its image's tokens, what it may generate.
    assert int(record[2]) == len("what is it?") // 4 + 1 + ref.tokens + 1


async def test_the_api_refuses_an_image_for_a_text_only_model(described):
    s = described
    stored = await s.redis.keys(Keys(s.settings.prefix).media("*"))
    resp = await s.client.post("/v1/jobs", json=job("text-only", f"data:image/png;base64,{b64(png((5, 5)))}"))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"] == "model `text-only` does not take images"
    assert error["param"] == "messages[0].parts[1]" and error["code"] == "invalid_request"
    assert await s.redis.keys(Keys(s.settings.prefix).media("*")) == stored  # nothing stored


async def test_the_api_refuses_an_image_past_the_limit_and_a_body_past_its_own(described):
    s = described
    stored = await s.redis.keys(Keys(s.settings.prefix).media("*"))
    big = f"data:image/png;base64,{b64(png() + bytes(9_000_000 * 3 // 4))}"  # a 9 MB data URL
    assert 8_900_000 < len(big) < 9_100_000
    resp = await s.client.post("/v1/jobs", json=job("vision", big))
    assert resp.status_code == 400, resp.text
    assert f"image exceeds {s.settings.max_image_bytes} bytes" in resp.json()["error"]["message"]
    over = job("vision", "data:image/png;base64," + "A" * s.settings.max_body_bytes)
    resp = await s.client.post("/v1/jobs", content=msgspec.json.encode(over),
                               headers={"content-type": "application/json"})
    assert resp.status_code == 413, resp.text[:300]
    assert await s.redis.keys(Keys(s.settings.prefix).media("*")) == stored


async def test_the_api_refuses_more_images_than_a_request_may_hold(described):
    s = described
    stored = await s.redis.keys(Keys(s.settings.prefix).media("*"))
    many = s.settings.max_images + 1
    parts = [{"type": "image", "url": f"data:image/png;base64,{b64(png((1, 1), color=n % 256))}"} for n in range(many)]
    body = {"model": "vision", "sampling": {"max_tokens": 1}, "messages": [{"role": "user", "parts": parts}]}
    resp = await s.client.post("/v1/jobs", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["message"] == f"too many images: at most 100 in a request (LLMQ_MAX_IMAGES), got {many}"
    assert error["param"] == "messages[0].parts[100]"
    assert await s.redis.keys(Keys(s.settings.prefix).media("*")) == stored  # none read or stored


async def test_models_say_what_each_model_takes(described):
    resp = await described.client.get("/v1/models")
    assert resp.status_code == 200
    taken = {card["id"]: card["input_modalities"] for card in resp.json()["data"]}
    # "tiny": its worker said text only (the scripted stack's); the others as their infos say.
    assert taken == {"tiny": ["text"], "text-only": ["text"], "vision": ["text", "image"]}


async def test_the_worker_reads_a_jobs_images_by_hash_and_hands_them_to_the_engine(redis_url):
    image = png((64, 48), color=7)
    async with scripted_stack(redis_url, f"imgw-{uuid.uuid4().hex[:6]}", info=VISION) as s:
        resp = await s.client.post("/v1/jobs", json=job("tiny", f"data:image/png;base64,{b64(image)}"))
        assert resp.status_code == 202, resp.text
        url = resp.json()["url"]

        async def done() -> bool:
            return (await s.client.get(url)).json()["status"] == "done"
        await eventually(done, timeout_s=10, what="the job to finish")
        [given] = [i for i in s.worker.engine.images if i]
        [(sha, decoded)] = given.items()
        assert sha == hashlib.sha256(image).hexdigest() and (decoded.mode, decoded.size) == ("RGB", (64, 48))
        # Claimed: renewed past the job's deadline (LLMQ_MEDIA_TTL_S, as it had none).
        assert await s.redis.ttl(Keys(s.settings.prefix).media(sha)) > s.settings.media_ttl_s


async def test_a_worker_fails_a_job_whose_image_is_gone_as_the_clients_to_send_again(redis):
    store = MediaStore(redis, Keys(f"gone-{uuid.uuid4().hex[:6]}"), ttl_s=60)
    ref = Image(sha256="0" * 64, format="png", width=1, height=1, tokens=1)
    req = GenerationRequest(messages=[ChatMessage(role="user", parts=[ref])])
    with pytest.raises(InvalidRequest, match="no longer stored"):
        await load_images(store, req)


async def test_a_client_cannot_name_a_stored_image_by_its_hash(described):
    """Images are kept by content hash for every tenant alike: a hash a client names could be an
    image another tenant sent, so only llmq's own records carry references."""
    s = described
    image = png((9, 9), color=3)
    sha = hashlib.sha256(image).hexdigest()
    await MediaStore(s.redis, Keys(s.settings.prefix), 60).put(sha, image)  # another tenant's image
    body = {"model": "vision", "sampling": {"max_tokens": 1}, "messages": [{"role": "user", "parts": [
        {"type": "image", "sha256": sha, "format": "png", "width": 9, "height": 9}]}]}
    resp = await s.client.post("/v1/jobs", json=body)
    assert resp.status_code == 400 and "sha256" in resp.json()["error"]["message"], resp.text
