"""The membership book: who is in the job, under which plan, and which reshapes are still open.

It owns the members (one `Member` per slot), the slot budget (failures, retired slots, the target
count), the membership epoch and plan version counters, the newest plan, and the reshapes decided
but not yet closed by a committed step. It decides nothing about failures (that is
`algorithms/rules/supervision.py`) and sends nothing to anyone: `next_plan` builds the plan and the
caller hands it out. No Ray, no event loop: every rule here runs in a unit test.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from actors.control.members import Member
from actors.messages import ReadyAnswer
from actors.plan import Plan
from algorithms.rules.kinds import Kind
from algorithms.rules.membership import MemberView, batch_for, choose_leavers, free_slots, server_members, slot_index
from algorithms.rules.supervision import JobState, JobView, MemberState, WorkloadFault
from core.schema import JobConfig, MemberStatus, WorkloadRefused

S = MemberState
ADMIT_HOLD_S = 1.0
"""At most this long, joiners wait for the survivors of a departure to commit a step without it."""
DEPARTED_KEPT = 20
"""Departed members shown in status (the newest)."""
WORKLOAD_FAULTS_KEPT = 64
"""Workload faults kept to compare a new one with (each holds its traceback)."""


@dataclass(frozen=True)
class Convergence:
    """What `MembershipBook.converge` decides to reach the target count."""

    missing: int
    """Members short of the target before `start` (more than `start` names when slots ran out)."""
    start: tuple[str, ...] = ()
    """Slots to start a worker in."""
    drop: tuple[str, ...] = ()
    """Joiners in no plan yet (starting or ready) that are no longer wanted."""
    leave: tuple[str, ...] = ()
    """Members of the plan that leave it."""


class MembershipBook:
    """Members, slots, epochs, plans and open reshapes of one job run."""

    def __init__(self, cfg: JobConfig, run_id: str, kind: Kind) -> None:
        self.cfg, self.run_id, self.kind = cfg, run_id, kind
        self.members: dict[str, Member] = {}
        self.plan: Plan | None = None
        self.epoch = 0
        self.version = 0
        self.target_count = cfg.workers.count
        self.failures: dict[str, int] = {}
        self.retired: dict[str, str] = {}
        self.departed: list[MemberStatus] = []
        self.pending: list[dict] = []
        """Reshapes decided but not yet followed by a committed step in their membership epoch."""
        self.stop_step: int | None = None
        """Once a stop is decided, every plan published carries it (a reshape must not lose it)."""
        self.policy: dict | None = None
        """A policy switched to mid-run (actors/control/trial.py): every plan published carries it."""
        self.batch_norm = False
        """A worker said its model has BatchNorm layers: a scale that leaves a share of one sample is refused."""
        self.workload_faults: list[tuple[str, WorkloadFault]] = []
        """The workload faults met so far (slot, fault; the newest WORKLOAD_FAULTS_KEPT): a second of the same
        makes one a bug in the workload (`workload_bug`)."""

    # ------------------------------------------------------------------ who is where
    def live(self) -> tuple[str, ...]:
        """The plan's members that are training, in rank order."""
        if self.plan is None:
            return ()
        members = self.members  # a restarted coordinator's plan names members it has not re-attached yet
        return tuple(s for s in self.plan.members if s in members and members[s].state == S.TRAINING)

    def slots_in(self, *states: MemberState) -> list[str]:
        return [slot for slot, m in self.members.items() if m.state in states]

    def reachable(self) -> list[Member]:
        """The members that take plans and aborts (a leaving member learns from the plan that it leaves)."""
        return [m for m in self.members.values() if m.state in (S.TRAINING, S.READY, S.LEAVING)]

    def node_of(self, slot: str) -> str:
        """The node a member runs on, for the plan: the lab's virtual node, else its Ray node."""
        if self.cfg.network.lab:
            return f"lab{self.cfg.network.node_of(slot)}"
        member = self.members.get(slot)
        return member.node_id if member is not None else ""

    # ------------------------------------------------------------------ plans
    def next_plan(self, members: tuple[str, ...], reason: str, *, incarnation: int, store_host: str, store_port: int,
                  history_step: int, new_epoch: bool = False) -> Plan:
        """The next plan for `members` (rank order), now the book's plan. A new membership epoch when the
        members change, when asked, and always for the decentralized kind (its members cannot switch plans
        together at a step: no vote is reduced over all of them)."""
        self.version += 1
        w = self.cfg.workers
        global_batch, lr_scale = batch_for(len(members), self.cfg.workload.batch_size, w.count, w.batch_mode,
                                            self.cfg.optimizer.resize_rule)
        previous = self.plan
        if previous is None or previous.members != members or new_epoch or self.kind.new_epoch_each_plan:
            self.epoch += 1
        self.plan = Plan(
            version=self.version, membership_epoch=self.epoch, members=members,
            group_name=f"{self.cfg.name}/{self.run_id}/c{incarnation}/e{self.epoch}",
            store_host=store_host, store_port=store_port, timeout_s=self.cfg.comm.timeout_s,
            formation_timeout_s=self.cfg.comm.formation_timeout_s,
            global_batch=global_batch, lr_scale=lr_scale,
            backend=self.cfg.group_backend,
            stop_step=self.stop_step, reason=reason, history_step=history_step,
            nodes=tuple(self.node_of(slot) for slot in members), policy=self.policy)
        return self.plan

    def carry_policy(self, policy: dict) -> None:
        """Every plan published from now on carries `policy` (the trial's switch, then the same policy no
        longer fresh once it committed a step)."""
        self.policy = policy

    def stop_at(self, step: int) -> None:
        """A stop is decided: every plan published from now on carries its step."""
        self.stop_step = step

    def carry_on(self, epoch: int) -> None:
        """A restarted coordinator: its next publication takes membership epoch `epoch` (newer than any a live
        member or the server holds), and a plan version above the newest plan's."""
        self.epoch = epoch - 1  # the next publication takes the one after
        self.version = max(self.version, self.plan.version if self.plan else 0)

    def adopt(self, plan: Plan) -> None:
        """A plan a re-attached member holds, newer than the book's (published just before a crash, never saved)."""
        if self.plan is None or plan.version > self.plan.version:
            self.plan = plan

    def server_membership(self) -> list[tuple[str, int]]:
        """What the parameter server admits with the current plan: (slot, worker incarnation) in rank order."""
        assert self.plan is not None  # asked once a plan was made
        plan = tuple((s, self.members[s].incarnation) for s in self.plan.members)
        leaving = tuple((s, m.incarnation) for s, m in self.members.items()
                        if m.state == S.LEAVING and s not in self.plan.members)
        return list(server_members(self.kind, plan, leaving))

    # ------------------------------------------------------------------ reshapes
    def open_reshape(self, plan: Plan, old: tuple[str, ...], reason: str, detector: str, decided_at: float,
                     joiners: tuple[str, ...] = (), leavers: tuple[str, ...] = ()) -> None:
        self.pending.append({"membership_epoch": plan.membership_epoch, "old_members": list(old),
                             "new_members": list(plan.members), "joiners": list(joiners), "leavers": list(leavers),
                             "reason": reason, "detector": detector, "decided_at": decided_at,
                             "global_batch": plan.global_batch, "lr_scale": plan.lr_scale,
                             "batch_mode": self.cfg.workers.batch_mode, "state_sources": {}})

    def close_reshapes(self, record: dict) -> list[dict]:
        """A committed step in a reshape's epoch closes it (and every older one): returns each closed
        reshape's detail, with its duration; its joiners now hold the state (but a background kind's:
        `state_received` says when those do)."""
        epoch = record.get("membership_epoch", 0)
        closed = []
        for reshape in [r for r in self.pending if r["membership_epoch"] <= epoch]:
            self.pending.remove(reshape)
            reshape.update(first_committed_step=record["step"], first_step_at=record["time"],
                           duration_s=record["time"] - reshape["decided_at"])
            for slot in reshape["joiners"]:
                if slot in self.members and not self.kind.background_rounds:
                    self.members[slot].holds(True)
            closed.append(dict(reshape, cause=reshape.pop("reason")))
        return closed

    def state_received(self, slot: str, epoch: int, source: str, step: int) -> bool:
        """A joiner loaded the state of `source`: noted on the epoch's open reshapes; False when none is open."""
        if slot in self.members:
            self.members[slot].holds(True)
        pending = [r for r in self.pending if r["membership_epoch"] == epoch]
        for reshape in pending:
            reshape["state_sources"][slot] = {"source": source, "step": step}
        return bool(pending)

    def held_departure(self, state: JobState, now: float | None = None) -> bool:
        """Whether joiners wait for the survivors of a departure to commit their first step without it
        (at most ADMIT_HOLD_S; never while PAUSED or below `workers.min`: nobody could commit)."""
        if state == JobState.PAUSED or self.plan is None or len(self.live()) < self.cfg.workers.min:
            return False
        now = time.time() if now is None else now
        newest = self.plan.membership_epoch
        return any(r["membership_epoch"] == newest and not r["joiners"] and now - r["decided_at"] < ADMIT_HOLD_S
                   for r in self.pending)

    # ------------------------------------------------------------------ slots
    def note_workload_fault(self, slot: str, fault: WorkloadFault) -> None:
        self.workload_faults = [*self.workload_faults, (slot, fault)][-WORKLOAD_FAULTS_KEPT:]

    def count_failure(self, slot: str, cause: str) -> bool:
        """A failure against the slot; True (and the slot retired) past `workers.failure_budget`, or at
        once when the workload refused itself (`WorkloadRefused`: every start would fail alike)."""
        self.failures[slot] = self.failures.get(slot, 0) + 1
        budget = self.cfg.workers.failure_budget
        if WorkloadRefused.__name__ in cause:
            self.retired[slot] = f"retired: the workload cannot be trained as configured: {cause}"
            return True
        if self.failures[slot] < budget:
            return False
        self.retired[slot] = f"retired after {self.failures[slot]} failures (workers.failure_budget = {budget}); last: {cause}"
        return True

    def retarget(self, count: int) -> int:
        """The job's target count is `count` now (a scale); returns the one before."""
        previous, self.target_count = self.target_count, count
        return previous

    def converge(self) -> Convergence:
        """What reaches `target_count`: when short, the lowest free slots (fewer than missing when slots
        run out); when over, first the joiners not yet in a plan (starting or ready; the newest slots
        first: nobody waits for a worker the job no longer wants), then leavers by `workers.scale_down`."""
        live = list(self.live())
        coming = self.slots_in(S.STARTING, S.READY)
        missing = self.target_count - len(live) - len(coming)
        if missing > 0:
            taken = set(self.slots_in(S.TRAINING, S.STARTING, S.READY, S.LEAVING))
            assert self.cfg.workers.max is not None  # WorkersConfig.__post_init__ fills it in
            return Convergence(missing, start=tuple(free_slots(self.cfg.workers.max, taken, set(self.retired), missing)))
        over = -missing
        drop = choose_leavers([MemberView(s, 0.0) for s in coming], min(over, len(coming)), "newest")
        views = [MemberView(s, self.members[s].compute_s) for s in live]
        leave = choose_leavers(views, len(live) - self.target_count, self.cfg.workers.scale_down)
        return Convergence(0, drop=tuple(drop), leave=tuple(leave))

    def note_model(self, ready: ReadyAnswer) -> None:
        """What a worker's ready answer says of the model that the book's rules need."""
        self.batch_norm = self.batch_norm or ready.batch_norm

    def ready_to_admit(self) -> list[str]:
        return sorted(self.slots_in(S.READY), key=slot_index)

    # ------------------------------------------------------------------ status
    def member_status(self, m: Member, actor_id: str = "") -> MemberStatus:
        rank = self.plan.rank_of(m.slot) if self.plan else None
        return MemberStatus(slot=m.slot, rank=-1 if rank is None or m.state.departed else rank, node=m.node,
                            pid=m.pid, state=m.state.value, cause=m.cause or m.waiting_for, node_id=m.node_id,
                            actor_id=actor_id)

    def depart(self, member: Member, actor_id: str = "") -> None:
        self.departed = (self.departed + [self.member_status(member, actor_id)])[-DEPARTED_KEPT:]

    def view(self, state: JobState, stop_kind: str | None, checkpoint_step: int | None) -> JobView:
        """The frozen view `decide` takes."""
        w = self.cfg.workers
        return JobView(state=state, plan_members=self.plan.members if self.plan else (),
                       members={s: m.state for s, m in self.members.items()}, failures=dict(self.failures),
                       min_workers=w.min, failure_budget=w.failure_budget, on_failure=w.on_failure, stop_kind=stop_kind,
                       stateless=frozenset(s for s, m in self.members.items() if not m.holds_state),
                       checkpoint_step=checkpoint_step, workload_faults=tuple(self.workload_faults))

    # ------------------------------------------------------------------ the state file
    def snapshot(self) -> dict[str, Any]:
        """What a restarted coordinator cannot re-learn from the live workers: a copy that later changes
        to the book leave alone (it is serialized in another thread)."""
        plan = {f.name: getattr(self.plan, f.name) for f in dataclasses.fields(self.plan)} if self.plan else None
        return {"epoch": self.epoch, "version": self.version, "target_count": self.target_count,
                "plan": plan, "failures": dict(self.failures),
                "retired": dict(self.retired), "stop_step": self.stop_step, "batch_norm": self.batch_norm,
                "pending": [dict(r, state_sources=dict(r["state_sources"])) for r in self.pending],
                "departed": [dict(d.__dict__) for d in self.departed],
                "members": {slot: {"state": m.state.value, "pid": m.pid, "node": m.node, "node_id": m.node_id, "store_port": m.store_port,
                                   "cause": m.cause, "incarnation": m.incarnation, "actor_name": m.actor_name,
                                   "holds_state": m.holds_state} for slot, m in self.members.items()}}

    def load(self, saved: dict[str, Any]) -> None:
        self.epoch, self.version, self.target_count = saved["epoch"], saved["version"], saved["target_count"]
        self.failures, self.retired, self.stop_step = saved["failures"], saved["retired"], saved["stop_step"]
        self.pending = saved["pending"]
        self.batch_norm = saved.get("batch_norm", False)
        self.departed = [MemberStatus(**d) for d in saved["departed"]]
        if saved["plan"]:
            fields: dict[str, Any] = {k: tuple(v) if k in ("members", "nodes") else v for k, v in saved["plan"].items()}
            self.plan = Plan(**fields)
            self.policy = self.plan.policy
