"""`python -m orchestrator run|status|stop ...`: the command line over `ElasticJob`.

Exit codes of `run`: 0 finished, 1 training failed, 2 bad input (one line on stderr), 3 stopped
from elsewhere, 130 interrupted. Bad input is caught before Ray starts and before anything is
written. Progress goes to stdout as plain lines (works without a terminal).

`status`, `scale` and `stop` reach a job by its name: at `--address` (or RAY_ADDRESS), else, for a
job that started a local Ray on this machine, at the address its run recorded (`orchestrator/local_runs.py`),
or, once it has ended, through its run folder. Their exit codes: 0 done, 1 no such job, or nothing
answers at the address within 10 s (one line, `error: no Ray at ADDRESS ...`), 2 bad input.

`calibrate` (re)writes the convergence factors `plan` and `auto` rank with (`orchestrator/convergence.json`)
from the network lab grid's result rows, training nothing; `--measure` first runs the grid's cell that
counts them on the lab. Its exit codes: 0 written (or, with `--check`, the file is what the rows give), 1 the
file differs (`--check`), 2 bad input or no lab here.

`prepare` tokenizes text into token shards with a manifest (orchestrator/prepare.py); `export` writes a run's
final model, or one of its checkpoints, as a Hugging Face model folder (orchestrator/export.py). Both start
nothing; their exit codes: 0 written, 2 bad input (one line).
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from actors.runs.storage import first_line
from core.display import checkpoint_line
from core.schema import ConfigError, JobStatus, OrchestratorError

if TYPE_CHECKING:  # pragma: no cover
    from core.schema import NetworkConfig

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
ADDRESS_HELP = ("the job's Ray (default: RAY_ADDRESS, else the local Ray a run of NAME on this machine started, "
                "else its newest run folder)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        raise ConfigError(f"arguments: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m orchestrator", description="Elastic distributed training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job from a YAML config")
    run.add_argument("config")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--address", default=None)
    run.add_argument("--resume", nargs="?", const="newest", default=None, metavar="RUN_ID|CHECKPOINT",
                     help="continue from the most recently written valid checkpoint of the job, of one run "
                          "(its id), or from one checkpoint (its data file's path or URI)")
    run.add_argument("--detach", action="store_true", help="start the job and return; it outlives this process")
    scale = sub.add_parser("scale", help="grow or shrink a running job")
    scale.add_argument("name")
    scale.add_argument("count", type=int)
    scale.add_argument("--address", default=None, help=ADDRESS_HELP)
    for name, text in (("status", "show a job's status"), ("stop", "stop a job gracefully")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("name")
        cmd.add_argument("--address", default=None, help=ADDRESS_HELP)
        if name == "status":
            cmd.add_argument("--json", action="store_true")
    lab = sub.add_parser("lab", help="the emulated network on this machine: up CONFIG | down | show [CONFIG --probe]")
    lab.add_argument("action", choices=["up", "down", "show"])
    lab.add_argument("config", nargs="?", help="a job config (or a file with just a network: section)")
    lab.add_argument("--probe", action="store_true", help="show: measure each link against what was asked")
    lab.add_argument("--json", action="store_true")
    plan = sub.add_parser("plan", help="predict every applicable policy's time per step and to the target; recommend one")
    plan.add_argument("config")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--network", default=None, metavar="FILE", help="a file with a network: section (else the config's)")
    where.add_argument("--probe", action="store_true",
                       help="measure instead of assuming: the lab's links, or (no network: section) the Ray cluster's: "
                            "probes placed as the job's workers time its compute and every node pair's link")
    plan.add_argument("--compute-ms", type=float, default=None, help="one step's compute (else measured here)")
    plan.add_argument("--json", action="store_true")
    report = sub.add_parser("report", help="draw a run's report (loss, membership, stragglers, bytes, recoveries) as a PNG")
    report.add_argument("run_dir", help="a run directory (it holds history.jsonl and events.jsonl), the run on "
                                        "its storage (s3://bucket/prefix/JOB/RUN_ID), or a job's name (its newest "
                                        "run on this machine)")
    report.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/report.png; ./report.png for a URI)")
    calibrate = sub.add_parser(
        "calibrate", help="(re)compute the convergence factors (orchestrator/convergence.json) from the lab grid's result rows",
        description="Compute each policy's steps to the target relative to BSP (10 Gbit/s, no straggler, the median over "
                    "seeds), one set per learning rate and world size the rows measure, and write them where plan and "
                    "sync.policy: auto read them. Sets at other rates and world sizes in the file are kept. Nothing trains "
                    "unless --measure is given.")
    calibrate.add_argument("rows", nargs="*", metavar="ROWS.jsonl",
                           help="the lab grid's result files (default: benchmarks/results/tradeoffs*.jsonl in this checkout); "
                                "with --measure, the one file the new rows are appended to")
    calibrate.add_argument("--out", default=None, metavar="FILE",
                           help="the convergence file to write (default: the package's orchestrator/convergence.json)")
    calibrate.add_argument("--check", action="store_true",
                           help="write nothing; exit 1 where --out is not what the rows give")
    calibrate.add_argument("--measure", action="store_true",
                           help="first run every candidate on the lab's 10g link with no straggler, once per seed, appending "
                                "to ROWS.jsonl (rows already there are kept and not run again); needs root and tc")
    for flag, kind, text in (("--lr", float, "SGD's rate (default 0.1)"), ("--workers", int, "workers, 2 a lab node (default 4)"),
                             ("--seeds", str, "comma-separated seeds (default 0)"),
                             ("--only", str, "comma-separated plan labels or policy names (default: every candidate)"),
                             ("--target", float, "held-out accuracy to reach (default 0.96)"),
                             ("--hidden", int, "the MLP's hidden width (default 512)"),
                             ("--compute-ms", float, "modelled compute a step (default 15)"),
                             ("--max-steps", int, "at most this many steps a run (default 600)")):
        calibrate.add_argument(flag, type=kind, default=None, help=f"with --measure: {text}")
    _add_prepare(sub)
    _add_export(sub)
    for cmd in sub.choices.values():
        cmd.error = parser.error  # type: ignore[method-assign]
        cmd.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                         help="logging level here (and, for run, in the job's actors)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=args.log_level or "WARNING", format="%(levelname)s %(name)s: %(message)s")
        return {"run": cmd_run, "status": cmd_status, "stop": cmd_stop, "scale": cmd_scale,
                "lab": cmd_lab, "plan": cmd_plan, "report": cmd_report, "calibrate": cmd_calibrate,
                "prepare": cmd_prepare, "export": cmd_export}[args.command](args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OrchestratorError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def cmd_run(args: argparse.Namespace) -> int:
    from orchestrator.config import load_config

    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's stack to stderr (a run that seems stuck)
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stderr without a file (called in process)
            faulthandler.register(signal.SIGUSR1, all_threads=True)

    overrides = list(args.overrides) + ([f"log_level={args.log_level}"] if args.log_level else [])
    config = load_config(args.config, overrides)  # validates everything before Ray starts
    if args.address:
        config.ray.address = args.address
    if args.detach and not (config.ray.address or os.environ.get("RAY_ADDRESS")):
        raise ConfigError("--detach: a local Ray ends with this process; pass --address (or set RAY_ADDRESS) "
                          "to run the job on a cluster that outlives it")
    from orchestrator.job import check_storage

    storage = check_storage(config)  # an unusable store ends here, exit 2, before Ray starts
    resume_from = None
    if args.resume:
        from core.schema import SERVER_POLICIES
        from orchestrator.planner import refuse_resume

        refuse_resume(config.sync.policy)  # `auto`: the policy its run picked is checked when the job starts

        ref = _resume_ref(args.resume, storage, config, config.sync.policy in SERVER_POLICIES)
        print(f"resuming from step {ref.step} of run {ref.run_id} ({ref.location})", flush=True)
        resume_from = ref.location
    with contextlib.ExitStack() as lab:
        if config.network.lab:
            _enter_lab(config, lab, keep_up=args.detach)
        return _run(config, args, resume_from)


def _resume_ref(which: str, storage, config, server: bool):
    """The checkpoint `--resume [which]` continues from, checked against this config's workload:
    ConfigError (one line) when there is none or it was written by another workload."""
    from actors.runs import checkpoints

    warn = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if which != "newest" and (which.endswith(".pt") or "/" in which):  # one checkpoint, by its data's location
        try:
            ref = checkpoints.ref_of(storage, which)
        except (RuntimeError, OSError, ValueError) as err:
            raise ConfigError(f"--resume {which}: {first_line(err)}") from None
    else:
        newest = checkpoints.newest_valid_of_job((storage, config.name), server, warn=warn,
                                                 run_id="" if which == "newest" else which)
        if newest is None:
            run = "" if which == "newest" else f" in run {which!r}"
            raise ConfigError(f"--resume: no valid checkpoint for job {config.name!r}{run} under "
                              f"{storage.location(config.name)}")
        ref = newest
    fp, described = checkpoints.fingerprint(config.workload.factory, config.workload.params)
    if ref.fingerprint is not None and ref.fingerprint != fp:
        raise ConfigError(f"--resume: the checkpoint at step {ref.step} of run {ref.run_id} was written by another "
                          f"workload ({ref.workload}) than this config's ({described}); its tensors would not fit")
    return ref


def _enter_lab(config, stack: contextlib.ExitStack, keep_up: bool) -> None:
    """`network:` set: bring the lab up for this run (down again when it ends), or, for a detached job
    that outlives this process, require the one `lab up` brought up."""
    from orchestrator import lab

    try:
        if keep_up:
            lab.require(config.network)
        else:
            stack.enter_context(lab.Lab(config.network))
    except lab.LabUnavailable as err:
        raise ConfigError(f"network: {err}") from None


def _run(config, args: argparse.Namespace, resume_from: str | None) -> int:
    from orchestrator.job import ElasticJob

    if args.detach:
        job = ElasticJob(config, resume_from=resume_from).start(owned=False)
        _announce(job, config)
        print(f"detached; follow with: python -m orchestrator status {job.name}", flush=True)
        return EXIT_OK
    with CtrlC() as interrupt:  # from here a Ctrl-C stops the job this process owns, once it has started
        job = ElasticJob(config, resume_from=resume_from).start(owned=True)
        _announce(job, config)
        return follow(job, ProgressPrinter(config.stop.max_steps, config.progress_every_s), interrupt)


def _announce(job, config) -> None:
    print(f"job {job.name} run {job.run_id}: {config.workers.count} workers, policy {job.config.sync.policy}; "
          f"run dir {job.run_dir}", flush=True)
    if job.local_address:
        print(f"local Ray at {job.local_address}: from another shell, python -m orchestrator status|scale|stop "
              f"{job.name} (or --address {job.local_address})", flush=True)
    if job.policy_choice:
        print(f"policy auto: {job.policy_choice}", flush=True)


class Interrupted(Exception):
    """Raised by `CtrlC.check` in the main loop once a Ctrl-C has come."""


class CtrlC:
    """SIGINT sets a flag that the main loop looks at between calls, instead of raising
    KeyboardInterrupt wherever the main thread happens to be. A KeyboardInterrupt raised inside a
    callback that a C extension runs on the main thread (Ray's core worker runs Python there while it
    waits in `ray.get`) can be printed as "Exception ignored" and dropped: the Ctrl-C is then lost and
    the job trains on. A flag cannot be lost. A second Ctrl-C raises KeyboardInterrupt to leave at once
    (an owned job then stops on its own: its owner is gone)."""

    def __init__(self) -> None:
        self.count = 0
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None

    def _handler(self, signum, frame) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.count:
            raise Interrupted

    def __enter__(self) -> CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)


def follow(job, printer: ProgressPrinter, interrupt: CtrlC) -> int:
    """Print the job's progress until it ends (its exit code), or stop it gracefully after a Ctrl-C (130)."""
    def on_status(status: JobStatus) -> None:
        printer(status)
        interrupt.check()

    try:
        result = job.wait(on_status=on_status)
    except Interrupted:
        print("interrupted: stopping the job gracefully (Ctrl-C again to leave at once)", flush=True)
        stopped = job.stop("interrupted (Ctrl-C)")  # once every actor is gone: the final model is written
        printer.summary(stopped, (stopped.ended_at or time.time()) - stopped.started_at, job.model_location())
        return EXIT_INTERRUPTED
    final = job.status()
    printer.summary(final, result.elapsed_s, job.model_location())
    return {"FINISHED": EXIT_OK, "STOPPED": EXIT_STOPPED}.get(result.state, EXIT_FAILED)


class ProgressPrinter:
    """Prints `step N/M loss L steps/s S world W epoch E` every few seconds while the job runs."""

    def __init__(self, max_steps: int | None, every_s: float) -> None:
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
        if status.tokens_per_s and status.world_size:
            rate += f" tokens/s {status.tokens_per_s:,.0f} ({status.tokens_per_s / status.world_size:,.0f} a worker"
            if status.worker_tokens_per_compute_s:  # goodput beside what a worker's compute achieves
                rate += f"; {status.worker_tokens_per_compute_s:,.0f} on its compute"
            rate += ")" + (f" MFU {status.mfu:.1%}" if status.mfu is not None else "")
        metrics = " ".join(f"{k} {v:.4f}" for k, v in sorted(status.metrics.items()))
        loss += "".join(f" {k} {v:.4f}" for k, v in sorted(status.step_metrics.items()))  # the loss's own metrics
        slow = " ".join(f"{slot} {ratio:.1f}x" for slot, ratio in sorted(status.stragglers.items()))
        print(f"[{status.state.lower()}] step {status.step}{total} loss {loss} steps/s {rate} world {status.world_size} "
              f"epoch {status.membership_epoch} {metrics}{' stragglers ' + slow if slow else ''}".rstrip(), flush=True)

    def summary(self, status: JobStatus, elapsed_s: float, model: str | None = None) -> None:
        """The lines at the end of a run: its end, metrics, where its final model (`model`, its location)
        and last checkpoint are, and its run folder."""
        print(f"{status.state}: {status.name} run {status.run_id} at step {status.step} in {elapsed_s:.1f}s"
              + (f"; cause: {status.cause}" if status.cause else ""), flush=True)
        if status.samples_skipped:
            print(f"  bad samples skipped: {status.samples_skipped} (workload.on_bad_sample: skip; "
                  f"samples_skipped events)", flush=True)
        for key, value in sorted(status.metrics.items()):
            print(f"  {key}: {value:.4f}", flush=True)
        if status.step_metrics:
            print("  step metrics of the last step: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(status.step_metrics.items())),
                  flush=True)
        print(f"  final model: {model} (orchestrator.load_model({str(status.run_dir)!r}) rebuilds it)" if model
              else "  final model: none written", flush=True)
        checkpoint = status.checkpoint
        print(f"  last checkpoint: {checkpoint['path']} (step {checkpoint['step']}; --resume continues from it)"
              if checkpoint.get("path") else "  last checkpoint: none stored", flush=True)
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
    if status.samples_skipped:
        lines.append(f"bad samples skipped: {status.samples_skipped}")
    if status.loss is not None:
        lines.append(f"loss {status.loss:.4f}" + (f", {status.throughput:.1f} steps/s" if status.throughput else ""))
    if status.checkpoint:
        lines.append(checkpoint_line(status.checkpoint))
    lines.append(f"{'slot':<6}{'rank':>5}  {'state':<10}{'pid':>8}  node")
    for m in status.members:
        lines.append(f"{m.slot:<6}{m.rank:>5}  {m.state:<10}{m.pid:>8}  {m.node}" + (f"  ({m.cause})" if m.cause else ""))
    for spare in status.spares:
        lines.append(f"{'spare':<6}{'-':>5}  {spare['state']:<10}{spare['pid'] or '':>8}  {spare['node']}  ({spare['name']}"
                     + (f": {spare['cause']})" if spare.get("cause") else ")"))
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

    status = ElasticJob.attach(args.name, args.address).scale(args.count)  # once the plan is out, or why not
    print(f"{status.name}: scaling to {args.count} workers: done, membership epoch {status.membership_epoch} has "
          f"{status.world_size} ({', '.join(m.slot for m in status.members if m.rank >= 0)}), now {status.state}")
    return EXIT_OK


def cmd_stop(args: argparse.Namespace) -> int:
    from orchestrator.job import ElasticJob

    status = ElasticJob.attach(args.name, args.address).stop("stopped from the command line")
    print(f"{status.name}: {status.state} at step {status.step}")
    return EXIT_OK


def cmd_lab(args: argparse.Namespace) -> int:
    """`lab up CONFIG` shapes `lo` for the config's `network:` (idempotent), `lab down` removes it,
    `lab show` says what is up; `--probe` measures every link. Exit 2 where the lab cannot run."""
    from orchestrator import lab

    net = None
    if args.config:
        net = _network_of(args.config)
    elif args.action == "up" or args.probe:
        raise ConfigError(f"lab {args.action}{' --probe' if args.probe else ''}: needs a CONFIG with a network: section")
    try:
        if args.action == "up" and net is not None:  # `up` without a network was refused above
            brought = lab.up(net)
            print(f"lab {'up' if brought else 'already up'}: {net.nodes} nodes at {net.address(0)}.."
                  f"{net.address(net.nodes - 1)}, inter-node {_link_text(net.inter)}, intra-node {_link_text(net.intra)}")
        elif args.action == "down":
            print("lab down" if lab.down() else "lab was not up; nothing changed")
        else:
            state = lab.current()
            print(json.dumps(state) if args.json else (f"lab up since {time.ctime(state['since'])}" if state and state.get("since")
                                                       else ("lab up" if state else "lab not up")))
        if args.probe and net is not None:
            rows = lab.probe(net)
            if args.json:
                print(json.dumps(rows))
            for row in rows:
                asked = f"{row['asked_mbit']:.0f}" if row["asked_mbit"] else "unshaped"
                print(f"node {row['a']} -> {row['b']}: asked {asked} Mbit/s, measured {row['measured_mbit']:.1f} Mbit/s, "
                      f"rtt {row['rtt_ms']:.3f} ms (kernel) + {row['modelled_latency_ms']:g} ms modelled one way")
    except lab.LabUnavailable as err:
        print(f"error: lab: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def _link_text(link) -> str:
    rate = f"{link.mbit:g} Mbit/s" if link.mbit else "unshaped"
    return f"{rate}{f' + {link.latency_ms:g} ms modelled latency' if link.latency_ms else ''}"


def _network_of(path: str) -> NetworkConfig:
    """The `network:` section of a job config, or of a file that holds only that section."""
    import yaml

    from core.schema import NetworkConfig, parse

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    section = data.get("network") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: no network: section")
    net = parse(NetworkConfig, section, "network")
    if not net.enabled:
        raise ConfigError(f"{path}: network.nodes must be at least 1 for a lab")
    return net


def cmd_report(args: argparse.Namespace) -> int:
    """The run report of RUN_DIR as a PNG (actors/observe/report.py). Starts nothing."""
    from actors.observe import report
    from actors.runs.storage import StorageError, is_remote

    run_dir = args.run_dir if is_remote(args.run_dir) else Path(args.run_dir).expanduser()  # a URI: the run's storage
    if isinstance(run_dir, Path) and not run_dir.is_dir():
        from orchestrator.local_runs import run_folder

        newest = run_folder(args.run_dir)  # a job's name: its newest run on this machine
        if newest is None:
            raise ConfigError(f"report: {run_dir} is not a directory, nor the name of a job with a run folder here")
        run_dir = newest
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("report: needs matplotlib (pip install 'elastic-orchestrator[plot]')")
    try:
        out = report.draw(run_dir, Path(args.out).expanduser() if args.out else None)
    except (FileNotFoundError, StorageError) as err:
        raise ConfigError(f"report: {err}") from None
    print(f"report: {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Every applicable policy's predicted time per step, bytes and time to the target on the config's
    network (or `--network FILE`'s, or the lab's links as `--probe` measures them), best first, and the
    recommendation in one line. Starts nothing."""
    import dataclasses

    from orchestrator import lab, planner
    from orchestrator.config import load_config

    config = load_config(args.config, args.overrides)
    if args.network:
        config = dataclasses.replace(config, network=_network_of(args.network))
    probed = cluster = None
    if args.probe and config.network.lab:  # the lab: its links, shaped on this machine
        try:
            lab.require(config.network)
            probed = lab.probe(config.network)
        except lab.LabUnavailable as err:
            print(f"error: plan --probe: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    elif args.probe:  # the user's Ray cluster: probes placed as the job's workers, measured there
        from actors.training.probe import probe_cluster
        from orchestrator.job import connect

        connect(config)
        print(f"probing the cluster with {config.workers.count} probe(s) placed as the job's workers...", flush=True)
        cluster = probe_cluster(config.to_dict())
    if cluster is not None:
        compute_s, model_bytes = planner.probed_compute_s(cluster), cluster["model_bytes"]
    else:
        compute_s, model_bytes = planner.measure_compute(config)
    if args.compute_ms is not None:
        compute_s = args.compute_ms / 1e3
    cands = planner.candidates_on(config, cluster)
    rows = planner.ranked(config, cands, compute_s, model_bytes, probed, cluster=cluster)
    line = planner.recommendation(rows)
    if args.json:
        print(json.dumps({"compute_s": compute_s, "model_bytes": model_bytes, "recommendation": line,
                          "factors": planner.factors_line(config),
                          "cluster": ({k: v for k, v in cluster.items() if k != "compute"}
                                      | {"compute_median_s": planner.rank_medians(cluster)})
                          if cluster else None,
                          "rows": [{"policy": r.candidate.label, "step_s": r.step_s, "bytes_per_step": r.bytes_per_step,
                                    "factor": r.factor, "to_target_s": r.to_target_s, "exact": r.exact,
                                    "note": r.note, "basis": r.basis} for r in rows]}))
        return EXIT_OK
    where = ("probed" if probed else "as told (a real cluster's: network.emulate false)" if planner.told_network(config)
             else "measured on the cluster" if cluster else
             "as asked" if config.network.enabled else "one node, unshaped (not probed: pass --probe)")
    told = " (told: --compute-ms; ranked with it)" if args.compute_ms is not None else ""
    print(f"{config.workers.count} workers, network {where}; one step's compute {compute_s * 1e3:.2f} ms{told}, "
          f"model {model_bytes / 1e6:.3f} MB")
    if cluster:
        print(planner.describe_probe(cluster))
    print(planner.table(rows, planner.factors_line(config)))
    print(f"recommended: {line}")
    return EXIT_OK


GRID_OPTIONS = ("lr", "workers", "seeds", "only", "target", "hidden", "compute_ms", "max_steps")


def cmd_calibrate(args: argparse.Namespace) -> int:
    """The convergence factors from the lab grid's result rows into `--out` (orchestrator/calibration.py);
    with `--measure`, the grid's 10g/none cell run first (orchestrator/lab_grid.py)."""
    from orchestrator import calibration
    from orchestrator.planning.ranking import FACTORS_PATH

    given = {k: getattr(args, k) for k in GRID_OPTIONS if getattr(args, k) is not None}
    if args.measure:
        if len(args.rows) != 1:
            raise ConfigError("calibrate --measure: name the one result file the new rows go to "
                              "(e.g. benchmarks/results/tradeoffs_w8.jsonl)")
        from orchestrator import lab_grid

        words = {k: tuple(w.strip() for w in given[k].split(",") if w.strip()) for k in ("seeds", "only") if k in given}
        try:
            seeds = tuple(int(s) for s in words.get("seeds", ()))
        except ValueError:
            raise ConfigError(f"calibrate: --seeds {given['seeds']}: not comma-separated integers") from None
        grid = lab_grid.Grid(**{**given, **({"seeds": seeds} if seeds else {}), "only": frozenset(words.get("only", ())),
                                "networks": ("10g",), "conditions": ("none",), "resume": True})
        code = lab_grid.measure(grid, Path(args.rows[0]))
        if code:
            return code
    elif given:
        raise ConfigError(f"calibrate: --{', --'.join(k.replace('_', '-') for k in given)} only with --measure "
                          "(the rows say what they were measured at)")
    out = Path(args.out).expanduser() if args.out else FACTORS_PATH
    paths = [Path(p).expanduser() for p in args.rows] or calibration.default_rows()
    contents = calibration.calibrated(paths, calibration.read_current(out))
    text = calibration.file_text(contents)
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out} is {'' if same else 'not '}what the rows of {len(paths)} file(s) give")
        return EXIT_OK if same else EXIT_FAILED
    out.write_text(text)
    for s in contents["sets"]:
        at = s["measured_at"]
        print(f"lr {at['lr']:g}, {at['workers']} workers: BSP {s['bsp_steps']} steps to {at['target']}; "
              + ", ".join(f"{label} {f:.2f}" for label, f in s["factors"].items() if label != "bsp"))
    print(f"wrote {out}")
    return EXIT_OK


def _add_prepare(sub) -> None:
    """Options left out are absent (SUPPRESS): `PrepareOptions` holds the defaults (its import needs numpy)."""
    prep = sub.add_parser(
        "prepare", help="tokenize text files, folders or a saved Hugging Face dataset into token shards with a manifest",
        description="Each file or dataset row is a document; a fixed hash of its path (or row number) holds "
                    "--eval-fraction of them out. Writes OUT/train/, OUT/eval/ (shard-00000.bin, ...), "
                    "OUT/tokenizer/ and OUT/manifest.json, through OUT.partial/ (an interrupted run resumes there).")
    prep.add_argument("inputs", nargs="+", metavar="INPUT",
                      help="a text file, a folder (its files matching --glob), or a dataset saved with save_to_disk")
    prep.add_argument("--out", required=True, metavar="DIR", help="the folder to write (it must not exist)")
    which = prep.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", metavar="TOKDIR",
                       help="a local tokenizer: a transformers tokenizer folder, or a tokenizers tokenizer.json")
    which.add_argument("--train-bpe", type=int, metavar="VOCAB",
                       help="train a byte-level BPE of VOCAB tokens (with <|endoftext|>) on the training documents")
    for flag, kind, text in (("--glob", str, "the files of a folder that are documents (default **/*.txt)"),
                             ("--text-column", str, "a saved dataset's text column (default text)"),
                             ("--split", str, "a saved DatasetDict's split (default train)"),
                             ("--eval-fraction", float, "the fraction of documents held out (default 0.05)"),
                             ("--shard-tokens", int, "tokens a shard (default 10_000_000)"),
                             ("--eos-token", str, "--tokenizer's end-of-text token (default: its eos token)")):
        prep.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=text)
    prep.add_argument("--exclude", action="append", default=argparse.SUPPRESS, metavar="PATTERN",
                      help="a folder's files whose path under it matches PATTERN (fnmatch: * crosses folders, e.g. "
                           "'site-packages/*') are not documents; repeatable")
    prep.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def _add_export(sub) -> None:
    export = sub.add_parser("export", help="a run's final model (or a checkpoint) as a Hugging Face model folder")
    export.add_argument("run_dir", help="the run folder (it holds config.yaml, and model.pt once the run has ended)")
    export.add_argument("--hf", required=True, metavar="OUT", help="the folder to write (it must not exist)")
    export.add_argument("--checkpoint", default=None, metavar="STEP|PATH",
                        help="a committed checkpoint instead of the final model: its step, or its data file")
    export.add_argument("--tokenizer", default=None, metavar="TOKDIR",
                        help="the tokenizer to save beside the model (default: that of the workload's data_dir, if any)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def cmd_prepare(args: argparse.Namespace) -> int:
    from orchestrator.prepare import PrepareOptions, prepare

    given = {k: v for k, v in vars(args).items() if k in PrepareOptions.__dataclass_fields__ and k != "inputs"}
    if "exclude" in given:
        given["exclude"] = tuple(given["exclude"])
    manifest = prepare(PrepareOptions(inputs=tuple(args.inputs), **given))
    print(f"prepared {manifest.folder}: vocabulary {manifest.vocab_size} ({manifest.dtype}), train "
          f"{manifest.train_documents} documents {manifest.train_tokens} tokens, eval {manifest.eval_documents} "
          f"documents {manifest.eval_tokens} tokens")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from orchestrator.export import export_hf

    written = export_hf(args.run_dir, args.hf, checkpoint=args.checkpoint, tokenizer=args.tokenizer,
                        overwrite=args.overwrite)
    print(f"exported {written.model} to {written.folder}"
          + (f" with the tokenizer of {written.tokenizer}" if written.tokenizer else " (no tokenizer known: --tokenizer)"))
    return EXIT_OK
