"""Which samples a replica applied and which were lost: the ids of its steps not yet committed, the
departed members' shares of local steps the survivors keep (counted as dropped), and, with
`faults.record_samples`, the file `samples/<slot>.txt` that the exactly-once tests read
(`step membership_epoch ids...` for each step applied, `dropped epoch step ids...` for shares lost).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import IO

import numpy as np

from actors.plan import Plan
from actors.runs import runfiles


class SampleLedger:
    """A member's applied and dropped samples since its last commit."""

    def __init__(self, run_dir: str, slot: str, record: bool) -> None:
        """`record`: write the applied samples (`faults.record_samples`; a server kind's server writes
        what it applies instead)."""
        self._file: IO[str] | None = None
        if record:
            os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
            self._file = runfiles.open_appended(os.path.join(run_dir, "samples", f"{slot}.txt"))
        self._pending: list[tuple[int, np.ndarray]] = []
        """(step, ids) of the steps trained since the last commit (recorded only)."""
        self._departed: set[str] = set()
        """Departed members whose shares of those steps were already counted as dropped."""
        self._dropped = 0
        """Samples handed to departed members since the last record and counted as dropped."""

    def trained(self, step: int, ids: np.ndarray) -> None:
        """Step `step` trained `ids`; they count as applied once it commits."""
        if self._file is not None:
            self._pending.append((step, ids))

    def attempted(self, step: int, ids: np.ndarray) -> None:
        """Step `step` failed here: its `ids` were applied if some member committed it (a split vote)."""
        if self._file is not None:
            self._pending = [(step, ids)]

    def take_pending(self) -> list[tuple[int, np.ndarray]]:
        """The steps trained (or attempted) since the last commit, forgotten here."""
        pending, self._pending = self._pending, []
        return pending

    def write(self, steps: list[tuple[int, np.ndarray]], epoch: int) -> None:
        """`steps` were applied, in membership epoch `epoch`."""
        if self._file is not None and steps:
            for step, ids in steps:
                self._file.write(f"{step} {epoch} {' '.join(map(str, ids.tolist()))}\n")
            self._file.flush()

    def forget(self) -> None:
        """The steps since the last commit will not be applied (rewound, redone, or replaced by a state)."""
        self._pending = []

    def committed(self, epoch: int) -> None:
        """A commit: the steps since the last one were applied, in membership epoch `epoch`."""
        self.write(self.take_pending(), epoch)
        self._departed = set()

    def drop(self, count: int) -> None:
        """`count` samples were handed out and will never be trained (a share skipped over)."""
        self._dropped += count

    def drop_departed(self, trained: Plan, plan: Plan, first_step: int, cursors: list[int],
                      share: Callable[[Plan, int, int], np.ndarray], writes: bool) -> None:
        """The survivors keep their local steps since the last commit (steps `first_step`, ... at the
        data `cursors`): the shares that members departed from `trained` to `plan` trained in those steps died
        with their replicas. `share(plan, cursor, rank)` is a rank's share; `writes`: this member records
        them (rank 0)."""
        departed = [s for s in trained.members if s not in plan.members and s not in self._departed]
        self._departed.update(departed)
        for k, cursor in enumerate(cursors):
            shares = [share(trained, cursor, trained.members.index(s)) for s in departed]
            lost = np.concatenate(shares) if shares else np.empty(0, dtype=np.int64)
            self._dropped += len(lost)
            if self._file is not None and writes and len(lost):
                self._file.write(f"dropped {plan.membership_epoch} {first_step + k} {' '.join(map(str, lost.tolist()))}\n")
                self._file.flush()

    def take_dropped(self) -> int:
        """The samples dropped since the last call (each history record says how many)."""
        dropped, self._dropped = self._dropped, 0
        return dropped
