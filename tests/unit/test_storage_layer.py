"""The storage layer (actors/runs/storage.py), the run mirror (actors/runs/mirror.py) and checkpoints on a
remote filesystem, without Ray and without a network: fsspec's in-memory filesystem through pyarrow's
fsspec handler is the remote store here (the same code path as s3://, which the e2e tests use)."""
from __future__ import annotations

import json
import time
import uuid

import pytest

from actors.runs import checkpoints
from actors.runs.mirror import RunMirror, appended_pieces, read_appended
from actors.runs.storage import StorageError, is_remote, open_storage


@pytest.fixture
def remote():
    storage = open_storage(f"memory://bucket-{uuid.uuid4().hex[:8]}/prefix")
    assert storage.remote
    return storage


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_objects_are_written_whole_listed_and_deleted(tmp_path, remote, kind):
    storage = open_storage(str(tmp_path)) if kind == "local" else remote
    storage.write("job/run/a.txt", b"abc")
    storage.write("job/run/sub/b.txt", b"de")
    assert storage.read("job/run/a.txt") == b"abc" and storage.size("job/run/sub/b.txt") == 2
    assert storage.list("job/run") == [("job/run/a.txt", 3), ("job/run/sub/b.txt", 2)]
    assert storage.list("job/run", recursive=False) == [("job/run/a.txt", 3), ("job/run/sub", -1)]
    assert storage.key_of(storage.location("job/run/a.txt")) == "job/run/a.txt"
    storage.delete("job/run/a.txt")
    storage.delete("job/run/never.txt")  # gone if it was there
    assert storage.size("job/run/a.txt") is None
    with pytest.raises(FileNotFoundError):
        storage.read("job/run/a.txt")
    storage.check()


def test_uris_and_their_errors():
    assert not is_remote("/tmp/x") and not is_remote("file:///tmp/x") and not is_remote("C:\\runs")
    assert is_remote("s3://b/p") and is_remote("memory://b")
    with pytest.raises(StorageError, match="^storage: no filesystem for nosuch://"):
        open_storage("nosuch://bucket/p")
    with pytest.raises(StorageError, match="^storage: unknown S3 option"):
        open_storage("s3://bucket/p?endpoint=http://127.0.0.1:9")
    with pytest.raises(StorageError, match="^storage: .*names no bucket"):
        open_storage("s3:///p")


def test_missing_s3_credentials_are_said_before_any_request(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StorageError, match="^storage: no S3 credentials"):
        open_storage("s3://bucket/p?endpoint_override=http://127.0.0.1:9&scheme=http")
    open_storage("s3://bucket/p?endpoint_override=http://127.0.0.1:9&scheme=http&anonymous=true")  # none wanted


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_appended_files_go_up_as_parts_of_whole_lines_that_read_back_byte_for_byte(tmp_path, remote):
    mirror = RunMirror(remote, "job/run", tmp_path, interval_s=0.05).start()
    lines = []
    with open(tmp_path / "history.jsonl", "a") as out:
        for step in range(1, 20):
            line = json.dumps({"step": step}) + "\n"
            out.write(line[:5])  # a line still being written stays here
            out.flush()
            assert mirror.flush(10)
            out.write(line[5:])
            out.flush()
            lines.append(line)
    assert mirror.close()
    assert read_appended(remote, "job/run/history.jsonl") == "".join(lines).encode()
    pieces = appended_pieces(remote, "job/run/history.jsonl")
    assert all(remote.read(p.key).endswith(b"\n") for p in pieces), "a part ends in the middle of a line"
    assert mirror.uploaded_bytes == len("".join(lines)), "a byte went up twice"


def test_a_new_mirror_sends_only_what_the_store_lacks_and_a_hole_ends_the_read(tmp_path, remote):
    (tmp_path / "events.jsonl").write_text("a\nb\n")
    first = RunMirror(remote, "job/run", tmp_path, interval_s=0.05).start()
    assert first.close()
    (tmp_path / "events.jsonl").write_text("a\nb\nc\n")
    second = RunMirror(remote, "job/run", tmp_path, interval_s=0.05).start()
    assert second.close()
    assert second.uploaded_bytes == 2, "the restarted mirror sent again what the store had"
    assert read_appended(remote, "job/run/events.jsonl") == b"a\nb\nc\n"
    remote.delete(appended_pieces(remote, "job/run/events.jsonl")[0].key)  # a hole at the start
    assert read_appended(remote, "job/run/events.jsonl") == b""


def test_hydrate_copies_down_what_this_nodes_folder_lacks(tmp_path, remote):
    here, there = tmp_path / "node-a", tmp_path / "node-b"
    here.mkdir()
    (here / "coordinator.json").write_text('{"epoch": 3}')
    (here / "history.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    mirror = RunMirror(remote, "job/run", here, interval_s=0.05).start()
    mirror.put("coordinator.json")
    assert mirror.close()
    there.mkdir()
    (there / "history.jsonl").write_text('{"step": 1}\n')  # less than the store has
    copied = RunMirror(remote, "job/run", there).hydrate()
    assert sorted(copied) == ["coordinator.json", "history.jsonl"]
    assert (there / "coordinator.json").read_text() == '{"epoch": 3}'
    assert (there / "history.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert RunMirror(remote, "job/run", there).hydrate() == [], "a second hydrate copied again"


def test_puts_are_coalesced_newest_wins(tmp_path, remote):
    mirror = RunMirror(remote, "job/run", tmp_path, interval_s=10.0)
    for n in range(5):
        (tmp_path / "coordinator.json").write_text(json.dumps({"n": n}))
        mirror.put("coordinator.json")  # not started yet: all five wait as one
    mirror.start()
    assert mirror.flush(10)
    assert json.loads(remote.read("job/run/coordinator.json")) == {"n": 4}
    assert mirror.uploaded_bytes == len(json.dumps({"n": 4})), "each put was uploaded, not the newest once"
    mirror.close()


class Flaky:
    """A storage whose writes fail until `healed`."""

    def __init__(self, inner):
        self.inner, self.healed, self.writes = inner, False, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, key, data):
        self.writes += 1
        if not self.healed:
            raise OSError("connection refused\nsecond line")
        self.inner.write(key, data)


def test_a_failing_store_is_retried_and_reported_once(tmp_path, remote):
    flaky = Flaky(remote)
    said = []
    mirror = RunMirror(flaky, "job/run", tmp_path, interval_s=0.02, on_error=said.append).start()
    (tmp_path / "status.json").write_text("{}")
    mirror.put("status.json")
    wait_for(lambda: flaky.writes >= 3)  # retried (10 s allowed; every 0.02 s here)
    assert not mirror.flush(0.05)
    assert len(said) == 1 and said[0].startswith("storage: could not upload status.json") and "\n" not in said[0], said
    flaky.healed = True
    assert mirror.flush(5) and mirror.error == ""
    assert remote.read("job/run/status.json") == b"{}"
    mirror.close()


def test_a_torn_checkpoint_object_is_skipped_with_a_warning(remote):
    for step in (10, 20):
        checkpoints.save((remote, "job/r1"), step, bytes([step]) * 1000, keep=3)
    (newest,) = [k for k, _ in remote.list("job/r1/checkpoints") if k.endswith(".pt") and "step-00000020-" in k]
    remote.write(newest, remote.read(newest)[:400])  # a partial upload under the real name
    warnings = []
    ref = checkpoints.newest_valid((remote, "job"), warn=warnings.append)
    assert ref.step == 10 and ref.run_id == "r1" and ref.location.startswith(remote.uri), ref
    assert len(warnings) == 1 and newest.rsplit("/", 1)[1] in warnings[0] and "400 bytes" in warnings[0], warnings
    assert checkpoints.read_verified(remote, ref.location) == bytes([10]) * 1000
    with pytest.raises(RuntimeError, match="manifest says 1000"):
        checkpoints.read_verified(remote, remote.location(newest))


def test_a_checkpoint_without_its_manifest_does_not_count(remote):
    """The manifest goes last: data whose manifest never arrived (an upload cut off between the two) is
    not a checkpoint; retention deletes the manifest first, and the next save collects data no manifest
    names."""
    checkpoints.save((remote, "job/r1"), 10, b"x" * 10, keep=1)
    remote.write("job/r1/checkpoints/step-00000020-0badc0de.pt", b"y" * 10)  # data of 20, no manifest
    assert checkpoints.newest_valid((remote, "job")).step == 10
    checkpoints.save((remote, "job/r1"), 30, b"z" * 10, keep=1)
    left = [k.rsplit("/", 1)[1] for k, _ in remote.list("job/r1/checkpoints")]
    assert sorted(left)[1] == "step-00000030.json" and sorted(left)[0].startswith("step-00000030-") and len(left) == 2, left


def test_a_local_run_root_on_a_cluster_of_several_nodes_is_warned_about(monkeypatch, capsys, tmp_path):
    import orchestrator.run_storage as job_module
    from orchestrator.config import config_from_dict

    cfg = {"name": "warned", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "run_dir": str(tmp_path)}
    nodes = [{"Alive": True}, {"Alive": True}, {"Alive": False}]
    monkeypatch.setattr(job_module.ray, "nodes", lambda: nodes)
    job_module.warn_local_storage(config_from_dict(cfg))
    out = capsys.readouterr().out
    assert out.startswith("warning: storage:") and "2 nodes" in out and str(tmp_path) in out, out
    job_module.warn_local_storage(config_from_dict(dict(cfg, storage="memory://bucket/runs", run_dir=None)))
    nodes[1]["Alive"] = False
    job_module.warn_local_storage(config_from_dict(cfg))
    assert capsys.readouterr().out == "", "warned for shared storage, or for one node"


class Counting:
    """A storage that counts the bytes written to it."""

    def __init__(self, inner):
        self.inner, self.written = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, key, data):
        self.written += len(data)
        self.inner.write(key, data)


class Clock:
    """The mirror's `time`, one second a pass, without waiting for it."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def time(self):
        return self.now

    def sleep(self, seconds):
        time.sleep(seconds)


def test_a_long_run_uploads_each_appended_byte_about_once_and_reads_only_new_bytes(tmp_path, monkeypatch):
    """10,000 mirror passes, one a second, of a history file that grows by 10 lines a pass: what goes up
    is at most 1.1x what was appended (compaction used to re-upload the whole file, N * size / 128), and a
    pass reads the new bytes only, never the whole file (what the mirror holds stays bounded)."""
    import builtins

    import actors.runs.mirror as mirror_module

    store = Counting(open_storage(str(tmp_path / "store")))
    run = tmp_path / "run"
    run.mkdir()
    clock = Clock()
    monkeypatch.setattr(mirror_module, "time", clock)
    reads = []

    def counting_open(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)
        read = handle.read
        handle.read = lambda n=-1: reads.append(len(data := read(n))) or data
        return handle

    monkeypatch.setattr(mirror_module, "open", counting_open, raising=False)
    mirror = RunMirror(store, "job/run", run)
    appended = 0
    with open(run / "history.jsonl", "ab") as out:
        for n in range(1, 10_001):
            lines = "".join(json.dumps({"step": n * 10 + i, "time": clock.now, "loss": 1 / (n + i), "lr": 0.1, "samples": 64,
                                        "world_size": 4, "membership_epoch": 3}) + "\n" for i in range(10))
            out.write(lines.encode())
            out.flush()
            appended += len(lines)
            mirror._append("history.jsonl")
            clock.now += 1.0
            if n % 1000 == 0:
                ratio = store.written / appended
                print(f"after {n} passes: {appended} bytes appended, {store.written} uploaded ({ratio:.3f}x), "
                      f"largest read {max(reads)} bytes")
                assert ratio <= 1.1, f"after {n} passes: {store.written} bytes uploaded for {appended} appended ({ratio:.2f}x)"
                assert max(reads) <= 64 * 1024, f"a pass read {max(reads)} bytes of a {appended}-byte file"
    mirror.start()
    assert mirror.flush(30)
    mirror.close()
    ratio = store.written / appended
    parts = appended_pieces(store, "job/run/history.jsonl")
    print(f"10,000 passes: {appended} bytes appended, {store.written} uploaded ({ratio:.4f}x) in {len(parts)} parts")
    assert ratio <= 1.1
    assert len(parts) <= 10_000 // 4, f"{len(parts)} parts for 10,000 passes: one object a pass"
    assert read_appended(store, "job/run/history.jsonl") == (run / "history.jsonl").read_bytes()


def test_a_zombie_incarnation_neither_spoils_the_live_copy_nor_writes_once_it_sees_the_newer_claim(tmp_path, remote):
    """After a partition, incarnation 1 (still running on its node, still reaching the store) and
    incarnation 2 (Ray's restart on another node) mirror the same run. The store's copy is 2's: its
    history byte for byte (none of 1's later lines) and its state file, even though 1 uploads after 2;
    and 1 writes nothing once it has seen 2's claim, which it says once."""
    from actors.runs.fencing import claim

    zombie_dir, live_dir = tmp_path / "node-a", tmp_path / "node-b"
    zombie_dir.mkdir()
    zombie_store, said = Counting(remote), []
    zombie = RunMirror(zombie_store, "job/run", zombie_dir, claim(remote, "job/run/incarnations", 1),
                       interval_s=0.02, on_error=said.append).start()
    with open(zombie_dir / "history.jsonl", "a") as out:
        out.write("".join(json.dumps({"step": s, "by": 1}) + "\n" for s in (1, 2, 3)))
    (zombie_dir / "coordinator.json").write_text(json.dumps({"incarnation": 1, "step": 3}))
    zombie.put("coordinator.json")
    assert zombie.flush(10)

    live_dir.mkdir()
    live = RunMirror(remote, "job/run", live_dir, claim(remote, "job/run/incarnations", 2), interval_s=0.02)
    assert sorted(live.hydrate()) == ["coordinator.json", "history.jsonl"]
    live.start()
    with open(live_dir / "history.jsonl", "a") as out:
        out.write("".join(json.dumps({"step": s, "by": 2}) + "\n" for s in (4, 5)))
    (live_dir / "coordinator.json").write_text(json.dumps({"incarnation": 2, "step": 5}))
    live.put("coordinator.json")
    assert live.flush(10)

    before = zombie_store.written
    with open(zombie_dir / "history.jsonl", "a") as out:  # the zombie goes on, and uploads last
        out.write("".join(json.dumps({"step": s, "by": 1}) + "\n" for s in (4, 5, 6, 7)))
    (zombie_dir / "coordinator.json").write_text(json.dumps({"incarnation": 1, "step": 7}))
    zombie.put("coordinator.json")
    zombie.flush(10)
    assert read_appended(remote, "job/run/history.jsonl") == (live_dir / "history.jsonl").read_bytes()
    assert RunMirror(remote, "job/run", tmp_path / "node-c").hydrate() == ["coordinator.json", "history.jsonl"]
    assert json.loads((tmp_path / "node-c" / "coordinator.json").read_text()) == {"incarnation": 2, "step": 5}
    assert zombie.fenced and zombie_store.written == before, "the zombie wrote after the store named a newer incarnation"
    assert len(said) == 1 and "incarnation 2" in said[0], said
    assert not zombie.flush(1) and not zombie.close(1)
    live.close()


def test_a_run_mirrored_in_the_old_layout_reads_back_and_a_restart_carries_on_after_it(tmp_path, remote):
    """A run already in a bucket in the layout before incarnations (`<name>.parts/<start>-<end>`, a
    compacted part from 0 beside one it replaced) reads back; a restarted coordinator copies it down,
    claims an incarnation above its state file's, and its parts carry on after it."""
    from actors.runs.mirror import claim_incarnation

    data = b"".join(json.dumps({"step": s}).encode() + b"\n" for s in range(1, 7))  # 12 bytes a line
    parts = "job/run/history.jsonl.parts"
    for start, end in ((0, 48), (24, 48), (48, 72)):
        remote.write(f"{parts}/{start:016d}-{end:016d}", data[start:end])
    remote.write("job/run/coordinator.json", json.dumps({"incarnation": 3}).encode())
    assert read_appended(remote, "job/run/history.jsonl") == data
    here = tmp_path / "node"
    here.mkdir()
    mirror = RunMirror(remote, "job/run", here, claim_incarnation(remote, "job/run", here), interval_s=0.02)
    assert mirror.incarnation == 4
    assert mirror.hydrate() == ["coordinator.json", "history.jsonl"]
    mirror.start()
    with open(here / "history.jsonl", "a") as out:
        out.write(json.dumps({"step": 7}) + "\n")
    assert mirror.close()
    assert read_appended(remote, "job/run/history.jsonl") == (here / "history.jsonl").read_bytes() == data + b'{"step": 7}\n'
    assert mirror.uploaded_bytes == 12


def test_a_part_holds_whole_lines_even_past_its_size(tmp_path, remote):
    mirror = RunMirror(remote, "job/run", tmp_path, interval_s=0.02, part_bytes=16, max_lag_s=3600).start()
    lines = [json.dumps({"step": s, "pad": "x" * (s % 3) * 10}) + "\n" for s in range(1, 30)]
    (tmp_path / "events.jsonl").write_text("".join(lines))
    assert mirror.flush(10)
    pieces = appended_pieces(remote, "job/run/events.jsonl")
    assert [remote.read(p.key).decode() for p in pieces] == lines, "one part per line here: each longer than 16 bytes"
    assert mirror.close()


def test_lines_wait_for_the_lag_after_a_part_and_flush_sends_them_at_once(tmp_path, remote):
    mirror = RunMirror(remote, "job/run", tmp_path, interval_s=0.02, max_lag_s=3600).start()
    (tmp_path / "events.jsonl").write_text('{"n": 1}\n')
    wait_for(lambda: read_appended(remote, "job/run/events.jsonl") == b'{"n": 1}\n')  # the first part goes at once
    with open(tmp_path / "events.jsonl", "a") as out:
        out.write('{"n": 2}\n{"n": 3}\n')
    assert mirror.flush(10) and read_appended(remote, "job/run/events.jsonl") == (tmp_path / "events.jsonl").read_bytes()
    assert len(appended_pieces(remote, "job/run/events.jsonl")) == 2
    assert mirror.close()
