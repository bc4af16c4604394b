"""Host side of the guest agent protocol (see docs/protocol/agent.md).

The agent listens on a virtio-serial port; QEMU exposes it to the host as
a unix socket.  Requests are `PING <token>` and `EXEC <n>` + n bytes of a
shell command; replies are `PONG <token>` and
`DONE <status> <out_len> <err_len>` + stdout + stderr.
"""

import contextlib
import json
import os
import secrets
import shlex
import socket
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thinvm.errors import AgentBusy, GuestError
from thinvm.host.locks import FileLock

# How long a fresh connection waits for the agent's PONG before a command.
SYNC_TIMEOUT = 30.0
# What a client reads from a guest at most.  The guest is not trusted (the
# balance controller runs as root beside every VM): a longer header line
# or reply is a protocol error, not a reason to buffer without end.  The
# agent's header lines are under 100 bytes and its JSON replies under
# 2 KiB (RECLAIM_JSON_MAX in guest/agent/reclaim.h).
MAX_LINE = 4096
MAX_JSON_REPLY = 1 << 20
MAX_COMMAND_OUTPUT = 256 << 20  # each of stdout and stderr of one EXEC
# The virtio-serial port's name, as thinvm-agent looks for it in the guest
# (/dev/virtio-ports/org.thinvm.agent): the same with thinvm's own VMs and
# with a libvirt domain's <channel type='unix'><target name=.../>.
AGENT_PORT = "org.thinvm.agent"


def libvirt_agent_socket(xml: str) -> str | None:
    """Where libvirt put the agent port's socket, from a live domain XML
    (`virsh dumpxml`); None if the domain has no such channel.  libvirt
    picks the path itself (its channel directory, per domain id), as it
    does for qemu-guest-agent."""
    for channel in ET.fromstring(xml).iter("channel"):
        target, source = channel.find("target"), channel.find("source")
        if target is not None and target.get("name") == AGENT_PORT and source is not None:
            path = source.get("path")
            if path:
                return path
    return None


# sockaddr_un.sun_path: 108 bytes, the terminating NUL included.
SUN_PATH_MAX = 107


def connect_unix(sock: socket.socket, path: str) -> None:
    """Connect `sock` to the unix socket at `path`, however long the path.

    A socket path has to fit sun_path, and libvirt's channel sockets seen
    from outside a cluster host's root do not always: the domain id is in
    the path, so /var/lib/thinvm/<cluster>/hosts/h1/root/run/libvirt/
    qemu/channel/10-optin-rolling/org.thinvm.agent is one byte too long
    where 9-optin-rolling was not.  Past the limit, connect through the
    directory's descriptor (/proc/self/fd/N/NAME), which the kernel
    resolves like the full path."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        sock.connect(path)
        return
    directory, name = os.path.split(path)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{name}")
    finally:
        os.close(fd)


def channel_lock(socket_path: str) -> Path:
    """The lock every client of a libvirt domain's agent takes its turns
    under (AgentClient): beside the socket, in the domain's own channel
    directory, so it goes when the domain does and clients on the host
    (the balance controller, `thinvm fleet`) agree on it."""
    return Path(socket_path + ".lock")


@dataclass(frozen=True)
class CommandResult:
    command: str
    status: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """The last stdout line parsed as JSON (thinvm-mem prints one)."""
        lines = self.stdout.strip().splitlines()
        if not lines:
            raise GuestError(f"guest command {self.command!r} printed nothing")
        return json.loads(lines[-1])


def shell_line(argv: Sequence[str]) -> str:
    """The `/bin/sh -c` line that runs exactly `argv`, word for word.

    The agent always hands its command to a shell, so an argv (what
    `thinvm exec NAME -- ...` receives) is quoted word by word: spaces,
    quotes, `$` and redirections reach the program as they were given.
    Shell syntax is the user's to ask for, as `sh -c 'LINE'`.
    """
    if not argv:
        raise GuestError("no guest command: give one after '--', e.g. 'thinvm exec vm -- uname -a'")
    return shlex.join(argv)


class AgentClient:
    """Talks to thinvm-agent through QEMU's chardev socket.

    QEMU's chardev socket serves one client at a time; a second one sits
    unanswered in the listen backlog until the first disconnects.  A
    client of a VM that other processes use too (a detached VM: the CLI,
    the balance controller, tests) therefore passes `lock`: then every
    request takes that lock file, connects, syncs, runs and disconnects,
    so clients take turns instead of timing out on each other.  Without a
    lock (a VM this process owns) the connection stays open between
    requests.  docs/protocol/agent.md says why turns rather than a second
    port.
    """

    def __init__(self, path: str, lock: Path | None = None) -> None:
        self.path = path
        self._lock = FileLock(lock) if lock is not None else None
        # Threads of one process (a benchmark's workloads and its balance
        # controller) share a client: one request on the wire at a time.
        self._busy = threading.RLock()
        self._sock: socket.socket | None = None
        self._buf = b""
        # Why the last ping failed, for the error when none answers.
        self._last_failure = ""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connect_unix(sock, self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
            self._buf = b""
        return self._sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self._disconnect()
        if self._lock is not None:
            self._lock.release()

    @contextlib.contextmanager
    def _turn(self, timeout: float) -> Iterator[None]:
        """This client's turn on a shared agent: from lock to disconnect."""
        if not self._busy.acquire(timeout=timeout):
            raise AgentBusy(
                f"guest agent {self.path} stayed busy with another thread's request for "
                f"{timeout:g} s"
            )
        try:
            with self._process_turn(timeout):
                yield
        finally:
            self._busy.release()

    @contextlib.contextmanager
    def _process_turn(self, timeout: float) -> Iterator[None]:
        if self._lock is None or self._lock.held:
            yield
            return
        try:
            taken = self._lock.acquire(timeout)
        except FileNotFoundError as exc:
            raise GuestError(
                f"the VM of {self.path} is gone: it was stopped or migrated to another host"
            ) from exc
        if not taken:
            raise AgentBusy(
                f"guest agent {self.path} stayed busy with another client's command for "
                f"{timeout:g} s: retry when it is done, or give a longer timeout"
            )
        try:
            yield
        finally:
            self.close()

    def _recv_more(self, deadline: float) -> None:
        sock = self._connect()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(1 << 16)
        if not chunk:
            self._disconnect()
            raise GuestError(f"agent socket {self.path} closed by QEMU")
        self._buf += chunk

    def _connection_lost(self, exc: OSError) -> GuestError:
        """The socket failed mid-request (QEMU exited or closed it): a
        GuestError like every other agent failure, so callers that handle
        those need not know socket errors too."""
        self._disconnect()
        return GuestError(f"agent socket {self.path}: connection lost ({exc})")

    def _protocol_error(self, message: str) -> GuestError:
        """A reply we cannot follow: what is left of it on the wire is
        dropped with the connection (a fresh one resyncs with PING)."""
        self._disconnect()
        return GuestError(message)

    def _read_line(self, deadline: float) -> bytes:
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_LINE:
                raise self._protocol_error(
                    f"agent {self.path} sent a line longer than {MAX_LINE} bytes: "
                    "not the thinvm agent protocol"
                )
            self._recv_more(deadline)
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _read_exact(self, size: int, deadline: float, limit: int) -> bytes:
        if size > limit:
            raise self._protocol_error(
                f"agent {self.path} announced {size} bytes, more than the {limit} a client reads"
            )
        while len(self._buf) < size:
            self._recv_more(deadline)
        data, self._buf = self._buf[:size], self._buf[size:]
        return data

    def ping(self, timeout: float = 5.0) -> bool:
        """Sync with the agent: True once it echoed a fresh token.

        Anything else on the wire (a stale reply from before a reconnect or
        a migration) is skipped until the matching PONG arrives.
        """
        with self._turn(timeout):
            return self._ping(timeout)

    def _ping(self, timeout: float) -> bool:
        token = secrets.token_hex(8)
        marker = f"PONG {token}\n".encode()
        deadline = time.monotonic() + timeout
        try:
            self._connect().sendall(f"PING {token}\n".encode())
            # Stale output need not end in a newline, so look for the marker
            # anywhere rather than line by line.
            while marker not in self._buf:
                # Only a marker's length of stale bytes can matter.
                self._buf = self._buf[-len(marker) :]
                self._recv_more(deadline)
            self._buf = self._buf.split(marker, 1)[1]
            return True
        except TimeoutError:
            self._last_failure = f"no PONG within {timeout:.1f} s"
        except OSError as exc:
            # Connecting fails at once (no socket, nobody listening);
            # an accepted connection that is never served only times out.
            self._last_failure = f"{type(exc).__name__}: {exc.strerror or exc}"
        self._disconnect()
        return False

    def wait_ready(self, timeout: float) -> float:
        """Ping until the agent answers; returns the seconds it took."""
        with self._turn(timeout):
            return self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> float:
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            try:
                # Longer than the agent's 2 s reply grace (docs/protocol/agent.md).
                if self._ping(timeout=min(3.0, max(0.1, deadline - time.monotonic()))):
                    return time.monotonic() - start
            except GuestError:
                pass
            time.sleep(0.1)
        last = f" (last attempt: {self._last_failure})" if self._last_failure else ""
        raise GuestError(f"guest agent did not answer within {timeout:.0f} s{last}")

    def run(self, command: str, timeout: float = 300.0) -> CommandResult:
        """Run a shell command in the guest and wait for its exit status."""
        with self._turn(timeout):
            return self._run(command, timeout)

    def _run(self, command: str, timeout: float) -> CommandResult:
        if self._sock is None:
            # A fresh connection (every CLI command makes one) first syncs
            # with a PING: stale bytes are skipped, and an agent that does
            # not answer fails in seconds instead of after `timeout`.
            self._wait_ready(min(timeout, SYNC_TIMEOUT))
        deadline = time.monotonic() + timeout
        payload = command.encode()
        try:
            self._connect().sendall(f"EXEC {len(payload)}\n".encode() + payload)
            header = self._read_line(deadline).decode(errors="replace").split()
            if len(header) != 4 or header[0] != "DONE" or not _decimal(header[1:]):
                raise self._protocol_error(f"agent sent a bad reply header {header!r}")
            status, out_len, err_len = int(header[1]), int(header[2]), int(header[3])
            out = self._read_exact(out_len, deadline, MAX_COMMAND_OUTPUT)
            err = self._read_exact(err_len, deadline, MAX_COMMAND_OUTPUT)
        except TimeoutError as exc:
            # The reply may still come; a fresh connection must resync.
            self._disconnect()
            raise GuestError(f"guest command {command!r} timed out after {timeout:.0f} s") from exc
        except OSError as exc:
            raise self._connection_lost(exc) from exc
        return CommandResult(
            command, status, out.decode(errors="replace"), err.decode(errors="replace")
        )

    def check(self, command: str, timeout: float = 300.0) -> CommandResult:
        """Like run(), but a non-zero exit status raises GuestError."""
        result = self.run(command, timeout)
        if result.status != 0:
            raise GuestError(
                f"guest command {command!r} exited {result.status}: "
                f"{(result.stderr or result.stdout).strip()[-500:]}"
            )
        return result

    def request_json(self, request: str, timeout: float = 60.0, wait: float | None = None) -> Any:
        """Send a one-line request answered with `JSON <n>` + n bytes
        (TRIM and RECLAIM, docs/protocol/agent.md).  Returns None if the
        agent answers `ERR unknown`: it predates the request.  `wait`: how
        long to wait for another client's request to finish (default
        `timeout`) before raising AgentBusy."""
        with self._turn(timeout if wait is None else wait):
            return self._request_json(request, timeout)

    def _request_json(self, request: str, timeout: float) -> Any:
        if self._sock is None:
            self._wait_ready(min(timeout, SYNC_TIMEOUT))
        deadline = time.monotonic() + timeout
        try:
            self._connect().sendall(request.encode() + b"\n")
            header = self._read_line(deadline).decode(errors="replace").split()
            if header == ["ERR", "unknown"]:
                return None
            if len(header) != 2 or header[0] != "JSON" or not _decimal(header[1:]):
                raise self._protocol_error(f"agent sent a bad reply header {header!r}")
            body = self._read_exact(int(header[1]), deadline, MAX_JSON_REPLY)
        except TimeoutError as exc:
            self._disconnect()
            raise GuestError(f"agent request {request!r} timed out after {timeout:.0f} s") from exc
        except OSError as exc:
            raise self._connection_lost(exc) from exc
        return json.loads(body)


def _decimal(fields: Sequence[str]) -> bool:
    """Whether every field is a plain decimal count (str.isdigit() takes
    "²" and other digits int() refuses)."""
    return all(field.isascii() and field.isdigit() for field in fields)
