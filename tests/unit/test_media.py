"""Images without Redis: what ``sniff`` reads from a header and refuses, the data URL and base64
readers' errors, the token estimates (shared/media.py, api/media.py)."""

from __future__ import annotations

import base64
import hashlib
import io
import struct
import zlib

import pytest
from PIL import Image as PILImage

from api.media import fallback_tokens, hold_for
from shared.errors import InvalidRequest
from shared.media import ImageCost, ModelInfo, data_url, decode_base64, sniff
from shared.schemas import ChatMessage, GenerationRequest

MB = 5 * 2**20


def image_bytes(fmt: str, size: tuple[int, int] = (3, 2), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    PILImage.new(mode, size).save(out, fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["png", "jpeg", "gif", "webp"])
def test_sniff_reads_each_format_and_size_from_the_header(fmt):
    data = image_bytes(fmt.upper(), (7, 5))
    found = sniff(data, max_bytes=MB, max_px=8000)
    assert (found.format, found.width, found.height, found.size) == (fmt, 7, 5, len(data))
    assert found.sha256 == hashlib.sha256(data).hexdigest()


def test_a_bmp_is_refused_as_an_unsupported_format():
    with pytest.raises(InvalidRequest, match="format `bmp` is not supported") as refused:
        sniff(image_bytes("BMP"), max_bytes=MB, max_px=8000, where="messages[0].parts[1]")
    assert refused.value.param == "messages[0].parts[1]"
    assert refused.value.message.startswith("messages[0].parts[1]: ")


@pytest.mark.parametrize("data", [image_bytes("PNG")[:12], b"", b"not an image at all", b"GIF8"],
                         ids=["truncated-png", "empty", "text", "truncated-gif"])
def test_bytes_that_are_no_image_header_are_refused(data):
    with pytest.raises(InvalidRequest, match="not a valid image"):
        sniff(data, max_bytes=MB, max_px=8000)


def test_an_image_wider_than_max_px_is_refused_from_its_header():
    wide = image_bytes("PNG", (8001, 1), mode="1")  # 1 bit per pixel: a 74-byte file
    assert len(wide) < 200
    with pytest.raises(InvalidRequest, match=r"exceed max allowed size: 8000 pixels \(8001x1\)"):
        sniff(wide, max_bytes=MB, max_px=8000)
    assert sniff(image_bytes("PNG", (8000, 1), mode="1"), max_bytes=MB, max_px=8000).width == 8000


def test_a_header_past_pillows_bomb_bound_is_refused_by_its_size_not_an_error():
    """A 100k x 100k PNG header: Pillow's DecompressionBombError, answered as the size limit."""
    huge = image_bytes("PNG", (8001, 1), mode="1")
    # Rewrite IHDR's width and height (bytes 16..24) and its CRC: Pillow reads only the header.
    ihdr = b"IHDR" + struct.pack(">II", 100_000, 100_000) + huge[24:29]
    huge = huge[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + huge[33:]
    with pytest.raises(InvalidRequest, match="exceed max allowed size"):
        sniff(huge, max_bytes=MB, max_px=8000)


def test_bytes_over_the_limit_are_refused_before_any_header_read():
    data = image_bytes("PNG")
    with pytest.raises(InvalidRequest, match=f"image exceeds {len(data) - 1} bytes"):
        sniff(data, max_bytes=len(data) - 1, max_px=8000)
    assert sniff(data, max_bytes=len(data), max_px=8000).size == len(data)


def test_data_urls_and_base64():
    png = image_bytes("PNG")
    text = base64.b64encode(png).decode()
    assert data_url(f"data:image/png;base64,{text}") == ("image/png", png)
    assert decode_base64(text[:20] + "\n " + text[20:]) == png  # whitespace tolerated
    for bad in ("data:image/png,abcd", "image/png;base64,abcd", f"data:image/png;base64{text}", "https://x/y.png"):
        with pytest.raises(InvalidRequest, match="data URL must be") as refused:
            data_url(bad, where="img")
        assert refused.value.param == "img"
    for bad in (text[:-1], "not*base64", text + "A"):
        with pytest.raises(InvalidRequest, match="not valid base64"):
            decode_base64(bad)
    with pytest.raises(InvalidRequest, match="not valid base64"):
        data_url("data:image/png;base64,%%%")


def test_image_cost_tokens():
    # Idefics3 / SmolVLM's: longest edge 2048, 512 px tiles of 64 tokens, plus the global image
    smol = ImageCost(longest_edge=2048, tile=512, per_tile=64, per_global=64)
    assert smol.tokens(2048, 2048) == 16 * 64 + 64
    assert smol.tokens(1024, 512) == 8 * 64 + 64  # scaled up to 2048 x 1024: 4 x 2 tiles
    assert smol.tokens(100, 100) == 16 * 64 + 64  # small images are scaled up to the longest edge too
    assert ImageCost(longest_edge=512, tile=512, per_tile=64, per_global=64).tokens(300, 200) == 64  # one tile
    assert ImageCost(per_global=576).tokens(4000, 3000) == 576  # another family: a fixed count
    assert ImageCost(tile=512, per_tile=64, per_global=64, split=False).tokens(4000, 3000) == 64
    assert smol.tokens(0, 10) == 64
    assert ModelInfo().images is False and ModelInfo(input_modalities=["text", "image"]).images is True


def test_the_fallback_estimate_is_anthropics_rule():
    assert fallback_tokens(750, 1) == 1
    assert fallback_tokens(1000, 1000) == 1334  # ceil(1e6 / 750)
    assert fallback_tokens(200, 200) == 54
    # Scaled to 1568 px on the long edge and 1.15 MP at most: about 1534 tokens, whatever the size.
    assert 1500 <= fallback_tokens(8000, 8000) <= 1534 and 1500 <= fallback_tokens(8000, 6000) <= 1534
    assert fallback_tokens(8000, 10) == fallback_tokens(1568, 2)
    assert fallback_tokens(0, 0) == 1


def test_images_are_held_until_the_jobs_deadline_and_a_margin():
    req = GenerationRequest(messages=[ChatMessage(role="user", content="hi")])
    assert hold_for(req, 0.0) is None  # no deadline: the store's own TTL
    assert hold_for(req, 600.0) == 660.0
    assert hold_for(GenerationRequest(prompt="x", timeout_s=30.0), 600.0) == 90.0
