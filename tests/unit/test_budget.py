"""A job's token budget in its context: the worker's clamp of ``max_tokens`` and the fair share's
estimate, both cut to what the context leaves after the prompt (shared/budget.py)."""

from __future__ import annotations

import pytest

from shared.admission import new_job
from shared.budget import generation_budget
from shared.schemas import ChatMessage, GenerationRequest, SamplingParams, estimate_tokens


@pytest.mark.parametrize(("max_tokens", "prompt", "context", "budget"), [
    (32000, 10000, 32768, 22768),  # Claude Code's ask on a 32k context: the room the prompt leaves
    (32000, 22, 2048, 2026),       # far past the context: clamped, not refused (vLLM's server: 200)
    (2048, 5, 2048, 2043),         # max_tokens == max_model_len
    (16, 100, 2048, 16),           # room to spare: as asked
    (100, 2047, 2048, 1),          # one token of room
    (100, 2048, 2048, 1),          # a prompt that fills the context: left for the engine to refuse
    (100, 5000, 2048, 1),          # ... or one past it
    (10**30, 7, 2048, 2041),       # any int: vLLM's engine request could not carry this one
    (32000, None, 2048, 2047),     # a text prompt, tokenised by vLLM: at least one token
])
def test_max_tokens_is_cut_to_the_room_the_prompt_leaves(max_tokens, prompt, context, budget):
    assert generation_budget(max_tokens, prompt, context) == budget


def test_the_estimate_charges_no_more_than_the_context_can_run():
    claude_code = GenerationRequest(messages=[ChatMessage(role="user", content="x" * 40_000)],  # ~10k tokens
                                    sampling=SamplingParams(max_tokens=32000))
    prompt = 40_000 // 4 + 1
    assert estimate_tokens(claude_code) == prompt + 32000  # unbounded: what it asked for
    assert estimate_tokens(claude_code, 32768) == 32768  # the prompt plus the room it leaves
    assert estimate_tokens(claude_code, 2048) == prompt + 1  # a prompt the engine will refuse
    short = GenerationRequest(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=16, n=2))
    assert estimate_tokens(short, 2048) == estimate_tokens(short) == 3 + 16 * 2  # fits: unchanged
    beams = GenerationRequest(prompt_token_ids=[1] * 48, sampling=SamplingParams(max_tokens=10**6, beam_width=4))
    assert estimate_tokens(beams, 64) == 48 + 16 * 4  # every beam's room, once the prompt is in


def test_a_record_made_with_the_context_carries_the_cut_estimate():
    req = GenerationRequest(prompt="hello", sampling=SamplingParams(max_tokens=32000))
    assert new_job(req, owner="", default_timeout_s=None, max_model_len=2048).estimate == 2048
    assert new_job(req, owner="", default_timeout_s=None).estimate == 2 + 32000


def test_any_int64_max_tokens_is_queued_and_a_larger_one_refused_with_the_dialects_400():
    from api.submit import check_queueable
    from shared.errors import InvalidRequest

    check_queueable(GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=2**63 - 1)))
    with pytest.raises(InvalidRequest, match=r"max_tokens") as refused:
        check_queueable(GenerationRequest(prompt="hi", sampling=SamplingParams(max_tokens=2**63)))
    assert refused.value.status == 400
