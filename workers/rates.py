"""A worker's measured speed (:class:`shared.slo.Rates`), for its heartbeat: what SLO-aware
admission predicts a waiting job's first token from (shared/slo.py, docs/guarantees.md#slos).

The worker (workers/runner.py) tells a :class:`RateMeter` four things, and nothing here does I/O
or reads a clock the caller did not ask for (the clock is injected, so the tests drive it):

- :meth:`RateMeter.started` and :meth:`RateMeter.stopped`, as a job starts and stops running here
  (however it stops): the meter's *busy clock* runs only while at least one job runs, so an idle
  worker's rates stay what it last measured instead of decaying towards zero;
- :meth:`RateMeter.generated`, per engine step of a job, its new tokens: one integer addition, no
  clock and no allocation (it runs about once per token of every job);
- :meth:`RateMeter.first_token`, for a job's first token: its prompt tokens and the time from its
  attempt's start, the prefill as the job saw it (waiting inside the engine included);
- :meth:`RateMeter.finished`, as a job ends with its Done: the tokens it generated.

:meth:`RateMeter.rates` (each heartbeat) reads them. The decode rate is the tokens generated over
the last ``window_s`` of busy time, measured between *marks* (busy seconds, tokens so far) taken
at starts, stops and reads, at most one per twentieth of the window: a few dozen marks at most,
whatever the load, and nothing per token.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from shared.slo import Rates

__all__ = ["RateMeter", "WINDOW_S", "WEIGHT"]

WINDOW_S = 10.0
"""Busy seconds the decode rate is measured over: long enough to smooth over jobs starting and
ending, short enough to follow a change of load within a few heartbeats."""

WEIGHT = 0.1
"""Each new job's weight in the moving means (prefill, tokens per job): about the last 20 jobs count."""


class RateMeter:
    """One worker's rates, measured as its jobs run."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S,
                 weight: float = WEIGHT) -> None:
        self._clock = clock
        """Seconds, monotonic: read at starts, stops and :meth:`rates`, never per step."""
        self._window_s = window_s
        self._weight = weight
        self._tokens = 0
        """Tokens generated here so far, every job's: all of them while the busy clock ran."""
        self._running = 0
        self._busy_s = 0.0
        """Busy seconds before the current busy spell (which began at ``_since``)."""
        self._since = 0.0
        self._marks: deque[tuple[float, int]] = deque()
        """(busy seconds, tokens) at some past moments, oldest first; the first is at most one
        window (plus one mark's gap) back, so the decode rate spans about a window."""
        # Prefill: moving means of the prompt tokens and of the seconds to the first token, apart,
        # and their ratio the rate. The mean of each job's own rate would make a short prompt
        # (whose first token is mostly fixed cost) count as much as a long one; this weighs each
        # job by its prompt, as the prediction (prompt tokens ahead / rate) does.
        self._prompt = 0.0
        self._prefill_s = 0.0
        self._prefill_var = 0.0
        self._per_job = 0.0
        self._prefills = self._jobs = 0

    # --- told by the worker -------------------------------------------------------------------

    def started(self) -> None:
        """A job started running here (claimed, in a slot)."""
        now = self._clock()
        if not self._running:
            self._since = now
        self._running += 1
        self._mark(now)

    def stopped(self) -> None:
        """A job stopped running here, however it ended (done, failed, cancelled, handed on)."""
        if not self._running:
            return  # never started here (not counted): nothing to stop
        now = self._clock()
        self._mark(now)
        self._running -= 1
        if not self._running:
            self._busy_s += now - self._since

    def generated(self, tokens: int) -> None:
        """An engine step of a running job generated ``tokens``."""
        self._tokens += tokens

    def first_token(self, prompt_tokens: int, after_ms: float) -> None:
        """A job's first token came ``after_ms`` after its attempt started, for a prompt of
        ``prompt_tokens`` (cached ones included: the rate is the prefill as jobs see it)."""
        if prompt_tokens <= 0 or after_ms <= 0:
            return  # nothing measured (a clock's resolution, or an engine that reports no prompt)
        self._prompt = self._mean(self._prompt, prompt_tokens, self._prefills)
        if self._prefills:  # the moving variance of the seconds to a first token (West, 1979)
            diff = after_ms / 1000 - self._prefill_s
            self._prefill_var = (1 - self._weight) * (self._prefill_var + self._weight * diff * diff)
        self._prefill_s = self._mean(self._prefill_s, after_ms / 1000, self._prefills)
        self._prefills += 1

    def finished(self, tokens: int) -> None:
        """A job ended with its Done, having generated ``tokens`` (its earlier attempts' included)."""
        self._per_job = self._mean(self._per_job, tokens, self._jobs)
        self._jobs += 1

    def lead_ms(self) -> float:
        """The time from a job's start here to its first token that most jobs make: the mean plus
        two standard deviations (0: not measured yet). A job whose first-token deadline comes
        sooner than that after its pick would likely miss it, and is not started (claim.lua, ``late``)."""
        return (self._prefill_s + 2 * self._prefill_var ** 0.5) * 1000

    # --- read by the heartbeat ----------------------------------------------------------------

    def rates(self) -> Rates:
        """What the worker measured so far, rounded to 0.1 (0: not measured yet)."""
        now = self._clock()
        self._mark(now)
        decode = 0.0
        if self._marks:
            busy_from, tokens_from = self._marks[0]
            span = self._busy(now) - busy_from
            if span > 0:
                decode = (self._tokens - tokens_from) / span
        prefill = self._prompt / self._prefill_s if self._prefill_s > 0 else 0.0
        return Rates(prefill_tps=round(prefill, 1), decode_tps=round(decode, 1),
                     generated_per_job=round(self._per_job, 1))

    # --- inside -------------------------------------------------------------------------------

    def _busy(self, now: float) -> float:
        """Busy seconds so far: the time at least one job ran here."""
        return self._busy_s + (now - self._since if self._running else 0.0)

    def _mark(self, now: float) -> None:
        busy = self._busy(now)
        marks = self._marks
        if not marks or busy - marks[-1][0] >= self._window_s / 20:
            marks.append((busy, self._tokens))
        # The oldest mark goes once the next one is a whole window back: the rate then still
        # spans at least a window (once the worker has been busy that long).
        while len(marks) > 1 and busy - marks[1][0] >= self._window_s:
            marks.popleft()

    def _mean(self, mean: float, value: float, count: int) -> float:
        """The moving mean after ``value``: the first value is the mean (no bias towards 0)."""
        return value if not count else mean + self._weight * (value - mean)
