"""Where a new worker goes under `workers.placement: pack` (actors/control/placement.py): the node that
already holds most of the job's workers and has room, else the one with most room of what a worker
asks; workers sent in a burst, not yet placed, count on their node and take its room. Pure: the
nodes' room and the actors' places are given; tests/integration/test_packing_on_two_nodes.py runs it on a
real two-node Ray cluster."""
from __future__ import annotations

from actors.control import placement
from actors.control.placement import ActorPlace, NodePacker, NodeRoom, pack_node


def test_a_worker_goes_where_the_job_already_is_while_it_fits():
    rooms = [NodeRoom("a", {"CPU": 2, "GPU": 1}), NodeRoom("b", {"CPU": 8, "GPU": 6})]
    assert pack_node({"CPU": 1, "GPU": 1}, rooms, {"a": 7}) == "a"  # the job's node, though b has more room
    assert pack_node({"CPU": 1, "GPU": 1}, rooms, {}) == "b"  # nowhere yet: the most free GPUs
    assert pack_node({"CPU": 3}, rooms, {"a": 7}) == "b"  # a has no room left
    assert pack_node({"CPU": 1, "GPU": 7}, rooms, {}) is None  # nobody has room: Ray queues it
    assert pack_node({"CPU": 0.5, "GPU": 0.5}, [NodeRoom("a", {"CPU": 0.5, "GPU": 0.5})], {}) == "a"


def test_gpu_workers_pick_by_free_gpus_and_cpu_workers_by_free_cpus():
    rooms = [NodeRoom("a", {"CPU": 30, "GPU": 2}), NodeRoom("b", {"CPU": 4, "GPU": 8})]
    assert pack_node({"CPU": 1, "GPU": 1}, rooms, {}) == "b"
    assert pack_node({"CPU": 1}, rooms, {}) == "a"


class Cluster:
    """Two 8-GPU nodes. Like Ray, a node's free resources leave out a name once none of it is free, and
    lag the placements: `lease_first` takes a worker's room at once, before its process (its place)
    exists; otherwise the room is taken only when `settle()` places it. A death's room comes back only
    at `release()`."""

    def __init__(self, lease_first: bool = False) -> None:
        self.free = {"n1": {"CPU": 8.0, "GPU": 8.0}, "n2": {"CPU": 8.0, "GPU": 8.0}}
        self.places: dict[str, ActorPlace] = {}
        self.sent: dict[str, str | None] = {}
        self.lease_first = lease_first
        self.dying: list[str] = []

    def rooms(self) -> list[NodeRoom]:
        return [NodeRoom(node, {k: v for k, v in free.items() if v > 0}) for node, free in self.free.items()]

    def take(self, node: str, sign: float = 1.0) -> None:
        self.free[node]["CPU"] -= sign
        self.free[node]["GPU"] -= sign

    def create(self, node: str | None) -> str:
        assert node is not None
        actor = f"actor{len(self.sent)}"
        self.sent[actor] = node
        self.places[actor] = ActorPlace(None)
        if self.lease_first:
            self.take(node)
        return actor

    def settle(self) -> None:
        for actor, node in self.sent.items():
            if self.places[actor].node_id is None and not self.places[actor].dead:
                assert node is not None
                self.places[actor] = ActorPlace(node)
                if not self.lease_first:
                    self.take(node)

    def kill(self, actor: str) -> None:
        self.places[actor] = ActorPlace(self.places[actor].node_id, dead=True)
        self.dying.append(actor)

    def release(self) -> None:
        for actor in self.dying:
            if self.places[actor].node_id is not None:
                self.take(self.places[actor].node_id, -1.0)
        self.dying.clear()


def packer_on(cluster: Cluster) -> NodePacker:
    return NodePacker({"CPU": 1, "GPU": 1}, cluster.rooms, lambda a: cluster.places[a], clock=lambda: 0.0)


def test_a_burst_of_workers_not_yet_placed_fills_one_node_before_the_next(monkeypatch):
    monkeypatch.setattr(placement, "FREED_WAIT_S", 0.0)  # Ray's room never shows the death here until release()
    for lease_first in (False, True):  # the room taken after the worker's process exists, or before
        cluster = Cluster(lease_first)
        packer = packer_on(cluster)
        first = [packer.place(cluster.create, str) for _ in range(10)]  # created before any is placed
        assert [cluster.sent[a] for a in first] == ["n2"] * 8 + ["n1"] * 2, lease_first  # n2 wins the tie by id
        cluster.settle()
        cluster.kill(first[3])  # a death on n2, whose room Ray does not show free yet (none of its CPUs listed)
        assert "CPU" not in cluster.rooms()[1].free
        replacement = packer.place(cluster.create, str)
        assert cluster.sent[replacement] == "n2", lease_first  # back where 7 of its group still are
        cluster.settle()


def test_without_the_packers_count_a_burst_goes_to_one_node_or_is_split():
    """The mechanism switched off: the nodes' room as Ray shows it at each creation, nothing remembered.
    Where Ray shows a room taken only once placed, all ten go to one node (two more than it holds);
    where it shows it at once, they go to one node and then alternate, as the room evens out."""
    cluster = Cluster()
    assert [pack_node({"CPU": 1, "GPU": 1}, cluster.rooms(), {}) for _ in range(10)] == ["n2"] * 10
    cluster = Cluster(lease_first=True)
    sent = [cluster.create(pack_node({"CPU": 1, "GPU": 1}, cluster.rooms(), {})) for _ in range(10)]
    assert [cluster.sent[a] for a in sent] != ["n2"] * 8 + ["n1"] * 2


def test_a_new_view_is_taken_once_the_workers_have_all_been_placed_for_a_while():
    now = {"t": 0.0}
    cluster = Cluster()
    packer = NodePacker({"CPU": 1, "GPU": 1}, cluster.rooms, lambda a: cluster.places[a], clock=lambda: now["t"])
    [packer.place(cluster.create, str) for _ in range(3)]
    cluster.settle()
    cluster.free["n2"]["GPU"] = 0.0  # another job took n2's other GPUs meanwhile
    now["t"] = placement.VIEW_LAG_S + 1.0
    assert cluster.sent[packer.place(cluster.create, str)] == "n1"  # seen in the new view
