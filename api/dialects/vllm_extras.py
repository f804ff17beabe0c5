"""vLLM's sampling keywords beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``, ...),
which its OpenAI server accepts on both completions and chat, and happy_vllm passes straight to
``SamplingParams``: declared once, as a Struct base the three request bodies inherit (msgspec
inherits fields), with the one mapping of them onto :class:`shared.schemas.SamplingParams`.

Names, ranges and defaults are vLLM's OpenAI protocol's: null (or absent) is "vLLM's default".
A body that takes vLLM's literal defaults instead (happy_vllm's) redeclares those fields.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from shared.schemas import SamplingParams

__all__ = ["VllmExtras"]


class VllmExtras(msgspec.Struct, kw_only=True):
    """The extras, and how they become sampling parameters."""

    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def sampling_params(self, **dialect: Any) -> SamplingParams:
        """The request's SamplingParams: these extras, plus the fields each dialect maps its own
        way (``dialect``: ``n``, ``temperature``, ``stop``, ``logprobs``, ...)."""
        return SamplingParams(
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            **dialect,
        )
