"""The host side of the agent protocol against a scripted fake agent."""

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from thinvm.errors import GuestError
from thinvm.guest.agent import SUN_PATH_MAX, AgentClient


def _fake_agent(path: Path, script: Callable[[socket.socket], None]) -> threading.Thread:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound through its directory's descriptor: the path may be too long.
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        server.bind(f"/proc/self/fd/{directory}/{path.name}")
    finally:
        os.close(directory)
    server.listen(1)

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            script(conn)
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _read_line(conn: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        line += conn.recv(1)
    return line[:-1]


def _answer_ping(conn: socket.socket, stale: bytes = b"") -> None:
    """What the agent does first on a fresh connection: echo the PING token."""
    token = _read_line(conn).split()[1]
    conn.sendall(stale + b"PONG " + token + b"\n")


@pytest.fixture
def sock_path(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "agent.sock"


def test_ping_skips_stale_replies(sock_path: Path) -> None:
    def script(conn: socket.socket) -> None:
        token = _read_line(conn).split()[1]
        # A reply left over from before a reconnect must be ignored.
        conn.sendall(b"DONE 0 3 0\nold" + b"PONG stale\n" + b"PONG " + token + b"\n")

    _fake_agent(sock_path, script)
    assert AgentClient(str(sock_path)).ping(timeout=5)


def test_exec_round_trip_with_binary_output(sock_path: Path) -> None:
    seen: list[bytes] = []

    def script(conn: socket.socket) -> None:
        _answer_ping(conn)
        header = _read_line(conn)
        size = int(header.split()[1])
        payload = b""
        while len(payload) < size:
            payload += conn.recv(size - len(payload))
        seen.append(payload)
        out, err = b"line1\nline2\n", b"warn\n"
        conn.sendall(f"DONE 3 {len(out)} {len(err)}\n".encode() + out + err)

    _fake_agent(sock_path, script)
    result = AgentClient(str(sock_path)).run("echo 'a\nb' | cat", timeout=5)
    assert seen == [b"echo 'a\nb' | cat"]
    assert (result.status, result.stdout, result.stderr) == (3, "line1\nline2\n", "warn\n")


def test_check_raises_on_failure(sock_path: Path) -> None:
    def script(conn: socket.socket) -> None:
        _answer_ping(conn)
        header = _read_line(conn)
        conn.recv(int(header.split()[1]))
        conn.sendall(b"DONE 1 0 4\nboom")

    _fake_agent(sock_path, script)
    with pytest.raises(GuestError, match="exited 1: boom"):
        AgentClient(str(sock_path)).check("false", timeout=5)


def test_silent_agent_times_out(sock_path: Path) -> None:
    done = threading.Event()

    def script(conn: socket.socket) -> None:
        _answer_ping(conn)
        done.wait(5)

    _fake_agent(sock_path, script)
    with pytest.raises(GuestError, match="timed out"):
        AgentClient(str(sock_path)).run("sleep 100", timeout=0.3)
    done.set()


def test_fresh_connection_skips_a_stale_reply_before_exec(sock_path: Path) -> None:
    """A reply meant for an earlier connection must not answer this EXEC."""

    def script(conn: socket.socket) -> None:
        _answer_ping(conn, stale=b"DONE 0 5 0\nstale")
        _read_line(conn)
        conn.recv(64)
        conn.sendall(b"DONE 0 5 0\nfresh")

    _fake_agent(sock_path, script)
    assert AgentClient(str(sock_path)).run("echo fresh", timeout=5).stdout == "fresh"


def test_a_socket_path_longer_than_sun_path_is_reached(tmp_path: Path) -> None:
    """A cluster host's channel socket seen from outside its root can be
    longer than sun_path's 108 bytes (a two-digit domain id was enough):
    connecting by the plain path fails with "AF_UNIX path too long"."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "org.thinvm.agent"
    assert len(str(path)) > SUN_PATH_MAX
    _fake_agent(path, _answer_ping)
    assert AgentClient(str(path)).ping(timeout=5)


def test_agent_that_never_answers_fails_fast(sock_path: Path) -> None:
    """No PONG on a fresh connection: an error long before the command's timeout."""
    done = threading.Event()
    _fake_agent(sock_path, lambda conn: done.wait(10))
    with pytest.raises(GuestError, match="did not answer within 1 s"):
        AgentClient(str(sock_path)).run("true", timeout=1)
    done.set()


@pytest.mark.parametrize("request_json", [False, True], ids=["exec", "json"])
def test_a_connection_lost_mid_request_is_a_guest_error(
    sock_path: Path, request_json: bool
) -> None:
    """QEMU gone between the sync and the request (an OOM-killed guest):
    the send fails with EPIPE, which callers see as a GuestError."""
    done = threading.Event()

    def script(conn: socket.socket) -> None:
        token = _read_line(conn).split()[1]
        # Shut for reading before the PONG: the request that follows
        # cannot be delivered, and the socket says so at once.
        conn.shutdown(socket.SHUT_RD)
        conn.sendall(b"PONG " + token + b"\n")
        done.wait(5)

    _fake_agent(sock_path, script)
    client = AgentClient(str(sock_path))
    with pytest.raises(GuestError, match="connection lost"):
        if request_json:
            client.request_json("TRIM 0", timeout=5)
        else:
            client.run("true", timeout=5)
    done.set()
