#!/usr/bin/env python3
"""Host-side self test for thinvm-agent's wire protocol over a socketpair."""

import json
import socket
import subprocess
import sys
import time


class Peer:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("agent closed the connection")
        self.buf += chunk

    def line(self) -> bytes:
        while b"\n" not in self.buf:
            self._fill()
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def exec(self, cmd: bytes) -> tuple[int, bytes, bytes]:
        self.send(b"EXEC %d\n" % len(cmd) + cmd)
        word, status, out_len, err_len = self.line().split(b" ")
        assert word == b"DONE", word
        out = self.exactly(int(out_len))
        err = self.exactly(int(err_len))
        return int(status), out, err


def check(name: str, got: object, want: object) -> None:
    if got != want:
        sys.exit(f"check-agent: FAIL: {name}: got {got!r}, want {want!r}")


def run(peer: Peer) -> None:
    peer.send(b"PING hello-1\n")
    check("ping", peer.line(), b"PONG hello-1")
    peer.send(b"garbage\nPING a b\nPING " + b"x" * 65 + b"\n")
    for i in range(3):
        check(f"garbage {i}", peer.line(), b"ERR unknown")
    peer.send(b"Y" * 5000 + b"\nPING after-long\n")
    check("overlong", peer.line(), b"ERR unknown")
    check("resync", peer.line(), b"PONG after-long")

    check("exit", peer.exec(b"echo out; echo err >&2; exit 3"), (3, b"out\n", b"err\n"))
    check("empty", peer.exec(b""), (0, b"", b""))
    check("signal", peer.exec(b"kill -9 $$"), (137, b"", b""))
    check("stdin", peer.exec(b"cat"), (0, b"", b""))
    check("binary", peer.exec(b"printf 'a\\000b\\nc'"), (0, b"a\0b\nc", b""))

    # Both pipes far beyond their capacity at once: needs the poll loop.
    status, out, err = peer.exec(b"head -c 3000000 /dev/zero & head -c 2000000 /dev/zero >&2; wait")
    check("big", (status, len(out), len(err)), (0, 3000000, 2000000))

    # Header and payload in separate, delayed writes.
    cmd = b"echo split"
    peer.send(b"EXEC %d\n" % len(cmd) + cmd[:3])
    time.sleep(0.2)
    peer.send(cmd[3:])
    check("split", peer.line(), b"DONE 0 6 0")
    check("split out", peer.exactly(6), b"split\n")

    # A detached background job does not hold the reply back.
    start = time.monotonic()
    check("background", peer.exec(b"sleep 3 >/dev/null 2>&1 &"), (0, b"", b""))
    check("background fast", time.monotonic() - start < 2, True)

    # The reclaimer's requests.  Nothing here reclaims: this runs on the
    # host, and TRIM with a zero timeout stops before its first step.
    def reclaim_json(request: bytes) -> dict:
        peer.send(request)
        word, length = peer.line().split(b" ")
        check(f"{request!r} header", word, b"JSON")
        return json.loads(peer.exactly(int(length)))

    status = reclaim_json(b"RECLAIM status\n")
    check(
        "status keys",
        {"available", "background", "reclaimed_bytes", "backoffs", "refault_pages", "compactions"}
        <= status.keys(),
        True,
    )
    check("background off", status["background"], False)
    # The background thread exists even while its mode is off.
    check("thread cpu", isinstance(status.get("thread_cpu_ms"), int), True)
    check("freed reports", status.get("freed_reports"), 0)
    trim = reclaim_json(b"TRIM 0 0\n")
    check("trim 0 0", trim.get("reclaimed_bytes_trim", 0), 0)
    peer.send(b"TRIM 1\nTRIM -1 5\nTRIM 1 5x\nRECLAIM maybe\n")
    for i in range(4):
        check(f"bad reclaim request {i}", peer.line(), b"ERR unknown")

    peer.send(b"PING bye\n")
    check("final ping", peer.line(), b"PONG bye")


def main() -> None:
    agent_path = sys.argv[1]
    host, guest = socket.socketpair()
    proc = subprocess.Popen(
        [agent_path, "--fd", str(guest.fileno())],
        pass_fds=[guest.fileno()],
        stderr=subprocess.DEVNULL,
    )
    guest.close()
    host.settimeout(30)
    try:
        run(Peer(host))
        check("agent alive", proc.poll(), None)
    finally:
        proc.kill()
        proc.wait()
    print("check-agent: ok")


if __name__ == "__main__":
    main()
