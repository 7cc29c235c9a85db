"""The parameter server's transfer cost next to Ray's object store, and its apply time, separately.

4 clients (Ray actors, one CPU each) against the server actor of actors/server/server_actor.py holding a
synthetic MLP of about 10M parameters (`orchestrator.workloads.synthetic:mlp`, width 2200, depth 3:
40 MiB as flat float32), policy asp. Each client repeats pull + push (a zero gradient: the work is the
bytes) and times the round trip; alternating with it (so the machine's noise falls on both alike),
against an echo actor that takes the same array and returns another of the same size (what a push +
pull moves, without the server's lock, lease table or optimizer step; threaded like the server, so the
four clients' calls overlap there too), the same clients time the raw round trip. The ratio is raw time / server time (1.0:
the server moves bytes as fast as the object store does). A push waits for its update, so the server's
round trip includes one apply; the apply time (one ASP push: lease lookup, scale, SGD-with-momentum
step over 10M parameters) is timed in process on `ServerCore` and reported on its own, and the ratio is
given both with and without it.

    python benchmarks/server.py [--rounds 20]

Prints a table, then one JSON line. Figures are measurements, not gates; on a 2-core machine 4
clients and the server share two cores, so the absolute times there say little.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from actors.plan import server_name  # noqa: E402
from actors.server.server_actor import ParameterServerActor  # noqa: E402
from actors.server.server_client import RayServerClient  # noqa: E402
from algorithms.policies.server import ServerCore  # noqa: E402
from algorithms.policies.server_messages import Fence, Push  # noqa: E402
from core.schema import JobConfig, parse  # noqa: E402
from orchestrator.workloads.synthetic import mlp  # noqa: E402

CLIENTS, WIDTH, DEPTH, NAME = 4, 2200, 3, "server-bench"
PARAMS = {"width": WIDTH, "depth": DEPTH, "samples": 4096}


def config() -> dict:
    return parse(JobConfig, {
        "name": NAME, "workers": {"count": CLIENTS}, "sync": {"policy": "asp"}, "eval_every": 0,
        "workload": {"factory": "orchestrator.workloads.synthetic:mlp", "params": PARAMS, "batch_size": 8},
        "optimizer": {"lr": 0.01, "momentum": 0.9}, "server": {"snapshot_every": 10**9}, "stop": {"max_steps": 10**9},
    }).to_dict()


@ray.remote(num_cpus=0)
class Sink:
    """Stands in for the coordinator: takes the server's reports."""

    def server_report(self, records, summary) -> None:
        pass

    def server_restarted(self, *args) -> None:
        pass


@ray.remote(num_cpus=0, max_concurrency=CLIENTS)
class Echo:
    """A push + pull without a server: takes an array, returns one of the same size."""

    def __init__(self, numel: int) -> None:
        self.out = np.zeros(numel, dtype=np.float32)

    def roundtrip(self, grad: np.ndarray) -> np.ndarray:
        return self.out


@ray.remote(num_cpus=1)
class Client:
    def __init__(self, slot: str) -> None:
        self.slot = slot
        self.client = RayServerClient(server_name(NAME, "bench"), "orchestrator")

    def rounds(self, echo, numel: int, rounds: int) -> tuple[list[float], list[float]]:
        """Server and raw round trips, alternating (so the machine's noise falls on both alike)."""
        grad = torch.zeros(numel)  # made once, for both
        served, raw = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            pull, flat = self.client.pull(Fence(1, self.slot, 0, 0), 5.0)
            assert pull.status == "ok", pull
            self.client.push(Push(Fence(1, self.slot, 0, 0), pull.ticket.lease_ids, pull.version, grad))
            served.append(time.perf_counter() - started)
            started = time.perf_counter()
            ray.get(echo.roundtrip.remote(grad.numpy()))  # a read-only view, as RayServerClient's pull keeps it
            raw.append(time.perf_counter() - started)
        return served, raw


def apply_time(rounds: int) -> float:
    """Median seconds of one ASP push applied by `ServerCore`, in process."""
    cfg = parse(JobConfig, config())
    torch.manual_seed(0)
    workload = mlp(**PARAMS)
    core = ServerCore(list(workload.model.parameters()), cfg.optimizer, cfg.sync, n_samples=4096, seed=0,
                      global_batch=8 * CLIENTS)
    core.set_members(1, [(f"w{i}", 0) for i in range(CLIENTS)])
    numel = core.parameters().numel()
    times = []
    for _ in range(rounds):
        pull = core.pull(Fence(1, "w0", 0, 0))
        push = Push(Fence(1, "w0", 0, 0), pull.ticket.lease_ids, pull.version, torch.zeros(numel))
        started = time.perf_counter()
        core.push(push)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=CLIENTS + 2, namespace="orchestrator", log_to_driver=False, include_dashboard=False,
             logging_level="ERROR")
    Sink.options(name=NAME, namespace="orchestrator").remote()
    run_dir = tempfile.mkdtemp(prefix="server-bench-")
    server = ParameterServerActor.options(name=server_name(NAME, "bench"), namespace="orchestrator", num_cpus=1).remote(
        config(), run_dir, NAME, "orchestrator")
    info = ray.get(server.ready.remote())
    ray.get(server.set_members.remote(1, [(f"w{i}", 0) for i in range(CLIENTS)]))
    numel = sum(p.numel() for p in mlp(**PARAMS).model.parameters())
    echo = Echo.remote(numel)
    clients = [Client.remote(f"w{i}") for i in range(CLIENTS)]
    ray.get([c.rounds.remote(echo, numel, 2) for c in clients])  # warm-up
    results = ray.get([c.rounds.remote(echo, numel, args.rounds) for c in clients])
    served = [t for ts, _ in results for t in ts]
    raw = [t for _, ts in results for t in ts]
    apply_s = apply_time(args.rounds)
    mib = numel * 4 / 2**20
    row = {"params": numel, "mib_each_way": round(mib, 1), "clients": CLIENTS, "rounds": args.rounds,
           "server_roundtrip_s": statistics.median(served), "raw_roundtrip_s": statistics.median(raw),
           "apply_s": apply_s, "server_pid": info["pid"]}
    row["ratio_raw_over_server"] = row["raw_roundtrip_s"] / row["server_roundtrip_s"]
    row["ratio_raw_over_server_less_apply"] = row["raw_roundtrip_s"] / max(row["server_roundtrip_s"] - apply_s, 1e-9)
    print(f"{numel / 1e6:.1f}M parameters ({mib:.0f} MiB each way), {CLIENTS} clients, {args.rounds} rounds each")
    print(f"{'':<34}{'median s':>10}")
    print(f"{'server push + pull':<34}{row['server_roundtrip_s']:>10.4f}")
    print(f"{'raw object store, same bytes':<34}{row['raw_roundtrip_s']:>10.4f}")
    print(f"{'server apply (one ASP push)':<34}{apply_s:>10.4f}")
    print(f"raw / server: {row['ratio_raw_over_server']:.2f}; raw / (server - apply): "
          f"{row['ratio_raw_over_server_less_apply']:.2f}")
    print(json.dumps(row))
    ray.shutdown()


if __name__ == "__main__":
    main()
