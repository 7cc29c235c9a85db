"""How a job's status shows in a notebook: compact HTML (`JobStatus._repr_html_`, `ElasticJob`'s too).

The state in its colour, step (and a progress bar towards `stop.max_steps`), world size, membership
epoch, loss, throughput and evaluation metrics; each member with its rank, state, pid, node and step
time over the median member's (stragglers); the cause of a failure; the newest events but the routine
checkpoint entries (`notable`), which would bury the reshapes and failures.
"""
from __future__ import annotations

import html
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from core.schema import JobStatus

COLORS = {"RUNNING": "#2e7d32", "FINISHED": "#1565c0", "FAILED": "#c62828", "STOPPED": "#6d4c41",
          "PAUSED": "#ef6c00", "RESHAPING": "#f9a825", "STARTING": "#757575", "STOPPING": "#6d4c41"}
STYLE = "font-family:monospace;font-size:12px;border-collapse:collapse"
CELL = "padding:1px 8px;text-align:left;border-bottom:1px solid #ddd"


def _e(value: Any) -> str:
    return html.escape(str(value))


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def checkpoint_line(checkpoint: dict, now: float | None = None) -> str:
    """"last durable checkpoint: step N, 12s ago; 3 failed tries to store one" ("" before any)."""
    if not checkpoint:
        return ""
    age = (now if now is not None else time.time()) - checkpoint["time"] if "time" in checkpoint else None
    line = (f"last durable checkpoint: step {checkpoint['step']}, {age:.0f}s ago" if age is not None
            else "last durable checkpoint: none yet")
    failures = checkpoint.get("failures", 0)
    return line + (f"; {failures} failed tries to store one (checkpoint_failed events)" if failures else "")


ROUTINE_EVENTS = frozenset({"checkpoint"})
"""Event kinds a run records over and over as it goes well (one per checkpoint stored): the status shows
the newest one's step and age, so a list of the newest events leaves them out and keeps the reshapes,
failures and transitions in view (`ElasticJob.events()` still returns them)."""


def notable(events: Sequence[dict], count: int = 5) -> tuple[dict, ...]:
    """The newest `count` events that are not routine (`ROUTINE_EVENTS`), oldest first."""
    return tuple([event for event in events if event["kind"] not in ROUTINE_EVENTS][-count:])


def status_html(status: JobStatus, events: tuple[dict, ...] = (), max_steps: int | None = None) -> str:
    color = COLORS.get(status.state, "#424242")
    head = (f'<b>{_e(status.name)}</b> <span style="color:{color};font-weight:bold">{_e(status.state)}</span> '
            f"step {status.step}{f'/{max_steps}' if max_steps else ''} · world {status.world_size} · "
            f"epoch {status.membership_epoch} · loss {fmt(status.loss, '.4f')} · "
            f"{fmt(status.throughput, '.1f')} steps/s"
            + (f" · {status.tokens_per_s:,.0f} tokens/s" if status.tokens_per_s else ""))
    metrics = ", ".join(f"{_e(k)} {v:.4f}" for k, v in status.metrics.items() if isinstance(v, (int, float)))
    parts = [f'<div style="{STYLE}">{head}' + (f" · {metrics}" if metrics else "")]
    if max_steps:
        done = min(100.0, 100.0 * status.step / max_steps)
        parts.append(f'<div style="background:#eee;width:320px;height:8px;margin:3px 0">'
                     f'<div style="background:{color};width:{done:.1f}%;height:8px"></div></div>')
    if status.cause:
        parts.append(f'<div style="color:#c62828">cause: {_e(status.cause)}</div>')
    if status.checkpoint:
        failed = status.checkpoint.get("failures", 0)
        parts.append(f'<div style="color:{"#c62828" if failed else "#424242"}">{_e(checkpoint_line(status.checkpoint))}</div>')
    rows = "".join(
        f'<tr><td style="{CELL}">{_e(m.slot)}</td><td style="{CELL}">{m.rank if m.rank >= 0 else "-"}</td>'
        f'<td style="{CELL}">{_e(m.state)}</td><td style="{CELL}">{m.pid or "-"}</td>'
        f'<td style="{CELL}">{_e(m.node)}</td>'
        f'<td style="{CELL}">{fmt(status.stragglers.get(m.slot), ".2f")}</td></tr>' for m in status.members)
    if rows:
        parts.append(f'<table style="{STYLE}"><tr><th style="{CELL}">slot</th><th style="{CELL}">rank</th>'
                     f'<th style="{CELL}">state</th><th style="{CELL}">pid</th><th style="{CELL}">node</th>'
                     f'<th style="{CELL}">step time / median</th></tr>{rows}</table>')
    if events:
        items = "".join(f"<li>{time.strftime('%H:%M:%S', time.localtime(e['time']))} {_e(e['kind'])}: "
                        f"{_e(e['reason'][:160])}</li>" for e in events)
        parts.append(f'<div>newest events (checkpoints aside):</div><ul style="margin:0">{items}</ul>')
    parts.append(f'<div style="color:#757575">run {_e(status.run_id)} · {_e(status.run_dir)}</div></div>')
    return "".join(parts)
