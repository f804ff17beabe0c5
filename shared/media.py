"""Images kept by content hash: what the API and the workers both know of them (docs/images.md).

The API reads an image once (a data URL, base64, or a URL it fetches itself: api/media.py), reads
its format and size from its header, checks the limits, and stores its bytes under their SHA-256
(:meth:`MediaStore.put`). The job carries only the reference (:class:`shared.schemas.Image`). A
worker reads the bytes back by that hash when it claims the job, or continues it after a crash
(:meth:`MediaStore.get`), and renews the key as it reads: an image never expires before the jobs
that name it.

What a model takes, and how its processor counts an image, is :class:`ModelInfo`: each worker
writes its model's as it comes up (``llmq:model-info``), and the API reads it to refuse an image
for a text-only model and to estimate an image's tokens at admission.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import warnings
from typing import Literal

import msgspec
from redis.asyncio import Redis

from shared.config import ModelKind
from shared.errors import InvalidRequest
from shared.keys import Keys
from shared.redis import reply
from shared.schemas import IMAGE_FORMATS, GenerationRequest

__all__ = ["HOLD_MARGIN_S", "Modality", "ImageCost", "ModelInfo", "Sniffed", "sniff", "decode_base64", "data_url",
           "MediaStore", "TEXT_ONLY", "default_timeout_s"]

Modality = Literal["text", "image"]

HOLD_MARGIN_S = 60.0
"""Past a job's deadline, how much longer its images are kept at least (at admission, and again at
each claim): clocks differ, and a takeover reads them after the first worker."""


def default_timeout_s(req: GenerationRequest, deadline_s: float, media_ttl_s: int) -> float:
    """A job's deadline when its request names none (seconds from queueing; 0: none): the
    deployment's LLMQ_DEADLINE_S, and for a job with images that has none, LLMQ_MEDIA_TTL_S, so
    no job outlives the images it names (they are kept past its deadline: :data:`HOLD_MARGIN_S`).
    A batch line's default is its batch's window instead (workers/housekeeping/batches.py)."""
    return deadline_s or (float(media_ttl_s) if req.images else 0.0)


class ImageCost(msgspec.Struct, frozen=True, kw_only=True):
    """How a model's processor turns an image into tokens, as its worker reads it from the
    processor's config (workers/vision.py), for the API's estimate (:meth:`tokens`). The Idefics3 /
    SmolVLM family: the image is resized so its longest edge is ``longest_edge``, cut into
    ``tile`` × ``tile`` tiles (when ``split`` and it is larger than one tile), each ``per_tile``
    tokens, each row of tiles followed by ``per_row`` (a newline), the whole by ``per_split`` once
    (a second newline, where the tokenizer does not merge the two), plus one global image of
    ``per_global``. An image of one tile is the global image alone. A model of another family
    reports ``tile`` 0: each image is then ``per_global`` tokens."""

    longest_edge: int = 0
    tile: int = 0
    per_tile: int = 0
    per_global: int = 0
    split: bool = True
    per_row: int = 0
    per_split: int = 0

    def tokens(self, width: int, height: int) -> int:
        """The tokens an image of ``width`` × ``height`` pixels becomes: exactly as many as the
        Idefics3 processor (transformers' ``get_number_of_image_patches``, which vLLM counts by) makes."""
        if self.tile <= 0 or not self.split or width <= 0 or height <= 0:
            return self.per_global
        w, h = _resized(width, height, self.longest_edge or max(width, height))
        rows, cols = math.ceil(h / self.tile), math.ceil(w / self.tile)
        if rows * cols <= 1:
            return self.per_global
        return rows * cols * self.per_tile + rows * self.per_row + self.per_split + self.per_global


_MAX_SIDE = 4096  # transformers' Idefics3 MAX_IMAGE_SIZE: no side is resized past it


def _resized(width: int, height: int, longest: int) -> tuple[int, int]:
    """An image's size once its longest edge is ``longest``, as Idefics3 resizes it: the other edge
    truncated, then rounded up to even, then both kept within :data:`_MAX_SIDE`."""
    aspect = width / height
    if width >= height:
        width = longest
        height = int(width / aspect)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect)
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    aspect = width / height
    if width >= height and width > _MAX_SIDE:
        width, height = _MAX_SIDE, int(_MAX_SIDE / aspect)
    elif height > width and height > _MAX_SIDE:
        height, width = _MAX_SIDE, int(_MAX_SIDE * aspect)
    return max(width, 1), max(height, 1)


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a model does and takes (``/v1/models``' ``kind`` and ``input_modalities``), as its workers
    report it."""

    kind: ModelKind = "generate"
    """A generator, or a pooling model (an embedder, a cross-encoder): the jobs it takes."""
    input_modalities: list[Modality] = msgspec.field(default_factory=lambda: ["text"])
    image: ImageCost | None = None
    """How it counts an image; None for a text-only model."""

    @property
    def images(self) -> bool:
        return "image" in self.input_modalities


TEXT_ONLY = ModelInfo()


class Sniffed(msgspec.Struct, frozen=True, kw_only=True):
    """An image's bytes, as its header describes them."""

    sha256: str
    format: str
    width: int
    height: int
    size: int


def sniff(data: bytes, *, max_bytes: int, max_px: int, where: str = "image") -> Sniffed:
    """``data``'s format and size from its header (Pillow reads only the header: nothing is
    decoded), checked against the limits. Raises :class:`InvalidRequest` naming ``where`` for an
    image too large (bytes or pixels), not an image, or of a format not in :data:`IMAGE_FORMATS`."""
    if len(data) > max_bytes:
        raise InvalidRequest(f"{where}: image exceeds {max_bytes} bytes ({len(data)} bytes)", param=where)
    from PIL import Image as PILImage  # the API's one image dependency, read on first use

    try:
        with warnings.catch_warnings():  # a huge header is refused below by its size, not warned of
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            with PILImage.open(io.BytesIO(data)) as img:
                fmt, (width, height) = (img.format or "").lower(), img.size
    except PILImage.DecompressionBombError:  # past twice Pillow's pixel bound: far past max_px too
        raise InvalidRequest(f"{where}: image dimensions exceed max allowed size: {max_px} pixels",
                             param=where) from None
    except Exception:  # Pillow's UnidentifiedImageError, and whatever a truncated header raises
        raise InvalidRequest(f"{where}: the data is not a valid image", param=where) from None
    if fmt not in IMAGE_FORMATS:
        raise InvalidRequest(f"{where}: image format `{fmt}` is not supported (png, jpeg, gif or webp)",
                             param=where)
    if width > max_px or height > max_px:
        raise InvalidRequest(f"{where}: image dimensions exceed max allowed size: {max_px} pixels "
                             f"({width}x{height})", param=where)
    return Sniffed(sha256=hashlib.sha256(data).hexdigest(), format=fmt, width=width, height=height, size=len(data))


def decode_base64(text: str, *, where: str = "image") -> bytes:
    """Base64 as clients send it (padding required, whitespace tolerated); raises InvalidRequest."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the image data is not valid base64", param=where) from None


def data_url(url: str, *, where: str = "image") -> tuple[str, bytes]:
    """A ``data:<media type>;base64,<data>`` URL's media type and bytes; raises InvalidRequest."""
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        raise InvalidRequest(f"{where}: a data URL must be `data:<media type>;base64,<data>`", param=where)
    return head[5:-7], decode_base64(payload, where=where)


class MediaStore:
    """Images in Redis under ``llmq:media:<sha256>`` (shared/keys.py), kept ``ttl_s`` past each use."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s

    def _ttl(self, hold_s: float | None) -> int:
        return max(self.ttl_s, math.ceil(hold_s or 0))

    async def put(self, sha256: str, data: bytes, *, hold_s: float | None = None) -> bool:
        """Store ``data`` under ``sha256`` unless it is there, and keep it ``max(ttl_s, hold_s)``
        from now either way; returns whether it was written (False: already held, renewed only:
        a conversation's screenshot is sent every turn and stored once)."""
        key, ttl = self.keys.media(sha256), self._ttl(hold_s)
        if await reply(self.redis.expire(key, ttl)):
            return False
        await reply(self.redis.set(key, data, ex=ttl))
        return True

    async def renew(self, sha256s: list[str], *, hold_s: float | None = None) -> list[bool]:
        """Keep each image ``max(ttl_s, hold_s)`` from now; per image, whether it was still held."""
        if not sha256s:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for sha in sha256s:
            pipe.expire(self.keys.media(sha), self._ttl(hold_s))
        return [bool(held) for held in await pipe.execute()]

    async def get(self, sha256: str, *, hold_s: float | None = None) -> bytes | None:
        """An image's bytes (None: expired or never stored), renewed as read (GETEX: Redis 6.2)."""
        return await reply(self.redis.getex(self.keys.media(sha256), ex=self._ttl(hold_s)))
