"""``python -m tests.support.fault_wrap <api|workers|housekeeping>``: a process's real ``main()``, with one
internal function made to raise ``RuntimeError`` the first time it is called. The error's message
quotes what that function was given (the request, the Settings), as an engine's or a library's
error may, so a test can check what an unexpected error puts in the logs. Test code only: the
production modules have no hooks for this.

- api: ``api.submit.admit(svc, ctx, req)``, which every generation route calls with the decoded
  body and the Services (holding the Settings) in its frames.
- workers: ``workers.runner.plan_for(queue, model, delivery, req, parsed)``, the first call inside
  ``Worker._run_job`` for a job, with the request in its frames.
- housekeeping: ``workers.housekeeping.sweeps._remove_dead_consumers(hk, reading)``, which the ``sweep``
  cron calls (at start-up, then every 30 s) with the Housekeeper (holding the Settings).

``python -m tests.support.fault_wrap engine`` is a worker whose vLLM fails, by itself, every request whose
prompt holds :data:`ENGINE_FAULT` (see :func:`fail_marked_requests`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Awaitable, Callable
from typing import Any

TARGETS: dict[str, tuple[str, str, str, Callable[..., str]]] = {
    # process: (module whose main() runs, module holding the function, function, message)
    "api": ("api.__main__", "api.submit", "admit", lambda svc, ctx, req: f"forced fault admitting {req!r} "
                                                                    f"with {svc.settings!r}"),
    "workers": ("workers.__main__", "workers.runner", "plan_for",
                lambda queue, model, d, req, parsed: f"forced fault running {req!r}"),
    "housekeeping": ("workers.housekeeping.__main__", "workers.housekeeping.sweeps", "_remove_dead_consumers",
                     lambda hk, reading: f"forced fault sweeping with {hk.settings!r}"),
}


def fail_once(module: Any, name: str, message: Callable[..., str]) -> None:
    original: Callable[..., Awaitable[Any]] = getattr(module, name)
    fired = False

    async def faulty(*args: Any, **kwargs: Any) -> Any:
        nonlocal fired
        if not fired:
            fired = True
            raise RuntimeError(message(*args, **kwargs))
        return await original(*args, **kwargs)

    setattr(module, name, faulty)


ENGINE_FAULT = "ENGINE-FAULT"
"""The prompt text that makes the ``engine`` target's vLLM fail the request."""


def fail_marked_requests() -> None:
    """vLLM's engine handed (through either front), for a prompt that holds :data:`ENGINE_FAULT`, a seed
    no engine request can carry (past 2**64 - 1; every API refuses it). vLLM then fails that one
    request itself, as it fails any request its own code cannot process: ``EngineGenerateError``
    from the ``OverflowError`` of its request serialisation. The engine goes on serving the rest.
    The fault is vLLM's; only the seed is planted."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from workers.engine_loop import EngineLoop

    def planted(tokenizer: Any, prompt: Any, sampling_params: Any) -> Any:
        text = prompt.get("prompt") or tokenizer.decode(prompt.get("prompt_token_ids") or [])
        if ENGINE_FAULT in text:
            sampling_params = sampling_params.clone()
            sampling_params.seed = 2**64
        return sampling_params

    generate = AsyncLLM.generate  # the AsyncLLM front's way in (LLMQ_ENGINE_FRONT=asyncllm)
    AsyncLLM.generate = lambda self, prompt, params, request_id, **kwargs: generate(  # type: ignore[method-assign]
        self, prompt, planted(self.tokenizer, prompt, params), request_id, **kwargs)
    submit = EngineLoop._submit  # the loop front's (LLMQ_ENGINE_FRONT=loop)
    EngineLoop._submit = lambda self, request_id, prompt, params, *args, **kwargs: submit(  # type: ignore[method-assign]
        self, request_id, prompt, planted(self.tokenizer, prompt, params), *args, **kwargs)


def main(process: str) -> None:
    if process == "engine":
        fail_marked_requests()
        entry = "workers.__main__"
    else:
        entry, holder, name, message = TARGETS[process]
        fail_once(importlib.import_module(holder), name, message)
    sys.argv = sys.argv[:1]  # the process's own main() reads argv (python -m api's options): not ours
    importlib.import_module(entry).main()


if __name__ == "__main__":  # a guard: vLLM's engine process imports this module again (spawn)
    main(sys.argv[1])
