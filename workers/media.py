"""A job's images, read back by hash as a worker starts (or continues) it (docs/images.md).

The API stored each image's bytes under its SHA-256 and queued only the reference
(shared/media.py). Here the worker reads them, renewing each key as it does (an image never
expires before the jobs naming it), and decodes them, off the event loop, for the engine. The hash
goes to vLLM too, as the image's ``multi_modal_uuids`` entry (workers/engine.py): vLLM's processor
cache then knows an image it has seen by the same key llmq's affinity uses, so a conversation's
screenshot re-sent each turn is processed once per worker. Workers need no egress.

What the worker tells the API about its model (:func:`model_info`) is written once it is up: its
input modalities and how its processor counts an image.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Mapping
from typing import Any

from shared.config import ModelKind
from shared.errors import InvalidRequest
from shared.media import ImageCost, MediaStore, ModelInfo
from shared.schemas import GenerationRequest

__all__ = ["Images", "load_images", "model_info"]

Images = Mapping[str, Any]
"""A job's decoded images by SHA-256 (PIL images, as vLLM takes them)."""


def _decode(data: bytes) -> Any:
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(data)) as img:
        return img.convert("RGB")  # loads it; the processors take RGB (a GIF's first frame)


async def load_images(store: MediaStore, req: GenerationRequest, *, hold_s: float | None = None) -> Images:
    """Every image ``req`` names, decoded, by hash; renewed for ``hold_s`` (at least the store's
    TTL). An image no longer stored (never expected: its TTL outlasts its job's deadline) fails
    the job as the client's to send again, never the worker."""
    images: dict[str, Any] = {}
    for image in req.images:
        if image.sha256 in images:
            continue
        data = await store.get(image.sha256, hold_s=hold_s)
        if data is None:
            raise InvalidRequest(f"image {image.sha256[:12]} is no longer stored (LLMQ_MEDIA_TTL_S): send it again")
        images[image.sha256] = await asyncio.to_thread(_decode, data)
    return images


def model_info(multimodal: bool, cost: ImageCost | None, kind: ModelKind = "generate") -> ModelInfo:
    """What a worker's model does (``kind``) and takes: images when vLLM serves it as multimodal,
    counted by ``cost`` (the processor's config, workers/vision.py) or, for a family llmq cannot
    read, as ``ImageCost()``'s flat zero (the job's real count corrects it when it ends)."""
    if not multimodal:
        return ModelInfo(kind=kind)
    return ModelInfo(kind=kind, input_modalities=["text", "image"], image=cost or ImageCost())
