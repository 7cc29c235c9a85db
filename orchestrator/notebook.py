"""Jobs in a notebook: compact HTML for `ElasticJob` and `JobStatus`, and `watch`.

Jupyter shows an object through its `_repr_html_`; these build it from a status (state, step, world
size, loss, throughput, each member with its rank and step-time ratio, the newest events). `watch`
keeps one display updated (a progress bar towards `stop.max_steps`) until the job ends: blocking for
at most `timeout` seconds, or in a background thread (`block=False`) so that the kernel runs other
cells meanwhile. Outside a notebook it prints a progress line instead.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from core.display import fmt, status_html
from core.schema import TERMINAL_STATES, JobStatus


def progress_line(status: JobStatus, max_steps: int | None) -> str:
    return (f"{status.name} {status.state} step {status.step}{f'/{max_steps}' if max_steps else ''} world "
            f"{status.world_size} loss {fmt(status.loss, '.4f')}")


def watch(read: Callable[[], tuple[JobStatus, tuple[dict, ...]]], max_steps: int | None,
          timeout: float | None, every: float, block: bool) -> threading.Thread | None:
    """Show the job until it ends (or `timeout` s pass): one display kept up to date in a notebook,
    progress lines elsewhere. `block=False`: in a daemon thread, returned at once."""
    shell = None
    if "IPython" in sys.modules:  # a notebook (or an IPython shell) has imported it; nobody else needs it
        from IPython import get_ipython
        from IPython.display import HTML, display

        shell = get_ipython()
        if shell is not None and type(shell).__name__ == "TerminalInteractiveShell":
            shell = None  # a terminal shows no HTML: progress lines
    handle = display(HTML(""), display_id=True) if shell is not None else None

    def loop() -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            status, events = read()
            if handle is not None:
                handle.update(HTML(status_html(status, events, max_steps)))
            else:
                print(progress_line(status, max_steps), flush=True)
            if status.state in TERMINAL_STATES or (deadline is not None and time.monotonic() >= deadline):
                return
            time.sleep(every)

    if block:
        loop()
        return None
    thread = threading.Thread(target=loop, name="orchestrator-watch", daemon=True)
    thread.start()
    return thread
