"""What a joiner's state transfer costs each member in memory: three processes of one gloo group, each holding a
training state of `--state-mib` (as its live model and optimizer hold it); the source sends its state, one member
keeps its own (it takes part, as a survivor whose state is current does), one receives it (the joiner). Each
process reports the growth of its peak resident memory (ru_maxrss) over the transfer.

`--mode chunked` is the transfer a join uses (actors/training/state_transfer.py: the tensors' bytes broadcast in
chunks of `--chunk-mib`); `--mode whole` is the one it replaced, written out here: the source's state saved to
bytes and broadcast as one buffer, which every member allocates, and the receiver parses.

    python benchmarks/join_memory.py [--state-mib 1024] [--chunk-mib 256] [--mode chunked|whole|both]

Prints one line per mode and a JSON line."""
from __future__ import annotations

import argparse
import io
import json
import resource
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from testkit.processes import run_group_processes  # noqa: E402

MIB = 2 ** 20
TENSOR_MIB = 64


def whole_buffer(comm, src: int, state: dict | None, keep: bool) -> dict | None:
    """The replaced transfer: torch.save of the whole state, broadcast as one uint8 buffer, parsed."""
    size = torch.zeros(1, dtype=torch.int64)
    blob = None
    if comm.rank == src:
        buf = io.BytesIO()
        torch.save(state, buf)
        blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size[0] = blob.numel()
    comm.broadcast(size, src).wait()
    if blob is None:
        blob = torch.empty(int(size[0]), dtype=torch.uint8)
    comm.broadcast(blob, src).wait()
    if keep or comm.rank == src:
        return None
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def member(rank: int, port: int, mode: str, state_mib: int, chunk_mib: int, out) -> None:
    from actors.training.state_transfer import broadcast_state
    from actors.transport.comm import make_communicator
    from core.comm_api import GroupSpec

    live = {f"t{i}": torch.full((TENSOR_MIB * MIB // 4,), float(rank)) for i in range(state_mib // TENSOR_MIB)}
    comm = make_communicator(GroupSpec("127.0.0.1", port, f"join-{mode}", rank, 3, 600.0))
    comm.broadcast(torch.zeros(1), 0).wait()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    state = {"model": live} if rank == 0 else None
    if mode == "chunked":
        got = broadcast_state(comm, 0, state, keep=rank == 1, chunk_bytes=chunk_mib * MIB)
    else:
        got = whole_buffer(comm, 0, state, keep=rank == 1)
    took = time.perf_counter() - began
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / MIB
    ok = got is None or all(float(t[0]) == 0.0 and float(t[-1]) == 0.0 for t in got["model"].values())
    out.put({"rank": rank, "grown_mib": round(grown, 1), "seconds": round(took, 2), "received": got is not None,
             "ok": ok, "baseline_mib": round(before / 1024, 1)})
    comm.close()


def run(mode: str, state_mib: int, chunk_mib: int) -> dict:
    rows = run_group_processes(member, 3, (mode, state_mib, chunk_mib), timeout_s=900)
    roles = {0: "source", 1: "keeper", 2: "receiver"}
    return {roles[row["rank"]]: row for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=int, default=1024)
    parser.add_argument("--chunk-mib", type=int, default=256)
    parser.add_argument("--mode", choices=["chunked", "whole", "both"], default="both")
    args = parser.parse_args()
    if args.state_mib < TENSOR_MIB or args.state_mib % TENSOR_MIB:
        parser.error(f"--state-mib must be a multiple of {TENSOR_MIB}")
    modes = ["chunked", "whole"] if args.mode == "both" else [args.mode]
    result = {"benchmark": "join_memory", "state_mib": args.state_mib, "chunk_mib": args.chunk_mib,
              "torch": torch.__version__, "modes": {}}
    for mode in modes:
        roles = run(mode, args.state_mib, args.chunk_mib)
        result["modes"][mode] = roles
        print(f"{mode:8s} peak RSS growth (MiB): " + ", ".join(
            f"{role} {row['grown_mib']:.0f} (from {row['baseline_mib']:.0f})" for role, row in roles.items())
            + f"; transfer {max(row['seconds'] for row in roles.values()):.1f} s; "
            + ("received intact" if all(row["ok"] for row in roles.values()) else "RECEIVED WRONG DATA"))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
