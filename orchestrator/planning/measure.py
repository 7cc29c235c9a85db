"""What `plan` and `auto` time on this machine: one step's compute on the workload (`measure_compute`),
and each synchronization pattern the candidates run, among the job's count of ranks in processes of their
own (`measure_host`): the host time that the lab's emulated nodes, which share this machine's cores, pay
however fast the links are. Torch and the transport are imported only when something is measured."""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from algorithms.rules.runtime_model import cpu_time, host_patterns
from core.schema import JobConfig, parse
from orchestrator.planning.candidates import Candidate, candidates, with_candidate

if TYPE_CHECKING:  # pragma: no cover
    from actors.transport.comm import GlooCommunicator

Step = Callable[[int], object]
"""One synchronization (or one policy step), as a function of the step number."""


_LAYOUTS: dict[str, list[tuple[int, str]]] = {}
"""Layouts already known in this process, by workload (`_workload_key`): `measure_compute` builds the model
anyway, and `parameter_layout` then need not build it again."""


def _workload_key(cfg: JobConfig) -> str:
    return json.dumps({"workload": cfg.to_dict()["workload"], "seed": cfg.seed}, sort_keys=True, default=str)


def parameter_layout(cfg: JobConfig) -> list[tuple[int, str]]:
    """Each trainable parameter of the job's model (element count, torch dtype name), in the model's order:
    what its gradient buckets are made of. The layout `measure_compute` saw, else the workload built once
    on the CPU."""
    key = _workload_key(cfg)
    if key not in _LAYOUTS:
        from actors.training.workload import build_workload, layout_of

        _LAYOUTS[key] = layout_of(build_workload(cfg).model)
    return _LAYOUTS[key]


def measure_host(cfg: JobConfig, cands: Sequence[Candidate], model_bytes: float, rounds: int = 40,
                 warmup: int = 5, layout: Sequence[tuple[int, str]] | None = None) -> dict[str, float]:
    """Each synchronization pattern the candidates run (`host_patterns`), timed among the job's count of
    ranks on this machine, each rank a process of its own as the lab's workers are, over gloo on
    127.0.0.1 with no link shaped, by the project's own code for it (the all-reduce, the compressed
    scatter-gather, the gossip policy's exchange and mixing). For each pattern, "PATTERN" is the median
    wall time of one synchronization and "PATTERN:cpu" the median CPU time of the rank's own thread in
    it (encoding, decoding, arithmetic; not the transport's threads): what the lab's emulated nodes,
    which share this machine's cores, pay for a synchronization however fast the links are. A policy's
    step runs on a model of the job's own parameters (`layout`, else `parameter_layout`), so a bucketed
    policy launches as many buckets as the job would."""
    import os  # only plan, auto and the benchmark measure
    import subprocess
    import sys

    from actors.transport.store import serve_store

    labels: dict[str, str] = {}
    for cand in cands:
        for pattern in host_patterns(cand.spec):
            labels.setdefault(pattern, cand.label)
    if not labels:
        return {}
    world = cfg.workers.count
    numels = [numel for numel, _ in (layout if layout is not None else parameter_layout(cfg))]
    _store, port, sock = serve_store("127.0.0.1", 120.0)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs: list[subprocess.Popen[str]] = []
    try:  # fresh interpreters (not multiprocessing: a spawned child would import the caller's main module)
        for rank in range(world):
            task = json.dumps({"config": cfg.to_dict(), "labels": labels, "model_bytes": model_bytes, "port": port, "layout": numels,
                               "rank": rank, "rounds": rounds, "warmup": warmup})
            procs.append(subprocess.Popen([sys.executable, "-c",
                                           "from orchestrator.planning.measure import _host_rank; _host_rank()", task],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True))
        ranks = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            if proc.returncode != 0:
                last = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
                raise RuntimeError(f"measuring this machine's synchronizations failed: {last}")
            ranks.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        sock.close()
    measured: dict[str, float] = {}
    for pattern in labels:
        measured[pattern] = statistics.median(rank[pattern][0] for rank in ranks)
        measured[cpu_time(pattern)] = statistics.median(rank[pattern][1] for rank in ranks)
    return measured


def _host_rank() -> None:
    """One rank of `measure_host`, in an interpreter of its own: its task as JSON in argv, every pattern
    in turn (each on its own group), {pattern: [wall, cpu]} as JSON on stdout."""
    import os
    import sys

    import torch

    from actors.transport.comm import GlooCommunicator, GroupSpec, make_communicator

    task = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    cfg = parse(JobConfig, task["config"])
    by_label = {c.label: c for c in candidates(cfg)}
    world, rank, warmup = cfg.workers.count, task["rank"], task["warmup"]
    numel = max(int(task["model_bytes"] // 4), 1)
    out = {}
    for pattern, label in task["labels"].items():
        comm = make_communicator(GroupSpec("127.0.0.1", task["port"], f"host/{pattern}", rank, world, 60.0, "gloo",
                                           "127.0.0.1", reduce_bytes=4 * numel))  # as the job's: the model in float32
        if not isinstance(comm, GlooCommunicator):  # the spec asks for gloo
            raise TypeError(f"expected a gloo group, got {type(comm).__name__}")
        try:
            run = _pattern_step(cfg, by_label[label], pattern, comm, numel, task.get("layout") or [numel])
            times, cpu = [], []
            for step in range(1, warmup + task["rounds"] + 1):
                began, began_cpu = time.perf_counter(), time.thread_time()
                run(step)
                if step > warmup:
                    times.append(time.perf_counter() - began)
                    cpu.append(time.thread_time() - began_cpu)
            out[pattern] = (statistics.median(times), statistics.median(cpu))
        finally:
            comm.close()
    print(json.dumps(out), flush=True)
    os._exit(0)  # past here only the store's and gloo's threads, whose teardown at exit can abort the process


def _pattern_step(cfg: JobConfig, cand: Candidate, pattern: str, comm: GlooCommunicator, numel: int,
                  layout: Sequence[int]) -> Step:
    """One synchronization of `pattern` on `comm` (a model of `numel` floats, whose parameters have `layout`'s
    element counts), as a function of the step."""
    import torch

    kind, _, arg = pattern.partition("/")
    if kind == "allreduce":
        tensor = torch.ones(max(numel // int(arg or 1), 1))
        return lambda step: comm.all_reduce(tensor).wait()
    if kind == "scatter_gather":
        from algorithms.policies.compression import get_codec
        from algorithms.policies.scatter_gather import ScatterGather

        codec = get_codec(arg)
        sg = ScatterGather(codec, numel, feedback=codec.needs_feedback)
        sg.bind(comm)
        tensor, tail = torch.randn(numel), torch.zeros(sg.tail_numel)
        return lambda step: sg.all_reduce(tensor, tail)
    return _policy_step(cfg, cand, comm, layout)


def _policy_step(cfg: JobConfig, cand: Candidate, comm: GlooCommunicator, layout: Sequence[int]) -> Step:
    """One step of the candidate's policy on a model of float parameters of `layout`'s element counts (the
    job's, so its gradients fill the job's buckets), in the worker's order of hooks, with a backward that
    only sets the gradients and the update at lr 0: what the step adds to the forward and backward (the
    gradients' all-reduce, bucket by bucket, or the exchange and mixing)."""
    import torch

    from algorithms.policies.base import EpochInfo, VoteDraft, get_algorithm
    from algorithms.policies.optim import build_optimizer

    job = with_candidate(cfg, cand)
    model = torch.nn.Module()
    params = [torch.nn.Parameter(torch.randn(max(int(n), 1)) * 0.01) for n in layout]
    for i, param in enumerate(params):
        model.register_parameter(f"p{i}", param)
    impl = get_algorithm(job.sync.policy)(job.sync, job.compression).bind(model, build_optimizer(model, job.optimizer))
    slots = tuple(f"w{i}" for i in range(comm.world_size))
    nodes = tuple(str(job.network.node_of(s)) for s in slots) if job.network.lab else ()
    impl.on_membership(comm, EpochInfo(comm.rank, comm.world_size, slots, comm.world_size, 1, nodes))

    def step(index: int) -> None:
        draft = VoteDraft(samples=1)
        impl.begin_step(index, draft)
        impl.before_forward(index)
        impl.backward(torch.stack([param.sum() for param in params]).sum())
        impl.end_backward(index)
        impl.finish_step(index, draft)
        impl.apply_update(index, 0.0)
        impl.commit(index)

    return step


def measure_compute(cfg: JobConfig, steps: int = 12, warmup: int = 3) -> tuple[float, float]:
    """(median seconds of one step's forward, backward and update on one worker's batch, the model's
    parameter bytes), measured in this process on its CPU (`actors.training.workload.time_steps`)."""
    import torch  # only `plan` and `auto` measure

    from actors.training.workload import time_steps

    measured = time_steps(cfg, torch.device("cpu"), steps, warmup, layout=True)
    _LAYOUTS[_workload_key(cfg)] = measured["layout"]
    return statistics.median(measured["times"]), measured["model_bytes"]
