"""A followed job's position, step by step, without Redis or a loop: events delivered in order,
duplicates dropped, a gap filled from the log, the end; and the lane (the listener's way) driving
the same position as the awaiting loop, so neither delivers what the other already did."""

from __future__ import annotations

import pytest

from api.follow import Lane
from api.follow_state import FollowState
from shared.codec import encode
from shared.events import Done, Error, Event, TokenDelta, Tokens


def tokens(seq: int) -> Tokens:
    return Tokens(seq=seq, deltas=[TokenDelta(token_ids=[96 + seq], text=chr(96 + seq))])


def done(seq: int) -> Done:
    return Done(seq=seq, deltas=[TokenDelta(token_ids=[1], text="", finish_reason="stop")])


def drain(state: FollowState) -> list[int]:
    """What the awaiting loop yields now: every held event that goes out, by seq."""
    out = []
    while (event := state.pop()) is not None:
        out.append(event.seq)
    return out


def receive(state: FollowState, event: Event) -> bool:
    """The awaiting loop's step for a live message: hold it, or False for a gap (read the log)."""
    if state.place(event) == "gap":
        return False
    state.hold(event)
    return True


def test_live_events_in_order_go_out_once_each_and_advance_the_position():
    state = FollowState()
    for seq in (1, 2, 3):
        assert state.place(tokens(seq)) == "next"
        state.hold(tokens(seq))
        assert drain(state) == [seq]
        assert state.last == seq
    assert not state.done and not state.pending


def test_a_resume_starts_after_the_clients_last_event():
    state = FollowState(after_seq=4)
    assert state.place(tokens(4)) == "duplicate"
    assert state.place(tokens(5)) == "next"
    state.fill([tokens(3), tokens(4), tokens(5), tokens(6)])  # the log may repeat what the client has
    assert drain(state) == [5, 6]


def test_a_duplicate_is_dropped_live_and_from_the_log():
    state = FollowState()
    for seq in (1, 2):  # the loop yields what it holds before it waits for the next message
        assert receive(state, tokens(seq)) and drain(state) == [seq]
    assert state.place(tokens(2)) == "duplicate"
    assert receive(state, tokens(1))  # held, and dropped as it is popped
    assert drain(state) == []
    state.fill([tokens(1), tokens(2), tokens(3)])  # a log read overlapping the live events
    assert drain(state) == [3]
    assert state.last == 3


def test_a_gap_is_left_to_the_log_which_fills_it_in_order():
    state = FollowState()
    assert receive(state, tokens(1)) and drain(state) == [1]
    assert state.place(tokens(4)) == "gap"  # 2 and 3 were lost on the way
    assert not receive(state, tokens(4))
    assert state.last == 1 and not state.pending  # nothing past the gap is held
    state.fill([tokens(2), tokens(3), tokens(4)])  # the log's events after last
    assert drain(state) == [2, 3, 4]


def test_the_terminal_event_ends_the_relay_and_nothing_goes_out_after_it():
    state = FollowState()
    assert receive(state, tokens(1)) and drain(state) == [1]
    assert state.place(done(2)) == "end"
    state.fill([done(2), tokens(3)])  # nothing real follows an end; whatever would is dropped
    assert state.pop() == done(2)
    assert state.done and state.pop() is None and not state.pending
    assert state.place(tokens(3)) == "duplicate"


def test_an_error_ends_the_relay_as_done_does():
    state = FollowState()
    error = Error(seq=1, code="engine_failed", message="boom")
    assert state.place(error) == "end"
    state.hold(error)
    assert state.pop() == error and state.done


def test_without_the_position_counted_a_log_read_repeats_what_went_out():
    """Control: the position is what drops a repeat. A relay that forgot what the lane sent (a
    fresh state, as when the lane kept its own copy and the loop missed an update) yields it again."""
    shared, forgetful = FollowState(), FollowState()
    shared.sent(tokens(1))  # went out by the lane
    shared.fill([tokens(1), tokens(2)])
    forgetful.fill([tokens(1), tokens(2)])
    assert drain(shared) == [2]
    assert drain(forgetful) == [1, 2]


class Consumer:
    """A stream's consumer as the lane sees it (api.http's _deliver): takes an event, or declines."""

    def __init__(self) -> None:
        self.got: list[int] = []
        self.keeping_up = True

    def __call__(self, event: Event) -> bool:
        if self.keeping_up:
            self.got.append(event.seq)
        return self.keeping_up


def lane_on(state: FollowState) -> tuple[Lane, Consumer]:
    lane, consumer = Lane(), Consumer()
    lane.state, lane.deliver = state, consumer
    return lane, consumer


async def test_the_lane_and_the_loop_share_one_position():
    state = FollowState()
    lane, consumer = lane_on(state)
    assert lane.take(encode(tokens(1))) and lane.take(encode(tokens(2)))
    assert consumer.got == [1, 2] and state.last == 2
    assert lane.take(encode(tokens(2)))  # a duplicate: dropped by the lane
    assert consumer.got == [1, 2]
    # The loop goes on from where the lane is: a log read finds only what the lane did not send.
    state.fill([tokens(1), tokens(2), tokens(3)])
    assert drain(state) == [3]
    assert lane.take(encode(tokens(4))) and consumer.got == [1, 2, 4]


@pytest.mark.parametrize("data", [encode(tokens(3)), encode(done(2)), b"", b"not json"],
                         ids=["gap", "end", "resync", "undecodable"])
async def test_the_lane_leaves_a_gap_the_end_a_resync_and_a_bad_message_to_the_loop(data: bytes):
    state = FollowState(after_seq=1)
    lane, consumer = lane_on(state)
    assert not lane.take(data)
    assert consumer.got == [] and state.last == 1


async def test_a_declined_event_stays_the_loops_to_deliver():
    state = FollowState()
    lane, consumer = lane_on(state)
    consumer.keeping_up = False
    assert not lane.take(encode(tokens(1)))
    assert state.last == 0
    assert receive(state, tokens(1)) and drain(state) == [1]


async def test_a_lane_failure_is_kept_for_the_loop_and_its_event_counted():
    state = FollowState()
    lane, _ = lane_on(state)

    def broken(event: Event) -> bool:
        raise ValueError("renderer broke")

    lane.deliver = broken
    assert not lane.take(encode(tokens(1)))
    assert isinstance(lane.failure, ValueError) and state.last == 1


async def test_a_lane_before_its_relay_started_takes_nothing():
    lane = Lane()
    lane.deliver = Consumer()
    assert not lane.take(encode(tokens(1)))
