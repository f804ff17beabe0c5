"""A pooling job in the engine: its inputs made engine requests, and their outputs one ``Pooled``.

An embedding's input is tokenised as vLLM's embeddings server does (the tokenizer's special tokens
added to a text, token ids taken as they are); a score's (query, document) pair as vLLM's score
server gives a cross-encoder one: the tokenizer's pair encoding, whose token types (the document's
of type 1) the engine reads from ``compressed_token_type_ids`` (where type 1 starts). An input
longer than the model takes is the request's 400, or with ``truncate`` cut to it: an embedding's at
its end, a pair's in its document (TEI's ``truncate``, the tokenizer's ``only_second``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm import PoolingParams
from vllm.inputs import TokensPrompt

from shared.errors import InvalidRequest
from shared.schemas import Pooled, Pooling

__all__ = ["pooling_inputs", "pooled"]

Inputs = list[tuple[TokensPrompt, PoolingParams]]


def pooling_inputs(tokenizer: Any, pooling: Pooling, max_len: int) -> Inputs:
    """One engine request's prompt and parameters per input of ``pooling``, in order."""
    if pooling.task == "embed":
        params = PoolingParams(task="embed", dimensions=pooling.dimensions, use_activation=pooling.activation)
        ids = pooling.token_ids or tokenizer(pooling.texts, add_special_tokens=True)["input_ids"]
        return [(TokensPrompt(prompt_token_ids=_fitted(list(one), i, max_len, pooling.truncate)), params)
                for i, one in enumerate(ids)]
    queries = pooling.queries * len(pooling.texts) if len(pooling.queries) == 1 else pooling.queries
    encoded = tokenizer(queries, pooling.texts, add_special_tokens=True,
                        **({"truncation": "only_second", "max_length": max_len} if pooling.truncate else {}))
    types = encoded.get("token_type_ids")
    inputs: Inputs = []
    for i, one in enumerate(encoded["input_ids"]):
        params = PoolingParams(task="classify", use_activation=pooling.activation)
        if types is not None and 1 in types[i]:
            params.extra_kwargs = {"compressed_token_type_ids": types[i].index(1)}
        inputs.append((TokensPrompt(prompt_token_ids=_fitted(list(one), i, max_len, False)), params))
    return inputs


def _fitted(ids: list[int], index: int, max_len: int, truncate: bool) -> list[int]:
    if not ids:
        raise InvalidRequest(f"input {index} is empty: it has no tokens to pool", param="input")
    if len(ids) <= max_len:
        return ids
    if truncate:
        return ids[:max_len]
    raise InvalidRequest(f"input {index} has {len(ids)} tokens, more than the model's context of {max_len}; "
                         "send it shorter, or ask for it truncated", param="input")


def pooled(outputs: list[Any]) -> Pooled:
    """The engine's output tensors, one per input, as float32 rows (little-endian), in order."""
    rows = [np.asarray(out.float().reshape(-1).numpy(), dtype="<f4") for out in outputs]
    return Pooled(data=b"".join(row.tobytes() for row in rows), width=rows[0].size if rows else 0)
