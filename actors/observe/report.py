"""The run report: one picture of a run, drawn from its run directory.

`python -m orchestrator report RUN_DIR` (and the coordinator, into `report.png`, when a job ends)
draws six panels against wall time from the job's start:

1. loss (one line per member where history is per member) and the evaluation metric;
2. world size and membership epoch, with each death, join and scale event marked;
3. each member's step time (a heat map, from `step_times.jsonl`): a straggler is a bright row;
4. bytes sent per committed step (and tokens per second, for workloads that count tokens);
5. recovery and join times (death or join decided -> first committed step), one mark per event;
6. a summary: state, steps, policy, deaths, joins, median recovery.

It reads only the run's files (history.jsonl, events.jsonl, step_times.jsonl, status.json,
config.yaml), so it works for any policy kind and after the job's actors are gone: from the run
directory, or from the run on its storage (`s3://bucket/prefix/<job>/<run id>`), where the appended
files are the mirror's parts (read through `actors/runs/mirror.py`'s `read_appended`).
"""
from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from actors.runs import runfiles
from actors.runs.mirror import read_appended
from actors.runs.storage import first_line, is_remote, open_storage

MARKS = {"death": ("tab:red", "x"), "join": ("tab:green", "^"), "scale": ("tab:blue", "v"), "other": ("tab:gray", ".")}


def load(run: Path | str) -> dict[str, Any]:
    """What the report draws, from a run directory or its URI on the run's storage."""
    read = _reader(run)
    history, events = runfiles.parse_jsonl(read("history.jsonl"), "history"), runfiles.parse_jsonl(read("events.jsonl"), "events")
    if not history and not events:
        raise FileNotFoundError(f"{run} is not a run directory (no history.jsonl or events.jsonl)")
    config = yaml.safe_load(read("config.yaml") or b"{}") or {}
    status = json.loads(read("status.json") or b"{}")
    times = [r["time"] for r in history] + [e["time"] for e in events]
    return {"config": config, "history": history, "events": events, "status": status,
            "step_times": runfiles.parse_jsonl(read("step_times.jsonl"), "step_times"), "t0": min(times) if times else 0.0}


def _reader(run: Path | str) -> Callable[[str], bytes]:
    """`read(name)`: a run file's bytes (b"" when there is none). On an object store the appended files
    are their mirrored parts (actors/runs/mirror.py)."""
    if not is_remote(str(run)):
        folder = Path(run)
        return lambda name: (folder / name).read_bytes() if (folder / name).is_file() else b""
    storage = open_storage(str(run))

    def read(name: str) -> bytes:
        if name.endswith(".jsonl"):
            return read_appended(storage, name)
        try:
            return storage.read(name)
        except FileNotFoundError:
            return b""
    return read


def run_name(run: Path | str) -> str:
    """The job's name as the run's path has it (`<job>/<run id>`), for a run without its config."""
    return urlsplit(str(run)).path.rstrip("/").rsplit("/", 2)[-2] if is_remote(str(run)) else Path(run).parent.name


def event_kind(event: dict) -> str | None:
    """death, join, scale or other for a reshape; None for other events."""
    if event.get("kind") != "reshape":
        return None
    detail = event.get("detail", {})
    gone = set(detail.get("old_members") or ()) - set(detail.get("new_members") or ())
    if detail.get("detector") == "scale request":
        return "scale"
    if detail.get("joiners"):
        return "join"
    if gone:
        return "death"
    return "other"


def draw_at_end(run_dir: Path, wanted: bool | None, note: Callable[..., Any]) -> None:
    """A job's end: its report into the run directory when asked (`tracking.report`; unset: unless the
    environment says ORCHESTRATOR_REPORT=0); a failure (no matplotlib) is an event, never the job's."""
    if wanted is None:
        wanted = os.environ.get("ORCHESTRATOR_REPORT", "1") != "0"
    if not wanted:
        return
    try:
        draw(run_dir)
    except Exception as err:  # noqa: BLE001 - a picture must not fail the job
        note("info", f"no run report: {type(err).__name__}: {first_line(err)}")


def tokens_per_s(history: list[dict], window: int = 20) -> list[tuple[int, float]]:
    """(step, tokens per second) over each run of `window` records in time order, for histories whose
    records count tokens; empty for the others."""
    ordered = sorted((r for r in history if r.get("tokens")), key=lambda r: r["time"])
    out = []
    for start in range(0, len(ordered) - window, window):
        chunk = ordered[start:start + window + 1]
        span = chunk[-1]["time"] - chunk[0]["time"]
        if span > 0:
            out.append((chunk[-1]["step"], sum(r["tokens"] for r in chunk[1:]) / span))
    return out


def draw(run: Path | str, out: Path | None = None) -> Path:
    """Draw the report of `run` (a run directory, or its URI on the run's storage) into `out` (default:
    the directory's report.png; for a URI, report.png here); returns the path."""
    import matplotlib  # the [plot] extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load(run)
    out = Path(out) if out is not None else Path("report.png") if is_remote(str(run)) else Path(run) / "report.png"
    t0, history, events = data["t0"], data["history"], data["events"]
    policy = (data["config"].get("sync") or {}).get("policy", "bsp")
    name = data["config"].get("name", run_name(run))
    fig, axes = plt.subplots(3, 2, figsize=(14, 11))
    (loss_ax, world_ax), (heat_ax, bytes_ax), (recovery_ax, text_ax) = axes

    # 1. loss and the evaluation metric
    by_member: dict[str, list[dict]] = {}
    for r in history:
        by_member.setdefault(r.get("slot", ""), []).append(r)
    for slot, records in sorted(by_member.items()):
        points = [(r["time"] - t0, r["loss"]) for r in records if r.get("loss") is not None]
        if points:
            loss_ax.plot(*zip(*points), lw=1, label=f"loss {slot}" if slot else "loss")
    loss_ax.set_xlabel("wall time (s)")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(f"{name}: loss and evaluation ({policy})")
    evals = [(r["time"] - t0, k, v) for r in history for k, v in (r.get("metrics") or {}).items()
             if isinstance(v, (int, float))]
    if evals:
        twin = loss_ax.twinx()
        for metric, color in zip(sorted({k for _, k, _ in evals}), ("tab:purple", "tab:brown", "tab:pink", "tab:olive")):
            pts = [(t, v) for t, k, v in evals if k == metric]
            twin.plot(*zip(*pts), "o-", ms=3, color=color, label=metric)
        twin.set_ylabel("evaluation")
        twin.legend(loc="center right", fontsize=8)
    if by_member:
        loss_ax.legend(loc="upper right", fontsize=8, ncol=2)

    # 2. world size and membership epochs, events marked
    if history:
        ordered = sorted(history, key=lambda r: r["time"])
        world_ax.step([r["time"] - t0 for r in ordered], [r.get("world_size", 0) for r in ordered], where="post",
                      label="world size")
        epoch_ax = world_ax.twinx()
        epoch_ax.step([r["time"] - t0 for r in ordered], [r.get("membership_epoch", 0) for r in ordered],
                      where="post", color="tab:orange", lw=1, label="membership epoch")
        epoch_ax.set_ylabel("membership epoch")
    marked = set()
    for e in events:
        kind = event_kind(e)
        if kind is None:
            continue
        color, marker = MARKS[kind]
        when = e["detail"].get("decided_at", e["time"]) - t0
        world_ax.axvline(when, color=color, lw=0.8, ls="--", label=kind if kind not in marked else None)
        marked.add(kind)
    world_ax.set_xlabel("wall time (s)")
    world_ax.set_ylabel("world size")
    world_ax.set_title("membership (dashed: deaths, joins, scale events)")
    world_ax.legend(loc="lower left", fontsize=8)

    # 3. step-time heat map
    rows = data["step_times"]
    slots = sorted({s for row in rows for s in row["step_s"]}, key=lambda s: (len(s), s))
    if rows and slots:
        import numpy as np

        grid = np.full((len(slots), len(rows)), np.nan)
        for j, row in enumerate(rows):
            for i, slot in enumerate(slots):
                if slot in row["step_s"]:
                    grid[i, j] = row["step_s"][slot] * 1000.0
        extent = (rows[0]["time"] - t0, rows[-1]["time"] - t0 + 1.0, len(slots) - 0.5, -0.5)
        image = heat_ax.imshow(grid, aspect="auto", interpolation="nearest", extent=extent, cmap="viridis")
        heat_ax.set_yticks(range(len(slots)))
        heat_ax.set_yticklabels(slots)
        fig.colorbar(image, ax=heat_ax, label="step time (ms)")
    else:
        heat_ax.text(0.5, 0.5, "no step times recorded", ha="center", va="center", transform=heat_ax.transAxes)
    heat_ax.set_xlabel("wall time (s)")
    heat_ax.set_title("each member's step time (stragglers: bright rows)")

    # 4. bytes per committed step
    for slot, records in sorted(by_member.items()):
        records = sorted(records, key=lambda r: r["step"])
        pts = [(b["step"], b["bytes_sent"] - a["bytes_sent"]) for a, b in zip(records, records[1:])
               if a.get("bytes_sent") is not None and b.get("bytes_sent") is not None
               and b["bytes_sent"] >= a["bytes_sent"] and b["step"] > a["step"]]
        if pts:
            bytes_ax.plot(*zip(*pts), lw=0.8, label=slot or "rank 0")
    bytes_ax.set_xlabel("committed step")
    bytes_ax.set_ylabel("bytes sent per step")
    bytes_ax.set_title("communication")
    if len(by_member) > 1:
        bytes_ax.legend(fontsize=8, ncol=2)
    rates = tokens_per_s(history)
    if rates:  # a workload that counts tokens: their rate, on the committed steps' axis
        tokens_ax = bytes_ax.twinx()
        tokens_ax.plot(*zip(*rates), color="tab:green", lw=1.2, label="tokens/s (all members)")
        tokens_ax.set_ylabel("tokens/s")
        tokens_ax.legend(loc="lower right", fontsize=8)
        bytes_ax.set_title("communication and tokens per second")

    # 5. recovery and join times
    timed = [(e, kind) for e in events if (kind := event_kind(e)) and e["detail"].get("duration_s") is not None]
    for e, kind in timed:
        color, marker = MARKS[kind]
        recovery_ax.scatter(e["detail"].get("decided_at", e["time"]) - t0, e["detail"]["duration_s"], color=color,
                            marker=marker, s=40)
    for kind in ("death", "join", "scale"):
        if any(k == kind for _, k in timed):
            recovery_ax.scatter([], [], color=MARKS[kind][0], marker=MARKS[kind][1], label=kind)
    recovery_ax.set_xlabel("wall time (s)")
    recovery_ax.set_ylabel("decided -> first committed step (s)")
    recovery_ax.set_title("recovery and join times")
    if timed:
        recovery_ax.legend(fontsize=8)
        recovery_ax.set_yscale("log")
    else:
        recovery_ax.text(0.5, 0.5, "no membership change", ha="center", va="center", transform=recovery_ax.transAxes)

    # 6. summary
    text_ax.axis("off")
    deaths = [e["detail"]["duration_s"] for e, k in timed if k == "death"]
    joins = [e["detail"]["duration_s"] for e, k in timed if k == "join"]
    status = data["status"]
    lines = [f"job {name}, policy {policy}", f"state {status.get('state', '?')} at step {status.get('step', '?')}",
             f"history records {len(history)}" + (f" ({len(by_member)} members)" if len(by_member) > 1 else ""),
             f"deaths {sum(1 for _, k in timed if k == 'death')}, joins {len(joins)}, "
             f"scale events {sum(1 for e in events if event_kind(e) == 'scale')}"]
    if deaths:
        lines.append(f"recovery: median {statistics.median(deaths):.3f} s, max {max(deaths):.3f} s")
    if joins:
        lines.append(f"join: median {statistics.median(joins):.2f} s")
    if status.get("cause"):
        lines.append(f"cause: {status['cause'][:80]}")
    text_ax.text(0.0, 1.0, "\n".join(lines), va="top", family="monospace", fontsize=10)

    end = max([r["time"] for r in history] + [e["time"] for e in events] + [t0]) - t0
    for ax in (loss_ax, world_ax, heat_ax, recovery_ax):  # one wall-time axis for every panel that has one
        ax.set_xlim(0, max(end, 1.0) * 1.02)
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(out)
    return out
