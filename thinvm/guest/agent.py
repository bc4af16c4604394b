"""Host side of the guest agent protocol (see docs/protocol/agent.md).

The agent listens on a virtio-serial port; QEMU exposes it to the host as
a unix socket.  Requests are `PING <token>` and `EXEC <n>` + n bytes of a
shell command; replies are `PONG <token>` and
`DONE <status> <out_len> <err_len>` + stdout + stderr.
"""

import json
import secrets
import shlex
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from thinvm.errors import GuestError

# How long a fresh connection waits for the agent's PONG before a command.
SYNC_TIMEOUT = 30.0


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
    """Talks to thinvm-agent through QEMU's chardev socket."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._buf = b""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.path)
            self._sock = sock
            self._buf = b""
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _recv_more(self, deadline: float) -> None:
        sock = self._connect()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)
        chunk = sock.recv(1 << 16)
        if not chunk:
            self.close()
            raise GuestError(f"agent socket {self.path} closed by QEMU")
        self._buf += chunk

    def _read_line(self, deadline: float) -> bytes:
        while b"\n" not in self._buf:
            self._recv_more(deadline)
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _read_exact(self, size: int, deadline: float) -> bytes:
        while len(self._buf) < size:
            self._recv_more(deadline)
        data, self._buf = self._buf[:size], self._buf[size:]
        return data

    def ping(self, timeout: float = 5.0) -> bool:
        """Sync with the agent: True once it echoed a fresh token.

        Anything else on the wire (a stale reply from before a reconnect or
        a migration) is skipped until the matching PONG arrives.
        """
        token = secrets.token_hex(8)
        marker = f"PONG {token}\n".encode()
        deadline = time.monotonic() + timeout
        try:
            self._connect().sendall(f"PING {token}\n".encode())
            # Stale output need not end in a newline, so look for the marker
            # anywhere rather than line by line.
            while marker not in self._buf:
                self._recv_more(deadline)
            self._buf = self._buf.split(marker, 1)[1]
            return True
        except (TimeoutError, OSError):
            self.close()
            return False

    def wait_ready(self, timeout: float) -> float:
        """Ping until the agent answers; returns the seconds it took."""
        start = time.monotonic()
        deadline = start + timeout
        while time.monotonic() < deadline:
            try:
                # Longer than the agent's 2 s reply grace (docs/protocol/agent.md).
                if self.ping(timeout=min(3.0, max(0.1, deadline - time.monotonic()))):
                    return time.monotonic() - start
            except GuestError:
                pass
            time.sleep(0.1)
        raise GuestError(f"guest agent did not answer within {timeout:.0f} s")

    def run(self, command: str, timeout: float = 300.0) -> CommandResult:
        """Run a shell command in the guest and wait for its exit status."""
        if self._sock is None:
            # A fresh connection (every CLI command makes one) first syncs
            # with a PING: stale bytes are skipped, and an agent that does
            # not answer fails in seconds instead of after `timeout`.
            self.wait_ready(min(timeout, SYNC_TIMEOUT))
        deadline = time.monotonic() + timeout
        payload = command.encode()
        try:
            self._connect().sendall(f"EXEC {len(payload)}\n".encode() + payload)
            header = self._read_line(deadline).decode(errors="replace").split()
            if len(header) != 4 or header[0] != "DONE":
                raise GuestError(f"agent sent a bad reply header {header!r}")
            status, out_len, err_len = (int(field) for field in header[1:])
            out = self._read_exact(out_len, deadline)
            err = self._read_exact(err_len, deadline)
        except TimeoutError as exc:
            # The reply may still come; a fresh connection must resync.
            self.close()
            raise GuestError(f"guest command {command!r} timed out after {timeout:.0f} s") from exc
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
