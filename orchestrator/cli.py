"""`python -m orchestrator run|status|stop ...`: the command line over `ElasticJob`.

Exit codes of `run`: 0 finished, 1 training failed, 2 bad input (one line on stderr), 3 stopped
from elsewhere, 130 interrupted. Bad input is caught before Ray starts and before anything is
written. Progress goes to stdout as plain lines (works without a terminal).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Optional, Sequence

from core.schema import ConfigError, JobStatus, OrchestratorError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        raise ConfigError(f"arguments: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m orchestrator", description="Elastic distributed training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job from a YAML config")
    run.add_argument("config")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--address", default=None)
    run.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    run.add_argument("--detach", action="store_true", help="start the job and return; it outlives this process")
    scale = sub.add_parser("scale", help="grow or shrink a running job")
    scale.add_argument("name")
    scale.add_argument("count", type=int)
    scale.add_argument("--address", default=None)
    for name, text in (("status", "show a job's status"), ("stop", "stop a job gracefully")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("name")
        cmd.add_argument("--address", default=None)
        if name == "status":
            cmd.add_argument("--json", action="store_true")
    for cmd in sub.choices.values():
        cmd.error = parser.error  # type: ignore[method-assign]
        cmd.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                         help="logging level here (and, for run, in the job's actors)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level or "WARNING", format="%(levelname)s %(name)s: %(message)s")
        return {"run": cmd_run, "status": cmd_status, "stop": cmd_stop, "scale": cmd_scale}[args.command](args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OrchestratorError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED


def cmd_run(args: argparse.Namespace) -> int:
    from orchestrator.config import load_config

    overrides = list(args.overrides) + ([f"log_level={args.log_level}"] if args.log_level else [])
    config = load_config(args.config, overrides)  # validates everything before Ray starts
    if args.address:
        config.ray.address = args.address
    if args.detach and not (config.ray.address or os.environ.get("RAY_ADDRESS")):
        raise ConfigError("--detach: a local Ray ends with this process; pass --address (or set RAY_ADDRESS) "
                          "to run the job on a cluster that outlives it")
    from orchestrator.job import ElasticJob, job_root

    resume_from = None
    if args.resume:
        from actors.checkpoints import newest_valid_of_job
        from core.schema import SERVER_POLICIES

        if config.sync.policy == "shadow":
            raise ConfigError("--resume: policy 'shadow' does not resume from a checkpoint yet (its lease table "
                              "lives on the dispenser and is not saved); start a new run")

        ref = newest_valid_of_job(job_root(config), config.sync.policy in SERVER_POLICIES,
                                  warn=lambda text: print(text, file=sys.stderr, flush=True))
        if ref is None:
            raise ConfigError(f"--resume: no valid checkpoint for job {config.name!r} under {job_root(config)}")
        print(f"resuming from step {ref.step} of run {ref.run_id} ({ref.path})", flush=True)
        resume_from = str(ref.path)
    job = ElasticJob(config, resume_from=resume_from).start(owned=not args.detach)
    print(f"job {job.name} run {job.run_id}: {config.workers.count} workers, policy {config.sync.policy}; run dir {job.run_dir}", flush=True)
    if args.detach:
        print(f"detached; follow with: python -m orchestrator status {job.name}", flush=True)
        return EXIT_OK
    printer = ProgressPrinter(config.stop.max_steps, config.progress_every_s)
    try:
        result = job.wait(on_status=printer)
    except KeyboardInterrupt:
        print("interrupted: stopping the job gracefully", flush=True)
        job.stop("interrupted (Ctrl-C)")
        return EXIT_INTERRUPTED
    final = job.status()
    printer.summary(final, result.elapsed_s)
    return {"FINISHED": EXIT_OK, "STOPPED": EXIT_STOPPED}.get(result.state, EXIT_FAILED)


class ProgressPrinter:
    """Prints `step N/M loss L steps/s S world W epoch E` every few seconds while the job runs."""

    def __init__(self, max_steps: Optional[int], every_s: float) -> None:
        self.max_steps = max_steps
        self.every_s = every_s
        self.last = 0.0
        self.last_step = -1
        self.last_state = ""

    def __call__(self, status: JobStatus) -> None:
        now = time.monotonic()
        changed = status.state != self.last_state
        first_step = self.last_step <= 0 < status.step
        if not (changed or first_step or (now - self.last >= self.every_s and status.step != self.last_step)):
            return
        self.last, self.last_step, self.last_state = now, status.step, status.state
        if status.state == "STARTING":
            print("[starting] waiting for the workers to start and form a group", flush=True)
            return
        total = f"/{self.max_steps}" if self.max_steps else ""
        loss = f"{status.loss:.4f}" if status.loss is not None else "-"
        rate = f"{status.throughput:.1f}" if status.throughput else "-"
        metrics = " ".join(f"{k} {v:.4f}" for k, v in sorted(status.metrics.items()))
        slow = " ".join(f"{slot} {ratio:.1f}x" for slot, ratio in sorted(status.stragglers.items()))
        print(f"[{status.state.lower()}] step {status.step}{total} loss {loss} steps/s {rate} world {status.world_size} "
              f"epoch {status.membership_epoch} {metrics}{' stragglers ' + slow if slow else ''}".rstrip(), flush=True)

    def summary(self, status: JobStatus, elapsed_s: float) -> None:
        print(f"{status.state}: {status.name} run {status.run_id} at step {status.step} in {elapsed_s:.1f}s"
              + (f"; cause: {status.cause}" if status.cause else ""), flush=True)
        for key, value in sorted(status.metrics.items()):
            print(f"  {key}: {value:.4f}", flush=True)
        print(f"  run dir: {status.run_dir}", flush=True)


def cmd_status(args: argparse.Namespace) -> int:
    from orchestrator.job import ElasticJob

    status = ElasticJob.attach(args.name, args.address).status()
    if args.json:
        print(json.dumps(status.to_dict(), indent=1, default=str))
        return EXIT_OK
    print(format_status(status))
    return EXIT_OK


def format_status(status: JobStatus) -> str:
    lines = [f"job {status.name} run {status.run_id}: {status.state} at step {status.step}, "
             f"membership epoch {status.membership_epoch}, world size {status.world_size}"
             + (f", coordinator incarnation {status.incarnation}" if status.incarnation else "")]
    if status.cause:
        lines.append(f"cause: {status.cause}")
    if status.loss is not None:
        lines.append(f"loss {status.loss:.4f}" + (f", {status.throughput:.1f} steps/s" if status.throughput else ""))
    lines.append(f"{'slot':<6}{'rank':>5}  {'state':<10}{'pid':>8}  node")
    for m in status.members:
        lines.append(f"{m.slot:<6}{m.rank:>5}  {m.state:<10}{m.pid:>8}  {m.node}" + (f"  ({m.cause})" if m.cause else ""))
    for spare in status.spares:
        lines.append(f"{'spare':<6}{'-':>5}  {spare['state']:<10}{spare['pid'] or '':>8}  {spare['node']}  ({spare['name']})")
    for m in status.departed:
        lines.append(f"departed: {m.slot} (pid {m.pid}) {m.state}: {m.cause}")
    if status.server:
        lines.append(format_server(status.server))
    if status.topology:
        t = status.topology
        lines.append(f"topology: {t.get('kind')} over {t.get('world_size')} members, spectral gap {t.get('spectral_gap', 0):.4f}")
    for event in status.reshapes:
        d = event.detail
        lines.append(f"reshape: epoch {d.get('membership_epoch')}: {d.get('cause', event.reason)} | detector "
                     f"{d.get('detector')} | {','.join(d.get('old_members', []))} -> {','.join(d.get('new_members', []))} "
                     f"| {d.get('duration_s', 0):.2f}s to step {d.get('first_committed_step')}"
                     + (f" | state from {sorted({v['source'] for v in d['state_sources'].values()})}" if d.get("state_sources") else ""))
    lines.append(f"run dir: {status.run_dir}")
    return "\n".join(lines)


def format_server(server: dict) -> str:
    """The parameter server's line: version, incarnation, staleness histogram, refused pushes, leases."""
    refused = ", ".join(f"{k} {v}" for k, v in server.get("rejected", {}).items() if v) or "none"
    staleness = " ".join(f"{k}:{v}" for k, v in server.get("staleness", {}).items()) or "-"
    leases = server.get("leases", {})
    return (f"server: version {server.get('version')}, incarnation {server.get('incarnation')} (pid {server.get('pid')}); "
            f"staleness (versions: updates) {staleness}; refused pushes: {refused}; samples leased "
            f"{leases.get('leased')}, applied {leases.get('applied')}, dropped {leases.get('dropped')}, "
            f"requeued {leases.get('requeued')}, outstanding {leases.get('outstanding')}")


def cmd_scale(args: argparse.Namespace) -> int:
    from orchestrator.job import ElasticJob

    status = ElasticJob.attach(args.name, args.address).scale(args.count)
    print(f"{status.name}: scaling to {args.count} workers (now {status.state}, membership epoch "
          f"{status.membership_epoch}: {', '.join(m.slot for m in status.members if m.rank >= 0)})")
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from orchestrator.job import ElasticJob

    status = ElasticJob.attach(args.name, args.address).stop("stopped from the command line")
    print(f"{status.name}: {status.state} at step {status.step}")
    return EXIT_OK
