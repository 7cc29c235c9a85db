"""One training replica: model, optimizer, data shard and the committed-step loop.

A worker owns a *slot* (a stable id such as `w3`); its rank changes with every membership
epoch. `run()` is called exactly once and trains until the plan says stop; control methods
(`set_plan`, `abort_epoch`, `status`, `final_state`) run in their own concurrency group so they
answer while `run()` trains, and `watch()` in a third so it never starves them.

The step protocol: forward, backward with bucket all-reduces
launched from gradient hooks, and a *tail* reduced with the last bucket that carries the
weighted loss, the sample count, a failure flag and "I have seen a newer plan". A step is
committed only when every reduction succeeded here and the reduced failure count is zero.
When the tail says someone saw a newer plan, all members agree on the newest version with one
extra MAX all-reduce (rare path) and switch at the same step. At the start of every membership
epoch the members exchange (committed step, parameter checksum); the newest committed state is
broadcast from its lowest-ranked holder to anyone behind or different.
"""
from __future__ import annotations

import hashlib
import io
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any, Optional

import numpy as np
import ray
import torch

from actors.comm import BaseCommunicator, CommError, GroupSpec, make_communicator
from actors.plan import ParentWatch, Plan, Progress, WorkerSpec
from actors.sampler import GlobalSampler, split_for_rank
from algorithms.base import get_algorithm
from algorithms.optim import build_optimizer, lr_at, set_lr
from orchestrator.config import check_factory
from orchestrator.schema import JobConfig, KillFault, parse

TAIL = 3  # weighted loss, samples, saw-newer-plan
REPORT_EVERY_S = 0.25
log = logging.getLogger(__name__)
KEEP_RECORDS = 2048
"""Records each rank keeps of its newest committed steps, for the coordinator to catch up from
(a departed rank 0's unreported steps, a restarted coordinator's gap)."""


class InjectedFault(RuntimeError):
    """Raised by `faults.kills` entries with `at: user_exception`."""


def checksum(model: torch.nn.Module) -> int:
    """A digest of the parameters' bytes (any dtype: bf16 has no numpy type, so bytes are viewed raw)."""
    digest = hashlib.blake2b(digest_size=8)
    for p in model.parameters():
        digest.update(p.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


class FaultyComm:
    """Wraps a communicator so a `kills` entry with `at: allreduce` fires while one is in flight."""

    def __init__(self, inner: BaseCommunicator, worker: "Replica") -> None:
        self._inner = inner
        self._worker = worker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum"):
        kill = self._worker.due("allreduce")  # recorded first, so the kill lands while the op is in flight
        handle = self._inner.all_reduce(tensor, op)
        if kill is not None:
            self._worker.fire(kill)
        return handle


class Replica:
    """The training replica itself; a plain class so Ray's per-method wrappers stay off the hot path."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.slot = spec.slot
        self._parent = ParentWatch()
        self._redirect_output()
        self.cfg: JobConfig = parse(JobConfig, spec.config)
        logging.basicConfig(level=self.cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        for path in spec.search_path:
            if os.path.isdir(path) and path not in sys.path:
                sys.path.insert(0, path)
        torch.set_num_threads(max(1, int(self.cfg.workers.cpus)))
        os.environ["ORCHESTRATOR_SLOT"] = self.slot  # user code may read which slot it runs in
        torch.manual_seed(self.cfg.seed)  # identical initial replicas; verified by checksum
        self.workload = check_factory(self.cfg.workload.factory)(**self.cfg.workload.params)
        self.model: torch.nn.Module = self.workload.model
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optimizer)
        algo_cls = get_algorithm(self.cfg.sync.policy)
        sync = self.cfg.sync
        self.algorithm = algo_cls(bucket_mb=sync.bucket_mb, s=sync.s, r=sync.r, k=sync.k, h=sync.h, method=sync.method)
        self.impl = self.algorithm.bind(self.model, self.optimizer)
        self.sampler = GlobalSampler(len(self.workload.train_data), self.cfg.seed)
        self._fast_index = isinstance(self.workload.train_data, torch.utils.data.TensorDataset)
        self.step = 0
        self.cursor = 0
        self._cuda = self.cfg.workers.gpus > 0 and torch.cuda.is_available()
        self.rng = np.random.default_rng([self.cfg.seed, int(self.slot[1:])])
        """Per-slot numpy stream for user augmentation; re-derived every step like torch's."""
        self.plan: Optional[Plan] = None
        self.latest: Optional[Plan] = None
        self.plans: dict[int, Plan] = {}
        self.comm: Optional[BaseCommunicator] = None
        self.comm_epoch = -1
        self.state = "ready"
        self.cause = ""
        self.phase, self.phase_since = "starting", time.monotonic()
        self._plan_cv = threading.Condition()
        self._finished = threading.Event()
        self._outcome: dict = {}
        self._records: list[dict] = []
        self.kept: deque[dict] = deque(maxlen=KEEP_RECORDS)
        """History records of this replica's newest committed steps (every rank keeps them; rank 0 reports)."""
        self._last_report = 0.0
        self._pending_report = None
        self._fired: set[int] = set()
        self._coordinator = None
        self.max_steps = self.cfg.stop.max_steps
        self._slowdown = max([s.slowdown for s in self.cfg.faults.stragglers if s.slot == self.slot] or [1.0])
        self.compute_s = 0.0
        self._last_ids = np.empty(0, dtype=np.int64)
        self._samples = None
        if self.cfg.faults.record_samples:
            os.makedirs(os.path.join(spec.run_dir, "samples"), exist_ok=True)
            self._samples = open(os.path.join(spec.run_dir, "samples", f"{self.slot}.txt"), "a", encoding="utf-8")

    # ------------------------------------------------------------------ control group
    def ready(self, fired_faults: tuple[int, ...] = ()) -> dict:
        self._fired = set(fired_faults)
        return {"slot": self.slot, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "checksum": checksum(self.model)}

    def set_plan(self, plan: Plan) -> None:
        with self._plan_cv:
            self.plans[plan.version] = plan
            if self.latest is None or plan.version > self.latest.version:
                self.latest = plan
            self._plan_cv.notify_all()

    def abort_epoch(self, membership_epoch: int, reason: str) -> None:
        comm = self.comm
        if comm is not None and self.comm_epoch <= membership_epoch:
            comm.abort(reason)

    def heartbeat(self) -> dict:
        """Cheap liveness and progress: what the run thread is doing and for how long."""
        return {"step": self.step, "phase": self.phase, "phase_age_s": time.monotonic() - self.phase_since}

    def _enter_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    def status(self) -> dict:
        plan = self.plan
        return {"slot": self.slot, "pid": os.getpid(), "step": self.step, "state": self.state, "checksum": checksum(self.model),
                "rank": plan.rank_of(self.slot) if plan else -1, "membership_epoch": plan.membership_epoch if plan else 0,
                "plan": self.latest}

    def load_checkpoint(self, data: bytes) -> int:
        """Resume: this member starts from a disk checkpoint; the epoch start spreads it to the rest."""
        self._load_state_bytes(data)
        return self.step

    def final_state(self) -> bytes:
        """The whole training state (model, optimizer, step, data position, ...), as a checkpoint holds it."""
        return self._state_bytes()

    def records_after(self, step: int) -> tuple[dict, ...]:
        """The kept history records of committed steps after `step` (a restarted coordinator's catch-up)."""
        return tuple(r for r in list(self.kept) if r["step"] > step)

    def watch(self) -> dict:
        """Returns when run() ends (with its outcome); raises ActorDiedError if the process dies."""
        self._finished.wait()
        return self._outcome

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        try:
            self._loop()
            self._outcome = {"ok": True, "step": self.step, "slot": self.slot}
            self.state = "finished"
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the coordinator
            self.state = "failed"
            self._outcome = {"ok": False, "step": self.step, "slot": self.slot, "error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()}
        finally:
            self._flush_report(force=True)
            self._finished.set()
        return self._outcome

    def _loop(self) -> None:
        self.plan = self._wait_for_admission()
        while True:
            plan = self.plan
            if plan.rank_of(self.slot) is None:
                return  # left the job (scale-down): finish cleanly
            if self.comm is None or self.comm.name != plan.group_name:
                if not self._enter_epoch(plan):
                    self.plan = self._wait_for_plan(newer_than=plan.version)
                    continue
            if self._should_stop(plan):
                self._final_eval()
                return
            self.state = "training"
            ok = self._train_step(plan)
            if not ok:
                self.state = "waiting"
                self._flush_report(force=True)  # committed steps reach history before any teardown
                self.plan = self._wait_for_plan(newer_than=plan.version)

    def _should_stop(self, plan: Plan) -> bool:
        if self.max_steps is not None and self.step >= self.max_steps:
            return True
        return plan.stop_step is not None and self.step >= plan.stop_step

    def _wait_for_admission(self) -> Plan:
        """The plan that admits this worker and `run()` travel on different concurrency groups, so
        `run()` may start before that plan has arrived: wait until some plan names this slot (a
        later one may already drop it again, and then the worker leaves)."""
        self._enter_phase("waiting")
        with self._plan_cv:
            while not any(self.slot in p.members for p in self.plans.values()):
                self._plan_cv.wait(0.5)
                self._parent.exit_if_orphaned()
            return self.latest

    def _wait_for_plan(self, newer_than: int) -> Plan:
        self._enter_phase("waiting")
        with self._plan_cv:
            while self.latest is None or self.latest.version <= newer_than:
                self._plan_cv.wait(0.5)
                self._parent.exit_if_orphaned()
            return self.latest

    def _enter_epoch(self, plan: Plan) -> bool:
        if self.comm is not None:
            self.comm.close()
        self.comm = None
        rank = plan.rank_of(self.slot)
        spec = GroupSpec(plan.store_host, plan.store_port, plan.group_name, rank, len(plan.members), plan.timeout_s,
                         plan.backend, ray.util.get_node_ip_address())
        self.state = "joining"
        self._enter_phase("joining")
        try:
            comm = self._form(spec, plan)
            if comm is None:
                return False  # a newer membership arrived while forming: go straight to it
            self.comm_epoch = plan.membership_epoch
            self.comm = comm
            source = self._reconcile(comm)
            if rank == 0:  # the newest committed step is agreed: history takes it, and any step it lacks
                missing = tuple(r for r in self.kept if r["step"] > plan.history_step)
                self._coord().epoch_agreed.remote(plan.membership_epoch, self.step, missing)
        except CommError as err:
            self.cause = str(err)
            if self.comm is not None:
                self.comm.close()
                self.comm = None
            return False
        self.impl.on_membership(FaultyComm(comm, self) if self._has_fault("allreduce") else comm)
        if source is not None:
            self._coord().state_received.remote(self.slot, plan.membership_epoch, plan.members[source], self.step)
            self.maybe_fire("join")  # a joiner that has its state but has not trained yet
        return True

    def _form(self, spec: GroupSpec, plan: Plan) -> Optional[BaseCommunicator]:
        """Form the group in a helper thread, abandoning it if a newer membership is published meanwhile.

        Group construction blocks in C++ until every member arrives or the timeout; a member
        that waited for a superseded epoch would otherwise miss the next one.
        """
        result: dict = {}
        done = threading.Event()

        def build() -> None:
            try:
                result["comm"] = make_communicator(spec)
            except BaseException as err:  # noqa: BLE001 - re-raised in the run thread, whatever it is
                result["error"] = err
            finally:
                done.set()
                if result.get("abandoned") and "comm" in result:
                    result["comm"].close()

        threading.Thread(target=build, name=f"form {spec.name}", daemon=True).start()
        while not done.wait(0.02):
            latest = self.latest
            if latest.version > plan.version and latest.membership_epoch != plan.membership_epoch:
                result["abandoned"] = True
                if done.is_set() and "comm" in result:
                    result["comm"].close()
                return None
        if "error" in result:
            raise result["error"]
        return result["comm"]

    def _reconcile(self, comm: BaseCommunicator) -> Optional[int]:
        """Agree on the newest committed state; its lowest-ranked holder broadcasts it if needed.

        Returns the source rank when this member loaded the state, else None.
        """
        mine = torch.tensor([self.step, checksum(self.model)], dtype=torch.int64)
        views = [torch.zeros(2, dtype=torch.int64) for _ in range(comm.world_size)]
        comm.all_gather(views, mine).wait()
        newest = max(int(v[0]) for v in views)
        src = min(r for r, v in enumerate(views) if int(v[0]) == newest)
        if all(torch.equal(v, views[src]) for v in views):
            return None
        size = torch.zeros(1, dtype=torch.int64)
        blob = self._state_blob() if comm.rank == src else None
        if blob is not None:
            size[0] = blob.numel()
        comm.broadcast(size, src).wait()
        if blob is None:
            blob = torch.empty(int(size[0]), dtype=torch.uint8)
        comm.broadcast(blob, src).wait()
        if comm.rank == src or torch.equal(views[comm.rank], views[src]):
            return None  # the broadcast is collective, but a member already at the newest state keeps its own
        self._load_state_blob(blob)
        return src

    def _state_bytes(self) -> bytes:
        """The whole training state: what a joiner receives and what a checkpoint holds."""
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "cursor": self.cursor, "algorithm": self.impl.state_dict(),
                    "record": self.kept[-1] if self.kept else None,
                    "rng": {"torch": torch.get_rng_state(), "numpy": self.rng.bit_generator.state}}, buf)
        return buf.getvalue()

    def _state_blob(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self._state_bytes()), dtype=torch.uint8)

    def _load_state_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.impl.load_state_dict(state["algorithm"])
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        record = state.get("record")
        if record is not None and (not self.kept or self.kept[-1]["step"] < record["step"]):
            self.kept.append(record)
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])
            self.rng.bit_generator.state = state["rng"]["numpy"]

    def _load_state_blob(self, blob: torch.Tensor) -> None:
        self._load_state_bytes(blob.numpy().tobytes())

    # ------------------------------------------------------------------ one step
    def _micro_batches(self, plan: Plan) -> list[tuple[Any, int]]:
        """This rank's share of the next global batch, in chunks of at most `workload.micro_batch`."""
        ids = self.sampler.global_batch(self.cursor, plan.global_batch)
        mine = split_for_rank(ids, plan.rank_of(self.slot), len(plan.members))
        self._last_ids = mine
        size = self.cfg.workload.micro_batch or max(len(mine), 1)
        return [self._collate(mine[i:i + size]) for i in range(0, len(mine), size)]

    def _collate(self, ids: np.ndarray) -> tuple[Any, int]:
        data = self.workload.train_data
        if self._fast_index:
            index = torch.from_numpy(ids)
            return tuple(t[index] for t in data.tensors), len(ids)
        return torch.utils.data.default_collate([data[int(i)] for i in ids]), len(ids)

    def _seed_step(self) -> None:
        """Randomness (dropout, augmentation) from streams derived from (seed, slot, step)."""
        seq = np.random.SeedSequence([self.cfg.seed, int(self.slot[1:]), self.step])
        value = int(seq.generate_state(1, np.uint64)[0] >> 1)
        torch.default_generator.manual_seed(value)  # torch.manual_seed walks every backend: 175 us
        if self._cuda:
            torch.cuda.manual_seed(value)
        self.rng = np.random.default_rng(seq)

    def _train_step(self, plan: Plan) -> bool:
        started = time.perf_counter()
        self._enter_phase("compute")
        self._parent.exit_if_orphaned()
        self._seed_step()
        self.maybe_fire("step")
        self.maybe_fire("user_exception")
        micro = self._micro_batches(plan)
        tail = torch.zeros(TAIL, dtype=torch.float32)
        self.impl.begin_step(self.step, tail)
        self.impl.before_forward(self.step)
        tail[1] = sum(n for _, n in micro)
        tail[2] = 1.0 if self.latest.version > plan.version else 0.0
        try:
            for i, (batch, n) in enumerate(micro):
                self.impl.accumulating = i < len(micro) - 1
                weight = n / plan.global_batch  # each sample counts 1/global batch, however it is split
                loss = self.workload.loss(self.model, batch)
                tail[0] += float(loss.detach()) * weight  # before the backward that launches the last bucket
                (loss * weight).backward()
            self.impl.end_backward(self.step)
            self._enter_phase("communicate")
            self.compute_s = 0.9 * self.compute_s + 0.1 * (time.perf_counter() - started) if self.compute_s else time.perf_counter() - started
            reduced = self.impl.finish_step(self.step)
            self._maybe_lose_vote()
        except CommError as err:
            self.cause = str(err)
            self._report_collective_failure(plan, err)
            return False
        if self._slowdown > 1.0:
            time.sleep((time.perf_counter() - started) * (self._slowdown - 1.0))
        counted = int(round(float(reduced[1])))
        if counted != plan.global_batch:  # every member runs the same plan: a mismatch is a bug, not a vote
            raise RuntimeError(f"the commit vote of step {self.step + 1} counted {counted} samples; the plan's global "
                               f"batch is {plan.global_batch}")
        set_lr(self.optimizer, lr_at(self.step, self.cfg.optimizer, self.max_steps, plan.lr_scale))
        self.optimizer.step()
        self.impl.after_optimizer_step(self.step)
        self.step += 1
        self.cursor += plan.global_batch
        if self._samples is not None:
            self._samples.write(f"{self.step} {plan.membership_epoch} {' '.join(map(str, self._last_ids.tolist()))}\n")
            self._samples.flush()
        self._record(plan, float(reduced[0]), started, len(micro))
        self._maybe_checkpoint(plan)
        if reduced[2] > 0:
            return self._adopt_newest_plan()
        return True

    def _report_collective_failure(self, plan: Plan, err: CommError) -> None:
        """Tell the coordinator at once: a peer may be gone without Ray knowing yet (a lost node)."""
        if not self.comm or not self.comm.aborted:
            try:
                self._coord().collective_failed.remote(self.slot, plan.membership_epoch, str(err)[:300])
            except Exception as failure:  # noqa: BLE001 - the coordinator may be restarting; its abort comes anyway
                log.warning("could not tell the coordinator that a collective failed: %s", failure)

    def _adopt_newest_plan(self) -> bool:
        """Rare path: someone saw a newer plan; agree on the newest with one MAX all-reduce.

        Every member is sent every plan, so one this member has not received yet is on its way: it
        waits for it (asking the coordinator instead would fail while the coordinator restarts). If
        a still newer plan arrives first, that one supersedes the agreed one: wait for it instead.
        """
        version = torch.tensor([float(self.latest.version)])
        try:
            self.comm.all_reduce(version, "max").wait()
        except CommError as err:
            self.cause = str(err)
            return False
        wanted = int(version[0])
        with self._plan_cv:
            while wanted not in self.plans and self.latest.version < wanted:
                self._plan_cv.wait(0.5)
                self._parent.exit_if_orphaned()
        if wanted not in self.plans:
            return False
        self.plan = self.plans[wanted]
        return True

    def _maybe_checkpoint(self, plan: Plan) -> None:
        every = self.cfg.checkpoint.every_steps
        if not every or self.step % every:
            return
        self.maybe_fire("checkpoint")
        if plan.rank_of(self.slot) == 0:
            self._flush_report(force=True)  # history up to this step precedes the checkpoint
            self._coord().save_checkpoint.remote(self.step, self._state_bytes())

    # ------------------------------------------------------------------ reporting
    def _record(self, plan: Plan, loss: float, started: float, micro_steps: int) -> None:
        record = {"step": self.step, "time": time.time(), "loss": loss, "world_size": len(plan.members),
                  "global_batch": plan.global_batch, "micro_steps": micro_steps,
                  "membership_epoch": plan.membership_epoch, "bytes_sent": self.impl.bytes_sent,
                  "lr": self.optimizer.param_groups[0]["lr"], "step_time": time.perf_counter() - started}
        self.kept.append(record)
        if plan.rank_of(self.slot) == 0:
            every = self.cfg.eval_every
            if every and self.step % every == 0:
                record.update(self._evaluate())
            self._records.append(record)
        self._flush_report()

    def _evaluate(self) -> dict:
        evaluate = getattr(self.workload, "evaluate", None)
        data = getattr(self.workload, "eval_data", None)
        if evaluate is None or data is None:
            return {}
        return {"metrics": {k: float(v) for k, v in evaluate(self.model, data).items()}}

    def _final_eval(self) -> None:
        """Rank 0 evaluates the final model; the record updates status, not history."""
        if self.plan is not None and self.plan.rank_of(self.slot) == 0:
            self._records.append({"step": self.step, "time": time.time(), "final": True, **self._evaluate()})

    def _flush_report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_report < REPORT_EVERY_S:
            return
        self._last_report = now
        epoch = self.plan.membership_epoch if self.plan else 0
        progress = Progress(self.slot, self.step, epoch, time.time(), tuple(self._records), self.compute_s)
        self._records = []
        try:
            ref = self._coord().report.remote(progress)
            if force:
                ray.get(ref, timeout=10)
        except Exception as err:  # noqa: BLE001 - a lost report must not kill training (records are kept)
            log.warning("progress report at step %d lost: %s", self.step, str(err).splitlines()[0][:200])

    def _coord(self):
        if self._coordinator is None:
            self._coordinator = ray.get_actor(self.spec.coordinator, namespace=self.spec.namespace)
        return self._coordinator

    # ------------------------------------------------------------------ faults
    def _has_fault(self, phase: str) -> bool:
        return any(k.slot == self.slot and k.at == phase for k in self.cfg.faults.kills)

    def maybe_fire(self, phase: str) -> None:
        kill = self.due(phase)
        if kill is not None:
            self.fire(kill)

    def due(self, phase: str) -> Optional[KillFault]:
        """The kill entry that fires now in this phase, recorded with the coordinator (fires once)."""
        for index, kill in enumerate(self.cfg.faults.kills):
            at_step = kill.step <= self.step if phase == "join" else kill.step == self.step
            if kill.slot != self.slot or kill.at != phase or not at_step:
                continue
            if index in self._fired and not kill.repeat:
                continue
            self._fired.add(index)
            try:
                ray.get(self._coord().fault_fired.remote(index, self.slot, self.step, phase), timeout=5)
            except Exception as err:  # noqa: BLE001 - the fault fires anyway
                log.warning("could not record fault #%d with the coordinator: %s", index, str(err).splitlines()[0][:200])
            return kill
        return None

    def _maybe_lose_vote(self) -> None:
        """`at: vote`: this member loses the result of a vote the others commit (a split commit)."""
        if self.due("vote") is not None:
            raise CommError(f"injected fault: {self.slot} lost the result of the commit vote for step {self.step + 1}")

    def fire(self, kill: KillFault) -> None:
        if kill.how == "raise":
            raise InjectedFault(f"injected user exception in slot {self.slot} at step {self.step}")
        if kill.how == "hang":
            while True:  # a step that never ends; control calls still answer
                time.sleep(1.0)
        sys.stdout.flush()
        if kill.how == "exit":
            os._exit(1)
        if kill.how == "actor_kill":
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            time.sleep(10)
        os.kill(os.getpid(), signal.SIGKILL)

    def _redirect_output(self) -> None:
        """Worker output (and user prints) goes to the run directory, not the user's screen."""
        log_dir = os.path.join(self.spec.run_dir, "workers")
        os.makedirs(log_dir, exist_ok=True)
        fd = os.open(os.path.join(log_dir, f"{self.slot}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


class Worker:
    """The Ray actor: `run()` once in the default group, control methods in their own group."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.replica = Replica(spec)

    def run(self) -> dict:
        return self.replica.run()

    @ray.method(concurrency_group="watch")
    def watch(self) -> dict:
        return self.replica.watch()

    @ray.method(concurrency_group="control")
    def ready(self, fired_faults: tuple[int, ...] = ()) -> dict:
        return self.replica.ready(fired_faults)

    @ray.method(concurrency_group="control")
    def set_plan(self, plan: Plan) -> None:
        self.replica.set_plan(plan)

    @ray.method(concurrency_group="control")
    def abort_epoch(self, membership_epoch: int, reason: str) -> None:
        self.replica.abort_epoch(membership_epoch, reason)

    @ray.method(concurrency_group="control")
    def status(self) -> dict:
        return self.replica.status()

    @ray.method(concurrency_group="control")
    def heartbeat(self) -> dict:
        return self.replica.heartbeat()

    @ray.method(concurrency_group="control")
    def load_checkpoint(self, data: bytes) -> int:
        return self.replica.load_checkpoint(data)

    @ray.method(concurrency_group="control")
    def final_state(self) -> bytes:
        return self.replica.final_state()

    @ray.method(concurrency_group="control")
    def records_after(self, step: int) -> tuple[dict, ...]:
        return self.replica.records_after(step)


# Every coordinator incarnation keeps one watch() pending: the dead one's stays until run() ends.
WorkerActor = ray.remote(concurrency_groups={"control": 4, "watch": 8})(Worker)
