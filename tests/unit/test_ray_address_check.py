"""The bounded connect to a Ray address (orchestrator/connection.py `check_reachable`): what answers as Ray's
GCS does (a gRPC server) passes; a refused connect, a peer that accepts and says nothing, one that hangs
up, and one that speaks another protocol each fail in one line, within the bound. Servers on loopback,
in threads; no Ray."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest

from orchestrator.cli import main
from orchestrator.connection import RayUnreachable, check_reachable


@pytest.fixture
def peer() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """A loopback server that hands each connection to `serve` (in a thread); yields its address's maker."""
    listeners: list[socket.socket] = []

    def start(serve: Callable[[socket.socket], None]) -> str:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listeners.append(listener)

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                serve(conn)
        threading.Thread(target=accept, daemon=True).start()
        return f"127.0.0.1:{listener.getsockname()[1]}"
    yield start
    for listener in listeners:
        listener.close()


def _refused() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def test_a_grpc_server_passes_as_rays_gcs_would():
    grpc = pytest.importorskip("grpc")  # Ray's own dependency
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check_reachable(f"127.0.0.1:{port}")
        check_reachable(f"ray://127.0.0.1:{port}")  # Ray Client's form
    finally:
        server.stop(None)


def test_nothing_listening_fails_at_once_in_one_line():
    address = _refused()
    with pytest.raises(RayUnreachable, match=rf"^no Ray at {address} \(nothing answered within 10s\): "
                                             r"Connection refused; check the address"):
        check_reachable(address)


def test_a_peer_that_accepts_and_says_nothing_fails_at_the_bound(peer):
    held: list[socket.socket] = []
    address = peer(held.append)  # accepted, kept open, never a byte
    began = time.monotonic()
    with pytest.raises(RayUnreachable, match=r"within 0.5s\): timed out"):
        check_reachable(address, timeout_s=0.5)
    assert time.monotonic() - began < 5  # the bound is the mechanism: a wide margin over 0.5 s


def test_a_peer_that_hangs_up_or_speaks_http1_is_not_taken_for_ray(peer):
    def hang_up(conn: socket.socket) -> None:
        conn.recv(1024)  # read what came first: a close then ends the connection (FIN), not a reset
        conn.close()
    with pytest.raises(RayUnreachable, match="closed without an answer"):
        check_reachable(peer(hang_up))

    def http1(conn: socket.socket) -> None:  # the dashboard's port, say: HTTP/1.1
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        conn.close()
    with pytest.raises(RayUnreachable, match="not as Ray's GCS"):
        check_reachable(peer(http1))


def test_the_cli_names_an_address_where_no_ray_answers_and_exits_1(capsys, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as the CLI would set it; this process's Ray config untouched
    address = _refused()
    assert main(["status", "x", "--address", address]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: no Ray at {address} (nothing answered within 10s): ") and err.count("\n") == 1
