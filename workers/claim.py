"""Device claims: which GPUs, or which share of the CPUs, this worker process's engine may use.

``honcho start -c worker=N`` starts N identical processes that know nothing of each other, so each
claims its device by itself through a host-local lock: one file per device in
``Settings.device_lock_dir``, held with a non-blocking exclusive ``flock`` for the life of the
process. The kernel drops a flock when the last descriptor on it closes, so a worker that dies in
any way (SIGKILL and the OOM killer included) frees its device with no cleanup; a stale file is
harmless. The files hold the holder's pid, for an operator's ``cat``.

An engine of several ranks (tensor × pipeline, docs/operations.md#sizing) claims one device per
rank on this host, all at once: its claim holds the host's claim lock while it takes them, so two
workers that each need two GPUs never each end up holding one.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from shared.config import DEFAULT_MODEL, TINY_POOLING_DIRS, VISION_MODEL, Settings
from workers.environment import apply_device_environment, apply_engine_environment, cpu_engine, visible_gpus

__all__ = ["Claim", "NoFreeDevice", "prepare_host", "claim_device", "claim_gpus", "claim_cpu_share", "split_cpus",
           "gpu_count"]

log = structlog.get_logger()


class NoFreeDevice(RuntimeError):
    """Every GPU this worker may use is claimed by another process on this host."""


@dataclass
class Claim:
    label: str
    """What the heartbeat reports as ``device``: ``gpu:0``, ``gpu:2,3``, ``cpu:1 cpus=0-1``."""
    fds: list[int] = field(default_factory=list)
    cuda_visible_devices: str | None = None
    cpus: list[int] | None = None
    """The CPU share to pin this process to; None: every CPU it may use now (no pinning)."""
    omp_bind: str | None = None
    """A CPU engine of several ranks: each rank's CPUs, ``|``-separated (vLLM's VLLM_CPU_OMP_THREADS_BIND)."""
    devices: list[str] = field(default_factory=list)
    """What the heartbeat reports as ``devices``: one entry per local rank (``gpu:0``, ``cpu:0-3``)."""

    def apply(self, env: MutableMapping[str, str]) -> None:
        """Before vLLM (and torch) are imported: CUDA reads CUDA_VISIBLE_DEVICES once, when it
        initialises, and OpenMP threads inherit the affinity of the process that starts them."""
        apply_device_environment(self.cuda_visible_devices, self.omp_bind, env)
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def _lock(lock_dir: Path, name: str) -> int | None:
    """The open descriptor holding ``name``'s lock, or None if another process holds it."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    # A forked child (vLLM's engine core) shares the lock, so the device stays claimed until the
    # engine is gone too; close-on-exec (os.open's default) keeps exec'd programs out of it.
    fd = os.open(lock_dir / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


@contextmanager
def _claiming(lock_dir: Path) -> Iterator[None]:
    """The host's claim lock, held while one process takes its devices: a claim of several is
    atomic against every other claim on this host (a lone device's is anyway)."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / "claim.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for milliseconds: waiting is right
        yield
    finally:
        os.close(fd)


def _holder(lock_dir: Path, name: str) -> str:
    try:
        return (lock_dir / f"{name}.lock").read_text().strip() or "?"
    except OSError:
        return "?"


def gpu_count() -> int:
    """NVIDIA GPUs on this host, counted without initialising CUDA in this process: once CUDA
    is initialised (``torch.cuda.device_count()`` may do it; importing torch also costs seconds)
    a later CUDA_VISIBLE_DEVICES is ignored and the engine would see every GPU."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))  # one directory per GPU (PCI bus id)
    except OSError:
        pass
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def claim_gpus(lock_dir: Path, pool: list[str], count: int = 1) -> Claim:
    """The first ``count`` free GPUs of ``pool`` (CUDA ids as CUDA_VISIBLE_DEVICES names them), all
    or none."""
    held: list[tuple[str, int]] = []
    with _claiming(lock_dir):
        for gpu in pool:
            fd = _lock(lock_dir, f"gpu-{gpu}")
            if fd is not None:
                held.append((gpu, fd))
                if len(held) == count:
                    return _gpu_claim([g for g, _ in held], [fd for _, fd in held])
        for _, fd in held:
            os.close(fd)
    holders = ", ".join(f"{g} (pid {_holder(lock_dir, f'gpu-{g}')})" for g in pool) or "none visible"
    raise NoFreeDevice(f"no {count} free GPU(s) among {holders}; locks in {lock_dir}: stop a worker, "
                       "or set LLMQ_DEVICES to share a GPU on purpose")


def _gpu_claim(gpus: list[str], fds: list[int]) -> Claim:
    ids = ",".join(gpus)
    return Claim(f"gpu:{ids}", fds, cuda_visible_devices=ids, devices=[f"gpu:{g}" for g in gpus])


def pin_gpus(lock_dir: Path, devices: list[str]) -> Claim:
    """LLMQ_DEVICES: exactly these GPUs, the operator's choice. Locked where free so that
    claiming workers avoid them; already held means shared on purpose, which is allowed."""
    fds = []
    with _claiming(lock_dir):
        for gpu in devices:
            fd = _lock(lock_dir, f"gpu-{gpu}")
            if fd is None:
                log.warning("device_shared", device=f"gpu:{gpu}", holder_pid=_holder(lock_dir, f"gpu-{gpu}"))
            else:
                fds.append(fd)
    return _gpu_claim(devices, fds)


def split_cpus(usable: list[int], shares: int) -> list[list[int]]:
    """``usable`` in ``shares`` contiguous parts (0: one per NUMA node, as vLLM's auto-binding)."""
    if shares <= 0:
        nodes = []
        for cpulist in sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist")):
            cpus = set(_parse_cpulist(cpulist.read_text()))
            nodes.append([c for c in usable if c in cpus])
        return [n for n in nodes if n] or [usable]
    shares = min(shares, len(usable))
    size, extra = divmod(len(usable), shares)
    starts = [i * size + min(i, extra) for i in range(shares + 1)]
    return [usable[a:b] for a, b in zip(starts, starts[1:], strict=False)]


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return cpus


def _cpulist(cpus: list[int]) -> str:
    contiguous = len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1))
    return f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))


def claim_cpu_share(lock_dir: Path, shares: list[list[int]], ranks: int = 1) -> Claim:
    """Slots: the first ``ranks`` free ones, never refused. Slot k runs on share k mod len(shares),
    so with more slots taken than shares some share CPUs (warned). One rank on one share means no
    pinning at all, which keeps a lone worker exactly as it ran before claims existed; several
    ranks are each bound to their share's CPUs by vLLM (VLLM_CPU_OMP_THREADS_BIND), since every
    rank's OpenMP threads otherwise spin on every CPU and each stalls the others' steps."""
    slots: list[int] = []
    fds: list[int] = []
    with _claiming(lock_dir):
        slot = 0
        while len(slots) < ranks:
            if (fd := _lock(lock_dir, f"cpu-{slot}")) is not None:
                slots.append(slot)
                fds.append(fd)
            slot += 1
    parts = [shares[k % len(shares)] for k in slots]
    bind = "|".join(_cpulist(p) for p in parts)  # one CPU list per rank, as VLLM_CPU_OMP_THREADS_BIND has them
    if slots[-1] >= len(shares):  # distinct slots below it are distinct shares
        log.warning("cpu_share_oversubscribed", slots=slots, shares=len(shares), cpus=bind)
    label = f"cpu:{','.join(map(str, slots))} cpus={bind}"
    devices = [f"cpu:{_cpulist(p)}" for p in parts]
    if ranks == 1:
        return Claim(label, fds, cpus=parts[0] if len(shares) > 1 else None, devices=devices)
    every = sorted({c for p in parts for c in p})
    return Claim(label, fds, cpus=every if len(every) < sum(map(len, shares)) else None, omp_bind=bind,
                 devices=devices)


def claim_device(settings: Settings, env: Mapping[str, str], *, on_cpu: bool) -> Claim:
    """This worker's claim, per the settings (``env``: the process environment, whose
    CUDA_VISIBLE_DEVICES is the pool); raises :class:`NoFreeDevice` when none is free."""
    lock_dir = Path(settings.device_lock_dir)
    if settings.executor_backend == "ray":
        # Ray places every rank on its cluster's GPUs, this host's included, and Ray's own
        # accounting keeps two engines off one GPU: a claim here would count ranks on other hosts.
        log.info("devices_left_to_ray", ranks=settings.world_size)
        return Claim("ray")
    ranks = settings.local_ranks
    if on_cpu:
        usable = sorted(os.sched_getaffinity(0))  # `taskset` by the operator narrows the pool
        shares = split_cpus(usable, settings.cpu_shares)
        if len(shares) < ranks:  # fewer shares than ranks: one part per rank, as vLLM's own binding
            shares = split_cpus(usable, ranks)
        return claim_cpu_share(lock_dir, shares, ranks)
    if settings.device_ids:  # as many as ranks: load_settings checks
        return pin_gpus(lock_dir, list(settings.device_ids))
    pool = visible_gpus(env)  # an operator's CUDA_VISIBLE_DEVICES is the pool to choose from
    if pool is None:
        pool = [str(i) for i in range(gpu_count())]
    if not pool:
        log.warning("no_gpu_to_claim", detail="leaving device selection to vLLM")
        return Claim("gpu:unclaimed")
    return claim_gpus(lock_dir, pool, count=ranks)


def prepare_host(settings: Settings, env: MutableMapping[str, str]) -> Claim:
    """What a process that runs engine ranks (a worker, a follower) does first, in this order: claim
    its devices (exit 1 with one ``no_free_device`` line when none is free), set them in ``env``
    (CUDA_VISIBLE_DEVICES and the CPU affinity must precede any torch import, the tiny model's build
    included), build a tiny model (tiny-llama, tiny-vision, tiny-embed, tiny-rerank) if it is the
    model, then set the engine's own variables (the OMP thread count follows the affinity)."""
    try:
        claim = claim_device(settings, env, on_cpu=cpu_engine())
    except NoFreeDevice as exc:
        log.error("no_free_device", detail=str(exc))
        raise SystemExit(1) from None
    claim.apply(env)
    log.info("device_claimed", device=claim.label, tensor=settings.tensor_parallel_size,
             pipeline=settings.pipeline_parallel_size, nodes=settings.nnodes, node_rank=settings.node_rank)
    if settings.model == DEFAULT_MODEL:
        from workers.tiny_model import ensure_tiny_model

        ensure_tiny_model(Path(settings.model_path))
    elif settings.model == VISION_MODEL:
        from workers.tiny_vision import ensure_tiny_vision

        ensure_tiny_vision(Path(settings.model_path))
    elif settings.model in TINY_POOLING_DIRS:
        from workers.tiny_pooling import ensure_tiny_pooling

        ensure_tiny_pooling(settings.model, Path(settings.model_path))
    apply_engine_environment(settings, env)
    return claim
