"""The housekeeping process (``python -m workers.housekeeping``, run by :mod:`.__main__`): arq crons
and retryable background work, away from the hot path.

- :mod:`.housekeeper`: the :class:`~.housekeeper.Housekeeper` every task takes (settings, clients,
  the queue). The task modules import it and nothing else of the package, so none imports another;
- :mod:`.webhooks`, :mod:`.batches`, :mod:`.sweeps`: the tasks;
- :mod:`.arq_settings`: arq's connection settings for llmq's Redis URL;
- :mod:`.__main__`: arq's entry points, the crons' schedule and the process's ``main()``.
"""
