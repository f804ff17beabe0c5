"""A chat rendered with the model's own chat template, tokenised: the prompt the engine sees.

One function for the worker, which feeds it to the engine (workers/engine.py), and for the API,
which counts it (Anthropic's ``count_tokens``, api/tokenizer.py): the same messages give the same
ids in both, so a count equals the ``input_tokens`` the job reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from shared.errors import InvalidRequest
from shared.schemas import ChatMessage, ChatOptions

__all__ = ["chat_token_ids"]


def chat_token_ids(tokenizer: Any, messages: Sequence[ChatMessage], options: ChatOptions) -> list[int]:
    """``messages`` through ``tokenizer.apply_chat_template``, tokenised there so the template's
    BOS is not doubled. A template that refuses them (a role it does not know, a bad kwarg) is the
    client's 400."""
    rendered = [msgspec.structs.asdict(m) for m in messages]
    for m in rendered:
        if m.get("name") is None:
            m.pop("name", None)
    try:
        encoded = tokenizer.apply_chat_template(
            rendered, tokenize=True, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **options.template_kwargs,
        )
    except Exception as exc:  # jinja errors: a role the template refuses, a bad kwarg, ...
        raise InvalidRequest(f"the chat template could not render these messages: {exc}") from None
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)
