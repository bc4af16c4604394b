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

A second relay carries 200 MB/s until ~120 MiB are left, then loses a
third of its rate every 300 ms: the stop meets a rate lower than any
sample before it, as at 128 GiB where the destination's page zeroing
took the host's two cores.  Measured here: 426-483 ms of downtime with
the slowest-sample window of QEMU 0018 alone (3 runs), 138-291 ms with
its falling-rate step (8 runs).
"""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from tests.conftest import VMFactory
from thinvm.errors import ThinvmError
from thinvm.guest import workload
from thinvm.guest.agent import AgentClient
from thinvm.units import GiB, MiB
from thinvm.vm import migrate
from thinvm.vm.machine import VM, VMConfig
from thinvm.vm.stack import STOCK_BEST, THINVM, Stack

pytestmark = pytest.mark.guest

DOWNTIME_LIMIT_MS = 300
# Device state and the final dirty sync take a few ms beyond what RAM
# needs; QEMU treats the limit as a target, not a deadline.
TOLERANCE = 1.1
CHUNK = 64 * 1024
# The falling link starts to fall once the source reports this much left:
# about twice what 300 ms carry at its fast rate.
FALL_AT = 120 * MiB
# Migrations over the falling link, each to a fresh destination, until one
# keeps to the limit (the falling-link test says why).
ATTEMPTS = 3


class Relay:
    """A TCP relay to `target` whose rate (bytes/s, rate()) is shared by all
    connections.

    Only the source-to-destination direction is shaped; the return path
    carries little.  The schedule starts with the first connection.
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.start = 0.0
        self.link_free = 0.0  # when the link has carried what it was given
        self.closing = False
        self.sockets: list[socket.socket] = []

    def rate(self, now: float) -> int:
        raise NotImplementedError

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


class FluctuatingLink(Relay):
    """`fast` bytes/s for `fast_s`, then `slow` bytes/s for `slow_s`, in turn."""

    def __init__(self, target: int, fast: int, fast_s: float, slow: int, slow_s: float) -> None:
        super().__init__(target)
        self.fast, self.fast_s, self.slow, self.slow_s = fast, fast_s, slow, slow_s

    def rate(self, now: float) -> int:
        phase = (now - self.start) % (self.fast_s + self.slow_s)
        return self.fast if phase < self.fast_s else self.slow


class FallingLink(Relay):
    """`fast` bytes/s until fall() is called, then a rate that loses `loss`
    of itself every `period` seconds, down to `floor`: the last stretch of
    the 128 GiB migration, where the destination's page zeroing took both
    of the host's cores (QEMU 0018)."""

    def __init__(self, target: int, fast: int, loss: float, period: float, floor: int) -> None:
        super().__init__(target)
        self.fast, self.loss, self.period, self.floor = fast, loss, period, floor
        self.fall_start: float | None = None

    def fall(self) -> None:
        if self.fall_start is None:
            self.fall_start = time.monotonic()

    def rate(self, now: float) -> int:
        if self.fall_start is None or now < self.fall_start:
            return self.fast
        kept = (1 - self.loss) ** ((now - self.fall_start) / self.period)
        return max(self.floor, int(self.fast * kept))


@contextmanager
def relay(link: Relay) -> Iterator[Relay]:
    thread = threading.Thread(target=link.accept_loop, daemon=True)
    thread.start()
    try:
        yield link
    finally:
        link.close()
        thread.join(timeout=5)


def start_pair(make_vm: VMFactory, name: str, seed: int) -> tuple[VM, VM]:
    """A thinvm guest with a 256 MiB pattern and its listening destination."""
    config = VMConfig(
        name=name,
        build=THINVM.build,
        guest_driver=THINVM.driver,
        memory=1 * GiB,
        balloon=THINVM.balloon(),
    )
    src = make_vm(config)
    workload.pattern_write(src.agent, 256 * MiB, seed=seed)
    return src, start_destination(make_vm, config)


def start_destination(make_vm: VMFactory, config: VMConfig, stack: Stack = THINVM) -> VM:
    dst = make_vm(config, incoming=True)
    migrate.set_capabilities(dst, stack.caps)
    migrate.set_parameters(dst, {"multifd-channels": 2})
    return dst


def migrate_over_a_falling_link(src: VM, dst: VM) -> tuple[migrate.MigrationResult, FallingLink]:
    port = migrate.free_port()
    dst.qmp("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
    link = FallingLink(port, fast=200 * 10**6, loss=1 / 3, period=0.3, floor=10 * 10**6)

    def fall_near_the_end(info: dict[str, object]) -> None:
        ram = info.get("ram")
        if isinstance(ram, dict) and 0 < int(ram.get("remaining", 0)) < FALL_AT:
            link.fall()

    params = {**migrate.UNCAPPED, "multifd-channels": 2, "downtime-limit": DOWNTIME_LIMIT_MS}
    with relay(link):
        result = migrate.migrate_to_uri(
            src,
            f"tcp:127.0.0.1:{link.port}",
            caps=THINVM.caps,
            params=params,
            timeout=120,
            progress=fall_near_the_end,
        )
        migrate.wait_destination_running(dst)
    assert link.fall_start is not None, "the link never fell: not the case under test"
    return result, link


def test_sparse_migration_keeps_to_the_downtime_limit_on_a_falling_link(
    make_vm: VMFactory,
) -> None:
    """The rate falls by a third every 300 ms from when FALL_AT are left:
    budgeted with its slowest sample alone (QEMU 0018 without its
    falling-rate step), the stop meets a
    rate lower than any sample and overruns the limit.

    The fall goes on through the stop, so where the stop lands between
    QEMU's 100 ms samples, and how busy the host's two cores are, move the
    downtime: with the falling-rate step, 138-291 ms in 8 runs on a quiet host, but 115-410
    ms in 4 runs beside two CPU burners and 353 ms in one CI run of five;
    without it 426-483 ms, quiet.  So the guest goes on to a fresh
    destination, up to ATTEMPTS times, until one migration keeps to the
    limit: the window alone never does."""
    src, dst = start_pair(make_vm, "falling", seed=23)
    downtimes: list[int] = []
    for attempt in range(ATTEMPTS):
        if attempt:
            src, dst = dst, start_destination(make_vm, dst.config)
        result, _ = migrate_over_a_falling_link(src, dst)
        downtimes.append(result.downtime_ms)
        if result.downtime_ms <= DOWNTIME_LIMIT_MS * TOLERANCE:
            break
    assert min(downtimes) <= DOWNTIME_LIMIT_MS * TOLERANCE, (
        f"downtimes {downtimes} ms against a limit of {DOWNTIME_LIMIT_MS} ms "
        f"(the last: {result.transferred / MiB:.0f} MiB in {result.total_time_ms} ms)"
    )
    dst.wait_agent(timeout=60)
    check = workload.pattern_verify(dst.agent, seed=23)
    assert check.bad == 0 and check.pages == 256 * MiB // 4096, check


def test_sparse_migration_keeps_to_the_downtime_limit_on_a_fluctuating_link(
    make_vm: VMFactory,
) -> None:
    # Enough populated memory that the first pass crosses the range where
    # a fast sample and a slow one disagree about what fits.
    src, dst = start_pair(make_vm, "downtime", seed=19)
    params = {**migrate.UNCAPPED, "multifd-channels": 2, "downtime-limit": DOWNTIME_LIMIT_MS}
    port = migrate.free_port()
    dst.qmp("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
    link = FluctuatingLink(port, fast=200 * 10**6, fast_s=0.1, slow=20 * 10**6, slow_s=0.3)
    with relay(link):
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


# -- convergence on a link that flips between two rates (issue 46) ----------
#
# The link carries FLIP_FAST for FLIP_S, then FLIP_SLOW for FLIP_S, in
# turn; the guest re-dirties DIRTY_SET twenty times a second, so each round
# leaves V ~ 33 MB to send again, between what DOWNTIME_LIMIT_MS carry at
# the slow rate (6 MB) and at the fast one (60 MB), with margin on both
# sides (the numbers are in the test's docstring).
FLIP_S = 0.2
FLIP_FAST = 200 * 10**6
FLIP_SLOW = 20 * 10**6
DIRTY_SET = 31 * MiB
DIRTY_RATE = 20 * DIRTY_SET  # bytes/s: the whole set every 50 ms
CONVERGE_S = 60
CONVERGE_SEED = 29


def dirty_in_background(agent: AgentClient, size: int, rate: int) -> int:
    """Start `thinvm-mem dirty` in the guest, detached, for longer than any
    migration here takes; its pid."""
    command = f"thinvm-mem dirty {size // MiB} --rate {rate // MiB} --seconds 600"
    return int(agent.check(f"{command} >/dev/null 2>&1 </dev/null & echo $!").stdout)


class MigrationTrail:
    """What query-migrate said while the migration ran: its last status
    and the range of QEMU's bandwidth samples, for the failure message."""

    def __init__(self) -> None:
        self.status = "none"
        self.syncs = 0
        self.samples: list[float] = []

    def record(self, info: dict[str, object]) -> None:
        self.status = str(info.get("status", "none"))
        ram = info.get("ram")
        if isinstance(ram, dict):
            self.syncs = int(ram.get("dirty-sync-count", 0))
            if mbps := float(ram.get("mbps", 0)):
                self.samples.append(mbps / 8)  # MB/s

    def describe(self) -> str:
        low, high = (min(self.samples), max(self.samples)) if self.samples else (0.0, 0.0)
        return (
            f"last seen {self.status} after {self.syncs} dirty syncs, "
            f"bandwidth samples {low:.0f}-{high:.0f} MB/s"
        )


@pytest.mark.parametrize("stack", [STOCK_BEST, THINVM], ids=["stock", "thinvm"])
def test_a_dirtying_guest_converges_on_a_flipping_link(make_vm: VMFactory, stack: Stack) -> None:
    """A guest that leaves V to send every round, with downtime-limit
    between V / FLIP_FAST and V / FLIP_SLOW, on a link whose rate flips
    between the two every FLIP_S: stock QEMU stops right after a fast
    sample, and so must thinvm's.  Its budget is sized with the slowest of
    the last five samples (QEMU 0018), a window that here always
    holds a slow one; without the bound on how long the window may defer a
    switchover the newest sample allows, the migration iterates for ever
    and is still active when CONVERGE_S run out.

    Measured on this 2-CPU host (load 3-10 from other work), from QEMU's
    migrate_transferred and migrate_pending_exact trace events: V is
    32.7-32.8 MB at every one of ~640 dirty syncs, so the budget must
    reach 109 MB/s x 300 ms; a quarter to a half of the 100 ms samples
    do.  The slowest-sample budget (0018's rules applied to the recorded
    samples) reached at most 16-23 MB in each of five one-minute runs,
    ~2000 windows in all: samples that straddle a slow phase carry up
    to ~75 MB/s, never V's 109.  Whole migrations, 6 runs each: stock
    completed in 1.8-4.2 s, thinvm in 3.3-7.0 s (8-15 syncs); 3 runs
    beside two CPU burners: 5.3-6.5 s and 5.7-13.8 s.  Downtimes were
    355-447 ms and 365-466 ms (up to 800 ms beside the burners): a stop
    sized by a fast sample overruns the limit when the link then slows,
    as in stock QEMU; that is the price of converging, and not what this
    test checks.
    """
    config = VMConfig(
        name=f"converge-{stack.build}",
        build=stack.build,
        guest_driver=stack.driver,
        memory=512 * MiB,
        balloon=stack.balloon(),
    )
    src = make_vm(config)
    workload.pattern_write(src.agent, 64 * MiB, seed=CONVERGE_SEED)
    writer = dirty_in_background(src.agent, DIRTY_SET, DIRTY_RATE)
    dst = start_destination(make_vm, config, stack)
    port = migrate.free_port()
    dst.qmp("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
    link = FluctuatingLink(port, fast=FLIP_FAST, fast_s=FLIP_S, slow=FLIP_SLOW, slow_s=FLIP_S)
    params = {**migrate.UNCAPPED, "multifd-channels": 2, "downtime-limit": DOWNTIME_LIMIT_MS}
    trail = MigrationTrail()
    with relay(link):
        try:
            migrate.migrate_to_uri(
                src,
                f"tcp:127.0.0.1:{link.port}",
                caps=stack.caps,
                params=params,
                timeout=CONVERGE_S,
                progress=trail.record,
            )
        except ThinvmError as exc:
            pytest.fail(f"{stack.describe()}: {trail.describe()} ({exc})")
        migrate.wait_destination_running(dst)
    dst.wait_agent(timeout=60)
    # The writer ran on through the migration: every round had V to send.
    dst.agent.check(f"kill {writer}")
    check = workload.pattern_verify(dst.agent, seed=CONVERGE_SEED)
    assert check.bad == 0 and check.pages == 64 * MiB // 4096, check


# -- the first pass goes while the guest runs (QEMU 0021) --------------------

# A steady link, which carries the downtime's data at the rate its samples
# saw: what is left at the stop shows in the downtime as it is.
STEADY_RATE = 100 * 10**6
# What an idle guest has left once its first pass has ended (its last
# round's dirty pages and device state) goes in a few tens of ms at
# STEADY_RATE; stopped mid-pass, up to a budget of first-pass data goes,
# ~300 ms' worth.
IDLE_DOWNTIME_MS = 150


class SteadyLink(Relay):
    def __init__(self, target: int, rate: int) -> None:
        super().__init__(target)
        self.steady = rate

    def rate(self, now: float) -> int:
        return self.steady


def test_an_idle_sparse_guest_stops_only_after_its_first_pass(make_vm: VMFactory) -> None:
    """With sparse-ram the pages the host never populated are not pending,
    so an idle guest's pending size falls below the budget (bandwidth x
    downtime-limit) in the middle of the first pass: before QEMU 0021 the
    source stopped there and sent the rest of the pass, up to a whole
    budget of it, while the guest was stopped.  The demo's idle 2 GiB
    guest: 169 ms [17-412] of downtime against stock's 34 ms [5-62], 101 MB
    left at the stop in the worst run.  Now the first pass ends before the
    switchover, and what goes during the downtime is the last round's
    dirty pages and device state."""
    src, dst = start_pair(make_vm, "firstpass", seed=29)
    params = {**migrate.UNCAPPED, "multifd-channels": 2, "downtime-limit": DOWNTIME_LIMIT_MS}
    port = migrate.free_port()
    dst.qmp("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
    with relay(SteadyLink(port, STEADY_RATE)) as link:
        result = migrate.migrate_to_uri(
            src, f"tcp:127.0.0.1:{link.port}", caps=THINVM.caps, params=params, timeout=120
        )
        migrate.wait_destination_running(dst)
    assert result.sparse_skipped > 0, "sparse-ram skipped nothing: not the case under test"
    assert result.downtime_ms <= IDLE_DOWNTIME_MS, (
        f"downtime {result.downtime_ms} ms for an idle guest "
        f"({result.transferred / MiB:.0f} MiB in {result.total_time_ms} ms, "
        f"{result.dirty_sync_count} syncs)"
    )
    dst.wait_agent(timeout=60)
    check = workload.pattern_verify(dst.agent, seed=29)
    assert check.bad == 0 and check.pages == 256 * MiB // 4096, check
