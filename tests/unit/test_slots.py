"""A worker's engine slots (workers/slots.py): what a claim reserves, and a running job's slot
passed to the job that takes its place (a preemption), never counted twice."""

from __future__ import annotations

from workers.slots import Slots


def test_a_reservation_holds_what_is_available_and_gives_back_what_it_did_not_fill():
    slots = Slots(4)
    with slots.reserve(3) as held:
        assert held.held == 3 and slots.available == 1
        held.fill()
        with slots.reserve(5) as more:
            assert more.held == 1 and slots.available == 0
    assert (slots.running, slots.available) == (1, 3)


def test_a_passed_slot_goes_to_the_job_that_takes_its_place_and_no_other():
    slots = Slots(2)
    with slots.reserve(2) as held:
        held.fill()
        held.fill()
    with slots.pass_on() as passed:
        assert passed.held == 1
        assert slots.available == 0, "a takeover meanwhile cannot take the passed slot"
        passed.fill()
    assert (slots.running, slots.available) == (2, 0)
    # The job that gave its slot up ends: its slot is not freed again (the worker skips free()).
    slots.free()
    assert (slots.running, slots.available) == (1, 1)


def test_a_passed_slot_not_filled_is_available_again():
    slots = Slots(1)
    with slots.reserve(1) as held:
        held.fill()
    with slots.pass_on():
        pass
    assert (slots.running, slots.available) == (0, 1)
