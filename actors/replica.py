"""One training replica: model, optimizer, data shard and the step loop. No Ray here.

A replica owns a *slot* (a stable id such as `w3`); its rank changes with every membership epoch.
`run()` trains until the plan says stop. It talks to its coordinator only through a `Link` (the
Ray actor in actors/worker.py provides one over Ray; tests run replicas in threads with an
in-process one), and its synchronization policy only through the seam of algorithms/base.py:

    each step      forward and backward (the policy's hooks launch communication), then the
                   policy's vote: a step whose vote fails is not applied; one that passes is
                   applied and, when it is a commit point, becomes the committed state
    each round     periodic policies: `sync` is the round and its vote, the commit point of the
                   local steps before it (which stay provisional until then)
    each epoch     a new group is formed and entered (actors/entry.py): the members agree on the
                   newest committed state before training on

Every committed state is marked (step, data cursor); history records, checkpoints, the final model
and the state a joiner receives are all taken at a commit point. Data: every member computes each
step's global batch from (seed, cursor) and trains its rank's share, so within a data epoch no
sample is applied twice across any number of reshapes; a departed member's shares of periodic
local steps that the survivors keep are counted as dropped.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import io
import logging
import os
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from actors import collective, runfiles
from actors.comm import BaseCommunicator, CommError, GroupSpec, NoGroup, form_in_thread, make_communicator
from actors.entry import enter, enter_switched
from actors.faults import WorkerFaults
from actors.loader import BatchLoader, ProcessFetcher
from actors.plan import Plan, PlanBook, Progress, WorkerSpec
from actors.sources import Fetched, source_for
from algorithms.base import EpochInfo, StepVote, VoteDraft, get_algorithm
from algorithms.optim import build_optimizer, lr_at
from algorithms.sampler import split_for_rank
from core.factory import check_factory
from core.schema import JobConfig, WorkloadRefused, parse

log = logging.getLogger(__name__)
REPORT_EVERY_S = 0.25
REPORTS_PER_S = 2000.0
"""The coordinator's share of reports: a member reports every REPORT_EVERY_S, or less often in a job
so large that all of them together would send more than this many per second (Ray's own figure for
calls into one async actor from one caller is 4,100-4,800 per second; see docs/control-plane.md)."""
CHECKPOINT_STORED_S = 300.0
"""How long the end of a run waits for its last checkpoint to be stored (a large upload)."""
KEEP_RECORDS = 2048
"""Records each member keeps of its newest commit points, for the coordinator to catch up from
(a departed rank 0's unreported steps, a restarted coordinator's gap)."""


class Link(Protocol):
    """How a replica reaches its coordinator (every call may be lost; none may block training long)."""

    def report(self, progress: Progress, wait: bool) -> None: ...
    def epoch_agreed(self, epoch: int, step: int, records: tuple[dict, ...]) -> None: ...
    def state_received(self, slot: str, epoch: int, source: str, step: int) -> None: ...
    def collective_failed(self, slot: str, epoch: int, error: str) -> None: ...
    def fault_fired(self, index: int, slot: str, step: int, phase: str) -> None: ...
    def samples_skipped(self, slot: str, step: int, ids: list[int], reason: str) -> None: ...
    def save_checkpoint(self, step: int, blob: bytes) -> None: ...
    def checkpoints_stored(self, timeout: float) -> None:
        """Returns once the checkpoints sent so far are stored (or raises, or `timeout` passed)."""


def checksum(tensors) -> int:
    """A digest of the tensors' bytes (any dtype: bf16 has no numpy type, so bytes are viewed raw)."""
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(digest.digest(), "little", signed=True)


class Replica:
    def __init__(self, spec: WorkerSpec, link: Link, node_ip: str, tick: Callable[[], None] = lambda: None,
                 kill_actor: Callable[[], None] = lambda: None, server: Any = None, workload: Any = None) -> None:
        """`tick` runs while the replica waits (the orphan check); `kill_actor` for `how: actor_kill` faults;
        `server`: the parameter server's client (algorithms/server_policies.py), for server kinds;
        `workload`: one `build_workload` made earlier (a hot spare's), else it is built here."""
        self.spec, self.slot, self.link, self.node_ip, self._tick = spec, spec.slot, link, node_ip, tick
        self.cfg: JobConfig = parse(JobConfig, spec.config)
        self.comm_address = node_ip
        """Where this member's group traffic leaves from: the node's address, or in the lab its virtual
        node's (orchestrator/lab.py; the preloaded shim binds its connections there too)."""
        network = self.cfg.network
        if network.lab and not spec.slot.startswith("spare"):
            self.comm_address = network.address(network.node_of(spec.slot))
            os.environ["ORCHESTRATOR_LAB_SOURCE"] = self.comm_address
        torch.set_num_threads(max(1, int(self.cfg.workers.cpus)))
        self.device = _device(self.cfg.workers.gpus)
        self.workload = workload if workload is not None else build_workload(self.cfg)
        self.model: torch.nn.Module = self.workload.model.to(self.device)
        self.model.train()
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.optimizer)
        self.algorithm = get_algorithm(self.cfg.sync.policy)(self.cfg.sync, self.cfg.compression)
        self.impl = self.algorithm.bind(self.model, self.optimizer)
        self.impl.on_gradients_ready = self._gradients_ready
        self._gradients_at: float | None = None
        if server is not None and self.algorithm.kind in ("server", "background"):
            self.impl.connect(server, self.slot, spec.incarnation)  # fenced by (slot, worker incarnation)
        if self.algorithm.kind == "background":  # its own group per epoch, formed off the foreground
            self.impl.attach(self._background_group, self._state_bytes, self._load_state_bytes, self._background_failed,
                             lambda source, epoch: self.link.state_received(self.slot, epoch, source, self.step))
        self.param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.source = source_for(self.workload.train_data, self.cfg.seed, self.cfg.workload.on_bad_sample,
                                 functools.partial(_ray_blocks, spec), self.algorithm.kind)
        loader = self.cfg.workload.loader
        self._loader = BatchLoader(loader.workers, loader.prefetch) if loader.workers > 0 else None
        self._fetcher: ProcessFetcher | None = None
        if loader.workers > 0 and loader.processes:
            if self.source.kind not in ("map-style", "datasets"):
                raise WorkloadRefused(f"workload.loader.processes reads map-style or Hugging Face data by id; this "
                                      f"train_data is a {self.source.kind} source (use loader threads)")
            self._fetcher = ProcessFetcher(loader.workers, spec.config)
        self._copy_stream: Any = None
        """The loader's CUDA stream for its copies to the device (created at its first batch on a GPU)."""
        self.tokens_per_sample = int(getattr(self.workload, "tokens_per_sample", None) or 0)
        self.step = self.cursor = 0
        self.holds_state = False
        """It trained a step or loaded a state (entry `average`: a member that never did receives one)."""
        self.mark_cursor = 0
        """The data cursor at the newest commit point."""
        self._slot_index = int(self.slot[1:])
        self.plans = PlanBook(tick)
        self.plan: Plan | None = None
        self.trained_plan: Plan | None = None
        """The plan under which the provisional steps since the last commit were trained."""
        self._dropped_slots: set[str] = set()
        """Departed members whose shares of those steps were already counted as dropped."""
        self.comm: BaseCommunicator | None = None
        self.state, self.cause = "ready", ""
        self.phase, self.phase_since = "starting", time.monotonic()
        self.exit_if_stuck: Callable[[str], None] | None = None
        """Set by the worker actor: ends this process when a step outlives its group's abort (`watch_release`);
        None in process (replicas in threads of a test), where the group's timeout ends such a step."""
        self._finished = threading.Event()
        self._left = False
        self._eval_model: torch.nn.Module | None = None
        self._waited = 0.0
        """Seconds the newest step waited on others: for its samples, the policy's lock, its collectives."""
        self._outcome: dict = {}
        self._records: list[dict] = []
        self.kept: deque[dict] = deque(maxlen=KEEP_RECORDS)
        """History records of this replica's newest commit points (every member keeps them)."""
        self._last_report = 0.0
        self.compute_s = 0.0
        self._step_s: list[float] = []
        self.bytes_before = 0
        """Bytes this member sent in earlier membership epochs (each epoch's communicator counts its own)."""
        self.dropped = 0
        """Samples handed to departed members since the last record and counted as dropped."""
        self.max_steps = self.cfg.stop.max_steps if self.algorithm.counts_steps else None
        self.faults = WorkerFaults(self.cfg.faults, self.slot, link.fault_fired, kill_actor)
        self._pending_ids: list[tuple[int, np.ndarray]] = []
        self._samples = None
        if self.cfg.faults.record_samples and self.algorithm.reporter != "server":  # the server writes what it applies
            os.makedirs(os.path.join(spec.run_dir, "samples"), exist_ok=True)
            self._samples = runfiles.open_appended(os.path.join(spec.run_dir, "samples", f"{self.slot}.txt"))

    # ------------------------------------------------------------------ control (any thread)
    def ready(self, fired_faults: tuple[int, ...] = ()) -> dict:
        self.faults.fired = set(fired_faults)
        return {"slot": self.slot, "pid": os.getpid(), "node": self.node_ip, "checksum": checksum(self.model.parameters())}

    def set_plan(self, plan: Plan) -> None:
        self.plans.add(plan)

    def abort_epoch(self, membership_epoch: int, reason: str) -> None:
        comm, plan = self.comm, self.plan
        if comm is not None and plan is not None and plan.membership_epoch <= membership_epoch:
            comm.abort(reason)
            if self.phase in STEP_PHASES and self.exit_if_stuck is not None:
                grace = max(STUCK_AFTER_ABORT_S, 5.0 * self.compute_s)
                watch_release(lambda: self.comm is not comm or self.phase not in STEP_PHASES, grace,
                              lambda: self.exit_if_stuck(f"the step of {self.slot} still runs {grace:.0f}s after group "
                                                         f"{comm.name} was aborted ({reason}): an operation stuck in C++ "
                                                         f"that the abort did not release"))

    def heartbeat(self) -> dict:
        """Cheap liveness and progress: what the run thread is doing and for how long."""
        return {"step": self.step, "phase": self.phase, "phase_age_s": time.monotonic() - self.phase_since}

    def status(self) -> dict:
        plan = self.plan
        mark, digest = self.committed_view()
        return {"slot": self.slot, "pid": os.getpid(), "step": mark, "checksum": digest, "state": self.state,
                "holds_state": self.holds_state,
                "rank": plan.rank_of(self.slot) if plan else -1, "membership_epoch": plan.membership_epoch if plan else 0,
                "plan": self.plans.latest}

    def load_checkpoint(self, data: bytes) -> int:
        """Resume: this member starts from a disk checkpoint; the epoch start spreads it to the rest."""
        self._load_state_bytes(data)
        return self.step

    def final_state(self) -> bytes:
        """The committed training state (model, optimizer, step, data position, ...), as a checkpoint holds it."""
        return self._state_bytes()

    def evaluate_state(self, blob: bytes) -> dict:
        """The workload's metrics of a model state (the average of the replicas), on a copy of the model."""
        evaluate, data = getattr(self.workload, "evaluate", None), getattr(self.workload, "eval_data", None)
        if evaluate is None or data is None:
            return {}
        model = copy.deepcopy(self.model)
        model.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")["model"])
        model.eval()
        return {k: float(v) for k, v in evaluate(model, data).items()}

    def records_after(self, step: int) -> tuple[dict, ...]:
        """The kept history records of commit points after `step` (a restarted coordinator's catch-up)."""
        return tuple(r for r in list(self.kept) if r["step"] > step)

    def watch(self) -> dict:
        """Returns when run() ends, with its outcome."""
        self._finished.wait()
        return self._outcome

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        try:
            self._loop()
            self._outcome = {"ok": True, "step": self.step, "slot": self.slot, "holds_state": self.holds_state}
            self.state = "finished"
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the coordinator
            self.state = "failed"
            self._outcome = {"ok": False, "step": self.step, "slot": self.slot, "error": f"{type(err).__name__}: {err}",
                             "traceback": traceback.format_exc()}
        finally:
            if self._loader is not None:
                self._loader.close()
            if self._fetcher is not None:
                self._fetcher.close()
            collective.withdraw(self.comm)
            self.impl.close(finished=self.state == "finished" and not self._left)
            self._flush_report(force=True)
            self._await_checkpoints()
            self._finished.set()
        return self._outcome

    def _loop(self) -> None:
        self._enter_phase("waiting")
        self.plan = self.plans.admission(self.slot)
        while True:
            if self.algorithm.entry in ("server", "none"):
                self.plan = self.plans.latest  # no lockstep to keep: such a member takes a plan at once
            plan = self.plan
            if plan.rank_of(self.slot) is None:
                self._left = True
                return  # left the job (scale-down): finish cleanly
            if self.comm is None or self.comm.name != plan.group_name:
                if not self._enter_epoch(plan):
                    self._enter_phase("waiting")
                    self.plan = self.plans.newer_than(plan.version)
                    continue
            stop_at = self._stop_at(plan)
            if self.impl.sync_due(self.step, stop_at):
                ok = self._sync(plan)
            elif (stop_at is not None and self.step >= stop_at) or self.impl.stop_requested():
                self._final_eval()
                return
            else:
                ok = self._train_step(plan)
            if not ok:
                self.state = "waiting"
                self._flush_report(force=True)  # committed steps reach history before any teardown
                self._enter_phase("waiting")
                self.plan = self.plans.newer_than(plan.version)

    def _stop_at(self, plan: Plan) -> int | None:
        limits = [s for s in (self.max_steps, plan.stop_step) if s is not None]
        return min(limits) if limits else None

    def _enter_phase(self, phase: str) -> None:
        self.phase, self.phase_since = phase, time.monotonic()

    def _gradients_ready(self) -> None:
        """This member's gradients are computed; its backward now waits for the sums (the reducer)."""
        self._gradients_at = time.perf_counter()
        self._enter_phase("communicate")

    # ------------------------------------------------------------------ membership epochs
    def _enter_epoch(self, plan: Plan) -> bool:
        if self.comm is not None:
            self.impl.on_epoch_end(f"membership epoch {plan.membership_epoch} begins")
            self.bytes_before += self.comm.bytes_sent
            collective.withdraw(self.comm)
            self.comm.close()
        self.comm = None
        if plan.policy is not None:  # the coordinator switched the policy (the online trial of `sync.auto`)
            self._switch_policy(plan.policy["sync"], plan.policy["compression"])
        rank = plan.rank_of(self.slot)
        spec = GroupSpec(plan.store_host, plan.store_port, plan.group_name, rank, len(plan.members), plan.timeout_s,
                         plan.backend, self.comm_address, secret=self.spec.secret)
        self.state = "joining"
        self._enter_phase("joining")
        previous = self.trained_plan
        try:
            comm = NoGroup(spec) if self.algorithm.entry in ("server", "none") else self._form(spec, plan)
            if comm is None:
                return False  # a newer membership arrived while forming: go straight to it
            self.comm = comm
            self._model_latency(comm, plan)
            source = enter(self.algorithm.entry, self, comm)
            if plan.policy is not None and plan.policy.get("fresh"):
                switched = enter_switched(self, comm)
                source = source if switched is None else switched
            if self.impl.commit_mark is None:
                self._pending_ids = []  # a step that failed everywhere is redone: its samples were not applied
            elif self.step > self.impl.commit_mark:
                self._count_dropped(previous, plan)  # local steps kept: the departed members' shares are lost
            if rank == 0 and self.algorithm.entry == "replicated":  # history takes the agreed step, and any it lacks
                missing = tuple(r for r in self.kept if r["step"] > plan.history_step)
                self.link.epoch_agreed(plan.membership_epoch, self._mark(), missing)
        except CommError as err:
            self.cause = str(err)
            self.impl.on_epoch_end(str(err))
            if self.comm is not None:
                self.comm.close()
                self.comm = None
            return False
        self.impl.on_membership(self.faults.wrap(comm, lambda: self.step),
                                EpochInfo(rank, len(plan.members), plan.members, plan.global_batch, plan.membership_epoch,
                                          plan.nodes))
        if self.step == self._mark():
            self.trained_plan = plan  # else the kept local steps were trained under the plan before
        collective.publish(comm, self.cfg.sync.policy)  # the workload's `ray.util.collective` calls reach it
        if source is not None:
            self.link.state_received(self.slot, plan.membership_epoch, plan.members[source], self.step)
            self.faults.maybe_fire("join", self.step)  # a joiner that has its state but has not trained yet
        return True

    def _form(self, spec: GroupSpec, plan: Plan) -> BaseCommunicator | None:
        def superseded() -> bool:
            latest = self.plans.latest
            return latest.version > plan.version and latest.group_name != plan.group_name
        return form_group(spec, superseded)

    def _background_group(self, epoch: EpochInfo) -> BaseCommunicator | None:
        """The background kind's own group of membership epoch `epoch` (`<group>/bg`), formed in the
        policy's entry thread; None once a newer epoch superseded it."""
        comm = self.comm
        if comm is None or self.plan is None or self.plan.membership_epoch != epoch.membership_epoch:
            return None
        spec = dataclasses.replace(comm.spec, name=comm.spec.name + "/bg")
        group = form_group(spec, lambda: self.comm is not comm)
        if group is not None and self.plan is not None:
            self._model_latency(group, self.plan)
        return group

    def _model_latency(self, comm: BaseCommunicator, plan: Plan) -> None:
        """`faults.comm_latency_s` on every operation, and in the lab each link's modelled latency."""
        comm.latency_s = self.cfg.faults.comm_latency_s
        network = self.cfg.network
        if network.lab:
            nodes = [network.node_of(slot) for slot in plan.members]
            matrix = [[network.link(a, b).latency_ms / 1e3 for b in nodes] for a in nodes]
            comm.link_latency_s = matrix if any(any(row) for row in matrix) else None

    def _background_failed(self, error: str) -> None:
        """A background round failed: the coordinator probes the members and re-forms the group."""
        try:
            self.link.collective_failed(self.slot, self.plan.membership_epoch if self.plan else 0, error[:300])
        except Exception as failure:  # noqa: BLE001 - the coordinator may be restarting
            log.warning("could not tell the coordinator that a background round failed: %s", failure)

    # --- what actors/entry.py needs
    def _mark(self) -> int:
        """The step of the newest committed state (the current step, unless periodic local steps are
        provisional)."""
        mark = self.impl.commit_mark
        return self.step if mark is None else mark

    def committed_view(self) -> tuple[int, int]:
        """(step, checksum) of the newest committed state."""
        params = self.impl.committed_parameters()
        return self._mark(), checksum(params if params is not None else self.model.parameters())

    def committed_blob(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self._state_bytes()), dtype=torch.uint8)

    def load_blob(self, blob: torch.Tensor) -> None:
        """Take a holder's newer committed state. If it is the very step (or round) this member
        attempted in the same epoch (a split vote: its result was lost here, but its share was in
        the all-reduce everyone else finished), this member's samples of it were applied."""
        attempted, epoch = self._pending_ids, self.trained_plan.membership_epoch if self.trained_plan else None
        self._load_state_bytes(blob.cpu().numpy().tobytes())
        record = self.kept[-1] if self.kept else None
        if attempted and record is not None and record.get("membership_epoch") == epoch and attempted[-1][0] == self.step:
            self._write_samples(attempted, epoch)

    def rewind(self) -> None:
        """Back to the committed state: provisional local steps (and their samples) are discarded."""
        self.impl.rewind()
        self.step, self.cursor = self._mark(), self.mark_cursor
        self._pending_ids = []

    def skip_to(self, step: int) -> None:
        """Decentralized entry: a member behind the newest step skips ahead to it; the shares it would
        have trained in the steps it skips are counted as dropped."""
        plan = self.trained_plan or self.plan
        while self.step < step:
            batch = self.source.global_batch(self.cursor, plan.global_batch)
            self.dropped += len(split_for_rank(batch, plan.rank_of(self.slot) or 0, len(plan.members)))
            self.step += 1
            self.cursor += plan.global_batch
        self.mark_cursor = self.cursor
        self.source.committed(self.mark_cursor)

    def _switch_policy(self, sync: dict, compression: dict) -> None:
        """Run `sync`/`compression` from now on (a policy switched to mid-run, or the policy a state was
        saved under), from the newest commit point, where a switchable policy's replicas agree
        (orchestrator/planner.py `SWITCHABLE`): a periodic member that meets the switch between rounds
        rewinds its provisional local steps first. The model and the optimizer stay; the old policy's
        hooks go; the new one starts with fresh state of its own (its outer momentum, its residuals)."""
        raw = self.cfg.to_dict()
        raw["sync"], raw["compression"] = sync, compression
        cfg = parse(JobConfig, raw)
        if (cfg.sync, cfg.compression) == (self.cfg.sync, self.cfg.compression):
            return
        if self.impl.commit_mark is not None and self.step > self.impl.commit_mark:
            self.rewind()  # provisional local steps (met between rounds, after an abort): the new policy redoes them
        log.info("%s switches policy at step %d: %s -> %s", self.slot, self.step, self.cfg.sync.policy, cfg.sync.policy)
        self.impl.detach()
        self.cfg = cfg
        self.algorithm = get_algorithm(cfg.sync.policy)(cfg.sync, cfg.compression)
        self.impl = self.algorithm.bind(self.model, self.optimizer)
        self.impl.on_gradients_ready = self._gradients_ready
        self.impl.start_at(self.step)  # e.g. a periodic policy's first committed state: this step's, not step 0's
        self.max_steps = cfg.stop.max_steps if self.algorithm.counts_steps else None

    def _policy_state(self) -> dict:
        return {"sync": dataclasses.asdict(self.cfg.sync), "compression": dataclasses.asdict(self.cfg.compression)}

    def _count_dropped(self, trained: Plan | None, plan: Plan) -> None:
        """The survivors keep their local steps since the last commit: the shares that departed
        members trained in those steps died with their replicas (counted, and recorded with
        `faults.record_samples`)."""
        if trained is None:
            return
        departed = [s for s in trained.members if s not in plan.members and s not in self._dropped_slots]
        self._dropped_slots.update(departed)
        mark = self._mark()
        for k in range(self.step - mark):
            batch = self.source.global_batch(self.mark_cursor + k * trained.global_batch, trained.global_batch)
            shares = [split_for_rank(batch, trained.rank_of(s), len(trained.members)) for s in departed]
            lost = np.concatenate(shares) if shares else np.empty(0, dtype=np.int64)
            self.dropped += len(lost)
            if self._samples is not None and plan.rank_of(self.slot) == 0 and len(lost):
                self._samples.write(f"dropped {plan.membership_epoch} {mark + k + 1} {' '.join(map(str, lost.tolist()))}\n")
                self._samples.flush()

    # ------------------------------------------------------------------ state
    def _state_bytes(self) -> bytes:
        """The committed state: what a joiner receives, what a checkpoint holds, the final model."""
        model = self.model.state_dict()
        committed = self.impl.committed_parameters()
        if committed is not None:
            model.update({name: t.detach().clone() for name, t in zip(self.param_names, committed)})
        buf = io.BytesIO()
        torch.save({"model": model, "optimizer": self.optimizer.state_dict(), "step": self._mark(),
                    "cursor": self.mark_cursor, "algorithm": self.impl.state_dict(),
                    "data": {"position": self.source.state_dict(), "fingerprint": self.source.fingerprint()},
                    "record": self.kept[-1] if self.kept else None,
                    "rng": {"torch": torch.get_rng_state()}, "policy": self._policy_state()}, buf)
        return buf.getvalue()

    def _load_state_bytes(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        if "data" in state and state["data"]["fingerprint"] != self.source.fingerprint():
            raise ValueError(f"the state's data ({state['data']['fingerprint']}) is not this job's "
                             f"({self.source.fingerprint()}): the training data changed since it was saved, so its "
                             f"data position would name other samples")
        saved = state.get("policy")
        if saved is not None and self.cfg.policy_trial and \
                any(saved["sync"]["policy"] == c["sync"]["policy"] for c in self.cfg.policy_trial["candidates"]):
            self._switch_policy(saved["sync"], saved["compression"])  # a trial's state: the policy it was saved under
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.impl.load_state_dict(state["algorithm"])
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self.holds_state = True
        self.mark_cursor = self.cursor
        if "data" in state:
            self.source.load_state_dict(state["data"]["position"])
        self._pending_ids = []
        record = state.get("record")
        if record is not None and (not self.kept or self.kept[-1]["step"] < record["step"]):
            self.kept.append(record)
        if "rng" in state:
            torch.set_rng_state(state["rng"]["torch"])

    # ------------------------------------------------------------------ steps and rounds
    def _micro_batches(self, plan: Plan, mine: np.ndarray | None) -> tuple[np.ndarray, list[Fetched]]:
        """This rank's share of the next global batch (or the ids the policy dealt), in chunks of at
        most `workload.micro_batch`. With a loader (`workload.loader.workers`), the share at the
        cursor was built ahead while earlier steps computed, and the next ones are asked for now."""
        if mine is not None:
            return mine, self._chunks(mine, self.cursor)
        if self._loader is None:
            return self._share(plan, self.cursor)
        built = self._loader.take(self._batch_key(plan, self.cursor))
        self._loader.ahead([(self._batch_key(plan, cursor), functools.partial(self._share, plan, cursor, True))
                            for cursor in (self.cursor + k * plan.global_batch for k in range(1, self._loader.prefetch + 1))])
        return built if built is not None else self._share(plan, self.cursor)

    def _share(self, plan: Plan, cursor: int, ahead: bool = False) -> tuple[np.ndarray, list[Fetched]]:
        ids = self.source.global_batch(cursor, plan.global_batch)
        mine = split_for_rank(ids, plan.rank_of(self.slot), len(plan.members))
        return mine, self._chunks(mine, cursor, ahead)

    def _batch_key(self, plan: Plan, cursor: int) -> tuple:
        """What a share depends on: a batch built for another split (a reshape) or another cursor (a
        step that did not commit, a state received) is never taken."""
        return cursor, plan.global_batch, plan.members, self.slot, self.cfg.workload.micro_batch

    def _chunks(self, mine: np.ndarray, cursor: int, ahead: bool = False) -> list[Fetched]:
        """The share `mine` of the global batch at `cursor`, read by the data source (actors/sources.py)
        in micro-batches and moved to the device. Built ahead by the loader on a GPU, a batch is pinned
        and copied on the loader's own CUDA stream, so the copy overlaps the step's kernels; the step
        waits for the copy's event before it uses the batch (`_ready`)."""
        size = self.cfg.workload.micro_batch or max(len(mine), 1)
        chunks = [mine] if size >= len(mine) else [mine[i:i + size] for i in range(0, len(mine), size)]
        fetch = self._fetcher.fetch if self._fetcher is not None and ahead else self.source.fetch
        out = [fetch(ids, cursor) for ids in chunks]
        if self.device.type == "cuda" and ahead:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._copy_stream):
                for fetched in out:
                    fetched.batch = _to(_pinned(fetched.batch), self.device)
                    fetched.ready = torch.cuda.Event()
                    fetched.ready.record(self._copy_stream)
        elif self.device.type != "cpu":
            for fetched in out:
                fetched.batch = _to(fetched.batch, self.device)
        return out

    def _ready(self, micro: list[Fetched]) -> None:
        """The step's stream waits for the copies of batches built ahead; their memory is then the
        step stream's too (the caching allocator must not hand it out while the step uses it)."""
        stream = torch.cuda.current_stream(self.device)
        for fetched in micro:
            if fetched.ready is not None:
                stream.wait_event(fetched.ready)
                map_tensors(fetched.batch, lambda t: t.record_stream(stream))
                fetched.ready = None

    def _seed_step(self) -> None:
        """Randomness (dropout, augmentation in torch) from a stream derived from (seed, slot, step)."""
        value = step_seed(self.cfg.seed, self._slot_index, self.step)
        torch.default_generator.manual_seed(value)  # torch.manual_seed walks every backend: 175 us
        if self.device.type == "cuda":
            torch.cuda.manual_seed(value)

    def _train_step(self, plan: Plan) -> bool:
        self._enter_phase("samples")
        asked = time.perf_counter()
        dealt = self.impl.step_samples(self.step)  # a server kind pulls here
        if dealt is not None and not len(dealt):
            return True  # nothing to train now (the server said wait, or finished): the loop looks again
        started = time.perf_counter()
        waited = started - asked
        self._enter_phase("compute")
        self._tick()
        self._seed_step()
        self.faults.maybe_fire("step", self.step)
        self.faults.maybe_fire("user_exception", self.step)
        if self.step == self._mark():
            self.trained_plan = plan  # the first provisional step after a commit
        dealt_ids, micro = self._micro_batches(plan, dealt)
        if self._copy_stream is not None:
            self._ready(micro)
        ids = micro[0].ids if len(micro) == 1 else np.concatenate([m.ids for m in micro])  # what is trained
        skipped = [i for m in micro for i in m.skipped]
        if skipped:
            self.link.samples_skipped(self.slot, self.step + 1, skipped, "workload.on_bad_sample: skip")
        draft = VoteDraft(samples=len(dealt_ids), newer_plan=self.plans.latest.version > plan.version)
        denominator = max(len(dealt_ids), 1) if self.algorithm.local_mean else plan.global_batch
        began = time.perf_counter()
        self._gradients_at = None
        self.impl.begin_step(self.step, draft)  # the background kind waits here for its lock
        waited += time.perf_counter() - began
        try:
            self.impl.before_forward(self.step)  # a gossip exchange launches here (and may fail)
            for i, fetched in enumerate(micro):
                batch, n = fetched.batch, len(fetched.ids)
                self.impl.accumulating = i < len(micro) - 1
                weight = n / denominator  # each sample counts 1/B (shares) or 1/n_i (own mean), however split
                scaled = self.workload.loss(self.model, batch) * weight
                share = scaled.detach()  # before the backward that may launch the vote
                draft.loss = share if i == 0 else draft.loss + share
                self.impl.backward(scaled)
            self.impl.end_backward(self.step)
            if self._gradients_at is None:
                self._enter_phase("communicate")
            spent = (self._gradients_at or time.perf_counter()) - started  # compute: until this member's gradients are in
            vote = self.impl.finish_step(self.step, draft)
            waited += time.perf_counter() - started - spent
            self.faults.lose_vote(self.step)
        except CommError as err:
            if self._samples is not None and self.impl.commit_mark is None:
                self._pending_ids = [(self.step + 1, ids)]  # applied if some member committed it (a split vote)
            return self._failed(plan, err)
        spent += self.faults.straggle(started, self.step)  # a modelled straggler's sleep is compute time
        self.compute_s = 0.9 * self.compute_s + 0.1 * spent if self.compute_s else spent
        self._step_s.append(spent)
        if vote.communicated and self.algorithm.kind == "synchronous" and vote.samples != plan.global_batch:
            raise RuntimeError(f"the commit vote of step {self.step + 1} counted {vote.samples} samples; the plan's "
                               f"global batch is {plan.global_batch}")  # every member runs one plan: a bug, not a vote
        self.impl.apply_update(self.step, lr_at(self.step, self.cfg.optimizer, self.max_steps, plan.lr_scale))
        self.step += 1
        self.holds_state = True
        self.cursor += plan.global_batch
        if self._samples is not None:
            self._pending_ids.append((self.step, ids))
        self._waited = waited
        if self.impl.commit_mark is None:  # every step is a commit point
            self._commit(plan, vote, started, len(micro))
        # Only a reduced vote is everyone's: members switch plans together, never on a local step's flag.
        return self._adopt_newest_plan() if vote.newer_plan and vote.communicated else True

    def _sync(self, plan: Plan) -> bool:
        """A periodic round: its vote is the commit point of the local steps since the last one."""
        started = time.perf_counter()
        self._enter_phase("communicate")
        draft = VoteDraft(newer_plan=self.plans.latest.version > plan.version)
        try:
            vote = self.impl.sync(self.step, draft)
            if vote is None:
                return True  # launched; merged (and committed) after the overlap
            self.faults.lose_vote(self.step)
        except CommError as err:
            return self._failed(plan, err)
        self._waited = time.perf_counter() - started  # a round is all communication
        self._commit(plan, vote, started, 0)
        return self._adopt_newest_plan() if vote.newer_plan else True

    def _failed(self, plan: Plan, err: CommError) -> bool:
        self.cause = str(err)
        self.impl.discard(self.step)
        if not self.comm or not self.comm.aborted:  # a peer may be gone without Ray knowing (a lost node)
            try:
                self.link.collective_failed(self.slot, plan.membership_epoch, str(err)[:300])
            except Exception as failure:  # noqa: BLE001 - the coordinator may be restarting; its abort comes anyway
                log.warning("could not tell the coordinator that a collective failed: %s", failure)
        return False

    def _commit(self, plan: Plan, vote: StepVote, started: float, micro_steps: int) -> None:
        """This step (or round) is the newest committed state: mark it, record it, save it if due."""
        prev = self.kept[-1]["step"] if self.kept else None
        self.impl.commit(self.step)
        self.mark_cursor = self.cursor
        self.source.committed(self.mark_cursor)
        self.trained_plan = plan
        self._dropped_slots = set()
        self._write_samples(self._pending_ids, plan.membership_epoch)
        self._pending_ids = []
        self._record(plan, vote, started, micro_steps, prev)
        self._maybe_checkpoint(plan, prev)

    def _write_samples(self, steps: list[tuple[int, np.ndarray]], epoch: int) -> None:
        """`faults.record_samples`: `step membership_epoch ids...` for each step this member applied."""
        if self._samples is None or not steps:
            return
        for step, ids in steps:
            self._samples.write(f"{step} {epoch} {' '.join(map(str, ids.tolist()))}\n")
        self._samples.flush()

    def _adopt_newest_plan(self) -> bool:
        """Rare path: someone saw a newer plan; agree on the newest with one MAX all-reduce, then every
        member switches to it at this same step."""
        version = torch.tensor([float(self.plans.latest.version)], device=self.comm.device)
        try:
            self.comm.all_reduce(version, "max").wait()
        except CommError as err:
            self.cause = str(err)
            return False
        agreed = self.plans.agreed(int(version[0]))
        if agreed is None:
            return False  # superseded before it arrived: the loop takes the newest
        self.plan = agreed
        return True

    def _maybe_checkpoint(self, plan: Plan, prev: int | None) -> None:
        every = self.cfg.checkpoint.every_steps
        if self.algorithm.final_model == "server" or not _crossed(every, prev, self.step):  # the server's state is checkpointed
            return
        self.faults.maybe_fire("checkpoint", self.step)
        if plan.rank_of(self.slot) == 0:
            self._flush_report(force=True)  # history up to this step precedes the checkpoint
            self.link.save_checkpoint(self.step, self._state_bytes())

    def _await_checkpoints(self) -> None:
        """A run ends once the checkpoints it sent are stored: the coordinator stores them off its event
        loop while it goes on, and one sent at the last step (an upload, to an object store) was cut
        off when the job ended and its coordinator exited (CI, S3: step 120's data without its manifest)."""
        try:
            self.link.checkpoints_stored(CHECKPOINT_STORED_S)
        except Exception as err:  # noqa: BLE001 - the coordinator is gone or slow: the run ends regardless
            log.warning("the checkpoint sent last may not be stored: %s", str(err).splitlines()[0][:200])

    # ------------------------------------------------------------------ reporting
    def _reports(self, plan: Plan) -> bool:
        return self.algorithm.reporter == "each" or (self.algorithm.reporter == "rank0" and plan.rank_of(self.slot) == 0)

    def _record(self, plan: Plan, vote: StepVote, started: float, micro_steps: int, prev: int | None) -> None:
        record = {"step": self.step, "time": time.time(), "loss": float(vote.loss), "world_size": len(plan.members),
                  "global_batch": plan.global_batch, "micro_steps": micro_steps,
                  "membership_epoch": plan.membership_epoch, "bytes_sent": self.bytes_before + self.impl.bytes_sent,
                  "lr": self.optimizer.param_groups[0]["lr"], "step_time": time.perf_counter() - started,
                  "wait_s": self._waited}
        if plan.policy is not None:  # switched mid-run: which policy committed it (the trial measures each)
            record["policy"] = plan.policy["label"]
        if self.impl.commit_mark is not None:
            record.update(prev=prev if prev is not None else 0, samples=vote.samples)
        if self.algorithm.reporter == "each":
            record.update(slot=self.slot, samples=vote.samples)
        record.update(self.impl.record_fields())
        if self.tokens_per_sample:  # the step's tokens: the global batch's, or this member's own (per-member kinds)
            record["tokens"] = int(record.get("samples", plan.global_batch)) * self.tokens_per_sample
        if self.dropped:
            record["dropped_samples"], self.dropped = self.dropped, 0
        self.kept.append(record)
        if self._reports(plan):
            if self._evaluates(plan) and _crossed(self.cfg.eval_every, prev if prev is not None else self.step - 1, self.step):
                record.update(self._evaluate())
            self._records.append(record)
        self._flush_report()

    def _evaluates(self, plan: Plan) -> bool:
        """Who evaluates: every reporter, except that a background kind's rank 0 alone evaluates the
        replicas' newest average (the same on every member) for the job."""
        return self.algorithm.kind != "background" or plan.rank_of(self.slot) == 0

    def _evaluate(self) -> dict:
        evaluate = getattr(self.workload, "evaluate", None)
        data = getattr(self.workload, "eval_data", None)
        if evaluate is None or data is None:
            return {}
        model, flat = self.model, self.impl.eval_parameters()
        if flat is not None:  # the replicas' average, on a copy of the model
            if self._eval_model is None:
                self._eval_model = copy.deepcopy(self.model)
            model = self._eval_model
            with torch.no_grad():
                torch.nn.utils.vector_to_parameters(flat.to(self.device), [p for p in model.parameters() if p.requires_grad])
        return {"metrics": {k: float(v) for k, v in evaluate(model, data).items()}}

    def _final_eval(self) -> None:
        """The final model is evaluated once; the record updates status, not history."""
        if self.plan is not None and self.plan.rank_of(self.slot) == 0:
            self._records.append({"step": self.step, "time": time.time(), "final": True, **self._evaluate()})

    def _flush_report(self, force: bool = False) -> None:
        now = time.monotonic()
        world = len(self.plan.members) if self.plan else 1
        if not force and now - self._last_report < max(REPORT_EVERY_S, world / REPORTS_PER_S):
            return
        self._last_report = now
        epoch = self.plan.membership_epoch if self.plan else 0
        progress = Progress(self.slot, self.step, epoch, time.time(), tuple(self._records), self.compute_s,
                            mark=self._mark(), step_s=tuple(self._step_s))
        self._records, self._step_s = [], []
        try:
            self.link.report(progress, wait=force)
        except Exception as err:  # noqa: BLE001 - a lost report must not kill training (records are kept)
            log.warning("progress report at step %d lost: %s", self.step, str(err).splitlines()[0][:200])


STEP_PHASES = ("compute", "communicate")
"""The run thread's phases inside a step, where it may wait on the group's operations."""
STUCK_AFTER_ABORT_S = 10.0
"""How long the run thread may stay inside its step after its group was aborted (at least; 5 steps'
compute time where that is longer) before the worker counts it stuck and exits (`watch_release`)."""


def watch_release(released: Callable[[], bool], grace_s: float, on_stuck: Callable[[], None],
                  poll_s: float = 0.05, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> threading.Thread:
    """After an abort: a thread that calls `on_stuck` unless `released()` comes true within `grace_s`.

    The abort releases every wait this project makes, and shuts down the pairs of a group lent to torch's
    reducer, so that gloo's own waits fail. One wait has been seen to outlive it: gloo's ring all-reduce,
    inside torch's reducer, waiting to receive from a peer that was SIGKILLed as the abort landed (about
    1 abort in 50 on a loaded 2-core machine; the thread in `UnboundBuffer::waitRecv` with the group's
    timeout, nothing left to wake it). Nothing in Python can release it; the group's timeout
    (`comm.timeout_s`, 120 s by default) would hold every member's next membership meanwhile, so the
    worker exits instead (`on_stuck`), and the coordinator treats it as a death."""
    def watch() -> None:
        deadline = clock() + grace_s
        while clock() < deadline:
            if released():
                return
            sleep(poll_s)
        if not released():
            on_stuck()

    thread = threading.Thread(target=watch, name="release watch", daemon=True)
    thread.start()
    return thread


_MASK64 = (1 << 64) - 1


def step_seed(*values: int) -> int:
    """A 63-bit seed from a few integers (job seed, slot, step): splitmix64 folded over them, in plain
    integers (a numpy SeedSequence per step cost ~30 us of the hot path)."""
    x = 0
    for v in values:
        x = (x ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
        x ^= x >> 31
    return x >> 1


def build_workload(cfg: JobConfig) -> Any:
    """The job's workload from its factory, after seeding: identical initial replicas everywhere
    (verified by checksum at the first plan)."""
    torch.manual_seed(cfg.seed)
    return check_factory(cfg.workload.factory)(**cfg.workload.params)


def time_steps(cfg: JobConfig, device: torch.device, steps: int = 12, warmup: int = 3) -> dict:
    """The job's workload timed as a worker runs it: one worker's batch (the next of the data's global
    order each time, read outside the timing) through forward, backward and the optimizer's step, on
    `device`, `steps` times after `warmup`. What `plan` and `auto` take one step's compute from, on a
    placed probe (actors/probe.py) or in the driver (orchestrator/planner.py `measure_compute`).
    Returns {"times": seconds of each step, "backward": seconds of each backward pass, "model_bytes"}."""
    workload = build_workload(cfg)
    model = workload.model.to(device)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    source = source_for(workload.train_data, cfg.seed)
    size = cfg.workload.batch_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, backward = [], []
    for i in range(steps + warmup):
        batch = _to(source.fetch(source.global_batch(i * size, size), i * size).batch, device)
        sync()
        began = time.perf_counter()
        optimizer.zero_grad()
        loss = workload.loss(model, batch)
        sync()
        forward_end = time.perf_counter()
        loss.backward()
        sync()
        backward_end = time.perf_counter()
        optimizer.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - began)
            backward.append(backward_end - forward_end)
    return {"times": times, "backward": backward,
            "model_bytes": float(sum(p.numel() * p.element_size() for p in model.parameters()))}


def warm_up(cfg: JobConfig, workload: Any) -> None:
    """What a replica's first construction would import (the optimizer's first construction imports
    torch._dynamo: 1.4 s here; the policy's modules): a hot spare pays it before it is needed."""
    build_optimizer(workload.model.parameters(), cfg.optimizer)
    get_algorithm(cfg.sync.policy)(cfg.sync, cfg.compression)


def form_group(spec: GroupSpec, superseded: Callable[[], bool]) -> BaseCommunicator | None:
    """Form one membership epoch's group in a helper thread (`form_in_thread`); None if it is
    `superseded()` meanwhile: a member that waited for a superseded epoch goes straight to the next
    one. After `spec.timeout_s` (plus a margin) the attempt fails with CommTimeout."""
    return form_in_thread(spec, lambda: make_communicator(spec), superseded)


def _ray_blocks(spec: WorkerSpec, dataset: Any) -> list[tuple[Any, int]]:
    """A Ray Data dataset's blocks, through the run's holder (imported only for a Ray Data job)."""
    from actors.data_holder import block_reader

    return block_reader(spec.job, spec.run_id, spec.namespace)(dataset)


def _device(gpus: float) -> torch.device:
    """The worker's device: its GPU when it asked for one (Ray makes the assigned GPU the only
    visible one, so it is cuda:0), else the CPU."""
    if gpus > 0 and torch.cuda.is_available():
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`batch` (tensors in tuples, lists or dicts) with `fn` applied to each tensor; other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def _to(batch: Any, device: torch.device) -> Any:
    """A batch on `device`."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def _pinned(batch: Any) -> Any:
    """A batch's CPU tensors in page-locked memory (a copy from there to the GPU is asynchronous)."""
    return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" else t)


def _crossed(every: int | None, before: int | None, now: int) -> bool:
    """Whether a multiple of `every` lies in (before, now]: commit points may jump several steps."""
    if not every:
        return False
    before = now - 1 if before is None else before
    return now // every > before // every
