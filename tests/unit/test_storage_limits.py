"""The store as users have it (issue 47 item 9): a bucket outside us-east-1 found without AWS_REGION,
an IAM policy scoped to a prefix, schemes other than S3 held to the same timeouts and retries, and a
location under the root told by path components, not by a string prefix. In process; no network."""
from __future__ import annotations

import io
import threading
import time

import pytest

from actors.runs import storage as storage_module
from actors.runs.storage import Storage, StorageError, open_storage


def test_a_location_beside_the_root_is_not_under_it():
    root = Storage(uri="/data/runs", base="/data/runs")
    assert root.key_of("/data/runs/job/r1/checkpoints/step-1.pt") == "job/r1/checkpoints/step-1.pt"
    with pytest.raises(StorageError, match="is not under"):
        root.key_of("/data/runs-other/job/r1/checkpoints/step-1.pt")


def test_the_buckets_region_is_resolved_when_none_is_given(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    asked = []
    import pyarrow.fs as pafs

    monkeypatch.setattr(pafs, "resolve_s3_region", lambda bucket: asked.append(bucket) or "eu-west-1")
    store = open_storage("s3://my-eu-bucket/runs")
    assert asked == ["my-eu-bucket"] and store.fs.region == "eu-west-1", (asked, store.fs.region)
    pinned = open_storage("s3://my-eu-bucket/runs?region=ap-south-1")
    assert pinned.fs.region == "ap-south-1" and asked == ["my-eu-bucket"], "a region given is not asked for"


class _Out(io.BytesIO):
    def __init__(self, objects, path):
        super().__init__()
        self.objects, self.p = objects, path

    def close(self):
        self.objects[self.p] = self.getvalue()
        super().close()


class PrefixOnlyFs:
    """What an IAM policy scoped to `bucket/prefix/*` allows: objects under the prefix, not HeadBucket."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

    def get_file_info(self, path):
        raise OSError("When getting information for bucket 'bucket': AWS Error ACCESS_DENIED during HeadBucket "
                      "operation: No response body.")

    def open_output_stream(self, path):
        return _Out(self.objects, path)

    def open_input_stream(self, path):
        return io.BytesIO(self.objects[path])

    def delete_file(self, path):
        self.objects.pop(path, None)


def test_the_probe_accepts_an_iam_policy_scoped_to_a_prefix():
    store = Storage(uri="s3://bucket/prefix", base="bucket/prefix", fs=PrefixOnlyFs(), scheme="s3")
    store.check()  # the object probe decides; HeadBucket's AccessDenied alone is not a failure


class HangingFs:
    """An fsspec store (any scheme but S3) whose first reads hang or fail, then work."""

    def __init__(self, hang: int = 0, fail: int = 0):
        self.hang, self.fail, self.release = hang, fail, threading.Event()

    def open_input_stream(self, path):
        if self.hang > 0:
            self.hang -= 1
            self.release.wait(60)
        if self.fail > 0:
            self.fail -= 1
            raise OSError("503 Service Unavailable")
        return io.BytesIO(b"data")


def test_other_schemes_get_a_timeout_and_retries(monkeypatch):
    monkeypatch.setattr(storage_module, "REMOTE_TIMEOUT_S", 0.3, raising=False)
    monkeypatch.setattr(storage_module, "REMOTE_RETRY_PAUSE_S", 0.01, raising=False)
    flaky = Storage(uri="az://container/runs", base="container/runs", fs=HangingFs(fail=2), scheme="az")
    assert flaky.read("job/x") == b"data", "a failure that passes is retried"
    hung = HangingFs(hang=5)
    store = Storage(uri="gs://bucket/runs", base="bucket/runs", fs=hung, scheme="gs")
    started = time.monotonic()
    try:  # the bound is the mechanism under test (a read that never answers), with a wide margin
        with pytest.raises(OSError, match="did not answer"):
            store.read("job/x")
        assert time.monotonic() - started < 20
    finally:
        hung.release.set()
