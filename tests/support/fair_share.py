"""A tenant's time to first token, with the openai SDK, on a stack whose tenants are named by a
trusted gateway's header (LLMQ_TENANT_HEADER): the fair-share and preemption e2e tests."""

from __future__ import annotations

import time

import openai

__all__ = ["HEADER", "ttft_s"]

HEADER = "x-tenant"
"""The tenant header the stack under test is configured with."""


def ttft_s(client: openai.OpenAI, model: str, tenant: str) -> float:
    start = time.perf_counter()
    stream = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       stream=True, extra_headers={HEADER: tenant})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - start
    assert first is not None
    return first
