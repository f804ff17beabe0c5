"""The forced-prefix logits processors on vLLM's own batch-update and context types (no engine:
the e2e suite runs them inside vLLM; the V2 class only here, as this machine has no V2 runner)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")  # the engine tier: collected everywhere, run where a worker extra is installed

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext

from workers.forcing import FORCED, ForcedPrefix, ForcedPrefixV2, forced_tokens, processor_for

pytestmark = pytest.mark.engine

VOCAB = 8
NEG = float("-inf")


def forcing(tokens: list[int]) -> SamplingParams:
    return SamplingParams(max_tokens=20, extra_args={FORCED: tokens})


def forced_row(logits: torch.Tensor, row: int) -> int | None:
    """The token a row is forced to (None: the row is untouched)."""
    line = logits[row]
    if torch.isinf(line).sum() == 0:
        return None
    assert torch.isinf(line).sum() == VOCAB - 1 and (line == NEG).sum() == VOCAB - 1
    return int(torch.argmax(line))


def test_v1_forces_each_output_position_of_its_request_and_leaves_the_rest_alone():
    proc = ForcedPrefix(None, torch.device("cpu"), False)
    output: list[int] = []  # vLLM's live output list of the forcing request
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, SamplingParams(max_tokens=5), [9], []), (1, forcing([3, 5]), [9], output)]))
    seen = []
    for sampled in (3, 5, 6):
        logits = torch.randn(2, VOCAB)
        before = logits.clone()
        proc.update_state(None)
        logits = proc.apply(logits)
        assert torch.equal(logits[0], before[0]), "a request without forcing keeps its logits"
        seen.append(forced_row(logits, 1))
        output.append(sampled)
    assert seen == [3, 5, None], "forced through its prefix, then the model's own logits"
    assert not proc.forcing, "a request past its prefix leaves the processor"


def test_v1_follows_a_forcing_request_moved_within_the_batch():
    proc = ForcedPrefix(None, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[(2, forcing([4, 4]), [9], [])]))
    proc.update_state(BatchUpdate(batch_size=1, removed=[0, 1], added=[],
                                  moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert forced_row(proc.apply(torch.randn(1, VOCAB)), 0) == 4


def test_v2_forces_by_sequence_position_and_skips_prompt_chunks():
    req_states = SimpleNamespace(prompt_len=SimpleNamespace(np=np.array([0, 10, 4], dtype=np.int32)))
    proc = ForcedPrefixV2(None, req_states)
    assert proc.add_request(1, forcing([6, 2])) is True
    assert proc.add_request(2, SamplingParams(max_tokens=5)) is False

    def step(seq_len_of_slot_1: int) -> torch.Tensor:
        # Batch rows: slot 2, then slot 1 (rows are reordered freely; slots are what persist).
        ctx = LogitsContext(expanded_idx_mapping=None, idx_mapping=None, idx_mapping_np=np.array([2, 1]),
                            expanded_local_pos=None, input_ids=None, pos=None,
                            seq_lens_upper_bound_np=np.array([7, seq_len_of_slot_1]))
        return proc.apply(torch.randn(2, VOCAB), ctx)

    assert forced_row(step(8), 1) is None, "a prompt chunk: its sample is discarded anyway"
    assert forced_row(step(10), 1) == 6 and forced_row(step(10), 0) is None
    assert forced_row(step(11), 1) == 2
    assert forced_row(step(12), 1) is None and 1 not in proc.forcing
    # A slot reused by a plain request forgets its forcing occupant.
    proc.add_request(1, forcing([1]))
    assert proc.add_request(1, SamplingParams(max_tokens=5)) is False and 1 not in proc.forcing


@pytest.mark.parametrize("extra", [{FORCED: "1,2"}, {FORCED: [1, -2]}, {FORCED: [1.5]}])
def test_malformed_forced_tokens_are_refused(extra):
    with pytest.raises(ValueError):
        forced_tokens(SamplingParams(max_tokens=5, extra_args=extra))


def test_forcing_needs_a_single_choice_and_nothing_asked_is_no_forcing():
    with pytest.raises(ValueError):
        forced_tokens(SamplingParams(n=2, temperature=1.0, max_tokens=5, extra_args={FORCED: [1]}))
    assert forced_tokens(SamplingParams(max_tokens=5)) is None
    assert processor_for(False) is ForcedPrefix and processor_for(True) is ForcedPrefixV2
