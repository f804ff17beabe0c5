"""The engine adapter: the only module in llmq that imports vLLM.

It builds one ``AsyncLLM`` from Settings, maps the internal request to vLLM (one function:
:func:`to_sampling_params`) and turns vLLM's DELTA outputs into llmq token deltas.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from dataclasses import dataclass

from vllm import SamplingParams as VllmSamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from shared.config import Settings
from shared.errors import EngineDead, InvalidRequest
from shared.events import TokenDelta
from shared.schemas import GenerationRequest, TopLogprob

__all__ = ["VllmEngine", "Step", "to_sampling_params"]


@dataclass(slots=True)
class Step:
    """What one engine step produced for one job."""

    deltas: list[TokenDelta]
    finished: bool = False
    prompt_tokens: int = 0


def to_sampling_params(req: GenerationRequest) -> VllmSamplingParams:
    """The one mapping from llmq's sampling parameters to vLLM's."""
    s = req.sampling
    return VllmSamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        max_tokens=s.max_tokens,
        min_tokens=s.min_tokens,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
        logit_bias=dict(s.logit_bias) or None,
        # DELTA: each output carries only what is new, so per-token work stays O(new tokens).
        output_kind=RequestOutputKind.DELTA,
    )


def _to_prompt(req: GenerationRequest) -> TextPrompt | TokensPrompt:
    if req.prompt_token_ids is not None:
        return TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
    assert req.prompt is not None
    return TextPrompt(prompt=req.prompt)


def _step(out: RequestOutput, want_top: int | None) -> Step:
    deltas = []
    for comp in out.outputs:
        delta = TokenDelta(
            index=comp.index,
            token_ids=list(comp.token_ids),
            text=comp.text,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
        )
        if comp.logprobs is not None and want_top is not None:
            logprobs, texts, tops = [], [], []
            for token_id, position in zip(comp.token_ids, comp.logprobs, strict=False):
                sampled = position[token_id]
                logprobs.append(sampled.logprob)
                texts.append(sampled.decoded_token or "")
                if want_top:
                    # The dict holds the top k plus the sampled token when that ranked lower.
                    ranked = sorted(
                        (lp.rank or 0, tid, lp) for tid, lp in position.items() if (lp.rank or 0) <= want_top
                    )
                    tops.append([TopLogprob(tid, lp.decoded_token or "", lp.logprob) for _, tid, lp in ranked])
            delta.logprobs, delta.token_texts = logprobs, texts
            delta.top_logprobs = tops if want_top else None
        deltas.append(delta)
    return Step(deltas=deltas, finished=out.finished, prompt_tokens=len(out.prompt_token_ids or ()))


class VllmEngine:
    """One vLLM engine. ``stream`` yields a :class:`Step` per engine step for one job."""

    def __init__(self, engine: AsyncLLM, max_model_len: int) -> None:
        self.engine = engine
        self.max_model_len = max_model_len

    @classmethod
    def build(cls, settings: Settings, model_path: str) -> VllmEngine:
        args = AsyncEngineArgs(
            model=model_path,
            served_model_name=[settings.model_name],
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            # None: the engine sizes its KV cache itself (GPU memory utilisation, CPU default).
            kv_cache_memory_bytes=settings.kv_cache_bytes,
            enforce_eager=settings.eager,
            disable_log_stats=True,
            enable_log_requests=False,
        )
        return cls(AsyncLLM.from_engine_args(args), settings.max_model_len)

    async def stream(self, job_id: str, req: GenerationRequest) -> AsyncIterator[Step]:
        want_top = req.sampling.logprobs
        try:
            params = to_sampling_params(req)
        except ValueError as exc:  # SamplingParams' own range checks
            raise InvalidRequest(str(exc)) from None
        try:
            async for out in self.engine.generate(_to_prompt(req), params, request_id=job_id, priority=req.priority):
                yield _step(out, want_top)
        except VLLMValidationError as exc:  # the engine's checks: prompt too long, bad token ids, ...
            raise InvalidRequest(str(exc)) from None
        except EngineDeadError as exc:
            raise EngineDead(f"the engine died: {exc}") from None

    async def abort(self, job_id: str) -> None:
        await self.engine.abort(job_id)

    def shutdown(self) -> None:
        self.engine.shutdown()
        # Collect the engine now: left to interpreter teardown, AsyncLLM.__del__ runs after
        # vLLM's module globals are gone and prints a TypeError.
        del self.engine
        gc.collect()
