"""The network lab: an emulated multi-node network on one machine.

On one machine every link is loopback and communication is nearly free, so nothing shows when a
relaxed policy beats BSP. The lab gives each virtual node of `network:` its own loopback address
(all of 127/8 is this machine; node k is the k+1-th host of `network.subnet`, 127.77.0.1 for node 0)
and lets the kernel shape the traffic between different nodes' addresses: an `htb` root qdisc on
`lo` with one class per shaped (source node, destination node) pair and a `u32` filter on both
addresses; TCP's bare acknowledgements pass beside the shaping (`ACK_LENGTHS` says why).
Unclassified traffic (everything outside the lab's addresses, and unshaped pairs) takes htb's direct
path, unshaped. Latency is not the kernel's (no netem on these machines): the transport
adds it per operation (`network.*.latency_ms`; actors/transport/comm.py), labelled as modelled.

Workers bind their gloo device to their node's address. gloo connects without binding, which would
give every connection the source 127.0.0.1, so lab workers preload a small connect() shim
(actors/native/lab_bind.c, compiled here by `up`; actors/transport/lab_shim.py) that binds connections into the lab's
subnet to the worker's own node address first.

`Lab(network)` is a context manager; `python -m orchestrator lab up CONFIG | down | show` does the
same from a shell. Both are idempotent, and neither touches a root qdisc on `lo` that is not the
lab's. Without root or without `tc`, `LabUnavailable` says why (the CLI exits 2; lab tests skip).

Who holds the lab is in its state file: each `Lab` block adds its process (pid and start time) and
removes it on the way out, and the lab comes down when the last live holder leaves, unless a shell's
`lab up` asked for it to stay (until `lab down`). A holder killed without leaving (SIGKILL, the OOM
killer) is found dead by the next process that looks: the next run takes the lab over and removes it
when it leaves, and a lab with another network held by nobody alive is replaced instead of refused.
Two runs of one config share the lab, and the first to finish no longer takes it from the other.
The state file and its lock live in a folder of root's (`FOLDER`, /run/orchestrator by default; created
0700 when missing, refused unless it is a real directory owned by root or this user that no one else
may write), are opened without following links, and the state is written atomically, readable by root
only. The state is changed under an exclusive `flock` of the lock file, taken with a timeout
(`LOCK_TIMEOUT_S`): a process that holds it longer (a stuck `lab up`, or anyone's `flock` on the file)
makes the others fail with one line naming it (pid, command line, for how long), never hang. The
holder writes its pid and command line into the lock file; /proc/locks names any other holder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from actors.transport.lab_shim import LabUnavailable, shim_path, worker_env
from core.schema import NetworkConfig

DEV = "lo"
HANDLE = "7a6"
"""The lab's root qdisc handle on `lo` (how `down` knows the qdisc is the lab's)."""
FOLDER = Path(os.environ.get("ORCHESTRATOR_LAB_DIR", "/run/orchestrator"))
"""The lab's own folder (root's; ORCHESTRATOR_LAB_DIR overrides it, for tests). Not /tmp: there any
user could plant a link where root creates the lock, or hold the lock for ever."""
STATE = "lab.json"
"""In `FOLDER`: what the lab that is up was brought up with (its network, holders), for `require` and `show`."""
LOCK = "lab.lock"
"""In `FOLDER`: the state's lock file, which also says who holds it (pid, command line, since when)."""
LOCK_TIMEOUT_S = 10.0
"""How long `up`, `leave` and `down` wait for the lock. A holder changes the state and `lo` in well under
a second (an 8-node lab is about 120 `tc` commands); one that holds it longer is stuck or not the lab's."""
LOCK_POLL_S = 0.05


def fingerprint(net: NetworkConfig) -> str:
    return hashlib.sha256(json.dumps(dataclasses.asdict(net), sort_keys=True).encode()).hexdigest()[:16]


def _rate(mbit: float) -> str:
    return f"{mbit * 1000:.0f}kbit"


def _burst_bytes(mbit: float) -> int:
    """htb's bucket: one 64 KiB loopback segment (htb cannot send a packet larger than its bucket), or
    0.1 ms of the rate where that is more (a fast class needs it to reach its rate). Any more lets a
    short transfer after an idle moment through at loopback speed: with 256 KiB, a step's 75 KiB
    chunks crossed a 100 Mbit/s link in no time, which no real 100 Mbit/s link does."""
    return max(65536, int(mbit * 1e6 / 8 * 0.0001))


ACKS = 0xFFFF
"""The class of TCP's bare acknowledgements: at 10 Gbit/s, in effect unshaped (see `ACK_LENGTHS`)."""
ACK_LENGTHS = (40, 52, 64, 72, 80)
"""IPv4 lengths of a bare TCP acknowledgement: 40 bytes of headers, 52 with timestamps (Linux's
default), 64-80 with one to three SACK blocks. On `lo` a data packet is up to 64 KiB, 5.2 ms at
100 Mbit/s, and a shaped pair's queue holds several of them. An acknowledgement for a flow the other
way that waits in that queue holds its sender back: with both directions of a pair loaded by
connections of their own (a ring's all-reduce on two nodes), 1.2 MB each way took 158 ms where one
direction took 91. On a real link an acknowledgement waits behind at most a 1,500-byte frame (0.12 ms
at 100 Mbit/s). So the lab lets them pass beside the shaping (2026-11-28: 92 ms both ways;
`tests/e2e/test_lab.py`). They are about 0.1% of the bytes on `lo`. One connection loaded both ways
(gossip's exchange over gloo's one connection per pair) is not helped: its acknowledgements ride on
its data packets (docs/lab.md)."""


def tc_commands(net: NetworkConfig) -> list[list[str]]:
    """The `tc` commands that bring the lab up on an unshaped `lo` (pure; tested): the acknowledgements'
    class and filters first (`ACK_LENGTHS`), then one class and filter per shaped pair."""
    cmds = [["tc", "qdisc", "add", "dev", DEV, "root", "handle", f"{HANDLE}:", "htb", "default", "0"],
            ["tc", "class", "add", "dev", DEV, "parent", f"{HANDLE}:", "classid", f"{HANDLE}:{ACKS:x}", "htb",
             "rate", "10gbit", "ceil", "10gbit", "quantum", "65536"]]
    for length in ACK_LENGTHS:  # u32: the IPv4 header's total length (bytes 2-3), exactly
        cmds.append(["tc", "filter", "add", "dev", DEV, "parent", f"{HANDLE}:", "protocol", "ip", "prio", "1", "u32",
                     "match", "u16", f"0x{length:04x}", "0xffff", "at", "2", "flowid", f"{HANDLE}:{ACKS:x}"])
    classid = 0
    for a in range(net.nodes):
        for b in range(net.nodes):
            link = net.link(a, b)
            if link.mbit is None:
                continue
            classid += 1
            burst = _burst_bytes(link.mbit)
            cmds.append(["tc", "class", "add", "dev", DEV, "parent", f"{HANDLE}:", "classid", f"{HANDLE}:{classid:x}",
                         "htb", "rate", _rate(link.mbit), "ceil", _rate(link.mbit), "burst", str(burst),
                         "cburst", str(burst), "quantum", "65536"])
            cmds.append(["tc", "filter", "add", "dev", DEV, "parent", f"{HANDLE}:", "protocol", "ip", "prio", "2",
                         "u32", "match", "ip", "src", f"{net.address(a)}/32", "match", "ip", "dst",
                         f"{net.address(b)}/32", "flowid", f"{HANDLE}:{classid:x}"])
    return cmds


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise LabUnavailable(f"`tc {' '.join(args)}` failed: {(out.stderr or out.stdout).strip()[:300]}")
    return out


def root_qdisc() -> str:
    """The root qdisc line of `tc qdisc show dev lo` ("" when tc shows none)."""
    out = _tc("qdisc", "show", "dev", DEV)
    return next((line.strip() for line in out.stdout.splitlines() if " root " in f" {line} "), "")


def is_lab_qdisc(line: str) -> bool:
    return line.startswith("qdisc htb ") and line.split()[2] == f"{HANDLE}:"


def check_privileges(compiler: bool = True) -> None:
    """Raise `LabUnavailable` with the reason when this process cannot shape `lo` (or, with `compiler`,
    cannot build the connect() shim that bringing the lab up needs)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise LabUnavailable("the lab shapes loopback traffic with tc and needs root (run as root, or skip lab runs)")
    if shutil.which("tc") is None:
        raise LabUnavailable("the lab needs Linux `tc` (iproute2), which is not installed")
    if compiler and shutil.which("cc") is None and shutil.which("gcc") is None:
        raise LabUnavailable("the lab compiles a small connect() shim and needs a C compiler (cc)")


def _folder(create: bool = False) -> Path:
    """`FOLDER`, checked: a directory (not a link) owned by root or this user, writable by no one else;
    created 0700 when missing and `create`. Anything else raises `LabUnavailable` saying what to do."""
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(FOLDER, 0o700)
        info = os.lstat(FOLDER)
    except OSError as err:  # absent (and not to be created: no lab state), or its parent is
        raise LabUnavailable(f"the lab's folder {FOLDER}: {err.strerror}") from None
    problem = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory" if not stat.S_ISDIR(info.st_mode)
               else f"owned by uid {info.st_uid}" if info.st_uid not in (0, os.geteuid())
               else f"writable by others (mode {stat.S_IMODE(info.st_mode):o})" if info.st_mode & 0o022 else "")
    if problem:
        raise LabUnavailable(f"the lab's folder {FOLDER} is {problem}: it must be a directory of root's that no one "
                             f"else can write; remove it (it is made 0700 when missing) or set ORCHESTRATOR_LAB_DIR")
    return FOLDER


def _open(path: Path, flags: int, mode: int = 0o600) -> int:
    """`path` opened without following a link (ELOOP), nor blocking on a planted FIFO; a regular file only."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as err:  # ELOOP: a link planted at the name
        raise LabUnavailable(f"cannot open {path} ({err.strerror}): remove whatever is there") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LabUnavailable(f"{path} is not a regular file: remove it")
    return fd


def read_state() -> dict | None:
    try:
        fd = _open(_folder() / STATE, os.O_RDONLY)
        with os.fdopen(fd) as src:
            return json.loads(src.read())
    except (OSError, ValueError, LabUnavailable):
        return None


def _write_state(state: dict) -> None:
    folder = _folder()
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "w") as out:  # mkstemp: an unpredictable name, O_EXCL, mode 0600
        out.write(json.dumps(state))
    os.replace(tmp, folder / STATE)  # replaces a link planted at the name itself, never its target


@contextlib.contextmanager
def _locked():
    """The state's lock: one process at a time changes the lab and its holders. Waits at most
    `LOCK_TIMEOUT_S`, then raises `LabUnavailable` naming the holder."""
    fd = _open(_folder(create=True) / LOCK, os.O_RDWR | os.O_CREAT)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LabUnavailable(_held_by(fd)) from None
                time.sleep(LOCK_POLL_S)
        me = {"pid": os.getpid(), "cmd": _command_line(os.getpid()), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield
    finally:
        os.close(fd)


def _held_by(fd: int) -> str:
    """The one-line error for a lock we could not take: its holder (from /proc/locks, which names any
    process's `flock`; the lock file's record, written by lab processes, says since when)."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        record = {}
    if not isinstance(record, dict):
        record = {}
    pid = _flock_holder(os.fstat(fd)) or record.get("pid")
    if pid is None:
        who = "another process"
    else:
        who = f"pid {pid} ({_command_line(pid) or record.get('cmd') or 'command line unknown'})"
    since = record.get("since") if record.get("pid") == pid else None
    held = f"for {time.time() - since:.1f}s" if isinstance(since, (int, float)) else f"for over {LOCK_TIMEOUT_S:g}s"
    return (f"the lab's lock is held by {who} {held}; wait for it to finish or stop it, then run this again "
            f"(lock file {FOLDER / LOCK})")


def _flock_holder(info: os.stat_result) -> int | None:
    """The pid /proc/locks gives for the `flock` held on the file `info` describes (None if not found)."""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # "->" lines are waiters, not the holder
            continue
        try:
            major, minor, inode = fields[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == (os.major(info.st_dev), os.minor(info.st_dev),
                                                                info.st_ino):
                return int(fields[4])
        except ValueError:
            continue
    return None


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(raw.decode(errors="replace").replace("\0", " ").split())[:200]  # one line, however it was written


def _process(pid: int) -> list:
    """[pid, start time]: a process, told apart from a later one that reuses its pid."""
    try:
        start = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = ""
    return [pid, start]


def _alive(holder: list) -> bool:
    return _process(int(holder[0])) == list(holder) and holder[1] != ""


def _live_holders(state: dict | None) -> list[list]:
    return [h for h in (state or {}).get("holders", []) if _alive(h)]


def current() -> dict | None:
    """The lab that is up: its state (network, since) when `lo`'s root qdisc is the lab's, else None."""
    try:
        line = root_qdisc()
    except (LabUnavailable, OSError):
        return None
    if not is_lab_qdisc(line):
        return None
    return read_state() or {"network": None, "fingerprint": None, "since": None}


def up(net: NetworkConfig, holder: int | None = None) -> bool:
    """Bring the lab up for `net`; True when this call shaped `lo`, False when the same lab was up.
    `holder`: the process that holds it (a `Lab` block; it goes down when the last live holder leaves);
    None: a shell's `lab up`, which keeps it up until `lab down`. A different lab that a live process
    holds (or a shell asked for), or a root qdisc on `lo` that is not the lab's, is an error; one that
    nobody alive holds is replaced."""
    if not net.enabled:
        raise LabUnavailable("network.nodes is 0: there is no lab to bring up")
    if not net.emulate:
        raise LabUnavailable("network.emulate is false: the section describes a real cluster, not a lab to bring up")
    check_privileges()
    shim_path(build=True)
    with _locked():
        line = root_qdisc()
        state = read_state() if is_lab_qdisc(line) else None
        holders = _live_holders(state)
        if is_lab_qdisc(line):
            if state and state.get("fingerprint") == fingerprint(net):
                _write_state({**state, "holders": holders + ([_process(holder)] if holder else []),
                              "manual": bool(state.get("manual")) or holder is None})
                return False
            if holders or (state or {}).get("manual"):
                raise LabUnavailable("a lab with another network is up: run `python -m orchestrator lab down` first")
            _down()  # another network's lab, held by nobody alive: a run killed with it up left it
            line = root_qdisc()
        if line and not line.startswith("qdisc noqueue"):
            raise LabUnavailable(f"`lo` has a root qdisc that is not the lab's ({line}): the lab leaves it alone")
        try:
            for cmd in tc_commands(net):
                _tc(*cmd[1:])
        except BaseException:
            _down()
            raise
        _write_state({"network": dataclasses.asdict(net), "fingerprint": fingerprint(net), "since": time.time(),
                      "holders": [_process(holder)] if holder else [], "manual": holder is None})
        return True


def leave(holder: int) -> bool:
    """`holder` no longer uses the lab: down when no live holder is left and no shell asked for it
    (True), else it stays (False)."""
    with _locked():
        state = read_state()
        if state is None or not is_lab_qdisc(root_qdisc()):
            return False
        holders = [h for h in _live_holders(state) if int(h[0]) != holder]
        if holders or state.get("manual"):
            _write_state({**state, "holders": holders})
            return False
        _down()
        return True


def _down() -> bool:
    removed = False
    if is_lab_qdisc(root_qdisc()):
        _tc("qdisc", "del", "dev", DEV, "root")
        removed = True
    (_folder() / STATE).unlink(missing_ok=True)
    return removed


def down() -> bool:
    """Remove the lab's qdisc from `lo` (True) or do nothing when it is not up (False), whoever holds it."""
    check_privileges(compiler=False)  # removing it builds nothing
    with _locked():
        return _down()


def require(net: NetworkConfig) -> None:
    """A job with `network:` starts only on the lab it names (raises `LabUnavailable` naming the fix)."""
    state = current()
    if state is None:
        raise LabUnavailable("network: is set but the lab is not up: run `python -m orchestrator lab up CONFIG` "
                             "as root (`orchestrator run` brings it up itself)")
    if state.get("fingerprint") != fingerprint(net):
        raise LabUnavailable("network: differs from the lab that is up: `python -m orchestrator lab down`, then up "
                             "with this config")
    worker_env(net)


class Lab:
    """`with Lab(network):` the lab is up inside, held by this process; down after if no other live
    process holds it (and no shell's `lab up` asked for it)."""

    def __init__(self, net: NetworkConfig) -> None:
        self.net = net
        self.brought_up = False

    def __enter__(self) -> Lab:
        self.brought_up = up(self.net, holder=os.getpid())
        return self

    def __exit__(self, *exc: object) -> None:
        leave(os.getpid())


# --------------------------------------------------------------------------- the probe
def _free_port_listener(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(1)
    return sock


def probe_link(src: str, dst: str, seconds: float = 1.0, pings: int = 30) -> dict:
    """What one direction of a link delivers: a TCP stream from `src` to `dst` for `seconds` (bytes/s
    at the receiver over the last 80% of the stream, after htb's initial bucket), and the median
    round trip of 1-byte messages on the same addresses (the kernel's; the lab's latency is modelled
    in the transport and is not in it)."""
    listener = _free_port_listener(dst)
    port = listener.getsockname()[1]
    marks: list[tuple[float, int]] = []

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            total = 0
            while True:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                total += len(chunk)
                marks.append((time.perf_counter(), total))

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.bind((src, 0))
    client.connect((dst, port))
    block = b"\0" * (1 << 20)
    end = time.perf_counter() + seconds
    with client:
        while time.perf_counter() < end:
            client.sendall(block)
    thread.join(timeout=seconds + 30)
    listener.close()
    start_at = marks[0][0] + 0.2 * (marks[-1][0] - marks[0][0]) if marks else 0.0
    window = [m for m in marks if m[0] >= start_at]
    rate = (window[-1][1] - window[0][1]) / (window[-1][0] - window[0][0]) if len(window) > 1 and \
        window[-1][0] > window[0][0] else 0.0
    return {"src": src, "dst": dst, "bytes_per_s": rate, "rtt_s": _ping(src, dst, pings)}


def _ping(src: str, dst: str, count: int) -> float:
    listener = _free_port_listener(dst)

    def echo() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(1):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.bind((src, 0))
    client.connect((dst, listener.getsockname()[1]))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    with client:
        for _ in range(count):
            began = time.perf_counter()
            client.sendall(b"x")
            client.recv(1)
            times.append(time.perf_counter() - began)
    thread.join(timeout=5)
    listener.close()
    return statistics.median(times)


def probe(net: NetworkConfig, seconds: float = 1.0) -> list[dict]:
    """Every shaped direction of `net` (and one intra-node pair), measured, next to what was asked."""
    rows = []
    pairs = [(a, b) for a in range(net.nodes) for b in range(net.nodes) if a != b] + [(0, 0)]
    for a, b in pairs:
        link = net.link(a, b)
        src, dst = net.address(a), net.address(b)
        measured = probe_link(src, dst, seconds)
        rows.append({"a": a, "b": b, "asked_mbit": link.mbit, "measured_mbit": measured["bytes_per_s"] * 8 / 1e6,
                     "rtt_ms": measured["rtt_s"] * 1e3, "modelled_latency_ms": link.latency_ms})
    return rows
