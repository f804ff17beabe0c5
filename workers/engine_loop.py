"""The worker's own engine front end: vLLM's engine-core client read by one loop, with vLLM's
per-request helpers used as libraries (``LLMQ_ENGINE_FRONT=loop``, docs/architecture.md#engine-front).

vLLM's ``AsyncLLM`` (workers/engine.py's other front) turns each engine step into a
``RequestOutput`` per request, puts it in that request's collector and wakes the request's task,
which llmq then turns into its own :class:`~workers.protocol.Step`. Most of that is vLLM's API
server's work, not a worker's. This loop builds the same parts ``AsyncLLM.__init__`` builds (the
renderer, the ``InputProcessor`` and the ``AsyncMPClient``), and for each ``EngineCoreOutputs``
runs, per output: the request's own ``IncrementalDetokenizer`` (the same text, stop strings and
their hold-back), a ``LogprobsProcessor`` only where logprobs were asked for, the stop-string trim
and abort, and the stream interval (a front-end rule in vLLM: ``output_processor.py``'s
``make_request_output``). The result is a ``Step`` straight away.

It follows ``AsyncLLM`` and ``OutputProcessor`` line by line where they decide what a client sees
(tests/engine/test_engine_fronts.py runs both and compares every step): request ids unique per
attempt (vLLM's own ``assign_request_id``), n > 1 as children seeded seed + index (vLLM's
``ParentRequest``), a step its job has not read yet merged with the next (vLLM's collector), and
an abort's final output with the text a stop string held back.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from copy import copy
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import structlog
from vllm import PoolingParams, SamplingParams
from vllm.config import VllmConfig
from vllm.lora.request import LoRARequest
from vllm.renderers import renderer_from_config
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.utils.async_utils import make_async
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.core_client import EngineCoreClient
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.engine.parallel_sampling import ParentRequest
from vllm.v1.executor import Executor

from shared.events import TokenDelta
from workers.outputs import add_logprobs, prompt_info
from workers.protocol import Step

__all__ = ["EngineLoop"]

log = structlog.get_logger()

CHUNK = 128
"""Outputs handled between yields to the worker's other tasks, so one slow step (a parser, many
logprobs) does not hold every lease and flush behind it (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE)."""


@dataclass(slots=True)
class _Job:
    """One submitted request (n > 1: its children, one per choice): where its steps go as the loop
    makes them (``deliver``), and where its failure goes (``fail``)."""

    deliver: Callable[[Step], None]
    fail: Callable[[BaseException], None]
    want_top: int | None
    want_prompt: bool
    k_prompt: int | None
    children: set[str] = field(default_factory=set)
    unfinished: set[str] = field(default_factory=set)
    emitted: bool = False  # a step has been made: only the first carries the prompt's info


class _Collector:
    """The steps of a job read as an iterator (:meth:`EngineLoop.steps`): a step not read yet takes
    the next one in, as vLLM's ``RequestOutputCollector`` does in DELTA mode (``RequestOutput.add``)."""

    __slots__ = ("pending", "error", "ready")

    def __init__(self) -> None:
        self.pending: Step | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, step: Step) -> None:
        if self.pending is None:
            self.pending = step
            self.ready.set()
            return
        _merge(self.pending, step)

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.ready.set()

    async def get(self) -> Step:
        if self.pending is None and self.error is None:
            await self.ready.wait()
        if self.error is not None:
            raise self.error
        step, self.pending = self.pending, None
        self.ready.clear()
        assert step is not None
        return step


class _Handed:
    """The steps of a job handed to a callback as the loop makes them (:meth:`EngineLoop.run`): its
    task is not woken per step, only at the end (``done``)."""

    __slots__ = ("on_step", "done", "context")

    def __init__(self, on_step: Callable[[Step], None]) -> None:
        self.on_step = on_step
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # The caller's context (a job's task: its job_id and attempt bound for structlog), which
        # the callback runs in, not the loop's own.
        self.context = contextvars.copy_context()

    def put(self, step: Step) -> None:
        self.context.run(self.on_step, step)
        if step.finished and not self.done.done():
            self.done.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


def _merge(into: Step, then: Step) -> None:
    into.finished |= then.finished
    for delta in then.deltas:
        same = next((d for d in into.deltas if d.index == delta.index), None)
        if same is None:
            into.deltas.append(delta)
            continue
        same.text += delta.text
        same.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None and same.logprobs is not None:
            same.logprobs.extend(delta.logprobs)
            same.token_texts = [*(same.token_texts or []), *(delta.token_texts or [])]
            if delta.top_logprobs is not None and same.top_logprobs is not None:
                same.top_logprobs.extend(delta.top_logprobs)
        same.finish_reason, same.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(slots=True)
class _Request:
    """One engine request's state in the loop (vLLM's ``RequestState``, as much as llmq reads)."""

    job: _Job
    index: int
    prompt_ids: list[int]
    detokenizer: IncrementalDetokenizer
    logprobs: LogprobsProcessor | None
    interval: int
    sent: int = 0  # output tokens emitted so far (the stream interval's offset)
    prefilling: bool = True
    cached_tokens: int = 0


class EngineLoop:
    """One vLLM engine, read by one loop task (started with the first request, in the caller's
    event loop). Quacks as much of ``AsyncLLM`` as workers/engine.py and workers/adapters.py use."""

    def __init__(self, config: VllmConfig) -> None:
        self.vllm_config = config
        self.model_config = config.model_config
        self.renderer = renderer_from_config(config)
        self.input_processor = InputProcessor(config, self.renderer)
        self.engine_core = EngineCoreClient.make_async_mp_client(
            vllm_config=config, executor_class=Executor.get_class(config), log_stats=False, renderer=self.renderer)
        self.tokenizer = self.renderer.get_tokenizer()
        self.interval = config.scheduler_config.stream_interval
        # Rendering and input processing block (tokenising a text prompt, an image's processor):
        # one hop to the renderer's thread per request, as AsyncLLM's raw-prompt path takes.
        self._process = make_async(self._engine_request, executor=self.renderer._executor)
        self._process_pooling = make_async(self._pooling_requests, executor=self.renderer._executor)
        self._requests: dict[str, _Request] = {}  # internal request id -> its state
        self._by_external: dict[str, list[str]] = {}  # the caller's request id -> internal ids
        self._loop: asyncio.Task[None] | None = None
        self._failed: list[_Job] = []  # jobs whose callback raised in the chunk being handled
        self._supported: tuple[Any, ...] | None = None
        self._pooling: dict[str, asyncio.Future[Any]] = {}  # a pooling request's id -> its output

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def errored(self) -> bool:
        return self.engine_core.resources.engine_dead or (self._loop is not None and self._loop.done())

    async def add_lora(self, lora: LoRARequest) -> bool:
        return await self.engine_core.add_lora_async(lora)

    async def list_loras(self) -> set[int]:
        return await self.engine_core.list_loras_async()

    def processes(self) -> list[BaseProcess]:
        return list(getattr(self.engine_core.resources.engine_manager, "processes", ()))

    def shutdown(self) -> None:
        self.renderer.shutdown()
        self.engine_core.shutdown()
        if self._loop is not None:
            self._loop.cancel()

    def _engine_request(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams | PoolingParams,
                        supported: tuple[Any, ...], kwargs: dict[str, Any]) -> EngineCoreRequest:
        (rendered,) = self.renderer.render_cmpl([parse_model_prompt(self.model_config, prompt)],
                                                self.renderer.default_cmpl_tok_params)
        return self.input_processor.process_inputs(request_id, rendered, params, supported_tasks=supported,
                                                   **kwargs)

    async def steps(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams, *,
                    priority: int = 0, lora_request: LoRARequest | None = None,
                    trace_headers: Mapping[str, str] | None = None, reasoning_ended: bool | None = None,
                    want_top: int | None = None, want_prompt: bool = False) -> AsyncIterator[Step]:
        """One request's steps, as llmq reads them (``want_top``: the logprobs' alternatives asked
        for; ``want_prompt``: the first step carries the prompt's tokens, workers/outputs.py)."""
        collector = _Collector()
        job = await self._submit(request_id, prompt, params, collector.put, collector.fail, priority=priority,
                                 lora_request=lora_request, trace_headers=trace_headers,
                                 reasoning_ended=reasoning_ended, want_top=want_top, want_prompt=want_prompt)
        try:
            finished = False
            while not finished:
                step = await collector.get()
                finished = step.finished
                yield step
        except (asyncio.CancelledError, GeneratorExit):
            await self._stop(job)  # the job's task was cancelled, or it stopped reading
            raise
        finally:
            self._unregister(request_id, job)

    async def run(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams, *,
                  on_step: Callable[[Step], None], priority: int = 0, lora_request: LoRARequest | None = None,
                  trace_headers: Mapping[str, str] | None = None, reasoning_ended: bool | None = None,
                  want_top: int | None = None, want_prompt: bool = False) -> None:
        """:meth:`steps`' batch form: each step handed to ``on_step`` from the loop as it is made,
        and this returns after the last. ``on_step`` runs inside the loop: what it raises fails
        this request only (raised here), and its engine requests are stopped."""
        handed = _Handed(on_step)
        job = await self._submit(request_id, prompt, params, handed.put, handed.fail, priority=priority,
                                 lora_request=lora_request, trace_headers=trace_headers,
                                 reasoning_ended=reasoning_ended, want_top=want_top, want_prompt=want_prompt)
        try:
            await handed.done
        except asyncio.CancelledError:
            await self._stop(job)
            raise
        finally:
            self._unregister(request_id, job)

    async def pool(self, request_id: str, inputs: Sequence[tuple[Mapping[str, Any], PoolingParams]], *,
                   priority: int = 0) -> list[Any]:
        """A pooling job's outputs (vLLM's ``pooling_output`` tensors), one per input, in input order:
        each input an engine request ``{i}-{request_id}``, rendered and processed in one hop to the
        renderer's thread, all sent before any is awaited, so the engine batches them per step."""
        if self.errored:
            raise EngineDeadError()
        if self._supported is None:
            self._supported = await self.engine_core.get_supported_tasks_async()
        requests = await self._process_pooling(request_id, inputs, self._supported, priority)
        outputs: list[asyncio.Future[Any]] = []
        for request in requests:
            self.input_processor.assign_request_id(request)
            outputs.append(self._pooling.setdefault(request.request_id, asyncio.get_running_loop().create_future()))
        self._start()
        ids = [request.request_id for request in requests]
        try:
            for request in requests:
                await self.engine_core.add_request_async(request)
            return list(await asyncio.gather(*outputs))
        except BaseException:
            if live := [rid for rid in ids if self._pooling.pop(rid, None) is not None]:
                await self.engine_core.abort_requests_async(live)
            raise
        finally:
            for rid in ids:
                self._pooling.pop(rid, None)

    def _pooling_requests(self, request_id: str, inputs: Sequence[tuple[Mapping[str, Any], PoolingParams]],
                          supported: tuple[Any, ...], priority: int) -> list[EngineCoreRequest]:
        return [self._engine_request(f"{i}-{request_id}", prompt, params, supported, {"priority": priority})
                for i, (prompt, params) in enumerate(inputs)]

    async def _submit(self, request_id: str, prompt: Mapping[str, Any], params: SamplingParams,
                      deliver: Callable[[Step], None], fail: Callable[[BaseException], None], *, priority: int,
                      lora_request: LoRARequest | None, trace_headers: Mapping[str, str] | None,
                      reasoning_ended: bool | None, want_top: int | None, want_prompt: bool) -> _Job:
        """``prompt`` rendered and processed as ``AsyncLLM.add_request`` does, its engine requests
        registered with the loop and sent to the engine."""
        if self.errored:
            raise EngineDeadError()
        if self._supported is None:
            self._supported = await self.engine_core.get_supported_tasks_async()
        request = await self._process(request_id, prompt, params, self._supported,
                                      {"lora_request": lora_request, "trace_headers": trace_headers,
                                       "priority": priority})
        if reasoning_ended is not None:
            request.reasoning_ended = reasoning_ended
        self.input_processor.assign_request_id(request)
        job = _Job(deliver=deliver, fail=fail, want_top=want_top, want_prompt=want_prompt,
                   k_prompt=request.sampling_params.prompt_logprobs if request.sampling_params else None)
        requests = self._fan_out(request)
        for child, index in requests:
            self._register(job, child, index)
        self._by_external.setdefault(request_id, []).extend(job.children)
        self._start()
        try:
            for child, _ in requests:
                await self.engine_core.add_request_async(child)
        except BaseException:
            await self._stop(job)
            self._unregister(request_id, job)
            raise
        return job

    async def _stop(self, job: _Job) -> None:
        """The engine stops ``job``'s requests still running, and the loop forgets them."""
        if live := self._forget(job.children):
            await self.engine_core.abort_requests_async(live)

    def _unregister(self, request_id: str, job: _Job) -> None:
        self._forget(job.children)
        ids = self._by_external.get(request_id)
        if ids is not None:
            ids[:] = [i for i in ids if i not in job.children]
            if not ids:
                del self._by_external[request_id]

    @staticmethod
    def _fan_out(request: EngineCoreRequest) -> list[tuple[EngineCoreRequest, int]]:
        """``request``, or with n > 1 its children: ids ``{i}_{id}``, seeds seed + i (vLLM's
        ``ParentRequest``, as ``AsyncLLM.add_request`` fans them out)."""
        params = request.sampling_params
        if params is None or params.n == 1:
            return [(request, 0)]
        parent = ParentRequest(request)
        children = []
        for index in range(params.n):
            child_id, child_params = parent.get_child_info(index)
            child = request if index == params.n - 1 else copy(request)
            child.request_id, child.sampling_params = child_id, child_params
            children.append((child, index))
        return children

    def _register(self, job: _Job, request: EngineCoreRequest, index: int) -> None:
        params = request.sampling_params
        assert params is not None
        asks = params.logprobs is not None or params.prompt_logprobs is not None
        self._requests[request.request_id] = _Request(
            job=job, index=index, prompt_ids=list(request.prompt_token_ids or ()),
            detokenizer=IncrementalDetokenizer.from_new_request(self.tokenizer, request),
            logprobs=LogprobsProcessor.from_new_request(self.tokenizer, request) if asks else None,
            interval=self.interval)
        job.children.add(request.request_id)
        job.unfinished.add(request.request_id)

    def _forget(self, ids: set[str]) -> list[str]:
        """Drop ``ids``' states; returns those still running."""
        return [rid for rid in ids if self._requests.pop(rid, None) is not None]

    async def abort(self, request_ids: list[str]) -> None:
        """Stop the requests made under ``request_ids`` (the callers' ids): each ends with a final
        step of finish reason ``abort`` carrying any text a stop string held back, as vLLM's
        ``OutputProcessor.abort_requests`` makes."""
        internal = [rid for external in request_ids for rid in self._by_external.pop(external, ())]
        live = []
        for rid in internal:
            state = self._requests.pop(rid, None)
            if state is None:
                continue
            live.append(rid)
            if (step := self._output(rid, state, [], FinishReason.ABORT, None)) is not None:
                self._deliver(state.job, step)
        if live:
            await self.engine_core.abort_requests_async(live)

    def _start(self) -> None:
        if self._loop is None:
            # A context of its own: started from a job's task, it would otherwise log as that job.
            self._loop = asyncio.create_task(self._run(), name="engine-loop", context=contextvars.Context())

    async def _run(self) -> None:
        try:
            while True:
                outputs = (await self.engine_core.get_output_async()).outputs
                for start in range(0, len(outputs), CHUNK):
                    stopped = self._handle(outputs[start:start + CHUNK])
                    for job in self._failed:
                        stopped += self._forget(job.children)
                    self._failed.clear()
                    if stopped:
                        # Ended by a stop string here, not in the engine: the engine stops them too.
                        await self.engine_core.abort_requests_async(stopped)
                    if start + CHUNK < len(outputs):
                        await asyncio.sleep(0)
        except Exception as exc:  # noqa: BLE001 - every caller gets it (EngineDeadError: the engine died)
            if not isinstance(exc, EngineDeadError):
                log.exception("engine_loop_failed")
            for job in {id(state.job): state.job for state in self._requests.values()}.values():
                job.fail(exc)
            self._requests.clear()
            for pooled in self._pooling.values():
                if not pooled.done():
                    pooled.set_exception(exc)
            self._pooling.clear()

    def _handle(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """One chunk of a step's outputs, each to its job; returns the requests a stop string ended."""
        stopped = []
        for out in outputs:
            rid = out.request_id
            if (pooled := self._pooling.get(rid)) is not None:
                if out.pooling_output is not None or out.finished:
                    del self._pooling[rid]
                    if pooled.done():
                        pass  # its job was cancelled
                    elif out.pooling_output is not None:
                        pooled.set_result(out.pooling_output)
                    else:  # finished without an output: the engine ended it
                        pooled.set_exception(RuntimeError(f"the engine ended pooling request {rid} without an output"))
                continue
            state = self._requests.get(rid)
            if state is None:  # aborted, or its job gone
                continue
            if state.prefilling:
                if out.prefill_stats is not None:
                    state.cached_tokens = out.prefill_stats.num_cached_tokens
                state.prefilling = False
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            ids = out.new_token_ids
            before = state.detokenizer.num_output_tokens()
            if stop := state.detokenizer.update(ids, finish_reason == FinishReason.STOP):
                finish_reason, stop_reason = FinishReason.STOP, stop
                kept = state.detokenizer.num_output_tokens() - before
                if kept < len(ids):
                    del ids[kept:]
                    if out.new_logprobs is not None:
                        out.new_logprobs = out.new_logprobs.slice_request(0, kept)
            if state.logprobs is not None:
                state.logprobs.update_from_output(out)
            if finish_reason is not None:
                del self._requests[rid]
                if not out.finished:
                    stopped.append(rid)
            if (step := self._output(rid, state, ids, finish_reason, stop_reason)) is not None:
                self._deliver(state.job, step)
        return stopped

    def _deliver(self, job: _Job, step: Step) -> None:
        """``step`` to its job; what its callback raises fails that job alone (its engine requests
        are stopped after the chunk)."""
        if job in self._failed:
            return
        try:
            job.deliver(step)
        except Exception as exc:  # noqa: BLE001 - the job's own failure, raised in its task
            job.fail(exc)
            self._failed.append(job)

    def _output(self, rid: str, state: _Request, ids: list[int], finish_reason: FinishReason | None,
                stop_reason: int | str | None) -> Step | None:
        """The step ``state``'s job reads for these new tokens (None: the stream interval holds them
        back): ``make_request_output`` and ``_new_completion_output`` in vLLM's DELTA mode."""
        finished = finish_reason is not None
        detok = state.detokenizer
        if state.interval > 1:
            if not (finished or state.sent == 0 or detok.num_output_tokens() - state.sent >= state.interval):
                return None
            ids = detok.output_token_ids[state.sent:]
            state.sent = detok.num_output_tokens()
        job = state.job
        delta = TokenDelta(index=state.index, token_ids=list(ids), text=detok.get_next_output_text(finished, True),
                           finish_reason=str(finish_reason) if finished else None,
                           stop_reason=stop_reason if finished else None)
        positions = None
        if state.logprobs is not None:
            positions = state.logprobs.pop_prompt_logprobs()
            sampled = state.logprobs.logprobs
            if sampled is not None and job.want_top is not None:
                add_logprobs(delta, sampled[-len(ids):] if ids else sampled[:0], job.want_top)
        if finished:
            job.unfinished.discard(rid)
        step = Step(deltas=[delta], finished=not job.unfinished, prompt_tokens=len(state.prompt_ids),
                    cached_tokens=state.cached_tokens)
        if not job.emitted:
            job.emitted = True
            step.prompt_token_ids = list(state.prompt_ids)
            if job.want_prompt:
                step.prompt = prompt_info(self.tokenizer.decode, state.prompt_ids, positions, job.k_prompt)
        return step
