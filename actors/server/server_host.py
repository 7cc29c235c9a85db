"""The parameter server of the server policies (asp, ssp, quorum): one `ServerCore` behind a lock.

`ServerHost` is Ray-free (tests run it in process, as `LocalJob` does): it holds the core
(algorithms/policies/server.py decides everything; `server.shards` stays inside it), one lock and a condition.
A pull waits on the condition until `pull_ready` or a short timeout, and then answers "wait", so the
worker's loop comes back to look at its plans; parameters go back as one flat float32 array. Where it
applies an update it writes `faults.record_samples` (`samples/server.txt`: `version membership_epoch
ids...`, and `dropped membership_epoch version ids...` for a late push whose samples are requeued),
reports the version as a history record, and every `server.snapshot_every` versions hands a snapshot of
its state to a thread that stores it (actors/server/server_snapshots.py: no push waits for the store) under
`<run>/server/checkpoints/` on the job's storage, with a sha256 manifest as actors/runs/checkpoints.py writes
checkpoints; it loads with `torch.load(weights_only=True)`.

`ParameterServer` (actors/server/server_actor.py, which imports the host only in the server's process) is
the Ray actor around it, restarted by Ray when its process dies. A restarted server loads its newest
valid snapshot, claims a new incarnation on the storage (actors/runs/fencing.py; pushes addressed to an
older one are fenced) and tells the
coordinator from which version it resumed: the versions after it are lost (`snapshot_every`, plus those
applied while newer snapshots were still being stored), and the coordinator states them in an event.

The background kind's lease dispenser is a `ServerHost` too (actors/server/dispenser_host.py); the workers'
side is actors/server/server_client.py.
"""
from __future__ import annotations

import io
import logging
import os
import queue
import signal
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from actors.runs import checkpoints, fencing
from actors.runs.storage import run_storage
from actors.server.server_snapshots import SnapshotWriter
from actors.training.sources import source_for
from actors.training.user_code import metrics_of
from algorithms.policies.base import get_algorithm
from algorithms.policies.server import ServerCore, ServerPolicy
from algorithms.policies.server_messages import Fence, Pull, Push, PushResult, Update
from algorithms.policies.server_shards import combine_buffers
from core.factory import check_factory
from core.schema import JobConfig, OptimizerConfig, parse

log = logging.getLogger(__name__)
KEEP_RECORDS = 2048
"""History records the server keeps for a restarted coordinator to catch up from."""
FLAT_POOL = 4
"""Flat parameter arrays kept for reuse (a version's array may still be on its way to pullers)."""
FREE_REFS = 3
"""`sys.getrefcount` of a pooled array that nobody else holds: the pool's list, the loop's name, the call."""
SNAPSHOTS_KEPT = 2
SNAPSHOT_WAIT_S = 60.0
"""The longest an injected death waits for the snapshot being stored."""


class ServerReports(Protocol):
    """Where the server's history records, summary and events go (the coordinator, or a test's link)."""

    def records(self, records: tuple[dict, ...], summary: dict) -> None: ...
    def restarted(self, resumed_version: int, incarnation: int, snapshot: str | None) -> None: ...
    def barrier(self, index: int, members: tuple[str, ...], intervals: dict[str, list[float]]) -> None:
        """elastic_bsp: round `index` (of `members`) began; `intervals` are the iteration times measured
        over the round before (pull answered to push received, per slot)."""
        ...


def global_batch(cfg: JobConfig) -> int:
    """The server's B: the starting global batch (server policies keep it on a reshape)."""
    return cfg.workload.batch_size * cfg.workers.count


class ServerHost:
    def __init__(self, config: dict, run_dir: str, reports: ServerReports, restarted: bool = False) -> None:
        self.cfg: JobConfig = parse(JobConfig, config)
        self.run_dir = Path(run_dir)
        storage, run_key = run_storage(self.cfg.storage, self.run_dir, self.cfg.storage_options)
        self.snapshots = (storage, f"{run_key}/server")
        """Where the snapshots and the incarnation claims go: `<run>/server/` on the job's storage (a
        server that Ray restarts on another node finds them there)."""
        self._snapshots = SnapshotWriter(self.snapshots, SNAPSHOTS_KEPT, self.run_dir.name)
        self.reports = reports
        torch.set_num_threads(max(1, int(self.cfg.server.cpus)))
        torch.manual_seed(self.cfg.seed)  # the workers' initial replicas, bit for bit
        self.workload = check_factory(self.cfg.workload.factory)(**self.cfg.workload.params)
        self.model: torch.nn.Module = self.workload.model
        self.core = self._make_core()
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self._model_lock = threading.Lock()
        """The workload's model holds the parameters only while it is saved or evaluated."""
        self.closed: str | None = None
        self._ended = False
        self._flat_cache: tuple[tuple[int, int], np.ndarray] | None = None
        self._flat_pool: list[np.ndarray] = []
        self.kept: deque[dict] = deque(maxlen=KEEP_RECORDS)
        self._outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._report_loop, name="server reports", daemon=True).start()
        self.bytes_sent = 0
        self._delayed: set[int] = set()
        self._pulled_at: dict[str, float] = {}
        self._intervals: dict[str, list[float]] = {}
        """elastic_bsp: each slot's iteration times this round (pull answered to push received)."""
        self._samples = self._open_samples()
        self._pulls = self._open_samples("pulls.txt")
        if restarted:
            self._resume()

    def _samples_in(self) -> int:
        """The training data's size; data a server cannot deal from (a stream, a Ray Data dataset) is refused."""
        return source_for(self.workload.train_data, self.cfg.seed, kind=get_algorithm(self.cfg.sync.policy).kind).n

    def _make_core(self) -> Any:
        policy = self.cfg.sync
        if not isinstance(policy, ServerPolicy):
            raise ValueError(f"sync.policy {policy.policy!r} is not run by a parameter server")
        optimizer = self.cfg.optimizer
        if not isinstance(optimizer, OptimizerConfig):  # refused at load (core/schema/job.py): shards need sgd/adamw
            raise ValueError(f"optimizer {optimizer.name!r} cannot run on a parameter server's shards")
        return ServerCore(list(self.model.parameters()), optimizer, policy,
                          n_samples=self._samples_in(), seed=self.cfg.seed,
                          global_batch=global_batch(self.cfg), shards=self.cfg.server.shards,
                          max_steps=self.cfg.stop.max_steps)

    # ------------------------------------------------------------------ control
    def set_members(self, epoch: int, members: Sequence[tuple[str, int]]) -> None:
        """A membership epoch (slot, worker incarnation in rank order); an older one arriving late is ignored."""
        with self.lock:
            if epoch <= self.core.membership_epoch and self.core.members:
                return
            updates = self.core.set_members(epoch, list(members))
            self._applied(updates)
            self.ready.notify_all()
        self._maybe_snapshot(updates)

    def set_schedule(self, index: int, iterations: dict[str, int]) -> bool:
        """elastic_bsp: the coordinator's ZipLine schedule for round `index` (refused when late)."""
        with self.lock:
            return self.core.set_schedule(index, iterations)

    def close(self, reason: str, wait_s: float) -> None:
        """The job stops: every pull answers `finished` from now on. Waits (`wait_s` at most) for the
        snapshot being stored."""
        with self.lock:
            self.closed = reason
            self._end()
            self.ready.notify_all()
        if not self.wait_snapshots(wait_s):
            log.warning("closed while a snapshot was still being stored (waited %.0fs)", wait_s)

    def wait_snapshots(self, timeout: float) -> bool:
        """True once no snapshot waits or is being stored; False after `timeout`."""
        return self._snapshots.wait(timeout)

    def _end(self) -> None:
        """Once finished or closed: what is staged or dealt and not pushed is accounted for (under the lock)."""
        if not self._ended:
            self._ended = True
            self.core.end()

    def summary(self) -> dict:
        """Counts for `status`: version, incarnation, staleness histogram, refused pushes, leases."""
        with self.lock:
            return self._summary()

    def _summary(self) -> dict:
        core = self.core
        return {"pid": os.getpid(), "version": core.version, "incarnation": core.incarnation, "membership_epoch": core.membership_epoch,
                "staleness": {str(k): v for k, v in sorted(core.staleness.items())}, "rejected": dict(core.rejected),
                "leases": dict(core.leases.counts, outstanding=core.leases.outstanding), "clocks": dict(core.clocks),
                "snapshot_failures": self._snapshots.failures, "snapshot_version": self._snapshots.stored,
                **({"barriers": core.round.index, "schedules": dict(core.schedules)} if core.elastic else {})}

    def model_state(self) -> bytes:
        """What `model()` returns and a checkpoint holds: the parameters as the workload's state dict,
        the version, and the server's whole state (a resume needs it)."""
        with self.lock:
            flat, state, version = self.core.parameters(), self.core.state_dict(), self.core.version
            buffers = self.core.buffers()
        with self._model_lock:
            self._load_model(flat, buffers)
            buf = io.BytesIO()
            torch.save({"model": self.model.state_dict(), "step": version, "server": state}, buf)
        return buf.getvalue()

    def _load_model(self, flat: torch.Tensor, buffers: list[torch.Tensor] | None = None) -> None:
        """The server's parameters into its model, with the buffers combined from the members' newest
        (`combine_buffers`) when any member sent them (else the model keeps its own)."""
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(flat, list(self.model.parameters()))
            combined = combine_buffers(buffers or [], list(self.model.buffers()))
            for target, value in zip(self.model.buffers(), combined or []):
                target.copy_(value)

    def _evaluate(self, flat: torch.Tensor, buffers: list[torch.Tensor] | None = None) -> dict:
        """The workload's metrics of these parameters and the members' buffers (the server's model is
        what `model()` returns)."""
        evaluate = getattr(self.workload, "evaluate", None)
        data = getattr(self.workload, "eval_data", None)
        if evaluate is None or data is None:
            return {}
        with self._model_lock:
            self._load_model(flat, buffers)
            self.model.eval()
            try:
                return metrics_of(evaluate, self.model, data, None)
            finally:
                self.model.train()

    def records_after(self, step: int) -> tuple[dict, ...]:
        self.flush()
        return tuple(r for r in list(self.kept) if r["step"] > step)

    # ------------------------------------------------------------------ pull and push
    def pull(self, fence: Fence, wait_s: float) -> tuple[Pull, np.ndarray | None]:
        """The pull's answer once `pull_ready` (or "wait" after `wait_s`), with the flat parameters when
        the answer is ok or finished."""
        deadline = time.monotonic() + wait_s
        with self.lock:
            while True:
                if self.closed or self.core.finished:
                    return Pull("finished", version=self.core.version), self._flat()
                pull = self.core.pull(fence)
                left = deadline - time.monotonic()
                if pull.status == "ok" or left <= 0:
                    break  # else wait: for the bound, or for `set_members` to admit this incarnation
                self.ready.wait(left)
            if pull.status != "ok":
                return pull, None
            if self._pulls is not None:
                self._pulls.write(f"{fence.slot} {pull.clock} {pull.version} {min(self.core.clocks.values())}\n")
            if self.core.elastic:
                self._pulled_at[fence.slot] = time.monotonic()
            return pull, self._flat()

    def _flat(self) -> np.ndarray:
        """The parameters as one flat array, made once per version (under the lock) and shared by the
        pulls of that version. Ray serializes a pull's answer outside the lock, so a version's array is
        never written while a pull may still hold it: it is written again (for a later version) only
        once nothing but the pool refers to it. Reusing the arrays spares a fresh 4-bytes-a-parameter
        allocation (and its page faults, as long as a copy) per version."""
        key = (self.core.incarnation, self.core.version)
        if self._flat_cache is None or self._flat_cache[0] != key:
            self._flat_cache = None  # the cache's reference would count as a holder
            buffer = next((b for b in self._flat_pool if sys.getrefcount(b) <= FREE_REFS), None)
            if buffer is None:
                buffer = np.empty(self.core.numel, dtype=np.float32)
                if len(self._flat_pool) < FLAT_POOL:
                    self._flat_pool.append(buffer)
            self.core.parameters(out=torch.from_numpy(buffer))
            self._flat_cache = (key, buffer)
        flat = self._flat_cache[1]
        self.bytes_sent += flat.nbytes
        return flat

    def push(self, fence: Fence, lease_ids: tuple[int, ...], pulled_version: int, grad: np.ndarray, loss: float,
             buffers: np.ndarray | None = None) -> PushResult:
        """Apply (or stage) a push; the answer carries no update details (those go to history)."""
        self._maybe_delay(fence, lease_ids)
        tensor = as_tensor(grad)
        held = None if buffers is None else torch.from_numpy(np.array(buffers, dtype=np.float64))
        with self.lock:
            ticket = self.core.leases.find(lease_ids)
            result = self.core.push(Push(fence, tuple(lease_ids), pulled_version, tensor, loss, held))
            if result.status in ("applied", "staged") and fence.slot in self._pulled_at:
                self._intervals.setdefault(fence.slot, []).append(time.monotonic() - self._pulled_at.pop(fence.slot))
            if result.status in ("dropped", "finished") and ticket is not None and self._samples is not None:
                ids = " ".join(str(i) for lease in ticket.leases for i in lease.ids)
                self._samples.write(f"dropped {self.core.membership_epoch} {ticket.clock + 1} {ids}\n")
            self._applied(result.updates)
            if result.updates:
                self.ready.notify_all()
        self._maybe_snapshot(result.updates)
        self._maybe_die(result.updates)
        return PushResult(result.status, result.version)

    def _maybe_delay(self, fence: Fence, lease_ids: tuple[int, ...]) -> None:
        """`faults.delayed_pushes`: hold this push as a slow network would (outside the lock), once."""
        if not self.cfg.faults.delayed_pushes:
            return
        with self.lock:
            ticket = self.core.leases.find(lease_ids)
        for index, delayed in enumerate(self.cfg.faults.delayed_pushes):
            if ticket is not None and (delayed.slot, delayed.clock) == (fence.slot, ticket.clock) and index not in self._delayed:
                self._delayed.add(index)
                log.warning("injected fault: the push of %s for clock %d arrives %.1fs late", fence.slot, ticket.clock, delayed.delay_s)
                time.sleep(delayed.delay_s)

    def _maybe_die(self, updates: tuple[Update, ...]) -> None:
        """`faults.server`: the first incarnation SIGKILLs its own process once it has applied the fault's
        version, after the snapshot being stored (if one is) is stored."""
        if not updates or not self.cfg.faults.server or self.core.incarnation != 0:
            return
        if any(updates[-1].version >= fault.version for fault in self.cfg.faults.server):
            self.wait_snapshots(SNAPSHOT_WAIT_S)
            log.warning("injected fault: the parameter server dies at version %d (snapshot of version %d stored)",
                        updates[-1].version, self._snapshots.stored)
            os.kill(os.getpid(), signal.SIGKILL)

    def push_pull(self, fence: Fence, lease_ids: tuple[int, ...], pulled_version: int, grad: np.ndarray, loss: float,
                  wait_s: float, buffers: np.ndarray | None = None) -> tuple[PushResult, Pull | None, np.ndarray | None]:
        """A push and the sender's next pull in one call (one round trip a step); no pull after a push
        that was refused or came after the end."""
        result = self.push(fence, lease_ids, pulled_version, grad, loss, buffers)
        if result.status not in ("applied", "staged", "dropped"):
            return result, None, None
        pull, flat = self.pull(fence, wait_s)
        return result, pull, flat

    # ------------------------------------------------------------------ what applying a version entails
    def _applied(self, updates: tuple[Update, ...]) -> None:
        """Under the lock, right after the updates were applied: their records go out in version order
        (pushes apply in several threads; the reporter thread sends what is queued here, in order)."""
        if not updates:
            return
        every = self.cfg.eval_every
        records = tuple(self._record(u) for u in updates)
        if self.core.finished:
            self._end()
        due = every and records[-1]["step"] // every > (records[0]["step"] - 1) // every
        self._outbox.put((records, self._summary(), (self.core.parameters(), self.core.buffers()) if due else None))
        if any(u.barrier is not None for u in updates) and self.core.policy.r > 1:  # r: 1 needs no ZipLine
            intervals, self._intervals = self._intervals, {}
            self._outbox.put(("barrier", self.core.round.index, tuple(self.core.round.at), intervals))
        for file in (self._samples, self._pulls):
            if file is not None:
                file.flush()

    def _report_loop(self) -> None:
        """Evaluate where due, keep, and report the queued records, in version order: whatever queued up
        while the last report was on its way goes in one call (ASP applies many versions a second)."""
        while True:
            items = [self._outbox.get()]
            while True:
                try:
                    items.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._report(items)
            finally:
                for _ in items:
                    self._outbox.task_done()

    def _report(self, items: list[tuple]) -> None:
        records: list[dict] = []
        summary: dict = {}
        for item in items + [("end",)]:
            if item[0] in ("barrier", "end") and records:  # the records before it go first
                try:
                    self.reports.records(tuple(records), summary)
                except Exception as err:  # noqa: BLE001 - the coordinator may be restarting: it catches up from `kept`
                    log.warning("could not report versions %d..%d: %s", records[0]["step"], records[-1]["step"],
                                str(err).splitlines()[0][:200])
                records = []
            if item[0] == "barrier":
                try:
                    self.reports.barrier(*item[1:])
                except Exception as err:  # noqa: BLE001 - no schedule: the server's fallback holds
                    log.warning("could not report barrier %d: %s", item[1], str(err).splitlines()[0][:200])
            elif item[0] != "end":
                batch, summary, state = item
                if state is not None:  # evaluated at the newest version that crossed a multiple of eval_every
                    try:
                        batch[-1]["metrics"] = self._evaluate(*state)
                    except Exception as err:  # noqa: BLE001 - the record goes without metrics
                        log.warning("could not evaluate version %d: %s", batch[-1]["step"], str(err).splitlines()[0][:200])
                self.kept.extend(batch)
                records.extend(batch)

    def flush(self) -> None:
        """Wait until every queued record is kept and reported."""
        self._outbox.join()

    def _record(self, update: Update) -> dict:
        """One history record (called under the lock, right after the update was applied)."""
        core = self.core
        if self._samples is not None:
            for ticket in update.tickets:
                ids = " ".join(str(i) for lease in ticket.leases for i in lease.ids)
                self._samples.write(f"{update.version} {core.membership_epoch} {ids}\n")
        return {"step": update.version, "time": time.time(), "loss": update.loss, "lr": update.lr,
                "samples": update.samples, "staleness": list(update.staleness), "pushes": len(update.tickets),
                "world_size": len(core.members), "membership_epoch": core.membership_epoch,
                "global_batch": core.global_batch, "bytes_sent": self.bytes_sent,
                "server_incarnation": core.incarnation, **({"barrier": update.barrier} if core.elastic else {}),
                **({"grad_norm": update.grad_norm} if update.grad_norm is not None else {})}

    def _open_samples(self, name: str = "server.txt"):
        if not self.cfg.faults.record_samples:
            return None
        folder = self.run_dir / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / name, "a", encoding="utf-8")

    # ------------------------------------------------------------------ incarnations
    def _claim_incarnation(self, at_least: int) -> int:
        """A restart's incarnation, claimed on the job's storage before any push is fenced by it: above
        every one a restart of this run's server took (a snapshot may be older than the last restart:
        two restarts from one snapshot must not both take its incarnation + 1), even when two restarts
        claim at once (a read then a write would not do that on an object store; actors/runs/fencing.py)."""
        storage, key = self.snapshots
        return fencing.claim(storage, f"{key}/incarnations", at_least)

    # ------------------------------------------------------------------ snapshots
    def _maybe_snapshot(self, updates: tuple[Update, ...]) -> None:
        every = self.cfg.server.snapshot_every
        if not updates or updates[-1].version // every <= (updates[0].version - 1) // every:
            return
        with self.lock:  # the state's tensors are copies: the writer's thread serializes them while pushes go on
            state, version = self.core.state_dict(), self.core.version
        self._snapshots.submit(version, state)

    def load_checkpoint(self, blob: bytes) -> int:
        """`--resume`: take the server's state from a checkpoint (`model_state`'s) or one of its own
        snapshots, before any member is admitted; returns the version it resumes from."""
        state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
        state = state.get("server", state)
        with self.lock:
            if self.core.members or self.core.version:
                raise RuntimeError("a checkpoint is loaded only into a new server, before the first membership")
            self.core.load_state_dict(state)
            self.core.begin_run()
            self._flat_cache = None
            return self.core.version

    def _resume(self) -> None:
        """A restart: carry on from the newest valid snapshot (or the initial state when there is none),
        as a new incarnation."""
        ref = checkpoints.newest_valid(self.snapshots, warn=log.warning, pattern="checkpoints/step-*.json")
        if ref is not None:
            blob = checkpoints.read_verified(self.snapshots[0], ref.location)  # read once: the bytes verified
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
            self.core.load_state_dict(state)
        self.core.incarnation = self._claim_incarnation(self.core.incarnation + 1) - 1
        self.core.new_incarnation()  # takes the number claimed, and requeues what the snapshot's incarnation dealt
        log.warning("parameter server restarted as incarnation %d from version %d", self.core.incarnation, self.core.version)
        self.reports.restarted(self.core.version, self.core.incarnation, ref.location if ref else None)




def as_tensor(grad: np.ndarray) -> torch.Tensor:
    """A pushed gradient (or pulled parameters) as a tensor without a copy: Ray hands it over as a
    read-only view of the object store, which stays pinned as long as the tensor (the core holds a
    gradient until its clock is applied; a worker copies parameters into its model) and is only read."""
    grad = np.asarray(grad, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(grad)

