"""A job's event log read straight from Redis by a synchronous test (the e2e suites): the stream
while the job runs, the compact log (shared/eventlog.py) once its worker ended it.
``Queue.read_events`` is the asynchronous reader the services use."""

from __future__ import annotations

import json

from redis import Redis

from shared import eventlog
from shared.keys import Keys

__all__ = ["logged_events"]


def logged_events(redis: Redis, keys: Keys, model: str, job_id: str) -> list[tuple[int, dict]]:
    """(seq, event) of every logged event, in order; [] when there is no log."""
    log = keys.events(model, job_id)
    # One MULTI: the worker's end swaps the stream for the compact log between two plain reads.
    pipe = redis.pipeline(transaction=True)
    pipe.type(log)
    pipe.xrange(log)
    pipe.hmget(keys.job(model, job_id), "log", "result")  # Job.finish keeps the compact log in the record
    kind, entries, (compact, result) = pipe.execute(raise_on_error=False)
    if kind == b"stream":
        return [(int(entry_id.split(b"-")[0]), json.loads(fields[b"e"])) for entry_id, fields in entries]
    if compact is not None:
        return [(e["seq"], e) for e in json.loads(eventlog.expand(compact, result))]
    return []
