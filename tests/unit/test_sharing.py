"""How several processes share one VM: lock files, agent turns, QMP monitors."""

import os
import socket
import threading
import time
from pathlib import Path

from thinvm.guest.agent import AgentClient
from thinvm.host.locks import FileLock
from thinvm.vm.machine import QMP_MONITORS, VM, VMConfig


def test_exclusive_and_shared_locks_between_open_files(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    a, b = FileLock(path), FileLock(path)
    assert a.try_acquire(exclusive=False) and b.try_acquire(exclusive=False)
    b.release()
    assert not b.try_acquire(exclusive=True)
    assert not b.acquire(0.2, exclusive=True)
    a.release()
    assert b.try_acquire(exclusive=True)


def test_a_lock_file_replaced_meanwhile_is_not_the_lock(tmp_path: Path) -> None:
    """A run directory replaced by a migration brings fresh lock files."""
    old = tmp_path / "vm" / "agent.lock"
    old.parent.mkdir()
    holder = FileLock(old)
    assert holder.try_acquire()
    os.rename(old.parent, tmp_path / "vm.old")
    (tmp_path / "vm").mkdir()
    newcomer = FileLock(old)
    assert newcomer.try_acquire(), "the new directory's lock is free"
    # The path is locked through the new inode, not the renamed one.
    assert not FileLock(old).try_acquire()


def _serial_agent(path: Path, connections: int, overlap: list[int]) -> threading.Thread:
    """A fake agent behind a one-client chardev, as QEMU's: it accepts the
    next connection only once the previous one closed."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)

    def serve() -> None:
        for _ in range(connections):
            conn, _ = server.accept()
            with conn, conn.makefile("rb") as stream:
                while line := stream.readline():
                    word, arg = line.decode().split()
                    if word == "PING":
                        conn.sendall(f"PONG {arg}\n".encode())
                    else:
                        payload = stream.read(int(arg))
                        time.sleep(0.05)
                        # A client that connected while this one was served
                        # would sit in the backlog.
                        overlap.append(_backlog(server))
                        conn.sendall(f"DONE 0 {len(payload)} 0\n".encode() + payload)
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _backlog(server: socket.socket) -> int:
    server.setblocking(False)
    try:
        server.accept()[0].close()
        return 1
    except BlockingIOError:
        return 0
    finally:
        server.setblocking(True)


def test_clients_of_a_shared_agent_take_turns(tmp_path: Path) -> None:
    sock, lock = tmp_path / "agent.sock", tmp_path / "agent.lock"
    overlap: list[int] = []
    server = _serial_agent(sock, connections=6, overlap=overlap)
    results: dict[str, list[str]] = {}

    def client(name: str) -> None:
        agent = AgentClient(str(sock), lock=lock)
        results[name] = [agent.run(f"{name}{i}", timeout=10).stdout for i in range(3)]

    threads = [threading.Thread(target=client, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    server.join(10)
    assert results == {"a": ["a0", "a1", "a2"], "b": ["b0", "b1", "b2"]}
    assert overlap == [0] * 6, "a client connected while another held the agent"
    assert FileLock(lock).try_acquire(), "a client kept the agent's lock"


def test_every_vm_has_several_qmp_monitors() -> None:
    vm = VM(VMConfig(name="m"), rundir=Path("/tmp/thinvm-unit-m"))
    assert len(vm.qmp_sockets) == QMP_MONITORS >= 2
    assert vm.qmp_sockets[0] == vm.qmp_socket
    assert len({str(p) for p in vm.qmp_sockets}) == QMP_MONITORS
    assert vm.agent._lock is None  # an owned VM keeps its agent connection
    detached = VM(VMConfig(name="m"), rundir=Path("/tmp/thinvm-unit-m"), detached=True)
    assert detached.agent._lock is not None


def test_a_lock_whose_directory_is_replaced_is_waited_for(tmp_path: Path) -> None:
    directory = tmp_path / "vm"
    directory.mkdir()
    directory.rename(tmp_path / "gone")

    def successor() -> None:
        time.sleep(0.3)
        directory.mkdir()

    thread = threading.Thread(target=successor)
    thread.start()
    assert FileLock(directory / "agent.lock").acquire(5)
    thread.join()


def test_a_lock_whose_directory_stays_gone_raises(tmp_path: Path) -> None:
    started = time.monotonic()
    try:
        FileLock(tmp_path / "gone" / "agent.lock").acquire(30)
    except FileNotFoundError:
        assert time.monotonic() - started < 10
    else:
        raise AssertionError("acquired a lock in a directory that does not exist")
