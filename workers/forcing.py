"""Forced output prefixes: a vLLM logits processor that makes a request's first k output tokens
the given ones (crash continuation's forced replay, workers/continuation.py).

The tokens ride the request's ``SamplingParams.extra_args[FORCED]``. For output positions below k
every logit of that request's row becomes -inf except the forced token's, so greedy and random
sampling (seeded or not) both pick it, and everything downstream of sampling (the grammar's
accepted state, penalties' output counts, the detokeniser, stop strings, a seeded generator's
draws) advances exactly as when the model chose those tokens. vLLM applies the structured-output
bitmask before logits processors and temperature, min_p, top-k/top-p after them. Logprobs of the
forced positions go out with them unread (the client has those tokens already); later positions
are not touched. The forced token gets logit 0.0 rather than keeping its own, so a token the
grammar masked is still forced: vLLM's grammar then rejects it and ends the request, which the
replay check reports.

vLLM 0.32's own ``SamplingParams.trace_decode_token_ids`` forces tokens too, but it ends the
request when the trace ends (``max_tokens`` is cut to the trace's length) and needs the V2 runner;
a continuation must go on after the forced prefix, on either runner.

It runs every engine step for the whole batch: with no forcing request in the batch both hooks
return at once; a forcing request leaves the processor once its prefix is out.

vLLM 0.32 has two model runners with two processor interfaces: V1 (the CPU build, and GPU setups
V2 does not support) and V2 (the GPU default). Both classes are here; :func:`processor_for` picks the one
the engine's runner takes. vLLM builds the processor inside its engine core, which on GPU hosts is
a spawned process that imports the class by its module path: this module therefore stands alone,
importing only vLLM and torch (the engine adapter, workers/engine.py, stays the one that drives
vLLM). Speculative decoding is not supported here (vLLM's V1 runner refuses custom processors
with it; llmq does not configure it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as LogitsProcessorV2

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["FORCED", "ForcedPrefix", "ForcedPrefixV2", "forced_tokens", "processor_for"]

FORCED = "llmq_forced_tokens"
"""The key of the forced tokens in ``SamplingParams.extra_args``."""


def forced_tokens(params: SamplingParams) -> list[int] | None:
    """The request's forced output prefix (None: none). Raises ValueError when malformed (vLLM
    turns that into a refused request)."""
    tokens = (params.extra_args or {}).get(FORCED)
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise ValueError(f"extra_args[{FORCED!r}] must be a list of token ids")
    if params.n != 1:
        raise ValueError(f"extra_args[{FORCED!r}] needs n = 1")
    return tokens or None


def _force(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    # Row views filled in place: a few rows at a time, cheaper than index tensors (no copies).
    for row, token in zip(rows, tokens, strict=True):
        line = logits[row]
        line.fill_(float("-inf"))
        line[token] = 0.0


class ForcedPrefix(LogitsProcessor):
    """For vLLM's V1 model runner: rows are batch indices; each forcing request's output token
    list is vLLM's own, live (its length is the position being sampled)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.forcing: dict[int, tuple[list[int], list[int]]] = {}  # row -> (forced, output so far)

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        forced_tokens(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides greedy picks too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.forcing, batch_update, _v1_state)
        for row in [row for row, (forced, output) in self.forcing.items() if len(output) >= len(forced)]:
            del self.forcing[row]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forcing:
            return logits
        rows, tokens = [], []
        for row, (forced, output) in self.forcing.items():
            if len(output) < len(forced):
                rows.append(row)
                tokens.append(forced[len(output)])
        if rows:
            _force(logits, rows, tokens)
        return logits


def _v1_state(params: SamplingParams, _prompt: list[int] | None, output: list[int],
              ) -> tuple[list[int], list[int]] | None:
    forced = forced_tokens(params)
    return None if forced is None or len(output) >= len(forced) else (forced, output)


class ForcedPrefixV2(LogitsProcessorV2):
    """For vLLM's V2 model runner: requests live in slots; the position being sampled is the
    sequence length this step (host side, exact without speculative decoding) minus the prompt's."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self.prompt_len = req_states.prompt_len.np
        self.forcing: dict[int, list[int]] = {}  # slot -> forced tokens

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        forced_tokens(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        forced = forced_tokens(sampling_params)
        if forced is None:
            self.forcing.pop(req_idx, None)  # the slot's previous occupant may have forced
            return False
        self.forcing[req_idx] = forced
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        if not self.forcing:
            return logits
        if logits.shape[0] != len(ctx.idx_mapping_np):
            # Draft rows (speculative decoding): force nothing rather than fail the engine step;
            # the replay check then ends the job with worker_lost.
            return logits
        rows, tokens = [], []
        for row, slot in enumerate(ctx.idx_mapping_np.tolist()):
            forced = self.forcing.get(slot)
            if forced is None:
                continue
            position = int(ctx.seq_lens_upper_bound_np[row]) - int(self.prompt_len[slot])
            if position >= len(forced):
                del self.forcing[slot]
            elif position >= 0:  # < 0: a chunk of the prompt, whose sample is discarded
                rows.append(row)
                tokens.append(forced[position])
        if rows:
            _force(logits, rows, tokens)
        return logits


def processor_for(v2_runner: bool) -> type[ForcedPrefix] | type[ForcedPrefixV2]:
    """The class for the engine's model runner (``VllmConfig.use_v2_model_runner``)."""
    return ForcedPrefixV2 if v2_runner else ForcedPrefix
