"""A sparse-ram migration keeps to the downtime limit it was given (issue 19).

QEMU stops the guest once what is left fits into bandwidth x downtime-limit.
Upstream sizes that budget with the last 100 ms bandwidth sample alone, so
on a link whose throughput comes and goes (a shared host, a destination
that faults its memory in, a congested network) one fast sample lets the
source stop with more left than the link then carries within the limit:
at 128 GiB on the lab's 10 Gbit/s veth the downtime was 268-999 ms against
300 ms (bench/notes.md).  The link here is a relay through this test that
carries 200 MB/s for 100 ms, then 20 MB/s for 300 ms, over and over, for
every connection together (the main channel and both multifd channels).
"""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from tests.conftest import VMFactory
from thinvm.guest import workload
from thinvm.units import GiB, MiB
from thinvm.vm import migrate
from thinvm.vm.machine import VMConfig
from thinvm.vm.stack import THINVM

pytestmark = pytest.mark.guest

DOWNTIME_LIMIT_MS = 300
# Device state and the final dirty sync take a few ms beyond what RAM
# needs; QEMU treats the limit as a target, not a deadline.
TOLERANCE = 1.1
CHUNK = 64 * 1024


class FluctuatingLink:
    """A TCP relay to `target` whose rate alternates between `fast` bytes/s
    for `fast_s` and `slow` bytes/s for `slow_s`, shared by all connections.

    Only the source-to-destination direction is shaped; the return path
    carries little.  The schedule starts with the first connection.
    """

    def __init__(self, target: int, fast: int, fast_s: float, slow: int, slow_s: float) -> None:
        self.target = target
        self.fast, self.fast_s, self.slow, self.slow_s = fast, fast_s, slow, slow_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.start = 0.0
        self.link_free = 0.0  # when the link has carried what it was given
        self.closing = False
        self.sockets: list[socket.socket] = []

    def rate(self, now: float) -> int:
        phase = (now - self.start) % (self.fast_s + self.slow_s)
        return self.fast if phase < self.fast_s else self.slow

    def occupy(self, nbytes: int) -> None:
        """Wait until the link has room for `nbytes` more."""
        with self.lock:
            now = time.monotonic()
            begin = max(now, self.link_free)
            self.link_free = begin + nbytes / self.rate(begin)
            wait = begin - now
        if wait > 0:
            time.sleep(wait)

    def pump(self, src: socket.socket, dst: socket.socket, shaped: bool) -> None:
        try:
            while data := src.recv(CHUNK):
                if shaped:
                    self.occupy(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            # Pass the end of the stream on; the other direction may go on.
            with suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def accept_loop(self) -> None:
        while not self.closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                if not self.start:
                    self.start = time.monotonic()
                self.sockets += [client, upstream]
            for a, b, shaped in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self.pump, args=(a, b, shaped), daemon=True).start()

    def close(self) -> None:
        self.closing = True
        self.listener.close()
        for s in self.sockets:
            s.close()


@contextmanager
def fluctuating_link(target: int) -> Iterator[FluctuatingLink]:
    link = FluctuatingLink(target, fast=200 * 10**6, fast_s=0.1, slow=20 * 10**6, slow_s=0.3)
    thread = threading.Thread(target=link.accept_loop, daemon=True)
    thread.start()
    try:
        yield link
    finally:
        link.close()
        thread.join(timeout=5)


def test_sparse_migration_keeps_to_the_downtime_limit_on_a_fluctuating_link(
    make_vm: VMFactory,
) -> None:
    config = VMConfig(
        name="downtime",
        build=THINVM.build,
        guest_driver=THINVM.driver,
        memory=1 * GiB,
        balloon=THINVM.balloon(),
    )
    src = make_vm(config)
    # Enough populated memory that the first pass crosses the range where
    # a fast sample and a slow one disagree about what fits.
    workload.pattern_write(src.agent, 256 * MiB, seed=19)
    params = {**migrate.UNCAPPED, "multifd-channels": 2, "downtime-limit": DOWNTIME_LIMIT_MS}
    dst = make_vm(config, incoming=True)
    migrate.set_capabilities(dst, THINVM.caps)
    migrate.set_parameters(dst, {"multifd-channels": 2})
    port = migrate.free_port()
    dst.qmp("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
    with fluctuating_link(port) as link:
        result = migrate.migrate_to_uri(
            src, f"tcp:127.0.0.1:{link.port}", caps=THINVM.caps, params=params, timeout=120
        )
        # The source is done once the relay has it all; the link stays
        # up until the destination has loaded it.
        migrate.wait_destination_running(dst)
    assert result.sparse_skipped > 0, "sparse-ram skipped nothing: not the case under test"
    assert result.downtime_ms <= DOWNTIME_LIMIT_MS * TOLERANCE, (
        f"downtime {result.downtime_ms} ms against a limit of {DOWNTIME_LIMIT_MS} ms "
        f"({result.transferred / MiB:.0f} MiB in {result.total_time_ms} ms, "
        f"{result.dirty_sync_count} syncs)"
    )
    dst.wait_agent(timeout=60)
    check = workload.pattern_verify(dst.agent, seed=19)
    assert check.bad == 0 and check.pages == 256 * MiB // 4096, check
