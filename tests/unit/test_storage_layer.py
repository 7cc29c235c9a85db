"""The storage layer (actors/storage.py), the run mirror (actors/mirror.py) and checkpoints on a
remote filesystem, without Ray and without a network: fsspec's in-memory filesystem through pyarrow's
fsspec handler is the remote store here (the same code path as s3://, which the e2e tests use)."""
from __future__ import annotations

import json
import time
import uuid

import pytest

from actors import checkpoints
from actors.mirror import COMPACT_AFTER, RunMirror, appended_parts, read_appended
from actors.storage import StorageError, is_remote, open_storage


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


def test_appended_files_go_up_as_parts_that_read_back_byte_for_byte(tmp_path, remote):
    mirror = RunMirror(remote, "job/run", tmp_path, interval_s=0.05).start()
    lines = []
    with open(tmp_path / "history.jsonl", "a") as out:
        for step in range(1, COMPACT_AFTER + 10):  # past a compaction
            line = json.dumps({"step": step}) + "\n"
            out.write(line)
            out.flush()
            lines.append(line)
            assert mirror.flush(10)
    mirror.close()
    assert read_appended(remote, "job/run/history.jsonl") == "".join(lines).encode()
    parts = appended_parts(remote, "job/run/history.jsonl")
    assert len(parts) <= 10, f"{len(parts)} parts: never compacted"
    assert parts[0][0] == 0 and parts[0][1] >= len("".join(lines[:COMPACT_AFTER])), parts[0]


def test_a_new_mirror_sends_only_what_the_store_lacks_and_a_hole_ends_the_read(tmp_path, remote):
    (tmp_path / "events.jsonl").write_text("a\nb\n")
    first = RunMirror(remote, "job/run", tmp_path, interval_s=0.05).start()
    assert first.close()
    (tmp_path / "events.jsonl").write_text("a\nb\nc\n")
    second = RunMirror(remote, "job/run", tmp_path, interval_s=0.05).start()
    assert second.close()
    assert second.uploaded_bytes == 2, "the restarted mirror sent again what the store had"
    assert read_appended(remote, "job/run/events.jsonl") == b"a\nb\nc\n"
    remote.delete(appended_parts(remote, "job/run/events.jsonl")[0][2])  # a hole at the start
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
    newest = "job/r1/checkpoints/step-00000020.pt"
    remote.write(newest, remote.read(newest)[:400])  # a partial upload under the real name
    warnings = []
    ref = checkpoints.newest_valid((remote, "job"), warn=warnings.append)
    assert ref.step == 10 and ref.run_id == "r1" and ref.location.startswith("memory://"), ref
    assert len(warnings) == 1 and "step-00000020.pt" in warnings[0] and "400 bytes" in warnings[0], warnings
    assert checkpoints.read_verified(remote, ref.location) == bytes([10]) * 1000
    with pytest.raises(RuntimeError, match="manifest says 1000"):
        checkpoints.read_verified(remote, remote.location(newest))


def test_a_checkpoint_without_its_manifest_does_not_count(remote):
    """The manifest goes last: data whose manifest never arrived (an upload cut off between the two) is
    not a checkpoint; and retention deletes the manifest first."""
    checkpoints.save((remote, "job/r1"), 10, b"x" * 10, keep=1)
    remote.write("job/r1/checkpoints/step-00000020.pt", b"y" * 10)  # data of 20, no manifest
    assert checkpoints.newest_valid((remote, "job")).step == 10
    checkpoints.save((remote, "job/r1"), 30, b"z" * 10, keep=1)
    assert [k for k, _ in remote.list("job/r1/checkpoints")] == [
        "job/r1/checkpoints/step-00000020.pt", "job/r1/checkpoints/step-00000030.json", "job/r1/checkpoints/step-00000030.pt"]


def test_a_local_run_root_on_a_cluster_of_several_nodes_is_warned_about(monkeypatch, capsys, tmp_path):
    import orchestrator.job as job_module
    from orchestrator.config import config_from_dict

    cfg = {"name": "warned", "workload": {"factory": "orchestrator.workloads.digits:mlp"}, "run_dir": str(tmp_path)}
    nodes = [{"Alive": True}, {"Alive": True}, {"Alive": False}]
    monkeypatch.setattr(job_module.ray, "nodes", lambda: nodes)
    job_module._warn_local_storage(config_from_dict(cfg))
    out = capsys.readouterr().out
    assert out.startswith("warning: storage:") and "2 nodes" in out and str(tmp_path) in out, out
    job_module._warn_local_storage(config_from_dict(dict(cfg, storage="memory://bucket/runs", run_dir=None)))
    nodes[1]["Alive"] = False
    job_module._warn_local_storage(config_from_dict(cfg))
    assert capsys.readouterr().out == "", "warned for shared storage, or for one node"
