"""Where a job keeps what outlives its processes: a local folder, or an object store.

`storage:` in the config is a path or a URI:
- a path (or `file://`): a folder, as `run_dir` always was;
- `s3://bucket/prefix`: S3 or an S3-compatible store, through `pyarrow.fs.S3FileSystem`. The query
  string sets its options: `endpoint_override` (an on-premises or test store), `scheme` (`http`),
  `region`, `anonymous=true`, `connect_timeout` and `request_timeout` (seconds). Credentials come
  from the usual AWS places (environment, profile, web identity, container or instance role);
- `gs://bucket/prefix` (and `hdfs://`): through `pyarrow.fs.FileSystem.from_uri`;
- any other scheme that fsspec knows (`memory://`, `az://`, ...): through pyarrow's fsspec handler,
  with the query string as the filesystem's options.

Every operation takes a key: a `/`-separated path under the storage's root. An object is written
whole or not at all: a local file with temp + fsync + rename, an object with one upload (a store
never shows half an object under its name). What a store lacks is a rename and an append; the
callers build on whole objects only: a checkpoint counts once its manifest, written last, checks
out (actors/runs/checkpoints.py), and an appended file is mirrored as numbered parts (actors/runs/mirror.py).

`check()` tries the storage before a job starts (a probe object written, read and deleted), so that
an unreachable store, missing credentials or a bucket that does not exist end the command line with
one line naming `storage` before Ray starts.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from actors.runs import credentials, runfiles

log = logging.getLogger(__name__)

PYARROW_SCHEMES = ("gs", "gcs", "hdfs", "viewfs")
"""Schemes pyarrow opens itself (s3 too, with the options parsed here)."""
S3_TIMEOUTS_S = {"connect_timeout": 5.0, "request_timeout": 30.0}
"""Default S3 timeouts: an unreachable endpoint fails in seconds, not the SDK's minutes."""
SAFE_OPTIONS = frozenset({
    "endpoint_override", "scheme", "region", "anonymous", "anon", "connect_timeout", "request_timeout",
    "force_virtual_addressing", "project_id", "default_bucket_location", "retry_limit_seconds", "account_name",
    "use_ssl", "requester_pays", "version_aware", "default_block_size", "replication", "buffer_size", "username",
})
"""Query options known to be settings, not secrets: the only ones kept in a storage URI (written with the
config, shown in status and logs). Every other option, any name that mentions a key, secret, token,
password or credential among these included, and the `user:password@` part of the URI are credentials
(`move_credentials`, `redact`)."""
SECRET_WORDS = ("key", "secret", "token", "pass", "credential", "auth", "sas", "signature", "cookie", "session")
REMOTE_TIMEOUT_S = 60.0
"""Schemes other than S3 (whose client times out itself): one try of a read, write, list or delete that
does not answer within this long has failed (a whole object in one call: generous)."""
REMOTE_ATTEMPTS = 3
REMOTE_RETRY_PAUSE_S = 0.5
"""A failed try of a scheme other than S3 is made again after this pause, doubled each time."""
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _remote_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that make calls to stores held to a timeout (a call that never answers keeps its
    thread; the caller goes on)."""
    global _POOL
    if _POOL is None:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="storage-call")
    return _POOL


class StorageError(RuntimeError):
    """The storage cannot be used; the message is one line that starts with `storage:`."""


def first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:limit]


def is_remote(location: str | None) -> bool:
    """True for a URI with a scheme other than file:// (a Windows drive letter is not a scheme)."""
    if not location:
        return False
    scheme = urlsplit(str(location)).scheme
    return len(scheme) > 1 and scheme != "file"


@dataclass
class Storage:
    """One root, local or remote. `fs` is a pyarrow filesystem (None: the local disk, written with
    temp + fsync + rename); `base` the root's path in it; `uri` the root as the user wrote it, without
    its query (which may hold secrets)."""

    uri: str
    base: str
    fs: Any = None
    scheme: str = ""

    @property
    def remote(self) -> bool:
        return self.fs is not None

    # ------------------------------------------------------------------ names
    def path(self, key: str) -> str:
        key = key.strip("/")
        return f"{self.base.rstrip('/')}/{key}" if key else self.base

    def location(self, key: str) -> str:
        """The key as one string a person can read (a local path, or the URI without its options)."""
        key = key.strip("/")
        return str(Path(self.base) / key) if not self.remote else f"{self.uri.rstrip('/')}/{key}"

    def holds(self, location: str) -> bool:
        """Whether `location` is under this root (by path components: `/runs-other` is not under `/runs`)."""
        try:
            self.key_of(location)
            return True
        except StorageError:
            return False

    def key_of(self, location: str) -> str:
        """The inverse of `location` (for a location under this root)."""
        location = str(location)
        root = self.base if not self.remote else self.uri.rstrip("/")
        if location.rstrip("/") != root.rstrip("/") and not location.startswith(root.rstrip("/") + "/"):
            raise StorageError(f"storage: {location} is not under {root}")
        return location[len(root.rstrip("/")):].strip("/")

    # ------------------------------------------------------------------ objects
    def _limited(self, what: str, call: Callable[[], Any]) -> Any:
        """`call()` held to S3's limits on schemes whose clients set none of their own (gs, fsspec's):
        each try answers within REMOTE_TIMEOUT_S or counts as failed, and a failed try is made again
        (REMOTE_ATTEMPTS in all). S3's client does both itself (S3_TIMEOUTS_S, its retry strategy);
        a missing object is an answer, not a failure."""
        if self.scheme == "s3":
            return call()
        error: BaseException | None = None
        for attempt in range(REMOTE_ATTEMPTS):
            future = _remote_pool().submit(call)
            try:
                return future.result(timeout=REMOTE_TIMEOUT_S)
            except FileNotFoundError:
                raise
            except concurrent.futures.TimeoutError:
                error = OSError(f"{what} did not answer within {REMOTE_TIMEOUT_S:g}s")
            except Exception as err:  # noqa: BLE001 - tried again, then raised as it was
                error = err
            if attempt + 1 < REMOTE_ATTEMPTS:
                time.sleep(REMOTE_RETRY_PAUSE_S * 2 ** attempt)
        assert error is not None
        raise error

    def write(self, key: str, data: bytes) -> None:
        if not self.remote:
            runfiles.write_bytes_atomic(Path(self.path(key)), data)
            return

        def put() -> None:
            parent = self.path(key).rsplit("/", 1)[0]
            if self.scheme not in ("s3", "gs", "gcs"):  # object stores have no folders to make
                self.fs.create_dir(parent, recursive=True)
            with self.fs.open_output_stream(self.path(key)) as out:
                out.write(data)
        self._limited(f"writing {self.location(key)}", put)

    def read(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        if not self.remote:
            return Path(self.path(key)).read_bytes()

        def get() -> bytes:
            try:
                with self.fs.open_input_stream(self.path(key)) as src:
                    return src.read()
            except FileNotFoundError:
                raise
            except OSError as err:
                if "not found" in str(err).lower() or "does not exist" in str(err).lower():
                    raise FileNotFoundError(self.location(key)) from None
                raise
        return self._limited(f"reading {self.location(key)}", get)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes of the object from `offset` (fewer at its end), without reading the rest of it."""
        if not self.remote:
            with open(self.path(key), "rb") as src:
                src.seek(offset)
                return src.read(length)

        def get() -> bytes:
            with self.fs.open_input_file(self.path(key)) as src:
                return src.read_at(length, offset)
        return self._limited(f"reading {self.location(key)} at {offset}", get)

    def size(self, key: str) -> int | None:
        """The object's size, None when there is none."""
        if not self.remote:
            try:
                return Path(self.path(key)).stat().st_size
            except OSError:
                return None
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self.path(key))
        return info.size if info.type == pafs.FileType.File else None

    def list(self, prefix: str, recursive: bool = True) -> list[tuple[str, int]]:
        """(key, size) of the objects under `prefix` (a folder's key), sorted by key; without
        `recursive`, the folders directly under it come too, with size -1."""
        if not self.remote:
            root = Path(self.path(prefix))
            if not root.is_dir():
                return []
            found = []
            for p in (root.rglob("*") if recursive else root.iterdir()):
                if p.name.startswith(".") and p.name.endswith(".tmp"):
                    continue  # a local write in progress
                rel = str(p.relative_to(self.base)).replace(os.sep, "/")
                if p.is_file():
                    found.append((rel, p.stat().st_size))
                elif not recursive and p.is_dir():
                    found.append((rel, -1))
            return sorted(found)
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.path(prefix), allow_not_found=True, recursive=recursive)
        base = self.base.rstrip("/") + "/"
        found = []
        for info in self._limited(f"listing {self.location(prefix)}", lambda: self.fs.get_file_info(selector)):
            rel = info.path[len(base):] if info.path.startswith(base) else info.path
            if info.type == pafs.FileType.File:
                found.append((rel, info.size))
            elif not recursive and info.type == pafs.FileType.Directory:
                found.append((rel, -1))
        return sorted(found)

    def delete(self, key: str) -> None:
        """Gone if it was there."""
        if not self.remote:
            Path(self.path(key)).unlink(missing_ok=True)
            return
        def rm() -> None:
            try:
                self.fs.delete_file(self.path(key))
            except FileNotFoundError:
                pass
        self._limited(f"deleting {self.location(key)}", rm)

    # ------------------------------------------------------------------ the probe
    def check(self) -> None:
        """Write, read back and delete a probe object under the root; StorageError (one line naming
        `storage` and the cause) when any of it fails."""
        if self.scheme == "s3":
            self._check_bucket()
        key = f".orchestrator-probe-{uuid.uuid4().hex[:12]}"
        try:
            self.write(key, b"probe")
            if self.read(key) != b"probe":
                raise StorageError(f"storage: {self.uri} gave back other bytes than were written")
            self.delete(key)
        except StorageError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of the probe is the storage's
            raise StorageError(f"storage: cannot write to {self.uri}: {first_line(err)}") from None

    def _check_bucket(self) -> None:
        import pyarrow.fs as pafs

        bucket = self.base.split("/", 1)[0]
        try:
            info = self.fs.get_file_info(bucket)
        except Exception as err:  # noqa: BLE001
            if "ACCESS_DENIED" in str(err).upper() or "ACCESSDENIED" in str(err).upper():
                return  # a policy scoped to a prefix may not allow HeadBucket: the object probe decides
            raise StorageError(f"storage: cannot reach the store of {self.uri}: {first_line(err)}") from None
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"storage: bucket {bucket!r} does not exist ({self.uri})")


def is_setting(option: str) -> bool:
    """Whether a URI's query option may stay in the URI (a known setting whose name mentions no secret)."""
    name = option.lower()
    return name in SAFE_OPTIONS and not any(word in name for word in SECRET_WORDS)


def _userinfo(parts: SplitResult) -> list[tuple[str, str]]:
    """The `user:password@` of a URI as the options it stands for: S3's access and secret key, else a
    username (kept, a setting) and a password (a credential)."""
    if parts.username is None and parts.password is None:
        return []
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    if parts.scheme.lower() == "s3":
        return [("access_key", user), ("secret_key", password)]
    return [("username", user)] + ([("password", password)] if parts.password is not None else [])


def move_credentials(location: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """(the URI with only its settings, {option: the name its value is held under}, {name: value}): every
    query option that is not a known setting (`is_setting`), and the `user:password@` part, leave the URI;
    the caller holds their values in memory (actors/runs/credentials.py), so that no copy of them is
    written down with the config (its file, Ray's KV record, actor arguments, the bucket, a command line)."""
    if not is_remote(location):
        return location, {}, {}
    parts = urlsplit(location)
    kept, options, values = [], {}, {}
    for name, value in [*_userinfo(parts), *parse_qsl(parts.query, keep_blank_values=True)]:
        if is_setting(name):
            kept.append((name, value))
        else:
            variable = credentials.moved_name(name)
            options[name], values[variable] = variable, value
    if not options and parts.username is None:
        return location, {}, {}
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(kept, safe=":/"))), options, values


def redact(location: str | None) -> str | None:
    """The location with every credential (an option that is not a known setting, a password in its
    user part) replaced by `***` (to print)."""
    if not location or not is_remote(location):
        return location
    parts = urlsplit(location)
    netloc = parts.netloc
    if parts.username is not None or parts.password is not None:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = [(k, v if is_setting(k) else "***") for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe=":/*")))


def open_storage(location: str, from_env: dict[str, str] | None = None) -> Storage:
    """The storage at `location` (a path or a URI; see the module's docstring). `from_env`: options
    whose values are read from environment variables ({option: variable}, the config's
    `storage_options`). Raises StorageError for a scheme nothing here can open, options that do not
    parse, a named variable that is not set, or missing S3 credentials."""
    location = str(location)
    if not is_remote(location):
        path = location[len("file://"):] if location.startswith("file://") else location
        path = str(Path(os.path.expanduser(path)).resolve())
        return Storage(uri=path, base=path)
    parts = urlsplit(location)
    scheme = parts.scheme.lower()
    options = dict(parse_qsl(parts.query))
    for option, variable in (from_env or {}).items():
        held = credentials.value(variable)
        if held is None and variable.startswith(credentials.MOVED):
            raise StorageError(f"storage: the credential {option} taken out of the storage URI did not reach this "
                               f"process (pid {os.getpid()}): give it to every node as an environment variable "
                               f"named in storage_options.{option}")
        if held is None:
            raise StorageError(f"storage: storage_options.{option} names the environment variable {variable}, "
                               f"which is not set in this process (pid {os.getpid()})")
        options[option] = held
    uri = f"{scheme}://{parts.netloc}{parts.path}".rstrip("/")
    base = f"{parts.netloc}{parts.path}".rstrip("/")
    if not parts.netloc:
        raise StorageError(f"storage: {uri} names no bucket or host")
    try:
        if scheme == "s3":
            return Storage(uri=uri, base=base, fs=_s3(uri, options), scheme=scheme)
        if scheme in PYARROW_SCHEMES:  # pyarrow reads its options from the query: all of them, in memory only
            import pyarrow.fs as pafs

            fs, path = pafs.FileSystem.from_uri(urlunsplit(parts._replace(query=urlencode(sorted(options.items())))))
            return Storage(uri=uri, base=path.rstrip("/"), fs=fs, scheme=scheme)
        return _fsspec(uri, scheme, base, options)
    except StorageError:
        raise
    except ImportError as err:
        raise StorageError(f"storage: {uri} needs a package that is not installed ({first_line(err)}); "
                           f"pip install 'elastic-orchestrator[storage]'") from None
    except Exception as err:  # noqa: BLE001 - a bad option or URI: said in one line
        raise StorageError(f"storage: cannot open {uri}: {first_line(err)}") from None


def _s3(uri: str, options: dict[str, str]) -> Any:
    import pyarrow.fs as pafs

    known = {"endpoint_override", "scheme", "region", "anonymous", "connect_timeout", "request_timeout",
             "access_key", "secret_key", "session_token", "force_virtual_addressing"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise StorageError(f"storage: unknown S3 option(s) {', '.join(unknown)} in {uri} (known: {', '.join(sorted(known))})")
    anonymous = options.get("anonymous", "").lower() in ("1", "true", "yes")
    if not anonymous and "access_key" not in options and credentials_source() is None:
        raise StorageError(f"storage: no S3 credentials for {uri}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                           f"AWS_PROFILE, or add ?anonymous=true")
    kwargs: dict[str, Any] = {k: float(options.get(k, v)) for k, v in S3_TIMEOUTS_S.items()}
    for name in ("endpoint_override", "scheme", "region", "access_key", "secret_key", "session_token"):
        if name in options:
            kwargs[name] = options[name]
    if "endpoint_override" in kwargs and "region" not in kwargs:
        kwargs["region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    elif "region" not in kwargs:  # AWS itself: the bucket's own region (as pyarrow's from_uri does), not a guess
        kwargs["region"] = _bucket_region(uri)
    if options.get("force_virtual_addressing", "").lower() in ("1", "true", "yes"):
        kwargs["force_virtual_addressing"] = True
    kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=3)
    return pafs.S3FileSystem(anonymous=anonymous, **kwargs)


def _bucket_region(uri: str) -> str:
    """The region an AWS bucket lives in (pyarrow asks S3; no credentials needed), else AWS_REGION,
    AWS_DEFAULT_REGION or us-east-1 (then the probe says what is wrong)."""
    import pyarrow.fs as pafs

    bucket = urlsplit(uri).netloc
    try:
        return pafs.resolve_s3_region(bucket)
    except Exception as err:  # noqa: BLE001 - no network, no such bucket: the probe reports it
        fallback = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        log.debug("could not resolve the region of bucket %s (%s); using %s", bucket, first_line(err), fallback)
        return fallback


def credentials_source() -> str | None:
    """Where the AWS SDK would find S3 credentials here, or None when it has nowhere to look (the
    instance role counts unless `AWS_EC2_METADATA_DISABLED` is true)."""
    env = os.environ
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return "environment"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return "web identity"
    if env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return "container"
    for name, default in (("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"), ("AWS_CONFIG_FILE", "~/.aws/config")):
        if os.path.isfile(os.path.expanduser(env.get(name, default))):
            return "profile"
    if env.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        return "instance role"
    return None


def _fsspec(uri: str, scheme: str, base: str, options: dict[str, str]) -> Storage:
    import fsspec
    import pyarrow.fs as pafs

    try:
        fs = fsspec.filesystem(scheme, **options)
    except ValueError as err:
        raise StorageError(f"storage: no filesystem for {scheme}:// ({first_line(err)})") from None
    return Storage(uri=uri, base="/" + base if scheme == "memory" else base,
                   fs=pafs.PyFileSystem(pafs.FSSpecHandler(fs)), scheme=scheme)


def run_storage(setting: str | None, run_dir: Path, from_env: dict[str, str] | None = None) -> tuple[Storage, str]:
    """A run's storage and its key (`<job>/<run id>`): the URI `setting` (the config's `storage`, with
    `from_env` its `storage_options`), or else the local run root the run folder `run_dir` is in."""
    run_dir = Path(run_dir)
    key = f"{run_dir.parent.name}/{run_dir.name}"
    if is_remote(setting):
        return open_storage(str(setting), from_env), key
    return open_storage(str(run_dir.parent.parent)), key
