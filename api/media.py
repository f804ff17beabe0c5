"""Images at admission: read once, checked, stored by hash, queued as references (docs/images.md).

A dialect reads an image as a source (:class:`shared.schemas.Image` with ``url``, or ``data`` and
``media_type``). Before the job is queued, :func:`store_images` reads each source (a ``data:``
URL, base64, or an http(s) URL the :class:`MediaFetcher` fetches), reads its format and size from
its header (:func:`shared.media.sniff`), checks the limits, stores its bytes under their SHA-256
(:class:`shared.media.MediaStore`: a second request with the same image only renews it) and puts
the reference in the source's place. The job record, and so the worker, sees references only.

A URL is fetched the way webhooks are delivered (shared/egress.py), under ``LLMQ_MEDIA_ALLOW``:
every address the host resolves to is checked, the connection goes to the checked address (no DNS
rebinding), redirects are not followed by httpx but checked again as a new hop (at most
:data:`MAX_REDIRECTS`), the body is read up to ``LLMQ_MAX_IMAGE_BYTES`` and the whole fetch within
``LLMQ_MEDIA_FETCH_TIMEOUT_S``. Every failure is the client's 400, naming the URL's host, never an
address it resolved to.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy

import httpx
import msgspec
import structlog
from redis.asyncio import Redis

from shared.config import Settings
from shared.egress import Policy, Refused, pin, policy
from shared.errors import InternalError, InvalidRequest
from shared.keys import Keys
from shared.media import (
    HOLD_MARGIN_S,
    MediaStore,
    ModelInfo,
    Sniffed,
    data_url,
    decode_base64,
    default_timeout_s,
    sniff,
)
from shared.redis import reply
from shared.schemas import IMAGE_FORMATS, GenerationRequest, Image

__all__ = ["MediaFetcher", "ModelInfos", "Media", "store_images", "fallback_tokens", "hold_for", "MAX_REDIRECTS",
           "FETCH_CONCURRENCY", "HOLD_MARGIN_S", "USER_AGENT", "admit_images", "media_client"]

log = structlog.get_logger()

MAX_REDIRECTS = 5
"""Redirects one image URL may take (each checked as a new hop); the sixth is a 400."""
FETCH_CONCURRENCY = 4
"""Sources of one request read at once (fetches, and decoding in threads)."""
USER_AGENT = "llmq"
_ACCEPT = "image/png,image/jpeg,image/gif,image/webp,image/*;q=0.8,*/*;q=0.1"
_SHA256_HEX = frozenset("0123456789abcdef")

_model_info = msgspec.json.Decoder(ModelInfo)


def _no_cookies() -> CookieJar:
    """A jar that keeps nothing: a fetch never sends a cookie another fetch (another client's URL) was set."""
    return CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))


def media_client(timeout_s: float) -> httpx.AsyncClient:
    """The API's client for image URLs: no redirects of its own (each hop is checked and pinned),
    no proxies, ``.netrc`` or certificates from the environment, no cookies kept, no auth."""
    return httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False, cookies=_no_cookies(),
                             headers={"User-Agent": USER_AGENT, "Accept": _ACCEPT, "Accept-Encoding": "identity"})


def _host(url: httpx.URL | str) -> str:
    """The URL's host as a message may name it (never an address it resolved to)."""
    try:
        return (url if isinstance(url, httpx.URL) else httpx.URL(url)).host or "the URL's host"
    except (httpx.InvalidURL, TypeError):
        return "the URL's host"


class MediaFetcher:
    """Fetches image URLs through the egress guard (``LLMQ_MEDIA_ALLOW``, shared/egress.py)."""

    def __init__(self, *, allow: str = "", max_bytes: int, timeout_s: float,
                 client: httpx.AsyncClient | None = None) -> None:
        self.rules: Policy = policy(allow)
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.client = client if client is not None else media_client(timeout_s)

    @classmethod
    def of(cls, settings: Settings, client: httpx.AsyncClient | None = None) -> MediaFetcher:
        return cls(allow=settings.media_allow, max_bytes=settings.max_image_bytes,
                   timeout_s=settings.media_fetch_timeout_s, client=client)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def fetch(self, url: str, *, where: str = "image") -> bytes:
        """The body at ``url``, redirects followed (each one checked), at most ``max_bytes`` and
        within ``timeout_s`` in all. Raises :class:`InvalidRequest` (``param``: ``where``)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._fetch(url, where)
        except TimeoutError:
            raise InvalidRequest(f"{where}: fetching the image from {_host(url)} took longer than "
                                 f"{self.timeout_s:g} s (LLMQ_MEDIA_FETCH_TIMEOUT_S)", param=where) from None

    async def _fetch(self, url: str, where: str) -> bytes:
        current = url
        for hop in range(MAX_REDIRECTS + 1):
            host = _host(current)
            try:
                target = await pin(self.rules, current, timeout_s=self.timeout_s)
            except Refused as exc:
                # The policy's words name LLMQ_WEBHOOK_ALLOW (shared/egress.py); here it is ours.
                reason = exc.message.replace("LLMQ_WEBHOOK_ALLOW", "LLMQ_MEDIA_ALLOW")
                what = "the image URL" if hop == 0 else "the image URL's redirect"
                log.info("media_refused", reason=reason, address=str(exc.address) if exc.address else None)
                raise InvalidRequest(f"{where}: {what} is refused: {reason}", param=where) from None
            except OSError:  # the name does not resolve (TimeoutError passes: the whole fetch's)
                raise InvalidRequest(f"{where}: could not resolve the image URL's host {host}", param=where) from None
            # No credentials leave with the request: userinfo in a URL would become a Basic header.
            request_url = target.url.copy_with(username=None, password=None)
            try:
                async with self.client.stream("GET", request_url, headers=target.headers,
                                              extensions=target.extensions) as answer:
                    if answer.is_redirect:
                        try:
                            current = str(httpx.URL(current).join(answer.headers["location"]))
                        except httpx.InvalidURL:
                            raise InvalidRequest(f"{where}: {host} redirected the image URL to an invalid URL",
                                                 param=where) from None
                        continue
                    if not answer.is_success:
                        raise InvalidRequest(f"{where}: fetching the image from {host} answered "
                                             f"{answer.status_code}", param=where)
                    return await self._body(answer, host, where)
            except httpx.HTTPError as exc:
                # Not str(exc): a connection error's text may name the address connected to.
                raise InvalidRequest(f"{where}: could not fetch the image from {host} ({type(exc).__name__})",
                                     param=where) from None
        raise InvalidRequest(f"{where}: the image URL redirected more than {MAX_REDIRECTS} times", param=where)

    async def _body(self, answer: httpx.Response, host: str, where: str) -> bytes:
        too_large = InvalidRequest(f"{where}: the image at {host} exceeds {self.max_bytes} bytes "
                                   "(LLMQ_MAX_IMAGE_BYTES)", param=where)
        length = answer.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise too_large  # known from the header: nothing of the body is read
        encoding = answer.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # asked for identity; a compressed answer's size is unknown
            raise InvalidRequest(f"{where}: {host} answered with Content-Encoding {encoding}; images are "
                                 "fetched uncompressed", param=where)
        chunks: list[bytes] = []
        size = 0
        async for chunk in answer.aiter_raw():
            size += len(chunk)
            if size > self.max_bytes:
                raise too_large  # the rest is never read: the connection is closed
            chunks.append(chunk)
        return b"".join(chunks)


class ModelInfos:
    """What each model takes (``llmq:model-info``, written by its workers), read whole at most once
    per ``cache_s`` per process."""

    def __init__(self, redis: Redis, keys: Keys, *, cache_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = keys
        self.cache_s = cache_s
        self._infos: dict[str, ModelInfo] = {}
        self._at = float("-inf")

    async def get(self, model: str) -> ModelInfo | None:
        """``model``'s info; None when no worker of it has reported one yet (unknown)."""
        if time.monotonic() - self._at >= self.cache_s:
            raw: dict[bytes, bytes] = await reply(self.redis.hgetall(self.keys.model_info()))
            infos: dict[str, ModelInfo] = {}
            for name, value in raw.items():
                try:
                    infos[name.decode()] = _model_info.decode(value)
                except (msgspec.DecodeError, UnicodeDecodeError):  # a newer worker's form: unknown here
                    log.warning("model_info_unreadable", model=name.decode(errors="replace"))
            self._infos, self._at = infos, time.monotonic()
        return self._infos.get(model)


# What llmq assumes of a model whose worker has not said (no `llmq:model-info` entry yet):
# Anthropic's published rule, tokens = width * height / 750 after the image is scaled to at most
# 1568 pixels on its long edge and 1.15 megapixels. An estimate for the fair share and quotas
# only; the worker counts the real tokens, and refuses the image if its model takes none.
_FALLBACK_EDGE = 1568
_FALLBACK_AREA = 1_150_000
_FALLBACK_PX_PER_TOKEN = 750


def fallback_tokens(width: int, height: int) -> int:
    """An image's tokens for a model of unknown cost (Anthropic's rule): at most about 1534."""
    if width <= 0 or height <= 0:
        return 1
    scale = min(1.0, _FALLBACK_EDGE / max(width, height), math.sqrt(_FALLBACK_AREA / (width * height)))
    return max(1, math.ceil(round(width * scale) * round(height * scale) / _FALLBACK_PX_PER_TOKEN))


def _tokens(info: ModelInfo | None, width: int, height: int) -> int:
    if info is None or info.image is None:
        return fallback_tokens(width, height)
    return info.image.tokens(width, height)


def hold_for(req: GenerationRequest, default_timeout_s: float) -> float | None:
    """How long a job's images must be kept at least from now: its deadline (``timeout_s``, else
    ``LLMQ_DEADLINE_S``) plus :data:`HOLD_MARGIN_S`; None for a job with no deadline (the store's
    ``LLMQ_MEDIA_TTL_S`` then, renewed when a worker claims it)."""
    timeout = req.timeout_s or default_timeout_s
    return timeout + HOLD_MARGIN_S if timeout > 0 else None


def _source_key(image: Image) -> tuple[str, ...]:
    if image.url is not None:
        return ("url", image.url)
    if image.data is not None:
        return ("data", image.data, image.media_type or "")
    return ("ref", image.sha256)


async def _read(image: Image, where: str, fetcher: MediaFetcher) -> bytes:
    """A source's bytes. Base64 is decoded in a thread (a 5 MB image is milliseconds of CPU the
    event loop would otherwise stop for)."""
    url, data = image.url, image.data
    if url is not None and data is not None:
        raise InvalidRequest(f"{where}: an image has either `url` or `data`, not both", param=where)
    if url is not None and url[:5].lower() == "data:":
        # A data URL's own media type is not checked against its bytes (OpenAI's is not either).
        _, raw = await asyncio.to_thread(data_url, url, where=where)
        return raw
    if url is not None:
        return await fetcher.fetch(url, where=where)
    assert data is not None
    return await asyncio.to_thread(decode_base64, data, where=where)


async def store_images(req: GenerationRequest, *, store: MediaStore, fetcher: MediaFetcher, info: ModelInfo | None,
                       settings: Settings, hold_s: float | None, keep: bool = True) -> GenerationRequest:
    """``req`` with every image source read, checked, stored (once per content) and replaced by its
    reference; ``req`` itself when it holds no image (no Redis call). ``info``: the model's
    (None: unknown, images admitted with :func:`fallback_tokens`). A reference already in ``req``
    (a conversation continued from a stored one) is renewed, and refused if it is gone. Raises
    :class:`InvalidRequest` naming the image (``messages[i].parts[j]``) for anything refused.
    ``keep`` False: read and checked only, nothing stored or renewed (``count_tokens``)."""
    places = [(i, j, part) for i, m in enumerate(req.messages or ()) for j, part in enumerate(m.parts)
              if isinstance(part, Image)]
    if not places:
        return req
    if info is not None and not info.images:
        i, j, _ = places[0]
        raise InvalidRequest(f"model `{req.served_name}` does not take images", param=f"messages[{i}].parts[{j}]")
    if len(places) > settings.max_images:
        i, j, _ = places[settings.max_images]
        raise InvalidRequest(f"too many images: at most {settings.max_images} in a request (LLMQ_MAX_IMAGES), "
                             f"got {len(places)}", param=f"messages[{i}].parts[{j}]")
    max_bytes, max_px = settings.max_image_bytes, settings.max_image_px
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def one(image: Image, where: str) -> Sniffed:
        async with gate:
            if image.url is None and image.data is None:
                return await _reference(image, where)
            raw = await _read(image, where, fetcher)
            found = await asyncio.to_thread(sniff, raw, max_bytes=max_bytes, max_px=max_px, where=where)
            if image.data is not None and image.media_type and image.media_type.lower() != f"image/{found.format}":
                # Anthropic's words for a base64 source whose media_type is not what its bytes are
                raise InvalidRequest(f"{where}: Image does not match the provided media type {image.media_type}",
                                     param=where)
            if keep:
                await store.put(found.sha256, raw, hold_s=hold_s)
            return found

    async def _reference(image: Image, where: str) -> Sniffed:
        sha = image.sha256
        if len(sha) != 64 or not set(sha) <= _SHA256_HEX or image.format not in IMAGE_FORMATS:
            raise InvalidRequest(f"{where}: an image needs a `url` or `data`", param=where)
        if image.width <= 0 or image.height <= 0 or max(image.width, image.height) > max_px:
            raise InvalidRequest(f"{where}: the stored image's size is not valid", param=where)
        [held] = await store.renew([sha], hold_s=hold_s) if keep else [True]
        if not held:
            raise InvalidRequest(f"{where}: the image {sha} is no longer stored; send the image again", param=where)
        return Sniffed(sha256=sha, format=image.format, width=image.width, height=image.height, size=0)

    # One read per distinct source (a conversation re-sends its screenshot every turn): the first
    # place that names it is the one its errors name.
    firsts: dict[tuple[str, ...], tuple[Image, str]] = {}
    for i, j, image in places:
        firsts.setdefault(_source_key(image), (image, f"messages[{i}].parts[{j}]"))
    tasks: dict[tuple[str, ...], asyncio.Task[Sniffed]] = {}
    try:
        async with asyncio.TaskGroup() as group:
            for key, (image, where) in firsts.items():
                tasks[key] = group.create_task(one(image, where))
    except BaseExceptionGroup as eg:
        raise _first(eg) from None
    found = {key: task.result() for key, task in tasks.items()}

    messages = list(req.messages or ())
    parts_of: dict[int, list] = {}
    for i, j, image in places:
        s = found[_source_key(image)]
        parts = parts_of.setdefault(i, list(messages[i].parts))
        parts[j] = Image(sha256=s.sha256, format=s.format, width=s.width, height=s.height,
                         tokens=_tokens(info, s.width, s.height), detail=image.detail)
    for i, parts in parts_of.items():
        messages[i] = msgspec.structs.replace(messages[i], parts=parts)
    return msgspec.structs.replace(req, messages=messages)


def _first(eg: BaseExceptionGroup) -> BaseException:
    """The error a failed group answers with: a client error if there is one (the first raised:
    the group cancels the other reads then), else the first error of any kind (Redis down: 503)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(eg)
    return next((e for e in leaves if isinstance(e, InvalidRequest)), leaves[0])


@dataclass(slots=True)
class Media:
    """The API's images: the store, the fetcher (its HTTP client closed with the app) and what
    each model takes. Owned by :class:`api.services.Services`."""

    store: MediaStore
    fetcher: MediaFetcher
    infos: ModelInfos
    settings: Settings

    @classmethod
    def of(cls, redis: Redis, keys: Keys, settings: Settings) -> Media:
        return cls(store=MediaStore(redis, keys, settings.media_ttl_s), fetcher=MediaFetcher.of(settings),
                   infos=ModelInfos(redis, keys), settings=settings)

    async def admit(self, req: GenerationRequest) -> GenerationRequest:
        """:func:`store_images` for a request whose model is resolved; held until its deadline (a
        job with images and no deadline gets ``LLMQ_MEDIA_TTL_S``: :func:`default_timeout_s`)."""
        if not req.images:
            return req
        default = default_timeout_s(req, self.settings.deadline_s, self.settings.media_ttl_s)
        return await store_images(req, store=self.store, fetcher=self.fetcher, info=await self.infos.get(req.model),
                                  settings=self.settings, hold_s=hold_for(req, default))

    async def measure(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with each image read and checked, its tokens estimated, nothing stored
        (Anthropic's ``count_tokens``)."""
        if not req.images:
            return req
        return await store_images(req, store=self.store, fetcher=self.fetcher, info=await self.infos.get(req.model),
                                  settings=self.settings, hold_s=None, keep=False)

    async def aclose(self) -> None:
        await self.fetcher.aclose()


async def admit_images(media: Media | None, req: GenerationRequest) -> GenerationRequest:
    """:meth:`Media.admit`; a request with images on services built without media is an internal
    error (never queued with its sources)."""
    if not req.images:
        return req
    if media is None:
        raise InternalError("images are not configured on this process")
    return await media.admit(req)

