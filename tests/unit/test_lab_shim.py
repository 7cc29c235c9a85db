"""The lab's connect() shim is preloaded into every lab worker, from a path anyone can predict (the
user's cache): one found there is used only when this user alone can have written it."""
from __future__ import annotations

import os

import pytest

from actors.transport import lab_shim
from actors.transport.lab_shim import LabUnavailable, shim_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "orchestrator"
    folder.mkdir(mode=0o700)
    return shim_path().parent


def plant(path, mode=0o755):
    path.write_bytes(b"\x7fELF not really")
    os.chmod(path, mode)


def test_a_shim_of_this_users_own_is_used(cache):
    plant(shim_path())
    assert shim_path() == cache / shim_path().name


@pytest.mark.parametrize("how", ["writable by others", "folder writable by others", "a link", "another owner"])
def test_a_shim_someone_else_could_have_written_is_refused(cache, tmp_path, how):
    path = shim_path()
    if how == "a link":
        plant(tmp_path / "elsewhere.so")
        path.symlink_to(tmp_path / "elsewhere.so")
    else:
        plant(path, 0o777 if how == "writable by others" else 0o755)
    if how == "folder writable by others":
        os.chmod(cache, 0o777)
    if how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, 65534, 65534)
    with pytest.raises(LabUnavailable, match="is not used"):
        shim_path()
    with pytest.raises(LabUnavailable, match="is not used"):
        lab_shim.worker_env(type("Net", (), {"subnet": "127.77.0.0/24"})())  # type: ignore[arg-type]
