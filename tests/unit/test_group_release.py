"""A membership epoch's gloo group is destroyed in its release thread, after a grace, never in the member's
thread. The backend's destructor joins its worker threads holding the GIL; a worker thread that has
just completed an operation may still need the GIL (the Python callback on the operation's future, and
its release). Seen in CI (2026-11-28, `test_policy_switch.py`): BSP's reducer held the last reference to
the old group's backend, the member dropped it while switching policy, and the process froze for good
(py-spy: `~Reducer` -> `~ProcessGroupGloo` -> `std::thread::join` in the member's thread, every other
member waiting for the GIL). In process, no Ray."""
from __future__ import annotations

import threading
import time
import weakref

import torch

from actors.transport.comm import GroupSpec, make_communicator
from actors.transport.formation import release
from algorithms.policies.base import EpochInfo, get_algorithm
from core.schema import JobConfig, parse
from orchestrator.config import config_from_dict
from testkit.harness import local_store


class Held:
    """Stands for a group's backend: something only its holders keep alive."""


def test_the_release_thread_holds_the_group_for_a_grace_after_its_operations_finished():
    held = Held()
    gone = threading.Event()
    weakref.finalize(held, gone.set)
    thread = threading.Thread(target=release, args=(held, [], time.monotonic() + 5.0, False, 0.3))
    del held
    started = time.monotonic()
    thread.start()
    assert gone.wait(10), "released in the end"
    assert time.monotonic() - started >= 0.25, "not before the grace: its worker threads may still need the GIL"
    thread.join(5)


def test_bsps_reducer_goes_when_the_epoch_ends_while_the_group_still_holds_its_backend():
    """The member ends an epoch (`on_epoch_end`) before it closes the group: the reducer is gone by then,
    so the group's release thread holds the last reference, not the member."""
    cfg = parse(JobConfig, config_from_dict({
        "name": "release", "workload": {"factory": "orchestrator.workloads.digits:mlp", "batch_size": 8},
        "sync": {"policy": "bsp", "engine": "reducer"}, "stop": {"max_steps": 1}}).to_dict())
    host, port = local_store()
    comm = make_communicator(GroupSpec(host, port, "release/r/c0/e1", 0, 1, 10.0, "gloo", "127.0.0.1", secret=b"k" * 32))
    model = torch.nn.Linear(4, 2)
    impl = get_algorithm("bsp")(cfg.sync, cfg.compression).bind(model, torch.optim.SGD(model.parameters(), lr=0.1))
    impl.on_membership(comm, EpochInfo(0, 1, ("w0",), 8, 1))
    assert impl.reducer is not None, "BSP runs on torch's reducer over the gloo group"
    impl.on_epoch_end("membership epoch 2 begins")
    assert impl.reducer is None, "the reducer goes with the epoch, before the group is closed"
    comm.close()
