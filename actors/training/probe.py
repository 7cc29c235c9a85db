"""Measuring the user's own cluster for `plan --probe` and `sync.policy: auto` (orchestrator/planner.py):
probe actors placed as the job's workers would be, on the Ray cluster the job runs on.

- **Where:** `count` probes with the job's `workers.cpus`, `workers.gpus` and placement: the nodes
  they land on are the nodes the job's ranks would land on (`node_of_rank`).
- **Compute:** every probe builds the workload (its factory) and times forward, backward and the
  optimizer's step on one worker's batch, on its device with the job's thread count, all probes at
  once (as the workers would run): each rank's median, the spread of its steps, and the backward
  pass's part (BSP's buckets overlap it).
- **Links:** for each pair of nodes, one probe on each forms a two-rank group over the job's own
  transport (`actors/transport/comm.py`: gloo, or NCCL for GPU jobs) and times all-reduces of a small and a
  large tensor. A two-rank ring all-reduce of P bytes sends P/2 each way twice: t(P) = P/B + 2L, so
  B = (P_large - P_small) / (t_large - t_small) and L from the small one. Two probes on one node
  measure that node's own rate the same way. The large size grows until one all-reduce takes 0.2 s
  (at most 64 MiB), so a slow link is measured over a long enough transfer.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any

import ray

from actors import REMOTE_HOME

SMALL = 4096
LARGE_MIN, LARGE_MAX = 1 << 20, 64 << 20
LONG_ENOUGH_S = 0.2
ROUNDS = 5


@ray.remote(num_cpus=0)
class Probe:
    __module__ = REMOTE_HOME  # orchestrator/remote.py: Ray imports it from there

    def __init__(self, config: dict) -> None:
        import torch

        from core.schema import JobConfig, parse

        self.cfg = parse(JobConfig, config)
        torch.set_num_threads(max(1, int(self.cfg.workers.cpus)))
        self.gpu = self.cfg.workers.gpus > 0 and torch.cuda.is_available()
        self.ip = ray.util.get_node_ip_address()
        self._store: Any = None

    def where(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), self.ip

    def compute(self) -> dict:
        """Each step's seconds (and its backward pass's) on this probe: `actors.training.workload.time_steps`."""
        import torch

        from actors.training.workload import time_steps

        device = torch.device("cuda", 0) if self.gpu else torch.device("cpu")
        return {**time_steps(self.cfg, device), "device": str(device), "threads": torch.get_num_threads()}

    def serve(self) -> tuple[str, int]:
        from actors.transport.store import serve_store

        self._store = serve_store(self.ip, 60.0)
        return self.ip, self._store[1]

    def link(self, host: str, port: int, name: str, rank: int) -> list[tuple[int, float]]:
        """All-reduce times (bytes, median seconds) with the probe of the other rank: a small tensor, then
        larger ones until one takes LONG_ENOUGH_S."""
        import torch

        from actors.transport.comm import GroupSpec, make_communicator

        backend = "nccl" if self.gpu else "gloo"
        comm = make_communicator(GroupSpec(host, port, name, rank, 2, 60.0, backend, self.ip))
        device = torch.device("cuda", 0) if self.gpu else torch.device("cpu")
        out = []
        try:
            size = SMALL
            while True:
                tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
                comm.all_reduce(tensor).wait()  # warm the connection at this size
                times = []
                for _ in range(ROUNDS):
                    began = time.perf_counter()
                    comm.all_reduce(tensor).wait()
                    times.append(time.perf_counter() - began)
                out.append((size, statistics.median(times)))
                # both ranks take the same decision: rank 0's time decides (broadcast of a flag)
                flag = torch.tensor([1.0 if size >= LARGE_MAX or (size >= LARGE_MIN and out[-1][1] >= LONG_ENOUGH_S)
                                     else 0.0], device=device)
                comm.broadcast(flag, 0).wait()
                if flag.item() > 0:
                    return out
                size = LARGE_MIN if size < LARGE_MIN else size * 4
        finally:
            comm.close()


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(bytes/s, one-way latency s) from a two-rank all-reduce's (bytes, seconds): t(P) = P/B + 2L."""
    (small, t_small), (large, t_large) = points[0], points[-1]
    rate = (large - small) / max(t_large - t_small, 1e-9)
    return rate, max(t_small - small / rate, 0.0) / 2


def probe_cluster(config: dict, timeout: float = 300.0) -> dict:
    """Place `workers.count` probes as the job's workers would be, measure compute on each and every
    node pair's link; returns {"nodes": [ip, ...], "node_of_rank": [...], "compute": [per-rank step times],
    "model_bytes", "device", "threads", "links": [{"a", "b", "bytes_per_s", "latency_s", "points"}]}."""
    from core.schema import JobConfig, parse

    cfg = parse(JobConfig, config)
    w = cfg.workers
    options: dict = {"num_cpus": w.cpus, "num_gpus": w.gpus,
                     "scheduling_strategy": "SPREAD" if w.placement == "spread" else "DEFAULT"}
    # mypy keeps a decorated class's own type (python/mypy#3135): @ray.remote made it an ActorClass
    probes = [Probe.options(**options).remote(config) for _ in range(w.count)]  # type: ignore[attr-defined]
    try:
        placed = ray.get([p.where.remote() for p in probes], timeout=timeout)
        nodes = list(dict.fromkeys(ip for _, ip in placed))
        node_of_rank = [nodes.index(ip) for _, ip in placed]
        measured = ray.get([p.compute.remote() for p in probes], timeout=timeout)
        first_on: dict[int, list[int]] = {}
        for rank, node in enumerate(node_of_rank):
            first_on.setdefault(node, []).append(rank)
        links = []
        pairs = [(a, b) for a in range(len(nodes)) for b in range(a + 1, len(nodes))]
        pairs += [(a, a) for a, ranks in first_on.items() if len(ranks) > 1]  # a node's own rate
        for a, b in pairs:
            ra = first_on[a][0]
            rb = first_on[b][1] if a == b else first_on[b][0]
            host, port = ray.get(probes[ra].serve.remote(), timeout=timeout)
            name = f"probe-{os.getpid()}-{a}-{b}-{time.monotonic_ns()}"
            points_a, _ = ray.get([probes[ra].link.remote(host, port, name, 0), probes[rb].link.remote(host, port, name, 1)],
                                  timeout=timeout)
            rate, latency = fit(points_a)
            links.append({"a": a, "b": b, "bytes_per_s": rate, "latency_s": latency, "points": points_a})
        return {"nodes": nodes, "node_of_rank": node_of_rank, "compute": [m["times"] for m in measured],
                "backward": [m["backward"] for m in measured],
                "model_bytes": measured[0]["model_bytes"], "device": measured[0]["device"],
                "threads": measured[0]["threads"], "links": links}
    finally:
        for p in probes:
            ray.kill(p)
