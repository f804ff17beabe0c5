"""The internal request every dialect translates into, and the job record kept in Redis.

New fields always get defaults, so API and workers of different versions can share a queue.
"""

from __future__ import annotations

import array
import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from shared.budget import generation_budget
from shared.config import ModelKind
from shared.errors import InvalidRequest, ServiceError, error_from_code
from shared.keys import new_job_id
from shared.slo import Standing
from shared.tenants import DEFAULT_TENANT

__all__ = [
    "Slo",
    "AdapterSpec",
    "StructuredOutput",
    "SamplingParams",
    "ChatMessage",
    "Text",
    "Image",
    "Part",
    "ImageDetail",
    "IMAGE_FORMATS",
    "Tool",
    "ToolCall",
    "ToolUse",
    "ToolUseChoice",
    "PromptInfo",
    "OutputOptions",
    "Reported",
    "GenerationRequest",
    "Pooling",
    "PoolingTask",
    "Pooled",
    "ChatOptions",
    "Choice",
    "TopLogprob",
    "Usage",
    "JobResult",
    "JobError",
    "JobView",
    "SloReport",
    "JobStatus",
    "DialectName",
    "JobRecord",
    "Run",
    "parse_run",
    "runs_of",
    "token_counts_of",
    "JobGroup",
    "GROUP_PREFIX",
    "TERMINAL_STATUSES",
    "estimate_tokens",
    "wrong_kind",
]

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]

DialectName = Literal["jobs", "lmi", "lmi_tgi", "lmi_batch", "openai_completions", "openai_chat", "tgi", "triton",
                      "happy_vllm", "lmtp", "anthropic_messages", "openai_responses", "openai_embeddings", "rerank",
                      "vllm_score", "tei"]
"""Every shape a result or an error is rendered in (``api/dialects``: one module each; LMI has three
shapes). A request naming another is refused when it is decoded, never rendered by a fallback."""

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
"""What vLLM can carry: its engine requests travel as msgpack and seeds become torch int64s, so
a larger int fails inside the worker (vLLM's own server bounds ``seed`` the same way)."""
TokenId = Annotated[int, Meta(ge=0)]
"""A token id: vLLM takes a negative one for a prompt and fails inside the worker (an overflow,
not a validation error), so it is refused here, at the API."""
TERMINAL_STATUSES = frozenset({"done", "failed", "cancelled"})


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Constrained decoding (vLLM structured outputs): exactly one of the fields is set."""

    json: dict | None = None
    """A JSON Schema the output must validate against."""
    json_object: bool = False
    """Any JSON object."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """An EBNF / Lark grammar."""

    def __post_init__(self) -> None:
        chosen = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                  self.grammar is not None]
        if sum(chosen) != 1:
            raise ValueError("structured output needs exactly one of json, json_object, regex, choice, grammar")
        if self.choice is not None and not self.choice:
            raise ValueError("structured output `choice` must not be empty")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Sampling as vLLM understands it; the ranges are vLLM's own (``SamplingParams._verify_args``).

    Dialects validate with their own rules and messages first; these bounds guard the internal
    ``POST /v1/jobs`` shape and anything a dialect forgot.
    """

    n: Annotated[int, Meta(ge=1, le=128)] = 1
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=2**63 - 1)] = 0  # 0 and -1 both disable top-k
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: Int64 | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=2**63 - 1)] = 16
    """Any int64, however far past the context: the worker clamps it to the room the prompt leaves
    (shared/budget.py). A larger number is refused (400), as no int64 field could carry it."""
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    stop: list[Annotated[str, Meta(min_length=1)]] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Top-k logprobs per generated token; 0 = only the sampled token's logprob."""
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    structured: StructuredOutput | None = None
    beam_width: Annotated[int, Meta(ge=1, le=32)] = 1
    """Beam search when > 1 (LMI ``num_beams``): returns ``beam_width`` beams, best first."""
    length_penalty: float = 1.0
    """Beam search only: scores are divided by ``length ** length_penalty``."""


class Reported(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Settings of a request that its answer repeats but no worker uses (OpenAI Responses'): kept
    with the job, so a response read back later (a poll, a resumed stream) says what the first
    answer said."""

    instructions: str | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    format_name: str | None = None
    """``text.format.name`` of a ``json_schema`` format."""
    background: bool = False
    store: bool = True
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    """The ``tools`` as sent, hosted ones included (what the model is offered is ``GenerationRequest.tools``)."""
    tool_choice: str | dict[str, Any] | None = None
    """``tool_choice`` as sent."""
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    reasoning_summary: str | None = None


class OutputOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the submitting dialect wants the result rendered (also for ``GET /v1/jobs/{id}``)."""

    details: bool = False
    return_full_text: bool = False
    echo: bool = False
    include_usage: bool = False
    prompt_tokens: bool = False
    """The worker reports the prompt's tokens (:class:`PromptInfo`) on the first event; with
    ``sampling.prompt_logprobs`` they carry logprobs too."""
    service_tier: str | None = None
    """The ``service_tier`` the request named (OpenAI's, Anthropic's), as the response reports it
    back; None: it named none (the response then says nothing of a tier where it can)."""
    reported: Reported | None = None
    reasoning: bool = True
    """The answer includes the model's reasoning (vLLM's ``include_reasoning``), where a reasoning
    parser separated it."""


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A call the model made: in an assistant turn of the history, and in a result."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's form; Anthropic's ``input`` object is dumped to it)."""


IMAGE_FORMATS = ("png", "jpeg", "gif", "webp")
"""The image formats llmq takes (Anthropic's four; OpenAI's are the same), as Pillow names them,
lower-cased."""


ImageDetail = Literal["auto", "low", "high", "original"]
"""OpenAI's image ``detail`` values (``original`` is Responses')."""


class Text(msgspec.Struct, frozen=True, kw_only=True, tag="text"):
    """A text part of a turn that also holds images (:attr:`ChatMessage.parts`)."""

    text: str


class Image(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="image"):
    """An image in a turn (docs/images.md). A dialect reads it as a source: ``url`` (an http(s)
    URL, or a ``data:`` URL) or ``data`` (base64, with its ``media_type``). Admission
    (api/media.py) reads it, stores its bytes under their SHA-256 (``llmq:media:<sha256>``) and
    queues only the reference: ``sha256``, what its header says, and its estimated tokens. A
    queued job never carries a source, so a worker needs no egress and a conversation that sends
    one screenshot every turn stores it once."""

    sha256: str = ""
    format: str = ""
    """One of :data:`IMAGE_FORMATS`."""
    width: int = 0
    height: int = 0
    tokens: int = 0
    """What the model's processor makes of it, estimated at admission from its size: counted in
    the job's estimate (fair share, quotas) and in ``count_tokens``."""
    detail: ImageDetail | None = None
    """OpenAI's ``detail``, as sent: kept with the job, and without effect (the engine's processor
    sizes an image by its own config)."""
    url: str | None = None
    data: str | None = None
    media_type: str | None = None

    @property
    def stored(self) -> bool:
        """Whether this is a reference to stored bytes, as every queued image is."""
        return bool(self.sha256)


Part = Text | Image
"""A part of a turn that holds images: its text and images in the order the client sent them."""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One chat turn. Dialects flatten multi-part content to text before queueing, unless it holds
    an image: then ``parts`` holds its text and images in order and ``content`` is empty. They map
    their tool history to OpenAI's form: an assistant turn's ``tool_calls``, then one ``tool`` turn
    per result, naming its call (a result's images in its ``parts``)."""

    role: str
    content: str = ""
    parts: list[Part] = []
    """A turn with images: its texts and images in order (``content`` is then empty)."""
    name: str | None = None
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    """A ``tool`` turn: the call it answers."""
    reasoning: str | None = None
    """An assistant turn's reasoning, sent back (templates with interleaved thinking render it)."""


class Tool(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A function the model may call (every dialect's function tools map to this)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """Its arguments' JSON Schema."""
    strict: bool | None = None


ToolUseChoice = Literal["auto", "none", "required", "function"]
"""How a chat's model must use its tools (:attr:`ToolUse.choice`)."""


class ToolUse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The tools a chat offers and how the model must use them, as vLLM's OpenAI server takes them."""

    tools: list[Tool] = []
    choice: ToolUseChoice = "auto"
    """``auto``: the model decides (needs the worker's tool parser); ``required``: at least one
    call; ``function``: exactly the tool ``function`` names; ``none``: no call."""
    function: str | None = None
    parallel: bool = True
    """False: at most one call (OpenAI's ``parallel_tool_calls``, Anthropic's ``disable_parallel_tool_use``)."""


class ChatOptions(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How the worker renders ``messages`` with the model's chat template."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, object] = {}


class PromptInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The prompt as the engine saw it. ``logprobs[0]`` is None: the first token has no context."""

    token_ids: list[int] = []
    token_texts: list[str] = []
    logprobs: list[float | None] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None


class AdapterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The LoRA adapter a job runs with (shared/adapters.py): its name, and where a worker loads it
    from (a directory, or a hub name). Kept in the job, so a worker needs no lookup to run it, and
    a continuation runs with what the job started with."""

    name: str
    source: str


FaultMarker = Literal["kill-engine"]
"""What a fault test may ask of a worker (:attr:`GenerationRequest.test_fault`)."""


class Slo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's service-level objectives (llm-d's ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` headers,
    ``slo`` in /v1/jobs, or its tenant's defaults): docs/guarantees.md#slos."""

    ttft_ms: Annotated[int, Meta(gt=0, le=86_400_000)] | None = None
    """Milliseconds from enqueue to its first token. Admission refuses a request predicted to miss
    it (``slo_unattainable``), its tenant's waiting jobs are ordered by it (earliest first-token
    deadline first), and a job not started by then is never started."""
    tpot_ms: Annotated[int, Meta(gt=0, le=86_400_000)] | None = None
    """Milliseconds per output token after the first: recorded and reported, never enforced."""


PoolingTask = Literal["embed", "score"]


class Pooling(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A pooling job: one output per input, computed whole (nothing streams), by a worker whose model
    pools (``LLMQ_MODEL`` of kind ``embed`` or ``rerank``: Settings.model_kind)."""

    task: PoolingTask
    """``embed``: a vector per input; ``score``: a cross-encoder's relevance per (query, input) pair."""
    texts: list[str] = []
    """The inputs as text (embed), or the documents scored against :attr:`queries` (score)."""
    token_ids: list[list[TokenId]] = []
    """The inputs as token ids (embed only), when not :attr:`texts`."""
    queries: list[str] = []
    """score: one query for every document, or one per document."""
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    """embed: the vector's first ``dimensions`` components, normalised again (a Matryoshka model's)."""
    activation: bool = True
    """embed: normalised to unit length; score: through the model's sigmoid (TEI's ``normalize``,
    ``raw_scores``)."""
    truncate: bool = False
    """An input longer than the model takes is cut to its end, not refused (TEI's ``truncate``)."""
    encoding: Literal["float", "base64"] = "float"
    """How its dialect renders the vectors (OpenAI's ``encoding_format``)."""
    top_n: Annotated[int, Meta(ge=0)] = 0
    """How its dialect renders a ranking: the best ``top_n`` documents only (0: all of them)."""
    return_text: bool = True
    """How its dialect renders a ranking: each document's text with its score."""

    @property
    def size(self) -> int:
        """How many outputs the job makes."""
        return len(self.texts) or len(self.token_ids)

    def __post_init__(self) -> None:
        if bool(self.texts) == bool(self.token_ids):
            raise ValueError("a pooling job takes its inputs as `texts` or `token_ids`, one of them")
        if self.task == "score" and (self.token_ids or len(self.queries) not in (1, len(self.texts))):
            raise ValueError("a score job takes texts, and one query or one per text")


class Pooled(msgspec.Struct, frozen=True, kw_only=True):
    """A pooling job's outputs: one row of ``width`` float32 values per input, in input order,
    little-endian (a JSON event carries them as base64: the bytes the engine made, none rounded)."""

    data: bytes
    width: int

    @property
    def count(self) -> int:
        """How many rows (inputs) it holds."""
        return len(self.data) // (4 * self.width) if self.width else 0

    def row(self, i: int) -> bytes:
        """Row ``i``'s float32 bytes, as stored."""
        return self.data[i * 4 * self.width:(i + 1) * 4 * self.width]

    def rows(self) -> list[list[float]]:
        values = array.array("f", self.data)
        if sys.byteorder != "little":
            values.byteswap()
        return [values[i:i + self.width].tolist() for i in range(0, len(values), self.width)]


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One generation job, whatever wire dialect it arrived in."""

    model: str = ""
    """The base model: its queue holds the job (an adapter's name is resolved to its base at admission)."""
    adapter: AdapterSpec | None = None
    """The LoRA adapter the request named as its model, resolved at admission."""
    cache_key: str | None = None
    """The client's key for what its requests share (OpenAI's ``prompt_cache_key``, or the
    ``X-LLMQ-Affinity`` header): its job's prefix key (shared/affinity.py)."""
    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    """A chat: the worker renders it with the model's chat template."""
    pooling: Pooling | None = None
    """A pooling job (embeddings, scores) in place of a prompt: its inputs and what to make of them."""
    chat: ChatOptions = msgspec.field(default_factory=ChatOptions)
    tools: ToolUse | None = None
    """A chat's tools; the worker renders them with the chat template and parses the output into
    content, reasoning and tool calls (workers/parsing.py)."""
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    output: OutputOptions = msgspec.field(default_factory=OutputOptions)
    dialect: DialectName = "jobs"
    """Which dialect renders the result (and, for a stored job, ``GET /v1/jobs/{id}``'s result)."""
    priority: Int64 | None = None
    """Lower runs earlier (vLLM's convention). Queued on the level stream ``clamp(priority, 0, 2)``;
    the engine gets the value itself (its priority scheduler orders and preempts by it). None: the
    ``X-LLMQ-Priority`` header, or 0; the API resolves it before queueing, so a queued request
    always has a number (an explicit 0 is a choice, not "unset")."""
    timeout_s: Annotated[float, Meta(gt=0.0)] | None = None
    """Seconds from enqueue until the job must have finished; None: the header or the default
    (``LLMQ_DEADLINE_S``). The API turns it into the record's absolute ``deadline``."""
    slo: Slo | None = None
    """Its SLOs; None: the ``x-slo-*`` headers, or its tenant's defaults, or none. Resolved by the
    API before queueing."""
    webhook: Annotated[str, Meta(pattern=r"^https?://[^\s/?#]+[^\s]*$", max_length=2048)] | None = None
    """An http(s) URL POSTed the finished job (signed; see shared/webhooks.py). /v1/jobs only."""
    test_fault: FaultMarker | None = None
    """llmq's own fault tests only (``X-LLMQ-Test-Fault``, honoured while LLMQ_TEST_FAULTS is on in
    the API and the worker): ``kill-engine`` makes its worker kill its engine at each of the job's
    starts. Set at admission from the header alone, whatever a body says."""

    @property
    def images(self) -> list[Image]:
        """Every image of its chat, in order."""
        return [p for m in self.messages or () for p in m.parts if isinstance(p, Image)]

    @property
    def served_name(self) -> str:
        """The name the client asked for, as answers echo it: the adapter's, else the model's."""
        return self.adapter.name if self.adapter is not None else self.model

    @property
    def kind(self) -> ModelKind:
        """The kind of model that makes this job: a generator, an embedder or a cross-encoder."""
        if self.pooling is None:
            return "generate"
        return "embed" if self.pooling.task == "embed" else "rerank"

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages, self.pooling))
        if given != 1:
            raise ValueError("exactly one of `prompt`, `prompt_token_ids`, `messages` or `pooling` is required")


class TopLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One alternative token: compact on the wire as ``[id, text, logprob]``."""

    id: int
    text: str
    logprob: float


class Choice(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One generated sequence, accumulated from token events."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = []
    token_texts: list[str] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: str | None = None
    """vLLM's vocabulary: ``stop``, ``length``, ``abort``; dialects translate."""
    stop_reason: str | int | None = None
    """The stop string or token id that matched; None when EOS ended the sequence."""
    reasoning: str | None = None
    """With a reasoning parser: the reasoning, apart from ``text`` (the content)."""
    tool_calls: list[ToolCall] | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | msgspec.UnsetType = msgspec.UNSET
    """Prompt tokens the engine found in its prefix cache (vLLM's ``num_cached_tokens``), when
    any: what affinity saves (docs/adapters.md#affinity)."""


class JobResult(msgspec.Struct, kw_only=True):
    choices: list[Choice] = []
    usage: Usage = msgspec.field(default_factory=Usage)
    prompt: PromptInfo | None = None
    """Present when the request asked for ``output.prompt_tokens``."""
    pooled: Pooled | None = None
    """A pooling job's outputs (its choices are empty)."""


class JobError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    status: int = 500

    @classmethod
    def of(cls, exc: ServiceError) -> JobError:
        return cls(code=exc.code, message=exc.message, status=exc.status)

    def exception(self) -> ServiceError:
        """The typed error the job ended with."""
        return error_from_code(self.code, self.message, self.status)


class Run(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt at a job: the worker that claimed it, and when (epoch ms)."""

    attempt: int
    worker: str
    started_at: float


class JobRecord(msgspec.Struct, kw_only=True):
    """The job hash ``llmq:{model}:job:<id>``, decoded. Timestamps are epoch milliseconds."""

    id: str
    model: str
    status: JobStatus = "queued"
    request: GenerationRequest
    queued_at: float = 0.0
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    worker: str = ""
    attempt: int = 0
    cancel: bool = False
    result: JobResult | None = None
    error: JobError | None = None
    owner: str = ""
    """With API keys on: a hash of the key that queued the job (only that key may read or cancel it)."""
    tenant: str = ""
    """Whose fair share, quotas and usage the job counts toward (shared/tenants.py)."""
    adapter: str | None = None
    """Its request's LoRA adapter's name, as a field of its own: the script ending the job meters
    the tenant's usage of it too (shared/lua/tenants.lua), and the pick prefers a worker that
    holds it (read.lua)."""
    affinity: str | None = None
    """Its prefix key (shared/affinity.py): the pick leaves it a moment for the worker that served
    the last job of the same key (read.lua)."""
    estimate: int = 0
    """The tokens its tenant is charged when it is picked (prompt estimate + what it may generate),
    corrected to the real count when it ends."""
    deadline: float | None = None
    """Epoch ms by which the job must be finished: past it a queued job never starts and a running
    one is aborted, both ending with ``deadline_exceeded``."""
    first_token_deadline: float | None = None
    """Epoch ms by which its first token is due (its request's ``slo.ttft_ms`` after queueing):
    the pick orders its tenant's waiting jobs by it, and a job not started by then ends with
    ``deadline_exceeded`` unstarted. A job that has sent a token is never ended by it."""
    preemptions: int = 0
    """How often the job gave its engine slot to a job owed it, and waited again
    (docs/tenants.md#preemption)."""
    preempted_ms: int = 0
    """The time it spent waiting again after its preemptions."""
    webhook: str | None = None
    """The request's webhook URL, as a field of its own so the script ending the job sees it."""
    webhook_status: Literal["delivered", "failed"] | None = None
    """Set by the delivery: ``failed`` once every attempt was refused or given up."""
    webhook_attempts: int = 0
    traceparent: str | None = None
    """With tracing on: the W3C ``traceparent`` of the API's span of the request that queued the
    job, the parent of the worker's spans (shared/tracing.py). None (no field) with tracing off."""
    runs: str = ""
    """Each attempt as ``<attempt>@<worker>@<epoch ms>``, space-separated, oldest first (claim.lua):
    who ran the job; a takeover or a preemption is one more. Dropped at its end when there was one
    only (``worker`` and ``started_at`` say the same): read it with :meth:`attempts`."""
    tokens: str = ""
    """Once it ended: ``<prompt> <generated>`` tokens, as metered ("": not known, or not ended);
    read them with :meth:`token_counts`."""

    def attempts(self) -> list[Run]:
        """Each attempt's worker and start, oldest first."""
        return runs_of(self.runs, self.attempt, self.worker, self.started_at)

    def tenant_of(self) -> str:
        """Its tenant, also once it ended: the end drops the field when it says what the owner
        does (a key's tenant is its hash, and with no key ``default``; tenants.lua)."""
        return self.tenant or self.owner or DEFAULT_TENANT

    def token_counts(self) -> tuple[int | None, int | None]:
        """(prompt, generated) tokens of an ended job, or (None, None)."""
        return token_counts_of(self.tokens)

    @classmethod
    def new(cls, req: GenerationRequest, *, owner: str, tenant: str, queued_at: float, deadline: float | None,
            estimate: int, affinity: str | None, traceparent: str | None = None,
            first_token_deadline: float | None = None) -> JobRecord:
        """The record of a job about to be queued: a fresh id tagged with its model, and the request's
        fields the scripts read (webhook, adapter) copied out. What admission decided (deadline,
        estimate, affinity) is given: :func:`shared.admission.new_job` is how a job is made."""
        return cls(id=new_job_id(req.model), model=req.model, request=req, queued_at=queued_at, owner=owner,
                   deadline=deadline, webhook=req.webhook, tenant=tenant, estimate=estimate, traceparent=traceparent,
                   adapter=req.adapter.name if req.adapter is not None else None, affinity=affinity,
                   first_token_deadline=first_token_deadline)


def runs_of(runs: str, attempt: int, worker: str, started_at: float | None) -> list[Run]:
    """A record's attempts from its fields (the record's own, or a few read with HMGET): its
    ``runs``, or, with none (one attempt: its end dropped the field), its worker and start."""
    if not runs:
        if attempt and worker and started_at is not None:
            return [Run(attempt=attempt, worker=worker, started_at=started_at)]
        return []
    return [parse_run(run) for run in runs.split()]


def token_counts_of(tokens: str) -> tuple[int | None, int | None]:
    """A record's ``tokens`` field, ``<prompt> <generated>``: the counts, or (None, None)."""
    prompt, _, generated = tokens.partition(" ")
    return (int(prompt), int(generated)) if generated else (None, None)


def parse_run(run: str) -> Run:
    """One entry of a record's ``runs``: ``<attempt>@<worker>@<epoch ms>`` (a worker id may hold
    anything but a space)."""
    attempt, _, rest = run.partition("@")
    worker, _, started = rest.rpartition("@")
    return Run(attempt=int(attempt), worker=worker, started_at=float(started))


def estimate_prompt_tokens(req: GenerationRequest) -> int:
    """Its prompt's tokens, before it is rendered: exact for token ids, else about 4 bytes of text
    per token, plus each image's estimate (:attr:`Image.tokens`); a pooling job's inputs (a score's
    queries once per document)."""
    if (pooling := req.pooling) is not None:
        if pooling.token_ids:
            return sum(len(ids) for ids in pooling.token_ids)
        queries = sum(map(len, map(str.encode, pooling.queries))) * (pooling.size if len(pooling.queries) == 1 else 1)
        return (sum(len(t.encode()) for t in pooling.texts) + queries) // 4 + pooling.size
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    size = len(req.prompt.encode()) if req.prompt is not None else sum(
        len(m.content.encode()) + sum(len(p.text.encode()) for p in m.parts if isinstance(p, Text))
        + sum(len(c.arguments) for c in m.tool_calls) for m in req.messages or ())
    if req.tools is not None:  # the template renders each tool's schema into the prompt
        size += len(msgspec.json.encode(req.tools.tools))
    return size // 4 + 1 + sum(image.tokens for image in req.images)


def estimate_tokens(req: GenerationRequest, max_model_len: int | None = None) -> int:
    """What a job will use, before it runs: its prompt (about 4 bytes of text per token) and
    every token it may generate: with ``max_model_len``, only what the context leaves after that
    prompt (the worker clamps ``max_tokens`` so, shared/budget.py). The fair share charges this
    when the job starts and corrects it to the real count when it ends."""
    prompt = estimate_prompt_tokens(req)
    if req.pooling is not None:
        return prompt  # nothing generated
    sampling = req.sampling
    generated = sampling.max_tokens if max_model_len is None else generation_budget(sampling.max_tokens, prompt,
                                                                                     max_model_len)
    return prompt + generated * max(sampling.n, sampling.beam_width)


# What each kind of model does, and does not: (it ..., it does not ...).
_KIND_DOES = {"generate": ("generates text", "generate text"), "embed": ("makes embeddings", "make embeddings"),
              "rerank": ("scores (query, document) pairs", "score (query, document) pairs")}


def wrong_kind(kind: ModelKind) -> ServiceError:
    """The 400 of a job its model does not make (an embedding of a generator, a completion of an
    embedder), named by what the model does."""
    others = " or ".join(not_ for k, (_, not_) in _KIND_DOES.items() if k != kind)
    return InvalidRequest(f"this model {_KIND_DOES[kind][0]}: it does not {others}", param="model")


GROUP_PREFIX = "grp-"
"""How a group's id begins (a job's id is 32 hex digits), so a route knows which record to read."""


class JobGroup(msgspec.Struct, kw_only=True):
    """One request's several jobs, queued as one fire-and-poll job: a list of prompts (OpenAI) or
    LMI's dynamic batch with ``Prefer: respond-async``. Each job is an ordinary job; the group only
    lets a client poll and cancel them as one, with the result in the request's own shape. Its id is
    ``grp-`` + its first job's id, so a repeated Idempotency-Key (which finds the same jobs) finds
    the same group."""

    id: str
    model: str
    jobs: list[str]
    queued_at: float
    owner: str = ""
    """As on a job record: the API key hash that queued it (only that key may read or cancel it)."""


class SloReport(msgspec.Struct, kw_only=True):
    """A job's SLOs beside what it achieved (:attr:`JobView.slo`), in milliseconds. A measure or
    verdict is None while it is not known."""

    objective: Slo
    """What its request asked for (the body's ``slo``, else the ``x-slo-*`` headers, else its
    tenant's defaults)."""
    ttft_ms: float | None
    """From enqueue to its first token: the time its client waited, queueing included."""
    tpot_ms: float | None
    """Once it ended: from its first token to its end, per token after the first (a preempted
    job's wait counts: its client saw that pause; with ``n`` > 1 the tokens are every choice's).
    None with fewer than two tokens."""
    ttft_met: bool | None
    """Its first token came within ``objective.ttft_ms``; False too once it ended without one."""
    tpot_met: bool | None
    """Its ``tpot_ms`` was within ``objective.tpot_ms``: recorded and reported, never enforced."""

    @classmethod
    def of(cls, record: JobRecord) -> SloReport | None:
        """The record's report; None when its request had no SLO."""
        objective = record.request.slo
        if objective is None:
            return None
        ttft = tpot = None
        if record.first_token_at is not None:
            ttft = round(record.first_token_at - record.queued_at, 3)
            _, generated = record.token_counts()
            if generated is None and record.result is not None:
                # Read from its ending before its record's end wrote the counts (JobStore._ended).
                generated = record.result.usage.completion_tokens
            if record.finished_at is not None and generated is not None and generated > 1:
                tpot = round((record.finished_at - record.first_token_at) / (generated - 1), 3)
        ttft_met = None
        if objective.ttft_ms is not None and ttft is not None:
            ttft_met = ttft <= objective.ttft_ms
        elif objective.ttft_ms is not None and record.status in TERMINAL_STATUSES:
            ttft_met = False  # ended without a token: it never met it
        tpot_met = tpot <= objective.tpot_ms if objective.tpot_ms is not None and tpot is not None else None
        return cls(objective=objective, ttft_ms=ttft, tpot_ms=tpot, ttft_met=ttft_met, tpot_met=tpot_met)


class JobView(msgspec.Struct, kw_only=True):
    """A job as ``GET /v1/jobs/{id}`` shows it, and as its webhook delivers it."""

    id: str
    object: str = "job"
    model: str
    status: JobStatus
    dialect: str
    attempt: int
    worker: str | None
    queued_at: float
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None
    deadline: float | None
    result: Any
    """The result in the submitting dialect's shape (a JobResult for /v1/jobs)."""
    error: JobError | None
    queue_position: int | None = None
    """While the job waits: how many jobs of its model are estimated to start before it (null otherwise)."""
    eta_s: float | None = None
    """While the job waits: seconds until it is estimated to start (null otherwise, or while no
    warm worker has measured its speed)."""

    slo: SloReport | msgspec.UnsetType = msgspec.UNSET
    """Its SLOs and how it did against them; absent when its request had none."""

    @classmethod
    def of(cls, record: JobRecord, result: Any, standing: Standing | None = None) -> JobView:
        slo = SloReport.of(record)
        return cls(id=record.id, model=record.model, status=record.status, dialect=record.request.dialect,
                   attempt=record.attempt, worker=record.worker or None, queued_at=record.queued_at,
                   started_at=record.started_at, first_token_at=record.first_token_at,
                   finished_at=record.finished_at, deadline=record.deadline, result=result, error=record.error,
                   slo=msgspec.UNSET if slo is None else slo,
                   queue_position=standing.position if standing is not None else None,
                   eta_s=standing.eta_s if standing is not None else None)
