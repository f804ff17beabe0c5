"""A worker's measured speed (workers/rates.py): the decode rate over busy time only, the prefill
rate weighed by prompt, the moving means, and the heartbeat field that carries them."""

from __future__ import annotations

import msgspec
import pytest

from shared.config import load_settings
from shared.metrics import Recorder
from shared.slo import Rates
from shared.status import _json
from workers.presence import Presence
from workers.rates import RateMeter


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def run(meter: RateMeter, clock: Clock, seconds: float, tokens_per_s: float, steps_per_s: int = 10) -> None:
    """The meter's running jobs generate ``tokens_per_s`` together for ``seconds``, a step at a time."""
    for _ in range(int(seconds * steps_per_s)):
        clock.t += 1 / steps_per_s
        meter.generated(round(tokens_per_s / steps_per_s))


def test_nothing_measured_is_all_zeros(clock):
    meter = RateMeter(clock=clock)
    assert meter.rates() == Rates()


def test_decode_rate_is_tokens_over_the_time_jobs_ran(clock):
    meter = RateMeter(clock=clock)
    meter.started()
    run(meter, clock, 4, 50)
    assert meter.rates().decode_tps == 50.0


def test_idle_time_does_not_lower_the_decode_rate(clock):
    meter = RateMeter(clock=clock)
    meter.started()
    run(meter, clock, 4, 80)
    meter.stopped()
    clock.t += 600  # ten idle minutes, read by heartbeats meanwhile
    assert meter.rates().decode_tps == 80.0
    meter.started()
    run(meter, clock, 1, 80)
    meter.stopped()
    assert meter.rates().decode_tps == 80.0


def test_the_busy_clock_runs_while_any_job_runs(clock):
    """Overlapping jobs: busy from the first start to the last stop, not per job nor summed."""
    meter = RateMeter(clock=clock)
    meter.started()
    run(meter, clock, 1, 100)
    meter.started()  # a second job joins: the engine's rate is the two together
    run(meter, clock, 1, 100)
    meter.stopped()
    run(meter, clock, 1, 100)
    meter.stopped()
    clock.t += 5
    assert meter.rates().decode_tps == 100.0


def test_a_stop_without_a_start_is_ignored(clock):
    meter = RateMeter(clock=clock)
    meter.stopped()
    meter.started()
    run(meter, clock, 2, 30)
    assert meter.rates().decode_tps == 30.0


def test_the_decode_rate_follows_the_last_window_of_busy_time(clock):
    meter = RateMeter(clock=clock, window_s=10)
    meter.started()
    for _ in range(30):  # slow for 30 s, read as heartbeats do
        run(meter, clock, 1, 20)
        meter.rates()
    meter.stopped()
    clock.t += 100
    meter.started()
    for _ in range(30):  # then fast: the slow spell is more than a window back
        run(meter, clock, 1, 200)
        meter.rates()
    assert meter.rates().decode_tps == 200.0
    # Half a window later on, it is half the one rate and half the other... within a mark's gap.
    for _ in range(5):
        run(meter, clock, 1, 20)
        meter.rates()
    assert 100 <= meter.rates().decode_tps <= 120


def test_marks_stay_few_however_many_jobs(clock):
    meter = RateMeter(clock=clock, window_s=10)
    for _ in range(10_000):  # a job a hundredth of a second: 100 s of busy time
        meter.started()
        run(meter, clock, 0.01, 100, steps_per_s=100)
        meter.stopped()
    assert meter.rates().decode_tps == 100.0
    assert len(meter._marks) <= 22


def test_prefill_rate_weighs_each_job_by_its_prompt(clock):
    """A short prompt's first token is mostly fixed cost: the mean of per-job rates (here
    (10 + 1000) / 2 = 505) would overstate what a long prompt ahead in the queue costs."""
    meter = RateMeter(clock=clock, weight=0.5)
    meter.first_token(10, 1000)  # 10 tokens in 1 s
    meter.first_token(1000, 1000)  # 1000 tokens in 1 s
    assert meter.rates().prefill_tps == round((0.5 * 10 + 0.5 * 1000) / 1.0, 1)


def test_the_first_job_is_the_mean_and_later_ones_move_it_by_their_weight(clock):
    meter = RateMeter(clock=clock, weight=0.1)
    meter.finished(100)
    assert meter.rates().generated_per_job == 100.0
    meter.finished(200)
    assert meter.rates().generated_per_job == 110.0
    for _ in range(200):  # the workload changed: the mean follows it
        meter.finished(50)
    assert meter.rates().generated_per_job == 50.0
    meter.first_token(100, 250)
    assert meter.rates().prefill_tps == 400.0


def test_a_first_token_without_a_prompt_or_a_duration_measures_nothing(clock):
    meter = RateMeter(clock=clock)
    meter.first_token(0, 100)
    meter.first_token(100, 0)
    assert meter.rates().prefill_tps == 0.0
    meter.first_token(300, 100)
    assert meter.rates().prefill_tps == 3000.0


def test_rates_are_rounded_to_a_tenth(clock):
    meter = RateMeter(clock=clock)
    meter.finished(1)
    meter.finished(2)
    meter.first_token(1, 3000)
    assert meter.rates() == Rates(prefill_tps=0.3, generated_per_job=1.1)


def test_the_heartbeat_carries_the_rates_as_json_and_the_status_reads_them(clock):
    meter = RateMeter(clock=clock)
    meter.started()
    run(meter, clock, 2, 40)
    meter.first_token(500, 100)
    meter.finished(12)
    presence = Presence(load_settings({}, served_model_name="m"), None, "w", Recorder("m"),  # type: ignore[arg-type]
                        rates=meter.rates)
    fields = presence._heartbeat_fields("ready", 1, [])
    assert msgspec.json.decode(fields["rates"]) == {"prefill_tps": 5000.0, "decode_tps": 40.0,
                                                    "generated_per_job": 12.0}
    # As Redis hands it back (strings), read as llmq-status and /v1/deployment read it.
    raw = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in fields.items()}
    assert _json(raw, "rates", Rates, Rates()) == Rates(prefill_tps=5000.0, decode_tps=40.0, generated_per_job=12.0)
    del raw["rates"]  # a worker older than the field
    assert _json(raw, "rates", Rates, Rates()) == Rates()


def test_a_presence_without_a_meter_reports_no_rates():
    presence = Presence(load_settings({}, served_model_name="m"), None, "w", Recorder("m"))  # type: ignore[arg-type]
    assert msgspec.json.decode(presence._heartbeat_fields("warming", 0, [])["rates"], type=Rates) == Rates()


def test_the_lead_is_the_mean_time_to_a_first_token_two_deviations_up():
    meter = RateMeter(clock=lambda: 0.0, weight=0.5)
    assert meter.lead_ms() == 0.0
    meter.first_token(10, 100.0)
    assert meter.lead_ms() == pytest.approx(100.0)  # one sample: no spread yet
    meter.first_token(10, 300.0)
    # mean 200 ms; variance (1 - 0.5) * (0 + 0.5 * 0.2 ** 2) = 0.01 s²: 100 ms a deviation
    assert meter.lead_ms() == pytest.approx(200.0 + 2 * 100.0)
