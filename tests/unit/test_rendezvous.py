"""The group store takes only what the job's own members wrote: values are signed with the job's key
(it travels over Ray only), and one written by anything else is refused with a clear error. In
process (no Ray): members of one gloo group formed in threads over an in-memory store."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from actors.transport import sockets, stores
from actors.transport.comm import CommError, ForgedRendezvous, GroupSpec, make_communicator
from testkit.harness import local_store

KEY = b"k" * 32


def spec(host, port, rank: int, secret: bytes, name: str = "job/r/c0/e1", timeout_s: float = 4.0) -> GroupSpec:
    return GroupSpec(host, port, name, rank, 2, timeout_s, "gloo", "127.0.0.1", secret=secret)


def test_members_with_the_jobs_key_form_and_reduce():
    host, port = local_store()
    with ThreadPoolExecutor(2) as pool:
        comms = list(pool.map(make_communicator, [spec(host, port, r, KEY) for r in range(2)]))
    tensors = [torch.full((3,), float(r + 1)) for r in range(2)]
    handles = [c.all_reduce(t) for c, t in zip(comms, tensors)]
    for h in handles:
        h.wait()
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in tensors)
    raw = bytes(dist.PrefixStore("job/r/c0/e1/", stores._client_stores[(host, port)]).get("gloo-listen/0"))
    assert len(raw) > 32 and raw[:32] != raw[32:64], "what reaches the store is signed"


@pytest.mark.parametrize("outsider", [b"", b"x" * 32], ids=["no key", "another key"])
def test_a_rendezvous_value_written_outside_the_job_is_refused(outsider):
    """Rank 1 of the epoch's group is played by something without the job's key: it writes its gloo
    address and listening address like a member would. The member refuses them, naming the key."""
    host, port = local_store()
    threading.Thread(target=lambda: _try(make_communicator, spec(host, port, 1, outsider, timeout_s=2.0)),
                     daemon=True).start()
    started = time.monotonic()
    with pytest.raises(ForgedRendezvous) as err:
        make_communicator(spec(host, port, 0, KEY))
    print(f"refused after {time.monotonic() - started:.2f}s: {err.value}")
    assert "not signed with this job's key" in str(err.value) and "job/r/c0/e1" in str(err.value)


def test_a_forged_listening_address_is_refused_by_the_signed_store():
    """The abort shuts down the connections to the peers' published gloo listening addresses: a forged
    one (here written straight into the store, after the member's own) would aim it at the worker's
    own Ray connections. Read through the group's signed view, it is refused."""
    from actors.transport.comm import SignedStore

    raw = dist.HashStore()
    view = SignedStore(dist.PrefixStore("job/r/c0/e1/", raw), KEY)
    view.set("gloo-listen/1", "127.0.0.1 40000")
    assert view.get("gloo-listen/1") == b"127.0.0.1 40000"
    signed = bytes(raw.get("job/r/c0/e1//gloo-listen/1"))
    dist.PrefixStore("job/r/c0/e1/", raw).set("gloo-listen/1", "127.0.0.1 6379")  # the forger
    with pytest.raises(ForgedRendezvous, match="'gloo-listen/1' is not signed with this job's key"):
        view.get("gloo-listen/1")
    with pytest.raises(ForgedRendezvous):
        view.multi_get(["gloo-listen/1"])
    dist.PrefixStore("job/r/c0/e1/", raw).set("gloo-listen/0", signed)  # a member's signed value moved to another key
    with pytest.raises(ForgedRendezvous):
        view.get("gloo-listen/0")


def _try(fn, *args):
    try:
        return fn(*args)
    except CommError as err:
        return err


def test_the_devices_listening_address_is_found_when_its_descriptor_number_was_just_freed(monkeypatch):
    """Another thread closes a socket while a member creates its gloo device, and the device's
    listening socket takes the freed descriptor number. The address is still found (by the socket's
    identity, not its number); without it, the member published an empty address (a CI flake of
    `test_members_with_the_jobs_key_form_and_reduce`) and its abort could not shut its pairs down."""
    import socket

    create = dist.ProcessGroupGloo.create_device
    others = [socket.socket() for _ in range(8)]

    def closing_first(**kwargs):
        for other in others:  # the lowest free numbers are now ones `before` saw: the device's take them
            other.close()
        return create(**kwargs)

    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device", closing_first)
    _device, listen = sockets.device_and_address("127.0.0.1")
    assert listen is not None and listen[0] == "127.0.0.1", listen


def test_a_device_made_ahead_is_the_next_groups_and_no_creation_is_paid_then(monkeypatch):
    """`prepare_device` makes the next group's gloo device (and finds its listening address) off a
    re-form's path; `device_and_address` then hands that one out and creates none, and the one after
    it is a new device again."""
    import socket

    import torch.distributed as dist

    from actors.transport import sockets

    sockets.prepare_device("127.0.0.1")
    ahead = sockets._SPARE_DEVICES["127.0.0.1"]
    create = dist.ProcessGroupGloo.create_device

    def refused(**kwargs):
        raise AssertionError("a device was created with one made ahead")
    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device", refused)
    device, listen = sockets.device_and_address("127.0.0.1")
    assert (device, listen) == ahead and listen is not None and listen[0] == "127.0.0.1"
    socket.create_connection(listen, timeout=5).close()  # the address it listens on, found ahead
    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device", create)
    _, again = sockets.device_and_address("127.0.0.1")
    assert again is not None and again != listen, "one made ahead serves one group"


def test_a_store_connection_made_ahead_is_the_next_formations_own(monkeypatch):
    """`prepare_client` connects the next formation's client to the epoch's store off a re-form's path;
    `client_store` then hands that one out (and connects none), once; a later one is new again."""
    import torch.distributed as dist

    from actors.transport import stores
    from actors.transport.comm import serve_store

    _server, port, sock = serve_store("127.0.0.1", 5.0)
    try:
        stores.prepare_client("127.0.0.1", port, 5.0)
        ahead = stores._spare_client[("127.0.0.1", port, 5.0)]
        real = dist.TCPStore

        def refused(*args, **kwargs):
            raise AssertionError("a client was connected with one made ahead")
        monkeypatch.setattr(stores.dist, "TCPStore", refused)
        client = stores.client_store("127.0.0.1", port, 5.0)
        assert client is ahead
        client.set("k", "v")
        assert client.get("k") == b"v", "the client made ahead works"
        monkeypatch.setattr(stores.dist, "TCPStore", real)
        assert stores.client_store("127.0.0.1", port, 5.0) is not ahead, "one made ahead serves one formation"
    finally:
        sock.close()


def _view(raw: dist.Store, name: str) -> dist.Store:
    from actors.transport.signed_store import group_store

    return group_store(GroupSpec("127.0.0.1", 0, name, 0, 2, 4.0, "gloo", "127.0.0.1", secret=KEY), raw)


@pytest.mark.parametrize("target", ["job/r/c0/e2", "job/r/c0/e1/bg", "job/r/c1/e1", "otherjob/r/c0/e1"],
                         ids=["next epoch", "background group", "next coordinator incarnation", "another job"])
def test_a_signed_value_replayed_into_another_group_or_epoch_is_refused(target):
    """Anything that reaches the store's port can read a member's signed value and copy it under the same
    key into another group's prefix (the background group's listening value names its shared-memory
    segment: copied into the main group, peers would sum the wrong segment). The MAC covers the group's
    whole key, so the copy does not verify there."""
    raw = dist.HashStore()
    source = _view(raw, "job/r/c0/e1")
    source.set("gloo-listen/1", "127.0.0.1 40001 orchestrator-0123456789abcdef")
    assert source.get("gloo-listen/1") == b"127.0.0.1 40001 orchestrator-0123456789abcdef"
    copied = bytes(raw.get("job/r/c0/e1//gloo-listen/1"))
    raw.set(f"{target}//gloo-listen/1", copied)
    with pytest.raises(ForgedRendezvous, match="copied from another group or epoch"):
        _view(raw, target).get("gloo-listen/1")


def test_counters_are_signed_and_one_changed_from_outside_is_refused():
    """A member's counter counts; a client outside the job that adds to it (or writes it) leaves a value
    that no longer verifies, and the next member to read it is refused instead of trusting the count."""
    raw = dist.HashStore()
    view = _view(raw, "job/r/c0/e1")
    assert view.add("attached", 1) == 1 and view.add("attached", 2) == 3
    assert view.get("attached") == b"3"
    raw.set("job/r/c0/e1//attached", "100")  # the outsider, straight to the store (its `add` fails on a signed value)
    with pytest.raises(ForgedRendezvous):
        view.add("attached", 1)
    fresh = _view(raw, "job/r/c0/e1")
    raw.add("job/r/c0/e1//fresh", 7)  # a counter the job never made
    with pytest.raises(ForgedRendezvous):
        fresh.add("fresh", 1)


def test_a_delete_through_the_group_view_removes_only_what_the_job_signed():
    raw = dist.HashStore()
    view = _view(raw, "job/r/c0/e1")
    view.set("mine", "v")
    assert view.delete_key("mine") and not raw.check(["job/r/c0/e1//mine"])
    raw.set("job/r/c0/e1//planted", "x")
    with pytest.raises(ForgedRendezvous):
        view.delete_key("planted")
    assert raw.check(["job/r/c0/e1//planted"]), "a value the job did not sign is left, not removed on its say"
    assert view.delete_key("never-written") is False
