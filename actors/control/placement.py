"""Where a new worker of a job goes under `workers.placement: pack` (the default): to the node that
already holds most of this job's workers and has room for one more, so that a group's ring stays on
one node's links (NVLink, shared memory) as long as it fits; where none of them has room, to the node
with the most room of what a worker asks (GPUs, else CPUs), which the next workers then fill.

Every worker the group creates, the first ones, joiners, replacements and spares, is sent this way
(Ray's node affinity, soft and spilling: if the room went meanwhile, Ray places it elsewhere rather
than wait). A worker found dead gives its node's room back at once for the next choice (Ray's free
resources show it a moment later), so a replacement goes where its group is.
Not a placement group: an elastic job's membership changes size, a placement group cannot, and one
reserved for `workers.max` would hold resources the job does not use (and would never be granted
on a cluster smaller than that, leaving the job unstarted). Ray's DEFAULT strategy spreads workers
across nodes once a node is half used.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

EPS = 1e-9
FREED_WAIT_S = 2.0
"""How long a replacement waits for Ray to show a dead worker's room free on the node it goes to."""
VIEW_LAG_S = 1.0
"""How long a job's workers have all been placed before the packer takes a new view of the nodes' room."""


@dataclasses.dataclass(frozen=True)
class NodeRoom:
    """A node and what it has free (Ray's resource names: `CPU`, `GPU`, ...)."""

    node_id: str
    free: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class ActorPlace:
    """Where Ray has a worker actor: `node_id` once it is placed (None while it waits), `dead` once gone
    (with the node it was on, where Ray knows)."""

    node_id: str | None
    dead: bool = False


def pack_node(ask: Mapping[str, float], rooms: Sequence[NodeRoom], hosting: Mapping[str, int]) -> str | None:
    """The node for one more worker that asks `ask`: among the nodes with room for it, the one that
    hosts most of the job's workers (`hosting`), then the one with most room of what it asks (GPUs,
    else CPUs), then the greater node id; None where no node has room (Ray queues it)."""
    kind = "GPU" if ask.get("GPU", 0.0) > 0 else "CPU"
    fits = [r for r in rooms if all(r.free.get(name, 0.0) + EPS >= amount for name, amount in ask.items() if amount > 0)]
    if not fits:
        return None
    return max(fits, key=lambda r: (hosting.get(r.node_id, 0), r.free.get(kind, 0.0), r.node_id)).node_id


@dataclasses.dataclass
class _Sent:
    node: str
    """The node it was sent to."""
    since_view: bool
    """Sent after the view the packer counts from was taken (its ask is taken off that view)."""


class NodePacker:
    """The nodes this job's workers were sent to, and the next one's (`pack_node`).

    Ray's free resources lag its placements, in either direction: a worker can have its process before
    its node's free CPUs show it taken (about 60 ms here), or its node's resources can be taken for a
    worker whose process is still starting. So while workers are in flight the packer counts from one
    view of the nodes' room, taken when its workers had all been placed for `VIEW_LAG_S`, and takes off
    it each worker sent since and gives back each one that died: a burst of workers is packed as one
    set, and a replacement goes where its group is."""

    def __init__(self, ask: Mapping[str, float], rooms: Callable[[], list[NodeRoom]],
                 place_of: Callable[[str], ActorPlace], clock: Callable[[], float] = time.monotonic) -> None:
        """`rooms()`: every live node's free resources; `place_of(actor_id)`: where Ray has that actor."""
        self.ask = {name: amount for name, amount in ask.items() if amount > 0}
        self._rooms, self._place_of, self._clock = rooms, place_of, clock
        self._sent: dict[str, _Sent] = {}
        self._view: dict[str, dict[str, float]] | None = None
        self._since: Counter[str] = Counter()
        """Per node: workers sent there since the view, less those that died there."""
        self._freed: set[str] = set()
        """Nodes where a worker died since the view."""
        self._quiet_since = clock()
        self._lock = threading.Lock()

    def place(self, create: Callable[[str | None], Any], actor_id: Callable[[Any], str]) -> Any:
        """Create one worker (`create(node_id)`: None lets Ray choose) on the node `pack_node` picks."""
        with self._lock:
            try:
                node = self._choose()
            except Exception as err:  # noqa: BLE001 - Ray's private state API: unknown, not fatal
                log.debug("could not read the nodes' free resources: %s", err)
                node = None
            handle = create(node)
            if node is not None:
                self._sent[actor_id(handle)] = _Sent(node, since_view=True)
                self._since[node] += 1
                self._quiet_since = self._clock()
            return handle

    def _choose(self) -> str | None:
        hosting: Counter[str] = Counter()
        unplaced: Counter[str] = Counter()
        for actor, sent in list(self._sent.items()):
            where = self._place_of(actor)
            if where.dead:
                del self._sent[actor]
                node = sent.node if sent.since_view or where.node_id is None else where.node_id
                self._since[node] -= 1
                self._freed.add(node)
                self._quiet_since = self._clock()
            else:
                hosting[where.node_id or sent.node] += 1
                unplaced[sent.node] += where.node_id is None
        if self._view is None or (not sum(unplaced.values()) and self._clock() - self._quiet_since >= VIEW_LAG_S):
            self._view = {r.node_id: dict(r.free) for r in self._rooms()}
            self._since.clear()
            self._freed.clear()
            for sent in self._sent.values():
                sent.since_view = False
        rooms = [NodeRoom(n, {name: free.get(name, 0.0) - self._since[n] * amount for name, amount in self.ask.items()})
                 for n, free in self._view.items()]  # (Ray leaves a resource out once none of it is free)
        chosen = pack_node(self.ask, rooms, hosting)
        if chosen is not None and chosen in self._freed:
            self._await_room(chosen, unplaced[chosen])
        return chosen

    def _await_room(self, node: str, unplaced: int) -> None:
        """Wait, at most `FREED_WAIT_S`, until Ray shows room on `node` for one more worker beside the
        `unplaced` ones sent there: a dead worker's room shows free a moment after its death, and a
        worker sent there before would spill to another node."""
        deadline = time.monotonic() + FREED_WAIT_S
        while time.monotonic() < deadline:
            room = next((r.free for r in self._rooms() if r.node_id == node), None)
            if room is None or all(room.get(name, 0.0) + EPS >= (unplaced + 1) * amount for name, amount in self.ask.items()):
                return
            time.sleep(0.01)


def ray_rooms() -> list[NodeRoom]:
    """Every live node's free resources, from Ray's GCS (no dashboard needed)."""
    from ray._private.state import state

    return [NodeRoom(node, dict(free)) for node, free in state.available_resources_per_node().items()]


def ray_place_of(actor_id: str) -> ActorPlace:
    """Where Ray has the actor (its GCS actor table)."""
    from ray._private.state import state

    info = state.actor_table(actor_id) or {}
    node = (info.get("Address") or {}).get("NodeID") if info.get("Pid") else None  # a process: placed there
    return ActorPlace(node or None, dead=info.get("State") == "DEAD")
