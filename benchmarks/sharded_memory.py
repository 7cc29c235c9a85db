"""What one worker holds when replica groups shard the model: four processes of one gloo group train the built-in
GPT through actors/training/sharding.py (torch's FSDP2 inside each replica group of `group_size`, the shards summed
across groups) with AdamW, at group sizes 1, 2 and 4. Each process reports the bytes of its parameters, gradients
and optimizer state after its last step (its shards), the growth of its peak resident memory (ru_maxrss) from
before the model was built, and its median step time. Group size 1 is plain replication: every worker holds the
whole model and optimizer.

    python benchmarks/sharded_memory.py [--sizes tiny,small] [--group-sizes 1,2,4] [--steps 3] [--rows 2] [--no-mirror]

With `--mirror` (the default) each group size above 1 runs a second time with a `ShardMirror` on every member (a copy
of the previous member's shard kept current: its bytes are in the total, and its exchange in the step time). In the
run with one group of 4 and mirrors, member 2 then dies: the three survivors form a new group, re-cut the replica
three ways from what they hold (the lost shard from its mirror) and take a step; the times of each phase are printed.

Prints one line per (size, group size) and a JSON line. The goal (issue 73): a worker's tensor bytes at group
size k at most 1/k of group size 1's, plus 5%."""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from testkit.processes import run_group_processes  # noqa: E402

WORLD = 4
MIB = 2 ** 20


def member(rank: int, port: int, size: str, group_size: int, mirror: bool, steps: int, rows: int, out) -> None:
    import torch.nn.functional as F

    from actors.training.sharding import ShardedGroup, ShardMirror, enter_epoch, held_shards, tensor_bytes
    from actors.transport.comm import make_communicator
    from algorithms.rules.sharding import HeldView, ShardLayout
    from core.comm_api import GroupSpec
    from orchestrator.workloads.lm import GPT, SIZES

    torch.set_num_threads(1)
    config = SIZES[size]
    comm = make_communicator(GroupSpec("127.0.0.1", port, f"sharded-{size}-{group_size}-{mirror}", rank, WORLD, 120.0))
    group = ShardedGroup(comm, ShardLayout(WORLD, group_size), rank)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    model = group.shard(GPT(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    copy = ShardMirror(group, model, opt) if mirror else None
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        data = torch.randint(0, config.vocab, (rows, config.seq_len + 1), generator=gen)
        began = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1)) / WORLD
        loss.backward()
        group.reduce_across(model, torch.tensor([float(loss.detach()), float(rows), 0.0], dtype=torch.float64))
        if copy is not None:
            copy.step(model)
        opt.step()
        times.append(time.perf_counter() - began)
    held = tensor_bytes(model, opt)
    mirrored = copy.tensor_bytes() if copy is not None else 0
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 / MIB
    row = {"rank": rank, "parameters": held.parameters, "gradients": held.gradients, "optimizer": held.optimizer,
           "mirror": mirrored, "total": held.total + mirrored, "peak_rss_growth_mib": round(grown, 1),
           "step_s": round(statistics.median(times), 3),
           "full_parameters": sum(p.numel() * p.element_size() for p in GPT(config).parameters())}
    if copy is not None and group_size == WORLD:  # one group: member 2 dies; the others go on from their memory
        held_now = held_shards(group, model, opt, copy)
        group.close()
        comm.close()
        if rank != 2:
            began = time.perf_counter()
            survivors = [r for r in range(WORLD) if r != 2]
            new_rank = survivors.index(rank)
            after = make_communicator(GroupSpec("127.0.0.1", port, f"sharded-{size}-after", new_rank, WORLD - 1, 120.0))
            formed = time.perf_counter()
            view = HeldView(steps, group_size, tuple(h.index for h in held_now))  # its own shard and its mirror's
            state = enter_epoch(after, WORLD, view, held_now, lambda: GPT(config),
                                lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), mirror=False)
            model, opt, new_group = state.model, state.optimizer, state.group
            recut = time.perf_counter()
            data = torch.randint(0, config.vocab, (rows, config.seq_len + 1), generator=gen)
            logits = model(data[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1)) / (WORLD - 1)
            loss.backward()
            new_group.reduce_across(model)
            opt.step()
            row["recovery"] = {"form_s": round(formed - began, 3), "recut_s": round(recut - formed, 3),
                               "first_step_s": round(time.perf_counter() - recut, 3)}
            new_group.close()
            after.close()
        out.put(row)
        return
    out.put(row)
    group.close()
    comm.close()


def run(size: str, group_size: int, mirror: bool, steps: int, rows: int) -> list[dict]:
    return run_group_processes(member, WORLD, (size, group_size, mirror, steps, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,small")
    parser.add_argument("--group-sizes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--mirror", action=argparse.BooleanOptionalAction, default=True,
                        help="also run each group size above 1 with every member mirroring its neighbour's shard")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    try:
        group_sizes = [int(k) for k in args.group_sizes.split(",")]
    except ValueError:
        parser.error(f"--group-sizes: integers, comma-separated (got {args.group_sizes!r})")
    bad = [k for k in group_sizes if k < 1 or WORLD % k]
    if bad or any(s not in ("tiny", "small") for s in sizes):
        parser.error(f"--group-sizes must divide {WORLD} and --sizes be tiny or small")
    result = {"benchmark": "sharded_memory", "world": WORLD, "steps": args.steps, "rows": args.rows,
              "torch": torch.__version__, "runs": {}}
    for size in sizes:
        base = None
        for k, mirror in [(g, m) for g in group_sizes for m in ((False, True) if g > 1 and args.mirror else (False,))]:
            rows = run(size, k, mirror, args.steps, args.rows)
            worst = max(rows, key=lambda r: r["total"])
            base = worst["total"] if k == 1 else base
            ratio = worst["total"] / base if base else None
            label = f"k={k}" + ("+mirror" if mirror else "")
            result["runs"][f"{size}/{label}"] = {"members": rows, "largest_total": worst["total"], "ratio_to_k1": ratio}
            goal = f"; goal <= {(2 if mirror else 1) / k * 1.05:.3f}" if base and k > 1 else ""
            print(f"{size:5s} {label:8s}: tensor bytes per worker (largest) params {worst['parameters'] / MIB:.2f} MiB, "
                  f"grads {worst['gradients'] / MIB:.2f}, optimizer {worst['optimizer'] / MIB:.2f}, mirror "
                  f"{worst['mirror'] / MIB:.2f}, total {worst['total'] / MIB:.2f} MiB"
                  + (f" = {ratio:.3f} of k=1{goal}" if ratio else "")
                  + f"; peak RSS growth {max(r['peak_rss_growth_mib'] for r in rows):.0f} MiB; "
                  f"median step {statistics.median(r['step_s'] for r in rows):.3f} s", flush=True)
            recovered = [r["recovery"] for r in rows if "recovery" in r]
            if recovered:
                print(f"{size:5s} {label:8s}: member 2 dies; the 3 survivors re-form in "
                      f"{max(r['form_s'] for r in recovered):.3f} s, re-cut the replica from memory in "
                      f"{max(r['recut_s'] for r in recovered):.3f} s, first step "
                      f"{max(r['first_step_s'] for r in recovered):.3f} s (the slowest survivor's)", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
