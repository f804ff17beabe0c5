"""``new_job`` (shared/admission.py): the one way a job about to be queued is made (the API's routes, the
console's requeue, batch lines)."""

from __future__ import annotations

import time

from shared.admission import new_job
from shared.keys import model_tag
from shared.schemas import GenerationRequest


def test_a_new_record_is_queued_now_under_a_fresh_id_tagged_with_its_model():
    req = GenerationRequest(model="tiny", prompt="x", webhook="https://example.com/hook")
    before = time.time() * 1000
    a = new_job(req, owner="k1", default_timeout_s=None)
    b = new_job(req, owner="k1", default_timeout_s=None)
    assert before <= a.queued_at <= time.time() * 1000
    assert a.id != b.id and len(a.id) == 32 and a.id.startswith(model_tag("tiny")) and int(a.id, 16) >= 0
    assert (a.model, a.request, a.owner, a.status, a.webhook, a.deadline) == (
        "tiny", req, "k1", "queued", "https://example.com/hook", None)


def test_the_deadline_is_the_requests_own_timeout_else_the_default_else_none():
    def deadline(timeout_s: float | None, default_timeout_s: float | None) -> float | None:
        req = GenerationRequest(model="tiny", prompt="x", timeout_s=timeout_s)
        return new_job(req, owner="", default_timeout_s=default_timeout_s, now_ms=1_000.5).deadline

    assert deadline(2.5, 60) == 3_500.5  # the request's own wins over the server's default
    assert deadline(None, 60) == 61_000.5
    assert deadline(None, None) is None and deadline(None, 0) is None  # LLMQ_DEADLINE_S=0: no deadline
