"""One all-reduce between two processes of one node: gloo over loopback against the shared-memory path.

Two processes form a group with this project's communicator (`make_communicator`, over a TCPStore),
once with `ORCHESTRATOR_SHM=0` (gloo: TCP on loopback and gloo's worker threads) and once as a job gets
it (shared memory: actors/transport/shm.py), and time `all_reduce(t).wait()` back to back, after a
warm-up, for float32 tensors of a few sizes (38 KB is the digits MLP of `bsp_vs_ddp.py`, 3.3 MB the
tiny GPT's gradients). The two sides alternate `--rounds` times; each figure is the median over the
rounds of the mean time per operation on rank 0.

    python benchmarks/shm_allreduce.py [--sizes 9610,830000] [--iters 2000] [--rounds 3]

Prints a table, then one JSON line. Figures are measurements, not gates.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def member(rank: int, port: int, numel: int, iters: int, shm: str, out) -> None:
    os.environ["ORCHESTRATOR_SHM"] = shm
    import torch
    import torch.distributed as dist

    from actors.transport.comm import GroupSpec, make_communicator

    torch.set_num_threads(1)
    if rank == 0:
        server = dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)  # noqa: F841 - serves the group
    comm = make_communicator(GroupSpec("127.0.0.1", port, f"bench-{shm}-{numel}", rank, 2, 60.0, "gloo", "127.0.0.1"))
    tensor = torch.ones(numel)
    for _ in range(100):
        comm.all_reduce(tensor).wait()
    started = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(tensor).wait()
    elapsed = time.perf_counter() - started
    if rank == 0:
        out.put((bool(getattr(comm, "shared_memory", False)), elapsed / iters))
    comm.close()
    time.sleep(1.0)  # the group's release thread lets it go before the process exits


def one(numel: int, iters: int, shm: str) -> tuple[bool, float]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=member, args=(r, port, numel, iters, shm, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="9610,830000", help="float32 elements per tensor")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    print(f"{'elements':>10}{'KB':>9}{'gloo us':>10}{'shm us':>10}{'ratio':>8}")
    for numel in [int(x) for x in args.sizes.split(",") if x.strip()]:
        iters = max(50, args.iters * 9610 // max(numel, 9610))
        gloo, shm = [], []
        for _ in range(args.rounds):
            used, t = one(numel, iters, "0")
            assert not used
            gloo.append(t)
            used, t = one(numel, iters, "1")
            if not used:
                print("shared memory not available here (x86-64 Linux with /dev/shm)", file=sys.stderr)
                return 2
            shm.append(t)
        g, m = statistics.median(gloo), statistics.median(shm)
        rows.append({"numel": numel, "gloo_us": g * 1e6, "shm_us": m * 1e6, "ratio": g / m,
                     "gloo_rounds_us": [x * 1e6 for x in gloo], "shm_rounds_us": [x * 1e6 for x in shm]})
        print(f"{numel:>10}{numel * 4 / 1e3:>9.1f}{g * 1e6:>10.1f}{m * 1e6:>10.1f}{g / m:>8.1f}")
    print(json.dumps({"benchmark": "shm_allreduce", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
