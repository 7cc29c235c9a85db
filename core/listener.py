"""What hears a job as it runs: the journal's listeners (the metrics, the status feed, TensorBoard).

The journal tells each listener every committed history record and every event, in order, and closes
it at the job's end. A listener that raises is told nothing more of that kind's failure: the journal
notes the failure once as an event and the job trains on (watching a job must never stop it)."""
from __future__ import annotations

from typing import Any, Protocol


class JobListener(Protocol):
    def record(self, record: dict[str, Any]) -> None:
        """A committed history record (`history.jsonl`'s line)."""

    def event(self, event: Any) -> None:
        """An event (`core.schema.Event`), as it is written to `events.jsonl`."""

    def close(self) -> None:
        """The job has ended: flush and let go of what it holds."""
