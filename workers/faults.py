"""llmq's fault tests: a request that kills its engine, as a request that breaks vLLM does.

vLLM fails its whole engine when one request makes a step raise (vllm#16668: prompt logprobs with
LoRA on, in a shared step): the engine core process exits and every request in it with it. The
worker's recovery (workers/runner.py) must survive that and quarantine the request, and the fault
suite needs such a request on demand. :class:`EngineKiller` is a logits processor that raises inside
the engine core's step once a marked request has its first output token (mid-stream, so its
continuation is exercised too). The engine gets it only with LLMQ_TEST_FAULTS on
(workers/engine.py); a request is marked by ``SamplingParams.extra_args[KILL]``, set from
``X-LLMQ-Test-Fault: kill-engine`` (refused by the API unless LLMQ_TEST_FAULTS is on there too).

vLLM imports the class by its module path inside the engine core (as workers/forcing.py's), so
this module stands alone, importing only vLLM and torch. Both model runners' interfaces are here.
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

__all__ = ["KILL", "EngineKiller", "EngineKillerV2", "killer_for"]

KILL = "llmq_test_fault_kill_engine"
"""The marker's key in ``SamplingParams.extra_args``."""


class EngineFaultTest(RuntimeError):
    """What the marked request's step raises (its name in the engine core's log says why)."""


def _marked(params: SamplingParams) -> bool:
    return bool((params.extra_args or {}).get(KILL))


def _raise() -> None:
    raise EngineFaultTest("llmq fault test (X-LLMQ-Test-Fault: kill-engine): this request fails its engine's step")


class EngineKiller(LogitsProcessor):
    """For vLLM's V1 model runner: rows are batch indices, each marked one holding its live output."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.marked: dict[int, list[int]] = {}  # row -> the marked request's output so far

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False  # applied to greedy rows too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.marked, batch_update,
                             lambda params, _prompt, output: output if _marked(params) else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if any(self.marked.values()):
            _raise()
        return logits


class EngineKillerV2(LogitsProcessorV2):
    """For vLLM's V2 model runner: marked requests by slot; a row past its prompt has output."""

    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState) -> None:
        self.prompt_len = req_states.prompt_len.np
        self.marked: set[int] = set()

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        pass

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        if _marked(sampling_params):
            self.marked.add(req_idx)
            return True
        self.marked.discard(req_idx)  # the slot's previous occupant may have been marked
        return False

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        for row, slot in enumerate(ctx.idx_mapping_np.tolist()):
            if slot in self.marked and int(ctx.seq_lens_upper_bound_np[row]) - int(self.prompt_len[slot]) >= 1:
                _raise()
        return logits


def killer_for(v2_runner: bool) -> type[EngineKiller] | type[EngineKillerV2]:
    """The class for the engine's model runner (``VllmConfig.use_v2_model_runner``)."""
    return EngineKillerV2 if v2_runner else EngineKiller
