"""Which running jobs a full worker offers to give way, without Redis or a loop
(workers/preemption.py): who may ever give way, when a job becomes a candidate (its run time, its
tokens, its confirmed claim), which one of a tenant's jobs at a level is offered, and how long until
the next may be. Each rule has its control: the same job with the rule met."""

from __future__ import annotations

from shared.config import load_settings
from shared.events import TokenDelta
from shared.queue import Delivery, Held
from shared.result import ResultBuilder
from shared.schemas import GenerationRequest, SamplingParams
from shared.scripts import Candidate
from workers.attempt import Attempt
from workers.preemption import PREEMPT_POLL_S, RunningJob, candidates, may_give_way
from workers.protocol import Step

SETTINGS = load_settings({}, redis_url="redis://127.0.0.1:1/0", served_model_name="m", preempt_min_run_ms=250,
                         preempt_min_tokens=4, preempt_max=3)


def attempt(tokens: int, prompt_tokens: int = 10, carried: int = 0) -> Attempt:
    """An attempt that generated ``tokens`` in this start, after ``carried`` published before."""
    a = Attempt(queued_at=1.0, started_at=2.0)
    if carried:
        a.continues(carried, ResultBuilder(), prompt_tokens=prompt_tokens, emitted=carried)
    for i in range(tokens):
        a.on_step(Step(deltas=[TokenDelta(token_ids=[i], text="x")], prompt_tokens=prompt_tokens), lambda: 3.0)
    return a


def job(job_id: str = "j", *, tenant: str = "t", level: int = 0, started: float = 0.0, preemptions: int = 0,
        confirmed: bool = True, tokens: int | None = 8, prompt_tokens: int = 10, carried: int = 0) -> RunningJob:
    """A running job, by default one that may give way at 1.0 (started at 0.0, 8 tokens)."""
    return RunningJob(job_id, Held(job_id, f"{job_id}-0".encode(), 1, level), tenant, started, preemptions, confirmed,
                      None if tokens is None else attempt(tokens, prompt_tokens, carried))


def offered(*running: RunningJob, now: float = 1.0) -> list[str]:
    return [c.job_id for c in candidates(running, now, SETTINGS)[0]]


def delivery(*, tenant: str = "t", preemptions: int = 0, beam_width: int = 1) -> Delivery:
    req = GenerationRequest(prompt="p", sampling=SamplingParams(beam_width=beam_width))
    return Delivery(entry_id=b"1-0", job_id="j", state="run", request=req, queued_at=1.0, attempt=1,
                    tenant=tenant, preemptions=preemptions)


# --- who may ever give way --------------------------------------------------------------------------


def test_a_tenants_job_may_give_way():
    assert may_give_way(delivery(), SETTINGS)


def test_a_job_with_no_tenant_never_gives_way():
    assert not may_give_way(delivery(tenant=""), SETTINGS)


def test_a_beam_search_never_gives_way():
    """It publishes only at its end: a successor would have nothing to continue from."""
    assert not may_give_way(delivery(beam_width=2), SETTINGS)


def test_a_job_preempted_preempt_max_times_keeps_its_slot():
    assert may_give_way(delivery(preemptions=2), SETTINGS)
    assert not may_give_way(delivery(preemptions=3), SETTINGS)


# --- when a job becomes a candidate -----------------------------------------------------------------


def test_a_job_that_ran_long_enough_with_enough_tokens_is_offered_with_what_it_used():
    [candidate], soonest = candidates([job(tokens=8, prompt_tokens=10)], 1.0, SETTINGS)
    assert candidate == Candidate("j", b"j-0", 1, 0, 10, 8)
    assert soonest is None  # no other job will be


def test_a_job_within_its_minimum_run_is_not_offered_and_says_when_it_will_be():
    candidates_, soonest = candidates([job(started=0.0)], 0.1, SETTINGS)
    assert candidates_ == [] and abs(soonest - 0.15) < 1e-9  # 250 ms after its start
    assert offered(job(started=0.0), now=0.25) == ["j"]  # the control: at its minimum run


def test_a_job_with_too_few_tokens_in_this_start_is_asked_about_again_soon():
    assert candidates([job(tokens=3)], 1.0, SETTINGS) == ([], PREEMPT_POLL_S)
    assert offered(job(tokens=4)) == ["j"]


def test_tokens_published_before_this_start_do_not_count():
    """A continued job must make progress of its own before it gives way again."""
    assert offered(job(tokens=3, carried=20)) == []
    assert offered(job(tokens=4, carried=20)) == ["j"]


def test_a_job_whose_task_has_not_started_is_not_offered():
    assert candidates([job(tokens=None)], 1.0, SETTINGS) == ([], PREEMPT_POLL_S)


def test_a_job_whose_claim_is_not_confirmed_is_not_offered():
    assert candidates([job(confirmed=False)], 1.0, SETTINGS) == ([], PREEMPT_POLL_S)
    assert offered(job(confirmed=True)) == ["j"]


def test_the_soonest_wait_is_the_shortest_over_the_jobs_not_offered():
    running = [job("a", started=0.9), job("b", started=0.95), job("c")]
    candidates_, soonest = candidates(running, 1.0, SETTINGS)
    assert [c.job_id for c in candidates_] == ["c"] and abs(soonest - 0.15) < 1e-9


# --- which job of a tenant and level is offered -----------------------------------------------------


def test_one_job_per_tenant_and_level_the_cheapest_to_resume():
    running = [job("long", tokens=40), job("short", tokens=5), job("other", tenant="u", tokens=40),
               job("urgent", level=1, tokens=40)]
    assert sorted(offered(*running)) == ["other", "short", "urgent"]


def test_the_job_preempted_least_often_goes_first_whatever_its_cost():
    running = [job("cheap", tokens=5, preemptions=1), job("costly", tokens=40)]
    assert offered(*running) == ["costly"]
    assert offered(job("cheap", tokens=5), job("costly", tokens=40)) == ["cheap"]  # the control: equal counts


def test_the_prompt_counts_in_the_cost_to_resume():
    running = [job("long_prompt", tokens=5, prompt_tokens=100), job("short_prompt", tokens=20, prompt_tokens=10)]
    assert offered(*running) == ["short_prompt"]


def test_nothing_running_offers_nothing_and_asks_nothing_again():
    assert candidates([], 1.0, SETTINGS) == ([], None)
