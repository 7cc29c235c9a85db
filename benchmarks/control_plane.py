"""The coordinator at 64, 256 and 1,024 members: what its control plane costs, with fake workers.

The real `Coordinator` runs on this process's event loop over `FakeWorkerGroup`
(testkit/fake_workers.py): every call it makes to a worker is answered in-process, so what is
timed is the coordinator's own work (Ray's latencies are not modelled; see the README for what Ray
itself costs at that size). Training is an autopilot: the plan's members commit a step every
`--step-ms` once every member holds the plan; the records go out with rank 0's report, and every
member reports its batched progress every 0.1-0.5 s (uniform), as workers do.

Per size, in one run:
- steady state: report ingestion (reports and records per second, the time one report takes),
  and the whole process's CPU seconds per committed step (an upper bound: the fakes' reporting
  runs in the same process);
- a flood: rank 0 reports batches of 256 new records as fast as the coordinator takes them;
- deaths, one at a time: from the death until the survivors' new plan is handed to every member
  (p50, p99), then the replacement's join;
- a storm: 10% of the members die at uniform random times within 100 ms; how many plans re-formed
  the survivors, the time until the last survivor holds the plan, then the replacements' join,
  and whether anything was lost (history has every committed step once, every member the plan);
- a scale-up by 256: from `scale()` until every member holds the plan that names them all;
- memory per member (tracemalloc over the coordinator's allocations, in a run of its own);
- ZipLine's barrier decision (elastic_bsp) for that many members.

    python benchmarks/control_plane.py [--sizes 64,256,1024] [--deaths 20] [--out FILE]

Prints a table and one JSON line per size (appended to --out if given).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from actors.control.coordinator import Coordinator  # noqa: E402
from actors.plan import Progress  # noqa: E402
from algorithms.rules.supervision import JobState  # noqa: E402
from algorithms.rules.zipline import BarrierPlanner  # noqa: E402
from orchestrator.config import config_from_dict  # noqa: E402
from testkit.fake_workers import FakeWorkerGroup  # noqa: E402

SCALE_UP = 256


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def config(n: int, heartbeat_s: float) -> dict:
    return config_from_dict({
        "name": f"cp{n}", "seed": 0,
        "workers": {"count": n, "min": 1, "max": n + SCALE_UP, "cpus": 0.01, "heartbeat_s": heartbeat_s,
                    "start_grace_s": 0.01, "failure_budget": 1000},
        "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
        "sync": {"policy": "bsp"}, "stop": {"max_steps": 10_000_000}, "eval_every": 0,
        "log_level": "ERROR"}).to_dict()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class Autopilot:
    """Training as the coordinator sees it (module docstring)."""

    def __init__(self, coord: Coordinator, group: FakeWorkerGroup, step_s: float, rng: random.Random) -> None:
        self.coord, self.group, self.step_s, self.rng = coord, group, step_s, rng
        self.step = 0
        self.buffer: list[dict] = []
        self.committing = True
        self.report_s: list[float] = []
        self.reports = 0
        self.records = 0
        self._reporting: set[int] = set()
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks.append(asyncio.get_running_loop().create_task(self._train()))
        self.tasks.append(asyncio.get_running_loop().create_task(self._adopt_reporters()))

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()

    def _formed(self):
        plan = self.coord.book.plan
        if plan is None:
            return None
        for slot in plan.members:
            w = self.group.current(slot)
            if not w.alive or not w.running or w.plan is None or w.plan.membership_epoch != plan.membership_epoch:
                return None
        return plan

    async def _train(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            plan = self._formed() if self.committing else None
            if plan is None:
                continue
            if plan.stop_step is not None and self.step >= plan.stop_step:
                records, self.buffer = tuple(self.buffer), []  # a worker's last report goes out before it ends
                await self.coord.report(Progress(plan.members[0], self.step, plan.membership_epoch, time.time(), records,
                                                 0.05, mark=self.step))
                for slot in plan.members:
                    self.group.finish(slot)
                return
            self.step += 1
            self.buffer.append({"step": self.step, "time": time.time(), "loss": 1.0, "world_size": len(plan.members),
                                "global_batch": plan.global_batch, "micro_steps": 1,
                                "membership_epoch": plan.membership_epoch})

    async def _adopt_reporters(self) -> None:
        """Every running worker gets a reporting loop (joiners too, as they start)."""
        while True:
            for worker in list(self.group.workers.values()):
                if worker.running and worker.alive and id(worker) not in self._reporting:
                    self._reporting.add(id(worker))
                    self.tasks.append(asyncio.get_running_loop().create_task(self._report(worker)))
            await asyncio.sleep(0.05)

    async def _report(self, worker) -> None:
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))
        while worker.alive and not (worker.ended is not None and worker.ended.done()):
            plan = self.coord.book.plan
            records = ()
            if plan is not None and plan.members and plan.members[0] == worker.slot and self.buffer:
                records, self.buffer = tuple(self.buffer), []
            started = time.perf_counter()
            await self.coord.report(Progress(worker.slot, self.step, plan.membership_epoch if plan else 0, time.time(),
                                             records, 0.05 * (1 + 0.1 * self.rng.random()), mark=self.step))
            self.report_s.append(time.perf_counter() - started)
            self.reports += 1
            self.records += len(records)
            await asyncio.sleep(self.rng.uniform(0.1, 0.5))


async def until(condition, what: str, timeout: float = 60.0, every: float = 0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        await asyncio.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")


def handed_to_all(group: FakeWorkerGroup, coord: Coordinator, members, after_epoch: int):
    """Every one of `members` holds a plan newer than `after_epoch` that names exactly the live ones:
    the latest time one of them received it."""
    plan = coord.book.plan
    if plan is None or plan.membership_epoch <= after_epoch or set(plan.members) != set(members):
        return None
    times = []
    for slot in members:
        w = group.current(slot)
        if w.plan is None or w.plan.membership_epoch != plan.membership_epoch:
            return None
        times.append(w.plan_at)
    return max(times)


async def all_up(coord: Coordinator, group: FakeWorkerGroup, n: int) -> None:
    """Until every one of the `n` members holds a plan that names them all. (Not until the job is RUNNING:
    the first plan names only the workers ready within `start_grace_s`, the others join by a reshape, and
    the job stays RESHAPING until a step commits under it, which waiting for RUNNING never let happen.)"""
    everyone = [f"w{i}" for i in range(n)]
    await until(lambda: handed_to_all(group, coord, everyone, 0), "every member's first plan", 300, 0.01)


async def measure(n: int, deaths: int, step_s: float, steady_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    run_dir = Path(tempfile.mkdtemp(prefix=f"control-plane-{n}-"))
    group = FakeWorkerGroup(free_cpus=1e9)
    coord = Coordinator(config(n, heartbeat_s=10.0), "bench", str(run_dir), group=group)
    t0 = time.perf_counter()
    await coord.start()
    await all_up(coord, group, n)
    out: dict = {"members": n, "start_s": round(time.perf_counter() - t0, 3)}
    pilot = Autopilot(coord, group, step_s, rng)
    pilot.start()
    await until(lambda: pilot.step >= 20, "the first steps", 60, 0.01)

    # ---------------------------------------------------------------- steady state
    await asyncio.sleep(1.0)  # every reporter started
    reports0, records0, step0, cpu0, wall0 = pilot.reports, pilot.records, pilot.step, time.process_time(), time.perf_counter()
    pilot.report_s.clear()
    await asyncio.sleep(steady_s)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    steps = pilot.step - step0
    out.update(reports_per_s=round((pilot.reports - reports0) / wall, 1),
               records_per_s=round((pilot.records - records0) / wall, 1),
               steps_per_s=round(steps / wall, 1), cpu_s_per_step=round(cpu / max(steps, 1), 6),
               cpu_share=round(cpu / wall, 3),
               report_ms_p50=round(1e3 * pct(pilot.report_s, 50), 3), report_ms_p99=round(1e3 * pct(pilot.report_s, 99), 3))
    log(f"  n={n}: steady: {out['reports_per_s']} reports/s, {out['steps_per_s']} steps/s, CPU {out['cpu_share']:.0%} "
        f"of a core, report p50 {out['report_ms_p50']} ms p99 {out['report_ms_p99']} ms")

    # ---------------------------------------------------------------- a flood of records
    pilot.committing = False
    await until(lambda: not pilot.buffer, "rank 0's buffer to drain", 10, 0.01)
    plan = coord.book.plan
    flooded, started = 0, time.perf_counter()
    while time.perf_counter() - started < 2.0:
        batch = []
        for _ in range(256):
            pilot.step += 1
            batch.append({"step": pilot.step, "time": time.time(), "loss": 1.0, "world_size": n,
                          "global_batch": plan.global_batch, "micro_steps": 1, "membership_epoch": plan.membership_epoch})
        await coord.report(Progress(plan.members[0], pilot.step, plan.membership_epoch, time.time(), tuple(batch), 0.05,
                                    mark=pilot.step))
        flooded += len(batch)
    out["flood_records_per_s"] = round(flooded / (time.perf_counter() - started))
    await until(lambda: coord.history.step() == pilot.step, "history to hold the flood", 10, 0.01)
    pilot.committing = True
    log(f"  n={n}: flood: {out['flood_records_per_s']} records/s")

    for phase in (deaths_one_at_a_time, storm, scale_up):
        try:
            await phase(coord, group, rng, out, n, deaths)
        except TimeoutError as err:
            out[f"{phase.__name__}_error"] = str(err)
            log(f"  n={n}: {phase.__name__}: {err}")
            break
    await finish(coord, group, pilot, run_dir, out, n)
    return out


async def deaths_one_at_a_time(coord, group, rng, out, n, deaths) -> None:
    latencies, joins = [], []
    for _ in range(deaths):
        plan = coord.book.plan
        victim = rng.choice(plan.members)
        survivors = [s for s in plan.members if s != victim]
        died = time.perf_counter()
        group.die(victim)
        handed = await until(lambda: handed_to_all(group, coord, survivors, plan.membership_epoch), "the survivors' plan")
        latencies.append(handed - died)
        back = await until(lambda: handed_to_all(group, coord, survivors + [victim], plan.membership_epoch + 1),
                           "the replacement's join")
        joins.append(back - died)
        await asyncio.sleep(0.05)
    out.update(death_to_plan_ms_p50=round(1e3 * pct(latencies, 50), 2), death_to_plan_ms_p99=round(1e3 * pct(latencies, 99), 2),
               death_to_plan_ms_max=round(1e3 * max(latencies), 2), death_to_rejoin_ms_p50=round(1e3 * pct(joins, 50), 1))
    log(f"  n={n}: {deaths} deaths: plan handed to every survivor p50 {out['death_to_plan_ms_p50']} ms, "
        f"p99 {out['death_to_plan_ms_p99']} ms; replacement in p50 {out['death_to_rejoin_ms_p50']} ms")


async def storm(coord, group, rng, out, n, deaths) -> None:
    await asyncio.sleep(0.5)
    plan = coord.book.plan
    victims = rng.sample(list(plan.members), max(1, n // 10))
    survivors = [s for s in plan.members if s not in victims]
    epoch0, sent0 = coord.book.epoch, group.plans_sent
    started = time.perf_counter()
    loop = asyncio.get_running_loop()
    for slot in victims:
        loop.call_later(rng.uniform(0, 0.1), group.die, slot)
    handed = await until(lambda: handed_to_all(group, coord, survivors, plan.membership_epoch), "the storm's survivors' plan")
    reforms = coord.book.epoch - epoch0
    back = await until(lambda: handed_to_all(group, coord, survivors + victims, coord.book.epoch - 1 if
                                             set(coord.book.plan.members) == set(survivors + victims) else 10**9),
                       "the replacements' join", 120)
    await until(lambda: coord.job.state == JobState.RUNNING, "RUNNING after the storm", 60, 0.01)
    out.update(storm_deaths=len(victims), storm_reforms=reforms, storm_plans_sent=group.plans_sent - sent0,
               storm_to_plan_ms=round(1e3 * (handed - started), 1), storm_to_rejoin_ms=round(1e3 * (back - started), 1))
    log(f"  n={n}: storm of {len(victims)} deaths in 100 ms: {reforms} re-form(s) before the survivors' plan, "
        f"handed at {out['storm_to_plan_ms']} ms; all {len(victims)} replaced by {out['storm_to_rejoin_ms']} ms")


async def scale_up(coord, group, rng, out, n, deaths) -> None:
    await asyncio.sleep(0.5)
    everyone = [f"w{i}" for i in range(n + SCALE_UP)]
    epoch = coord.book.epoch
    started = time.perf_counter()
    await coord.scale(n + SCALE_UP)
    handed = await until(lambda: handed_to_all(group, coord, everyone, epoch), "the scale-up's plan", 120)
    out["scale_up_ms"] = round(1e3 * (handed - started), 1)
    log(f"  n={n}: scale-up by {SCALE_UP}: every member holds the plan {out['scale_up_ms']} ms after scale()")



async def finish(coord, group, pilot, run_dir, out, n) -> None:
    """Stop the job and check that history holds every committed step once."""
    await asyncio.sleep(0.5)
    try:
        await coord.request_stop()
        await until(lambda: coord.job.state.terminal, "the stop", 120, 0.01)
    except TimeoutError as err:
        out["stop_error"] = str(err)
    finally:
        pilot.stop()
        await coord.release()
        if not coord.job.state.terminal:  # its loop is stuck: end it here (its linger is released above)
            coord.lifecycle.main_task.cancel()
        try:
            await asyncio.wait_for(coord.lifecycle.main_task, 30)
        except (asyncio.CancelledError, TimeoutError):
            pass
    steps = [json.loads(line)["step"] for line in (run_dir / "history.jsonl").read_text().splitlines()]
    out["history_complete"] = steps == list(range(1, len(steps) + 1)) and steps[-1] == pilot.step
    if not out["history_complete"]:
        gaps = [(a, b) for a, b in zip(steps, steps[1:]) if b != a + 1]
        log(f"  n={n}: history: {len(steps)} records, last {steps[-1] if steps else None}, pilot {pilot.step}, "
            f"breaks {gaps[:5]}")
    out["final_state"] = coord.job.state.value
    out["last_step"] = pilot.step
    log(f"  n={n}: {coord.job.state.value} at step {pilot.step}; history holds every step once: {out['history_complete']}")


async def memory(n: int) -> float:
    """Bytes the coordinator allocated per member, at steady state (its own allocations only)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"control-plane-mem-{n}-"))
    group = FakeWorkerGroup(free_cpus=1e9)
    tracemalloc.start(8)
    coord = Coordinator(config(n, heartbeat_s=10.0), "mem", str(run_dir), group=group)
    await coord.start()
    await all_up(coord, group, n)
    await group.commit(coord, 5)  # the joiners' reshape, if any, closes: RUNNING
    await asyncio.sleep(0.5)
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    mine = snapshot.filter_traces([tracemalloc.Filter(False, "*/testkit/fake_workers.py"),
                                   tracemalloc.Filter(False, __file__), tracemalloc.Filter(False, "<frozen*"),
                                   tracemalloc.Filter(False, "*/asyncio/*"), tracemalloc.Filter(False, "*/tracemalloc.py")])
    total = sum(stat.size for stat in mine.statistics("filename"))
    await coord.request_stop()
    await group.commit(coord, 2)
    await until(lambda: coord.job.state.terminal, "the stop", 60, 0.01)
    await coord.release()
    await asyncio.wait_for(coord.lifecycle.main_task, 30)
    return total / n


def zipline_ms(n: int, r: int = 8) -> float:
    rng = random.Random(0)
    members = [f"w{i}" for i in range(n)]
    planner = BarrierPlanner(r, 0.3)
    times = []
    for _ in range(20):
        intervals = {m: [rng.uniform(0.05, 0.2) for _ in range(r)] for m in members}
        started = time.perf_counter()
        planner.plan(members, intervals)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--deaths", type=int, default=20)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--steady-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        log(f"{n} members")
        row = asyncio.run(measure(n, args.deaths, args.step_ms / 1e3, args.steady_s, args.seed))
        row["memory_bytes_per_member"] = round(asyncio.run(memory(n)))
        row["zipline_ms"] = round(zipline_ms(n), 3)
        row["label"] = args.label
        log(f"  n={n}: {row['memory_bytes_per_member']} bytes per member; ZipLine decision {row['zipline_ms']} ms")
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    cols = ["members", "death_to_plan_ms_p50", "death_to_plan_ms_p99", "storm_reforms", "storm_to_plan_ms",
            "scale_up_ms", "reports_per_s", "report_ms_p99", "flood_records_per_s", "cpu_s_per_step",
            "memory_bytes_per_member", "zipline_ms", "history_complete"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
